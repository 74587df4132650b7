//! Kernel tests of the nftables marking adapter, each in a fresh network namespace.

use ipnet::IpNet;
use serde_json::Value;
use wirespan_dataplane::{
    marking::{render, Marking, MarkingError, MarkingSpec, NftMarking, PrefixDelta, SetLayout},
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
        // These tests were written for the split layout's sets.
        layout: SetLayout::Split,
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
    let mut s = MarkingSpec {
        layout: SetLayout::Split,
        ..MarkingSpec::default()
    };
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
    s.layout = SetLayout::PerLength;
    m.apply(&s).unwrap();
    let v = nft_json(&ns);
    assert_eq!(set_elems(&v, "wirespan", "v4_hosts"), 5000);
    assert_eq!(set_elems(&v, "wirespan", "v4_len24"), 5000);
    assert_eq!(set_elems(&v, "wirespan", "v4_nets"), 0);
    assert!(!m.apply(&s).unwrap());
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

/// The prefixes nft lists for one set (intervals as `addr/len`, hosts bare).
fn listed(ns: &NetnsGuard, set: &str) -> Vec<String> {
    let v: Value = serde_json::from_str(
        &ns.run_stdout("nft", &["-j", "list", "set", "inet", "wirespan", set])
            .unwrap(),
    )
    .unwrap();
    let mut out: Vec<String> = objects(&v, "set")
        .first()
        .and_then(|s| s["elem"].as_array())
        .map(|a| {
            a.iter()
                .map(|e| match e.get("prefix") {
                    Some(p) => format!("{}/{}", p["addr"].as_str().unwrap(), p["len"]),
                    None => e.as_str().unwrap().to_owned(),
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// Every set of our table with its elements (format of [`listed`]), from one listing.
fn listed_all(ns: &NetnsGuard) -> std::collections::BTreeMap<String, Vec<String>> {
    let v: Value = serde_json::from_str(
        &ns.run_stdout("nft", &["-j", "list", "table", "inet", "wirespan"])
            .unwrap(),
    )
    .unwrap();
    objects(&v, "set")
        .into_iter()
        .map(|s| {
            let mut elems: Vec<String> = s["elem"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|e| match e.get("prefix") {
                            Some(p) => format!("{}/{}", p["addr"].as_str().unwrap(), p["len"]),
                            None => e.as_str().unwrap().to_owned(),
                        })
                        .collect()
                })
                .unwrap_or_default();
            elems.sort();
            (s["name"].as_str().unwrap().to_owned(), elems)
        })
        .collect()
}

/// [`rendered_sets`] in the form of [`listed_all`].
fn rendered_all(s: &MarkingSpec) -> std::collections::BTreeMap<String, Vec<String>> {
    rendered_sets(s)
        .into_iter()
        .map(|(n, v)| (n.to_owned(), v))
        .collect()
}

fn sorted(v: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = v.iter().map(|s| (*s).to_owned()).collect();
    v.sort();
    v
}

/// Small element changes go to the kernel as one netlink batch: adjacent intervals,
/// deletes, a prefix replaced by a covering one, both families. What nft lists
/// afterwards is exactly the desired set, the kernel finds addresses inside the
/// intervals, and a fresh adapter (nothing cached) sees nothing to do.
#[test]
fn netlink_element_updates_match_nft_listing() {
    let ns = NetnsGuard::new("wsnft").unwrap();
    let mut m = NftMarking::new(ns.netns().clone());
    let mut s = spec(
        &["10.9.0.1/32", "10.0.0.0/26"],
        &["fd00::1/128", "fd10::/64"],
    );
    m.apply(&s).unwrap();

    let steps: [(&[&str], &[&str]); 4] = [
        // Adjacent /26 after an existing /26, a second host, a second v6 /64.
        (
            &["10.9.0.1/32", "10.9.0.2/32", "10.0.0.0/26", "10.0.0.64/26"],
            &["fd00::1/128", "fd10::/64", "fd10:0:0:1::/64"],
        ),
        // Delete the first /26 and a host.
        (&["10.9.0.2/32", "10.0.0.64/26"], &["fd10:0:0:1::/64"]),
        // Replace the /26 by a covering /24 in one transaction.
        (&["10.9.0.2/32", "10.0.0.0/24"], &["fd10::/56"]),
        // Top of the address space (no interval-end entry).
        (&["10.9.0.2/32", "255.255.255.0/24"], &["fd10::/56"]),
    ];
    for (i, (v4, v6)) in steps.iter().enumerate() {
        s = spec(v4, v6);
        let before = m.transactions();
        assert!(m.apply(&s).unwrap(), "step {i} wrote nothing");
        assert_eq!(m.transactions(), before + 1, "step {i}: one transaction");
        let want = |fam4: bool, interval: bool| -> Vec<String> {
            let all: &[&str] = if fam4 { v4 } else { v6 };
            let host = if fam4 { "/32" } else { "/128" };
            let picked: Vec<&str> = all
                .iter()
                .filter(|p| p.ends_with(host) != interval)
                .map(|p| {
                    if interval {
                        *p
                    } else {
                        p.split('/').next().unwrap()
                    }
                })
                .collect();
            sorted(&picked)
        };
        assert_eq!(listed(&ns, "v4_hosts"), want(true, false), "step {i}");
        assert_eq!(listed(&ns, "v4_nets"), want(true, true), "step {i}");
        assert_eq!(listed(&ns, "v6_hosts"), want(false, false), "step {i}");
        assert_eq!(listed(&ns, "v6_nets"), want(false, true), "step {i}");
        let mut fresh = NftMarking::new(ns.netns().clone());
        assert!(
            !fresh.apply(&s).unwrap(),
            "step {i}: kernel differs from plan"
        );
    }

    // Kernel lookups inside and outside the last intervals.
    let get = |set: &str, addr: &str| {
        ns.run(
            "nft",
            &["get", "element", "inet", "wirespan", set, "{", addr, "}"],
        )
        .is_ok()
    };
    assert!(get("v4_nets", "255.255.255.255"));
    assert!(!get("v4_nets", "10.0.0.70"));
    assert!(get("v6_nets", "fd10:0:0:ff::1"));
    assert!(!get("v6_nets", "fd10:0:0:100::1"));
}

/// A change bigger than one netlink batch goes through nft and ends the same.
#[test]
fn large_element_change_goes_through_nft() {
    let ns = NetnsGuard::new("wsnft").unwrap();
    let mut m = NftMarking::new(ns.netns().clone());
    let mut s = spec(&["10.9.0.1/32"], &[]);
    m.apply(&s).unwrap();
    s.prefixes_v4.extend(
        (0..3000u32).map(|i| {
            IpNet::new(std::net::Ipv4Addr::from(0x0a00_0000 + (i << 8)).into(), 24).unwrap()
        }),
    );
    assert!(m.apply(&s).unwrap());
    assert_eq!(listed(&ns, "v4_nets").len(), 3000);
    assert!(!NftMarking::new(ns.netns().clone()).apply(&s).unwrap());
}

/// What nft should list for each set of `spec`'s rendering (format of [`listed`]).
fn rendered_sets(s: &MarkingSpec) -> Vec<(&'static str, Vec<String>)> {
    render(s)
        .sets
        .iter()
        .map(|set| {
            let mut v: Vec<String> = set
                .elements
                .iter()
                .map(|p| {
                    // nft lists a one-address interval as the bare address.
                    if set.interval && p.prefix_len() != p.max_prefix_len() {
                        p.to_string()
                    } else {
                        p.addr().to_string()
                    }
                })
                .collect();
            v.sort();
            (set.name, v)
        })
        .collect()
}

/// Deltas before any apply are refused; after one, each delta leaves the kernel with
/// exactly the table a full apply of the resulting spec renders (both layouts), in
/// one transaction and without listing the table while no one else wrote; a delta
/// that empties a set rewrites the rules; after a foreign transaction the delta still
/// ends right (the table is read once).
#[test]
fn deltas_leave_exactly_the_rendered_table() {
    let p = |s: &str| s.parse::<IpNet>().unwrap();
    for layout in [SetLayout::Split, SetLayout::Interval, SetLayout::PerLength] {
        let ns = NetnsGuard::new("wsnftd").unwrap();
        let mut m = NftMarking::new(ns.netns().clone());
        let first = PrefixDelta {
            remove: vec![],
            add: vec![p("10.9.0.1/32")],
        };
        assert!(matches!(
            m.apply_delta(&first),
            Err(MarkingError::NotApplied)
        ));
        assert!(ns
            .run_stdout("nft", &["list", "ruleset"])
            .unwrap()
            .trim()
            .is_empty());
        let mut s = MarkingSpec {
            layout,
            ..spec(
                &["10.9.0.1/32", "10.9.0.2/32", "10.0.0.0/26", "10.0.0.0/24"],
                &["fd00::1/128", "fd10::/64"],
            )
        };
        m.apply(&s).unwrap();
        let steps: Vec<(Vec<&str>, Vec<&str>)> = vec![
            // A host for a host; an adjacent interval.
            (vec!["10.9.0.1/32"], vec!["10.9.0.3/32", "10.0.1.0/24"]),
            // The covering /24 goes: the /26 it hid appears.
            (vec!["10.0.0.0/24"], vec![]),
            // A covering prefix arrives over two others.
            (vec![], vec!["10.0.0.0/16"]),
            // A duplicate added, then one copy removed: no change.
            (vec![], vec!["10.9.0.2/32"]),
            (vec!["10.9.0.2/32"], vec![]),
            // IPv6: a /64 for a /56 covering it, a host replaced.
            (
                vec!["fd10::/64", "fd00::1/128"],
                vec!["fd10::/56", "fd00::2/128"],
            ),
            // Top of the address space.
            (vec![], vec!["255.255.255.0/24"]),
        ];
        for (i, (remove, add)) in steps.iter().enumerate() {
            let delta = PrefixDelta {
                remove: remove.iter().map(|q| p(q)).collect(),
                add: add.iter().map(|q| p(q)).collect(),
            };
            let (writes, reads) = (m.transactions(), m.reads());
            let before = rendered_sets(&s);
            s = delta.applied_to(&s).unwrap();
            let wrote = m.apply_delta(&delta).unwrap();
            let want = rendered_sets(&s);
            assert_eq!(wrote, before != want, "{layout:?} step {i}");
            assert_eq!(
                m.transactions(),
                writes + u64::from(wrote),
                "{layout:?} step {i}"
            );
            assert_eq!(m.reads(), reads, "{layout:?} step {i}: table listed");
            assert_eq!(listed_all(&ns), rendered_all(&s), "{layout:?} step {i}");
            assert!(
                !NftMarking::new(ns.netns().clone()).apply(&s).unwrap(),
                "{layout:?} step {i}: kernel differs from a full apply"
            );
        }
        // Everything IPv6 goes: its sets empty, its rules go with them.
        let delta = PrefixDelta {
            remove: s.prefixes_v6.clone(),
            add: vec![],
        };
        s = delta.applied_to(&s).unwrap();
        assert!(m.apply_delta(&delta).unwrap());
        let rules = ns
            .run_stdout("nft", &["list", "table", "inet", "wirespan"])
            .unwrap();
        assert!(!rules.contains("ip6 daddr"), "{rules}");
        assert!(!NftMarking::new(ns.netns().clone()).apply(&s).unwrap());
        // A foreign transaction: the next delta reads the table once and ends right.
        ns.run("nft", &["add", "table", "inet", "other"]).unwrap();
        let reads = m.reads();
        let delta = PrefixDelta {
            remove: vec![p("10.9.0.3/32")],
            add: vec![p("fd00::9/128")],
        };
        s = delta.applied_to(&s).unwrap();
        assert!(m.apply_delta(&delta).unwrap());
        assert_eq!(m.reads(), reads + 1);
        assert_eq!(
            listed_all(&ns),
            rendered_all(&s),
            "{layout:?} after foreign"
        );
        assert!(!NftMarking::new(ns.netns().clone()).apply(&s).unwrap());
    }
}

/// An invalid delta names its entry and writes nothing; the next valid one applies.
#[test]
fn invalid_delta_writes_nothing() {
    let p = |s: &str| s.parse::<IpNet>().unwrap();
    let ns = NetnsGuard::new("wsnftd").unwrap();
    let mut m = NftMarking::new(ns.netns().clone());
    let s = spec(&["10.9.0.1/32", "10.0.0.0/24"], &[]);
    m.apply(&s).unwrap();
    let before = ns.run_stdout("nft", &["list", "ruleset"]).unwrap();
    for (bad, field) in [
        (
            PrefixDelta {
                remove: vec![p("10.0.0.0/24"), p("10.9.0.9/32")],
                add: vec![p("10.1.0.0/24")],
            },
            "remove[1]",
        ),
        (
            PrefixDelta {
                remove: vec![p("10.0.0.0/24")],
                add: vec![p("10.1.0.0/24"), p("10.2.0.1/24")],
            },
            "add[1]",
        ),
    ] {
        match m.apply_delta(&bad) {
            Err(MarkingError::Invalid(e)) => assert_eq!(e.field, field, "{e}"),
            other => panic!("expected invalid {field}, got {other:?}"),
        }
    }
    assert_eq!(m.transactions(), 1);
    assert_eq!(ns.run_stdout("nft", &["list", "ruleset"]).unwrap(), before);
    let ok = PrefixDelta {
        remove: vec![p("10.0.0.0/24")],
        add: vec![p("10.1.0.0/24")],
    };
    assert!(m.apply_delta(&ok).unwrap());
    assert_eq!(listed(&ns, "v4_nets"), vec!["10.1.0.0/24".to_owned()]);
    assert_eq!(listed(&ns, "v4_hosts"), vec!["10.9.0.1".to_owned()]);
}

/// The per-length layout: one hash set per prefix length holding network addresses,
/// a masked lookup per non-empty length; full applies and deltas leave exactly the
/// rendered elements; locally originated packets to covered addresses are marked,
/// others not.
#[test]
fn per_length_layout_lists_and_marks_exactly_the_routed_set() {
    let p = |s: &str| s.parse::<IpNet>().unwrap();
    let ns = NetnsGuard::new("wsnftl").unwrap();
    // A route for everything, so pings leave through the output chain.
    for args in [
        &["link", "add", "d0", "type", "veth", "peer", "name", "d1"][..],
        &["link", "set", "d0", "up"],
        &["link", "set", "d1", "up"],
        &["addr", "add", "192.0.2.1/24", "dev", "d0"],
        &["route", "add", "default", "dev", "d0"],
        &["-6", "route", "add", "default", "dev", "d0"],
    ] {
        ns.run("ip", args).unwrap();
    }
    let mut m = NftMarking::new(ns.netns().clone());
    let mut s = MarkingSpec {
        layout: SetLayout::PerLength,
        ..spec(
            &[
                "10.9.0.1/32",
                "10.244.1.0/24",
                "10.244.0.0/16",
                "100.64.0.0/26",
            ],
            &["fd00:1::1/128", "fd10::/64"],
        )
    };
    assert!(m.apply(&s).unwrap());
    let all = listed_all(&ns);
    assert_eq!(all, rendered_all(&s));
    let nonempty: Vec<(&str, Vec<String>)> = all
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    assert_eq!(
        nonempty,
        vec![
            ("v4_hosts", sorted(&["10.9.0.1"])),
            ("v4_len16", sorted(&["10.244.0.0"])),
            ("v4_len24", sorted(&["10.244.1.0"])),
            ("v4_len26", sorted(&["100.64.0.0"])),
            ("v6_hosts", sorted(&["fd00:1::1"])),
            ("v6_len64", sorted(&["fd10::"])),
        ]
    );
    let chain = ns
        .run_stdout(
            "nft",
            &["list", "chain", "inet", "wirespan", "kubespan_outgoing"],
        )
        .unwrap();
    assert!(
        chain.contains("ip daddr & 255.255.255.0 == @v4_len24")
            && chain.contains("ip daddr @v4_hosts")
            && chain.contains("ip6 daddr & ffff:ffff:ffff:ffff:: == @v6_len64")
            && !chain.contains("v4_len8"),
        "{chain}"
    );
    assert!(!m.apply(&s).unwrap(), "re-apply wrote");

    let marked = |m: &mut NftMarking| -> u64 {
        m.observe()
            .unwrap()
            .counters
            .iter()
            .filter(|(c, _, _)| c.starts_with("wirespan:mark:"))
            .map(|(_, n, _)| *n)
            .sum()
    };
    let send = |dst: &str| {
        // No one answers: only the packet going out matters.
        let _ = ns.run("ping", &["-c", "1", "-W", "1", dst]);
    };
    for (dst, covered) in [
        ("10.9.0.1", true),
        ("10.9.0.2", false),
        ("10.244.1.77", true),
        ("10.244.200.3", true),
        ("10.245.0.1", false),
        ("100.64.0.63", true),
        ("100.64.0.64", false),
        ("fd10::42", true),
        ("fd10:0:0:1::1", false),
        ("fd00:1::1", true),
        ("fd00:1::2", false),
    ] {
        let before = marked(&mut m);
        send(dst);
        let after = marked(&mut m);
        assert_eq!(
            after > before,
            covered,
            "{dst}: mark counter {before} -> {after}"
        );
    }

    // Deltas: a new length appears (rules change), an element goes, a length empties.
    let steps: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (vec![], vec!["10.10.0.0/20"]),
        (vec!["10.244.1.0/24"], vec!["10.244.2.0/24"]),
        (vec!["100.64.0.0/26"], vec![]),
        (vec!["fd10::/64"], vec!["fd10::/56"]),
    ];
    for (i, (remove, add)) in steps.iter().enumerate() {
        let delta = PrefixDelta {
            remove: remove.iter().map(|q| p(q)).collect(),
            add: add.iter().map(|q| p(q)).collect(),
        };
        s = delta.applied_to(&s).unwrap();
        assert!(m.apply_delta(&delta).unwrap(), "step {i}");
        assert_eq!(listed_all(&ns), rendered_all(&s), "step {i}");
        assert!(
            !NftMarking::new(ns.netns().clone()).apply(&s).unwrap(),
            "step {i}: kernel differs from a full apply"
        );
    }
    for (dst, covered) in [
        ("10.10.15.255", true),
        ("10.10.16.0", false),
        ("10.244.2.9", true),
        ("100.64.0.1", false),
        ("fd10:0:0:ff::1", true),
    ] {
        let before = marked(&mut m);
        send(dst);
        let after = marked(&mut m);
        assert_eq!(
            after > before,
            covered,
            "{dst}: mark counter {before} -> {after}"
        );
    }
}
