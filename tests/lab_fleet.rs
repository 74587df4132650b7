//! The fleet in a lab: every node serves the remote API, `lab exec` points
//! `WIRESPANCONFIG` at the lab's admin client config, and one command from node1 reads
//! node2 and node3 through node1 (the proxy, over the mesh). The reader config reads
//! and may not apply.

mod common;

use common::lab::Lab;

#[test]
fn one_command_from_node1_reads_node2_and_node3_and_a_reader_may_not_apply() {
    let lab = Lab::new();
    lab.ok(&["up", "--nodes", "3"]);
    let out = lab.exec_ok("node1", &["wirespan", "-n", "node2,node3", "get", "peers"]);
    let rows: Vec<&str> = out.lines().collect();
    assert!(rows[0].starts_with("NODE "), "{out}");
    for (node, peers) in [("node2", ["node1", "node3"]), ("node3", ["node1", "node2"])] {
        for peer in peers {
            assert!(
                rows.iter()
                    .any(|r| r.starts_with(&format!("{node} ")) && r.contains(&format!(" {peer} "))),
                "no row of {node} for its peer {peer}:\n{out}"
            );
        }
    }

    let reader = lab.dir().join("reader.yaml");
    let reader = reader.to_str().unwrap();
    let out = lab.exec_ok(
        "node1",
        &[
            "env",
            &format!("WIRESPANCONFIG={reader}"),
            "wirespan",
            "-n",
            "node2,node3",
            "get",
            "peers",
        ],
    );
    assert!(out.lines().any(|r| r.starts_with("node3 ")), "{out}");
    let cluster = lab.dir().join("cluster.yaml");
    let o = lab.exec(
        "node1",
        &[
            "env",
            &format!("WIRESPANCONFIG={reader}"),
            "wirespan",
            "-n",
            "node2",
            "apply",
            "--dry-run",
            cluster.to_str().unwrap(),
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("PermissionDenied"),
        "{err}"
    );
}

/// A host document sent to a lab node acts on that node's own directory
/// (`--host-root`), never on the machine's files: a `ResolverConfig` patched into node2
/// from node1 writes node2's resolv.conf, and the machine's stays as it was.
#[test]
fn a_lab_nodes_host_documents_write_its_own_files_not_the_machines() {
    let before = std::fs::read("/etc/resolv.conf").ok();
    let lab = Lab::new();
    lab.ok(&["up", "--nodes", "2"]);
    let patch = "apiVersion: v1alpha1\nkind: ResolverConfig\nnameservers: [192.0.2.53]\n";
    lab.exec_ok(
        "node1",
        &["wirespan", "-n", "node2", "patch", "--patch", patch],
    );
    let own = lab.dir().join("node2/host/etc/resolv.conf");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let text = std::fs::read_to_string(&own).unwrap_or_default();
        if text.contains("nameserver 192.0.2.53") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} never named the patched server: {text:?}",
            own.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(
        std::fs::read("/etc/resolv.conf").ok(),
        before,
        "the machine's /etc/resolv.conf changed"
    );
    assert!(
        !lab.dir().join("node1/host/etc/resolv.conf").exists(),
        "node1 was not patched"
    );
}
