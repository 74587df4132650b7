//! The table for a [`MarkingSpec`], as plain values (pure): which sets hold which
//! prefixes, and which rules each chain holds. Nothing here knows `nft` or its JSON
//! beyond the statements themselves.

use ipnet::IpNet;
use nftables::{
    stmt::Statement,
    types::{NfChainType, NfHook},
};
use serde_json::json;

use crate::markspec::{MarkingSpec, PreroutingMarking, SetLayout};

/// Name of the prerouting chain.
pub const CHAIN_PREROUTING: &str = "kubespan_prerouting";
/// Name of the output chain.
pub const CHAIN_OUTGOING: &str = "kubespan_outgoing";
/// Prefix of every rule comment we write.
const COMMENT_PREFIX: &str = "wirespan:";

/// Address family of a set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

/// One named set of the rendered table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetDef {
    /// Set name.
    pub name: &'static str,
    /// Address family of its elements.
    pub family: Family,
    /// Interval (prefixes) or hash (exact addresses).
    pub interval: bool,
    /// Elements, normalised (sorted, no duplicates, no prefix inside another in an
    /// interval set: nft refuses overlapping intervals).
    pub elements: Vec<IpNet>,
}

/// One rule: its identifying comment and its statements.
#[derive(Debug, Clone, PartialEq)]
pub struct RuleDef {
    /// Comment naming the rule and its parameters; compared to detect drift.
    pub comment: String,
    /// nftables statements.
    pub statements: Vec<Statement<'static>>,
}

/// One base chain.
#[derive(Debug, Clone, PartialEq)]
pub struct ChainDef {
    /// Chain name.
    pub name: &'static str,
    /// Chain type (`filter` or `route`).
    pub kind: NfChainType,
    /// Hook.
    pub hook: NfHook,
    /// Rules in order.
    pub rules: Vec<RuleDef>,
}

/// The rendered table: what [`NftMarking`](super::NftMarking) makes the kernel hold.
#[derive(Debug, Clone, PartialEq)]
pub struct Ruleset {
    /// Table name.
    pub table: String,
    /// Named sets.
    pub sets: Vec<SetDef>,
    /// Base chains.
    pub chains: Vec<ChainDef>,
}

fn stmt(v: serde_json::Value) -> Statement<'static> {
    // The JSON below is fixed by this module; a failure is a programming error caught
    // by the unit tests.
    serde_json::from_value(v).expect("statement JSON matches the nftables schema")
}

/// Longest prefix of `family`.
fn max_len(family: Family) -> u8 {
    match family {
        Family::V4 => 32,
        Family::V6 => 128,
    }
}

/// Names of the per-length sets: IPv4 from /32 down to /0, then IPv6 from /128 down
/// to /0 — the order of [`render`]'s sets, most specific (most populous: hosts) first
/// so its rules come first.
fn length_set_names() -> &'static [&'static str] {
    static NAMES: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();
    NAMES.get_or_init(|| {
        // 162 short names, built once: set names are `&'static str` everywhere. The
        // whole-address sets keep the split layout's names: they hold the same.
        let name = |f: &str, l: u8, max: u8| {
            if l == max {
                format!("{f}_hosts")
            } else {
                format!("{f}_len{l}")
            }
        };
        let v4 = (0..=32u8).rev().map(move |l| name("v4", l, 32));
        let v6 = (0..=128u8).rev().map(move |l| name("v6", l, 128));
        v4.chain(v6)
            .map(|n| &*Box::leak(n.into_boxed_str()))
            .collect()
    })
}

/// Index in the per-length layout's sets (and name) of prefixes of `family` and
/// length `len`.
pub(super) fn length_set_index(family: Family, len: u8) -> usize {
    match family {
        Family::V4 => usize::from(32 - len.min(32)),
        Family::V6 => 33 + usize::from(128 - len.min(128)),
    }
}

/// The family and prefix length of a per-length set, from its name.
pub(super) fn length_of_set(name: &str) -> Option<(Family, u8)> {
    let (family, len) = match name {
        "v4_hosts" => (Family::V4, 32),
        "v6_hosts" => (Family::V6, 128),
        _ => match name.strip_prefix("v4_len") {
            Some(l) => (Family::V4, l.parse().ok()?),
            None => (Family::V6, name.strip_prefix("v6_len")?.parse().ok()?),
        },
    };
    (len <= max_len(family) && length_set_names()[length_set_index(family, len)] == name)
        .then_some((family, len))
}

/// `daddr` of `family`, masked to `set`'s prefix length when it is a per-length set
/// of less than a whole address.
fn daddr_in(family: Family, set: &str) -> Statement<'static> {
    let proto = match family {
        Family::V4 => "ip",
        Family::V6 => "ip6",
    };
    let daddr = json!({"payload": {"protocol": proto, "field": "daddr"}});
    let left = match length_of_set(set) {
        Some((_, len)) if len < max_len(family) => {
            let mask = match family {
                Family::V4 => {
                    std::net::Ipv4Addr::from(u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0))
                        .to_string()
                }
                Family::V6 => std::net::Ipv6Addr::from(
                    u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0),
                )
                .to_string(),
            };
            json!({"&": [daddr, mask]})
        }
        _ => daddr,
    };
    stmt(json!({"match": {"op": "==", "left": left, "right": format!("@{set}")}}))
}

fn mss_clamp(family: Family, set: &str, mss: u32) -> RuleDef {
    let opt = json!({"tcp option": {"name": "maxseg", "field": "size"}});
    RuleDef {
        comment: format!("{COMMENT_PREFIX}mss:{set}:{mss}"),
        statements: vec![
            daddr_in(family, set),
            stmt(json!({"match": {"op": "==",
                "left": {"&": [{"payload": {"protocol": "tcp", "field": "flags"}}, ["syn", "rst"]]},
                "right": "syn"}})),
            stmt(json!({"match": {"op": ">", "left": opt, "right": mss}})),
            stmt(json!({"mangle": {"key": opt, "value": mss}})),
        ],
    }
}

/// MSS clamp of forwarded SYNs the fast path already marked: no set lookup.
fn mss_clamp_marked(family: Family, mss: u32, spec: &MarkingSpec) -> RuleDef {
    let (proto, name) = match family {
        Family::V4 => ("ipv4", "v4"),
        Family::V6 => ("ipv6", "v6"),
    };
    let opt = json!({"tcp option": {"name": "maxseg", "field": "size"}});
    RuleDef {
        comment: format!(
            "{COMMENT_PREFIX}mss-marked:{name}:{mss}:{:#x}/{:#x}",
            spec.mark, spec.mask
        ),
        statements: vec![
            stmt(
                json!({"match": {"op": "==", "left": {"meta": {"key": "nfproto"}}, "right": proto}}),
            ),
            stmt(json!({"match": {"op": "==",
                "left": {"&": [{"meta": {"key": "mark"}}, spec.mask]},
                "right": spec.mark}})),
            stmt(json!({"match": {"op": "==",
                "left": {"&": [{"payload": {"protocol": "tcp", "field": "flags"}}, ["syn", "rst"]]},
                "right": "syn"}})),
            stmt(json!({"match": {"op": ">", "left": opt, "right": mss}})),
            stmt(json!({"mangle": {"key": opt, "value": mss}})),
        ],
    }
}

fn mark_rule(family: Family, set: &str, spec: &MarkingSpec) -> RuleDef {
    let meta = json!({"meta": {"key": "mark"}});
    RuleDef {
        comment: format!(
            "{COMMENT_PREFIX}mark:{set}:{:#x}/{:#x}",
            spec.mark, spec.mask
        ),
        statements: vec![
            daddr_in(family, set),
            stmt(json!({"counter": null})),
            stmt(json!({"mangle": {"key": meta,
                "value": {"|": [{"&": [meta, !spec.mask]}, spec.mark]}}})),
            stmt(json!({"accept": null})),
        ],
    }
}

fn device_mark_accept(spec: &MarkingSpec) -> RuleDef {
    RuleDef {
        comment: format!(
            "{COMMENT_PREFIX}device-mark:{:#x}/{:#x}",
            spec.device_mark, spec.mask
        ),
        statements: vec![
            stmt(json!({"match": {"op": "==",
                "left": {"&": [{"meta": {"key": "mark"}}, spec.mask]},
                "right": spec.device_mark}})),
            stmt(json!({"accept": null})),
        ],
    }
}

/// Sorts, de-duplicates and (for interval sets) drops prefixes covered by another.
fn normalise(mut prefixes: Vec<IpNet>, interval: bool) -> Vec<IpNet> {
    // Validated prefixes carry no host bits, so `IpNet`'s order is (network, length);
    // it is also the order `plan` merges in.
    prefixes.sort_unstable();
    prefixes.dedup();
    if !interval {
        return prefixes;
    }
    // Sorted by (address, length): a covering prefix comes before everything it covers.
    let mut out: Vec<IpNet> = Vec::with_capacity(prefixes.len());
    for p in prefixes {
        if out.last().is_some_and(|last| last.contains(&p)) {
            continue;
        }
        out.push(p);
    }
    out
}

/// Renders the table for `spec` (pure). Call [`MarkingSpec::validate`] first.
///
/// A family (or, in the split layout, a set) without prefixes gets no rules at all,
/// never an unconditional rule.
#[must_use]
pub fn render(spec: &MarkingSpec) -> Ruleset {
    let mut sets = Vec::new();
    for (family, prefixes) in [
        (Family::V4, &spec.prefixes_v4),
        (Family::V6, &spec.prefixes_v6),
    ] {
        let (hosts_name, nets_name) = match family {
            Family::V4 => ("v4_hosts", "v4_nets"),
            Family::V6 => ("v6_hosts", "v6_nets"),
        };
        match spec.layout {
            SetLayout::Split => {
                let (hosts, nets): (Vec<IpNet>, Vec<IpNet>) = prefixes
                    .iter()
                    .partition(|p| p.prefix_len() == p.max_prefix_len());
                sets.push(SetDef {
                    name: hosts_name,
                    family,
                    interval: false,
                    elements: normalise(hosts, false),
                });
                sets.push(SetDef {
                    name: nets_name,
                    family,
                    interval: true,
                    elements: normalise(nets, true),
                });
            }
            SetLayout::Interval => sets.push(SetDef {
                name: nets_name,
                family,
                interval: true,
                elements: normalise(prefixes.clone(), true),
            }),
            SetLayout::PerLength => {
                let names = length_set_names();
                let first = length_set_index(family, max_len(family));
                let mut by_len = vec![Vec::new(); usize::from(max_len(family)) + 1];
                for p in prefixes {
                    by_len[usize::from(max_len(family) - p.prefix_len())].push(*p);
                }
                sets.extend(by_len.into_iter().enumerate().map(|(i, ps)| SetDef {
                    name: names[first + i],
                    family,
                    interval: false,
                    elements: normalise(ps, false),
                }));
            }
        }
    }

    Ruleset {
        table: spec.table.clone(),
        chains: render_chains(spec, &sets),
        sets,
    }
}

/// The chains of the table for `spec` whose sets are `sets` (only which sets are empty
/// matters).
pub(super) fn render_chains(spec: &MarkingSpec, sets: &[SetDef]) -> Vec<ChainDef> {
    let live: Vec<&SetDef> = sets.iter().filter(|s| !s.elements.is_empty()).collect();
    let mss = |f: Family| match f {
        Family::V4 => spec.mss_v4(),
        Family::V6 => spec.mss_v6(),
    };

    // Prerouting sees forwarded traffic before the routing decision: clamp it too
    // (upstream clamps only locally originated SYNs, `docs/kubespan.md` §12.5).
    let mut pre = vec![device_mark_accept(spec)];
    match spec.prerouting {
        PreroutingMarking::Nftables => {
            pre.extend(
                live.iter()
                    .map(|s| mss_clamp(s.family, s.name, mss(s.family))),
            );
            pre.extend(live.iter().map(|s| mark_rule(s.family, s.name, spec)));
        }
        PreroutingMarking::FastPath => {
            let mut families: Vec<Family> = live.iter().map(|s| s.family).collect();
            families.dedup();
            pre.extend(
                families
                    .into_iter()
                    .map(|f| mss_clamp_marked(f, mss(f), spec)),
            );
        }
    }

    let mut out = vec![
        device_mark_accept(spec),
        RuleDef {
            comment: format!("{COMMENT_PREFIX}lo"),
            statements: vec![
                stmt(
                    json!({"match": {"op": "==", "left": {"meta": {"key": "oifname"}}, "right": "lo"}}),
                ),
                stmt(json!({"accept": null})),
            ],
        },
    ];
    out.extend(
        live.iter()
            .map(|s| mss_clamp(s.family, s.name, mss(s.family))),
    );
    out.extend(live.iter().map(|s| mark_rule(s.family, s.name, spec)));

    vec![
        ChainDef {
            name: CHAIN_PREROUTING,
            kind: NfChainType::Filter,
            hook: NfHook::Prerouting,
            rules: pre,
        },
        ChainDef {
            name: CHAIN_OUTGOING,
            // `route` so the kernel re-routes a local packet after its mark changes.
            kind: NfChainType::Route,
            hook: NfHook::Output,
            rules: out,
        },
    ]
}
