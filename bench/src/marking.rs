//! `wirespan bench marking`: what marking a packet costs, per lookup structure, so
//! users can choose between the nftables and the eBPF path. Needs root.
//!
//! - micro: ns per packet through `BPF_PROG_TEST_RUN` for routed sets of 1 to
//!   100,000 prefixes per family (90 % hosts, 10 % CIDRs), IPv4 and IPv6, with the
//!   destination hitting a host, hitting a CIDR, or missing (an address next to the
//!   hosts, so the miss probes the same bucket). Programs: the prefix-hash classifier
//!   (default), the host-hash + LPM-trie classifier (fallback), and in the same run a
//!   floor program that parses and does exactly one hash lookup, and an empty one.
//! - macro: forwarded packets through a router namespace (sender veth -> router ->
//!   sink veth) with no marking, the upstream-style single nftables interval set, our
//!   nftables hash + interval sets, and the eBPF classifier (as deployed: classifier
//!   plus the nftables table with the prerouting set rules omitted; prefix hash and
//!   LPM), at 100 and 10,000 prefixes, configurations alternating over several rounds.
//!   Traffic: `BPF_PROG_TEST_RUN` with XDP live frames injected as received on the
//!   router's ingress veth (pktgen needs a kernel module, unavailable here), 2/3 of
//!   destinations in the set; the sink drops in XDP and counts. The generator runs in
//!   the same CPU context as the router's forwarding, so time per packet is generator
//!   plus router; the generator's share is the same in every configuration and cancels
//!   in the reported overhead against no marking. Time is the sending thread's CPU
//!   time (the forwarding runs in its softirq context), not wall time, so other load
//!   on the machine does not inflate it. No policy rule is installed, so the route is
//!   the same for marked and unmarked packets: the difference is marking.
//!
//! - apply cost: what one routed-set change costs each adapter (nftables table, eBPF
//!   maps with the prefix hash) at 100, 1,000 and 10,000 peers of 2 prefixes each (a
//!   /32 host and a /24): a full-spec apply with that one prefix changed, next to the
//!   same change as a one-prefix delta (`apply_delta`), which should not grow with
//!   the number of peers. Wall time, median and p90.
//!
//! Output: a table on stdout, `report.md` and `chart.svg` in `--out`.

use std::{
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::Context;
use wirespan_dataplane::{
    fastpath::{
        sync::{MapState, Structures},
        testrun, FastPath, FastPathConfig, Interfaces, Lookup, Programs,
    },
    ipnet::IpNet,
    marking::{Marking, MarkingSpec, NftMarking, PrefixDelta, PreroutingMarking, SetLayout},
    netns::{unique_name, NetnsGuard, NetnsThread},
};
use wirespan_ebpf::{PROG_EMPTY, PROG_FLOOR, PROG_LPM, PROG_PHASH, PROG_XDP_PASS, PROG_XDP_SINK};

use crate::bar;

/// Options of `wirespan bench marking`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Short run (under a minute): fewer repetitions and rounds, same table.
    #[arg(long)]
    pub quick: bool,
    /// Folder for report.md and chart.svg.
    #[arg(long, default_value = "bench-marking")]
    pub out: PathBuf,
    /// Macro rounds (each runs every configuration once, alternating); default 5, 2
    /// with --quick.
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Only the apply-cost table (full spec vs one-prefix delta per adapter).
    #[arg(long)]
    pub apply_only: bool,
}

const SIZES: [usize; 5] = [1, 100, 1_000, 10_000, 100_000];
const MACRO_SIZES: [usize; 2] = [100, 10_000];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    Host,
    Cidr,
    Miss,
}

impl Probe {
    fn name(self) -> &'static str {
        match self {
            Probe::Host => "host hit",
            Probe::Cidr => "CIDR hit",
            Probe::Miss => "miss",
        }
    }
}

/// The routed set of the benchmark: `n` prefixes per family, 90 % hosts, 10 % CIDRs.
/// IPv4 hosts 172.16.0.0 + i, CIDRs 172.20.i.0/24 (wrapping into 172.21…); IPv6
/// hosts fd00:2::i, CIDRs fd00:1:0:i::/64.
fn routed_set(n: usize) -> MarkingSpec {
    let mut s = MarkingSpec::default();
    let cidrs = n / 10;
    let hosts = n - cidrs;
    for i in 0..hosts as u32 {
        s.prefixes_v4
            .push(IpNet::new(Ipv4Addr::from(0xac10_0000 + i).into(), 32).unwrap_or_default());
        s.prefixes_v6.push(
            IpNet::new(
                Ipv6Addr::from(0xfd00_0002_u128 << 96 | u128::from(i)).into(),
                128,
            )
            .unwrap_or_default(),
        );
    }
    for i in 0..cidrs as u32 {
        s.prefixes_v4.push(
            IpNet::new(Ipv4Addr::from(0xac14_0000 + (i << 8)).into(), 24).unwrap_or_default(),
        );
        s.prefixes_v6.push(
            IpNet::new(
                Ipv6Addr::from(0xfd00_0001_u128 << 96 | u128::from(i) << 64).into(),
                64,
            )
            .unwrap_or_default(),
        );
    }
    s
}

/// Destination of a probe for a set of `n` (None: the set has no CIDR).
fn probe_dst(n: usize, v6: bool, probe: Probe) -> Option<IpAddr> {
    let cidrs = (n / 10) as u32;
    let hosts = n as u32 - cidrs;
    Some(match (probe, v6) {
        (Probe::Host, false) => Ipv4Addr::from(0xac10_0000 + hosts / 2).into(),
        (Probe::Host, true) => {
            Ipv6Addr::from(0xfd00_0002_u128 << 96 | u128::from(hosts / 2)).into()
        }
        (Probe::Cidr, _) if cidrs == 0 => return None,
        (Probe::Cidr, false) => Ipv4Addr::from(0xac14_0000 + ((cidrs / 2) << 8) + 77).into(),
        (Probe::Cidr, true) => {
            Ipv6Addr::from(0xfd00_0001_u128 << 96 | u128::from(cidrs / 2) << 64 | 77).into()
        }
        // Next to the last host: same region, not in the set.
        (Probe::Miss, false) => Ipv4Addr::from(0xac10_0000 + hosts).into(),
        (Probe::Miss, true) => Ipv6Addr::from(0xfd00_0002_u128 << 96 | u128::from(hosts)).into(),
    })
}

fn frame_to(dst: IpAddr, dst_mac: [u8; 6], src_mac: [u8; 6]) -> Vec<u8> {
    let src: IpAddr = match dst {
        IpAddr::V4(_) => Ipv4Addr::new(10, 1, 0, 2).into(),
        IpAddr::V6(_) => "fd01::2".parse::<Ipv6Addr>().map_or(dst, IpAddr::V6),
    };
    testrun::udp_frame(dst_mac, src_mac, src, dst, 18)
}

/// One micro figure: ns per packet (median over rounds).
#[derive(Debug, Clone)]
struct Micro {
    size: usize,
    v6: bool,
    probe: Probe,
    phash: f64,
    lpm: f64,
    floor: f64,
    empty: f64,
}

fn median_f(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n.is_multiple_of(2) {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    } else {
        v[n / 2]
    }
}

/// CPU time of the calling thread (user + system, softirq work done in its context
/// included): unlike wall time, not inflated when other work preempts it.
#[allow(unsafe_code)]
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write into.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &raw mut ts) };
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

fn micro(args: &Args) -> anyhow::Result<Vec<Micro>> {
    let (repeat, rounds) = if args.quick {
        (20_000, 3)
    } else {
        (200_000, 7)
    };
    let mut out = Vec::new();
    let pb = bar(SIZES.len(), "micro (BPF_PROG_TEST_RUN)");
    for &n in &SIZES {
        let mut p = Programs::load(
            Structures {
                phash: true,
                lpm: true,
            },
            wirespan_ebpf::DEFAULT_ENTRIES,
            &[PROG_PHASH, PROG_LPM, PROG_FLOOR, PROG_EMPTY],
        )
        .context("loading the BPF programs (root and a kernel with BPF needed)")?;
        p.apply(&routed_set(n))?;
        for v6 in [false, true] {
            for probe in [Probe::Host, Probe::Cidr, Probe::Miss] {
                let Some(dst) = probe_dst(n, v6, probe) else {
                    continue;
                };
                let pkt = frame_to(dst, [2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]);
                // Sanity: the structures agree on the verdict.
                let want = u32::from(probe != Probe::Miss) * 0x40;
                for prog in [PROG_PHASH, PROG_LPM] {
                    let r = p.test_run(prog, &pkt, 0, 1)?;
                    anyhow::ensure!(
                        r.mark == want,
                        "{prog} {dst}: mark {:#x}, want {want:#x}",
                        r.mark
                    );
                }
                let mut samples: [Vec<f64>; 4] = Default::default();
                for _ in 0..rounds {
                    for (i, prog) in [PROG_PHASH, PROG_LPM, PROG_FLOOR, PROG_EMPTY]
                        .iter()
                        .enumerate()
                    {
                        let r = p.test_run(prog, &pkt, 0, repeat)?;
                        samples[i].push(r.per_run.as_nanos() as f64);
                    }
                }
                // The kernel reports whole ns per run; average of the medians is fine.
                let [a, b, c, d] = &mut samples;
                out.push(Micro {
                    size: n,
                    v6,
                    probe,
                    phash: median_f(a),
                    lpm: median_f(b),
                    floor: median_f(c),
                    empty: median_f(d),
                });
            }
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    Ok(out)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Config {
    None,
    NftInterval,
    NftSplit,
    Ebpf,
    EbpfLpm,
}

const CONFIGS: [Config; 5] = [
    Config::None,
    Config::NftInterval,
    Config::NftSplit,
    Config::Ebpf,
    Config::EbpfLpm,
];

impl Config {
    fn name(self) -> &'static str {
        match self {
            Config::None => "no marking",
            Config::NftInterval => "nft interval set (upstream)",
            Config::NftSplit => "nft hash + interval (ours)",
            Config::Ebpf => "eBPF tcx prefix hash",
            Config::EbpfLpm => "eBPF tcx hash + LPM",
        }
    }
}

struct Router {
    sender: NetnsGuard,
    router: NetnsGuard,
    sink: NetnsGuard,
    r_in: String,
    r_in_index: u32,
    r_in_mac: [u8; 6],
    sender_mac: [u8; 6],
    thread: NetnsThread,
    source: Programs,
    sink_counter: Programs,
}

fn mac_of(ns: &NetnsGuard, dev: &str) -> anyhow::Result<([u8; 6], u32)> {
    let out = ns.run_stdout("ip", &["-j", "link", "show", "dev", dev])?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let addr = v[0]["address"].as_str().context("no MAC")?;
    let mut mac = [0u8; 6];
    for (m, part) in mac.iter_mut().zip(addr.split(':')) {
        *m = u8::from_str_radix(part, 16)?;
    }
    let index = u32::try_from(v[0]["ifindex"].as_u64().context("no ifindex")?)?;
    Ok((mac, index))
}

fn veth(a: &NetnsGuard, b: &NetnsGuard) -> anyhow::Result<(String, String)> {
    let (x, y) = (unique_name("bm"), unique_name("bn"));
    a.run(
        "ip",
        &["link", "add", &x, "type", "veth", "peer", "name", &y],
    )?;
    a.run("ip", &["link", "set", &y, "netns", b.name()])?;
    a.run("ip", &["link", "set", &x, "up"])?;
    b.run("ip", &["link", "set", &y, "up"])?;
    Ok((x, y))
}

impl Router {
    fn new() -> anyhow::Result<Self> {
        let sender = NetnsGuard::new("wsbS")?;
        let router = NetnsGuard::new("wsbR")?;
        let sink = NetnsGuard::new("wsbK")?;
        let (s_out, r_in) = veth(&sender, &router)?;
        let (r_out, k_in) = veth(&router, &sink)?;
        sender.run("ip", &["addr", "add", "10.1.0.2/24", "dev", &s_out])?;
        router.run("ip", &["addr", "add", "10.1.0.1/24", "dev", &r_in])?;
        router.run("ip", &["addr", "add", "10.2.0.1/24", "dev", &r_out])?;
        sink.run("ip", &["addr", "add", "10.2.0.2/24", "dev", &k_in])?;
        for kv in [
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
        ] {
            router.run("sysctl", &["-q", "-w", kv])?;
        }
        // The sink gets the router ingress's MAC: live-frame pages are recycled with the
        // Ethernet header forwarding wrote, which then still addresses the router.
        let (r_in_mac0, _) = mac_of(&router, &r_in)?;
        let mac = r_in_mac0.map(|b| format!("{b:02x}")).join(":");
        sink.run("ip", &["link", "set", "dev", &k_in, "address", &mac])?;
        router.run(
            "ip",
            &[
                "neigh",
                "replace",
                "10.2.0.2",
                "lladdr",
                &mac,
                "dev",
                &r_out,
                "nud",
                "permanent",
            ],
        )?;
        router.run("ip", &["route", "add", "172.16.0.0/12", "via", "10.2.0.2"])?;
        let (r_in_mac, r_in_index) = mac_of(&router, &r_in)?;
        let (sender_mac, _) = mac_of(&sender, &s_out)?;

        let source = Programs::load(
            Structures {
                phash: false,
                lpm: false,
            },
            1,
            &[PROG_XDP_PASS],
        )?;
        let mut sink_counter = Programs::load(
            Structures {
                phash: false,
                lpm: false,
            },
            1,
            &[PROG_XDP_SINK],
        )?;
        let thread = NetnsThread::spawn(sink.netns())?;
        // Attach in the sink's namespace: aya resolves the name there.
        let k = k_in;
        let sc = std::sync::Arc::new(std::sync::Mutex::new(Some(sink_counter)));
        let sc2 = std::sync::Arc::clone(&sc);
        thread
            .run(move || {
                let mut g = sc2
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                g.as_mut().map(|p| p.attach_xdp(PROG_XDP_SINK, &k))
            })?
            .context("no sink")??;
        sink_counter = sc
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
            .context("sink")?;
        let thread = NetnsThread::spawn(router.netns())?;
        Ok(Self {
            sender,
            router,
            sink,
            r_in,
            r_in_index,
            r_in_mac,
            sender_mac,
            thread,
            source,
            sink_counter,
        })
    }

    /// Sends `per_dst` frames to each destination; returns (CPU time of the sending
    /// thread per packet in ns, fraction delivered to the sink).
    fn blast(&self, dsts: &[IpAddr], per_dst: u32) -> anyhow::Result<(f64, f64)> {
        let frames: Vec<Vec<u8>> = dsts
            .iter()
            .map(|d| frame_to(*d, self.r_in_mac, self.sender_mac))
            .collect();
        let fd = self.source.program_fd(PROG_XDP_PASS)?;
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        let index = self.r_in_index;
        let before = self.sink_counter.counters()?.hit;
        let elapsed = self.thread.run(move || -> std::io::Result<Duration> {
            let fd = unsafe_borrow(raw);
            let start = thread_cpu_time();
            for f in &frames {
                testrun::run_xdp_live(fd, f, index, per_dst, 64)?;
            }
            Ok(thread_cpu_time().saturating_sub(start))
        })??;
        // Let the sink's softirq drain (it runs right after, on this CPU).
        let sent = u64::from(per_dst) * dsts.len() as u64;
        let deadline = Instant::now() + Duration::from_millis(500);
        let mut got = 0;
        while Instant::now() < deadline {
            got = self.sink_counter.counters()?.hit - before;
            if got >= sent {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok((
            elapsed.as_nanos() as f64 / sent as f64,
            got as f64 / sent as f64,
        ))
    }
}

/// Borrows a raw fd for the duration of a closure on another thread.
#[allow(unsafe_code)]
fn unsafe_borrow(raw: std::os::fd::RawFd) -> std::os::fd::BorrowedFd<'static> {
    // SAFETY: callers pass an fd owned by a `Programs` that outlives the call
    // (`Router::blast` waits for the closure to finish before returning).
    unsafe { std::os::fd::BorrowedFd::borrow_raw(raw) }
}

/// The configuration's kernel state, removed on drop.
enum Applied {
    None,
    Nft(NftMarking),
    Ebpf(NftMarking, FastPath),
}

fn apply_config(r: &Router, config: Config, set: &MarkingSpec) -> anyhow::Result<Applied> {
    Ok(match config {
        Config::None => Applied::None,
        Config::NftInterval | Config::NftSplit => {
            let mut m = NftMarking::new(r.router.netns().clone());
            m.apply(&MarkingSpec {
                layout: if config == Config::NftInterval {
                    SetLayout::Interval
                } else {
                    SetLayout::Split
                },
                ..set.clone()
            })?;
            Applied::Nft(m)
        }
        Config::Ebpf | Config::EbpfLpm => {
            let spec = MarkingSpec {
                prerouting: PreroutingMarking::FastPath,
                ..set.clone()
            };
            let mut m = NftMarking::new(r.router.netns().clone());
            m.apply(&spec)?;
            let fp = FastPath::attach(
                r.router.netns(),
                FastPathConfig {
                    interfaces: Interfaces::Only(vec![r.r_in.clone()]),
                    lookup: if config == Config::Ebpf {
                        Lookup::PrefixHash
                    } else {
                        Lookup::Lpm
                    },
                    ..FastPathConfig::default()
                },
            )?;
            fp.apply(&spec)?;
            Applied::Ebpf(m, fp)
        }
    })
}

fn remove_config(applied: Applied) -> anyhow::Result<()> {
    match applied {
        Applied::None => {}
        Applied::Nft(mut m) => m.teardown()?,
        Applied::Ebpf(mut m, fp) => {
            fp.teardown()?;
            m.teardown()?;
        }
    }
    Ok(())
}

/// One bar of the chart: (label, median, min, max).
type Bar = (String, f64, f64, f64);
/// A titled group of bars.
type BarGroup = (String, Vec<Bar>);

/// Macro figures of one (size, config): ns per packet per round, delivery.
#[derive(Debug, Clone)]
struct MacroRow {
    size: usize,
    config: Config,
    per_packet: Vec<f64>,
    delivered: f64,
}

fn macro_bench(args: &Args) -> anyhow::Result<Vec<MacroRow>> {
    let rounds = args.rounds.unwrap_or(if args.quick { 2 } else { 5 }).max(1);
    let per_dst: u32 = if args.quick { 20_000 } else { 200_000 };
    let r = Router::new().context("building the router namespaces")?;
    let mut rows: Vec<MacroRow> = Vec::new();
    let pb = bar(
        rounds * MACRO_SIZES.len() * CONFIGS.len(),
        "macro (forwarding)",
    );
    // Warm-up: neighbour, route caches.
    let (_, delivered) = r.blast(&[Ipv4Addr::new(172, 16, 0, 1).into()], 2_000)?;
    anyhow::ensure!(
        delivered > 0.99,
        "the router forwarded only {:.1} % of the warm-up packets",
        delivered * 100.0
    );
    for round in 0..rounds {
        for &n in &MACRO_SIZES {
            let set = MarkingSpec {
                prefixes_v6: Vec::new(),
                ..routed_set(n)
            };
            let dsts: Vec<IpAddr> = [Probe::Host, Probe::Cidr, Probe::Miss]
                .iter()
                .filter_map(|p| probe_dst(n, false, *p))
                .collect();
            // Alternate the order each round so drift does not favour one config.
            let mut order = CONFIGS.to_vec();
            if round % 2 == 1 {
                order.reverse();
            }
            for config in order {
                let applied = apply_config(&r, config, &set)
                    .with_context(|| format!("setting up {}", config.name()))?;
                let (ns, delivered) = r.blast(&dsts, per_dst)?;
                remove_config(applied)?;
                match rows.iter_mut().find(|x| x.size == n && x.config == config) {
                    Some(row) => {
                        row.per_packet.push(ns);
                        row.delivered = row.delivered.min(delivered);
                    }
                    None => rows.push(MacroRow {
                        size: n,
                        config,
                        per_packet: vec![ns],
                        delivered,
                    }),
                }
                pb.inc(1);
            }
        }
    }
    pb.finish_and_clear();
    drop(r.sender);
    drop(r.sink);
    Ok(rows)
}

/// Overhead of each round against the same round's no-marking figure.
fn overheads(rows: &[MacroRow], row: &MacroRow) -> Vec<f64> {
    let base = rows
        .iter()
        .find(|r| r.size == row.size && r.config == Config::None);
    match base {
        Some(b) => row
            .per_packet
            .iter()
            .zip(&b.per_packet)
            .map(|(x, y)| x - y)
            .collect(),
        None => Vec::new(),
    }
}

/// Peer counts of the apply-cost table.
const APPLY_PEERS: [usize; 3] = [100, 1_000, 10_000];

/// The two prefixes of peer `i`: a host 10.0.0.0 + i + 1 and the /24 172.16.0.0 + 256 i.
fn peer_prefixes(i: usize) -> [IpNet; 2] {
    let i = u32::try_from(i).unwrap_or(0);
    [
        IpNet::new(Ipv4Addr::from(0x0a00_0001 + i).into(), 32).unwrap_or_default(),
        IpNet::new(Ipv4Addr::from(0xac10_0000 + (i << 8)).into(), 24).unwrap_or_default(),
    ]
}

/// Where peer `i`'s prefix `which` (0: host, 1: /24) moves to and back: 11.0.0.0 +
/// i + 1, 100.64.0.0 + 256 i.
fn moved(i: usize, which: usize) -> IpNet {
    let i = u32::try_from(i).unwrap_or(0);
    if which == 0 {
        IpNet::new(Ipv4Addr::from(0x0b00_0001 + i).into(), 32).unwrap_or_default()
    } else {
        IpNet::new(Ipv4Addr::from(0x6440_0000 + (i << 8)).into(), 24).unwrap_or_default()
    }
}

/// A marking adapter as the apply-cost table drives it.
trait ApplyCost {
    fn full(&mut self, spec: &MarkingSpec) -> anyhow::Result<()>;
    fn delta(&mut self, delta: &PrefixDelta) -> anyhow::Result<()>;
}

impl ApplyCost for NftMarking {
    fn full(&mut self, spec: &MarkingSpec) -> anyhow::Result<()> {
        anyhow::ensure!(self.apply(spec)?, "full apply wrote nothing");
        Ok(())
    }
    fn delta(&mut self, delta: &PrefixDelta) -> anyhow::Result<()> {
        anyhow::ensure!(self.apply_delta(delta)?, "delta wrote nothing");
        Ok(())
    }
}

impl ApplyCost for Programs {
    fn full(&mut self, spec: &MarkingSpec) -> anyhow::Result<()> {
        anyhow::ensure!(self.apply(spec)?.writes() > 0, "full apply wrote nothing");
        Ok(())
    }
    fn delta(&mut self, delta: &PrefixDelta) -> anyhow::Result<()> {
        anyhow::ensure!(self.apply_delta(delta)?.writes() > 0, "delta wrote nothing");
        Ok(())
    }
}

/// The fast path's planning alone (no map writes): what the userspace part costs.
impl ApplyCost for MapState {
    fn full(&mut self, spec: &MarkingSpec) -> anyhow::Result<()> {
        let (plan, next) = self.plan(spec);
        anyhow::ensure!(!plan.is_empty(), "full apply planned nothing");
        let old = std::mem::replace(self, next);
        self.adopt_index(old);
        Ok(())
    }
    fn delta(&mut self, delta: &PrefixDelta) -> anyhow::Result<()> {
        let (plan, changes) = self.plan_delta(delta)?;
        anyhow::ensure!(!plan.is_empty(), "delta planned nothing");
        self.commit_delta(delta, &plan, changes);
        Ok(())
    }
}

/// One row of the apply-cost table: medians and p90s of each way to apply one change.
#[derive(Debug, Clone)]
struct ApplyRow {
    peers: usize,
    adapter: &'static str,
    full: (Duration, Duration),
    /// Per prefix kind: 0 the host (hash set), 1 the /24 (interval set).
    delta: [(Duration, Duration); 2],
}

fn median_p90(v: &mut [Duration]) -> (Duration, Duration) {
    v.sort_unstable();
    let at = |q: usize| v.get((v.len() * q / 100).min(v.len().saturating_sub(1)));
    (
        at(50).copied().unwrap_or_default(),
        at(90).copied().unwrap_or_default(),
    )
}

/// Times `fulls` full applies moving one peer's /24 (to [`moved`] or back), and
/// `deltas` deltas moving one peer's host, then as many moving its /24, on an adapter
/// that holds `spec`. Returns the full and the two delta (median, p90).
#[allow(clippy::type_complexity)]
fn time_changes(
    a: &mut dyn ApplyCost,
    spec: &MarkingSpec,
    fulls: usize,
    deltas: usize,
) -> anyhow::Result<((Duration, Duration), [(Duration, Duration); 2])> {
    let peers = spec.prefixes_v4.len() / 2;
    let mut cur = spec.clone();
    // Prefix `which` of peer k is at position 2k + which (a delta's addition takes
    // the removed prefix's position, so that stays true).
    let change = |cur: &MarkingSpec, step: usize, which: usize| {
        let k = (step * 7_919 + 13) % peers;
        let at = 2 * k + which;
        let now = cur.prefixes_v4[at];
        let next = if now == moved(k, which) {
            peer_prefixes(k)[which]
        } else {
            moved(k, which)
        };
        (at, now, next)
    };
    let warmup = 5;
    let mut delta_times = [Vec::new(), Vec::new()];
    for (which, times) in delta_times.iter_mut().enumerate() {
        for step in 0..warmup + deltas {
            let (at, now, next) = change(&cur, step, which);
            let delta = PrefixDelta {
                remove: vec![now],
                add: vec![next],
            };
            let t = Instant::now();
            a.delta(&delta)?;
            let took = t.elapsed();
            cur.prefixes_v4[at] = next;
            if step >= warmup {
                times.push(took);
            }
        }
    }
    let mut full_times = Vec::with_capacity(fulls);
    for step in 0..warmup + fulls {
        let (at, _, next) = change(&cur, step + 1_000_003, 1);
        cur.prefixes_v4[at] = next;
        let t = Instant::now();
        a.full(&cur)?;
        let took = t.elapsed();
        if step >= warmup {
            full_times.push(took);
        }
    }
    let [host, cidr] = &mut delta_times;
    Ok((
        median_p90(&mut full_times),
        [median_p90(host), median_p90(cidr)],
    ))
}

fn apply_cost(args: &Args) -> anyhow::Result<Vec<ApplyRow>> {
    let (fulls, deltas) = if args.quick { (5, 20) } else { (40, 400) };
    let mut out = Vec::new();
    let pb = bar(APPLY_PEERS.len() * 2, "apply cost (full vs delta)");
    for &peers in &APPLY_PEERS {
        let spec = MarkingSpec {
            prefixes_v4: (0..peers).flat_map(peer_prefixes).collect(),
            ..MarkingSpec::default()
        };
        let ns = NetnsGuard::new("wsbapply")?;
        let mut nft = NftMarking::new(ns.netns().clone());
        nft.apply(&spec)?;
        let (full, delta) = time_changes(&mut nft, &spec, fulls, deltas)?;
        out.push(ApplyRow {
            peers,
            adapter: "nftables (hash + interval sets)",
            full,
            delta,
        });
        pb.inc(1);
        let mut maps = Programs::load(
            Structures {
                phash: true,
                lpm: false,
            },
            wirespan_ebpf::DEFAULT_ENTRIES,
            &[],
        )
        .context("loading the BPF programs (root and a kernel with BPF needed)")?;
        maps.apply(&spec)?;
        let (full, delta) = time_changes(&mut maps, &spec, fulls, deltas)?;
        out.push(ApplyRow {
            peers,
            adapter: "eBPF maps (prefix hash)",
            full,
            delta,
        });
        let structures = Structures {
            phash: true,
            lpm: false,
        };
        let mut state = MapState::new(structures);
        state.full(&spec)?;
        let (full, delta) = time_changes(&mut state, &spec, fulls, deltas)?;
        out.push(ApplyRow {
            peers,
            adapter: "eBPF planning only (MapState, no writes)",
            full,
            delta,
        });
        pb.inc(1);
    }
    pb.finish_and_clear();
    Ok(out)
}

/// The apply-cost section of the report.
fn apply_cost_report(md: &mut String, rows: &[ApplyRow]) {
    let us = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1e6);
    let _ = writeln!(
        md,
        "## Apply cost: one peer's prefix changed, full spec vs one-prefix delta (µs, wall time)\n"
    );
    let _ = writeln!(
        md,
        "Peers of 2 prefixes each (a /32 host and a /24, IPv4). Full: `apply` of the whole spec with one /24 changed (the incremental full path: lists compared position by position). Delta: `apply_delta` of one prefix out and one in, a host (nftables: hash set) or a /24 (nftables: interval set). Median / p90.\n"
    );
    let _ = writeln!(md, "| peers | adapter | full /24 | delta /32 | delta /24 |");
    let _ = writeln!(md, "|---:|---|---:|---:|---:|");
    for r in rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} / {} | {} / {} | {} / {} |",
            r.peers,
            r.adapter,
            us(r.full.0),
            us(r.full.1),
            us(r.delta[0].0),
            us(r.delta[0].1),
            us(r.delta[1].0),
            us(r.delta[1].1)
        );
    }
    let _ = writeln!(md);
    let (lo, hi) = (APPLY_PEERS[0], APPLY_PEERS[APPLY_PEERS.len() - 1]);
    let mut adapters: Vec<&str> = Vec::new();
    for r in rows {
        if !adapters.contains(&r.adapter) {
            adapters.push(r.adapter);
        }
    }
    let ratio = |x: Duration, y: Duration| y.as_secs_f64() / x.as_secs_f64().max(1e-9);
    for adapter in adapters {
        let at = |n: usize| rows.iter().find(|r| r.adapter == adapter && r.peers == n);
        if let (Some(a), Some(b)) = (at(lo), at(hi)) {
            let judged = |x: f64| if x <= 2.0 { "ok" } else { "MISSED" };
            let (h, c) = (
                ratio(a.delta[0].0, b.delta[0].0),
                ratio(a.delta[1].0, b.delta[1].0),
            );
            let _ = writeln!(
                md,
                "- {adapter}, {hi} peers vs {lo} (target ≤ 2x): delta /32 {h:.2}x {}, delta /24 {c:.2}x {}; full {:.2}x",
                judged(h),
                judged(c),
                ratio(a.full.0, b.full.0)
            );
        }
    }
    let _ = writeln!(md);
}

/// Runs the benchmark and writes its report.
///
/// # Errors
/// Not root, no BPF support, a missing tool (`ip`, `nft`), or an output folder that
/// cannot be written.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let started = Instant::now();
    let apply_rows = apply_cost(args)?;
    if args.apply_only {
        let mut md = String::new();
        apply_cost_report(&mut md, &apply_rows);
        println!("{md}");
        return Ok(());
    }
    let micro = micro(args)?;
    let macro_rows = macro_bench(args)?;
    let mut md = String::new();
    let build = if cfg!(debug_assertions) {
        "DEBUG build (userspace only; kernel figures are unaffected)"
    } else {
        "release build"
    };
    let _ = writeln!(md, "# wirespan bench marking\n");
    let _ = writeln!(
        md,
        "{build}; {}; kernel {}.\n",
        if args.quick { "--quick" } else { "full run" },
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
    );

    // Micro table.
    let _ = writeln!(md, "## Micro: ns per packet (BPF_PROG_TEST_RUN, median)\n");
    let _ = writeln!(
        md,
        "Target: at 10k and 100k prefixes every probe within 1.5x of the floor (parse + one hash lookup, same run), judged on ns per run as the kernel reports it. The column \"above empty\" shows the same ratio after subtracting the empty program (test-run and hook overhead): the stricter reading, reported, not judged.\n"
    );
    let _ = writeln!(
        md,
        "| prefixes | family | destination | prefix hash | hash + LPM | floor | empty | prefix hash / floor | above empty | target |"
    );
    let _ = writeln!(md, "|---:|---|---|---:|---:|---:|---:|---:|---:|---|");
    let mut missed = Vec::new();
    for m in &micro {
        let ratio = m.phash / m.floor.max(1.0);
        let target = if m.size >= 10_000 {
            if ratio <= 1.5 {
                "ok"
            } else {
                missed.push(format!(
                    "micro {} {} {}: {:.2}x",
                    m.size,
                    if m.v6 { "IPv6" } else { "IPv4" },
                    m.probe.name(),
                    ratio
                ));
                "MISSED"
            }
        } else {
            ""
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2}x | {:.2}x | {target} |",
            m.size,
            if m.v6 { "IPv6" } else { "IPv4" },
            m.probe.name(),
            m.phash,
            m.lpm,
            m.floor,
            m.empty,
            ratio,
            (m.phash - m.empty).max(0.0) / (m.floor - m.empty).max(1.0)
        );
    }

    // Macro table.
    let _ = writeln!(
        md,
        "\n## Macro: forwarded packets, ns per packet (generator + router) and overhead against no marking\n"
    );
    let _ = writeln!(
        md,
        "XDP live frames injected on the router's ingress veth, 3 destinations (host hit, CIDR hit, miss; 2/3 in the set), {} rounds alternating configurations. ns/packet = CPU time of the generating thread, in whose softirq context the router forwards (so the generator, not the router, bounds the rate, and absolute ns include the generator); overhead = per-round difference to no marking, which cancels the generator; spread = min..max over rounds.\n",
        macro_rows.first().map_or(0, |r| r.per_packet.len())
    );
    let _ = writeln!(
        md,
        "| prefixes | configuration | ns/packet | Mpps | overhead ns | spread | vs upstream | delivered |"
    );
    let _ = writeln!(md, "|---:|---|---:|---:|---:|---|---:|---:|");
    let mut chart: Vec<BarGroup> = Vec::new();
    for &n in &MACRO_SIZES {
        let upstream = macro_rows
            .iter()
            .find(|r| r.size == n && r.config == Config::NftInterval)
            .map(|r| median_f(&mut overheads(&macro_rows, r)));
        let mut group = Vec::new();
        for row in macro_rows.iter().filter(|r| r.size == n) {
            let per = median_f(&mut row.per_packet.clone());
            let mut ov = overheads(&macro_rows, row);
            let (lo, hi) = ov
                .iter()
                .fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(*x), b.max(*x)));
            let med = if ov.is_empty() {
                0.0
            } else {
                median_f(&mut ov)
            };
            let vs = match (row.config, upstream) {
                (Config::None, _) | (_, None) => String::new(),
                (_, Some(u)) => format!("{:.2}", med / u.max(1.0)),
            };
            let _ = writeln!(
                md,
                "| {n} | {} | {per:.0} | {:.2} | {} | {} | {vs} | {:.1} % |",
                row.config.name(),
                1_000.0 / per,
                if row.config == Config::None {
                    "—".into()
                } else {
                    format!("{med:+.0}")
                },
                if row.config == Config::None {
                    "—".into()
                } else {
                    format!("{lo:+.0} .. {hi:+.0}")
                },
                row.delivered * 100.0
            );
            if row.config != Config::None {
                group.push((row.config.name().to_owned(), med, lo, hi));
            }
            if n == 10_000 && row.config == Config::Ebpf {
                if let Some(u) = upstream {
                    if med > u / 3.0 {
                        missed.push(format!(
                            "macro 10k: eBPF overhead {med:.0} ns > 1/3 of upstream {u:.0} ns"
                        ));
                    }
                }
            }
        }
        chart.push((format!("{n} prefixes"), group));
    }
    let _ = writeln!(md, "\nTarget (macro): eBPF overhead at 10,000 prefixes ≤ 1/3 of the upstream interval set's (column \"vs upstream\" ≤ 0.33). Stretch (steering to the mesh link) is not implemented.\n");
    if missed.is_empty() {
        let _ = writeln!(md, "All targets met in this run.");
    } else {
        let _ = writeln!(md, "Targets missed in this run:\n");
        for m in &missed {
            let _ = writeln!(md, "- {m}");
        }
    }
    let _ = writeln!(md);
    apply_cost_report(&mut md, &apply_rows);
    let _ = writeln!(md, "Total time: {:.1} s.", started.elapsed().as_secs_f64());

    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let report = args.out.join("report.md");
    std::fs::write(&report, &md).with_context(|| format!("writing {}", report.display()))?;
    let svg = args.out.join("chart.svg");
    std::fs::write(&svg, chart_svg(&chart))
        .with_context(|| format!("writing {}", svg.display()))?;
    println!("{md}");
    println!("report: {}  chart: {}", report.display(), svg.display());
    Ok(())
}

/// A grouped horizontal bar chart of overheads (ns) with min..max whiskers.
fn chart_svg(groups: &[BarGroup]) -> String {
    let max = groups
        .iter()
        .flat_map(|(_, g)| g.iter().map(|(_, m, _, hi)| m.max(*hi)))
        .fold(1.0f64, f64::max);
    let (left, width, row_h) = (230.0, 460.0, 22.0);
    let rows: usize = groups.iter().map(|(_, g)| g.len() + 1).sum();
    let height = 50.0 + rows as f64 * row_h + 20.0;
    let x = |v: f64| left + (v.max(0.0) / max) * width;
    let mut s = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="760" height="{height}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="10" y="20" font-size="14" font-weight="bold">Forwarding overhead of marking against no marking (ns/packet, median; whiskers min..max)</text>
"##
    );
    let mut y = 40.0;
    for (title, g) in groups {
        let _ = writeln!(
            s,
            r#"<text x="10" y="{}" font-weight="bold">{title}</text>"#,
            y + 14.0
        );
        y += row_h;
        for (name, med, lo, hi) in g {
            let color = if name.starts_with("eBPF") {
                "#2b7a3d"
            } else {
                "#b5651d"
            };
            let _ = writeln!(
                s,
                r#"<text x="20" y="{ty}">{name}</text><rect x="{left}" y="{ry}" width="{w:.1}" height="14" fill="{color}"/><line x1="{x1:.1}" x2="{x2:.1}" y1="{ly}" y2="{ly}" stroke="black"/><text x="{tx:.1}" y="{ty}">{med:.0}</text>"#,
                ty = y + 12.0,
                ry = y + 1.0,
                w = x(*med) - left,
                x1 = x(*lo),
                x2 = x(*hi),
                ly = y + 8.0,
                tx = x(med.max(*hi)) + 6.0,
            );
            y += row_h;
        }
    }
    s.push_str("</svg>\n");
    s
}
