//! The report: the micro and macro tables with their targets judged, the apply-cost
//! section, and the SVG chart of forwarding overheads.

use std::{fmt::Write as _, time::Instant};

use super::{
    apply::{apply_cost_report, ApplyRow},
    forwarding::{overheads, Config, MacroRow, MACRO_SIZES},
    median_f,
    micro::Micro,
    Args,
};

pub(super) use crate::chart::BarGroup;

/// The Markdown report of a whole run and the chart's bar groups.
pub(super) fn render(
    args: &Args,
    started: Instant,
    micro: &[Micro],
    macro_rows: &[MacroRow],
    apply_rows: &[ApplyRow],
) -> (String, Vec<BarGroup>) {
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
    for m in micro {
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
            .map(|r| median_f(&mut overheads(macro_rows, r)));
        let mut group = Vec::new();
        for row in macro_rows.iter().filter(|r| r.size == n) {
            let per = median_f(&mut row.per_packet.clone());
            let mut ov = overheads(macro_rows, row);
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
    crate::write_targets(&mut md, &missed);
    let _ = writeln!(md);
    apply_cost_report(&mut md, apply_rows);
    let _ = writeln!(md, "Total time: {:.1} s.", started.elapsed().as_secs_f64());
    (md, chart)
}
