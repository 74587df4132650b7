//! Every benchmark runs once in `--quick` mode, through the real binary, so none can
//! rot unnoticed. The figures are not checked (a debug build on a shared machine);
//! that each section ran and printed its rows is.

mod common;

use std::process::Command;

fn bench(args: &[&str]) -> String {
    let out = Command::new(common::BIN)
        .arg("bench")
        .args(args)
        .arg("--quick")
        .output()
        .expect("running wirespan bench");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "wirespan bench {args:?} --quick failed: {}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("--quick"), "no quick notice:\n{stdout}");
    stdout
}

#[test]
fn bench_runtime_quick_runs_every_section() {
    let out = bench(&["runtime"]);
    for needle in [
        "updates/s, 0 kind watchers",
        "updates/s, 64 kind watchers",
        "no-op",
    ] {
        assert!(out.contains(needle), "missing {needle:?}:\n{out}");
    }
}

#[test]
fn bench_discovery_quick_runs_every_section() {
    let out = bench(&["discovery"]);
    for needle in [
        "AffiliateUpdate throughput",
        "Watch fan-out",
        "Memory:",
        "Join storm",
        "Hostile load",
        "Watch delivery",
        "limits' worst case",
    ] {
        assert!(out.contains(needle), "missing {needle:?}:\n{out}");
    }
}

#[test]
fn bench_dataplane_quick_runs_every_section() {
    // Root only: it builds namespaces, a userspace WireGuard device and nft tables.
    let out = bench(&["dataplane"]);
    for needle in [
        "from empty",
        "one-peer change",
        "hash+interval",
        "interval only",
    ] {
        assert!(out.contains(needle), "missing {needle:?}:\n{out}");
    }
}

#[test]
fn bench_throughput_quick_measures_every_path() {
    // Root only: two labs (nodes, discovery server, WireGuard) and iperf3 in them.
    let dir = tempfile::tempdir().unwrap();
    let out = bench(&["throughput", "--out", dir.path().to_str().unwrap()]);
    for needle in [
        "underlay (ceiling)",
        "mesh, no marking",
        "mesh, nftables marking",
        "eBPF: mesh, fast-path marking",
        "Through the mesh (no marking, TCP, one stream):",
        "userspace (wirespan wireguard) WireGuard",
        "userspace-go (wireguard-go) WireGuard",
        "TCP, 4 streams",
        "device CPU s/GB",
        "Implementations compared",
        "Mixed pairs",
        "Handshake flood (mesh, no marking)",
        "under 100k/s",
        "Target: TCP under the 100k/s flood ≥ 80 % of unflooded and ahead of wireguard-go's ratio: not judged (--quick)",
        "report:",
    ] {
        assert!(out.contains(needle), "missing {needle:?}:\n{out}");
    }
    // The report holds the flood phase too, with both implementations' rows.
    let report = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    assert!(report.contains("## Handshake flood"), "{report}");
    assert_eq!(
        report
            .lines()
            .filter(|l| l.starts_with("| userspace") && l.contains(" / "))
            .count(),
        2,
        "a flood row per implementation:\n{report}"
    );
    let chart = std::fs::read_to_string(dir.path().join("chart.svg")).unwrap();
    assert!(
        chart.contains("<svg") && chart.contains("mesh, no marking"),
        "{chart}"
    );
}

#[test]
fn bench_failover_quick_fails_over_to_each_relay_and_back() {
    // Root only: labs of three and two nodes, their direct path cut on the lab bridge.
    let dir = tempfile::tempdir().unwrap();
    let out = bench(&["failover", "--out", dir.path().to_str().unwrap()]);
    for needle in [
        "peer relay: cut → traffic flows again",
        "peer relay: repair → both ends direct",
        "server relay: cut → traffic flows again",
        "Talos KubeSpan (upstream rule): cut → peer down | 275 s",
        "peer relay via [\"node3\"]",
        "report:",
    ] {
        assert!(out.contains(needle), "missing {needle:?}:\n{out}");
    }
    assert!(dir.path().join("report.md").exists());
}
