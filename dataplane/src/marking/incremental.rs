//! Re-rendering the marking table after a few prefixes changed, in time proportional
//! to the change rather than to the whole routed set.
//!
//! The adapter is given the complete desired state every time. When a spec differs
//! from the remembered one only in a few positions of its prefix lists (the steady
//! state: one peer joined, left or changed), the sets are updated from per-set counts
//! of the input prefixes instead of partitioning and sorting everything again. Interval
//! sets stay normalised (no prefix inside another): a region is recomputed only under
//! a changed prefix that no unchanged prefix covers. Anything else (other fields
//! changed, lists of other lengths, many changes, a set becoming empty or non-empty,
//! which changes the rules) falls back to a full [`super::render`].

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;

use super::{render, MarkingSpec, Ruleset, SetLayout};

/// More changed positions than this: render in full.
const MAX_CHANGES: usize = 64;

/// A rendered spec and the input counts behind each of its sets.
#[derive(Debug)]
pub(super) struct RenderCache {
    spec: MarkingSpec,
    rs: Ruleset,
    /// Per set of `rs.sets` (same order): how often each input prefix occurs.
    counts: Vec<BTreeMap<IpNet, u32>>,
}

/// The index in `rs.sets` of the set prefix `p` belongs to (sets are v4 then v6;
/// split: hosts then nets).
fn set_index(layout: SetLayout, p: &IpNet) -> usize {
    let v6 = usize::from(matches!(p, IpNet::V6(_)));
    match layout {
        SetLayout::Split => 2 * v6 + usize::from(p.prefix_len() != p.max_prefix_len()),
        SetLayout::Interval => v6,
    }
}

/// The last prefix inside `p` in `IpNet` order: its broadcast address as a host.
fn end_of(p: &IpNet) -> IpNet {
    IpNet::new(p.broadcast(), p.max_prefix_len()).unwrap_or(*p)
}

/// Whether only the prefix lists differ.
fn same_shape(a: &MarkingSpec, b: &MarkingSpec) -> bool {
    a.table == b.table
        && a.device_mark == b.device_mark
        && a.mark == b.mark
        && a.mask == b.mask
        && a.mtu == b.mtu
        && a.layout == b.layout
        && a.prerouting == b.prerouting
        && a.prefixes_v4.len() == b.prefixes_v4.len()
        && a.prefixes_v6.len() == b.prefixes_v6.len()
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
            spec: spec.clone(),
            rs,
            counts,
        }
    }

    /// The remembered spec.
    pub(super) fn spec(&self) -> &MarkingSpec {
        &self.spec
    }

    /// The remembered rendering.
    pub(super) fn ruleset(&self) -> &Ruleset {
        &self.rs
    }

    /// Brings the rendering to `spec` incrementally. `false`: not possible (the cache is
    /// then unusable; build a new one). The changed prefixes must be valid (the caller
    /// checks them, see [`RenderCache::changes`]).
    pub(super) fn update(&mut self, spec: &MarkingSpec) -> bool {
        let Some(changes) = self.changes(spec) else {
            return false;
        };
        if changes.is_empty() {
            return true;
        }
        let layout = spec.layout;
        // Count changes; remember the prefixes whose presence may have flipped.
        let mut touched: Vec<BTreeSet<IpNet>> = vec![BTreeSet::new(); self.counts.len()];
        for (old, new) in &changes {
            let i = set_index(layout, old);
            if let Some(c) = self.counts[i].get_mut(old) {
                *c -= 1;
                if *c == 0 {
                    self.counts[i].remove(old);
                }
            }
            touched[i].insert(*old);
            let j = set_index(layout, new);
            *self.counts[j].entry(*new).or_insert(0) += 1;
            touched[j].insert(*new);
        }
        for (i, touched) in touched.iter().enumerate() {
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
            for p in add {
                if let Err(k) = set.elements.binary_search(&p) {
                    set.elements.insert(k, p);
                }
            }
            if set.elements.is_empty() != was_empty {
                // The rules depend on which sets are empty.
                return false;
            }
        }
        for (old, new) in self
            .spec
            .prefixes_v4
            .iter_mut()
            .zip(&spec.prefixes_v4)
            .chain(self.spec.prefixes_v6.iter_mut().zip(&spec.prefixes_v6))
        {
            *old = *new;
        }
        true
    }

    /// The (old, new) prefix pairs at the positions where `spec` differs from the
    /// remembered one; `None` when more than the prefix lists differ, too much did, or
    /// a changed prefix is invalid (the caller's full validation then names it).
    pub(super) fn changes(&self, spec: &MarkingSpec) -> Option<Vec<(IpNet, IpNet)>> {
        if !same_shape(&self.spec, spec) {
            return None;
        }
        let mut out = Vec::new();
        let v4 = self.spec.prefixes_v4.iter().zip(&spec.prefixes_v4);
        let v6 = self.spec.prefixes_v6.iter().zip(&spec.prefixes_v6);
        let all = v4
            .map(|(o, n)| (*o, *n, false))
            .chain(v6.map(|(o, n)| (*o, *n, true)));
        for (old, new, v6) in all {
            if old == new {
                continue;
            }
            let valid = matches!(new, IpNet::V6(_)) == v6 && new.trunc() == new;
            if !valid || out.len() == MAX_CHANGES {
                return None;
            }
            out.push((old, new));
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
        for layout in [SetLayout::Split, SetLayout::Interval] {
            let mut r = Rng(0x9e37_79b9_7f4a_7c15);
            let (mut incremental, mut steps) = (0, 0);
            for _round in 0..40 {
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
