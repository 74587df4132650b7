//! wirespan-bench: reproducible benchmarks behind `wirespan bench …`.
//!
//! Each benchmark prints its figures and compares alternatives in the same run.
//!
//! The `wirespan` binary links this crate on purpose: it is the simplest honest design.
//! Operators run the benchmarks with the very binary they deploy, on the host they care
//! about (its kernel, its CPU, its nftables), and the lab uses the same binary, so the
//! figures describe the code that runs in production rather than a separately built
//! tool. The cost is binary size (the benchmark code; it adds no dependency the daemon
//! does not already link); none of it runs unless `wirespan bench` is invoked. For the
//! same reason this crate uses only product APIs of the other crates (for instance
//! `wirespan_control::runtime::Harness` and its own resource kinds, never
//! `wirespan_control::testing`).

mod chart;
pub mod dataplane;
pub mod discovery;
pub mod failover;
mod lab;
pub mod marking;
pub mod reconcile;
pub mod runtime;
pub mod sanity;
pub mod throughput;

/// A progress bar for one phase of a benchmark (on stderr, so reports stay clean).
pub(crate) fn bar(len: usize, what: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(len as u64);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{msg:>28} [{bar:30}] {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_message(what.to_owned());
    pb
}

/// Says, before any figure, that a `--quick` run is a smoke test.
pub(crate) fn quick_notice(quick: bool) {
    if quick {
        println!("--quick: small counts to check that the benchmark runs; the figures below are not the benchmark's, and targets are not judged by them");
    }
}

/// The report's verdict: every target met, or the list of those missed.
pub(crate) fn write_targets(md: &mut String, missed: &[String]) {
    use std::fmt::Write as _;
    if missed.is_empty() {
        let _ = writeln!(md, "All targets met in this run.");
    } else {
        let _ = writeln!(md, "Targets missed in this run:\n");
        for m in missed {
            let _ = writeln!(md, "- {m}");
        }
    }
}
