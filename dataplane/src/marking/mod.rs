//! The nftables marking table (spec §6.6): marks packets bound for the mesh so policy
//! routing sends them into the WireGuard link.
//!
//! [`render`] turns a [`MarkingSpec`] into a [`Ruleset`] (pure). [`NftMarking`] reads
//! our table with `nft -j list table`, and then either changes only set elements (the
//! steady state: chains are never touched) or, when the structure differs (first
//! apply, MTU or mark change, someone flushed or edited the table), replaces the whole
//! table. Either way it is one atomic transaction touching only our table: small
//! element changes go straight to the kernel as one nf_tables netlink batch (`nft`
//! would fetch every element first), everything else is one `nft -j -f -`. While the
//! ruleset generation shows no transaction but ours, the table is not read at all,
//! and a spec that differs from the previous one in a few prefixes is re-rendered
//! incrementally: a steady-state change costs time in proportion to the change.
//! [`Marking::apply_delta`] goes further: given the change itself ([`PrefixDelta`]),
//! no list is compared at all, and the element changes it renders are committed
//! straight onto the remembered table state.
//!
//! Every rule carries a comment naming what it does and its parameters
//! (`wirespan:mss:v4_hosts:1368`); the comments of the listed rules are compared with
//! the rendered ones to detect edits without comparing nft's normalised expressions.

use std::{
    borrow::Cow,
    collections::{BTreeSet, HashSet},
    io::Write,
    net::IpAddr,
    process::Stdio,
};

use ipnet::IpNet;
use nftables::{
    expr::{Expression, NamedExpression},
    schema::{self, NfCmd, NfListObject, NfObject, Nftables, SetFlag, SetType, SetTypeValue},
    stmt::Statement,
    types::{NfChainPolicy, NfChainType, NfFamily, NfHook},
};
use serde_json::json;

use crate::{error::Invalid, netns::Netns};

mod incremental;
mod positions;

pub use positions::{AppliedSpec, PrefixLists};

/// Default table name (ours alone, not shared with the host firewall).
pub const DEFAULT_TABLE: &str = "wirespan";
/// Name of the prerouting chain.
pub const CHAIN_PREROUTING: &str = "kubespan_prerouting";
/// Name of the output chain.
pub const CHAIN_OUTGOING: &str = "kubespan_outgoing";
/// Prefix of every rule comment we write.
const COMMENT_PREFIX: &str = "wirespan:";

/// How the routed prefixes are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SetLayout {
    /// Host addresses (/32, /128) in hash sets, true CIDRs in interval sets: a hash
    /// lookup is several times cheaper than the interval (rbtree) lookup (spec §12.1).
    #[default]
    Split,
    /// Everything in one interval set per family, as upstream does.
    Interval,
}

/// Who marks forwarded traffic (the prerouting chain's job).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PreroutingMarking {
    /// The prerouting chain looks the destination up in the sets and marks.
    #[default]
    Nftables,
    /// The eBPF fast path ([`crate::fastpath`]) marks at tc ingress, before
    /// prerouting: the chain keeps the device-mark accept and clamps the MSS of
    /// forwarded SYNs that already carry the mesh mark, with no set lookup. The output
    /// chain (locally originated traffic) is unchanged.
    FastPath,
}

/// The desired marking table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarkingSpec {
    /// nftables table name (family `inet`).
    pub table: String,
    /// Mark WireGuard puts on its own UDP (`0x20`); such packets are never re-marked.
    pub device_mark: u32,
    /// Mark that sends a packet into the mesh (`0x40`).
    pub mark: u32,
    /// Mask of both marks (`0x60`); other bits are left alone.
    pub mask: u32,
    /// Link MTU; the TCP MSS is clamped to `mtu - 52` (IPv4) and `mtu - 72` (IPv6).
    pub mtu: u32,
    /// IPv4 part of the routed set.
    pub prefixes_v4: Vec<IpNet>,
    /// IPv6 part of the routed set.
    pub prefixes_v6: Vec<IpNet>,
    /// Storage of the prefixes.
    pub layout: SetLayout,
    /// Who marks forwarded traffic.
    pub prerouting: PreroutingMarking,
}

impl Default for MarkingSpec {
    fn default() -> Self {
        Self {
            table: DEFAULT_TABLE.to_owned(),
            device_mark: crate::DEVICE_FWMARK,
            mark: crate::MESH_MARK,
            mask: crate::MARK_MASK,
            mtu: crate::DEFAULT_MTU,
            prefixes_v4: Vec::new(),
            prefixes_v6: Vec::new(),
            layout: SetLayout::Split,
            prerouting: PreroutingMarking::Nftables,
        }
    }
}

impl MarkingSpec {
    /// Checks every field; nothing is written when this fails.
    ///
    /// # Errors
    /// The first invalid field.
    pub fn validate(&self) -> Result<(), Invalid> {
        let t = &self.table;
        if t.is_empty()
            || t.len() > 64
            || !t.starts_with(|c: char| c.is_ascii_alphabetic())
            || !t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            return Err(Invalid::new(
                "table",
                format!("{t:?} must be 1 to 64 letters, digits or '_', starting with a letter"),
            ));
        }
        if self.mask == 0 {
            return Err(Invalid::new("mask", "must not be 0"));
        }
        for (field, v) in [("mark", self.mark), ("device_mark", self.device_mark)] {
            if v == 0 || v & !self.mask != 0 {
                return Err(Invalid::new(
                    field,
                    format!("{v:#x} must be non-zero and inside mask {:#x}", self.mask),
                ));
            }
        }
        if self.mark == self.device_mark {
            return Err(Invalid::new("mark", "must differ from device_mark"));
        }
        crate::error::check_mtu("mtu", self.mtu)?;
        for (field, list, v4) in [
            ("prefixes_v4", &self.prefixes_v4, true),
            ("prefixes_v6", &self.prefixes_v6, false),
        ] {
            for (i, p) in list.iter().enumerate() {
                let ok = matches!((p, v4), (IpNet::V4(_), true) | (IpNet::V6(_), false));
                if !ok {
                    let fam = if v4 { "IPv4" } else { "IPv6" };
                    return Err(Invalid::new(
                        format!("{field}[{i}]"),
                        format!("{p} is not an {fam} prefix"),
                    ));
                }
                if p.trunc() != *p {
                    return Err(Invalid::new(
                        format!("{field}[{i}]"),
                        format!("{p} has host bits set (expected {})", p.trunc()),
                    ));
                }
            }
        }
        Ok(())
    }

    /// MSS clamp value for IPv4.
    #[must_use]
    pub fn mss_v4(&self) -> u32 {
        self.mtu.saturating_sub(52)
    }

    /// MSS clamp value for IPv6.
    #[must_use]
    pub fn mss_v6(&self) -> u32 {
        self.mtu.saturating_sub(72)
    }
}

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

/// The rendered table: what [`NftMarking`] makes the kernel hold.
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

fn daddr_in(family: Family, set: &str) -> Statement<'static> {
    let proto = match family {
        Family::V4 => "ip",
        Family::V6 => "ip6",
    };
    stmt(json!({"match": {"op": "==",
        "left": {"payload": {"protocol": proto, "field": "daddr"}},
        "right": format!("@{set}")}}))
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
fn render_chains(spec: &MarkingSpec, sets: &[SetDef]) -> Vec<ChainDef> {
    let live: Vec<&SetDef> = sets.iter().filter(|s| !s.elements.is_empty()).collect();
    let mss = |f: Family| match f {
        Family::V4 => spec.mss_v4(),
        Family::V6 => spec.mss_v6(),
    };

    // Prerouting sees forwarded traffic before the routing decision: clamp it too
    // (upstream clamps only locally originated SYNs, spec §12.5).
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

fn elem_expr(p: &IpNet, interval: bool) -> Expression<'static> {
    if interval {
        Expression::Named(NamedExpression::Prefix(nftables::expr::Prefix {
            addr: Box::new(Expression::String(Cow::Owned(p.network().to_string()))),
            len: u32::from(p.prefix_len()),
        }))
    } else {
        Expression::String(Cow::Owned(p.addr().to_string()))
    }
}

fn set_object(table: &str, s: &SetDef, with_elements: bool) -> NfListObject<'static> {
    let set_type = match s.family {
        Family::V4 => SetType::Ipv4Addr,
        Family::V6 => SetType::Ipv6Addr,
    };
    let elem = (with_elements && !s.elements.is_empty()).then(|| {
        Cow::Owned(
            s.elements
                .iter()
                .map(|p| elem_expr(p, s.interval))
                .collect::<Vec<_>>(),
        )
    });
    NfListObject::Set(Box::new(schema::Set {
        family: NfFamily::INet,
        table: Cow::Owned(table.to_owned()),
        name: Cow::Borrowed(s.name),
        set_type: SetTypeValue::Single(set_type),
        flags: s.interval.then(|| HashSet::from([SetFlag::Interval])),
        elem,
        ..schema::Set::default()
    }))
}

fn table_object(name: &str) -> NfListObject<'static> {
    NfListObject::Table(schema::Table {
        family: NfFamily::INet,
        name: Cow::Owned(name.to_owned()),
        handle: None,
    })
}

/// The transaction that replaces our table (and nothing else) with `rs`: `add table`
/// first so the `delete` cannot fail when it is absent.
#[must_use]
pub fn full_batch(rs: &Ruleset) -> Nftables<'static> {
    let mut objs = vec![
        NfObject::CmdObject(NfCmd::Add(table_object(&rs.table))),
        NfObject::CmdObject(NfCmd::Delete(table_object(&rs.table))),
        NfObject::CmdObject(NfCmd::Add(table_object(&rs.table))),
    ];
    for s in &rs.sets {
        objs.push(NfObject::CmdObject(NfCmd::Add(set_object(
            &rs.table, s, true,
        ))));
    }
    for c in &rs.chains {
        objs.push(NfObject::CmdObject(NfCmd::Add(NfListObject::Chain(
            schema::Chain {
                family: NfFamily::INet,
                table: Cow::Owned(rs.table.clone()),
                name: Cow::Borrowed(c.name),
                _type: Some(c.kind),
                hook: Some(c.hook),
                prio: Some(0),
                policy: Some(NfChainPolicy::Accept),
                ..schema::Chain::default()
            },
        ))));
        for r in &c.rules {
            objs.push(NfObject::CmdObject(NfCmd::Add(NfListObject::Rule(
                schema::Rule {
                    family: NfFamily::INet,
                    table: Cow::Owned(rs.table.clone()),
                    chain: Cow::Borrowed(c.name),
                    expr: Cow::Owned(r.statements.clone()),
                    comment: Some(Cow::Owned(r.comment.clone())),
                    ..schema::Rule::default()
                },
            ))));
        }
    }
    Nftables {
        objects: Cow::Owned(objs),
    }
}

/// Element changes of one set.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SetDiff {
    /// Set name.
    pub name: &'static str,
    /// Interval set?
    pub interval: bool,
    /// Elements to add.
    pub add: Vec<IpNet>,
    /// Elements to delete.
    pub delete: Vec<IpNet>,
}

/// The transaction that applies element changes (deletes first, so a prefix that is
/// replaced by a covering one never overlaps in an interval set).
#[must_use]
pub fn element_batch(table: &str, diffs: &[SetDiff]) -> Nftables<'static> {
    let mut objs = Vec::new();
    let element = |d: &SetDiff, list: &[IpNet]| {
        NfListObject::Element(schema::Element {
            family: NfFamily::INet,
            table: Cow::Owned(table.to_owned()),
            name: Cow::Borrowed(d.name),
            elem: Cow::Owned(list.iter().map(|p| elem_expr(p, d.interval)).collect()),
        })
    };
    for d in diffs.iter().filter(|d| !d.delete.is_empty()) {
        objs.push(NfObject::CmdObject(NfCmd::Delete(element(d, &d.delete))));
    }
    for d in diffs.iter().filter(|d| !d.add.is_empty()) {
        objs.push(NfObject::CmdObject(NfCmd::Add(element(d, &d.add))));
    }
    Nftables {
        objects: Cow::Owned(objs),
    }
}

/// What the kernel holds in our table, as far as we compare it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TableState {
    /// Sets by name: (family, interval, elements). Elements are `None` when nft listed
    /// something we cannot represent as a prefix (foreign edit).
    pub sets: Vec<(String, Family, bool, Option<BTreeSet<IpNet>>)>,
    /// Chains: (name, type, hook, prio, policy, rule comments in order).
    pub chains: Vec<(String, String, String, i32, String, Vec<String>)>,
    /// Rule counters by comment: (packets, bytes).
    pub counters: Vec<(String, u64, u64)>,
}

fn parse_addr(e: &Expression<'_>) -> Option<IpAddr> {
    match e {
        Expression::String(s) => s.parse().ok(),
        _ => None,
    }
}

fn parse_elem(e: &Expression<'_>) -> Option<IpNet> {
    match e {
        Expression::String(_) => parse_addr(e).map(IpNet::from),
        Expression::Named(NamedExpression::Prefix(p)) => {
            IpNet::new(parse_addr(&p.addr)?, u8::try_from(p.len).ok()?).ok()
        }
        Expression::Named(NamedExpression::Elem(el)) => parse_elem(&el.val),
        _ => None,
    }
}

/// Parses `nft -j list table inet NAME` output. `None` if it does not parse with the
/// nftables schema (someone put something there we do not model: treat as drift).
#[must_use]
pub fn parse_table(json: &str) -> Option<TableState> {
    let doc: Nftables<'_> = serde_json::from_str(json).ok()?;
    let mut st = TableState::default();
    let mut rules: Vec<(String, String)> = Vec::new();
    for obj in doc.objects.iter() {
        let NfObject::ListObject(obj) = obj else {
            continue;
        };
        match obj {
            NfListObject::Set(s) => {
                let family = match &s.set_type {
                    SetTypeValue::Single(SetType::Ipv4Addr) => Family::V4,
                    SetTypeValue::Single(SetType::Ipv6Addr) => Family::V6,
                    _ => return None,
                };
                let interval = s
                    .flags
                    .as_ref()
                    .is_some_and(|f| f.contains(&SetFlag::Interval));
                let elements = s
                    .elem
                    .as_deref()
                    .unwrap_or_default()
                    .iter()
                    .map(parse_elem)
                    .collect::<Option<BTreeSet<_>>>();
                st.sets
                    .push((s.name.to_string(), family, interval, elements));
            }
            NfListObject::Chain(c) => st.chains.push((
                c.name.to_string(),
                c._type
                    .as_ref()
                    .map(|t| format!("{t:?}"))
                    .unwrap_or_default(),
                c.hook
                    .as_ref()
                    .map(|h| format!("{h:?}"))
                    .unwrap_or_default(),
                c.prio.unwrap_or_default(),
                c.policy
                    .as_ref()
                    .map(|p| format!("{p:?}"))
                    .unwrap_or_default(),
                Vec::new(),
            )),
            NfListObject::Rule(r) => {
                let comment = r.comment.as_deref().unwrap_or_default().to_owned();
                for s in r.expr.iter() {
                    if let Statement::Counter(nftables::stmt::Counter::Anonymous(Some(c))) = s {
                        let n = |v: Option<usize>| v.unwrap_or_default() as u64;
                        st.counters
                            .push((comment.clone(), n(c.packets), n(c.bytes)));
                    }
                }
                rules.push((r.chain.to_string(), comment));
            }
            _ => {}
        }
    }
    for (chain, comment) in rules {
        if let Some(c) = st.chains.iter_mut().find(|c| c.0 == chain) {
            c.5.push(comment);
        }
    }
    Some(st)
}

/// What an apply has to do to make `current` equal `rs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Already in place: write nothing.
    Nothing,
    /// Change set elements only.
    Elements(Vec<SetDiff>),
    /// Replace the whole table (absent, or its structure differs).
    Rebuild,
}

/// Compares the kernel's table with the rendered one (pure).
#[must_use]
pub fn plan(rs: &Ruleset, current: Option<&TableState>) -> Plan {
    let Some(cur) = current else {
        return Plan::Rebuild;
    };
    let want_chains: Vec<_> = rs.chains.iter().map(chain_state).collect();
    let mut have_chains = cur.chains.clone();
    have_chains.sort();
    let mut want_sorted = want_chains;
    want_sorted.sort();
    if have_chains != want_sorted || cur.sets.len() != rs.sets.len() {
        return Plan::Rebuild;
    }
    let mut diffs = Vec::new();
    for s in &rs.sets {
        let Some((_, fam, interval, elems)) = cur.sets.iter().find(|c| c.0 == s.name) else {
            return Plan::Rebuild;
        };
        let Some(have) = elems else {
            return Plan::Rebuild;
        };
        if *fam != s.family || *interval != s.interval {
            return Plan::Rebuild;
        }
        let (add, delete) = sorted_difference(&s.elements, have);
        if !add.is_empty() || !delete.is_empty() {
            diffs.push(SetDiff {
                name: s.name,
                interval: s.interval,
                add,
                delete,
            });
        }
    }
    if diffs.is_empty() {
        Plan::Nothing
    } else {
        Plan::Elements(diffs)
    }
}

/// (in `want` only, in `have` only). Linear when `want` is strictly ascending, as
/// rendered sets are; no set is built.
fn sorted_difference(want: &[IpNet], have: &BTreeSet<IpNet>) -> (Vec<IpNet>, Vec<IpNet>) {
    if !want.windows(2).all(|w| w[0] < w[1]) {
        let want: BTreeSet<IpNet> = want.iter().copied().collect();
        return (
            want.difference(have).copied().collect(),
            have.difference(&want).copied().collect(),
        );
    }
    let (mut add, mut delete) = (Vec::new(), Vec::new());
    let (mut w, mut h) = (want.iter().peekable(), have.iter().peekable());
    loop {
        match (w.peek(), h.peek()) {
            (None, None) => break,
            (Some(a), None) => {
                add.push(**a);
                w.next();
            }
            (None, Some(b)) => {
                delete.push(**b);
                h.next();
            }
            (Some(a), Some(b)) => match a.cmp(b) {
                std::cmp::Ordering::Less => {
                    add.push(**a);
                    w.next();
                }
                std::cmp::Ordering::Greater => {
                    delete.push(**b);
                    h.next();
                }
                std::cmp::Ordering::Equal => {
                    w.next();
                    h.next();
                }
            },
        }
    }
    (add, delete)
}

/// Applies committed element changes to a remembered table state.
fn apply_diffs(st: &mut TableState, diffs: &[SetDiff]) {
    for d in diffs {
        if let Some((_, _, _, Some(elems))) = st.sets.iter_mut().find(|s| s.0 == d.name) {
            for p in &d.delete {
                elems.remove(p);
            }
            elems.extend(d.add.iter().copied());
        }
    }
}

/// How [`parse_table`] reports a chain that holds exactly `c`.
fn chain_state(c: &ChainDef) -> (String, String, String, i32, String, Vec<String>) {
    (
        c.name.to_owned(),
        format!("{:?}", c.kind),
        format!("{:?}", c.hook),
        0,
        format!("{:?}", NfChainPolicy::Accept),
        c.rules.iter().map(|r| r.comment.clone()).collect(),
    )
}

/// The state [`parse_table`] would report for a table that holds exactly `rs`.
#[must_use]
pub fn expected_state(rs: &Ruleset) -> TableState {
    TableState {
        sets: rs
            .sets
            .iter()
            .map(|s| {
                (
                    s.name.to_owned(),
                    s.family,
                    s.interval,
                    Some(s.elements.iter().copied().collect()),
                )
            })
            .collect(),
        chains: rs.chains.iter().map(chain_state).collect(),
        counters: Vec::new(),
    }
}

/// Errors of the nftables adapter.
#[derive(Debug, thiserror::Error)]
pub enum MarkingError {
    /// The desired state is invalid; nothing was written.
    #[error("invalid marking spec: {0}")]
    Invalid(#[from] Invalid),
    /// `nft` could not be run.
    #[error("cannot run nft: {0}")]
    Spawn(#[source] std::io::Error),
    /// The nf_tables netlink socket failed mid-transaction; the next apply re-reads the
    /// table.
    #[error("nf_tables netlink: {0}")]
    Netlink(#[source] std::io::Error),
    /// `nft` refused a command; the kernel keeps its previous state (transactions are
    /// atomic).
    #[error("nft {op} failed: {stderr}")]
    Nft {
        /// What we asked for.
        op: &'static str,
        /// nft's message.
        stderr: String,
    },
    /// A delta was given before any spec was applied.
    #[error("a routed-set delta needs a spec applied first")]
    NotApplied,
    /// The eBPF fast path that marks forwarded traffic failed to sync its maps.
    #[error("eBPF fast path: {0}")]
    FastPath(#[source] crate::fastpath::FastPathError),
}

/// A change of the routed set relative to the spec last applied. Like the spec's
/// prefix lists, the routed set is a multiset: each entry of `remove` takes away one
/// occurrence, each entry of `add` adds one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixDelta {
    /// Occurrences to remove (each must be present).
    pub remove: Vec<IpNet>,
    /// Occurrences to add (host bits must be zero).
    pub add: Vec<IpNet>,
}

impl PrefixDelta {
    /// Whether nothing changes.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.remove.is_empty() && self.add.is_empty()
    }

    /// Checks the added prefixes; nothing is written when this fails.
    ///
    /// # Errors
    /// The first prefix with host bits set.
    pub fn validate(&self) -> Result<(), Invalid> {
        for (i, p) in self.add.iter().enumerate() {
            if p.trunc() != *p {
                return Err(Invalid::new(
                    format!("add[{i}]"),
                    format!("{p} has host bits set (expected {})", p.trunc()),
                ));
            }
        }
        Ok(())
    }

    /// `spec` with this change. An added prefix takes the position of a removed one of
    /// its family where it can (so a spec compared position by position afterwards
    /// differs in few places); other additions are appended.
    ///
    /// # Errors
    /// An added prefix is invalid, or a removed one is not in `spec`.
    pub fn applied_to(&self, spec: &MarkingSpec) -> Result<MarkingSpec, Invalid> {
        self.validate()?;
        let mut out = spec.clone();
        let mut free: (Vec<usize>, Vec<usize>) = (Vec::new(), Vec::new());
        for (i, p) in self.remove.iter().enumerate() {
            let (list, free) = match p {
                IpNet::V4(_) => (&out.prefixes_v4, &mut free.0),
                IpNet::V6(_) => (&out.prefixes_v6, &mut free.1),
            };
            let at = list
                .iter()
                .enumerate()
                .position(|(k, q)| q == p && !free.contains(&k))
                .ok_or_else(|| {
                    Invalid::new(
                        format!("remove[{i}]"),
                        format!("{p} is not in the routed set"),
                    )
                })?;
            free.push(at);
        }
        for p in &self.add {
            let (list, free) = match p {
                IpNet::V4(_) => (&mut out.prefixes_v4, &mut free.0),
                IpNet::V6(_) => (&mut out.prefixes_v6, &mut free.1),
            };
            match free.pop() {
                Some(at) => list[at] = *p,
                None => list.push(*p),
            }
        }
        for (list, free) in [
            (&mut out.prefixes_v4, &mut free.0),
            (&mut out.prefixes_v6, &mut free.1),
        ] {
            // Highest position first, so every index stays valid.
            free.sort_unstable();
            for at in free.iter().rev() {
                list.swap_remove(*at);
            }
        }
        Ok(out)
    }
}

/// Observed state of the marking table.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MarkingStatus {
    /// Whether our table exists.
    pub present: bool,
    /// Elements per set name.
    pub elements: Vec<(String, usize)>,
    /// Rule counters: (rule comment, packets, bytes).
    pub counters: Vec<(String, u64, u64)>,
}

/// The marking adapter interface (implemented by [`NftMarking`] and the fake).
pub trait Marking {
    /// Makes the kernel hold exactly the table rendered from `spec`, with the least
    /// change. Returns whether anything was written.
    ///
    /// # Errors
    /// Invalid spec (nothing written) or nft failure (previous state kept).
    fn apply(&mut self, spec: &MarkingSpec) -> Result<bool, MarkingError>;
    /// Applies `delta` to the spec last applied, writing only what it changes; the
    /// other fields stay as last applied. Returns whether anything was written.
    ///
    /// # Errors
    /// No spec applied yet, an invalid delta (nothing written), or as [`Marking::apply`].
    fn apply_delta(&mut self, delta: &PrefixDelta) -> Result<bool, MarkingError>;
    /// Reads the table's sets and counters.
    ///
    /// # Errors
    /// nft failure.
    fn observe(&mut self) -> Result<MarkingStatus, MarkingError>;
    /// Removes our table (and nothing else). Idempotent.
    ///
    /// # Errors
    /// nft failure.
    fn teardown(&mut self) -> Result<(), MarkingError>;
    /// Number of write transactions so far (for tests and metrics).
    fn transactions(&self) -> u64;
}

/// nftables through the `nft` binary, in a given namespace.
#[derive(Debug)]
pub struct NftMarking {
    netns: Netns,
    table: Option<String>,
    transactions: u64,
    reads: u64,
    /// Netlink socket in the namespace for the generation id.
    gen_sock: Option<rtnetlink::sys::Socket>,
    gen_seq: u32,
    /// What our table holds, valid while the ruleset generation is still `.0`.
    cache: Option<(u32, TableState)>,
    /// The last spec and its rendering (pure: independent of the kernel).
    render: Option<incremental::RenderCache>,
}

impl NftMarking {
    /// An adapter for `netns`.
    #[must_use]
    pub fn new(netns: Netns) -> Self {
        Self {
            netns,
            table: None,
            transactions: 0,
            reads: 0,
            gen_sock: None,
            gen_seq: 0,
            cache: None,
            render: None,
        }
    }

    /// Number of full table listings (`nft -j list table`) so far: a steady-state
    /// apply needs none.
    #[must_use]
    pub fn reads(&self) -> u64 {
        self.reads
    }

    /// The current ruleset generation, `None` if it cannot be read (then every apply
    /// lists the table, which is correct, only slower).
    fn generation(&mut self) -> Option<u32> {
        if self.gen_sock.is_none() {
            let thread = crate::netns::NetnsThread::spawn(&self.netns).ok()?;
            self.gen_sock = thread.run(crate::nfnl::open).ok()?.ok();
        }
        self.gen_seq = self.gen_seq.wrapping_add(1);
        match crate::nfnl::generation(self.gen_sock.as_ref()?, self.gen_seq) {
            Ok(g) => Some(g),
            Err(e) => {
                tracing::debug!(error = %e, "cannot read nftables generation");
                self.gen_sock = None;
                None
            }
        }
    }

    fn nft(
        &self,
        args: &[&str],
        stdin: Option<&[u8]>,
        op: &'static str,
    ) -> Result<String, MarkingError> {
        let mut cmd = self.netns.command("nft");
        cmd.args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().map_err(MarkingError::Spawn)?;
        if let Some(input) = stdin {
            let mut pipe = child.stdin.take().ok_or_else(|| {
                MarkingError::Spawn(std::io::Error::other("nft stdin not captured"))
            })?;
            pipe.write_all(input).map_err(MarkingError::Spawn)?;
        }
        let out = child.wait_with_output().map_err(MarkingError::Spawn)?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(MarkingError::Nft {
                op,
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            })
        }
    }

    /// Lists our table; `Ok(None)` when it does not exist.
    fn list(&self, table: &str) -> Result<Option<String>, MarkingError> {
        match self.nft(&["-j", "list", "table", "inet", table], None, "list table") {
            Ok(s) => Ok(Some(s)),
            Err(MarkingError::Nft { stderr, .. })
                if stderr.contains("No such file or directory") =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    fn commit(&mut self, batch: &Nftables<'_>, op: &'static str) -> Result<(), MarkingError> {
        let json = serde_json::to_vec(batch).map_err(|e| MarkingError::Spawn(e.into()))?;
        self.nft(&["-j", "-f", "-"], Some(&json), op)?;
        self.transactions += 1;
        Ok(())
    }
}

impl Marking for NftMarking {
    fn apply(&mut self, spec: &MarkingSpec) -> Result<bool, MarkingError> {
        // Re-render incrementally when only a few prefixes changed since last time.
        let cache = match self
            .render
            .take()
            .and_then(|mut c| c.update(spec).then_some(c))
        {
            Some(c) => c,
            None => {
                spec.validate()?;
                incremental::RenderCache::new(spec)
            }
        };
        let result = self.apply_rendered(spec, cache.ruleset());
        self.render = Some(cache);
        result
    }

    /// Updates the remembered rendering by the delta alone and, while the kernel's
    /// table is known to be as we left it (no other transaction since ours), commits
    /// just the resulting element changes: time in proportion to the delta, whatever
    /// the size of the routed set. Otherwise (a set became empty or non-empty, or the
    /// table must be read) as [`Marking::apply`] with the changed spec. After a write
    /// error the delta still counts as desired: the next apply or delta writes it.
    fn apply_delta(&mut self, delta: &PrefixDelta) -> Result<bool, MarkingError> {
        let mut cache = self.render.take().ok_or(MarkingError::NotApplied)?;
        if delta.is_empty() {
            self.render = Some(cache);
            return Ok(false);
        }
        let result = match cache.apply_delta(delta) {
            Ok(changes) => self.write_changes(&cache, &changes),
            Err(e) => Err(e.into()),
        };
        self.render = Some(cache);
        result
    }

    fn observe(&mut self) -> Result<MarkingStatus, MarkingError> {
        let Some(table) = self.table.clone() else {
            return Ok(MarkingStatus::default());
        };
        let Some(json) = self.list(&table)? else {
            return Ok(MarkingStatus::default());
        };
        let st = parse_table(&json).unwrap_or_default();
        Ok(MarkingStatus {
            present: true,
            elements: st
                .sets
                .iter()
                .map(|s| (s.0.clone(), s.3.as_ref().map_or(0, BTreeSet::len)))
                .collect(),
            counters: st.counters,
        })
    }

    fn teardown(&mut self) -> Result<(), MarkingError> {
        self.cache = None;
        if let Some(t) = self.table.take() {
            self.remove_table(&t)?;
        }
        Ok(())
    }

    fn transactions(&self) -> u64 {
        self.transactions
    }
}

impl NftMarking {
    /// Makes the kernel hold `cache`'s rendering after `changes` brought it there:
    /// just the element changes when the remembered table state is still valid and
    /// the rules stay, else the full comparison of [`NftMarking::apply_rendered`].
    fn write_changes(
        &mut self,
        cache: &incremental::RenderCache,
        changes: &incremental::SetChanges,
    ) -> Result<bool, MarkingError> {
        let spec = cache.fields();
        if !changes.rules_changed && self.table.as_deref() == Some(spec.table.as_str()) {
            let gen_before = self.generation();
            match (self.cache.take(), gen_before) {
                (Some((g, mut st)), Some(now)) if g == now => {
                    if changes.diffs.is_empty() {
                        self.cache = Some((g, st));
                        return Ok(false);
                    }
                    let diffs = &changes.diffs;
                    let (add, del) = diffs
                        .iter()
                        .fold((0, 0), |(a, d), s| (a + s.add.len(), d + s.delete.len()));
                    tracing::debug!(table = %spec.table, add, delete = del, "updating set elements by a delta");
                    apply_diffs(&mut st, diffs);
                    if !self.commit_elements_netlink(&spec.table, diffs)? {
                        self.commit(&element_batch(&spec.table, diffs), "update set elements")?;
                    }
                    self.after_commit(gen_before, st);
                    return Ok(true);
                }
                _ => {}
            }
        }
        self.apply_rendered(spec, cache.ruleset())
    }

    /// Makes the kernel hold `rs` (rendered from `spec`) with the least change.
    fn apply_rendered(&mut self, spec: &MarkingSpec, rs: &Ruleset) -> Result<bool, MarkingError> {
        // A renamed table: the old one is ours too and goes first (own transaction; if
        // the rest fails the mesh is unmarked, which a retry repairs).
        if let Some(old) = self.table.clone().filter(|t| *t != spec.table) {
            self.remove_table(&old)?;
        }
        self.table = Some(spec.table.clone());
        // Trust the cache only if no transaction at all happened since our last one.
        let gen_before = self.generation();
        let cached = match (self.cache.take(), gen_before) {
            (Some((g, st)), Some(now)) if g == now => Some(st),
            _ => None,
        };
        let current = match cached {
            Some(st) => Some(st),
            None => {
                self.reads += 1;
                match self.list(&spec.table)?.map(|j| parse_table(&j)) {
                    None => None,
                    Some(None) => {
                        tracing::warn!(table = %spec.table, "nftables table unreadable, replacing it");
                        None
                    }
                    Some(Some(st)) => Some(st),
                }
            }
        };
        let (batch, op, next) = match plan(rs, current.as_ref()) {
            Plan::Nothing => {
                if let (Some(g), Some(st)) = (gen_before, current) {
                    self.cache = Some((g, st));
                }
                return Ok(false);
            }
            Plan::Elements(diffs) => {
                let (add, del) = diffs
                    .iter()
                    .fold((0, 0), |(a, d), s| (a + s.add.len(), d + s.delete.len()));
                tracing::debug!(table = %spec.table, add, delete = del, "updating set elements");
                // What the table holds after this transaction, without re-deriving it
                // from every element.
                let next = match current {
                    Some(mut st) => {
                        apply_diffs(&mut st, &diffs);
                        st
                    }
                    None => expected_state(rs),
                };
                if self.commit_elements_netlink(&spec.table, &diffs)? {
                    self.after_commit(gen_before, next);
                    return Ok(true);
                }
                (
                    element_batch(&spec.table, &diffs),
                    "update set elements",
                    next,
                )
            }
            Plan::Rebuild => {
                if current.is_some() {
                    tracing::info!(table = %spec.table, "nftables table differs from desired, replacing it");
                }
                (full_batch(rs), "replace table", expected_state(rs))
            }
        };
        self.commit(&batch, op)?;
        self.after_commit(gen_before, next);
        Ok(true)
    }
}

impl NftMarking {
    /// Our transaction is exactly one generation; anything more means someone else
    /// committed too, and the next apply reads the table again.
    fn after_commit(&mut self, gen_before: Option<u32>, state: TableState) {
        if let (Some(before), Some(after)) = (gen_before, self.generation()) {
            if after == before.wrapping_add(1) {
                self.cache = Some((after, state));
            }
        }
    }

    /// Commits small element changes straight over netlink (one round trip, whatever
    /// the set sizes). `Ok(false)`: not attempted (too big, or no netlink socket), the
    /// caller goes through `nft`.
    fn commit_elements_netlink(
        &mut self,
        table: &str,
        diffs: &[SetDiff],
    ) -> Result<bool, MarkingError> {
        self.cache = None;
        let changes: Vec<crate::nfnl::SetChange<'_>> = diffs
            .iter()
            .map(|d| crate::nfnl::SetChange {
                set: d.name,
                interval: d.interval,
                add: &d.add,
                delete: &d.delete,
            })
            .collect();
        if crate::nfnl::entry_count(&changes) > crate::nfnl::MAX_BATCH_ENTRIES {
            return Ok(false);
        }
        let Some(sock) = self.gen_sock.as_ref() else {
            return Ok(false);
        };
        let (batch, acks) = crate::nfnl::element_batch(table, &changes, &mut self.gen_seq);
        let started = std::time::Instant::now();
        match crate::nfnl::commit(sock, &batch, &acks) {
            Ok(()) => {
                tracing::debug!(table, bytes = batch.len(), elapsed = ?started.elapsed(), "element batch committed over netlink");
                self.transactions += 1;
                Ok(true)
            }
            Err(crate::nfnl::BatchError::Refused(errno)) => Err(MarkingError::Nft {
                op: "update set elements",
                stderr: format!(
                    "kernel refused the element batch: {}",
                    std::io::Error::from_raw_os_error(errno)
                ),
            }),
            Err(crate::nfnl::BatchError::Io(e)) => {
                // Outcome unknown: the next apply re-reads the table and re-plans.
                self.gen_sock = None;
                Err(MarkingError::Netlink(e))
            }
        }
    }

    /// Deletes table `name` in our namespace if it exists; forgets nothing else.
    ///
    /// # Errors
    /// nft failure.
    pub fn remove_table(&mut self, name: &str) -> Result<(), MarkingError> {
        let batch = Nftables {
            objects: Cow::Owned(vec![
                NfObject::CmdObject(NfCmd::Add(table_object(name))),
                NfObject::CmdObject(NfCmd::Delete(table_object(name))),
            ]),
        };
        self.commit(&batch, "delete table")
    }

    /// Removes the table `spec` names even if this adapter did not create it in this
    /// process (cleanup after a restart).
    ///
    /// # Errors
    /// nft failure.
    pub fn teardown_table(&mut self, table: &str) -> Result<(), MarkingError> {
        self.table = None;
        self.cache = None;
        self.remove_table(table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delta_reuses_removed_positions_and_names_what_is_missing() {
        let p = |s: &str| s.parse::<IpNet>().unwrap();
        let spec = MarkingSpec {
            prefixes_v4: vec![p("10.0.0.1/32"), p("10.1.0.0/24"), p("10.0.0.1/32")],
            prefixes_v6: vec![p("fd00::1/128")],
            ..MarkingSpec::default()
        };
        let delta = PrefixDelta {
            remove: vec![p("10.1.0.0/24"), p("10.0.0.1/32"), p("fd00::1/128")],
            add: vec![p("10.9.0.0/16")],
        };
        let out = delta.applied_to(&spec).unwrap();
        // One occurrence of the duplicate stays; the /16 takes a freed position.
        let mut v4 = out.prefixes_v4.clone();
        v4.sort();
        assert_eq!(v4, vec![p("10.0.0.1/32"), p("10.9.0.0/16")]);
        assert!(out.prefixes_v6.is_empty());
        let missing = PrefixDelta {
            remove: vec![p("10.1.0.0/24"), p("10.1.0.0/24")],
            add: vec![],
        };
        assert_eq!(missing.applied_to(&spec).unwrap_err().field, "remove[1]");
        let host_bits = PrefixDelta {
            remove: vec![],
            add: vec![p("10.1.0.1/24")],
        };
        assert_eq!(host_bits.applied_to(&spec).unwrap_err().field, "add[0]");
    }

    fn spec(v4: &[&str], v6: &[&str]) -> MarkingSpec {
        MarkingSpec {
            prefixes_v4: v4.iter().map(|p| p.parse().unwrap()).collect(),
            prefixes_v6: v6.iter().map(|p| p.parse().unwrap()).collect(),
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
    fn validation_names_the_field() {
        let mut s = spec(&["10.0.0.0/8", "2001:db8::/32"], &[]);
        let e = s.validate().unwrap_err();
        assert_eq!(e.field, "prefixes_v4[1]");
        s = spec(&["10.0.0.1/8"], &[]);
        assert_eq!(s.validate().unwrap_err().field, "prefixes_v4[0]");
        s = spec(&[], &[]);
        s.mtu = 1279;
        assert_eq!(s.validate().unwrap_err().field, "mtu");
        s.mtu = 1420;
        s.mark = 0x80;
        assert_eq!(s.validate().unwrap_err().field, "mark");
        s.mark = 0x40;
        s.table = "bad name".into();
        assert_eq!(s.validate().unwrap_err().field, "table");
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
        assert!(objs.iter().any(
            |o| o["add"]["set"]["elem"] == json!([{"prefix": {"addr": "10.1.0.0", "len": 16}}])
        ));
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
}
