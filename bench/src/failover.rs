//! `wirespan bench failover`: how long a pair of nodes is cut off when its direct path
//! dies, and how long it takes to come back to direct once the path heals.
//!
//! Real labs (`wirespan lab up` with this binary). The direct path is killed by
//! dropping UDP between the two nodes' underlay addresses on the lab's bridge (their
//! TCP to the discovery server passes), and healed by removing that rule. Failover is
//! the time from the cut until a ping from one node reaches the other's KubeSpan
//! address again (one ping a second, each waiting up to a second), and the path the
//! pair then reports is checked:
//!
//! - **peer relay**: three nodes; node3 reaches both, so the pair goes through it.
//!   Back to direct is the time from the repair until both ends report `direct`.
//!   Run twice: at the default `peerReceiveTimeout` (20 s) and at its minimum (6 s).
//! - **server relay**: two nodes, nobody to relay; the pair goes through the lab
//!   discovery server's relay. A pair on the server relay tries its direct path again
//!   only when a node publishes new endpoints (kubespan.md §8.8), so each trial runs
//!   on a fresh lab and back to direct is not measured.
//!
//! Talos KubeSpan is the comparison: it has no relay, and it notices a dead path only
//! after `peerDownInterval` (275 s); the pair stays down until the path heals.
//!
//! Output: a table on stdout and `report.md` in `--out`.

use std::{
    fmt::Write as _,
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _};

use crate::{
    bar,
    lab::{run_ok, Lab},
    quick_notice, write_targets,
};

/// Options of `wirespan bench failover`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Short run: one trial of each kind.
    #[arg(long)]
    pub quick: bool,
    /// Trials of each kind; default 20, 1 with --quick.
    #[arg(long)]
    pub trials: Option<usize>,
    /// Folder for report.md.
    #[arg(long, default_value = "bench-failover")]
    pub out: PathBuf,
    /// The wirespan binary that runs the labs (default: this one).
    #[arg(long, hide = true)]
    pub exe: Option<PathBuf>,
}

/// Upstream's only failure rule: a peer is down 275 s after its last handshake.
const UPSTREAM_DOWN: Duration = Duration::from_secs(275);
/// Target: traffic flows again within this of the cut, at the default window.
const TARGET_FAILOVER: Duration = Duration::from_secs(30);
/// The smallest `peerReceiveTimeout` a node accepts.
const MIN_WINDOW: Duration = Duration::from_secs(6);
/// Target: traffic flows again within this of the cut, at the minimum window.
const TARGET_FAILOVER_MIN_WINDOW: Duration = Duration::from_secs(10);
/// Longest a failover or a return may take before the trial fails.
const TRIAL_LIMIT: Duration = Duration::from_secs(120);

/// The nft table that cuts the pair.
const CUT_TABLE: &str = "wirespan_bench_cut";

/// Nearest-rank percentile of sorted seconds.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// p50, p99 and max of `samples`, in seconds.
fn summary(samples: &[Duration]) -> (f64, f64, f64) {
    let mut s: Vec<f64> = samples.iter().map(Duration::as_secs_f64).collect();
    s.sort_by(f64::total_cmp);
    (
        percentile(&s, 50.0),
        percentile(&s, 99.0),
        s.last().copied().unwrap_or(f64::NAN),
    )
}

impl Lab {
    fn underlay(&self, node: &str) -> anyhow::Result<Vec<String>> {
        Ok(self.node(node)?["addresses"]["underlay"]
            .as_array()
            .context("node without underlay addresses")?
            .iter()
            .filter_map(|a| a.as_str().map(str::to_owned))
            .collect())
    }

    fn kubespan_address(&self, node: &str) -> anyhow::Result<String> {
        Ok(self.node(node)?["addresses"]["kubespan"]
            .as_str()
            .and_then(|a| a.split('/').next())
            .context("node without a KubeSpan address")?
            .to_owned())
    }

    fn nft(&self, script: &str) -> anyhow::Result<()> {
        use std::io::Write as _;
        let ns = self.status["underlayNamespace"]
            .as_str()
            .context("lab without underlay namespace")?;
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns, "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("running nft")?;
        child
            .stdin
            .take()
            .context("nft stdin")?
            .write_all(script.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!("nft -f: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(())
    }

    /// Drops UDP between `a`'s and `b`'s underlay addresses on the lab's bridge.
    fn cut(&self, a: &str, b: &str) -> anyhow::Result<()> {
        let (ua, ub) = (self.underlay(a)?, self.underlay(b)?);
        let mut rules = String::new();
        for (x, y) in [(&ua, &ub), (&ub, &ua)] {
            for s in x {
                for d in y.iter().filter(|d| d.contains(':') == s.contains(':')) {
                    let fam = if s.contains(':') { "ip6" } else { "ip" };
                    let _ = writeln!(
                        rules,
                        "    {fam} saddr {s} {fam} daddr {d} meta l4proto udp drop"
                    );
                }
            }
        }
        self.nft(&format!(
            "table bridge {CUT_TABLE} {{\n  chain forward {{\n    type filter hook forward priority filter; policy accept;\n{rules}  }}\n}}\n"
        ))
    }

    fn heal(&self) -> anyhow::Result<()> {
        self.nft(&format!("delete table bridge {CUT_TABLE}\n"))
    }

    /// One echo from `from` to `to`'s KubeSpan address, waiting up to a second.
    fn ping(&self, from: &str, to_addr: &str) -> anyhow::Result<bool> {
        let ns = self.namespace(from)?;
        Ok(Command::new("ip")
            .args([
                "netns", "exec", &ns, "ping", "-n", "-q", "-c", "1", "-W", "1", to_addr,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .context("running ping")?
            .success())
    }

    /// (path, via) `from` reports for `to`, from a fresh status.
    fn path(&mut self, from: &str, to: &str) -> anyhow::Result<(String, String)> {
        self.refresh()?;
        let peer = self.node(from)?["peers"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["node"] == to)
            .with_context(|| format!("{from} has no peer {to}"))?;
        let s = |k: &str| peer[k].as_str().unwrap_or_default().to_owned();
        Ok((s("path"), s("via")))
    }

    /// Time from `since` until a ping from `a` reaches `b`.
    fn until_ping(&self, a: &str, b: &str, since: Instant) -> anyhow::Result<Duration> {
        let addr = self.kubespan_address(b)?;
        loop {
            let tried = Instant::now();
            if self.ping(a, &addr)? {
                return Ok(since.elapsed());
            }
            if since.elapsed() > TRIAL_LIMIT {
                bail!("{a} could not reach {b} within {TRIAL_LIMIT:?} of the cut");
            }
            // One attempt a second (a failed ping already waited up to one).
            if let Some(rest) = Duration::from_secs(1).checked_sub(tried.elapsed()) {
                std::thread::sleep(rest);
            }
        }
    }

    /// Time from `since` until both ends report `want` for each other.
    fn until_path(
        &mut self,
        a: &str,
        b: &str,
        want: &str,
        since: Instant,
    ) -> anyhow::Result<Duration> {
        loop {
            let (pa, _) = self.path(a, b)?;
            let (pb, _) = self.path(b, a)?;
            if pa == want && pb == want {
                return Ok(since.elapsed());
            }
            if since.elapsed() > TRIAL_LIMIT {
                bail!("{a}<->{b} not {want} within {TRIAL_LIMIT:?} (now {pa}/{pb})");
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

/// The figures of one kind.
#[derive(Debug, Default)]
struct Results {
    failover: Vec<Duration>,
    back: Vec<Duration>,
    via: Vec<String>,
}

/// Peer relay trials on one 3-node lab; `window`: its `peerReceiveTimeout` (`None`:
/// the default).
fn peer_relay_trials(
    exe: &std::path::Path,
    trials: usize,
    window: Option<Duration>,
) -> anyhow::Result<Results> {
    let mut args = vec!["--nodes".to_owned(), "3".to_owned()];
    let mut name = format!("bf{}p", std::process::id());
    if let Some(w) = window {
        args.extend([
            "--peer-receive-timeout".to_owned(),
            format!("{}s", w.as_secs()),
        ]);
        name.push('m');
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut lab = Lab::up(exe, &name, &args)?;
    let mut r = Results::default();
    let pb = bar(
        trials,
        if window.is_some() {
            "peer relay trials, minimum window"
        } else {
            "peer relay trials"
        },
    );
    for _ in 0..trials {
        lab.until_path("node1", "node2", "direct", Instant::now())?;
        lab.cut("node1", "node2")?;
        let cut = Instant::now();
        r.failover.push(lab.until_ping("node1", "node2", cut)?);
        let (path, via) = lab.path("node1", "node2")?;
        if path != "relay" {
            bail!("node1 reached node2 after the cut, but through path {path:?}, not a peer relay");
        }
        r.via.push(via);
        lab.heal()?;
        let healed = Instant::now();
        r.back
            .push(lab.until_path("node1", "node2", "direct", healed)?);
        pb.inc(1);
    }
    pb.finish_and_clear();
    Ok(r)
}

fn server_relay_trials(exe: &std::path::Path, trials: usize) -> anyhow::Result<Results> {
    let mut r = Results::default();
    let pb = bar(trials, "server relay trials");
    for t in 0..trials {
        let mut lab = Lab::up(
            exe,
            &format!("bf{}s{t}", std::process::id()),
            &["--nodes", "2"],
        )?;
        lab.cut("node1", "node2")?;
        let cut = Instant::now();
        r.failover.push(lab.until_ping("node1", "node2", cut)?);
        let (path, via) = lab.path("node1", "node2")?;
        if path != "server" {
            bail!("node1 reached node2 after the cut, but through path {path:?}, not the server relay");
        }
        r.via.push(via);
        pb.inc(1);
    }
    pb.finish_and_clear();
    Ok(r)
}

fn row(md: &mut String, what: &str, samples: &[Duration]) {
    if samples.is_empty() {
        let _ = writeln!(md, "| {what} | — | — | — | 0 |");
        return;
    }
    let (p50, p99, max) = summary(samples);
    let _ = writeln!(
        md,
        "| {what} | {p50:.1} s | {p99:.1} s | {max:.1} s | {} |",
        samples.len()
    );
}

/// Runs the benchmark.
///
/// # Errors
/// A lab could not be made, or a trial did not recover within its limit.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let trials = args
        .trials
        .unwrap_or(if args.quick { 1 } else { 20 })
        .max(1);
    let exe = match &args.exe {
        Some(e) => e.clone(),
        None => std::env::current_exe().context("locating this binary")?,
    };
    run_ok(Command::new("nft").arg("--version"), "nft --version")?;
    quick_notice(args.quick);
    let peer = peer_relay_trials(&exe, trials, None)?;
    let fast = peer_relay_trials(&exe, trials, Some(MIN_WINDOW))?;
    let server = server_relay_trials(&exe, trials)?;

    let mut md = String::new();
    let _ = writeln!(md, "# Failover when a direct path dies\n");
    let _ = writeln!(
        md,
        "Trials per kind: {trials}. Default `peerReceiveTimeout` (20 s) unless the row says the \
         minimum ({} s). The cut drops UDP between the two nodes on the lab bridge; failover ends \
         at the first echo reply over the mesh.\n",
        MIN_WINDOW.as_secs()
    );
    let _ = writeln!(
        md,
        "| measure | p50 | p99 | max | trials |\n|---|---|---|---|---|"
    );
    row(
        &mut md,
        "peer relay: cut → traffic flows again",
        &peer.failover,
    );
    row(&mut md, "peer relay: repair → both ends direct", &peer.back);
    row(
        &mut md,
        "peer relay, minimum window: cut → traffic flows again",
        &fast.failover,
    );
    row(
        &mut md,
        "peer relay, minimum window: repair → both ends direct",
        &fast.back,
    );
    row(
        &mut md,
        "server relay: cut → traffic flows again",
        &server.failover,
    );
    let _ = writeln!(
        md,
        "| Talos KubeSpan (upstream rule): cut → peer down | {0} s | {0} s | {0} s | (rule) |",
        UPSTREAM_DOWN.as_secs()
    );
    let _ = writeln!(
        md,
        "\nUpstream has no relay: after those {} s the pair stays down until the path heals.\n",
        UPSTREAM_DOWN.as_secs()
    );
    let _ = writeln!(
        md,
        "Relays used: peer relay via {:?} (minimum window: {:?}); server relay via {:?}, a \
         fresh allocation per trial.\n",
        dedup(&peer.via),
        dedup(&fast.via),
        dedup(&hosts(&server.via))
    );
    let mut missed = Vec::new();
    if args.quick {
        let _ = writeln!(md, "Targets are not judged on a --quick run.\n");
    } else {
        for (what, r) in [("peer relay", &peer), ("server relay", &server)] {
            let (_, p99, _) = summary(&r.failover);
            if p99 > TARGET_FAILOVER.as_secs_f64() {
                missed.push(format!(
                    "{what} failover p99 {p99:.1} s > {} s at the default window",
                    TARGET_FAILOVER.as_secs()
                ));
            }
        }
        let (_, p99, _) = summary(&fast.failover);
        if p99 > TARGET_FAILOVER_MIN_WINDOW.as_secs_f64() {
            missed.push(format!(
                "peer relay failover p99 {p99:.1} s > {} s at the minimum window",
                TARGET_FAILOVER_MIN_WINDOW.as_secs()
            ));
        }
        write_targets(&mut md, &missed);
    }
    print!("{md}");
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let report = args.out.join("report.md");
    std::fs::write(&report, &md).with_context(|| format!("writing {}", report.display()))?;
    println!("report: {}", report.display());
    Ok(())
}

/// The hosts of `host:port` relay addresses (each server relay trial gets new ports).
fn hosts(v: &[String]) -> Vec<String> {
    v.iter()
        .map(|a| a.rsplit_once(':').map_or(a.as_str(), |(h, _)| h).to_owned())
        .collect()
}

fn dedup(v: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for s in v {
        if !out.contains(s) {
            out.push(s.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_relay_allocations_are_reported_by_host() {
        let via = ["10.99.1.2:45221".to_owned(), "10.99.1.2:59478".to_owned()];
        assert_eq!(dedup(&hosts(&via)), ["10.99.1.2"]);
        assert_eq!(hosts(&["[fd99::2]:4000".to_owned()]), ["[fd99::2]"]);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let s: Vec<Duration> = (1..=20).map(Duration::from_secs).collect();
        assert_eq!(summary(&s), (10.0, 20.0, 20.0));
        assert_eq!(summary(&s[..1]), (1.0, 1.0, 1.0));
        assert!(summary(&[]).0.is_nan());
    }
}
