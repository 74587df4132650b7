//! `NodeAddress` (`docs/runtime.md` §6): the node's addresses from `AddressStatus` and
//! `LinkStatus`, without link-local, loopback, multicast and host-scope addresses and
//! without the mesh link (its name from `kubespan/KubeSpanConfig kubespan`, else
//! `kubespan`). Outputs `default` (sticky), `current`, `routed`, `accumulative` (never
//! shrinks) and `<id>-<filter>` per `NodeAddressFilter`.

use std::{cmp::Ordering, collections::BTreeMap, net::IpAddr};

use futures::future::BoxFuture;
use ipnet::IpNet;

use crate::{
    resources::{
        kubespan::KubeSpanConfig,
        network::{
            node_address, AddressStatus, AddressStatusSpec, LinkStatus, LinkStatusSpec,
            NodeAddress, NodeAddressFilter, NodeAddressFilterSpec, Scope, NS,
        },
    },
    runtime::{
        Action, Controller, ControllerResult, ControllerRuntime, Input, InputKind, Kind, Output,
        ResourceKind,
    },
};

/// Pseudo-link of platform-reported public addresses.
pub const EXTERNAL_LINK: &str = "external";
/// Mesh link name when no KubeSpanConfig says otherwise.
pub const DEFAULT_MESH_LINK: &str = "kubespan";

/// Prefix order of node addresses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SortAlgorithm {
    /// Upstream's default: address, then prefix length.
    V1,
    /// IPv4 first; same address ⇒ longer prefix first; a prefix containing the other's
    /// address after it; else by address.
    #[default]
    V2,
}

/// Compares two prefixes under `algo`.
#[must_use]
pub fn compare(algo: SortAlgorithm, a: &IpNet, b: &IpNet) -> Ordering {
    match algo {
        SortAlgorithm::V1 => a
            .addr()
            .cmp(&b.addr())
            .then(a.prefix_len().cmp(&b.prefix_len())),
        SortAlgorithm::V2 => {
            let fam = |n: &IpNet| u8::from(n.addr().is_ipv6());
            fam(a).cmp(&fam(b)).then_with(|| {
                if a.addr() == b.addr() {
                    b.prefix_len().cmp(&a.prefix_len())
                } else if a.contains(&b.addr()) && a.prefix_len() < b.prefix_len() {
                    Ordering::Greater
                } else if b.contains(&a.addr()) && b.prefix_len() < a.prefix_len() {
                    Ordering::Less
                } else {
                    a.addr().cmp(&b.addr())
                }
            })
        }
    }
}

fn sorted_dedup(algo: SortAlgorithm, mut v: Vec<IpNet>) -> Vec<IpNet> {
    v.sort_by(|a, b| compare(algo, a, b));
    v.dedup();
    v
}

fn is_link_local(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.segments()[0] & 0xffc0 == 0xfe80,
    }
}

/// Inputs of one computation.
#[derive(Debug, Default)]
pub struct Inputs<'a> {
    /// Link statuses.
    pub links: &'a [LinkStatusSpec],
    /// Address statuses (link `external` = platform public addresses).
    pub addresses: &'a [AddressStatusSpec],
    /// Mesh link name (excluded).
    pub mesh_link: &'a str,
    /// Filters by id.
    pub filters: &'a [(String, NodeAddressFilterSpec)],
    /// The previous `default`.
    pub previous_default: Option<IpNet>,
    /// The previous `accumulative` list.
    pub previous_accumulative: &'a [IpNet],
}

/// Computes every `NodeAddress` by id (`docs/runtime.md` §6).
#[must_use]
pub fn compute(algo: SortAlgorithm, inp: &Inputs<'_>) -> BTreeMap<String, Vec<IpNet>> {
    let up = |name: &str| inp.links.iter().any(|l| l.name == name && l.is_up());
    let mut kept: Vec<(&str, IpNet)> = inp
        .addresses
        .iter()
        .filter_map(|a| a.address.map(|n| (a.link_name.as_str(), n, a.scope)))
        .filter(|(link, n, scope)| {
            let ip = n.addr();
            !matches!(scope, Scope::Link | Scope::Host)
                && !ip.is_loopback()
                && !ip.is_multicast()
                && !ip.is_unspecified()
                && !is_link_local(ip)
                && *link != inp.mesh_link
        })
        .map(|(l, n, _)| (l, n))
        .collect();
    kept.sort_by(|(la, a), (lb, b)| la.cmp(lb).then_with(|| compare(algo, a, b)));

    let current = sorted_dedup(
        algo,
        kept.iter()
            .filter(|(l, _)| *l == EXTERNAL_LINK || up(l))
            .map(|(_, n)| *n)
            .collect(),
    );
    let routed = sorted_dedup(
        algo,
        kept.iter()
            .filter(|(l, _)| *l != EXTERNAL_LINK && up(l))
            .map(|(_, n)| *n)
            .collect(),
    );
    let mut accumulative = inp.previous_accumulative.to_vec();
    for (_, n) in &kept {
        if !accumulative.contains(n) {
            let pos = accumulative
                .iter()
                .position(|x| compare(algo, n, x) == Ordering::Less)
                .unwrap_or(accumulative.len());
            accumulative.insert(pos, *n);
        }
    }
    let default = inp
        .previous_default
        .filter(|d| current.contains(d))
        .or_else(|| {
            kept.iter()
                .find(|(l, _)| *l != EXTERNAL_LINK)
                .map(|(_, n)| *n)
        });

    let mut out = BTreeMap::new();
    if let Some(d) = default {
        out.insert(node_address::DEFAULT.to_owned(), vec![d]);
    }
    for (fid, f) in inp.filters {
        for (base, list) in [
            (node_address::CURRENT, &current),
            (node_address::ROUTED, &routed),
            (node_address::ACCUMULATIVE, &accumulative),
        ] {
            out.insert(
                format!("{base}-{fid}"),
                list.iter().filter(|n| f.keeps(n)).copied().collect(),
            );
        }
    }
    out.insert(node_address::CURRENT.to_owned(), current);
    out.insert(node_address::ROUTED.to_owned(), routed);
    out.insert(node_address::ACCUMULATIVE.to_owned(), accumulative);
    out
}

/// Publishes `network/NodeAddress *`.
#[derive(Debug, Default)]
pub struct NodeAddressController {
    /// Prefix order (default V2).
    pub algorithm: SortAlgorithm,
}

impl Controller for NodeAddressController {
    type Event = ();

    fn name(&self) -> &str {
        "NodeAddressController"
    }

    fn inputs(&self) -> Vec<Input> {
        vec![
            Input::of::<LinkStatus>(NS, InputKind::Weak),
            Input::of::<AddressStatus>(NS, InputKind::Weak),
            Input::of::<NodeAddressFilter>(NS, InputKind::Weak),
            Input::id_of::<KubeSpanConfig>(
                KubeSpanConfig::DEFAULT_NAMESPACE,
                "kubespan",
                InputKind::Weak,
            ),
        ]
    }

    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<NodeAddress>()]
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let links: Vec<LinkStatusSpec> = rt
                .list::<LinkStatus>(NS)?
                .iter()
                .map(|r| r.spec.clone())
                .collect();
            let addresses: Vec<AddressStatusSpec> = rt
                .list::<AddressStatus>(NS)?
                .iter()
                .map(|r| r.spec.clone())
                .collect();
            let filters: Vec<(String, NodeAddressFilterSpec)> = rt
                .list::<NodeAddressFilter>(NS)?
                .iter()
                .map(|r| (r.metadata.id.clone(), r.spec.clone()))
                .collect();
            let mesh_link = rt
                .get_opt::<KubeSpanConfig>(KubeSpanConfig::DEFAULT_NAMESPACE, "kubespan")?
                .map(|c| c.spec.config.link_name.clone())
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| DEFAULT_MESH_LINK.to_owned());
            let previous_default = rt
                .get_opt::<NodeAddress>(NS, node_address::DEFAULT)?
                .and_then(|r| r.spec.addresses.first().copied());
            let previous_accumulative = rt
                .get_opt::<NodeAddress>(NS, node_address::ACCUMULATIVE)?
                .map(|r| r.spec.addresses.clone())
                .unwrap_or_default();
            let out = compute(
                self.algorithm,
                &Inputs {
                    links: &links,
                    addresses: &addresses,
                    mesh_link: &mesh_link,
                    filters: &filters,
                    previous_default,
                    previous_accumulative: &previous_accumulative,
                },
            );
            rt.start_tracking_outputs()?;
            for (id, addrs) in out {
                rt.modify::<NodeAddress>(NS, &id, |r| r.spec.addresses.clone_from(&addrs))?;
            }
            rt.cleanup_outputs(&[Kind::new(NS, NodeAddress::TYPE)])?;
            Ok(Action::await_change())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn link(name: &str, oper: &str) -> LinkStatusSpec {
        LinkStatusSpec {
            name: name.into(),
            oper_state: oper.into(),
            carrier: true,
            physical: true,
            ..LinkStatusSpec::default()
        }
    }

    fn addr(link: &str, a: &str, scope: Scope) -> AddressStatusSpec {
        AddressStatusSpec {
            address: Some(n(a)),
            link_name: link.into(),
            scope,
            ..AddressStatusSpec::default()
        }
    }

    #[test]
    fn v2_orders_ipv4_first_longer_prefix_first_and_containers_after() {
        let mut v = vec![
            n("fd00::1/64"),
            n("10.0.0.1/8"),
            n("10.0.0.1/24"),
            n("9.0.0.1/32"),
        ];
        v.sort_by(|a, b| compare(SortAlgorithm::V2, a, b));
        assert_eq!(
            v,
            vec![
                n("9.0.0.1/32"),
                n("10.0.0.1/24"),
                n("10.0.0.1/8"),
                n("fd00::1/64")
            ]
        );
        let mut v = vec![n("10.0.0.1/24"), n("10.0.0.1/8")];
        v.sort_by(|a, b| compare(SortAlgorithm::V1, a, b));
        assert_eq!(v, vec![n("10.0.0.1/8"), n("10.0.0.1/24")]);
    }

    #[test]
    fn node_addresses_exclude_link_local_loopback_mesh_and_down_links() {
        let links = vec![
            link("eth0", "up"),
            link("eth1", "down"),
            link("kubespan", "unknown"),
            link("lo", "unknown"),
        ];
        let addresses = vec![
            addr("eth0", "192.168.1.10/24", Scope::Global),
            addr("eth0", "fe80::1/64", Scope::Link),
            addr("eth0", "169.254.3.4/16", Scope::Global),
            addr("eth1", "10.1.0.1/16", Scope::Global),
            addr("kubespan", "fd00::5/128", Scope::Global),
            addr("lo", "127.0.0.1/8", Scope::Host),
            addr(EXTERNAL_LINK, "203.0.113.7/32", Scope::Global),
        ];
        let filters = vec![(
            "no-k8s".to_owned(),
            NodeAddressFilterSpec {
                include_subnets: vec![],
                exclude_subnets: vec![n("192.168.0.0/16")],
            },
        )];
        let out = compute(
            SortAlgorithm::V2,
            &Inputs {
                links: &links,
                addresses: &addresses,
                mesh_link: "kubespan",
                filters: &filters,
                previous_default: None,
                previous_accumulative: &[n("1.1.1.1/32")],
            },
        );
        assert_eq!(out["routed"], vec![n("192.168.1.10/24")]);
        assert_eq!(
            out["current"],
            vec![n("192.168.1.10/24"), n("203.0.113.7/32")]
        );
        assert_eq!(out["default"], vec![n("192.168.1.10/24")]);
        assert_eq!(
            out["accumulative"],
            vec![
                n("1.1.1.1/32"),
                n("10.1.0.1/16"),
                n("192.168.1.10/24"),
                n("203.0.113.7/32")
            ]
        );
        assert_eq!(out["current-no-k8s"], vec![n("203.0.113.7/32")]);
        assert!(out["routed-no-k8s"].is_empty());

        // Sticky default: kept while still current.
        let addresses2 = vec![
            addr("eth0", "192.168.1.10/24", Scope::Global),
            addr("eth0", "10.0.0.1/8", Scope::Global),
        ];
        let out = compute(
            SortAlgorithm::V2,
            &Inputs {
                links: &links,
                addresses: &addresses2,
                mesh_link: "kubespan",
                previous_default: Some(n("192.168.1.10/24")),
                ..Inputs::default()
            },
        );
        assert_eq!(out["default"], vec![n("192.168.1.10/24")]);
    }
}
