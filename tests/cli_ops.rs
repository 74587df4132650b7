//! Operating wirespan: `--version`, shell completions, man pages, the systemd units
//! (`systemd-analyze verify`) and readiness notification, `wirespan doctor` and
//! `wirespan status` against running nodes.

mod common;

use std::{
    os::unix::net::UnixDatagram,
    path::Path,
    process::{Command, Output},
    time::Duration,
};

use common::{cli, lab::Lab, stdout, wait_for_path, ChildGuard, BIN};
use serde_json::Value;
use wirespan_dataplane::netns::NetnsGuard;

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("WIRESPAN_SOCKET")
        .env_remove("WIRESPAN_CONFIG")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap()
}

/// A datagram socket to stand in for systemd's `$NOTIFY_SOCKET`.
fn notify_socket(dir: &Path) -> (UnixDatagram, std::path::PathBuf) {
    let path = dir.join("notify.sock");
    let sock = UnixDatagram::bind(&path).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    (sock, path)
}

/// The next datagram on `sock`. Waits up to 30 s while `child` runs; when it exits or
/// time runs out, fails with its stderr (`log`) and the binary's version.
fn next_notification(sock: &UnixDatagram, child: &mut ChildGuard, log: &Path) -> String {
    sock.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut buf = [0u8; 512];
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let why = loop {
        if let Ok(n) = sock.recv(&mut buf) {
            return String::from_utf8(buf[..n].to_vec()).unwrap();
        }
        if let Some(st) = child.0.try_wait().unwrap() {
            break format!("exited ({st}) without notifying");
        }
        if std::time::Instant::now() > deadline {
            break "no notification within 30 s".to_owned();
        }
    };
    let version = String::from_utf8_lossy(&run(&["--version"]).stdout).into_owned();
    panic!(
        "{why}; {BIN} is {}stderr:\n{}",
        version,
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

/// A file for a child's stderr.
fn log_file(dir: &Path, name: &str) -> (std::path::PathBuf, std::fs::File) {
    let path = dir.join(name);
    let f = std::fs::File::create(&path).unwrap();
    (path, f)
}

fn sigterm(child: &ChildGuard) {
    let pid = child.0.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
}

#[test]
fn version_names_the_git_commit() {
    let out = stdout(&run(&["--version"]));
    let (name, commit) = out
        .trim()
        .strip_suffix(')')
        .and_then(|s| s.split_once(" ("))
        .unwrap_or_else(|| panic!("{out:?}"));
    assert_eq!(name, concat!("wirespan ", env!("CARGO_PKG_VERSION")));
    let head = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8(o.stdout).unwrap().trim().to_owned());
    assert_eq!(commit, head.as_deref().unwrap_or("unknown"));
    // Subcommands say the same.
    assert_eq!(
        stdout(&run(&["status", "--version"])).trim(),
        format!("wirespan-status {}", &out.trim()[9..])
    );
}

#[test]
fn bash_completions_load_and_other_shells_generate() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("wirespan.bash");
    std::fs::write(&script, stdout(&run(&["completions", "bash"]))).unwrap();
    let o = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "source {} && complete -p wirespan",
            script.display()
        ))
        .output()
        .unwrap();
    let out = stdout(&o);
    assert!(
        out.contains("-F _wirespan") && out.trim_end().ends_with(" wirespan"),
        "{out}"
    );
    // The script knows the subcommands.
    let text = std::fs::read_to_string(&script).unwrap();
    for sub in ["status", "doctor", "completions", "install"] {
        assert!(text.contains(sub), "{sub}");
    }
    assert!(stdout(&run(&["completions", "zsh"])).starts_with("#compdef wirespan"));
    assert!(stdout(&run(&["completions", "fish"])).contains("complete -c wirespan"));
    assert!(!run(&["completions", "tcsh"]).status.success());
}

#[test]
fn man_pages_for_every_subcommand() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("man1");
    let listed = stdout(&run(&["man", "--out", out.to_str().unwrap()]));
    for page in [
        "wirespan.1",
        "wirespan-node.1",
        "wirespan-discovery.1",
        "wirespan-status.1",
        "wirespan-doctor.1",
        "wirespan-install-systemd.1",
        "wirespan-gen-cluster.1",
        "wirespan-lab.1",
    ] {
        let path = out.join(page);
        assert!(
            listed.contains(path.to_str().unwrap()),
            "{page} not listed: {listed}"
        );
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(".TH"), "{page}");
    }
    let node = std::fs::read_to_string(out.join("wirespan-node.1")).unwrap();
    assert!(node.contains("state\\-dir"), "{node}");
}

/// Installs the units under a temp prefix, running the test binary, with man pages
/// where `man` finds them (the units' `Documentation=` links are checked too).
fn install_units(prefix: &Path) -> Vec<std::path::PathBuf> {
    let listed = stdout(&run(&[
        "install",
        "systemd",
        "--prefix",
        prefix.to_str().unwrap(),
        "--bin",
        BIN,
    ]));
    stdout(&run(&[
        "man",
        "--out",
        prefix.join("share/man/man1").to_str().unwrap(),
    ]));
    listed.lines().map(Into::into).collect()
}

fn verify(unit: &Path, manpath: &Path) -> Output {
    Command::new("systemd-analyze")
        .arg("verify")
        .arg(unit)
        .env("MANPATH", manpath)
        .output()
        .expect("systemd-analyze (scripts/setup.sh installs it)")
}

#[test]
fn systemd_units_verify_and_a_broken_one_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let units = install_units(dir.path());
    let names: Vec<_> = units
        .iter()
        .map(|u| u.file_name().unwrap().to_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["wirespan-node.service", "wirespan-discovery.service"]
    );
    let manpath = dir.path().join("share/man");
    for unit in &units {
        assert!(unit.starts_with(dir.path().join("lib/systemd/system")));
        let text = std::fs::read_to_string(unit).unwrap();
        assert!(text.contains(&format!("ExecStart={BIN} ")), "{text}");
        let o = verify(unit, &manpath);
        assert!(
            o.status.success() && o.stderr.is_empty(),
            "{}: {}\n{}",
            unit.display(),
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
    }
    // The check can fail: a misspelt key and a bad value are reported.
    let bad = dir.path().join("lib/systemd/system/wirespan-bad.service");
    let text = std::fs::read_to_string(&units[0])
        .unwrap()
        .replace("Type=notify", "Type=notfy")
        .replace("Restart=on-failure", "Restrat=on-failure");
    std::fs::write(&bad, text).unwrap();
    let o = verify(&bad, &manpath);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("notfy") && err.contains("Restrat"), "{err}");
}

/// The capabilities `CapabilityBoundingSet=` of the node unit grants.
fn node_unit_capabilities() -> Vec<String> {
    let unit = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/systemd/wirespan-node.service"),
    )
    .unwrap();
    let line = unit
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .unwrap();
    line.split_whitespace()
        .map(|c| c.trim_start_matches("CAP_").to_lowercase())
        .collect()
}

fn doctor_line<'a>(out: &'a str, check: &str) -> &'a str {
    out.lines()
        .find(|l| l.split_whitespace().nth(1) == Some(check))
        .unwrap_or_else(|| panic!("no {check} line:\n{out}"))
}

const CHECKS: [&str; 10] = [
    "privileges",
    "wireguard",
    "nft",
    "nf_tables",
    "bpf",
    "tc",
    "ip_forward",
    "rp_filter",
    "src_valid_mark",
    "listen_port",
];

/// `wirespan doctor ARGS…` in `ns` (its probes create a WireGuard link and bind the
/// port; the host's namespace is left alone), under `wrap` (e.g. `setpriv …`).
fn doctor_in(ns: &NetnsGuard, wrap: &[&str], args: &[&str]) -> Output {
    Command::new("ip")
        .args(["netns", "exec", ns.name()])
        .args(wrap)
        .args([BIN, "doctor"])
        .args(args)
        .env_remove("WIRESPAN_CONFIG")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap()
}

#[test]
fn doctor_prints_every_check_and_fails_on_a_taken_port() {
    let ns = NetnsGuard::new("wsdr").unwrap();
    let o = doctor_in(&ns, &[], &["--port", "51820"]);
    let out = String::from_utf8(o.stdout.clone()).unwrap();
    for check in CHECKS {
        let l = doctor_line(&out, check);
        assert!(
            ["ok", "warn", "fail"].contains(&l.split_whitespace().next().unwrap()),
            "{l}"
        );
    }
    // The outcome is the host's; the exit status follows it.
    let failed = out.lines().any(|l| l.starts_with("fail"));
    assert_eq!(o.status.success(), !failed, "{out}");
    assert!(doctor_line(&out, "listen_port").starts_with("ok"), "{out}");
    assert!(
        out.lines().last().unwrap().starts_with("10 checks: "),
        "{out}"
    );

    // The port held in the namespace: a failure, named with its fix, and exit status 1.
    let thread = wirespan_dataplane::netns::NetnsThread::spawn(ns.netns()).unwrap();
    let held = thread
        .run(|| std::net::UdpSocket::bind("0.0.0.0:51820"))
        .unwrap()
        .unwrap();
    let o = doctor_in(&ns, &[], &["--port", "51820"]);
    let out = String::from_utf8(o.stdout).unwrap();
    assert!(
        doctor_line(&out, "listen_port").starts_with("fail"),
        "{out}"
    );
    assert!(out.contains("ss -ulpn sport = :51820"), "{out}");
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("check(s) failed"));
    drop(held);
}

/// The node unit's capability set is enough for nftables and the BPF fast path (the
/// probes doctor runs), and dropping CAP_BPF is noticed.
#[test]
fn node_unit_capabilities_suffice_for_nftables_and_bpf() {
    let caps = node_unit_capabilities();
    assert_eq!(caps, ["net_admin", "bpf", "perfmon"]);
    let ns = NetnsGuard::new("wscp").unwrap();
    let with = |caps: &[String]| {
        let set = format!(
            "-all,{}",
            caps.iter()
                .map(|c| format!("+{c}"))
                .collect::<Vec<_>>()
                .join(",")
        );
        let o = doctor_in(&ns, &["setpriv", "--bounding-set", &set], &[]);
        String::from_utf8(o.stdout).unwrap()
    };
    // The kernels this runs on load BPF classifiers: if even full capabilities cannot,
    // that is a failure here, not a reason to pass without checking.
    let all = String::from_utf8(doctor_in(&ns, &[], &[]).stdout).unwrap();
    assert!(
        doctor_line(&all, "bpf").contains("classifier loads"),
        "the BPF classifier does not load even with every capability:\n{all}"
    );
    let out = with(&caps);
    for check in ["nft", "nf_tables", "bpf"] {
        let l = doctor_line(&out, check);
        assert!(l.starts_with("ok"), "{l}\n{out}");
    }
    assert!(
        doctor_line(&out, "bpf").contains("classifier loads"),
        "{out}"
    );
    let out = with(&caps[..1]);
    assert!(doctor_line(&out, "bpf").contains("unavailable"), "{out}");
}

const CLUSTER: &str = "apiVersion: v1alpha1
kind: ClusterConfig
id: b3BzLXRlc3QtY2x1c3Rlci1pZC0wMDAwMDAwMDAwMDA=
secret: AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=
";

/// A node in its own network namespace with the mesh on and no discovery service:
/// `READY=1` only after the mesh is programmed, `wirespan status` describes it,
/// `STOPPING=1` on SIGTERM.
#[test]
fn node_notifies_readiness_and_status_summarises_it() {
    let ns = NetnsGuard::new("wsops").unwrap();
    // A link with a MAC for the KubeSpan address.
    ns.run(
        "ip",
        &[
            "link", "add", "eth9", "type", "veth", "peer", "name", "eth9p",
        ],
    )
    .unwrap();
    ns.run("ip", &["link", "set", "eth9", "up"]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("node.sock");
    // The userspace device's socket directory is the host's: a link name of this test
    // only.
    let link = format!("wso{}", std::process::id() % 100_000);
    let cfg = dir.path().join("config.yaml");
    std::fs::write(
        &cfg,
        format!("{CLUSTER}---\napiVersion: v1alpha1\nkind: KubeSpanConfig\nenabled: true\nlinkName: {link}\n"),
    )
    .unwrap();
    let (notify, notify_path) = notify_socket(dir.path());
    let (log, log_f) = log_file(dir.path(), "node.log");
    let child = Command::new("ip")
        .args(["netns", "exec", ns.name(), BIN, "--socket"])
        .arg(&socket)
        .arg("node")
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--config")
        .arg(&cfg)
        .env_remove("WIRESPAN_SOCKET")
        .env("NOTIFY_SOCKET", &notify_path)
        .stderr(log_f)
        .spawn()
        .unwrap();
    let mut node = ChildGuard(child);
    assert_eq!(next_notification(&notify, &mut node, &log), "READY=1");
    wait_for_path(&socket);
    // Ready means programmed: the manager's status is there at once.
    let o = cli(
        &socket,
        &["get", "KubeSpanManagerStatus", "kubespan", "-o", "json"],
    );
    let m: Value = serde_json::from_slice(&stdout(&o).into_bytes()).unwrap();
    assert_eq!(m["spec"]["linkName"], link.as_str());

    let text = stdout(&cli(&socket, &["status"]));
    let line = |label: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(label).filter(|r| r.starts_with("  ")))
            .map(str::trim)
            .unwrap_or_else(|| panic!("no {label}:\n{text}"))
            .to_owned()
    };
    assert!(
        line("mesh").starts_with(&format!("on, link {link}, address fd")),
        "{text}"
    );
    assert_eq!(line("fast path"), "nftables", "{text}");
    let wg = line("wireguard");
    assert!(
        wg == format!("kernel, {link} on UDP 51820")
            || wg == format!("userspace (wirespan wireguard), {link} on UDP 51820"),
        "{text}"
    );
    assert_eq!(line("peers"), "0", "{text}");
    assert_eq!(line("discovery"), "none configured", "{text}");
    // The accepted config's version: the first 16 hex digits of its SHA-256.
    let config = line("config");
    let version = config
        .strip_prefix("accepted version ")
        .and_then(|r| r.split_once(';'))
        .map(|(v, _)| v);
    assert!(
        version.is_some_and(|v| v.len() == 16 && v.bytes().all(|b| b.is_ascii_hexdigit())),
        "{text}"
    );
    assert!(config.ends_with("last error: none"), "{text}");
    assert_eq!(line("probes"), "none configured", "{text}");
    let node_id = line("node");
    assert!(node_id.len() >= 43, "{text}");

    let json: Value =
        serde_json::from_str(&stdout(&cli(&socket, &["status", "-o", "json"]))).unwrap();
    assert_eq!(json["node"], node_id.as_str());
    assert_eq!(json["peers"], "0");

    sigterm(&node);
    assert_eq!(next_notification(&notify, &mut node, &log), "STOPPING=1");
}

#[test]
fn status_of_a_stopped_node_says_it_is_not_running() {
    let dir = tempfile::tempdir().unwrap();
    let o = cli(&dir.path().join("none.sock"), &["status"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("none.sock"), "{err}");
}

/// The discovery server notifies once it listens: a connection right after `READY=1`
/// succeeds.
#[test]
fn discovery_notifies_readiness_when_it_listens() {
    let dir = tempfile::tempdir().unwrap();
    let (notify, notify_path) = notify_socket(dir.path());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let (log, log_f) = log_file(dir.path(), "discovery.log");
    let child = Command::new(BIN)
        .args(["discovery", "--listen", &addr])
        .env("NOTIFY_SOCKET", &notify_path)
        .stderr(log_f)
        .spawn()
        .unwrap();
    let mut server = ChildGuard(child);
    assert_eq!(next_notification(&notify, &mut server, &log), "READY=1");
    std::net::TcpStream::connect(&addr).expect("listening once ready");
    sigterm(&server);
    assert_eq!(next_notification(&notify, &mut server, &log), "STOPPING=1");
}

/// The discovery server's admission flags: bad values are refused naming the flag, and
/// the removed header-trust flags are gone (proxies are named with `--trusted-proxy`).
#[test]
fn discovery_admission_flags_are_checked() {
    let refused = |args: &[&str], needle: &str| {
        let out = Command::new(BIN)
            .args(["discovery", "--listen", "127.0.0.1:0"])
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(err.contains(needle), "{args:?}: {err}");
    };
    refused(&["--no-trust-x-real-ip"], "--no-trust-x-real-ip");
    refused(
        &["--no-trust-x-forwarded-for"],
        "--no-trust-x-forwarded-for",
    );
    refused(&["--trusted-proxy", "10.0.0.1/33"], "--trusted-proxy");
    refused(&["--affiliate-delete", "maybe"], "allow or refuse");
    refused(&["--max-clusters", "0"], "--max-clusters must be positive");
    refused(
        &["--state-budget-mib", "0"],
        "--state-budget-mib must be between",
    );
}

/// `wirespan status` inside a 2-node lab: the mesh up through a discovery server.
#[test]
fn status_in_a_lab_node_counts_peers_and_discovery() {
    let lab = Lab::new();
    lab.ok(&["up", "--nodes", "2", "--timeout", "45s", "--no-hints"]);
    let out = lab.exec_ok("node1", &["wirespan", "status", "-o", "json"]);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["peers"], "1/1 up", "{v}");
    assert!(
        v["discovery"]
            .as_str()
            .unwrap()
            .starts_with("1/1 connected"),
        "{v}"
    );
    assert!(
        v["mesh"].as_str().unwrap().starts_with("on, link kubespan"),
        "{v}"
    );

    // doctor on the same running node: every check answers, and the listen port in
    // use is recognised as the running mesh's own, not a conflict.
    let o = lab.exec("node1", &["wirespan", "doctor", "--port", "51820"]);
    let out = String::from_utf8(o.stdout).unwrap();
    for check in CHECKS {
        let l = doctor_line(&out, check);
        assert!(
            ["ok", "warn", "fail"].contains(&l.split_whitespace().next().unwrap()),
            "{l}\n{out}"
        );
    }
    let port = doctor_line(&out, "listen_port");
    assert!(
        port.starts_with("ok") && port.contains("the mesh is running"),
        "{out}"
    );
    let failed = out.lines().any(|l| l.starts_with("fail"));
    assert_eq!(o.status.success(), !failed, "{out}");
}
