//! Watch delivery: pre-encoded events shared by every watcher of a cluster, one queue
//! per watcher, and catch-up for watchers that read but fall behind.
//!
//! Upstream gives each watcher a queue of 32 events and aborts it when the queue is
//! full. Here a full queue aborts the watcher only if it has stalled: it had something
//! to read for longer than the stall timeout and took nothing. A watcher that keeps
//! reading is switched to catch-up instead: its queue is dropped, and when it next
//! reads it gets, in event order, the current state of every affiliate changed since
//! the last event it took and a delete for every affiliate removed since, several
//! affiliates per message. What it sees is a subsequence of the events every other
//! watcher sees (superseded states of one affiliate skipped), ending in the same state;
//! catch-up costs no memory per watcher, so a burst of any size is survived
//! (`docs/discovery-protocol.md` §7.6).

use std::{
    collections::VecDeque,
    sync::{Mutex, MutexGuard},
    time::{Duration, Instant},
};

use bytes::{BufMut, Bytes, BytesMut};
use prost::encoding::{encode_varint, encoded_len_varint};
use tokio::sync::Notify;

use super::Affiliate;

/// Largest catch-up message; a longer catch-up is split (clients accept 4 MiB by
/// default).
pub const CATCH_UP_BATCH: usize = 1 << 20;

/// How long a watcher with a full queue may go without taking an event before it is
/// aborted as stalled.
pub const WATCH_STALL: Duration = Duration::from_secs(2);

/// What the stream of one watcher should do next.
#[derive(Debug)]
pub enum Next {
    /// Send this encoded `WatchResponse`.
    Send(Bytes),
    /// Nothing queued: ask the state for a catch-up, then poll again.
    CatchUp,
    /// Nothing queued: wait for [`WatchQueue::notified`].
    Wait,
    /// The watcher was aborted as stalled: end with `ABORTED`.
    Lost,
    /// The server closed the watch: end with OK.
    Closed,
}

#[derive(Debug)]
struct Inner {
    /// Encoded messages with the sequence number of the last event each covers.
    events: VecDeque<(u64, Bytes)>,
    /// Sequence number of the last event handed to the stream.
    delivered: u64,
    /// The queue was dropped; the stream must ask for a catch-up.
    lagging: bool,
    lost: bool,
    closed: bool,
    /// Since when the watcher has had something to read (queue became non-empty).
    pending_since: Instant,
    /// When the stream last took an event.
    last_take: Instant,
}

/// One watcher's queue, shared by the state (producer) and the stream (consumer).
#[derive(Debug)]
pub struct WatchQueue {
    inner: Mutex<Inner>,
    notify: Notify,
    limit: usize,
    stall: Duration,
}

impl WatchQueue {
    pub(crate) fn new(limit: usize, stall: Duration, delivered: u64, now: Instant) -> Self {
        Self {
            inner: Mutex::new(Inner {
                events: VecDeque::new(),
                delivered,
                lagging: false,
                lost: false,
                closed: false,
                pending_since: now,
                last_take: now,
            }),
            notify: Notify::new(),
            limit: limit.max(1),
            stall,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Queues one event; returns false if the watcher must be dropped (stalled, or
    /// already closed).
    pub(crate) fn push(&self, seq: u64, event: &Bytes, now: Instant) -> bool {
        let mut q = self.lock();
        if q.lost || q.closed {
            return false;
        }
        if q.lagging {
            return self.keep_if_reading(&mut q, now);
        }
        if q.events.len() >= self.limit {
            if !self.keep_if_reading(&mut q, now) {
                return false;
            }
            q.events.clear();
            q.lagging = true;
        } else {
            if q.events.is_empty() {
                q.pending_since = now;
            }
            q.events.push_back((seq, event.clone()));
        }
        drop(q);
        self.notify.notify_one();
        true
    }

    /// A watcher that has had something to read for longer than the stall timeout
    /// and took nothing is marked lost (and woken, so its stream ends).
    fn keep_if_reading(&self, q: &mut Inner, now: Instant) -> bool {
        let active = q.pending_since.max(q.last_take);
        if now.saturating_duration_since(active) > self.stall {
            // What is queued is still delivered, then the stream ends with ABORTED.
            q.lost = true;
            self.notify.notify_one();
            return false;
        }
        true
    }

    /// Periodic check for watchers that stopped reading while no new events arrive.
    pub(crate) fn check_stalled(&self, now: Instant) -> bool {
        let mut q = self.lock();
        if q.lost || q.closed {
            return false;
        }
        if q.lagging || !q.events.is_empty() {
            return self.keep_if_reading(&mut q, now);
        }
        true
    }

    /// Ends the watch with OK (shutdown or unsubscribe).
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.notify.notify_one();
    }

    /// Whether the queue needs a catch-up, and from which sequence number.
    pub(crate) fn lagging_since(&self) -> Option<u64> {
        let q = self.lock();
        q.lagging.then_some(q.delivered)
    }

    pub(crate) fn delivered(&self) -> u64 {
        self.lock().delivered
    }

    /// Replaces the dropped queue with the catch-up messages.
    pub(crate) fn fill_catch_up(&self, messages: Vec<(u64, Bytes)>, now: Instant) {
        let mut q = self.lock();
        q.lagging = false;
        q.pending_since = now;
        q.events.extend(messages);
        drop(q);
        self.notify.notify_one();
    }

    /// Takes the next thing to do; never blocks.
    pub fn next(&self, now: Instant) -> Next {
        let mut q = self.lock();
        if let Some((seq, event)) = q.events.pop_front() {
            q.delivered = seq;
            q.last_take = now;
            return Next::Send(event);
        }
        if q.lost {
            Next::Lost
        } else if q.closed {
            Next::Closed
        } else if q.lagging {
            q.last_take = now;
            Next::CatchUp
        } else {
            Next::Wait
        }
    }

    /// Resolves after the next push, catch-up, loss or close.
    pub async fn notified(&self) {
        self.notify.notified().await;
    }

    /// Whether the watcher was aborted as stalled.
    #[must_use]
    pub fn is_lost(&self) -> bool {
        self.lock().lost
    }
}

/// Encoded length of `Affiliate{id, data, endpoints}`.
fn affiliate_len(id: &str, a: &Affiliate) -> usize {
    let field = |n: usize| 1 + encoded_len_varint(n as u64) + n;
    let mut len = 0;
    if !id.is_empty() {
        len += field(id.len());
    }
    if !a.data().is_empty() {
        len += field(a.data().len());
    }
    len + a.endpoints().map(|e| field(e.data.len())).sum::<usize>()
}

fn put_field(buf: &mut BytesMut, tag: u8, bytes: &[u8]) {
    buf.put_u8(tag);
    encode_varint(bytes.len() as u64, buf);
    buf.put_slice(bytes);
}

/// Appends one `affiliates` entry (field 1 of `WatchResponse`/`ListResponse`) with
/// the affiliate's ID, data and endpoints, as prost would encode it.
pub(crate) fn put_affiliate(buf: &mut BytesMut, id: &str, a: &Affiliate) {
    buf.put_u8(0x0a);
    encode_varint(affiliate_len(id, a) as u64, buf);
    if !id.is_empty() {
        put_field(buf, 0x0a, id.as_bytes());
    }
    if !a.data().is_empty() {
        put_field(buf, 0x12, a.data());
    }
    for e in a.endpoints() {
        put_field(buf, 0x1a, e.data);
    }
}

/// Bytes [`put_affiliate`] appends.
pub(crate) fn affiliate_entry_len(id: &str, a: &Affiliate) -> usize {
    let len = affiliate_len(id, a);
    1 + encoded_len_varint(len as u64) + len
}

/// Appends a deleted affiliate's entry (ID only).
pub(crate) fn put_deleted(buf: &mut BytesMut, id: &str) {
    let inner = if id.is_empty() {
        0
    } else {
        1 + encoded_len_varint(id.len() as u64) + id.len()
    };
    buf.put_u8(0x0a);
    encode_varint(inner as u64, buf);
    if !id.is_empty() {
        put_field(buf, 0x0a, id.as_bytes());
    }
}

/// Ends a `WatchResponse` whose affiliates were all deleted (field 2 = true).
pub(crate) fn put_deleted_flag(buf: &mut BytesMut) {
    buf.put_slice(&[0x10, 0x01]);
}
