//! The flood phase: one TCP stream (iperf3) through the mesh from node1 to node2 while
//! a flooder sends node2's WireGuard handshake initiations with a valid MAC1, at
//! [`RATES`] per second, from [`SOURCES`] addresses. A valid MAC1 is what an attacker
//! who knows the public key (it is public) can always produce: such initiations pass
//! the cheap check and push the device into cookie replies (under load) or into the
//! expensive Diffie-Hellman work. The question is how much of the tunnel's throughput
//! survives.
//!
//! The flooder lives in a network namespace of its own on the lab's underlay bridge,
//! with [`SOURCES`] IPv6 addresses of the underlay's prefix and a socket bound to each;
//! it sends `sendmmsg` batches of [`BATCH`] from one socket after the other, paced to
//! the rate by a token bucket on the monotonic clock, and counts the replies (cookie
//! replies) its sockets receive.

use std::{
    fmt::Write as _,
    io::{IoSlice, Write as _},
    net::{Ipv6Addr, SocketAddr, SocketAddrV6, UdpSocket},
    os::fd::AsRawFd,
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _};
use nix::sys::socket::{sendmmsg, MsgFlags, MultiHeaders, SockaddrIn6};
use wirespan_dataplane::{
    netns::{unique_name, NetnsGuard, NetnsThread},
    userspace_wireguard::noise::{crypto::mac, handshake},
};

use super::{implementation, measure, spread, Run, Sample};
use crate::{lab::run_ok, lab::Lab, sanity::Sanity};

/// The flood rates, initiations per second.
pub(super) const RATES: [u64; 2] = [10_000, 100_000];
/// Source addresses (one socket each).
const SOURCES: u16 = 256;
/// Initiations per `sendmmsg`.
const BATCH: usize = 64;
/// Distinct initiations sent round-robin (each with its own random fields).
const POOL: usize = 4096;
/// The size of a handshake initiation.
pub(crate) const INITIATION_LEN: usize = 148;
/// Where MAC1 sits: it covers everything before it.
const MAC1_AT: usize = 116;

/// MAC1's key for a responder: BLAKE2s-256("mac1----" ‖ its static public key).
#[must_use]
pub(crate) fn mac1_key(responder: &[u8; 32]) -> [u8; 32] {
    handshake::mac1_key(responder)
}

/// A handshake initiation to `responder` that passes its MAC1 check: message type 1,
/// `random` as sender index, ephemeral key, encrypted static key and timestamp
/// (which only the Diffie-Hellman work can find wrong), a keyed BLAKE2s-128 MAC1 over
/// the first 116 bytes, and MAC2 zero (no cookie).
#[must_use]
pub(crate) fn initiation(mac1_key: &[u8; 32], random: &[u8; 112]) -> [u8; INITIATION_LEN] {
    let mut m = [0u8; INITIATION_LEN];
    m[..4].copy_from_slice(&1u32.to_le_bytes());
    m[4..MAC1_AT].copy_from_slice(random);
    let mac1 = mac(mac1_key, &m[..MAC1_AT]);
    m[MAC1_AT..MAC1_AT + 16].copy_from_slice(&mac1);
    m
}

/// A token bucket on a clock passed in: `rate` tokens a second, at most `burst` saved.
#[derive(Debug, Clone)]
pub(crate) struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// An empty bucket at `now` (no burst at the start).
    pub(crate) fn new(rate: u64, burst: usize, now: Instant) -> Self {
        Self {
            rate: rate as f64,
            burst: burst as f64,
            tokens: 0.0,
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        self.last = now;
    }

    /// Takes up to `want` whole tokens; returns how many.
    pub(crate) fn take(&mut self, now: Instant, want: usize) -> usize {
        self.refill(now);
        let n = (self.tokens.floor() as usize).min(want);
        self.tokens -= n as f64;
        n
    }

    /// How long until `want` tokens are there (zero if they are).
    pub(crate) fn wait(&self, want: usize) -> Duration {
        let missing = (want as f64).min(self.burst) - self.tokens;
        if missing <= 0.0 || self.rate <= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(missing / self.rate)
        }
    }
}

/// splitmix64: the initiations' random fields need no more than looking random.
fn pseudo_random(seed: &mut u64, out: &mut [u8]) {
    for chunk in out.chunks_mut(8) {
        *seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
    }
}

/// What one flood did.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct FloodStats {
    pub(super) sent: u64,
    pub(super) replies: u64,
    pub(super) seconds: f64,
}

impl FloodStats {
    pub(super) fn rate(&self) -> f64 {
        if self.seconds > 0.0 {
            self.sent as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// The flooder's namespace on a lab's underlay and its sockets.
pub(super) struct Flooder {
    sockets: Arc<Vec<UdpSocket>>,
    target: SocketAddr,
    pool: Arc<Vec<[u8; INITIATION_LEN]>>,
    /// Removed last: the sockets' namespace.
    _ns: NetnsGuard,
}

impl Flooder {
    /// A flooder aimed at node2 of `lab`: its IPv6 underlay address, WireGuard port
    /// and public key.
    pub(super) fn new(lab: &Lab) -> anyhow::Result<Self> {
        let node2 = lab.node("node2")?;
        let key = node2["publicKey"]
            .as_str()
            .context("node2 without a public key")?;
        let key = wirespan_dataplane::wireguard::PublicKey::from_base64("publicKey", key)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let addr: Ipv6Addr = node2["addresses"]["underlay"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(serde_json::Value::as_str)
            .find_map(|a| a.split('/').next()?.parse().ok())
            .context("node2 without an IPv6 underlay address")?;
        let port = listen_port(lab)?;
        let underlay = lab.status["underlayNamespace"]
            .as_str()
            .context("lab without an underlay namespace")?;
        let ns = NetnsGuard::new("wsflood").context("creating the flooder's namespace")?;
        let (inside, outside) = (unique_name("fl"), unique_name("fl"));
        let ip =
            |ns: &str, args: &[&str]| run_ok(Command::new("ip").args(["-n", ns]).args(args), "ip");
        ip(
            ns.name(),
            &[
                "link", "add", &inside, "type", "veth", "peer", "name", &outside, "netns", underlay,
            ],
        )?;
        ip(underlay, &["link", "set", &outside, "master", "br0", "up"])?;
        // All addresses with one `ip` (a few hundred processes would take seconds).
        let mut batch = String::new();
        let sources: Vec<Ipv6Addr> = (1..=SOURCES).map(|i| source_address(addr, i)).collect();
        for a in &sources {
            let _ = writeln!(batch, "addr add {a}/64 dev {inside} nodad");
        }
        let _ = writeln!(batch, "link set {inside} up");
        let mut child = Command::new("ip")
            .args(["-n", ns.name(), "-batch", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .context("ip -batch")?;
        child
            .stdin
            .take()
            .context("ip -batch stdin")?
            .write_all(batch.as_bytes())?;
        if !child.wait()?.success() {
            bail!("adding the flooder's addresses failed");
        }
        let sockets = NetnsThread::spawn(ns.netns())?.run(move || {
            sources
                .iter()
                .map(|a| {
                    let s = UdpSocket::bind(SocketAddrV6::new(*a, 0, 0, 0))?;
                    s.set_nonblocking(true)?;
                    Ok(s)
                })
                .collect::<std::io::Result<Vec<_>>>()
        })??;
        let mac1 = mac1_key(key.as_bytes());
        let mut seed = u64::from(std::process::id()) << 32 | u64::from(port);
        let pool = (0..POOL)
            .map(|_| {
                let mut r = [0u8; 112];
                pseudo_random(&mut seed, &mut r);
                initiation(&mac1, &r)
            })
            .collect();
        Ok(Self {
            sockets: Arc::new(sockets),
            target: SocketAddr::V6(SocketAddrV6::new(addr, port, 0, 0)),
            pool: Arc::new(pool),
            _ns: ns,
        })
    }

    /// Starts flooding at `rate` initiations a second until the returned flood stops.
    pub(super) fn start(&self, rate: u64) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let (sockets, pool, target, halt) = (
            self.sockets.clone(),
            self.pool.clone(),
            self.target,
            stop.clone(),
        );
        let thread = std::thread::spawn(move || flood(&sockets, &pool, target, rate, &halt));
        Flood { stop, thread }
    }
}

/// Source address `i` of the flooder: the target's /64, interface identifier
/// `::f100:i`, clear of the lab's hosts.
fn source_address(target: Ipv6Addr, i: u16) -> Ipv6Addr {
    let s = target.segments();
    Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0xf100, i)
}

/// node2's WireGuard listen port (`wg show kubespan listen-port`).
fn listen_port(lab: &Lab) -> anyhow::Result<u16> {
    let out = run_ok(
        &mut lab.cmd(&[
            "exec",
            "node2",
            "--",
            "wg",
            "show",
            "kubespan",
            "listen-port",
        ]),
        "wg show listen-port",
    )?;
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .context("node2's listen port")
}

/// A running flood.
pub(super) struct Flood {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<anyhow::Result<FloodStats>>,
}

impl Flood {
    /// Stops it; what it did.
    pub(super) fn stop(self) -> anyhow::Result<FloodStats> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("the flooder panicked"))?
    }
}

fn flood(
    sockets: &[UdpSocket],
    pool: &[[u8; INITIATION_LEN]],
    target: SocketAddr,
    rate: u64,
    stop: &AtomicBool,
) -> anyhow::Result<FloodStats> {
    let SocketAddr::V6(v6) = target else {
        bail!("the flood target is IPv6");
    };
    let to = SockaddrIn6::from(v6);
    let addrs = [Some(to); BATCH];
    let mut headers = MultiHeaders::<SockaddrIn6>::preallocate(BATCH, None);
    let started = Instant::now();
    let mut bucket = TokenBucket::new(rate, 2 * BATCH, started);
    let (mut stats, mut next, mut at) = (FloodStats::default(), 0usize, 0usize);
    let mut reply = [0u8; 256];
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        let n = bucket.take(now, BATCH);
        if n == 0 {
            // Pacing, not synchronisation: the bucket says when the next batch is due.
            std::thread::sleep(bucket.wait(BATCH).max(Duration::from_micros(50)));
            continue;
        }
        let slices: Vec<[IoSlice<'_>; 1]> = (0..n)
            .map(|k| [IoSlice::new(&pool[(at + k) % pool.len()])])
            .collect();
        at = (at + n) % pool.len();
        let socket = &sockets[next];
        next = (next + 1) % sockets.len();
        match sendmmsg(
            socket.as_raw_fd(),
            &mut headers,
            &slices,
            &addrs[..n],
            [],
            MsgFlags::empty(),
        ) {
            Ok(done) => stats.sent += done.count() as u64,
            // A full queue: those initiations are lost, as a real flood's would be.
            Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::ENOBUFS) => {}
            Err(e) => bail!("sendmmsg: {e}"),
        }
        // Count what came back to this source (cookie replies), without blocking.
        while socket.recv_from(&mut reply).is_ok() {
            stats.replies += 1;
        }
    }
    // The replies to the last batches, from every source.
    for s in sockets {
        while s.recv_from(&mut reply).is_ok() {
            stats.replies += 1;
        }
    }
    stats.seconds = started.elapsed().as_secs_f64();
    Ok(stats)
}

/// The flood phase of one implementation: per round, TCP without a flood and under
/// each rate.
#[derive(Debug, Clone, Default)]
pub(super) struct FloodRun {
    pub(super) unflooded: Vec<Sample>,
    /// Per rate in [`RATES`]: the TCP samples and the floods' stats.
    pub(super) flooded: [Vec<(Sample, FloodStats)>; 2],
}

/// Runs the flood phase on `lab` (node1 → node2's KubeSpan address).
pub(super) fn measure_flood(
    lab: &Lab,
    ran: &str,
    rounds: usize,
    seconds: u64,
    sanity: &mut Sanity,
) -> anyhow::Result<FloodRun> {
    let (target, server_ns) = lab.target(super::PathKind::MeshUnmarked)?;
    let client_ns = lab.namespace("node1")?;
    let flooder = Flooder::new(lab)?;
    let pb = crate::bar(rounds * (1 + RATES.len()), &format!("{ran} under flood"));
    let mut r = FloodRun::default();
    for _ in 0..rounds {
        r.unflooded
            .push(measure(&client_ns, target, &server_ns, Run::TCP, seconds)?);
        pb.inc(1);
        for (i, &rate) in RATES.iter().enumerate() {
            let flood = flooder.start(rate);
            let s = measure(&client_ns, target, &server_ns, Run::TCP, seconds);
            let stats = flood.stop()?;
            let s = s?;
            judge_flood(sanity, ran, rate, &stats, &s);
            r.flooded[i].push((s, stats));
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    Ok(r)
}

/// Only broken code fails a flood run: a flood that did not reach a tenth of its
/// rate never really ran (the phase would measure nothing), and TCP that delivered
/// nothing under it is a dead tunnel. A slow tunnel is a figure, not a failure.
fn judge_flood(sanity: &mut Sanity, ran: &str, rate: u64, stats: &FloodStats, tcp: &Sample) {
    sanity.require(stats.rate() >= 0.1 * rate as f64, || {
        format!(
            "{ran} WireGuard: the {rate}/s handshake flood never ran ({} sent in {:.1} s)",
            stats.sent, stats.seconds
        )
    });
    sanity.require(tcp.delivered_bytes > 0, || {
        format!("{ran} WireGuard: no TCP got through under the {rate}/s flood")
    });
}

/// Median TCP Mbit/s without a flood and under each rate, the ratios, the rates
/// achieved and the replies.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct FloodSummary {
    pub(super) unflooded: f64,
    pub(super) flooded: [f64; 2],
    pub(super) achieved: [f64; 2],
    pub(super) replies: [u64; 2],
    pub(super) sent: [u64; 2],
}

impl FloodSummary {
    pub(super) fn of(r: &FloodRun) -> Self {
        let med = |v: Vec<f64>| spread(&v).0;
        let mut s = Self {
            unflooded: med(r.unflooded.iter().map(|x| x.mbps).collect()),
            ..Self::default()
        };
        for i in 0..RATES.len() {
            s.flooded[i] = med(r.flooded[i].iter().map(|(x, _)| x.mbps).collect());
            s.achieved[i] = med(r.flooded[i].iter().map(|(_, f)| f.rate()).collect());
            s.replies[i] = r.flooded[i].iter().map(|(_, f)| f.replies).sum();
            s.sent[i] = r.flooded[i].iter().map(|(_, f)| f.sent).sum();
        }
        s
    }

    /// TCP under flood `i` as a share of TCP without one.
    /// Replies per initiation sent under flood `i`, in %.
    pub(super) fn replied(&self, i: usize) -> f64 {
        if self.sent[i] > 0 {
            self.replies[i] as f64 / self.sent[i] as f64 * 100.0
        } else {
            0.0
        }
    }

    pub(super) fn ratio(&self, i: usize) -> f64 {
        if self.unflooded > 0.0 {
            self.flooded[i] / self.unflooded
        } else {
            0.0
        }
    }
}

/// The phase's section: a row per implementation and the goal line, judged for
/// `wirespan wireguard` against wireguard-go.
pub(super) fn table(
    runs: &[(String, FloodSummary)],
    quick: bool,
    missed: &mut Vec<String>,
) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "\n## Handshake flood (mesh, no marking)\n\nOne TCP stream node1 → node2 while a \
         flooder on the underlay sends node2 handshake initiations with a valid MAC1 \
         from {SOURCES} addresses (sendmmsg batches of {BATCH}, token-bucket paced). \
         Replies: what the flooder's sockets received (cookie replies), in all and \
         per initiation sent.\n"
    );
    let _ = writeln!(
        t,
        "| implementation | TCP Mbit/s unflooded | under 10k/s | ratio | under 100k/s | ratio | flood achieved (10k / 100k), /s | replies (10k / 100k) |"
    );
    let _ = writeln!(t, "|---|---|---|---|---|---|---|---|");
    for (ran, s) in runs {
        let _ = writeln!(
            t,
            "| {} | {:.0} | {:.0} | {:.0} % | {:.0} | {:.0} % | {:.0} / {:.0} | {} ({:.0} %) / {} ({:.0} %) |",
            implementation(ran),
            s.unflooded,
            s.flooded[0],
            s.ratio(0) * 100.0,
            s.flooded[1],
            s.ratio(1) * 100.0,
            s.achieved[0],
            s.achieved[1],
            s.replies[0],
            s.replied(0),
            s.replies[1],
            s.replied(1),
        );
    }
    let ours = runs.iter().find(|(r, _)| r == "userspace").map(|(_, s)| s);
    let go = runs
        .iter()
        .find(|(r, _)| r == "userspace-go")
        .map(|(_, s)| s);
    let verdict = match (ours, go) {
        (None, _) => "not judged (wirespan wireguard not measured)".to_owned(),
        (Some(_), None) => "not judged (wireguard-go not measured)".to_owned(),
        (Some(_), Some(_)) if quick => "not judged (--quick)".to_owned(),
        (Some(o), Some(g)) => {
            let met = o.ratio(1) >= 0.8 && o.ratio(1) > g.ratio(1);
            if !met {
                missed.push(format!(
                    "flood: TCP under 100k/s at {:.0} % of unflooded (wireguard-go {:.0} %)",
                    o.ratio(1) * 100.0,
                    g.ratio(1) * 100.0
                ));
            }
            format!(
                "{} ({:.0} %, wireguard-go {:.0} %)",
                if met { "met" } else { "missed" },
                o.ratio(1) * 100.0,
                g.ratio(1) * 100.0
            )
        }
    };
    let _ = writeln!(
        t,
        "\nTarget: TCP under the 100k/s flood ≥ 80 % of unflooded and ahead of \
         wireguard-go's ratio: {verdict}.\n"
    );
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> (
        boringtun::x25519::StaticSecret,
        boringtun::x25519::PublicKey,
    ) {
        let secret = boringtun::x25519::StaticSecret::from([7u8; 32]);
        let public = boringtun::x25519::PublicKey::from(&secret);
        (secret, public)
    }

    #[test]
    fn a_responder_accepts_the_initiations_mac1_and_refuses_a_wrong_one() {
        use boringtun::noise::{rate_limiter::RateLimiter, Packet, TunnResult};
        let (_, public) = keys();
        let key = mac1_key(public.as_bytes());
        let mut seed = 1;
        let mut random = [0u8; 112];
        pseudo_random(&mut seed, &mut random);
        let init = initiation(&key, &random);
        assert_eq!(&init[..4], &[1, 0, 0, 0]);
        assert_eq!(&init[132..], &[0u8; 16], "MAC2 is zero");
        let mut dst = [0u8; 256];

        let calm = RateLimiter::new(&public, 1_000);
        assert!(matches!(
            calm.verify_packet(None, &init, &mut dst),
            Ok(Packet::HandshakeInit(_))
        ));
        // Another responder's key: a wrong MAC1.
        let other = boringtun::x25519::PublicKey::from([9u8; 32]);
        let wrong = initiation(&mac1_key(other.as_bytes()), &random);
        assert!(matches!(
            calm.verify_packet(None, &wrong, &mut dst),
            Err(TunnResult::Err(_))
        ));
        let mut flipped = init;
        flipped[MAC1_AT] ^= 1;
        assert!(calm.verify_packet(None, &flipped, &mut dst).is_err());
        // Under load (a limit of 0), a valid MAC1 draws a cookie reply: what the
        // flooder counts.
        let loaded = RateLimiter::new(&public, 0);
        let from = Some("fd99:1ab::f100:1".parse().unwrap());
        assert!(matches!(
            loaded.verify_packet(from, &init, &mut dst),
            Err(TunnResult::WriteToNetwork(reply)) if reply.len() == 64
        ));
    }

    #[test]
    fn the_bucket_paces_to_the_rate_without_a_start_burst() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(100_000, 128, t0);
        assert_eq!(b.take(t0, 64), 0, "empty at the start");
        assert_eq!(b.wait(64), Duration::from_secs_f64(64.0 / 100_000.0));
        // 1 ms: 100 tokens.
        assert_eq!(b.take(t0 + Duration::from_millis(1), 64), 64);
        assert_eq!(b.take(t0 + Duration::from_millis(1), 64), 36);
        // A long pause saves at most the burst.
        assert_eq!(b.take(t0 + Duration::from_secs(10), 1_000), 128);
        // Over a second of small steps, the rate and no more.
        let mut b = TokenBucket::new(10_000, 128, t0);
        let sent: usize = (1..=1000)
            .map(|ms| b.take(t0 + Duration::from_millis(ms), 64))
            .sum();
        assert!((9_990..=10_000).contains(&sent), "{sent}");
    }

    #[test]
    fn the_goal_is_judged_against_wireguard_go_and_only_on_a_full_run() {
        let s = |unflooded: f64, at100k: f64| FloodSummary {
            unflooded,
            flooded: [unflooded, at100k],
            achieved: [10_000.0, 100_000.0],
            replies: [0, 0],
            sent: [0, 0],
        };
        let mut missed = Vec::new();
        let runs = vec![
            ("userspace".to_owned(), s(1000.0, 850.0)),
            ("userspace-go".to_owned(), s(200.0, 100.0)),
        ];
        let t = table(&runs, false, &mut missed);
        assert!(t.contains(": met (85 %, wireguard-go 50 %)"), "{t}");
        assert!(missed.is_empty());
        assert!(table(&runs, true, &mut missed).contains("not judged (--quick)"));
        let behind = vec![
            ("userspace".to_owned(), s(1000.0, 850.0)),
            ("userspace-go".to_owned(), s(200.0, 190.0)),
        ];
        assert!(table(&behind, false, &mut missed).contains(": missed (85 %"));
        assert_eq!(missed.len(), 1);
        let alone = vec![("userspace".to_owned(), s(1000.0, 500.0))];
        assert!(table(&alone, false, &mut missed).contains("wireguard-go not measured"));
    }

    #[test]
    fn a_flood_that_never_ran_fails_the_run_a_slow_tunnel_does_not() {
        let tcp = |delivered_bytes| Sample {
            mbps: 1.0,
            delivered_bytes,
            lost_percent: 0.0,
            mss: 0,
        };
        let flood = |sent| FloodStats {
            sent,
            replies: 0,
            seconds: 1.0,
        };
        let mut s = Sanity::new("throughput");
        judge_flood(&mut s, "userspace", 100_000, &flood(20_000), &tcp(1));
        assert!(s.problems().is_empty(), "{:?}", s.problems());
        judge_flood(&mut s, "userspace", 100_000, &flood(0), &tcp(1));
        judge_flood(&mut s, "userspace-go", 10_000, &flood(10_000), &tcp(0));
        assert_eq!(s.problems().len(), 2, "{:?}", s.problems());
        assert!(s.problems()[0].contains("100000/s handshake flood never ran"));
        assert!(s.problems()[1].contains("no TCP got through"));
    }

    #[test]
    fn the_sources_share_the_targets_prefix_and_are_distinct() {
        let t: Ipv6Addr = "fd99:1ab::12".parse().unwrap();
        let a = source_address(t, 1);
        assert_eq!(a, "fd99:1ab::f100:1".parse::<Ipv6Addr>().unwrap());
        assert_ne!(source_address(t, 2), a);
    }
}
