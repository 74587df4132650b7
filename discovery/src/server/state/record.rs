//! The stored affiliate, packed for memory: its ID, the data blob and every endpoint
//! (its expiration, length and bytes) share one allocation, and a cluster's table
//! ([`Affiliates`]) holds the records themselves, keyed by the ID inside them. An
//! affiliate costs one table slot (40 bytes) and one heap block, instead of a slot
//! with a separate key, a block for the ID, a block per blob and a vector.
//!
//! Layout of the block: `id_len: u16 LE | id | data_len: u16 LE | data | { expiration:
//! i64 LE | len: u8 | bytes }*`, endpoints in insertion order. Expirations are
//! nanoseconds from a process-wide epoch, which round-trips every `Instant` the server
//! can produce (it saturates at ±292 years, beyond what `offset` yields).

use std::{
    hash::{BuildHasher as _, RandomState},
    sync::{Arc, OnceLock},
    time::{Duration, Instant},
};

use hashbrown::HashTable;

use super::entry::{Entry, KeptEntry};

/// One stored affiliate: opaque blobs, each expiring on its own.
#[derive(Debug, Clone)]
pub(crate) struct Affiliate {
    /// Expiration in ticks (see [`to_ticks`]): 8 bytes instead of an `Instant`'s 16.
    expiration: i64,
    /// Sequence number of the cluster event that last carried this affiliate.
    pub(crate) changed: u64,
    block: Box<[u8]>,
    /// The affiliate's current Watch event (gRPC-framed, one entry), kept while its
    /// cluster has watchers: snapshots are made of these shared entries instead of a
    /// copy of every affiliate per joining watcher. Any change clears it.
    entry: KeptEntry,
}

/// One stored endpoint, borrowed from its affiliate.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Endpoint<'a> {
    pub(crate) expiration: Instant,
    pub(crate) data: &'a [u8],
}

const EXP: usize = 8;
const HEAD: usize = EXP + 1;

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn to_ticks(t: Instant) -> i64 {
    let e = epoch();
    if t >= e {
        i64::try_from((t - e).as_nanos()).unwrap_or(i64::MAX)
    } else {
        -i64::try_from((e - t).as_nanos()).unwrap_or(i64::MAX)
    }
}

fn from_ticks(ticks: i64) -> Instant {
    let e = epoch();
    let d = Duration::from_nanos(ticks.unsigned_abs());
    if ticks >= 0 {
        e.checked_add(d).unwrap_or(e)
    } else {
        e.checked_sub(d).unwrap_or(e)
    }
}

fn put_endpoint(out: &mut Vec<u8>, expiration: Instant, data: &[u8]) {
    out.extend_from_slice(&to_ticks(expiration).to_le_bytes());
    // Endpoint blobs are at most 32 bytes (validated before they get here).
    out.push(u8::try_from(data.len()).unwrap_or(u8::MAX));
    out.extend_from_slice(&data[..data.len().min(usize::from(u8::MAX))]);
}

/// Appends a length-prefixed (u16 LE) field; IDs (≤ 256) and data (≤ 2048) are
/// validated far below the prefix's range.
fn put_short(out: &mut Vec<u8>, bytes: &[u8]) {
    let len = u16::try_from(bytes.len()).unwrap_or(u16::MAX);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&bytes[..usize::from(len)]);
}

fn short_at(block: &[u8], pos: usize) -> usize {
    usize::from(u16::from_le_bytes([block[pos], block[pos + 1]]))
}

impl Affiliate {
    /// An affiliate `id` with `data` (at most 2048 bytes, validated) and `endpoints`.
    pub(crate) fn new<'a>(
        id: &str,
        expiration: Instant,
        data: &[u8],
        endpoints: impl IntoIterator<Item = Endpoint<'a>>,
    ) -> Self {
        Self {
            expiration: to_ticks(expiration),
            changed: 0,
            block: Self::pack(id.as_bytes(), data, endpoints),
            entry: KeptEntry::default(),
        }
    }

    fn pack<'a>(
        id: &[u8],
        data: &[u8],
        endpoints: impl IntoIterator<Item = Endpoint<'a>>,
    ) -> Box<[u8]> {
        let mut block = Vec::with_capacity(4 + id.len() + data.len());
        put_short(&mut block, id);
        put_short(&mut block, data);
        for e in endpoints {
            put_endpoint(&mut block, e.expiration, e.data);
        }
        block.into_boxed_slice()
    }

    fn data_start(&self) -> usize {
        2 + short_at(&self.block, 0)
    }

    fn data_end(&self) -> usize {
        let start = self.data_start();
        start + 2 + short_at(&self.block, start)
    }

    fn id_bytes(&self) -> &[u8] {
        &self.block[2..self.data_start()]
    }

    /// The affiliate's ID.
    pub(crate) fn id(&self) -> &str {
        // Built from a `&str` in `new` and never changed.
        std::str::from_utf8(self.id_bytes()).unwrap_or_default()
    }

    /// When the affiliate expires (GC removes it after that).
    pub(crate) fn expiration(&self) -> Instant {
        from_ticks(self.expiration)
    }

    pub(crate) fn set_expiration(&mut self, expiration: Instant) {
        self.expiration = to_ticks(expiration);
    }

    /// The encrypted data blob (empty: none yet).
    pub(crate) fn data(&self) -> &[u8] {
        &self.block[self.data_start() + 2..self.data_end()]
    }

    /// Endpoints in insertion order.
    pub(crate) fn endpoints(&self) -> impl Iterator<Item = Endpoint<'_>> + '_ {
        let mut pos = self.data_end();
        std::iter::from_fn(move || {
            let head = self.block.get(pos..pos + HEAD)?;
            let ticks = i64::from_le_bytes(head[..EXP].try_into().ok()?);
            let len = usize::from(head[EXP]);
            let data = &self.block[pos + HEAD..pos + HEAD + len];
            pos += HEAD + len;
            Some(Endpoint {
                expiration: from_ticks(ticks),
                data,
            })
        })
    }

    /// Bytes this affiliate takes in the state: its block and a fixed share for
    /// the table slot, the allocation and the kept fields (see `budget`).
    pub(crate) fn stored_bytes(&self) -> usize {
        super::budget::AFFILIATE_OVERHEAD + self.block.len()
    }

    /// Whether the endpoint blob `data` is stored.
    pub(crate) fn has_endpoint(&self, data: &[u8]) -> bool {
        self.endpoints().any(|e| e.data == data)
    }

    pub(crate) fn endpoint_count(&self) -> usize {
        self.endpoints().count()
    }

    /// The encoded entry, if one was kept since the last change.
    pub(crate) fn entry(&self) -> Option<&Arc<Entry>> {
        self.entry.get()
    }

    /// Keeps `entry` (this affiliate's current encoding) for snapshots.
    pub(crate) fn set_entry(&mut self, entry: Arc<Entry>) {
        self.entry.set(Some(entry));
    }

    /// Replaces the data blob, keeping the ID and the endpoints: in place when the
    /// length stays (a node re-publishing its data), repacked otherwise.
    pub(crate) fn set_data(&mut self, data: &[u8]) {
        let start = self.data_start() + 2;
        let end = self.data_end();
        if end - start == data.len() {
            self.block[start..end].copy_from_slice(data);
        } else {
            self.block = Self::pack(self.id_bytes(), data, self.endpoints());
        }
        self.entry.set(None);
    }

    /// Extends a known endpoint's expiration to at least `expiration`; false if the
    /// endpoint is not stored.
    pub(crate) fn extend_endpoint(&mut self, data: &[u8], expiration: Instant) -> bool {
        let mut pos = self.data_end();
        while pos + HEAD <= self.block.len() {
            let len = usize::from(self.block[pos + EXP]);
            if &self.block[pos + HEAD..pos + HEAD + len] == data {
                let exp = &mut self.block[pos..pos + EXP];
                let old = i64::from_le_bytes(exp.try_into().unwrap_or_default());
                exp.copy_from_slice(&old.max(to_ticks(expiration)).to_le_bytes());
                return true;
            }
            pos += HEAD + len;
        }
        false
    }

    /// Appends an endpoint.
    pub(crate) fn push_endpoint(&mut self, data: &[u8], expiration: Instant) {
        let mut block = Vec::with_capacity(self.block.len() + HEAD + data.len());
        block.extend_from_slice(&self.block);
        put_endpoint(&mut block, expiration, data);
        self.block = block.into_boxed_slice();
        self.entry.set(None);
    }

    /// Drops endpoints `keep` refuses; returns how many.
    pub(crate) fn retain_endpoints(&mut self, keep: impl Fn(Instant) -> bool) -> usize {
        let before = self.endpoint_count();
        let kept: Vec<Endpoint<'_>> = self.endpoints().filter(|e| keep(e.expiration)).collect();
        let removed = before - kept.len();
        if removed > 0 {
            self.block = Self::pack(self.id_bytes(), self.data(), kept);
            self.entry.set(None);
        }
        removed
    }
}

/// A cluster's affiliates, keyed by the ID stored in each record. SipHash with a
/// per-table random key, as `std`'s `HashMap`: IDs come from clients, so a fixed hash
/// would let one fill a bucket chain on purpose.
#[derive(Default)]
pub(crate) struct Affiliates {
    table: HashTable<Affiliate>,
    hasher: RandomState,
}

impl std::fmt::Debug for Affiliates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Affiliates")
            .field("len", &self.table.len())
            .finish_non_exhaustive()
    }
}

impl Affiliates {
    pub(crate) fn with_capacity(n: usize) -> Self {
        Self {
            table: HashTable::with_capacity(n),
            hasher: RandomState::new(),
        }
    }

    fn hash(&self, id: &str) -> u64 {
        self.hasher.hash_one(id)
    }

    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    pub(crate) fn get(&self, id: &str) -> Option<&Affiliate> {
        self.table.find(self.hash(id), |a| a.id() == id)
    }

    pub(crate) fn get_mut(&mut self, id: &str) -> Option<&mut Affiliate> {
        let hash = self.hash(id);
        self.table.find_mut(hash, |a| a.id() == id)
    }

    /// Stores `a`, replacing a record with the same ID.
    pub(crate) fn insert(&mut self, a: Affiliate) {
        let hash = self.hash(a.id());
        let hasher = &self.hasher;
        match self
            .table
            .entry(hash, |b| b.id() == a.id(), |b| hasher.hash_one(b.id()))
        {
            hashbrown::hash_table::Entry::Occupied(mut e) => *e.get_mut() = a,
            hashbrown::hash_table::Entry::Vacant(e) => {
                e.insert(a);
            }
        }
    }

    pub(crate) fn remove(&mut self, id: &str) -> Option<Affiliate> {
        let hash = self.hash(id);
        self.table
            .find_entry(hash, |a| a.id() == id)
            .ok()
            .map(|e| e.remove().0)
    }

    pub(crate) fn retain(&mut self, keep: impl FnMut(&mut Affiliate) -> bool) {
        self.table.retain(keep);
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &Affiliate> + '_ {
        self.table.iter()
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Affiliate> + '_ {
        self.table.iter_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_and_unpacks() {
        let now = Instant::now();
        let past = now - Duration::from_secs(5);
        let mut a = Affiliate::new(
            "node-1",
            now,
            b"data",
            [Endpoint {
                expiration: past,
                data: b"e1",
            }],
        );
        assert_eq!((a.id(), a.data()), ("node-1", &b"data"[..]));
        a.push_endpoint(b"e2", now + Duration::from_secs(60));
        assert!(a.extend_endpoint(b"e1", now));
        assert!(!a.extend_endpoint(b"e3", now));
        a.set_data(b"DATA");
        assert_eq!(a.data(), b"DATA", "same length: in place");
        a.set_data(b"");
        let eps: Vec<_> = a.endpoints().map(|e| (e.expiration, e.data)).collect();
        assert_eq!(
            eps,
            [
                (now, &b"e1"[..]),
                (now + Duration::from_secs(60), &b"e2"[..])
            ]
        );
        assert_eq!((a.id(), a.data()), ("node-1", &b""[..]));
        assert_eq!(a.retain_endpoints(|t| t > now), 1);
        assert_eq!(a.endpoint_count(), 1);
        assert_eq!(a.id(), "node-1");
        assert_eq!(a.expiration(), now);
        assert_eq!(from_ticks(to_ticks(past)), past);
    }

    #[test]
    fn the_longest_id_and_data_round_trip() {
        let id = "i".repeat(super::super::MAX_ID_LEN);
        let data = vec![7u8; super::super::MAX_DATA_LEN];
        let a = Affiliate::new(&id, Instant::now(), &data, []);
        assert_eq!((a.id(), a.data()), (id.as_str(), &data[..]));
    }

    #[test]
    fn the_table_finds_replaces_and_removes_by_the_id_inside_the_record() {
        let now = Instant::now();
        let mut t = Affiliates::default();
        for i in 0..100 {
            t.insert(Affiliate::new(&format!("n{i}"), now, &[i as u8], []));
        }
        t.insert(Affiliate::new("n7", now, b"odd", []));
        assert_eq!(t.len(), 100);
        assert_eq!(t.get("n7").map(Affiliate::data), Some(&b"odd"[..]));
        assert!(t.get("n100").is_none());
        assert_eq!(t.remove("n8").map(|a| a.data().to_vec()), Some(vec![8]));
        assert!(t.remove("n8").is_none());
        t.retain(|a| a.data().first().is_some_and(|&b| b % 2 == 0));
        assert!(t.iter().all(|a| a.data()[0] % 2 == 0));
        assert_eq!(
            t.len(),
            49,
            "the even first bytes but 8 (n7 now starts with an odd one)"
        );
        assert!(t.get("n10").is_some());
    }
}
