//! `wirespan node`: the mesh daemon. Runs in the network namespace it was started
//! in: loads `--config FILE` (and reloads it after each complete write; `wirespan
//! apply` replaces it through the API; a bad file keeps the last good config, see
//! `config_loader`), runs the controllers and serves the resource API. Under
//! systemd (`Type=notify`) it reports ready once the first reconcile is done (see
//! [`Readiness`]).

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;
use wirespan_control::{
    api::{
        remote_server,
        server::{bind, serve, ResourceApi},
    },
    config::cluster::ClusterConfig,
    config_loader as loader,
    controllers::{kubespan, network, probe},
    resources::{
        self,
        config::MachineConfig,
        identity::{NodeIdentity, NodeIdentityController, LOCAL},
        kubespan::{KubeSpanManagerStatus, KUBESPAN, NS as KUBESPAN_NS},
        meta,
    },
    runtime::{ResourceKind as _, Runtime, Store, StoreOptions},
};
use wirespan_dataplane::{netns::Netns, routing::NetlinkRouting};

/// How often the store is looked at until the node is ready.
const READY_POLL: Duration = Duration::from_millis(50);

/// Options of `wirespan node`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Directory for persistent state (node identity, keys).
    #[arg(long, env = "WIRESPAN_STATE_DIR", default_value = "/var/lib/wirespan")]
    pub state_dir: PathBuf,
    /// Machine config (multi-document YAML); reloaded after each complete write. A bad
    /// file (invalid, empty, over 4 MiB) is rejected, logged and shown by `wirespan get
    /// configstatus`, and the last good config stays (at start: the copy kept in the
    /// state dir; fatal when there is none).
    #[arg(long, env = "WIRESPAN_CONFIG")]
    pub config: Option<PathBuf>,
    /// Also serve the API on this TCP address with mutual TLS 1.3 (off by default; the
    /// local socket stays). The node's certificate is issued from the cluster API CA
    /// in the config (`ClusterConfig.apiCaCert`/`apiCaKey`); clients need a
    /// certificate from that CA (`wirespan gen client`). Every node of a cluster should
    /// use the same port: a node forwards requests for another node to that port on
    /// the other node's mesh address.
    #[arg(long, value_name = "ADDR:PORT")]
    pub api_listen: Option<std::net::SocketAddr>,
    /// The root under which `HostnameConfig`, `ResolverConfig` and `TimeServerConfig`
    /// manage the host's files (`/etc/hostname`, `/etc/resolv.conf`, the resolved,
    /// timesyncd and chrony drop-ins). `/` on a host; the lab gives each node a
    /// directory of its own, so a lab node never writes the machine's files.
    #[arg(long, value_name = "DIR", default_value = "/")]
    pub host_root: PathBuf,
    #[command(flatten)]
    pub mesh: MeshArgs,
}

/// Mesh options of `wirespan node`.
#[derive(Debug, clap::Args)]
pub struct MeshArgs {
    /// Serve Prometheus metrics on this address (`GET /metrics`).
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// What happens to the WireGuard link, marking table, rules and routes on a
    /// graceful stop: `teardown` removes them, `keep` leaves the mesh forwarding (a
    /// later start adopts or replaces what it finds).
    #[arg(long, value_enum, default_value_t = OnStopArg::Teardown)]
    pub on_stop: OnStopArg,
    /// WireGuard implementation: kernel if available, else `wirespan wireguard` (auto),
    /// or forced (`userspace-go`: wireguard-go).
    #[arg(long, value_enum, default_value_t = WireGuardArg::Auto)]
    pub wireguard: WireGuardArg,
    /// The `wirespan` executable run as `wirespan wireguard` for the userspace device
    /// (default: this executable).
    #[arg(long, value_name = "PATH")]
    pub wireguard_binary: Option<PathBuf>,
}

/// `--on-stop`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum OnStopArg {
    /// Leave kernel state in place.
    Keep,
    /// Remove kernel state.
    Teardown,
}

/// Why `--wireguard kernel` cannot run here (the daemon and `lab up` say the same).
pub const KERNEL_WIREGUARD_MISSING: &str = "--wireguard kernel: this kernel cannot create \
    WireGuard links (the `wireguard` kernel module is missing or cannot be loaded: \
    `modprobe wireguard`); use --wireguard auto, userspace (wirespan wireguard) or \
    userspace-go (wireguard-go)";

/// `--wireguard`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WireGuardArg {
    /// Kernel if supported, else `wirespan wireguard`.
    Auto,
    /// Kernel WireGuard.
    Kernel,
    /// `wirespan wireguard`: wirespan's own userspace device (this executable).
    Userspace,
    /// wireguard-go (from PATH).
    UserspaceGo,
}

impl WireGuardArg {
    /// The dataplane's backend choice.
    #[must_use]
    pub fn choice(self) -> wirespan_dataplane::wireguard::BackendChoice {
        use wirespan_dataplane::wireguard::BackendChoice;
        match self {
            Self::Auto => BackendChoice::Auto,
            Self::Kernel => BackendChoice::Kernel,
            Self::Userspace => BackendChoice::Userspace,
            Self::UserspaceGo => BackendChoice::UserspaceGo,
        }
    }
}

/// Mirrors the ConfigStatus and DiscoveryServiceStatus resources into the metrics at
/// each scrape (they change rarely; reading them then costs a few store lookups).
fn config_status_collector(store: Store) -> kubespan::metrics::Collector {
    use wirespan_control::resources::{
        cluster::DiscoveryServiceStatus,
        config::{attempt, ConfigStatus, CURRENT},
    };
    Box::new(move |m| {
        let counts: Vec<(String, u64)> = store
            .list::<DiscoveryServiceStatus>(
                DiscoveryServiceStatus::DEFAULT_NAMESPACE,
                &wirespan_control::runtime::Filter::all(),
            )
            .iter()
            .map(|r| (r.metadata.id.clone(), r.spec.republishes))
            .collect();
        m.set_discovery_republishes(&counts);
        if let Ok(st) = store.get::<ConfigStatus>(ConfigStatus::DEFAULT_NAMESPACE, CURRENT) {
            let s = &st.spec;
            m.set_config(
                s.last_attempt != attempt::REJECTED,
                s.documents,
                &s.accepted_version,
                &s.source,
            );
        }
    })
}

/// Registers the KubeSpan controllers for the namespace the node runs in; returns the
/// metrics to serve.
fn register_mesh(
    runtime: &mut Runtime,
    state_dir: &Path,
    args: &MeshArgs,
) -> anyhow::Result<std::sync::Arc<kubespan::metrics::MeshMetrics>> {
    use std::sync::Arc;
    use wirespan_dataplane::{
        kernel_marking::KernelMarking, netns::Netns, routing::NetlinkRouting,
    };
    let netns = Netns::current();
    let metrics = Arc::new(kubespan::metrics::MeshMetrics::new());
    let m = Arc::clone(&metrics);
    runtime.on_controller_restart(Arc::new(move |name| m.controller_restarted(name)));
    let routing = NetlinkRouting::new(&netns).context("opening rtnetlink")?;
    // Forced kernel WireGuard on a kernel without it would only fail at the first
    // reconcile, over and over: refuse to start instead, saying what is missing.
    if matches!(args.wireguard, WireGuardArg::Kernel)
        && !wirespan_dataplane::wireguard::kernel::supported(&netns)
    {
        anyhow::bail!("{KERNEL_WIREGUARD_MISSING}");
    }
    kubespan::register(
        runtime,
        kubespan::Deps {
            state_dir: state_dir.to_owned(),
            links: Arc::new(kubespan::identity::IpLinkSource(netns.clone())),
            manager: kubespan::manager::ManagerDeps {
                wireguard: Arc::new(kubespan::KernelWireGuard {
                    netns: netns.clone(),
                    choice: args.wireguard.choice(),
                    wirespan_binary: args.wireguard_binary.clone(),
                }),
                marking: Arc::new(kubespan::KernelMarkingFactory {
                    marking: KernelMarking {
                        netns: netns.clone(),
                    },
                    metrics: Some(Arc::clone(&metrics)),
                }),
                routing_cleanup: Some(Box::new(routing)),
                clock: Arc::new(wirespan_control::kubespan::clock::SystemClock),
                metrics: Some(Arc::clone(&metrics)),
                on_stop: match args.on_stop {
                    OnStopArg::Keep => kubespan::manager::OnStop::Keep,
                    OnStopArg::Teardown => kubespan::manager::OnStop::Teardown,
                },
                sysctl: Some(Arc::new(wirespan_dataplane::sysctl::ProcSysctl::new(netns))),
                prober: Some(Arc::new(kubespan::manager::UdpProber::new())),
            },
        },
    )?;
    Ok(metrics)
}

/// What readiness depends on, as found in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Readiness {
    /// The node identity exists: the controllers have run once.
    identity: bool,
    /// The config in force turns the mesh on and names the cluster, so the mesh
    /// manager has something to program.
    mesh_expected: bool,
    /// The mesh manager has programmed the device once (it then writes its status).
    mesh_programmed: bool,
}

impl Readiness {
    fn observe(store: &Store) -> Self {
        let config = store
            .get::<MachineConfig>(MachineConfig::DEFAULT_NAMESPACE, resources::config::ACTIVE)
            .ok();
        let mesh_expected = config.is_some_and(|c| {
            c.spec.config.singleton::<ClusterConfig>().is_some()
                && kubespan::config::effective(&c.spec.config).is_some_and(|k| k.config.enabled)
        });
        Self {
            identity: store
                .get::<NodeIdentity>(NodeIdentity::DEFAULT_NAMESPACE, LOCAL)
                .is_ok(),
            mesh_expected,
            mesh_programmed: store
                .get::<KubeSpanManagerStatus>(KUBESPAN_NS, KUBESPAN)
                .is_ok(),
        }
    }

    /// The first reconcile is done: the identity is there and, when the mesh is on,
    /// the WireGuard device, marking and routes were programmed.
    fn ready(self) -> bool {
        self.identity && (!self.mesh_expected || self.mesh_programmed)
    }
}

/// Tells systemd `READY=1` once the store shows the first reconcile done.
async fn notify_when_ready(store: Store, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(READY_POLL);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        if Readiness::observe(&store).ready() {
            tracing::info!("first reconcile done: node ready");
            crate::notify::notify_or_log("READY=1");
            return;
        }
    }
}

pub fn run(args: &Args, socket: &Path) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(run_async(args, socket))
}

async fn run_async(args: &Args, socket: &Path) -> anyhow::Result<()> {
    // A burst of thousands of affiliates (a big cluster joining) must not overrun the
    // runtime's own watches: an overrun stops the runtime (`docs/kubespan.md` §3.4).
    let store = Store::new(StoreOptions {
        history_capacity: 65_536,
    });
    meta::register(&store, &resources::definitions())
        .context("registering resource definitions")?;
    wirespan_control::files::ensure_private_dir(&args.state_dir)
        .with_context(|| format!("creating the state dir {}", args.state_dir.display()))?;
    let config_loader = loader::ConfigLoader::in_state_dir(store.clone(), &args.state_dir);
    // Parsing is blocking work: off the async workers, like every later parse.
    let (start_loader, start_file) = (config_loader.clone(), args.config.clone());
    tokio::task::spawn_blocking(move || start_loader.start(start_file.as_deref()))
        .await
        .context("loading the config")?
        .with_context(|| match &args.config {
            Some(p) => format!(
                "loading config {} (and no last good config to fall back to)",
                p.display()
            ),
            None => "loading the last good config".to_owned(),
        })?;
    let mut runtime = Runtime::new(store.clone());
    runtime.register(NodeIdentityController::new(args.state_dir.clone()))?;
    let netns = Netns::current();
    let net_deps = network::Deps {
        net: Arc::new(Mutex::new(
            NetlinkRouting::new(&netns).context("opening netlink")?,
        )),
        feed: Arc::new(network::NetlinkFeed(netns)),
    };
    let host = network::host::HostDeps::under(network::host::HostPaths::under(&args.host_root));
    network::register_on_host(&mut runtime, &net_deps, &host)?;
    probe::register(&mut runtime)?;
    wirespan_control::controllers::cluster::register(&mut runtime, Default::default())?;
    let metrics = register_mesh(&mut runtime, &args.state_dir, &args.mesh)?;
    metrics.set_collector(config_status_collector(store.clone()));
    let api = ResourceApi::new(store.clone(), Some(runtime.graph()))
        .with_config_apply(config_loader.clone(), args.config.clone());
    let listener = bind(socket)?;
    tracing::info!(socket = %socket.display(), state_dir = %args.state_dir.display(), "node started");

    let cancel = CancellationToken::new();
    if let Some(addr) = args.mesh.metrics_listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding --metrics-listen {addr}"))?;
        tracing::info!(addr = %listener.local_addr()?, "serving metrics");
        tokio::spawn(kubespan::metrics::serve(listener, metrics, cancel.clone()));
    }
    // The SIGTERM handler before anything can report readiness (see `discovery`).
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut rt_task = tokio::spawn(runtime.run(cancel.clone()));
    tokio::spawn(notify_when_ready(store.clone(), cancel.clone()));
    if let Some(path) = &args.config {
        tokio::spawn(config_loader.watch_file(path.clone(), cancel.clone(), None));
    }
    // Rolls a config trial (`apply --mode try`) back at its deadline.
    tokio::spawn(config_loader.enforce_trials(cancel.clone()));
    if let Some(addr) = args.api_listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding --api-listen {addr}"))?;
        tracing::info!(addr = %listener.local_addr()?, "serving the API with mutual TLS");
        let (store, api, cancel) = (store.clone(), api.clone(), cancel.clone());
        tokio::spawn(async move {
            if let Err(e) = remote_server::serve(listener, store, api, cancel).await {
                tracing::error!(error = %e, "remote API server failed");
            }
        });
    }
    let mut api_task = tokio::spawn({
        let cancel = cancel.clone();
        let socket = socket.to_owned();
        async move { serve(listener, &socket, api, cancel).await }
    });

    // Shutdown begins: tell systemd (before the teardown, which may take a while),
    // then stop everything.
    let stop = || {
        crate::notify::notify_or_log("STOPPING=1");
        cancel.cancel();
    };
    // Whichever ends first (a signal, the runtime failing, the server failing) stops
    // everything; the other half is then awaited so its tasks finish cleanly.
    let (rt_res, api_res) = tokio::select! {
        _ = term.recv() => {
            tracing::info!("SIGTERM, shutting down");
            stop();
            (rt_task.await, api_task.await)
        }
        _ = tokio::signal::ctrl_c() => {
            tracing::info!("SIGINT, shutting down");
            stop();
            (rt_task.await, api_task.await)
        }
        r = &mut rt_task => {
            stop();
            (r, api_task.await)
        }
        a = &mut api_task => {
            stop();
            (rt_task.await, a)
        }
    };
    // The server removes its socket; make sure even on error.
    let _ = std::fs::remove_file(socket);
    rt_res
        .context("runtime task")?
        .context("controller runtime")?;
    api_res.context("API task")??;
    tracing::info!("node stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Readiness;

    #[test]
    fn ready_after_identity_and_mesh_programming_when_the_mesh_is_on() {
        let r = |identity, mesh_expected, mesh_programmed| {
            Readiness {
                identity,
                mesh_expected,
                mesh_programmed,
            }
            .ready()
        };
        assert!(!r(false, false, false));
        assert!(r(true, false, false));
        assert!(!r(true, true, false));
        assert!(r(true, true, true));
        assert!(!r(false, true, true));
    }
}
