//! `wirespan lab` with the real binary: namespaces, underlay, discovery server, daemons,
//! status, exec, and `down` — also after `up` or a daemon was killed with SIGKILL.
//!
//! Every lab has a unique name and a guard that runs `lab down` even when the test
//! fails. Until the mesh controllers land the peers never come up, so the labs here
//! start with `--no-wait` (or a timeout that is expected to expire).

mod common;

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use common::{
    lab::{alive, pid_of, wait_until, Lab},
    BIN,
};
use serde_json::Value;

#[test]
fn up_builds_nodes_underlay_discovery_and_daemons_and_down_removes_them() {
    let lab = Lab::new();
    let up = lab.run(&["up", "--nodes", "2", "--no-wait"]);
    assert!(
        up.status.success(),
        "{}",
        String::from_utf8_lossy(&up.stderr)
    );
    let p = lab.prefix();
    let mut ns = lab.namespaces();
    ns.sort();
    assert_eq!(
        ns,
        [
            format!("{p}disco"),
            format!("{p}node1"),
            format!("{p}node2"),
            format!("{p}underlay")
        ]
    );

    // status -o json: everything a script needs.
    let st = lab.status();
    assert_eq!(st["name"], lab.name.as_str());
    assert_eq!(st["dir"], lab.dir().to_str().unwrap());
    let cluster = PathBuf::from(st["clusterConfig"].as_str().unwrap());
    assert_eq!(st["discovery"]["namespace"], format!("{p}disco").as_str());
    assert_eq!(st["discovery"]["address"], "10.99.1.2:3000");
    assert_eq!(st["discovery"]["running"], true);
    let nodes = st["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 2);
    for (i, n) in nodes.iter().enumerate() {
        let name = format!("node{}", i + 1);
        assert_eq!(n["name"], name.as_str());
        assert_eq!(n["namespace"], format!("{p}{name}").as_str());
        assert_eq!(n["daemon"], "running");
        let underlay: Vec<&str> = n["addresses"]["underlay"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        let host = 11 + i;
        assert_eq!(
            underlay,
            [
                format!("10.99.1.{host}"),
                format!("10.99.2.{host}"),
                format!("fd99:1ab::{host:x}")
            ]
        );
        for key in [
            "socket",
            "config",
            "stateDir",
            "log",
            "mountNamespace",
            "utsNamespace",
        ] {
            assert!(
                Path::new(n[key].as_str().unwrap()).exists(),
                "{key} of {name}: {n}"
            );
        }
        // Present even before the mesh has them (null until known).
        for key in ["publicKey", "peers"] {
            assert!(n.get(key).is_some(), "{key} missing: {n}");
        }
        assert!(n["addresses"].get("kubespan").is_some());
        assert!(n["peers"].is_array());
        let mode = std::fs::metadata(n["config"].as_str().unwrap())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    assert_eq!(
        std::fs::metadata(&cluster).unwrap().permissions().mode() & 0o777,
        0o600
    );

    // The secret is in the config file and nowhere in the output.
    let text = std::fs::read_to_string(&cluster).unwrap();
    let secret = text
        .lines()
        .find_map(|l| l.strip_prefix("secret: "))
        .unwrap()
        .trim_matches('\'');
    assert_eq!(secret.len(), 44);
    for out in [&up.stdout, &up.stderr] {
        assert!(!String::from_utf8_lossy(out).contains(secret));
    }
    assert!(!lab.ok(&["status"]).contains(secret));
    assert!(!lab.ok(&["status", "-o", "json"]).contains(secret));

    // Every daemon's API answers, each with its own identity.
    let mut ids = Vec::new();
    for n in nodes {
        let o = Command::new(BIN)
            .args(["--socket", n["socket"].as_str().unwrap()])
            .args(["get", "nodeidentity", "local", "-o", "json"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        ids.push(v["spec"]["nodeId"].as_str().unwrap().to_owned());
    }
    assert_ne!(ids[0], ids[1]);

    // exec runs inside the node: its hostname, its addresses, its own /run/wireguard,
    // and WIRESPAN_SOCKET pointing at its daemon.
    assert_eq!(lab.exec_ok("node1", &["hostname"]).trim(), "node1");
    assert_eq!(lab.exec_ok("node2", &["hostname"]).trim(), "node2");
    let addrs: Value = serde_json::from_str(&lab.exec_ok("node1", &["ip", "-j", "addr"])).unwrap();
    let eth0 = addrs
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["ifname"] == "eth0")
        .expect("eth0 in node1");
    let local: Vec<&str> = eth0["addr_info"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["local"].as_str().unwrap())
        .collect();
    for a in ["10.99.1.11", "10.99.2.11", "fd99:1ab::b"] {
        assert!(local.contains(&a), "{a} not on node1's eth0: {local:?}");
    }
    assert_eq!(
        lab.exec_ok(
            "node1",
            &["findmnt", "-n", "-o", "FSTYPE", "/run/wireguard"]
        )
        .trim(),
        "tmpfs"
    );
    let ni = lab.exec_ok(
        "node2",
        &["wirespan", "get", "nodeidentity", "local", "-o", "json"],
    );
    assert!(ni.contains(&ids[1]), "{ni}");
    // The command's exit code is exec's.
    assert_eq!(
        lab.exec("node1", &["sh", "-c", "exit 7"]).status.code(),
        Some(7)
    );

    // Traffic reaches node2 on all three of its addresses. They are node addresses, so
    // the mesh (not waited for here) marks them into the tunnel, where they are dropped
    // until the first handshake (allowDownPeerBypass is off): one reply within a
    // deadline, not the first packet.
    for a in ["10.99.1.12", "10.99.2.12", "fd99:1ab::c"] {
        lab.exec_ok("node1", &["ping", "-n", "-c", "1", "-w", "20", a]);
    }
    // The discovery server answers on the underlay (its landing page).
    let page = lab.exec_ok("node1", &["curl", "-sf", "http://10.99.1.2:2122/"]);
    assert!(page.contains("wirespan discovery"), "{page}");
    // And its gRPC API: grpc.health.v1.Health/Check with an empty request (one
    // uncompressed frame of length 0) gets SERVING (field 1 = 1).
    let tmp = tempfile::tempdir().unwrap();
    let request = tmp.path().join("health-check.grpc");
    std::fs::write(&request, [0u8; 5]).unwrap();
    let o = lab.exec(
        "node1",
        &[
            "curl",
            "-sf",
            "--http2-prior-knowledge",
            "-H",
            "content-type: application/grpc",
            "-H",
            "te: trailers",
            "--data-binary",
            &format!("@{}", request.display()),
            "http://10.99.1.2:3000/grpc.health.v1.Health/Check",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.stdout, [0, 0, 0, 0, 2, 0x08, 0x01], "not SERVING");
    // The host's namespace is not on the underlay: none of its addresses is in the
    // lab's ranges. (Checked on the host's own addresses: a test never sends packets
    // from the host namespace towards private ranges.)
    let o = Command::new("ip").args(["-j", "addr"]).output().unwrap();
    let host_addrs = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success());
    assert!(
        !host_addrs.contains("\"10.99.") && !host_addrs.contains("\"fd99:1ab:"),
        "the host has an underlay address: {host_addrs}"
    );

    // A second lab of the same name is refused; the first is untouched.
    let again = lab.run(&["up", "--nodes", "1", "--no-wait"]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
    assert_eq!(lab.namespaces().len(), 4);

    let mut pids = lab.pids();
    pids.extend(nodes.iter().map(pid_of));
    pids.push(pid_of(&st["discovery"]));
    assert!(pids.iter().all(|p| alive(*p)));
    let out = lab.ok(&["down"]);
    assert!(out.contains("removed"), "{out}");
    lab.assert_gone(&pids);
    // Idempotent.
    assert!(lab.ok(&["down"]).contains("nothing to remove"));
}

#[test]
fn down_removes_everything_after_up_was_killed_midway() {
    // `up` is fast; kill it as soon as node1's namespace exists and a process of the
    // lab runs in a namespace (the discovery server, started before the nodes, may
    // still be entering its own), and retry when it got as far as writing its state
    // file anyway.
    for _ in 0..5 {
        let lab = Lab::new();
        let mut up = lab
            .cmd(&["up", "--nodes", "3", "--no-wait"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let node1 = PathBuf::from(format!("/run/netns/{}node1", lab.prefix()));
        let deadline = Instant::now() + Duration::from_secs(20);
        while !node1.exists() || lab.pids().is_empty() {
            assert!(
                Instant::now() < deadline,
                "node1's namespace and a lab process never appeared"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        up.kill().unwrap();
        up.wait().unwrap();
        let midway = !lab.dir().join("state.json").exists();
        let pids = lab.pids();
        assert!(!pids.is_empty(), "no process was running yet");
        let out = lab.ok(&["down"]);
        assert!(out.contains("removed"), "{out}");
        lab.assert_gone(&pids);
        if midway {
            return;
        }
    }
    panic!("`up` always finished before it could be killed");
}

#[test]
fn down_removes_everything_after_a_daemon_was_killed() {
    let lab = Lab::new();
    lab.ok(&["up", "--nodes", "2", "--no-wait"]);
    let st = lab.status();
    let victim = pid_of(&st["nodes"][0]);
    nix_kill9(victim);
    wait_until("the daemon to die", || !alive(victim));
    let st = lab.status();
    assert_eq!(st["nodes"][0]["daemon"], "exited");
    assert_eq!(st["nodes"][1]["daemon"], "running");
    let mut pids = lab.pids();
    pids.push(victim);
    lab.ok(&["down"]);
    lab.assert_gone(&pids);
}

#[test]
fn up_that_times_out_names_the_peers_and_leaves_the_lab_up() {
    let lab = Lab::new();
    let o = lab.run(&["up", "--nodes", "2", "--timeout", "1ms"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("node1: peer node2"), "{err}");
    assert!(err.contains("node2: peer node1"), "{err}");
    assert!(err.contains("left up for inspection"), "{err}");
    assert!(
        err.contains(&format!("{}/node*/node.log", lab.dir().display())),
        "{err}"
    );
    // Still there to look at.
    let st = lab.status();
    assert_eq!(st["nodes"][1]["daemon"], "running");
    assert_eq!(lab.exec_ok("node2", &["hostname"]).trim(), "node2");
}

#[test]
fn up_of_one_node_has_no_peers_to_wait_for_and_prints_the_summary() {
    let lab = Lab::new();
    let o = lab.run(&["up", "--nodes", "1", "--timeout", "10s"]);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{err}");
    assert!(err.contains("every peer up"), "{err}");
    let summary = out.lines().nth(1).unwrap();
    assert_eq!(
        summary.split_whitespace().next_back(),
        Some("running"),
        "{out}"
    );
    assert!(out.contains("ping underlay"), "{out}");
    assert!(out.contains(&format!("--name {} down", lab.name)), "{out}");
}

#[test]
fn bad_names_and_unknown_nodes_are_refused() {
    let o = Command::new(BIN)
        .args(["lab", "up", "--name", "Bad-Name"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("lowercase letters and digits"));
    let lab = Lab::new();
    let o = lab.run(&["status"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains(&format!("no lab {}", lab.name)));
    lab.ok(&["up", "--nodes", "1", "--no-wait"]);
    let o = lab.exec("node9", &["true"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("has no node \"node9\" (nodes: node1)"));
}

fn nix_kill9(pid: i32) {
    assert!(Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap()
        .success());
}

#[test]
fn underlay_rules_that_cannot_load_are_refused() {
    // A missing file: refused before anything is made.
    let lab = Lab::new();
    let o = lab.run(&[
        "up",
        "--nodes",
        "1",
        "--no-wait",
        "--underlay-nft",
        "/nonexistent.nft",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--underlay-nft /nonexistent.nft"), "{err}");
    assert!(lab.namespaces().is_empty(), "{:?}", lab.namespaces());
    assert!(!lab.dir().exists());

    // Rules nft rejects: the error names the flag and nft's complaint; `down` cleans up.
    let bad = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(bad.path(), "table bridge t { chain c { nonsense } }\n").unwrap();
    let o = lab.run(&[
        "up",
        "--nodes",
        "1",
        "--no-wait",
        "--underlay-nft",
        bad.path().to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("loading --underlay-nft") && err.contains("nft"),
        "{err}"
    );
    let pids = lab.pids();
    lab.ok(&["down"]);
    lab.assert_gone(&pids);
}

/// Issue 16 item 8: `lab down --after-exit PID` removes the lab once PID is gone, even
/// by SIGKILL (no chance to clean up): what keeps a killed test from leaving its lab.
#[test]
fn down_after_exit_removes_the_lab_when_its_owner_is_killed() {
    let lab = Lab::new();
    lab.ok(&["up", "--nodes", "1", "--no-wait"]);
    let pids = lab.pids();
    assert!(!pids.is_empty());
    let mut owner = Command::new("sleep").arg("600").spawn().unwrap();
    let mut watchdog = lab
        .cmd(&["down", "--after-exit", &owner.id().to_string()])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // The watchdog waits while its owner lives: the lab is still there once the
    // watchdog is certainly blocked (it has opened its pidfd and polls).
    wait_until("the watchdog to block", || {
        std::fs::read_to_string(format!("/proc/{}/wchan", watchdog.id()))
            .is_ok_and(|w| w.contains("poll"))
    });
    assert!(
        !lab.namespaces().is_empty(),
        "removed before its owner exited"
    );
    owner.kill().unwrap();
    owner.wait().unwrap();
    let status = watchdog.wait().unwrap();
    assert!(status.success(), "{status:?}");
    lab.assert_gone(&pids);
}

/// The userspace WireGuard processes in namespace `ns`: `wireguard-go`, or
/// `wirespan wireguard` (named `wirespan-wireguard` here), one entry per process.
/// The `lab status` entry of `node`.
fn node_status<'a>(st: &'a Value, node: &str) -> &'a Value {
    st["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == node)
        .unwrap_or_else(|| panic!("no {node} in {st}"))
}

/// Pings node1 ↔ node2 over their mesh addresses (`lab status` JSON `st`).
fn ping_mesh_both_ways(lab: &Lab, st: &Value) {
    for (from, to) in [("node1", "node2"), ("node2", "node1")] {
        let ula = node_status(st, to)["addresses"]["kubespan"]
            .as_str()
            .unwrap();
        let ula = ula.split('/').next().unwrap();
        lab.exec_ok(
            from,
            &["ping", "-n", "-q", "-c", "3", "-i", "0.2", "-w", "20", ula],
        );
    }
}

fn userspace_wireguard_in(ns: &str) -> Vec<&'static str> {
    userspace_wireguard_pids(ns)
        .into_iter()
        .map(|(_, name)| name)
        .collect()
}

/// As [`userspace_wireguard_in`], with each process's pid.
fn userspace_wireguard_pids(ns: &str) -> Vec<(i32, &'static str)> {
    let out = Command::new("ip")
        .args(["netns", "pids", ns])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            let name = if args[0].ends_with(b"wireguard-go") {
                "wireguard-go"
            } else if args.get(1) == Some(&b"wireguard".as_slice()) {
                "wirespan-wireguard"
            } else {
                return None;
            };
            Some((pid.parse().ok()?, name))
        })
        .collect()
}

/// Whether this kernel can make a WireGuard link, asked with `ip` in a throwaway
/// namespace (`unshare --net`): independent of the product's own probe.
fn kernel_has_wireguard() -> bool {
    Command::new("unshare")
        .args([
            "--net",
            "ip",
            "link",
            "add",
            "wstestprobe",
            "type",
            "wireguard",
        ])
        .output()
        .unwrap()
        .status
        .success()
}

/// `--wireguard userspace-go` runs wireguard-go on every node and `lab status` (JSON
/// and table) says so per node.
#[test]
fn up_with_wireguard_go_reports_it_for_every_node() {
    let lab = Lab::new();
    let out = lab.ok(&[
        "up",
        "--nodes",
        "2",
        "--wireguard",
        "userspace-go",
        "--timeout",
        "45s",
        "--no-hints",
    ]);
    let st = lab.status();
    assert_eq!(st["wireguard"], "userspace-go");
    for n in st["nodes"].as_array().unwrap() {
        assert_eq!(n["wireguard"], "userspace-go", "{n}");
        assert_eq!(
            userspace_wireguard_in(n["namespace"].as_str().unwrap()),
            ["wireguard-go"],
            "{n}"
        );
    }
    // The summary table has the column.
    let header = out.lines().next().unwrap();
    assert!(header.contains("WIREGUARD"), "{out}");
    let text = lab.ok(&["status"]);
    for row in text.lines().skip(1).take(2) {
        assert!(row.contains("userspace-go"), "{text}");
    }
}

/// The default (`auto`) runs kernel WireGuard where the kernel has it, else `wirespan
/// wireguard`; a node given `userspace-go` runs wireguard-go beside it, and the two
/// userspace implementations (or wireguard-go and the kernel) mesh: pings through the
/// tunnel both ways. Each userspace process killed (-9) is started again by its node's
/// supervisor, which programs it again: the pings cross again.
#[test]
fn auto_runs_wirespan_wireguard_and_meshes_with_a_wireguard_go_node() {
    let lab = Lab::new();
    lab.ok(&[
        "up",
        "--nodes",
        "2",
        "--wireguard",
        "node1=userspace-go",
        "--timeout",
        "90s",
        "--no-hints",
    ]);
    let st = lab.status();
    let node2 = if kernel_has_wireguard() {
        ("kernel", Vec::<&str>::new())
    } else {
        ("userspace", vec!["wirespan-wireguard"])
    };
    for (node, (want, procs)) in [
        ("node1", ("userspace-go", vec!["wireguard-go"])),
        ("node2", node2),
    ] {
        assert_eq!(lab.backend(node), want);
        let n = node_status(&st, node);
        assert_eq!(
            userspace_wireguard_in(n["namespace"].as_str().unwrap()),
            procs,
            "{n}"
        );
    }
    ping_mesh_both_ways(&lab, &st);
    for n in st["nodes"].as_array().unwrap() {
        let ns = n["namespace"].as_str().unwrap();
        for (pid, name) in userspace_wireguard_pids(ns) {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            )
            .unwrap();
            wait_until(&format!("a new {name} in {ns}"), || {
                userspace_wireguard_pids(ns)
                    .iter()
                    .any(|(p, m)| *p != pid && *m == name)
            });
        }
    }
    ping_mesh_both_ways(&lab, &st);
}

/// `--wireguard kernel`: on a kernel without WireGuard `up` fails at once, naming the
/// missing module, and makes nothing; on one with it every node runs kernel WireGuard
/// (no userspace process).
#[test]
fn up_with_kernel_wireguard_fails_fast_without_the_module_or_runs_it() {
    let lab = Lab::new();
    let o = lab.run(&[
        "up",
        "--nodes",
        "2",
        "--wireguard",
        "kernel",
        "--timeout",
        "45s",
        "--no-hints",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    if !kernel_has_wireguard() {
        assert!(!o.status.success(), "{err}");
        assert!(
            err.contains("the `wireguard` kernel module is missing"),
            "{err}"
        );
        assert!(err.contains("userspace (wirespan wireguard)"), "{err}");
        assert!(lab.namespaces().is_empty(), "{:?}", lab.namespaces());
        assert!(!lab.dir().exists());
        return;
    }
    assert!(o.status.success(), "{err}");
    let st = lab.status();
    for n in st["nodes"].as_array().unwrap() {
        assert_eq!(n["wireguard"], "kernel", "{n}");
        assert!(
            userspace_wireguard_in(n["namespace"].as_str().unwrap()).is_empty(),
            "{n}"
        );
    }
}

/// A mixed lab: `--wireguard node1=kernel,node2=userspace` runs kernel WireGuard on
/// node1 and `wirespan wireguard` on node2, and the two mesh (both peers up, pings through the
/// tunnel). Where the kernel has no WireGuard, `up` refuses as for `--wireguard
/// kernel`. A node not in the lab is refused by name, making nothing.
#[test]
fn a_mixed_lab_runs_kernel_wireguard_and_wirespan_wireguard_side_by_side() {
    let lab = Lab::new();
    let bad = lab.run(&[
        "up",
        "--nodes",
        "2",
        "--wireguard",
        "node3=kernel",
        "--no-hints",
    ]);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success(), "{err}");
    assert!(
        err.contains("\"node3\"") && err.contains("node1, node2"),
        "{err}"
    );
    assert!(lab.namespaces().is_empty(), "{:?}", lab.namespaces());

    let o = lab.run(&[
        "up",
        "--nodes",
        "2",
        "--wireguard",
        "node1=kernel,node2=userspace",
        "--timeout",
        "180s",
        "--no-hints",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    if !kernel_has_wireguard() {
        assert!(!o.status.success(), "{err}");
        assert!(
            err.contains("the `wireguard` kernel module is missing"),
            "{err}"
        );
        assert!(lab.namespaces().is_empty(), "{:?}", lab.namespaces());
        return;
    }
    assert!(o.status.success(), "{err}");
    let st = lab.status();
    assert_eq!(st["wireguard"], "node1=kernel,node2=userspace");
    for (node, want, procs) in [
        ("node1", "kernel", Vec::<&str>::new()),
        ("node2", "userspace", vec!["wirespan-wireguard"]),
    ] {
        assert_eq!(lab.backend(node), want);
        common::ran::record("wireguard", want);
        let n = node_status(&st, node);
        assert_eq!(
            userspace_wireguard_in(n["namespace"].as_str().unwrap()),
            procs,
            "{n}"
        );
    }
    // `up` waited for both peers; the tunnel (each node's mesh address) carries
    // traffic both ways.
    ping_mesh_both_ways(&lab, &st);
}
