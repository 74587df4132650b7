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
//!
//! Files: `micro`, `router` (the macro topology), `forwarding` (macro), `apply`
//! (apply cost), `report` (tables and chart); this file holds the options, the
//! routed set and probes they share, and the run.

mod apply;
mod forwarding;
mod micro;
mod report;
mod router;

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::PathBuf,
    time::Instant,
};

use anyhow::Context;
use wirespan_dataplane::{fastpath::testrun, ipnet::IpNet, marking::MarkingSpec};

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Probe {
    Host,
    Cidr,
    Miss,
}

impl Probe {
    pub(super) fn name(self) -> &'static str {
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
pub(super) fn routed_set(n: usize) -> MarkingSpec {
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
pub(super) fn probe_dst(n: usize, v6: bool, probe: Probe) -> Option<IpAddr> {
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

pub(super) fn frame_to(dst: IpAddr, dst_mac: [u8; 6], src_mac: [u8; 6]) -> Vec<u8> {
    let src: IpAddr = match dst {
        IpAddr::V4(_) => Ipv4Addr::new(10, 1, 0, 2).into(),
        IpAddr::V6(_) => "fd01::2".parse::<Ipv6Addr>().map_or(dst, IpAddr::V6),
    };
    testrun::udp_frame(dst_mac, src_mac, src, dst, 18)
}

pub(super) fn median_f(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n.is_multiple_of(2) {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    } else {
        v[n / 2]
    }
}

/// Runs the benchmark and writes its report.
///
/// # Errors
/// Not root, no BPF support, a missing tool (`ip`, `nft`), or an output folder that
/// cannot be written.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let started = Instant::now();
    let apply_rows = apply::apply_cost(args)?;
    if args.apply_only {
        let mut md = String::new();
        apply::apply_cost_report(&mut md, &apply_rows);
        println!("{md}");
        return Ok(());
    }
    let micro = micro::micro(args)?;
    let macro_rows = forwarding::macro_bench(args)?;
    let (md, chart) = report::render(args, started, &micro, &macro_rows, &apply_rows);

    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let report = args.out.join("report.md");
    std::fs::write(&report, &md).with_context(|| format!("writing {}", report.display()))?;
    let svg = args.out.join("chart.svg");
    std::fs::write(&svg, crate::chart::svg(
        "Forwarding overhead of marking against no marking (ns/packet, median; whiskers min..max)",
        &chart,
    ))
        .with_context(|| format!("writing {}", svg.display()))?;
    println!("{md}");
    println!("report: {}  chart: {}", report.display(), svg.display());
    let mut sanity = crate::sanity::Sanity::new("marking");
    forwarding::judge(&mut sanity, &macro_rows);
    sanity.into_result()?;
    Ok(())
}
