//! `KubeSpanManagerController`: programs the WireGuard device and its peers, the
//! marking set, emits the link/address/routes/rules as operator-layer network specs,
//! and keeps a status per peer with the endpoint-rotation state machine (`docs/kubespan.md` §6–§9).
//!
//! Woken by its inputs, every 30 s, every second while a peer awaits its first
//! handshake, at `lastEndpointChange + 15 s` of peers in `unknown` and when an `up`
//! peer would turn down (§8.5); time comes from a [`Clock`], so tests drive rotation
//! by hand. A change of a few peer specs between those wake-ups is a delta round:
//! only those peers are stepped and written, as WireGuard peer changes and a
//! routed-set delta (see `round`).
//!
//! The decisions are the planner's (`crate::kubespan::planner`): this controller
//! gathers a round's inputs (the specs from a change feed, the device as read, probe
//! replies, server relay allocations), asks the planner's `MeshState` for a plan, and
//! executes it. Its state is in three parts: the mesh state, the kernel handles
//! (`Kernel`) and what was last written to the store (`Written`).
//!
//! By concern: this file holds the public types, the controller's contract (what
//! wakes it: its inputs, and a timer or a recreated device as [`ManagerWake`]) and the
//! choice between a `complete` and a `delta` round; `complete` and `delta` execute the
//! two kinds of plan; `outputs` writes statuses, endpoints and network specs;
//! `teardown` removes kernel state.

mod complete;
mod delta;
mod outputs;
mod probe;
mod teardown;

pub use probe::UdpProber;

pub use crate::kubespan::planner::{PERSISTENT_KEEPALIVE, RETAIN_AFTER_START};

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    fmt,
    net::IpAddr,
    sync::Arc,
    time::{Instant, SystemTime},
};

use futures::future::BoxFuture;
use wirespan_dataplane::{
    marking::{Marking, MarkingError},
    routing::Routing,
    sysctl::{MeshRpFilter, Sysctl, SysctlError},
    wireguard::{WgError, WireGuard},
};

use super::metrics::MeshMetrics;
use crate::{
    config::kubespan::FastPath,
    kubespan::{
        clock::Clock,
        peer_status::PeerStatus,
        planner::{choose_round, MeshState, Round, DELTA_MAX},
    },
    resources::{
        cluster::{self, ClusterIdentity, CLUSTER},
        config::MachineConfig,
        kubespan::{
            KubeSpanConfig, KubeSpanEndpoint, KubeSpanEndpointSpec, KubeSpanIdentity,
            KubeSpanManagerStatus, KubeSpanPeerSpec, KubeSpanPeerStatus, KubeSpanRelayEndpoint,
            KUBESPAN, NS,
        },
        network::{AddressSpec, LinkSpec, RouteSpec, RoutingRuleSpec},
    },
    runtime::{
        Action, ChangeFeed, Controller, ControllerError, ControllerResult, ControllerRuntime,
        Input, InputKind, Output, Triggers,
    },
};

/// Sends a probe through the tunnel to a peer's mesh address, so that a live peer
/// answers (see [`RxTrack`](crate::kubespan::rotation::RxTrack)): its kernel at once
/// (an ICMPv6 error), its WireGuard within 10 s (a keepalive). Best effort: failures
/// are only logged.
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
    /// What the mesh knows between rounds (the planner's state).
    mesh: MeshState,
    /// The kernel objects it drives.
    kernel: Kernel,
    /// What was last written to the store.
    written: Written,
    /// The peer specs' change feed (the mesh state holds their mirror).
    feed: ChangeFeed<KubeSpanPeerSpec>,
    /// The non-peer inputs of the last complete round (`None`: the next is complete).
    basis: Option<Basis>,
}

/// The kernel objects the manager drives, and when it last read them.
#[derive(Default)]
struct Kernel {
    wg: Option<Box<dyn WireGuard + Send>>,
    /// Notified when the backend recreated the device empty (see
    /// [`WireGuard::recreated`]): a complete round with a read follows at once.
    wg_recreated: Option<Arc<tokio::sync::Notify>>,
    link: String,
    marking: Option<ActiveMarking>,
    /// Reverse-path filtering off on the mesh link, with the value it replaced.
    rp_filter: Option<MeshRpFilter>,
    /// When the device was last read (`None`: never, or the device is new).
    last_read: Option<SystemTime>,
    /// Kernel state may exist from an earlier run: clean it up once if disabled.
    first_round: bool,
    /// Why the backend asked for cannot run the link (logged once, in the status).
    refused: Option<String>,
}

/// What the manager last wrote to the store, so unchanged outputs are not rewritten.
#[derive(Debug, Default)]
struct Written {
    /// In the mesh's own type: compared with the planner's each round, converted to
    /// the resource's spec only when written.
    statuses: BTreeMap<String, PeerStatus>,
    endpoints: BTreeMap<String, KubeSpanEndpointSpec>,
    /// Network specs: (type, id).
    specs: BTreeSet<(&'static str, String)>,
}

impl fmt::Debug for KubeSpanManagerController {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KubeSpanManagerController")
            .field("link", &self.kernel.link)
            .field("peers", &self.mesh.statuses().len())
            .finish_non_exhaustive()
    }
}

/// The inputs besides the peer specs, as a complete round saw them.
#[derive(Debug, PartialEq)]
struct Basis {
    config: (u64, crate::resources::kubespan::KubeSpanConfigSpec),
    identity: (u64, crate::resources::kubespan::KubeSpanIdentitySpec),
    cluster: (u64, crate::resources::cluster::ClusterIdentitySpec),
}

/// What, besides its inputs, starts a manager round (a round so started is
/// complete).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ManagerWake {
    /// The deadline the last round asked for passed on the manager's [`Clock`].
    Timer,
    /// The backend recreated the device empty (see [`WireGuard::recreated`]).
    Recreated,
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
    /// What the runtime waits for after a round that asked for `deadline`: that time on
    /// the manager's clock (not the runtime's: tests drive it by hand), or the device
    /// being recreated, whichever first.
    fn next_wake(&self, deadline: Option<SystemTime>) -> Action<ManagerWake> {
        let sleep = deadline.map(|d| self.deps.clock.sleep_until(d));
        let recreated = self.kernel.wg_recreated.clone();
        if sleep.is_none() && recreated.is_none() {
            return Action::await_change();
        }
        Action::requeue_when(Box::pin(async move {
            let sleep = async move {
                match sleep {
                    Some(s) => s.await,
                    None => std::future::pending().await,
                }
            };
            let recreated = async move {
                match recreated {
                    Some(n) => n.notified().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                () = sleep => ManagerWake::Timer,
                () = recreated => ManagerWake::Recreated,
            }
        }))
    }

    /// A manager over `deps`.
    #[must_use]
    pub fn new(deps: ManagerDeps) -> Self {
        Self {
            deps,
            mesh: MeshState::new(),
            kernel: Kernel {
                first_round: true,
                ..Kernel::default()
            },
            written: Written::default(),
            feed: ChangeFeed::new(NS),
            basis: None,
        }
    }

    /// One round; returns the next timer deadline.
    ///
    /// A round is *complete* (every peer looked at, the whole device and marking set
    /// applied) when a timer woke the manager, when the device is due for a read (§8.2
    /// step 2: on the first round with a device and a tick after the last read), when
    /// anything but peer specs changed since the last complete round, or when many
    /// peers did. Otherwise it is a *delta* round over the peers whose specs changed,
    /// with work proportional to them: their statuses stepped without a device read,
    /// their WireGuard peers and routed prefixes applied as changes. Such a change goes
    /// before a due read, which follows at once (see [`choose_round`]).
    async fn round(
        &mut self,
        rt: &mut ControllerRuntime,
        timer: bool,
    ) -> Result<Option<SystemTime>, ControllerError> {
        let changes = self.feed.take(rt)?;
        let changed = self.mesh.sync_specs(changes, self.deps.clock.now());
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
            self.kernel.first_round = false;
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
                self.kernel.wg.is_some()
                    && keys.len() <= DELTA_MAX
                    && self.mesh.delta_allowed()
                    && self.basis.as_ref() == Some(&basis)
            })
            .map(Vec::len);
        match (
            choose_round(now, self.kernel.last_read, self.mesh.wake(), timer, delta),
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
                self.kernel.first_round = false;
                self.basis = Some(basis);
                Ok(wake)
            }
        }
    }
}

impl Controller for KubeSpanManagerController {
    type Event = ManagerWake;

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

    fn start(
        &mut self,
        rt: &mut ControllerRuntime,
    ) -> Result<Triggers<ManagerWake>, ControllerError> {
        self.adopt_outputs(rt)?;
        // A restart looks at everything again.
        self.feed.reset();
        self.basis = None;
        Ok(Triggers::inputs_only())
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        wakes: Vec<ManagerWake>,
    ) -> BoxFuture<'a, ControllerResult<ManagerWake>> {
        Box::pin(async move {
            if wakes.contains(&ManagerWake::Recreated) {
                tracing::info!(link = %self.kernel.link, "WireGuard device recreated empty: applying it whole");
                // Whole, even with a change pending: no delta round first.
                self.basis = None;
            }
            let started = Instant::now();
            let deadline = self.round(rt, !wakes.is_empty()).await?;
            if let Some(m) = &self.deps.metrics {
                m.observe_reconcile(NAME, started.elapsed());
            }
            Ok(self.next_wake(deadline))
        })
    }

    fn stop<'a>(&'a mut self, _rt: &'a mut ControllerRuntime) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            match self.deps.on_stop {
                OnStop::Teardown => {
                    tracing::info!("stopping: tearing down mesh kernel state");
                    self.teardown_kernel().await;
                }
                OnStop::Keep => {
                    tracing::info!(link = %self.kernel.link, "stopping: keeping mesh kernel state");
                    // Not dropped: a userspace backend would stop wireguard-go.
                    if let Some(wg) = self.kernel.wg.take() {
                        wg.keep();
                    }
                }
            }
        })
    }
}
