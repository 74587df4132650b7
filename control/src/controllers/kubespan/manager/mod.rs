//! `KubeSpanManagerController`: programs the WireGuard device and its peers, the
//! marking set, emits the link/address/routes/rules as operator-layer network specs,
//! and keeps a status per peer with the endpoint-rotation state machine (`docs/kubespan.md` §6–§9).
//!
//! Woken by its inputs, every 30 s, every second while a peer awaits its first
//! handshake, at `lastEndpointChange + 15 s` of peers in `unknown` and when an `up`
//! peer would turn down (§8.5); time comes from a [`Clock`], so tests drive rotation
//! by hand. A change of a few peer specs between those wake-ups is a delta round:
//! only those peers are stepped and written, as WireGuard peer changes and a
//! routed-set delta (see `reconcile`).
//!
//! By concern: this file holds the public types, the controller's run loop and the
//! choice between a `complete` and a `delta` round; `outputs` writes statuses,
//! endpoints and network specs; `teardown` removes kernel state.

mod complete;
mod delta;
mod outputs;
mod probe;
mod relay;
mod teardown;
mod unlisted;

pub use probe::UdpProber;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    fmt,
    net::IpAddr,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use futures::future::BoxFuture;
use ipnet::IpNet;
use wirespan_dataplane::{
    marking::{Marking, MarkingError},
    routing::Routing,
    sysctl::{MeshRpFilter, Sysctl, SysctlError},
    wireguard::{PresharedKey, PublicKey, WgError, WgPeer, WireGuard},
};

use super::metrics::MeshMetrics;
use crate::{
    config::kubespan::FastPath,
    kubespan::{
        clock::Clock,
        relay::DirectPath,
        rotation::{
            defers_first_handshake, wirespan_keepalive, Observed, RxTrack, PEER_DOWN_INTERVAL,
            RECONCILE_TICK,
        },
    },
    resources::{
        cluster::{self, ClusterIdentity, CLUSTER},
        config::MachineConfig,
        kubespan::{
            KubeSpanConfig, KubeSpanEndpoint, KubeSpanEndpointSpec, KubeSpanIdentity,
            KubeSpanManagerStatus, KubeSpanPeerSpec, KubeSpanPeerSpecSpec, KubeSpanPeerStatus,
            KubeSpanPeerStatusSpec, KubeSpanRelayEndpoint, ServerRelayWant, KUBESPAN, NS,
        },
        network::{AddressSpec, LinkSpec, RouteSpec, RoutingRuleSpec},
    },
    runtime::{
        ChangeFeed, Controller, ControllerError, ControllerResult, ControllerRuntime, Input,
        InputKind, Output, Resource,
    },
};

/// Persistent keepalive of Talos peers (seconds); wirespan peers get a third of
/// `peerReceiveTimeout` (`docs/kubespan.md` §8.6).
pub const PERSISTENT_KEEPALIVE: u16 = 25;

/// Sends a probe through the tunnel to a peer's mesh address, so that a live peer
/// answers (see [`RxTrack`]): its kernel at once (an ICMPv6 error), its WireGuard
/// within 10 s (a keepalive). Best effort: failures are only logged.
pub trait Prober: Send + Sync + fmt::Debug {
    /// Probes the peer whose mesh address is `to`.
    fn probe(&self, to: IpAddr);
    /// The mesh addresses whose kernels answered a probe since the last call.
    fn kernel_replies(&self) -> HashSet<IpAddr>;
}

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
    /// The marking for `fast_path`; `link` is the mesh link (the kernel's eBPF
    /// classifier goes on every interface, the mesh link too, for relays).
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
    /// Kernel parameters of the mesh link (reverse-path filtering off while the mesh
    /// runs); `None` leaves them alone.
    pub sysctl: Option<Arc<dyn Sysctl + Send + Sync>>,
    /// Probes silent wirespan peers; `None`: no probes (a peer on an idle tunnel whose
    /// keepalives the node's own keep suppressing may then be judged down).
    pub prober: Option<Arc<dyn Prober>>,
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
    /// A kernel parameter of the mesh link.
    #[error(transparent)]
    Sysctl(#[from] SysctlError),
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
    /// Notified when the backend recreated the device empty (see
    /// [`WireGuard::recreated`]): a complete round with a read follows at once.
    wg_recreated: Option<Arc<tokio::sync::Notify>>,
    wg_link: String,
    marking: Option<ActiveMarking>,
    /// Live per-peer state (the rotation cursor), by public key.
    statuses: BTreeMap<String, KubeSpanPeerStatusSpec>,
    /// Receive tracking of wirespan peers, by public key.
    rx: HashMap<String, RxTrack>,
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
    /// Whether the device was read once since start (the read that adopts kernel
    /// state kept by an earlier run).
    adopt_checked: bool,
    /// Until when peers found on the device at start but without a spec yet are kept
    /// as they are (see [`Retained`]).
    retain_until: Option<SystemTime>,
    /// Those peers, by public key.
    retained: BTreeMap<String, Retained>,
    /// Peers whose spec vanished while their session was fresh, with their last spec,
    /// by public key (see `unlisted`).
    unlisted: BTreeMap<String, Arc<Resource<KubeSpanPeerSpec>>>,
    /// Reverse-path filtering off on the mesh link, with the value it replaced.
    rp_filter: Option<MeshRpFilter>,
    /// The direct path of each peer that takes part in relays, by public key.
    direct: HashMap<String, DirectPath>,
    /// Relayed peers as last applied: peer → relay, by public key.
    relayed: BTreeMap<String, String>,
    /// Relays are in use or needed: rounds stay complete (a delta round would write a
    /// relay's or a relayed peer's AllowedIPs without the move).
    relay_active: bool,
    /// Key ids of the peers not reachable directly (`None`: too many to publish).
    direct_down: Option<Vec<u64>>,
    /// Peers with neither a direct path nor a peer relay (asked of the server relay).
    server_wanted: Vec<ServerRelayWant>,
    /// Peers sent through the server relay, by public key.
    server_relayed: HashMap<String, relay::ServerRelayed>,
}

/// A peer the device held at start (kernel state kept by an earlier run) that has no
/// spec yet: after a restart the specs come back only when discovery answers, and
/// removing the peer meanwhile would cut a working tunnel. It stays as the device has
/// it (minus prefixes a peer with a spec claims) until its spec arrives, when its
/// status is seeded from it, or until [`RETAIN_AFTER_START`] has passed.
#[derive(Debug, Clone)]
struct Retained {
    observed: Observed,
    allowed_ips: Vec<IpNet>,
    /// As the device has it: an earlier run may have set a wirespan peer's shorter one.
    keepalive: u16,
}

/// How long after start a device peer without a spec is kept: as long as a peer that
/// stopped handshaking counts as up, so a kept peer outlives neither.
pub const RETAIN_AFTER_START: std::time::Duration = PEER_DOWN_INTERVAL;

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

/// How long a due device read may wait behind one-peer changes (see [`choose_round`]).
/// Short against every window the reads serve (a receive window is at least 6 s, a
/// probe's grace 2 s), so failure detection is late by this at most, and only while
/// peer specs keep changing.
const READ_DEFER_MAX: Duration = Duration::from_secs(1);

/// The kind of a round (see [`KubeSpanManagerController::reconcile`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Round {
    /// Only the changed peers, on the last observation.
    Delta,
    /// A delta round now, and the due read in a complete round right after: the
    /// change does not wait for every peer to be read and judged.
    DeltaThenRead,
    /// Every peer; `read`: the device is read first.
    Complete { read: bool },
}

/// Chooses the round at `now`. A read is due on a new device (`last_read` none), a
/// tick after the last read, or at a peer wake-up that has passed (a change can win
/// the race with the timer: judging receive windows then needs fresh counters);
/// `timer`: the loop's timer fired, which also means a read is due. `delta`: the
/// round could be a delta round over this many changed peer specs (nothing else
/// changed).
///
/// A change that could be a delta round goes first even when a read is due, unless
/// the device is new or the read overdue by [`READ_DEFER_MAX`]: at 10,000 peers a read
/// and judging every peer take tens to hundreds of milliseconds, the change a fraction
/// of one.
fn choose_round(
    now: SystemTime,
    last_read: Option<SystemTime>,
    wake: Option<SystemTime>,
    timer: bool,
    delta: Option<usize>,
) -> Round {
    let Some(last_read) = last_read else {
        return Round::Complete { read: true };
    };
    let due_at = wake.map_or(last_read + RECONCILE_TICK, |w| {
        w.min(last_read + RECONCILE_TICK)
    });
    let read_due = timer || now >= due_at;
    match (delta, read_due) {
        (Some(_), false) => Round::Delta,
        // With nothing changed there is nothing to put first.
        (Some(n), true) if n > 0 && now < due_at + READ_DEFER_MAX => Round::DeltaThenRead,
        _ => Round::Complete { read: read_due },
    }
}

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

/// Whether the active machine config has a mesh document the config controller has not
/// turned into `KubeSpanConfig` yet.
fn config_pending(rt: &ControllerRuntime) -> Result<bool, ControllerError> {
    Ok(MachineConfig::active(rt)?
        .is_some_and(|mc| super::config::effective(&mc.spec.config).is_some()))
}

fn wg_error(link: &str, source: WgError) -> ControllerError {
    ControllerError::other(ManagerError::WireGuard {
        link: link.to_owned(),
        source,
    })
}

impl KubeSpanManagerController {
    /// A manager over `deps`.
    #[must_use]
    pub fn new(deps: ManagerDeps) -> Self {
        Self {
            deps,
            wg: None,
            wg_recreated: None,
            wg_link: String::new(),
            marking: None,
            statuses: BTreeMap::new(),
            rx: HashMap::new(),
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
            adopt_checked: false,
            retain_until: None,
            retained: BTreeMap::new(),
            unlisted: BTreeMap::new(),
            rp_filter: None,
            direct: HashMap::new(),
            relayed: BTreeMap::new(),
            relay_active: false,
            direct_down: Some(Vec::new()),
            server_wanted: Vec::new(),
            server_relayed: HashMap::new(),
        }
    }

    /// One reconcile; returns the next timer deadline.
    ///
    /// A round is *complete* (every peer looked at, the whole device and marking set
    /// applied) when a timer woke the manager, when the device is due for a read (§8.2
    /// step 2: on the first round with a device and a tick after the last read), when
    /// anything but peer specs changed since the last complete round, or when many
    /// peers did. Otherwise it is a *delta* round over the peers whose specs changed,
    /// with work proportional to them: their statuses stepped without a device read,
    /// their WireGuard peers and routed prefixes applied as changes. Such a change goes
    /// before a due read, which follows at once (see [`choose_round`]).
    async fn reconcile(
        &mut self,
        rt: &mut ControllerRuntime,
        timer: bool,
    ) -> Result<Option<SystemTime>, ControllerError> {
        let changed = self.sync_specs(rt, self.deps.clock.now())?;
        let cfg = rt.get_opt::<KubeSpanConfig>(NS, KUBESPAN)?;
        if cfg.is_none() && config_pending(rt)? {
            // The machine config turns the mesh on but the config controller has not
            // derived it yet (the first moments after start): absent is not disabled,
            // and tearing down now would cut what an earlier run kept.
            return Ok(None);
        }
        let Some(cfg) = cfg.filter(|c| c.spec.config.enabled) else {
            self.basis = None;
            self.disable(rt).await?;
            self.first_round = false;
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
        let delta = changed
            .as_ref()
            .filter(|keys| {
                self.wg.is_some()
                    && keys.len() <= DELTA_MAX
                    && !self.relay_active
                    && self.unlisted.is_empty()
                    && self.basis.as_ref() == Some(&basis)
            })
            .map(Vec::len);
        match (
            choose_round(now, self.last_read, self.wake, timer, delta),
            changed,
        ) {
            (round @ (Round::Delta | Round::DeltaThenRead), Some(keys)) => {
                let next = self
                    .delta_round(rt, &cfg.spec.config, &cluster, &keys, now)
                    .await?;
                // The read that was due follows at once, as a timer round; a change
                // pending by then goes first again (the loop prefers changes), within
                // `READ_DEFER_MAX`.
                Ok(if round == Round::DeltaThenRead {
                    Some(now)
                } else {
                    next
                })
            }
            (round, _) => {
                self.basis = None;
                let read = matches!(round, Round::Complete { read: true });
                let wake = self
                    .complete_round(rt, &cfg.spec.config, &identity, &cluster, read)
                    .await?;
                self.first_round = false;
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
        settings: &crate::config::kubespan::KubeSpanConfig,
    ) -> Option<WgPeer> {
        let persistent_keepalive = if spec.wirespan.is_some() {
            wirespan_keepalive(settings.peer_receive_timeout)
        } else {
            PERSISTENT_KEEPALIVE
        };
        if let Some((cached, peer)) = self.peers.get(key) {
            if cached == spec
                && peer.preshared_key.as_ref() == Some(psk)
                && peer.persistent_keepalive == persistent_keepalive
            {
                return Some(peer.clone());
            }
        }
        let Ok(public_key) = PublicKey::from_base64("publicKey", key) else {
            tracing::warn!(peer = ?key, "peer spec id is not a WireGuard public key; skipped");
            return None;
        };
        let peer = WgPeer {
            public_key,
            preshared_key: Some(psk.clone()),
            persistent_keepalive,
            endpoint: None,
            allowed_ips: spec.allowed_ips.clone(),
        };
        self.peers
            .insert(key.to_owned(), (spec.clone(), peer.clone()));
        Some(peer)
    }
}

impl Controller for KubeSpanManagerController {
    fn name(&self) -> &str {
        NAME
    }

    fn inputs(&self) -> Vec<Input> {
        vec![
            Input::id_of::<KubeSpanConfig>(NS, KUBESPAN, InputKind::Weak),
            MachineConfig::input(),
            Input::id_of::<KubeSpanIdentity>(NS, KUBESPAN, InputKind::Weak),
            Input::id_of::<ClusterIdentity>(cluster::NS, CLUSTER, InputKind::Weak),
            Input::of::<KubeSpanPeerSpec>(NS, InputKind::Weak),
            Input::of::<KubeSpanRelayEndpoint>(NS, InputKind::Weak),
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
                let recreated = self.wg_recreated.clone();
                let recreated = async move {
                    match recreated {
                        Some(n) => n.notified().await,
                        None => std::future::pending().await,
                    }
                };
                let timer = tokio::select! {
                    biased;
                    () = rt.cancelled() => break,
                    () = rt.changed() => false,
                    () = sleep => true,
                    () = recreated => {
                        tracing::info!(link = %self.wg_link, "WireGuard device recreated empty: applying it whole");
                        // Whole, even with a change pending: no delta round first.
                        self.basis = None;
                        true
                    }
                };
                let started = Instant::now();
                deadline = self.reconcile(rt, timer).await?;
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
                    // Not dropped: a userspace backend would stop wireguard-go.
                    if let Some(wg) = self.wg.take() {
                        wg.keep();
                    }
                }
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ms: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000) + Duration::from_millis(ms)
    }

    const TICK_MS: u64 = 30_000;

    #[test]
    fn a_change_before_the_read_is_due_is_a_delta_round() {
        assert_eq!(
            choose_round(t(10_000), Some(t(0)), None, false, Some(1)),
            Round::Delta
        );
        assert_eq!(
            choose_round(t(10_000), Some(t(0)), Some(t(12_000)), false, Some(1)),
            Round::Delta
        );
    }

    #[test]
    fn a_change_when_the_read_is_due_goes_first_and_the_read_follows() {
        // The tick passed, a peer wake-up passed, or the timer fired with the change.
        for (now, wake, timer) in [
            (TICK_MS, None, false),
            (5_000, Some(t(4_500)), false),
            (TICK_MS, None, true),
        ] {
            assert_eq!(
                choose_round(t(now), Some(t(0)), wake, timer, Some(1)),
                Round::DeltaThenRead,
                "now {now} wake {wake:?} timer {timer}"
            );
        }
    }

    #[test]
    fn a_read_overdue_by_the_deferral_limit_waits_no_longer() {
        let limit = u64::try_from(READ_DEFER_MAX.as_millis()).unwrap_or(u64::MAX);
        assert_eq!(
            choose_round(t(TICK_MS + limit - 1), Some(t(0)), None, false, Some(1)),
            Round::DeltaThenRead
        );
        assert_eq!(
            choose_round(t(TICK_MS + limit), Some(t(0)), None, false, Some(1)),
            Round::Complete { read: true }
        );
        assert_eq!(
            choose_round(t(4_000 + limit), Some(t(0)), Some(t(4_000)), true, Some(1)),
            Round::Complete { read: true }
        );
    }

    #[test]
    fn rounds_that_cannot_be_deltas_are_complete_and_read_when_due() {
        assert_eq!(
            choose_round(t(10_000), Some(t(0)), None, false, None),
            Round::Complete { read: false }
        );
        assert_eq!(
            choose_round(t(10_000), Some(t(0)), None, true, None),
            Round::Complete { read: true }
        );
        assert_eq!(
            choose_round(t(TICK_MS), Some(t(0)), None, false, None),
            Round::Complete { read: true }
        );
        // Nothing changed: nothing to put before a due read.
        assert_eq!(
            choose_round(t(TICK_MS), Some(t(0)), None, true, Some(0)),
            Round::Complete { read: true }
        );
        assert_eq!(
            choose_round(t(10_000), Some(t(0)), None, false, Some(0)),
            Round::Delta
        );
        // A new device is read at once, change or not.
        assert_eq!(
            choose_round(t(0), None, None, false, Some(1)),
            Round::Complete { read: true }
        );
    }
}
