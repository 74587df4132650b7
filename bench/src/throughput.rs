//! `wirespan bench throughput`: TCP and UDP throughput between two lab nodes (iperf3),
//! over the underlay alone (the ceiling) and through the mesh: to the peer's KubeSpan
//! address (the mesh with no marking: its on-link route needs none), and to the peer's
//! node address, which is marked into the mesh by nftables or by the eBPF fast path.
//! Every available WireGuard implementation is measured (kernel WireGuard where this
//! kernel has it, `wirespan wireguard`, wireguard-go); paths alternate over several
//! rounds. On the unmarked mesh path it also runs TCP with 4 streams and reads the CPU
//! time each run cost ([`cpu`]). Last, two-node labs whose two sides run different
//! implementations carry TCP both ways. A flood phase ([`flood`]) runs one TCP stream
//! while a flooder sends node2 handshake initiations with a valid MAC1 at 10k and 100k
//! a second.
//!
//! The labs are real (`wirespan lab up` with this binary): two nodes and a discovery
//! server in network namespaces, removed on exit (and by a watchdog if this process
//! is killed). Each run checks that its traffic went where its label says: the mesh
//! runs must show up in the WireGuard peer's transmit counter, the underlay run must
//! not. All traffic is IPv6 so the paths differ only in what is measured.
//!
//! Output: a table on stdout, `report.md` and `chart.svg` in `--out`.

use std::{
    fmt::Write as _,
    net::IpAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _};

use crate::sanity::Sanity;
use serde_json::Value;

use crate::{
    bar, chart,
    lab::{run_ok, Lab},
    quick_notice,
};

mod cpu;
mod flood;
mod mixed;

use cpu::CpuTicks;

/// Options of `wirespan bench throughput`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Short run: one round of one second per measurement.
    #[arg(long)]
    pub quick: bool,
    /// Folder for report.md and chart.svg.
    #[arg(long, default_value = "bench-throughput")]
    pub out: PathBuf,
    /// Seconds per iperf3 run; default 5, 1 with --quick.
    #[arg(long)]
    pub seconds: Option<u64>,
    /// Rounds (each runs every path once, alternating); default 3, 1 with --quick.
    #[arg(long)]
    pub rounds: Option<usize>,
    /// WireGuard implementations to measure; default: every one this host has (the
    /// kernel's when it can create a WireGuard link; `userspace`, i.e. `wirespan
    /// wireguard`, and `userspace-go`, i.e. wireguard-go, always).
    #[arg(long, value_delimiter = ',', value_parser = ["kernel", "userspace", "userspace-go"])]
    pub wireguard: Vec<String>,
    /// The wirespan binary that runs the labs (default: this one).
    #[arg(long, hide = true)]
    pub exe: Option<PathBuf>,
}

/// What one measurement crosses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PathKind {
    /// Node to the discovery server's namespace: veth, bridge, veth; no mesh.
    Underlay,
    /// To the peer's KubeSpan address: through WireGuard, no marking involved.
    MeshUnmarked,
    /// To the peer's node address, marked by nftables.
    MeshNftables,
    /// To the peer's node address, marked by the eBPF fast path.
    MeshEbpf,
}

const PATHS: [PathKind; 4] = [
    PathKind::Underlay,
    PathKind::MeshUnmarked,
    PathKind::MeshNftables,
    PathKind::MeshEbpf,
];

impl PathKind {
    fn label(self) -> &'static str {
        match self {
            PathKind::Underlay => "underlay (ceiling)",
            PathKind::MeshUnmarked => "mesh, no marking",
            PathKind::MeshNftables => "mesh, nftables marking",
            PathKind::MeshEbpf => "eBPF: mesh, fast-path marking",
        }
    }

    fn through_mesh(self) -> bool {
        self != PathKind::Underlay
    }
}

/// One iperf3 result.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Received rate, Mbit/s.
    mbps: f64,
    /// Bytes that reached the receiver (TCP: all sent; UDP: sent less the lost).
    delivered_bytes: u64,
    /// UDP datagrams lost (%), 0 for TCP.
    lost_percent: f64,
    /// TCP MSS iperf3 saw (0 for UDP).
    mss: u64,
}

/// Reads an iperf3 client's JSON report.
fn parse_iperf(json: &str, udp: bool) -> anyhow::Result<Sample> {
    let v: Value = serde_json::from_str(json).context("iperf3 printed no JSON")?;
    if let Some(e) = v["error"].as_str() {
        bail!("iperf3: {e}");
    }
    let end = &v["end"];
    if udp {
        let sum = &end["sum"];
        let lost = sum["lost_percent"].as_f64().unwrap_or(0.0);
        // The receiver's own count when iperf3 reports it: the sender's count less the
        // loss overstates delivery when datagrams after the last one received are lost.
        let received = &end["sum_received"];
        if let (Some(bytes), Some(rate)) = (
            received["bytes"].as_u64(),
            received["bits_per_second"].as_f64(),
        ) {
            return Ok(Sample {
                mbps: rate / 1e6,
                delivered_bytes: bytes,
                lost_percent: lost,
                mss: 0,
            });
        }
        let sent_rate = sum["bits_per_second"]
            .as_f64()
            .context("iperf3 UDP report without end.sum.bits_per_second")?;
        Ok(Sample {
            mbps: sent_rate * (1.0 - lost / 100.0) / 1e6,
            delivered_bytes: (sum["bytes"].as_f64().unwrap_or(0.0) * (1.0 - lost / 100.0)) as u64,
            lost_percent: lost,
            mss: 0,
        })
    } else {
        Ok(Sample {
            mbps: end["sum_received"]["bits_per_second"]
                .as_f64()
                .context("iperf3 TCP report without end.sum_received")?
                / 1e6,
            delivered_bytes: end["sum_sent"]["bytes"].as_u64().unwrap_or(0),
            lost_percent: 0.0,
            mss: v["start"]["tcp_mss_default"].as_u64().unwrap_or(0),
        })
    }
}

/// Median, min and max.
fn spread(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    (s[s.len() / 2], s[0], s[s.len() - 1])
}

impl Lab {
    fn up_pair(exe: &Path, name: &str, fast_path: &str, wireguard: &str) -> anyhow::Result<Self> {
        Self::up(
            exe,
            name,
            &[
                "--nodes",
                "2",
                "--fast-path",
                fast_path,
                "--wireguard",
                wireguard,
            ],
        )
    }

    /// The WireGuard implementation that runs node1's device.
    fn backend(&self) -> String {
        self.backend_of("node1")
    }

    /// The WireGuard implementation that runs `node`'s device.
    fn backend_of(&self, node: &str) -> String {
        self.node(node)
            .ok()
            .and_then(|n| n["wireguard"].as_str())
            .unwrap_or("?")
            .to_owned()
    }

    /// Bytes node1 sent through WireGuard, over all its peers.
    fn mesh_tx(&self) -> anyhow::Result<u64> {
        self.mesh_bytes(false)
    }

    /// Bytes node1 sent (`received`: received) through WireGuard, over all its peers.
    fn mesh_bytes(&self, received: bool) -> anyhow::Result<u64> {
        let out = run_ok(
            &mut self.cmd(&["exec", "node1", "--", "wg", "show", "kubespan", "transfer"]),
            "wg show transfer",
        )?;
        let field = if received { 1 } else { 2 };
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split('\t').nth(field)?.parse::<u64>().ok())
            .sum())
    }

    /// MTU of `link` in node1.
    fn mtu(&self, link: &str) -> anyhow::Result<u64> {
        let ns = self.namespace("node1")?;
        let out = run_ok(
            Command::new("ip").args(["-n", &ns, "-j", "link", "show", link]),
            "ip link show",
        )?;
        let v: Value = serde_json::from_slice(&out.stdout)?;
        v[0]["mtu"].as_u64().context("link without MTU")
    }

    /// Where a path's traffic goes, and the namespace that serves it.
    fn target(&self, path: PathKind) -> anyhow::Result<(IpAddr, String)> {
        let node2 = self.node("node2")?;
        match path {
            PathKind::Underlay => {
                let ns = self.status["discovery"]["namespace"]
                    .as_str()
                    .context("lab without discovery namespace")?
                    .to_owned();
                Ok((global_ipv6(&ns)?, ns))
            }
            PathKind::MeshUnmarked => {
                let ula = node2["addresses"]["kubespan"]
                    .as_str()
                    .and_then(|a| a.split('/').next())
                    .context("node2 without KubeSpan address")?;
                Ok((ula.parse()?, self.namespace("node2")?))
            }
            PathKind::MeshNftables | PathKind::MeshEbpf => {
                let v6 = node2["addresses"]["underlay"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .find(|a| a.contains(':'))
                    .context("node2 without an IPv6 node address")?;
                Ok((v6.parse()?, self.namespace("node2")?))
            }
        }
    }
}

/// The first global IPv6 address in namespace `ns`.
fn global_ipv6(ns: &str) -> anyhow::Result<IpAddr> {
    let out = run_ok(
        Command::new("ip").args(["-n", ns, "-j", "-6", "addr", "show", "scope", "global"]),
        "ip addr show",
    )?;
    let v: Value = serde_json::from_slice(&out.stdout)?;
    v.as_array()
        .into_iter()
        .flatten()
        .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
        .find_map(|a| a["local"].as_str().and_then(|s| s.parse().ok()))
        .with_context(|| format!("no global IPv6 address in {ns}"))
}

/// An iperf3 server in a namespace, killed on drop.
struct Server(Child);

impl Server {
    fn start(ns: &str) -> anyhow::Result<Self> {
        let child = Command::new("ip")
            .args(["netns", "exec", ns, "iperf3", "-s", "--one-off"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting iperf3 -s (is iperf3 installed? scripts/setup.sh installs it)")?;
        Ok(Self(child))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What one iperf3 run sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    /// UDP at unlimited rate (else TCP).
    udp: bool,
    /// Parallel streams (TCP).
    streams: u32,
    /// The server sends (`iperf3 -R`).
    reverse: bool,
}

impl Run {
    const TCP: Run = Run {
        udp: false,
        streams: 1,
        reverse: false,
    };
    const TCP4: Run = Run {
        udp: false,
        streams: 4,
        reverse: false,
    };
    const UDP: Run = Run {
        udp: true,
        streams: 1,
        reverse: false,
    };
}

/// One iperf3 run from node1 to `target` served in `server_ns`.
fn measure(
    client_ns: &str,
    target: IpAddr,
    server_ns: &str,
    run: Run,
    seconds: u64,
) -> anyhow::Result<Sample> {
    let _server = Server::start(server_ns)?;
    let secs = seconds.to_string();
    let addr = target.to_string();
    let streams = run.streams.to_string();
    let mut args = vec![
        "netns", "exec", client_ns, "iperf3", "-J", "-c", &addr, "-t", &secs, "-P", &streams,
    ];
    let udp = run.udp;
    if udp {
        // Unlimited rate; datagrams that fit the mesh link without fragmenting.
        args.extend(["-u", "-b", "0", "-l", "1280"]);
    }
    if run.reverse {
        args.push("-R");
    }
    // The server needs a moment to listen: retry a refused connection.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = Command::new("ip")
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .context("running iperf3 -c")?;
        let text = String::from_utf8_lossy(&out.stdout);
        match parse_iperf(&text, udp) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() < deadline && e.to_string().contains("connect") => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(e.context(format!("iperf3 to {addr}"))),
        }
    }
}

/// The samples of one path: TCP and UDP.
#[derive(Debug, Default, Clone)]
struct PathSamples {
    tcp: Vec<Sample>,
    udp: Vec<Sample>,
    mtu: u64,
}

/// Runs the benchmark.
///
/// # Errors
/// Not root, iperf3 missing, a lab that does not come up, or a run whose traffic did
/// not take the path it measures.
pub fn run(args: &Args) -> anyhow::Result<()> {
    quick_notice(args.quick);
    let started = Instant::now();
    let exe = match &args.exe {
        Some(e) => e.clone(),
        None => std::env::current_exe().context("locating this executable")?,
    };
    let seconds = args.seconds.unwrap_or(if args.quick { 1 } else { 5 });
    let rounds = args.rounds.unwrap_or(if args.quick { 1 } else { 3 });
    let backends: Vec<String> = if args.wireguard.is_empty() {
        let mut b = vec!["userspace".to_owned(), "userspace-go".to_owned()];
        if wirespan_dataplane::wireguard::kernel::supported_on_host() {
            b.insert(0, "kernel".to_owned());
        }
        b
    } else {
        args.wireguard.clone()
    };
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;

    let mut md = String::new();
    let _ = writeln!(
        md,
        "# wirespan bench throughput\n\n{} s per run, {rounds} round(s), paths alternating; \
         IPv6; iperf3 TCP (one stream, and four on the unmarked mesh) and UDP (unlimited \
         rate, 1,280-byte datagrams, received rate). Client, server and both WireGuard \
         devices share this machine's {} CPU(s). Load average at the start: {}.\n",
        seconds,
        std::thread::available_parallelism().map_or(0, std::num::NonZero::get),
        load_average(),
    );
    let mut groups: Vec<chart::BarGroup> = Vec::new();
    let mut sanity = Sanity::new("throughput");
    let mut missed = Vec::new();
    let mut summary = Vec::new();
    for (bi, backend) in backends.iter().enumerate() {
        let r = measure_backend(&exe, backend, bi, rounds, seconds, &mut sanity)?;
        let table = backend_table(&r.ran, &r.samples, args.quick, &mut missed);
        let cpu = cpu_table(&r);
        print!("{table}{cpu}");
        md.push_str(&table);
        md.push_str(&cpu);
        groups.push(chart_group(&r));
        summary.push(r);
    }
    let compared = comparison_table(&summary);
    print!("{compared}");
    md.push_str(&compared);
    let floods: Vec<_> = summary
        .iter()
        .map(|r| (r.ran.clone(), flood::FloodSummary::of(&r.flood)))
        .collect();
    let flooded = flood::table(&floods, args.quick, &mut missed);
    print!("{flooded}");
    md.push_str(&flooded);
    let pairs = mixed::pairs(&backends);
    if !pairs.is_empty() {
        let t = mixed::run(&exe, &pairs, rounds, seconds, &mut sanity)?;
        print!("{t}");
        md.push_str(&t);
    }
    let _ = writeln!(
        md,
        "Target: marking with the eBPF fast path costs < 2 % of the mesh's throughput \
         without marking (TCP, median)."
    );
    crate::write_targets(&mut md, &missed);
    let _ = writeln!(
        md,
        "\nTotal time: {:.1} s; load average at the end: {}.",
        started.elapsed().as_secs_f64(),
        load_average()
    );
    if !missed.is_empty() {
        println!("Targets missed: {}", missed.join("; "));
    }
    let report = args.out.join("report.md");
    std::fs::write(&report, &md).with_context(|| format!("writing {}", report.display()))?;
    let svg = args.out.join("chart.svg");
    std::fs::write(
        &svg,
        chart::svg(
            "Throughput between two lab nodes (TCP, Mbit/s, median; whiskers min..max)",
            &groups,
        ),
    )
    .with_context(|| format!("writing {}", svg.display()))?;
    println!("report: {}, chart: {}", report.display(), svg.display());
    sanity.into_result()?;
    Ok(())
}

/// `/proc/loadavg`'s three figures.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg").map_or_else(
        |_| "unknown".to_owned(),
        |s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
    )
}

/// CPU time spent over the runs of one kind, and the bytes they delivered.
#[derive(Debug, Default, Clone, Copy)]
struct CpuUse {
    /// Seconds of the userspace WireGuard processes of both nodes.
    device_s: f64,
    /// Non-idle seconds of the whole machine.
    machine_s: f64,
    bytes: u64,
}

impl CpuUse {
    fn add(&mut self, (device_s, machine_s): (f64, f64), bytes: u64) {
        self.device_s += device_s;
        self.machine_s += machine_s;
        self.bytes += bytes;
    }

    /// (device, machine) CPU seconds per GB delivered.
    fn per_gb(&self) -> (f64, f64) {
        let gb = self.bytes as f64 / 1e9;
        if gb > 0.0 {
            (self.device_s / gb, self.machine_s / gb)
        } else {
            (0.0, 0.0)
        }
    }
}

/// Everything measured for one WireGuard implementation.
#[derive(Debug, Clone)]
struct BackendRun {
    /// The implementation the nodes reported running.
    ran: String,
    samples: Vec<PathSamples>,
    /// TCP, 4 streams, on the unmarked mesh.
    tcp4: Vec<Sample>,
    /// CPU of the unmarked mesh's runs: TCP 1 stream, TCP 4 streams, UDP.
    cpu: [CpuUse; 3],
    /// TCP without and under the handshake floods.
    flood: flood::FloodRun,
}

/// The runs of one path: TCP and UDP everywhere; on the unmarked mesh also TCP with
/// four streams, each with its CPU time read (index into [`BackendRun::cpu`]).
fn runs_of(path: PathKind) -> &'static [(Run, usize)] {
    if path == PathKind::MeshUnmarked {
        &[(Run::TCP, 0), (Run::UDP, 2), (Run::TCP4, 1)]
    } else {
        &[(Run::TCP, 0), (Run::UDP, 2)]
    }
}

/// Measures every path on two labs (nftables and eBPF marking) running `backend`.
fn measure_backend(
    exe: &Path,
    backend: &str,
    bi: usize,
    rounds: usize,
    seconds: u64,
    sanity: &mut Sanity,
) -> anyhow::Result<BackendRun> {
    let pid = std::process::id();
    let nft = Lab::up_pair(exe, &format!("bt{pid}n{bi}"), "nftables", backend)?;
    let ebpf = Lab::up_pair(exe, &format!("bt{pid}e{bi}"), "ebpf", backend)?;
    let ran = nft.backend();
    let mut r = BackendRun {
        ran: ran.clone(),
        samples: vec![PathSamples::default(); PATHS.len()],
        tcp4: Vec::new(),
        cpu: [CpuUse::default(); 3],
        flood: flood::FloodRun::default(),
    };
    let per_round: usize = PATHS.iter().map(|p| runs_of(*p).len()).sum();
    let pb = bar(rounds * per_round, &format!("{ran} WireGuard"));
    for _ in 0..rounds {
        for (pi, &path) in PATHS.iter().enumerate() {
            let lab = if path == PathKind::MeshEbpf {
                &ebpf
            } else {
                &nft
            };
            let (target, server_ns) = lab.target(path)?;
            let client_ns = lab.namespace("node1")?;
            r.samples[pi].mtu = lab.mtu(if path.through_mesh() {
                "kubespan"
            } else {
                "eth0"
            })?;
            for &(run, kind) in runs_of(path) {
                let tx0 = lab.mesh_tx()?;
                let cpu0 = CpuTicks::now(lab);
                let s = measure(&client_ns, target, &server_ns, run, seconds)?;
                let cpu = CpuTicks::now(lab).seconds_since(cpu0);
                let tunnelled = lab.mesh_tx()?.saturating_sub(tx0);
                if judge_sample(sanity, &ran, path, run.udp, &s) {
                    check_path(path, run.udp, &s, tunnelled)?;
                }
                if path == PathKind::MeshUnmarked {
                    r.cpu[kind].add(cpu, s.delivered_bytes);
                }
                match kind {
                    0 => r.samples[pi].tcp.push(s),
                    1 => r.tcp4.push(s),
                    _ => r.samples[pi].udp.push(s),
                }
                pb.inc(1);
            }
        }
    }
    pb.finish_and_clear();
    r.flood = flood::measure_flood(&nft, &ran, rounds, seconds, sanity)?;
    Ok(r)
}

/// The chart's bars for one implementation: each path's TCP, and 4 streams.
fn chart_group(r: &BackendRun) -> chart::BarGroup {
    let bar = |label: &str, v: &[Sample]| {
        let (m, lo, hi) = spread(&v.iter().map(|x| x.mbps).collect::<Vec<_>>());
        (label.to_owned(), m, lo, hi)
    };
    let mut bars: Vec<chart::Bar> = PATHS
        .iter()
        .zip(&r.samples)
        .map(|(p, s)| bar(p.label(), &s.tcp))
        .collect();
    bars.insert(2, bar("mesh, no marking, 4 streams", &r.tcp4));
    (
        format!("{} WireGuard: TCP Mbit/s", implementation(&r.ran)),
        bars,
    )
}

/// How the report names an implementation.
fn implementation(backend: &str) -> String {
    match backend {
        "userspace" => "userspace (wirespan wireguard)".to_owned(),
        "userspace-go" => "userspace-go (wireguard-go)".to_owned(),
        other => other.to_owned(),
    }
}

/// The unmarked mesh's runs with their CPU time per GB.
fn cpu_table(r: &BackendRun) -> String {
    let med = |v: &[Sample], f: fn(&Sample) -> f64| spread(&v.iter().map(f).collect::<Vec<_>>()).0;
    let rows = [
        (
            "TCP, 1 stream",
            med(&r.samples[1].tcp, |s| s.mbps),
            None,
            r.cpu[0],
        ),
        ("TCP, 4 streams", med(&r.tcp4, |s| s.mbps), None, r.cpu[1]),
        (
            "UDP, unlimited rate",
            med(&r.samples[1].udp, |s| s.mbps),
            Some(med(&r.samples[1].udp, |s| s.lost_percent)),
            r.cpu[2],
        ),
    ];
    let mut t = String::new();
    let _ = writeln!(
        t,
        "Through the mesh, no marking, with CPU time per GB delivered (device: the userspace \
         WireGuard processes of both nodes, user + system, from /proc/PID/stat; 0 for kernel \
         WireGuard, which has no process. Machine: every CPU's non-idle time from /proc/stat, \
         which holds the kernel's share, iperf3, and any other load):\n"
    );
    let _ = writeln!(
        t,
        "| run | Mbit/s received (median) | UDP loss | device CPU s/GB | machine CPU s/GB |"
    );
    let _ = writeln!(t, "|---|---|---|---|---|");
    for (label, mbps, loss, cpu) in rows {
        let (dev, all) = cpu.per_gb();
        let loss = loss.map_or("—".to_owned(), |l| format!("{l:.1} %"));
        let _ = writeln!(t, "| {label} | {mbps:.0} | {loss} | {dev:.2} | {all:.2} |");
    }
    t.push('\n');
    t
}

/// One row per implementation: the unmarked mesh against the underlay.
fn comparison_table(runs: &[BackendRun]) -> String {
    let med = |v: &[Sample], f: fn(&Sample) -> f64| spread(&v.iter().map(f).collect::<Vec<_>>()).0;
    let mut t = String::new();
    let _ = writeln!(t, "\n## Implementations compared (mesh, no marking)\n");
    let _ = writeln!(
        t,
        "| implementation | TCP 1 stream Mbit/s | share of the underlay | TCP 4 streams Mbit/s | UDP Mbit/s received | UDP loss | device CPU s/GB (TCP 1) | machine CPU s/GB (TCP 1) |"
    );
    let _ = writeln!(t, "|---|---|---|---|---|---|---|---|");
    for r in runs {
        let ceiling = med(&r.samples[0].tcp, |s| s.mbps);
        let tcp = med(&r.samples[1].tcp, |s| s.mbps);
        let (dev, all) = r.cpu[0].per_gb();
        let _ = writeln!(
            t,
            "| {} | {tcp:.0} | {:.0} % of {ceiling:.0} | {:.0} | {:.0} | {:.1} % | {dev:.2} | {all:.2} |",
            implementation(&r.ran),
            if ceiling > 0.0 { tcp / ceiling * 100.0 } else { 0.0 },
            med(&r.tcp4, |s| s.mbps),
            med(&r.samples[1].udp, |s| s.mbps),
            med(&r.samples[1].udp, |s| s.lost_percent),
        );
    }
    t.push('\n');
    t
}

/// A run that delivered nothing is broken (the path, not the machine); returns
/// whether the sample delivered anything, so its path can be checked.
fn judge_sample(sanity: &mut Sanity, backend: &str, path: PathKind, udp: bool, s: &Sample) -> bool {
    let delivered = s.delivered_bytes > 0 && s.mbps > 0.0;
    sanity.require(delivered, || {
        format!(
            "{backend} WireGuard, {} {}: nothing reached the receiver",
            path.label(),
            if udp { "UDP" } else { "TCP" }
        )
    });
    delivered
}

/// A run's traffic must cross WireGuard exactly when its path says so: what reached
/// the receiver went through the tunnel (which adds headers), or none of it did.
fn check_path(path: PathKind, udp: bool, s: &Sample, tunnelled: u64) -> anyhow::Result<()> {
    let proto = if udp { "UDP" } else { "TCP" };
    let delivered = s.delivered_bytes as f64;
    if path.through_mesh() && (tunnelled as f64) < 0.9 * delivered {
        bail!(
            "{} {proto}: {} bytes delivered but only {tunnelled} sent through WireGuard: \
             the traffic did not take the mesh",
            path.label(),
            s.delivered_bytes
        );
    }
    if !path.through_mesh() && (tunnelled as f64) >= 0.05 * delivered {
        bail!(
            "{} {proto}: {tunnelled} bytes went through WireGuard for {} delivered",
            path.label(),
            s.delivered_bytes
        );
    }
    Ok(())
}

/// The table of one backend, judging the marking target.
fn backend_table(
    backend: &str,
    samples: &[PathSamples],
    quick: bool,
    missed: &mut Vec<String>,
) -> String {
    let med = |v: &[Sample], f: fn(&Sample) -> f64| spread(&v.iter().map(f).collect::<Vec<_>>());
    let tcp = |i: usize| med(&samples[i].tcp, |s| s.mbps).0;
    let ceiling = tcp(0);
    let unmarked = tcp(1);
    let mut t = String::new();
    let _ = writeln!(t, "\n## {} WireGuard\n", implementation(backend));
    let _ = writeln!(
        t,
        "| path | MTU | TCP MSS | TCP Mbit/s (median, min–max) | of ceiling | UDP Mbit/s received | UDP loss | vs mesh, no marking |"
    );
    let _ = writeln!(t, "|---|---|---|---|---|---|---|---|");
    for (i, (p, s)) in PATHS.iter().zip(samples).enumerate() {
        let (tm, tlo, thi) = med(&s.tcp, |x| x.mbps);
        let (um, _, _) = med(&s.udp, |x| x.mbps);
        let (loss, _, _) = med(&s.udp, |x| x.lost_percent);
        let mss = s.tcp.first().map_or(0, |x| x.mss);
        let vs = if i >= 1 && unmarked > 0.0 {
            format!("{:+.1} %", (tm / unmarked - 1.0) * 100.0)
        } else {
            "—".to_owned()
        };
        let _ = writeln!(
            t,
            "| {} | {} | {mss} | {tm:.0} ({tlo:.0}–{thi:.0}) | {:.0} % | {um:.0} | {loss:.1} % | {vs} |",
            p.label(),
            s.mtu,
            if ceiling > 0.0 { tm / ceiling * 100.0 } else { 0.0 },
        );
    }
    let _ = writeln!(
        t,
        "\nThrough the mesh (no marking, TCP, one stream): {unmarked:.0} Mbit/s, {:.0} % of \
         the underlay's {ceiling:.0} Mbit/s.",
        if ceiling > 0.0 {
            unmarked / ceiling * 100.0
        } else {
            0.0
        }
    );
    let ebpf = tcp(3);
    let cost = if unmarked > 0.0 {
        (1.0 - ebpf / unmarked) * 100.0
    } else {
        0.0
    };
    let verdict = match (quick, cost < 2.0) {
        (true, _) => "not judged (--quick)",
        (false, true) => "met",
        (false, false) => "missed",
    };
    let _ = writeln!(
        t,
        "eBPF marking costs {cost:.1} % of the unmarked mesh throughput (target < 2 %): {verdict}.\n"
    );
    if !quick && cost >= 2.0 {
        missed.push(format!(
            "{backend}: eBPF marking costs {cost:.1} % (target < 2 %)"
        ));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iperf_reports_parse_for_tcp_and_udp_and_errors_are_named() {
        let tcp = r#"{"start":{"tcp_mss_default":1348},"end":{"sum_sent":{"bytes":1000,"bits_per_second":9e8},"sum_received":{"bits_per_second":8e8}}}"#;
        let s = parse_iperf(tcp, false).unwrap();
        assert!((s.mbps - 800.0).abs() < 1e-9);
        assert_eq!((s.delivered_bytes, s.mss), (1000, 1348));
        let udp = r#"{"end":{"sum":{"bytes":500,"bits_per_second":1e9,"lost_percent":25.0}}}"#;
        let s = parse_iperf(udp, true).unwrap();
        assert!((s.mbps - 750.0).abs() < 1e-9);
        assert_eq!(s.delivered_bytes, 375);
        let udp = r#"{"end":{"sum":{"bytes":500,"bits_per_second":1e9,"lost_percent":10.0},"sum_received":{"bytes":300,"bits_per_second":6e8}}}"#;
        let s = parse_iperf(udp, true).unwrap();
        assert!((s.mbps - 600.0).abs() < 1e-9);
        assert_eq!((s.delivered_bytes, s.lost_percent), (300, 10.0));
        let err = parse_iperf(r#"{"error":"unable to connect to server"}"#, false).unwrap_err();
        assert!(err.to_string().contains("connect"), "{err}");
        assert!(parse_iperf("", false).is_err());
    }

    #[test]
    fn a_run_that_missed_its_path_is_refused() {
        let s = Sample {
            mbps: 1.0,
            delivered_bytes: 1_000_000,
            lost_percent: 0.0,
            mss: 0,
        };
        assert!(check_path(PathKind::MeshEbpf, false, &s, 1_100_000).is_ok());
        assert!(check_path(PathKind::MeshEbpf, false, &s, 1_000).is_err());
        assert!(check_path(PathKind::Underlay, false, &s, 1_000).is_ok());
        assert!(check_path(PathKind::Underlay, false, &s, 1_100_000).is_err());
    }

    #[test]
    fn a_run_that_delivered_nothing_is_broken_a_slow_one_is_not() {
        let at = |delivered_bytes: u64, mbps: f64| Sample {
            mbps,
            delivered_bytes,
            lost_percent: 99.0,
            mss: 0,
        };
        let mut s = Sanity::new("throughput");
        assert!(judge_sample(
            &mut s,
            "userspace",
            PathKind::MeshEbpf,
            true,
            &at(1_280, 0.01)
        ));
        assert!(s.problems().is_empty());
        assert!(!judge_sample(
            &mut s,
            "kernel",
            PathKind::Underlay,
            false,
            &at(0, 0.0)
        ));
        assert_eq!(s.problems().len(), 1);
        assert!(
            s.problems()[0].starts_with("kernel WireGuard"),
            "{:?}",
            s.problems()
        );
        assert!(s.problems()[0].ends_with("TCP: nothing reached the receiver"));
    }

    #[test]
    fn the_marking_target_is_judged_against_the_unmarked_mesh() {
        let at = |mbps: f64| Sample {
            mbps,
            delivered_bytes: 0,
            lost_percent: 0.0,
            mss: 0,
        };
        let paths = |ebpf: f64| {
            [1000.0, 500.0, 480.0, ebpf]
                .iter()
                .map(|&m| PathSamples {
                    tcp: vec![at(m)],
                    udp: vec![at(m)],
                    mtu: 1420,
                })
                .collect::<Vec<_>>()
        };
        let mut missed = Vec::new();
        let t = backend_table("userspace", &paths(495.0), false, &mut missed);
        assert!(missed.is_empty(), "{t}");
        assert!(
            t.contains("500 Mbit/s, 50 % of the underlay's 1000 Mbit/s"),
            "{t}"
        );
        backend_table("userspace", &paths(450.0), true, &mut missed);
        assert!(missed.is_empty(), "a --quick run judges nothing");
        backend_table("userspace", &paths(450.0), false, &mut missed);
        assert_eq!(missed.len(), 1);
    }
}
