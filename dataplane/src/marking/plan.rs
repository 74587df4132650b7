//! The planner (pure): what an apply writes to bring the table the kernel holds to
//! the rendered one — nothing, set elements only, or the whole table — and the table
//! state expected after it.

use std::collections::BTreeSet;

use ipnet::IpNet;
use nftables::types::NfChainPolicy;

use super::{
    listing::TableState,
    ruleset::{ChainDef, Ruleset},
};

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
pub(super) fn apply_diffs(st: &mut TableState, diffs: &[SetDiff]) {
    for d in diffs {
        if let Some((_, _, _, Some(elems))) = st.sets.iter_mut().find(|s| s.0 == d.name) {
            for p in &d.delete {
                elems.remove(p);
            }
            elems.extend(d.add.iter().copied());
        }
    }
}

/// How [`parse_table`](super::parse_table) reports a chain that holds exactly `c`.
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

/// The state [`parse_table`](super::parse_table) would report for a table that holds exactly `rs`.
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
