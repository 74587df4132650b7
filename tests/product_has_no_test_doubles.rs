//! The product carries no test doubles: `dataplane::fake`, `control::testing` and
//! `FakeClock` compile only under `cfg(test)` or the crates' `testing` feature, and only
//! dev-dependencies turn that feature on. Cargo resolves the release binary's features
//! from its normal and build dependencies alone, so the binary has test doubles exactly
//! when that feature tree enables `testing` somewhere.

use std::process::Command;

/// `(crate, feature)` pairs enabled when building the `wirespan` binary (no dev edges).
fn product_features() -> Vec<(String, String)> {
    let out = Command::new(env!("CARGO"))
        .args([
            "tree",
            "--locked",
            "--offline",
            "--package",
            "wirespan",
            "--edges",
            "normal,build,features",
            "--prefix",
            "none",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("cargo tree prints UTF-8");
    // Lines look like `wirespan-control feature "default"`.
    text.lines()
        .filter_map(|l| {
            let (krate, rest) = l.split_once(" feature \"")?;
            Some((krate.to_owned(), rest.split('"').next()?.to_owned()))
        })
        .collect()
}

#[test]
fn the_wirespan_binary_is_built_without_the_testing_feature() {
    let features = product_features();
    // The listing must cover the workspace crates at all, or an empty tree would pass.
    for krate in ["wirespan-control", "wirespan-dataplane", "wirespan-bench"] {
        assert!(
            features.iter().any(|(k, _)| k == krate),
            "cargo tree shows no features of {krate}: {features:?}"
        );
    }
    let testing: Vec<_> = features
        .iter()
        .filter(|(k, f)| k.starts_with("wirespan") && f == "testing")
        .collect();
    assert!(
        testing.is_empty(),
        "the product enables test doubles through {testing:?}"
    );
}
