//! Encoded affiliates shared by the state, the snapshots and the catch-up batches: a
//! batch costs a pointer per entry until the state lets go of an entry.

use std::sync::{
    atomic::{AtomicBool, Ordering},
    Arc, Weak,
};

use bytes::{BufMut, Bytes, BytesMut};

use super::{encode::PREFIX, meter::WatchBytes};

/// One affiliate's Watch event (gRPC-framed, one entry), shared by the state and the
/// snapshots and catch-up batches made of it. While the state keeps it as the
/// affiliate's current encoding, a batch holding it costs only a pointer. Once the
/// state lets go of it (the affiliate changed or left) while batches still hold it,
/// it is memory kept for those watchers alone: it counts in [`WatchBytes`] from then
/// until the last of them drops it.
#[derive(Debug)]
pub(crate) struct Entry {
    bytes: Bytes,
    meter: Arc<WatchBytes>,
    orphaned: AtomicBool,
}

impl Entry {
    pub(crate) fn new(bytes: Bytes, meter: &Arc<WatchBytes>) -> Arc<Self> {
        Arc::new(Self {
            bytes,
            meter: Arc::clone(meter),
            orphaned: AtomicBool::new(false),
        })
    }

    /// The state is about to drop its reference `entry`. Entries are shared only
    /// under the state lock, which the caller holds, so no new holder appears
    /// meanwhile; if the others drop theirs concurrently, the state's reference is
    /// the last, and its drop takes the count back.
    pub(crate) fn release(entry: &Arc<Self>) {
        if Arc::strong_count(entry) > 1 {
            entry
                .meter
                .0
                .fetch_add(entry.bytes.len(), Ordering::Relaxed);
            entry.orphaned.store(true, Ordering::Relaxed);
        }
    }
}

impl std::ops::Deref for Entry {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        if *self.orphaned.get_mut() {
            self.meter.0.fetch_sub(self.bytes.len(), Ordering::Relaxed);
        }
    }
}

/// The state's reference to an affiliate's [`Entry`]; letting go of it (replaced,
/// cleared, or dropped with the affiliate) releases the entry.
#[derive(Debug, Default)]
pub(crate) struct KeptEntry(Option<Arc<Entry>>);

impl KeptEntry {
    pub(crate) fn get(&self) -> Option<&Arc<Entry>> {
        self.0.as_ref()
    }

    pub(crate) fn set(&mut self, entry: Option<Arc<Entry>>) {
        if let Some(old) = std::mem::replace(&mut self.0, entry) {
            Entry::release(&old);
        }
    }
}

impl Clone for KeptEntry {
    /// A copy of an affiliate encodes its own entry when one is needed.
    fn clone(&self) -> Self {
        Self(None)
    }
}

impl Drop for KeptEntry {
    fn drop(&mut self) {
        self.set(None);
    }
}

/// One gRPC-framed `WatchResponse` of upserts (a snapshot, a catch-up batch) made of
/// the affiliates' shared `Entry`s rather than a copy of them. Watchers that
/// register between the same two events share one snapshot. Counted in
/// [`WatchBytes`] at what it costs of its own, a pointer per entry; the entries it
/// keeps alive after the affiliates changed count themselves.
#[derive(Clone)]
pub struct Batch(Arc<BatchParts>);

pub(crate) struct BatchParts {
    prefix: [u8; PREFIX],
    entries: Vec<Arc<Entry>>,
    /// Encoded length, the prefix included.
    len: usize,
    /// What the batch counts in the meter.
    cost: usize,
    meter: Arc<WatchBytes>,
}

impl Drop for BatchParts {
    fn drop(&mut self) {
        self.meter.0.fetch_sub(self.cost, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("affiliates", &self.0.entries.len())
            .field("len", &self.0.len)
            .finish()
    }
}

impl Default for Batch {
    /// An empty snapshot counted nowhere (a placeholder).
    fn default() -> Self {
        Self::new(Vec::new(), &Arc::default())
    }
}

impl Batch {
    /// A snapshot of `entries` (framed single-entry events), counted in `meter`.
    pub(crate) fn new(entries: Vec<Arc<Entry>>, meter: &Arc<WatchBytes>) -> Self {
        let body: usize = entries.iter().map(|e| e.len() - PREFIX).sum();
        let mut prefix = [0; PREFIX];
        // Messages are far below 4 GiB (a maximal cluster encodes to ~4.5 MiB).
        prefix[1..].copy_from_slice(&u32::try_from(body).unwrap_or(u32::MAX).to_be_bytes());
        let len = PREFIX + body;
        let cost = PREFIX + entries.len() * std::mem::size_of::<Arc<Entry>>();
        meter.0.fetch_add(cost, Ordering::Relaxed);
        Self(Arc::new(BatchParts {
            prefix,
            entries,
            len,
            cost,
            meter: Arc::clone(meter),
        }))
    }

    /// What the batch counts in [`WatchBytes`] of its own.
    #[must_use]
    pub fn cost(&self) -> usize {
        self.0.cost
    }

    pub(crate) fn downgrade(&self) -> Weak<BatchParts> {
        Arc::downgrade(&self.0)
    }

    pub(crate) fn upgrade(weak: &Weak<BatchParts>) -> Option<Self> {
        weak.upgrade().map(Self)
    }

    /// Encoded length, the gRPC prefix included.
    #[must_use]
    pub fn len(&self) -> usize {
        self.0.len
    }

    /// Whether the batch has no affiliates.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.entries.is_empty()
    }

    /// Part `i` of the framed message: the prefix, then each entry.
    pub(super) fn part(&self, i: usize) -> Option<&[u8]> {
        if i == 0 {
            return Some(&self.0.prefix);
        }
        self.0.entries.get(i - 1).map(|e| &e[PREFIX..])
    }

    /// Where each affiliate's entry lives (tests check sharing).
    #[cfg(test)]
    pub(crate) fn entry_ptrs(&self) -> Vec<*const u8> {
        self.0.entries.iter().map(|e| e.as_ptr()).collect()
    }

    /// The whole framed message in one buffer (a copy).
    #[must_use]
    pub fn to_bytes(&self) -> Bytes {
        let mut buf = BytesMut::with_capacity(self.len());
        let mut i = 0;
        while let Some(part) = self.part(i) {
            buf.put_slice(part);
            i += 1;
        }
        buf.freeze()
    }
}
