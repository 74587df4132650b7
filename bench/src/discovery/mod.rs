//! `wirespan bench discovery`: discovery server throughput, Watch fan-out latency,
//! memory per affiliate, a join storm and good clients' latency under a hostile client
//! set, against the real server binary.
//!
//! The server runs as a child process (`<this executable> discovery --no-rate-limit`)
//! on loopback, so its memory can be read from `/proc/PID/status` and its CPU is not
//! shared with the load generator's runtime. The rate limit is disabled because all
//! load comes from one source address (it would cap every phase at 15 requests/s).

mod attack;
mod h2conn;
mod hostile;
mod process;
mod storm;
mod watch_readers;
mod wire;

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _};

use crate::{bar, sanity::Sanity};
use process::{connect_many, ServerProcess};
use watch_readers::{Delivery, WatchReaders};
use wire::WireClient;
use wirespan_discovery::proto::{health::HealthCheckRequest, server::*};

/// Options of `wirespan bench discovery`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Seconds measured per throughput point (after a 0.5 s warm-up).
    #[arg(long, default_value_t = 3)]
    pub seconds: u64,
    /// Affiliates stored for the memory measurement.
    #[arg(long, default_value_t = 100_000)]
    pub affiliates: usize,
    /// Nodes in the join storm (above 1024 the server runs with `--max-affiliates`).
    #[arg(long, default_value_t = 10_240)]
    pub storm_nodes: usize,
    /// Updates published per fan-out measurement.
    #[arg(long, default_value_t = 40)]
    pub fanout_events: usize,
    /// Server binary (default: this executable, run as `… discovery`).
    #[arg(long)]
    pub server_bin: Option<PathBuf>,
    /// Run only the hostile-load section (good clients' latency with and without a
    /// hostile client set); the same as `--only hostile`.
    #[arg(long)]
    pub hostile_only: bool,
    /// Run only these sections (comma-separated), in the usual order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        conflicts_with = "hostile_only"
    )]
    pub only: Vec<Section>,
    /// A smoke run with small counts and fewer points (the test suite runs it once);
    /// its figures are not the benchmark's.
    #[arg(long)]
    pub quick: bool,
    /// Internal: be the hostile client set against the server at this address (the
    /// hostile section runs it as its own process), until stdin closes.
    #[arg(long, hide = true)]
    pub hostile_client: Option<SocketAddr>,
    /// Internal: the server's pages port, for the hostile client set's slowloris.
    #[arg(long, hide = true, requires = "hostile_client")]
    pub hostile_web: Option<SocketAddr>,
}

/// Sections of the benchmark, for `--only`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Section {
    /// AffiliateUpdate throughput against the empty-RPC ceiling.
    Throughput,
    /// Watch fan-out latency (up to 10,000 watchers; 100 with --quick).
    Fanout,
    /// Memory per affiliate.
    Memory,
    /// Join storm (--storm-nodes, 10,240 by default; 64 with --quick).
    Storm,
    /// Good clients' latency under a hostile client set.
    Hostile,
}

impl Args {
    /// Whether `section` runs.
    fn runs(&self, section: Section) -> bool {
        if self.hostile_only {
            return section == Section::Hostile;
        }
        self.only.is_empty() || self.only.contains(&section)
    }

    /// The counts actually used: small ones with `--quick`.
    fn effective(&self) -> Self {
        if self.quick {
            Self {
                seconds: 1,
                affiliates: self.affiliates.min(5_000),
                storm_nodes: self.storm_nodes.min(64),
                fanout_events: self.fanout_events.min(10),
                ..self.clone()
            }
        } else {
            self.clone()
        }
    }

    fn client_points(&self) -> &'static [usize] {
        if self.quick {
            &[1, 16]
        } else {
            &[1, 16, 128]
        }
    }

    fn watcher_points(&self) -> &'static [usize] {
        if self.quick {
            &[100]
        } else {
            &[100, 1000, 10_000]
        }
    }
}

/// Runs the benchmark and prints its report.
///
/// # Errors
/// Whatever stops the benchmark from producing a valid report.
pub fn run(args: &Args) -> anyhow::Result<()> {
    if let Some(addr) = args.hostile_client {
        // One thread: the hostile set stands for other machines and may take at most
        // one of this host's cores from the server and the good clients.
        return tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the tokio runtime")?
            .block_on(hostile::generate(addr, args.hostile_web, args.quick));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    crate::quick_notice(args.quick);
    runtime.block_on(run_async(&args.effective()))
}

const DATA_LEN: usize = 256;
const TTL_SECS: i64 = 600;

async fn run_async(args: &Args) -> anyhow::Result<()> {
    let exe = match &args.server_bin {
        Some(p) => p.clone(),
        None => std::env::current_exe().context("locating this executable")?,
    };
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    println!("wirespan bench discovery");
    println!(
        "server: `{} discovery --no-rate-limit --max-connections-per-ip 1000000` (child \
         process, loopback, per-address limits off: all load comes from one address; the \
         hostile section runs it with its default limits \
         and the relay, every client from an address of its own); {cores} cores shared by \
         server and load generator",
        exe.display()
    );
    println!(
        "load generator (throughput, fan-out publisher): gRPC over HTTP/2 (h2) with each \
         request encoded once, responses checked for their status but not decoded, each \
         connection driven by the task using it; fan-out watchers and storm nodes: a minimal \
         HTTP/2 client, every connection on one epoll thread; memory and hostile sections: \
         tonic clients"
    );

    let mut sanity = Sanity::new("discovery");
    if args.runs(Section::Throughput) || args.runs(Section::Fanout) {
        throughput_and_fanout(&exe, args, &mut sanity).await?;
    }
    if args.runs(Section::Memory) {
        memory_section(&exe, args).await?;
    }
    if args.runs(Section::Storm) {
        storm_section(&exe, args, &mut sanity).await?;
    }
    if args.runs(Section::Hostile) {
        // Fresh server, upstream limits.
        hostile::run(&exe, args.quick).await?;
    }
    sanity.into_result()?;
    Ok(())
}

async fn throughput_and_fanout(
    exe: &std::path::Path,
    args: &Args,
    sanity: &mut Sanity,
) -> anyhow::Result<()> {
    let server = ServerProcess::start(exe)?;
    if args.runs(Section::Throughput) {
        throughput_section(&server, args, sanity).await?;
    }
    if args.runs(Section::Fanout) {
        fanout_section(&server, args).await?;
    }
    drop(server);
    Ok(())
}

async fn throughput_section(
    server: &ServerProcess,
    args: &Args,
    sanity: &mut Sanity,
) -> anyhow::Result<()> {
    let measure = Duration::from_secs(args.seconds.max(1));
    // Warm-up (discarded): connection setup, allocator and page-cache effects of a
    // fresh process would otherwise land on the first measured point.
    let warm_up = if args.quick {
        Duration::from_millis(200)
    } else {
        Duration::from_secs(1)
    };
    for rpc in [Rpc::Check, Rpc::Hello, Rpc::Update] {
        throughput(server, 16, warm_up, rpc).await?;
    }
    // The three RPCs take turns, several rounds, and each keeps its median: a burst of
    // other work on the machine then lands on one sample of each, not on one RPC.
    let rounds = if args.quick { 1 } else { 3 };
    let mut rows = Vec::new();
    for &clients in args.client_points() {
        let mut samples = [const { Vec::new() }; 3];
        for _ in 0..rounds {
            for (i, rpc) in [Rpc::Check, Rpc::Hello, Rpc::Update]
                .into_iter()
                .enumerate()
            {
                samples[i].push(throughput(server, clients, measure, rpc).await?);
            }
        }
        let [empty, hello, update] = samples.map(|mut v| {
            v.sort_by(|a: &Rate, b: &Rate| a.rate.total_cmp(&b.rate));
            v[v.len() / 2]
        });
        rows.push((clients, empty, hello, update));
    }
    println!();
    println!(
        "AffiliateUpdate throughput ({DATA_LEN} B data + 1 endpoint, one cluster per client, \
         one HTTP/2 connection per client); ceiling = the empty unary RPC on the same stack \
         (grpc.health.v1 Health/Check), Hello for comparison; median of {rounds} rounds of \
         {} s, the RPCs taking turns",
        measure.as_secs()
    );
    println!(
        "{:>8}  {:>14}  {:>10}  {:>18}  {:>12}  {:>13}  {:>22}  {:>22}  target",
        "clients",
        "empty RPC/s",
        "Hello/s",
        "AffiliateUpdate/s",
        "Update/Hello",
        "Update/empty",
        "server µs/call (e/H/U)",
        "client µs/call (e/H/U)"
    );
    for (clients, empty, hello, update) in &rows {
        let ratio = update.rate / empty.rate;
        let target = if *clients == 128 {
            format!("Update/empty ≥ 85 %  {}", verdict(ratio >= 0.85))
        } else {
            String::new()
        };
        let cpu = format!(
            "{:.1}/{:.1}/{:.1}",
            empty.server_us, hello.server_us, update.server_us
        );
        let own = format!(
            "{:.1}/{:.1}/{:.1}",
            empty.client_us, hello.client_us, update.client_us
        );
        println!(
            "{clients:>8}  {:>14.0}  {:>10.0}  {:>18.0}  {:>11.1}%  {:>12.1}%  {cpu:>22}  {own:>22}  {target}",
            empty.rate,
            hello.rate,
            update.rate,
            update.rate / hello.rate * 100.0,
            ratio * 100.0
        );
    }
    judge_throughput(sanity, &rows);
    Ok(())
}

/// An RPC the server answered not once in a measured window is broken.
fn judge_throughput(sanity: &mut Sanity, rows: &[(usize, Rate, Rate, Rate)]) {
    for (clients, empty, hello, update) in rows {
        for (rpc, r) in [
            ("Health/Check", empty),
            ("Hello", hello),
            ("AffiliateUpdate", update),
        ] {
            sanity.positive_rate(&format!("{rpc} with {clients} clients"), r.rate);
        }
    }
}

/// A storm that never converged is broken (slow convergence is a missed target).
fn judge_storm(sanity: &mut Sanity, s: &storm::Storm) {
    sanity.require(s.converged == s.nodes, || {
        format!(
            "join storm: {} of {} nodes converged before the limit",
            s.converged, s.nodes
        )
    });
}

async fn fanout_section(server: &ServerProcess, args: &Args) -> anyhow::Result<()> {
    println!();
    println!(
        "Watch fan-out latency: one cluster, {} updates, each sent {} ms after every watcher \
         received the previous one (the latency of one fan-out, not of a backlog of them), \
         measured from sending AffiliateUpdate to receipt by each watcher",
        args.fanout_events,
        FANOUT_GAP.as_millis()
    );
    println!(
        "{:>8}  {:>9}  {:>9}  {:>9}  {:>8}  {:>24}  target",
        "watchers", "p50", "p99", "max", "aborted", "µs/delivery server/client"
    );
    for &watchers in args.watcher_points() {
        let f = fanout(server, watchers, args.fanout_events.max(1)).await?;
        let target = if watchers == 10_000 {
            format!(
                "p99 < 100 ms, 0 aborted  {}",
                verdict(f.p99 < Duration::from_millis(100) && f.aborted == 0)
            )
        } else {
            String::new()
        };
        let cpu = format!("{:.1}/{:.1}", f.server_us, f.client_us);
        println!(
            "{watchers:>8}  {:>9}  {:>9}  {:>9}  {:>8}  {cpu:>24}  {target}",
            ms(f.p50),
            ms(f.p99),
            ms(f.max),
            f.aborted
        );
    }
    Ok(())
}

async fn memory_section(exe: &std::path::Path, args: &Args) -> anyhow::Result<()> {
    // Fresh server.
    let server = ServerProcess::start(exe)?;
    let m = memory(&server, args.affiliates.max(1)).await?;
    println!();
    println!(
        "Memory: {} affiliates in {} clusters, payload {} B each ({} B data + 2 endpoints), \
         IDs {} B each (cluster ID shared per 1024)",
        m.affiliates,
        m.clusters,
        m.payload,
        DATA_LEN * 2,
        m.id_bytes
    );
    println!(
        "  server VmRSS {:.1} MiB → {:.1} MiB; {:.0} B per affiliate, {:.0} B beyond payload; \
         target ≤ 256 B beyond payload  {}",
        m.rss_before as f64 / 1_048_576.0,
        m.rss_after as f64 / 1_048_576.0,
        m.per_affiliate,
        m.overhead,
        verdict(m.overhead <= 256.0)
    );
    drop(server);
    Ok(())
}

async fn storm_section(
    exe: &std::path::Path,
    args: &Args,
    sanity: &mut Sanity,
) -> anyhow::Result<()> {
    // Fresh server, its per-cluster cap raised to fit the storm.
    let nodes = args.storm_nodes.max(2);
    let server = ServerProcess::start_with(exe, &max_affiliates_args(nodes))?;
    let s = storm::storm(server.addr, nodes).await?;
    println!();
    println!(
        "Join storm: {} nodes at once, each Hello + Watch + AffiliateUpdate ({DATA_LEN} B), \
         converged when every watcher holds all {} affiliates",
        s.nodes, s.nodes
    );
    let converged = s.converged == s.nodes;
    println!(
        "  {} of {} nodes converged in {:.2} s{}, {} watch streams (all reading; the load \
         generator's longest pass over ready sockets {} ms) aborted as slow and \
         re-established; target < 30 s and 0 aborted  {}",
        s.converged,
        s.nodes,
        s.elapsed.as_secs_f64(),
        if converged { "" } else { " (limit reached)" },
        s.aborted,
        s.longest_pass.as_millis(),
        verdict(converged && s.elapsed < Duration::from_secs(30) && s.aborted == 0)
    );
    println!(
        "  Watch bodies read: {:.1} GB in all, {:.2} GB/s",
        s.bytes as f64 / 1e9,
        s.bytes as f64 / 1e9 / s.elapsed.as_secs_f64()
    );
    judge_storm(sanity, &s);
    drop(server);
    Ok(())
}

/// Server flags for a cluster of `nodes`: the upstream cap of 1024 stays unless the
/// storm needs more.
fn max_affiliates_args(nodes: usize) -> Vec<String> {
    if nodes > 1024 {
        vec!["--max-affiliates".into(), nodes.to_string()]
    } else {
        Vec::new()
    }
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "PASS"
    } else {
        "FAIL"
    }
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

fn ttl() -> Option<prost_types::Duration> {
    Some(prost_types::Duration {
        seconds: TTL_SECS,
        nanos: 0,
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Rpc {
    /// `grpc.health.v1.Health/Check`: the empty unary RPC, the stack's ceiling.
    Check,
    Hello,
    Update,
}

/// Completed calls per second with `clients` concurrent clients, each on its own
/// connection, calling back to back.
/// One throughput point: completed calls per second, and the server's CPU time per
/// call over the same interval (what the load generator's share of the cores does not
/// blur).
#[derive(Debug, Clone, Copy)]
struct Rate {
    rate: f64,
    server_us: f64,
    /// The load generator's (this process's) CPU time per call.
    client_us: f64,
}

async fn throughput(
    server: &ServerProcess,
    clients: usize,
    measure: Duration,
    rpc: Rpc,
) -> anyhow::Result<Rate> {
    let conns = wire::connect_many(server.addr, clients, None, "connecting").await?;
    let count = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for (i, mut client) in conns.into_iter().enumerate() {
        let (count, stop) = (Arc::clone(&count), Arc::clone(&stop));
        let cluster = format!("tp-{clients}-{i}");
        let call = match rpc {
            Rpc::Check => client.call(
                "/grpc.health.v1.Health/Check",
                &HealthCheckRequest {
                    service: String::new(),
                },
            ),
            Rpc::Hello => client.call(
                "/sidero.discovery.server.Cluster/Hello",
                &HelloRequest {
                    cluster_id: cluster,
                    client_version: "v1.8.3".into(),
                },
            ),
            Rpc::Update => client.call(
                "/sidero.discovery.server.Cluster/AffiliateUpdate",
                &AffiliateUpdateRequest {
                    cluster_id: cluster,
                    affiliate_id: "node".into(),
                    affiliate_data: Some(vec![0x5a; DATA_LEN]),
                    affiliate_endpoints: vec![vec![0xe0; 16]],
                    ttl: ttl(),
                },
            ),
        };
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                client.unary(&call).await?;
                count.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<_, tonic::Status>(())
        }));
    }
    let name = match rpc {
        Rpc::Check => "Health.Check",
        Rpc::Hello => "Hello",
        Rpc::Update => "AffiliateUpdate",
    };
    let pb = bar(
        usize::try_from(measure.as_millis()).unwrap_or(usize::MAX) / 100 + 5,
        &format!("{name} × {clients}"),
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    pb.inc(5);
    let (c0, t0, cpu0, own0) = (
        count.load(Ordering::Relaxed),
        Instant::now(),
        server.cpu_time()?,
        process::cpu_time("/proc/self/stat")?,
    );
    while t0.elapsed() < measure {
        tokio::time::sleep(Duration::from_millis(100)).await;
        pb.inc(1);
    }
    let (c1, t1, cpu1, own1) = (
        count.load(Ordering::Relaxed),
        Instant::now(),
        server.cpu_time()?,
        process::cpu_time("/proc/self/stat")?,
    );
    stop.store(true, Ordering::Relaxed);
    pb.finish_and_clear();
    for t in tasks {
        t.await??;
    }
    let calls = (c1 - c0).max(1) as f64;
    Ok(Rate {
        rate: (c1 - c0) as f64 / (t1 - t0).as_secs_f64(),
        server_us: cpu1.saturating_sub(cpu0).as_secs_f64() * 1e6 / calls,
        client_us: own1.saturating_sub(own0).as_secs_f64() * 1e6 / calls,
    })
}

struct Fanout {
    p50: Duration,
    p99: Duration,
    max: Duration,
    aborted: usize,
    /// CPU time per delivery (one update to one watcher) of the server and of the
    /// load generator (publisher and watchers), while the updates were published.
    server_us: f64,
    client_us: f64,
}

/// Pause between one update reaching every watcher and the next update.
const FANOUT_GAP: Duration = Duration::from_millis(20);

/// The Watch messages as a fan-out watcher reads them: the data blobs only, without a
/// copy (the load generator shares the machine's cores with the server).
#[derive(Clone, PartialEq, prost::Message)]
struct WatchStamps {
    #[prost(message, repeated, tag = "1")]
    affiliates: Vec<AffiliateStamp>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct AffiliateStamp {
    #[prost(bytes = "bytes", tag = "2")]
    data: bytes::Bytes,
}

/// Updates received by all watchers together; wakes the publisher each time the count
/// reaches a multiple of the watcher count (an update reached everyone).
struct Received {
    count: AtomicU64,
    watchers: u64,
    all: tokio::sync::Notify,
}

impl Received {
    fn add(&self, n: u64) {
        let before = self.count.fetch_add(n, Ordering::Relaxed);
        if (before + n) / self.watchers > before / self.watchers {
            self.all.notify_one();
        }
    }

    /// Waits until `target` receipts were counted.
    async fn reach(&self, target: u64, deadline: tokio::time::Instant) -> anyhow::Result<()> {
        while self.count.load(Ordering::Relaxed) < target {
            tokio::time::timeout_at(deadline, self.all.notified())
                .await
                .context("watchers did not receive an update within 30 s")?;
        }
        Ok(())
    }
}

/// Watchers of one cluster; a publisher sends updates carrying their send time, each
/// once every watcher has the previous one; every watcher records receive time − send
/// time. The watchers are read by one thread of their own ([`WatchReaders`]).
async fn fanout(server: &ServerProcess, watchers: usize, events: usize) -> anyhow::Result<Fanout> {
    let addr = server.addr;
    let cluster = format!("fanout-{watchers}");
    let readers = {
        let (cluster, what) = (cluster.clone(), format!("{watchers} watchers"));
        tokio::task::spawn_blocking(move || WatchReaders::open(addr, &cluster, watchers, &what))
            .await??
    };
    let epoch = Instant::now();
    let received = Arc::new(Received {
        count: AtomicU64::new(0),
        watchers: watchers as u64,
        all: tokio::sync::Notify::new(),
    });
    let stop = StopOnDrop(Arc::new(AtomicBool::new(false)));
    let reading = {
        let (received, stop) = (Arc::clone(&received), Arc::clone(&stop.0));
        std::thread::spawn(move || read_stamps(readers, events, epoch, &received, &stop))
    };
    let pb = bar(events, &format!("fan-out to {watchers}"));
    let mut publisher = WireClient::connect(addr, None).await?;
    let (cpu0, own0) = (server.cpu_time()?, process::cpu_time("/proc/self/stat")?);
    for k in 0..events {
        let mut data = vec![0u8; DATA_LEN];
        let sent = u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        data[..8].copy_from_slice(&sent.to_be_bytes());
        let call = publisher.call(
            "/sidero.discovery.server.Cluster/AffiliateUpdate",
            &AffiliateUpdateRequest {
                cluster_id: cluster.clone(),
                affiliate_id: "publisher".into(),
                affiliate_data: Some(data),
                affiliate_endpoints: vec![],
                ttl: ttl(),
            },
        );
        publisher.unary(&call).await?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        received
            .reach((k as u64 + 1) * watchers as u64, deadline)
            .await?;
        pb.inc(1);
        tokio::time::sleep(FANOUT_GAP).await;
    }
    let (cpu1, own1) = (server.cpu_time()?, process::cpu_time("/proc/self/stat")?);
    let deliveries = (events * watchers) as f64;
    pb.finish_and_clear();
    // Every update was counted, so the reader has recorded them all.
    drop(stop);
    let (readers, mut all, aborted) = tokio::task::spawn_blocking(move || reading.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the watchers' reader panicked"))??;
    drop(readers);
    if all.is_empty() {
        bail!("no fan-out samples");
    }
    all.sort_unstable();
    let pick = |q: f64| all[((all.len() - 1) as f64 * q).round() as usize];
    Ok(Fanout {
        p50: pick(0.50),
        p99: pick(0.99),
        max: all[all.len() - 1],
        aborted,
        server_us: cpu1.saturating_sub(cpu0).as_secs_f64() * 1e6 / deliveries,
        client_us: own1.saturating_sub(own0).as_secs_f64() * 1e6 / deliveries,
    })
}

/// Sets the flag when dropped: the publisher gave up or finished.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// The fan-out's watchers' side: reads every watcher's updates until each has
/// `events` of them or its stream ended (`ABORTED` is counted; any other status fails
/// the run once every watcher is done), or `stop` is set. Returns the
/// watchers still connected (closing 10,000 connections while others wait for the last
/// update would be measured as its latency), the latencies, and the aborts.
fn read_stamps(
    mut readers: WatchReaders,
    events: usize,
    epoch: Instant,
    received: &Received,
    stop: &AtomicBool,
) -> anyhow::Result<(WatchReaders, Vec<Duration>, usize)> {
    let n = readers.len();
    let mut seen = vec![0usize; n];
    let mut finished = vec![false; n];
    let mut open = n;
    let mut lat = Vec::with_capacity(n * events);
    let mut aborted = 0;
    let mut bad = None;
    // A Watch that ended with another status than ABORTED: the server misbehaved.
    let mut ended = None;
    while open > 0 && !stop.load(Ordering::Relaxed) {
        readers.pump(Duration::from_millis(50), |i, d| {
            if finished[i] {
                return;
            }
            match d {
                Delivery::Message(m) => {
                    let now = epoch.elapsed();
                    let msg = match <WatchStamps as prost::Message>::decode(m) {
                        Ok(msg) => msg,
                        Err(e) => return bad = Some(e),
                    };
                    for a in &msg.affiliates {
                        let sent = a
                            .data
                            .get(..8)
                            .and_then(|b| b.try_into().ok())
                            .map_or(0, u64::from_be_bytes);
                        lat.push(now.saturating_sub(Duration::from_nanos(sent)));
                    }
                    seen[i] += msg.affiliates.len();
                    received.add(msg.affiliates.len() as u64);
                    finished[i] = seen[i] >= events;
                }
                Delivery::Ended(status) => {
                    if status.code() == tonic::Code::Aborted {
                        aborted += 1;
                    } else {
                        ended.get_or_insert(status);
                    }
                    // A watcher that ended does not hold up the publisher.
                    received.add((events - seen[i]) as u64);
                    finished[i] = true;
                }
            }
            open -= usize::from(finished[i]);
        })?;
        if let Some(e) = bad.take() {
            bail!("a Watch message did not decode: {e}");
        }
    }
    if let Some(status) = ended {
        bail!("a watcher's Watch ended other than as slow: {status}");
    }
    Ok((readers, lat, aborted))
}

struct Memory {
    affiliates: usize,
    clusters: usize,
    payload: usize,
    id_bytes: usize,
    rss_before: u64,
    rss_after: u64,
    per_affiliate: f64,
    overhead: f64,
}

/// Stores `n` affiliates (1024 per cluster) and reads the server's VmRSS around it.
async fn memory(server: &ServerProcess, n: usize) -> anyhow::Result<Memory> {
    const WRITERS: usize = 32;
    const DATA: usize = DATA_LEN * 2;
    let conns = connect_many(server.addr, WRITERS, "connecting").await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rss_before = server.rss_bytes()?;
    let pb = bar(n, "storing affiliates");
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for mut c in conns {
        let (next, pb) = (Arc::clone(&next), pb.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = usize::try_from(next.fetch_add(1, Ordering::Relaxed)).unwrap_or(usize::MAX);
                if i >= n {
                    return Ok::<_, tonic::Status>(());
                }
                let mut data = vec![0u8; DATA];
                data[..8].copy_from_slice(&(i as u64).to_be_bytes());
                let mut ep4 = vec![0u8; 16];
                ep4[..8].copy_from_slice(&(i as u64).to_be_bytes());
                let mut ep6 = vec![1u8; 32];
                ep6[..8].copy_from_slice(&(i as u64).to_be_bytes());
                c.affiliate_update(AffiliateUpdateRequest {
                    cluster_id: cluster_id(i / 1024),
                    affiliate_id: affiliate_id(i),
                    affiliate_data: Some(data),
                    affiliate_endpoints: vec![ep4, ep6],
                    ttl: ttl(),
                })
                .await?;
                pb.inc(1);
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    pb.finish_and_clear();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_after = server.rss_bytes()?;
    let payload = DATA + 16 + 32;
    let per_affiliate = rss_after.saturating_sub(rss_before) as f64 / n as f64;
    Ok(Memory {
        affiliates: n,
        clusters: n.div_ceil(1024),
        payload,
        id_bytes: affiliate_id(0).len(),
        rss_before,
        rss_after,
        per_affiliate,
        overhead: per_affiliate - payload as f64,
    })
}

/// Talos-shaped IDs: a 44-character cluster ID and a 44-character node ID.
fn cluster_id(i: usize) -> String {
    format!("{i:0>44}")
}

fn affiliate_id(i: usize) -> String {
    format!("node{i:0>40}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(rate: f64) -> Rate {
        Rate {
            rate,
            server_us: 1.0,
            client_us: 1.0,
        }
    }

    #[test]
    fn an_rpc_never_answered_is_broken_a_slow_one_is_not() {
        let mut s = Sanity::new("discovery");
        judge_throughput(&mut s, &[(16, rate(3.0), rate(2.0), rate(1.0))]);
        assert!(s.problems().is_empty());
        judge_throughput(&mut s, &[(128, rate(900.0), rate(800.0), rate(0.0))]);
        assert_eq!(s.problems().len(), 1, "{:?}", s.problems());
        assert!(s.problems()[0].starts_with("AffiliateUpdate with 128 clients"));
    }

    #[test]
    fn a_storm_short_of_convergence_is_broken_a_slow_one_is_not() {
        let storm = |converged| storm::Storm {
            nodes: 100,
            converged,
            elapsed: Duration::from_secs(600),
            aborted: 40,
            longest_pass: Duration::from_secs(1),
            bytes: 0,
        };
        let mut s = Sanity::new("discovery");
        judge_storm(&mut s, &storm(100));
        assert!(
            s.problems().is_empty(),
            "slow and aborting is a missed target"
        );
        judge_storm(&mut s, &storm(99));
        assert_eq!(
            s.problems(),
            ["join storm: 99 of 100 nodes converged before the limit"]
        );
    }
}
