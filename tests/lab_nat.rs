//! `wirespan lab up --topology`: nodes behind NAT routers and blocked pairs, through
//! the real binary. Each lab has a guard that runs `lab down` even when a test fails.
//!
//! NAT is shown to have happened from three sides: the discovery server observed each
//! NATed node at its router's WAN address, a peer's WireGuard endpoint for a NATed
//! node is that WAN address (with the node's own port behind a cone NAT), and the
//! router's conntrack table holds the translation.

mod common;

use std::{collections::BTreeMap, process::Command};

use common::{
    lab::Lab,
    talos::{self, TalosPeer},
};
use serde_json::Value;

/// The cells of one ping matrix of `lab up`'s output: (from, to) → reply seen.
fn matrix(out: &str, title: &str) -> BTreeMap<(String, String), bool> {
    let mut lines = out.lines().skip_while(|l| !l.starts_with(title));
    let header: Vec<String> = lines
        .next()
        .unwrap_or_else(|| panic!("no {title:?} matrix in:\n{out}"))
        .split_whitespace()
        .skip(2)
        .map(str::to_owned)
        .collect();
    let mut cells = BTreeMap::new();
    for line in lines.take(header.len()) {
        // Cells are `-`, `FAIL` or `ok 0.42ms` (two words).
        let words: Vec<&str> = line.split_whitespace().collect();
        let mut it = words[1..].iter();
        for to in &header {
            match *it.next().unwrap() {
                "ok" => {
                    it.next();
                    cells.insert((words[0].to_owned(), to.clone()), true);
                }
                "FAIL" => {
                    cells.insert((words[0].to_owned(), to.clone()), false);
                }
                _ => {}
            }
        }
    }
    cells
}

/// `node`'s entry in `lab status -o json`.
fn node<'a>(st: &'a Value, name: &str) -> &'a Value {
    st["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == name)
        .unwrap_or_else(|| panic!("no {name} in {st}"))
}

/// What `from` reports about its peer `to`: (state, endpoint, expected).
fn peer(st: &Value, from: &str, to: &str) -> (String, String, String) {
    let p = node(st, from)["peers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["node"] == to)
        .unwrap_or_else(|| panic!("{from} has no peer {to}: {st}"));
    let s = |k: &str| p[k].as_str().unwrap_or_default().to_owned();
    (s("state"), s("endpoint"), s("expected"))
}

/// How `from` reaches its peer `to`: (path, via).
fn path(st: &Value, from: &str, to: &str) -> (String, String) {
    let p = node(st, from)["peers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["node"] == to)
        .unwrap_or_else(|| panic!("{from} has no peer {to}: {st}"));
    let s = |k: &str| p[k].as_str().unwrap_or_default().to_owned();
    (s("path"), s("via"))
}

fn wan(st: &Value, name: &str) -> String {
    node(st, name)["router"]["wan"][0]
        .as_str()
        .unwrap_or_else(|| panic!("{name} has no router: {st}"))
        .to_owned()
}

/// The UDP flows in a router's conntrack table: the original direction's
/// `src dst sport dport` and the reply direction's.
fn udp_flows(router_ns: &str) -> Vec<([String; 4], [String; 4])> {
    // The proc file where the kernel has it, else conntrack(8).
    let proc = Command::new("ip")
        .args(["netns", "exec", router_ns, "cat", "/proc/net/nf_conntrack"])
        .output()
        .unwrap();
    let text = if proc.status.success() {
        proc.stdout
    } else {
        let o = Command::new("ip")
            .args(["netns", "exec", router_ns, "conntrack", "-L", "-p", "udp"])
            .output()
            .expect("conntrack(8) (scripts/setup.sh installs it)");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        o.stdout
    };
    String::from_utf8_lossy(&text)
        .lines()
        .filter(|l| l.contains(" udp "))
        .map(|l| {
            let vals = |k: &str| -> Vec<String> {
                l.split_whitespace()
                    .filter_map(|w| w.strip_prefix(k))
                    .map(str::to_owned)
                    .collect()
            };
            let (src, dst, sp, dp) = (vals("src="), vals("dst="), vals("sport="), vals("dport="));
            (
                [src[0].clone(), dst[0].clone(), sp[0].clone(), dp[0].clone()],
                [src[1].clone(), dst[1].clone(), sp[1].clone(), dp[1].clone()],
            )
        })
        .collect()
}

/// Where NATed node `name`'s WireGuard packets to `dst` (port 51820) come from: its
/// router's WAN address and the port the router mapped the flow to (the reply
/// direction's destination port of the flow in the router's conntrack table).
fn mapped_endpoint(st: &Value, name: &str, dst: &str) -> String {
    let lan = node(st, name)["addresses"]["underlay"][0]
        .as_str()
        .unwrap()
        .to_owned();
    let flows = udp_flows(node(st, name)["router"]["namespace"].as_str().unwrap());
    flows
        .iter()
        .find(|(o, _)| o[0] == lan && o[1] == dst && o[2] == "51820" && o[3] == "51820")
        .map(|(_, r)| format!("{}:{}", wan(st, name), r[3]))
        .unwrap_or_else(|| panic!("no flow {name} -> {dst} in {flows:?}"))
}

/// Three nodes, each behind a port-preserving NAT: the discovery server sees each at
/// its router's WAN address, the node publishes that address, and every pair comes
/// up directly by simultaneous open (both sides send to the other's WAN address and
/// WireGuard port) and pings over the mesh.
#[test]
fn cone_nat_nodes_mesh_directly_through_their_routers() {
    let lab = Lab::new();
    let out = lab.ok(&[
        "up",
        "--topology",
        "cone",
        "--nodes",
        "3",
        "--timeout",
        "90s",
        "--no-hints",
    ]);
    let st = lab.status();
    assert_eq!(st["topology"], "cone");
    assert_eq!(st["expectedServerRelayed"], serde_json::json!([]));
    let names = ["node1", "node2", "node3"];
    for n in names {
        let v = node(&st, n);
        assert_eq!(v["nat"], "cone", "{v}");
        assert_eq!(v["publicAddress"].as_str().unwrap(), wan(&st, n), "{v}");
        // The discovery server saw the router's WAN address, not the LAN one.
        assert_eq!(v["observedAddress"].as_str().unwrap(), wan(&st, n), "{v}");
        assert!(
            v["addresses"]["underlay"][0]
                .as_str()
                .unwrap()
                .starts_with("192.168."),
            "{v}"
        );
    }
    for a in names {
        for b in names.iter().filter(|b| **b != a) {
            let (state, endpoint, expected) = peer(&st, a, b);
            assert_eq!(
                (state.as_str(), expected.as_str()),
                ("up", "direct"),
                "{a}->{b}"
            );
            // The router's WAN address with the node's own port: port preserved.
            assert_eq!(endpoint, format!("{}:51820", wan(&st, b)), "{a}->{b}");
        }
    }
    let pings = matrix(&out, "ping kubespan");
    assert_eq!(pings.len(), 6, "{out}");
    assert!(pings.values().all(|ok| *ok), "{out}");
    // The router rewrote node1's LAN source to its WAN address, keeping the port.
    let lan1 = node(&st, "node1")["addresses"]["underlay"][0]
        .as_str()
        .unwrap()
        .to_owned();
    let flows = udp_flows(node(&st, "node1")["router"]["namespace"].as_str().unwrap());
    let to_node2 = flows
        .iter()
        .find(|(o, _)| o[0] == lan1 && o[1] == wan(&st, "node2") && o[3] == "51820")
        .unwrap_or_else(|| panic!("no flow node1 -> node2 in {flows:?}"));
    assert_eq!(to_node2.1[1], wan(&st, "node1"), "{to_node2:?}");
    assert_eq!(to_node2.1[3], "51820", "{to_node2:?}");
    // `lab down` finds the routers by the lab's prefix.
    let pids = lab.pids();
    assert_eq!(lab.namespaces().len(), 3 + 3 + 2, "{:?}", lab.namespaces());
    lab.ok(&["down"]);
    lab.assert_gone(&pids);
}

/// `lab up` of the `mixed` topology with 4 nodes, waiting up to 90 s.
const MIXED4: [&str; 8] = [
    "up",
    "--topology",
    "mixed",
    "--nodes",
    "4",
    "--timeout",
    "90s",
    "--no-hints",
];

/// `mixed` with 4 nodes: node1 public, node2 and node3 behind cone NATs, node4 behind
/// a symmetric NAT. node2<->node4 and node3<->node4 cannot connect directly; node1
/// reaches both ends of each, so `up` waits until both pairs run through node1 as a
/// peer relay and every pair pings over the mesh. node1 reaches node4 at the port the
/// symmetric NAT mapped for node1 alone.
#[test]
fn mixed_nat_lab_connects_direct_pairs_directly_and_the_rest_through_a_relay() {
    let lab = Lab::new();
    let o = lab.run(&MIXED4);
    let err = String::from_utf8_lossy(&o.stderr);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{err}\n{out}");
    assert!(
        err.contains(
            "through a relay: node2<->node4 (symmetric NAT facing a cone NAT), \
             node3<->node4 (symmetric NAT facing a cone NAT)"
        ),
        "{err}"
    );
    let st = lab.status();
    let kinds: Vec<&str> = st["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["nat"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["none", "cone", "cone", "symmetric"]);
    assert_eq!(st["expectedRelayed"].as_array().unwrap().len(), 2);
    assert_eq!(st["expectedServerRelayed"], serde_json::json!([]));
    assert_eq!(node(&st, "node1")["publicAddress"], "10.99.1.11");
    assert_eq!(
        node(&st, "node4")["observedAddress"].as_str().unwrap(),
        wan(&st, "node4")
    );
    let relay = [("node2", "node4"), ("node3", "node4")];
    let all = ["node1", "node2", "node3", "node4"];
    let pings = matrix(&out, "ping kubespan");
    for a in all {
        for b in all.iter().filter(|b| **b != a) {
            let needs_relay = relay.contains(&(a, b)) || relay.contains(&(b, a));
            let (state, _, expected) = peer(&st, a, b);
            let (path, via) = path(&st, a, b);
            if needs_relay {
                assert_eq!(
                    (expected.as_str(), path.as_str(), via.as_str()),
                    ("relay", "relay", "node1"),
                    "{a}->{b}"
                );
                // No direct handshake: the pair's own state never reads up.
                assert_ne!(state, "up", "{a}->{b} reported up");
            } else {
                assert_eq!(
                    (state.as_str(), expected.as_str(), path.as_str()),
                    ("up", "direct", "direct"),
                    "{a}->{b}"
                );
            }
            assert!(pings[&(a.to_owned(), (*b).to_owned())], "{a}->{b}\n{out}");
        }
    }
    // The table says where each node sits.
    let table = lab.ok(&["status"]);
    let row4 = table.lines().find(|l| l.starts_with("node4 ")).unwrap();
    assert!(row4.contains("symmetric"), "{table}");
    // node1 learnt node4's endpoint from node4's handshakes (roaming): the port
    // node4's router mapped for node1, which is not the port it mapped elsewhere.
    let (_, endpoint, _) = peer(&st, "node1", "node4");
    assert_eq!(endpoint, mapped_endpoint(&st, "node4", "10.99.1.11"));
}

/// A topology file with a blocked pair: node1 and node2 exchange no UDP, so their
/// direct path stays down; node3 reaches both, and the pair connects through it as a
/// peer relay while every other pair is up directly.
#[test]
fn a_blocked_pair_in_a_topology_file_connects_through_the_node_that_reaches_both() {
    let lab = Lab::new();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("topology.yaml");
    std::fs::write(
        &file,
        "nodes:\n  - nat: none\n  - nat: none\n  - nat: cone\nblock:\n  - [node1, node2]\n",
    )
    .unwrap();
    let o = lab.run(&[
        "up",
        "--topology",
        file.to_str().unwrap(),
        "--timeout",
        "180s",
        "--no-hints",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("through a relay: node1<->node2 (UDP blocked between them)"),
        "{err}"
    );
    let st = lab.status();
    assert_eq!(st["blocked"], serde_json::json!([["node1", "node2"]]));
    let pings = matrix(&out, "ping kubespan");
    for (a, b) in [("node1", "node2"), ("node2", "node1")] {
        let (state, _, expected) = peer(&st, a, b);
        assert_eq!(expected, "relay");
        assert_ne!(state, "up", "{a}->{b} reported up");
        assert_eq!(
            path(&st, a, b),
            ("relay".into(), "node3".into()),
            "{a}->{b}"
        );
        assert!(pings[&(a.to_owned(), b.to_owned())], "{a}->{b}\n{out}");
    }
    for (a, b) in [
        ("node1", "node3"),
        ("node3", "node1"),
        ("node2", "node3"),
        ("node3", "node2"),
    ] {
        let (state, _, expected) = peer(&st, a, b);
        assert_eq!(
            (state.as_str(), expected.as_str()),
            ("up", "direct"),
            "{a}->{b}"
        );
    }
    // The underlay's rule dropped the pair's handshakes.
    let rules = Command::new("ip")
        .args([
            "netns",
            "exec",
            st["underlayNamespace"].as_str().unwrap(),
            "nft",
            "list",
            "table",
            "bridge",
            "wirespan_lab_block",
        ])
        .output()
        .unwrap();
    let rules = String::from_utf8_lossy(&rules.stdout);
    let dropped = rules
        .lines()
        .filter(|l| l.contains("ip saddr 10.99.1.11 ip daddr 10.99.1.12"))
        .any(|l| !l.contains("packets 0 "));
    assert!(dropped, "{rules}");
}

/// Two nodes, both behind symmetric NATs: no direct path, and no third node to relay.
/// Both ask the lab's discovery server for a relay allocation (it runs with
/// `--relay`), send to their side's port, and ping each other through it; each
/// reports the path as `server` via the relay's address.
#[test]
fn two_nodes_behind_symmetric_nats_connect_through_the_server_relay() {
    symmetric_lab_connects_through_the_server_relay(2);
}

/// Every node behind a symmetric NAT: no direct path and no node to relay, so each of
/// the three pairs gets its own allocation at the server relay.
#[test]
fn every_pair_of_a_symmetric_lab_connects_through_the_server_relay() {
    symmetric_lab_connects_through_the_server_relay(3);
}

fn symmetric_lab_connects_through_the_server_relay(nodes: usize) {
    let lab = Lab::new();
    let n = nodes.to_string();
    let o = lab.run(&[
        "up",
        "--topology",
        "symmetric",
        "--nodes",
        &n,
        "--timeout",
        "90s",
        "--no-hints",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{err}\n{out}");
    let st = lab.status();
    let relay_ip = st["discovery"]["address"]
        .as_str()
        .unwrap()
        .rsplit_once(':')
        .unwrap()
        .0
        .to_owned();
    let names: Vec<String> = (1..=nodes).map(|i| format!("node{i}")).collect();
    let pings = matrix(&out, "ping kubespan");
    let mut allocations = std::collections::BTreeSet::new();
    for (i, a) in names.iter().enumerate() {
        for b in &names[i + 1..] {
            let listed = err
                .split_once("through the server relay: ")
                .is_some_and(|(_, pairs)| {
                    pairs.contains(&format!("{a}<->{b} (symmetric NAT on both sides)"))
                });
            assert!(listed, "{a}<->{b}: {err}");
            for (x, y) in [(a, b), (b, a)] {
                let (state, endpoint, expected) = peer(&st, x, y);
                let (path, via) = path(&st, x, y);
                assert_eq!(
                    (state.as_str(), expected.as_str(), path.as_str()),
                    ("up", "server", "server"),
                    "{x}->{y}"
                );
                // WireGuard sends to the relay, at this node's side of the allocation.
                assert_eq!(via, endpoint, "{x}->{y}");
                assert!(via.starts_with(&format!("{relay_ip}:")), "{x}->{y}: {via}");
                assert!(allocations.insert(via.clone()), "{via} used twice");
                assert!(pings[&(x.clone(), y.clone())], "{x}->{y}: {out}");
            }
        }
    }
    // Each side of each pair has its own port.
    assert_eq!(allocations.len(), nodes * (nodes - 1));
}

/// A bad topology is refused before anything is made, the message naming the field
/// (or the unknown name); a file's node count and `--nodes` must agree.
#[test]
fn a_bad_topology_is_refused_naming_the_field_and_makes_nothing() {
    let lab = Lab::new();
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "nodes:\n  - nat: full\n",
            vec![],
            "nodes[0].nat: \"full\" is not a NAT kind",
        ),
        (
            "nodes:\n  - nat: cone\n    port: 1\n",
            vec![],
            "nodes[0]: unknown field `port`",
        ),
        (
            "nodes:\n  - nat: cone\n  - nat: none\nblock:\n  - [node1, node5]\n",
            vec![],
            "block[0][1]: no node \"node5\"",
        ),
        (
            "nodes:\n  - nat: cone\n",
            vec!["--nodes", "2"],
            "--nodes 2: topology",
        ),
    ];
    for (i, (text, extra, want)) in cases.iter().enumerate() {
        let file = dir.path().join(format!("t{i}.yaml"));
        std::fs::write(&file, text).unwrap();
        let mut args = vec!["up", "--topology", file.to_str().unwrap(), "--no-wait"];
        args.extend(extra);
        let o = lab.run(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{text:?}: {err}");
    }
    let o = lab.run(&["up", "--topology", "star", "--no-wait"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--topology star: neither a built-in topology (flat, cone, symmetric, mixed)"),
        "{err}"
    );
    // The nodes' receive window, checked by the node's own rule.
    let o = lab.run(&["up", "--peer-receive-timeout", "5s", "--no-wait"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("--peer-receive-timeout: 5s is out of range (6s–5m)"),
        "{err}"
    );
    assert!(lab.namespaces().is_empty(), "{:?}", lab.namespaces());
    assert!(!lab.dir().exists());
}

/// Pings from a namespace: five echo replies of 1000 bytes within a 20 s deadline (a
/// packet lost to a busy machine is resent, not a failure); the target follows.
const PING: [&str; 11] = [
    "ping", "-n", "-q", "-c", "5", "-i", "0.2", "-s", "1000", "-w", "20",
];

/// `from`'s peer status of the peer with `key` (a peer that is not a lab node has no
/// `node`).
fn peer_by_key<'a>(st: &'a Value, from: &str, key: &str) -> Option<&'a Value> {
    node(st, from)["peers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["publicKey"] == key)
}

/// A Talos node (tests/common/talos.rs: stock wireguard-go set up with `wg` as Talos
/// sets up its device, its affiliate published in the upstream format) on the public
/// segment of a `mixed` lab: node1 public, node2 and node3 behind cone NATs, node4
/// behind a symmetric NAT. Being public, it has a direct path to every node: the
/// NATed nodes open their routers towards it by sending first (they learn its endpoint
/// from its affiliate), and its WireGuard answers at the address each handshake came
/// from. Shown from both sides' devices and from real traffic: each node has it `up`
/// and `direct` at its published endpoint, its device has a recent handshake with
/// every node at the node's router's mapping (node4's symmetric NAT: the port it
/// mapped for the Talos node, which only roaming can learn), and pings cross the
/// tunnel both ways. It never takes part in relaying: the pairs that need a relay still go
/// through node1, no peer is reached via the Talos node, and its WireGuard peer on
/// every node holds its own prefixes only.
#[test]
fn a_talos_node_on_the_public_segment_meshes_directly_with_nodes_behind_nat() {
    let lab = Lab::new();
    lab.ok(&MIXED4);
    let st = lab.status();
    let all = ["node1", "node2", "node3", "node4"];
    let kinds: Vec<&str> = all
        .iter()
        .map(|n| node(&st, n)["nat"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["none", "cone", "cone", "symmetric"]);
    let key = |n: &str| node(&st, n)["publicKey"].as_str().unwrap().to_owned();

    let talos = TalosPeer::builder(&st).start();
    let talos_endpoint = talos.endpoint().to_string();
    for n in all {
        let v = node(&st, n);
        // The discovery server saw each node where the lab put it (behind NAT: its
        // router's WAN address), and the node published that address as an endpoint:
        // what a Talos node reads from discovery, and the endpoint it is given.
        assert_eq!(v["observedAddress"], v["publicAddress"], "{v}");
        let observed = format!("{}:51820", v["observedAddress"].as_str().unwrap());
        let other = if n == "node1" { "node2" } else { "node1" };
        let spec: Value = serde_json::from_str(&lab.exec_ok(
            other,
            &[
                "wirespan",
                "get",
                "kubespanpeerspecs",
                &key(n),
                "-o",
                "json",
            ],
        ))
        .unwrap();
        assert!(
            spec["spec"]["endpoints"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| *e == observed.as_str()),
            "{n} did not publish {observed}: {spec}"
        );
        talos.peer_with(v);
    }
    assert_eq!(
        talos.publish(),
        common::upstream::ip_bytes(talos.address()),
        "the discovery server saw the Talos node elsewhere"
    );
    let published = std::time::Instant::now();

    // Every node has it up, directly, at its published endpoint (NATed ones too: they
    // reach the public segment through their routers).
    within(
        60,
        "every node to have the Talos node up and direct",
        || {
            let st = lab.status();
            let not_yet: Vec<String> = all
                .iter()
                .filter_map(|n| {
                    let p = peer_by_key(&st, n, talos.public_key());
                    let ok = p.is_some_and(|p| {
                        p["state"] == "up"
                            && p["path"] == "direct"
                            && p["endpoint"] == talos_endpoint.as_str()
                    });
                    (!ok).then(|| format!("{n}: {}", p.unwrap_or(&Value::Null)))
                })
                .collect();
            not_yet
                .is_empty()
                .then_some(())
                .ok_or_else(|| not_yet.join("; "))
        },
    );

    // Its device has a recent handshake with every node, at the address and port the
    // node's packets come from: node1's own, a cone NAT's WAN address with the node's
    // port, the port node4's symmetric NAT mapped for the Talos node.
    within(
        60,
        "a recent handshake of the Talos device with every node",
        || {
            let peers: Vec<(&str, Option<u64>)> = all
                .iter()
                .map(|n| (*n, talos.peer(&key(n)).handshake_age()))
                .collect();
            peers
                .iter()
                .all(|(_, age)| age.is_some_and(|a| a < 150))
                .then_some(())
                .ok_or_else(|| format!("{peers:?}"))
        },
    );
    let talos_ip = talos.address().to_string();
    let at = |n: &str| talos.peer(&key(n)).endpoint;
    eprintln!(
        "every node up with the Talos node {:.1}s after it published; its device has {}",
        published.elapsed().as_secs_f64(),
        all.map(|n| format!("{n} at {}", at(n))).join(", ")
    );
    assert_eq!(at("node1"), "10.99.1.11:51820");
    for n in ["node2", "node3"] {
        assert_eq!(at(n), format!("{}:51820", wan(&st, n)), "{n}");
        // The router kept the node's port for the flow to the Talos node.
        assert_eq!(mapped_endpoint(&st, n, &talos_ip), at(n), "{n}");
    }
    assert_eq!(mapped_endpoint(&st, "node4", &talos_ip), at("node4"));

    // Real traffic through the tunnel, both ways, counted by the Talos device.
    for n in all {
        let k = key(n);
        let before = talos.peer(&k);
        let v = node(&st, n);
        let ula = v["addresses"]["kubespan"]
            .as_str()
            .unwrap()
            .split('/')
            .next()
            .unwrap();
        // Its own address: for a NATed node a LAN address only the tunnel reaches.
        let addr = v["addresses"]["underlay"][0].as_str().unwrap();
        for to in [&talos_ip, &talos.ula().to_string()] {
            lab.exec_ok(n, &[&PING[..], &[to.as_str()]].concat());
        }
        for to in [addr, ula] {
            talos.run(&[&PING[..], &[to]].concat());
        }
        let after = talos.peer(&k);
        // Each way at least 10 echo requests and 10 replies of 1000 bytes.
        assert!(
            after.rx - before.rx >= 20 * 1000,
            "{n}: {before:?} {after:?}"
        );
        assert!(
            after.tx - before.tx >= 20 * 1000,
            "{n}: {before:?} {after:?}"
        );
    }

    // No relaying with the Talos node: the pairs that need a relay still go through
    // node1, no node reaches any peer via the Talos node or the Talos node via anyone,
    // and its WireGuard peer on every node holds its own prefixes only (a relay's
    // peer would also hold the relayed peer's).
    let st = lab.status();
    for (a, b) in [("node2", "node4"), ("node3", "node4")] {
        assert_eq!(
            path(&st, a, b),
            ("relay".into(), "node1".into()),
            "{a}->{b}"
        );
        assert_eq!(
            path(&st, b, a),
            ("relay".into(), "node1".into()),
            "{b}->{a}"
        );
    }
    for n in all {
        for p in node(&st, n)["peers"].as_array().unwrap() {
            assert_ne!(p["via"], talos::NODENAME, "{n}: {p}");
        }
        let p = peer_by_key(&st, n, talos.public_key()).unwrap();
        assert_eq!(
            (&p["path"], &p["via"]),
            (&"direct".into(), &Value::Null),
            "{n}: {p}"
        );
        let allowed = lab.exec_ok(n, &["wg", "show", "kubespan", "allowed-ips"]);
        let mut theirs: Vec<&str> = allowed
            .lines()
            .find_map(|l| l.strip_prefix(talos.public_key()))
            .unwrap_or_else(|| panic!("{n} has no WireGuard peer for the Talos node"))
            .split_whitespace()
            .collect();
        theirs.sort_unstable();
        assert_eq!(theirs, talos.allowed_ips(), "{n}");
    }
}

/// Polls `f` every 200 ms until it holds, failing after `secs` with what it last saw.
fn within(secs: u64, what: &str, mut f: impl FnMut() -> Result<(), String>) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        match f() {
            Ok(()) => return,
            Err(seen) if std::time::Instant::now() >= deadline => {
                panic!("timed out after {secs}s waiting for {what}; last seen: {seen}")
            }
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(200)),
        }
    }
}

/// Both ends' (path, via) for the pair `a`, `b`, from `lab status`.
fn pair_paths(lab: &Lab, a: &str, b: &str) -> [(String, String); 2] {
    let st = lab.status();
    [path(&st, a, b), path(&st, b, a)]
}

/// A direct path that fails while the mesh runs: three nodes up directly, then the
/// underlay drops UDP between node1 and node2. Once node1's receive window passes, both
/// ends move the pair to node3, the node that reaches both, and ping over the mesh
/// again; when the drop is lifted, the direct handshake the relayed peers keep retrying
/// succeeds and the pair is direct again.
#[test]
fn a_direct_path_that_fails_moves_to_a_relay_and_back_when_it_heals() {
    let lab = Lab::new();
    lab.ok(&["up", "--nodes", "3", "--timeout", "60s", "--no-hints"]);
    let st = lab.status();
    let underlay = |n: &str| -> Vec<String> {
        node(&st, n)["addresses"]["underlay"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_owned())
            .collect()
    };
    let ula2 = node(&st, "node2")["addresses"]["kubespan"]
        .as_str()
        .unwrap()
        .to_owned();
    let ns = st["underlayNamespace"].as_str().unwrap().to_owned();
    let nft = |script: &str| {
        let mut c = Command::new("ip")
            .args(["netns", "exec", &ns, "nft", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write as _;
        c.stdin
            .take()
            .unwrap()
            .write_all(script.as_bytes())
            .unwrap();
        assert!(c.wait().unwrap().success(), "nft -f: {script}");
    };
    let ping = |from: &str| {
        lab.exec_ok(
            from,
            &[
                "ping", "-n", "-q", "-c", "3", "-i", "0.2", "-w", "20", &ula2,
            ],
        );
    };
    ping("node1");
    assert_eq!(
        pair_paths(&lab, "node1", "node2"),
        [
            ("direct".into(), String::new()),
            ("direct".into(), String::new())
        ]
    );

    // The cut, in the lab's own underlay namespace (removed with the lab).
    let mut rules = String::new();
    for (x, y) in [
        (underlay("node1"), underlay("node2")),
        (underlay("node2"), underlay("node1")),
    ] {
        for s in &x {
            for d in y.iter().filter(|d| d.contains(':') == s.contains(':')) {
                let fam = if s.contains(':') { "ip6" } else { "ip" };
                rules.push_str(&format!(
                    "{fam} saddr {s} {fam} daddr {d} meta l4proto udp drop\n"
                ));
            }
        }
    }
    nft(&format!(
        "table bridge wirespan_test_cut {{ chain forward {{ type filter hook forward priority filter; policy accept;\n{rules}}}\n}}\n"
    ));
    let cut = std::time::Instant::now();
    let relayed = [
        ("relay".to_owned(), "node3".to_owned()),
        ("relay".to_owned(), "node3".to_owned()),
    ];
    within(90, "node1<->node2 through node3", || {
        let got = pair_paths(&lab, "node1", "node2");
        (got == relayed).then_some(()).ok_or(format!("{got:?}"))
    });
    ping("node1");
    eprintln!(
        "relayed and pinging {:.1}s after the cut",
        cut.elapsed().as_secs_f64()
    );

    nft("delete table bridge wirespan_test_cut\n");
    let healed = std::time::Instant::now();
    let direct = [
        ("direct".to_owned(), String::new()),
        ("direct".to_owned(), String::new()),
    ];
    within(60, "node1<->node2 direct again", || {
        let got = pair_paths(&lab, "node1", "node2");
        (got == direct).then_some(()).ok_or(format!("{got:?}"))
    });
    ping("node1");
    eprintln!(
        "direct again {:.1}s after the repair",
        healed.elapsed().as_secs_f64()
    );
}
