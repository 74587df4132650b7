//! Unit tests of the pure parts: rendering, planning, the JSON batches and the
//! listing parser. (The adapter itself is tested against a kernel in
//! `dataplane/tests/nftables.rs`.)

use ipnet::IpNet;
use serde_json::json;

use super::*;

fn spec(v4: &[&str], v6: &[&str]) -> MarkingSpec {
    MarkingSpec {
        prefixes_v4: v4.iter().map(|p| p.parse().unwrap()).collect(),
        prefixes_v6: v6.iter().map(|p| p.parse().unwrap()).collect(),
        // These tests were written for the split layout's sets.
        layout: SetLayout::Split,
        ..MarkingSpec::default()
    }
}

fn comments(rs: &Ruleset, chain: &str) -> Vec<String> {
    rs.chains
        .iter()
        .find(|c| c.name == chain)
        .unwrap()
        .rules
        .iter()
        .map(|r| r.comment.clone())
        .collect()
}

#[test]
fn empty_sets_render_no_conditional_rules() {
    let rs = render(&spec(&[], &[]));
    assert_eq!(
        comments(&rs, CHAIN_PREROUTING),
        ["wirespan:device-mark:0x20/0x60"]
    );
    assert_eq!(
        comments(&rs, CHAIN_OUTGOING),
        ["wirespan:device-mark:0x20/0x60", "wirespan:lo"]
    );
    assert_eq!(rs.sets.len(), 4);
    assert!(rs.sets.iter().all(|s| s.elements.is_empty()));
}

#[test]
fn v4_only_renders_v4_rules_with_mss_1368() {
    let rs = render(&spec(&["10.0.0.1/32", "10.244.0.0/24"], &[]));
    assert_eq!(
        comments(&rs, CHAIN_OUTGOING),
        [
            "wirespan:device-mark:0x20/0x60",
            "wirespan:lo",
            "wirespan:mss:v4_hosts:1368",
            "wirespan:mss:v4_nets:1368",
            "wirespan:mark:v4_hosts:0x40/0x60",
            "wirespan:mark:v4_nets:0x40/0x60",
        ]
    );
    assert_eq!(
        comments(&rs, CHAIN_PREROUTING)[0],
        "wirespan:device-mark:0x20/0x60"
    );
    assert_eq!(comments(&rs, CHAIN_PREROUTING).len(), 5);
}

#[test]
fn v6_only_renders_v6_rules_with_mss_1348() {
    let rs = render(&spec(&[], &["2001:db8::1/128"]));
    assert_eq!(
        comments(&rs, CHAIN_OUTGOING)[2..],
        [
            "wirespan:mss:v6_hosts:1348",
            "wirespan:mark:v6_hosts:0x40/0x60"
        ]
    );
}

#[test]
fn both_families_at_minimum_mtu() {
    let mut s = spec(&["10.0.0.0/8"], &["fd00::/8"]);
    s.mtu = 1280;
    let rs = render(&s);
    let out = comments(&rs, CHAIN_OUTGOING);
    assert!(out.contains(&"wirespan:mss:v4_nets:1228".to_owned()));
    assert!(out.contains(&"wirespan:mss:v6_nets:1208".to_owned()));
}

#[test]
fn device_mark_first_and_mark_arithmetic() {
    let rs = render(&spec(&["10.0.0.1/32"], &[]));
    let j = serde_json::to_value(&rs.chains[1].rules[0].statements).unwrap();
    assert_eq!(
        j,
        json!([{"match": {"op": "==", "left": {"&": [{"meta": {"key": "mark"}}, 0x60]}, "right": 0x20}}, {"accept": null}])
    );
    let mark = rs.chains[1].rules.last().unwrap();
    let j = serde_json::to_value(&mark.statements[2]).unwrap();
    assert_eq!(
        j,
        json!({"mangle": {"key": {"meta": {"key": "mark"}}, "value": {"|": [{"&": [{"meta": {"key": "mark"}}, 0xffff_ff9f_u32]}, 0x40]}}})
    );
}

#[test]
fn split_layout_separates_hosts_and_normalises_intervals() {
    let rs = render(&spec(
        &[
            "10.0.0.0/8",
            "10.1.0.0/16",
            "192.168.1.1/32",
            "192.168.1.1/32",
            "172.16.0.0/12",
        ],
        &[],
    ));
    let get = |n: &str| {
        rs.sets
            .iter()
            .find(|s| s.name == n)
            .unwrap()
            .elements
            .clone()
    };
    assert_eq!(
        get("v4_hosts"),
        vec!["192.168.1.1/32".parse::<IpNet>().unwrap()]
    );
    assert_eq!(
        get("v4_nets"),
        vec![
            "10.0.0.0/8".parse::<IpNet>().unwrap(),
            "172.16.0.0/12".parse().unwrap()
        ]
    );
    let mut s = spec(&["10.0.0.0/24", "10.0.0.5/32"], &[]);
    s.layout = SetLayout::Interval;
    let rs = render(&s);
    assert_eq!(rs.sets.len(), 2);
    assert_eq!(
        rs.sets[0].elements,
        vec!["10.0.0.0/24".parse::<IpNet>().unwrap()]
    );
}

#[test]
fn fast_path_prerouting_has_no_set_lookup_and_keeps_the_output_chain() {
    let mut s = spec(&["10.0.0.1/32", "10.244.0.0/24"], &["fd00::/64"]);
    let full = render(&s);
    s.prerouting = PreroutingMarking::FastPath;
    let rs = render(&s);
    assert_eq!(
        comments(&rs, CHAIN_PREROUTING),
        [
            "wirespan:device-mark:0x20/0x60",
            "wirespan:mss-marked:v4:1368:0x40/0x60",
            "wirespan:mss-marked:v6:1348:0x40/0x60",
        ]
    );
    let pre: Vec<_> = rs.chains[0].rules.iter().map(|r| &r.statements).collect();
    let pre = serde_json::to_string(&pre).unwrap();
    assert!(!pre.contains('@'), "a set lookup in prerouting: {pre}");
    assert_eq!(rs.chains[1], full.chains[1]);
    assert_eq!(rs.sets, full.sets);
    // A family without prefixes gets no rule.
    let mut v4 = spec(&["10.0.0.1/32"], &[]);
    v4.prerouting = PreroutingMarking::FastPath;
    assert_eq!(comments(&render(&v4), CHAIN_PREROUTING).len(), 2);
}

#[test]
fn plan_detects_element_changes_and_structure_drift() {
    let s1 = spec(&["10.0.0.1/32"], &[]);
    let rs1 = render(&s1);
    assert_eq!(plan(&rs1, None), Plan::Rebuild);
    let st1 = expected_state(&rs1);
    assert_eq!(plan(&rs1, Some(&st1)), Plan::Nothing);
    let rs2 = render(&spec(&["10.0.0.2/32"], &[]));
    assert_eq!(
        plan(&rs2, Some(&st1)),
        Plan::Elements(vec![SetDiff {
            name: "v4_hosts",
            interval: false,
            add: vec!["10.0.0.2/32".parse().unwrap()],
            delete: vec!["10.0.0.1/32".parse().unwrap()],
        }])
    );
    // A new family needs new rules: rebuild.
    let rs3 = render(&spec(&["10.0.0.1/32"], &["fd00::1/128"]));
    assert_eq!(plan(&rs3, Some(&st1)), Plan::Rebuild);
    // A deleted rule is drift.
    let mut st = st1;
    st.chains[1].5.pop();
    assert_eq!(plan(&rs1, Some(&st)), Plan::Rebuild);
}

#[test]
fn batches_serialise() {
    let rs = render(&spec(&["10.0.0.1/32", "10.1.0.0/16"], &["fd00::/64"]));
    let j = serde_json::to_value(full_batch(&rs)).unwrap();
    let objs = j["nftables"].as_array().unwrap();
    assert_eq!(
        objs[0],
        json!({"add": {"table": {"family": "inet", "name": "wirespan"}}})
    );
    assert_eq!(
        objs[1],
        json!({"delete": {"table": {"family": "inet", "name": "wirespan"}}})
    );
    assert!(objs
        .iter()
        .any(|o| o["add"]["set"]["elem"] == json!([{"prefix": {"addr": "10.1.0.0", "len": 16}}])));
    assert!(objs
        .iter()
        .any(|o| o["add"]["set"]["elem"] == json!(["10.0.0.1"])));
}

#[test]
fn parses_listing() {
    let j = r#"{"nftables": [{"metainfo": {"version": "1.0.6", "release_name": "x", "json_schema_version": 1}},
      {"table": {"family": "inet", "name": "w", "handle": 3}},
      {"set": {"family": "inet", "name": "v6_nets", "table": "w", "type": "ipv6_addr", "handle": 3, "flags": ["interval"],
               "elem": [{"prefix": {"addr": "2001:db8::", "len": 32}}]}},
      {"set": {"family": "inet", "name": "v4_hosts", "table": "w", "type": "ipv4_addr", "handle": 2, "elem": ["10.0.0.1"]}},
      {"chain": {"family": "inet", "table": "w", "name": "o", "handle": 1, "type": "route", "hook": "output", "prio": 0, "policy": "accept"}},
      {"rule": {"family": "inet", "table": "w", "chain": "o", "handle": 7, "comment": "x1",
                "expr": [{"counter": {"packets": 3, "bytes": 252}}, {"accept": null}]}}]}"#;
    let st = parse_table(j).unwrap();
    assert_eq!(st.sets[0].3.as_ref().unwrap().len(), 1);
    assert_eq!(st.sets[1].1, Family::V4);
    assert_eq!(st.chains[0].5, ["x1"]);
    assert_eq!(st.counters, [("x1".to_owned(), 3, 252)]);
}

#[test]
fn per_length_layout_has_a_masked_lookup_per_non_empty_length() {
    let mut s = spec(
        &["10.9.0.1/32", "10.244.1.0/24", "10.0.0.0/8"],
        &["fd10::/64"],
    );
    s.layout = SetLayout::PerLength;
    let rs = render(&s);
    assert_eq!(rs.sets.len(), 33 + 129);
    let live: Vec<(&str, Vec<String>)> = rs
        .sets
        .iter()
        .filter(|s| !s.elements.is_empty())
        .map(|s| (s.name, s.elements.iter().map(ToString::to_string).collect()))
        .collect();
    assert_eq!(
        live,
        vec![
            ("v4_hosts", vec!["10.9.0.1/32".to_owned()]),
            ("v4_len24", vec!["10.244.1.0/24".to_owned()]),
            ("v4_len8", vec!["10.0.0.0/8".to_owned()]),
            ("v6_len64", vec!["fd10::/64".to_owned()]),
        ]
    );
    // Both chains: one MSS clamp and one mark rule per non-empty length.
    let out = &rs.chains[1];
    let marks: Vec<&str> = out
        .rules
        .iter()
        .map(|r| r.comment.as_str())
        .filter(|c| c.starts_with("wirespan:mark:"))
        .collect();
    assert_eq!(
        marks,
        vec![
            "wirespan:mark:v4_hosts:0x40/0x60",
            "wirespan:mark:v4_len24:0x40/0x60",
            "wirespan:mark:v4_len8:0x40/0x60",
            "wirespan:mark:v6_len64:0x40/0x60",
        ]
    );
    let lookup = serde_json::to_value(&out.rules.last().unwrap().statements[0]).unwrap();
    assert_eq!(
        lookup,
        json!({"match": {"op": "==",
            "left": {"&": [{"payload": {"protocol": "ip6", "field": "daddr"}}, "ffff:ffff:ffff:ffff::"]},
            "right": "@v6_len64"}})
    );
    // nft lists bare network addresses; the listing gives them the set's length back,
    // so the listed table is the rendered one.
    let st = expected_state(&rs);
    assert_eq!(plan(&rs, Some(&st)), Plan::Nothing);
    let doc = json!({"nftables": [
        {"set": {"family": "inet", "table": "wirespan", "name": "v4_len24",
                 "type": "ipv4_addr", "handle": 1, "elem": ["10.244.1.0", "10.7.0.0"]}},
    ]});
    let parsed = parse_table(&doc.to_string()).unwrap();
    let elems: Vec<String> = parsed.sets[0]
        .3
        .as_ref()
        .unwrap()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(elems, vec!["10.7.0.0/24", "10.244.1.0/24"]);
}
