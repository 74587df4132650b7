//! Puts the git commit of the build into `WIRESPAN_GIT_COMMIT` for `wirespan --version`
//! ("unknown" outside a git checkout, e.g. a source tarball, or without git).

use std::{path::PathBuf, process::Command};

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (!s.is_empty()).then_some(s)
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let commit = git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=WIRESPAN_GIT_COMMIT={commit}");

    // Rebuild when HEAD moves: HEAD itself (a checkout), and the branch it points to (a
    // commit). A worktree keeps HEAD in its own git dir and refs in the common one.
    // Only existing paths are named: cargo reruns a script on every build while a named
    // path is missing. A packed branch has no file of its own: packed-refs, and the
    // directory its loose file will appear in on the next commit, stand for it.
    let Some(git_dir) = git(&["rev-parse", "--git-dir"]).map(PathBuf::from) else {
        return;
    };
    let common =
        git(&["rev-parse", "--git-common-dir"]).map_or_else(|| git_dir.clone(), PathBuf::from);
    let mut watch = vec![git_dir.join("HEAD"), common.join("packed-refs")];
    if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]).map(|r| common.join(r)) {
        if !r.exists() {
            watch.extend(r.parent().map(PathBuf::from));
        }
        watch.push(r);
    }
    for p in watch.into_iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", p.display());
    }
}
