//! Observed state: the device as a backend reads it ([`DeviceState`]) and the
//! per-peer status published to controllers ([`WgStatus`]).

use std::{net::SocketAddr, time::SystemTime};

use ipnet::IpNet;

use super::{PresharedKey, PrivateKey, PublicKey};

/// What a userspace device dropped since its process started (`wirespan wireguard`'s
/// `stats=1`): hostile or broken input made visible.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceDrops {
    /// Datagrams dropped as malformed or unauthenticated (bad length, type, MAC, tag
    /// or counter, unknown receiver).
    pub invalid_datagrams: u64,
    /// Decrypted packets whose source is outside the sending peer's allowed IPs.
    pub spoofed_packets: u64,
    /// Packets from the TUN with no route, key or endpoint.
    pub unroutable_packets: u64,
    /// Authentic initiations refused as replays (a timestamp not newer than one
    /// taken before, or one too soon after it).
    pub replayed_initiations: u64,
    /// Handshake messages over their source's rate under load (cookie replies
    /// included).
    pub rate_limited_handshakes: u64,
}

/// A peer as the device holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevicePeer {
    /// Public key.
    pub public_key: PublicKey,
    /// Preshared key, `None` when unset (all zeros).
    pub preshared_key: Option<PresharedKey>,
    /// Endpoint WireGuard currently uses.
    pub endpoint: Option<SocketAddr>,
    /// Persistent keepalive seconds, 0 = off.
    pub persistent_keepalive: u16,
    /// Allowed IPs.
    pub allowed_ips: Vec<IpNet>,
    /// Last completed handshake.
    pub last_handshake: Option<SystemTime>,
    /// Bytes received.
    pub rx_bytes: u64,
    /// Bytes sent.
    pub tx_bytes: u64,
}

impl DevicePeer {
    /// A peer with only its key: no PSK, endpoint, keepalive, allowed IPs or traffic.
    #[must_use]
    pub fn new(public_key: PublicKey) -> Self {
        Self {
            public_key,
            preshared_key: None,
            endpoint: None,
            persistent_keepalive: 0,
            allowed_ips: Vec::new(),
            last_handshake: None,
            rx_bytes: 0,
            tx_bytes: 0,
        }
    }
}

/// The device as it is.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceState {
    /// Private key, if set.
    pub private_key: Option<PrivateKey>,
    /// Listen port (0 if none yet).
    pub listen_port: u16,
    /// fwmark, 0 = none.
    pub fwmark: u32,
    /// Peers.
    pub peers: Vec<DevicePeer>,
}

/// Per-peer observation, for status controllers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerStatus {
    /// Public key.
    pub public_key: PublicKey,
    /// Endpoint in use.
    pub endpoint: Option<SocketAddr>,
    /// Last completed handshake.
    pub last_handshake: Option<SystemTime>,
    /// Bytes received.
    pub rx_bytes: u64,
    /// Bytes sent.
    pub tx_bytes: u64,
    /// Persistent keepalive seconds as the device holds them, 0 = off.
    pub persistent_keepalive: u16,
    /// Allowed IPs as the device holds them (a restart keeps a peer it does not know
    /// yet as it is).
    pub allowed_ips: Vec<IpNet>,
}

/// Observed device.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WgStatus {
    /// Whether the device exists.
    pub present: bool,
    /// Public key of the device.
    pub public_key: Option<PublicKey>,
    /// Listen port.
    pub listen_port: u16,
    /// Peers, sorted by public key.
    pub peers: Vec<PeerStatus>,
}

impl From<&DeviceState> for WgStatus {
    fn from(d: &DeviceState) -> Self {
        let mut peers: Vec<PeerStatus> = d
            .peers
            .iter()
            .map(|p| PeerStatus {
                public_key: p.public_key.clone(),
                endpoint: p.endpoint,
                last_handshake: p.last_handshake,
                rx_bytes: p.rx_bytes,
                tx_bytes: p.tx_bytes,
                persistent_keepalive: p.persistent_keepalive,
                allowed_ips: p.allowed_ips.clone(),
            })
            .collect();
        peers.sort_by(|a, b| a.public_key.cmp(&b.public_key));
        Self {
            present: true,
            public_key: d.private_key.as_ref().map(PrivateKey::public_key),
            listen_port: d.listen_port,
            peers,
        }
    }
}
