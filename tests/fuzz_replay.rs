//! Every cargo-fuzz target's committed inputs, replayed on stable: the seeds in
//! `fuzz/corpus/<target>/` and the crashes once found in `fuzz/regressions/<target>/`
//! go through the same function the target calls (each crate's `fuzzing` module), so
//! a fixed crash stays fixed without nightly or libFuzzer. Also checks that every
//! target in `fuzz/fuzz_targets/` has its body listed here and calls it.

use std::{
    fs,
    panic::{self, AssertUnwindSafe},
    path::{Path, PathBuf},
};

type Body = fn(&[u8]);

/// Every fuzz target and its body.
const TARGETS: &[(&str, Body)] = &[
    ("config_parse", wirespan_control::fuzzing::config_parse),
    (
        "discovery_crypto",
        wirespan_discovery::fuzzing::discovery_crypto,
    ),
    ("discovery_rpc", wirespan_discovery::fuzzing::discovery_rpc),
    ("snapshot_read", wirespan_discovery::fuzzing::snapshot_read),
    ("nfnl_reply", wirespan_dataplane::fuzzing::nfnl_reply),
    ("nft_listing", wirespan_dataplane::fuzzing::nft_listing),
    ("uapi_parse", wirespan_dataplane::fuzzing::uapi_parse),
    (
        "wg_device_input",
        wirespan_dataplane::fuzzing::wg_device_input,
    ),
    ("tun_write", wirespan_dataplane::fuzzing::tun_write),
    ("wg_session", wirespan_dataplane::fuzzing::wg_session),
];

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

/// The names of the entries of `dir` (none when it does not exist).
fn entries(dir: &Path) -> Vec<PathBuf> {
    let Ok(read) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = read.map(|e| e.unwrap().path()).collect();
    paths.sort();
    paths
}

fn file_stem(path: &Path) -> String {
    path.file_stem().unwrap().to_string_lossy().into_owned()
}

#[test]
fn every_fuzz_target_is_replayed_through_the_body_it_calls() {
    let mut listed: Vec<&str> = TARGETS.iter().map(|(name, _)| *name).collect();
    listed.sort_unstable();
    let mut targets: Vec<String> = entries(&fuzz_dir().join("fuzz_targets"))
        .iter()
        .map(|p| file_stem(p))
        .collect();
    targets.sort();
    assert_eq!(
        targets, listed,
        "fuzz/fuzz_targets/ and this test's TARGETS"
    );
    for (name, _) in TARGETS {
        let source = fs::read_to_string(fuzz_dir().join(format!("fuzz_targets/{name}.rs")))
            .expect("the target's source");
        assert!(
            source.contains(&format!("::fuzzing::{name}(data)")),
            "fuzz_targets/{name}.rs must call its body, fuzzing::{name}"
        );
    }
    // Inputs kept for a target that no longer exists would never run.
    for kind in ["corpus", "regressions"] {
        for dir in entries(&fuzz_dir().join(kind)) {
            let name = file_stem(&dir);
            assert!(
                listed.contains(&name.as_str()),
                "fuzz/{kind}/{name}: no such target"
            );
        }
    }
}

#[test]
fn every_corpus_and_regression_input_runs_clean() {
    let mut failures = Vec::new();
    let mut replayed = 0;
    for (name, body) in TARGETS {
        for kind in ["corpus", "regressions"] {
            for path in entries(&fuzz_dir().join(kind).join(name)) {
                let data = fs::read(&path).unwrap();
                replayed += 1;
                if panic::catch_unwind(AssertUnwindSafe(|| body(&data))).is_err() {
                    failures.push(path.display().to_string());
                }
            }
        }
    }
    eprintln!("{replayed} inputs replayed");
    assert!(replayed >= TARGETS.len(), "every target has a seed");
    assert!(failures.is_empty(), "inputs that panicked: {failures:#?}");
}
