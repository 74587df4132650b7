//! The device's UDP port: two sockets in one `SO_REUSEPORT` group, and a classic BPF
//! program on the group that steers each datagram by its first byte. Data messages
//! (type 4) go to the data socket, everything else to the handshake socket, in the
//! kernel, before either is queued: a flood of handshake messages fills only the
//! handshake socket's queue and never delays, or overflows into, the data path's.

#![allow(unsafe_code)] // One setsockopt with a filter program built here.

use std::{
    io,
    net::{Ipv6Addr, SocketAddrV6, UdpSocket},
    os::fd::{AsRawFd, OwnedFd},
};

use nix::sys::socket::{self, sockopt, AddressFamily, SockFlag, SockType, SockaddrIn6};

/// The UDP socket's send and receive buffer size.
const SOCKET_BUFFER: usize = 7 << 20;

/// The two sockets of the device's port.
#[derive(Debug)]
pub struct PortSockets {
    /// Receives data messages (with UDP GRO); sends everything.
    pub data: UdpSocket,
    /// Receives handshake messages (and anything that is not a data message).
    pub handshake: UdpSocket,
    /// False when the steering program could not be attached: the kernel then
    /// spreads datagrams over both sockets by flow, and each reader handles both kinds.
    pub steered: bool,
}

impl PortSockets {
    /// The port both are bound to.
    pub fn port(&self) -> u16 {
        self.data.local_addr().map(|a| a.port()).unwrap_or_default()
    }

    /// Marks both sockets' packets with `mark`.
    pub fn set_mark(&self, mark: u32) -> nix::Result<()> {
        socket::setsockopt(&self.data, sockopt::Mark, &mark)?;
        socket::setsockopt(&self.handshake, sockopt::Mark, &mark)
    }

    /// Wakes readers blocked on these sockets (they are being replaced).
    pub fn shut_down(&self) {
        for s in [&self.data, &self.handshake] {
            let _ = socket::shutdown(s.as_raw_fd(), socket::Shutdown::Read);
        }
    }
}

/// A dual-stack UDP socket on `port` (0: any), marked with `mark` when non-zero, in a
/// reuseport group when `reuseport`.
fn bind_one(port: u16, mark: u32, reuseport: bool, gro: bool) -> io::Result<UdpSocket> {
    let fd: OwnedFd = socket::socket(
        AddressFamily::Inet6,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    socket::setsockopt(&fd, sockopt::Ipv6V6Only, &false)?;
    if reuseport {
        socket::setsockopt(&fd, sockopt::ReusePort, &true)?;
    }
    if mark != 0 {
        socket::setsockopt(&fd, sockopt::Mark, &mark)?;
    }
    // Room for the bursts that GSO sends and GRO receives (as wireguard-go does): with
    // the default 208 KiB, a burst overflows the receive queue and TCP inside the
    // tunnel retransmits. `*BUFFORCE` passes the sysctl limit (we run as root).
    if socket::setsockopt(&fd, sockopt::RcvBufForce, &SOCKET_BUFFER).is_err() {
        let _ = socket::setsockopt(&fd, sockopt::RcvBuf, &SOCKET_BUFFER);
    }
    if socket::setsockopt(&fd, sockopt::SndBufForce, &SOCKET_BUFFER).is_err() {
        let _ = socket::setsockopt(&fd, sockopt::SndBuf, &SOCKET_BUFFER);
    }
    // Coalesced receives (split by `gro_segments`); without it, one datagram a read.
    if gro {
        if let Err(e) = socket::setsockopt(&fd, sockopt::UdpGroSegment, &true) {
            tracing::debug!(error = %e, "UDP GRO unavailable");
        }
    }
    let addr = SockaddrIn6::from(SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, port, 0, 0));
    socket::bind(fd.as_raw_fd(), &addr)?;
    Ok(UdpSocket::from(fd))
}

// Classic BPF opcodes (linux/filter.h).
/// `BPF_LD | BPF_B | BPF_ABS` (`BPF_LD` is 0).
const BPF_LD_B_ABS: u16 = 0x10 | 0x20;
const BPF_JMP_JEQ_K: u16 = 0x05 | 0x10;
const BPF_RET_K: u16 = 0x06;

/// The steering program: the group's socket 0 (data) for a datagram whose first
/// byte is 4, socket 1 (handshake) for any other. The kernel runs it with the UDP
/// payload at offset 0; an empty datagram fails the load and goes to socket 0.
fn steering_program() -> [libc::sock_filter; 4] {
    let op = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
    [
        op(BPF_LD_B_ABS, 0, 0, 0),
        op(BPF_JMP_JEQ_K, 0, 1, 4),
        op(BPF_RET_K, 0, 0, 0),
        op(BPF_RET_K, 0, 0, 1),
    ]
}

fn attach_steering(group: &UdpSocket) -> io::Result<()> {
    let mut prog = steering_program();
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_mut_ptr(),
    };
    // SAFETY: `fprog` points at `prog`, alive for the call; the kernel copies it.
    let rc = unsafe {
        libc::setsockopt(
            group.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ATTACH_REUSEPORT_CBPF,
            std::ptr::from_ref(&fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The handshake reader's niceness: when the cores are busy, data readers (nice 0)
/// get about nine times its share, which still leaves it thousands of Diffie-Hellman
/// operations a second.
pub const HANDSHAKE_NICE: i32 = 10;

/// Lowers the calling thread's scheduling priority to `nice` (Linux keeps a nice value
/// per thread).
pub fn lower_this_threads_priority(nice: i32) -> io::Result<()> {
    let tid = nix::unistd::gettid().as_raw();
    // SAFETY: a plain system call on this thread's own id.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Binds the device's port (`port` 0: any free one) and its steering. A port another
/// socket holds is refused (`AddrInUse`), even one in a reuseport group of its own.
pub fn bind(port: u16, mark: u32) -> io::Result<PortSockets> {
    if port != 0 {
        // Joining a stranger's reuseport group would take part of its traffic: a
        // plain bind first finds any holder of the port.
        drop(bind_one(port, mark, false, false)?);
    }
    let data = bind_one(port, mark, true, true)?;
    let port = data.local_addr()?.port();
    let handshake = bind_one(port, mark, true, false)?;
    let steered = match attach_steering(&data) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, "cannot steer handshakes to their own socket; both readers take both kinds");
            false
        }
    };
    Ok(PortSockets {
        data,
        handshake,
        steered,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Datagrams to the port land on the socket their first byte calls for.
    #[test]
    fn data_messages_reach_the_data_socket_and_the_rest_the_handshake_socket() {
        let sockets = bind(0, 0).unwrap();
        assert!(sockets.steered);
        let port = sockets.port();
        for s in [&sockets.data, &sockets.handshake] {
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        }
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = ("127.0.0.1", port);
        // Several source ports each: without steering, the kernel's flow hash would
        // put some on the other socket.
        for _ in 0..8 {
            let c = UdpSocket::bind("127.0.0.1:0").unwrap();
            c.send_to(&[4, 0, 0, 0, 9], to).unwrap();
            c.send_to(&[1, 0, 0, 0, 9], to).unwrap();
        }
        client.send_to(&[2, 0, 0, 0], to).unwrap();
        let mut buf = [0u8; 64];
        for _ in 0..8 {
            let n = sockets.data.recv(&mut buf).unwrap();
            assert_eq!(buf[0], 4, "{:?}", &buf[..n]);
        }
        for first in std::iter::repeat_n(1, 8).chain([2]) {
            sockets.handshake.recv(&mut buf).unwrap();
            assert_eq!(buf[0], first);
        }
    }

    #[test]
    fn a_thread_lowers_its_own_priority_only() {
        let nice_of = |tid: i32| {
            let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap();
            // Field 19 (nice), counted after the command's closing parenthesis.
            let after = &stat[stat.rfind(')').unwrap() + 2..];
            after.split(' ').nth(16).unwrap().parse::<i32>().unwrap()
        };
        let main = nix::unistd::gettid().as_raw();
        let before = nice_of(main);
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            lower_this_threads_priority(HANDSHAKE_NICE).unwrap();
            tx.send(nix::unistd::gettid().as_raw()).unwrap();
            done_rx.recv().unwrap();
        });
        let tid = rx.recv().unwrap();
        assert_eq!(nice_of(tid), HANDSHAKE_NICE);
        assert_eq!(nice_of(main), before, "the calling thread only");
        done_tx.send(()).unwrap();
        t.join().unwrap();
    }

    #[test]
    fn a_port_someone_holds_is_refused_even_to_a_reuseport_group() {
        let held = bind(0, 0).unwrap();
        let err = bind(held.port(), 0).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
    }
}
