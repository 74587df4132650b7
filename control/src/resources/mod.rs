//! Resource types of the node and the controllers that do not need the data plane.

pub mod cluster;
pub mod config;
pub mod identity;
pub mod kubespan;
pub mod meta;
pub mod network;

use crate::runtime::{Definition, ResourceKind};

/// Definitions of every resource type the node serves.
#[must_use]
pub fn definitions() -> Vec<Definition> {
    vec![
        meta::ResourceDefinition::definition(),
        meta::Namespace::definition(),
        identity::NodeIdentity::definition(),
        config::MachineConfig::definition(),
        network::LinkSpec::definition(),
        network::AddressSpec::definition(),
        network::RouteSpec::definition(),
        network::RoutingRuleSpec::definition(),
        network::NodeAddress::definition(),
        network::HostnameStatus::definition(),
        cluster::ClusterIdentity::definition(),
        cluster::Affiliate::definition(),
        kubespan::KubeSpanIdentity::definition(),
        kubespan::KubeSpanConfig::definition(),
        kubespan::KubeSpanEndpoint::definition(),
        kubespan::KubeSpanPeerStatus::definition(),
        kubespan::KubeSpanPeerSpec::definition(),
        kubespan::KubeSpanManagerStatus::definition(),
    ]
}

/// Namespaces the project uses (spec §1.4) with a short description each.
pub const NAMESPACES: &[(&str, &str)] = &[
    ("config", "machine config and derived configs"),
    ("network-config", "raw per-source network specs"),
    (
        "network",
        "merged network specs, statuses, node addresses, probes",
    ),
    ("cluster", "node identity, merged affiliates, members"),
    ("cluster-raw", "per-source affiliates"),
    (
        "kubespan",
        "mesh identity, peer specs and statuses, endpoints",
    ),
    ("meta", "resource definitions and namespaces"),
];
