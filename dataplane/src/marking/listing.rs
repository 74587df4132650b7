//! Reading our table back: `nft -j list table` output as a [`TableState`], the form
//! in which the planner compares it with the rendered table.

use std::{collections::BTreeSet, net::IpAddr};

use ipnet::IpNet;
use nftables::{
    expr::{Expression, NamedExpression},
    schema::{NfListObject, NfObject, Nftables, SetFlag, SetType, SetTypeValue},
    stmt::Statement,
};

use super::ruleset::Family;

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
                // A per-length set holds bare network addresses: the length is the
                // set's.
                let len = super::ruleset::length_of_set(&s.name)
                    .filter(|(f, _)| *f == family && !interval)
                    .map(|(_, l)| l);
                let elements = s
                    .elem
                    .as_deref()
                    .unwrap_or_default()
                    .iter()
                    .map(|e| match (parse_elem(e), len) {
                        (Some(p), Some(l)) if p.prefix_len() == p.max_prefix_len() => {
                            IpNet::new(p.addr(), l).ok()
                        }
                        (p, None) => p,
                        _ => None,
                    })
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
