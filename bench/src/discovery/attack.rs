//! The hostile section's attackers of the public surfaces, beside the loaded cluster:
//! a delete storm, updates behind rotating proxy headers, relay exhaustion and
//! slowloris connections on both ports. They run in the hostile client process from
//! source addresses of their own on the loopback range (each attacker a "host"), until
//! told to stop; each then reports one line of what the server let through.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpSocket, TcpStream},
    task::JoinHandle,
};
use tonic::{transport::Channel, Request};
use wirespan_discovery::proto::{
    relay::{relay_client::RelayClient, AllocateRequest},
    server::{cluster_client::ClusterClient, AffiliateDeleteRequest, AffiliateUpdateRequest},
};

/// Calls each RPC attacker keeps in flight on its connection.
const IN_FLIGHT: usize = 8;
/// How often a slowloris connection sends its next byte.
const TRICKLE: Duration = Duration::from_secs(1);

/// A source address on the loopback range for attacker "host" `n`: 127.0.2.1 onwards
/// (the good clients use 127.0.1.x, the server 127.0.0.1).
#[must_use]
pub(super) fn source(n: usize) -> IpAddr {
    let n = u32::try_from(n).unwrap_or(u32::MAX) % (250 * 200);
    IpAddr::V4(Ipv4Addr::new(
        127,
        0,
        2 + (n / 250) as u8,
        1 + (n % 250) as u8,
    ))
}

/// A TCP connection to `to` from `from`.
pub(super) async fn tcp_from(from: IpAddr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = if to.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.bind(SocketAddr::new(from, 0))?;
    socket.connect(to).await
}

/// A tonic channel to `to` from `from`.
pub(super) async fn channel_from(from: IpAddr, to: SocketAddr) -> anyhow::Result<Channel> {
    Ok(
        tonic::transport::Endpoint::from_shared(format!("http://{to}"))?
            .local_address(Some(from))
            .tcp_nodelay(true)
            .connect()
            .await?,
    )
}

/// Sizes of the attackers.
#[derive(Debug, Clone, Copy)]
pub(super) struct AttackCounts {
    /// Hosts sending `AffiliateDelete` for the good clients' and hostile affiliates.
    pub deleters: usize,
    /// Hosts sending updates, each with a new `X-Real-IP`/`X-Forwarded-For`.
    pub rotators: usize,
    /// Hosts asking the relay for allocations.
    pub allocators: usize,
    /// Slowloris connections per port.
    pub slowloris: usize,
}

impl AttackCounts {
    pub(super) fn new(quick: bool) -> Self {
        if quick {
            Self {
                deleters: 1,
                rotators: 1,
                allocators: 1,
                slowloris: 8,
            }
        } else {
            Self {
                deleters: 4,
                rotators: 4,
                allocators: 4,
                slowloris: 200,
            }
        }
    }
}

/// What the attackers are aimed at.
#[derive(Debug, Clone)]
pub(super) struct Targets {
    /// The gRPC port.
    pub grpc: SocketAddr,
    /// The metrics/pages port, if the server has one.
    pub web: Option<SocketAddr>,
    /// The good clients' clusters and their affiliate.
    pub good_clusters: Vec<String>,
    /// The hostile cluster and how many affiliates it holds.
    pub hostile_cluster: String,
    pub hostile_affiliates: usize,
}

/// gRPC results by status code name.
#[derive(Debug, Default)]
struct Tally {
    by_code: BTreeMap<String, u64>,
    /// The first message seen per error code, for the report.
    example: BTreeMap<String, String>,
}

impl Tally {
    fn add<T>(&mut self, r: &Result<T, tonic::Status>) {
        let code = match r {
            Ok(_) => "OK".to_string(),
            Err(s) => {
                let code = format!("{:?}", s.code());
                self.example
                    .entry(code.clone())
                    .or_insert_with(|| s.message().chars().take(120).collect());
                code
            }
        };
        *self.by_code.entry(code).or_default() += 1;
    }

    fn total(&self) -> u64 {
        self.by_code.values().sum()
    }

    fn ok(&self) -> u64 {
        self.by_code.get("OK").copied().unwrap_or(0)
    }

    fn merge(&mut self, other: Self) {
        for (k, v) in other.by_code {
            *self.by_code.entry(k).or_default() += v;
        }
        for (k, v) in other.example {
            self.example.entry(k).or_insert(v);
        }
    }
}

impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self
            .by_code
            .iter()
            .map(|(k, v)| match self.example.get(k) {
                Some(e) => format!("{k} {v} ({e:?})"),
                None => format!("{k} {v}"),
            })
            .collect();
        write!(f, "{}", parts.join(", "))
    }
}

/// A spoofed client address for call `n` (documentation range: never a target, it
/// only travels inside a header).
fn spoofed(n: u64) -> String {
    let b = n.to_be_bytes();
    format!("198.18.{}.{}", b[6], b[7])
}

fn with_headers<T>(msg: T, n: u64) -> Request<T> {
    let mut req = Request::new(msg);
    let ip = spoofed(n);
    if let Ok(v) = ip.parse() {
        req.metadata_mut().insert("x-real-ip", v);
    }
    if let Ok(v) = ip.parse() {
        req.metadata_mut().insert("x-forwarded-for", v);
    }
    req
}

/// The attackers: connected first, sending once [`Attacks::begin`] says so.
pub(super) struct Attacks {
    stop: Arc<AtomicBool>,
    go: tokio::sync::watch::Sender<bool>,
    started: Instant,
    rpc: Vec<(&'static str, JoinHandle<Tally>)>,
    slow: Vec<(&'static str, JoinHandle<Option<Duration>>)>,
}

/// An attacker's connection, and the signal to start sending on it.
struct Armed {
    channel: Option<Channel>,
    go: tokio::sync::watch::Receiver<bool>,
}

impl Armed {
    /// The channel once the attack begins; `None` if it never connected or never began.
    async fn fire(mut self) -> Option<Channel> {
        let channel = self.channel?;
        self.go.wait_for(|go| *go).await.ok()?;
        Some(channel)
    }
}

impl Attacks {
    /// Connects every attacker to `t` (before the rest of the hostile set, so the
    /// server's connection caps do not keep them out) and starts the slowloris
    /// connections, which need no signal; the RPC attackers wait for [`Self::begin`].
    pub(super) async fn connect(t: &Targets, c: AttackCounts) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (go, armed) = tokio::sync::watch::channel(false);
        let arm = |host: usize| {
            let armed = armed.clone();
            async move {
                Armed {
                    channel: channel_from(source(host), t.grpc).await.ok(),
                    go: armed,
                }
            }
        };
        let mut rpc = Vec::new();
        for d in 0..c.deleters {
            let a = arm(100 + d).await;
            let task = tokio::spawn(delete_storm(t.clone(), a, Arc::clone(&stop)));
            rpc.push(("delete storm", task));
        }
        for r in 0..c.rotators {
            let a = arm(200 + r).await;
            rpc.push((
                "header rotation",
                tokio::spawn(rotate(a, r, Arc::clone(&stop))),
            ));
        }
        for x in 0..c.allocators {
            let a = arm(300 + x).await;
            let task = tokio::spawn(exhaust_relay(t.clone(), a, x, Arc::clone(&stop)));
            rpc.push(("relay exhaustion", task));
        }
        let mut slow = Vec::new();
        for s in 0..c.slowloris {
            let from = source(400 + s % 16);
            let mut ports = vec![("HTTP/2 preface", t.grpc, H2_PREFACE)];
            ports.extend(t.web.map(|web| ("HTTP/1 headers", web, H1_HEADERS)));
            for (kind, to, bytes) in ports {
                let conn = tcp_from(from, to).await.ok();
                slow.push((
                    kind,
                    tokio::spawn(slowloris(conn, bytes, Arc::clone(&stop))),
                ));
            }
        }
        Self {
            stop,
            go,
            started: Instant::now(),
            rpc,
            slow,
        }
    }

    /// The RPC attackers start sending.
    pub(super) fn begin(&mut self) {
        self.started = Instant::now();
        // Nobody listening only means every attacker failed to connect.
        let _ = self.go.send(true);
    }

    /// Stops every attacker; returns one report line per kind.
    pub(super) async fn stop(self) -> Vec<String> {
        self.stop.store(true, Ordering::Relaxed);
        let secs = self.started.elapsed().as_secs_f64().max(0.001);
        let mut lines = Vec::new();
        let mut tallies: BTreeMap<&str, (usize, Tally)> = BTreeMap::new();
        for (kind, task) in self.rpc {
            let t = task.await.unwrap_or_default();
            let e = tallies.entry(kind).or_default();
            e.0 += 1;
            e.1.merge(t);
        }
        for (kind, (hosts, t)) in tallies {
            lines.push(format!(
                "{kind}: {hosts} host(s), {} calls in {secs:.1} s, {} accepted ({:.1}/s per host); {t}",
                t.total(),
                t.ok(),
                t.ok() as f64 / secs / hosts as f64,
            ));
        }
        let mut closed: BTreeMap<&str, (usize, Vec<Duration>)> = BTreeMap::new();
        for (kind, task) in self.slow {
            let e = closed.entry(kind).or_default();
            e.0 += 1;
            if let Ok(Some(after)) = task.await {
                e.1.push(after);
            }
        }
        for (kind, (n, mut after)) in closed {
            after.sort_unstable();
            let median = after
                .get(after.len() / 2)
                .map_or_else(|| "-".to_string(), |d| format!("{:.1} s", d.as_secs_f64()));
            lines.push(format!(
                "slowloris ({kind}, 1 byte/{} s): {n} connections, {} closed by the server \
                 (median after {median})",
                TRICKLE.as_secs(),
                after.len()
            ));
        }
        lines
    }
}

/// Sends `AffiliateDelete` for the good clients' affiliates and the hostile ones, as
/// fast as the server answers, `IN_FLIGHT` at a time, each with new proxy headers.
async fn delete_storm(t: Targets, armed: Armed, stop: Arc<AtomicBool>) -> Tally {
    let Some(channel) = armed.fire().await else {
        return Tally::default();
    };
    let victims: Vec<(String, String)> = t
        .good_clusters
        .iter()
        .map(|c| (c.clone(), "good".to_string()))
        .chain(
            (0..t.hostile_affiliates.min(64))
                .map(|i| (t.hostile_cluster.clone(), format!("hostile-{i:0>247}"))),
        )
        .collect();
    pipeline(&stop, |n| {
        let mut client = ClusterClient::new(channel.clone());
        let (cluster_id, affiliate_id) = victims[n as usize % victims.len().max(1)].clone();
        async move {
            client
                .affiliate_delete(with_headers(
                    AffiliateDeleteRequest {
                        cluster_id,
                        affiliate_id,
                    },
                    n,
                ))
                .await
        }
    })
    .await
}

/// Small updates to a cluster of its own, each call claiming another client address.
async fn rotate(armed: Armed, host: usize, stop: Arc<AtomicBool>) -> Tally {
    let Some(channel) = armed.fire().await else {
        return Tally::default();
    };
    pipeline(&stop, |n| {
        let mut client = ClusterClient::new(channel.clone());
        async move {
            client
                .affiliate_update(with_headers(
                    AffiliateUpdateRequest {
                        cluster_id: format!("rotate-{host}"),
                        affiliate_id: format!("a{}", n % 16),
                        affiliate_data: Some(n.to_be_bytes().to_vec()),
                        affiliate_endpoints: vec![],
                        ttl: None,
                    },
                    n,
                ))
                .await
        }
    })
    .await
}

/// Relay allocations for clusters that do not exist and for pairs of the hostile
/// cluster's affiliates with made-up tokens, claiming other addresses in headers.
async fn exhaust_relay(t: Targets, armed: Armed, host: usize, stop: Arc<AtomicBool>) -> Tally {
    let Some(channel) = armed.fire().await else {
        return Tally::default();
    };
    let n_aff = t.hostile_affiliates.max(2) as u64;
    pipeline(&stop, |n| {
        let mut client = RelayClient::new(channel.clone());
        let (cluster_id, a, b) = if n % 2 == 0 {
            (
                format!("absent-{host}-{n}"),
                "a".to_string(),
                "b".to_string(),
            )
        } else {
            let i = (n / 2) % n_aff;
            let j = (i + 1 + n / (2 * n_aff)) % n_aff;
            (
                t.hostile_cluster.clone(),
                format!("hostile-{i:0>247}"),
                format!("hostile-{j:0>247}"),
            )
        };
        async move {
            client
                .allocate(with_headers(
                    AllocateRequest {
                        cluster_id,
                        affiliate_id: a,
                        peer_affiliate_id: b,
                        pair_token: n.to_be_bytes().repeat(4),
                    },
                    n,
                ))
                .await
        }
    })
    .await
}

/// Runs `call(n)` for n = 0, 1, … with `IN_FLIGHT` calls outstanding until `stop`.
async fn pipeline<F, Fut, T>(stop: &AtomicBool, mut call: F) -> Tally
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    use futures::stream::{FuturesUnordered, StreamExt as _};
    let mut tally = Tally::default();
    let mut inflight = FuturesUnordered::new();
    let mut n = 0u64;
    loop {
        while inflight.len() < IN_FLIGHT && !stop.load(Ordering::Relaxed) {
            inflight.push(call(n));
            n += 1;
        }
        let Some(r) = inflight.next().await else {
            return tally;
        };
        tally.add(&r);
    }
}

/// The HTTP/2 client preface and the start of a SETTINGS frame that never ends.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x0c\x04\x00\x00\x00\x00\x00";
/// An HTTP/1 request whose headers never end.
const H1_HEADERS: &[u8] =
    b"GET /metrics HTTP/1.1\r\nHost: bench\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaa";

/// Sends `bytes` on `conn` one at a time, one every [`TRICKLE`], until `stop`; returns
/// how long after it started the server closed the connection, if it did.
async fn slowloris(
    conn: Option<TcpStream>,
    bytes: &'static [u8],
    stop: Arc<AtomicBool>,
) -> Option<Duration> {
    let mut conn = conn?;
    let opened = Instant::now();
    let mut i = 0;
    let mut buf = [0u8; 512];
    while !stop.load(Ordering::Relaxed) {
        if i < bytes.len() && conn.write_all(&bytes[i..=i]).await.is_err() {
            return Some(opened.elapsed());
        }
        i += 1;
        // The server closing shows as EOF or an error on read; what it sends (an h2
        // SETTINGS frame, a 408) is read and ignored.
        if let Ok(Ok(0) | Err(_)) = tokio::time::timeout(TRICKLE, conn.read(&mut buf)).await {
            return Some(opened.elapsed());
        }
    }
    None
}
