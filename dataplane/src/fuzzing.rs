//! The bodies of this crate's cargo-fuzz targets (`fuzz/fuzz_targets/`), one function
//! per target, each taking the fuzzer's raw input and panicking on a broken property.
//! The targets only call these, and the stable suite's `tests/fuzz_replay.rs` (root
//! package) runs every committed corpus and regression input of each target through
//! the same function, so what a fuzzer once found stays fixed without nightly.
//! Compiled only with the `fuzzing` feature (the fuzz crate and the root package's
//! tests enable it; the product does not).

use std::{
    net::SocketAddr,
    time::{Duration, Instant, SystemTime},
};

use crate::{
    marking, nfnl,
    userspace_wireguard::{
        batch::Outbox,
        core::DeviceCore,
        io::Io,
        offload::{self, finish, ones_sum, VnetHdr, GSO_NONE, VNET_HDR_LEN},
        tun,
        uapi_request::parse_set,
    },
    wireguard::uapi,
};

/// `wg_session`: the device core with a real peer after a completed handshake, driven
/// by a script of peer packets, attacker replays, bit flips, junk and clock jumps
/// (`userspace_wireguard::session_fuzz`).
pub use crate::userspace_wireguard::session_fuzz::wg_session;

/// `nfnl_reply`: the nf_tables netlink reply parsers (`nfnl::messages`,
/// `generation_reply`, `take_acks`). Input: a little-endian u32 sequence number (the
/// GETGEN request's, and the first of three pending batch acknowledgements), then the
/// datagram.
pub fn nfnl_reply(data: &[u8]) {
    let Some((seq, buf)) = data.split_first_chunk::<4>() else {
        return;
    };
    let seq = u32::from_le_bytes(*seq);
    for (_, _, body) in nfnl::messages(buf) {
        assert!(body.len() <= buf.len());
    }
    let _ = nfnl::generation_reply(buf, seq);
    let mut pending = vec![seq, seq.wrapping_add(1), seq.wrapping_add(2)];
    let mut refused = None;
    nfnl::take_acks(buf, &mut pending, &mut refused);
    assert!(pending.len() <= 3);
    if refused.is_some() {
        assert!(pending.is_empty());
    }
}

/// `nft_listing`: the `nft -j list table` parser (`marking::parse_table`) on text.
pub fn nft_listing(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = marking::parse_table(text);
    }
}

/// `uapi_parse`: the WireGuard UAPI answer parsers (`parse_get`, `parse_errno`,
/// `parse_stats`) on text.
pub fn uapi_parse(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let _ = uapi::parse_get(&text);
    let _ = uapi::parse_errno(&text);
    let _ = uapi::parse_stats(&text);
}

struct Discard;

impl Io for Discard {
    fn send(&mut self, _: SocketAddr, _: &[u8]) {}
    fn write_tun(&mut self, _: &[u8]) {}
}

const DEVICE: &str =
    "private_key=0101010101010101010101010101010101010101010101010101010101010101\n\
public_key=8f40c5adb68f25624ae5b214ea767a6ec94d829d3d7b5e1ad1ba6f3e2138285f\n\
endpoint=192.0.2.2:51820\nallowed_ip=10.0.0.0/8\nallowed_ip=fd00::/8\n";

/// `wg_device_input`: the `wirespan wireguard` device's untrusted input. The first
/// byte picks what the rest is: (0) a `set=1` body, parsed and applied (a refused one
/// leaves `get=1` unchanged); (1) datagrams from the peer and (2) TUN packets, split at
/// 0xff bytes, through a configured `DeviceCore` with its timers; (3) a TUN read (a
/// `virtio_net_hdr` and a packet) cut by `offload::split`, whose packets are whole and
/// no longer than the read; (4) a batch of decrypted packets, split at 0xff bytes,
/// through the TUN writer as in [`tun_write`] (bit 0x80: the kernel has USO).
pub fn wg_device_input(data: &[u8]) {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let core = DeviceCore::default();
    core.apply_set(parse_set(DEVICE).expect("the base config parses"));
    let now = Instant::now();
    match selector % 5 {
        0 => {
            let before = core.render_get();
            match parse_set(&String::from_utf8_lossy(rest)) {
                Ok(req) => core.apply_set(req),
                Err(_) => assert_eq!(core.render_get(), before),
            }
        }
        1 => {
            let from: SocketAddr = "192.0.2.2:51820".parse().expect("an address");
            for chunk in rest.split(|b| *b == 0xff) {
                core.handle_datagram(from, chunk, now, SystemTime::now(), &mut Discard);
            }
        }
        3 => {
            let Some(hdr) = VnetHdr::parse(rest) else {
                return;
            };
            let packet = &rest[VNET_HDR_LEN..];
            let (mut out, mut ranges) = (Vec::new(), Vec::new());
            if offload::split(&hdr, packet, &mut out, &mut ranges).is_ok() {
                for r in &ranges {
                    assert!(r.end <= out.len() && r.len() <= packet.len().max(1));
                }
            } else {
                assert!(
                    out.is_empty() && ranges.is_empty(),
                    "a refused read adds nothing"
                );
            }
        }
        4 => {
            let packets: Vec<&[u8]> = rest.split(|b| *b == 0xff).collect();
            check_tun_writes(&packets, selector & 0x80 != 0);
        }
        _ => {
            for (i, chunk) in rest.split(|b| *b == 0xff).enumerate() {
                let t = now + Duration::from_secs(i as u64 * 7);
                core.handle_tun_packet(chunk, t, &mut Discard);
                core.tick(t, &mut Discard);
            }
        }
    }
}

/// `tun_write`: one batch of decrypted packets, as a peer can make them, through
/// everything between decryption and the TUN's file descriptor: the batch's
/// `Outbox`, the coalescer and the TUN writer, whose writes are collected instead of
/// written. Input: a byte of options (bit 0: the kernel has USO), then packets, each
/// a big-endian u16 length and that many bytes (the last may be cut short). Nothing
/// may panic, every write must be one the kernel takes (a `virtio_net_hdr` and at
/// most 64 KiB), and the writes, cut as the kernel cuts them, must give back the
/// batch's packets byte for byte (checksums made valid first: a super-packet's are
/// computed afresh, as the kernel does).
pub fn tun_write(data: &[u8]) {
    let Some((&options, mut rest)) = data.split_first() else {
        return;
    };
    let mut packets = Vec::new();
    while let Some((len, tail)) = rest.split_first_chunk::<2>() {
        let len = usize::from(u16::from_be_bytes(*len)).min(tail.len());
        let (packet, tail) = tail.split_at(len);
        let mut packet = packet.to_vec();
        with_valid_checksums(&mut packet);
        packets.push(packet);
        rest = tail;
    }
    let refs: Vec<&[u8]> = packets.iter().map(Vec::as_slice).collect();
    check_tun_writes(&refs, options & 1 != 0);
}

/// Runs `packets` through the TUN writer and checks its writes (see [`tun_write`]).
fn check_tun_writes(packets: &[&[u8]], uso: bool) {
    let mut outbox = Outbox::default();
    for p in packets {
        outbox.write_tun(p);
    }
    let mut writes = Vec::new();
    tun::write_batch(outbox.packets(), uso, |w| writes.push(w.to_vec()));
    let (mut out, mut ranges) = (Vec::new(), Vec::new());
    for write in &writes {
        let hdr = VnetHdr::parse(write).expect("a write starts with its header");
        let packet = &write[VNET_HDR_LEN..];
        if hdr.gso_type != GSO_NONE {
            assert!(packet.len() <= 65_535, "a super-packet of {}", packet.len());
        }
        offload::split(&hdr, packet, &mut out, &mut ranges).expect("a write splits");
    }
    let mut back: Vec<&[u8]> = ranges.iter().map(|r| &out[r.clone()]).collect();
    let mut want = packets.to_vec();
    // Packets of different flows may pass each other.
    back.sort_unstable();
    want.sort_unstable();
    assert_eq!(back, want, "the batch's packets, one for one");
}

/// Gives an IPv4 header, and a TCP or UDP segment whose header is all there, a valid
/// checksum (as the kernel's segmentation writes them).
fn with_valid_checksums(p: &mut [u8]) {
    let (ip_len, proto) = match p.first().map(|b| b >> 4) {
        Some(4) if p.len() >= 20 && p[0] == 0x45 => {
            p[10..12].fill(0);
            let sum = finish(ones_sum(&p[..20], 0));
            p[10..12].copy_from_slice(&sum.to_be_bytes());
            (20, p[9])
        }
        Some(6) if p.len() >= 40 => (40, p[6]),
        _ => return,
    };
    let (at, header) = match proto {
        6 => (ip_len + 16, ip_len + 20),
        17 => (ip_len + 6, ip_len + 8),
        _ => return,
    };
    if p.len() < header {
        return;
    }
    p[at..at + 2].fill(0);
    let addrs = if ip_len == 20 { &p[12..20] } else { &p[8..40] };
    let pseudo = ones_sum(addrs, u64::from(proto) + (p.len() - ip_len) as u64);
    let sum = match finish(ones_sum(&p[ip_len..], pseudo)) {
        // UDP sends a computed zero as all ones: zero means "no checksum".
        0 if proto == 17 => 0xffff,
        sum => sum,
    };
    p[at..at + 2].copy_from_slice(&sum.to_be_bytes());
}
