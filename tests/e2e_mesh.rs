//! End to end: the real binary as a mesh of nodes in `wirespan lab` (network, mount and
//! UTS namespaces per node, a discovery server, WireGuard: kernel where the kernel has
//! it, else `wirespan wireguard`, and wireguard-go where a test asks for it; the harness
//! prints which), real traffic.
//!
//! Every lab has a unique name and is removed by its guard even when a test fails.
//! Assertions read the kernel (`wg show … dump`, `nft -j`, `ip -j`) inside the nodes;
//! traffic only ever flows between the lab's own namespaces.

mod common;

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use common::{
    lab::Lab,
    talos::{self, TalosPeer},
    BIN,
};
use serde_json::Value;

/// Brings a lab of `nodes` up and waits (inside `lab up`) until every peer is up: a
/// deadline, not a wait, so a generous one (an emulated VM on a busy machine, the
/// suite's VM tier, took 52 s for three nodes).
fn mesh(nodes: usize) -> Lab {
    let lab = Lab::new();
    lab.ok(&[
        "up",
        "--nodes",
        &nodes.to_string(),
        "--timeout",
        LAB_UP_TIMEOUT,
        "--no-hints",
    ]);
    lab
}

/// The longest `lab up` waits for every peer.
const LAB_UP_TIMEOUT: &str = "180s";

/// Polls `f` until it returns `Some` or 60 s pass.
fn eventually<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    eventually_or(what, String::new, f)
}

/// As [`eventually`]; on timeout the failure shows what `diagnose` returns.
fn eventually_or<T>(
    what: &str,
    diagnose: impl FnOnce() -> String,
    mut f: impl FnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(v) = f() {
            return v;
        }
        if Instant::now() >= deadline {
            panic!("timed out waiting for {what}\n{}", diagnose());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `wirespan get TYPE -o json` inside a node: the stream of resources, or the failed
/// command's output (a daemon that is restarting has no API for a moment).
fn try_get(lab: &Lab, node: &str, ty: &str) -> Result<Vec<Value>, String> {
    let o = lab.exec(node, &["wirespan", "get", ty, "-o", "json"]);
    if !o.status.success() {
        return Err(format!(
            "get {ty} on {node}: {}\n{}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        ));
    }
    serde_json::Deserializer::from_slice(&o.stdout)
        .into_iter::<Value>()
        .map(|v| v.map_err(|e| format!("get {ty} on {node}: bad JSON: {e}")))
        .collect()
}

/// [`try_get`] where the daemon must answer.
fn get(lab: &Lab, node: &str, ty: &str) -> Vec<Value> {
    try_get(lab, node, ty).unwrap_or_else(|e| panic!("{e}"))
}

/// Polled across restarts: a daemon that does not answer yet has no peers up.
fn peers_up(lab: &Lab, node: &str, want: usize) -> bool {
    try_get(lab, node, "peers")
        .is_ok_and(|peers| peers.len() == want && peers.iter().all(|p| p["spec"]["state"] == "up"))
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

/// Packets counted by the output chain's IPv4 mark rules of `node`.
fn marked_packets(lab: &Lab, node: &str) -> u64 {
    marked_packets_of(lab, node, "v4")
}

/// Packets counted by the output chain's mark rules of `family` (`v4`, `v6`).
fn marked_packets_of(lab: &Lab, node: &str, family: &str) -> u64 {
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
                .is_some_and(|c| c.starts_with(&format!("wirespan:mark:{family}")))
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
    // The node's readiness summary, through the CLI: the table by its alias, the
    // fields as JSON.
    let table = lab.exec_ok("node1", &["wirespan", "get", "netstatus"]);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    for col in ["ADDRESS", "CONNECTIVITY", "HOSTNAME", "MESH"] {
        assert!(header.contains(&col), "{table}");
    }
    // Computed after the peer statuses it reads: wait for it to catch up.
    let status = eventually("node1's network status to show the mesh ready", || {
        let status: Value = serde_json::from_str(&lab.exec_ok(
            "node1",
            &["wirespan", "get", "networkstatus", "status", "-o", "json"],
        ))
        .unwrap();
        (status["spec"]["meshReady"] == true).then_some(status)
    });
    let spec = &status["spec"];
    for field in ["addressReady", "hostnameReady", "meshEnabled", "meshReady"] {
        assert_eq!(spec[field], true, "{field}: {status}");
    }
    assert_eq!(
        (&spec["peers"], &spec["peersUp"]),
        (&2.into(), &2.into()),
        "{status}"
    );

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

    // The same over IPv6: a peer's IPv6 node address goes through the v6 set and rule.
    // The lab gives every node one; its absence fails here instead of skipping the path.
    let node2_ip6 = node2["addresses"]["underlay"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .find(|a| a.contains(':'))
        .expect("node2 has an IPv6 underlay address")
        .to_owned();
    let (_, tx6a) = wg_bytes(&lab, "node1", node2_key);
    let marked6a = marked_packets_of(&lab, "node1", "v6");
    ping(&lab, "node1", &node2_ip6, "1000");
    let (_, tx6b) = wg_bytes(&lab, "node1", node2_key);
    let marked6b = marked_packets_of(&lab, "node1", "v6");
    assert!(
        tx6b - tx6a >= 5 * 1000,
        "IPv6 sent through WireGuard: {}",
        tx6b - tx6a
    );
    assert!(
        marked6b - marked6a >= 5,
        "IPv6 marked: {}",
        marked6b - marked6a
    );

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

impl Daemon {
    /// `wirespan node` again inside the lab node `n` (its status entry), with the
    /// files the lab gave it and the WireGuard implementation it ran; output to `log`
    /// in the lab directory.
    fn start(lab: &Lab, n: &Value, log: &str) -> Self {
        let name = n["name"].as_str().unwrap();
        let wireguard = n["wireguard"].as_str().unwrap_or("auto");
        let log = std::fs::File::create(lab.dir().join(log)).unwrap();
        Daemon(
            Command::new(BIN)
                .args([
                    "lab", "exec", "--name", &lab.name, name, "--", "wirespan", "node",
                ])
                .args(["--config", n["config"].as_str().unwrap()])
                .args(["--state-dir", n["stateDir"].as_str().unwrap()])
                .args(["--socket", n["socket"].as_str().unwrap()])
                .args(["--wireguard", wireguard])
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap(),
        )
    }
}

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

    // kill -9: no cleanup at all; kernel state (and wireguard-go, if it runs) are left
    // behind.
    assert!(Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    eventually("the daemon to die", || {
        (!common::lab::alive(pid)).then_some(())
    });

    let _daemon = Daemon::start(&lab, n1, "node1-restart.log");
    let diagnose = || {
        format!(
            "peers: {:?}\nwg: {}\ndaemon log:\n{}",
            try_get(&lab, "node1", "peers"),
            lab.exec_ok("node1", &["wg", "show", "kubespan"]),
            std::fs::read_to_string(lab.dir().join("node1-restart.log")).unwrap_or_default()
        )
    };
    eventually_or("node1's peer to be up again", diagnose, || {
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

/// `lab up` of `nodes` nodes with extra options, waiting up to `timeout` for every peer.
fn mesh_with(nodes: usize, timeout: &str, extra: &[&str]) -> Lab {
    let lab = Lab::new();
    let n = nodes.to_string();
    let mut args = vec!["up", "--nodes", &n, "--timeout", timeout, "--no-hints"];
    args.extend_from_slice(extra);
    lab.ok(&args);
    lab
}

/// The one resource of `ty` on `node` whose id is `id`.
fn get_one(lab: &Lab, node: &str, ty: &str, id: &str) -> Option<Value> {
    get(lab, node, ty)
        .into_iter()
        .find(|r| r["metadata"]["id"] == id)
}

/// `(endpoint, allowed IPs)` of WireGuard peer `public_key` on `node`'s mesh link, as
/// `wg show kubespan dump` lists them; `None` when the peer is not on the device.
fn wg_peer(lab: &Lab, node: &str, public_key: &str) -> Option<(String, Vec<String>)> {
    common::wg_dump(&lab.exec_ok(node, &["wg", "show", "kubespan", "dump"]))
        .into_iter()
        .find(|p| p.public_key == public_key)
        .map(|p| (p.endpoint, p.allowed_ips))
}

/// `(label, state, endpoint)` of every peer status of `node`, for failure messages.
fn peer_summary(lab: &Lab, node: &str) -> Vec<(Value, Value, Value)> {
    get(lab, node, "peers")
        .iter()
        .map(|p| {
            (
                p["spec"]["label"].clone(),
                p["spec"]["state"].clone(),
                p["spec"]["endpoint"].clone(),
            )
        })
        .collect()
}

/// Packets counted by the rules of an nft table (`family name`) inside network
/// namespace `netns`, by rule comment.
fn nft_counters(netns: &str, family: &str, table: &str) -> Vec<(String, u64)> {
    let out = Command::new("ip")
        .args([
            "netns", "exec", netns, "nft", "-j", "list", "table", family, table,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o.get("rule"))
        .map(|r| {
            let packets = r["expr"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|e| e.get("counter"))
                .map(|c| c["packets"].as_u64().unwrap())
                .sum();
            (
                r["comment"].as_str().unwrap_or_default().to_owned(),
                packets,
            )
        })
        .collect()
}

#[test]
fn a_node_whose_first_endpoint_is_blackholed_is_reached_on_its_second() {
    // node2 advertises its current addresses in sort order (`docs/kubespan.md` §4.2): 10.99.1.12,
    // 10.99.2.12, fd99:1ab::12, each on port 51820. The underlay drops WireGuard to and
    // from the first one from the very first packet (loaded before the daemons start),
    // while everything else (discovery, the other two addresses) still flows.
    let (first, second) = ("10.99.1.12:51820", "10.99.2.12:51820");
    let rules = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        rules.path(),
        "table bridge blackhole {\n\
         \x20 chain forward {\n\
         \x20   type filter hook forward priority 0; policy accept;\n\
         \x20   ip daddr 10.99.1.12 udp dport 51820 counter drop comment \"to node2's first\"\n\
         \x20   ip saddr 10.99.1.12 udp sport 51820 counter drop comment \"from node2's first\"\n\
         \x20 }\n\
         }\n",
    )
    .unwrap();
    // Rotation takes ≈ 15 s (the connection timeout) before the second endpoint is tried.
    let lab = mesh_with(
        3,
        LAB_UP_TIMEOUT,
        &["--underlay-nft", rules.path().to_str().unwrap()],
    );
    let st = lab.status();
    let underlay = st["underlayNamespace"].as_str().unwrap().to_owned();
    let node2 = node(&st, "node2");
    let node2_key = node2["publicKey"].as_str().unwrap().to_owned();
    let node2_ip = node2["addresses"]["underlay"][0]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(format!("{node2_ip}:51820"), first, "lab addressing changed");

    // The premise: the blackholed endpoint is the first candidate peers see.
    let spec = get_one(&lab, "node1", "kubespanpeerspecs", &node2_key)
        .unwrap_or_else(|| panic!("node1 has no peer spec for node2"));
    let endpoints: Vec<&str> = spec["spec"]["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    assert_eq!(endpoints[..2], [first, second], "{spec}");

    // The first endpoint was really tried, and dropped.
    let counters = nft_counters(&underlay, "bridge", "blackhole");
    let to_first = counters
        .iter()
        .find(|(c, _)| c == "to node2's first")
        .map(|(_, n)| *n);
    assert!(
        to_first.is_some_and(|n| n > 0),
        "no packet to node2's first endpoint was dropped: {counters:?}"
    );

    for n in ["node1", "node3"] {
        // Up on the second endpoint: in the peer status and in WireGuard.
        let status = get_one(&lab, n, "peers", &node2_key)
            .unwrap_or_else(|| panic!("{n} has no status for node2: {:?}", peer_summary(&lab, n)));
        assert_eq!(status["spec"]["state"], "up", "{n}: {status}");
        assert_eq!(status["spec"]["endpoint"], second, "{n}: {status}");
        let (endpoint, _) = wg_peer(&lab, n, &node2_key)
            .unwrap_or_else(|| panic!("{n} has no WireGuard peer for node2"));
        assert_eq!(endpoint, second, "{n}: WireGuard endpoint of node2");

        // Mesh traffic to node2's (blackholed-for-WireGuard) address crosses the tunnel.
        let (rx0, tx0) = wg_bytes(&lab, n, &node2_key);
        ping(&lab, n, &node2_ip, "1000");
        let (rx1, tx1) = wg_bytes(&lab, n, &node2_key);
        assert!(
            tx1 - tx0 >= 5 * 1000,
            "{n}: sent through WireGuard: {}",
            tx1 - tx0
        );
        assert!(
            rx1 - rx0 >= 5 * 1000,
            "{n}: received through WireGuard: {}",
            rx1 - rx0
        );
    }
    // node2 reaches the others too (on their second endpoints or the one they roamed to).
    assert_peers_up(&lab, "node2", 2);
}

/// The spec's vectors (docs/discovery-protocol.md §6 a, b, c) pin the test's own encoder before
/// it meets the real server.
#[test]
fn upstream_encoder_matches_the_spec_vectors() {
    use common::upstream::{seal_affiliate_with_nonce, seal_endpoint, Affiliate, KubeSpan};
    let key: [u8; 32] = std::array::from_fn(|i| u8::try_from(i).unwrap());
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    assert_eq!(
        hex(&seal_endpoint(&key, "1.2.3.4:5678".parse().unwrap())),
        "bc149092d77478cece8809c3e0153800"
    );
    assert_eq!(
        hex(&seal_endpoint(&key, "[2001:db8::1]:51820".parse().unwrap())),
        "e2702633ca89239d5ee036a316dde237d604c19a74d2f45c1e624c2d38c4cca0"
    );
    let affiliate = Affiliate {
        node_id: "node-a".into(),
        addresses: vec![vec![10, 0, 0, 1]],
        hostname: "a".into(),
        kubespan: Some(KubeSpan {
            public_key: "PUBKEY=".into(),
            address: "fd00::1"
                .parse::<std::net::Ipv6Addr>()
                .unwrap()
                .octets()
                .to_vec(),
            additional_addresses: Vec::new(),
            exclude_advertised_addresses: Vec::new(),
        }),
        ..Affiliate::default()
    };
    let nonce: [u8; 12] = std::array::from_fn(|i| u8::try_from(i).unwrap());
    assert_eq!(
        hex(&seal_affiliate_with_nonce(&key, nonce, &affiliate)),
        "000102030405060708090a0b\
         4d04b874a180ef7a9f459d8bb1e8626ce2ec9c3ef72b0a3e7322bcb80f79fdb20110aefcafc1129874a47fed8886\
         c46b3a40ac53fd969a0b23d76cc0b514"
    );
}

/// What wirespan publishes, read by both upstream decoders: Talos with discovery-api
/// v0.1.8 sees the exclusions in the presumed field; an older Talos ignores the field
/// and still decodes everything else (it gets the same AllowedIPs, because wirespan
/// also leaves excluded networks out of what it advertises).
#[test]
fn our_affiliate_with_exclusions_decodes_in_both_upstream_formats() {
    use common::upstream::{Affiliate, IpPrefix, LegacyAffiliate};
    use prost::Message as _;
    use wirespan_discovery::client::{AffiliateInfo, KubeSpanInfo};
    let ours = AffiliateInfo {
        node_id: "node-a".into(),
        addresses: vec!["10.5.0.1".parse().unwrap()],
        nodename: "a".into(),
        kubespan: Some(KubeSpanInfo {
            public_key: "PUBKEY=".into(),
            address: "fd00::1".parse().unwrap(),
            additional_addresses: vec!["10.244.1.0/24".parse().unwrap()],
            exclude_advertised_networks: vec![
                "10.244.1.128/25".parse().unwrap(),
                "2001:db8::/32".parse().unwrap(),
            ],
        }),
        ..AffiliateInfo::default()
    };
    let bytes = ours.encode();
    let prefix = |ip: Vec<u8>, bits| IpPrefix { ip, bits };
    let new = Affiliate::decode(bytes.as_slice()).expect("a v0.1.8 decoder reads it");
    let ks = new.kubespan.unwrap();
    assert_eq!(
        ks.exclude_advertised_addresses,
        vec![
            prefix(vec![10, 244, 1, 128], 25),
            prefix(
                "2001:db8::"
                    .parse::<std::net::Ipv6Addr>()
                    .unwrap()
                    .octets()
                    .to_vec(),
                32
            ),
        ]
    );
    assert_eq!(
        ks.additional_addresses,
        vec![prefix(vec![10, 244, 1, 0], 24)]
    );
    let old = LegacyAffiliate::decode(bytes.as_slice()).expect("an older decoder reads it");
    assert_eq!(old.node_id, "node-a");
    assert_eq!(old.nodename, "a");
    assert_eq!(old.addresses, vec![vec![10, 5, 0, 1]]);
    let ks = old.kubespan.unwrap();
    assert_eq!(ks.public_key, "PUBKEY=");
    assert_eq!(
        ks.additional_addresses,
        vec![prefix(vec![10, 244, 1, 0], 24)]
    );
}

/// wirespan's extension rides in the affiliate as a field upstream does not know:
/// both upstream decoders read exactly what they read without it, our decoder reads
/// it, and an affiliate a Talos node encodes has none (the peer is a Talos peer).
#[test]
fn our_affiliate_extension_is_invisible_to_upstream_and_absent_from_talos_affiliates() {
    use common::upstream::{Affiliate, KubeSpan, LegacyAffiliate};
    use prost::Message as _;
    use wirespan_discovery::client::{AffiliateInfo, KubeSpanInfo, WirespanInfo};
    let plain = AffiliateInfo {
        node_id: "node-a".into(),
        addresses: vec!["10.5.0.1".parse().unwrap()],
        nodename: "a".into(),
        kubespan: Some(KubeSpanInfo {
            public_key: "PUBKEY=".into(),
            address: "fd00::1".parse().unwrap(),
            additional_addresses: vec!["10.244.1.0/24".parse().unwrap()],
            exclude_advertised_networks: vec![],
        }),
        ..AffiliateInfo::default()
    };
    let ours = AffiliateInfo {
        wirespan: Some(WirespanInfo::new(10)),
        ..plain.clone()
    };
    let (with, without) = (ours.encode(), plain.encode());
    assert_ne!(with, without);
    assert_eq!(
        Affiliate::decode(with.as_slice()).expect("a v0.1.8 decoder reads it"),
        Affiliate::decode(without.as_slice()).unwrap()
    );
    assert_eq!(
        LegacyAffiliate::decode(with.as_slice()).expect("an older decoder reads it"),
        LegacyAffiliate::decode(without.as_slice()).unwrap()
    );
    let decoded = AffiliateInfo::decode(&with).unwrap();
    assert_eq!(decoded, ours);
    assert_eq!(
        decoded
            .wirespan
            .map(|w| (w.version, w.persistent_keepalive_secs)),
        Some((1, 10))
    );
    let talos = Affiliate {
        node_id: "node-t".into(),
        nodename: "t".into(),
        kubespan: Some(KubeSpan {
            public_key: "PUBKEY=".into(),
            address: vec![0xfd; 16],
            additional_addresses: vec![],
            exclude_advertised_addresses: vec![],
        }),
        ..Affiliate::default()
    };
    let decoded = AffiliateInfo::decode(&talos.encode_to_vec()).unwrap();
    assert!(decoded.kubespan.is_some());
    assert_eq!(decoded.wirespan, None);
}

#[test]
fn a_peer_publishing_in_the_upstream_format_becomes_a_wireguard_peer() {
    let lab = mesh(2);
    let st = lab.status();

    // The foreign node (tests/common/talos.rs): 10.99.1.99 on the underlay, its node
    // address and endpoint; a pod CIDR whose upper half it asks peers not to route
    // (Talos's `excludeAdvertisedNetworks`, sent in the affiliate); a ULA in the
    // cluster's KubeSpan prefix. Its device has both nodes as peers, as Talos sets
    // them up.
    let talos = TalosPeer::builder(&st).start();
    let (node_ip, endpoint, public) = (
        talos.address(),
        talos.endpoint(),
        talos.public_key().to_owned(),
    );
    for n in st["nodes"].as_array().unwrap() {
        // The lab's own nodes are in the same prefix: the helper derives it as they do.
        let theirs: std::net::Ipv6Addr = n["addresses"]["kubespan"]
            .as_str()
            .unwrap()
            .split('/')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(theirs.segments()[..4], talos.ula().segments()[..4], "{n}");
        talos.peer_with(n);
    }

    // Publish the affiliate, from inside the foreign namespace.
    let client_ip = talos.publish();
    assert_eq!(
        client_ip,
        common::upstream::ip_bytes(node_ip),
        "the server saw us from elsewhere"
    );

    // AllowedIPs keep the lower half of the pod CIDR.
    let want_allowed = talos.allowed_ips();
    for n in ["node1", "node2"] {
        // The peer spec, as `wirespan get kubespanpeerspecs` shows it.
        let spec = eventually("the foreign peer's spec", || {
            get_one(&lab, n, "kubespanpeerspecs", &public)
        });
        let mut allowed: Vec<String> = spec["spec"]["allowedIps"]
            .as_array()
            .unwrap_or_else(|| panic!("{n}: {spec}"))
            .iter()
            .map(|a| a.as_str().unwrap().to_owned())
            .collect();
        allowed.sort();
        assert_eq!(allowed, want_allowed, "{n}: {spec}");
        assert_eq!(spec["spec"]["label"], talos::NODENAME, "{n}: {spec}");
        assert_eq!(
            spec["spec"]["endpoints"],
            serde_json::json!([endpoint.to_string()]),
            "{n}: {spec}"
        );

        // The WireGuard peer on the node's device.
        let (wg_endpoint, wg_allowed) = eventually("the foreign peer on the device", || {
            wg_peer(&lab, n, &public).filter(|(e, _)| e != "(none)")
        });
        assert_eq!(wg_allowed, want_allowed, "{n}");
        assert_eq!(wg_endpoint, endpoint.to_string(), "{n}");

        // And it comes up: the stock wireguard-go completes the handshake.
        eventually("the foreign peer to be up", || {
            get_one(&lab, n, "peers", &public).filter(|p| p["spec"]["state"] == "up")
        });

        // Traffic to its node address and its ULA goes through the tunnel both ways.
        let (rx0, tx0) = wg_bytes(&lab, n, &public);
        ping(&lab, n, &node_ip.to_string(), "1000");
        ping(&lab, n, &talos.ula().to_string(), "1000");
        let (rx1, tx1) = wg_bytes(&lab, n, &public);
        assert!(
            tx1 - tx0 >= 10 * 1000,
            "{n}: sent through WireGuard: {}",
            tx1 - tx0
        );
        assert!(
            rx1 - rx0 >= 10 * 1000,
            "{n}: received through WireGuard: {}",
            rx1 - rx0
        );
    }
    // The foreign side saw the same: both nodes are live peers of its device.
    for n in st["nodes"].as_array().unwrap() {
        let rx = talos.peer(n["publicKey"].as_str().unwrap()).rx;
        assert!(
            rx >= 10 * 1000,
            "foreign peer received {rx} from {}",
            n["name"]
        );
    }
}

/// Every element of the marking sets of `node` (`inet wirespan`), as text: host
/// addresses, `addr/len` prefixes and `first-last` ranges.
fn marking_set(lab: &Lab, node: &str) -> Vec<String> {
    let out = lab.exec_ok(node, &["nft", "-j", "list", "table", "inet", "wirespan"]);
    let v: Value = serde_json::from_str(&out).unwrap();
    let elem_text = |e: &Value| -> String {
        let e = e.get("elem").map_or(e, |inner| &inner["val"]);
        if let Some(s) = e.as_str() {
            s.to_owned()
        } else if let Some(p) = e.get("prefix") {
            format!("{}/{}", p["addr"].as_str().unwrap(), p["len"])
        } else if let Some(r) = e.get("range") {
            format!("{}-{}", r[0].as_str().unwrap(), r[1].as_str().unwrap())
        } else {
            e.to_string()
        }
    };
    v["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o.get("set"))
        .flat_map(|s| s["elem"].as_array().cloned().unwrap_or_default())
        .map(|e| elem_text(&e))
        .collect()
}

/// Polls `f` every 2 s until it returns `Some` or `secs` pass.
fn eventually_within<T>(secs: u64, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {secs} s waiting for {what}"
        );
        std::thread::sleep(Duration::from_secs(2));
    }
}

/// The state of peer `key` as `node` reports it.
fn peer_state(lab: &Lab, node: &str, key: &str) -> String {
    get_one(lab, node, "peers", key)
        .and_then(|p| p["spec"]["state"].as_str().map(str::to_owned))
        .unwrap_or_else(|| "(no status)".into())
}

fn underlay_ips(status: &Value, name: &str) -> Vec<String> {
    node(status, name)["addresses"]["underlay"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect()
}

/// Applies `allowDownPeerBypass: true` to `name` live (`wirespan apply` of its config
/// with that one change).
fn apply_bypass(lab: &Lab, status: &Value, name: &str) {
    let cfg_path = node(status, name)["config"].as_str().unwrap().to_owned();
    let cfg = std::fs::read_to_string(&cfg_path).unwrap();
    assert!(
        cfg.contains("allowDownPeerBypass: false"),
        "lab config changed shape"
    );
    let bypass = lab.dir().join(format!("{name}-bypass.yaml"));
    std::fs::write(
        &bypass,
        cfg.replace("allowDownPeerBypass: false", "allowDownPeerBypass: true"),
    )
    .unwrap();
    lab.exec_ok(name, &["wirespan", "apply", bypass.to_str().unwrap()]);
    assert!(std::fs::read_to_string(&cfg_path)
        .unwrap()
        .contains("allowDownPeerBypass: true"));
}

fn has_all(set: &[String], ips: &[String]) -> bool {
    ips.iter().all(|a| set.contains(a))
}

fn has_none(set: &[String], ips: &[String]) -> bool {
    !ips.iter().any(|a| set.contains(a))
}

/// With node2 not up: node1 (bypass on) has dropped node2's addresses from its set but
/// kept node3's, and reaches node2 in clear (node2's kernel answers; nothing marked,
/// nothing into WireGuard); node3 (bypass off) keeps node2 in its set and marks its
/// traffic into the tunnel, where nobody answers.
fn assert_down_peer_routing(lab: &Lab, status: &Value, node2_key: &str) {
    let node2_ips = underlay_ips(status, "node2");
    let node2_ip = &node2_ips[0];
    let set1 = eventually("node2 to leave node1's set", || {
        let set = marking_set(lab, "node1");
        has_none(&set, &node2_ips).then_some(set)
    });
    assert!(
        has_all(&set1, &underlay_ips(status, "node3")),
        "node1: {set1:?}"
    );
    let (_, tx0) = wg_bytes(lab, "node1", node2_key);
    let marked0 = marked_packets(lab, "node1");
    ping(lab, "node1", node2_ip, "1000");
    let (_, tx1) = wg_bytes(lab, "node1", node2_key);
    assert!(
        tx1 - tx0 < 1000,
        "node1: traffic to the down peer went into WireGuard: {}",
        tx1 - tx0
    );
    assert_eq!(
        marked_packets(lab, "node1"),
        marked0,
        "node1: traffic to the down peer was marked"
    );

    let set3 = marking_set(lab, "node3");
    assert!(
        has_all(&set3, &node2_ips),
        "node3 dropped the down peer without bypass: {set3:?}"
    );
    let marked0 = marked_packets(lab, "node3");
    let o = lab.exec(
        "node3",
        &[
            "ping", "-n", "-q", "-c", "3", "-i", "0.2", "-w", "3", node2_ip,
        ],
    );
    assert!(
        !o.status.success(),
        "node3 reached the down peer outside the tunnel: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    let marked = marked_packets(lab, "node3") - marked0;
    assert!(marked >= 3, "node3: marked {marked} of 3 echo requests");
}

/// Spec §7: a peer that stops answering leaves the routed set only where
/// `allowDownPeerBypass` is on; there its node addresses are reached outside the tunnel,
/// elsewhere they stay in the set (blackholed into the tunnel). The lab's nodes are
/// wirespan peers of each other, so a dead one is declared down by the receive window
/// (`peerReceiveTimeout`, 20 s by default, §8.6) rather than 275 s after its last
/// handshake (§8.3); restarted, it is up again.
#[test]
fn a_killed_peer_leaves_the_marking_set_only_with_allow_down_peer_bypass() {
    let lab = mesh(3);
    let st = lab.status();
    let node2 = node(&st, "node2");
    let node2_key = node2["publicKey"].as_str().unwrap().to_owned();
    let node2_ips = underlay_ips(&st, "node2");

    // node1 gets allowDownPeerBypass: true, applied live; node3 keeps the default.
    apply_bypass(&lab, &st, "node1");

    // While node2 is up, both modes route it: bypass only drops peers that are not up.
    for (n, other) in [("node1", "node3"), ("node3", "node1")] {
        let set = marking_set(&lab, n);
        assert!(
            has_all(&set, &node2_ips) && has_all(&set, &underlay_ips(&st, other)),
            "{n}: {set:?}"
        );
    }

    // node2 really stops answering: its daemon and its userspace WireGuard, kill -9; a kernel
    // link outlives its daemon and keeps answering, so it is deleted instead.
    let backend = lab.backend("node2");
    let ns2 = node2["namespace"].as_str().unwrap().to_owned();
    let pids: Vec<i32> = String::from_utf8(
        Command::new("ip")
            .args(["netns", "pids", &ns2])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap()
    .split_whitespace()
    .map(|p| p.parse().unwrap())
    .collect();
    assert!(
        pids.len() >= if backend == "kernel" { 1 } else { 2 },
        "daemon (and the userspace device on {backend}) expected: {pids:?}"
    );
    for p in &pids {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*p),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    eventually("node2's processes to die", || {
        pids.iter().all(|p| !common::lab::alive(*p)).then_some(())
    });
    let killed = Instant::now();
    let killed_at = std::time::SystemTime::now();
    // Its mesh link goes with the userspace device; a kernel one is removed by hand.
    if backend == "kernel" {
        let _ = Command::new("ip")
            .args(["-n", &ns2, "link", "del", "kubespan"])
            .status();
    }
    eventually("node2's mesh link to disappear", || {
        (!Command::new("ip")
            .args(["-n", &ns2, "link", "show", "kubespan"])
            .output()
            .unwrap()
            .status
            .success())
        .then_some(())
    });

    // The receive window (30 s) and one poll (15 s), plus slack for a loaded CI: far
    // below the 275 s the handshake rule alone would take.
    let mut seen = Vec::new();
    for n in ["node1", "node3"] {
        eventually_within(90, &format!("{n} to see node2 not up"), || {
            let s = peer_state(&lab, n, &node2_key);
            if seen.last() != Some(&(n, s.clone())) {
                seen.push((n, s.clone()));
            }
            (s == "down" || s == "unknown").then_some(())
        });
    }
    eprintln!(
        "node2 not up on both after {:.0} s; states seen: {seen:?}",
        killed.elapsed().as_secs_f64()
    );
    // Declared down, not merely unknown: a peer that had a pushed endpoint is only
    // rotated to its next endpoint when its state is `down` (§8.2 step 4), and the push
    // leaves it `unknown` while the new endpoint is tried, so the rotation after the kill
    // is the trace of `down`.
    for n in ["node1", "node3"] {
        let status = get_one(&lab, n, "peers", &node2_key).unwrap();
        let changed = status["spec"]["lastEndpointChange"]
            .as_str()
            .and_then(|t| humantime::parse_rfc3339(t).ok())
            .unwrap_or_else(|| panic!("{n}: {status}"));
        assert!(
            changed > killed_at,
            "{n}: node2 not rotated since the kill: {status}"
        );
    }
    assert_down_peer_routing(&lab, &st, &node2_key);

    // Restarted, node2 is up again on both (it handshakes with them itself).
    let _node2 = Daemon::start(&lab, node2, "node2-restart.log");
    for n in ["node1", "node3"] {
        eventually_within(90, &format!("{n} to see node2 up again"), || {
            (peer_state(&lab, n, &node2_key) == "up").then_some(())
        });
    }
}

/// The quick variant of the test above (≈ 30 s): a peer whose WireGuard never gets
/// through (blackholed on every endpoint from the start) is down 15 s after each
/// endpoint push (§8.3), so it never joins node1's set with bypass on, while node3
/// (bypass off) routes it into the tunnel all along.
#[test]
fn a_peer_that_never_connects_is_reached_in_clear_only_with_allow_down_peer_bypass() {
    let rules = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        rules.path(),
        "table bridge blackhole {\n\
         \x20 chain forward {\n\
         \x20   type filter hook forward priority 0; policy accept;\n\
         \x20   ip daddr { 10.99.1.12, 10.99.2.12 } udp dport 51820 drop\n\
         \x20   ip saddr { 10.99.1.12, 10.99.2.12 } udp sport 51820 drop\n\
         \x20   ip6 daddr fd99:1ab::c udp dport 51820 drop\n\
         \x20   ip6 saddr fd99:1ab::c udp sport 51820 drop\n\
         \x20 }\n\
         }\n",
    )
    .unwrap();
    let lab = mesh_with(
        3,
        "60s",
        &[
            "--no-wait",
            "--underlay-nft",
            rules.path().to_str().unwrap(),
        ],
    );
    let st = lab.status();
    let node2 = node(&st, "node2");
    assert_eq!(
        underlay_ips(&st, "node2"),
        ["10.99.1.12", "10.99.2.12", "fd99:1ab::c"],
        "lab addressing changed"
    );
    let node2_key = node2["publicKey"].as_str().unwrap().to_owned();
    // node2 runs with bypass too: it is alive and must answer node1 in clear as well
    // (without it, node2 would mark its replies into its own blackholed tunnel).
    apply_bypass(&lab, &st, "node1");
    apply_bypass(&lab, &st, "node2");

    // node1 and node3 reach each other; node2, declared down 15 s after its first
    // endpoint was pushed, has been rotated to its second.
    for (n, other) in [("node1", "node3"), ("node3", "node1")] {
        let other_key = node(&st, other)["publicKey"].as_str().unwrap().to_owned();
        eventually(&format!("{n} to see {other} up"), || {
            (peer_state(&lab, n, &other_key) == "up").then_some(())
        });
        let status = eventually_within(90, &format!("{n} to rotate node2"), || {
            get_one(&lab, n, "peers", &node2_key)
                .filter(|p| p["spec"]["lastUsedEndpoint"] == "10.99.2.12:51820")
        });
        assert_ne!(status["spec"]["state"], "up", "{n}: {status}");
    }
    assert_down_peer_routing(&lab, &st, &node2_key);
}

/// `(priority, from, table)` of every rule of `family` in `node`.
fn rules(lab: &Lab, node: &str, family: &str) -> Vec<(u64, String, String)> {
    let v: Value = serde_json::from_str(&lab.exec_ok(node, &["ip", "-j", family, "rule"])).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let from = match (r["src"].as_str(), r["srclen"].as_u64()) {
                (Some("all") | None, _) => String::new(),
                (Some(s), Some(l)) => format!("{s}/{l}"),
                (Some(s), None) => s.to_owned(),
            };
            let table = r["table"]
                .as_str()
                .map_or_else(|| r["table"].to_string(), str::to_owned);
            (r["priority"].as_u64().unwrap_or_default(), from, table)
        })
        .collect()
}

/// Destinations of the IPv4 routes in `table` of `node`.
fn route_dsts(lab: &Lab, node: &str, table: &str) -> Vec<String> {
    let v: Value = serde_json::from_str(
        &lab.exec_ok(node, &["ip", "-j", "-4", "route", "show", "table", table]),
    )
    .unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["dst"].as_str().map(str::to_owned))
        .collect()
}

/// Issue 15 item 1, through the binary: the mesh's teardown (disable, and the stop
/// before a restart) removes only what the mesh made. Routes and rules from the
/// config's RouteConfig/RoutingRuleConfig documents and foreign ones (protocol
/// `static`, one of them in the mesh's own table, one at the mesh's own priority)
/// survive disable → enable → restart.
#[test]
fn mesh_teardown_leaves_configured_and_foreign_routes_and_rules() {
    let lab = mesh(2);
    let st = lab.status();
    let n1 = node(&st, "node1").clone();
    let cfg_path = n1["config"].as_str().unwrap().to_owned();
    let cfg = std::fs::read_to_string(&cfg_path).unwrap();
    assert!(cfg.contains("enabled: true"), "lab config changed shape");
    let node2_ip = node(&st, "node2")["addresses"]["underlay"][0]
        .as_str()
        .unwrap()
        .to_owned();

    // Foreign objects, as other software on the host would make them.
    for args in [
        &[
            "ip",
            "route",
            "add",
            "10.77.0.0/16",
            "dev",
            "eth0",
            "proto",
            "static",
            "table",
            "180",
        ][..],
        &[
            "ip",
            "rule",
            "add",
            "priority",
            "32501",
            "from",
            "10.77.0.0/16",
            "table",
            "181",
            "proto",
            "static",
        ],
        &[
            "ip",
            "rule",
            "add",
            "priority",
            "32500",
            "from",
            "10.78.0.0/16",
            "table",
            "182",
            "proto",
            "static",
        ],
    ] {
        lab.exec_ok("node1", args);
    }
    // Objects from the user's network documents.
    let with_docs = format!(
        "{cfg}---\napiVersion: v1alpha1\nkind: RouteConfig\ndestination: 10.60.0.0/16\n\
         gateway: {node2_ip}\nlink: eth0\n---\napiVersion: v1alpha1\nkind: RoutingRuleConfig\n\
         priority: 1234\ntable: 100\nsrc: 10.61.0.0/16\n"
    );
    let apply = |text: &str, file: &str| {
        let path = lab.dir().join(file);
        std::fs::write(&path, text).unwrap();
        lab.exec_ok("node1", &["wirespan", "apply", path.to_str().unwrap()]);
    };
    apply(&with_docs, "with-docs.yaml");

    let mesh_rule = |lab: &Lab| {
        rules(lab, "node1", "-4")
            .iter()
            .any(|r| r.0 == 32500 && r.1.is_empty() && r.2 == "180")
    };
    let mesh_route = |lab: &Lab| {
        route_dsts(lab, "node1", "180")
            .iter()
            .any(|d| d == "default")
    };
    let survivors = |lab: &Lab, when: &str| {
        let r = rules(lab, "node1", "-4");
        for (prio, from, table) in [
            (32501, "10.77.0.0/16", "181"),
            (32500, "10.78.0.0/16", "182"),
            (1234, "10.61.0.0/16", "100"),
        ] {
            assert!(
                r.iter().any(|x| x.0 == prio && x.1 == from && x.2 == table),
                "{when}: rule {prio} from {from} lookup {table} missing: {r:?}"
            );
        }
        let t180 = route_dsts(lab, "node1", "180");
        assert!(
            t180.iter().any(|d| d == "10.77.0.0/16"),
            "{when}: foreign route in table 180 missing: {t180:?}"
        );
        let main = route_dsts(lab, "node1", "main");
        assert!(
            main.iter().any(|d| d == "10.60.0.0/16"),
            "{when}: configured route missing: {main:?}"
        );
    };
    eventually("the configured route and rule", || {
        let main = route_dsts(&lab, "node1", "main");
        let r = rules(&lab, "node1", "-4");
        (main.iter().any(|d| d == "10.60.0.0/16") && r.iter().any(|x| x.0 == 1234)).then_some(())
    });
    assert!(mesh_rule(&lab) && mesh_route(&lab));
    survivors(&lab, "mesh on");

    // Disable: the mesh's rule, route and link go; nothing else does.
    apply(
        &with_docs.replace("enabled: true", "enabled: false"),
        "disabled.yaml",
    );
    eventually("the mesh's rule and route gone", || {
        (!mesh_rule(&lab) && !mesh_route(&lab)).then_some(())
    });
    survivors(&lab, "mesh disabled");

    // Enable: back, still nothing else touched.
    apply(&with_docs, "enabled.yaml");
    eventually("node1's peer up again", || {
        peers_up(&lab, "node1", 1).then_some(())
    });
    eventually("the mesh's rule and route back", || {
        (mesh_rule(&lab) && mesh_route(&lab)).then_some(())
    });
    survivors(&lab, "mesh enabled again");

    // Restart: a graceful stop (teardown, the daemon's default) and a new start.
    let pid = n1["pid"].as_u64().unwrap().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let pid = i32::try_from(n1["pid"].as_u64().unwrap()).unwrap();
    eventually("the daemon to stop", || {
        (!common::lab::alive(pid)).then_some(())
    });
    assert!(!mesh_rule(&lab), "the stop tore the mesh down");
    survivors(&lab, "daemon stopped");
    let _daemon = Daemon::start(&lab, &n1, "node1-restart.log");
    eventually("node1's peer up after the restart", || {
        peers_up(&lab, "node1", 1).then_some(())
    });
    eventually("the mesh's rule and route after the restart", || {
        (mesh_rule(&lab) && mesh_route(&lab)).then_some(())
    });
    survivors(&lab, "after the restart");
    assert_eq!(
        rules(&lab, "node1", "-4")
            .iter()
            .filter(|r| r.0 == 32500)
            .count(),
        2,
        "the mesh rule once, the foreign one at its priority once"
    );
}

/// `wirespan node --on-stop keep` in a lab node (as the lab started it, plus the flag),
/// logging at debug level to `log`.
/// node `n`'s daemon started again by hand, with the WireGuard the lab ran it with (a
/// restart keeps its flags; `auto` on a kernel with WireGuard would pick the kernel
/// and not adopt a kept userspace device).
fn start_kept_daemon(lab: &Lab, n: &Value, wireguard: &str, log: &std::path::Path) -> Daemon {
    let name = n["name"].as_str().unwrap();
    let log = std::fs::File::create(log).unwrap();
    Daemon(
        Command::new(BIN)
            .args(["lab", "exec", "--name", &lab.name, name])
            .args(["--", "wirespan", "node", "--on-stop", "keep"])
            .args(["--wireguard", wireguard])
            .args(["--config", n["config"].as_str().unwrap()])
            .args(["--state-dir", n["stateDir"].as_str().unwrap()])
            .args(["--socket", n["socket"].as_str().unwrap()])
            .env("WIRESPAN_LOG", "info,wirespan_dataplane=debug")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    )
}

/// The daemon under a `lab exec` wrapper: the wrapper's one child.
fn daemon_pid(wrapper: &Daemon) -> i32 {
    let pid = wrapper.0.id();
    eventually("the daemon under lab exec", || {
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .ok()?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// Userspace WireGuard processes (`wirespan wireguard`, wireguard-go) in a network
/// namespace.
fn userspace_wireguard_in(netns: &str) -> Vec<i32> {
    let out = Command::new("ip")
        .args(["netns", "pids", netns])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|p| p.parse::<i32>().ok())
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| {
                let args: Vec<&[u8]> = c.split(|b| *b == 0).collect();
                args[0].ends_with(b"wireguard-go") || args.get(1) == Some(&b"wireguard".as_slice())
            }) && common::lab::alive(*p)
        })
        .collect()
}

/// `(endpoint, latest handshake)` of one peer in `wg show kubespan dump`.
fn wg_endpoint(lab: &Lab, node: &str, public_key: &str) -> (String, String) {
    let dump = lab.exec_ok(node, &["wg", "show", "kubespan", "dump"]);
    dump.lines()
        .skip(1)
        .map(|l| l.split('\t').collect::<Vec<_>>())
        .find(|f| f.first() == Some(&public_key))
        .map(|f| (f[2].to_owned(), f[4].to_owned()))
        .unwrap_or_else(|| panic!("{node} has no WireGuard peer {public_key}"))
}

/// A ping every 50 ms from a node's namespace; replies' sequence numbers arrive on a
/// channel. Interrupted (summary printed) and reaped on drop.
struct Pinger {
    child: Child,
    seqs: std::sync::mpsc::Receiver<u64>,
    got: Vec<u64>,
}

impl Pinger {
    fn start(netns: &str, to: &str) -> Self {
        let mut child = Command::new("ip")
            .args(["netns", "exec", netns, "ping", "-n", "-i", "0.05", to])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, seqs) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead as _;
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { return };
                let seq = line
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("icmp_seq=")?.parse::<u64>().ok());
                if let Some(seq) = seq {
                    if tx.send(seq).is_err() {
                        return;
                    }
                }
            }
        });
        Self {
            child,
            seqs,
            got: Vec::new(),
        }
    }

    /// Waits (30 s at most) until `more` further replies have arrived.
    fn wait_replies(&mut self, more: usize) {
        let want = self.got.len() + more;
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.got.len() < want {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.seqs.recv_timeout(left) {
                Ok(s) => self.got.push(s),
                Err(_) => panic!(
                    "only {} of {want} replies; last seq {:?}",
                    self.got.len(),
                    self.got.last()
                ),
            }
        }
    }

    /// Sequence numbers sent but not answered, up to the last answered one.
    fn lost(&self) -> Vec<u64> {
        let got: std::collections::BTreeSet<u64> = self.got.iter().copied().collect();
        let last = got.last().copied().unwrap_or(0);
        (1..=last).filter(|s| !got.contains(s)).collect()
    }
}

impl Drop for Pinger {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_restart_with_kernel_state_kept_loses_no_ping_and_pushes_no_endpoint() {
    let lab = mesh(2);
    let backend = lab.backend("node1");
    restart_with_kernel_state_kept(&lab, &backend);
}

/// The same with wireguard-go on both nodes, the daemon restarted with `--wireguard
/// auto`: it adopts the wireguard-go it left running, and reports it (`userspace-go`),
/// even on a kernel with WireGuard (where `auto` once took the kernel and failed on
/// the kept TUN).
#[test]
fn a_restart_with_kernel_state_kept_adopts_wireguard_go() {
    let lab = Lab::new();
    lab.ok(&[
        "up",
        "--nodes",
        "2",
        "--wireguard",
        "userspace-go",
        "--timeout",
        LAB_UP_TIMEOUT,
        "--no-hints",
    ]);
    assert_eq!(lab.backend("node1"), "userspace-go");
    restart_with_kernel_state_kept(&lab, "auto");
}

/// Kills node1's lab daemon and restarts it twice with its kernel state kept, with
/// `--wireguard restart_with`: the device (and the ping through it) survives.
fn restart_with_kernel_state_kept(lab: &Lab, restart_with: &str) {
    let st = lab.status();
    let n1 = node(&st, "node1").clone();
    let n2 = node(&st, "node2");
    let ns1 = n1["namespace"].as_str().unwrap().to_owned();
    let key2 = n2["publicKey"].as_str().unwrap().to_owned();
    let ula2 = n2["addresses"]["kubespan"].as_str().unwrap();
    let ula2 = ula2.split('/').next().unwrap().to_owned();

    // The lab's daemon's metrics say which implementation runs.
    let backend = lab.backend("node1");
    assert_eq!(
        metric(
            lab,
            "node1",
            &format!("wirespan_kubespan_wireguard{{implementation=\"{backend}\"}}")
        ),
        1
    );

    // node1 runs with `--on-stop keep`: the lab's daemon (default `teardown`) is
    // replaced, kill -9 leaving its kernel state and userspace device to the new one.
    let pid = common::lab::pid_of(&n1);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    eventually("the lab's daemon to die", || {
        (!common::lab::alive(pid)).then_some(())
    });
    let log1 = lab.dir().join("node1-keep-1.log");
    let mut first = start_kept_daemon(lab, &n1, restart_with, &log1);
    // Seen once in the suite (not reproduced alone): say what the daemon saw.
    let diagnose = || {
        format!(
            "peers: {:?}\nwg: {}\ndaemon log:\n{}",
            try_get(lab, "node1", "peers"),
            lab.exec_ok("node1", &["wg", "show", "kubespan"]),
            std::fs::read_to_string(&log1).unwrap_or_default()
        )
    };
    eventually_or("node1's peer up under the kept daemon", diagnose, || {
        peers_up(lab, "node1", 1).then_some(())
    });
    // A userspace device is one process to keep and adopt; kernel WireGuard is the
    // link alone.
    let kernel = backend == "kernel";
    let wg_go = userspace_wireguard_in(&ns1);
    assert_eq!(wg_go.len(), usize::from(!kernel), "{wg_go:?}");
    let (endpoint, _) = wg_endpoint(lab, "node1", &key2);

    // Traffic across the mesh (node2's KubeSpan address: only the tunnel reaches it).
    let mut ping = Pinger::start(&ns1, &ula2);
    ping.wait_replies(20);

    // SIGTERM: the daemon stops, the mesh stays.
    let daemon = daemon_pid(&first);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(daemon),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    eventually("the daemon to stop", || first.0.try_wait().unwrap());
    ping.wait_replies(10);
    assert_eq!(
        userspace_wireguard_in(&ns1),
        wg_go,
        "the userspace device did not outlive the daemon"
    );

    // The same daemon again: same state dir and config.
    let log = lab.dir().join("node1-keep-2.log");
    let _second = start_kept_daemon(lab, &n1, restart_with, &log);
    // Polled while the daemon starts: no API yet is not a failure.
    let peer = eventually("node1 ready with its peer up", || {
        try_get(lab, "node1", "peers")
            .ok()?
            .into_iter()
            .find(|p| p["spec"]["state"] == "up")
    });
    ping.wait_replies(40);
    assert_eq!(
        ping.lost(),
        Vec::<u64>::new(),
        "echo requests lost across the restart"
    );

    // Adopted, not rebuilt: the same device process, the same endpoint, no write to the
    // device, and the peer was up from its first status (seeded from the device, no
    // endpoint change of its own).
    assert_eq!(
        userspace_wireguard_in(&ns1),
        wg_go,
        "a second userspace device, or a new one"
    );
    // No reverse-path filtering on the mesh link (a host prerequisite the daemon sets).
    let rp = lab.exec_ok(
        "node1",
        &["cat", "/proc/sys/net/ipv4/conf/kubespan/rp_filter"],
    );
    assert_eq!(rp.trim(), "0");
    assert_eq!(wg_endpoint(lab, "node1", &key2).0, endpoint);
    assert_eq!(peer["spec"]["lastEndpointChange"], Value::Null, "{peer}");
    assert_eq!(peer["metadata"]["version"], 1, "the status changed: {peer}");
    // What runs is reported, not what was asked for.
    let status = get(lab, "node1", "kubespanmanagerstatuses");
    assert_eq!(
        status[0]["spec"]["wireguard"],
        backend.as_str(),
        "{status:?}"
    );
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        text.contains("adopted the running userspace WireGuard process"),
        !kernel,
        "{text}"
    );
    assert!(
        !text.contains("updating WireGuard"),
        "the restarted daemon wrote the device:\n{text}"
    );
    ping.wait_replies(10);
    assert_eq!(ping.lost(), Vec::<u64>::new());
}

/// One sample of `node`'s `/metrics` (served inside its namespace), by its full name
/// with labels, e.g. `wirespan_kubespan_fast_path_packets_total{result="hit"}`.
fn metric(lab: &Lab, node_name: &str, series: &str) -> u64 {
    let st = lab.status();
    let addr = node(&st, node_name)["metricsAddress"]
        .as_str()
        .unwrap()
        .to_owned();
    let text = lab.exec_ok(
        node_name,
        &[
            "curl",
            "-sSf",
            "--max-time",
            "5",
            &format!("http://{addr}/metrics"),
        ],
    );
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or_else(|| panic!("{node_name} exports no {series}:\n{text}"))
}

/// `lab up --fast-path ebpf` through the real binary with the fast path taken: each
/// node's manager status says `ebpf` with no fallback note, the mesh carries pings,
/// and the classifier really marks forwarded packets. A packet sent from the discovery
/// server's namespace to node2's underlay address via node1 (a peer node address in
/// node1's routed set) enters node1 on its underlay link: the tc classifier counts a
/// hit (exported as a node metric), marks it, and node1 routes it into WireGuard.
/// Without the mark it would go straight back out on the underlay.
#[test]
fn ebpf_fast_path_marks_forwarded_traffic_into_the_mesh() {
    let lab = mesh_with(2, LAB_UP_TIMEOUT, &["--fast-path", "ebpf"]);
    for n in ["node1", "node2"] {
        let st = get(&lab, n, "kubespanmanagerstatuses");
        assert_eq!(st.len(), 1, "{n}: {st:?}");
        assert_eq!(st[0]["spec"]["fastPath"], "ebpf", "{n}: {st:?}");
        assert_eq!(st[0]["spec"]["note"], "", "{n}: {st:?}");
    }
    let st = lab.status();
    let node2_ula = node(&st, "node2")["addresses"]["kubespan"]
        .as_str()
        .unwrap()
        .to_owned();
    ping(&lab, "node1", &node2_ula, "100");

    let node1_ip = underlay_ips(&st, "node1")[0].clone();
    let node2_ip = underlay_ips(&st, "node2")[0].clone();
    let node2_key = node(&st, "node2")["publicKey"].as_str().unwrap().to_owned();
    let disco = st["discovery"]["namespace"].as_str().unwrap().to_owned();
    let set = marking_set(&lab, "node1");
    assert!(
        set.contains(&node2_ip) || set.contains(&format!("{node2_ip}/32")),
        "{node2_ip} not in node1's routed set: {set:?}"
    );
    // node1 forwards; the discovery namespace reaches node2's address through node1.
    lab.exec_ok("node1", &["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
    let ip = |args: &[&str]| {
        let o = Command::new("ip").args(args).output().unwrap();
        assert!(
            o.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    ip(&[
        "-n",
        &disco,
        "route",
        "add",
        &format!("{node2_ip}/32"),
        "via",
        &node1_ip,
    ]);

    let hit = r#"wirespan_kubespan_fast_path_packets_total{result="hit"}"#;
    let hits0 = metric(&lab, "node1", hit);
    let (_, tx0) = wg_bytes(&lab, "node1", &node2_key);
    // node2 drops these after decrypting (the discovery server's address is not one
    // of node1's allowed IPs), so no replies: only what node1 did is asserted.
    let _ = Command::new("ip")
        .args([
            "netns", "exec", &disco, "ping", "-n", "-q", "-c", "5", "-i", "0.2", "-s", "1000",
            "-W", "1", &node2_ip,
        ])
        .output()
        .unwrap();
    let hits = metric(&lab, "node1", hit) - hits0;
    let (_, tx) = wg_bytes(&lab, "node1", &node2_key);
    assert!(
        hits >= 5,
        "node1's classifier counted {hits} hits of 5 packets"
    );
    assert!(
        tx - tx0 >= 5 * 1000,
        "node1 sent {} bytes to node2 through WireGuard for 5 forwarded 1000-byte pings",
        tx - tx0
    );
}

/// Cluster members choose their own names, and anyone with the cluster ID can publish
/// one: a foreign peer whose nodename and hostname carry a forged metrics series and
/// a terminal escape (clear screen) shows up on the nodes with neither working: no
/// `forged_series` line in node1's `/metrics`, no ESC byte in `wirespan get peers`.
#[test]
fn a_crafted_nodename_forges_no_metrics_series_and_no_terminal_escape() {
    const CRAFTED: &str = "evil\"} 1\nforged_series 1\n\u{1b}[2J";
    let lab = mesh(2);
    let st = lab.status();
    let talos = TalosPeer::builder(&st).start();
    talos.publish_as(CRAFTED, CRAFTED);
    let public = talos.public_key().to_owned();

    let peer = eventually("the crafted peer on node1", || {
        get_one(&lab, "node1", "peers", &public)
    });

    let table = lab.exec("node1", &["wirespan", "get", "peers"]);
    assert!(table.status.success());
    let row = String::from_utf8_lossy(&table.stdout)
        .lines()
        .find(|l| l.contains(&public))
        .unwrap_or_else(|| panic!("no row for the crafted peer"))
        .to_owned();
    assert!(row.contains("evil\"} 1"), "{row}");
    assert!(!table.stdout.contains(&0x1b), "raw ESC printed: {row:?}");

    let addr = node(&st, "node1")["metricsAddress"]
        .as_str()
        .unwrap()
        .to_owned();
    let metrics = eventually("node1's metrics to list the crafted peer", || {
        let text = lab.exec_ok(
            "node1",
            &[
                "curl",
                "-sSf",
                "--max-time",
                "5",
                &format!("http://{addr}/metrics"),
            ],
        );
        text.contains(&public).then_some(text)
    });
    assert!(
        !metrics.lines().any(|l| l.starts_with("forged_series")),
        "{metrics}"
    );
    let up = metrics
        .lines()
        .find(|l| l.starts_with("wirespan_kubespan_peer_up{") && l.contains(&public))
        .unwrap();
    assert!(up.contains("label=\"evil\\\"} 1"), "{up}");

    // The first defence: the name was sanitised when decoded.
    let label = peer["spec"]["label"].as_str().unwrap();
    assert!(label.starts_with("evil\"} 1"), "{peer}");
    assert!(
        !label.contains(['\n', '\u{1b}']),
        "sanitised at decode: {label:?}"
    );
}
