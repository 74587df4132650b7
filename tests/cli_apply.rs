//! `wirespan node --config` in a network namespace, `wirespan apply` and file reload:
//! a valid config reaches the kernel, an invalid one is rejected with every error
//! (document and field) and the previous one stays.

mod common;

use std::{process::Command, time::Duration};

use common::{cli, wait_for_path, ChildGuard, BIN};
use wirespan_dataplane::netns::NetnsGuard;

fn addr_cfg(ip: &str) -> String {
    format!("apiVersion: v1alpha1\nkind: AddressConfig\nlink: eth9\naddress: {ip}/24\n")
}

fn has_addr(ns: &NetnsGuard, ip: &str) -> bool {
    let out = ns
        .run_stdout("ip", &["-j", "addr", "show", "dev", "eth9"])
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v[0]["addr_info"]
        .as_array()
        .unwrap()
        .iter()
        .any(|a| a["local"] == ip)
}

fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(std::time::Instant::now() < deadline, "timed out: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn node_config_apply_and_reload_reach_the_kernel_and_bad_configs_change_nothing() {
    let ns = NetnsGuard::new("wscli").unwrap();
    ns.run(
        "ip",
        &[
            "link", "add", "eth9", "type", "veth", "peer", "name", "eth9p",
        ],
    )
    .unwrap();
    ns.run("ip", &["link", "set", "eth9p", "up"]).unwrap();
    ns.run("ip", &["link", "set", "eth9", "up"]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("node.sock");
    let cfg = dir.path().join("config.yaml");
    std::fs::write(&cfg, addr_cfg("10.88.0.5")).unwrap();
    let child = Command::new("ip")
        .args(["netns", "exec", ns.name(), BIN, "--socket"])
        .arg(&socket)
        .arg("node")
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--config")
        .arg(&cfg)
        .env_remove("WIRESPAN_SOCKET")
        .spawn()
        .unwrap();
    let _node = ChildGuard(child);
    wait_for_path(&socket);
    until("10.88.0.5 from --config", || has_addr(&ns, "10.88.0.5"));

    // Invalid: every error, nothing changes.
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        format!(
            "{}---\napiVersion: v1alpha1\nkind: HTTPProbeConfig\nname: web\nurl: gopher://x\nfailureThreshold: -1\n",
            addr_cfg("10.88.0.6")
        ),
    )
    .unwrap();
    let o = cli(&socket, &["apply", bad.to_str().unwrap()]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("document 2 (HTTPProbeConfig \"web\")"),
        "{err}"
    );
    assert!(
        err.contains("url: HTTP probe URL scheme must be http or https"),
        "{err}"
    );
    assert!(
        err.contains("failureThreshold: probe failure threshold cannot be negative: -1"),
        "{err}"
    );
    assert!(err.contains("keeps its previous config"), "{err}");
    // Rejected before anything was written: the store still has the old spec only.
    let o = cli(&socket, &["get", "addressspecs", "-o", "json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!String::from_utf8_lossy(&o.stdout).contains("10.88.0.6"));

    // Valid: applied, and written back to the config file so a reload keeps it.
    let good = dir.path().join("good.yaml");
    std::fs::write(&good, addr_cfg("10.88.0.6")).unwrap();
    let o = cli(&socket, &["apply", good.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    until("10.88.0.6 applied, 10.88.0.5 removed", || {
        has_addr(&ns, "10.88.0.6") && !has_addr(&ns, "10.88.0.5")
    });
    assert_eq!(
        std::fs::read_to_string(&cfg).unwrap(),
        addr_cfg("10.88.0.6")
    );

    // Edit the file: the daemon reloads it.
    std::fs::write(&cfg, addr_cfg("10.88.0.7")).unwrap();
    until("10.88.0.7 from reload", || {
        has_addr(&ns, "10.88.0.7") && !has_addr(&ns, "10.88.0.6")
    });
    until("NodeAddress routed follows", || {
        let o = cli(&socket, &["get", "nodeaddresses", "routed", "-o", "json"]);
        o.status.success()
            && serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["spec"]["addresses"]
                == serde_json::json!(["10.88.0.7/24"])
    });
}

/// Hostile configs through `wirespan apply`: 30,000 invalid documents get a reply of a
/// few KB (50 problems and a count of the rest), in the CLI's output and in
/// `configstatus`; 100,000 levels of `[` are refused before parsing, naming the
/// document and line; the node answers `get` afterwards.
#[test]
fn hostile_configs_get_short_errors() {
    let ns = NetnsGuard::new("wscli").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("node.sock");
    let child = common::bin_in(&ns)
        .arg("--socket")
        .arg(&socket)
        .arg("node")
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .env_remove("WIRESPAN_SOCKET")
        .spawn()
        .unwrap();
    let _node = ChildGuard(child);
    wait_for_path(&socket);

    let many = dir.path().join("many.yaml");
    std::fs::write(
        &many,
        "apiVersion: v1alpha1\nkind: Bogus\n---\n".repeat(30_000),
    )
    .unwrap();
    for dry_run in [true, false] {
        let mut args = vec!["apply", many.to_str().unwrap()];
        if dry_run {
            args.push("--dry-run");
        }
        let o = cli(&socket, &args);
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.len() < 16 * 1024,
            "dry run {dry_run}: {} bytes",
            err.len()
        );
        assert!(err.contains("and 29950 more problems"), "{err}");
        assert!(
            err.contains("document 1 (Bogus): kind: unknown kind"),
            "{err}"
        );
    }
    let status = common::stdout(&cli(&socket, &["get", "configstatus", "-o", "json"]));
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    let last_error = status["spec"]["lastError"].as_str().unwrap();
    assert!(last_error.len() < 16 * 1024, "{} bytes", last_error.len());
    assert!(
        last_error.ends_with("and 29950 more problems"),
        "{last_error}"
    );

    let deep = dir.path().join("deep.yaml");
    std::fs::write(
        &deep,
        format!(
            "apiVersion: v1alpha1\nkind: X\nv: {}\n",
            "[".repeat(100_000)
        ),
    )
    .unwrap();
    let o = cli(&socket, &["apply", "--dry-run", deep.to_str().unwrap()]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("document 1: line 3: nested deeper than 64 levels"),
        "{err}"
    );
    assert!(cli(&socket, &["get", "configstatus"]).status.success());
}
