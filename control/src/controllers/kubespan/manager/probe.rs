//! The production [`Prober`]. A probe is two packets to the peer's mesh address, both
//! through the tunnel (its /128 is in the peer's AllowedIPs):
//!
//! - an ICMPv6 echo request, which the peer's kernel answers at once: a reply proves
//!   the path within a round trip, and [`TunnelProber::echo_replies`] reports it so
//!   the failure detector learns which peers answer (`docs/kubespan.md` §8.6);
//! - an empty UDP datagram to the discard port: a live peer's WireGuard, having
//!   received data, sends at least a keepalive back within 10 s, whatever its
//!   firewall does with echo requests; what its kernel does with the datagram (a port
//!   unreachable, or nothing) does not matter.
//!
//! KubeSpan mesh addresses are IPv6; an IPv4 one gets the datagram only.

use std::{
    collections::HashSet,
    net::{IpAddr, Ipv6Addr, SocketAddr, SocketAddrV6, UdpSocket},
    os::fd::{AsRawFd as _, OwnedFd},
    sync::Mutex,
};

use nix::{
    errno::Errno,
    sys::socket::{
        recvfrom, sendto, socket, AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType,
        SockaddrIn6,
    },
};

use super::Prober;

/// The discard service: nothing is expected to answer on it.
const DISCARD_PORT: u16 = 9;
const ICMPV6_ECHO_REQUEST: u8 = 128;
const ICMPV6_ECHO_REPLY: u8 = 129;
/// Echo payload, so a capture shows whose probe it is.
const ECHO_PAYLOAD: &[u8] = b"wirespan probe";

/// An ICMPv6 raw socket: the kernel fills in the checksum of what is sent, and hands
/// over every ICMPv6 message that arrives (replies are picked out by type and id).
#[derive(Debug)]
struct EchoSocket {
    fd: OwnedFd,
    /// The echo identifier of this process's probes.
    id: u16,
    seq: u16,
}

impl EchoSocket {
    fn open() -> nix::Result<Self> {
        let fd = socket(
            AddressFamily::Inet6,
            SockType::Raw,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            SockProtocol::IcmpV6,
        )?;
        Ok(Self {
            fd,
            id: rand::random(),
            seq: 0,
        })
    }

    fn send(&mut self, to: Ipv6Addr) -> nix::Result<()> {
        self.seq = self.seq.wrapping_add(1);
        let mut msg = vec![ICMPV6_ECHO_REQUEST, 0, 0, 0];
        msg.extend_from_slice(&self.id.to_be_bytes());
        msg.extend_from_slice(&self.seq.to_be_bytes());
        msg.extend_from_slice(ECHO_PAYLOAD);
        let addr = SockaddrIn6::from(SocketAddrV6::new(to, 0, 0, 0));
        sendto(self.fd.as_raw_fd(), &msg, &addr, MsgFlags::empty()).map(drop)
    }

    /// The sources of the echo replies to this process's requests that are queued.
    fn replies(&self) -> HashSet<IpAddr> {
        let mut from = HashSet::new();
        let mut buf = [0u8; 1500];
        loop {
            match recvfrom::<SockaddrIn6>(self.fd.as_raw_fd(), &mut buf) {
                Ok((n, Some(src))) => {
                    if is_reply_to(&buf[..n], self.id) {
                        from.insert(IpAddr::V6(src.ip()));
                    }
                }
                Ok((_, None)) => {}
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => return from,
                Err(e) => {
                    tracing::debug!(error = %e, "reading echo replies failed");
                    return from;
                }
            }
        }
    }
}

/// Whether an ICMPv6 message is an echo reply with identifier `id`.
fn is_reply_to(msg: &[u8], id: u16) -> bool {
    msg.len() >= 8 && msg[0] == ICMPV6_ECHO_REPLY && msg[4..6] == id.to_be_bytes()
}

#[derive(Debug, Default)]
struct Sockets {
    echo: Option<EchoSocket>,
    udp6: Option<UdpSocket>,
    udp4: Option<UdpSocket>,
}

/// Sends probes from sockets opened on first use (an ICMPv6 raw socket, one unbound
/// UDP socket per family).
#[derive(Debug, Default)]
pub struct TunnelProber {
    sockets: Mutex<Sockets>,
}

impl TunnelProber {
    /// A prober with no socket open yet.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    fn sockets(&self) -> std::sync::MutexGuard<'_, Sockets> {
        self.sockets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn open_udp(v6: bool) -> std::io::Result<UdpSocket> {
    let any: SocketAddr = if v6 {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    } else {
        ([0, 0, 0, 0], 0).into()
    };
    let s = UdpSocket::bind(any)?;
    s.set_nonblocking(true)?;
    Ok(s)
}

/// The socket in `slot`, opened with `open` if it is not yet; `None` (logged) when it
/// cannot be.
fn opened<'a, T, E: std::fmt::Display>(
    slot: &'a mut Option<T>,
    what: &str,
    open: impl FnOnce() -> Result<T, E>,
) -> Option<&'a mut T> {
    if slot.is_none() {
        match open() {
            Ok(s) => *slot = Some(s),
            Err(e) => {
                tracing::debug!(socket = what, error = %e, "opening a probe socket failed");
                return None;
            }
        }
    }
    slot.as_mut()
}

impl Prober for TunnelProber {
    fn probe(&self, to: IpAddr) {
        let mut sockets = self.sockets();
        if let IpAddr::V6(v6) = to {
            if let Some(echo) = opened(&mut sockets.echo, "icmpv6", EchoSocket::open) {
                if let Err(e) = echo.send(v6) {
                    tracing::debug!(peer = %to, error = %e, "echo probe not sent");
                }
            }
        }
        let slot = if to.is_ipv6() {
            &mut sockets.udp6
        } else {
            &mut sockets.udp4
        };
        if let Some(udp) = opened(slot, "udp", || open_udp(to.is_ipv6())) {
            if let Err(e) = udp.send_to(&[], (to, DISCARD_PORT)) {
                tracing::debug!(peer = %to, error = %e, "probe not sent");
            }
        }
    }

    fn echo_replies(&self) -> HashSet<IpAddr> {
        self.sockets()
            .echo
            .as_ref()
            .map(EchoSocket::replies)
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_echo_replies_with_our_identifier_count() {
        let reply = [ICMPV6_ECHO_REPLY, 0, 0xab, 0xcd, 0x12, 0x34, 0, 1, b'w'];
        assert!(is_reply_to(&reply, 0x1234));
        assert!(!is_reply_to(&reply, 0x1235), "someone else's ping");
        let mut request = reply;
        request[0] = ICMPV6_ECHO_REQUEST;
        assert!(!is_reply_to(&request, 0x1234), "a request to us");
        assert!(!is_reply_to(&reply[..7], 0x1234), "truncated");
    }
}
