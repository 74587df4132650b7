//! Re-rendering the marking table after a few prefixes changed, in time proportional
//! to the change rather than to the whole routed set.
//!
//! The adapter is given the complete desired state every time. When a spec differs
//! from the remembered one only in a few positions of its prefix lists (the steady
//! state: one peer joined, left or changed), the sets are updated from per-set counts
//! of the input prefixes instead of partitioning and sorting everything again. Interval
//! sets stay normalised (no prefix inside another): a region is recomputed only under
//! a changed prefix that no unchanged prefix covers. Anything else (other fields
//! changed, lists of other lengths, many changes) falls back to a full
//! [`render()`]; a set becoming empty or non-empty re-renders the chains only.
//!
//! A [`PrefixDelta`] (the routed set's change itself, not the next whole spec) goes
//! the same way without comparing the lists at all: the cost is the delta's.

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;

use super::{
    render,
    ruleset::{length_set_index, render_chains, Family},
    AppliedSpec, MarkingSpec, PrefixDelta, Ruleset, SetDiff, SetLayout,
};
use crate::error::Invalid;

/// More changed positions than this: render in full.
const MAX_CHANGES: usize = 64;

/// A rendered spec and the input counts behind each of its sets.
#[derive(Debug)]
pub(super) struct RenderCache {
    spec: AppliedSpec,
    rs: Ruleset,
    /// Per set of `rs.sets` (same order): how often each input prefix occurs.
    counts: Vec<BTreeMap<IpNet, u32>>,
}

/// What an incremental update changed in the rendering.
#[derive(Debug, Default)]
pub(super) struct SetChanges {
    /// Element changes per set (only sets that changed).
    pub diffs: Vec<SetDiff>,
    /// A set became empty or non-empty: the chains were re-rendered.
    pub rules_changed: bool,
}

/// The index in `rs.sets` of the set prefix `p` belongs to (sets are v4 then v6;
/// split: hosts then nets).
fn set_index(layout: SetLayout, p: &IpNet) -> usize {
    let v6 = usize::from(matches!(p, IpNet::V6(_)));
    match layout {
        SetLayout::Split => 2 * v6 + usize::from(p.prefix_len() != p.max_prefix_len()),
        SetLayout::Interval => v6,
        SetLayout::PerLength => {
            let family = if v6 == 1 { Family::V6 } else { Family::V4 };
            length_set_index(family, p.prefix_len())
        }
    }
}

/// The last prefix inside `p` in `IpNet` order: its broadcast address as a host.
fn end_of(p: &IpNet) -> IpNet {
    IpNet::new(p.broadcast(), p.max_prefix_len()).unwrap_or(*p)
}

/// Whether only the prefixes differ, and the lists have the same lengths.
fn same_shape(a: &AppliedSpec, b: &MarkingSpec) -> bool {
    let (f, p) = (a.fields(), a.prefixes());
    f.table == b.table
        && f.device_mark == b.device_mark
        && f.mark == b.mark
        && f.mask == b.mask
        && f.mtu == b.mtu
        && f.layout == b.layout
        && f.prerouting == b.prerouting
        && p.v4().len() == b.prefixes_v4.len()
        && p.v6().len() == b.prefixes_v6.len()
}

impl RenderCache {
    /// Renders `spec` (validated by the caller) in full and remembers it.
    pub(super) fn new(spec: &MarkingSpec) -> Self {
        let rs = render(spec);
        let mut counts = vec![BTreeMap::new(); rs.sets.len()];
        for p in spec.prefixes_v4.iter().chain(&spec.prefixes_v6) {
            *counts[set_index(spec.layout, p)].entry(*p).or_insert(0) += 1;
        }
        Self {
            spec: AppliedSpec::new(spec.clone()),
            rs,
            counts,
        }
    }

    /// The remembered spec's fields other than its prefixes.
    pub(super) fn fields(&self) -> &MarkingSpec {
        self.spec.fields()
    }

    /// The remembered spec, whole (copies the prefix lists).
    #[cfg(test)]
    pub(super) fn spec(&self) -> MarkingSpec {
        self.spec.to_spec()
    }

    /// The remembered rendering.
    pub(super) fn ruleset(&self) -> &Ruleset {
        &self.rs
    }

    /// Brings the rendering to `spec` incrementally. `false`: not possible (the cache is
    /// unchanged; build a new one). The changed prefixes must be valid (the caller
    /// checks them, see [`RenderCache::changes`]).
    pub(super) fn update(&mut self, spec: &MarkingSpec) -> bool {
        let Some(changes) = self.changes(spec) else {
            return false;
        };
        if changes.is_empty() {
            return true;
        }
        let removed: Vec<IpNet> = changes.iter().map(|c| c.2).collect();
        let added: Vec<IpNet> = changes.iter().map(|c| c.3).collect();
        self.change_sets(&removed, &added);
        for (list, at, _, new) in changes {
            self.spec.prefixes_mut().set(list, at, new);
        }
        true
    }

    /// Applies `delta` to the remembered spec and its rendering, in time proportional
    /// to the delta (plus moving set elements in memory).
    ///
    /// # Errors
    /// The delta does not fit the remembered spec (see
    /// [`PrefixLists::check`](crate::markspec::PrefixLists::check)); nothing changes then.
    pub(super) fn apply_delta(&mut self, delta: &PrefixDelta) -> Result<SetChanges, Invalid> {
        self.spec.apply_delta(delta)?;
        Ok(self.change_sets(&delta.remove, &delta.add))
    }

    /// Takes one occurrence of each of `removed` (present) out of the counts and puts
    /// one of each of `added` (valid) in, and updates the sets to match: per set, the
    /// element changes. Interval sets stay normalised: a region is recomputed only
    /// under a changed prefix that no unchanged prefix covers.
    fn change_sets(&mut self, removed: &[IpNet], added: &[IpNet]) -> SetChanges {
        let layout = self.spec.fields().layout;
        // Count changes; remember the prefixes whose presence may have flipped.
        let mut touched: Vec<BTreeSet<IpNet>> = vec![BTreeSet::new(); self.counts.len()];
        for old in removed {
            let i = set_index(layout, old);
            if let Some(c) = self.counts[i].get_mut(old) {
                *c -= 1;
                if *c == 0 {
                    self.counts[i].remove(old);
                }
            }
            touched[i].insert(*old);
        }
        for new in added {
            let j = set_index(layout, new);
            *self.counts[j].entry(*new).or_insert(0) += 1;
            touched[j].insert(*new);
        }
        let mut out = SetChanges::default();
        for (i, touched) in touched.iter().enumerate() {
            if touched.is_empty() {
                continue;
            }
            let set = &mut self.rs.sets[i];
            let counts = &self.counts[i];
            let was_empty = set.elements.is_empty();
            let (mut add, mut del) = (Vec::new(), Vec::new());
            for p in touched {
                if !set.interval {
                    let now = counts.contains_key(p);
                    let before = set.elements.binary_search(p).is_ok();
                    if now && !before {
                        add.push(*p);
                    } else if before && !now {
                        del.push(*p);
                    }
                    continue;
                }
                // Under a touched or a present (hence unchanged) strict ancestor,
                // nothing at or below `p` is top-level, before or after.
                let covered = (0..p.prefix_len()).any(|len| {
                    IpNet::new(p.addr(), len).is_ok_and(|a| {
                        let a = a.trunc();
                        touched.contains(&a) || counts.contains_key(&a)
                    })
                });
                if covered {
                    continue;
                }
                let end = end_of(p);
                let lo = set.elements.partition_point(|e| e < p);
                let hi = set.elements.partition_point(|e| *e <= end);
                let before = &set.elements[lo..hi];
                let mut after: Vec<IpNet> = Vec::new();
                for q in counts.range(*p..=end).map(|(q, _)| *q) {
                    if after.last().is_none_or(|top: &IpNet| !top.contains(&q)) {
                        after.push(q);
                    }
                }
                del.extend(before.iter().filter(|e| after.binary_search(e).is_err()));
                add.extend(after.iter().filter(|e| before.binary_search(e).is_err()));
            }
            for p in &del {
                if let Ok(k) = set.elements.binary_search(p) {
                    set.elements.remove(k);
                }
            }
            for p in &add {
                if let Err(k) = set.elements.binary_search(p) {
                    set.elements.insert(k, *p);
                }
            }
            // The rules depend on which sets are empty.
            out.rules_changed |= set.elements.is_empty() != was_empty;
            if !add.is_empty() || !del.is_empty() {
                add.sort_unstable();
                del.sort_unstable();
                out.diffs.push(SetDiff {
                    name: set.name,
                    interval: set.interval,
                    add,
                    delete: del,
                });
            }
        }
        if out.rules_changed {
            self.rs.chains = render_chains(self.spec.fields(), &self.rs.sets);
        }
        out
    }

    /// The (list, position, old, new) of the positions where `spec`'s prefixes differ
    /// from the remembered ones (list 0: IPv4, 1: IPv6); `None` when more than the
    /// prefix lists differ, too much did, or a changed prefix is invalid (the caller's
    /// full validation then names it).
    pub(super) fn changes(&self, spec: &MarkingSpec) -> Option<Vec<(usize, usize, IpNet, IpNet)>> {
        if !same_shape(&self.spec, spec) {
            return None;
        }
        let mut out = Vec::new();
        let have = self.spec.prefixes();
        let v4 = have.v4().iter().zip(&spec.prefixes_v4).enumerate();
        let v6 = have.v6().iter().zip(&spec.prefixes_v6).enumerate();
        let all = v4
            .map(|(at, (o, n))| (0, at, *o, *n))
            .chain(v6.map(|(at, (o, n))| (1, at, *o, *n)));
        for (list, at, old, new) in all {
            if old == new {
                continue;
            }
            let valid = matches!(new, IpNet::V6(_)) == (list == 1) && new.trunc() == new;
            if !valid || out.len() == MAX_CHANGES {
                return None;
            }
            out.push((list, at, old, new));
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64*: deterministic, no dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: usize) -> usize {
            usize::try_from(self.next() % n as u64).unwrap_or(0)
        }
    }

    /// A small universe where prefixes nest, touch and repeat often.
    fn prefix(r: &mut Rng, v6: bool) -> IpNet {
        let lens: &[u8] = if v6 {
            &[32, 48, 56, 64, 120, 128]
        } else {
            &[8, 16, 24, 25, 26, 30, 32]
        };
        let len = lens[r.below(lens.len())];
        let p = if v6 {
            let a =
                0xfd00_u128 << 112 | u128::from(r.next() as u8) << 64 | u128::from(r.next() as u8);
            IpNet::new(std::net::Ipv6Addr::from(a).into(), len)
        } else {
            let a =
                0x0a00_0000_u32 | u32::from(r.next() as u8) << 8 | u32::from(r.next() as u8 & 0xc3);
            IpNet::new(std::net::Ipv4Addr::from(a).into(), len)
        };
        p.unwrap().trunc()
    }

    #[test]
    fn incremental_rendering_equals_full_rendering() {
        for layout in [SetLayout::Split, SetLayout::Interval, SetLayout::PerLength] {
            let mut r = Rng(0x9e37_79b9_7f4a_7c15);
            let (mut incremental, mut steps) = (0, 0);
            // The per-length layout has many more rules to render (slow in debug).
            let rounds = if layout == SetLayout::PerLength {
                12
            } else {
                40
            };
            for _round in 0..rounds {
                let mut spec = MarkingSpec {
                    layout,
                    prefixes_v4: (0..30).map(|_| prefix(&mut r, false)).collect(),
                    prefixes_v6: (0..30).map(|_| prefix(&mut r, true)).collect(),
                    ..MarkingSpec::default()
                };
                let mut cache = RenderCache::new(&spec);
                for _step in 0..30 {
                    for _ in 0..=r.below(3) {
                        let v6 = r.below(2) == 1;
                        let list = if v6 {
                            &mut spec.prefixes_v6
                        } else {
                            &mut spec.prefixes_v4
                        };
                        let i = r.below(list.len());
                        // Sometimes a duplicate of another position.
                        list[i] = if r.below(4) == 0 {
                            list[r.below(list.len())]
                        } else {
                            prefix(&mut r, v6)
                        };
                    }
                    steps += 1;
                    if cache.update(&spec) {
                        incremental += 1;
                    } else {
                        cache = RenderCache::new(&spec);
                    }
                    assert_eq!(cache.ruleset(), &render(&spec), "{layout:?}");
                }
            }
            // The comparison above must mostly be of the incremental path.
            assert!(
                incremental * 10 > steps * 9,
                "{layout:?}: {incremental}/{steps}"
            );
        }
    }

    fn sorted(mut v: Vec<IpNet>) -> Vec<IpNet> {
        v.sort_unstable();
        v
    }

    #[test]
    fn rendering_by_deltas_equals_full_rendering() {
        for layout in [SetLayout::Split, SetLayout::Interval, SetLayout::PerLength] {
            let mut r = Rng(0x0123_4567_89ab_cdef);
            let (mut steps, mut flips) = (0, 0);
            for _round in 0..25 {
                // Small lists now and then, so sets become empty and non-empty.
                let n = if r.below(3) == 0 { 2 } else { 30 };
                let mut spec = MarkingSpec {
                    layout,
                    prefixes_v4: (0..n).map(|_| prefix(&mut r, false)).collect(),
                    prefixes_v6: (0..n).map(|_| prefix(&mut r, true)).collect(),
                    ..MarkingSpec::default()
                };
                let mut cache = RenderCache::new(&spec);
                for _step in 0..30 {
                    let mut delta = PrefixDelta::default();
                    let mut left: Vec<IpNet> = spec
                        .prefixes_v4
                        .iter()
                        .chain(&spec.prefixes_v6)
                        .copied()
                        .collect();
                    for _ in 0..r.below(4) {
                        if !left.is_empty() {
                            delta.remove.push(left.swap_remove(r.below(left.len())));
                        }
                    }
                    for _ in 0..r.below(4) {
                        // Sometimes a duplicate of a present prefix.
                        let v6 = r.below(2) == 1;
                        let list = if v6 {
                            &spec.prefixes_v6
                        } else {
                            &spec.prefixes_v4
                        };
                        delta.add.push(if r.below(4) == 0 && !list.is_empty() {
                            list[r.below(list.len())]
                        } else {
                            prefix(&mut r, v6)
                        });
                    }
                    let before = cache.ruleset().clone();
                    let changes = cache.apply_delta(&delta).unwrap();
                    spec = delta.applied_to(&spec).unwrap();
                    steps += 1;
                    let want = render(&spec);
                    assert_eq!(cache.ruleset(), &want, "{layout:?}");
                    let got = cache.spec();
                    assert_eq!(sorted(got.prefixes_v4), sorted(spec.prefixes_v4.clone()));
                    assert_eq!(sorted(got.prefixes_v6), sorted(spec.prefixes_v6.clone()));
                    // The diffs are exactly what turns the old sets into the new ones.
                    for (old, new) in before.sets.iter().zip(&want.sets) {
                        let diff = changes.diffs.iter().find(|d| d.name == old.name);
                        let mut elems: BTreeSet<IpNet> = old.elements.iter().copied().collect();
                        if let Some(d) = diff {
                            for p in &d.delete {
                                assert!(elems.remove(p), "{layout:?} {p} deleted but absent");
                            }
                            for p in &d.add {
                                assert!(elems.insert(*p), "{layout:?} {p} added but present");
                            }
                        }
                        assert_eq!(elems.into_iter().collect::<Vec<_>>(), new.elements);
                    }
                    let flipped = before
                        .sets
                        .iter()
                        .zip(&want.sets)
                        .any(|(a, b)| a.elements.is_empty() != b.elements.is_empty());
                    assert_eq!(changes.rules_changed, flipped, "{layout:?}");
                    flips += usize::from(flipped);
                }
            }
            // Both kinds of step were exercised.
            assert!(flips > 0 && flips < steps, "{layout:?}: {flips}/{steps}");
        }
    }

    #[test]
    fn an_invalid_delta_leaves_the_rendering_as_it_was() {
        let p = |s: &str| s.parse::<IpNet>().unwrap();
        let spec = MarkingSpec {
            prefixes_v4: vec![p("10.0.0.1/32"), p("10.1.0.0/24")],
            ..MarkingSpec::default()
        };
        let mut cache = RenderCache::new(&spec);
        let bad = PrefixDelta {
            remove: vec![p("10.1.0.0/24"), p("10.9.0.0/24")],
            add: vec![p("10.2.0.0/24")],
        };
        assert_eq!(cache.apply_delta(&bad).unwrap_err().field, "remove[1]");
        assert_eq!(cache.ruleset(), &render(&spec));
        assert_eq!(cache.spec(), spec);
    }

    #[test]
    fn removing_a_covering_prefix_uncovers_what_it_hid() {
        let p = |s: &str| s.parse::<IpNet>().unwrap();
        let mut spec = MarkingSpec {
            prefixes_v4: vec![
                p("10.0.0.0/8"),
                p("10.1.0.0/16"),
                p("10.1.2.0/24"),
                p("10.2.0.0/16"),
            ],
            layout: SetLayout::Split,
            ..MarkingSpec::default()
        };
        let mut cache = RenderCache::new(&spec);
        spec.prefixes_v4[0] = p("192.168.0.0/16");
        assert!(cache.update(&spec));
        let nets = &cache.ruleset().sets[1];
        assert_eq!(nets.name, "v4_nets");
        assert_eq!(
            nets.elements,
            vec![p("10.1.0.0/16"), p("10.2.0.0/16"), p("192.168.0.0/16")]
        );
        // Too many or other changes: not incremental.
        spec.mtu = 1400;
        assert!(cache.changes(&spec).is_none());
    }
}
