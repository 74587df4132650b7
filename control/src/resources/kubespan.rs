//! Mesh resources shared between controllers: identity, effective mesh config and
//! harvested endpoints (`docs/kubespan.md`).

use std::{net::SocketAddr, time::SystemTime};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::{
    config::kubespan::KubeSpanConfigDocument,
    runtime::{Definition, ResourceKind},
    secret::Key32,
};

/// Namespace of the mesh resources.
pub const NS: &str = "kubespan";
/// Id of the singletons (identity, config).
pub const KUBESPAN: &str = "kubespan";

/// This node's mesh identity (`kubespan/KubeSpanIdentity kubespan`).
#[derive(Debug)]
pub struct KubeSpanIdentity;

impl ResourceKind for KubeSpanIdentity {
    const TYPE: &'static str = "KubeSpanIdentities.kubespan.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = NS;
    type Spec = KubeSpanIdentitySpec;
    fn definition() -> Definition {
        Definition::new(Self::TYPE, "KubeSpanIdentity", Self::DEFAULT_NAMESPACE)
            .column("Address", ".address")
            .column("Public Key", ".publicKey")
    }
}

/// Spec of [`KubeSpanIdentity`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeSpanIdentitySpec {
    /// The node's ULA as a /128.
    pub address: Option<IpNet>,
    /// The cluster's /64.
    pub subnet: Option<IpNet>,
    /// WireGuard public key (base64).
    pub public_key: String,
    /// Link whose MAC derived the address.
    pub mac_source_link: String,
    /// WireGuard private key; never serialized (the API and CLI never show it).
    #[serde(skip)]
    pub private_key: Key32,
}

/// The mesh settings in force (`kubespan/KubeSpanConfig kubespan`): the config
/// document with defaults applied, plus every document's extra endpoints.
#[derive(Debug)]
pub struct KubeSpanConfig;

impl ResourceKind for KubeSpanConfig {
    const TYPE: &'static str = "KubeSpanConfigs.kubespan.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = NS;
    type Spec = KubeSpanConfigSpec;
    fn definition() -> Definition {
        Definition::new(Self::TYPE, "KubeSpanConfig", Self::DEFAULT_NAMESPACE)
            .column("Enabled", ".config.enabled")
            .column("Link", ".config.linkName")
            .column("Fast Path", ".config.fastPath")
    }
}

/// Spec of [`KubeSpanConfig`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeSpanConfigSpec {
    /// The document.
    pub config: KubeSpanConfigDocument,
    /// Union of all `KubeSpanEndpointsConfig` documents.
    pub extra_announced_endpoints: Vec<SocketAddr>,
}

/// An endpoint observed for another peer, to publish for it (`harvestExtraEndpoints`;
/// id = the peer's public key).
#[derive(Debug)]
pub struct KubeSpanEndpoint;

impl ResourceKind for KubeSpanEndpoint {
    const TYPE: &'static str = "KubeSpanEndpoints.kubespan.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = NS;
    type Spec = KubeSpanEndpointSpec;
    fn definition() -> Definition {
        Definition::new(Self::TYPE, "KubeSpanEndpoint", Self::DEFAULT_NAMESPACE)
            .column("Endpoint", ".endpoint")
            .column("Affiliate ID", ".affiliateId")
    }
}

/// Spec of [`KubeSpanEndpoint`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeSpanEndpointSpec {
    /// Node ID of the peer.
    pub affiliate_id: String,
    /// The endpoint WireGuard uses for it.
    pub endpoint: Option<SocketAddr>,
}

/// The server relay's allocation for one peer (`docs/kubespan.md` §8.8; id = the
/// peer's public key): where this node's WireGuard sends the peer's packets while no
/// other path works.
#[derive(Debug)]
pub struct KubeSpanRelayEndpoint;

impl ResourceKind for KubeSpanRelayEndpoint {
    const TYPE: &'static str = "KubeSpanRelayEndpoints.kubespan.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = NS;
    type Spec = KubeSpanRelayEndpointSpec;
    fn definition() -> Definition {
        Definition::new(Self::TYPE, "KubeSpanRelayEndpoint", Self::DEFAULT_NAMESPACE)
            .column("Endpoint", ".endpoint")
            .column("Service", ".service")
            .column("Affiliate ID", ".affiliateId")
    }
}

/// Spec of [`KubeSpanRelayEndpoint`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeSpanRelayEndpointSpec {
    /// Node ID of the peer.
    pub affiliate_id: String,
    /// The relay's UDP endpoint for this node's side of the pair.
    pub endpoint: Option<SocketAddr>,
    /// The discovery service that granted it.
    pub service: String,
}

/// A peer that needs the server relay (no direct path, no peer relay).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServerRelayWant {
    /// The peer's public key.
    pub public_key: String,
    /// Its node ID (affiliate id).
    pub affiliate_id: String,
}

/// Peer state (`docs/kubespan.md` §8.1), shown lowercase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PeerState {
    /// No handshake yet on the current endpoint (or never pushed).
    #[default]
    Unknown,
    /// Handshaking.
    Up,
    /// No handshake for too long.
    Down,
}

impl PeerState {
    /// The lowercase name.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::Up => "up",
            Self::Down => "down",
        }
    }
}

/// A WireGuard peer derived from an affiliate (`kubespan/KubeSpanPeerSpec <public
/// key>`).
#[derive(Debug)]
pub struct KubeSpanPeerSpec;

impl ResourceKind for KubeSpanPeerSpec {
    const TYPE: &'static str = "KubeSpanPeerSpecs.kubespan.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = NS;
    type Spec = KubeSpanPeerSpecSpec;
    fn definition() -> Definition {
        Definition::new(Self::TYPE, "KubeSpanPeerSpec", Self::DEFAULT_NAMESPACE)
            .alias("peerspecs")
            .column("Label", ".label")
            .column("Endpoints", ".endpoints")
            .column("Allowed IPs", ".allowedIps")
    }
}

/// Spec of [`KubeSpanPeerSpec`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeSpanPeerSpecSpec {
    /// The affiliate (node) ID.
    pub node_id: String,
    /// Peer nodename.
    pub label: String,
    /// Its KubeSpan ULA.
    pub address: Option<std::net::IpAddr>,
    /// WireGuard AllowedIPs after overlap resolution (`docs/kubespan.md` §5.3).
    pub allowed_ips: Vec<IpNet>,
    /// Ranges the peer claimed that earlier peers (node-ID order) already had.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overlap_removed: Vec<IpNet>,
    /// Endpoints in the order to try them.
    pub endpoints: Vec<SocketAddr>,
    /// The peer's wirespan extension: a wirespan peer is also judged by what it
    /// sends (`peerReceiveTimeout`); absent for a Talos peer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wirespan: Option<crate::resources::cluster::WirespanAffiliateSpec>,
}

/// A peer's live state (`kubespan/KubeSpanPeerStatus <public key>`; alias `peers`).
#[derive(Debug)]
pub struct KubeSpanPeerStatus;

impl ResourceKind for KubeSpanPeerStatus {
    const TYPE: &'static str = "KubeSpanPeerStatuses.kubespan.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = NS;
    type Spec = KubeSpanPeerStatusSpec;
    fn definition() -> Definition {
        Definition::new(Self::TYPE, "KubeSpanPeerStatus", Self::DEFAULT_NAMESPACE)
            .alias("peers")
            .alias("peerstatuses")
            .column("Label", ".label")
            .column("Endpoint", ".endpoint")
            .column("State", ".state")
            .column("Path", ".path")
            .column("Via", ".via")
            .column("Last Handshake", ".lastHandshakeTime")
            .column("Rx", ".receiveBytes")
            .column("Tx", ".transmitBytes")
            .column("Retained", ".retainedReason")
    }
}

/// Spec of [`KubeSpanPeerStatus`] (`docs/kubespan.md` §8.1).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeSpanPeerStatusSpec {
    /// Peer nodename (set when the status is created).
    pub label: String,
    /// Endpoint WireGuard uses (or the one just pushed).
    pub endpoint: Option<SocketAddr>,
    /// Endpoint the daemon last pushed (rotation cursor).
    pub last_used_endpoint: Option<SocketAddr>,
    /// When the daemon last pushed an endpoint.
    #[serde(with = "rfc3339_opt")]
    pub last_endpoint_change: Option<SystemTime>,
    /// Last handshake, from WireGuard.
    #[serde(with = "rfc3339_opt")]
    pub last_handshake_time: Option<SystemTime>,
    /// Bytes received.
    pub receive_bytes: i64,
    /// Bytes sent.
    pub transmit_bytes: i64,
    /// up, down or unknown: the state of the direct WireGuard path.
    pub state: PeerState,
    /// How traffic to the peer goes (`docs/kubespan.md` §8.7).
    #[serde(default)]
    pub path: PeerPath,
    /// The relay for [`PeerPath::Relay`] (its label), else empty.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub via: String,
    /// Why the peer is programmed though discovery no longer lists it (`docs/kubespan.md`
    /// §8.10), else empty.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub retained_reason: String,
}

/// How traffic reaches a peer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PeerPath {
    /// Not known to work yet (the peer is not up and has no relay).
    #[default]
    None,
    /// Straight to the peer's endpoint.
    Direct,
    /// Through another wirespan node.
    Relay,
    /// Through the discovery server's relay.
    Server,
}

impl PeerPath {
    /// As shown and exported.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Direct => "direct",
            Self::Relay => "relay",
            Self::Server => "server",
        }
    }
}

/// What the mesh manager runs on (`kubespan/KubeSpanManagerStatus kubespan`).
#[derive(Debug)]
pub struct KubeSpanManagerStatus;

impl ResourceKind for KubeSpanManagerStatus {
    const TYPE: &'static str = "KubeSpanManagerStatuses.kubespan.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = NS;
    type Spec = KubeSpanManagerStatusSpec;
    fn definition() -> Definition {
        Definition::new(Self::TYPE, "KubeSpanManagerStatus", Self::DEFAULT_NAMESPACE)
            .column("Link", ".linkName")
            .column("WireGuard", ".wireguard")
            .column("Fast Path", ".fastPath")
            .column("Peers", ".peers")
            .column("Relay", ".relayOffered")
            .column("Note", ".note")
    }
}

/// Spec of [`KubeSpanManagerStatus`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeSpanManagerStatusSpec {
    /// The WireGuard link.
    pub link_name: String,
    /// WireGuard implementation running the link (`kernel`, `userspace` for `wirespan
    /// wireguard`, `userspace-go` for wireguard-go); empty
    /// before the device is programmed, and in statuses written by older daemons.
    #[serde(default)]
    pub wireguard: String,
    /// Marking in use (`nftables` or `ebpf`).
    pub fast_path: String,
    /// Number of peers programmed.
    pub peers: usize,
    /// Why the configured fast path is not in use, if it is not.
    pub note: String,
    /// Whether the node forwards for peer relays (§8.7).
    #[serde(default)]
    pub relay_offered: bool,
    /// Why it does not, when relays are configured but not offered.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub relay_note: String,
    /// Peers whose direct path is down, by relay key id (published to peers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub direct_down: Vec<u64>,
    /// Peers reachable by neither a direct path nor a peer relay: the server relay is
    /// asked for them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub server_relay_wanted: Vec<ServerRelayWant>,
}

/// `Option<SystemTime>` as RFC 3339 text (`null` when unset).
mod rfc3339_opt {
    use std::time::SystemTime;

    use serde::{Deserialize as _, Deserializer, Serializer};

    #[allow(clippy::ref_option)]
    pub fn serialize<S: Serializer>(t: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
        match t {
            Some(t) => s.serialize_str(&humantime::format_rfc3339_seconds(*t).to_string()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SystemTime>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|s| humantime::parse_rfc3339_weak(&s).map_err(serde::de::Error::custom))
            .transpose()
    }
}
