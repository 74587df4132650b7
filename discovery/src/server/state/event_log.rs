//! A cluster's recent Watch events, back to back in event order, each with its gRPC
//! prefix: the bytes a watcher that fell behind reads instead of a catch-up made for
//! it alone.
//!
//! Events are appended to an open buffer, which is sealed into an immutable segment
//! once the next event would take it past [`SEGMENT`] bytes. A watcher reads from its
//! position to the end of that position's segment: a slice of memory every other
//! watcher reading there shares, so under a burst the server neither scans the
//! cluster nor copies events per watcher. Only the open buffer's bytes are copied
//! for each reader (at most one segment's worth). Segments hold whole events, so every
//! read ends on an event boundary, and a slice pins at most one segment.
//!
//! Positions are byte offsets counted from the first event ever appended; they never
//! repeat, so a position from before a trim or a reset reads as [`Read::Gone`].

use std::{collections::VecDeque, time::Instant};

use bytes::{Bytes, BytesMut};

use super::encode::FRAME;

/// Most bytes of one sealed segment (a single larger event is a segment of its own):
/// one body frame, so a slice of a segment goes to the transport as it is.
pub(crate) const SEGMENT: usize = FRAME;

/// What a read found at a position.
#[derive(Debug)]
pub(crate) enum Read {
    /// Whole events from the position on, the last of them `last_seq`.
    Events { bytes: Bytes, last_seq: u64 },
    /// Nothing after the position yet.
    End,
    /// The position is no longer (or never was) in the log.
    Gone,
}

#[derive(Debug)]
struct Segment {
    start: u64,
    last_seq: u64,
    bytes: Bytes,
}

impl Segment {
    fn end(&self) -> u64 {
        self.start + self.bytes.len() as u64
    }
}

/// Where one event starts, and when it was appended (a reader that has it unread
/// has had something to read since then).
#[derive(Debug, Clone, Copy)]
struct Logged {
    start: u64,
    at: Instant,
}

/// The events of one cluster from `first_seq` on, without gaps.
#[derive(Debug, Default)]
pub(crate) struct EventLog {
    /// Sequence number of `events[0]` (of the next event, while there is none).
    first_seq: u64,
    events: VecDeque<Logged>,
    sealed: VecDeque<Segment>,
    open: BytesMut,
    /// Position of `open[0]`.
    open_start: u64,
    /// Size at which the next trim is tried.
    trim_at: usize,
}

impl EventLog {
    /// Position after the last event.
    pub(crate) fn end(&self) -> u64 {
        self.open_start + self.open.len() as u64
    }

    /// Position of the first event kept.
    fn base(&self) -> u64 {
        self.sealed.front().map_or(self.open_start, |s| s.start)
    }

    /// Bytes kept.
    pub(crate) fn bytes(&self) -> usize {
        usize::try_from(self.end() - self.base()).unwrap_or(usize::MAX)
    }

    /// Events kept.
    pub(crate) fn len(&self) -> usize {
        self.events.len()
    }

    fn next_seq(&self) -> u64 {
        self.first_seq + self.events.len() as u64
    }

    /// Appends the framed `event`, number `seq`, at `now`. An event that does not
    /// follow the last one (events went unlogged while the cluster had no watchers)
    /// starts the log afresh; positions from before read as gone.
    pub(crate) fn append(&mut self, seq: u64, event: &[u8], now: Instant) {
        if seq != self.next_seq() || self.events.is_empty() {
            self.reset(seq);
        }
        if !self.open.is_empty() && self.open.len() + event.len() > SEGMENT {
            self.seal();
        }
        let start = self.end();
        self.open.extend_from_slice(event);
        self.events.push_back(Logged { start, at: now });
    }

    /// Drops every event; the next append starts at `seq`. One byte of position is
    /// skipped, so a reader that was at the end reads as gone, not as caught up.
    pub(crate) fn reset(&mut self, seq: u64) {
        self.open_start = self.end() + 1;
        self.open = BytesMut::new();
        self.sealed.clear();
        self.events.clear();
        self.first_seq = seq;
    }

    /// Drops every event (the cluster has no watchers left to read them).
    pub(crate) fn clear(&mut self) {
        if !self.events.is_empty() {
            self.reset(self.next_seq());
        }
    }

    fn seal(&mut self) {
        let bytes = std::mem::take(&mut self.open).freeze();
        let start = self.open_start;
        self.open_start += bytes.len() as u64;
        self.sealed.push_back(Segment {
            start,
            last_seq: self.next_seq() - 1,
            bytes,
        });
    }

    /// Position of event `seq`: the end for the next one, `None` if it is not kept.
    pub(crate) fn position(&self, seq: u64) -> Option<u64> {
        if seq == self.next_seq() {
            return Some(self.end());
        }
        let i = usize::try_from(seq.checked_sub(self.first_seq)?).ok()?;
        self.events.get(i).map(|e| e.start)
    }

    /// Index in `events` of the event starting at `at`.
    fn event_at(&self, at: u64) -> usize {
        self.events.partition_point(|e| e.start < at)
    }

    /// The events from position `from` (an event's start) to the end of its segment.
    pub(crate) fn read(&self, from: u64) -> Read {
        self.read_from(from, false)
    }

    /// The one event starting at position `from`.
    pub(crate) fn read_one(&self, from: u64) -> Read {
        self.read_from(from, true)
    }

    /// From position `from` to the end of the segment (or open buffer) holding it,
    /// or (`one`) to the end of the event there: a slice of a sealed segment, a copy
    /// of the open buffer.
    fn read_from(&self, from: u64, one: bool) -> Read {
        if from == self.end() {
            return Read::End;
        }
        if from < self.base() || from > self.end() {
            return Read::Gone;
        }
        let sealed = (from < self.open_start)
            .then(|| &self.sealed[self.sealed.partition_point(|s| s.end() <= from)]);
        let (start, mut until, mut last_seq) = match sealed {
            Some(s) => (s.start, s.end(), s.last_seq),
            None => (self.open_start, self.end(), self.next_seq() - 1),
        };
        if one {
            // Segments hold whole events, so the next event starts within this one.
            let i = self.event_at(from);
            last_seq = self.first_seq + i as u64;
            until = self.events.get(i + 1).map_or(until, |e| e.start);
        }
        let range = offset(from - start)..offset(until - start);
        let bytes = match sealed {
            Some(s) => s.bytes.slice(range),
            None => Bytes::copy_from_slice(&self.open[range]),
        };
        Read::Events { bytes, last_seq }
    }

    /// When the event at position `from` was appended; `None` at the end (nothing
    /// unread). A position no longer kept counts from the oldest event kept.
    pub(crate) fn unread_since(&self, from: u64) -> Option<Instant> {
        if from >= self.end() {
            return None;
        }
        let i = self.event_at(from).min(self.events.len().saturating_sub(1));
        self.events.get(i).map(|e| e.at)
    }

    /// Whether the log has grown to where a trim of what no reader needs is due:
    /// twice what the last trim kept.
    pub(crate) fn trim_due(&self) -> bool {
        self.bytes() > self.trim_at.max(SEGMENT)
    }

    /// Drops the sealed segments no reader needs (all their events come before
    /// `seq`), then the oldest others while the log is over `limit` bytes: readers
    /// still behind them read as gone. The next trim is due at twice what is kept.
    pub(crate) fn trim(&mut self, seq: u64, limit: usize) {
        while let Some(front) = self.sealed.front() {
            if front.last_seq >= seq && self.bytes() <= limit {
                break;
            }
            self.sealed.pop_front();
        }
        let base = self.base();
        while self.events.front().is_some_and(|e| e.start < base) {
            self.events.pop_front();
            self.first_seq += 1;
        }
        self.trim_at = self.bytes().saturating_mul(2);
    }
}

/// A position difference within one segment or the open buffer (both far below
/// `usize::MAX`) as an index.
fn offset(d: u64) -> usize {
    usize::try_from(d).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A framed event of `len` bytes, every byte `tag`.
    fn event(tag: u8, len: usize) -> Vec<u8> {
        vec![tag; len]
    }

    fn filled(n: u8, len: usize, t0: Instant) -> (EventLog, Vec<Vec<u8>>) {
        let mut log = EventLog::default();
        let events: Vec<_> = (0..n).map(|i| event(i, len)).collect();
        for (i, e) in events.iter().enumerate() {
            log.append(10 + i as u64, e, t0);
        }
        (log, events)
    }

    /// Everything from `from` to the end, read as a watcher reads it.
    fn read_all(log: &EventLog, mut from: u64) -> (Vec<u8>, Vec<(usize, u64)>) {
        let mut body = Vec::new();
        let mut reads = Vec::new();
        loop {
            match log.read(from) {
                Read::Events { bytes, last_seq } => {
                    from += bytes.len() as u64;
                    reads.push((bytes.len(), last_seq));
                    body.extend_from_slice(&bytes);
                }
                Read::End => return (body, reads),
                Read::Gone => panic!("gone at {from}"),
            }
        }
    }

    #[test]
    fn reads_give_whole_events_up_to_a_segment_in_order() {
        let t0 = Instant::now();
        // 1,000-byte events: 16 per segment.
        let (log, events) = filled(40, 1000, t0);
        let (body, reads) = read_all(&log, log.position(10).unwrap());
        assert_eq!(body, events.concat());
        assert_eq!(
            reads,
            [(16_000, 25), (16_000, 41), (8_000, 49)],
            "two sealed segments, then the open buffer"
        );
        // From an event inside a segment: the rest of that segment.
        let (body, reads) = read_all(&log, log.position(30).unwrap());
        assert_eq!(body, events[20..].concat());
        assert_eq!(reads[0], (12_000, 41));
        assert_eq!(log.position(50), Some(log.end()));
        assert!(matches!(log.read(log.end()), Read::End));
        assert_eq!(log.position(51), None);
        assert_eq!(log.position(9), None);
    }

    #[test]
    fn one_event_at_a_time() {
        let t0 = Instant::now();
        let (log, events) = filled(20, 1000, t0);
        let mut at = log.position(10).unwrap();
        for (i, e) in events.iter().enumerate() {
            let Read::Events { bytes, last_seq } = log.read_one(at) else {
                panic!("event {i}");
            };
            assert_eq!(&bytes[..], &e[..]);
            assert_eq!(last_seq, 10 + i as u64);
            at += bytes.len() as u64;
        }
        assert!(matches!(log.read_one(at), Read::End));
    }

    /// A sealed segment is the same memory for every reader; the open buffer is
    /// copied.
    #[test]
    fn sealed_segments_are_shared_by_every_reader() {
        let t0 = Instant::now();
        let (log, _) = filled(20, 1000, t0);
        let from = log.position(12).unwrap();
        let bytes = |r: Read| match r {
            Read::Events { bytes, .. } => bytes,
            other => panic!("{other:?}"),
        };
        // Both reads held at once, so a copy could not reuse the other's memory.
        let (a, b) = (bytes(log.read(from)), bytes(log.read(from)));
        assert_eq!(a.as_ptr(), b.as_ptr());
        let open = log.position(28).unwrap();
        let (a, b) = (bytes(log.read(open)), bytes(log.read(open)));
        assert_ne!(a.as_ptr(), b.as_ptr());
    }

    #[test]
    fn an_event_larger_than_a_segment_is_a_segment_of_its_own() {
        let t0 = Instant::now();
        let mut log = EventLog::default();
        let big = event(7, SEGMENT + 10);
        for (seq, e) in [(1, event(1, 100)), (2, big.clone()), (3, event(3, 100))] {
            log.append(seq, &e, t0);
        }
        let Read::Events { bytes, last_seq } = log.read(log.position(2).unwrap()) else {
            panic!("no read");
        };
        assert_eq!((&bytes[..], last_seq), (&big[..], 2));
    }

    #[test]
    fn trim_keeps_what_readers_need_and_the_limit_overrides_it() {
        let t0 = Instant::now();
        let (mut log, events) = filled(64, 1000, t0);
        // A reader needs event 30 on: segments ending before it go.
        log.trim(30, usize::MAX);
        assert_eq!(log.position(25), None);
        assert!(log.position(26).is_some(), "segment 26..=41 holds event 30");
        let (body, _) = read_all(&log, log.position(30).unwrap());
        assert_eq!(body, events[20..].concat());
        // Over the limit the oldest segments go even though a reader needs them.
        let from = log.position(30).unwrap();
        log.trim(30, 20_000);
        assert!(log.bytes() <= 20_000, "{}", log.bytes());
        assert!(matches!(log.read(from), Read::Gone));
        assert!(matches!(log.read_one(from), Read::Gone));
    }

    #[test]
    fn a_gap_in_sequence_numbers_starts_afresh_and_old_positions_read_as_gone() {
        let t0 = Instant::now();
        let (mut log, _) = filled(3, 100, t0);
        let end = log.end();
        log.append(20, &event(9, 100), t0);
        assert!(matches!(log.read(end), Read::Gone));
        assert_eq!(log.len(), 1);
        assert_eq!(log.position(20), Some(end + 1));
    }

    #[test]
    fn unread_since_is_the_append_time_of_the_first_unread_event() {
        let t0 = Instant::now();
        let mut log = EventLog::default();
        for i in 0..4u64 {
            log.append(
                i + 1,
                &event(1, 100),
                t0 + std::time::Duration::from_secs(i),
            );
        }
        let at = log.position(3).unwrap();
        assert_eq!(
            log.unread_since(at),
            Some(t0 + std::time::Duration::from_secs(2))
        );
        assert_eq!(log.unread_since(log.end()), None);
    }
}
