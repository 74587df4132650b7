//! Cluster identity and affiliates (`docs/discovery-protocol.md` §4,
//! `docs/kubespan.md` §4–§5).
//!
//! Raw affiliates, one per (discovery service, node), live in `cluster-raw` with ids
//! `<service>/<node id>`; merged affiliates in `cluster` with id = node id.

use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::{
    runtime::{Definition, ResourceKind},
    secret::Key32,
};

/// Namespace of merged affiliates, members and the identities.
pub const NS: &str = "cluster";
/// Namespace of per-service raw affiliates.
pub const NS_RAW: &str = "cluster-raw";

/// The cluster this node belongs to (`cluster/ClusterIdentity cluster`).
#[derive(Debug)]
pub struct ClusterIdentity;

/// Id of the one cluster identity.
pub const CLUSTER: &str = "cluster";

impl ResourceKind for ClusterIdentity {
    const TYPE: &'static str = "ClusterIdentities.cluster.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = NS;
    type Spec = ClusterIdentitySpec;
    fn definition() -> Definition {
        Definition::new(Self::TYPE, "ClusterIdentity", Self::DEFAULT_NAMESPACE)
            .column("Cluster ID", ".clusterId")
    }
}

/// Spec of [`ClusterIdentity`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterIdentitySpec {
    /// Opaque cluster ID (used raw for the ULA hash and discovery).
    pub cluster_id: String,
    /// The 32-byte cluster secret: discovery AES-256 key and WireGuard PSK. Never
    /// serialized.
    #[serde(skip)]
    pub secret: Key32,
}

/// An affiliate: a node of the cluster as discovery describes it.
#[derive(Debug)]
pub struct Affiliate;

impl ResourceKind for Affiliate {
    const TYPE: &'static str = "Affiliates.cluster.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = NS;
    type Spec = AffiliateSpec;
    fn definition() -> Definition {
        Definition::new(Self::TYPE, "Affiliate", Self::DEFAULT_NAMESPACE)
            .column("Hostname", ".hostname")
            .column("Machine Type", ".machineType")
            .column("Addresses", ".addresses")
    }
}

/// Spec of [`Affiliate`] (the decrypted discovery payload).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AffiliateSpec {
    /// Node ID (= the affiliate ID).
    pub node_id: String,
    /// FQDN.
    pub hostname: String,
    /// Kubernetes node name (peer label).
    pub nodename: String,
    /// `controlplane`, `worker`, `init` or `unknown`.
    pub machine_type: String,
    /// Free text, `<name> (<version>)`.
    pub operating_system: String,
    /// Routed node addresses.
    pub addresses: Vec<IpAddr>,
    /// Mesh data, when the node runs the mesh.
    pub kubespan: Option<KubeSpanAffiliateSpec>,
    /// Control-plane data, on control-plane nodes.
    pub control_plane: Option<ControlPlaneSpec>,
    /// wirespan's extension; absent for a Talos node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wirespan: Option<WirespanAffiliateSpec>,
}

/// What a wirespan node advertises beyond the upstream affiliate (`docs/kubespan.md`
/// §8.6, §8.7).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WirespanAffiliateSpec {
    /// Extension format version.
    pub version: u32,
    /// The persistent keepalive the node sets towards wirespan peers, in seconds.
    pub persistent_keepalive_secs: u32,
    /// The node sends traffic for a peer it cannot reach directly through a relay,
    /// and accepts a peer's traffic that way.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub relay_user: bool,
    /// The node forwards between two of its peers.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub relay_offered: bool,
    /// The peers the node cannot reach directly, by key id
    /// (`crate::kubespan::relay::key_id`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub direct_down: Vec<u64>,
}

/// Mesh part of an affiliate.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeSpanAffiliateSpec {
    /// WireGuard public key (base64).
    pub public_key: String,
    /// The node's KubeSpan ULA.
    pub address: Option<IpAddr>,
    /// Pod CIDRs the node advertises.
    pub additional_addresses: Vec<IpNet>,
    /// Networks the node asks peers not to route to it.
    pub exclude_advertised_networks: Vec<IpNet>,
    /// WireGuard endpoints, in the order to try them.
    pub endpoints: Vec<SocketAddr>,
}

/// Control-plane part of an affiliate.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ControlPlaneSpec {
    /// Kubernetes API server port.
    pub api_server_port: u16,
}

/// A member of the cluster (`cluster/Member <node id>`): the merged affiliate reduced
/// to what operators want to see. Derived from every merged affiliate, including this
/// node's own.
#[derive(Debug)]
pub struct Member;

impl ResourceKind for Member {
    const TYPE: &'static str = "Members.cluster.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = NS;
    type Spec = MemberSpec;
    fn definition() -> Definition {
        Definition::new(Self::TYPE, "Member", Self::DEFAULT_NAMESPACE)
            .column("Hostname", ".hostname")
            .column("Nodename", ".nodename")
            .column("Machine Type", ".machineType")
            .column("OS", ".operatingSystem")
            .column("Addresses", ".addresses")
    }
}

/// Spec of [`Member`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MemberSpec {
    /// Node ID (= the resource id).
    pub node_id: String,
    /// FQDN.
    pub hostname: String,
    /// Node name (peer label).
    pub nodename: String,
    /// `controlplane`, `worker`, `init` or `unknown`.
    pub machine_type: String,
    /// Free text.
    pub operating_system: String,
    /// Node addresses as advertised.
    pub addresses: Vec<IpAddr>,
}

/// The state of one configured discovery service's client
/// (`cluster/DiscoveryServiceStatus <service name>`).
#[derive(Debug)]
pub struct DiscoveryServiceStatus;

impl ResourceKind for DiscoveryServiceStatus {
    const TYPE: &'static str = "DiscoveryServiceStatuses.cluster.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = NS;
    type Spec = DiscoveryServiceStatusSpec;
    fn definition() -> Definition {
        Definition::new(
            Self::TYPE,
            "DiscoveryServiceStatus",
            Self::DEFAULT_NAMESPACE,
        )
        .alias("discoveryservices")
        .alias("discoveryservice")
        .column("Endpoint", ".endpoint")
        .column("Connected", ".connected")
        .column("Public IP", ".publicIp")
        .column("Affiliates", ".affiliateCount")
        .column("Last Error", ".lastError")
    }
}

/// Spec of [`DiscoveryServiceStatus`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiscoveryServiceStatusSpec {
    /// The configured endpoint URL.
    pub endpoint: String,
    /// `host:port` in use (differs from the configured one after a redirect).
    pub current_endpoint: String,
    /// Watch snapshot received: the discovered set is live.
    pub connected: bool,
    /// `backoff`, `connecting` or `connected`.
    pub connection: String,
    /// Most recent failure since the last successful connection.
    pub last_error: Option<String>,
    /// This node's address as the server saw it (Hello).
    pub public_ip: Option<IpAddr>,
    /// Affiliates of other nodes this service currently lists (decoded ones only).
    pub affiliate_count: usize,
    /// Times this node re-published its affiliate because someone else deleted or
    /// altered it on the server (since the client started).
    #[serde(default)]
    pub republishes: u64,
}
