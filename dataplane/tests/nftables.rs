//! Kernel tests of the nftables marking adapter, each in a fresh network namespace.

use ipnet::IpNet;
use serde_json::Value;
use wirespan_dataplane::{
    marking::{Marking, MarkingError, MarkingSpec, NftMarking, SetLayout},
    netns::NetnsGuard,
};

fn nft_json(ns: &NetnsGuard) -> Value {
    serde_json::from_str(&ns.run_stdout("nft", &["-j", "list", "ruleset"]).unwrap()).unwrap()
}

fn objects<'a>(v: &'a Value, kind: &str) -> Vec<&'a Value> {
    v["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o.get(kind))
        .collect()
}

fn set_elems(v: &Value, table: &str, set: &str) -> usize {
    objects(v, "set")
        .into_iter()
        .find(|s| s["table"] == table && s["name"] == set)
        .map_or(0, |s| s["elem"].as_array().map_or(0, Vec::len))
}

fn spec(v4: &[&str], v6: &[&str]) -> MarkingSpec {
    MarkingSpec {
        prefixes_v4: v4.iter().map(|p| p.parse().unwrap()).collect(),
        prefixes_v6: v6.iter().map(|p| p.parse().unwrap()).collect(),
        ..MarkingSpec::default()
    }
}

#[test]
fn apply_from_empty_matches_spec_text_and_reapply_is_noop() {
    let ns = NetnsGuard::new("wsnft").unwrap();
    let mut m = NftMarking::new(ns.netns().clone());
    let s = spec(
        &["10.9.0.1/32", "10.244.1.0/24"],
        &["fd00:1::1/128", "2001:db8::/32"],
    );
    assert!(m.apply(&s).unwrap());
    assert_eq!(m.transactions(), 1);

    let text = ns
        .run_stdout(
            "nft",
            &["list", "chain", "inet", "wirespan", "kubespan_outgoing"],
        )
        .unwrap();
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(
        lines[2],
        "type route hook output priority filter; policy accept;"
    );
    assert!(
        lines[3].starts_with("meta mark & 0x00000060 == 0x00000020 accept"),
        "{text}"
    );
    assert!(lines[4].starts_with("oifname \"lo\" accept"), "{text}");
    assert!(text.contains("ip daddr @v4_hosts tcp flags syn / syn,rst tcp option maxseg size > 1368 tcp option maxseg size set 1368"), "{text}");
    assert!(text.contains("ip6 daddr @v6_nets tcp flags syn / syn,rst tcp option maxseg size > 1348 tcp option maxseg size set 1348"), "{text}");
    assert!(text.contains("ip daddr @v4_nets counter packets 0 bytes 0 meta mark set meta mark & 0xffffffdf | 0x00000040 accept"), "{text}");
    let pre = ns
        .run_stdout(
            "nft",
            &["list", "chain", "inet", "wirespan", "kubespan_prerouting"],
        )
        .unwrap();
    assert!(
        pre.contains("type filter hook prerouting priority filter; policy accept;"),
        "{pre}"
    );
    assert!(
        pre.lines()
            .nth(3)
            .unwrap()
            .trim()
            .starts_with("meta mark & 0x00000060 == 0x00000020 accept"),
        "{pre}"
    );
    assert!(
        pre.contains("ip6 daddr @v6_hosts tcp flags syn / syn,rst tcp option maxseg size > 1348"),
        "{pre}"
    );

    let v = nft_json(&ns);
    assert_eq!(set_elems(&v, "wirespan", "v4_hosts"), 1);
    assert_eq!(set_elems(&v, "wirespan", "v4_nets"), 1);
    assert_eq!(set_elems(&v, "wirespan", "v6_hosts"), 1);
    assert_eq!(set_elems(&v, "wirespan", "v6_nets"), 1);

    let reads = m.reads();
    assert!(!m.apply(&s).unwrap());
    assert_eq!(m.transactions(), 1, "re-apply must not write");
    assert_eq!(
        m.reads(),
        reads,
        "nothing changed since our write: no listing needed"
    );
    // Any foreign transaction (even in another table) makes the next apply list ours.
    ns.run("nft", &["add", "table", "inet", "other"]).unwrap();
    assert!(!m.apply(&s).unwrap());
    assert_eq!(m.reads(), reads + 1);
}

#[test]
fn element_change_touches_no_chain() {
    let ns = NetnsGuard::new("wsnft").unwrap();
    let mut m = NftMarking::new(ns.netns().clone());
    m.apply(&spec(&["10.9.0.1/32", "10.244.1.0/24"], &[]))
        .unwrap();
    let handles = |v: &Value| -> Vec<(String, u64)> {
        objects(v, "rule")
            .into_iter()
            .map(|r| {
                (
                    r["comment"].as_str().unwrap_or("").to_owned(),
                    r["handle"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let before = handles(&nft_json(&ns));
    m.apply(&spec(
        &["10.9.0.2/32", "10.244.2.0/24", "10.250.0.0/16"],
        &[],
    ))
    .unwrap();
    assert_eq!(m.transactions(), 2);
    let v = nft_json(&ns);
    assert_eq!(
        handles(&v),
        before,
        "rules were rebuilt for an element change"
    );
    assert_eq!(set_elems(&v, "wirespan", "v4_hosts"), 1);
    assert_eq!(set_elems(&v, "wirespan", "v4_nets"), 2);
    let out = ns
        .run_stdout("nft", &["list", "set", "inet", "wirespan", "v4_hosts"])
        .unwrap();
    assert!(
        out.contains("10.9.0.2") && !out.contains("10.9.0.1"),
        "{out}"
    );
}

#[test]
fn ten_thousand_elements_both_layouts() {
    let ns = NetnsGuard::new("wsnft").unwrap();
    let mut m = NftMarking::new(ns.netns().clone());
    let mut s = MarkingSpec::default();
    for i in 0..5000u32 {
        s.prefixes_v4
            .push(IpNet::new(std::net::Ipv4Addr::from(0x0a00_0000 + i).into(), 32).unwrap());
        s.prefixes_v4
            .push(IpNet::new(std::net::Ipv4Addr::from(0x6400_0000 + (i << 8)).into(), 24).unwrap());
    }
    m.apply(&s).unwrap();
    let v = nft_json(&ns);
    assert_eq!(set_elems(&v, "wirespan", "v4_hosts"), 5000);
    assert_eq!(set_elems(&v, "wirespan", "v4_nets"), 5000);
    assert!(!m.apply(&s).unwrap());
    s.layout = SetLayout::Interval;
    m.apply(&s).unwrap();
    let v = nft_json(&ns);
    assert_eq!(set_elems(&v, "wirespan", "v4_nets"), 10_000);
    assert_eq!(set_elems(&v, "wirespan", "v4_hosts"), 0);
}

#[test]
fn repairs_after_flush_and_rule_delete_and_teardown_leaves_foreign_table() {
    let ns = NetnsGuard::new("wsnft").unwrap();
    ns.run("nft", &["add", "table", "inet", "foreign"]).unwrap();
    ns.run(
        "nft",
        &["add", "set", "inet", "foreign", "s", "{ type ipv4_addr; }"],
    )
    .unwrap();
    let mut m = NftMarking::new(ns.netns().clone());
    let s = spec(&["10.9.0.1/32"], &["fd00::1/128"]);
    m.apply(&s).unwrap();

    ns.run("nft", &["flush", "ruleset"]).unwrap();
    assert!(m.apply(&s).unwrap(), "flushed table not repaired");
    assert_eq!(set_elems(&nft_json(&ns), "wirespan", "v4_hosts"), 1);

    // Someone deletes our mark rule.
    let v = nft_json(&ns);
    let rule = objects(&v, "rule")
        .into_iter()
        .find(|r| {
            r["comment"]
                .as_str()
                .unwrap_or("")
                .starts_with("wirespan:mark:v4_hosts")
                && r["chain"] == "kubespan_outgoing"
        })
        .unwrap()
        .clone();
    let handle = rule["handle"].to_string();
    ns.run(
        "nft",
        &[
            "delete",
            "rule",
            "inet",
            "wirespan",
            "kubespan_outgoing",
            "handle",
            &handle,
        ],
    )
    .unwrap();
    assert!(m.apply(&s).unwrap(), "deleted rule not repaired");
    let out = ns
        .run_stdout(
            "nft",
            &["list", "chain", "inet", "wirespan", "kubespan_outgoing"],
        )
        .unwrap();
    assert!(out.contains("ip daddr @v4_hosts counter"), "{out}");

    // Someone deletes an element.
    ns.run(
        "nft",
        &[
            "delete",
            "element",
            "inet",
            "wirespan",
            "v6_hosts",
            "{ fd00::1 }",
        ],
    )
    .unwrap();
    assert!(m.apply(&s).unwrap());
    assert_eq!(set_elems(&nft_json(&ns), "wirespan", "v6_hosts"), 1);

    ns.run("nft", &["add", "table", "inet", "foreign"]).unwrap();
    m.teardown().unwrap();
    let v = nft_json(&ns);
    let tables: Vec<_> = objects(&v, "table")
        .into_iter()
        .map(|t| t["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(tables, ["foreign"]);
    m.teardown().unwrap();
}

#[test]
fn invalid_spec_writes_nothing() {
    let ns = NetnsGuard::new("wsnft").unwrap();
    let mut m = NftMarking::new(ns.netns().clone());
    let good = spec(&["10.9.0.1/32"], &[]);
    m.apply(&good).unwrap();
    let before = ns.run_stdout("nft", &["list", "ruleset"]).unwrap();
    for (bad, field) in [
        (spec(&["fd00::/64"], &[]), "prefixes_v4[0]"),
        (
            MarkingSpec {
                mtu: 1200,
                ..good.clone()
            },
            "mtu",
        ),
        (spec(&["10.9.0.1/32", "10.1.2.3/16"], &[]), "prefixes_v4[1]"),
    ] {
        match m.apply(&bad) {
            Err(MarkingError::Invalid(e)) => {
                assert_eq!(e.field, field);
                assert!(e.to_string().contains(field));
            }
            other => panic!("expected invalid {field}, got {other:?}"),
        }
    }
    assert_eq!(m.transactions(), 1);
    assert_eq!(ns.run_stdout("nft", &["list", "ruleset"]).unwrap(), before);
}
