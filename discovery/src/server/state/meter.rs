//! Metering of Watch messages made for one watcher alone, for the watch byte budget.

use std::sync::{
    atomic::{AtomicUsize, Ordering},
    Arc,
};

use bytes::{Bytes, BytesMut};

/// Bytes of encoded Watch messages made for one watcher alone (snapshots, catch-up
/// batches) that are still alive, whoever holds them. Shared events are not counted:
/// one copy serves every watcher of a cluster.
#[derive(Debug, Default)]
pub struct WatchBytes(pub(super) AtomicUsize);

impl WatchBytes {
    /// Bytes currently held.
    #[must_use]
    pub fn get(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// The owner of one counted message: the count drops when its last `Bytes` does.
struct Counted {
    buf: BytesMut,
    meter: Arc<WatchBytes>,
}

impl AsRef<[u8]> for Counted {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.meter.0.fetch_sub(self.buf.len(), Ordering::Relaxed);
    }
}

/// Counts `buf` in `meter` for as long as the returned bytes live.
pub(crate) fn counted(buf: BytesMut, meter: &Arc<WatchBytes>) -> Bytes {
    meter.0.fetch_add(buf.len(), Ordering::Relaxed);
    Bytes::from_owner(Counted {
        buf,
        meter: Arc::clone(meter),
    })
}
