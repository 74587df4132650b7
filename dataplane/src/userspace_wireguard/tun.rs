//! The TUN device: `/dev/net/tun` opened with `IFF_TUN | IFF_NO_PI | IFF_VNET_HDR`, so
//! each read is one IP packet (or TCP super-packet) after a `virtio_net_hdr`, and each
//! write takes one packet after such a header (see `offload.rs`): a plain packet or a
//! TCP super-packet of one flow's segments (see `coalesce.rs`).

#![allow(unsafe_code)] // Three ioctls (TUNSETIFF, TUNSETOFFLOAD, SIOCSIFMTU) on owned descriptors.

use std::{
    cell::RefCell,
    fs::{File, OpenOptions},
    io::{self, Write},
    os::{fd::AsRawFd, unix::fs::OpenOptionsExt},
    sync::atomic::{AtomicBool, Ordering},
};

use super::coalesce::Coalescer;

/// The kernel's `struct ifreq`: a name and a union, 40 bytes on 64-bit Linux.
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    /// `ifr_flags` (a short) or `ifr_mtu` (an int), little room needed either way.
    data: [u8; 24],
}

impl IfReq {
    fn new(name: &str) -> io::Result<Self> {
        let bytes = name.as_bytes();
        if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("bad interface name {name:?}"),
            ));
        }
        let mut req = Self {
            name: [0; libc::IFNAMSIZ],
            data: [0; 24],
        };
        req.name[..bytes.len()].copy_from_slice(bytes);
        Ok(req)
    }
}

/// Creates (or attaches to) the TUN interface `name` and returns its descriptor,
/// non-blocking so that a reader can drain what is queued and wait with `poll`.
pub fn open(name: &str) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/net/tun")?;
    let mut req = IfReq::new(name)?;
    let flags = (libc::IFF_TUN | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as i16;
    req.data[..2].copy_from_slice(&flags.to_ne_bytes());
    // SAFETY: the descriptor is open and owned by `file`; `req` is a live, correctly
    // sized `struct ifreq` the kernel reads and writes within its 40 bytes.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req as *mut IfReq) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

/// Lets the kernel hand over TCP super-packets (TSO over IPv4 and IPv6, with ECN), UDP
/// ones where the kernel has USO (6.2 and later), and packets whose transport checksum
/// is left partial; `offload::split` cuts them all. Returns whether USO is on.
pub fn enable_offloads(tun: &File) -> io::Result<bool> {
    let tcp = libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6 | libc::TUN_F_TSO_ECN;
    let uso = libc::TUN_F_USO4 | libc::TUN_F_USO6;
    // An older kernel refuses flags it does not know (EINVAL): ask again without USO.
    if set_offload(tun, tcp | uso).is_ok() {
        KERNEL_HAS_USO.store(true, Ordering::Relaxed);
        return Ok(true);
    }
    set_offload(tun, tcp).map(|()| false)
}

fn set_offload(tun: &File, flags: libc::c_uint) -> io::Result<()> {
    // SAFETY: an owned TUN descriptor; TUNSETOFFLOAD takes its flags by value.
    let rc = unsafe {
        libc::ioctl(
            tun.as_raw_fd(),
            libc::TUNSETOFFLOAD,
            libc::c_ulong::from(flags),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets the MTU of interface `name` (through any socket of the current namespace).
pub fn set_mtu(name: &str, mtu: u32) -> io::Result<()> {
    let sock = std::net::UdpSocket::bind("0.0.0.0:0")?;
    let mut req = IfReq::new(name)?;
    let mtu = i32::try_from(mtu).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    req.data[..4].copy_from_slice(&mtu.to_ne_bytes());
    // SAFETY: as in `open`: an owned descriptor and a live `struct ifreq`.
    let rc = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFMTU, &mut req as *mut IfReq) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Set when the kernel took the USO flags: only then does it accept UDP super-packets
/// (`GSO_UDP_L4`) written to a TUN. A process runs one device.
static KERNEL_HAS_USO: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Each writing thread's buffers, kept from batch to batch.
    static COALESCER: RefCell<Coalescer> = RefCell::default();
}

/// Writes one batch's packets (decrypted, so their checksums need no check) to the
/// TUN, one flow's consecutive TCP segments (and, with USO, equal-sized UDP datagrams)
/// as one super-packet: a write each.
pub fn write_packets<'a>(tun: &File, packets: impl Iterator<Item = &'a [u8]>) {
    let uso = KERNEL_HAS_USO.load(Ordering::Relaxed);
    write_batch(packets, uso, |write| {
        if let Err(e) = (&*tun).write(write) {
            tracing::trace!(error = %e, "TUN write failed");
        }
    });
}

/// [`write_packets`] without the descriptor (for the fuzz target): hands each write,
/// a `virtio_net_hdr` and a packet or super-packet, to `write` in order; UDP datagrams
/// are merged only when `uso`.
pub fn write_batch<'a>(
    packets: impl Iterator<Item = &'a [u8]>,
    uso: bool,
    mut write: impl FnMut(&[u8]),
) {
    let packets: Vec<&[u8]> = packets.collect();
    if packets.is_empty() {
        return;
    }
    COALESCER.with_borrow_mut(|coalescer| {
        coalescer.coalesce(&packets, uso);
        for w in coalescer.writes() {
            write(w);
        }
    });
}
