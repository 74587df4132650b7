//! GRO for the TUN, sans-IO: of one batch's decrypted packets, consecutive TCP segments
//! of one flow are merged into one super-packet (up to 64 KiB) written with a
//! `virtio_net_hdr` of `GSO_TCPV4`/`GSO_TCPV6`, so the receiving kernel runs its stack
//! (and acknowledges) once per super-packet instead of once per 1,420 bytes. Where the
//! kernel has USO, equal-sized UDP datagrams of one flow are merged the same way into
//! a `GSO_UDP_L4` write (up to 64 datagrams). Anything else is written as one plain
//! packet.
//!
//! A segment joins its flow's run only where the kernel's own GRO would merge it and
//! where cutting the super-packet again (`offload::split`, or the kernel's GSO when
//! the packet is forwarded) gives back the same segments: IPv4 without options or
//! fragmentation and with the id increasing by one, IPv6 without extension headers,
//! every IP and TCP header field equal apart from lengths, ids, sequence numbers,
//! checksums and PSH, only ACK (and PSH on the last) set, the sequence contiguous, and
//! every payload the size of the first (a shorter one, or PSH, ends the run); for UDP
//! the same IP rules, and every datagram the size of the first but the last. Packets
//! of one flow keep their order; packets of different flows may pass each other.

use std::ops::Range;

use super::offload::{
    finish, fold, ones_sum, VnetHdr, F_DATA_VALID, F_NEEDS_CSUM, GSO_TCPV4, GSO_TCPV6, GSO_UDP_L4,
    VNET_HDR_LEN,
};

const TCP: u8 = 6;
const UDP: u8 = 17;
const TCP_PSH: u8 = 0x08;
const TCP_ACK: u8 = 0x10;
/// The largest super-packet: what an IPv4 total length can describe.
const MAX_SUPER_PACKET: usize = 65_535;
/// How many recent TCP runs a segment is matched against (the kernel's GRO keeps
/// eight per bucket): enough for the flows interleaved in a batch, bounded work when
/// a batch holds many flows.
const OPEN_RUNS: usize = 8;
/// Most datagrams in one UDP super-packet: the kernel's `UDP_MAX_SEGMENTS` on older
/// kernels (newer ones take 128).
const MAX_UDP_SEGMENTS: usize = 64;

/// A TCP segment's (or UDP datagram's) fields that decide whether it joins a run.
#[derive(Debug, Clone, Copy)]
struct Segment {
    v4: bool,
    /// A UDP datagram (`seq` and `flags` are then 0).
    udp: bool,
    ip_len: usize,
    /// IP and TCP (or UDP) headers.
    hdr_len: usize,
    payload: usize,
    seq: u32,
    id: u16,
    flags: u8,
}

/// `packet` as a segment that may be coalesced (a UDP datagram only when `udp`), or
/// `None` (anything else is written alone).
fn parse_segment(p: &[u8], udp: bool) -> Option<Segment> {
    let wanted = |proto: u8| proto == TCP || (udp && proto == UDP);
    let (v4, ip_len, proto) = match p.first()? >> 4 {
        4 if p.len() >= 20
            && p[0] == 0x45
            && wanted(p[9])
            && usize::from(u16::from_be_bytes([p[2], p[3]])) == p.len()
            // Neither more fragments nor an offset; DF is compared between segments.
            && u16::from_be_bytes([p[6], p[7]]) & 0x3fff == 0 =>
        {
            (true, 20, p[9])
        }
        6 if p.len() >= 40
            && wanted(p[6])
            && usize::from(u16::from_be_bytes([p[4], p[5]])) + 40 == p.len() =>
        {
            (false, 40, p[6])
        }
        _ => return None,
    };
    let id = u16::from_be_bytes([p[4], p[5]]);
    if proto == UDP {
        let udp_len = u16::from_be_bytes([*p.get(ip_len + 4)?, *p.get(ip_len + 5)?]);
        if p.len() <= ip_len + 8 || usize::from(udp_len) != p.len() - ip_len {
            return None;
        }
        return Some(Segment {
            v4,
            udp: true,
            ip_len,
            hdr_len: ip_len + 8,
            payload: p.len() - ip_len - 8,
            seq: 0,
            id,
            flags: 0,
        });
    }
    // The peer chose every byte after its address: a packet may end anywhere.
    let t = p.get(ip_len..ip_len + 20)?;
    let tcp_len = usize::from(t[12] >> 4) * 4;
    let hdr_len = ip_len + tcp_len;
    let flags = t[13];
    if tcp_len < 20 || p.len() <= hdr_len || flags & !TCP_PSH != TCP_ACK {
        return None;
    }
    Some(Segment {
        v4,
        udp: false,
        ip_len,
        hdr_len,
        payload: p.len() - hdr_len,
        seq: u32::from_be_bytes([t[4], t[5], t[6], t[7]]),
        id,
        flags,
    })
}

/// The byte ranges of a segment's headers that must be equal in every segment of a
/// run: IPv4 version to TOS, DF to addresses apart from the checksum; IPv6 all but the
/// payload length; TCP ports, acknowledgement, header length, window, urgent pointer
/// and options (timestamps included, as the kernel's GRO requires). UDP has nothing
/// beyond its ports to compare.
fn same_headers(a: &[u8], sa: &Segment, b: &[u8], sb: &Segment) -> bool {
    if sa.v4 != sb.v4 || sa.udp != sb.udp || sa.hdr_len != sb.hdr_len {
        return false;
    }
    let ip: &[Range<usize>] = if sa.v4 {
        &[0..2, 6..10, 12..20]
    } else {
        &[0..4, 6..40]
    };
    let t = sa.ip_len;
    let tcp = [t..t + 4, t + 8..t + 13, t + 14..t + 16, t + 18..sa.hdr_len];
    let tcp: &[Range<usize>] = if sa.udp { &[] } else { &tcp };
    ip.iter().chain(tcp).all(|r| a[r.clone()] == b[r.clone()])
}

/// Whether `a` and `b` belong to the same flow (addresses and ports).
fn same_flow(a: &[u8], sa: &Segment, b: &[u8], sb: &Segment) -> bool {
    let addrs = if sa.v4 { 12..20 } else { 8..40 };
    sa.v4 == sb.v4
        && sa.udp == sb.udp
        && a[addrs.clone()] == b[addrs]
        && a[sa.ip_len..sa.ip_len + 4] == b[sb.ip_len..sb.ip_len + 4]
}

/// Packets written as one: the first and last packet's index in the batch (the
/// others are chained through `Coalescer::next`), and what the next segment must match.
#[derive(Debug, Clone, Copy)]
struct Run {
    first: usize,
    last: usize,
    /// The last packet as a segment (`None`: a packet that is never coalesced).
    tail: Option<Segment>,
    /// Packets in the run.
    count: usize,
    /// The first segment's payload size: the run's `gso_size`.
    size: usize,
    /// The super-packet's length so far.
    len: usize,
    /// A shorter segment or PSH ended it.
    closed: bool,
}

/// Turns one batch's packets into TUN writes, each a `virtio_net_hdr` and a packet or
/// a TCP super-packet; the buffers are kept from batch to batch.
#[derive(Debug, Default)]
pub struct Coalescer {
    bytes: Vec<u8>,
    writes: Vec<Range<usize>>,
    runs: Vec<Run>,
    /// Per packet, the next packet of its run.
    next: Vec<Option<usize>>,
    /// Indices in `runs` of the recent TCP runs, newest last.
    open: Vec<usize>,
}

impl Coalescer {
    /// Replaces the writes with those for `packets` (in the order they were produced);
    /// UDP datagrams are merged only when `udp` (the kernel has USO).
    pub fn coalesce(&mut self, packets: &[&[u8]], udp: bool) {
        self.bytes.clear();
        self.writes.clear();
        self.runs.clear();
        self.open.clear();
        self.next.clear();
        self.next.resize(packets.len(), None);
        for (i, packet) in packets.iter().enumerate() {
            let seg = parse_segment(packet, udp);
            if let Some(seg) = seg {
                if self.join(packets, i, &seg) {
                    continue;
                }
            }
            self.runs.push(Run {
                first: i,
                last: i,
                tail: seg,
                count: 1,
                size: seg.map_or(0, |s| s.payload),
                len: packet.len(),
                closed: seg.is_none_or(|s| s.flags & TCP_PSH != 0),
            });
            if seg.is_some() {
                if self.open.len() == OPEN_RUNS {
                    self.open.remove(0);
                }
                self.open.push(self.runs.len() - 1);
            }
        }
        for r in 0..self.runs.len() {
            self.emit(packets, self.runs[r]);
        }
    }

    /// Appends segment `i` to the newest open run of its flow if it fits there; false
    /// when it must start a run of its own (which then replaces the flow's run).
    fn join(&mut self, packets: &[&[u8]], i: usize, seg: &Segment) -> bool {
        let packet = packets[i];
        let Some(pos) = self.open.iter().rposition(|&r| {
            let run = &self.runs[r];
            run.tail
                .is_some_and(|t| same_flow(packets[run.last], &t, packet, seg))
        }) else {
            return false;
        };
        let r = self.open[pos];
        let run = self.runs[r];
        let Some(tail) = run.tail else {
            return false;
        };
        let fits = !run.closed
            && seg.payload <= run.size
            && (seg.udp || seg.seq == tail.seq.wrapping_add(tail.payload as u32))
            && (!seg.udp || run.count < MAX_UDP_SEGMENTS)
            && (!seg.v4 || seg.id == tail.id.wrapping_add(1))
            && run.len + seg.payload <= MAX_SUPER_PACKET
            && same_headers(packets[run.last], &tail, packet, seg);
        if !fits {
            // The flow goes on in a new run; this one takes no more.
            self.open.remove(pos);
            return false;
        }
        let short = seg.payload < run.size;
        self.next[run.last] = Some(i);
        self.runs[r] = Run {
            last: i,
            tail: Some(*seg),
            count: run.count + 1,
            len: run.len + seg.payload,
            closed: short || seg.flags & TCP_PSH != 0,
            ..run
        };
        true
    }

    /// Appends the write for `run`.
    fn emit(&mut self, packets: &[&[u8]], run: Run) {
        let start = self.bytes.len();
        let first = packets[run.first];
        let (Some(tail), true) = (run.tail, run.count > 1) else {
            let hdr = VnetHdr {
                flags: F_DATA_VALID,
                ..VnetHdr::default()
            };
            self.bytes.extend_from_slice(&hdr.to_bytes());
            self.bytes.extend_from_slice(first);
            self.writes.push(start..self.bytes.len());
            return;
        };
        let (ip_len, hdr_len) = (tail.ip_len, tail.hdr_len);
        let (gso_type, proto, csum_offset) = match (tail.udp, tail.v4) {
            (true, _) => (GSO_UDP_L4, UDP, 6),
            (false, true) => (GSO_TCPV4, TCP, 16),
            (false, false) => (GSO_TCPV6, TCP, 16),
        };
        let hdr = VnetHdr {
            flags: F_NEEDS_CSUM,
            gso_type,
            hdr_len: hdr_len as u16,
            gso_size: run.size as u16,
            csum_start: ip_len as u16,
            csum_offset: csum_offset as u16,
        };
        self.bytes.extend_from_slice(&hdr.to_bytes());
        self.bytes.extend_from_slice(first);
        let mut i = run.first;
        while let Some(n) = self.next[i] {
            self.bytes.extend_from_slice(&packets[n][hdr_len..]);
            i = n;
        }
        let p = &mut self.bytes[start + VNET_HDR_LEN..];
        let total = p.len();
        if tail.v4 {
            p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
            p[10..12].fill(0);
            let sum = finish(ones_sum(&p[..20], 0));
            p[10..12].copy_from_slice(&sum.to_be_bytes());
        } else {
            p[4..6].copy_from_slice(&((total - 40) as u16).to_be_bytes());
        }
        if tail.udp {
            p[ip_len + 4..ip_len + 6].copy_from_slice(&((total - ip_len) as u16).to_be_bytes());
        } else {
            // PSH as the last segment had it.
            p[ip_len + 13] = tail.flags;
        }
        // The checksum field holds the pseudo-header's sum, which the kernel (or
        // `offload::split`) completes over the rest.
        let addrs = if tail.v4 { &p[12..20] } else { &p[8..40] };
        let pseudo = fold(ones_sum(addrs, u64::from(proto) + (total - ip_len) as u64));
        let at = ip_len + csum_offset;
        p[at..at + 2].copy_from_slice(&pseudo.to_be_bytes());
        self.writes.push(start..self.bytes.len());
    }

    /// The writes, each a `virtio_net_hdr` and a packet, in order.
    pub fn writes(&self) -> impl Iterator<Item = &[u8]> {
        self.writes.iter().map(|r| &self.bytes[r.clone()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::userspace_wireguard::offload::{split, GSO_NONE};

    /// A TCP segment with valid checksums: IPv4 (id `id`, DF) or IPv6, from port
    /// `sport`, sequence `seq`, `flags`, with a timestamp option and `payload` bytes.
    fn segment(v4: bool, sport: u16, seq: u32, id: u16, flags: u8, payload: usize) -> Vec<u8> {
        let mut p = if v4 {
            let mut h = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, TCP, 0, 0];
            h[4..6].copy_from_slice(&id.to_be_bytes());
            h.extend_from_slice(&[10, 0, 0, 1, 10, 0, 0, 2]);
            h
        } else {
            let mut h = vec![0x60, 0, 0, 0, 0, 0, TCP, 64];
            h.extend_from_slice(&[0xfd; 16]);
            h.extend_from_slice(&[0xfe; 16]);
            h
        };
        let ip_len = p.len();
        p.extend_from_slice(&sport.to_be_bytes());
        p.extend_from_slice(&5201u16.to_be_bytes());
        p.extend_from_slice(&seq.to_be_bytes());
        p.extend_from_slice(&7u32.to_be_bytes());
        p.extend_from_slice(&[8 << 4, flags, 0x01, 0xf5, 0, 0, 0, 0]);
        // NOP, NOP, timestamps.
        p.extend_from_slice(&[1, 1, 8, 10, 0, 0, 0, 9, 0, 0, 0, 3]);
        p.extend((0..payload).map(|i| (seq as usize + i) as u8));
        let total = p.len();
        if v4 {
            p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
            let sum = finish(ones_sum(&p[..20], 0));
            p[10..12].copy_from_slice(&sum.to_be_bytes());
        } else {
            p[4..6].copy_from_slice(&((total - 40) as u16).to_be_bytes());
        }
        let addrs = if v4 { &p[12..20] } else { &p[8..40] };
        let pseudo = ones_sum(addrs, u64::from(TCP) + (total - ip_len) as u64);
        let sum = finish(ones_sum(&p[ip_len..], pseudo));
        p[ip_len + 16..ip_len + 18].copy_from_slice(&sum.to_be_bytes());
        p
    }

    /// `n` contiguous segments of `size` bytes of one flow, PSH on the last.
    fn flow(v4: bool, sport: u16, n: usize, size: usize) -> Vec<Vec<u8>> {
        (0..n)
            .map(|i| {
                let psh = if i + 1 == n { TCP_PSH } else { 0 };
                let seq = 0xffff_f000u32.wrapping_add((i * size) as u32);
                segment(v4, sport, seq, 100 + i as u16, TCP_ACK | psh, size)
            })
            .collect()
    }

    fn coalesce(packets: &[Vec<u8>]) -> Vec<Vec<u8>> {
        coalesce_with(packets, true)
    }

    fn coalesce_with(packets: &[Vec<u8>], udp: bool) -> Vec<Vec<u8>> {
        let refs: Vec<&[u8]> = packets.iter().map(Vec::as_slice).collect();
        let mut c = Coalescer::default();
        c.coalesce(&refs, udp);
        c.writes().map(<[u8]>::to_vec).collect()
    }

    /// A UDP datagram with a valid checksum: IPv4 (id `id`) or IPv6, from port `sport`,
    /// `payload` bytes.
    fn datagram(v4: bool, sport: u16, id: u16, payload: usize) -> Vec<u8> {
        let mut p = segment(v4, sport, 0, id, TCP_ACK, payload);
        let ip_len = if v4 { 20 } else { 40 };
        p.drain(ip_len + 8..ip_len + 32);
        let total = p.len();
        if v4 {
            p[9] = UDP;
            p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
            p[10..12].fill(0);
            let sum = finish(ones_sum(&p[..20], 0));
            p[10..12].copy_from_slice(&sum.to_be_bytes());
        } else {
            p[6] = UDP;
            p[4..6].copy_from_slice(&((total - 40) as u16).to_be_bytes());
        }
        let udp_len = total - ip_len;
        p[ip_len + 4..ip_len + 6].copy_from_slice(&(udp_len as u16).to_be_bytes());
        p[ip_len + 6..ip_len + 8].fill(0);
        let addrs = if v4 { &p[12..20] } else { &p[8..40] };
        let pseudo = ones_sum(addrs, u64::from(UDP) + udp_len as u64);
        let sum = match finish(ones_sum(&p[ip_len..], pseudo)) {
            0 => 0xffff,
            sum => sum,
        };
        p[ip_len + 6..ip_len + 8].copy_from_slice(&sum.to_be_bytes());
        p
    }

    /// What the kernel would deliver for `writes`: each cut back into packets.
    fn resplit(writes: &[Vec<u8>]) -> Vec<Vec<u8>> {
        let (mut out, mut ranges) = (Vec::new(), Vec::new());
        for w in writes {
            let hdr = VnetHdr::parse(w).unwrap();
            split(&hdr, &w[VNET_HDR_LEN..], &mut out, &mut ranges).unwrap();
        }
        ranges.into_iter().map(|r| out[r].to_vec()).collect()
    }

    fn gso_types(writes: &[Vec<u8>]) -> Vec<u8> {
        writes.iter().map(|w| w[1]).collect()
    }

    #[test]
    fn a_flow_of_segments_becomes_one_super_packet_that_splits_back_byte_for_byte() {
        for (v4, gso) in [(true, GSO_TCPV4), (false, GSO_TCPV6)] {
            let packets = flow(v4, 40000, 20, 1368);
            let writes = coalesce(&packets);
            assert_eq!(gso_types(&writes), vec![gso]);
            let hdr = VnetHdr::parse(&writes[0]).unwrap();
            let ip_len = if v4 { 20 } else { 40 };
            assert_eq!(
                (hdr.flags, hdr.gso_size, hdr.hdr_len, hdr.csum_start),
                (F_NEEDS_CSUM, 1368, ip_len + 32, ip_len)
            );
            assert_eq!(
                writes[0].len(),
                VNET_HDR_LEN + ip_len as usize + 32 + 20 * 1368
            );
            assert_eq!(resplit(&writes), packets);
        }
    }

    #[test]
    fn the_checksum_field_holds_the_pseudo_header_sum_the_kernel_completes() {
        for v4 in [true, false] {
            let writes = coalesce(&flow(v4, 40000, 5, 1000));
            let super_packet = &writes[0][VNET_HDR_LEN..];
            // Finished as a partial checksum, the whole TCP segment must check.
            let partial = VnetHdr {
                gso_type: GSO_NONE,
                ..VnetHdr::parse(&writes[0]).unwrap()
            };
            let whole = resplit(&[[&partial.to_bytes()[..], super_packet].concat()]);
            let ip_len = if v4 { 20 } else { 40 };
            let p = &whole[0];
            let addrs = if v4 { &p[12..20] } else { &p[8..40] };
            let pseudo = ones_sum(addrs, u64::from(TCP) + (p.len() - ip_len) as u64);
            assert_eq!(finish(ones_sum(&p[ip_len..], pseudo)), 0);
            if v4 {
                assert_eq!(finish(ones_sum(&p[..20], 0)), 0, "IPv4 header");
            }
        }
    }

    #[test]
    fn a_gap_a_flag_change_or_a_shorter_segment_ends_a_run() {
        let mut gap = flow(true, 40000, 4, 1000);
        gap.remove(2);
        // The id is still one more than the last one's: only the sequence jumps.
        gap[2] = segment(
            true,
            40000,
            0xffff_f000 + 3000,
            102,
            TCP_ACK | TCP_PSH,
            1000,
        );
        assert_eq!(gso_types(&coalesce(&gap)), vec![GSO_TCPV4, GSO_NONE]);
        assert_eq!(resplit(&coalesce(&gap)), gap);

        let mut psh = flow(true, 40000, 4, 1000);
        psh[1] = segment(
            true,
            40000,
            0xffff_f000 + 1000,
            101,
            TCP_ACK | TCP_PSH,
            1000,
        );
        assert_eq!(gso_types(&coalesce(&psh)), vec![GSO_TCPV4, GSO_TCPV4]);
        assert_eq!(resplit(&coalesce(&psh)), psh);

        let mut fin = flow(false, 40000, 3, 1000);
        fin[1] = segment(false, 40000, 0xffff_f000 + 1000, 0, TCP_ACK | 0x01, 1000);
        assert_eq!(gso_types(&coalesce(&fin)), vec![0, 0, 0]);

        let mut short = flow(true, 40000, 4, 1000);
        short[2] = segment(true, 40000, 0xffff_f000 + 2000, 102, TCP_ACK, 500);
        short[3] = segment(true, 40000, 0xffff_f000 + 2500, 103, TCP_ACK, 1000);
        let writes = coalesce(&short);
        assert_eq!(gso_types(&writes), vec![GSO_TCPV4, GSO_NONE]);
        assert_eq!(
            writes[0].len(),
            VNET_HDR_LEN + 52 + 2500,
            "the short one ends it"
        );
        assert_eq!(resplit(&writes), short);
    }

    #[test]
    fn headers_that_differ_are_not_merged() {
        let base = flow(true, 40000, 2, 1000);
        let changes: [(usize, u8); 5] = [(1, 0x04), (8, 63), (5, 0x77), (35, 0x05), (47, 4)];
        for (at, value) in changes {
            let mut packets = base.clone();
            // TOS, TTL, the id, the window, the timestamp.
            packets[1][at] = value;
            assert_eq!(gso_types(&coalesce(&packets)), vec![0, 0], "byte {at}");
        }
        let mut frag = base;
        frag[1][6] = 0x20;
        assert_eq!(gso_types(&coalesce(&frag)), vec![0, 0], "more fragments");
    }

    #[test]
    fn interleaved_flows_coalesce_each_in_order_and_others_pass_through() {
        let a = flow(true, 40000, 3, 1000);
        let b = flow(false, 40001, 3, 1200);
        let udp = vec![
            0x45, 0, 0, 28, 0, 0, 0, 0, 64, 17, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8,
        ];
        let ack = segment(true, 40002, 5, 1, TCP_ACK, 0);
        let packets = vec![
            a[0].clone(),
            b[0].clone(),
            udp.clone(),
            a[1].clone(),
            ack.clone(),
            b[1].clone(),
            a[2].clone(),
            b[2].clone(),
        ];
        let writes = coalesce(&packets);
        assert_eq!(gso_types(&writes), vec![GSO_TCPV4, GSO_TCPV6, 0, 0]);
        assert_eq!(writes[2][0], F_DATA_VALID);
        assert_eq!(writes[2][VNET_HDR_LEN..], udp[..]);
        let expected: Vec<Vec<u8>> = [a, b, vec![udp, ack]].concat();
        assert_eq!(resplit(&writes), expected);
    }

    #[test]
    fn a_super_packet_stays_within_64_kib() {
        let packets = flow(true, 40000, 100, 1368);
        let writes = coalesce(&packets);
        assert_eq!(writes.len(), 3);
        assert!(writes
            .iter()
            .all(|w| w.len() - VNET_HDR_LEN <= MAX_SUPER_PACKET));
        assert_eq!(resplit(&writes), packets);
    }

    #[test]
    fn equal_udp_datagrams_of_a_flow_coalesce_where_the_kernel_has_uso() {
        for v4 in [true, false] {
            let mut packets: Vec<Vec<u8>> =
                (0..100).map(|i| datagram(v4, 40000, 7 + i, 800)).collect();
            packets.push(datagram(v4, 40000, 107, 300));
            packets.push(datagram(v4, 40000, 108, 800));
            let writes = coalesce(&packets);
            // 64 at most, then the rest up to the short one, then the last alone.
            assert_eq!(gso_types(&writes), vec![GSO_UDP_L4, GSO_UDP_L4, GSO_NONE]);
            let hdr = VnetHdr::parse(&writes[0]).unwrap();
            assert_eq!((hdr.gso_size, hdr.csum_offset), (800, 6));
            assert_eq!(
                writes[0].len(),
                VNET_HDR_LEN + hdr.hdr_len as usize + 64 * 800
            );
            assert_eq!(resplit(&writes), packets);
            let plain = coalesce_with(&packets, false);
            assert_eq!(plain.len(), packets.len(), "without USO, one write each");
            assert!(plain.iter().all(|w| w[1] == GSO_NONE));
        }
    }

    /// `p` cut to `len` bytes, its IP length field saying so.
    fn truncated(mut p: Vec<u8>, len: usize) -> Vec<u8> {
        p.truncate(len);
        if p[0] >> 4 == 4 {
            p[2..4].copy_from_slice(&(len as u16).to_be_bytes());
        } else {
            p[4..6].copy_from_slice(&((len - 40) as u16).to_be_bytes());
        }
        p
    }

    /// A peer decides every byte after its source address: a TCP or UDP packet cut
    /// anywhere inside its transport header (33 bytes of IPv4 and 53 of IPv6 left the
    /// TCP flags byte out and panicked the receive thread) is written as it came,
    /// alone or amid a flow, and nothing panics.
    #[test]
    fn packets_cut_inside_their_transport_header_are_written_as_they_came() {
        for v4 in [true, false] {
            let ip_len = if v4 { 20 } else { 40 };
            let flow = flow(v4, 40000, 2, 1000);
            for proto in [TCP, UDP] {
                for len in ip_len..=ip_len + 33 {
                    let mut short = truncated(flow[0].clone(), len);
                    short[if v4 { 9 } else { 6 }] = proto;
                    let packets = vec![flow[0].clone(), short.clone(), flow[1].clone()];
                    for udp in [false, true] {
                        let alone = coalesce_with(std::slice::from_ref(&short), udp);
                        assert_eq!(resplit(&alone), vec![short.clone()], "{len} bytes");
                        // The flow's segments may pass the packet that is not one.
                        let mut back = resplit(&coalesce_with(&packets, udp));
                        let mut want = packets.clone();
                        back.sort();
                        want.sort();
                        assert_eq!(back, want, "{len} bytes amid a flow");
                    }
                }
            }
        }
    }

    #[test]
    fn udp_and_tcp_of_the_same_ports_stay_apart() {
        let tcp = flow(true, 40000, 2, 1000);
        let udp = [
            datagram(true, 40000, 1, 1000),
            datagram(true, 40000, 2, 1000),
        ];
        let packets = vec![
            tcp[0].clone(),
            udp[0].clone(),
            tcp[1].clone(),
            udp[1].clone(),
        ];
        let writes = coalesce(&packets);
        assert_eq!(gso_types(&writes), vec![GSO_TCPV4, GSO_UDP_L4]);
    }
}
