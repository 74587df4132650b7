//! Merge controllers (`docs/runtime.md` §4.3–§4.4): raw per-layer specs in `network-config` become
//! one merged spec per key in `network`.

use std::{collections::BTreeMap, marker::PhantomData};

use futures::future::BoxFuture;

use crate::{
    resources::network::{
        AddressSpec, AddressSpecSpec, HostnameSpec, HostnameSpecSpec, LinkSpec, LinkSpecSpec,
        ProbeSpec, ProbeSpecSpec, ResolverSpec, ResolverSpecSpec, RouteSpec, RouteSpecSpec,
        RoutingRuleSpec, RoutingRuleSpecSpec, TimeServerSpec, TimeServerSpecSpec, NS, NS_CONFIG,
    },
    runtime::{
        Action, Controller, ControllerResult, ControllerRuntime, Input, InputKind, Output, Phase,
        ResourceKind,
    },
};

/// How raw specs of one type merge.
pub trait MergeRule: ResourceKind {
    /// Controller name (`<Type>MergeController`).
    const CONTROLLER: &'static str;
    /// Merged specs by merged id, from `(raw id, spec)` pairs.
    fn merge(raw: Vec<(String, Self::Spec)>) -> BTreeMap<String, Self::Spec>;
}

/// One winner per key: sort by (layer, raw id); a later entry replaces an earlier one.
fn keyed<S: Clone>(
    mut raw: Vec<(String, S)>,
    layer: impl Fn(&S) -> crate::resources::network::ConfigLayer,
    key: impl Fn(&S) -> String,
) -> BTreeMap<String, S> {
    raw.sort_by(|(ia, a), (ib, b)| layer(a).cmp(&layer(b)).then_with(|| ia.cmp(ib)));
    let mut out = BTreeMap::new();
    for (_, s) in raw {
        let k = key(&s);
        if k.is_empty() {
            continue;
        }
        out.insert(k, s);
    }
    out
}

impl MergeRule for AddressSpec {
    const CONTROLLER: &'static str = "AddressMergeController";
    fn merge(raw: Vec<(String, AddressSpecSpec)>) -> BTreeMap<String, AddressSpecSpec> {
        keyed(
            raw,
            |s| s.layer,
            |s| {
                if s.address.is_some() {
                    s.key()
                } else {
                    String::new()
                }
            },
        )
    }
}

impl MergeRule for RouteSpec {
    const CONTROLLER: &'static str = "RouteMergeController";
    fn merge(raw: Vec<(String, RouteSpecSpec)>) -> BTreeMap<String, RouteSpecSpec> {
        keyed(raw, |s| s.layer, RouteSpecSpec::key)
    }
}

impl MergeRule for RoutingRuleSpec {
    const CONTROLLER: &'static str = "RoutingRuleMergeController";
    fn merge(raw: Vec<(String, RoutingRuleSpecSpec)>) -> BTreeMap<String, RoutingRuleSpecSpec> {
        keyed(raw, |s| s.layer, RoutingRuleSpecSpec::key)
    }
}

impl MergeRule for ProbeSpec {
    const CONTROLLER: &'static str = "ProbeMergeController";
    fn merge(raw: Vec<(String, ProbeSpecSpec)>) -> BTreeMap<String, ProbeSpecSpec> {
        keyed(raw, |s| s.layer, ProbeSpecSpec::key)
    }
}

impl MergeRule for HostnameSpec {
    const CONTROLLER: &'static str = "HostnameMergeController";
    fn merge(raw: Vec<(String, HostnameSpecSpec)>) -> BTreeMap<String, HostnameSpecSpec> {
        keyed(raw, |s| s.layer, HostnameSpecSpec::key)
    }
}

impl MergeRule for ResolverSpec {
    const CONTROLLER: &'static str = "ResolverMergeController";
    fn merge(raw: Vec<(String, ResolverSpecSpec)>) -> BTreeMap<String, ResolverSpecSpec> {
        keyed(raw, |s| s.layer, ResolverSpecSpec::key)
    }
}

impl MergeRule for TimeServerSpec {
    const CONTROLLER: &'static str = "TimeServerMergeController";
    fn merge(raw: Vec<(String, TimeServerSpecSpec)>) -> BTreeMap<String, TimeServerSpecSpec> {
        keyed(raw, |s| s.layer, TimeServerSpecSpec::key)
    }
}

impl MergeRule for LinkSpec {
    const CONTROLLER: &'static str = "LinkMergeController";
    /// Field-wise: sorted by (name, layer), the lowest layer is the base and each
    /// higher layer overrides only its non-zero fields; the result has the highest
    /// layer. A higher layer cannot force `false` or MTU 0.
    fn merge(mut raw: Vec<(String, LinkSpecSpec)>) -> BTreeMap<String, LinkSpecSpec> {
        raw.sort_by(|(ia, a), (ib, b)| {
            a.name
                .cmp(&b.name)
                .then(a.layer.cmp(&b.layer))
                .then_with(|| ia.cmp(ib))
        });
        let mut out: BTreeMap<String, LinkSpecSpec> = BTreeMap::new();
        for (_, s) in raw {
            if s.name.is_empty() {
                continue;
            }
            match out.get_mut(&s.name) {
                None => {
                    out.insert(s.name.clone(), s);
                }
                Some(m) => {
                    m.logical |= s.logical;
                    m.up |= s.up;
                    if s.mtu != 0 {
                        m.mtu = s.mtu;
                    }
                    if !s.kind.is_empty() {
                        m.kind = s.kind;
                    }
                    m.layer = m.layer.max(s.layer);
                }
            }
        }
        out
    }
}

/// The generic merge controller of type `K` (Weak on `network-config/K`, DestroyReady
/// on `network/K`, Shared output `K`).
#[derive(Debug, Default)]
pub struct MergeController<K>(PhantomData<fn() -> K>);

impl<K> MergeController<K> {
    /// A new controller.
    #[must_use]
    pub fn new() -> Self {
        Self(PhantomData)
    }
}

impl<K> Controller for MergeController<K>
where
    K: MergeRule,
    K::Spec: Default,
{
    type Event = ();

    fn name(&self) -> &str {
        K::CONTROLLER
    }

    fn inputs(&self) -> Vec<Input> {
        vec![
            Input::of::<K>(NS_CONFIG, InputKind::Weak),
            Input::of::<K>(NS, InputKind::DestroyReady),
        ]
    }

    fn outputs(&self) -> Vec<Output> {
        vec![Output::shared::<K>()]
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let raw = rt
                .list::<K>(NS_CONFIG)?
                .into_iter()
                .filter(|r| r.metadata.phase == Phase::Running)
                .map(|r| (r.metadata.id.clone(), r.spec.clone()))
                .collect();
            let mut merged = K::merge(raw);
            for out in rt.list::<K>(NS)? {
                if out.metadata.owner != rt.name() {
                    continue;
                }
                let id = &out.metadata.id;
                if !merged.contains_key(id) || out.metadata.phase == Phase::TearingDown {
                    if rt.teardown(&out.pointer())? {
                        rt.destroy(&out.pointer())?;
                    } else {
                        // Wait for DestroyReady, then recreate.
                        merged.remove(id);
                    }
                }
            }
            for (id, spec) in merged {
                rt.modify::<K>(NS, &id, |r| r.spec = spec.clone())?;
            }
            Ok(Action::await_change())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::network::ConfigLayer;

    fn link(name: &str, layer: ConfigLayer, up: bool, mtu: u32, kind: &str) -> LinkSpecSpec {
        LinkSpecSpec {
            name: name.into(),
            logical: !kind.is_empty(),
            up,
            mtu,
            kind: kind.into(),
            layer,
        }
    }

    #[test]
    fn links_merge_field_wise_and_higher_layers_cannot_zero_fields() {
        use ConfigLayer::*;
        let cases: Vec<(Vec<LinkSpecSpec>, LinkSpecSpec)> = vec![
            (
                vec![
                    link("a", Operator, false, 1500, ""),
                    link("a", Configuration, true, 0, ""),
                ],
                link("a", Configuration, true, 1500, ""),
            ),
            (
                vec![
                    link("a", Configuration, false, 0, ""),
                    link("a", Operator, true, 1420, "dummy"),
                ],
                link("a", Configuration, true, 1420, "dummy"),
            ),
            (
                vec![
                    link("a", Operator, true, 1420, ""),
                    link("a", Configuration, false, 9000, ""),
                ],
                link("a", Configuration, true, 9000, ""),
            ),
        ];
        for (input, want) in cases {
            let raw = input
                .iter()
                .enumerate()
                .map(|(i, s)| (format!("{}/{i}", s.layer.prefix()), s.clone()))
                .collect();
            let got = LinkSpec::merge(raw);
            assert_eq!(got.len(), 1);
            assert_eq!(got["a"], want, "input {input:?}");
        }
    }

    #[test]
    fn keyed_merge_higher_layer_wins_and_union_across_keys() {
        use ConfigLayer::*;
        let a = |ip: &str, layer, scope| AddressSpecSpec {
            address: Some(ip.parse().unwrap()),
            link_name: "eth0".into(),
            scope,
            layer,
        };
        let raw = vec![
            (
                "configuration/x".into(),
                a(
                    "10.0.0.1/24",
                    Configuration,
                    crate::resources::network::Scope::Host,
                ),
            ),
            (
                "operator/x".into(),
                a(
                    "10.0.0.1/24",
                    Operator,
                    crate::resources::network::Scope::Global,
                ),
            ),
            (
                "operator/y".into(),
                a(
                    "10.0.0.2/24",
                    Operator,
                    crate::resources::network::Scope::Global,
                ),
            ),
            ("operator/z".into(), AddressSpecSpec::default()),
        ];
        let got = AddressSpec::merge(raw);
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got["eth0/10.0.0.1/24"].layer, Configuration);
        assert_eq!(
            got["eth0/10.0.0.1/24"].scope,
            crate::resources::network::Scope::Host
        );
        assert_eq!(got["eth0/10.0.0.2/24"].layer, Operator);

        // Same layer: the later raw id wins.
        let r = |prio, table, id: &str| {
            (
                id.to_owned(),
                RoutingRuleSpecSpec {
                    priority: prio,
                    table,
                    layer: Operator,
                    ..RoutingRuleSpecSpec::default()
                },
            )
        };
        let got = RoutingRuleSpec::merge(vec![r(100, 2, "operator/b"), r(100, 1, "operator/a")]);
        assert_eq!(got["inet4/00100"].table, 2);
    }
}
