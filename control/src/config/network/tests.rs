//! Validation of every network document, alone and against the others of its config.

use super::*;
use crate::config::parse;

/// The `field: message` errors of a document.
fn errors(doc: &impl ConfigDocument) -> Vec<String> {
    doc.validate().iter().map(ToString::to_string).collect()
}

fn has(errs: &[String], want: &str) -> bool {
    errs.iter().any(|e| e.contains(want))
}

fn net(s: &str) -> Option<IpNet> {
    Some(s.parse().unwrap())
}

/// The whole error text of a config made of `docs` (each without `apiVersion`).
fn config_error(docs: &[&str]) -> String {
    let text: Vec<String> = docs
        .iter()
        .map(|d| format!("apiVersion: v1alpha1\n{d}"))
        .collect();
    parse(&text.join("---\n")).unwrap_err().to_string()
}

#[test]
fn link_config() {
    let ok = LinkConfig {
        name: "dummy0".into(),
        link_kind: Some("dummy".into()),
        up: None,
        mtu: Some(1400),
    };
    assert!(errors(&ok).is_empty());
    let bad = LinkConfig {
        name: "a/b".into(),
        link_kind: Some("vxlan".into()),
        up: Some(true),
        mtu: Some(10),
    };
    let e = errors(&bad);
    assert!(
        has(&e, "name: \"a/b\" is not a valid interface name"),
        "{e:?}"
    );
    assert!(has(&e, "mtu: 10 is outside 68..=65535"), "{e:?}");
    assert!(has(&e, "linkKind: \"vxlan\" is not supported"), "{e:?}");
    let long = LinkConfig {
        name: "0123456789abcdef".into(),
        ..LinkConfig::default()
    };
    assert!(has(&errors(&long), "not a valid interface name"));
    assert!(has(&errors(&LinkConfig::default()), "name: is required"));
    // Two documents for one link: the second would replace the first.
    let err = config_error(&[
        "kind: LinkConfig\nname: eth0\nmtu: 1400\n",
        "kind: LinkConfig\nname: eth0\nmtu: 9000\n",
    ]);
    assert!(
        err.contains("document 2 (LinkConfig \"eth0\"): name: duplicate name (also document 1)"),
        "{err}"
    );
}

#[test]
fn address_config() {
    let ok = AddressConfig {
        link: "eth0".into(),
        address: net("10.0.0.1/24"),
        scope: Scope::Global,
    };
    assert!(
        errors(&ok).is_empty(),
        "host bits are the point of an address"
    );
    let e = errors(&AddressConfig::default());
    assert!(
        has(&e, "link: is required") && has(&e, "address: is required"),
        "{e:?}"
    );
    for a in ["0.0.0.0/0", "224.0.0.1/4", "::/0", "ff02::1/16"] {
        let bad = AddressConfig {
            address: net(a),
            ..ok.clone()
        };
        assert!(has(&errors(&bad), "is not a unicast address"), "{a}");
    }
    // Same link and address twice; the same address on two links is fine.
    let err = config_error(&[
        "kind: AddressConfig\nlink: eth0\naddress: 10.0.0.1/24\n",
        "kind: AddressConfig\nlink: eth1\naddress: 10.0.0.1/24\n",
        "kind: AddressConfig\nlink: eth0\naddress: 10.0.0.1/24\nscope: host\n",
    ]);
    assert!(
        err.contains(
            "document 3 (AddressConfig): same link and address as document 1 (eth0/10.0.0.1/24)"
        ),
        "{err}"
    );
    assert!(!err.contains("document 2"), "{err}");
}

#[test]
fn route_config() {
    let ok = RouteConfig {
        destination: net("10.10.0.0/16"),
        gateway: Some("10.9.0.254".parse().unwrap()),
        out_link_name: "eth0".into(),
        ..RouteConfig::default()
    };
    assert!(errors(&ok).is_empty());
    let host_bits = RouteConfig {
        destination: net("10.10.3.4/16"),
        ..ok.clone()
    };
    assert_eq!(
        errors(&host_bits),
        ["destination: 10.10.3.4/16 has host bits set; the kernel would use 10.10.0.0/16: write destination: 10.10.0.0/16"]
    );
    let v6 = RouteConfig {
        destination: net("fd00::1/64"),
        gateway: None,
        ..ok.clone()
    };
    assert!(has(&errors(&v6), "write destination: fd00::/64"));
    let host_route = RouteConfig {
        destination: net("10.10.3.4/32"),
        ..ok
    };
    assert!(errors(&host_route).is_empty());
    let e = errors(&RouteConfig::default());
    assert!(has(&e, "link: a route needs a link or a gateway"), "{e:?}");
    let bad = RouteConfig {
        destination: net("10.0.0.0/8"),
        gateway: Some("fd00::1".parse().unwrap()),
        source: Some("fd00::2".parse().unwrap()),
        out_link_name: "a b".into(),
        table: Some(255),
        priority: None,
        mtu: Some(1),
    };
    let e = errors(&bad);
    for want in [
        "gateway: fd00::1 is not of the destination's family",
        "source: fd00::2 is not of the destination's family",
        "link: \"a b\" is not a valid interface name",
        "table: 255 is reserved",
        "mtu: 1 is outside",
    ] {
        assert!(has(&e, want), "{want:?} in {e:?}");
    }
    // The merge key: table, family, gateway, destination, metric.
    let route = |extra: &str| {
        format!("kind: RouteConfig\ndestination: 10.10.0.0/16\ngateway: 10.9.0.254\n{extra}")
    };
    let err = config_error(&[
        &route("link: eth0\n"),
        &route("link: eth1\nmtu: 1400\n"),
        &route("metric: 10\n"),
        &route("table: 100\n"),
    ]);
    assert!(
        err.contains("document 2 (RouteConfig): same table, family, gateway, destination and metric (and link, for IPv6) as document 1 (inet4/10.9.0.254/10.10.0.0/16/1024)"),
        "{err}"
    );
    assert!(
        !err.contains("document 3") && !err.contains("document 4"),
        "{err}"
    );
    // IPv6 routes differ by link too.
    let v6 = |link: &str| format!("kind: RouteConfig\ndestination: fd01::/64\nlink: {link}\n");
    parse(&format!(
        "apiVersion: v1alpha1\n{}---\napiVersion: v1alpha1\n{}",
        v6("eth0"),
        v6("eth1")
    ))
    .unwrap();
    // A default route spelled two ways is one route.
    let err = config_error(&[
        "kind: RouteConfig\ngateway: 10.0.0.1\n",
        "kind: RouteConfig\ndestination: 0.0.0.0/0\ngateway: 10.0.0.1\n",
    ]);
    assert!(err.contains("document 2 (RouteConfig): same"), "{err}");
}

#[test]
fn routing_rule_config() {
    let ok = RoutingRuleConfig {
        priority: 1000,
        table: 100,
        src: net("10.9.0.0/24"),
        dst: None,
        ..RoutingRuleConfig::default()
    };
    assert!(errors(&ok).is_empty());
    let host_bits = RoutingRuleConfig {
        src: net("10.9.0.7/24"),
        dst: net("10.8.1.1/16"),
        ..ok
    };
    let e = errors(&host_bits);
    assert!(has(&e, "src: 10.9.0.7/24 has host bits set; the kernel would use 10.9.0.0/24: write src: 10.9.0.0/24"), "{e:?}");
    assert!(has(&e, "dst: 10.8.1.1/16 has host bits set; the kernel would use 10.8.0.0/16: write dst: 10.8.0.0/16"), "{e:?}");
    let bad = RoutingRuleConfig {
        priority: 32766,
        table: 0,
        ipv6: false,
        src: net("10.0.0.0/8"),
        dst: net("fd00::/8"),
        fw_mark: 0x10,
        fw_mask: 0x0f,
    };
    let e = errors(&bad);
    for want in [
        "priority: 32766 is outside 1..=32765",
        "table: 0 is reserved",
        "dst: fd00::/8 mixes address families",
        "fwMark: 0x10 is outside fwMask 0xf",
    ] {
        assert!(has(&e, want), "{want:?} in {e:?}");
    }
    // One rule per family and priority.
    let err = config_error(&[
        "kind: RoutingRuleConfig\npriority: 1000\ntable: 100\nsrc: 10.9.0.0/24\n",
        "kind: RoutingRuleConfig\npriority: 1000\ntable: 101\n",
        "kind: RoutingRuleConfig\npriority: 1000\ntable: 101\nipv6: true\n",
    ]);
    assert!(
        err.contains(
            "document 2 (RoutingRuleConfig): same family and priority as document 1 (inet4/01000)"
        ),
        "{err}"
    );
    assert!(!err.contains("document 3"), "{err}");
}

#[test]
fn probe_configs() {
    use crate::config::probe::{check_probe_url, HttpProbeConfig, TcpProbeConfig};
    for ok in [
        "http://example.com/health",
        "https://user:pw@[fd00::1]:8443/x",
        "http://[fd00::1]/",
        "http://10.0.0.1:8080",
        "http://example.com:/x",
    ] {
        check_probe_url(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
    }
    for (bad, want) in [
        (
            "http://fd00::1/health",
            "is an IPv6 address without brackets; write http://[fd00::1]/",
        ),
        ("http://[fd00::1/", "has no closing ']'"),
        ("http://[example.com]/", "is not an IPv6 address"),
        ("http://[fd00::1]x/", "after the IPv6 host"),
        (
            "http://example.com:http/",
            "port \"http\" is not a port number",
        ),
        ("http://example.com:0/", "port \"0\" is not a port number"),
    ] {
        let e = check_probe_url(bad).unwrap_err();
        assert!(e.contains(want), "{bad}: {e}");
    }
    let tcp = |endpoint: &str| TcpProbeConfig {
        name: "t".into(),
        endpoint: endpoint.into(),
        ..TcpProbeConfig::default()
    };
    assert!(errors(&tcp("[fd00::1]:6443")).is_empty());
    assert!(errors(&tcp("api.example:6443")).is_empty());
    assert_eq!(
        errors(&tcp("fd00::1:6443")),
        ["endpoint: TCP probe endpoint \"fd00::1:6443\" has an IPv6 host without brackets; write \"[fd00::1]:6443\""]
    );
    assert!(has(&errors(&tcp("host:0")), "must be host:port"));
    let http = HttpProbeConfig {
        name: "h".into(),
        url: "http://fd00::1/".into(),
        ..HttpProbeConfig::default()
    };
    assert!(has(&errors(&http), "url: HTTP probe URL host \"fd00::1\""));
    // Two documents with one target are one probe: rejected.
    let err = config_error(&[
        "kind: TCPProbeConfig\nname: a\nendpoint: 10.0.0.1:22\n",
        "kind: TCPProbeConfig\nname: b\nendpoint: 10.0.0.1:22\ninterval: 5s\n",
        "kind: HTTPProbeConfig\nname: c\nurl: http://x/\n",
        "kind: HTTPProbeConfig\nname: d\nurl: http://u:p@x/\n",
        "kind: TCPProbeConfig\nname: a\nendpoint: 10.0.0.1:22\n",
    ]);
    assert!(
        err.contains(
            "document 2 (TCPProbeConfig \"b\"): same target as document 1 (tcp:10.0.0.1:22)"
        ),
        "{err}"
    );
    assert!(
        err.contains(
            "document 4 (HTTPProbeConfig \"d\"): same target as document 3 (http:http://x/)"
        ),
        "{err}"
    );
    // Every problem of a document: same target and same name.
    assert!(
        err.contains("document 5 (TCPProbeConfig \"a\"): same target as document 1 (tcp:10.0.0.1:22); one would silently replace the other; name: duplicate name (also document 1)"),
        "{err}"
    );
    // Zero durations mean the defaults.
    let zero = HttpProbeConfig {
        interval: Some("0s".into()),
        timeout: Some("0".into()),
        ..http
    };
    assert_eq!(
        zero.durations(),
        (
            crate::config::probe::DEFAULT_INTERVAL,
            crate::config::probe::DEFAULT_TIMEOUT
        )
    );
}
