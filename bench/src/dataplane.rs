//! `wirespan bench dataplane`: kernel apply times of the data plane adapters.
//!
//! Everything runs against the real kernel in throwaway network namespaces, with the
//! userspace WireGuard backend (wireguard-go) this machine has; needs root. Measures,
//! in one run:
//!
//! - from empty: WireGuard with 1,000 peers, the nftables marking table with their
//!   10,000 prefixes, and policy routing, each timed and summed;
//! - one-peer change on top (one CIDR of one peer replaced: a WireGuard allowed-IPs
//!   replacement plus one nft element out and one in) at N = 100, 1,000 and 10,000
//!   peers, which must not grow with N;
//! - the nftables set layouts side by side for the same prefixes (10,000 and 100,000):
//!   host addresses in hash sets plus CIDRs in interval sets (ours) vs one interval
//!   set per family (upstream); from empty, one host and one CIDR update (same
//!   in-memory work, so the difference is the kernel's set backend), and a full
//!   table rebuild for contrast with element updates.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::{Duration, Instant},
};

use crate::{bar, sanity::Sanity};
use wirespan_dataplane::{
    ipnet::{IpNet, Ipv4Net, Ipv6Net},
    marking::{Marking, MarkingSpec, NftMarking, SetLayout},
    netns::{unique_name, NetnsGuard},
    routing::{NetlinkRouting, Routing, RoutingSpec},
    wireguard::{userspace::UserspaceBackend, PrivateKey, PublicKey, WgDevice, WgPeer, WireGuard},
};

/// Options of `wirespan bench dataplane`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Peers of the from-empty measurement.
    #[arg(long, default_value_t = 1_000)]
    pub peers: usize,
    /// Prefixes per peer (node IPv4 and IPv6 address, then alternating v4 /26 and v6
    /// /64 CIDRs); 10 × 1,000 peers = 10,000 prefixes.
    #[arg(long, default_value_t = 10)]
    pub prefixes_per_peer: usize,
    /// From-empty repetitions, each in a fresh namespace (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Peer counts of the one-peer-change measurement.
    #[arg(long, value_delimiter = ',', default_values_t = vec![100, 1_000, 10_000])]
    pub sizes: Vec<usize>,
    /// One-peer changes timed at each size.
    #[arg(long, default_value_t = 40)]
    pub changes: usize,
    /// A smoke run with small sizes (the test suite runs it once); its figures are not
    /// the benchmark's.
    #[arg(long)]
    pub quick: bool,
}

impl Args {
    /// The sizes actually used: small ones with `--quick`.
    fn effective(&self) -> Self {
        if self.quick {
            Self {
                peers: self.peers.min(100),
                rounds: 1,
                sizes: vec![10, 100],
                changes: self.changes.min(5),
                ..self.clone()
            }
        } else {
            self.clone()
        }
    }
}

/// Runs the benchmark and prints its report.
///
/// # Errors
/// Not root, a missing tool (`ip`, `nft`, `wireguard-go`), or a failed apply.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let args = &args.effective();
    crate::quick_notice(args.quick);
    anyhow::ensure!(
        args.prefixes_per_peer >= 2,
        "--prefixes-per-peer must be at least 2 (the node addresses), got {}",
        args.prefixes_per_peer
    );
    anyhow::ensure!(args.rounds >= 1, "--rounds must be at least 1");
    anyhow::ensure!(args.changes >= 1, "--changes must be at least 1");
    println!(
        "wirespan bench dataplane: {} build, userspace WireGuard (wireguard-go), {} prefixes per peer",
        if cfg!(debug_assertions) {
            "DEBUG (numbers not meaningful)"
        } else {
            "release"
        },
        args.prefixes_per_peer
    );
    let mut rows = Vec::new();
    let mut sanity = Sanity::new("dataplane");
    from_empty_section(args, &mut rows, &mut sanity)?;

    // One-peer change at each N.
    let mut medians = Vec::new();
    for &n in &args.sizes {
        let c = one_peer_change(n, args.prefixes_per_peer, args.changes)?;
        rows.push(Row::target(
            format!("one-peer change, N={n}: median"),
            c.total_median,
            "< 20 ms",
            c.total_median < Duration::from_millis(20),
        ));
        rows.push(Row::info(
            format!("one-peer change, N={n}: p99"),
            c.total_p99,
        ));
        rows.push(Row::info(
            format!("one-peer change, N={n}: WireGuard / nft"),
            Measured::Pair(c.wg_median, c.nft_median),
        ));
        medians.push((n, c.total_median));
    }
    if let (Some(&(n0, first)), Some(&(n1, last))) = (medians.first(), medians.last()) {
        if n1 > n0 {
            // "Flat": the largest N may cost at most twice the smallest plus 2 ms of
            // noise, where a linear cost would be 100× at the default sizes.
            let flat = last <= first * 2 + Duration::from_millis(2);
            rows.push(Row::target(
                format!("one-peer change, N={n1} vs N={n0}"),
                Measured::Ratio(last.as_secs_f64() / first.as_secs_f64().max(1e-9)),
                "flat",
                flat,
            ));
        }
    }

    // Set layouts for the from-empty prefixes and ten times as many: a host address
    // change touches a hash set in the split layout, a CIDR change an interval set;
    // the in-memory work is the same for both, so their difference is the kernel's.
    let scales: &[usize] = if args.quick { &[1] } else { &[1, 10] };
    for &scale in scales {
        let prefixes = peer_set(0, args.peers * scale, args.prefixes_per_peer)
            .into_iter()
            .flat_map(|(_, p)| p)
            .collect::<Vec<_>>();
        let n = prefixes.len();
        for layout in [SetLayout::Split, SetLayout::Interval, SetLayout::PerLength] {
            let l = layout_figures(&prefixes, layout, args.changes)?;
            let name = match layout {
                SetLayout::Split => "hash+interval",
                SetLayout::Interval => "interval only",
                SetLayout::PerLength => "hash per length",
            };
            rows.push(Row::info(
                format!("nft {name}, {n} prefixes: from empty"),
                l.from_empty,
            ));
            rows.push(Row::info(
                format!("nft {name}, {n} prefixes: host / CIDR update"),
                Measured::Pair(l.host, l.net),
            ));
            rows.push(Row::info(
                format!("nft {name}, {n} prefixes: full table rebuild"),
                l.rebuild,
            ));
        }
    }

    println!();
    println!(
        "{:<56} {:>18}   {:<8} result",
        "metric", "measured", "target"
    );
    let mut missed = 0;
    for r in &rows {
        let res = match r.ok {
            Some(true) => "ok",
            Some(false) => {
                missed += 1;
                "MISSED"
            }
            None => "",
        };
        println!(
            "{:<56} {:>18}   {:<8} {res}",
            r.name,
            r.measured.to_string(),
            r.target
        );
    }
    if missed > 0 {
        println!("\n{missed} target(s) missed");
    }
    sanity.into_result()?;
    Ok(())
}

/// From empty, `args.rounds` times: the rows, and what shows the adapters broken.
fn from_empty_section(args: &Args, rows: &mut Vec<Row>, sanity: &mut Sanity) -> anyhow::Result<()> {
    let pb = bar(args.rounds, "from empty");
    let mut runs = Vec::new();
    for _ in 0..args.rounds {
        runs.push(from_empty(args.peers, args.prefixes_per_peer)?);
        pb.inc(1);
    }
    pb.finish_and_clear();
    let med = |f: fn(&FromEmpty) -> Duration| median(&mut runs.iter().map(f).collect::<Vec<_>>());
    let total = med(|r| r.wg + r.nft + r.routing);
    let label = format!(
        "{} peers + {} prefixes",
        args.peers,
        args.peers * args.prefixes_per_peer
    );
    rows.push(Row::info(
        format!("from empty: wireguard-go start ({label})"),
        med(|r| r.start),
    ));
    rows.push(Row::info("from empty: WireGuard peers", med(|r| r.wg)));
    rows.push(Row::info(
        "from empty: nftables table + sets",
        med(|r| r.nft),
    ));
    rows.push(Row::info(
        "from empty: link, rules, routes",
        med(|r| r.routing),
    ));
    rows.push(Row::target(
        "from empty: total apply",
        total,
        "< 1 s",
        total < Duration::from_secs(1),
    ));
    rows.push(Row::info(
        "from empty: total incl. daemon start",
        med(|r| r.start + r.wg + r.nft + r.routing),
    ));
    rows.push(Row::info("re-apply (no change)", med(|r| r.noop)));
    judge_from_empty(sanity, args.peers, &runs);
    Ok(())
}

/// Broken: peers missing from the device after the apply, or a re-apply of the same
/// state that wrote to it.
fn judge_from_empty(sanity: &mut Sanity, peers: usize, runs: &[FromEmpty]) {
    for (i, r) in runs.iter().enumerate() {
        sanity.require(r.peers_on_device == peers, || {
            format!(
                "from empty, round {}: {} of {peers} peers on the device after the apply",
                i + 1,
                r.peers_on_device
            )
        });
        sanity.require(r.noop_writes == 0, || {
            format!(
                "from empty, round {}: re-applying the same state wrote {} time(s)",
                i + 1,
                r.noop_writes
            )
        });
    }
}

enum Measured {
    Time(Duration),
    Pair(Duration, Duration),
    Ratio(f64),
}

impl From<Duration> for Measured {
    fn from(d: Duration) -> Self {
        Self::Time(d)
    }
}

impl std::fmt::Display for Measured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Time(d) => write!(f, "{}", ms(*d)),
            Self::Pair(a, b) => write!(f, "{} / {}", ms(*a), ms(*b)),
            Self::Ratio(r) => write!(f, "{r:.2}×"),
        }
    }
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

struct Row {
    name: String,
    measured: Measured,
    target: &'static str,
    ok: Option<bool>,
}

impl Row {
    fn info(name: impl Into<String>, measured: impl Into<Measured>) -> Self {
        Self {
            name: name.into(),
            measured: measured.into(),
            target: "—",
            ok: None,
        }
    }

    fn target(
        name: impl Into<String>,
        measured: impl Into<Measured>,
        target: &'static str,
        ok: bool,
    ) -> Self {
        Self {
            name: name.into(),
            measured: measured.into(),
            target,
            ok: Some(ok),
        }
    }
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

fn p99(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v[(v.len() * 99).div_ceil(100).saturating_sub(1)]
}

/// The prefixes of peer `i`: its node IPv4 and IPv6 address, then `per - 2` CIDRs
/// alternating IPv4 /26 and IPv6 /64, unique across peers for `i < 2^16`.
fn prefixes_of(i: usize, per: usize) -> Vec<IpNet> {
    let i32_ = u32::try_from(i).unwrap_or(u32::MAX);
    let mut v = vec![
        IpNet::V4(
            Ipv4Net::new(Ipv4Addr::from(0x6440_0000 | (i32_ & 0xffff)), 32).unwrap_or_default(),
        ),
        IpNet::V6(
            Ipv6Net::new(
                Ipv6Addr::from(0xfd00_0001_0000_0000_0000_0000_0000_0000u128 | u128::from(i32_)),
                128,
            )
            .unwrap_or_default(),
        ),
    ];
    for k in 0..per.saturating_sub(2) {
        v.push(cidr(i * per + k, k.is_multiple_of(2)));
    }
    v
}

/// The `j`-th IPv4 /26 (under 10.0.0.0/8) or IPv6 /64 (under fd10::/32).
fn cidr(j: usize, v4: bool) -> IpNet {
    let j = u32::try_from(j).unwrap_or(u32::MAX);
    if v4 {
        IpNet::V4(
            Ipv4Net::new(Ipv4Addr::from(0x0a00_0000 | ((j & 0x3_ffff) << 6)), 26)
                .unwrap_or_default(),
        )
    } else {
        let hi = 0xfd10_0000_u128 << 96;
        IpNet::V6(Ipv6Net::new(Ipv6Addr::from(hi | (u128::from(j) << 64)), 64).unwrap_or_default())
    }
}

/// Peers `from..from + n` with their prefixes.
fn peer_set(from: usize, n: usize, per: usize) -> Vec<(PublicKey, Vec<IpNet>)> {
    (from..from + n)
        .map(|i| (PrivateKey::generate().public_key(), prefixes_of(i, per)))
        .collect()
}

/// The whole desired state of one node: WireGuard device, marking, routing.
struct Desired {
    dev: WgDevice,
    marking: MarkingSpec,
    routing: RoutingSpec,
}

impl Desired {
    fn new(name: &str, peers: &[(PublicKey, Vec<IpNet>)], layout: SetLayout) -> Self {
        let dev = WgDevice {
            name: name.to_owned(),
            private_key: PrivateKey::generate(),
            listen_port: wirespan_dataplane::DEFAULT_LISTEN_PORT,
            fwmark: wirespan_dataplane::DEVICE_FWMARK,
            peers: peers
                .iter()
                .enumerate()
                .map(|(i, (key, prefixes))| WgPeer {
                    public_key: key.clone(),
                    preshared_key: None,
                    persistent_keepalive: 25,
                    // Documentation range: never reachable, never contacted.
                    endpoint: Some(std::net::SocketAddr::new(
                        IpAddr::V4(Ipv4Addr::new(198, 18, (i >> 8) as u8, i as u8)),
                        51820,
                    )),
                    allowed_ips: prefixes.clone(),
                })
                .collect(),
        };
        let mut d = Self {
            dev,
            marking: MarkingSpec {
                layout,
                ..MarkingSpec::default()
            },
            routing: RoutingSpec {
                link: name.to_owned(),
                addresses: vec!["fd7f:175a:b97c:5602::1/64"
                    .parse()
                    .unwrap_or_else(|_| unreachable!())],
                ..RoutingSpec::default()
            },
        };
        d.sync_marking();
        d
    }

    /// The routed set is the union of every peer's allowed IPs.
    fn sync_marking(&mut self) {
        let (v4, v6): (Vec<IpNet>, Vec<IpNet>) = self
            .dev
            .peers
            .iter()
            .flat_map(|p| p.allowed_ips.iter().copied())
            .partition(|p| matches!(p, IpNet::V4(_)));
        self.marking.prefixes_v4 = v4;
        self.marking.prefixes_v6 = v6;
    }
}

/// One node's adapters in a fresh namespace.
struct Node {
    // Field order is drop order: the adapters go before their namespace.
    wg: UserspaceBackend,
    marking: NftMarking,
    routing: NetlinkRouting,
    name: String,
    _ns: NetnsGuard,
}

impl Node {
    fn new() -> anyhow::Result<Self> {
        let ns = NetnsGuard::new("wsbench").map_err(|e| {
            anyhow::anyhow!("cannot create a network namespace (needs root and iproute2): {e}")
        })?;
        let name = unique_name("wsb");
        Ok(Self {
            wg: UserspaceBackend::new(&name, ns.netns().clone()),
            marking: NftMarking::new(ns.netns().clone()),
            routing: NetlinkRouting::new(ns.netns())?,
            name,
            _ns: ns,
        })
    }

    /// Applies all three adapters; returns (WireGuard, nft, routing) times.
    fn apply(&mut self, d: &Desired) -> anyhow::Result<(Duration, Duration, Duration)> {
        let t0 = Instant::now();
        self.wg.apply(&d.dev)?;
        let t1 = Instant::now();
        self.marking.apply(&d.marking)?;
        let t2 = Instant::now();
        self.routing.apply(&d.routing)?;
        let t3 = Instant::now();
        Ok((t1 - t0, t2 - t1, t3 - t2))
    }
}

struct FromEmpty {
    start: Duration,
    wg: Duration,
    nft: Duration,
    routing: Duration,
    noop: Duration,
    /// Peers the device reports after the apply.
    peers_on_device: usize,
    /// WireGuard writes of the re-apply (0 unless the diff is broken).
    noop_writes: u64,
}

fn from_empty(peers: usize, per: usize) -> anyhow::Result<FromEmpty> {
    let mut node = Node::new()?;
    let d = Desired::new(&node.name, &peer_set(0, peers, per), SetLayout::Split);
    let t = Instant::now();
    node.wg.ensure()?;
    let start = t.elapsed();
    let (wg, nft, routing) = node.apply(&d)?;
    let writes = node.wg.writes();
    let t = Instant::now();
    node.apply(&d)?;
    let noop = t.elapsed();
    let noop_writes = node.wg.writes() - writes;
    let peers_on_device = node.wg.observe()?.peers.len();
    Ok(FromEmpty {
        start,
        wg,
        nft,
        routing,
        noop,
        peers_on_device,
        noop_writes,
    })
}

struct Change {
    total_median: Duration,
    total_p99: Duration,
    wg_median: Duration,
    nft_median: Duration,
}

fn one_peer_change(n: usize, per: usize, changes: usize) -> anyhow::Result<Change> {
    let pb = bar(changes + 1, &format!("one-peer change, N={n}"));
    let mut node = Node::new()?;
    let mut d = Desired::new(&node.name, &peer_set(0, n, per), SetLayout::Split);
    node.wg.ensure()?;
    node.apply(&d)?;
    pb.inc(1);
    let (mut total, mut wg, mut nft) = (Vec::new(), Vec::new(), Vec::new());
    for c in 0..changes {
        let p = (c * 7919) % n;
        let slot = per - 1;
        // A fresh CIDR beyond every peer's range.
        d.dev.peers[p].allowed_ips[slot] = cidr(n * per + c, slot.is_multiple_of(2));
        // The desired-state recomputation is part of the cost a controller pays.
        let t = Instant::now();
        d.sync_marking();
        let (w, m, r) = node.apply(&d)?;
        total.push(t.elapsed());
        wg.push(w);
        nft.push(m);
        let _ = r;
        pb.inc(1);
    }
    pb.finish_and_clear();
    Ok(Change {
        total_median: median(&mut total),
        total_p99: p99(&mut total),
        wg_median: median(&mut wg),
        nft_median: median(&mut nft),
    })
}

struct LayoutFigures {
    from_empty: Duration,
    /// One host address replaced.
    host: Duration,
    /// One CIDR replaced.
    net: Duration,
    rebuild: Duration,
}

fn layout_figures(
    prefixes: &[IpNet],
    layout: SetLayout,
    changes: usize,
) -> anyhow::Result<LayoutFigures> {
    // Full rebuilds are slow at scale and their median settles quickly.
    let rebuilds = changes.min(5);
    let pb = bar(
        2 * changes + rebuilds + 1,
        &format!("nft {layout:?}, {}", prefixes.len()),
    );
    let ns = NetnsGuard::new("wsbench")
        .map_err(|e| anyhow::anyhow!("cannot create a network namespace: {e}"))?;
    let mut m = NftMarking::new(ns.netns().clone());
    let (v4, v6): (Vec<IpNet>, Vec<IpNet>) =
        prefixes.iter().partition(|p| matches!(p, IpNet::V4(_)));
    let mut spec = MarkingSpec {
        prefixes_v4: v4,
        prefixes_v6: v6,
        layout,
        ..MarkingSpec::default()
    };
    let t = Instant::now();
    m.apply(&spec)?;
    let from_empty = t.elapsed();
    pb.inc(1);
    // One host address replaced (slot 0 is peer 0's node address), then one CIDR.
    let mut timed = |spec: &mut MarkingSpec, change: &dyn Fn(&mut MarkingSpec, usize)| {
        let mut v = Vec::new();
        for c in 0..changes {
            change(spec, c);
            let t = Instant::now();
            anyhow::ensure!(m.apply(spec)?, "element update wrote nothing");
            v.push(t.elapsed());
            pb.inc(1);
        }
        Ok::<_, anyhow::Error>(median(&mut v))
    };
    let host = timed(&mut spec, &|s, c| {
        let c = u32::try_from(c).unwrap_or(0) & 0xffff;
        s.prefixes_v4[0] =
            IpNet::V4(Ipv4Net::new(Ipv4Addr::from(0x647f_0000 | c), 32).unwrap_or_default());
    })?;
    let last = spec.prefixes_v4.len() - 1;
    let net = timed(&mut spec, &|s, c| {
        s.prefixes_v4[last] = cidr(1 << 17 | c, true);
    })?;
    // An MTU change alters the MSS clamp rules: the whole table is replaced.
    let mut rebuild = Vec::new();
    for c in 0..rebuilds {
        spec.mtu = if c % 2 == 0 { 1400 } else { 1420 };
        let t = Instant::now();
        anyhow::ensure!(m.apply(&spec)?, "rebuild wrote nothing");
        rebuild.push(t.elapsed());
        pb.inc(1);
    }
    pb.finish_and_clear();
    drop(m);
    drop(ns);
    Ok(LayoutFigures {
        from_empty,
        host,
        net,
        rebuild: median(&mut rebuild),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(peers_on_device: usize, noop_writes: u64) -> FromEmpty {
        let slow = Duration::from_secs(30);
        FromEmpty {
            start: slow,
            wg: slow,
            nft: slow,
            routing: slow,
            noop: slow,
            peers_on_device,
            noop_writes,
        }
    }

    #[test]
    fn missing_peers_or_a_writing_no_op_are_broken_slow_applies_are_not() {
        let mut s = Sanity::new("dataplane");
        judge_from_empty(&mut s, 100, &[run(100, 0), run(100, 0)]);
        assert!(s.problems().is_empty());
        judge_from_empty(&mut s, 100, &[run(100, 0), run(99, 1)]);
        assert_eq!(
            s.problems(),
            [
                "from empty, round 2: 99 of 100 peers on the device after the apply",
                "from empty, round 2: re-applying the same state wrote 1 time(s)"
            ]
        );
    }
}
