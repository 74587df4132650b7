//! This node's own affiliate (`cluster-raw/Affiliate <node id>`; spec
//! `docs/kubespan.md` §4).

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv6Addr, SocketAddr},
};

use futures::future::BoxFuture;
use ipnet::{IpNet, Ipv6Net};

use super::{put, retire_stale};
use crate::{
    config::{cluster::DiscoveryServiceConfig, kubespan::filter_ips},
    kubespan::rotation::wirespan_keepalive,
    resources::{
        cluster::{
            Affiliate, AffiliateSpec, DiscoveryServiceStatus, KubeSpanAffiliateSpec,
            WirespanAffiliateSpec, NS, NS_RAW,
        },
        config::MachineConfig,
        identity::{NodeIdentity, LOCAL},
        kubespan::{
            KubeSpanConfig, KubeSpanConfigSpec, KubeSpanIdentity, KubeSpanIdentitySpec,
            KubeSpanManagerStatus, KubeSpanManagerStatusSpec, KUBESPAN,
        },
        network::{node_address, HostnameStatus, HostnameStatusSpec, NodeAddress},
    },
    runtime::{
        Action, Controller, ControllerResult, ControllerRuntime, Input, InputKind, Output,
        ResourceKind,
    },
};

/// SideroLink's ULA prefix: never advertised as an endpoint.
pub const SIDEROLINK_PREFIX: Ipv6Net = match Ipv6Net::new(
    Ipv6Addr::new(0xfdae, 0x41e4, 0x649b, 0x9303, 0, 0, 0, 0),
    64,
) {
    Ok(n) => n,
    Err(_) => panic!("valid prefix"),
};

/// Machine type this project publishes (it runs no Kubernetes control plane).
pub const MACHINE_TYPE: &str = "worker";

/// Operating-system text published: `<name> (<version>)`.
#[must_use]
pub fn operating_system() -> String {
    format!("wirespan (v{})", env!("CARGO_PKG_VERSION"))
}

/// Everything the local affiliate is built from.
#[derive(Debug, Clone, Copy)]
pub struct LocalInputs<'a> {
    /// The node ID.
    pub node_id: &'a str,
    /// Hostname status, when known.
    pub hostname: Option<&'a HostnameStatusSpec>,
    /// `network/NodeAddress routed`.
    pub routed: &'a [IpNet],
    /// `network/NodeAddress current`.
    pub current: &'a [IpNet],
    /// The mesh identity, when it exists.
    pub kubespan_identity: Option<&'a KubeSpanIdentitySpec>,
    /// The mesh settings, when known.
    pub kubespan_config: Option<&'a KubeSpanConfigSpec>,
    /// Public IP reported by the first configured discovery service that reported one.
    pub public_ip: Option<IpAddr>,
    /// The mesh manager's status (what the node publishes about relays).
    pub kubespan_status: Option<&'a KubeSpanManagerStatusSpec>,
}

/// `nets` minus `excluded`, as a CIDR cover (order kept; split halves in address
/// order). A net inside an exclusion disappears; one containing an exclusion is split
/// down to the parts outside it.
#[must_use]
pub fn subtract_nets(nets: &[IpNet], excluded: &[IpNet]) -> Vec<IpNet> {
    fn rest(net: IpNet, excluded: &[IpNet], out: &mut Vec<IpNet>) {
        if excluded.iter().any(|e| e.contains(&net)) {
            return;
        }
        if !excluded.iter().any(|e| net.contains(e)) {
            if !out.contains(&net) {
                out.push(net);
            }
            return;
        }
        if let Ok(halves) = net.subnets(net.prefix_len() + 1) {
            halves.for_each(|h| rest(h, excluded, out));
        }
    }
    let mut out = Vec::new();
    for n in nets {
        rest(n.trunc(), excluded, &mut out);
    }
    out
}

/// The node's own affiliate (`docs/kubespan.md` §4): addresses = routed addresses without pod
/// networks and exclusions; the KubeSpan part (with endpoints per §4.2) only when the
/// mesh is enabled and its identity exists.
#[must_use]
pub fn local_affiliate(inputs: &LocalInputs<'_>) -> AffiliateSpec {
    let config = inputs
        .kubespan_config
        .map(|c| &c.config)
        .filter(|c| c.enabled);
    let pod_nets: &[IpNet] = config.map_or(&[], |c| c.advertised_networks.as_slice());
    let excluded: &[IpNet] =
        config.map_or(&[], |c| c.filters.exclude_advertised_networks.as_slice());
    let kubernetes = |ip: &IpAddr| pod_nets.iter().any(|n| n.contains(ip));
    let mut addresses: Vec<IpAddr> = Vec::new();
    for ip in inputs.routed.iter().map(IpNet::addr) {
        if !kubernetes(&ip) && !excluded.iter().any(|n| n.contains(&ip)) && !addresses.contains(&ip)
        {
            addresses.push(ip);
        }
    }
    // The own ULA is one of the node's addresses once the mesh has one (§4.1), as
    // upstream publishes it; NodeAddress leaves the mesh link out, so it joins here, in
    // address order (IPv4 first, then by address, as the routed list is sorted).
    let ula = config
        .and(inputs.kubespan_identity)
        .and_then(|i| i.address)
        .map(|a| a.addr())
        .filter(|ip| !kubernetes(ip) && !excluded.iter().any(|n| n.contains(ip)));
    if let Some(ula) = ula.filter(|ip| !addresses.contains(ip)) {
        let at = addresses
            .iter()
            .position(|a| *a > ula)
            .unwrap_or(addresses.len());
        addresses.insert(at, ula);
    }
    let (hostname, nodename) = inputs
        .hostname
        .map(|h| (h.fqdn(), h.hostname.clone()))
        .unwrap_or_default();
    let kubespan = match (config, inputs.kubespan_identity) {
        (Some(config), Some(identity)) if !identity.public_key.is_empty() => {
            let spec = inputs.kubespan_config.expect("config comes from it");
            Some(KubeSpanAffiliateSpec {
                public_key: identity.public_key.clone(),
                address: identity.address.map(|a| a.addr()),
                additional_addresses: if config.advertise_kubernetes_networks {
                    subtract_nets(&config.advertised_networks, excluded)
                } else {
                    Vec::new()
                },
                // Published as Talos does, and also pre-subtracted above, so receivers
                // that do not read the field (older Talos, or if the presumed field
                // number is wrong) compute the same AllowedIPs (`docs/kubespan.md` §4.3).
                exclude_advertised_networks: excluded.to_vec(),
                endpoints: local_endpoints(inputs, identity, spec),
            })
        }
        _ => None,
    };
    // Peers that read the extension judge this node by what it sends: tell them how
    // often it sends at least (`docs/kubespan.md` §8.6), and how it takes part in
    // relays (§8.7).
    let status = inputs.kubespan_status;
    let wirespan = kubespan
        .as_ref()
        .and(config)
        .map(|c| WirespanAffiliateSpec {
            version: wirespan_discovery::client::extension::WIRESPAN_EXTENSION_VERSION,
            persistent_keepalive_secs: u32::from(wirespan_keepalive(c.peer_receive_timeout)),
            relay_user: c.peer_relay,
            relay_offered: c.peer_relay && status.is_some_and(|st| st.relay_offered),
            direct_down: status
                .filter(|st| c.peer_relay && st.relay_offered)
                .map(|st| st.direct_down.clone())
                .unwrap_or_default(),
        });
    AffiliateSpec {
        node_id: inputs.node_id.to_owned(),
        hostname,
        nodename,
        machine_type: MACHINE_TYPE.to_owned(),
        operating_system: operating_system(),
        addresses,
        kubespan,
        control_plane: None,
        wirespan,
    }
}

/// The own endpoints in order (`docs/kubespan.md` §4.2).
fn local_endpoints(
    inputs: &LocalInputs<'_>,
    identity: &KubeSpanIdentitySpec,
    spec: &KubeSpanConfigSpec,
) -> Vec<SocketAddr> {
    let config = &spec.config;
    let own = identity.address.map(|a| a.addr());
    let mut ips: Vec<IpAddr> = Vec::new();
    for ip in inputs.current.iter().map(IpNet::addr) {
        let skip = config.advertised_networks.iter().any(|n| n.contains(&ip))
            || Some(ip) == own
            || matches!(ip, IpAddr::V6(v6) if SIDEROLINK_PREFIX.contains(&v6))
            || ips.contains(&ip);
        if !skip {
            ips.push(ip);
        }
    }
    if let Some(public) = inputs.public_ip {
        if !ips.contains(&public) {
            ips.push(public);
        }
    }
    if let Some(filters) = config.endpoint_filters() {
        ips = filter_ips(&ips, &filters);
    }
    let mut endpoints: Vec<SocketAddr> = ips
        .into_iter()
        .map(|ip| SocketAddr::new(ip, config.listen_port))
        .collect();
    for extra in &spec.extra_announced_endpoints {
        if !endpoints.contains(extra) {
            endpoints.push(*extra);
        }
    }
    endpoints
}

/// Publishes this node's affiliate while at least one discovery service is configured.
#[derive(Debug, Default)]
pub struct LocalAffiliateController;

impl Controller for LocalAffiliateController {
    type Event = ();

    fn name(&self) -> &str {
        "cluster.LocalAffiliateController"
    }

    fn inputs(&self) -> Vec<Input> {
        vec![
            MachineConfig::input(),
            Input::id_of::<NodeIdentity>(NodeIdentity::DEFAULT_NAMESPACE, LOCAL, InputKind::Weak),
            Input::of::<NodeAddress>(NodeAddress::DEFAULT_NAMESPACE, InputKind::Weak),
            Input::of::<HostnameStatus>(HostnameStatus::DEFAULT_NAMESPACE, InputKind::Weak),
            Input::id_of::<KubeSpanIdentity>(
                KubeSpanIdentity::DEFAULT_NAMESPACE,
                KUBESPAN,
                InputKind::Weak,
            ),
            Input::id_of::<KubeSpanConfig>(
                KubeSpanConfig::DEFAULT_NAMESPACE,
                KUBESPAN,
                InputKind::Weak,
            ),
            Input::of::<DiscoveryServiceStatus>(NS, InputKind::Weak),
            Input::id_of::<KubeSpanManagerStatus>(
                KubeSpanManagerStatus::DEFAULT_NAMESPACE,
                KUBESPAN,
                InputKind::Weak,
            ),
            Input::of::<Affiliate>(NS_RAW, InputKind::DestroyReady),
        ]
    }

    fn outputs(&self) -> Vec<Output> {
        vec![Output::shared::<Affiliate>()]
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let mut keep = BTreeSet::new();
            if let Some(spec) = desired(rt)? {
                put::<Affiliate>(rt, NS_RAW, &spec.node_id, &spec)?;
                keep.insert(spec.node_id);
            }
            retire_stale::<Affiliate>(rt, NS_RAW, &keep)?;
            Ok(Action::await_change())
        })
    }
}

fn desired(
    rt: &ControllerRuntime,
) -> Result<Option<AffiliateSpec>, crate::runtime::ControllerError> {
    let Some(config) = MachineConfig::active(rt)? else {
        return Ok(None);
    };
    let services: Vec<&DiscoveryServiceConfig> = config
        .spec
        .config
        .documents_of::<DiscoveryServiceConfig>()
        .collect();
    if services.is_empty() {
        return Ok(None);
    }
    let Some(identity) = rt.get_opt::<NodeIdentity>(NodeIdentity::DEFAULT_NAMESPACE, LOCAL)? else {
        return Ok(None);
    };
    let ns = NodeAddress::DEFAULT_NAMESPACE;
    let routed = rt.get_opt::<NodeAddress>(ns, node_address::ROUTED)?;
    let current = rt.get_opt::<NodeAddress>(ns, node_address::CURRENT)?;
    let hostname = rt.get_opt::<HostnameStatus>(HostnameStatus::DEFAULT_NAMESPACE, "hostname")?;
    let ks_identity =
        rt.get_opt::<KubeSpanIdentity>(KubeSpanIdentity::DEFAULT_NAMESPACE, KUBESPAN)?;
    let ks_config = rt.get_opt::<KubeSpanConfig>(KubeSpanConfig::DEFAULT_NAMESPACE, KUBESPAN)?;
    let ks_status =
        rt.get_opt::<KubeSpanManagerStatus>(KubeSpanManagerStatus::DEFAULT_NAMESPACE, KUBESPAN)?;
    // Deterministic: the first configured service that reported an address.
    let statuses = rt.list::<DiscoveryServiceStatus>(NS)?;
    let public_ip = services.iter().find_map(|s| {
        statuses
            .iter()
            .find(|st| st.metadata.id == s.name)
            .and_then(|st| st.spec.public_ip)
    });
    Ok(Some(local_affiliate(&LocalInputs {
        node_id: &identity.spec.node_id,
        hostname: hostname.as_ref().map(|h| &h.spec),
        routed: routed.as_ref().map_or(&[], |r| r.spec.addresses.as_slice()),
        current: current
            .as_ref()
            .map_or(&[], |r| r.spec.addresses.as_slice()),
        kubespan_identity: ks_identity.as_ref().map(|i| &i.spec),
        kubespan_config: ks_config.as_ref().map(|c| &c.spec),
        public_ip,
        kubespan_status: ks_status.as_ref().map(|s| &s.spec),
    })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::kubespan::KubeSpanConfigDocument as Doc;

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    fn identity() -> KubeSpanIdentitySpec {
        KubeSpanIdentitySpec {
            address: Some("fd00:1::5/128".parse().unwrap()),
            public_key: "A".repeat(43) + "=",
            ..KubeSpanIdentitySpec::default()
        }
    }

    fn eps(spec: &AffiliateSpec) -> Vec<String> {
        spec.kubespan
            .as_ref()
            .unwrap()
            .endpoints
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    #[test]
    fn endpoints_follow_the_spec_order_filters_and_extras() {
        let mut doc = Doc {
            enabled: true,
            listen_port: 51821,
            ..Doc::default()
        };
        let ks = KubeSpanConfigSpec {
            config: doc.clone(),
            extra_announced_endpoints: vec![
                "203.0.113.9:4000".parse().unwrap(),
                "10.5.0.1:51821".parse().unwrap(),
            ],
        };
        let current = nets(&[
            "10.5.0.1/24",
            "192.168.1.10/24",
            "fd00:1::5/128",
            "fdae:41e4:649b:9303::7/64",
            "2001:123:4567::1/64",
        ]);
        let id = identity();
        let inputs = LocalInputs {
            node_id: "n",
            hostname: None,
            routed: &current[..2],
            current: &current,
            kubespan_identity: Some(&id),
            kubespan_config: Some(&ks),
            public_ip: Some("198.51.100.4".parse().unwrap()),
            kubespan_status: None,
        };
        let spec = local_affiliate(&inputs);
        assert_eq!(
            eps(&spec),
            [
                "10.5.0.1:51821",
                "192.168.1.10:51821",
                "[2001:123:4567::1]:51821",
                "198.51.100.4:51821",
                "203.0.113.9:4000"
            ],
            "own ULA and SideroLink dropped, public IP appended, extras without duplicates"
        );
        let addresses: Vec<String> = spec.addresses.iter().map(ToString::to_string).collect();
        assert_eq!(
            addresses,
            ["10.5.0.1", "192.168.1.10", "fd00:1::5"],
            "routed addresses, and the own ULA (docs/kubespan.md §4.1)"
        );
        assert_eq!(spec.machine_type, "worker");

        // Spec §4.2 example: filter order, then input order.
        doc.filters.endpoints = Some(vec![
            "0.0.0.0/0".into(),
            "!192.168.0.0/16".into(),
            "2001::/16".into(),
        ]);
        let ks = KubeSpanConfigSpec {
            config: doc.clone(),
            extra_announced_endpoints: Vec::new(),
        };
        let spec = local_affiliate(&LocalInputs {
            kubespan_config: Some(&ks),
            public_ip: None,
            kubespan_status: None,
            ..inputs
        });
        assert_eq!(eps(&spec), ["10.5.0.1:51821", "[2001:123:4567::1]:51821"]);
        // An explicitly empty filter list drops every address-derived endpoint.
        doc.filters.endpoints = Some(Vec::new());
        let ks = KubeSpanConfigSpec {
            config: doc,
            extra_announced_endpoints: vec!["203.0.113.9:4000".parse().unwrap()],
        };
        let spec = local_affiliate(&LocalInputs {
            kubespan_config: Some(&ks),
            ..inputs
        });
        assert_eq!(eps(&spec), ["203.0.113.9:4000"]);
    }

    #[test]
    fn kubespan_part_needs_the_mesh_enabled_and_an_identity() {
        let ks = KubeSpanConfigSpec::default();
        let id = identity();
        let inputs = LocalInputs {
            node_id: "n",
            hostname: None,
            routed: &[],
            current: &[],
            kubespan_identity: Some(&id),
            kubespan_config: Some(&ks),
            public_ip: None,
            kubespan_status: None,
        };
        assert!(local_affiliate(&inputs).kubespan.is_none(), "disabled");
        let on = KubeSpanConfigSpec {
            config: Doc {
                enabled: true,
                ..Doc::default()
            },
            ..KubeSpanConfigSpec::default()
        };
        let with = LocalInputs {
            kubespan_config: Some(&on),
            ..inputs
        };
        assert!(local_affiliate(&with).kubespan.is_some());
        assert_eq!(
            local_affiliate(&with).addresses,
            ["fd00:1::5".parse::<IpAddr>().unwrap()],
            "the ULA is published with the mesh on"
        );
        assert!(
            local_affiliate(&inputs).addresses.is_empty(),
            "and only then"
        );
        let without = LocalInputs {
            kubespan_identity: None,
            ..with
        };
        assert!(local_affiliate(&without).kubespan.is_none(), "no identity");
    }

    #[test]
    fn exclusions_and_pod_networks_are_subtracted_before_publishing() {
        let on = KubeSpanConfigSpec {
            config: Doc {
                enabled: true,
                advertise_kubernetes_networks: true,
                advertised_networks: nets(&["10.244.0.0/16"]),
                filters: crate::config::kubespan::KubeSpanFilters {
                    exclude_advertised_networks: nets(&["10.244.128.0/17", "192.168.0.0/16"]),
                    ..crate::config::kubespan::KubeSpanFilters::default()
                },
                ..Doc::default()
            },
            ..KubeSpanConfigSpec::default()
        };
        let routed = nets(&["10.244.1.1/24", "192.168.1.10/24", "10.5.0.1/24"]);
        let id = identity();
        let spec = local_affiliate(&LocalInputs {
            node_id: "n",
            hostname: None,
            routed: &routed,
            current: &routed,
            kubespan_identity: Some(&id),
            kubespan_config: Some(&on),
            public_ip: None,
            kubespan_status: None,
        });
        let addrs: Vec<String> = spec.addresses.iter().map(ToString::to_string).collect();
        assert_eq!(addrs, ["10.5.0.1", "fd00:1::5"]);
        let ks = spec.kubespan.unwrap();
        assert_eq!(ks.additional_addresses, nets(&["10.244.0.0/17"]));
        // And published for receivers that honour them (Talos ≥ discovery-api v0.1.8).
        assert_eq!(
            ks.exclude_advertised_networks,
            nets(&["10.244.128.0/17", "192.168.0.0/16"])
        );
        assert_eq!(
            subtract_nets(&nets(&["10.0.0.0/30"]), &nets(&["10.0.0.1/32"])),
            nets(&["10.0.0.0/32", "10.0.0.2/31"])
        );
    }
}
