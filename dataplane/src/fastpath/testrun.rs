//! `BPF_PROG_TEST_RUN`: runs a loaded program on a crafted packet inside the kernel
//! (aya 0.14 has no wrapper for it). Used by the correctness tests and the marking
//! benchmark; the XDP "live frames" mode is the benchmark's traffic source.

#![allow(unsafe_code)] // the bpf(2) syscall.

use std::{
    io,
    os::fd::{AsRawFd, BorrowedFd},
    time::Duration,
};

const BPF_PROG_TEST_RUN: libc::c_long = 10;
/// Frames are sent through the stack (XDP_PASS) or out (XDP_TX/REDIRECT) for real.
const BPF_F_TEST_XDP_LIVE_FRAMES: u32 = 1 << 1;

/// `union bpf_attr`, the `test` member, zero-padded to a size every kernel since 5.10
/// accepts (extra bytes must be zero).
#[repr(C)]
#[derive(Default)]
struct TestAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    pad: u32,
}

/// Size of `struct __sk_buff`.
const SKB_CTX_SIZE: usize = 192;
/// Offset of `mark` in `struct __sk_buff`.
const SKB_MARK_OFFSET: usize = 8;

fn bpf_test_run(attr: &mut TestAttr) -> io::Result<()> {
    // SAFETY: `attr` is a valid, initialised, properly sized bpf_attr for
    // BPF_PROG_TEST_RUN; every pointer in it refers to a buffer that outlives the call
    // with the size stated next to it.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_TEST_RUN,
            std::ptr::from_mut(attr),
            std::mem::size_of::<TestAttr>(),
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// The outcome of running a tc program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SkbRun {
    /// Program return code (`-1` is `TC_ACT_UNSPEC` / `TCX_NEXT`).
    pub retval: i32,
    /// `skb->mark` after the (last) run.
    pub mark: u32,
    /// Mean run time per repetition as the kernel measured it.
    pub per_run: Duration,
}

/// Runs tc program `prog` `repeat` times on `packet` (an Ethernet frame of at least
/// 14 bytes) entering with `mark`.
///
/// # Errors
/// The kernel refused the run (not a tc program, packet shorter than 14 bytes, …).
pub fn run_skb(prog: BorrowedFd<'_>, packet: &[u8], mark: u32, repeat: u32) -> io::Result<SkbRun> {
    let mut ctx_in = [0u8; SKB_MARK_OFFSET + 4];
    ctx_in[SKB_MARK_OFFSET..].copy_from_slice(&mark.to_ne_bytes());
    let mut ctx_out = [0u8; SKB_CTX_SIZE];
    let mut data_out = vec![0u8; packet.len() + 256];
    let mut attr = TestAttr {
        prog_fd: u32::try_from(prog.as_raw_fd()).map_err(io::Error::other)?,
        data_size_in: u32::try_from(packet.len()).map_err(io::Error::other)?,
        data_size_out: u32::try_from(data_out.len()).map_err(io::Error::other)?,
        data_in: packet.as_ptr() as u64,
        data_out: data_out.as_mut_ptr() as u64,
        repeat,
        ctx_size_in: ctx_in.len() as u32,
        ctx_size_out: ctx_out.len() as u32,
        ctx_in: ctx_in.as_ptr() as u64,
        ctx_out: ctx_out.as_mut_ptr() as u64,
        ..TestAttr::default()
    };
    bpf_test_run(&mut attr)?;
    let mut m = [0u8; 4];
    m.copy_from_slice(&ctx_out[SKB_MARK_OFFSET..SKB_MARK_OFFSET + 4]);
    Ok(SkbRun {
        retval: attr.retval as i32,
        mark: u32::from_ne_bytes(m),
        per_run: Duration::from_nanos(u64::from(attr.duration)),
    })
}

/// Sends `frame` `repeat` times through XDP program `prog` as if received on
/// `ingress_ifindex` (which must be in the calling thread's network namespace), in
/// live-frames mode: frames the program passes go up that interface's stack for
/// real. Returns the kernel's mean time per frame.
///
/// # Errors
/// The kernel refused the run (no live-frames support, unknown interface, …).
pub fn run_xdp_live(
    prog: BorrowedFd<'_>,
    frame: &[u8],
    ingress_ifindex: u32,
    repeat: u32,
    batch_size: u32,
) -> io::Result<Duration> {
    // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index,
    // egress_ifindex.
    let len = u32::try_from(frame.len()).map_err(io::Error::other)?;
    let ctx: [u32; 6] = [0, len, 0, ingress_ifindex, 0, 0];
    let mut attr = TestAttr {
        prog_fd: u32::try_from(prog.as_raw_fd()).map_err(io::Error::other)?,
        data_size_in: len,
        data_in: frame.as_ptr() as u64,
        repeat,
        ctx_size_in: std::mem::size_of_val(&ctx) as u32,
        ctx_in: ctx.as_ptr() as u64,
        flags: BPF_F_TEST_XDP_LIVE_FRAMES,
        batch_size,
        ..TestAttr::default()
    };
    bpf_test_run(&mut attr)?;
    Ok(Duration::from_nanos(u64::from(attr.duration)))
}

/// An Ethernet frame carrying a UDP datagram from `src` to `dst` (same family) with
/// `payload` bytes of zeros, as a test or benchmark packet. Checksums are left zero
/// (nothing on the marking path checks them); `ttl` is the IPv4 TTL / IPv6 hop
/// limit.
#[must_use]
pub fn udp_frame(
    dst_mac: [u8; 6],
    src_mac: [u8; 6],
    src: std::net::IpAddr,
    dst: std::net::IpAddr,
    payload: usize,
) -> Vec<u8> {
    use std::net::IpAddr;
    let mut f = Vec::with_capacity(14 + 40 + 8 + payload);
    f.extend_from_slice(&dst_mac);
    f.extend_from_slice(&src_mac);
    let udp_len = u16::try_from(8 + payload).unwrap_or(u16::MAX);
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            f.extend_from_slice(&0x0800u16.to_be_bytes());
            let total = udp_len.saturating_add(20);
            let mut ip = [0u8; 20];
            ip[0] = 0x45;
            ip[2..4].copy_from_slice(&total.to_be_bytes());
            ip[8] = 64;
            ip[9] = 17;
            ip[12..16].copy_from_slice(&s.octets());
            ip[16..20].copy_from_slice(&d.octets());
            let sum = checksum(&ip);
            ip[10..12].copy_from_slice(&sum.to_be_bytes());
            f.extend_from_slice(&ip);
        }
        (s, d) => {
            let to6 = |a: IpAddr| match a {
                IpAddr::V6(a) => a,
                IpAddr::V4(a) => a.to_ipv6_mapped(),
            };
            f.extend_from_slice(&0x86DDu16.to_be_bytes());
            let mut ip = [0u8; 40];
            ip[0] = 0x60;
            ip[4..6].copy_from_slice(&udp_len.to_be_bytes());
            ip[6] = 17;
            ip[7] = 64;
            ip[8..24].copy_from_slice(&to6(s).octets());
            ip[24..40].copy_from_slice(&to6(d).octets());
            f.extend_from_slice(&ip);
        }
    }
    f.extend_from_slice(&4000u16.to_be_bytes());
    f.extend_from_slice(&4001u16.to_be_bytes());
    f.extend_from_slice(&udp_len.to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    f.resize(f.len() + payload, 0);
    f
}

/// The IPv4 header checksum.
fn checksum(header: &[u8]) -> u16 {
    let mut sum: u32 = header
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}
