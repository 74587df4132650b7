//! `wirespan node` as a child process: identity, socket, API, clean shutdown.

mod common;

use std::{os::unix::fs::PermissionsExt as _, process::Command, time::Duration};

use common::{bin_in, cli, stdout, wait_for_path, ChildGuard};
use wirespan_dataplane::netns::NetnsGuard;

fn start(ns: &NetnsGuard, dir: &std::path::Path) -> ChildGuard {
    let child = bin_in(ns)
        .arg("node")
        .arg("--socket")
        .arg(dir.join("run/node.sock"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .env_remove("WIRESPAN_SOCKET")
        .spawn()
        .unwrap();
    let guard = ChildGuard(child);
    wait_for_path(&dir.join("run/node.sock"));
    guard
}

fn sigterm_and_wait(mut g: ChildGuard) -> std::process::ExitStatus {
    let pid = g.0.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    for _ in 0..500 {
        if let Some(st) = g.0.try_wait().unwrap() {
            return st;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("node did not stop on SIGTERM");
}

fn node_id(socket: &std::path::Path) -> String {
    // The identity controller runs right after start; retry briefly.
    for _ in 0..200 {
        let o = cli(socket, &["get", "nodeidentity", "local", "-o", "json"]);
        if o.status.success() {
            let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            return v["spec"]["nodeId"].as_str().unwrap().to_owned();
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    panic!("no NodeIdentity");
}

#[test]
fn node_serves_identity_and_graph_and_stops_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("run/node.sock");
    let ns = NetnsGuard::new("wsnode").unwrap();
    let node = start(&ns, dir.path());
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);

    let id = node_id(&socket);
    let file = std::fs::read_to_string(dir.path().join("state/node-id")).unwrap();
    assert_eq!(file.trim(), id);
    assert!(
        (43..=52).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric()),
        "{id}"
    );
    let fmode = std::fs::metadata(dir.path().join("state/node-id"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(fmode & 0o777, 0o600);

    let table = stdout(&cli(&socket, &["get", "ni"]));
    assert!(
        table.lines().nth(1).unwrap().split_whitespace().eq([
            "cluster",
            "NodeIdentity",
            "local",
            "1",
            id.as_str()
        ]),
        "{table}"
    );
    let ns = stdout(&cli(&socket, &["get", "namespaces"]));
    for n in [
        "config",
        "network-config",
        "network",
        "cluster",
        "cluster-raw",
        "kubespan",
        "meta",
    ] {
        assert!(
            ns.lines().any(|l| l.split_whitespace().nth(2) == Some(n)),
            "{n} missing: {ns}"
        );
    }
    let dot = stdout(&cli(&socket, &["inspect", "dependencies"]));
    assert!(dot.starts_with("digraph"), "{dot}");
    assert!(
        dot.contains(
            "\"NodeIdentityController\" -> \"NodeIdentities.cluster.wirespan.dev\" [style=bold];"
        ),
        "{dot}"
    );
    let dot = stdout(&cli(
        &socket,
        &["inspect", "dependencies", "--with-resources"],
    ));
    assert!(
        dot.contains(
            "\"NodeIdentities.cluster.wirespan.dev\" -> \"NodeIdentities.cluster.wirespan.dev:cluster/local\""
        ),
        "{dot}"
    );
    // The Talos names resolve (their content is the host's: observed, not asserted).
    for alias in [
        "resolvers",
        "timeservers",
        "hostnamespecs",
        "resolverspecs",
        "timeserverspecs",
    ] {
        stdout(&cli(&socket, &["get", alias]));
    }

    assert!(sigterm_and_wait(node).success());
    assert!(!socket.exists(), "socket left behind");

    // The identity survives a restart.
    let ns = NetnsGuard::new("wsnode").unwrap();
    let node = start(&ns, dir.path());
    assert_eq!(node_id(&socket), id);
    assert!(sigterm_and_wait(node).success());
}

#[test]
fn second_node_on_the_same_socket_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ns = NetnsGuard::new("wsnode").unwrap();
    let _node = start(&ns, dir.path());
    let o = bin_in(&ns)
        .arg("node")
        .arg("--socket")
        .arg(dir.path().join("run/node.sock"))
        .arg("--state-dir")
        .arg(dir.path().join("state2"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("in use by another process"));
}

/// Whether the kernel can make a WireGuard link, tried in a throwaway namespace.
fn kernel_has_wireguard(ns: &NetnsGuard) -> bool {
    let ok = ns
        .run("ip", &["link", "add", "wsprobe0", "type", "wireguard"])
        .is_ok();
    if ok {
        ns.run("ip", &["link", "del", "wsprobe0"]).unwrap();
    }
    ok
}

/// `--wireguard kernel` where the kernel has no WireGuard: the daemon refuses to start
/// and names the missing module, instead of failing every reconcile; where it has,
/// the daemon runs.
#[test]
fn forced_kernel_wireguard_refuses_to_start_without_the_module() {
    let dir = tempfile::tempdir().unwrap();
    let ns = NetnsGuard::new("wsnode").unwrap();
    let kernel = kernel_has_wireguard(&ns);
    let child = bin_in(&ns)
        .arg("node")
        .arg("--socket")
        .arg(dir.path().join("run/node.sock"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .args(["--wireguard", "kernel"])
        .env_remove("WIRESPAN_SOCKET")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut g = ChildGuard(child);
    if kernel {
        wait_for_path(&dir.path().join("run/node.sock"));
        assert!(g.0.try_wait().unwrap().is_none(), "the daemon exited");
        assert!(sigterm_and_wait(g).success());
        return;
    }
    let mut status = None;
    for _ in 0..1000 {
        status = g.0.try_wait().unwrap();
        if status.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = status.expect("the daemon kept running without kernel WireGuard");
    assert!(!status.success());
    let mut err = String::new();
    std::io::Read::read_to_string(&mut g.0.stderr.take().unwrap(), &mut err).unwrap();
    assert!(
        err.contains("the `wireguard` kernel module is missing"),
        "{err}"
    );
}

/// The node under umask 000 (so nothing it creates is private by accident), with a
/// config so that the last good copy is written too; stderr to `log`.
fn start_under_umask_000(
    ns: &NetnsGuard,
    dir: &std::path::Path,
    log: &std::path::Path,
) -> ChildGuard {
    let config = dir.join("config.yaml");
    std::fs::write(
        &config,
        "apiVersion: v1alpha1\nkind: TCPProbeConfig\nname: b\nendpoint: 127.0.0.1:1\ninterval: 30s\n",
    )
    .unwrap();
    let child = Command::new("sh")
        .args(["-c", "umask 000 && exec \"$@\"", "sh"])
        .args(["ip", "netns", "exec", ns.name(), common::BIN, "node"])
        .arg("--socket")
        .arg(dir.join("run/node.sock"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--config")
        .arg(&config)
        .env_remove("WIRESPAN_SOCKET")
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let guard = ChildGuard(child);
    wait_for_path(&dir.join("run/node.sock"));
    guard
}

/// Every entry of the state dir and its mode, once the node ID and the last good
/// config are written.
fn state_modes(dir: &std::path::Path) -> Vec<(String, u32)> {
    node_id(&dir.join("run/node.sock"));
    let state = dir.join("state");
    wait_for_path(&state.join("last-good-config.yaml"));
    let mut modes: Vec<(String, u32)> = std::fs::read_dir(&state)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let mode = e.metadata().unwrap().permissions().mode() & 0o7777;
            (e.file_name().to_string_lossy().into_owned(), mode)
        })
        .collect();
    modes.sort();
    let dir_mode = std::fs::metadata(&state).unwrap().permissions().mode() & 0o7777;
    modes.insert(0, (".".to_owned(), dir_mode));
    modes
}

#[test]
fn under_umask_000_the_state_dir_is_0700_and_its_files_0600() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("node.log");
    let ns = NetnsGuard::new("wsnode").unwrap();
    let want = vec![
        (".".to_owned(), 0o700),
        ("last-good-config.yaml".to_owned(), 0o600),
        ("node-id".to_owned(), 0o600),
    ];

    // Created by the node.
    let node = start_under_umask_000(&ns, dir.path(), &log);
    assert_eq!(state_modes(dir.path()), want);
    assert!(sigterm_and_wait(node).success());

    // Found open to everyone: tightened, and the node says so.
    let state = dir.path().join("state");
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o777)).unwrap();
    let node = start_under_umask_000(&ns, dir.path(), &log);
    assert_eq!(state_modes(dir.path()), want);
    assert!(sigterm_and_wait(node).success());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("state dir was open to other users; set it to 0700"),
        "{text}"
    );
}
