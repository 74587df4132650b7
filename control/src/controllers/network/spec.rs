//! Spec controllers (`docs/runtime.md` §4.5): apply merged `network/XSpec` to the kernel, with a
//! finalizer on each spec so a spec that goes away takes its kernel object with it.
//! The adapter only ever removes objects wirespan made.

use std::{
    collections::{BTreeMap, BTreeSet},
    marker::PhantomData,
    net::IpAddr,
    time::Duration,
};

use futures::future::BoxFuture;
use ipnet::IpNet;
use tokio::time::Instant;
use wirespan_dataplane::routing::{
    AddressParams, LinkParams, MarkedObject, NetworkConfig, NetworkState, Owner, RouteParams,
    RoutingError, RuleParams, RTPROT_WIRESPAN_CONFIG,
};

use super::{
    route_kind, scope_number,
    sweep::{Sweep, SWEEP_SETTLE},
    Deps,
};
use crate::{
    resources::{
        config::MachineConfig,
        network::{
            AddressSpec, ConfigLayer, Family, LinkSpec, RouteSpec, RoutingRuleSpec, NS, TABLE_MAIN,
        },
    },
    runtime::{
        Action, Controller, ControllerError, ControllerResult, ControllerRuntime, Input, InputKind,
        Output, Phase, ResourceKind, Triggers,
    },
};

/// How one spec type reaches the kernel.
pub trait KernelObject: ResourceKind {
    /// Controller name (also its finalizer).
    const CONTROLLER: &'static str;
    /// Converges the kernel object; `Ok(false)` = nothing to do.
    ///
    /// # Errors
    /// Those of the adapter.
    fn apply(net: &mut dyn NetworkConfig, spec: &Self::Spec) -> Result<bool, RoutingError>;
    /// Removes the kernel object if wirespan made it.
    ///
    /// # Errors
    /// Those of the adapter.
    fn remove(net: &mut dyn NetworkConfig, spec: &Self::Spec) -> Result<bool, RoutingError>;
    /// What identifies the kernel object of a spec (what the adapter matches on),
    /// for the start-up sweep ([`super::sweep`]).
    type Key: Ord + Clone + std::fmt::Debug + Send;
    /// The key of a spec's kernel object (`None`: it makes none).
    fn key(spec: &Self::Spec) -> Option<Self::Key>;
    /// The kernel objects of this kind that carry the network documents' marker
    /// (212, or the link alias), by key: the sweep's candidates. Never the mesh's
    /// (211) nor foreign ones.
    fn config_marked(state: &NetworkState) -> Vec<(Self::Key, MarkedObject)>;
}

/// A route's identity in the adapter: destination, gateway, table and priority (IPv6
/// priority 0 is the kernel's 1024).
type RouteKey = (IpNet, Option<IpAddr>, u32, u32);

fn route_key(destination: IpNet, gateway: Option<IpAddr>, table: u32, priority: u32) -> RouteKey {
    let priority = if destination.addr().is_ipv6() && priority == 0 {
        1024
    } else {
        priority
    };
    (destination, gateway, table, priority)
}

/// Whose marker a merged spec's kernel object carries: the operator layer is the
/// mesh manager's (protocol 211), every other layer comes from the user's network
/// documents or defaults (212). The mesh's teardown removes only the former.
#[must_use]
pub fn owner_of(layer: ConfigLayer) -> Owner {
    if layer == ConfigLayer::Operator {
        Owner::Mesh
    } else {
        Owner::Config
    }
}

fn link_params(s: &crate::resources::network::LinkSpecSpec) -> LinkParams {
    LinkParams {
        name: s.name.clone(),
        logical: s.logical,
        kind: s.kind.clone(),
        up: s.up,
        mtu: s.mtu,
    }
}

impl KernelObject for LinkSpec {
    const CONTROLLER: &'static str = "LinkSpecController";
    fn apply(net: &mut dyn NetworkConfig, s: &Self::Spec) -> Result<bool, RoutingError> {
        net.apply_link(&link_params(s))
    }
    fn remove(net: &mut dyn NetworkConfig, s: &Self::Spec) -> Result<bool, RoutingError> {
        if s.logical {
            net.remove_link(&s.name)
        } else {
            Ok(false)
        }
    }
    type Key = String;
    fn key(s: &Self::Spec) -> Option<String> {
        Some(s.name.clone())
    }
    fn config_marked(state: &NetworkState) -> Vec<(String, MarkedObject)> {
        // Only logical links from LinkConfig carry the alias (the WireGuard link is
        // the backend's and has none).
        state
            .links
            .iter()
            .filter(|l| l.ours && !l.kind.is_empty())
            .map(|l| (l.name.clone(), MarkedObject::Link(l.name.clone())))
            .collect()
    }
}

fn address_params(s: &crate::resources::network::AddressSpecSpec) -> Option<AddressParams> {
    Some(AddressParams {
        link: s.link_name.clone(),
        address: s.address?,
        scope: scope_number(s.scope),
        owner: owner_of(s.layer),
    })
}

impl KernelObject for AddressSpec {
    const CONTROLLER: &'static str = "AddressSpecController";
    fn apply(net: &mut dyn NetworkConfig, s: &Self::Spec) -> Result<bool, RoutingError> {
        address_params(s).map_or(Ok(false), |p| net.apply_address(&p))
    }
    fn remove(net: &mut dyn NetworkConfig, s: &Self::Spec) -> Result<bool, RoutingError> {
        address_params(s).map_or(Ok(false), |p| net.remove_address(&p))
    }
    /// Link name and address.
    type Key = (String, IpNet);
    fn key(s: &Self::Spec) -> Option<Self::Key> {
        Some((s.link_name.clone(), s.address?))
    }
    fn config_marked(state: &NetworkState) -> Vec<(Self::Key, MarkedObject)> {
        let name_of = |index: u32| state.links.iter().find(|l| l.index == index);
        state
            .addresses
            .iter()
            .filter(|a| a.protocol == RTPROT_WIRESPAN_CONFIG)
            .filter_map(|a| {
                let link = name_of(a.link_index)?;
                Some((
                    (link.name.clone(), a.address),
                    MarkedObject::Address(a.clone()),
                ))
            })
            .collect()
    }
}

/// Kernel parameters of a route spec.
#[must_use]
pub fn route_params(s: &crate::resources::network::RouteSpecSpec) -> RouteParams {
    let destination = s.destination.unwrap_or(match s.family {
        Family::Inet4 => IpNet::new(IpAddr::from([0u8; 4]), 0).expect("valid"),
        Family::Inet6 => IpNet::new(IpAddr::from([0u8; 16]), 0).expect("valid"),
    });
    RouteParams {
        destination,
        gateway: s.gateway,
        source: s.source,
        out_link_name: s.out_link_name.clone(),
        table: if s.table == 0 { TABLE_MAIN } else { s.table },
        priority: s.priority,
        scope: scope_number(s.scope),
        kind: route_kind(s.r#type),
        mtu: s.mtu,
        owner: owner_of(s.layer),
    }
}

impl KernelObject for RouteSpec {
    const CONTROLLER: &'static str = "RouteSpecController";
    fn apply(net: &mut dyn NetworkConfig, s: &Self::Spec) -> Result<bool, RoutingError> {
        net.apply_route(&route_params(s))
    }
    fn remove(net: &mut dyn NetworkConfig, s: &Self::Spec) -> Result<bool, RoutingError> {
        net.remove_route(&route_params(s))
    }
    type Key = RouteKey;
    fn key(s: &Self::Spec) -> Option<RouteKey> {
        let p = route_params(s);
        Some(route_key(p.destination, p.gateway, p.table, p.priority))
    }
    fn config_marked(state: &NetworkState) -> Vec<(RouteKey, MarkedObject)> {
        state
            .routes
            .iter()
            .filter(|r| r.protocol == RTPROT_WIRESPAN_CONFIG)
            .map(|r| {
                let k = route_key(r.destination, r.gateway, r.table, r.priority);
                (k, MarkedObject::Route(r.clone()))
            })
            .collect()
    }
}

fn rule_params(s: &crate::resources::network::RoutingRuleSpecSpec) -> RuleParams {
    RuleParams {
        v6: s.family == Family::Inet6,
        src: s.src,
        dst: s.dst,
        table: s.table,
        priority: s.priority,
        fw_mark: s.fw_mark,
        fw_mask: s.fw_mask,
        owner: owner_of(s.layer),
    }
}

impl KernelObject for RoutingRuleSpec {
    const CONTROLLER: &'static str = "RoutingRuleSpecController";
    fn apply(net: &mut dyn NetworkConfig, s: &Self::Spec) -> Result<bool, RoutingError> {
        net.apply_rule(&rule_params(s))
    }
    fn remove(net: &mut dyn NetworkConfig, s: &Self::Spec) -> Result<bool, RoutingError> {
        net.remove_rule(&rule_params(s))
    }
    /// Family (IPv6) and priority: one rule of ours per priority.
    type Key = (bool, u32);
    fn key(s: &Self::Spec) -> Option<(bool, u32)> {
        Some((s.family == Family::Inet6, s.priority))
    }
    fn config_marked(state: &NetworkState) -> Vec<((bool, u32), MarkedObject)> {
        state
            .rules
            .iter()
            .filter(|r| r.protocol == RTPROT_WIRESPAN_CONFIG)
            .map(|r| ((r.v6, r.priority), MarkedObject::Rule(r.clone())))
            .collect()
    }
}

/// How often every spec controller re-applies every spec although nothing woke it:
/// repairs drift the netlink events do not show (or a missed event), and retries
/// objects the kernel rejected.
pub const RESYNC: Duration = Duration::from_secs(30);

/// The annotation on a merged spec holding why its kernel object could not be applied
/// (absent when it was); shown by `wirespan get` in the specs' `Error` column.
pub const ERROR_ANNOTATION: &str = "error";

/// Applies `network/K` specs (Strong input; no outputs).
///
/// Every spec is applied on its own: a kernel rejection (unreachable gateway,
/// non-local source, MTU above the device's maximum, unknown link kind, missing link)
/// is recorded on that spec ([`ERROR_ANNOTATION`]) and logged once per change, and
/// the others still go in; it is retried on the next kernel event or resync.
#[derive(Debug)]
pub struct SpecController<K: KernelObject> {
    deps: Deps,
    resync: Duration,
    settle: Duration,
    sweep: Sweep<K::Key>,
    _kind: PhantomData<fn() -> K>,
}

impl<K: KernelObject> SpecController<K> {
    /// A controller using `deps.net`, woken by `deps.feed` and a [`RESYNC`] after its
    /// last round.
    #[must_use]
    pub fn new(deps: Deps) -> Self {
        Self::with_resync(deps, RESYNC)
    }

    /// Same, with another resync period (tests).
    #[must_use]
    pub fn with_resync(deps: Deps, resync: Duration) -> Self {
        Self::with_timing(deps, resync, SWEEP_SETTLE)
    }

    /// Same, with another resync period and sweep settle time (tests).
    #[must_use]
    pub fn with_timing(deps: Deps, resync: Duration, settle: Duration) -> Self {
        Self {
            deps,
            resync,
            settle,
            sweep: Sweep::new(settle),
            _kind: PhantomData,
        }
    }
}

impl<K> Controller for SpecController<K>
where
    K: KernelObject,
    K::Spec: Clone + Send,
{
    type Event = ();

    fn name(&self) -> &str {
        K::CONTROLLER
    }

    fn inputs(&self) -> Vec<Input> {
        // The active config only tells the sweep that a config is in force.
        vec![
            Input::of::<K>(NS, InputKind::Strong),
            MachineConfig::input(),
        ]
    }

    fn outputs(&self) -> Vec<Output> {
        Vec::new()
    }

    fn start(&mut self, _rt: &mut ControllerRuntime) -> Result<Triggers<()>, ControllerError> {
        // Kernel events (a link appearing, an object deleted from outside) and the
        // resync start a round.
        self.sweep = Sweep::new(self.settle);
        let events = self.deps.feed.subscribe().map_err(ControllerError::other)?;
        Ok(Triggers::inputs_only()
            .with_events(events)
            .with_resync(self.resync))
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            self.round(rt).await?;
            Ok(match self.sweep_round(rt).await? {
                Some(at) => Action::requeue_at(at),
                None => Action::await_change(),
            })
        })
    }
}

impl<K> SpecController<K>
where
    K: KernelObject,
    K::Spec: Clone + Send,
{
    /// The start-up sweep ([`super::sweep`]): removes marked kernel objects no spec
    /// names once they stayed so for the settle time with a config in force. Returns
    /// when to look again.
    async fn sweep_round(
        &mut self,
        rt: &mut ControllerRuntime,
    ) -> Result<Option<Instant>, ControllerError> {
        if !self.sweep.active() {
            return Ok(None);
        }
        let loaded = MachineConfig::active(rt)?.is_some();
        let (mut marked, mut wanted) = (BTreeMap::new(), BTreeSet::new());
        if loaded {
            let state = super::read_state(&self.deps.net).await?;
            marked = K::config_marked(&state).into_iter().collect();
            // Every phase: a tearing-down spec's object is its finalizer's to remove.
            wanted = rt
                .list::<K>(NS)?
                .iter()
                .filter_map(|r| K::key(&r.spec))
                .collect();
        }
        let keys: BTreeSet<K::Key> = marked.keys().cloned().collect();
        let now = Instant::now();
        let plan = self.sweep.plan(loaded, &keys, &wanted, now);
        let mut recheck_at = plan.recheck_at;
        for key in plan.remove {
            let Some(object) = marked.remove(&key) else {
                continue;
            };
            let net = self.deps.net.clone();
            let res = tokio::task::spawn_blocking(move || {
                net.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .remove_marked(&object)
            })
            .await
            .map_err(ControllerError::other)?;
            match res {
                Ok(removed) => tracing::info!(controller = K::CONTROLLER, key = ?key, removed,
                    "swept a kernel object from the network documents that no spec names"),
                Err(e) => {
                    tracing::warn!(controller = K::CONTROLLER, key = ?key, error = %e,
                        "could not sweep a leftover kernel object; retrying");
                    recheck_at =
                        Some(recheck_at.map_or(now + self.settle, |t| t.min(now + self.settle)));
                }
            }
        }
        Ok(recheck_at)
    }

    async fn round(&mut self, rt: &mut ControllerRuntime) -> Result<(), ControllerError> {
        let name = K::CONTROLLER;
        for (r, op) in round_work::<K>(rt, name)? {
            let (net, spec) = (self.deps.net.clone(), r.spec.clone());
            let res = tokio::task::spawn_blocking(move || {
                let mut g = net
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                match op {
                    Op::Apply => K::apply(&mut *g, &spec),
                    Op::Remove => K::remove(&mut *g, &spec),
                }
            })
            .await
            .map_err(ControllerError::other)?;
            let res = match res {
                // The link is gone and took the object with it; or never applied, so
                // nothing to remove.
                Err(RoutingError::LinkNotFound(_) | RoutingError::Invalid(_))
                    if op == Op::Remove =>
                {
                    Ok(false)
                }
                // Kept on this object; retried on the next event or resync.
                other => other.map_err(|e| e.to_string()),
            };
            record_outcome(rt, &r, name, op, "kernel", res)?;
        }
        Ok(())
    }
}

/// What a spec controller does with one spec in a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Op {
    /// Converge the object to the running spec.
    Apply,
    /// Remove the object of a tearing-down spec.
    Remove,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Self::Apply => "apply",
            Self::Remove => "remove",
        }
    }
}

/// A spec as listed from the store.
pub(super) type SpecRef<K> = std::sync::Arc<crate::runtime::Resource<K>>;

/// One round's work of a finalizer-holding spec controller (this one and the host
/// family's): tearing-down specs that still carry `finalizer` first (links: remove
/// before create), then the running ones, each given the finalizer.
///
/// # Errors
/// Store access.
pub(super) fn round_work<K: ResourceKind>(
    rt: &mut ControllerRuntime,
    finalizer: &str,
) -> Result<Vec<(SpecRef<K>, Op)>, ControllerError> {
    let specs = rt.list::<K>(NS)?;
    let mut work = Vec::new();
    for r in &specs {
        if r.metadata.phase == Phase::TearingDown && r.metadata.finalizers.contains(finalizer) {
            work.push((r.clone(), Op::Remove));
        }
    }
    for r in specs.iter().filter(|r| r.metadata.phase == Phase::Running) {
        rt.add_finalizer(&r.pointer(), &[finalizer])?;
        work.push((r.clone(), Op::Apply));
    }
    Ok(work)
}

/// Records how one spec's apply or removal went (`Ok(wrote)` or the error's text): a
/// done removal drops `finalizer`; the error sits in the [`ERROR_ANNOTATION`], logged
/// once per change. `target` names what was changed in the logs (`kernel`, `host`).
///
/// # Errors
/// Store access.
pub(super) fn record_outcome<K: ResourceKind>(
    rt: &mut ControllerRuntime,
    r: &crate::runtime::Resource<K>,
    finalizer: &str,
    op: Op,
    target: &str,
    res: Result<bool, String>,
) -> Result<(), ControllerError> {
    let ptr = r.pointer();
    let op_name = op.name();
    let error = match res {
        Ok(wrote) => {
            if wrote {
                tracing::info!(id = %ptr.id, op = op_name, target, "updated");
            }
            if op == Op::Remove {
                rt.remove_finalizer(&ptr, &[finalizer])?;
            }
            None
        }
        Err(e) => Some(e),
    };
    if r.metadata.annotations.get(ERROR_ANNOTATION) != error.as_ref() {
        match &error {
            Some(e) => tracing::warn!(id = %ptr.id, op = op_name, target,
                error = %e, "not applied; others continue"),
            None => tracing::info!(id = %ptr.id, target, "applied after an earlier error"),
        }
        // A removed spec's annotation is not cleared: the spec is going.
        if op == Op::Apply || error.is_some() {
            rt.set_annotation(&ptr, ERROR_ANNOTATION, error.as_deref())?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use wirespan_dataplane::routing::{
        ObservedAddress, ObservedLink, ObservedRoute, ObservedRule, RouteKind, RTPROT_WIRESPAN,
    };

    use super::*;
    use crate::resources::network::{AddressSpecSpec, RouteSpecSpec};

    fn route(dst: &str, protocol: u8, priority: u32) -> ObservedRoute {
        ObservedRoute {
            destination: dst.parse().unwrap(),
            gateway: None,
            source: None,
            oif: Some(2),
            table: TABLE_MAIN,
            priority,
            scope: 0,
            kind: RouteKind::Unicast,
            protocol,
        }
    }

    fn rule(priority: u32, protocol: u8) -> ObservedRule {
        ObservedRule {
            v6: false,
            src: None,
            dst: None,
            table: 100,
            priority,
            fw_mark: 0,
            fw_mask: 0,
            protocol,
        }
    }

    fn address(ip: &str, protocol: u8) -> ObservedAddress {
        ObservedAddress {
            link_index: 2,
            address: ip.parse().unwrap(),
            scope: 0,
            local: None,
            broadcast: None,
            flags: 0,
            ours: protocol != 0,
            protocol,
        }
    }

    fn state() -> NetworkState {
        let link = |index, name: &str, kind: &str, ours| ObservedLink {
            index,
            name: name.into(),
            kind: kind.into(),
            ours,
            ..ObservedLink::default()
        };
        NetworkState {
            links: vec![
                link(2, "eth0", "", false),
                link(3, "br-doc", "bridge", true),
                link(4, "br-foreign", "bridge", false),
                link(5, "kubespan", "wireguard", false),
            ],
            addresses: vec![
                address("10.0.0.1/24", 0),
                address("10.0.0.2/24", RTPROT_WIRESPAN),
                address("10.0.0.3/24", RTPROT_WIRESPAN_CONFIG),
            ],
            routes: vec![
                route("10.1.0.0/16", 0, 0),
                route("10.2.0.0/16", RTPROT_WIRESPAN, 0),
                route("10.3.0.0/16", RTPROT_WIRESPAN_CONFIG, 0),
                route("fd00::/64", RTPROT_WIRESPAN_CONFIG, 1024),
            ],
            rules: vec![
                rule(1000, 0),
                rule(1001, RTPROT_WIRESPAN),
                rule(1002, RTPROT_WIRESPAN_CONFIG),
            ],
        }
    }

    fn keys<K>(v: Vec<(K, MarkedObject)>) -> Vec<K> {
        v.into_iter().map(|(k, _)| k).collect()
    }

    #[test]
    fn only_objects_with_the_documents_marker_are_sweep_candidates() {
        let s = state();
        assert_eq!(keys(LinkSpec::config_marked(&s)), vec!["br-doc".to_owned()]);
        assert_eq!(
            keys(AddressSpec::config_marked(&s)),
            vec![("eth0".to_owned(), "10.0.0.3/24".parse().unwrap())]
        );
        let routes = keys(RouteSpec::config_marked(&s));
        let dsts: Vec<String> = routes.iter().map(|k| k.0.to_string()).collect();
        assert_eq!(dsts, ["10.3.0.0/16", "fd00::/64"]);
        assert_eq!(
            keys(RoutingRuleSpec::config_marked(&s)),
            vec![(false, 1002)]
        );
    }

    #[test]
    fn spec_keys_match_what_the_kernel_reports() {
        let s = state();
        // IPv6 metric 0 is the kernel's 1024; table 0 is main.
        let spec = RouteSpecSpec {
            family: Family::Inet6,
            destination: Some("fd00::/64".parse().unwrap()),
            out_link_name: "eth0".into(),
            ..RouteSpecSpec::default()
        };
        let marked = keys(RouteSpec::config_marked(&s));
        assert!(marked.contains(&RouteSpec::key(&spec).unwrap()));
        let spec = AddressSpecSpec {
            address: Some("10.0.0.3/24".parse().unwrap()),
            link_name: "eth0".into(),
            ..AddressSpecSpec::default()
        };
        assert_eq!(
            keys(AddressSpec::config_marked(&s)),
            vec![AddressSpec::key(&spec).unwrap()]
        );
    }
}
