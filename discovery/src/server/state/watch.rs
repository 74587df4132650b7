//! Watch delivery: pre-encoded events shared by every watcher of a cluster, one queue
//! per watcher, and the cluster's event log for watchers that read but fall behind.
//!
//! Upstream gives each watcher a queue of 32 events and aborts it when the queue is
//! full. Here a full queue aborts the watcher only if it has stalled: it had something
//! to read for longer than the stall timeout and took nothing. A watcher that keeps
//! reading is switched to the log instead: its queue is dropped, and it reads every
//! event since the last one it took from the cluster's log of recent events, slices
//! of memory shared by every watcher reading there (`event_log`), until it has read
//! them all and goes back to its queue. Only a watcher the log no longer reaches
//! back to gets a catch-up made for it: in event order, the current state of every
//! affiliate changed since the last event it took and a delete for every affiliate
//! removed since, several affiliates per message, so it sees a subsequence of the
//! events (superseded states skipped) ending in the same state.
//! Neither costs memory per watcher, so a burst of any size is survived
//! (`docs/discovery-protocol.md` §7.6).
//!
//! The parts: [`super::encode`] writes the messages by hand, [`super::meter`] counts
//! bytes made for one watcher, [`super::entry`] holds the encodings shared by every
//! watcher, [`super::lag`] estimates how late the runtime runs; this module is the
//! queue.

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use bytes::{BufMut, Bytes, BytesMut};
use futures::task::AtomicWaker;

use super::{
    encode::{FRAME, PREFIX},
    entry::Batch,
    event_log::{EventLog, Read},
    lag::RuntimeLag,
};

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
    /// Lagging, and at the event log's end or behind what it keeps: ask the state
    /// ([`State::catch_up`](super::State::catch_up)), then poll again.
    CatchUp,
    /// Nothing queued: wait for the waker given to [`WatchQueue::register`].
    Wait,
    /// The watcher was aborted as stalled: end with `ABORTED`.
    Lost,
    /// The server closed the watch: end with OK.
    Closed,
}

/// One framed message in a watcher's queue: one buffer, or a batch of entries.
#[derive(Debug)]
pub(crate) enum Message {
    Flat(Bytes),
    Parts(Batch),
}

impl Message {
    /// The message without its gRPC prefix (a copy for a batch).
    fn unframed(&self) -> Bytes {
        match self {
            Self::Flat(b) => b.slice(PREFIX..),
            Self::Parts(s) => s.to_bytes().slice(PREFIX..),
        }
    }

    fn len(&self) -> usize {
        match self {
            Self::Flat(b) => b.len(),
            Self::Parts(s) => s.len(),
        }
    }

    fn part(&self, i: usize) -> Option<&[u8]> {
        match self {
            Self::Flat(b) => (i == 0).then_some(&b[..]),
            Self::Parts(s) => s.part(i),
        }
    }
}

/// A message part-way through being handed out.
#[derive(Debug)]
struct Sending {
    msg: Message,
    /// Current part and offset in it.
    part: usize,
    off: usize,
    /// Bytes of the message already handed out.
    done: usize,
    own: bool,
}

#[derive(Debug)]
struct Inner {
    /// The snapshot, sent before anything else.
    first: Option<Batch>,
    /// Encoded messages (gRPC-framed) with the sequence number of the last event each
    /// covers, and
    /// whether the message was made for this watcher alone (catch-up).
    events: VecDeque<(u64, Message, bool)>,
    sending: Option<Sending>,
    /// Bytes of messages made for this watcher alone that it still holds.
    holds: usize,
    /// Sequence number of the last event handed to the stream.
    delivered: u64,
    /// The queue was dropped; the stream reads the cluster's event log from
    /// `delivered + 1` on (or asks for a catch-up if the log no longer has it).
    lagging: bool,
    /// Position in the event log of the next event to read, once lagging.
    cursor: Option<u64>,
    lost: bool,
    closed: bool,
    /// Since when the watcher has had something to read (queue became non-empty).
    pending_since: Instant,
    /// When the stream last took an event or a piece of one.
    last_take: Instant,
}

impl Inner {
    /// Frees what was made for this watcher alone (an abort). A message cut off
    /// part-way cannot be followed by another, so then nothing more is sent.
    fn drop_own(&mut self) {
        if self.sending.take().is_some() {
            self.events.clear();
        } else {
            self.events.retain(|(_, _, own)| !own);
        }
        self.first = None;
        self.holds = 0;
    }

    /// Where a lagging watcher reads on in the event log: its cursor, or (before its
    /// first read) the event after the last one it took; `None` if no longer kept.
    fn log_position(&self, log: &EventLog) -> Option<u64> {
        self.cursor.or_else(|| log.position(self.delivered + 1))
    }

    fn clear_events(&mut self) {
        for (_, msg, own) in self.events.drain(..) {
            if own {
                self.holds -= msg.len();
            }
        }
    }

    /// The next body frame of the message being sent: a copy of its next (at most)
    /// [`FRAME`] bytes.
    fn next_piece(&mut self) -> Option<Bytes> {
        let s = self.sending.as_mut()?;
        let len = s.msg.len();
        let mut piece = BytesMut::with_capacity(FRAME.min(len - s.done));
        while piece.len() < FRAME {
            let Some(part) = s.msg.part(s.part) else {
                break;
            };
            let take = (part.len() - s.off).min(FRAME - piece.len());
            piece.put_slice(&part[s.off..s.off + take]);
            s.off += take;
            if s.off == part.len() {
                s.part += 1;
                s.off = 0;
            }
        }
        s.done += piece.len();
        if s.done == len {
            if s.own {
                self.holds -= len;
            }
            self.sending = None;
        }
        Some(piece.freeze())
    }

    /// Starts handing out the framed `msg`: its first body frame. A shared event that
    /// fits one frame goes out as it is (no copy per watcher); anything else is copied
    /// out piece by piece, so a peer that stops reading pins at most one piece.
    fn start(&mut self, msg: Message, own: bool) -> Bytes {
        match msg {
            Message::Flat(msg) if !own && msg.len() <= FRAME => msg,
            msg => {
                self.sending = Some(Sending {
                    msg,
                    part: 0,
                    off: 0,
                    done: 0,
                    own,
                });
                self.next_piece().unwrap_or_default()
            }
        }
    }
}

/// Locks `m`; a panic elsewhere while it was held leaves nothing half-done that
/// the watch paths rely on.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What [`WatchQueue::push`] did with an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pushed {
    /// Queued for the stream.
    Queued,
    /// Not queued: the watcher lags and reads the event log once its queue is empty
    /// (which covers this event and every later one until then).
    Lagging,
    /// The watcher stalled, or is closed: drop it.
    Dropped,
}

/// One watcher's queue, shared by the state (producer) and the stream (consumer).
#[derive(Debug)]
pub struct WatchQueue {
    inner: Mutex<Inner>,
    /// The stream's task, woken by a push, a catch-up, a loss or a close. The
    /// stream registers before it looks at the queue, so a change after that look
    /// wakes it.
    waker: AtomicWaker,
    limit: usize,
    stall: Duration,
    lag: Arc<RuntimeLag>,
    log: Arc<Mutex<EventLog>>,
}

impl WatchQueue {
    pub(crate) fn new(
        limit: usize,
        stall: Duration,
        lag: Arc<RuntimeLag>,
        log: Arc<Mutex<EventLog>>,
        delivered: u64,
        now: Instant,
    ) -> Self {
        Self {
            inner: Mutex::new(Inner {
                first: None,
                events: VecDeque::new(),
                sending: None,
                holds: 0,
                delivered,
                lagging: false,
                cursor: None,
                lost: false,
                closed: false,
                pending_since: now,
                last_take: now,
            }),
            waker: AtomicWaker::new(),
            limit: limit.max(1),
            stall,
            lag,
            log,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        lock(&self.inner)
    }

    /// Queues one event.
    pub(crate) fn push(&self, seq: u64, event: &Bytes, now: Instant) -> Pushed {
        let mut q = self.lock();
        if q.lost || q.closed {
            return Pushed::Dropped;
        }
        if q.lagging {
            return if self.keep_if_reading(&mut q, now) {
                Pushed::Lagging
            } else {
                Pushed::Dropped
            };
        }
        let pushed = if q.events.len() >= self.limit {
            if !self.keep_if_reading(&mut q, now) {
                return Pushed::Dropped;
            }
            q.clear_events();
            q.lagging = true;
            Pushed::Lagging
        } else {
            if q.events.is_empty() {
                q.pending_since = now;
            }
            q.events
                .push_back((seq, Message::Flat(event.clone()), false));
            Pushed::Queued
        };
        drop(q);
        self.waker.wake();
        pushed
    }

    /// A watcher that has had something to read for longer than the stall timeout
    /// and took nothing is marked lost (and woken, so its stream ends).
    fn keep_if_reading(&self, q: &mut Inner, now: Instant) -> bool {
        let idle = now.saturating_duration_since(q.pending_since.max(q.last_take));
        // The lag's lock only for a watcher idle past the timeout itself.
        if idle > self.stall && idle > self.stall + self.lag.grace(now) {
            // Shared events already queued are still delivered, then the stream
            // ends with ABORTED; what was made for this watcher alone is freed now,
            // since a stream that stopped reading may never take it.
            q.lost = true;
            q.drop_own();
            self.waker.wake();
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
        if q.lagging && q.sending.is_none() && q.first.is_none() {
            // Reading the log: pending since the first event it has not read was
            // appended; nothing pending once it has read them all.
            let log = lock(&self.log);
            let at = q.log_position(&log);
            match at.map_or(Some(q.pending_since), |at| log.unread_since(at)) {
                Some(since) => q.pending_since = since,
                None => return true,
            }
            drop(log);
            return self.keep_if_reading(&mut q, now);
        }
        if q.lagging || !q.events.is_empty() {
            return self.keep_if_reading(&mut q, now);
        }
        true
    }

    /// Queues the snapshot, sent before any event. Counted in [`Self::holds`].
    pub(crate) fn send_first(&self, snapshot: Batch) {
        let mut q = self.lock();
        q.holds += snapshot.len();
        q.first = Some(snapshot);
    }

    /// The snapshot not yet started (tests check its sharing).
    #[cfg(test)]
    pub(crate) fn first_batch(&self) -> Option<Batch> {
        self.lock().first.clone()
    }

    /// Bytes of messages made for this watcher alone (its snapshot, catch-up) that
    /// it has not taken yet.
    #[must_use]
    pub fn holds(&self) -> usize {
        self.lock().holds
    }

    /// When the stream last made progress (took an event or a piece of one, or
    /// registered), if it holds messages made for it alone.
    pub(crate) fn holding_since(&self) -> Option<Instant> {
        let q = self.lock();
        (q.holds > 0).then_some(q.last_take)
    }

    /// Aborts the watcher to free what it holds (the byte budget is exceeded and it
    /// is among the slowest): it ends with ABORTED like a stalled one.
    pub(crate) fn abort(&self) {
        let mut q = self.lock();
        if !q.lost && !q.closed {
            q.lost = true;
            q.drop_own();
        }
        drop(q);
        self.waker.wake();
    }

    /// Ends the watch with OK (shutdown or unsubscribe).
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.waker.wake();
    }

    /// Whether the queue needs a catch-up, and from which sequence number.
    pub(crate) fn lagging_since(&self) -> Option<u64> {
        let q = self.lock();
        q.lagging.then_some(q.delivered)
    }

    pub(crate) fn delivered(&self) -> u64 {
        self.lock().delivered
    }

    /// Back from the event log to the queue: the watcher has read every event so
    /// far. Called under the state lock, so the next event is pushed to the queue.
    pub(crate) fn rejoin(&self, now: Instant) {
        let mut q = self.lock();
        q.lagging = false;
        q.cursor = None;
        q.pending_since = now;
    }

    /// Replaces the dropped queue with the catch-up messages (the log no longer had
    /// what the watcher needs).
    pub(crate) fn fill_catch_up(&self, messages: Vec<(u64, Message)>, now: Instant) {
        let mut q = self.lock();
        q.lagging = false;
        q.cursor = None;
        q.pending_since = now;
        for (seq, msg) in messages {
            q.holds += msg.len();
            q.events.push_back((seq, msg, true));
        }
        drop(q);
        self.waker.wake();
    }

    /// Takes the next thing to do, whole messages without the gRPC prefix (the
    /// snapshot first); never blocks.
    pub fn next(&self, now: Instant) -> Next {
        let mut q = self.lock();
        if let Some(first) = q.first.take() {
            q.holds -= first.len();
            q.last_take = now;
            return Next::Send(Message::Parts(first).unframed());
        }
        if let Some((seq, event, own)) = q.events.pop_front() {
            if own {
                q.holds -= event.len();
            }
            q.delivered = seq;
            q.last_take = now;
            return Next::Send(event.unframed());
        }
        match self.read_log(&mut q, now, EventLog::read_one) {
            Some(Ok(event)) => Next::Send(event.slice(PREFIX..)),
            Some(Err(next)) => next,
            None => Self::idle(&mut q),
        }
    }

    /// Like [`Self::next`], but [`Next::Send`] carries the next HTTP/2 body frame:
    /// the gRPC-framed messages in pieces of at most [`FRAME`] bytes.
    pub fn next_frame(&self, now: Instant) -> Next {
        let mut q = self.lock();
        if let Some(piece) = q.next_piece() {
            q.last_take = now;
            return Next::Send(piece);
        }
        if let Some(first) = q.first.take() {
            q.last_take = now;
            return Next::Send(q.start(Message::Parts(first), true));
        }
        if let Some((seq, event, own)) = q.events.pop_front() {
            q.delivered = seq;
            q.last_take = now;
            return Next::Send(q.start(event, own));
        }
        match self.read_log(&mut q, now, EventLog::read) {
            Some(Ok(events)) => Next::Send(q.start(Message::Flat(events), false)),
            Some(Err(next)) => next,
            None => Self::idle(&mut q),
        }
    }

    /// A lagging watcher's next read of the event log (`read` takes one event or
    /// the rest of a segment); `None` when it is not lagging. At the log's end, or
    /// at a position the log no longer has, it asks the state
    /// ([`State::catch_up`](super::State::catch_up)) to put it back on its queue or
    /// to make it a catch-up.
    fn read_log(
        &self,
        q: &mut Inner,
        now: Instant,
        read: fn(&EventLog, u64) -> Read,
    ) -> Option<Result<Bytes, Next>> {
        if !q.lagging || q.lost || q.closed {
            return None;
        }
        let log = lock(&self.log);
        let at = q.log_position(&log);
        match at.map(|at| (at, read(&log, at))) {
            Some((at, Read::Events { bytes, last_seq })) => {
                q.cursor = Some(at + bytes.len() as u64);
                q.delivered = last_seq;
                q.last_take = now;
                Some(Ok(bytes))
            }
            Some((at, Read::End)) => {
                q.cursor = Some(at);
                Some(Err(Next::CatchUp))
            }
            None | Some((_, Read::Gone)) => {
                q.last_take = now;
                Some(Err(Next::CatchUp))
            }
        }
    }

    fn idle(q: &mut Inner) -> Next {
        if q.lost {
            Next::Lost
        } else if q.closed {
            Next::Closed
        } else {
            Next::Wait
        }
    }

    /// Wakes `waker` at the next push, catch-up, loss or close. Register before
    /// taking from the queue, so nothing that follows the take goes unnoticed.
    pub fn register(&self, waker: &std::task::Waker) {
        self.waker.register(waker);
    }

    /// Whether the watcher was aborted as stalled.
    #[must_use]
    pub fn is_lost(&self) -> bool {
        self.lock().lost
    }
}
