//! `wirespan bench reconcile --quick` through the real binary: the controller chain
//! converges against the real kernel, with the eBPF fast path (the bench fails if it
//! is not in use) and with nftables, and the report carries every figure.

mod common;

use std::process::Command;

use common::BIN;

#[test]
fn bench_reconcile_quick_reports_every_figure() {
    let out = Command::new(BIN)
        .args(["bench", "reconcile", "--quick"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench failed: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for fast_path in ["ebpf", "nftables"] {
        for n in [20, 100] {
            for what in [
                "all arrive → WG peers + marking set",
                "then link, address, routes, rules",
                "one-peer change, median",
                "one-peer change, p99",
                "of which WG apply / marking apply",
            ] {
                let line = format!("{fast_path} N={n}: {what}");
                assert!(text.contains(&line), "missing {line:?} in:\n{text}");
            }
        }
        let ratio = format!("{fast_path}: one-peer change N=100 / N=20");
        assert!(text.contains(&ratio), "missing {ratio:?} in:\n{text}");
    }
}
