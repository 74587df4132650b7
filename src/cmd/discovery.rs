//! `wirespan discovery`: the discovery server. Under systemd (`Type=notify`) it
//! reports ready once it listens.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::Context as _;
use wirespan_discovery::{
    server::relay::{table::RelayLimits, RelayConfig},
    server::{self, transport::TransportLimits, DeletePolicy, ServerConfig, TlsFiles},
};

/// `mib` in bytes, if it is positive and fits.
fn mib_to_bytes(mib: usize, flag: &str) -> anyhow::Result<usize> {
    match mib.checked_mul(1 << 20).filter(|b| *b > 0) {
        Some(bytes) => Ok(bytes),
        None => anyhow::bail!("{flag} must be between 1 and {}", usize::MAX >> 20),
    }
}

fn parse_delete_policy(s: &str) -> Result<DeletePolicy, String> {
    match s {
        "allow" => Ok(DeletePolicy::Allow),
        "refuse" => Ok(DeletePolicy::Refuse),
        _ => Err(format!("{s:?} is not a delete policy: use allow or refuse")),
    }
}

/// Options of `wirespan discovery`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// gRPC listen address (plaintext h2c, or TLS with --tls-cert/--tls-key).
    #[arg(long, value_name = "ADDR:PORT")]
    listen: SocketAddr,
    /// Address of the metrics, landing and inspect pages (off when absent).
    #[arg(long, value_name = "ADDR:PORT")]
    metrics_listen: Option<SocketAddr>,
    /// Interval between garbage collection passes.
    #[arg(long, value_name = "DURATION", default_value = "1m", value_parser = humantime::parse_duration)]
    gc_interval: Duration,
    /// Snapshot file (upstream format); state is restored from it at start.
    #[arg(long, value_name = "FILE")]
    snapshot_path: Option<PathBuf>,
    /// Interval between snapshot saves (one more is written at shutdown).
    #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = humantime::parse_duration)]
    snapshot_interval: Duration,
    /// Disable the per-client-address rate limit (15 requests/s, burst 60).
    #[arg(long)]
    no_rate_limit: bool,
    /// Most affiliates in one cluster (upstream: 1024); a new affiliate beyond it gets
    /// RESOURCE_EXHAUSTED.
    #[arg(long, value_name = "N", default_value_t = wirespan_discovery::server::state::MAX_AFFILIATES)]
    max_affiliates: usize,
    /// MiB of snapshots and catch-up batches the server may hold for watchers; above
    /// it, watchers that took nothing for 2 s are aborted (ABORTED), least recently
    /// active first. Watchers that keep reading are never aborted.
    #[arg(long, value_name = "MIB", default_value_t = wirespan_discovery::server::state::WATCH_BUDGET >> 20)]
    watch_budget_mib: usize,
    /// Send every client to this `host:port` in Hello.
    #[arg(long, value_name = "HOST:PORT")]
    redirect_endpoint: Option<String>,
    /// Do not report the client's address in Hello.
    #[arg(long)]
    no_client_ip: bool,
    /// Network of a reverse proxy in front of the server (repeatable). Only a
    /// connection from inside one may name the client address in `X-Real-IP` or
    /// `X-Forwarded-For`; without any, the headers are ignored and the connection's
    /// address is the client's (for Hello, the rate limit and the relay).
    #[arg(long = "trusted-proxy", value_name = "CIDR")]
    trusted_proxies: Vec<server::IpNet>,
    /// What AffiliateDelete does: `allow` (upstream behaviour; rate-limited to 1/s,
    /// burst 5, per address) or `refuse` (PERMISSION_DENIED; a leaving node's affiliate
    /// expires at the end of its TTL). Anyone who knows a cluster ID can delete its
    /// affiliates, so a public server may refuse.
    #[arg(long, value_name = "POLICY", default_value = "allow", value_parser = parse_delete_policy)]
    affiliate_delete: DeletePolicy,
    /// Most clusters at once; a request that would create one more gets
    /// RESOURCE_EXHAUSTED.
    #[arg(long, value_name = "N", default_value_t = wirespan_discovery::server::state::MAX_CLUSTERS)]
    max_clusters: usize,
    /// MiB the stored clusters and affiliates may take; a request that would grow the
    /// state past it gets RESOURCE_EXHAUSTED, and a snapshot is loaded only up to it.
    #[arg(long, value_name = "MIB", default_value_t = wirespan_discovery::server::state::STATE_BUDGET >> 20)]
    state_budget_mib: usize,
    /// Offer the server relay (`wirespan.relay.v1`): a blind UDP relay for WireGuard
    /// packets of node pairs that reach each other by no other path. Each pair gets two
    /// UDP ports on --relay-bind; allow UDP to them in the firewall.
    #[arg(long)]
    relay: bool,
    /// Address the relay's UDP ports bind to (default: the --listen address).
    #[arg(long, value_name = "IP", requires = "relay")]
    relay_bind: Option<std::net::IpAddr>,
    /// Address nodes are told to send relayed packets to, when it is not the one they
    /// reach the server at (a server behind a load balancer).
    #[arg(long, value_name = "IP", requires = "relay")]
    relay_address: Option<std::net::IpAddr>,
    /// Most relay allocations (node pairs) at once; more get RESOURCE_EXHAUSTED.
    #[arg(long, value_name = "N", default_value_t = RelayLimits::default().max_allocations)]
    relay_max_allocations: usize,
    /// Most relay allocations of one cluster; more get RESOURCE_EXHAUSTED.
    #[arg(long, value_name = "N", default_value_t = RelayLimits::default().max_per_cluster)]
    relay_max_per_cluster: usize,
    /// KiB per second one pair may send through the relay (both directions); more
    /// is dropped.
    #[arg(long, value_name = "KIB", default_value_t = RelayLimits::default().rate >> 10)]
    relay_rate_kib: u64,
    #[command(flatten)]
    transport: TransportArgs,
    /// TLS certificate chain (PEM); needs --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// TLS private key (PEM); needs --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

/// Connection limits of both listeners.
#[derive(Debug, clap::Args)]
struct TransportArgs {
    /// Most open gRPC connections; more are closed at accept. Lowered to fit the
    /// descriptor limit (RLIMIT_NOFILE), which it shares with the relay's sockets.
    #[arg(long, value_name = "N", default_value_t = TransportLimits::default().max_connections)]
    max_connections: usize,
    /// Most open connections from one client address (IPv6: one /64), on each port;
    /// more are closed at accept. Raise it for a site of more nodes behind one NAT
    /// address.
    #[arg(long, value_name = "N", default_value_t = TransportLimits::default().max_connections_per_ip)]
    max_connections_per_ip: usize,
    /// Most concurrent HTTP/2 streams (calls, Watch included) per gRPC connection.
    #[arg(long, value_name = "N", default_value_t = TransportLimits::default().max_concurrent_streams)]
    max_concurrent_streams: u32,
    /// Time a new gRPC connection has to finish TLS and send the HTTP/2 preface, and
    /// a metrics-port request its headers, before it is closed.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    handshake_timeout: Duration,
    /// Time a gRPC call has until its answer (for Watch: until the stream opens; the
    /// stream itself lives on); longer calls get DEADLINE_EXCEEDED.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    request_timeout: Duration,
}

impl TransportArgs {
    fn limits(&self) -> anyhow::Result<TransportLimits> {
        let positive = [
            ("--max-connections", self.max_connections),
            ("--max-connections-per-ip", self.max_connections_per_ip),
            (
                "--max-concurrent-streams",
                self.max_concurrent_streams as usize,
            ),
        ];
        if let Some((flag, _)) = positive.iter().find(|(_, v)| *v == 0) {
            anyhow::bail!("{flag} must be positive");
        }
        if self.handshake_timeout.is_zero() {
            anyhow::bail!("--handshake-timeout must be positive");
        }
        if self.request_timeout.is_zero() {
            anyhow::bail!("--request-timeout must be positive");
        }
        Ok(TransportLimits {
            max_connections: self.max_connections,
            max_connections_per_ip: self.max_connections_per_ip,
            max_concurrent_streams: self.max_concurrent_streams,
            handshake_timeout: self.handshake_timeout,
            request_timeout: self.request_timeout,
            ..TransportLimits::default()
        })
    }
}

impl Args {
    fn into_config(self) -> anyhow::Result<ServerConfig> {
        if self.gc_interval.is_zero() {
            anyhow::bail!("--gc-interval must be positive");
        }
        if self.snapshot_interval.is_zero() {
            anyhow::bail!("--snapshot-interval must be positive");
        }
        if self.max_affiliates == 0 {
            anyhow::bail!("--max-affiliates must be positive");
        }
        let watch_budget = mib_to_bytes(self.watch_budget_mib, "--watch-budget-mib")?;
        if self.max_clusters == 0 {
            anyhow::bail!("--max-clusters must be positive");
        }
        let state_budget = mib_to_bytes(self.state_budget_mib, "--state-budget-mib")?;
        if self.relay_max_allocations == 0 {
            anyhow::bail!("--relay-max-allocations must be positive");
        }
        if self.relay_max_per_cluster == 0 {
            anyhow::bail!("--relay-max-per-cluster must be positive");
        }
        let transport = self.transport.limits()?;
        let Some(rate) = self.relay_rate_kib.checked_mul(1024).filter(|r| *r > 0) else {
            anyhow::bail!("--relay-rate-kib must be between 1 and {}", u64::MAX >> 10);
        };
        let relay = self.relay.then(|| RelayConfig {
            bind: self.relay_bind.unwrap_or(self.listen.ip()),
            address: self.relay_address,
            limits: RelayLimits {
                max_allocations: self.relay_max_allocations,
                max_per_cluster: self.relay_max_per_cluster,
                rate,
                // A quarter of a second at the rate, at least a few full-size packets.
                burst: (rate / 4).max(64 << 10),
                ..RelayLimits::default()
            },
        });
        Ok(ServerConfig {
            relay,
            transport,
            gc_interval: self.gc_interval,
            rate_limit: !self.no_rate_limit,
            redirect_endpoint: self.redirect_endpoint,
            snapshot_path: self.snapshot_path,
            snapshot_interval: self.snapshot_interval,
            max_affiliates: self.max_affiliates,
            watch_budget,
            report_client_ip: !self.no_client_ip,
            trusted_proxies: self.trusted_proxies,
            affiliate_delete: self.affiliate_delete,
            max_clusters: self.max_clusters,
            state_budget,
            tls: match (self.tls_cert, self.tls_key) {
                (Some(cert), Some(key)) => Some(TlsFiles { cert, key }),
                _ => None,
            },
            ..ServerConfig::default()
        })
    }
}

/// Runs the server until SIGTERM or SIGINT, then stops gracefully.
pub fn run(args: Args) -> anyhow::Result<()> {
    let (listen, metrics_listen) = (args.listen, args.metrics_listen);
    let config = args.into_config()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("discovery")
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("binding --listen {listen}"))?;
        let metrics = match metrics_listen {
            Some(addr) => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("binding --metrics-listen {addr}"))?,
            ),
            None => None,
        };
        let server = server::spawn_with_metrics(config, listener, metrics)
            .await
            .context("starting the discovery server")?;
        // The handler before readiness: a SIGTERM right after READY=1 must stop the
        // server gracefully, not kill it with the default disposition.
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("installing the SIGTERM handler")?;
        crate::notify::notify_or_log("READY=1");
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM, shutting down"),
            r = tokio::signal::ctrl_c() => {
                r.context("waiting for SIGINT")?;
                tracing::info!("SIGINT, shutting down");
            }
        }
        crate::notify::notify_or_log("STOPPING=1");
        server.shutdown().await.context("shutting down")?;
        Ok(())
    })
}
