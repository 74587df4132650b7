//! A peer's status as the mesh's state machine keeps it (`docs/kubespan.md` §8.1):
//! what [`rotation`](super::rotation) and the [`planner`](super::planner) read and
//! change each round. The persisted API type, `KubeSpanPeerStatusSpec`, is made from it
//! only where the manager writes the resource, and read back into it only where a
//! restarted manager adopts what it wrote before, so the state machine never mutates
//! the API type and either can change without the other.

use std::{net::SocketAddr, time::SystemTime};

use crate::resources::kubespan::{KubeSpanPeerStatusSpec, PeerPath, PeerState};

/// One peer's status in the mesh's state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerStatus {
    /// Peer nodename (set when the status is created).
    pub label: String,
    /// Endpoint WireGuard uses (or the one just pushed).
    pub endpoint: Option<SocketAddr>,
    /// Endpoint the daemon last pushed (rotation cursor).
    pub last_used_endpoint: Option<SocketAddr>,
    /// When the daemon last pushed an endpoint.
    pub last_endpoint_change: Option<SystemTime>,
    /// Last handshake, from WireGuard.
    pub last_handshake_time: Option<SystemTime>,
    /// Bytes received.
    pub receive_bytes: i64,
    /// Bytes sent.
    pub transmit_bytes: i64,
    /// The state of the direct WireGuard path.
    pub state: PeerState,
    /// How traffic to the peer goes (§8.7).
    pub path: PeerPath,
    /// The relay for [`PeerPath::Relay`] (its label), else empty.
    pub via: String,
    /// Why the peer is programmed though discovery no longer lists it (§8.10), else
    /// empty.
    pub retained_reason: String,
}

impl From<&PeerStatus> for KubeSpanPeerStatusSpec {
    fn from(s: &PeerStatus) -> Self {
        Self {
            label: s.label.clone(),
            endpoint: s.endpoint,
            last_used_endpoint: s.last_used_endpoint,
            last_endpoint_change: s.last_endpoint_change,
            last_handshake_time: s.last_handshake_time,
            receive_bytes: s.receive_bytes,
            transmit_bytes: s.transmit_bytes,
            state: s.state,
            path: s.path,
            via: s.via.clone(),
            retained_reason: s.retained_reason.clone(),
        }
    }
}

impl From<&KubeSpanPeerStatusSpec> for PeerStatus {
    fn from(s: &KubeSpanPeerStatusSpec) -> Self {
        Self {
            label: s.label.clone(),
            endpoint: s.endpoint,
            last_used_endpoint: s.last_used_endpoint,
            last_endpoint_change: s.last_endpoint_change,
            last_handshake_time: s.last_handshake_time,
            receive_bytes: s.receive_bytes,
            transmit_bytes: s.transmit_bytes,
            state: s.state,
            path: s.path,
            via: s.via.clone(),
            retained_reason: s.retained_reason.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_survives_the_round_trip_through_the_resource_spec() {
        let status = PeerStatus {
            label: "node-b".into(),
            endpoint: Some("192.0.2.1:51820".parse().unwrap()),
            last_used_endpoint: Some("192.0.2.2:51820".parse().unwrap()),
            last_endpoint_change: Some(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(5)),
            last_handshake_time: Some(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(7)),
            receive_bytes: 11,
            transmit_bytes: 13,
            state: PeerState::Up,
            path: PeerPath::Relay,
            via: "node-c".into(),
            retained_reason: "unlisted".into(),
        };
        let spec = KubeSpanPeerStatusSpec::from(&status);
        assert_eq!(PeerStatus::from(&spec), status);
    }
}
