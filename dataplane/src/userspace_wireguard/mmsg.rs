//! Many datagrams per system call: `sendmmsg` with a UDP GSO segment size per message
//! (so runs of equal-sized datagrams to one peer, and single datagrams to others, go
//! out in one call), and `recvmmsg` with each message's sender and `UDP_GRO` segment
//! size. `nix`'s wrappers share one control message across all messages on send and
//! leave each header's control length as the kernel shrank it on receive (a message
//! without a GRO size turns that slot's off for every later call), hence these.
#![allow(unsafe_code)] // Two system calls over header arrays built and owned here.

use std::{
    mem,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::{AsRawFd, BorrowedFd},
    ptr,
};

use nix::errno::Errno;

/// Most messages in one call.
pub const MMSG_MAX: usize = 64;

/// Room for one control message carrying a `u16` or an `i32` (`CMSG_SPACE(4)` is 24
/// on 64-bit Linux), in `u64`s for its alignment.
const CMSG_WORDS: usize = 4;

/// One message to send: a datagram, or with `segment` a GSO run the kernel cuts into
/// datagrams of that size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outgoing<'a> {
    /// The destination.
    pub to: SocketAddr,
    /// The bytes.
    pub bytes: &'a [u8],
    /// The GSO segment size (`None`: one datagram).
    pub segment: Option<u16>,
}

/// One received message: its sender, its length and, when the kernel coalesced several
/// datagrams (`UDP_GRO`), their size (0: one datagram).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received {
    /// The sender (IPv4-mapped addresses made IPv4).
    pub from: SocketAddr,
    /// The bytes received into the message's buffer.
    pub len: usize,
    /// The size of each coalesced datagram (0: one datagram).
    pub segment: usize,
}

/// `to` as the IPv6 socket address a dual-stack socket sends to (IPv4 mapped).
pub fn sockaddr_v6(to: SocketAddr) -> libc::sockaddr_in6 {
    let (ip, port, scope) = match to {
        SocketAddr::V4(v4) => (v4.ip().to_ipv6_mapped(), v4.port(), 0),
        SocketAddr::V6(v6) => (*v6.ip(), v6.port(), v6.scope_id()),
    };
    libc::sockaddr_in6 {
        sin6_family: libc::AF_INET6 as libc::sa_family_t,
        sin6_port: port.to_be(),
        sin6_flowinfo: 0,
        sin6_addr: libc::in6_addr {
            s6_addr: ip.octets(),
        },
        sin6_scope_id: scope,
    }
}

/// The address the kernel wrote into `storage` (`None`: none, as after a shutdown).
pub fn socket_addr(storage: &libc::sockaddr_storage, len: libc::socklen_t) -> Option<SocketAddr> {
    let len = len as usize;
    match i32::from(storage.ss_family) {
        libc::AF_INET6 if len >= mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: the family says the storage holds a `sockaddr_in6`, which fits.
            let a = unsafe { &*ptr::from_ref(storage).cast::<libc::sockaddr_in6>() };
            let ip = Ipv6Addr::from(a.sin6_addr.s6_addr).to_canonical();
            Some(SocketAddr::new(ip, u16::from_be(a.sin6_port)))
        }
        libc::AF_INET if len >= mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: as above, for a `sockaddr_in`.
            let a = unsafe { &*ptr::from_ref(storage).cast::<libc::sockaddr_in>() };
            let ip = Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
            Some(SocketAddr::new(IpAddr::V4(ip), u16::from_be(a.sin_port)))
        }
        _ => None,
    }
}

/// Sends up to [`MMSG_MAX`] of `msgs` with one `sendmmsg`. Returns how many were
/// sent: fewer than given means the next one failed, and a call starting from it
/// returns its error.
///
/// # Errors
/// The first message could not be sent.
pub fn send_batch(fd: BorrowedFd<'_>, msgs: &[Outgoing<'_>]) -> Result<usize, Errno> {
    let n = msgs.len().min(MMSG_MAX);
    let mut addrs: [libc::sockaddr_in6; MMSG_MAX] =
        [sockaddr_v6(SocketAddr::from(([0; 4], 0))); MMSG_MAX];
    let mut iovs = [libc::iovec {
        iov_base: ptr::null_mut(),
        iov_len: 0,
    }; MMSG_MAX];
    let mut cmsgs = [[0u64; CMSG_WORDS]; MMSG_MAX];
    // SAFETY: `mmsghdr` is plain data; all-zero is an empty header.
    let mut hdrs: [libc::mmsghdr; MMSG_MAX] = unsafe { mem::zeroed() };
    for (i, msg) in msgs.iter().take(n).enumerate() {
        addrs[i] = sockaddr_v6(msg.to);
        // The kernel only reads the bytes (the field is `*mut` for `readv`'s sake).
        iovs[i] = libc::iovec {
            iov_base: msg.bytes.as_ptr().cast_mut().cast(),
            iov_len: msg.bytes.len(),
        };
        let h = &mut hdrs[i].msg_hdr;
        h.msg_name = ptr::from_mut(&mut addrs[i]).cast();
        h.msg_namelen = mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t;
        h.msg_iov = ptr::from_mut(&mut iovs[i]);
        h.msg_iovlen = 1;
        if let Some(segment) = msg.segment {
            h.msg_control = cmsgs[i].as_mut_ptr().cast();
            // SAFETY: CMSG_SPACE only computes a size.
            h.msg_controllen = unsafe { libc::CMSG_SPACE(mem::size_of::<u16>() as u32) } as _;
            // SAFETY: the control buffer is `CMSG_WORDS` words, more than the one
            // `u16` message needs, and aligned; the header points at it.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(h);
                (*c).cmsg_level = libc::SOL_UDP;
                (*c).cmsg_type = libc::UDP_SEGMENT;
                (*c).cmsg_len = libc::CMSG_LEN(mem::size_of::<u16>() as u32) as _;
                ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), segment);
            }
        }
    }
    // SAFETY: the first `n` headers point at addresses, iovecs and control buffers
    // that live on this frame until the call returns, and at `msgs`' bytes.
    let rc = unsafe { libc::sendmmsg(fd.as_raw_fd(), hdrs.as_mut_ptr(), n as u32, 0) };
    Errno::result(rc).map(|sent| sent as usize)
}

/// Receives up to `bufs.len()` (at most [`MMSG_MAX`]) messages with one `recvmmsg`,
/// blocking until the first arrives and then taking only what is queued
/// (`MSG_WAITFORONE`). Appends them to `got` (cleared first), in order; the `i`th is
/// in `bufs[i]`. An empty datagram is a message like any other. Returns true when the
/// socket was shut down (as a replaced socket is): the kernel then answers with a
/// message that has no sender, after the datagrams queued before, which `got` holds.
///
/// # Errors
/// Nothing was received (`EINTR`, or a socket error).
pub fn recv_batch(
    fd: BorrowedFd<'_>,
    bufs: &mut [Vec<u8>],
    got: &mut Vec<Received>,
) -> Result<bool, Errno> {
    got.clear();
    let n = bufs.len().min(MMSG_MAX);
    // SAFETY: plain data; all-zero is an empty address.
    let mut addrs: [libc::sockaddr_storage; MMSG_MAX] = unsafe { mem::zeroed() };
    let mut iovs = [libc::iovec {
        iov_base: ptr::null_mut(),
        iov_len: 0,
    }; MMSG_MAX];
    let mut cmsgs = [[0u64; CMSG_WORDS]; MMSG_MAX];
    // SAFETY: as in `send_batch`.
    let mut hdrs: [libc::mmsghdr; MMSG_MAX] = unsafe { mem::zeroed() };
    for (i, buf) in bufs.iter_mut().take(n).enumerate() {
        iovs[i] = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let h = &mut hdrs[i].msg_hdr;
        h.msg_name = ptr::from_mut(&mut addrs[i]).cast();
        h.msg_namelen = mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        h.msg_iov = ptr::from_mut(&mut iovs[i]);
        h.msg_iovlen = 1;
        h.msg_control = cmsgs[i].as_mut_ptr().cast();
        h.msg_controllen = mem::size_of_val(&cmsgs[i]) as _;
    }
    // SAFETY: the first `n` headers point at this frame's addresses, iovecs and
    // control buffers, and at `bufs`, all alive and unaliased until the call returns.
    let rc = unsafe {
        libc::recvmmsg(
            fd.as_raw_fd(),
            hdrs.as_mut_ptr(),
            n as u32,
            libc::MSG_WAITFORONE,
            ptr::null_mut(),
        )
    };
    let count = Errno::result(rc)? as usize;
    for (h, addr) in hdrs.iter().zip(&addrs).take(count) {
        // Every datagram has a sender; a shut-down socket's end-of-file has none. What
        // follows it is left to the socket's owner (the socket is being replaced).
        let Some(from) = socket_addr(addr, h.msg_hdr.msg_namelen) else {
            return Ok(true);
        };
        got.push(Received {
            from,
            len: h.msg_len as usize,
            segment: gro_segment(&h.msg_hdr),
        });
    }
    Ok(false)
}

/// The `UDP_GRO` segment size among a received header's control messages (0: none).
fn gro_segment(h: &libc::msghdr) -> usize {
    // SAFETY: the kernel wrote `msg_controllen` bytes of well-formed control messages
    // into the buffer `msg_control` points at, which is still alive (the caller's).
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(h);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_UDP && (*c).cmsg_type == libc::UDP_GRO {
                let size = ptr::read_unaligned(libc::CMSG_DATA(c).cast::<i32>());
                return usize::try_from(size).unwrap_or(0);
            }
            c = libc::CMSG_NXTHDR(h, c);
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use std::{net::UdpSocket, os::fd::AsFd};

    use nix::sys::socket::{setsockopt, sockopt};

    use super::*;
    use crate::userspace_wireguard::batch::gro_segments;

    #[test]
    fn addresses_go_out_mapped_and_come_back_canonical() {
        for addr in ["192.0.2.1:51820", "[2001:db8::7]:4000"] {
            let addr: SocketAddr = addr.parse().unwrap();
            let v6 = sockaddr_v6(addr);
            // SAFETY: test only; plain data.
            let mut storage: libc::sockaddr_storage = unsafe { mem::zeroed() };
            // SAFETY: a `sockaddr_in6` fits in a `sockaddr_storage`.
            unsafe { ptr::write(ptr::from_mut(&mut storage).cast(), v6) };
            let len = mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t;
            assert_eq!(socket_addr(&storage, len), Some(addr));
            assert_eq!(socket_addr(&storage, 0), None, "no address (shut down)");
        }
    }

    /// An empty datagram is a datagram: the ones queued after it in the same
    /// `recvmmsg` are received too (they were dropped with it), and a shutdown (a
    /// replaced socket) is still told apart, by its missing sender.
    #[test]
    fn an_empty_datagram_is_received_with_the_rest_and_a_shutdown_is_still_seen() {
        let rx = UdpSocket::bind("[::1]:0").unwrap();
        let tx = UdpSocket::bind("[::1]:0").unwrap();
        let to = rx.local_addr().unwrap();
        for d in [&[1u8; 10][..], &[], &[2; 20]] {
            tx.send_to(d, to).unwrap();
        }
        let mut bufs = vec![vec![0u8; 2048]; 8];
        let mut got = Vec::new();
        // Loopback queues each datagram before `send_to` returns: one call takes all.
        assert_eq!(recv_batch(rx.as_fd(), &mut bufs, &mut got), Ok(false));
        let lens: Vec<usize> = got.iter().map(|r| r.len).collect();
        assert_eq!(lens, vec![10, 0, 20]);
        assert!(got.iter().all(|r| r.from == tx.local_addr().unwrap()));

        tx.send_to(&[3; 5], to).unwrap();
        // As `apply_set` does: an unconnected socket answers ENOTCONN, but is shut down.
        let _ = nix::sys::socket::shutdown(rx.as_raw_fd(), nix::sys::socket::Shutdown::Read);
        // What was queued first, then (where the call would block) the shutdown.
        assert_eq!(recv_batch(rx.as_fd(), &mut bufs, &mut got), Ok(false));
        assert_eq!(got.iter().map(|r| r.len).collect::<Vec<_>>(), vec![5]);
        assert_eq!(recv_batch(rx.as_fd(), &mut bufs, &mut got), Ok(true));
        assert!(got.is_empty());
    }

    /// One `sendmmsg` carries a GSO run to one socket and single datagrams of other
    /// sizes to two sockets; one `recvmmsg` per receiver gets each with its sender.
    #[test]
    fn one_sendmmsg_reaches_several_addresses_with_a_gso_run_among_them() {
        let bind = || UdpSocket::bind("[::1]:0").unwrap();
        let (sender, rx_a, rx_b) = (bind(), bind(), bind());
        setsockopt(&rx_a, sockopt::UdpGroSegment, &true).unwrap();
        for rx in [&rx_a, &rx_b] {
            rx.set_read_timeout(Some(std::time::Duration::from_secs(5)))
                .unwrap();
        }
        let (a, b) = (rx_a.local_addr().unwrap(), rx_b.local_addr().unwrap());
        let run: Vec<u8> = (0..250u8).collect();
        let msgs = [
            Outgoing {
                to: a,
                bytes: &run,
                segment: Some(100),
            },
            Outgoing {
                to: b,
                bytes: &[7; 30],
                segment: None,
            },
            Outgoing {
                to: a,
                bytes: &[8; 20],
                segment: None,
            },
            Outgoing {
                to: b,
                bytes: &[9; 40],
                segment: None,
            },
        ];
        assert_eq!(send_batch(sender.as_fd(), &msgs), Ok(4));
        let from = sender.local_addr().unwrap();
        let receive = |rx: &UdpSocket, want: usize| {
            let mut bufs = vec![vec![0u8; 2048]; 8];
            let mut datagrams = Vec::new();
            while datagrams.len() < want {
                let mut got = Vec::new();
                assert_eq!(recv_batch(rx.as_fd(), &mut bufs, &mut got), Ok(false));
                for (buf, r) in bufs.iter().zip(&got) {
                    assert_eq!(r.from, from);
                    datagrams.extend(gro_segments(&buf[..r.len], r.segment).map(<[u8]>::to_vec));
                }
            }
            datagrams
        };
        let at_a = receive(&rx_a, 4);
        assert_eq!(
            at_a[..3],
            [
                run[..100].to_vec(),
                run[100..200].to_vec(),
                run[200..].to_vec()
            ]
        );
        assert_eq!(at_a[3], vec![8; 20]);
        assert_eq!(receive(&rx_b, 2), vec![vec![7; 30], vec![9; 40]]);
    }
}
