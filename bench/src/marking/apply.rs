//! Apply cost: what one routed-set change costs each adapter, as a full-spec apply
//! and as a one-prefix delta, at growing peer counts; and its section of the report.

use std::{
    fmt::Write as _,
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use anyhow::Context;
use wirespan_dataplane::{
    fastpath::{
        sync::{MapState, Structures},
        Programs,
    },
    ipnet::IpNet,
    marking::{Marking, MarkingSpec, NftMarking, PrefixDelta, SetLayout},
    netns::NetnsGuard,
};

use super::Args;
use crate::bar;

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
pub(super) struct ApplyRow {
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

/// The apply-cost rows of every peer count and adapter.
pub(super) fn apply_cost(args: &Args) -> anyhow::Result<Vec<ApplyRow>> {
    let (fulls, deltas) = if args.quick { (5, 20) } else { (40, 400) };
    let mut out = Vec::new();
    let pb = bar(APPLY_PEERS.len() * 2, "apply cost (full vs delta)");
    for &peers in &APPLY_PEERS {
        let spec = MarkingSpec {
            prefixes_v4: (0..peers).flat_map(peer_prefixes).collect(),
            ..MarkingSpec::default()
        };
        // Both nftables layouts in the same run: the one-interval-set-per-family
        // commit walks the whole set, the per-length hash sets do not.
        for (layout, adapter) in [
            (SetLayout::Split, "nftables (hash + interval sets)"),
            (SetLayout::PerLength, "nftables (per-length hash sets)"),
        ] {
            let spec = MarkingSpec {
                layout,
                ..spec.clone()
            };
            let ns = NetnsGuard::new("wsbapply")?;
            let mut nft = NftMarking::new(ns.netns().clone());
            nft.apply(&spec)?;
            let (full, delta) = time_changes(&mut nft, &spec, fulls, deltas)?;
            out.push(ApplyRow {
                peers,
                adapter,
                full,
                delta,
            });
        }
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
pub(super) fn apply_cost_report(md: &mut String, rows: &[ApplyRow]) {
    let us = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1e6);
    let _ = writeln!(
        md,
        "## Apply cost: one peer's prefix changed, full spec vs one-prefix delta (µs, wall time)\n"
    );
    let _ = writeln!(
        md,
        "Peers of 2 prefixes each (a /32 host and a /24, IPv4). Full: `apply` of the whole spec with one /24 changed (the incremental full path: lists compared position by position). Delta: `apply_delta` of one prefix out and one in, a host (nftables: a hash set) or a /24 (nftables: the interval set, or the /24 hash set in the per-length layout). Median / p90.\n"
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
