//! End to end: the real binary as a mesh of nodes in `wirespan lab` (network, mount and
//! UTS namespaces per node, a discovery server, userspace WireGuard), real traffic.
//!
//! Every lab has a unique name and is removed by its guard even when a test fails.
//! Assertions read the kernel (`wg show … dump`, `nft -j`, `ip -j`) inside the nodes;
//! traffic only ever flows between the lab's own namespaces.

mod common;

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use common::{lab::Lab, BIN};
use serde_json::Value;

/// Brings a lab of `nodes` up and waits (inside `lab up`) until every peer is up.
fn mesh(nodes: usize) -> Lab {
    let lab = Lab::new();
    lab.ok(&[
        "up",
        "--nodes",
        &nodes.to_string(),
        "--timeout",
        "45s",
        "--no-hints",
    ]);
    lab
}

/// Polls `f` until it returns `Some` or 30 s pass.
fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `wirespan get TYPE -o json` inside a node: the stream of resources.
fn get(lab: &Lab, node: &str, ty: &str) -> Vec<Value> {
    let o = lab.exec(node, &["wirespan", "get", ty, "-o", "json"]);
    if !o.status.success() {
        return Vec::new();
    }
    serde_json::Deserializer::from_slice(&o.stdout)
        .into_iter::<Value>()
        .filter_map(Result::ok)
        .collect()
}

fn peers_up(lab: &Lab, node: &str, want: usize) -> bool {
    let peers = get(lab, node, "peers");
    peers.len() == want && peers.iter().all(|p| p["spec"]["state"] == "up")
}

/// Received and sent bytes of one WireGuard peer of `node`'s mesh link. Only the two
/// counters leave this function (the dump also lists keys).
fn wg_bytes(lab: &Lab, node: &str, public_key: &str) -> (u64, u64) {
    let dump = lab.exec_ok(node, &["wg", "show", "kubespan", "dump"]);
    dump.lines()
        .skip(1)
        .map(|l| l.split('\t').collect::<Vec<_>>())
        .find(|f| f.first() == Some(&public_key))
        .map(|f| (f[5].parse().unwrap(), f[6].parse().unwrap()))
        .unwrap_or_else(|| panic!("{node} has no WireGuard peer {public_key}"))
}

/// Packets counted by the output chain's IPv4 mark rule of `node`.
fn marked_packets(lab: &Lab, node: &str) -> u64 {
    let out = lab.exec_ok(
        node,
        &[
            "nft",
            "-j",
            "list",
            "chain",
            "inet",
            "wirespan",
            "kubespan_outgoing",
        ],
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    v["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o.get("rule"))
        .filter(|r| {
            r["comment"]
                .as_str()
                .is_some_and(|c| c.starts_with("wirespan:mark:v4"))
        })
        .flat_map(|r| r["expr"].as_array().unwrap().iter())
        .filter_map(|e| e.get("counter"))
        .map(|c| c["packets"].as_u64().unwrap())
        .sum()
}

fn node<'a>(status: &'a Value, name: &str) -> &'a Value {
    status["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == name)
        .unwrap()
}

/// Five echo replies of `size` bytes from `to`, within a 20 s deadline (a packet lost
/// to a busy CI machine is resent, not a failure).
fn ping(lab: &Lab, from: &str, to: &str, size: &str) {
    lab.exec_ok(
        from,
        &[
            "ping", "-n", "-q", "-c", "5", "-i", "0.2", "-s", size, "-w", "20", to,
        ],
    );
}

/// Asserts every peer of `node` is up, showing what it has if not.
fn assert_peers_up(lab: &Lab, node: &str, want: usize) {
    assert!(
        peers_up(lab, node, want),
        "{node}: want {want} peers up, have {:?}",
        get(lab, node, "peers")
            .iter()
            .map(|p| (p["spec"]["label"].clone(), p["spec"]["state"].clone()))
            .collect::<Vec<_>>()
    );
}

#[test]
fn mesh_converges_and_only_cluster_traffic_crosses_wireguard() {
    let lab = mesh(3);
    let st = lab.status();
    for n in st["nodes"].as_array().unwrap() {
        let peers = n["peers"].as_array().unwrap();
        assert_eq!(peers.len(), 2, "{n}");
        assert!(peers.iter().all(|p| p["state"] == "up"), "{n}");
    }
    let node2 = node(&st, "node2");
    let node2_key = node2["publicKey"].as_str().unwrap();
    let node2_ip = node2["addresses"]["underlay"][0]
        .as_str()
        .unwrap()
        .to_owned();
    let node2_ula = node2["addresses"]["kubespan"].as_str().unwrap().to_owned();
    let node2_ula = node2_ula.split('/').next().unwrap();

    // A node address of a peer is cluster traffic: marked, routed into the tunnel,
    // counted on that peer.
    let (rx0, tx0) = wg_bytes(&lab, "node1", node2_key);
    let marked0 = marked_packets(&lab, "node1");
    ping(&lab, "node1", &node2_ip, "1000");
    let (rx1, tx1) = wg_bytes(&lab, "node1", node2_key);
    let marked1 = marked_packets(&lab, "node1");
    assert!(
        tx1 - tx0 >= 5 * 1000,
        "sent through WireGuard: {}",
        tx1 - tx0
    );
    assert!(
        rx1 - rx0 >= 5 * 1000,
        "received through WireGuard: {}",
        rx1 - rx0
    );
    assert!(marked1 - marked0 >= 5, "marked: {}", marked1 - marked0);

    // The discovery server is on the underlay but no member: not marked, not tunnelled.
    let disco = st["discovery"]["address"].as_str().unwrap();
    let disco_ip = disco.rsplit_once(':').unwrap().0.to_owned();
    let (_, tx2) = wg_bytes(&lab, "node1", node2_key);
    let marked2 = marked_packets(&lab, "node1");
    ping(&lab, "node1", &disco_ip, "1000");
    assert_eq!(
        marked_packets(&lab, "node1"),
        marked2,
        "non-member traffic was marked"
    );
    let (_, tx3) = wg_bytes(&lab, "node1", node2_key);
    assert!(
        tx3 - tx2 < 1000,
        "non-member traffic went through WireGuard: {}",
        tx3 - tx2
    );

    // The KubeSpan ULAs are reachable over the mesh link's connected /64.
    let (_, tx4) = wg_bytes(&lab, "node1", node2_key);
    ping(&lab, "node1", node2_ula, "1000");
    let (_, tx5) = wg_bytes(&lab, "node1", node2_key);
    assert!(
        tx5 - tx4 >= 5 * 1000,
        "ULA traffic through WireGuard: {}",
        tx5 - tx4
    );
}

#[test]
fn bad_config_is_rejected_and_a_live_mtu_change_is_applied() {
    let lab = mesh(2);
    let st = lab.status();
    let cfg_path = node(&st, "node1")["config"].as_str().unwrap().to_owned();
    let cfg = std::fs::read_to_string(&cfg_path).unwrap();
    assert!(cfg.contains("mtu: 1420"), "lab config changed shape");
    let mtu = |lab: &Lab| -> u64 {
        let v: Value =
            serde_json::from_str(&lab.exec_ok("node1", &["ip", "-j", "link", "show", "kubespan"]))
                .unwrap();
        v[0]["mtu"].as_u64().unwrap()
    };
    assert_eq!(mtu(&lab), 1420);

    // A bad document: rejected with the document and field named; nothing changes.
    let bad = lab.dir().join("bad.yaml");
    std::fs::write(&bad, cfg.replace("mtu: 1420", "mtu: 1000")).unwrap();
    let o = lab.exec("node1", &["wirespan", "apply", bad.to_str().unwrap()]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("KubeSpanConfig") && err.contains("mtu"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&cfg_path).unwrap(), cfg);
    assert_peers_up(&lab, "node1", 1); // the mesh keeps running
    assert_eq!(mtu(&lab), 1420);

    // A good change is applied live to the link and to the mesh routes.
    let good = lab.dir().join("good.yaml");
    std::fs::write(&good, cfg.replace("mtu: 1420", "mtu: 1380")).unwrap();
    lab.exec_ok("node1", &["wirespan", "apply", good.to_str().unwrap()]);
    eventually("the link MTU to become 1380", || {
        (mtu(&lab) == 1380).then_some(())
    });
    eventually("the table-180 route MTU to become 1380", || {
        let out = lab.exec_ok(
            "node1",
            &["ip", "-j", "-d", "route", "show", "table", "180"],
        );
        let v: Value = serde_json::from_str(&out).unwrap();
        v.as_array()?
            .iter()
            .any(|r| {
                r["metrics"]
                    .as_array()
                    .is_some_and(|m| m.iter().any(|x| x["mtu"] == 1380))
            })
            .then_some(())
    });
    assert_peers_up(&lab, "node1", 1);
    let node2_ip = node(&st, "node2")["addresses"]["underlay"][0]
        .as_str()
        .unwrap()
        .to_owned();
    ping(&lab, "node1", &node2_ip, "1300");
}

/// A daemon started inside a lab node, killed on drop (and by `lab down` anyway).
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn killed_daemon_restarts_with_its_identity_and_no_duplicate_kernel_state() {
    let lab = mesh(2);
    let st = lab.status();
    let n1 = node(&st, "node1");
    let key = n1["publicKey"].as_str().unwrap().to_owned();
    let ula = n1["addresses"]["kubespan"].clone();
    let pid = i32::try_from(n1["pid"].as_u64().unwrap()).unwrap();
    let node_id = get(&lab, "node1", "nodeidentity")[0]["spec"]["nodeId"].clone();

    // kill -9: no cleanup at all; kernel state and wireguard-go are left behind.
    assert!(Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    eventually("the daemon to die", || {
        (!common::lab::alive(pid)).then_some(())
    });

    let log = std::fs::File::create(lab.dir().join("node1-restart.log")).unwrap();
    let _daemon = Daemon(
        Command::new(BIN)
            .args([
                "lab", "exec", "--name", &lab.name, "node1", "--", "wirespan", "node",
            ])
            .args(["--config", n1["config"].as_str().unwrap()])
            .args(["--state-dir", n1["stateDir"].as_str().unwrap()])
            .args(["--socket", n1["socket"].as_str().unwrap()])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    eventually("node1's peer to be up again", || {
        peers_up(&lab, "node1", 1).then_some(())
    });
    eventually("node2 to see node1 up again", || {
        peers_up(&lab, "node2", 1).then_some(())
    });

    // Same identity.
    let st = lab.status();
    assert_eq!(node(&st, "node1")["publicKey"], key.as_str());
    assert_eq!(node(&st, "node1")["addresses"]["kubespan"], ula);
    assert_eq!(
        get(&lab, "node1", "nodeidentity")[0]["spec"]["nodeId"],
        node_id
    );

    // No duplicates: one rule per family, one default route per family in table
    // 180, one WireGuard peer, one marking table.
    for family in ["-4", "-6"] {
        let rules: Value =
            serde_json::from_str(&lab.exec_ok("node1", &["ip", "-j", family, "rule"])).unwrap();
        let ours = rules
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["priority"] == 32500)
            .count();
        assert_eq!(ours, 1, "rules {family}: {rules}");
        let routes: Value = serde_json::from_str(&lab.exec_ok(
            "node1",
            &["ip", "-j", family, "route", "show", "table", "180"],
        ))
        .unwrap();
        assert_eq!(
            routes.as_array().unwrap().len(),
            1,
            "table 180 {family}: {routes}"
        );
    }
    let peers = lab.exec_ok("node1", &["wg", "show", "kubespan", "peers"]);
    assert_eq!(peers.lines().count(), 1);
    let tables = lab.exec_ok("node1", &["nft", "-j", "list", "tables"]);
    assert_eq!(tables.matches("\"wirespan\"").count(), 1, "{tables}");
    let node2_ip = node(&st, "node2")["addresses"]["underlay"][0]
        .as_str()
        .unwrap()
        .to_owned();
    ping(&lab, "node1", &node2_ip, "100");
}

/// `(connected, affiliates)` of `node`'s one discovery service.
fn discovery_state(lab: &Lab, node: &str) -> Option<(bool, u64)> {
    let s = get(lab, node, "discoveryservices");
    let spec = &s.first()?["spec"];
    Some((
        spec["connected"].as_bool()?,
        spec["affiliateCount"].as_u64()?,
    ))
}

#[test]
fn discovery_server_restart_keeps_the_mesh_and_rediscovers() {
    let lab = mesh(2);
    let st = lab.status();
    let (connected, affiliates) = discovery_state(&lab, "node1").unwrap();
    assert!(connected);
    // The peer status is created once; were the peer dropped and re-added it would be
    // a new resource (version 1 again).
    let created = get(&lab, "node1", "peers")[0]["metadata"]["created"].clone();
    let disco_pid = st["discovery"]["pid"].as_u64().unwrap().to_string();
    let disco_ns = st["discovery"]["namespace"].as_str().unwrap().to_owned();
    let node2_ip = node(&st, "node2")["addresses"]["underlay"][0]
        .as_str()
        .unwrap()
        .to_owned();

    // Server gone: both nodes notice, and the mesh keeps forwarding.
    assert!(Command::new("kill")
        .args(["-9", &disco_pid])
        .status()
        .unwrap()
        .success());
    for n in ["node1", "node2"] {
        eventually("the discovery service to be seen down", || {
            discovery_state(&lab, n)
                .is_some_and(|(c, _)| !c)
                .then_some(())
        });
    }
    ping(&lab, "node1", &node2_ip, "100");
    assert_peers_up(&lab, "node1", 1);
    assert_peers_up(&lab, "node2", 1);

    // A fresh, empty server on the same address: the nodes reconnect and republish.
    let log = std::fs::File::create(lab.dir().join("discovery-restart.log")).unwrap();
    let _server = Daemon(
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &disco_ns,
                BIN,
                "discovery",
                "--listen",
                "[::]:3000",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    for n in ["node1", "node2"] {
        eventually("the nodes to rediscover each other", || {
            (discovery_state(&lab, n) == Some((true, affiliates))).then_some(())
        });
    }
    // The peers were never dropped: same WireGuard peer, handshakes kept, still up.
    assert_peers_up(&lab, "node1", 1);
    assert_peers_up(&lab, "node2", 1);
    assert_eq!(
        get(&lab, "node1", "peers")[0]["metadata"]["created"],
        created
    );
    ping(&lab, "node1", &node2_ip, "100");
}
