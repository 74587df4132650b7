//! Config safety through the real binary: a node whose config file is emptied,
//! truncated, oversized or invalid keeps running on the last good config and says so
//! in `get configstatus`; a restart with a bad file starts from the last good copy in
//! the state dir; without one, a bad file is fatal. The configs hold probes only
//! (to a closed local port), so the node changes nothing in the host's kernel.

mod common;

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use common::{bin_in, cli, stdout, wait_for_path, ChildGuard};
use serde_json::Value;
use sha2::Digest as _;
use wirespan_dataplane::netns::NetnsGuard;

const A: &str = "apiVersion: v1alpha1\nkind: HTTPProbeConfig\nname: a\nurl: http://user:s3cret@127.0.0.1:1/a\ninterval: 30s\n";
const B: &str =
    "apiVersion: v1alpha1\nkind: TCPProbeConfig\nname: b\nendpoint: 127.0.0.1:1\ninterval: 30s\n";
const EMPTY: &str = "config file is empty; to turn the mesh off set enabled: false";

/// The version the node reports for a config text.
fn version(text: &str) -> String {
    sha2::Sha256::digest(text.as_bytes())[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

struct Node {
    ns: NetnsGuard,
    dir: PathBuf,
    socket: PathBuf,
    config: PathBuf,
}

impl Node {
    fn new(dir: &Path) -> Self {
        Self {
            ns: NetnsGuard::new("wssafe").unwrap(),
            dir: dir.to_owned(),
            socket: dir.join("run/node.sock"),
            config: dir.join("config.yaml"),
        }
    }

    fn command(&self) -> Command {
        let mut c = bin_in(&self.ns);
        c.arg("--socket")
            .arg(&self.socket)
            .arg("node")
            .arg("--state-dir")
            .arg(self.dir.join("state"))
            .arg("--config")
            .arg(&self.config)
            .env_remove("WIRESPAN_SOCKET");
        c
    }

    fn start(&self) -> ChildGuard {
        let g = ChildGuard(self.command().spawn().unwrap());
        wait_for_path(&self.socket);
        g
    }

    fn cli(&self, args: &[&str]) -> std::process::Output {
        cli(&self.socket, args)
    }

    /// The spec of `config/ConfigStatus current`, once there is one.
    fn status(&self) -> Option<Value> {
        let o = self.cli(&["get", "configstatus", "current", "-o", "json"]);
        o.status
            .success()
            .then(|| serde_json::from_slice::<Value>(&o.stdout).unwrap()["spec"].clone())
    }

    /// Waits until the status satisfies `f`; returns it.
    fn status_until(&self, what: &str, f: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let st = self.status();
            if let Some(st) = st.as_ref().filter(|s| f(s)) {
                return st.clone();
            }
            assert!(
                Instant::now() < deadline,
                "timed out: {what}; status {st:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn sigterm_and_wait(mut g: ChildGuard) {
    let pid = g.0.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let deadline = Instant::now() + Duration::from_secs(10);
    while g.0.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "node did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn alive(g: &mut ChildGuard) -> bool {
    g.0.try_wait().unwrap().is_none()
}

#[test]
fn bad_config_files_keep_the_last_good_config_and_restarts_start_from_it() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::new(dir.path());
    std::fs::write(&node.config, A).unwrap();
    let mut child = node.start();
    let (va, vb) = (version(A), version(B));
    let cfg = node.config.display().to_string();
    node.status_until("A accepted", |s| {
        s["acceptedVersion"] == va.as_str() && s["lastAttempt"] == "accepted"
    });
    // Kept in the state dir, private (it may hold the cluster secret).
    let last_good = dir.path().join("state/last-good-config.yaml");
    assert_eq!(std::fs::read_to_string(&last_good).unwrap(), A);
    let mode = std::fs::metadata(&last_good).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    // The probe's URL credentials are not shown.
    for args in [
        &["get", "probespecs", "-o", "yaml"][..],
        &["get", "probespecs"],
        &[
            "get",
            "probespecs",
            "--namespace",
            "network-config",
            "-o",
            "json",
        ],
    ] {
        let out = stdout(&node.cli(args));
        assert!(out.contains("127.0.0.1:1/a"), "{args:?}: {out}");
        assert!(!out.contains("s3cret"), "{args:?}: {out}");
    }

    // Emptied: rejected with the way to turn the mesh off; A stays.
    std::fs::write(&node.config, "").unwrap();
    let st = node.status_until("empty file rejected", |s| s["lastError"] == EMPTY);
    assert_eq!(st["lastAttempt"], "rejected");
    assert_eq!(st["acceptedVersion"], va.as_str());
    assert_eq!(st["lastErrorSource"], cfg.as_str());
    assert!(st["lastErrorTime"].as_str().unwrap().ends_with('Z'), "{st}");
    let table = stdout(&node.cli(&["get", "cs"]));
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "NAMESPACE",
            "TYPE",
            "ID",
            "VERSION",
            "ACCEPTED",
            "SOURCE",
            "LASTATTEMPT",
            "TRIALDEADLINE",
            "LASTERRORTIME",
            "LASTERROR"
        ],
        "{table}"
    );
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        row[..7],
        [
            "config",
            "ConfigStatus",
            "current",
            row[3],
            va.as_str(),
            cfg.as_str(),
            "rejected"
        ],
        "{table}"
    );
    assert!(table.contains(EMPTY), "{table}");
    assert!(alive(&mut child));
    assert!(stdout(&node.cli(&["get", "probespecs"])).contains("127.0.0.1:1/a"));

    // Truncated mid-document: rejected, naming the document.
    std::fs::write(&node.config, &A[..40]).unwrap();
    let st = node.status_until("truncated file rejected", |s| {
        s["lastError"].as_str().unwrap().contains("document 1")
    });
    assert!(
        st["lastError"].as_str().unwrap().contains("unknown kind"),
        "{st}"
    );
    assert_eq!(st["acceptedVersion"], va.as_str());

    // Over the size cap: rejected, naming the size and the cap.
    let big = format!("{A}#{}\n", "x".repeat(4 << 20));
    std::fs::write(&node.config, &big).unwrap();
    let want = format!(
        "config is {} bytes, over the 4194304-byte (4 MiB) limit",
        big.len()
    );
    node.status_until("oversized file rejected", |s| {
        s["lastError"] == want.as_str()
    });
    assert!(alive(&mut child));
    // The API takes the same cap (one constant): over it, refused before sending...
    let big_file = dir.path().join("big.yaml");
    std::fs::write(&big_file, &big).unwrap();
    let o = node.cli(&["apply", big_file.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains(&want), "{o:?}");
    // ...and a config of exactly 4 MiB goes through (over gRPC's 4 MiB default).
    let at_cap = format!("{A}#{}", "x".repeat((4 << 20) - A.len() - 1));
    std::fs::write(&big_file, &at_cap).unwrap();
    let out = stdout(&node.cli(&["apply", big_file.to_str().unwrap()]));
    assert_eq!(
        out.trim(),
        format!("config applied: version {} (1 documents)", version(&at_cap))
    );

    // `wirespan apply` says what the node did: the version applied...
    let b_file = dir.path().join("b.yaml");
    std::fs::write(&b_file, B).unwrap();
    let out = stdout(&node.cli(&["apply", b_file.to_str().unwrap()]));
    assert_eq!(
        out.trim(),
        format!("config applied: version {vb} (1 documents)")
    );
    let st = node.status_until("B accepted", |s| s["acceptedVersion"] == vb.as_str());
    assert_eq!(
        (st["source"].as_str(), st["lastAttempt"].as_str()),
        (Some("api"), Some("accepted"))
    );
    assert_eq!(std::fs::read_to_string(&node.config).unwrap(), B);
    assert_eq!(std::fs::read_to_string(&last_good).unwrap(), B);
    let out = stdout(&node.cli(&["apply", b_file.to_str().unwrap()]));
    assert_eq!(
        out.trim(),
        format!("config unchanged: version {vb} in force")
    );
    // ...or every error and the version kept.
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        format!("{B}---\napiVersion: v1alpha1\nkind: TCPProbeConfig\nname: c\nendpoint: fd00::1:80\n---\napiVersion: v1alpha1\nkind: RouteConfig\ndestination: 10.1.2.3/16\nlink: eth0\n"),
    )
    .unwrap();
    let o = node.cli(&["apply", bad.to_str().unwrap()]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    for want in [
        "document 2 (TCPProbeConfig \"c\"): endpoint: TCP probe endpoint \"fd00::1:80\" has an IPv6 host without brackets; write \"[fd00::1]:80\"",
        "document 3 (RouteConfig): destination: 10.1.2.3/16 has host bits set; the kernel would use 10.1.0.0/16",
        &format!("config rejected (2 error(s)); the node keeps its previous config (version {vb})"),
    ] {
        assert!(err.contains(want), "{want:?} in {err}");
    }
    let st = node.status_until("API rejection recorded", |s| s["lastErrorSource"] == "api");
    assert_eq!(st["acceptedVersion"], vb.as_str());
    sigterm_and_wait(child);

    // Restarted with an invalid file: starts from the last good copy and says so.
    std::fs::write(&node.config, "apiVersion: v1alpha1\nkind: [\n").unwrap();
    let _child = node.start();
    let st = node.status_until("started from the last good copy", |s| {
        s["acceptedVersion"] == vb.as_str()
    });
    assert_eq!(st["source"], last_good.display().to_string().as_str());
    assert_eq!(st["lastAttempt"], "rejected");
    assert_eq!(st["lastErrorSource"], cfg.as_str());
    assert!(
        st["lastError"].as_str().unwrap().contains("not valid YAML"),
        "{st}"
    );
    let specs = stdout(&node.cli(&["get", "probespecs"]));
    assert!(specs.contains("tcp:127.0.0.1:1"), "{specs}");

    // Fixing the file is picked up.
    std::fs::write(&node.config, A).unwrap();
    node.status_until("fixed file accepted", |s| {
        s["acceptedVersion"] == va.as_str() && s["lastAttempt"] == "accepted"
    });
}

#[test]
fn a_bad_config_file_without_a_last_good_copy_is_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::new(dir.path());
    std::fs::write(&node.config, "").unwrap();
    let mut child = ChildGuard(
        node.command()
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(st) = child.0.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "node did not exit");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!status.success());
    let mut err = String::new();
    std::io::Read::read_to_string(child.0.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(err.contains(EMPTY), "{err}");
    assert!(err.contains("no last good config to fall back to"), "{err}");
}
