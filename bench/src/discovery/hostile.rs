//! Hostile section of `wirespan bench discovery`: well-behaved clients' AffiliateUpdate
//! and Watch latency p99 on a server with its default limits (rate limit on, relay on),
//! without, then with, a hostile client set (one cluster filled to the affiliate limit
//! with maximal affiliates and kept churning, watchers of it that never read, idle
//! connections, and the attackers of `attack`: a delete storm, rotating proxy headers,
//! relay exhaustion, slowloris), in the same run; and the server's RSS growth against
//! the worst case the protocol limits allow. Every client has a loopback source
//! address of its own standing for its host, so per-address limits apply as they would
//! on the internet.

use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _};
use tonic::{transport::Channel, Streaming};
use wirespan_discovery::{
    proto::server::{cluster_client::ClusterClient, *},
    server::state::{MAX_AFFILIATES, MAX_DATA_LEN, MAX_ENDPOINTS, MAX_ENDPOINT_LEN, WATCH_QUEUE},
};

use super::{
    attack::{channel_from, source, tcp_from, AttackCounts, Attacks, Targets},
    ms,
    process::free_loopback_port,
    verdict, ServerProcess, DATA_LEN,
};
use crate::{bar, sanity::Sanity};

/// Sizes of the section; `--quick` scales the hostile set down.
#[derive(Debug, Clone, Copy)]
pub(super) struct Counts {
    good: usize,
    rounds: usize,
    /// Unloaded/loaded pairs.
    phases: usize,
    hostile_affiliates: usize,
    slow_watchers: usize,
    idle: usize,
    attacks: AttackCounts,
}

impl Counts {
    pub(super) fn new(quick: bool) -> Self {
        if quick {
            Self {
                good: 4,
                rounds: 10,
                phases: 1,
                hostile_affiliates: 64,
                slow_watchers: 20,
                idle: 200,
                attacks: AttackCounts::new(true),
            }
        } else {
            Self {
                good: 16,
                // 15 s per phase: longer than the server's 10 s handshake timeout, so the
                // slowloris connections see it.
                rounds: 150,
                phases: 2,
                hostile_affiliates: MAX_AFFILIATES,
                slow_watchers: 1000,
                idle: 10_000,
                attacks: AttackCounts::new(false),
            }
        }
    }
}

const HOSTILE_CLUSTER: &str = "hostile";
const HOSTILE_PUBLISHERS: usize = 16;
/// Source hosts the hostile set's slow watchers and idle connections come from.
const HOSTILE_HOSTS: usize = 64;
/// Gap between a good client's updates: 10/s stays under the per-address rate limit
/// (15/s), so the limiter never delays a good client.
const ROUND_GAP: Duration = Duration::from_millis(100);
/// Re-updates of hostile affiliates per second while the good clients are measured.
const CHURN_PER_SEC: u64 = 200;
/// h2 window of the slow watchers' connections: they never read, so this is all the
/// server can hand them before its send side backs up.
const SLOW_WINDOW: u32 = 65_535;
/// What one more connection may cost the server (h2 buffers, task, socket); the
/// allowance in the worst case below.
const PER_CONNECTION: u64 = 64 * 1024;

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (the server child inherits it);
/// returns the soft limit now in force.
#[allow(unsafe_code)]
fn raise_nofile() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid out-pointer for the duration of the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return 1024;
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: as above; a failure leaves the old limit, reported below.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            return raised.rlim_cur;
        }
    }
    lim.rlim_cur
}

fn seq_data(seq: u64) -> Vec<u8> {
    let mut data = vec![0u8; DATA_LEN];
    data[..8].copy_from_slice(&seq.to_be_bytes());
    data
}

fn max_ttl() -> Option<prost_types::Duration> {
    Some(prost_types::Duration {
        seconds: 30 * 60,
        nanos: 0,
    })
}

/// A maximal affiliate: largest data, every endpoint slot filled with the largest.
fn hostile_update(i: usize, round: u64) -> AffiliateUpdateRequest {
    let mut data = vec![0xdd; MAX_DATA_LEN];
    data[..8].copy_from_slice(&round.to_be_bytes());
    AffiliateUpdateRequest {
        cluster_id: HOSTILE_CLUSTER.into(),
        affiliate_id: format!("hostile-{i:0>247}"),
        affiliate_data: Some(data),
        affiliate_endpoints: (0..MAX_ENDPOINTS)
            .map(|k| {
                let mut e = vec![0xee; MAX_ENDPOINT_LEN];
                e[..8].copy_from_slice(&((i * MAX_ENDPOINTS + k) as u64).to_be_bytes());
                e
            })
            .collect(),
        ttl: max_ttl(),
    }
}

/// One good client: its own cluster, its own connection for updates and one for its
/// Watch, reading promptly.
struct Good {
    cluster: String,
    client: ClusterClient<Channel>,
    watch: Streaming<WatchResponse>,
    _watch_conn: ClusterClient<Channel>,
}

#[derive(Default)]
struct Samples {
    update: Vec<Duration>,
    watch: Vec<Duration>,
}

impl Samples {
    fn extend(&mut self, other: Self) {
        self.update.extend(other.update);
        self.watch.extend(other.watch);
    }

    fn p99(v: &mut [Duration]) -> Duration {
        v.sort_unstable();
        v.get(((v.len().saturating_sub(1)) as f64 * 0.99).round() as usize)
            .copied()
            .unwrap_or_default()
    }
}

/// Good client `i`'s source address: 127.0.1.(i+1).
fn good_source(i: usize) -> std::net::IpAddr {
    std::net::Ipv4Addr::new(127, 0, 1, 1 + (i % 250) as u8).into()
}

fn good_cluster(i: usize) -> String {
    format!("good-{i}")
}

async fn connect_good(addr: SocketAddr, i: usize) -> anyhow::Result<Good> {
    let cluster = good_cluster(i);
    let connect = |addr| async move {
        anyhow::Ok(ClusterClient::new(
            channel_from(good_source(i), addr).await?,
        ))
    };
    let mut watch_conn = connect(addr).await?;
    let mut watch = watch_conn
        .watch(WatchRequest {
            cluster_id: cluster.clone(),
        })
        .await?
        .into_inner();
    watch.message().await?.context("no watch snapshot")?;
    Ok(Good {
        cluster,
        client: connect(addr).await?,
        watch,
        _watch_conn: watch_conn,
    })
}

/// `rounds` updates [`ROUND_GAP`] apart from every good client at once: the RPC's latency,
/// and the time from sending it to its own watcher receiving it.
async fn measure(
    goods: Vec<Good>,
    rounds: usize,
    seq: &AtomicU64,
) -> anyhow::Result<(Vec<Good>, Samples)> {
    let mut tasks = Vec::new();
    for mut g in goods {
        let first = seq.fetch_add(rounds as u64, Ordering::Relaxed);
        tasks.push(tokio::spawn(async move {
            let mut s = Samples::default();
            for r in 0..rounds as u64 {
                let n = first + r;
                let t0 = Instant::now();
                g.client
                    .affiliate_update(AffiliateUpdateRequest {
                        cluster_id: g.cluster.clone(),
                        affiliate_id: "good".into(),
                        affiliate_data: Some(seq_data(n)),
                        affiliate_endpoints: vec![],
                        ttl: max_ttl(),
                    })
                    .await?;
                s.update.push(t0.elapsed());
                'seen: loop {
                    let msg = tokio::time::timeout(Duration::from_secs(30), g.watch.message())
                        .await
                        .context("a good watcher waited 30 s for its own update")??
                        .context("a good watcher's stream ended")?;
                    for a in msg.affiliates {
                        if a.data.get(..8) == Some(&n.to_be_bytes()[..]) {
                            break 'seen;
                        }
                    }
                }
                s.watch.push(t0.elapsed());
                tokio::time::sleep(ROUND_GAP).await;
            }
            anyhow::Ok((g, s))
        }));
    }
    let mut goods = Vec::new();
    let mut all = Samples::default();
    for t in tasks {
        let (g, s) = t.await??;
        goods.push(g);
        all.update.extend(s.update);
        all.watch.extend(s.watch);
    }
    Ok((goods, all))
}

/// The hostile client set; its connections stay open until dropped.
struct Hostile {
    _publishers: Vec<ClusterClient<Channel>>,
    _slow: Vec<(ClusterClient<Channel>, Streaming<WatchResponse>)>,
    idle: Vec<tokio::net::TcpStream>,
    /// Slow watchers the server refused (connection or stream).
    slow_refused: usize,
    stop: Arc<AtomicBool>,
    churn: Vec<tokio::task::JoinHandle<anyhow::Result<u64>>>,
}

async fn start_hostile(addr: SocketAddr, c: Counts) -> anyhow::Result<Hostile> {
    // Fill the cluster to the limit with maximal affiliates.
    let mut publishers = Vec::new();
    for p in 0..HOSTILE_PUBLISHERS {
        publishers.push(ClusterClient::new(channel_from(source(p), addr).await?));
    }
    let pb = bar(c.hostile_affiliates, "hostile affiliates");
    for chunk in (0..c.hostile_affiliates)
        .collect::<Vec<_>>()
        .chunks(HOSTILE_PUBLISHERS)
    {
        let calls = chunk.iter().zip(publishers.iter_mut()).map(|(&i, p)| {
            let mut p = p.clone();
            async move { p.affiliate_update(hostile_update(i, 0)).await }
        });
        for r in futures::future::join_all(calls).await {
            r.context("filling the hostile cluster")?;
            pb.inc(1);
        }
    }
    pb.finish_and_clear();

    // Watchers of it that never read, each on its own connection with a small window.
    let pb = bar(c.slow_watchers, "slow watchers");
    let mut slow = Vec::with_capacity(c.slow_watchers);
    let mut slow_refused = 0;
    for chunk in (0..c.slow_watchers).collect::<Vec<_>>().chunks(64) {
        let opens = chunk.iter().map(|&k| async move {
            let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
                .local_address(Some(source(500 + k % HOSTILE_HOSTS)))
                .initial_stream_window_size(SLOW_WINDOW)
                .initial_connection_window_size(SLOW_WINDOW)
                .connect()
                .await?;
            let mut client = ClusterClient::new(channel);
            let stream = client
                .watch(WatchRequest {
                    cluster_id: HOSTILE_CLUSTER.into(),
                })
                .await?
                .into_inner();
            anyhow::Ok((client, stream))
        });
        for r in futures::future::join_all(opens).await {
            // A server at its connection or stream limits refuses some: that is a
            // defence working, counted, not a failure of the benchmark.
            match r {
                Ok(s) => slow.push(s),
                Err(_) => slow_refused += 1,
            }
            pb.inc(1);
        }
    }
    pb.finish_and_clear();

    // Idle TCP connections: accepted, never a byte sent.
    let pb = bar(c.idle, "idle connections");
    let mut idle = Vec::with_capacity(c.idle);
    for chunk in (0..c.idle).collect::<Vec<_>>().chunks(256) {
        let conns = chunk
            .iter()
            .map(|&k| tcp_from(source(600 + k % HOSTILE_HOSTS), addr));
        for r in futures::future::join_all(conns).await {
            if let Ok(conn) = r {
                idle.push(conn);
            }
            pb.inc(1);
        }
    }
    pb.finish_and_clear();

    // Churn: the hostile affiliates keep being re-published (new data each round), so
    // every slow watcher keeps receiving events it never reads.
    let stop = Arc::new(AtomicBool::new(false));
    let per_publisher = Duration::from_secs_f64(HOSTILE_PUBLISHERS as f64 / CHURN_PER_SEC as f64);
    let churn = publishers
        .iter()
        .enumerate()
        .map(|(p, client)| {
            let (mut client, stop) = (client.clone(), Arc::clone(&stop));
            let n = c.hostile_affiliates;
            tokio::spawn(async move {
                let mut sent = 0u64;
                let mut i = p;
                while !stop.load(Ordering::Relaxed) && n > 0 {
                    client
                        .affiliate_update(hostile_update(i % n, sent + 1))
                        .await?;
                    sent += 1;
                    i += HOSTILE_PUBLISHERS;
                    tokio::time::sleep(per_publisher).await;
                }
                anyhow::Ok(sent)
            })
        })
        .collect();
    Ok(Hostile {
        _publishers: publishers,
        _slow: slow,
        idle,
        slow_refused,
        stop,
        churn,
    })
}

impl Hostile {
    /// Stops the churn; returns how many hostile updates it sent.
    async fn stop_churn(&mut self) -> anyhow::Result<u64> {
        self.stop.store(true, Ordering::Relaxed);
        let mut total = 0;
        for t in self.churn.drain(..) {
            total += t.await??;
        }
        Ok(total)
    }

    /// What became of the idle connections and slow watchers: one report line.
    fn report(&self, c: Counts) -> String {
        let closed = self.idle.iter().filter(|s| closed_by_peer(s)).count();
        format!(
            "idle connections: {} opened, {} closed by the server by the end; slow watchers: \
             {} of {} refused",
            self.idle.len(),
            closed,
            self.slow_refused,
            c.slow_watchers
        )
    }
}

/// Whether the other end closed `conn`: whatever it sent is read and dropped until EOF
/// or an error (closed) or nothing more is there (open).
fn closed_by_peer(conn: &tokio::net::TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match conn.try_read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

/// Encoded size of a maximal affiliate inside a Watch/List message (ID, data,
/// endpoints, field framing).
fn max_affiliate_bytes() -> u64 {
    use prost::Message as _;
    let a = Affiliate {
        id: "x".repeat(256),
        data: vec![0; MAX_DATA_LEN],
        endpoints: vec![vec![0; MAX_ENDPOINT_LEN]; MAX_ENDPOINTS],
    };
    (a.encoded_len() + 4) as u64
}

/// The hostile client set as its own process (`<this executable> bench discovery
/// --hostile-client ADDR`): hostile clients are other machines, so their own CPU work
/// (encoding 20 KiB updates, h2 bookkeeping of 11,000 connections) must not run in
/// the good clients' runtime, where it would delay their timers and reads and count
/// as the server's latency. It prints `ready SECONDS` once the set is up and churning,
/// and `churned N` after stdin closes.
struct HostileProcess {
    child: tokio::process::Child,
    stdout: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl HostileProcess {
    /// Starts the generator and waits until its set is up; returns it and the set-up time.
    async fn start(
        addr: SocketAddr,
        web: SocketAddr,
        quick: bool,
    ) -> anyhow::Result<(Self, Duration)> {
        use tokio::io::AsyncBufReadExt as _;
        let exe = std::env::current_exe().context("locating this executable")?;
        let mut cmd = tokio::process::Command::new(exe);
        cmd.args(["bench", "discovery", "--hostile-client"])
            .arg(addr.to_string())
            .arg("--hostile-web")
            .arg(web.to_string())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true);
        if quick {
            cmd.arg("--quick");
        }
        let mut child = cmd.spawn().context("starting the hostile client process")?;
        let stdout = child.stdout.take().context("hostile client stdout")?;
        let mut proc = Self {
            child,
            stdout: tokio::io::BufReader::new(stdout).lines(),
        };
        let line = tokio::time::timeout(Duration::from_secs(300), proc.stdout.next_line())
            .await
            .context("the hostile client set was not up within 300 s")??
            .context("the hostile client process exited before it was up")?;
        let secs: f64 = line
            .strip_prefix("ready ")
            .and_then(|s| s.parse().ok())
            .with_context(|| {
                format!("hostile client process said {line:?}, not `ready SECONDS`")
            })?;
        Ok((proc, Duration::from_secs_f64(secs)))
    }

    /// Closes its stdin (stop churning and attacking); returns how many re-publishes
    /// it sent and its attackers' report lines.
    async fn stop(mut self) -> anyhow::Result<(u64, Vec<String>)> {
        drop(self.child.stdin.take());
        let line = tokio::time::timeout(Duration::from_secs(60), self.stdout.next_line())
            .await
            .context("the hostile client process did not stop within 60 s")??
            .context("the hostile client process exited without its count")?;
        let n = line
            .strip_prefix("churned ")
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("hostile client process said {line:?}, not `churned N`"))?;
        let mut report = Vec::new();
        while let Some(line) = self.stdout.next_line().await? {
            report.push(line);
        }
        let status = self.child.wait().await?;
        if !status.success() {
            bail!("the hostile client process failed: {status}");
        }
        Ok((n, report))
    }
}

/// The hostile client process's body: builds the set against `addr`, churns until
/// stdin closes, then reports and drops every connection.
pub(super) async fn generate(
    addr: SocketAddr,
    web: Option<SocketAddr>,
    quick: bool,
) -> anyhow::Result<()> {
    use std::io::Write as _;
    use tokio::io::AsyncReadExt as _;
    let c = fit_idle(Counts::new(quick), false);
    let built = Instant::now();
    let targets = Targets {
        grpc: addr,
        web,
        good_clusters: (0..c.good).map(good_cluster).collect(),
        hostile_cluster: HOSTILE_CLUSTER.into(),
        hostile_affiliates: c.hostile_affiliates,
    };
    // The attackers hold their connections before the idle set may fill the server's.
    let mut attacks = Attacks::connect(&targets, c.attacks).await;
    let mut hostile = start_hostile(addr, c).await?;
    attacks.begin();
    let mut out = std::io::stdout();
    writeln!(out, "ready {}", built.elapsed().as_secs_f64())?;
    out.flush()?;
    // Anything or nothing on stdin: EOF is the stop.
    let mut sink = Vec::new();
    tokio::io::stdin().read_to_end(&mut sink).await?;
    let churned = hostile.stop_churn().await?;
    let report = attacks.stop().await;
    writeln!(out, "churned {churned}")?;
    writeln!(out, "{}", hostile.report(c))?;
    for line in report {
        writeln!(out, "{line}")?;
    }
    out.flush()?;
    Ok(())
}

/// Scales the idle connections down to what `RLIMIT_NOFILE` allows (both ends of
/// every connection live on this host and the limit is per process, so the server
/// and the hostile process each need one descriptor per connection).
fn fit_idle(mut c: Counts, report: bool) -> Counts {
    let nofile = raise_nofile();
    let spare = 512;
    let a = c.attacks;
    let fixed = (c.slow_watchers
        + 2 * c.good
        + HOSTILE_PUBLISHERS
        + a.deleters
        + a.rotators
        + a.allocators
        + 2 * a.slowloris
        + spare) as u64;
    if fixed + c.idle as u64 > nofile {
        let fit = nofile.saturating_sub(fixed) as usize;
        if report {
            println!(
                "  RLIMIT_NOFILE is {nofile}: idle connections scaled down from {} to {fit}",
                c.idle
            );
        }
        c.idle = fit;
    }
    c
}

/// Runs the section on a fresh server and prints its report.
pub(super) async fn run(exe: &std::path::Path, quick: bool) -> anyhow::Result<()> {
    let nofile = raise_nofile();
    let c = fit_idle(Counts::new(quick), true);
    // Default limits, the relay on (its exhaustion is one of the attacks), and the
    // pages port (slowloris is aimed at it too).
    let web = free_loopback_port()?;
    let mut server = ServerProcess::start_public(
        exe,
        &["--relay".into(), "--metrics-listen".into(), web.to_string()],
    )?;
    let addr = server.addr;
    let mut goods = Vec::with_capacity(c.good);
    for i in 0..c.good {
        goods.push(connect_good(addr, i).await?);
    }
    let seq = AtomicU64::new(1);
    // Warm-up (discarded).
    let (mut goods, _) = measure(goods, 3, &seq).await?;
    let rss_before = server.rss_bytes()?;
    // Unloaded and loaded phases take turns, so a burst of other work on the machine
    // does not land on one condition only; samples are pooled per condition.
    let (mut unloaded, mut loaded) = (Samples::default(), Samples::default());
    let (mut rss_loaded, mut churned, mut built) = (0, 0, Duration::ZERO);
    let mut attack_report = Vec::new();
    for _ in 0..c.phases {
        let (g, s) = measure(goods, c.rounds, &seq).await?;
        unloaded.extend(s);
        let (hostile, setup) = HostileProcess::start(addr, web, quick).await?;
        built = built.max(setup);
        let (g, s) = measure(g, c.rounds, &seq).await?;
        loaded.extend(s);
        rss_loaded = rss_loaded.max(server.rss_bytes()?);
        let (n, report) = hostile.stop().await?;
        churned += n;
        attack_report = report;
        if server.exited() {
            bail!("the server died under the hostile load");
        }
        goods = g;
    }
    drop(goods);

    let a = max_affiliate_bytes();
    let state = c.hostile_affiliates as u64 * a;
    let connections = (c.slow_watchers + c.idle + HOSTILE_PUBLISHERS) as u64;
    // Stored state and its event log (kept up to twice the cluster's size), plus per
    // slow watcher its initial snapshot of the cluster and a full queue of maximal
    // events, plus an allowance per connection.
    let worst = 3 * state
        + c.slow_watchers as u64 * (state + WATCH_QUEUE as u64 * a)
        + connections * PER_CONNECTION;
    let growth = rss_loaded.saturating_sub(rss_before);

    let (u0, u1) = (
        Samples::p99(&mut unloaded.update),
        Samples::p99(&mut loaded.update),
    );
    let (w0, w1) = (
        Samples::p99(&mut unloaded.watch),
        Samples::p99(&mut loaded.watch),
    );
    println!();
    println!(
        "Hostile load: {} good clients ({} B data, own cluster, own watcher, own address), {} \
         updates each {} ms apart per phase, {} phases without and {} with a hostile set taking turns \
         (samples pooled per condition); the set: {} maximal affiliates \
         ({} B data, {} endpoints) in one cluster re-published at {CHURN_PER_SEC}/s, {} \
         watchers of it that never read ({SLOW_WINDOW} B h2 window), {} idle TCP connections \
         (its own process, one thread; set up in {:.1} s; RLIMIT_NOFILE {nofile})",
        c.good,
        DATA_LEN,
        c.rounds,
        ROUND_GAP.as_millis(),
        c.phases,
        c.phases,
        c.hostile_affiliates,
        MAX_DATA_LEN,
        MAX_ENDPOINTS,
        c.slow_watchers,
        c.idle,
        built.as_secs_f64()
    );
    println!(
        "{:>18}  {:>10}  {:>10}  {:>7}  target",
        "good-client p99", "unloaded", "loaded", "ratio"
    );
    for (what, p0, p1) in [("AffiliateUpdate", u0, u1), ("Watch delivery", w0, w1)] {
        // A floor of 1 ms keeps sub-millisecond noise from making a ratio.
        let ratio = p1.as_secs_f64() / p0.as_secs_f64().max(0.001);
        println!(
            "{what:>18}  {:>10}  {:>10}  {ratio:>6.2}×  loaded ≤ 2× unloaded  {}",
            ms(p0),
            ms(p1),
            verdict(ratio <= 2.0)
        );
    }
    println!(
        "  server VmRSS {:.1} MiB → {:.1} MiB under load (+{:.1} MiB); limits' worst case \
         +{:.1} MiB (hostile cluster {:.1} MiB and twice that for its event log + per slow watcher a snapshot of it and \
         {WATCH_QUEUE} queued maximal events + {} KiB per connection)  {}; {churned} hostile \
         re-publishes during the loaded run",
        rss_before as f64 / 1_048_576.0,
        rss_loaded as f64 / 1_048_576.0,
        growth as f64 / 1_048_576.0,
        worst as f64 / 1_048_576.0,
        state as f64 / 1_048_576.0,
        PER_CONNECTION / 1024,
        verdict(growth <= worst)
    );
    println!("  attackers of the last loaded phase (each from source addresses of its own):");
    for line in &attack_report {
        println!("    {line}");
    }
    drop(server);
    let mut sanity = Sanity::new("discovery hostile");
    judge(&mut sanity, churned, &loaded);
    sanity.into_result()?;
    Ok(())
}

/// Broken: the hostile set never re-published (no attack ran, so the loaded figures
/// measure nothing), or no good client's update or delivery completed under load.
fn judge(sanity: &mut Sanity, churned: u64, loaded: &Samples) {
    sanity.require(churned > 0, || {
        "hostile load: the hostile set re-published nothing, so no attack ran".to_owned()
    });
    sanity.require(
        !loaded.update.is_empty() && !loaded.watch.is_empty(),
        || {
            format!(
                "hostile load: {} good-client updates and {} watch deliveries completed under load",
                loaded.update.len(),
                loaded.watch.len()
            )
        },
    );
}

#[cfg(test)]
mod sanity_tests {
    use super::*;

    #[test]
    fn no_attack_or_no_good_client_served_is_broken_slow_service_is_not() {
        let slow = Samples {
            update: vec![Duration::from_secs(5)],
            watch: vec![Duration::from_secs(9)],
        };
        let mut s = Sanity::new("discovery hostile");
        judge(&mut s, 1, &slow);
        assert!(s.problems().is_empty());
        judge(&mut s, 0, &Samples::default());
        assert_eq!(s.problems().len(), 2, "{:?}", s.problems());
        assert!(s.problems()[0].contains("no attack ran"));
        assert!(s.problems()[1].contains("0 good-client updates"));
    }
}
