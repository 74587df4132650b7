//! `KubeSpanManagerController`: programs the WireGuard device and its peers, the
//! marking set, emits the link/address/routes/rules as operator-layer network specs,
//! and keeps a status per peer with the endpoint-rotation state machine (spec §6–§9).
//!
//! Woken by its inputs, every 30 s, every second while a peer awaits its first
//! handshake, at `lastEndpointChange + 15 s` of peers in `unknown` and when an `up`
//! peer would turn down (§8.5); time comes from a [`Clock`], so tests drive rotation
//! by hand. A change of a few peer specs between those wake-ups is a delta round:
//! only those peers are stepped and written, as WireGuard peer changes and a
//! routed-set delta (see `reconcile`).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fmt,
    sync::Arc,
    time::{Instant, SystemTime},
};

use futures::future::BoxFuture;
use ipnet::{IpNet, Ipv6Net};
use wirespan_dataplane::{
    marking::{Marking, MarkingError, MarkingSpec, PrefixDelta, DEFAULT_TABLE},
    routing::Routing,
    wireguard::{
        PeerChange, PresharedKey, PrivateKey, PublicKey, WgDevice, WgError, WgPeer, WireGuard,
    },
};

use super::metrics::{MeshMetrics, PeerFigures};
use crate::{
    config::kubespan::{FastPath, KubeSpanConfig as Settings},
    kubespan::{
        clock::Clock,
        peers::{harvest, routed_prefixes},
        rotation::{defers_first_handshake, next_wake, step, Observed, RECONCILE_TICK},
    },
    resources::{
        cluster::{self, ClusterIdentity, CLUSTER},
        kubespan::{
            KubeSpanConfig, KubeSpanEndpoint, KubeSpanEndpointSpec, KubeSpanIdentity,
            KubeSpanManagerStatus, KubeSpanPeerSpec, KubeSpanPeerSpecSpec, KubeSpanPeerStatus,
            KubeSpanPeerStatusSpec, PeerState, KUBESPAN, NS,
        },
        network::{
            AddressSpec, ConfigLayer, Family, LinkSpec, RouteSpec, RouteType, RoutingRuleSpec,
            Scope, NS_CONFIG,
        },
    },
    runtime::{
        ChangeFeed, Controller, ControllerError, ControllerResult, ControllerRuntime, Input,
        InputKind, Output, Pointer, Resource, ResourceKind,
    },
};

/// Persistent keepalive of every peer (seconds).
pub const PERSISTENT_KEEPALIVE: u16 = 25;

/// Builds the WireGuard backend for a link.
pub trait WireGuardFactory: Send + Sync + fmt::Debug {
    /// A backend for device `link` (nothing created until used).
    ///
    /// # Errors
    /// The backend cannot be built.
    fn create(&self, link: &str) -> Result<Box<dyn WireGuard + Send>, WgError>;
}

/// The marking in use and why it is not the configured one.
pub struct MarkingChoice {
    /// The adapter.
    pub marking: Box<dyn Marking + Send>,
    /// What it is.
    pub fast_path: FastPath,
    /// Empty, or why the configured fast path is not in use.
    pub note: String,
}

/// Builds the marking adapter for a configured fast path (the eBPF fast path plugs in
/// here; without it the factory falls back to nftables and says so).
pub trait MarkingFactory: Send + Sync + fmt::Debug {
    /// The marking for `fast_path`; `link` is the mesh link (the eBPF classifier goes
    /// on every other interface).
    fn create(&self, fast_path: FastPath, link: &str) -> MarkingChoice;
}

/// What to do with kernel state when the daemon stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnStop {
    /// Leave device, peers, marking and routes in place (traffic keeps flowing).
    #[default]
    Keep,
    /// Remove them.
    Teardown,
}

/// What the manager needs from outside.
pub struct ManagerDeps {
    /// WireGuard backends.
    pub wireguard: Arc<dyn WireGuardFactory>,
    /// Marking adapters.
    pub marking: Arc<dyn MarkingFactory>,
    /// Removes our rules and routes on teardown (they are applied by the network
    /// controllers from the specs this manager emits).
    pub routing_cleanup: Option<Box<dyn Routing + Send>>,
    /// Time.
    pub clock: Arc<dyn Clock>,
    /// Metrics, if exported.
    pub metrics: Option<Arc<MeshMetrics>>,
    /// Shutdown behaviour.
    pub on_stop: OnStop,
}

impl fmt::Debug for ManagerDeps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ManagerDeps")
            .field("wireguard", &self.wireguard)
            .field("marking", &self.marking)
            .field("on_stop", &self.on_stop)
            .finish_non_exhaustive()
    }
}

/// Errors of the manager's kernel writes.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    /// WireGuard.
    #[error("WireGuard link {link}: {source}")]
    WireGuard {
        /// The link.
        link: String,
        /// Cause.
        #[source]
        source: WgError,
    },
    /// Marking.
    #[error("marking table: {0}")]
    Marking(#[source] MarkingError),
}

struct ActiveMarking {
    marking: Box<dyn Marking + Send>,
    configured: FastPath,
    link: String,
    in_use: FastPath,
    note: String,
}

/// The mesh manager.
pub struct KubeSpanManagerController {
    deps: ManagerDeps,
    wg: Option<Box<dyn WireGuard + Send>>,
    wg_link: String,
    marking: Option<ActiveMarking>,
    /// Live per-peer state (the rotation cursor), by public key.
    statuses: BTreeMap<String, KubeSpanPeerStatusSpec>,
    /// What was last written to the store.
    written_statuses: BTreeMap<String, KubeSpanPeerStatusSpec>,
    written_endpoints: BTreeMap<String, KubeSpanEndpointSpec>,
    /// Network specs written: (type, id).
    written_specs: BTreeSet<(&'static str, String)>,
    /// public key → (spec, peer without endpoint), so unchanged peers are not rebuilt.
    peers: HashMap<String, (KubeSpanPeerSpecSpec, WgPeer)>,
    /// Peer specs as last seen (the feed's mirror).
    specs: BTreeMap<String, Arc<Resource<KubeSpanPeerSpec>>>,
    feed: ChangeFeed<KubeSpanPeerSpec>,
    /// The non-peer inputs of the last complete round (`None`: the next is complete).
    basis: Option<Basis>,
    /// Each peer's prefixes in the marking set as last applied.
    routed: HashMap<String, Vec<IpNet>>,
    /// The earliest per-peer wake-up known.
    wake: Option<SystemTime>,
    /// This node's public key (set by a complete round).
    own_key: Option<PublicKey>,
    /// Kernel state may exist from an earlier run: clean it up once if disabled.
    first_round: bool,
    /// When the device was last read (`None`: never, or the device is new).
    last_read: Option<SystemTime>,
}

impl fmt::Debug for KubeSpanManagerController {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KubeSpanManagerController")
            .field("link", &self.wg_link)
            .field("peers", &self.statuses.len())
            .finish_non_exhaustive()
    }
}

/// More changed peers than this take a complete round.
const DELTA_MAX: usize = 64;

/// The inputs besides the peer specs, as a complete round saw them.
#[derive(Debug, PartialEq)]
struct Basis {
    config: (u64, crate::resources::kubespan::KubeSpanConfigSpec),
    identity: (u64, crate::resources::kubespan::KubeSpanIdentitySpec),
    cluster: (u64, crate::resources::cluster::ClusterIdentitySpec),
}

/// Name of the manager controller (also the owner of what it writes).
pub const NAME: &str = "KubeSpanManagerController";

async fn blocking<T: Send + 'static, R: Send + 'static>(
    mut t: T,
    f: impl FnOnce(&mut T) -> R + Send + 'static,
) -> Result<(T, R), ControllerError> {
    tokio::task::spawn_blocking(move || {
        let r = f(&mut t);
        (t, r)
    })
    .await
    .map_err(ControllerError::other)
}

/// The keepalive to program for a peer now (0 while its first handshake is deferred).
fn keepalive(
    own_key: Option<&PublicKey>,
    peer: &WgPeer,
    status: &KubeSpanPeerStatusSpec,
    now: SystemTime,
) -> u16 {
    let defer = own_key.is_some_and(|own| {
        defers_first_handshake(own.as_bytes(), peer.public_key.as_bytes(), status, now)
    });
    if defer {
        0
    } else {
        peer.persistent_keepalive
    }
}

fn wg_error(link: &str, source: WgError) -> ControllerError {
    ControllerError::other(ManagerError::WireGuard {
        link: link.to_owned(),
        source,
    })
}

fn operator_id(key: &str) -> String {
    format!("{}/{key}", ConfigLayer::Operator.prefix())
}

impl KubeSpanManagerController {
    /// A manager over `deps`.
    #[must_use]
    pub fn new(deps: ManagerDeps) -> Self {
        Self {
            deps,
            wg: None,
            wg_link: String::new(),
            marking: None,
            statuses: BTreeMap::new(),
            written_statuses: BTreeMap::new(),
            written_endpoints: BTreeMap::new(),
            written_specs: BTreeSet::new(),
            peers: HashMap::new(),
            specs: BTreeMap::new(),
            feed: ChangeFeed::new(NS),
            basis: None,
            routed: HashMap::new(),
            wake: None,
            own_key: None,
            first_round: true,
            last_read: None,
        }
    }

    /// Removes kernel state (device, marking table, our rules and routes).
    async fn teardown_kernel(&mut self) {
        if let Some(wg) = self.wg.take() {
            if let Ok((_, Err(e))) = blocking(wg, |w| w.teardown()).await {
                tracing::warn!(link = %self.wg_link, error = %e, "removing the WireGuard device failed");
            }
        }
        let marking = match self.marking.take() {
            Some(m) => Some(m.marking),
            None if self.first_round => Some(
                self.deps
                    .marking
                    .create(FastPath::Nftables, &self.wg_link)
                    .marking,
            ),
            None => None,
        };
        if let Some(m) = marking {
            if let Ok((_, Err(e))) = blocking(m, |m| m.teardown()).await {
                tracing::warn!(error = %e, "removing the marking table failed");
            }
        }
        if let Some(r) = self.deps.routing_cleanup.take() {
            match blocking(r, |r| r.teardown()).await {
                Ok((r, res)) => {
                    if let Err(e) = res {
                        tracing::warn!(error = %e, "removing mesh rules and routes failed");
                    }
                    self.deps.routing_cleanup = Some(r);
                }
                Err(e) => tracing::warn!(error = %e, "routing cleanup task failed"),
            }
        }
        self.peers.clear();
    }

    /// Disabled: remove kernel state and every output.
    async fn disable(&mut self, rt: &mut ControllerRuntime) -> ControllerResult {
        let active = self.wg.is_some() || self.marking.is_some() || self.first_round;
        if active {
            tracing::info!("mesh disabled: tearing down");
            self.teardown_kernel().await;
        }
        self.statuses.clear();
        self.destroy_outputs(rt)?;
        Ok(())
    }

    fn destroy_outputs(&mut self, rt: &mut ControllerRuntime) -> ControllerResult {
        for id in std::mem::take(&mut self.written_statuses).keys() {
            rt.destroy(&Pointer::new(NS, KubeSpanPeerStatus::TYPE, id))?;
        }
        for id in std::mem::take(&mut self.written_endpoints).keys() {
            rt.destroy(&Pointer::new(NS, KubeSpanEndpoint::TYPE, id))?;
        }
        for (ty, id) in std::mem::take(&mut self.written_specs) {
            rt.destroy(&Pointer::new(NS_CONFIG, ty, &id))?;
        }
        if rt.get_opt::<KubeSpanManagerStatus>(NS, KUBESPAN)?.is_some() {
            rt.destroy(&Pointer::new(NS, KubeSpanManagerStatus::TYPE, KUBESPAN))?;
        }
        Ok(())
    }

    /// Reads what a previous incarnation of this controller left in the store.
    fn adopt_outputs(&mut self, rt: &ControllerRuntime) -> ControllerResult {
        let name = rt.name().to_owned();
        for r in rt.list::<KubeSpanPeerStatus>(NS)? {
            self.written_statuses
                .insert(r.metadata.id.clone(), r.spec.clone());
            self.statuses
                .entry(r.metadata.id.clone())
                .or_insert_with(|| r.spec.clone());
        }
        for r in rt.list::<KubeSpanEndpoint>(NS)? {
            self.written_endpoints
                .insert(r.metadata.id.clone(), r.spec.clone());
        }
        macro_rules! adopt {
            ($k:ty) => {
                for r in rt.list::<$k>(NS_CONFIG)? {
                    if r.metadata.owner == name {
                        self.written_specs
                            .insert((<$k>::TYPE, r.metadata.id.clone()));
                    }
                }
            };
        }
        adopt!(LinkSpec);
        adopt!(AddressSpec);
        adopt!(RouteSpec);
        adopt!(RoutingRuleSpec);
        Ok(())
    }

    fn ensure_marking(&mut self, configured: FastPath, link: &str) -> &mut ActiveMarking {
        if self
            .marking
            .as_ref()
            .is_some_and(|m| m.configured != configured || m.link != link)
        {
            // A fast-path change: the new adapter replaces the table it finds.
            self.marking = None;
        }
        self.marking.get_or_insert_with(|| {
            let c = self.deps.marking.create(configured, link);
            if !c.note.is_empty() {
                tracing::warn!(configured = ?configured, in_use = ?c.fast_path, note = %c.note, "marking fast path fallback");
            }
            ActiveMarking {
                marking: c.marking,
                configured,
                link: link.to_owned(),
                in_use: c.fast_path,
                note: c.note,
            }
        })
    }

    fn write_network_specs(
        &mut self,
        rt: &mut ControllerRuntime,
        s: &Settings,
        address: Option<IpNet>,
    ) -> ControllerResult {
        let mut want: BTreeSet<(&'static str, String)> = BTreeSet::new();
        let layer = ConfigLayer::Operator;
        let link = s.link_name.clone();
        let id = operator_id(&link);
        rt.modify::<LinkSpec>(NS_CONFIG, &id, |r| {
            r.spec.name.clone_from(&link);
            r.spec.logical = false;
            r.spec.up = true;
            r.spec.mtu = s.mtu;
            r.spec.kind = String::new();
            r.spec.layer = layer;
        })?;
        want.insert((LinkSpec::TYPE, id));
        if let Some(IpNet::V6(a)) = address {
            let on_link = IpNet::V6(Ipv6Net::new(a.addr(), 64).unwrap_or(a));
            let spec = crate::resources::network::AddressSpecSpec {
                address: Some(on_link),
                link_name: link.clone(),
                scope: Scope::Global,
                layer,
            };
            let id = operator_id(&spec.key());
            rt.modify::<AddressSpec>(NS_CONFIG, &id, |r| r.spec.clone_from(&spec))?;
            want.insert((AddressSpec::TYPE, id));
        }
        for family in [Family::Inet4, Family::Inet6] {
            let route = crate::resources::network::RouteSpecSpec {
                family,
                destination: None,
                source: None,
                gateway: None,
                out_link_name: link.clone(),
                table: s.routing_table,
                priority: 1,
                scope: Scope::Global,
                r#type: RouteType::Unicast,
                mtu: s.mtu,
                layer,
            };
            let id = operator_id(&route.key());
            rt.modify::<RouteSpec>(NS_CONFIG, &id, |r| r.spec.clone_from(&route))?;
            want.insert((RouteSpec::TYPE, id));
            let rule = crate::resources::network::RoutingRuleSpecSpec {
                family,
                src: None,
                dst: None,
                table: s.routing_table,
                priority: s.rule_priority,
                fw_mark: s.route_mark,
                fw_mask: s.mark_mask,
                layer,
            };
            let id = operator_id(&rule.key());
            rt.modify::<RoutingRuleSpec>(NS_CONFIG, &id, |r| r.spec.clone_from(&rule))?;
            want.insert((RoutingRuleSpec::TYPE, id));
        }
        for (ty, id) in self.written_specs.difference(&want) {
            rt.destroy(&Pointer::new(NS_CONFIG, *ty, id))?;
        }
        self.written_specs = want;
        Ok(())
    }

    /// One reconcile; returns the next timer deadline.
    ///
    /// A round is *complete* (every peer looked at, the whole device and marking set
    /// applied) when a timer woke the manager, when the device is due for a read (§8.2
    /// step 2: on the first round with a device and a tick after the last read), when
    /// anything but peer specs changed since the last complete round, or when many
    /// peers did. Otherwise it is a *delta* round over the peers whose specs changed,
    /// with work proportional to them: their statuses stepped without a device read,
    /// their WireGuard peers and routed prefixes applied as changes.
    async fn reconcile(
        &mut self,
        rt: &mut ControllerRuntime,
        timer: bool,
    ) -> Result<Option<SystemTime>, ControllerError> {
        let changed = self.feed.sync(rt, &mut self.specs)?;
        let Some(cfg) = rt
            .get_opt::<KubeSpanConfig>(NS, KUBESPAN)?
            .filter(|c| c.spec.config.enabled)
        else {
            self.basis = None;
            self.disable(rt).await?;
            return Ok(None);
        };
        let identity = rt.get_opt::<KubeSpanIdentity>(NS, KUBESPAN)?;
        let cluster = rt.get_opt::<ClusterIdentity>(cluster::NS, CLUSTER)?;
        let (Some(identity), Some(cluster)) = (identity, cluster) else {
            // Enabled but not ready: wait for the identity and the cluster secret.
            self.basis = None;
            return Ok(None);
        };
        let basis = Basis {
            config: (cfg.metadata.version, cfg.spec.clone()),
            identity: (identity.metadata.version, identity.spec.clone()),
            cluster: (cluster.metadata.version, cluster.spec.clone()),
        };
        let now = self.deps.clock.now();
        let read_due = self
            .last_read
            .is_none_or(|t| now.duration_since(t).unwrap_or_default() >= RECONCILE_TICK);
        match changed {
            Some(keys)
                if !timer
                    && !read_due
                    && self.wg.is_some()
                    && keys.len() <= DELTA_MAX
                    && self.basis.as_ref() == Some(&basis) =>
            {
                self.delta_round(rt, &cfg.spec.config, &cluster, &keys, now)
                    .await
            }
            _ => {
                self.basis = None;
                let wake = self
                    .complete_round(rt, &cfg.spec.config, &identity, &cluster, timer || read_due)
                    .await?;
                self.basis = Some(basis);
                Ok(wake)
            }
        }
    }

    /// The WireGuard peer for a spec (cached while the spec and the secret stay), and
    /// its routed prefixes; `None` for a spec whose id is not a public key.
    fn peer_of(
        &mut self,
        key: &str,
        spec: &KubeSpanPeerSpecSpec,
        psk: &PresharedKey,
    ) -> Option<WgPeer> {
        if let Some((cached, peer)) = self.peers.get(key) {
            if cached == spec && peer.preshared_key.as_ref() == Some(psk) {
                return Some(peer.clone());
            }
        }
        let Ok(public_key) = PublicKey::from_base64("publicKey", key) else {
            tracing::warn!(peer = %key, "peer spec id is not a WireGuard public key; skipped");
            return None;
        };
        let peer = WgPeer {
            public_key,
            preshared_key: Some(psk.clone()),
            persistent_keepalive: PERSISTENT_KEEPALIVE,
            endpoint: None,
            allowed_ips: spec.allowed_ips.clone(),
        };
        self.peers
            .insert(key.to_owned(), (spec.clone(), peer.clone()));
        Some(peer)
    }

    /// Writes a peer's status if it changed, or destroys it when the peer is gone.
    fn write_status(&mut self, rt: &mut ControllerRuntime, key: &str) -> ControllerResult {
        match self.statuses.get(key) {
            Some(st) => {
                if self.written_statuses.get(key) != Some(st) {
                    rt.modify::<KubeSpanPeerStatus>(NS, key, |r| r.spec.clone_from(st))?;
                    self.written_statuses.insert(key.to_owned(), st.clone());
                }
            }
            None => {
                if self.written_statuses.remove(key).is_some() {
                    rt.destroy(&Pointer::new(NS, KubeSpanPeerStatus::TYPE, key))?;
                }
            }
        }
        Ok(())
    }

    /// Publishes or withdraws a peer's harvested endpoint (§9).
    fn write_harvested(
        &mut self,
        rt: &mut ControllerRuntime,
        s: &Settings,
        key: &str,
    ) -> ControllerResult {
        let want = s
            .harvest_extra_endpoints
            .then(|| {
                let spec = self.specs.get(key)?;
                let st = self.statuses.get(key)?;
                harvest(std::iter::once((
                    key,
                    spec.spec.node_id.as_str(),
                    st.state == PeerState::Up,
                    st.endpoint,
                )))
                .pop()
            })
            .flatten()
            .map(|h| KubeSpanEndpointSpec {
                affiliate_id: h.node_id,
                endpoint: Some(h.endpoint),
            });
        match want {
            Some(e) => {
                if self.written_endpoints.get(key) != Some(&e) {
                    rt.modify::<KubeSpanEndpoint>(NS, key, |r| r.spec.clone_from(&e))?;
                    self.written_endpoints.insert(key.to_owned(), e);
                }
            }
            None => {
                if self.written_endpoints.remove(key).is_some() {
                    rt.destroy(&Pointer::new(NS, KubeSpanEndpoint::TYPE, key))?;
                }
            }
        }
        Ok(())
    }

    fn write_manager_status(&self, rt: &mut ControllerRuntime, s: &Settings) -> ControllerResult {
        let (in_use, note) = self
            .marking
            .as_ref()
            .map_or((s.fast_path, ""), |m| (m.in_use, m.note.as_str()));
        rt.modify::<KubeSpanManagerStatus>(NS, KUBESPAN, |r| {
            r.spec.link_name.clone_from(&s.link_name);
            r.spec.fast_path = match in_use {
                FastPath::Nftables => "nftables".to_owned(),
                FastPath::Ebpf => "ebpf".to_owned(),
            };
            r.spec.peers = self.peers.len();
            note.clone_into(&mut r.spec.note);
        })?;
        Ok(())
    }

    /// A delta round over the peers `keys` (see [`Self::reconcile`]).
    async fn delta_round(
        &mut self,
        rt: &mut ControllerRuntime,
        s: &Settings,
        cluster: &Resource<ClusterIdentity>,
        keys: &[String],
        now: SystemTime,
    ) -> Result<Option<SystemTime>, ControllerError> {
        let psk = PresharedKey::from_bytes(*cluster.spec.secret.bytes());
        let mut changes = Vec::with_capacity(keys.len());
        let mut delta = PrefixDelta::default();
        let mut wake = self.wake;
        for key in keys {
            let spec = self.specs.get(key).map(|r| r.spec.clone());
            let peer = spec.as_ref().and_then(|spec| self.peer_of(key, spec, &psk));
            let (Some(spec), Some(peer)) = (spec, peer) else {
                // Gone (or never a valid peer).
                self.statuses.remove(key);
                if let Some((_, p)) = self.peers.remove(key) {
                    changes.push(PeerChange::Remove(p.public_key));
                }
                if let Some(old) = self.routed.remove(key) {
                    delta.remove.extend(old);
                }
                continue;
            };
            let st = self
                .statuses
                .entry(key.clone())
                .or_insert_with(|| KubeSpanPeerStatusSpec {
                    label: spec.label.clone(),
                    ..KubeSpanPeerStatusSpec::default()
                });
            let step = step(st, &spec.endpoints, None, now);
            if let Some(w) = next_wake(st, now) {
                wake = Some(wake.map_or(w, |x| x.min(w)));
            }
            let routed = routed_prefixes(
                !s.allow_down_peer_bypass,
                &peer.allowed_ips,
                st.state == PeerState::Up,
            );
            changes.push(PeerChange::Upsert(WgPeer {
                endpoint: step.desired_endpoint,
                persistent_keepalive: keepalive(self.own_key.as_ref(), &peer, st, now),
                ..peer
            }));
            let old = self
                .routed
                .insert(key.clone(), routed.clone())
                .unwrap_or_default();
            if old != routed {
                delta.remove.extend(old);
                delta.add.extend(routed);
            }
        }
        let wg = self
            .wg
            .take()
            .unwrap_or_else(|| unreachable!("checked by the caller"));
        let (wg, res) = blocking(wg, move |w| w.apply_peers(&changes)).await?;
        self.wg = Some(wg);
        res.map_err(|source| wg_error(&s.link_name, source))?;
        if !delta.is_empty() {
            let m = self
                .marking
                .take()
                .unwrap_or_else(|| unreachable!("set by a complete round"));
            let (m, res) = blocking(m, move |m| m.marking.apply_delta(&delta)).await?;
            self.marking = Some(m);
            res.map_err(|e| ControllerError::other(ManagerError::Marking(e)))?;
        }
        for key in keys {
            self.write_status(rt, key)?;
            self.write_harvested(rt, s, key)?;
        }
        self.write_manager_status(rt, s)?;
        self.wake = wake;
        let tick = self.last_read.map(|t| t + RECONCILE_TICK);
        Ok(match (wake, tick) {
            (Some(w), Some(t)) => Some(w.min(t)),
            (w, t) => w.or(t),
        })
    }

    /// A complete round (see [`Self::reconcile`]); `read`: read the device first.
    #[allow(clippy::too_many_lines)]
    async fn complete_round(
        &mut self,
        rt: &mut ControllerRuntime,
        s: &Settings,
        identity: &Resource<KubeSpanIdentity>,
        cluster: &Resource<ClusterIdentity>,
        read: bool,
    ) -> Result<Option<SystemTime>, ControllerError> {
        if self.wg_link != s.link_name {
            if self.wg.is_some() {
                tracing::info!(old = %self.wg_link, new = %s.link_name, "mesh link renamed");
                self.teardown_kernel().await;
            }
            self.wg = None;
            self.peers.clear();
            self.wg_link.clone_from(&s.link_name);
        }
        if self.wg.is_none() {
            self.last_read = None;
            self.wg = Some(
                self.deps
                    .wireguard
                    .create(&s.link_name)
                    .map_err(|source| wg_error(&s.link_name, source))?,
            );
        }
        let now = self.deps.clock.now();
        let read = read || self.last_read.is_none();

        // §8.2 step 2: what the device reports.
        let observed = if read {
            let wg = self
                .wg
                .take()
                .unwrap_or_else(|| unreachable!("created above"));
            let (wg, observed) = blocking(wg, |w| w.observe()).await?;
            self.wg = Some(wg);
            self.last_read = Some(now);
            Some(observed)
        } else {
            None
        };
        let observed: Option<HashMap<String, Observed>> = observed.map(|observed| match observed {
            Ok(st) if st.present => st
                .peers
                .into_iter()
                .map(|p| {
                    (
                        p.public_key.to_base64(),
                        Observed {
                            endpoint: p.endpoint,
                            last_handshake: p.last_handshake,
                            rx_bytes: p.rx_bytes,
                            tx_bytes: p.tx_bytes,
                        },
                    )
                })
                .collect(),
            Ok(_) => HashMap::new(),
            Err(e) => {
                tracing::warn!(link = %s.link_name, error = %e, "reading the WireGuard device failed");
                HashMap::new()
            }
        });

        // Step 1, 3–5: statuses and desired endpoints.
        self.own_key = PublicKey::from_base64("publicKey", &identity.spec.public_key).ok();
        let psk = PresharedKey::from_bytes(*cluster.spec.secret.bytes());
        let specs: Vec<Arc<Resource<KubeSpanPeerSpec>>> = self.specs.values().cloned().collect();
        let force = !s.allow_down_peer_bypass;
        let mut wg_peers = Vec::with_capacity(specs.len());
        let (mut v4, mut v6) = (Vec::new(), Vec::new());
        let mut routed = HashMap::with_capacity(specs.len());
        let mut wake: Option<SystemTime> = None;
        for r in &specs {
            let key = &r.metadata.id;
            let Some(base) = self.peer_of(key, &r.spec, &psk) else {
                continue;
            };
            let st = self
                .statuses
                .entry(key.clone())
                .or_insert_with(|| KubeSpanPeerStatusSpec {
                    label: r.spec.label.clone(),
                    ..KubeSpanPeerStatusSpec::default()
                });
            // Without a read (or without the peer on the device) the status keeps its
            // last observation.
            let seen = observed.as_ref().and_then(|o| o.get(key));
            let step = step(st, &r.spec.endpoints, seen, now);
            if let Some(w) = next_wake(st, now) {
                wake = Some(wake.map_or(w, |x: SystemTime| x.min(w)));
            }
            let prefixes = routed_prefixes(force, &base.allowed_ips, st.state == PeerState::Up);
            for p in &prefixes {
                match p {
                    IpNet::V4(_) => v4.push(*p),
                    IpNet::V6(_) => v6.push(*p),
                }
            }
            routed.insert(key.clone(), prefixes);
            wg_peers.push(WgPeer {
                endpoint: step.desired_endpoint,
                persistent_keepalive: keepalive(self.own_key.as_ref(), &base, st, now),
                ..base
            });
        }

        // Statuses of peers that went away: every spec has a status now, so there are
        // more statuses than specs exactly when some are stale (no lookups otherwise).
        if self.statuses.len() > specs.len() || self.peers.len() > specs.len() {
            self.statuses.retain(|k, _| self.specs.contains_key(k));
            self.peers.retain(|k, _| self.specs.contains_key(k));
        }

        // Step 6: device, routed set, statuses.
        let device = WgDevice {
            name: s.link_name.clone(),
            private_key: PrivateKey::from_bytes(*identity.spec.private_key.bytes()),
            listen_port: s.listen_port,
            fwmark: s.device_mark,
            peers: wg_peers,
        };
        let wg = self.wg.take().unwrap_or_else(|| unreachable!("set above"));
        let (wg, res) = blocking(wg, move |w| w.apply(&device)).await?;
        self.wg = Some(wg);
        res.map_err(|source| wg_error(&s.link_name, source))?;
        let marking_spec = MarkingSpec {
            table: DEFAULT_TABLE.to_owned(),
            device_mark: s.device_mark,
            mark: s.route_mark,
            mask: s.mark_mask,
            mtu: s.mtu,
            prefixes_v4: v4,
            prefixes_v6: v6,
            ..MarkingSpec::default()
        };
        self.ensure_marking(s.fast_path, &s.link_name);
        let m = self
            .marking
            .take()
            .unwrap_or_else(|| unreachable!("set above"));
        let (m, res) = blocking(m, move |m| m.marking.apply(&marking_spec)).await?;
        self.marking = Some(m);
        res.map_err(|e| ControllerError::other(ManagerError::Marking(e)))?;
        self.routed = routed;

        let keys: Vec<String> = self.statuses.keys().cloned().collect();
        for key in &keys {
            self.write_status(rt, key)?;
        }
        // Everything live was written, so more written than live means some are gone.
        if self.written_statuses.len() > self.statuses.len() {
            let gone: Vec<String> = self
                .written_statuses
                .keys()
                .filter(|id| !self.statuses.contains_key(*id))
                .cloned()
                .collect();
            for key in &gone {
                self.write_status(rt, key)?;
            }
        }

        // Step 7: link, address, routes, rules (no-op writes are suppressed).
        self.write_network_specs(rt, s, identity.spec.address)?;

        // §9 harvest.
        let mut keys: BTreeSet<String> = self.written_endpoints.keys().cloned().collect();
        if s.harvest_extra_endpoints {
            keys.extend(self.statuses.keys().cloned());
        }
        for key in &keys {
            self.write_harvested(rt, s, key)?;
        }

        self.write_manager_status(rt, s)?;

        if let Some(metrics) = self.deps.metrics.as_ref().filter(|_| read) {
            let figures: Vec<PeerFigures> = self
                .statuses
                .iter()
                .map(|(k, st)| PeerFigures {
                    public_key: k.clone(),
                    label: st.label.clone(),
                    state: st.state.as_str(),
                    handshake_age: st
                        .last_handshake_time
                        .and_then(|t| now.duration_since(t).ok())
                        .map(|d| d.as_secs_f64()),
                    rx: st.receive_bytes,
                    tx: st.transmit_bytes,
                })
                .collect();
            metrics.set_peers(&figures);
        }
        self.wake = wake;
        let tick = now + RECONCILE_TICK;
        Ok(Some(wake.map_or(tick, |w| w.min(tick))))
    }
}

impl Controller for KubeSpanManagerController {
    fn name(&self) -> &str {
        NAME
    }

    fn inputs(&self) -> Vec<Input> {
        vec![
            Input::id_of::<KubeSpanConfig>(NS, KUBESPAN, InputKind::Weak),
            Input::id_of::<KubeSpanIdentity>(NS, KUBESPAN, InputKind::Weak),
            Input::id_of::<ClusterIdentity>(cluster::NS, CLUSTER, InputKind::Weak),
            Input::of::<KubeSpanPeerSpec>(NS, InputKind::Weak),
        ]
    }

    fn outputs(&self) -> Vec<Output> {
        vec![
            Output::exclusive::<KubeSpanPeerStatus>(),
            Output::exclusive::<KubeSpanEndpoint>(),
            Output::exclusive::<KubeSpanManagerStatus>(),
            Output::shared::<LinkSpec>(),
            Output::shared::<AddressSpec>(),
            Output::shared::<RouteSpec>(),
            Output::shared::<RoutingRuleSpec>(),
        ]
    }

    fn run<'a>(&'a mut self, rt: &'a mut ControllerRuntime) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            self.adopt_outputs(rt)?;
            // A restart looks at everything again.
            self.feed.reset();
            self.basis = None;
            let mut deadline: Option<SystemTime> = None;
            loop {
                let sleep = match deadline {
                    Some(d) => self.deps.clock.sleep_until(d),
                    None => Box::pin(std::future::pending()),
                };
                let timer = tokio::select! {
                    biased;
                    () = rt.cancelled() => break,
                    () = rt.changed() => false,
                    () = sleep => true,
                };
                let started = Instant::now();
                deadline = self.reconcile(rt, timer).await?;
                self.first_round = false;
                if let Some(m) = &self.deps.metrics {
                    m.observe_reconcile(NAME, started.elapsed());
                }
                rt.reset_restart_backoff();
            }
            match self.deps.on_stop {
                OnStop::Teardown => {
                    tracing::info!("stopping: tearing down mesh kernel state");
                    self.teardown_kernel().await;
                }
                OnStop::Keep => {
                    tracing::info!(link = %self.wg_link, "stopping: keeping mesh kernel state");
                    // A userspace backend would stop wireguard-go when dropped.
                    if let Some(wg) = self.wg.take() {
                        std::mem::forget(wg);
                    }
                }
            }
            Ok(())
        })
    }
}
