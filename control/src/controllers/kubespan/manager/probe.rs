//! The production [`Prober`]: an empty UDP datagram to the discard port of the peer's
//! mesh address, through the tunnel (its /128 is in the peer's AllowedIPs). A live
//! peer answers it twice over:
//!
//! - its kernel, with nothing listening on the port, returns an ICMPv6 port
//!   unreachable at once (or its firewall rejects it; a firewall that drops it
//!   leaves only the next answer). The socket has `IPV6_RECVERR` on, so the error lands on its
//!   error queue with the datagram's destination: [`Prober::kernel_replies`] reports
//!   it, and the failure detector learns which peers answer (`docs/kubespan.md` §8.6).
//!   No raw socket, so no `CAP_NET_RAW`;
//! - its WireGuard, having received data, sends at least a keepalive back within 10 s,
//!   whatever its firewall does with the datagram.
//!
//! KubeSpan mesh addresses are IPv6; an IPv4 one is probed the same way, but its
//! replies are not read.

use std::{
    collections::HashSet,
    io::IoSliceMut,
    net::{IpAddr, Ipv6Addr, SocketAddr, UdpSocket},
    os::fd::AsRawFd as _,
    sync::Mutex,
};

use nix::{
    cmsg_space,
    errno::Errno,
    sys::socket::{recvmsg, setsockopt, sockopt, ControlMessageOwned, MsgFlags, SockaddrIn6},
};

use super::Prober;

/// The discard service: nothing is expected to listen on it.
const DISCARD_PORT: u16 = 9;
/// `SO_EE_ORIGIN_ICMP6`: the error came in an ICMPv6 message.
const ORIGIN_ICMP6: u8 = 3;

#[derive(Debug, Default)]
struct Sockets {
    v6: Option<UdpSocket>,
    v4: Option<UdpSocket>,
    /// Replies taken off the error queue to clear a failed send, not reported yet.
    pending: HashSet<IpAddr>,
}

/// Sends probes from one unbound-address UDP socket per family, opened on first use.
#[derive(Debug, Default)]
pub struct UdpProber {
    sockets: Mutex<Sockets>,
}

impl UdpProber {
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

fn open(v6: bool) -> std::io::Result<UdpSocket> {
    let any: SocketAddr = if v6 {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    } else {
        ([0, 0, 0, 0], 0).into()
    };
    let s = UdpSocket::bind(any)?;
    s.set_nonblocking(true)?;
    if v6 {
        setsockopt(&s, sockopt::Ipv6RecvErr, &true)?;
    }
    Ok(s)
}

/// Whether an error-queue entry is an ICMPv6 error sent by `dest` itself: its kernel
/// answered (a port unreachable, or its firewall's reject), so it is alive and the
/// tunnel carries both ways. Not an error from a router on the way, nor a local one.
fn is_reply_from(
    err: &nix::libc::sock_extended_err,
    offender: Option<Ipv6Addr>,
    dest: Ipv6Addr,
) -> bool {
    err.ee_origin == ORIGIN_ICMP6 && offender == Some(dest)
}

/// Takes every entry off the socket's error queue (which also clears the pending
/// socket error a send would otherwise fail on); returns the peers that answered.
fn drain_errors(socket: &UdpSocket) -> HashSet<IpAddr> {
    let mut from = HashSet::new();
    let mut buf = [0u8; 64];
    let mut cmsg = cmsg_space!(nix::libc::sock_extended_err, nix::libc::sockaddr_in6);
    loop {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = match recvmsg::<SockaddrIn6>(
            socket.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_ERRQUEUE | MsgFlags::MSG_DONTWAIT,
        ) {
            Ok(m) => m,
            Err(Errno::EINTR) => continue,
            Err(Errno::EAGAIN) => return from,
            Err(e) => {
                tracing::debug!(error = %e, "reading the probe socket's error queue failed");
                return from;
            }
        };
        let Some(dest) = msg.address.map(|a| a.ip()) else {
            continue;
        };
        let Ok(cmsgs) = msg.cmsgs() else {
            continue;
        };
        for c in cmsgs {
            if let ControlMessageOwned::Ipv6RecvErr(err, offender) = c {
                let offender = offender.map(|o| Ipv6Addr::from(o.sin6_addr.s6_addr));
                if is_reply_from(&err, offender, dest) {
                    from.insert(IpAddr::V6(dest));
                }
            }
        }
    }
}

impl Prober for UdpProber {
    fn probe(&self, to: IpAddr) {
        let mut guard = self.sockets();
        let sockets = &mut *guard;
        let slot = if to.is_ipv6() {
            &mut sockets.v6
        } else {
            &mut sockets.v4
        };
        if slot.is_none() {
            match open(to.is_ipv6()) {
                Ok(s) => *slot = Some(s),
                Err(e) => {
                    tracing::debug!(error = %e, "opening the probe socket failed");
                    return;
                }
            }
        }
        let Some(socket) = slot.as_ref() else {
            return;
        };
        let mut result = socket.send_to(&[], (to, DISCARD_PORT));
        if result.is_err() && to.is_ipv6() {
            // A reply that arrived since the last drain is the socket's pending
            // error, which the send reported instead of sending: keep it, and retry.
            sockets.pending.extend(drain_errors(socket));
            result = socket.send_to(&[], (to, DISCARD_PORT));
        }
        if let Err(e) = result {
            tracing::debug!(peer = %to, error = %e, "probe not sent");
        }
    }

    fn kernel_replies(&self) -> HashSet<IpAddr> {
        let mut sockets = self.sockets();
        let mut from = std::mem::take(&mut sockets.pending);
        if let Some(s) = sockets.v6.as_ref() {
            from.extend(drain_errors(s));
        }
        from
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(origin: u8, ty: u8, code: u8) -> nix::libc::sock_extended_err {
        nix::libc::sock_extended_err {
            ee_errno: 111,
            ee_origin: origin,
            ee_type: ty,
            ee_code: code,
            ee_pad: 0,
            ee_info: 0,
            ee_data: 0,
        }
    }

    #[test]
    fn only_an_icmpv6_error_from_the_peer_itself_counts() {
        let peer: Ipv6Addr = "fd00::2".parse().unwrap();
        let router: Ipv6Addr = "fd00::1".parse().unwrap();
        // Destination unreachable: port unreachable, or administratively prohibited.
        for code in [4, 1] {
            let e = err(ORIGIN_ICMP6, 1, code);
            assert!(is_reply_from(&e, Some(peer), peer));
            assert!(
                !is_reply_from(&e, Some(router), peer),
                "a router's error says nothing of the peer"
            );
            assert!(!is_reply_from(&e, None, peer));
        }
        // A local error (origin 1) names no peer.
        assert!(!is_reply_from(&err(1, 1, 4), Some(peer), peer));
    }
}
