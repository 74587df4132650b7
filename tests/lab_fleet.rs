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
