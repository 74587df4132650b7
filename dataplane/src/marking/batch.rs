//! The nftables JSON transactions (`nft -j -f -` input) that write our table: the
//! full replacement and the element-only update.

use std::{borrow::Cow, collections::HashSet};

use ipnet::IpNet;
use nftables::{
    expr::{Expression, NamedExpression},
    schema::{self, NfCmd, NfListObject, NfObject, Nftables, SetFlag, SetType, SetTypeValue},
    types::{NfChainPolicy, NfFamily},
};

use super::{
    plan::SetDiff,
    ruleset::{Family, Ruleset, SetDef},
};

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

pub(super) fn table_object(name: &str) -> NfListObject<'static> {
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
