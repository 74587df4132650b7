//! The stored affiliate, packed for memory: the data blob and every endpoint (its
//! expiration, length and bytes) share one allocation, so an affiliate costs its map
//! slot, its ID and one heap block instead of a block per blob plus a vector.
//!
//! Layout of the block: `data_len: u16 LE | data | { expiration: i64 LE | len: u8 |
//! bytes }*`, endpoints in insertion order. Endpoint expirations are nanoseconds from a
//! process-wide epoch, which round-trips every `Instant` the server can produce (it
//! saturates at ±292 years, beyond what `offset` yields).

use std::{
    sync::{Arc, OnceLock},
    time::{Duration, Instant},
};

use bytes::Bytes;

/// One stored affiliate: opaque blobs, each expiring on its own.
#[derive(Debug, Clone)]
pub(crate) struct Affiliate {
    pub(crate) expiration: Instant,
    /// Sequence number of the cluster event that last carried this affiliate.
    pub(crate) changed: u64,
    block: Box<[u8]>,
    /// The affiliate's current Watch event (gRPC-framed, one entry), kept while its
    /// cluster has watchers: snapshots are made of these shared entries instead of a
    /// copy of every affiliate per joining watcher. Any change clears it.
    entry: Option<Arc<Bytes>>,
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

impl Affiliate {
    /// An affiliate with `data` (at most 2048 bytes, validated) and `endpoints`.
    pub(crate) fn new<'a>(
        expiration: Instant,
        data: &[u8],
        endpoints: impl IntoIterator<Item = Endpoint<'a>>,
    ) -> Self {
        let mut block = Vec::with_capacity(2 + data.len());
        let len = u16::try_from(data.len()).unwrap_or(u16::MAX);
        block.extend_from_slice(&len.to_le_bytes());
        block.extend_from_slice(&data[..usize::from(len)]);
        for e in endpoints {
            put_endpoint(&mut block, e.expiration, e.data);
        }
        Self {
            expiration,
            changed: 0,
            block: block.into_boxed_slice(),
            entry: None,
        }
    }

    fn data_end(&self) -> usize {
        2 + usize::from(u16::from_le_bytes([self.block[0], self.block[1]]))
    }

    /// The encrypted data blob (empty: none yet).
    pub(crate) fn data(&self) -> &[u8] {
        &self.block[2..self.data_end()]
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

    pub(crate) fn endpoint_count(&self) -> usize {
        self.endpoints().count()
    }

    /// The encoded entry, if one was kept since the last change.
    pub(crate) fn entry(&self) -> Option<&Arc<Bytes>> {
        self.entry.as_ref()
    }

    /// Keeps `entry` (this affiliate's current encoding) for snapshots.
    pub(crate) fn set_entry(&mut self, entry: Arc<Bytes>) {
        self.entry = Some(entry);
    }

    /// Replaces the data blob, keeping the endpoints.
    pub(crate) fn set_data(&mut self, data: &[u8]) {
        let rebuilt = Self::new(self.expiration, data, self.endpoints());
        self.block = rebuilt.block;
        self.entry = None;
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
        self.entry = None;
    }

    /// Drops endpoints `keep` refuses; returns how many.
    pub(crate) fn retain_endpoints(&mut self, keep: impl Fn(Instant) -> bool) -> usize {
        let before = self.endpoint_count();
        let kept: Vec<Endpoint<'_>> = self.endpoints().filter(|e| keep(e.expiration)).collect();
        let removed = before - kept.len();
        if removed > 0 {
            let rebuilt = Self::new(self.expiration, self.data(), kept);
            self.block = rebuilt.block;
            self.entry = None;
        }
        removed
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
            now,
            b"data",
            [Endpoint {
                expiration: past,
                data: b"e1",
            }],
        );
        assert_eq!(a.data(), b"data");
        a.push_endpoint(b"e2", now + Duration::from_secs(60));
        assert!(a.extend_endpoint(b"e1", now));
        assert!(!a.extend_endpoint(b"e3", now));
        a.set_data(b"");
        let eps: Vec<_> = a.endpoints().map(|e| (e.expiration, e.data)).collect();
        assert_eq!(
            eps,
            [
                (now, &b"e1"[..]),
                (now + Duration::from_secs(60), &b"e2"[..])
            ]
        );
        assert_eq!(a.data(), b"");
        assert_eq!(a.retain_endpoints(|t| t > now), 1);
        assert_eq!(a.endpoint_count(), 1);
        assert_eq!(from_ticks(to_ticks(past)), past);
    }
}
