//! Raw affiliates (one per source and node) merged into `cluster/Affiliate <node id>`
//! (`docs/kubespan.md` §5.1).

use std::collections::{BTreeMap, BTreeSet};

use futures::future::BoxFuture;

use super::{put, retire_stale};
use crate::{
    resources::cluster::{Affiliate, AffiliateSpec, KubeSpanAffiliateSpec, NS, NS_RAW},
    runtime::{Action, Controller, ControllerResult, ControllerRuntime, Input, InputKind, Output},
};

/// Where a raw affiliate came from, parsed from its id: the bare node ID is the local
/// node's own record, `<service>/<node id>` a discovery service's.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Source<'a> {
    /// This node (always merged first).
    Local,
    /// A discovery service, by name (merged in name order).
    Service(&'a str),
}

/// Splits a raw affiliate id into its source and node ID.
#[must_use]
pub fn parse_raw_id(id: &str) -> (Source<'_>, &str) {
    match id.split_once('/') {
        Some((service, node)) => (Source::Service(service), node),
        None => (Source::Local, id),
    }
}

/// The raw id of a discovery service's record of `node_id`.
#[must_use]
pub fn raw_id(service: &str, node_id: &str) -> String {
    format!("{service}/{node_id}")
}

fn union<T: PartialEq + Clone>(base: &mut Vec<T>, other: &[T]) {
    for item in other {
        if !base.contains(item) {
            base.push(item.clone());
        }
    }
}

fn replace_nonempty(base: &mut String, other: &str) {
    if !other.is_empty() {
        other.clone_into(base);
    }
}

/// Merges one node's records, given in source order: the first is the base; each
/// further one appends new list items (order-preserving union), replaces hostname,
/// nodename, OS, public key and KubeSpan address when non-empty, the machine type when
/// not `unknown`, and the control-plane part and wirespan extension when present.
#[must_use]
pub fn merge_affiliates<'a>(
    records: impl IntoIterator<Item = &'a AffiliateSpec>,
) -> Option<AffiliateSpec> {
    let mut records = records.into_iter();
    let mut merged = records.next()?.clone();
    for other in records {
        union(&mut merged.addresses, &other.addresses);
        replace_nonempty(&mut merged.hostname, &other.hostname);
        replace_nonempty(&mut merged.nodename, &other.nodename);
        replace_nonempty(&mut merged.operating_system, &other.operating_system);
        if !other.machine_type.is_empty() && other.machine_type != "unknown" {
            merged.machine_type.clone_from(&other.machine_type);
        }
        if other.control_plane.is_some() {
            merged.control_plane.clone_from(&other.control_plane);
        }
        if other.wirespan.is_some() {
            merged.wirespan.clone_from(&other.wirespan);
        }
        if let Some(ks) = &other.kubespan {
            let base = merged
                .kubespan
                .get_or_insert_with(KubeSpanAffiliateSpec::default);
            replace_nonempty(&mut base.public_key, &ks.public_key);
            if ks.address.is_some() {
                base.address = ks.address;
            }
            union(&mut base.additional_addresses, &ks.additional_addresses);
            union(
                &mut base.exclude_advertised_networks,
                &ks.exclude_advertised_networks,
            );
            union(&mut base.endpoints, &ks.endpoints);
        }
    }
    Some(merged)
}

/// Merges every `cluster-raw` affiliate into `cluster/Affiliate <node id>`.
#[derive(Debug, Default)]
pub struct AffiliateMergeController;

impl Controller for AffiliateMergeController {
    type Event = ();

    fn name(&self) -> &str {
        "cluster.AffiliateMergeController"
    }

    fn inputs(&self) -> Vec<Input> {
        vec![
            Input::of::<Affiliate>(NS_RAW, InputKind::Weak),
            Input::of::<Affiliate>(NS, InputKind::DestroyReady),
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
            let raw = rt.list::<Affiliate>(NS_RAW)?;
            let mut by_node: BTreeMap<&str, Vec<(Source<'_>, &AffiliateSpec)>> = BTreeMap::new();
            for r in &raw {
                let (source, node) = parse_raw_id(&r.metadata.id);
                by_node.entry(node).or_default().push((source, &r.spec));
            }
            let mut keep = BTreeSet::new();
            for (node, mut records) in by_node {
                records.sort_by(|a, b| a.0.cmp(&b.0));
                let Some(mut merged) = merge_affiliates(records.iter().map(|(_, s)| *s)) else {
                    continue;
                };
                node.clone_into(&mut merged.node_id);
                put::<Affiliate>(rt, NS, node, &merged)?;
                keep.insert(node.to_owned());
            }
            retire_stale::<Affiliate>(rt, NS, &keep)?;
            Ok(Action::await_change())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::cluster::ControlPlaneSpec;

    fn aff(hostname: &str, machine: &str, addrs: &[&str], eps: &[&str]) -> AffiliateSpec {
        AffiliateSpec {
            node_id: "n".into(),
            hostname: hostname.into(),
            nodename: hostname.into(),
            machine_type: machine.into(),
            addresses: addrs.iter().map(|a| a.parse().unwrap()).collect(),
            kubespan: (!eps.is_empty()).then(|| KubeSpanAffiliateSpec {
                public_key: format!("key-{hostname}"),
                endpoints: eps.iter().map(|e| e.parse().unwrap()).collect(),
                ..KubeSpanAffiliateSpec::default()
            }),
            ..AffiliateSpec::default()
        }
    }

    #[test]
    fn merge_unions_lists_in_order_and_replaces_scalars_only_when_set() {
        let a = aff(
            "a",
            "worker",
            &["10.0.0.1", "10.0.0.2"],
            &["10.0.0.1:51820"],
        );
        let mut b = aff(
            "",
            "unknown",
            &["10.0.0.2", "192.0.2.7"],
            &["192.0.2.7:51820", "10.0.0.1:51820"],
        );
        b.control_plane = Some(ControlPlaneSpec {
            api_server_port: 6443,
        });
        let m = merge_affiliates([&a, &b]).unwrap();
        assert_eq!(m.hostname, "a", "empty hostname must not replace");
        assert_eq!(m.machine_type, "worker", "unknown must not replace");
        let addrs: Vec<String> = m.addresses.iter().map(ToString::to_string).collect();
        assert_eq!(addrs, ["10.0.0.1", "10.0.0.2", "192.0.2.7"]);
        let ks = m.kubespan.unwrap();
        assert_eq!(
            ks.public_key, "key-",
            "non-empty key of the later source replaces"
        );
        let eps: Vec<String> = ks.endpoints.iter().map(ToString::to_string).collect();
        assert_eq!(eps, ["10.0.0.1:51820", "192.0.2.7:51820"]);
        assert_eq!(m.control_plane.unwrap().api_server_port, 6443);

        // Order matters (base = first), and is the caller's source order.
        let m = merge_affiliates([&b, &a]).unwrap();
        assert_eq!(m.hostname, "a");
        let addrs: Vec<String> = m.addresses.iter().map(ToString::to_string).collect();
        assert_eq!(addrs, ["10.0.0.2", "192.0.2.7", "10.0.0.1"]);
        assert!(merge_affiliates(std::iter::empty()).is_none());
    }

    #[test]
    fn merge_adds_kubespan_from_a_later_source() {
        let a = aff("a", "worker", &["10.0.0.1"], &[]);
        let b = aff("", "controlplane", &[], &["10.0.0.1:51820"]);
        let m = merge_affiliates([&a, &b]).unwrap();
        assert_eq!(m.machine_type, "controlplane");
        assert_eq!(m.kubespan.unwrap().endpoints.len(), 1);
    }

    #[test]
    fn raw_ids_sort_local_first_then_services_by_name() {
        let mut ids = ["zeta/n1", "n1", "alpha/n1"].map(parse_raw_id);
        ids.sort();
        assert_eq!(
            ids,
            [
                (Source::Local, "n1"),
                (Source::Service("alpha"), "n1"),
                (Source::Service("zeta"), "n1")
            ]
        );
        assert_eq!(raw_id("lab", "n1"), "lab/n1");
    }
}
