//! `wirespan gen`: secrets land in 0600 files and never on the terminal.

use std::{os::unix::fs::PermissionsExt, process::Command};

fn gen(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_wirespan"))
        .arg("gen")
        .args(args)
        .output()
        .expect("run wirespan gen")
}

#[test]
fn key_is_written_0600_and_only_the_public_key_is_printed() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("wg.key");
    let k = key.to_str().unwrap();
    let out = gen(&["key", "--out", k]);
    assert!(out.status.success(), "{out:?}");
    let private = std::fs::read_to_string(&key).unwrap();
    assert_eq!(
        std::fs::metadata(&key).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let printed = String::from_utf8(out.stdout).unwrap();
    let all = format!("{printed}{}", String::from_utf8_lossy(&out.stderr));
    assert!(!all.contains(private.trim()), "private key printed");
    // `pubkey` derives the same public key from the file.
    let again = gen(&["pubkey", "--key", k]);
    assert!(again.status.success());
    assert_eq!(String::from_utf8(again.stdout).unwrap(), printed);
    assert_eq!(printed.trim().len(), 44);

    // No silent overwrite.
    let refused = gen(&["key", "--out", k]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--force"));
    assert_eq!(std::fs::read_to_string(&key).unwrap(), private);
    assert!(gen(&["key", "--out", k, "--force"]).status.success());
    assert_ne!(std::fs::read_to_string(&key).unwrap(), private);
}

#[test]
fn secret_is_written_not_printed_and_bad_key_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cluster.secret");
    let out = gen(&["secret", "--out", path.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let secret = std::fs::read_to_string(&path).unwrap();
    assert_eq!(secret.trim().len(), 44);
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!all.contains(secret.trim()));

    let bad = dir.path().join("bad.key");
    std::fs::write(&bad, "not a key\n").unwrap();
    let out = gen(&["pubkey", "--key", bad.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad.key") && err.contains("not a base64"),
        "{err}"
    );
    assert!(!err.contains("not a key"), "file contents echoed: {err}");
}

#[test]
fn node_ids_are_fresh_base62() {
    let a = String::from_utf8(gen(&["node-id"]).stdout).unwrap();
    let b = String::from_utf8(gen(&["node-id"]).stdout).unwrap();
    assert_ne!(a, b);
    assert!(a.trim().len() >= 43 && a.trim().bytes().all(|c| c.is_ascii_alphanumeric()));
}

#[test]
fn cluster_config_is_a_ready_0600_config_and_never_printed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cluster.yaml");
    let p = path.to_str().unwrap();
    let out = gen(&[
        "cluster",
        "--out",
        p,
        "--discovery",
        "http://10.99.0.1:3000",
        "--discovery",
        "backup=https://discovery.example:8443",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let text = std::fs::read_to_string(&path).unwrap();
    let config = wirespan_control::config::parse(&text).expect("the file loads as a node config");
    let cluster = config
        .singleton::<wirespan_control::config::cluster::ClusterConfig>()
        .unwrap();
    let secret = cluster.secret.expose().to_owned();
    assert_eq!(secret.len(), 44);
    assert_eq!(cluster.id.len(), 44);
    assert!(
        !cluster.id.contains(['+', '/']),
        "cluster ID is URL-safe base64"
    );
    let services: Vec<(String, String)> = config
        .documents_of::<wirespan_control::config::cluster::DiscoveryServiceConfig>()
        .map(|d| (d.name.clone(), d.endpoint.clone()))
        .collect();
    assert_eq!(
        services,
        [
            (
                "10.99.0.1-3000".to_owned(),
                "http://10.99.0.1:3000".to_owned()
            ),
            (
                "backup".to_owned(),
                "https://discovery.example:8443".to_owned()
            )
        ]
    );
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!all.contains(&secret), "secret printed");

    // Fresh material every time; no silent overwrite.
    let refused = gen(&["cluster", "--out", p]);
    assert!(!refused.status.success());
    assert!(gen(&["cluster", "--out", p, "--force"]).status.success());
    assert_ne!(std::fs::read_to_string(&path).unwrap(), text);

    // Without --discovery: a cluster document only (no public default service).
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(!text.contains("DiscoveryServiceConfig"));

    // A bad URL names the document and field, and nothing is written.
    let bad = dir.path().join("bad.yaml");
    let out = gen(&[
        "cluster",
        "--out",
        bad.to_str().unwrap(),
        "--discovery",
        "ftp://x",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("endpoint"), "{err}");
    assert!(!bad.exists());
}

#[test]
fn client_configs_carry_the_role_in_a_0600_file_and_print_no_key() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("cluster.yaml");
    let c = cluster.to_str().unwrap();
    assert!(gen(&["cluster", "--out", c]).status.success());
    let text = std::fs::read_to_string(&cluster).unwrap();
    assert!(
        text.contains("apiCaCert: |") && text.contains("apiCaKey: |"),
        "{text}"
    );
    for role in ["admin", "reader"] {
        let out_path = dir.path().join(format!("{role}.yaml"));
        let o = out_path.to_str().unwrap();
        let out = gen(&[
            "client",
            "--cluster",
            c,
            "--role",
            role,
            "--out",
            o,
            "--endpoint",
            "10.0.0.1:50100",
            "--node",
            "node2,node3",
        ]);
        assert!(out.status.success(), "{out:?}");
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!printed.contains("PRIVATE"), "{printed}");
        assert_eq!(
            std::fs::metadata(&out_path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let v: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(&std::fs::read_to_string(&out_path).unwrap()).unwrap();
        let ctx = &v["contexts"][role];
        assert_eq!(v["context"], role);
        assert_eq!(ctx["nodes"][1], "node3");
        let der = wirespan_control::api::pki::first_cert_der(ctx["crt"].as_str().unwrap()).unwrap();
        assert_eq!(
            wirespan_control::api::pki::organization_of(&der).as_deref(),
            Some(format!("wirespan:{role}").as_str())
        );
    }
    let bad = gen(&[
        "client",
        "--cluster",
        c,
        "--role",
        "root",
        "--out",
        "/dev/null",
    ]);
    assert!(!bad.status.success());
}
