//! The docs in the repository: the configuration reference is the one the binary
//! generates, and README and docs/ link only to files inside the repository.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

const BIN: &str = env!("CARGO_BIN_EXE_wirespan");

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn generate(args: &[&str]) -> String {
    let out = Command::new(BIN)
        .args(["docs", "config"])
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "wirespan docs config failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn config_reference_is_not_stale() {
    let generated = generate(&[]);
    let committed =
        std::fs::read_to_string(repo().join("docs/config-reference.md")).unwrap_or_default();
    assert!(
        committed == generated,
        "docs/config-reference.md is stale; regenerate with \
         `wirespan docs config --out docs/config-reference.md`"
    );
    // `--out` writes the same text.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ref.md");
    assert_eq!(generate(&["--out", file.to_str().unwrap()]), "");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), generated);
}

/// README.md and every docs/*.md.
fn markdown_files() -> Vec<PathBuf> {
    let mut files = vec![repo().join("README.md")];
    for e in std::fs::read_dir(repo().join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            files.push(p);
        }
    }
    files.sort();
    files
}

/// The targets of `[text](target)` links.
fn link_targets(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        if let Some(end) = rest.find(')') {
            out.push(&rest[..end]);
        }
    }
    out
}

#[test]
fn docs_link_only_inside_the_repository() {
    let root = repo().canonicalize().unwrap();
    let mut problems = Vec::new();
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let name = file.strip_prefix(repo()).unwrap().display().to_string();
        // `../` itself is fine (docs/ links to deploy/); where a link lands is checked
        // below.
        for bad in ["shared/", "DESIGN.md", "../../"] {
            if text.contains(bad) {
                problems.push(format!("{name} mentions {bad:?}"));
            }
        }
        for target in link_targets(&text) {
            let path = target.split('#').next().unwrap();
            if path.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let resolved = file.parent().unwrap().join(path);
            match resolved.canonicalize() {
                Ok(p) if p.starts_with(&root) => {}
                Ok(_) => problems.push(format!("{name} links outside the repository: {target}")),
                Err(_) => problems.push(format!("{name} links to a missing file: {target}")),
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
