//! `wirespan lab status`: every node's peers, as a table or JSON for scripts.

use std::fmt::Write as _;

use serde_json::{json, Value};
use wirespan_discovery::text::escape_terminal;

use super::{
    host,
    observe::{self, NodeView},
    plan::{self, LabState},
};

/// Observes every node of the lab.
pub async fn observe_all(state: &LabState) -> Vec<NodeView> {
    let mut views = Vec::with_capacity(state.nodes.len());
    for n in &state.nodes {
        views.push(observe::observe(&n.socket).await);
    }
    views
}

/// Per node, what it still lacks: every peer it can reach directly (by the topology's
/// rule) `up`; every peer that needs a relay reached through one when some node can
/// relay the pair, else at least known (its identity published and the peer
/// configured; it is never waited `up`).
#[must_use]
pub fn pending(state: &LabState, views: &[NodeView]) -> Vec<(String, Vec<String>)> {
    state
        .nodes
        .iter()
        .zip(views)
        .enumerate()
        .map(|(i, (node, view))| {
            let (mut direct, mut relay, mut server) = (Vec::new(), Vec::new(), Vec::new());
            for (j, (n, v)) in state.nodes.iter().zip(views).enumerate() {
                let other = (n.name.clone(), v.public_key.clone());
                match expected_path(state, i, j) {
                    _ if j == i => {}
                    "direct" => direct.push(other),
                    "relay" => relay.push(other),
                    _ => server.push(other),
                }
            }
            let mut p = observe::not_up(view, &direct);
            p.extend(observe::not_relayed(view, &relay));
            p.extend(observe::not_server_relayed(view, &server));
            if !view.api {
                p = direct
                    .iter()
                    .chain(&relay)
                    .chain(&server)
                    .map(|(n, _)| format!("{n}: the node's API does not answer"))
                    .collect();
            }
            (node.name.clone(), p)
        })
        .collect()
}

/// How nodes `i` and `j` should reach each other: `direct`, `relay` (no direct path,
/// but a third node reaches both) or `server` (the lab's discovery server relays).
fn expected_path(state: &LabState, i: usize, j: usize) -> &'static str {
    let topology = state.topology();
    match topology.direct(i, j) {
        Ok(()) => "direct",
        Err(_) if !topology.relays(i, j).is_empty() => "relay",
        Err(_) => "server",
    }
}

/// The pairs that need a relay and have a node for it, or (`relayed` false) have
/// none, as `node2<->node4 (why)`.
fn pairs_needing_relay(state: &LabState, relayed: bool) -> Vec<String> {
    let topology = state.topology();
    topology
        .unreachable()
        .into_iter()
        .filter(|(a, b, _)| topology.relays(*a, *b).is_empty() != relayed)
        .map(|(a, b, why)| {
            format!(
                "{}<->{} ({})",
                state.nodes[a].name,
                state.nodes[b].name,
                why.as_str()
            )
        })
        .collect()
}

/// The pairs that connect only through a peer relay.
#[must_use]
pub fn expected_relayed(state: &LabState) -> Vec<String> {
    pairs_needing_relay(state, true)
}

/// The pairs that connect only through the server relay: no direct path, and no
/// node reaches both.
#[must_use]
pub fn expected_server_relayed(state: &LabState) -> Vec<String> {
    pairs_needing_relay(state, false)
}

/// What the topology expects between node `i` and the node with `public_key`:
/// `direct`, `relay` or `server`.
fn expectation(state: &LabState, views: &[NodeView], i: usize, public_key: &str) -> &'static str {
    views
        .iter()
        .position(|v| !v.public_key.is_empty() && v.public_key == public_key)
        .map_or("direct", |j| expected_path(state, i, j))
}

/// Name of the lab node with `public_key`, if any.
fn node_of<'a>(state: &'a LabState, views: &[NodeView], public_key: &str) -> Option<&'a str> {
    state
        .nodes
        .iter()
        .zip(views)
        .find(|(_, v)| !v.public_key.is_empty() && v.public_key == public_key)
        .map(|(n, _)| n.name.as_str())
}

fn table(rows: &[Vec<String>]) -> String {
    // Cells show names the nodes chose: an escape sequence is printed as text.
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| r.iter().map(|c| escape_terminal(c).into_owned()).collect())
        .collect();
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(String::len)
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut s = String::new();
    for r in &rows {
        let mut line = String::new();
        for (c, cell) in r.iter().enumerate() {
            let _ = write!(line, "{cell:<w$}   ", w = widths[c]);
        }
        s.push_str(line.trim_end());
        s.push('\n');
    }
    s
}

/// The summary table: one row per node.
#[must_use]
pub fn render_nodes(state: &LabState, views: &[NodeView]) -> String {
    let mut rows = vec![[
        "NODE",
        "NAMESPACE",
        "UNDERLAY",
        "NAT",
        "PUBLIC ADDRESS",
        "KUBESPAN",
        "PUBLIC KEY",
        "PEERS UP",
        "WIREGUARD",
        "DAEMON",
    ]
    .map(String::from)
    .to_vec()];
    for (n, v) in state.nodes.iter().zip(views) {
        let up = v.peers.iter().filter(|p| p.state == "up").count();
        rows.push(vec![
            n.name.clone(),
            n.namespace.clone(),
            n.underlay
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(","),
            n.nat.as_str().to_owned(),
            n.public_addresses()
                .first()
                .map_or_else(|| "-".into(), ToString::to_string),
            v.kubespan_address
                .map(|a| a.to_string())
                .unwrap_or_else(|| "-".into()),
            if v.public_key.is_empty() {
                "-".into()
            } else {
                v.public_key.clone()
            },
            format!("{up}/{}", state.nodes.len() - 1),
            if v.wireguard.is_empty() {
                "-".into()
            } else {
                v.wireguard.clone()
            },
            daemon_state(n.pid, v),
        ]);
    }
    let mut s = table(&rows);
    for line in expected_relayed(state) {
        let _ = writeln!(s, "through a relay: {line}");
    }
    for line in expected_server_relayed(state) {
        let _ = writeln!(s, "through the server relay: {line}");
    }
    s
}

fn daemon_state(pid: u32, v: &NodeView) -> String {
    match (host::alive(i32::try_from(pid).unwrap_or(0)), v.api) {
        (true, true) => "running".into(),
        (true, false) => "no API".into(),
        (false, _) => "exited".into(),
    }
}

/// Every node's peers: one row per peer.
#[must_use]
pub fn render_peers(state: &LabState, views: &[NodeView]) -> String {
    let mut rows = vec![[
        "NODE",
        "PEER",
        "PUBLIC KEY",
        "ENDPOINT",
        "STATE",
        "PATH",
        "VIA",
        "EXPECTED",
    ]
    .map(String::from)
    .to_vec()];
    let mut notes = String::new();
    for (i, (n, v)) in state.nodes.iter().zip(views).enumerate() {
        for p in &v.peers {
            let peer = node_of(state, views, &p.public_key)
                .map(str::to_owned)
                .unwrap_or_else(|| {
                    if p.label.is_empty() {
                        "?".into()
                    } else {
                        p.label.clone()
                    }
                });
            rows.push(vec![
                n.name.clone(),
                peer,
                p.public_key.clone(),
                if p.endpoint.is_empty() {
                    "-".into()
                } else {
                    p.endpoint.clone()
                },
                p.state.clone(),
                if p.path.is_empty() {
                    "-".into()
                } else {
                    p.path.clone()
                },
                if p.via.is_empty() {
                    "-".into()
                } else {
                    p.via.clone()
                },
                expectation(state, views, i, &p.public_key).to_owned(),
            ]);
        }
        if let Some(e) = &v.error {
            let _ = writeln!(notes, "{}: {e}", n.name);
        }
    }
    let mut s = table(&rows);
    s.push_str(&notes);
    s
}

/// The JSON document of `status -o json`.
#[must_use]
pub fn to_json(state: &LabState, views: &[NodeView]) -> Value {
    let nodes: Vec<Value> = state
        .nodes
        .iter()
        .zip(views)
        .enumerate()
        .map(|(i, (n, v))| {
            let peers: Vec<Value> = v
                .peers
                .iter()
                .map(|p| {
                    json!({
                        "publicKey": p.public_key,
                        "label": p.label,
                        "node": node_of(state, views, &p.public_key),
                        "endpoint": p.endpoint,
                        "state": p.state,
                        "path": p.path,
                        "via": if p.via.is_empty() { Value::Null } else { json!(p.via) },
                        "expected": expectation(state, views, i, &p.public_key),
                    })
                })
                .collect();
            json!({
                "name": n.name,
                "hostname": n.name,
                "namespace": n.namespace,
                "mountNamespace": n.mount_namespace,
                "utsNamespace": n.uts_namespace,
                "socket": n.socket,
                "config": n.config,
                "stateDir": n.state_dir,
                "log": n.log,
                "metricsAddress": plan::node_metrics_address(),
                "pid": n.pid,
                "daemon": daemon_state(n.pid, v),
                "link": n.link,
                "addresses": {
                    "underlay": n.underlay,
                    "kubespan": v.kubespan_address,
                },
                "publicKey": if v.public_key.is_empty() { Value::Null } else { json!(v.public_key) },
                // The WireGuard implementation that runs (null until the link is made).
                "wireguard": if v.wireguard.is_empty() { Value::Null } else { json!(v.wireguard) },
                "peers": peers,
                // Where it sits, the address the lab sees it at, and the address the
                // discovery server observed it at (null until the node reports it).
                "nat": n.nat.as_str(),
                "publicAddress": n.public_addresses().first(),
                "observedAddress": v.observed_address,
                "router": n.router,
                "error": v.error,
            })
        })
        .collect();
    let d = &state.discovery;
    json!({
        "name": state.name,
        "dir": state.dir,
        "clusterConfig": state.cluster_config,
        "fastPath": state.fast_path,
        // What was asked (`auto` picks per kernel; each node says what runs).
        "wireguard": if state.wireguard.is_empty() { "auto" } else { state.wireguard.as_str() },
        "underlayNamespace": state.underlay_namespace,
        "discovery": {
            "namespace": d.namespace,
            "address": d.address,
            "endpoint": d.endpoint,
            "metricsAddress": d.metrics_address,
            "pid": d.pid,
            "running": host::alive(i32::try_from(d.pid).unwrap_or(0)),
            "log": d.log,
        },
        "nodes": nodes,
        "topology": state.topology().name,
        "blocked": state.blocked,
        "expectedRelayed": expected_relayed(state),
        "expectedServerRelayed": expected_server_relayed(state),
    })
}

#[cfg(test)]
mod tests {
    use std::{net::SocketAddr, path::PathBuf};

    use super::*;
    use crate::cmd::lab::{
        observe::PeerView,
        plan::{DiscoveryState, NodeState},
    };

    fn lab(n: usize) -> LabState {
        let addr: SocketAddr = "10.99.1.2:3000".parse().unwrap();
        LabState {
            name: "t".into(),
            dir: PathBuf::from("/run/wirespan-lab/t"),
            cluster_config: PathBuf::from("/run/wirespan-lab/t/cluster.yaml"),
            fast_path: "nftables".into(),
            wireguard: "auto".into(),
            underlay_namespace: "wsl-t-underlay".into(),
            discovery: DiscoveryState {
                namespace: "wsl-t-disco".into(),
                address: addr,
                endpoint: format!("http://{addr}"),
                metrics_address: addr,
                pid: 0,
                log: PathBuf::new(),
            },
            nodes: (1..=n)
                .map(|i| NodeState {
                    name: format!("node{i}"),
                    namespace: format!("wsl-t-node{i}"),
                    mount_namespace: PathBuf::new(),
                    uts_namespace: PathBuf::new(),
                    socket: PathBuf::new(),
                    config: PathBuf::new(),
                    state_dir: PathBuf::new(),
                    log: PathBuf::new(),
                    pid: 0,
                    link: "eth0".into(),
                    underlay: Vec::new(),
                    nat: crate::cmd::lab::topology::Nat::None,
                    router: None,
                })
                .collect(),
            topology: String::new(),
            blocked: Vec::new(),
        }
    }

    fn view(key: &str, up: &[&str]) -> NodeView {
        NodeView {
            api: true,
            public_key: key.into(),
            peers: up
                .iter()
                .map(|k| PeerView {
                    public_key: (*k).into(),
                    label: String::new(),
                    endpoint: String::new(),
                    state: "up".into(),
                    path: "direct".into(),
                    via: String::new(),
                })
                .collect(),
            ..NodeView::default()
        }
    }

    #[test]
    fn pending_skips_pairs_that_need_a_relay_and_status_says_so() {
        use crate::cmd::lab::{plan::RouterState, topology::Nat};
        // node1 public, node2 cone, node3 symmetric: node2<->node3 needs a relay.
        let mut state = lab(3);
        state.topology = "mixed".into();
        state.nodes[1].nat = Nat::Cone;
        state.nodes[2].nat = Nat::Symmetric;
        state.nodes[2].router = Some(RouterState {
            namespace: "wsl-t-router3".into(),
            wan: vec!["10.99.1.13".parse().unwrap()],
            lan: "192.168.3.1".parse().unwrap(),
        });
        let mut views = [
            view("k1", &["k2", "k3"]),
            view("k2", &["k1"]),
            view("k3", &["k1"]),
        ];
        views[2].observed_address = Some("10.99.1.13".parse().unwrap());
        // node2 and node3 do not know each other yet.
        assert_eq!(pending(&state, &views)[1].1, ["node3: not a peer yet"]);
        assert_eq!(pending(&state, &views)[2].1, ["node2: not a peer yet"]);
        // Known, not up: node1 reaches both, so the pair waits for its relay.
        for (v, key) in [(1, "k3"), (2, "k2")] {
            views[v].peers.push(PeerView {
                public_key: key.into(),
                label: String::new(),
                endpoint: "10.99.1.13:51820".into(),
                state: "unknown".into(),
                path: "none".into(),
                via: String::new(),
            });
        }
        assert_eq!(
            pending(&state, &views)[1].1,
            ["node3: path none (state unknown)"]
        );
        for v in [1, 2] {
            views[v].peers[1].path = "relay".into();
            views[v].peers[1].via = "node1".into();
        }
        assert!(pending(&state, &views).iter().all(|(_, p)| p.is_empty()));
        assert_eq!(
            expected_relayed(&state),
            ["node2<->node3 (symmetric NAT facing a cone NAT)"]
        );
        assert!(expected_server_relayed(&state).is_empty());
        // A pair expected direct is still waited for up.
        views[1].peers[0].state = "down".into();
        assert_eq!(
            pending(&state, &views)[1].1,
            ["node1: state down (endpoint none)"]
        );

        // Blocking a pair by name makes it a relay pair too; with node1<->node2
        // blocked nobody reaches both ends of either pair of node2: both wait for the
        // server relay, up.
        state.blocked = vec![["node1".into(), "node2".into()]];
        assert_eq!(
            pending(&state, &views)[1].1,
            [
                "node1: path direct (state down)",
                "node3: path relay (state unknown)"
            ]
        );
        for p in &mut views[1].peers {
            p.path = "server".into();
            p.state = "up".into();
            p.via = "10.99.0.2:40000".into();
        }
        assert_eq!(
            pending(&state, &views)[2].1,
            ["node2: path relay (state unknown)"]
        );
        assert_eq!(
            pending(&state, &views)[0].1,
            ["node2: path direct (state up)"]
        );
        views[2].peers[1].path = "server".into();
        views[2].peers[1].state = "up".into();
        views[0].peers[0].path = "server".into();
        assert!(pending(&state, &views).iter().all(|(_, p)| p.is_empty()));
        views[1].peers.remove(0);
        let json = to_json(&state, &views);
        assert_eq!(json["topology"], "mixed");
        assert_eq!(json["blocked"], json!([["node1", "node2"]]));
        assert_eq!(json["expectedServerRelayed"].as_array().unwrap().len(), 2);
        assert_eq!(json["nodes"][2]["nat"], "symmetric");
        assert_eq!(json["nodes"][2]["publicAddress"], "10.99.1.13");
        assert_eq!(json["nodes"][2]["observedAddress"], "10.99.1.13");
        assert_eq!(json["nodes"][2]["router"]["namespace"], "wsl-t-router3");
        assert_eq!(json["nodes"][0]["router"], Value::Null);
        assert_eq!(json["nodes"][0]["peers"][1]["expected"], "direct");
        assert_eq!(json["nodes"][1]["peers"][0]["expected"], "server");
        assert_eq!(json["nodes"][1]["peers"][0]["path"], "server");
        assert_eq!(json["nodes"][1]["peers"][0]["via"], "10.99.0.2:40000");
        assert_eq!(json["nodes"][0]["peers"][1]["via"], Value::Null);
        let table = render_peers(&state, &views);
        assert!(
            table.lines().any(|l| l.starts_with("node2")
                && l.split_whitespace()
                    .rev()
                    .take(3)
                    .eq(["server", "10.99.0.2:40000", "server"])),
            "{table}"
        );
        let nodes = render_nodes(&state, &views);
        assert!(
            nodes.lines().nth(3).unwrap().contains("symmetric"),
            "{nodes}"
        );
        assert!(
            nodes.contains("through the server relay: node2<->node3"),
            "{nodes}"
        );
    }

    #[test]
    fn pending_is_empty_only_when_every_node_sees_every_other_up() {
        let state = lab(3);
        let all = [
            view("k1", &["k2", "k3"]),
            view("k2", &["k1", "k3"]),
            view("k3", &["k1", "k2"]),
        ];
        assert!(pending(&state, &all).iter().all(|(_, p)| p.is_empty()));

        let mut some = all.clone();
        some[2].peers.pop();
        some[1] = NodeView::default();
        let p = pending(&state, &some);
        // node2's key is unknown while its API is down: nobody can be checked against it.
        assert_eq!(p[0].1, ["node2: no KubeSpan identity yet"]);
        assert_eq!(
            p[1].1,
            [
                "node1: the node's API does not answer",
                "node3: the node's API does not answer"
            ]
        );
        assert_eq!(p[2].1, ["node2: no KubeSpan identity yet"]);

        // Peer rows are named by the node owning the key; each node says which
        // WireGuard runs, null while unknown.
        let mut all = all;
        all[0].wireguard = "userspace".into();
        let json = to_json(&state, &all);
        assert_eq!(json["nodes"][0]["wireguard"], "userspace");
        assert_eq!(json["nodes"][1]["wireguard"], Value::Null);
        assert!(render_nodes(&state, &all)
            .lines()
            .nth(1)
            .unwrap()
            .contains("userspace"));
        assert_eq!(json["nodes"][0]["peers"][1]["node"], "node3");
        assert_eq!(json["nodes"][2]["publicKey"], "k3");
    }

    #[test]
    fn table_cells_print_escape_sequences_as_text() {
        let out = table(&[
            vec!["NODE".into(), "LABEL".into()],
            vec!["node1".into(), "x\u{1b}[2J".into()],
        ]);
        assert!(!out.contains('\u{1b}'), "{out:?}");
        assert!(out.contains("node1   x\\x1b[2J"), "{out:?}");
    }
}
