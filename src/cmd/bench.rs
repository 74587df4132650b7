//! `wirespan bench …`: thin dispatch into the `wirespan-bench` crate.

use clap::Subcommand;

/// The benchmarks.
#[derive(Debug, Subcommand)]
pub enum Bench {
    /// Resource store and controller runtime throughput and latency.
    Runtime(wirespan_bench::runtime::Args),
    /// Discovery server throughput, fan-out latency, memory and join storm.
    Discovery(wirespan_bench::discovery::Args),
    /// Kernel data plane apply times (needs root).
    Dataplane(wirespan_bench::dataplane::Args),
    /// The KubeSpan controller chain from affiliates to kernel state (needs root).
    Reconcile(wirespan_bench::reconcile::Args),
    /// Per-packet cost of marking: nftables vs the eBPF fast path (needs root).
    Marking(wirespan_bench::marking::Args),
    /// TCP and UDP throughput between two lab nodes: underlay, mesh, and mesh with
    /// each marking path, per WireGuard backend (needs root and iperf3).
    Throughput(wirespan_bench::throughput::Args),
    /// Time to fail over to a peer relay or the server relay when a direct path dies,
    /// and back to direct when it heals, against the upstream rule (needs root).
    Failover(wirespan_bench::failover::Args),
}

pub fn run(bench: &Bench) -> anyhow::Result<()> {
    match bench {
        Bench::Runtime(a) => wirespan_bench::runtime::run(a),
        Bench::Discovery(a) => wirespan_bench::discovery::run(a),
        Bench::Dataplane(a) => wirespan_bench::dataplane::run(a),
        Bench::Reconcile(a) => wirespan_bench::reconcile::run(a),
        Bench::Marking(a) => wirespan_bench::marking::run(a),
        Bench::Throughput(a) => wirespan_bench::throughput::run(a),
        Bench::Failover(a) => wirespan_bench::failover::run(a),
    }
}
