//! `wirespan lab chaos` with the real binary on a real lab: a short seeded run recovers
//! from every fault with no violation, and a planted violation (the cluster secret in a
//! daemon's log) fails the run without printing the secret.

mod common;

use std::collections::BTreeSet;

use common::lab::Lab;
use serde_json::Value;

fn report(out: &std::process::Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON report ({e}): {}\nstdout:\n{}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

#[test]
fn a_short_seeded_run_recovers_from_every_fault_and_a_leaked_secret_fails_it() {
    let lab = Lab::new();
    lab.ok(&["up", "--nodes", "3", "--timeout", "180s", "--no-hints"]);

    // Faults start for 45 s (the VM tier asks for 60 through
    // WIRESPAN_TEST_CHAOS_SECS); the last one's recovery (wireguard-go's the longest,
    // about one reconcile period) ends within the test's budget. At least four faults
    // applied, so four kinds (a round of the schedule has each kind once; skipped ones,
    // kill-wireguard on kernel WireGuard, do not count): in an emulated VM one fault's
    // recovery can take most of a minute.
    let duration = format!(
        "{}s",
        std::env::var("WIRESPAN_TEST_CHAOS_SECS").unwrap_or_else(|_| "45".into())
    );
    // Each fault's recovery within the default 60 s; the VM tier (QEMU without KVM, a
    // debug build) allows more through WIRESPAN_TEST_CHAOS_RECOVERY_SECS.
    let recovery = format!(
        "{}s",
        std::env::var("WIRESPAN_TEST_CHAOS_RECOVERY_SECS").unwrap_or_else(|_| "60".into())
    );
    let out = lab.run(&[
        "chaos",
        "--duration",
        &duration,
        "--min-faults",
        "4",
        "--recovery-timeout",
        &recovery,
        "--nodes",
        "3",
        "--seed",
        "1",
        "-o",
        "json",
    ]);
    let r = report(&out);
    assert!(
        out.status.success(),
        "violations: {:#}\nstderr:\n{}",
        r["violations"],
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(r["violations"].as_array().unwrap().len(), 0);
    assert_eq!(r["seed"], 1);
    let kinds: BTreeSet<&str> = r["kinds"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|k| k["count"].as_u64().unwrap() > 0)
        .map(|k| k["kind"].as_str().unwrap())
        .collect();
    assert!(kinds.len() >= 4, "too few kinds of fault ran: {kinds:?}");
    for f in r["faults"].as_array().unwrap() {
        assert!(
            f["recoveryMs"].is_u64() || f["skipped"].is_string(),
            "fault without a recovery time: {f}"
        );
    }
    // Progress, one line per fault, on stderr.
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("#1 "), "{err}");
    // The lab is still whole afterwards: `lab status` shows every daemon running.
    let st = lab.status();
    for n in st["nodes"].as_array().unwrap() {
        assert_eq!(n["daemon"], "running", "{n}");
    }
    assert_eq!(st["discovery"]["running"], true);

    // A leaked secret is a violation: the run fails and names it, never prints it.
    let cluster = std::fs::read_to_string(st["clusterConfig"].as_str().unwrap()).unwrap();
    let secret = cluster
        .lines()
        .find_map(|l| l.strip_prefix("secret: "))
        .unwrap()
        .trim_matches('\'')
        .to_owned();
    let log = st["nodes"][0]["log"].as_str().unwrap();
    let mut text = std::fs::read_to_string(log).unwrap();
    text.push_str(&format!("planted by the test: {secret}\n"));
    std::fs::write(log, text).unwrap();
    let out = lab.run(&["chaos", "--duration", "1s", "--seed", "2", "-o", "json"]);
    assert!(!out.status.success(), "a leaked secret must fail the run");
    let r = report(&out);
    let v = r["violations"].as_array().unwrap();
    assert!(
        v.iter().any(|v| v["problem"]
            .as_str()
            .unwrap()
            .starts_with("the cluster secret appears in node1's log")),
        "{v:?}"
    );
    for stream in [&out.stdout, &out.stderr] {
        assert!(!String::from_utf8_lossy(stream).contains(&secret));
    }
}
