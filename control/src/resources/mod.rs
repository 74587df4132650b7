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
        config::ConfigStatus::definition(),
        network::LinkSpec::definition(),
        network::AddressSpec::definition(),
        network::RouteSpec::definition(),
        network::RoutingRuleSpec::definition(),
        network::NodeAddress::definition(),
        network::NodeAddressFilter::definition(),
        network::HostnameStatus::definition(),
        network::ResolverStatus::definition(),
        network::HostnameSpec::definition(),
        network::ResolverSpec::definition(),
        network::TimeServerSpec::definition(),
        network::TimeServerStatus::definition(),
        network::LinkStatus::definition(),
        network::AddressStatus::definition(),
        network::RouteStatus::definition(),
        network::RoutingRuleStatus::definition(),
        network::ProbeSpec::definition(),
        network::ProbeStatus::definition(),
        network::NetworkStatus::definition(),
        cluster::ClusterIdentity::definition(),
        cluster::Affiliate::definition(),
        cluster::Member::definition(),
        cluster::DiscoveryServiceStatus::definition(),
        kubespan::KubeSpanIdentity::definition(),
        kubespan::KubeSpanConfig::definition(),
        kubespan::KubeSpanEndpoint::definition(),
        kubespan::KubeSpanRelayEndpoint::definition(),
        kubespan::KubeSpanPeerStatus::definition(),
        kubespan::KubeSpanPeerSpec::definition(),
        kubespan::KubeSpanManagerStatus::definition(),
    ]
}

/// Namespaces the project uses (`docs/runtime.md` §1.4) with a short description each.
pub const NAMESPACES: &[(&str, &str)] = &[
    ("config", "machine config, its status and derived configs"),
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

#[cfg(test)]
mod tests {
    use crate::api::resolve;

    #[test]
    fn aliases_resolve_to_the_obvious_type_and_do_not_collide() {
        let defs = super::definitions();
        for (alias, want) in [
            ("affiliates", "Affiliates.cluster.wirespan.dev"),
            ("members", "Members.cluster.wirespan.dev"),
            ("identities", "NodeIdentities.cluster.wirespan.dev"),
            ("identity", "NodeIdentities.cluster.wirespan.dev"),
            (
                "clusteridentities",
                "ClusterIdentities.cluster.wirespan.dev",
            ),
            (
                "discoveryservices",
                "DiscoveryServiceStatuses.cluster.wirespan.dev",
            ),
            ("dss", "DiscoveryServiceStatuses.cluster.wirespan.dev"),
            ("configstatus", "ConfigStatuses.config.wirespan.dev"),
            ("configstatuses", "ConfigStatuses.config.wirespan.dev"),
            ("cs", "ConfigStatuses.config.wirespan.dev"),
            ("networkstatus", "NetworkStatuses.net.wirespan.dev"),
            ("networkstatuses", "NetworkStatuses.net.wirespan.dev"),
            ("netstatus", "NetworkStatuses.net.wirespan.dev"),
            ("resolvers", "ResolverStatuses.net.wirespan.dev"),
            ("timeservers", "TimeServerStatuses.net.wirespan.dev"),
            ("hostnamespecs", "HostnameSpecs.net.wirespan.dev"),
            ("resolverspecs", "ResolverSpecs.net.wirespan.dev"),
            ("timeserverspecs", "TimeServerSpecs.net.wirespan.dev"),
        ] {
            assert_eq!(resolve(&defs, alias).unwrap().r#type, want, "{alias}");
            let claimants: Vec<&str> = defs
                .iter()
                .filter(|d| d.matches(alias))
                .map(|d| d.r#type.as_str())
                .collect();
            assert_eq!(claimants, [want], "{alias} is ambiguous");
        }
    }
}
