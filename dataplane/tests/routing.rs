//! Kernel tests of the routing adapter, each in a fresh network namespace, on a persistent tun
//! link standing in for the mesh link.

use serde_json::Value;
use wirespan_dataplane::{
    netns::NetnsGuard,
    routing::{NetlinkRouting, Routing, RoutingError, RoutingSpec},
};

fn ip_json(ns: &NetnsGuard, args: &[&str]) -> Vec<Value> {
    let mut full = vec!["-j"];
    full.extend_from_slice(args);
    let out = ns.run_stdout("ip", &full).unwrap();
    if out.trim().is_empty() {
        return Vec::new();
    }
    serde_json::from_str::<Value>(&out)
        .unwrap()
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn setup() -> (NetnsGuard, NetlinkRouting, RoutingSpec) {
    let ns = NetnsGuard::new("wsrt").unwrap();
    ns.run("ip", &["tuntap", "add", "dev", "mesh0", "mode", "tun"])
        .unwrap();
    let r = NetlinkRouting::new(ns.netns()).unwrap();
    let spec = RoutingSpec {
        link: "mesh0".into(),
        addresses: vec!["fd7f:175a:b97c:5602::1/64".parse().unwrap()],
        ..RoutingSpec::default()
    };
    (ns, r, spec)
}

fn our_rules(ns: &NetnsGuard, fam: &str) -> Vec<Value> {
    ip_json(ns, &[fam, "rule", "show"])
        .into_iter()
        .filter(|r| r["protocol"] == "211")
        .collect()
}

#[test]
fn apply_from_empty_then_noop() {
    let (ns, mut r, spec) = setup();
    let ch = r.apply(&spec).unwrap();
    assert!(!ch.is_empty());

    let link = &ip_json(&ns, &["link", "show", "mesh0"])[0];
    assert_eq!(link["mtu"], 1420);
    assert!(link["flags"].as_array().unwrap().iter().any(|f| f == "UP"));
    let addrs = ip_json(&ns, &["addr", "show", "mesh0"]);
    let infos = addrs[0]["addr_info"].as_array().unwrap();
    assert!(
        infos
            .iter()
            .any(|a| a["local"] == "fd7f:175a:b97c:5602::1" && a["prefixlen"] == 64),
        "{infos:?}"
    );

    for fam in ["-4", "-6"] {
        let rules = our_rules(&ns, fam);
        assert_eq!(rules.len(), 1, "{fam}: {rules:?}");
        assert_eq!(rules[0]["priority"], 32500);
        assert_eq!(rules[0]["fwmark"], "0x40");
        assert_eq!(rules[0]["fwmask"], "0x60");
        assert_eq!(rules[0]["table"], "180");
        let routes = ip_json(&ns, &[fam, "route", "show", "table", "180"]);
        assert_eq!(routes.len(), 1, "{fam}: {routes:?}");
        assert_eq!(routes[0]["dst"], "default");
        assert_eq!(routes[0]["dev"], "mesh0");
        assert_eq!(routes[0]["protocol"], "211");
        assert_eq!(routes[0]["metric"], 1);
        assert_eq!(routes[0]["metrics"][0]["mtu"], 1420);
    }

    let writes = r.writes();
    assert!(r.apply(&spec).unwrap().is_empty());
    assert_eq!(r.writes(), writes, "re-apply wrote");
    let st = r.observe("mesh0").unwrap();
    assert_eq!(st.rules.len(), 2);
    assert_eq!(st.routes.len(), 2);
    assert!(st.up);
}

#[test]
fn repairs_deleted_rule_and_follows_mtu_change() {
    let (ns, mut r, mut spec) = setup();
    r.apply(&spec).unwrap();
    ns.run("ip", &["-4", "rule", "del", "priority", "32500"])
        .unwrap();
    assert!(our_rules(&ns, "-4").is_empty());
    let ch = r.apply(&spec).unwrap();
    assert_eq!(ch.rules, 1);
    assert_eq!(our_rules(&ns, "-4").len(), 1);

    spec.mtu = 1380;
    let ch = r.apply(&spec).unwrap();
    assert_eq!(ch.link, 1);
    for fam in ["-4", "-6"] {
        let routes = ip_json(&ns, &[fam, "route", "show", "table", "180"]);
        assert_eq!(routes.len(), 1);
        assert_eq!(routes[0]["metrics"][0]["mtu"], 1380);
    }

    // Disabling IPv6 removes only the IPv6 rule and route.
    spec.ipv6 = false;
    spec.addresses.clear();
    r.apply(&spec).unwrap();
    assert!(our_rules(&ns, "-6").is_empty());
    assert!(ip_json(&ns, &["-6", "route", "show", "table", "180"]).is_empty());
    assert_eq!(our_rules(&ns, "-4").len(), 1);
}

#[test]
fn teardown_leaves_foreign_rule_and_route() {
    let (ns, mut r, spec) = setup();
    r.apply(&spec).unwrap();
    ns.run(
        "ip",
        &[
            "rule",
            "add",
            "priority",
            "32500",
            "fwmark",
            "0x40/0x60",
            "lookup",
            "181",
        ],
    )
    .unwrap();
    ns.run(
        "ip",
        &[
            "route",
            "add",
            "10.99.0.0/16",
            "dev",
            "mesh0",
            "table",
            "180",
        ],
    )
    .unwrap();
    // A second apply does not touch them either.
    assert!(r.apply(&spec).unwrap().is_empty());
    r.teardown().unwrap();
    assert!(our_rules(&ns, "-4").is_empty() && our_rules(&ns, "-6").is_empty());
    let rules = ip_json(&ns, &["-4", "rule", "show"]);
    assert!(
        rules
            .iter()
            .any(|r| r["table"] == "181" && r["priority"] == 32500),
        "{rules:?}"
    );
    let routes = ip_json(&ns, &["-4", "route", "show", "table", "180"]);
    assert_eq!(routes.len(), 1);
    assert_eq!(routes[0]["dst"], "10.99.0.0/16");
}

/// A restart with the mesh moved to another table and priority: the new process never
/// applied the old ones, yet its first apply removes what the earlier run left there.
#[test]
fn first_apply_of_a_new_process_removes_the_mesh_objects_of_an_earlier_table_and_priority() {
    let (ns, mut earlier, mut spec) = setup();
    spec.table = 181;
    spec.rule_priority = 32501;
    earlier.apply(&spec).unwrap();
    assert_eq!(our_rules(&ns, "-4")[0]["priority"], 32501);
    drop(earlier);

    let mut r = NetlinkRouting::new(ns.netns()).unwrap();
    spec.table = 180;
    spec.rule_priority = 32500;
    r.apply(&spec).unwrap();
    for fam in ["-4", "-6"] {
        let rules = our_rules(&ns, fam);
        assert_eq!(rules.len(), 1, "{fam}: {rules:?}");
        assert_eq!(rules[0]["priority"], 32500);
        assert_eq!(rules[0]["table"], "180");
        assert!(
            ip_json(&ns, &[fam, "route", "show", "table", "181"]).is_empty(),
            "{fam}: a route of the earlier run is left in table 181"
        );
        assert_eq!(
            ip_json(&ns, &[fam, "route", "show", "table", "180"]).len(),
            1
        );
    }
}

#[test]
fn invalid_spec_and_missing_link_write_nothing() {
    let (ns, mut r, spec) = setup();
    for (bad, field) in [
        (
            RoutingSpec {
                rule_priority: 0,
                ..spec.clone()
            },
            "rule_priority",
        ),
        (
            RoutingSpec {
                rule_priority: 32766,
                ..spec.clone()
            },
            "rule_priority",
        ),
        (
            RoutingSpec {
                rule_priority: 32767,
                ..spec.clone()
            },
            "rule_priority",
        ),
        (
            RoutingSpec {
                mtu: 1279,
                ..spec.clone()
            },
            "mtu",
        ),
        (
            RoutingSpec {
                table: 254,
                ..spec.clone()
            },
            "table",
        ),
        (
            RoutingSpec {
                fw_mark: 0x80,
                ..spec.clone()
            },
            "fw_mark",
        ),
        (
            RoutingSpec {
                link: "a/b".into(),
                ..spec.clone()
            },
            "link",
        ),
    ] {
        match r.apply(&bad) {
            Err(RoutingError::Invalid(e)) => assert_eq!(e.field, field, "{e}"),
            other => panic!("expected invalid {field}, got {other:?}"),
        }
    }
    assert_eq!(r.writes(), 0);
    assert!(our_rules(&ns, "-4").is_empty());

    // A failed apply (link gone) keeps the previous state.
    r.apply(&spec).unwrap();
    let other = RoutingSpec {
        link: "nosuch0".into(),
        mtu: 1300,
        ..spec.clone()
    };
    assert!(matches!(
        r.apply(&other),
        Err(RoutingError::LinkNotFound(_))
    ));
    assert_eq!(our_rules(&ns, "-4").len(), 1);
    let routes = ip_json(&ns, &["-4", "route", "show", "table", "180"]);
    assert_eq!(routes[0]["metrics"][0]["mtu"], 1420);
}

#[test]
fn generic_links_and_addresses_only_remove_what_wirespan_made() {
    use wirespan_dataplane::routing::{
        scope, AddressParams, LinkParams, NetworkConfig, LINK_ALIAS,
    };
    let ns = NetnsGuard::new("wsgen").unwrap();
    ns.run("ip", &["link", "add", "theirs0", "type", "bridge"])
        .unwrap();
    let mut r = NetlinkRouting::new(ns.netns()).unwrap();
    let ours = LinkParams {
        name: "ours0".into(),
        logical: true,
        kind: "bridge".into(),
        up: true,
        mtu: 1400,
    };
    assert!(r.apply_link(&ours).unwrap());
    assert!(!r.apply_link(&ours).unwrap(), "second apply is a no-op");
    let link = &ip_json(&ns, &["-d", "link", "show", "ours0"])[0];
    assert_eq!(link["ifalias"], LINK_ALIAS);
    assert_eq!(link["mtu"], 1400);

    // Physical (not logical) links are configured only; missing ones are reported.
    let missing = LinkParams {
        name: "nosuch0".into(),
        up: true,
        ..LinkParams::default()
    };
    assert!(matches!(
        r.apply_link(&missing),
        Err(RoutingError::LinkNotFound(_))
    ));

    // An address someone else added on the same link is never removed.
    ns.run("ip", &["addr", "add", "10.9.9.9/24", "dev", "ours0"])
        .unwrap();
    let foreign = AddressParams {
        link: "ours0".into(),
        address: "10.9.9.9/24".parse().unwrap(),
        scope: scope::UNIVERSE,
        owner: wirespan_dataplane::routing::Owner::Config,
    };
    let mine = AddressParams {
        address: "10.9.9.1/24".parse().unwrap(),
        ..foreign.clone()
    };
    assert!(
        !r.apply_address(&foreign).unwrap(),
        "foreign address satisfies the spec"
    );
    assert!(r.apply_address(&mine).unwrap());
    assert!(!r.remove_address(&foreign).unwrap());
    assert!(r.remove_address(&mine).unwrap());
    let addrs = ip_json(&ns, &["-4", "addr", "show", "dev", "ours0"]);
    let locals: Vec<&str> = addrs[0]["addr_info"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a["local"].as_str())
        .collect();
    assert_eq!(locals, vec!["10.9.9.9"]);

    assert!(!r.remove_link("theirs0").unwrap(), "foreign link removed");
    assert!(r.remove_link("ours0").unwrap());
    let names: Vec<String> = ip_json(&ns, &["link", "show"])
        .iter()
        .filter_map(|l| l["ifname"].as_str().map(str::to_owned))
        .collect();
    assert!(names.contains(&"theirs0".to_owned()));
    assert!(!names.contains(&"ours0".to_owned()));
}

/// Issue 15 item 1: the mesh's teardown removes only the mesh's objects (marker 211 at
/// its priority / in its table, also as an older wirespan wrote them); objects from
/// network documents (212) and foreign ones (`proto static`) survive disable → enable
/// → restart.
#[test]
fn mesh_teardown_spares_config_and_foreign_objects() {
    use wirespan_dataplane::routing::{
        NetworkConfig, Owner, RouteKind, RouteParams, RuleParams, RTPROT_WIRESPAN_CONFIG,
    };
    let (ns, mut r, _) = setup();
    ns.run("ip", &["link", "set", "mesh0", "up"]).unwrap();
    ns.run("ip", &["addr", "add", "10.77.0.1/24", "dev", "mesh0"])
        .unwrap();
    let route = |dst: &str, table: u32, owner: Owner| RouteParams {
        destination: dst.parse().unwrap(),
        gateway: None,
        source: None,
        out_link_name: "mesh0".into(),
        table,
        priority: 1,
        scope: 0,
        kind: RouteKind::Unicast,
        mtu: 0,
        owner,
    };
    let rule = |priority: u32, table: u32, owner: Owner| RuleParams {
        priority,
        table,
        fw_mark: if owner == Owner::Mesh { 0x40 } else { 0 },
        fw_mask: if owner == Owner::Mesh { 0x60 } else { 0 },
        owner,
        ..RuleParams::default()
    };
    // From network documents (RouteConfig / RoutingRuleConfig): in main and table 100.
    let cfg_route = route("10.88.0.0/16", 254, Owner::Config);
    let cfg_rule = rule(1000, 100, Owner::Config);
    assert!(r.apply_route(&cfg_route).unwrap());
    assert!(r.apply_rule(&cfg_rule).unwrap());
    // Foreign.
    ns.run(
        "ip",
        &[
            "route",
            "add",
            "10.66.0.0/16",
            "dev",
            "mesh0",
            "proto",
            "static",
        ],
    )
    .unwrap();
    ns.run(
        "ip",
        &[
            "rule", "add", "priority", "2000", "lookup", "101", "proto", "static",
        ],
    )
    .unwrap();
    let survivors = |ns: &NetnsGuard| {
        let routes = ip_json(ns, &["-4", "route", "show", "table", "all"]);
        let rules = ip_json(ns, &["-4", "rule", "show"]);
        let route_proto = |dst: &str| {
            routes
                .iter()
                .find(|r| r["dst"] == dst)
                .map(|r| r["protocol"].to_string())
        };
        let rule_proto = |prio: u32| {
            rules
                .iter()
                .find(|r| r["priority"] == prio)
                .map(|r| r["protocol"].to_string())
        };
        (
            route_proto("10.88.0.0/16"),
            rule_proto(1000),
            route_proto("10.66.0.0/16"),
            rule_proto(2000),
        )
    };
    let cfg = format!("\"{RTPROT_WIRESPAN_CONFIG}\"");
    let expected = (
        Some(cfg.clone()),
        Some(cfg),
        Some("\"static\"".to_owned()),
        Some("\"static\"".to_owned()),
    );
    assert_eq!(survivors(&ns), expected);

    // A mesh rule and route as an older wirespan left them (plain 211), on "restart".
    ns.run(
        "ip",
        &[
            "rule",
            "add",
            "priority",
            "32500",
            "fwmark",
            "0x40/0x60",
            "lookup",
            "180",
            "proto",
            "211",
        ],
    )
    .unwrap();
    ns.run(
        "ip",
        &[
            "route", "add", "default", "dev", "mesh0", "table", "180", "proto", "211",
        ],
    )
    .unwrap();
    let mesh_left = |ns: &NetnsGuard| {
        our_rules(ns, "-4").len() + ip_json(ns, &["-4", "route", "show", "table", "180"]).len()
    };
    // First round while the mesh is off: only the mesh's go.
    r.teardown().unwrap();
    assert_eq!(mesh_left(&ns), 0);
    assert_eq!(survivors(&ns), expected);

    // Enable (the mesh's specs are applied as the mesh's), then disable, then a
    // restart with `--on-stop teardown`.
    for _ in 0..2 {
        assert!(r
            .apply_route(&route("0.0.0.0/0", 180, Owner::Mesh))
            .unwrap());
        assert!(r.apply_rule(&rule(32500, 180, Owner::Mesh)).unwrap());
        assert_eq!(mesh_left(&ns), 2);
        r.teardown().unwrap();
        assert_eq!(mesh_left(&ns), 0);
        assert_eq!(survivors(&ns), expected);
        // The documents' objects are still converged (nothing to write).
        assert!(!r.apply_route(&cfg_route).unwrap());
        assert!(!r.apply_rule(&cfg_rule).unwrap());
    }
}
