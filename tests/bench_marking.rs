//! `wirespan bench marking --quick` through the real binary: it finishes, writes its
//! report and chart, and its table has every configuration. Needs root (BPF, netns).

use std::process::Command;

#[test]
fn bench_marking_quick_writes_report_and_chart() {
    let out = tempfile::tempdir().unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_wirespan"))
        .args(["bench", "marking", "--quick", "--out"])
        .arg(out.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "exit {}\nstdout:\n{stdout}\nstderr:\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    let report = std::fs::read_to_string(out.path().join("report.md")).unwrap();
    let svg = std::fs::read_to_string(out.path().join("chart.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    for text in [&report, &stdout.to_string()] {
        for config in [
            "no marking",
            "nft interval set (upstream)",
            "nft hash + interval",
            "nft hash per prefix length (ours)",
            "eBPF tcx prefix hash",
            "eBPF tcx hash + LPM",
        ] {
            for size in ["100", "10000"] {
                assert!(
                    text.contains(&format!("| {size} | {config} |")),
                    "macro row {size} / {config} missing:\n{text}"
                );
            }
        }
        for size in ["1", "100", "1000", "10000", "100000"] {
            for (family, probe) in [
                ("IPv4", "host hit"),
                ("IPv4", "miss"),
                ("IPv6", "host hit"),
                ("IPv6", "miss"),
            ] {
                assert!(
                    text.contains(&format!("| {size} | {family} | {probe} |")),
                    "micro row {size} {family} {probe} missing"
                );
            }
        }
        assert!(text.contains("| 100000 | IPv6 | CIDR hit |"));
    }
    // Forwarded packets reached the sink: ≥ 99 % in every macro row (a marking that
    // sent packets into the tunnel would lose them all, a broken router some).
    let delivered: Vec<f64> = report
        .lines()
        .filter_map(|l| l.trim_end().strip_suffix(" % |"))
        .filter_map(|l| l.rsplit("| ").next()?.trim().parse().ok())
        .collect();
    assert!(!delivered.is_empty(), "no delivery column:\n{report}");
    assert!(
        delivered.iter().all(|d| *d >= 99.0),
        "delivery below 99 %: {delivered:?}\n{report}"
    );
}
