//! `wirespan bench reconcile`: the whole KubeSpan controller chain against the real
//! kernel — affiliates in the store → peer specs → the manager → userspace WireGuard
//! (wireguard-go) and the marking (the eBPF fast path with nftables for local traffic,
//! or nftables alone), in a throwaway network namespace.
//!
//! For each fast path and size N: N affiliates arrive at once, timed until WireGuard
//! holds N peers and the marking set every routed prefix (then the routes and rules the
//! manager emitted as specs are applied with the routing adapter, timed apart, since
//! the network controllers that normally apply them are another part); then one
//! affiliate at a time changes a pod CIDR, timed until both the WireGuard peer and the
//! marking carry the new prefix, once the mesh has settled (no peer awaiting a first
//! handshake, so no per-second device reads). The adapters are wrapped to timestamp their applies
//! (whole-state or delta), so the report splits a change into WireGuard apply, marking
//! apply and the rest (the controllers). Needs root, `ip`, `nft` and `wireguard-go`.
//!
//! Files: `timed` (the timestamping adapters), `node` (the namespace and controllers
//! under test), `report`; this file holds the options and the measurement.

mod node;
mod report;
mod timed;

use std::time::{Duration, Instant};

use wirespan_control::{config::kubespan::FastPath, resources::cluster::Affiliate};
use wirespan_dataplane::ipnet::{IpNet, Ipv4Net};

use self::node::{affiliate, key, v4};
use crate::bar;

/// Options of `wirespan bench reconcile`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Peer counts.
    #[arg(long, value_delimiter = ',', default_values_t = vec![100, 1_000, 10_000])]
    pub sizes: Vec<usize>,
    /// One-peer changes timed at each size.
    #[arg(long, default_value_t = 40)]
    pub changes: usize,
    /// Marking fast paths to run, each over every size: `ebpf` (the tc classifier for
    /// forwarded traffic plus nftables for local traffic) and `nftables`.
    #[arg(long, value_delimiter = ',', default_values_t = vec!["ebpf".to_owned(), "nftables".to_owned()])]
    pub fast_path: Vec<String>,
    /// Small and fast (sizes 20 and 100, 5 changes): a smoke run for tests.
    #[arg(long)]
    pub quick: bool,
}

fn fast_path_of(name: &str) -> anyhow::Result<FastPath> {
    match name {
        "ebpf" => Ok(FastPath::Ebpf),
        "nftables" => Ok(FastPath::Nftables),
        other => anyhow::bail!("--fast-path: {other:?} is not one of ebpf, nftables"),
    }
}

pub(super) fn fast_path_name(f: FastPath) -> &'static str {
    match f {
        FastPath::Ebpf => "ebpf",
        FastPath::Nftables => "nftables",
    }
}

/// The figures of one fast path at one size.
pub(super) struct SizeFigures {
    pub(super) fast_path: FastPath,
    pub(super) n: usize,
    pub(super) from_empty: Duration,
    pub(super) routing: Duration,
    pub(super) change: Vec<Duration>,
    pub(super) change_wg: Vec<Duration>,
    pub(super) change_nft: Vec<Duration>,
}

/// Measures one fast path at size `n`: all peers arriving, then `changes` one-peer
/// changes.
async fn measure(n: usize, changes: usize, fast_path: FastPath) -> anyhow::Result<SizeFigures> {
    let pb = bar(
        changes + 1,
        &format!("{}, N={n}", fast_path_name(fast_path)),
    );
    let mut node = node::start(n, fast_path)?;
    // The manager's first apply: device up, no peers.
    node.wait(Duration::from_secs(30), |p, _| p == 0, |_, _| true)
        .await?;
    let chosen = node
        .chosen
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    match chosen {
        Some((f, _)) if f == fast_path => {}
        Some((_, note)) => anyhow::bail!(
            "the {} fast path is not in use: {note}",
            fast_path_name(fast_path)
        ),
        None => anyhow::bail!("the manager built no marking"),
    }
    let t0 = Instant::now();
    for i in 0..n {
        let a = affiliate(i);
        node.store
            .modify::<Affiliate>("cluster", &a.node_id, "", |r| r.spec = a.clone())?;
    }
    // Every peer routes its host /32 and its /24 (ULAs route via the /64).
    let (done, _, _) = node
        .wait(Duration::from_secs(120), |p, _| p == n, |x, _| x == 2 * n)
        .await?;
    let from_empty = done - t0;
    let routing = node.apply_routing()?;
    node.settle(n, Duration::from_secs(60)).await?;
    pb.inc(1);
    let (mut change, mut change_wg, mut change_nft) = (Vec::new(), Vec::new(), Vec::new());
    for c in 0..changes {
        let i = (c * 7919) % n;
        let net = IpNet::V4(Ipv4Net::new(v4(11, c, 0), 24).unwrap_or_default());
        *node
            .probe
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((key(i), net));
        while node.rx.try_recv().is_ok() {}
        let mut a = affiliate(i);
        if let Some(ks) = a.kubespan.as_mut() {
            ks.additional_addresses = vec![net];
        }
        let t = Instant::now();
        node.store
            .modify::<Affiliate>("cluster", &a.node_id, "", |r| r.spec = a.clone())?;
        let (done, wg, nft) = node
            .wait(Duration::from_secs(30), |_, p| p, |_, p| p)
            .await?;
        change.push(done - t);
        change_wg.push(wg);
        change_nft.push(nft);
        pb.inc(1);
    }
    pb.finish_and_clear();
    node.harness.stop().await?;
    Ok(SizeFigures {
        fast_path,
        n,
        from_empty,
        routing,
        change,
        change_wg,
        change_nft,
    })
}

/// Runs the benchmark and prints its report.
///
/// # Errors
/// Not root, a missing tool, or the chain not converging in time.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let (sizes, changes) = if args.quick {
        (vec![20, 100], 5)
    } else {
        (args.sizes.clone(), args.changes)
    };
    anyhow::ensure!(
        !sizes.is_empty() && changes >= 1,
        "need sizes and at least one change"
    );
    let fast_paths = args
        .fast_path
        .iter()
        .map(|f| fast_path_of(f))
        .collect::<anyhow::Result<Vec<_>>>()?;
    anyhow::ensure!(!fast_paths.is_empty(), "--fast-path: give at least one");
    println!(
        "wirespan bench reconcile: {} build, controllers + userspace WireGuard + marking ({}), {} one-peer changes per size",
        if cfg!(debug_assertions) { "DEBUG (numbers not meaningful)" } else { "release" },
        args.fast_path.join(", "),
        changes
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut figures = Vec::new();
    for &f in &fast_paths {
        for &n in &sizes {
            figures.push(rt.block_on(measure(n, changes, f))?);
        }
    }
    report::print(&figures, &fast_paths);
    Ok(())
}
