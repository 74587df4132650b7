//! Batching, sans-IO: what the core produces for one batch of input is gathered in
//! reusable buffers ([`Outbox`]) and written after the core's lock is released, with
//! runs of equal-sized datagrams to one address sent as one UDP GSO send
//! ([`gso_runs`]). Received GRO buffers are split back into datagrams by their segment
//! size ([`gro_segments`]).

use std::{
    net::SocketAddr,
    ops::Range,
    time::{Duration, Instant},
};

use nix::errno::Errno;

use super::io::Io;

/// Most segments in one GSO send (the kernel's `UDP_MAX_SEGMENTS` is 64 on older
/// kernels, 128 on newer ones).
pub const MAX_GSO_SEGMENTS: usize = 64;
/// Most bytes in one GSO send: a UDP datagram's payload limit over IPv6, rounded down.
pub const MAX_GSO_BYTES: usize = 65_000;

/// The output of one batch: datagrams for the socket and packets for the TUN, each
/// kind stored back to back in its own buffer, reused from batch to batch.
#[derive(Debug, Default)]
pub struct Outbox {
    bytes: Vec<u8>,
    datagrams: Vec<(SocketAddr, Range<usize>)>,
    tun_bytes: Vec<u8>,
    packets: Vec<Range<usize>>,
}

impl Outbox {
    /// Empties the outbox, keeping its memory.
    pub fn clear(&mut self) {
        self.bytes.clear();
        self.datagrams.clear();
        self.tun_bytes.clear();
        self.packets.clear();
    }

    /// The buffer the datagrams' ranges index into.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The datagrams, in the order they were sent.
    pub fn datagrams(&self) -> &[(SocketAddr, Range<usize>)] {
        &self.datagrams
    }

    /// The TUN packets, in the order they were written.
    pub fn packets(&self) -> impl Iterator<Item = &[u8]> {
        self.packets.iter().map(|r| &self.tun_bytes[r.clone()])
    }

    /// True when the batch produced nothing.
    pub fn is_empty(&self) -> bool {
        self.datagrams.is_empty() && self.packets.is_empty()
    }
}

fn push(buf: &mut Vec<u8>, data: &[u8]) -> Range<usize> {
    let start = buf.len();
    buf.extend_from_slice(data);
    start..buf.len()
}

impl Io for Outbox {
    fn send(&mut self, to: SocketAddr, datagram: &[u8]) {
        let range = push(&mut self.bytes, datagram);
        self.datagrams.push((to, range));
    }

    fn write_tun(&mut self, packet: &[u8]) {
        let range = push(&mut self.tun_bytes, packet);
        self.packets.push(range);
    }
}

/// One GSO send: `count` datagrams to `to`, all `segment` bytes long except possibly
/// the last (shorter), stored back to back at `bytes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GsoRun {
    /// The destination.
    pub to: SocketAddr,
    /// The datagrams' bytes, contiguous in the outbox.
    pub bytes: Range<usize>,
    /// The size of every datagram but the last.
    pub segment: usize,
    /// How many datagrams.
    pub count: usize,
}

/// Groups `datagrams` (in order) into GSO runs: consecutive datagrams to the same
/// address, stored back to back, of one size, where only the last may be shorter,
/// at most `max_segments` of them and `max_bytes` in all. Order is kept.
pub fn gso_runs(
    datagrams: &[(SocketAddr, Range<usize>)],
    max_segments: usize,
    max_bytes: usize,
) -> Vec<GsoRun> {
    let mut runs: Vec<GsoRun> = Vec::new();
    for (to, range) in datagrams {
        let len = range.len();
        if let Some(run) = runs.last_mut() {
            let last_full = run.bytes.len() == run.segment * run.count;
            let joins = run.to == *to
                && run.bytes.end == range.start
                && last_full
                && len <= run.segment
                && run.count < max_segments
                && run.bytes.len() + len <= max_bytes;
            if joins {
                run.bytes.end = range.end;
                run.count += 1;
                continue;
            }
        }
        runs.push(GsoRun {
            to: *to,
            bytes: range.clone(),
            segment: len,
            count: 1,
        });
    }
    runs
}

/// The datagrams of a GRO receive: `buf` cut every `segment` bytes (the last one may
/// be shorter). Without a segment size (0), the whole buffer is one datagram, an empty
/// one included (it is counted as invalid, not lost).
pub fn gro_segments(buf: &[u8], segment: usize) -> impl Iterator<Item = &[u8]> {
    let size = if segment == 0 { buf.len() } else { segment };
    buf.chunks(size.max(1)).chain(buf.is_empty().then_some(buf))
}

/// What a GSO send's error says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GsoFailure {
    /// This message could not be segmented: send its datagrams one by one.
    Message,
    /// The route cannot segment: send one by one, and stop using GSO for a while.
    Route,
}

/// The meaning of `error` from a send with a GSO segment size (`None`: not about
/// GSO, the message is lost as any failed send is).
pub fn gso_failure(error: Errno) -> Option<GsoFailure> {
    match error {
        // The kernel's UDP GSO checks of one message: a segment larger than the
        // route's MTU, more than its segment limit.
        Errno::EINVAL => Some(GsoFailure::Message),
        // The route's device cannot checksum for us (or it is an IPsec route), or the
        // kernel has no UDP_SEGMENT at all.
        Errno::EIO | Errno::ENOPROTOOPT | Errno::EOPNOTSUPP => Some(GsoFailure::Route),
        _ => None,
    }
}

/// How long GSO stays off after a route refused it, before it is tried again.
pub const GSO_REPROBE: Duration = Duration::from_secs(300);

/// Whether sends use UDP GSO: on until a route refuses it, then off for
/// [`GSO_REPROBE`], then tried again.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GsoSwitch {
    off_since: Option<Instant>,
}

impl GsoSwitch {
    /// Whether to use GSO at `now`, and whether this call turned it back on.
    pub fn enabled(&mut self, now: Instant) -> (bool, bool) {
        match self.off_since {
            None => (true, false),
            Some(t) if now.saturating_duration_since(t) >= GSO_REPROBE => {
                self.off_since = None;
                (true, true)
            }
            Some(_) => (false, false),
        }
    }

    /// Records a failed GSO send; returns true when it turned GSO off.
    pub fn failed(&mut self, failure: GsoFailure, now: Instant) -> bool {
        if failure != GsoFailure::Route || self.off_since.is_some() {
            return false;
        }
        self.off_since = Some(now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([192, 0, 2, 1], port))
    }

    /// An outbox holding datagrams of `sizes` to `addr(ports[i])`.
    fn outbox(items: &[(u16, usize)]) -> Outbox {
        let mut out = Outbox::default();
        for (i, (port, size)) in items.iter().enumerate() {
            out.send(addr(*port), &vec![i as u8; *size]);
        }
        out
    }

    fn shape(runs: &[GsoRun]) -> Vec<(u16, usize, usize)> {
        runs.iter()
            .map(|r| (r.to.port(), r.segment, r.count))
            .collect()
    }

    #[test]
    fn equal_datagrams_to_one_address_make_one_run_ended_by_a_shorter_one() {
        let out = outbox(&[(1, 100), (1, 100), (1, 40), (1, 100)]);
        let runs = gso_runs(out.datagrams(), 64, 65_000);
        assert_eq!(shape(&runs), vec![(1, 100, 3), (1, 100, 1)]);
        assert_eq!(runs[0].bytes, 0..240);
        // Cut back at the segment size, the run gives the datagrams back in order.
        let back: Vec<&[u8]> = gro_segments(&out.bytes()[runs[0].bytes.clone()], 100).collect();
        assert_eq!(back.len(), 3);
        assert_eq!(back[2], &[2u8; 40][..]);
    }

    #[test]
    fn runs_break_on_a_new_address_a_longer_datagram_and_the_limits() {
        let out = outbox(&[(1, 100), (2, 100), (2, 200), (2, 200), (2, 200)]);
        let runs = gso_runs(out.datagrams(), 2, 65_000);
        assert_eq!(
            shape(&runs),
            vec![(1, 100, 1), (2, 100, 1), (2, 200, 2), (2, 200, 1)]
        );
        let runs = gso_runs(out.datagrams(), 64, 450);
        assert_eq!(
            shape(&runs),
            vec![(1, 100, 1), (2, 100, 1), (2, 200, 2), (2, 200, 1)]
        );
    }

    #[test]
    fn tun_packets_between_datagrams_keep_them_in_one_run() {
        let mut out = Outbox::default();
        out.send(addr(1), &[1; 10]);
        out.write_tun(&[9; 5]);
        out.send(addr(1), &[2; 10]);
        let runs = gso_runs(out.datagrams(), 64, 65_000);
        assert_eq!(shape(&runs), vec![(1, 10, 2)]);
        assert_eq!(out.packets().collect::<Vec<_>>(), vec![&[9u8; 5][..]]);
        out.clear();
        assert!(out.is_empty() && out.bytes().is_empty());
    }

    #[test]
    fn a_gro_buffer_without_a_segment_size_is_one_datagram() {
        assert_eq!(gro_segments(&[1, 2, 3], 0).count(), 1);
        // An empty datagram is one (invalid) datagram, not none.
        assert_eq!(
            gro_segments(&[], 0).collect::<Vec<_>>(),
            vec![&[0u8; 0][..]]
        );
        let cut: Vec<&[u8]> = gro_segments(&[1, 2, 3, 4, 5], 2).collect();
        assert_eq!(cut, vec![&[1, 2][..], &[3, 4][..], &[5][..]]);
    }

    /// One message the kernel cannot segment (EINVAL: a segment over the route's
    /// MTU, too many segments) is sent datagram by datagram and GSO stays on; a route
    /// that cannot segment at all (EIO: no checksum offload; no UDP_SEGMENT) turns it
    /// off, and it is tried again after a while.
    #[test]
    fn one_bad_message_keeps_gso_and_a_route_that_cannot_gets_a_reprobe() {
        assert_eq!(gso_failure(Errno::EINVAL), Some(GsoFailure::Message));
        for e in [Errno::EIO, Errno::ENOPROTOOPT, Errno::EOPNOTSUPP] {
            assert_eq!(gso_failure(e), Some(GsoFailure::Route), "{e}");
        }
        assert_eq!(gso_failure(Errno::ENETUNREACH), None);

        let t0 = Instant::now();
        let mut gso = GsoSwitch::default();
        assert!(!gso.failed(GsoFailure::Message, t0));
        assert_eq!(gso.enabled(t0), (true, false));
        assert!(gso.failed(GsoFailure::Route, t0), "turned off: logged");
        assert!(!gso.failed(GsoFailure::Route, t0), "already off: not again");
        assert_eq!(gso.enabled(t0 + GSO_REPROBE / 2), (false, false));
        assert_eq!(gso.enabled(t0 + GSO_REPROBE), (true, true), "re-probed");
        assert_eq!(gso.enabled(t0 + GSO_REPROBE), (true, false));
        assert!(gso.failed(GsoFailure::Route, t0 + GSO_REPROBE));
    }
}
