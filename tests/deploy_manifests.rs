//! The Kubernetes manifests of `deploy/kubernetes/` against the Kubernetes schemas
//! (`kubernetes-validate --strict`: unknown fields are errors too), and a broken copy
//! that must fail, so that the check is known to bite.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

fn manifests() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

fn validate(file: &Path) -> Output {
    Command::new("python3")
        .args(["-m", "kubernetes_validate", "--strict"])
        .arg(file)
        .output()
        .expect("python3 with kubernetes-validate (scripts/setup.sh installs it)")
}

#[test]
fn every_manifest_validates() {
    let files = manifests();
    let names: Vec<_> = files
        .iter()
        .map(|f| f.file_name().unwrap().to_str().unwrap())
        .collect();
    assert_eq!(names, ["discovery.yaml", "namespace.yaml", "node.yaml"]);
    for f in &files {
        let o = validate(f);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{}: {}\n{out}{}",
            f.display(),
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(out.contains("passed"), "{out}");
    }
}

#[test]
fn every_resource_of_each_file_is_checked() {
    // One "passed" line per document: none is skipped.
    let o =
        validate(&Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes/discovery.yaml"));
    let out = String::from_utf8_lossy(&o.stdout);
    for r in [
        "deployment/wirespan-discovery-a",
        "service/wirespan-discovery-a",
        "deployment/wirespan-discovery-b",
        "service/wirespan-discovery-b",
    ] {
        assert!(
            out.contains(&format!("passed for resource {r}")),
            "{r}: {out}"
        );
    }
}

#[test]
fn a_broken_manifest_fails() {
    let node = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes/node.yaml"),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (what, from, to) in [
        ("misspelt field", "hostNetwork: true", "hostNetwrok: true"),
        ("wrong type", "maxUnavailable: 1", "maxUnavailable: [1]"),
    ] {
        assert!(node.contains(from), "{from}");
        let bad = dir.path().join("bad.yaml");
        std::fs::write(&bad, node.replace(from, to)).unwrap();
        let o = validate(&bad);
        assert!(!o.status.success(), "{what} passed");
    }
}
