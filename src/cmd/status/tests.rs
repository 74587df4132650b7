use serde_json::json;

use super::*;

fn res(id: &str, spec: Value) -> Res {
    Res {
        id: id.into(),
        version: 1,
        spec,
    }
}

fn line(f: &Facts, label: &str) -> String {
    lines(f)
        .into_iter()
        .find(|(k, _)| *k == label)
        .map(|(_, v)| v)
        .unwrap()
}

/// A node with the mesh on: two of three peers up, one of two services connected.
fn running() -> Facts {
    Facts {
        node_identity: Some(vec![res("local", json!({"nodeId": "abc123"}))]),
        kubespan_config: Some(vec![res(
            "kubespan",
            json!({"config": {"enabled": true, "linkName": "kubespan", "listenPort": 51820, "fastPath": "ebpf"}}),
        )]),
        kubespan_identity: Some(vec![res("kubespan", json!({"address": "fd00::1/128"}))]),
        manager: Some(vec![res(
            "kubespan",
            json!({"linkName": "kubespan", "fastPath": "ebpf", "peers": 3, "note": ""}),
        )]),
        links: Some(vec![
            res("eth0", json!({"name": "eth0", "kind": ""})),
            res("kubespan", json!({"name": "kubespan", "kind": "wireguard"})),
        ]),
        peers: Some(vec![
            res("k1", json!({"label": "n1", "state": "up"})),
            res("k2", json!({"label": "n2", "state": "up"})),
            res("k3", json!({"label": "n3", "state": "unknown"})),
        ]),
        discovery: Some(vec![
            res(
                "a",
                json!({"connected": true, "affiliateCount": 3, "connection": "connected"}),
            ),
            res(
                "b",
                json!({"connected": false, "lastError": "connection refused", "connection": "backoff"}),
            ),
        ]),
        machine_config: Some(vec![res("active", Value::Null)]),
        config_status: None,
        probes: Some(vec![
            res("web", json!({"success": true, "lastError": ""})),
            res("db", json!({"success": false, "lastError": "timeout"})),
        ]),
    }
}

#[test]
fn a_running_mesh_on_one_screen() {
    let f = running();
    assert_eq!(line(&f, "node"), "abc123");
    assert_eq!(line(&f, "mesh"), "on, link kubespan, address fd00::1/128");
    assert_eq!(line(&f, "fast path"), "ebpf");
    assert_eq!(line(&f, "wireguard"), "kernel, kubespan on UDP 51820");
    assert_eq!(line(&f, "peers"), "2/3 up (not up: n3 unknown)");
    assert_eq!(
        line(&f, "discovery"),
        "1/2 connected (b: connection refused), 3 affiliates"
    );
    assert_eq!(line(&f, "config"), "accepted version 1; last error: n/a");
    assert_eq!(line(&f, "probes"), "1/2 ok (failing: db: timeout)");
    let text = render_text(&lines(&f));
    assert!(text.starts_with("node       abc123\n"), "{text}");
    assert_eq!(text.lines().count(), 8);
}

#[test]
fn fallback_userspace_backend_and_fast_path_say_so() {
    let mut f = running();
    f.links = Some(vec![res(
        "kubespan",
        json!({"name": "kubespan", "kind": "tun"}),
    )]);
    f.manager = Some(vec![res(
        "kubespan",
        json!({"fastPath": "nftables", "note": "eBPF fast path unsupported"}),
    )]);
    // An older daemon does not say which userspace device: the link's kind only.
    assert_eq!(line(&f, "wireguard"), "userspace, kubespan on UDP 51820");
    assert_eq!(
        line(&f, "fast path"),
        "nftables (configured ebpf: eBPF fast path unsupported)"
    );
    for (reported, shown) in [
        ("userspace", "userspace (wirespan wireguard)"),
        ("userspace-go", "userspace-go (wireguard-go)"),
    ] {
        f.manager = Some(vec![res(
            "kubespan",
            json!({"fastPath": "nftables", "wireguard": reported}),
        )]);
        assert_eq!(
            line(&f, "wireguard"),
            format!("{shown}, kubespan on UDP 51820")
        );
    }
}

#[test]
fn a_fresh_node_without_config() {
    let f = Facts {
        node_identity: Some(vec![res("local", json!({"nodeId": "abc"}))]),
        kubespan_config: Some(vec![]),
        kubespan_identity: Some(vec![]),
        manager: Some(vec![]),
        links: Some(vec![]),
        peers: Some(vec![]),
        discovery: Some(vec![]),
        machine_config: Some(vec![]),
        config_status: Some(vec![]),
        probes: Some(vec![]),
    };
    assert_eq!(line(&f, "mesh"), "off (no KubeSpanConfig document)");
    assert_eq!(line(&f, "fast path"), "- (mesh off)");
    assert_eq!(line(&f, "wireguard"), "- (mesh off)");
    assert_eq!(line(&f, "peers"), "0");
    assert_eq!(line(&f, "discovery"), "none configured");
    assert_eq!(
        line(&f, "config"),
        "none (no config loaded); last error: none"
    );
    assert_eq!(line(&f, "probes"), "none configured");
}

#[test]
fn kinds_the_node_lacks_are_not_available() {
    let f = Facts::default();
    for (k, v) in lines(&f) {
        if k == "config" {
            assert_eq!(v, "n/a; last error: n/a");
        } else {
            assert_eq!(v, "n/a", "{k}");
        }
    }
}

#[test]
fn config_status_last_error_is_shown() {
    let mut f = running();
    f.config_status = Some(vec![res(
        "config",
        json!({"lastError": "document 2 (HTTPProbeConfig web): url: unsupported scheme"}),
    )]);
    assert_eq!(
        line(&f, "config"),
        "accepted version 1; last error: document 2 (HTTPProbeConfig web): url: unsupported scheme"
    );
    f.config_status = Some(vec![res("config", json!({"lastError": null}))]);
    assert_eq!(line(&f, "config"), "accepted version 1; last error: none");
}

#[test]
fn config_version_is_the_accepted_hash() {
    let mut f = running();
    f.config_status = Some(vec![res(
        "current",
        json!({"acceptedVersion": "3100fb2c244dd885", "lastError": ""}),
    )]);
    assert_eq!(
        line(&f, "config"),
        "accepted version 3100fb2c244dd885; last error: none"
    );
}

#[test]
fn disabled_mesh_and_long_lists() {
    let mut f = running();
    f.kubespan_config = Some(vec![res("kubespan", json!({"config": {"enabled": false}}))]);
    assert_eq!(line(&f, "mesh"), "off (enabled: false)");
    f = running();
    f.peers = Some(
        (0..8)
            .map(|i| {
                res(
                    &format!("k{i}"),
                    json!({"label": format!("n{i}"), "state": "down"}),
                )
            })
            .collect(),
    );
    assert_eq!(
        line(&f, "peers"),
        "0/8 up (not up: n0 down, n1 down, n2 down, n3 down, n4 down, … (3 more))"
    );
}

#[test]
fn an_escape_sequence_in_a_value_is_printed_as_text() {
    let out = render_text(&[("peers", "n\u{1b}[2J up".to_owned())]);
    assert!(!out.contains('\u{1b}'), "{out:?}");
    assert!(out.contains("n\\x1b[2J up"), "{out:?}");
}

#[test]
fn a_trial_in_progress_and_the_last_trial_are_shown() {
    let mut f = running();
    f.config_status = Some(vec![res(
        "current",
        json!({"acceptedVersion": "bbbb", "trialDeadline": "2026-11-27T14:00:00Z",
               "trialPreviousVersion": "aaaa", "lastTrial": "confirmed version cccc"}),
    )]);
    assert_eq!(
        line(&f, "config"),
        "accepted version bbbb, ON TRIAL until 2026-11-27T14:00:00Z (then back to aaaa unless `wirespan apply --confirm`); last error: none"
    );
    f.config_status = Some(vec![res(
        "current",
        json!({"acceptedVersion": "aaaa", "lastTrial": "rolled back to aaaa: not confirmed by its deadline 2026-11-27T14:00:00Z"}),
    )]);
    assert_eq!(
        line(&f, "config"),
        "accepted version aaaa; last trial: rolled back to aaaa: not confirmed by its deadline 2026-11-27T14:00:00Z; last error: none"
    );
}
