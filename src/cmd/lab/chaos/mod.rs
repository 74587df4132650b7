//! `wirespan lab chaos`: faults at random (seeded) on a running lab, each followed by
//! a wait for recovery and a check of what must hold; a report at the end.
//!
//! `schedule` and `invariants` are plain functions (the fault sequence of a seed, the
//! checks over what was read); `inject` does the I/O; this module runs the loop and
//! builds the report.

mod inject;
mod invariants;
mod schedule;

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use serde::Serialize;

use self::{
    inject::ChaosLab,
    invariants::percentile,
    schedule::{Fault, FaultKind, Schedule},
};
use super::plan::LabName;

/// Options of `chaos`.
#[derive(Debug)]
pub struct Options {
    /// No new fault starts after this long, counted from the first fault, once
    /// `min_faults` have run.
    pub duration: Duration,
    /// The fewest faults a run injects, however long they take (a skipped fault, one
    /// that does not apply to the lab, does not count).
    pub min_faults: usize,
    /// Seed of the fault schedule.
    pub seed: u64,
    /// The node count the run expects (checked against the lab).
    pub nodes: Option<usize>,
    /// How long the lab may take to recover from one fault.
    pub recovery_timeout: Duration,
    /// Most resident memory a daemon may use.
    pub rss_limit: u64,
    /// Print the report as JSON.
    pub json: bool,
}

/// Whether another fault starts, `elapsed` after the first one with `ran` faults
/// applied: while within the duration, and past it until `min_faults` have been.
fn another_fault(elapsed: Duration, ran: usize, opts: &Options) -> bool {
    elapsed < opts.duration || ran < opts.min_faults
}

/// One fault as it happened.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FaultRecord {
    pub seq: usize,
    pub kind: FaultKind,
    /// The node it hit (none for the discovery server).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    pub hold_ms: u64,
    /// From undoing the fault to every invariant holding; none when it did not
    /// recover in time or was skipped.
    pub recovery_ms: Option<u64>,
    /// What was still wrong at the last check before recovery (what took longest).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waited_for: Option<String>,
    /// Why the fault did not apply to this lab.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

/// Recovery figures of one kind.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KindStats {
    pub kind: FaultKind,
    pub count: usize,
    pub recovered: usize,
    pub p50_ms: Option<u64>,
    pub p99_ms: Option<u64>,
    pub max_ms: Option<u64>,
}

/// Something that must not happen, after the fault that preceded it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Violation {
    /// Number of the preceding fault (0: before any fault).
    pub after_fault: usize,
    /// That fault, as `kind node`.
    pub fault: String,
    pub problem: String,
}

/// The report of a run.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub lab: String,
    pub seed: u64,
    pub nodes: usize,
    pub elapsed_ms: u64,
    pub replay: String,
    pub kinds: Vec<KindStats>,
    pub faults: Vec<FaultRecord>,
    pub violations: Vec<Violation>,
    /// Highest resident memory seen per daemon, and the limit.
    pub max_rss_bytes: BTreeMap<String, u64>,
    pub rss_limit_bytes: u64,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Per kind (every kind, in order): how many faults, how many recovered, and the
/// recovery time percentiles of those that did.
#[must_use]
pub fn kind_stats(faults: &[FaultRecord]) -> Vec<KindStats> {
    FaultKind::ALL
        .iter()
        .map(|&kind| {
            let of_kind: Vec<&FaultRecord> = faults
                .iter()
                .filter(|f| f.kind == kind && f.skipped.is_none())
                .collect();
            let mut times: Vec<Duration> = of_kind
                .iter()
                .filter_map(|f| f.recovery_ms.map(Duration::from_millis))
                .collect();
            times.sort();
            KindStats {
                kind,
                count: of_kind.len(),
                recovered: times.len(),
                p50_ms: percentile(&times, 50.0).map(ms),
                p99_ms: percentile(&times, 99.0).map(ms),
                max_ms: times.last().copied().map(ms),
            }
        })
        .collect()
}

/// The report as text.
#[must_use]
pub fn render(r: &Report) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "chaos on lab {} ({} nodes), seed {}: {} faults in {:.1}s",
        r.lab,
        r.nodes,
        r.seed,
        r.faults.len(),
        Duration::from_millis(r.elapsed_ms).as_secs_f64()
    );
    let _ = writeln!(
        s,
        "{:<18} {:>6} {:>9} {:>9} {:>9} {:>9}",
        "KIND", "FAULTS", "RECOVERED", "P50", "P99", "MAX"
    );
    let t = |v: Option<u64>| v.map_or("-".to_owned(), |m| format!("{:.2}s", m as f64 / 1000.0));
    for k in &r.kinds {
        let _ = writeln!(
            s,
            "{:<18} {:>6} {:>9} {:>9} {:>9} {:>9}",
            k.kind.name(),
            k.count,
            k.recovered,
            t(k.p50_ms),
            t(k.p99_ms),
            t(k.max_ms)
        );
    }
    let skipped = r.faults.iter().filter(|f| f.skipped.is_some()).count();
    if skipped > 0 {
        let _ = writeln!(s, "skipped (not applicable to this lab): {skipped}");
    }
    let rss: Vec<String> = r
        .max_rss_bytes
        .iter()
        .map(|(n, b)| format!("{n} {} MiB", b >> 20))
        .collect();
    let _ = writeln!(
        s,
        "max resident memory (limit {} MiB): {}",
        r.rss_limit_bytes >> 20,
        rss.join(", ")
    );
    let _ = writeln!(s, "violations: {}", r.violations.len());
    for v in &r.violations {
        let _ = writeln!(s, "  after #{} {}: {}", v.after_fault, v.fault, v.problem);
    }
    let _ = writeln!(s, "replay: {}", r.replay);
    s
}

fn describe(lab: &ChaosLab, f: &Fault) -> String {
    if f.kind.has_node() {
        format!("{} {}", f.kind.name(), lab.state.nodes[f.node].name)
    } else {
        f.kind.name().to_owned()
    }
}

/// Polls until every recovery invariant holds or `timeout` passes; the time it took
/// and the first problem of the last failed check, or the problems left at the
/// deadline.
fn wait_recovered(
    lab: &mut ChaosLab,
    timeout: Duration,
) -> Result<(Duration, Option<String>), Vec<String>> {
    let start = Instant::now();
    let mut last = None;
    loop {
        let problems = lab.transient_problems();
        if problems.is_empty() {
            return Ok((start.elapsed(), last));
        }
        last = problems.first().cloned();
        if start.elapsed() >= timeout {
            return Err(problems);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub fn run(name: &LabName, opts: &Options) -> anyhow::Result<()> {
    let mut lab = ChaosLab::open(name)?;
    // Its faults and checks address nodes on the underlay and expect every pair up.
    anyhow::ensure!(
        lab.state.nodes.iter().all(|n| n.router.is_none()) && lab.state.blocked.is_empty(),
        "lab {name} has nodes behind NAT or blocked pairs; chaos runs on a `flat` lab"
    );
    let nodes = lab.state.nodes.len();
    if let Some(want) = opts.nodes {
        anyhow::ensure!(
            want == nodes,
            "--nodes {want}: lab {name} has {nodes} nodes (create it with \
             `wirespan lab up --name {name} --nodes {want}`)"
        );
    }
    let mut violations = Vec::new();
    let mut max_rss: BTreeMap<String, u64> = BTreeMap::new();
    // The lab must be healthy before the first fault, or nothing can be blamed on one.
    lab.record_baseline()?;
    if let Err(problems) = wait_recovered(&mut lab, opts.recovery_timeout) {
        anyhow::bail!(
            "lab {name} is not healthy before any fault:\n  {}",
            problems.join("\n  ")
        );
    }
    let mut faults = Vec::new();
    eprintln!(
        "chaos on lab {name} ({nodes} nodes), seed {}, for {}{}",
        opts.seed,
        humantime::format_duration(opts.duration),
        if opts.min_faults > 0 {
            format!(" and at least {} faults", opts.min_faults)
        } else {
            String::new()
        }
    );
    // The clock starts at the first fault: the baseline wait above is not chaos.
    let started = Instant::now();
    for fault in Schedule::new(opts.seed, nodes) {
        let applied = faults
            .iter()
            .filter(|f: &&FaultRecord| f.skipped.is_none())
            .count();
        if !another_fault(started.elapsed(), applied, opts) {
            break;
        }
        let what = describe(&lab, &fault);
        let at = started.elapsed();
        let mut record = FaultRecord {
            seq: fault.seq,
            kind: fault.kind,
            node: fault
                .kind
                .has_node()
                .then(|| lab.state.nodes[fault.node].name.clone()),
            hold_ms: ms(fault.hold),
            recovery_ms: None,
            waited_for: None,
            skipped: None,
        };
        let violation = |problem: String| Violation {
            after_fault: fault.seq,
            fault: what.clone(),
            problem,
        };
        let line = match lab.inject(&fault) {
            Ok(Some(reason)) => {
                record.skipped = Some(reason.clone());
                format!("skipped: {reason}")
            }
            result => {
                if let Err(e) = result {
                    violations.push(violation(format!("the fault went wrong: {e:#}")));
                }
                match wait_recovered(&mut lab, opts.recovery_timeout) {
                    Ok((t, waited_for)) => {
                        record.recovery_ms = Some(ms(t));
                        let line = format!(
                            "recovered in {:.2}s{}",
                            t.as_secs_f64(),
                            waited_for
                                .as_ref()
                                .map(|w| format!(" (last waited for: {w})"))
                                .unwrap_or_default()
                        );
                        record.waited_for = waited_for;
                        line
                    }
                    Err(problems) => {
                        let n = problems.len();
                        violations.extend(problems.into_iter().map(&violation));
                        format!(
                            "NOT recovered after {}: {n} problems",
                            humantime::format_duration(opts.recovery_timeout)
                        )
                    }
                }
            }
        };
        let (lasting, rss) = lab.lasting_problems(opts.rss_limit);
        violations.extend(lasting.into_iter().map(&violation));
        for (n, b) in rss {
            let m = max_rss.entry(n).or_default();
            *m = (*m).max(b);
        }
        eprintln!(
            "[{:>6.1}s] #{:<3} {:<28} hold {:>5}ms  {line}",
            at.as_secs_f64(),
            fault.seq,
            what,
            ms(fault.hold)
        );
        faults.push(record);
    }
    let report = Report {
        lab: name.to_string(),
        seed: opts.seed,
        nodes,
        elapsed_ms: ms(started.elapsed()),
        replay: format!(
            "wirespan lab chaos --name {name} --seed {} --duration {}{} (on a fresh `lab up --nodes {nodes}`)",
            opts.seed,
            humantime::format_duration(opts.duration),
            if opts.min_faults > 0 {
                format!(" --min-faults {}", opts.min_faults)
            } else {
                String::new()
            }
        ),
        kinds: kind_stats(&faults),
        faults,
        violations,
        max_rss_bytes: max_rss,
        rss_limit_bytes: opts.rss_limit,
    };
    if opts.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    if !report.violations.is_empty() {
        anyhow::bail!(
            "{} violations (see the report); replay: {}",
            report.violations.len(),
            report.replay
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_start_within_the_duration_and_past_it_until_the_minimum_ran() {
        let opts = |min_faults| Options {
            duration: Duration::from_secs(60),
            min_faults,
            seed: 1,
            nodes: None,
            recovery_timeout: Duration::from_secs(60),
            rss_limit: 0,
            json: false,
        };
        let s = Duration::from_secs;
        assert!(another_fault(s(59), 1, &opts(0)));
        assert!(!another_fault(s(60), 1, &opts(0)));
        // A slow machine: one fault took the whole minute.
        assert!(another_fault(s(90), 1, &opts(4)));
        assert!(another_fault(s(200), 3, &opts(4)));
        assert!(!another_fault(s(200), 4, &opts(4)));
        // The minimum does not cut a run short.
        assert!(another_fault(s(30), 9, &opts(4)));
    }

    fn rec(seq: usize, kind: FaultKind, recovery_ms: Option<u64>) -> FaultRecord {
        FaultRecord {
            seq,
            kind,
            node: None,
            hold_ms: 0,
            recovery_ms,
            waited_for: None,
            skipped: None,
        }
    }

    #[test]
    fn stats_per_kind_count_every_fault_and_time_only_the_recovered() {
        let mut faults: Vec<FaultRecord> = (1..=100)
            .map(|i| rec(i, FaultKind::LinkFlap, Some(i as u64 * 10)))
            .collect();
        faults.push(rec(101, FaultKind::Blackhole, None));
        let mut skipped = rec(102, FaultKind::KillWireguard, None);
        skipped.skipped = Some("kernel WireGuard".into());
        faults.push(skipped);
        let stats = kind_stats(&faults);
        assert_eq!(stats.len(), FaultKind::ALL.len());
        let flap = stats
            .iter()
            .find(|s| s.kind == FaultKind::LinkFlap)
            .unwrap();
        assert_eq!(
            (
                flap.count,
                flap.recovered,
                flap.p50_ms,
                flap.p99_ms,
                flap.max_ms
            ),
            (100, 100, Some(500), Some(990), Some(1000))
        );
        let bh = stats
            .iter()
            .find(|s| s.kind == FaultKind::Blackhole)
            .unwrap();
        assert_eq!((bh.count, bh.recovered, bh.max_ms), (1, 0, None));
        let wg = stats
            .iter()
            .find(|s| s.kind == FaultKind::KillWireguard)
            .unwrap();
        assert_eq!(wg.count, 0);
    }
}
