//! The routed set as two prefix lists that take a [`PrefixDelta`] in time proportional
//! to the delta: a position index (built on the first delta, then kept up to date)
//! finds a removed prefix without scanning the list.
//!
//! An added prefix takes the position of a removed one of its family where it can, as
//! [`PrefixDelta::applied_to`] does, so a full spec compared position by position
//! afterwards differs in few places.

use std::collections::HashMap;

use ipnet::IpNet;

use super::{MarkingSpec, PrefixDelta};
use crate::error::Invalid;

/// Positions of one prefix in its list (almost always one).
#[derive(Debug, Clone)]
enum Slots {
    One(usize),
    Many(Vec<usize>),
}

type Index = HashMap<IpNet, Slots>;

fn index_of(list: &[IpNet]) -> Index {
    let mut index = Index::with_capacity(list.len());
    for (at, p) in list.iter().enumerate() {
        slot_add(&mut index, *p, at);
    }
    index
}

fn slot_add(index: &mut Index, p: IpNet, at: usize) {
    match index.get_mut(&p) {
        None => {
            index.insert(p, Slots::One(at));
        }
        Some(Slots::One(first)) => {
            let first = *first;
            index.insert(p, Slots::Many(vec![first, at]));
        }
        Some(Slots::Many(v)) => v.push(at),
    }
}

/// Removes position `at` of `p` (`None`: any position, returned).
fn slot_take(index: &mut Index, p: &IpNet, at: Option<usize>) -> Option<usize> {
    let taken = match index.get_mut(p)? {
        Slots::One(only) => {
            let only = *only;
            if at.is_some_and(|a| a != only) {
                return None;
            }
            index.remove(p);
            return Some(only);
        }
        Slots::Many(v) => {
            let k = match at {
                Some(a) => v.iter().position(|x| *x == a)?,
                None => v.len() - 1,
            };
            let taken = v.swap_remove(k);
            if v.len() == 1 {
                let last = v[0];
                index.insert(*p, Slots::One(last));
            }
            taken
        }
    };
    Some(taken)
}

fn count(index: &Index, p: &IpNet) -> usize {
    match index.get(p) {
        None => 0,
        Some(Slots::One(_)) => 1,
        Some(Slots::Many(v)) => v.len(),
    }
}

/// 0 for IPv4, 1 for IPv6.
fn family(p: &IpNet) -> usize {
    usize::from(matches!(p, IpNet::V6(_)))
}

/// The IPv4 and IPv6 prefix lists of a routed set (multisets: order carries no
/// meaning, duplicates do). A clone copies the lists, not the index (rebuilt on its
/// first delta): cloning stays a memory copy.
#[derive(Debug, Default)]
pub struct PrefixLists {
    lists: [Vec<IpNet>; 2],
    /// Per family: prefix -> its positions. Built on the first delta.
    index: Option<[Index; 2]>,
}

impl Clone for PrefixLists {
    fn clone(&self) -> Self {
        Self {
            lists: self.lists.clone(),
            index: None,
        }
    }
}

impl PrefixLists {
    /// Lists as given (the caller has validated them).
    #[must_use]
    pub fn new(v4: Vec<IpNet>, v6: Vec<IpNet>) -> Self {
        Self {
            lists: [v4, v6],
            index: None,
        }
    }

    /// The IPv4 list.
    #[must_use]
    pub fn v4(&self) -> &[IpNet] {
        &self.lists[0]
    }

    /// The IPv6 list.
    #[must_use]
    pub fn v6(&self) -> &[IpNet] {
        &self.lists[1]
    }

    /// Makes the lists equal `v4` and `v6` (validated by the caller). Lists of the
    /// same lengths are compared position by position and the index kept; others are
    /// copied and the index dropped.
    pub fn assign(&mut self, v4: &[IpNet], v6: &[IpNet]) {
        for (f, new) in [v4, v6].into_iter().enumerate() {
            if self.lists[f].len() != new.len() {
                self.lists[f].clear();
                self.lists[f].extend_from_slice(new);
                self.index = None;
                continue;
            }
            for (at, p) in new.iter().enumerate() {
                if self.lists[f][at] != *p {
                    self.set(f, at, *p);
                }
            }
        }
    }

    /// `self` (whose index may be built) brought to `other`'s lists, keeping the
    /// index where the lengths allow (see [`PrefixLists::assign`]).
    #[must_use]
    pub fn updated_to(mut self, other: &PrefixLists) -> Self {
        self.assign(other.v4(), other.v6());
        self
    }

    /// Puts `p` at position `at` of list `f` (0: IPv4, 1: IPv6).
    pub(crate) fn set(&mut self, f: usize, at: usize, p: IpNet) {
        let old = std::mem::replace(&mut self.lists[f][at], p);
        if let Some(index) = self.index.as_mut() {
            slot_take(&mut index[f], &old, Some(at));
            slot_add(&mut index[f], p, at);
        }
    }

    /// How often `p` occurs.
    fn count(&mut self, p: &IpNet) -> usize {
        count(&self.index_mut()[family(p)], p)
    }

    /// Builds the position index now if it is missing, so that the first delta after
    /// a whole apply does not pay for indexing every prefix (whole applies take time
    /// in proportion to the set anyway; a one-prefix delta should not).
    pub fn ensure_index(&mut self) {
        self.index_mut();
    }

    fn index_mut(&mut self) -> &mut [Index; 2] {
        let lists = &self.lists;
        self.index
            .get_or_insert_with(|| [index_of(&lists[0]), index_of(&lists[1])])
    }

    /// Checks `delta` against these lists without changing them: added prefixes
    /// valid, every removed occurrence present.
    ///
    /// # Errors
    /// The first offending entry (`add[i]` or `remove[i]`).
    pub fn check(&mut self, delta: &PrefixDelta) -> Result<(), Invalid> {
        delta.validate()?;
        let mut demand: HashMap<IpNet, usize> = HashMap::with_capacity(delta.remove.len());
        for (i, p) in delta.remove.iter().enumerate() {
            let wanted = demand.entry(*p).or_insert(0);
            *wanted += 1;
            let wanted = *wanted;
            if wanted > self.count(p) {
                return Err(Invalid::new(
                    format!("remove[{i}]"),
                    format!("{p} is not in the routed set"),
                ));
            }
        }
        Ok(())
    }

    /// Applies `delta`: each removed occurrence goes, each added one comes, taking a
    /// removed one's position in its family's list where it can. Time proportional
    /// to the delta (after the index is built once).
    ///
    /// # Errors
    /// As [`PrefixLists::check`]; nothing changes then.
    pub fn apply(&mut self, delta: &PrefixDelta) -> Result<(), Invalid> {
        self.check(delta)?;
        let Self { lists, index } = self;
        let index = index.get_or_insert_with(|| [index_of(&lists[0]), index_of(&lists[1])]);
        let mut free: [Vec<usize>; 2] = [Vec::new(), Vec::new()];
        for p in &delta.remove {
            let f = family(p);
            if let Some(at) = slot_take(&mut index[f], p, None) {
                free[f].push(at);
            }
        }
        for p in &delta.add {
            let f = family(p);
            let at = match free[f].pop() {
                Some(at) => {
                    lists[f][at] = *p;
                    at
                }
                None => {
                    lists[f].push(*p);
                    lists[f].len() - 1
                }
            };
            slot_add(&mut index[f], *p, at);
        }
        for (f, free) in free.iter_mut().enumerate() {
            // Highest position first: the last element is then never a freed one.
            free.sort_unstable();
            for &at in free.iter().rev() {
                let last = lists[f].len() - 1;
                if at != last {
                    let moved = lists[f][last];
                    slot_take(&mut index[f], &moved, Some(last));
                    slot_add(&mut index[f], moved, at);
                }
                lists[f].swap_remove(at);
            }
        }
        Ok(())
    }
}

/// A spec that takes [`PrefixDelta`]s in time proportional to the delta: its other
/// fields, and its prefix lists as [`PrefixLists`].
#[derive(Debug, Clone)]
pub struct AppliedSpec {
    /// The spec without its prefixes (both lists empty).
    fields: MarkingSpec,
    prefixes: PrefixLists,
}

impl AppliedSpec {
    /// Takes `spec` apart.
    #[must_use]
    pub fn new(mut spec: MarkingSpec) -> Self {
        let v4 = std::mem::take(&mut spec.prefixes_v4);
        let v6 = std::mem::take(&mut spec.prefixes_v6);
        let mut prefixes = PrefixLists::new(v4, v6);
        // A spec is remembered to take deltas: indexed now (see `ensure_index`).
        prefixes.ensure_index();
        Self {
            fields: spec,
            prefixes,
        }
    }

    /// Makes this `spec` (validated by the caller), keeping the position index where
    /// the list lengths allow (see [`PrefixLists::assign`]): after a whole apply with
    /// few prefixes changed, the next delta still takes time in proportion to it
    /// rather than re-indexing every prefix.
    pub fn assign(&mut self, mut spec: MarkingSpec) {
        let v4 = std::mem::take(&mut spec.prefixes_v4);
        let v6 = std::mem::take(&mut spec.prefixes_v6);
        self.prefixes.assign(&v4, &v6);
        self.prefixes.ensure_index();
        self.fields = spec;
    }

    /// The fields other than the prefix lists (which are empty here).
    #[must_use]
    pub fn fields(&self) -> &MarkingSpec {
        &self.fields
    }

    /// The prefix lists.
    #[must_use]
    pub fn prefixes(&self) -> &PrefixLists {
        &self.prefixes
    }

    /// The prefix lists, to change.
    pub(crate) fn prefixes_mut(&mut self) -> &mut PrefixLists {
        &mut self.prefixes
    }

    /// The whole spec (copies the lists).
    #[must_use]
    pub fn to_spec(&self) -> MarkingSpec {
        MarkingSpec {
            prefixes_v4: self.prefixes.v4().to_vec(),
            prefixes_v6: self.prefixes.v6().to_vec(),
            ..self.fields.clone()
        }
    }

    /// Checks `delta` without changing anything (see [`PrefixLists::check`]).
    ///
    /// # Errors
    /// The first offending entry of the delta.
    pub fn check_delta(&mut self, delta: &PrefixDelta) -> Result<(), Invalid> {
        self.prefixes.check(delta)
    }

    /// Applies `delta` to the prefix lists (see [`PrefixLists::apply`]).
    ///
    /// # Errors
    /// The first offending entry of the delta; nothing changes then.
    pub fn apply_delta(&mut self, delta: &PrefixDelta) -> Result<(), Invalid> {
        self.prefixes.apply(delta)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(mut v: Vec<IpNet>) -> Vec<IpNet> {
        v.sort_unstable();
        v
    }

    #[test]
    fn deltas_give_the_same_multiset_and_positions_as_applied_to() {
        let mut r = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move || {
            r ^= r << 13;
            r ^= r >> 7;
            r ^= r << 17;
            r
        };
        let mut spec = MarkingSpec::default();
        let pick = |x: u64| -> IpNet {
            if x.is_multiple_of(3) {
                IpNet::new(
                    std::net::Ipv6Addr::from(0xfd00_u128 << 112 | u128::from(x % 17)).into(),
                    128,
                )
                .unwrap()
            } else {
                IpNet::new(
                    std::net::Ipv4Addr::from(0x0a00_0000 | (x % 23) as u32).into(),
                    32,
                )
                .unwrap()
            }
        };
        let mut lists = PrefixLists::default();
        for round in 0..400 {
            let mut delta = PrefixDelta::default();
            let all: Vec<IpNet> = spec
                .prefixes_v4
                .iter()
                .chain(&spec.prefixes_v6)
                .copied()
                .collect();
            for _ in 0..next() % 4 {
                if !all.is_empty() {
                    let p = all[(next() % all.len() as u64) as usize];
                    if delta.remove.iter().filter(|q| **q == p).count()
                        < all.iter().filter(|q| **q == p).count()
                    {
                        delta.remove.push(p);
                    }
                }
            }
            for _ in 0..next() % 4 {
                delta.add.push(pick(next()));
            }
            let want = delta.applied_to(&spec).unwrap();
            lists.apply(&delta).unwrap();
            // The same multiset as `applied_to` (duplicates may sit elsewhere).
            assert_eq!(
                sorted(lists.v4().to_vec()),
                sorted(want.prefixes_v4.clone()),
                "{round}"
            );
            assert_eq!(
                sorted(lists.v6().to_vec()),
                sorted(want.prefixes_v6.clone()),
                "{round}"
            );
            // The index agrees with the lists.
            let fresh = PrefixLists::new(lists.v4().to_vec(), lists.v6().to_vec());
            for p in lists
                .v4()
                .iter()
                .chain(lists.v6())
                .copied()
                .collect::<Vec<_>>()
            {
                let mut f = fresh.clone();
                assert_eq!(lists.count(&p), f.count(&p), "{round} {p}");
            }
            spec = want;
            // Now and then a positional change (a full spec of the same lengths).
            if round % 5 == 0 && !lists.v4().is_empty() {
                let mut v4 = lists.v4().to_vec();
                v4[0] = pick(next() % 1_000 * 3 + 1);
                let v6 = lists.v6().to_vec();
                lists.assign(&v4, &v6);
                spec.prefixes_v4 = v4;
                spec.prefixes_v6 = v6;
            }
        }
    }

    #[test]
    fn an_invalid_delta_names_the_entry_and_changes_nothing() {
        let p = |s: &str| s.parse::<IpNet>().unwrap();
        let mut lists = PrefixLists::new(vec![p("10.0.0.1/32"), p("10.1.0.0/24")], vec![]);
        let missing = PrefixDelta {
            remove: vec![p("10.0.0.1/32"), p("10.0.0.1/32")],
            add: vec![p("10.2.0.0/24")],
        };
        assert_eq!(lists.apply(&missing).unwrap_err().field, "remove[1]");
        let host_bits = PrefixDelta {
            remove: vec![p("10.0.0.1/32")],
            add: vec![p("10.2.0.1/24")],
        };
        assert_eq!(lists.apply(&host_bits).unwrap_err().field, "add[0]");
        assert_eq!(lists.v4(), &[p("10.0.0.1/32"), p("10.1.0.0/24")]);
        // A valid one reuses the freed position.
        let ok = PrefixDelta {
            remove: vec![p("10.0.0.1/32")],
            add: vec![p("fd00::/64"), p("10.3.0.0/24")],
        };
        lists.apply(&ok).unwrap();
        assert_eq!(lists.v4(), &[p("10.3.0.0/24"), p("10.1.0.0/24")]);
        assert_eq!(lists.v6(), &[p("fd00::/64")]);
    }
}
