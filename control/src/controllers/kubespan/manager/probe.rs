//! The production [`Prober`]: an empty UDP datagram to the discard port of the peer's
//! mesh address. It reaches the peer through the tunnel (its /128 is in the peer's
//! AllowedIPs), and a live peer's WireGuard, having received data, sends at least a
//! keepalive back within 10 s; what the peer's kernel does with the datagram (a port
//! unreachable, or nothing) does not matter.

use std::{
    net::{IpAddr, Ipv6Addr, SocketAddr, UdpSocket},
    sync::Mutex,
};

use super::Prober;

/// The discard service: nothing is expected to answer on it.
const DISCARD_PORT: u16 = 9;

/// Sends probes from one unbound-address UDP socket per family, opened on first use.
#[derive(Debug, Default)]
pub struct UdpProber {
    sockets: Mutex<(Option<UdpSocket>, Option<UdpSocket>)>,
}

impl UdpProber {
    /// A prober with no socket open yet.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
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
    Ok(s)
}

impl Prober for UdpProber {
    fn probe(&self, to: IpAddr) {
        let mut sockets = self
            .sockets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let slot = if to.is_ipv6() {
            &mut sockets.0
        } else {
            &mut sockets.1
        };
        let socket = match slot {
            Some(s) => s,
            None => match open(to.is_ipv6()) {
                Ok(s) => slot.insert(s),
                Err(e) => {
                    tracing::debug!(error = %e, "opening the probe socket failed");
                    return;
                }
            },
        };
        if let Err(e) = socket.send_to(&[], (to, DISCARD_PORT)) {
            tracing::debug!(peer = %to, error = %e, "probe not sent");
        }
    }
}
