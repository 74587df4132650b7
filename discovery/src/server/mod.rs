//! The discovery server: wire-compatible with the upstream
//! `sidero.discovery.server.Cluster` service (spec: `docs/discovery-protocol.md` §7).
//!
//! - [`state`]: the pure state machine (merge rules, limits, expiry, GC, fan-out).
//! - [`ratelimit`]: per-address token buckets, pure.
//! - [`snapshot`]: the upstream snapshot file format.
//! - `service`: the tonic shell; `web`: metrics, landing and inspect pages.

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use tokio::{net::TcpListener, task::JoinHandle};
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;

mod error;
mod health;
pub mod metrics;
mod panic;
pub mod ratelimit;
pub mod relay;
#[doc(hidden)]
pub mod service;
#[doc(hidden)]
pub mod shared;
pub mod snapshot;
pub mod state;
pub mod transport;
mod watch;
mod watch_frames;
mod web;

pub use error::{RequestError, ServerError, SnapshotError};
pub use ipnet::IpNet;
pub use ratelimit::{DELETE_BURST, DELETE_RATE};
pub use service::{client_address, grpc_timeout};

use crate::proto::server::cluster_server::ClusterServer;
use service::ClusterService;
use shared::Shared;

/// How long the snapshot save at shutdown may take (upstream: 10 s).
pub const SHUTDOWN_SAVE_BUDGET: Duration = Duration::from_secs(10);

/// How long shutdown waits for connections to drain before stopping hard.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// TLS material: PEM files of the server certificate chain and its private key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// Certificate chain (PEM).
    pub cert: PathBuf,
    /// Private key (PEM).
    pub key: PathBuf,
}

/// Server options. [`Default`] gives the upstream defaults, except that the snapshot
/// is off (upstream writes `/var/discovery-service/state.binpb` by default; the CLI
/// asks for a path explicitly).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Interval between garbage collection passes (one also runs at start).
    pub gc_interval: Duration,
    /// Per-client-address rate limit (15/s, burst 60).
    pub rate_limit: bool,
    /// Returned to every Hello as the endpoint to use instead.
    pub redirect_endpoint: Option<String>,
    /// Snapshot file; `None` disables persistence.
    pub snapshot_path: Option<PathBuf>,
    /// Interval between snapshot saves (one more is written at shutdown).
    pub snapshot_interval: Duration,
    /// Report the client's address in Hello.
    pub report_client_ip: bool,
    /// Networks of the reverse proxies in front of the server: only a connection from
    /// inside one of them may name the client address in `X-Real-IP` or
    /// `X-Forwarded-For` (see [`client_address`]). Empty (the default): headers are
    /// ignored and the transport peer is the client.
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// Whether AffiliateDelete is served or refused (PERMISSION_DENIED).
    pub affiliate_delete: DeletePolicy,
    /// Most clusters at once; a request that would create one more gets
    /// RESOURCE_EXHAUSTED.
    pub max_clusters: usize,
    /// Bytes the stored clusters and affiliates may take (see
    /// [`state::State::set_state_budget`]); a request that would grow past it gets
    /// RESOURCE_EXHAUSTED.
    pub state_budget: usize,
    /// Events queued per watcher before it is aborted as too slow (if it also took
    /// nothing for `watch_stall`) or switched to catch-up (if it reads).
    pub watch_queue: usize,
    /// How long a watcher with a full queue may take nothing before it is aborted.
    pub watch_stall: Duration,
    /// Bytes of snapshots and catch-up batches held for watchers before the slowest
    /// (those that took nothing for `watch_stall`) are aborted with ABORTED.
    pub watch_budget: usize,
    /// Most affiliates in one cluster (upstream: 1024).
    pub max_affiliates: usize,
    /// Serve TLS (ALPN `h2`) instead of plaintext h2c.
    pub tls: Option<TlsFiles>,
    /// The server relay (`wirespan.relay.v1`); off when `None`.
    pub relay: Option<relay::RelayConfig>,
    /// Connection caps, timeouts and HTTP/2 limits of both listeners.
    pub transport: transport::TransportLimits,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            gc_interval: Duration::from_secs(60),
            rate_limit: true,
            redirect_endpoint: None,
            snapshot_path: None,
            snapshot_interval: Duration::from_secs(600),
            report_client_ip: true,
            trusted_proxies: Vec::new(),
            affiliate_delete: DeletePolicy::Allow,
            max_clusters: state::MAX_CLUSTERS,
            state_budget: state::STATE_BUDGET,
            watch_queue: state::WATCH_QUEUE,
            watch_stall: state::WATCH_STALL,
            watch_budget: state::WATCH_BUDGET,
            max_affiliates: state::MAX_AFFILIATES,
            tls: None,
            relay: None,
            transport: transport::TransportLimits::default(),
        }
    }
}

/// What the server does with AffiliateDelete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeletePolicy {
    /// Delete the affiliate (upstream behaviour), rate-limited per address.
    #[default]
    Allow,
    /// Refuse with PERMISSION_DENIED: anyone who knows the cluster ID could delete
    /// any affiliate, so a public server may leave affiliates to expire by their TTL.
    Refuse,
}

/// A server running in the background on the current tokio runtime.
pub struct RunningServer {
    local_addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    shared: Arc<Shared>,
    grpc: JoinHandle<Result<(), tonic::transport::Error>>,
    web: Option<JoinHandle<std::io::Result<()>>>,
    background: JoinHandle<()>,
    // Stops everything if the handle is dropped without `shutdown`.
    _stop_on_drop: StopOnDrop,
}

struct StopOnDrop(Arc<Shared>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.stop();
    }
}

impl std::fmt::Debug for RunningServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningServer")
            .field("local_addr", &self.local_addr)
            .field("metrics_addr", &self.metrics_addr)
            .finish_non_exhaustive()
    }
}

impl RunningServer {
    /// The gRPC listener's address.
    #[must_use]
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The metrics/web listener's address, if one was given.
    #[must_use]
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// Current state sizes.
    #[must_use]
    pub fn counts(&self) -> state::Counts {
        self.shared.state().counts()
    }

    /// The Prometheus text exposition (what `/metrics` serves).
    #[must_use]
    pub fn metrics_text(&self) -> String {
        let counts = self.shared.state().counts();
        self.shared.metrics.render(counts)
    }

    /// Runs one GC pass now (the periodic one keeps its schedule).
    pub fn gc_now(&self) -> state::GcStats {
        run_gc(&self.shared)
    }

    /// Graceful stop: stop accepting, end Watch streams with OK, wait for connections
    /// to drain (at most [`SHUTDOWN_GRACE`], then stop hard), save the snapshot if
    /// configured.
    ///
    /// # Errors
    /// The transport failed while serving, or the snapshot could not be saved.
    pub async fn shutdown(mut self) -> Result<(), ServerError> {
        self.shared.stop();
        self.shared.state().close_subscriptions();
        let served = match tokio::time::timeout(SHUTDOWN_GRACE, &mut self.grpc).await {
            Ok(Ok(result)) => result.map_err(ServerError::from),
            Ok(Err(join)) => Err(ServerError::Task(join.to_string())),
            Err(_) => {
                tracing::warn!("connections did not drain in time, stopping hard");
                self.grpc.abort();
                Ok(())
            }
        };
        if let Some(web) = self.web.take() {
            if tokio::time::timeout(Duration::from_secs(1), web)
                .await
                .is_err()
            {
                tracing::warn!("metrics listener did not stop in time");
            }
        }
        self.background.abort();
        let saved = match self.shared.config.snapshot_path.clone() {
            Some(path) => {
                match tokio::time::timeout(
                    SHUTDOWN_SAVE_BUDGET,
                    save_snapshot(Arc::clone(&self.shared), path),
                )
                .await
                {
                    Ok(r) => r,
                    Err(_) => {
                        tracing::error!(budget = ?SHUTDOWN_SAVE_BUDGET, "snapshot save at shutdown did not finish in time");
                        Err(ServerError::Task(format!(
                            "snapshot save exceeded the {SHUTDOWN_SAVE_BUDGET:?} shutdown budget"
                        )))
                    }
                }
            }
            None => Ok(()),
        };
        served?;
        saved
    }
}

async fn save_snapshot(shared: Arc<Shared>, path: PathBuf) -> Result<(), ServerError> {
    let start = Instant::now();
    let result = tokio::task::spawn_blocking(move || {
        let _one_at_a_time = shared
            .save_lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let r = snapshot::save(&path, &shared.state);
        shared.metrics.storage("save", r.is_ok());
        r
    })
    .await
    .map_err(|e| ServerError::Task(e.to_string()))?;
    match result {
        Ok(stats) => {
            tracing::info!(
                clusters = stats.clusters,
                bytes = stats.bytes,
                elapsed_ms = start.elapsed().as_millis() as u64,
                "snapshot saved"
            );
            Ok(())
        }
        Err(e) => {
            tracing::error!(error = %e, "snapshot save failed");
            Err(e.into())
        }
    }
}

fn run_gc(shared: &Shared) -> state::GcStats {
    let stats = shared.state().gc(Instant::now());
    shared.metrics.gc(stats);
    if stats != state::GcStats::default() {
        tracing::debug!(
            clusters = stats.clusters,
            affiliates = stats.affiliates,
            endpoints = stats.endpoints,
            "gc"
        );
    }
    stats
}

/// Loads the snapshot, if configured; never fails the start.
fn restore(config: &ServerConfig) -> state::State {
    let Some(path) = &config.snapshot_path else {
        return state::State::new();
    };
    let limits = snapshot::LoadLimits {
        max_affiliates: config.max_affiliates,
        max_clusters: config.max_clusters,
        state_budget: config.state_budget,
    };
    match snapshot::load(path, Instant::now(), SystemTime::now(), limits) {
        snapshot::LoadOutcome::Missing => {
            tracing::info!(path = %path.display(), "no snapshot, starting empty");
            state::State::new()
        }
        snapshot::LoadOutcome::Loaded(state) => {
            let c = state.counts();
            tracing::info!(
                path = %path.display(),
                clusters = c.clusters,
                affiliates = c.affiliates,
                dropped = c.snapshot_dropped,
                "snapshot restored"
            );
            state
        }
        snapshot::LoadOutcome::Corrupt { error, moved_to } => {
            tracing::error!(
                path = %path.display(),
                moved_to = ?moved_to,
                error = %error,
                "snapshot unreadable, moved aside; starting empty"
            );
            state::State::new()
        }
    }
}

async fn background(shared: Arc<Shared>) {
    let gc_every = shared.config.gc_interval.max(Duration::from_millis(10));
    let mut gc = tokio::time::interval_at(tokio::time::Instant::now() + gc_every, gc_every);
    gc.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Watchers that stopped reading are aborted within a quarter of the stall timeout
    // even when no new event arrives to notice it.
    let stall_every = (shared.config.watch_stall / 4).max(Duration::from_millis(10));
    let mut stalled = tokio::time::interval(stall_every);
    stalled.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut limiter = tokio::time::interval(Duration::from_secs(60));
    limiter.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // A floor only so a zero interval cannot spin; short intervals are legitimate (the
    // kill-during-save test writes many snapshots a second).
    let snapshot_every = shared
        .config
        .snapshot_interval
        .max(Duration::from_millis(10));
    let mut snapshot =
        tokio::time::interval_at(tokio::time::Instant::now() + snapshot_every, snapshot_every);
    snapshot.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = gc.tick() => { run_gc(&shared); }
            due = stalled.tick() => {
                let mut state = shared.state();
                let now = Instant::now();
                // Lateness includes waiting for the state lock: both delay streams.
                state.runtime_tick(now, due.elapsed(), stall_every);
                state.check_stalled(now);
            }
            _ = limiter.tick() => {
                shared.cleanup_limiters(Instant::now());
            }
            _ = snapshot.tick(), if shared.config.snapshot_path.is_some() => {
                if let Some(path) = shared.config.snapshot_path.clone() {
                    // Errors are logged inside; the next interval tries again.
                    let _ = save_snapshot(Arc::clone(&shared), path).await;
                }
            }
        }
    }
}

/// How often the runtime-lag probe is queued.
const LAG_PROBE_EVERY: Duration = Duration::from_millis(100);

/// Queues a probe task into the runtime from a thread of its own every
/// [`LAG_PROBE_EVERY`] (see [`state::RuntimeLag`]): tasks queued from outside a
/// runtime wait in its shared queue. Stops with the server.
fn spawn_lag_probe(shared: &Shared, runtime: tokio::runtime::Handle, stop: CancellationToken) {
    let lag = Arc::downgrade(&shared.state().runtime_lag());
    let spawned = std::thread::Builder::new()
        .name("discovery-lag-probe".into())
        .spawn(move || {
            while !stop.is_cancelled() {
                let Some(lag) = lag.upgrade() else { return };
                if lag.probe_queued(Instant::now()) {
                    let ran = Arc::clone(&lag);
                    runtime.spawn(async move { ran.probe_ran(Instant::now()) });
                }
                drop(lag);
                std::thread::sleep(LAG_PROBE_EVERY);
            }
        });
    if let Err(error) = spawned {
        // Without it only the periodic task's lateness extends the stall timeout.
        tracing::warn!(%error, "runtime-lag probe thread not started");
    }
}

fn tls_acceptor(files: &TlsFiles) -> Result<tokio_rustls::TlsAcceptor, ServerError> {
    let read = |path: &PathBuf| {
        std::fs::read(path).map_err(|source| ServerError::TlsFile {
            path: path.clone(),
            source,
        })
    };
    let (cert, key) = (read(&files.cert)?, read(&files.key)?);
    let bad = |what: &str, e: &dyn std::fmt::Display| ServerError::Tls(format!("{what}: {e}"));
    let chain = rustls_pemfile::certs(&mut cert.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad("certificate", &e))?;
    let key = rustls_pemfile::private_key(&mut key.as_slice())
        .map_err(|e| bad("private key", &e))?
        .ok_or_else(|| ServerError::Tls(format!("no private key in {}", files.key.display())))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| bad("protocol versions", &e))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| bad("certificate and key", &e))?;
    // gRPC is HTTP/2 only.
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// How the descriptor limit is shared between connections and the relay; logged, with
/// a warning when the relay cannot hold its configured allocations.
fn fd_plan(config: &ServerConfig) -> transport::FdPlan {
    let nofile = transport::limits::nofile_limit();
    let plan = transport::FdPlan::new(
        nofile,
        config.transport.max_connections,
        config.relay.is_some(),
    );
    if let Some(relay) = &config.relay {
        let wanted = relay.limits.max_allocations.saturating_mul(2);
        if plan.relay < wanted.min(relay.limits.max_fds) {
            tracing::warn!(
                nofile = ?nofile,
                relay_allocations = plan.relay / 2,
                "the descriptor limit holds fewer relay allocations than configured; raise LimitNOFILE"
            );
        }
    }
    if plan.connections < config.transport.max_connections {
        tracing::warn!(
            nofile = ?nofile,
            connections = plan.connections,
            "the descriptor limit holds fewer gRPC connections than configured; raise LimitNOFILE"
        );
    }
    plan
}

/// The gRPC server: its HTTP/2 limits, services and accept loop.
fn serve_grpc(
    shared: &Arc<Shared>,
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    fds: transport::FdPlan,
) -> JoinHandle<Result<(), tonic::transport::Error>> {
    let limits = shared.config.transport;
    let max = limits.max_request_bytes;
    let token = shared.shutdown.clone();
    let service = ClusterService {
        shared: Arc::clone(shared),
    };
    let svc = watch::Routes {
        cluster: ClusterServer::new(service.clone()).max_decoding_message_size(max),
        service,
        max_request_bytes: max,
    };
    // Without the relay its service is absent: clients get UNIMPLEMENTED.
    let relay = shared.config.relay.map(|mut config| {
        config.limits.max_fds = config.limits.max_fds.min(fds.relay);
        let relay = relay::Relay::start(config, shared.metrics.relay.clone(), token.clone());
        crate::proto::relay::relay_server::RelayServer::new(relay::RelayService {
            relay,
            shared: Arc::clone(shared),
        })
        .max_decoding_message_size(max)
    });
    let health = crate::proto::health::health_server::HealthServer::new(health::HealthService {
        shutdown: token.clone(),
    })
    .max_decoding_message_size(max);
    let admission = transport::Admission::new(
        "grpc",
        fds.connections,
        limits.max_connections_per_ip,
        shared.metrics.transport.clone(),
    );
    let incoming = transport::grpc_incoming(
        listener,
        tls,
        admission,
        limits.handshake_timeout,
        token.clone(),
    );
    let timeout = transport::RequestTimeoutLayer {
        limit: limits.request_timeout,
        metrics: shared.metrics.transport.clone(),
    };
    // No server-initiated pings and no ping-rate enforcement: hyper/h2 never answers
    // client pings with GOAWAY too_many_pings, which is laxer than upstream's 10 s
    // minimum, as the protocol allows.
    tokio::spawn(
        Server::builder()
            .max_concurrent_streams(limits.max_concurrent_streams)
            .initial_stream_window_size(transport::limits::STREAM_WINDOW)
            .initial_connection_window_size(transport::limits::CONNECTION_WINDOW)
            .max_frame_size(transport::limits::MAX_FRAME)
            .http2_max_header_list_size(transport::limits::MAX_HEADER_LIST)
            .layer(panic::CatchPanicLayer)
            .layer(timeout)
            .add_service(svc)
            .add_optional_service(relay)
            .add_service(health)
            .serve_with_incoming_shutdown(incoming, token.cancelled_owned()),
    )
}

/// Serves gRPC (plaintext h2c, or TLS if `config.tls` is set) on `listener` until
/// shutdown.
///
/// # Errors
/// The listener has no local address, or the TLS files are unreadable or invalid.
pub async fn spawn(
    config: ServerConfig,
    listener: TcpListener,
) -> Result<RunningServer, ServerError> {
    spawn_with_metrics(config, listener, None).await
}

/// Like [`spawn`], and also serves `/metrics`, `/` and `/inspect` on
/// `metrics_listener`.
///
/// # Errors
/// As [`spawn`], or the metrics listener has no local address.
pub async fn spawn_with_metrics(
    config: ServerConfig,
    listener: TcpListener,
    metrics_listener: Option<TcpListener>,
) -> Result<RunningServer, ServerError> {
    let local_addr = listener.local_addr().map_err(ServerError::LocalAddr)?;
    let metrics_addr = metrics_listener
        .as_ref()
        .map(TcpListener::local_addr)
        .transpose()
        .map_err(ServerError::Web)?;
    let tls = config.tls.as_ref().map(tls_acceptor).transpose()?;
    let mut state = restore(&config);
    state.set_max_affiliates(config.max_affiliates);
    state.set_max_clusters(config.max_clusters);
    state.set_state_budget(config.state_budget);
    state.set_watch_stall(config.watch_stall);
    state.set_watch_budget(config.watch_budget);
    let token = CancellationToken::new();
    let shared = Arc::new(Shared::new(config, state, token.clone()));
    let fds = fd_plan(&shared.config);
    // GC at start (before serving, so it cannot race the first requests), then every
    // interval.
    run_gc(&shared);
    let grpc = serve_grpc(&shared, listener, tls, fds);
    let web = metrics_listener.map(|l| {
        let limits = shared.config.transport;
        let admission = transport::Admission::new(
            "web",
            fds.web,
            limits.max_connections_per_ip,
            shared.metrics.transport.clone(),
        );
        tokio::spawn(transport::serve_web(
            l,
            web::router(Arc::clone(&shared)),
            admission,
            limits.handshake_timeout,
            token.clone(),
        ))
    });
    let background = tokio::spawn(background(Arc::clone(&shared)));
    spawn_lag_probe(&shared, tokio::runtime::Handle::current(), token);
    tracing::info!(
        addr = %local_addr,
        metrics = ?metrics_addr,
        tls = shared.config.tls.is_some(),
        relay = ?shared.config.relay.map(|r| r.bind),
        "discovery server listening"
    );
    Ok(RunningServer {
        local_addr,
        metrics_addr,
        _stop_on_drop: StopOnDrop(Arc::clone(&shared)),
        shared,
        grpc,
        web,
        background,
    })
}
