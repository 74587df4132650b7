//! `wirespan get` of the cluster discovery types against a running node.

mod common;

use std::time::Duration;

use common::{bin_in, cli, wait_for_path, ChildGuard};
use wirespan_dataplane::netns::NetnsGuard;

#[test]
fn cluster_types_resolve_on_a_running_node() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("node.sock");
    let ns = NetnsGuard::new("wsclu").unwrap();
    let child = bin_in(&ns)
        .arg("node")
        .arg("--socket")
        .arg(&socket)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .env_remove("WIRESPAN_SOCKET")
        .spawn()
        .unwrap();
    let _guard = ChildGuard(child);
    wait_for_path(&socket);

    // `identities` is this node's identity (as in Talos).
    let mut id = None;
    for _ in 0..200 {
        let o = cli(&socket, &["get", "identities", "-o", "json"]);
        assert!(o.status.success(), "{o:?}");
        let text = String::from_utf8(o.stdout).unwrap();
        if text.contains("nodeId") {
            id = Some(text);
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let id = id.expect("no node identity");
    assert!(id.contains("NodeIdentit"), "{id}");
    for alias in [
        "affiliates",
        "members",
        "discoveryservices",
        "clusteridentities",
    ] {
        let o = cli(&socket, &["get", alias, "-o", "json"]);
        assert!(o.status.success(), "get {alias}: {o:?}");
    }
}
