//! TUN offloads, sans-IO. With `IFF_VNET_HDR` and `TUNSETOFFLOAD` the kernel hands the
//! device TCP super-packets of up to 64 KiB (and, on kernels with USO, UDP ones), each
//! after a `virtio_net_hdr`, and may leave a packet's transport checksum for the
//! device to finish. Before sealing, every packet is made whole here: a super-packet
//! is cut into MTU-sized TCP segments (each with its own IP length, IPv4 id and header
//! checksum, TCP sequence number, flags and checksum) or UDP datagrams (IP length, id
//! and header checksum, UDP length and checksum), and a partial checksum is completed.

use std::ops::Range;

/// The size of the `virtio_net_hdr` before each packet.
pub const VNET_HDR_LEN: usize = 10;
/// `flags`: the checksum from `csum_start` on is partial and must be finished.
pub const F_NEEDS_CSUM: u8 = 1;
/// `flags`: the checksums are known good (the packet was authenticated).
pub const F_DATA_VALID: u8 = 2;
/// `gso_type`: one plain packet.
pub const GSO_NONE: u8 = 0;
/// `gso_type`: a TCP over IPv4 super-packet.
pub const GSO_TCPV4: u8 = 1;
/// `gso_type`: a TCP over IPv6 super-packet.
pub const GSO_TCPV6: u8 = 4;
/// `gso_type`: a UDP super-packet (USO), IPv4 or IPv6: datagrams of `gso_size` payload
/// bytes (the last may be shorter) behind one IP and UDP header.
pub const GSO_UDP_L4: u8 = 5;
/// `gso_type` bit: the super-packet carries ECN (CWR stays on the first segment).
pub const GSO_ECN: u8 = 0x80;

const TCP: u8 = 6;
const UDP: u8 = 17;
const TCP_FIN: u8 = 0x01;
const TCP_PSH: u8 = 0x08;
const TCP_CWR: u8 = 0x80;

/// The header the kernel puts before (and expects before) each TUN packet, in the
/// host's byte order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VnetHdr {
    /// `F_NEEDS_CSUM`, `F_DATA_VALID`.
    pub flags: u8,
    /// `GSO_NONE`, `GSO_TCPV4`, `GSO_TCPV6`, possibly with `GSO_ECN`.
    pub gso_type: u8,
    /// The length of the headers (IP and TCP) of a super-packet.
    pub hdr_len: u16,
    /// The payload bytes in each segment of a super-packet.
    pub gso_size: u16,
    /// Where the checksummed region starts.
    pub csum_start: u16,
    /// Where, after `csum_start`, the checksum field is.
    pub csum_offset: u16,
}

impl VnetHdr {
    /// Reads the header at the start of `buf`.
    pub fn parse(buf: &[u8]) -> Option<Self> {
        let b = buf.get(..VNET_HDR_LEN)?;
        let u16_at = |i: usize| u16::from_ne_bytes([b[i], b[i + 1]]);
        Some(Self {
            flags: b[0],
            gso_type: b[1],
            hdr_len: u16_at(2),
            gso_size: u16_at(4),
            csum_start: u16_at(6),
            csum_offset: u16_at(8),
        })
    }

    /// The header as the kernel reads it.
    pub fn to_bytes(self) -> [u8; VNET_HDR_LEN] {
        let mut b = [0u8; VNET_HDR_LEN];
        b[0] = self.flags;
        b[1] = self.gso_type;
        b[2..4].copy_from_slice(&self.hdr_len.to_ne_bytes());
        b[4..6].copy_from_slice(&self.gso_size.to_ne_bytes());
        b[6..8].copy_from_slice(&self.csum_start.to_ne_bytes());
        b[8..10].copy_from_slice(&self.csum_offset.to_ne_bytes());
        b
    }
}

/// Why a packet from the TUN was dropped instead of split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OffloadError {
    /// A GSO type other than TCP or UDP (never enabled by the device).
    #[error("unsupported GSO type {0}")]
    UnsupportedGso(u8),
    /// The headers do not describe the packet (lengths, version, protocol).
    #[error("malformed packet")]
    Malformed,
}

/// The one's-complement sum of `data` as big-endian 16-bit words (an odd last byte is
/// padded with zero), added to `sum`; not folded.
///
/// This runs over every byte the device sends, and the device is also run as a debug
/// build: it sums aligned 64-bit words four at a time in the host's byte order (the
/// one's-complement sum is byte-order independent, RFC 1071) instead of going byte
/// pair by byte pair, which is ten times faster unoptimised.
pub fn ones_sum(data: &[u8], sum: u64) -> u64 {
    #[allow(unsafe_code)]
    // SAFETY: every bit pattern is a valid u64; `align_to` only reinterprets the
    // aligned middle of the slice.
    let (head, words, tail) = unsafe { data.align_to::<u64>() };
    let halves = |x: u64| (x >> 32) + (x & 0xffff_ffff);
    let mut wide = 0u64;
    let mut quads = words.chunks_exact(4);
    for q in &mut quads {
        wide += halves(q[0]) + halves(q[1]) + halves(q[2]) + halves(q[3]);
    }
    for w in quads.remainder() {
        wide += halves(*w);
    }
    // Folded to 16 bits in host order, then to big-endian order; swapped once more
    // when the words start at an odd byte of `data`.
    let mut middle = u16::from_be(fold(wide));
    if !head.len().is_multiple_of(2) {
        middle = middle.swap_bytes();
    }
    let sum = sum_bytes(head, 0, sum) + u64::from(middle);
    sum_bytes(tail, head.len() + 8 * words.len(), sum)
}

/// Adds `bytes`, which start at byte `offset` of the summed data, to `sum`.
fn sum_bytes(bytes: &[u8], offset: usize, mut sum: u64) -> u64 {
    for (i, b) in bytes.iter().enumerate() {
        let shift = if (offset + i).is_multiple_of(2) { 8 } else { 0 };
        sum += u64::from(*b) << shift;
    }
    sum
}

/// Folds a sum to 16 bits.
pub fn fold(mut sum: u64) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// Folds a sum to 16 bits and complements it: the Internet checksum.
pub fn finish(sum: u64) -> u16 {
    !fold(sum)
}

/// Splits one packet read from the TUN (after its `hdr`) into whole packets appended
/// to `out`, one range each: a super-packet into segments, a packet with a partial
/// checksum into one packet with the checksum finished, anything else copied as is.
///
/// # Errors
/// An unsupported GSO type or headers that do not match the packet.
pub fn split(
    hdr: &VnetHdr,
    packet: &[u8],
    out: &mut Vec<u8>,
    ranges: &mut Vec<Range<usize>>,
) -> Result<(), OffloadError> {
    match hdr.gso_type & !GSO_ECN {
        GSO_NONE => {
            let start = out.len();
            out.extend_from_slice(packet);
            if hdr.flags & F_NEEDS_CSUM != 0 {
                let (from, at) = (
                    usize::from(hdr.csum_start),
                    usize::from(hdr.csum_start) + usize::from(hdr.csum_offset),
                );
                if at + 2 > packet.len() {
                    out.truncate(start);
                    return Err(OffloadError::Malformed);
                }
                // The field holds the pseudo-header's sum already.
                let sum = finish(ones_sum(&packet[from..], 0));
                out[start + at..start + at + 2].copy_from_slice(&sum.to_be_bytes());
            }
            ranges.push(start..out.len());
            Ok(())
        }
        GSO_TCPV4 | GSO_TCPV6 => segment_tcp(hdr, packet, out, ranges),
        GSO_UDP_L4 => segment_udp(hdr, packet, out, ranges),
        other => Err(OffloadError::UnsupportedGso(other)),
    }
}

/// The IP header length and the TCP header length of `packet`, checked.
fn tcp_headers(packet: &[u8]) -> Result<(usize, usize), OffloadError> {
    let ip_len = match packet.first().map(|b| b >> 4) {
        Some(4) if packet.len() >= 20 && packet[9] == TCP => usize::from(packet[0] & 0x0f) * 4,
        // Extension headers are not expected on a TUN super-packet.
        Some(6) if packet.len() >= 40 && packet[6] == TCP => 40,
        _ => return Err(OffloadError::Malformed),
    };
    let tcp_len = packet
        .get(ip_len + 12)
        .map(|b| usize::from(b >> 4) * 4)
        .ok_or(OffloadError::Malformed)?;
    if ip_len < 20 || tcp_len < 20 || packet.len() < ip_len + tcp_len {
        return Err(OffloadError::Malformed);
    }
    Ok((ip_len, tcp_len))
}

/// Cuts a TCP super-packet into segments of `gso_size` payload bytes.
fn segment_tcp(
    hdr: &VnetHdr,
    packet: &[u8],
    out: &mut Vec<u8>,
    ranges: &mut Vec<Range<usize>>,
) -> Result<(), OffloadError> {
    let (ip_len, tcp_len) = tcp_headers(packet)?;
    let headers = ip_len + tcp_len;
    let mss = usize::from(hdr.gso_size);
    if mss == 0 {
        return Err(OffloadError::Malformed);
    }
    let v4 = packet[0] >> 4 == 4;
    let seq = u32::from_be_bytes([
        packet[ip_len + 4],
        packet[ip_len + 5],
        packet[ip_len + 6],
        packet[ip_len + 7],
    ]);
    let id = u16::from_be_bytes([packet[4], packet[5]]);
    let flags = packet[ip_len + 13];
    let payload = &packet[headers..];
    let count = payload.len().div_ceil(mss).max(1);
    for (i, chunk) in payload
        .chunks(mss)
        .chain(payload.is_empty().then_some(&[][..]))
        .enumerate()
    {
        let start = out.len();
        out.extend_from_slice(&packet[..headers]);
        out.extend_from_slice(chunk);
        let seg = &mut out[start..];
        let total = seg.len();
        set_ip_header(seg, v4, ip_len, id.wrapping_add(i as u16));
        let pseudo = pseudo_header_sum(seg, v4, total - ip_len);
        let tcp = &mut seg[ip_len..];
        tcp[4..8].copy_from_slice(&seq.wrapping_add((i * mss) as u32).to_be_bytes());
        let mut f = flags;
        if i + 1 < count {
            f &= !(TCP_FIN | TCP_PSH);
        }
        if i > 0 {
            f &= !TCP_CWR;
        }
        tcp[13] = f;
        tcp[16..18].fill(0);
        let sum = finish(ones_sum(tcp, pseudo));
        seg[ip_len + 16..ip_len + 18].copy_from_slice(&sum.to_be_bytes());
        ranges.push(start..out.len());
    }
    Ok(())
}

/// Gives one cut segment its own IP length and, for IPv4, its id and header checksum.
fn set_ip_header(seg: &mut [u8], v4: bool, ip_len: usize, id: u16) {
    let total = seg.len();
    if v4 {
        seg[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        seg[4..6].copy_from_slice(&id.to_be_bytes());
        seg[10..12].fill(0);
        let sum = finish(ones_sum(&seg[..ip_len], 0));
        seg[10..12].copy_from_slice(&sum.to_be_bytes());
    } else {
        seg[4..6].copy_from_slice(&((total - 40) as u16).to_be_bytes());
    }
}

/// The sum of the TCP pseudo-header of `packet` for a transport length of `len`.
fn pseudo_header_sum(packet: &[u8], v4: bool, len: usize) -> u64 {
    let addrs = if v4 { &packet[12..20] } else { &packet[8..40] };
    ones_sum(addrs, u64::from(TCP) + len as u64)
}

/// Cuts a UDP super-packet (USO) into datagrams of `gso_size` payload bytes, each with
/// its own IP length (and IPv4 id and header checksum), UDP length and checksum.
fn segment_udp(
    hdr: &VnetHdr,
    packet: &[u8],
    out: &mut Vec<u8>,
    ranges: &mut Vec<Range<usize>>,
) -> Result<(), OffloadError> {
    let ip_len = match packet.first().map(|b| b >> 4) {
        Some(4) if packet.len() >= 20 && packet[9] == UDP => usize::from(packet[0] & 0x0f) * 4,
        Some(6) if packet.len() >= 40 && packet[6] == UDP => 40,
        _ => return Err(OffloadError::Malformed),
    };
    let headers = ip_len + 8;
    let size = usize::from(hdr.gso_size);
    if ip_len < 20 || packet.len() < headers || size == 0 {
        return Err(OffloadError::Malformed);
    }
    let v4 = packet[0] >> 4 == 4;
    let id = u16::from_be_bytes([packet[4], packet[5]]);
    let payload = &packet[headers..];
    for (i, chunk) in payload
        .chunks(size)
        .chain(payload.is_empty().then_some(&[][..]))
        .enumerate()
    {
        let start = out.len();
        out.extend_from_slice(&packet[..headers]);
        out.extend_from_slice(chunk);
        let seg = &mut out[start..];
        let total = seg.len();
        set_ip_header(seg, v4, ip_len, id.wrapping_add(i as u16));
        let udp_len = total - ip_len;
        let addrs = if v4 { &seg[12..20] } else { &seg[8..40] };
        let pseudo = ones_sum(addrs, u64::from(UDP) + udp_len as u64);
        let udp = &mut seg[ip_len..];
        udp[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
        udp[6..8].fill(0);
        // A computed zero is sent as all ones: zero means "no checksum".
        let sum = match finish(ones_sum(udp, pseudo)) {
            0 => 0xffff,
            sum => sum,
        };
        udp[6..8].copy_from_slice(&sum.to_be_bytes());
        ranges.push(start..out.len());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 1071 written out plainly, byte pair by byte pair, folding as it goes.
    fn reference_checksum(parts: &[&[u8]]) -> u16 {
        let bytes: Vec<u8> = parts.concat();
        let mut sum: u32 = 0;
        let mut i = 0;
        while i < bytes.len() {
            let hi = u32::from(bytes[i]);
            let lo = u32::from(*bytes.get(i + 1).unwrap_or(&0));
            sum += (hi << 8) | lo;
            sum = (sum & 0xffff) + (sum >> 16);
            i += 2;
        }
        !(sum as u16)
    }

    /// Checks one segment's checksums against the reference.
    fn assert_checksums_valid(seg: &[u8]) {
        let v4 = seg[0] >> 4 == 4;
        let ip_len = if v4 {
            usize::from(seg[0] & 0xf) * 4
        } else {
            40
        };
        if v4 {
            assert_eq!(reference_checksum(&[&seg[..ip_len]]), 0, "IPv4 header");
        }
        let tcp_len = (seg.len() - ip_len) as u16;
        let mut pseudo = Vec::new();
        if v4 {
            pseudo.extend_from_slice(&seg[12..20]);
            pseudo.extend_from_slice(&[0, TCP]);
            pseudo.extend_from_slice(&tcp_len.to_be_bytes());
        } else {
            pseudo.extend_from_slice(&seg[8..40]);
            pseudo.extend_from_slice(&u32::from(tcp_len).to_be_bytes());
            pseudo.extend_from_slice(&[0, 0, 0, TCP]);
        }
        assert_eq!(reference_checksum(&[&pseudo, &seg[ip_len..]]), 0, "TCP");
    }

    /// A TCP super-packet: IPv4 (id 0xfffe) or IPv6, seq 0xffff_ff00, `flags`,
    /// `payload` bytes of payload (a counting pattern), checksums left zero.
    fn super_packet(v4: bool, payload: usize, flags: u8) -> Vec<u8> {
        let mut p = if v4 {
            let mut h = vec![0u8; 20];
            h[0] = 0x45;
            h[4..6].copy_from_slice(&0xfffeu16.to_be_bytes());
            h[8] = 64;
            h[9] = TCP;
            h[12..16].copy_from_slice(&[10, 0, 0, 1]);
            h[16..20].copy_from_slice(&[10, 0, 0, 2]);
            h
        } else {
            let mut h = vec![0u8; 40];
            h[0] = 0x60;
            h[6] = TCP;
            h[7] = 64;
            h[8..24].copy_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
            h[24..40].copy_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
            h
        };
        let ip_len = p.len();
        let mut tcp = vec![0u8; 20];
        tcp[0..2].copy_from_slice(&40000u16.to_be_bytes());
        tcp[2..4].copy_from_slice(&5201u16.to_be_bytes());
        tcp[4..8].copy_from_slice(&0xffff_ff00u32.to_be_bytes());
        tcp[12] = 5 << 4;
        tcp[13] = flags;
        p.extend_from_slice(&tcp);
        p.extend((0..payload).map(|i| (i % 251) as u8));
        let total = p.len();
        if v4 {
            p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        } else {
            p[4..6].copy_from_slice(&((total - ip_len) as u16).to_be_bytes());
        }
        p
    }

    fn split_all(hdr: &VnetHdr, packet: &[u8]) -> Vec<Vec<u8>> {
        let (mut out, mut ranges) = (Vec::new(), Vec::new());
        split(hdr, packet, &mut out, &mut ranges).unwrap();
        ranges.into_iter().map(|r| out[r].to_vec()).collect()
    }

    fn tso(v4: bool, mss: u16) -> VnetHdr {
        VnetHdr {
            flags: F_NEEDS_CSUM,
            gso_type: if v4 { GSO_TCPV4 } else { GSO_TCPV6 },
            hdr_len: if v4 { 40 } else { 60 },
            gso_size: mss,
            csum_start: if v4 { 20 } else { 40 },
            csum_offset: 16,
        }
    }

    #[test]
    fn a_tcp_super_packet_is_cut_into_valid_segments() {
        for v4 in [true, false] {
            let ip_len = if v4 { 20 } else { 40 };
            let packet = super_packet(v4, 3000, TCP_PSH | TCP_FIN | TCP_CWR | 0x10);
            let segs = split_all(&tso(v4, 1380), &packet);
            let sizes: Vec<usize> = segs.iter().map(|s| s.len() - ip_len - 20).collect();
            assert_eq!(sizes, vec![1380, 1380, 240]);
            let mut payload = Vec::new();
            for (i, seg) in segs.iter().enumerate() {
                assert_checksums_valid(seg);
                let tcp = &seg[ip_len..];
                let seq = u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]);
                assert_eq!(seq, 0xffff_ff00u32.wrapping_add(1380 * i as u32), "wraps");
                let last = i == segs.len() - 1;
                assert_eq!(
                    tcp[13] & (TCP_PSH | TCP_FIN) != 0,
                    last,
                    "PSH/FIN on the last"
                );
                assert_eq!(tcp[13] & TCP_CWR != 0, i == 0, "CWR on the first");
                assert_ne!(tcp[13] & 0x10, 0, "ACK on all");
                if v4 {
                    assert_eq!(u16::from_be_bytes([seg[2], seg[3]]) as usize, seg.len());
                    let id = u16::from_be_bytes([seg[4], seg[5]]);
                    assert_eq!(id, 0xfffeu16.wrapping_add(i as u16));
                } else {
                    assert_eq!(
                        u16::from_be_bytes([seg[4], seg[5]]) as usize,
                        seg.len() - 40
                    );
                }
                payload.extend_from_slice(&tcp[20..]);
            }
            assert_eq!(payload, packet[ip_len + 20..], "the payload, in order");
        }
    }

    #[test]
    fn a_udp_super_packet_is_cut_into_valid_datagrams() {
        for v4 in [true, false] {
            let mut packet = super_packet(v4, 2500, 0);
            let ip_len = if v4 { 20 } else { 40 };
            // The same headers made UDP: 8 bytes of UDP header, then the payload.
            packet.drain(ip_len + 8..ip_len + 20);
            if v4 {
                packet[9] = UDP;
                let total = packet.len() as u16;
                packet[2..4].copy_from_slice(&total.to_be_bytes());
            } else {
                packet[6] = UDP;
                let len = (packet.len() - 40) as u16;
                packet[4..6].copy_from_slice(&len.to_be_bytes());
            }
            let hdr = VnetHdr {
                flags: F_NEEDS_CSUM,
                gso_type: GSO_UDP_L4,
                hdr_len: ip_len as u16 + 8,
                gso_size: 1000,
                csum_start: ip_len as u16,
                csum_offset: 6,
            };
            let datagrams = split_all(&hdr, &packet);
            let sizes: Vec<usize> = datagrams.iter().map(|d| d.len() - ip_len - 8).collect();
            assert_eq!(sizes, vec![1000, 1000, 500]);
            let mut payload = Vec::new();
            for (i, d) in datagrams.iter().enumerate() {
                let udp_len = d.len() - ip_len;
                assert_eq!(
                    usize::from(u16::from_be_bytes([d[ip_len + 4], d[ip_len + 5]])),
                    udp_len
                );
                let mut pseudo = Vec::new();
                if v4 {
                    assert_eq!(reference_checksum(&[&d[..20]]), 0, "IPv4 header");
                    assert_eq!(u16::from_be_bytes([d[2], d[3]]) as usize, d.len());
                    let id = u16::from_be_bytes([d[4], d[5]]);
                    assert_eq!(id, 0xfffeu16.wrapping_add(i as u16));
                    pseudo.extend_from_slice(&d[12..20]);
                    pseudo.extend_from_slice(&[0, UDP]);
                    pseudo.extend_from_slice(&(udp_len as u16).to_be_bytes());
                } else {
                    assert_eq!(u16::from_be_bytes([d[4], d[5]]) as usize, udp_len);
                    pseudo.extend_from_slice(&d[8..40]);
                    pseudo.extend_from_slice(&(udp_len as u32).to_be_bytes());
                    pseudo.extend_from_slice(&[0, 0, 0, UDP]);
                }
                assert_eq!(reference_checksum(&[&pseudo, &d[ip_len..]]), 0, "UDP");
                payload.extend_from_slice(&d[ip_len + 8..]);
            }
            assert_eq!(payload, packet[ip_len + 8..], "the payload, in order");
        }
    }

    #[test]
    fn a_partial_checksum_is_finished() {
        let mut packet = super_packet(true, 101, 0x18);
        // What the kernel leaves: the pseudo-header's sum, not complemented.
        let pseudo = !finish(pseudo_header_sum(&packet, true, packet.len() - 20));
        packet[36..38].copy_from_slice(&pseudo.to_be_bytes());
        let hdr = VnetHdr {
            flags: F_NEEDS_CSUM,
            csum_start: 20,
            csum_offset: 16,
            ..VnetHdr::default()
        };
        let segs = split_all(&hdr, &packet);
        assert_eq!(segs.len(), 1);
        // The IPv4 header checksum is the kernel's job here: fill it for the check.
        let mut seg = segs[0].clone();
        let sum = finish(ones_sum(&seg[..20], 0));
        seg[10..12].copy_from_slice(&sum.to_be_bytes());
        assert_checksums_valid(&seg);
    }

    #[test]
    fn bad_headers_are_refused() {
        let (mut out, mut ranges) = (Vec::new(), Vec::new());
        let ufo = VnetHdr {
            gso_type: 3,
            ..VnetHdr::default()
        };
        assert_eq!(
            split(&ufo, &[0x45; 40], &mut out, &mut ranges),
            Err(OffloadError::UnsupportedGso(3))
        );
        let uso = VnetHdr {
            gso_type: GSO_UDP_L4,
            gso_size: 100,
            ..VnetHdr::default()
        };
        let tcp = super_packet(true, 300, 0x10);
        assert_eq!(
            split(&uso, &tcp, &mut out, &mut ranges),
            Err(OffloadError::Malformed),
            "not UDP"
        );
        let short = &super_packet(true, 10, 0)[..30];
        assert!(split(&tso(true, 1000), short, &mut out, &mut ranges).is_err());
        let far = VnetHdr {
            flags: F_NEEDS_CSUM,
            csum_start: 60,
            csum_offset: 16,
            ..VnetHdr::default()
        };
        assert!(split(&far, &[0x45; 40], &mut out, &mut ranges).is_err());
        assert!(out.is_empty() && ranges.is_empty());
    }

    #[test]
    fn the_sum_matches_the_reference_at_every_length_and_alignment() {
        let data: Vec<u8> = (0..300u32).map(|i| (i * 131 + 7) as u8).collect();
        for start in 0..9 {
            for len in (0..120).chain([255, 291]) {
                let part = &data[start..start + len];
                assert_eq!(
                    finish(ones_sum(part, 0)),
                    reference_checksum(&[part]),
                    "{start}+{len}"
                );
            }
        }
        assert_eq!(
            finish(ones_sum(&[0xff; 8], 0xffff)),
            reference_checksum(&[&[0xff; 10]])
        );
    }

    #[test]
    fn the_header_round_trips() {
        let hdr = tso(false, 1380);
        assert_eq!(VnetHdr::parse(&hdr.to_bytes()), Some(hdr));
        assert_eq!(VnetHdr::parse(&[0; 9]), None);
    }
}
