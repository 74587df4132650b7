//! The map contents a [`MarkingSpec`] asks for, kept incrementally (pure: no kernel).
//!
//! [`MapState`] remembers the prefix multiset of the last applied spec and the
//! per-bucket length counts derived from it. [`MapState::plan`] turns the next spec
//! into the smallest list of map writes: when the prefix lists have the same lengths
//! as before (the steady state: one peer's prefixes changed), only the changed
//! positions are looked at; otherwise the multisets are compared. Either way the kernel
//! sees writes only for prefixes that appeared or disappeared, and for the buckets and
//! global bitmaps whose set of lengths changed.

use std::collections::HashMap;

use ipnet::IpNet;

use super::keys::{self, Bits6, Config, Slot};
use crate::{
    error::Invalid,
    markspec::{MarkingSpec, PrefixDelta, PrefixLists},
};

/// Which lookup structures are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Structures {
    /// Prefix hash + bucket bitmaps.
    pub phash: bool,
    /// Exact hosts + LPM tries.
    pub lpm: bool,
}

/// Map writes that bring the kernel from one spec to the next. Apply in field order:
/// inserts, bitmaps, config, removals (a packet never sees a length bit whose entries
/// are half written; a prefix present before and after is never missing).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// Prefixes to insert (or rewrite, after a route-mark change), with the route mark.
    pub insert: Vec<IpNet>,
    /// IPv4 buckets whose bitmap changed: (bucket, bitmap).
    pub buckets_v4: Vec<(u32, u64)>,
    /// IPv6 buckets whose bitmap changed.
    pub buckets_v6: Vec<(u32, Bits6)>,
    /// The config entry, when it changed.
    pub config: Option<Config>,
    /// Prefixes to remove.
    pub remove: Vec<IpNet>,
    /// Route mark of the inserted entries.
    pub route_mark: u32,
}

impl Plan {
    /// Whether nothing needs writing.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.insert.is_empty()
            && self.remove.is_empty()
            && self.buckets_v4.is_empty()
            && self.buckets_v6.is_empty()
            && self.config.is_none()
    }
}

/// Entry counts per structure and family, for capacity checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Occupancy {
    /// Prefix-hash entries (IPv4, IPv6); `::/0` is a flag, not an entry.
    pub phash: (usize, usize),
    /// Exact hosts (IPv4, IPv6).
    pub hosts: (usize, usize),
    /// LPM trie entries (IPv4, IPv6).
    pub lpm: (usize, usize),
}

/// What the maps hold (as far as this process wrote them).
#[derive(Debug, Clone)]
pub struct MapState {
    structures: Structures,
    /// The prefix lists of the last spec (with deltas applied).
    lists: PrefixLists,
    /// Multiplicity of each prefix in the lists.
    mult: HashMap<IpNet, u32>,
    /// Prefix-hash length counts: bucket -> per-bit counts (sparse).
    bucket_counts_v4: HashMap<(u32, u32), u32>,
    bucket_counts_v6: HashMap<(u32, u32), u32>,
    bucket_bits_v4: HashMap<u32, u64>,
    bucket_bits_v6: HashMap<u32, Bits6>,
    global_counts_v4: [u32; 33],
    global_counts_v6: [u32; 129],
    config: Option<Config>,
    route_mark: Option<u32>,
    occupancy: Occupancy,
}

fn is_host(p: &IpNet) -> bool {
    p.prefix_len() == p.max_prefix_len()
}

impl MapState {
    /// Empty maps.
    #[must_use]
    pub fn new(structures: Structures) -> Self {
        Self {
            structures,
            lists: PrefixLists::default(),
            mult: HashMap::new(),
            bucket_counts_v4: HashMap::new(),
            bucket_counts_v6: HashMap::new(),
            bucket_bits_v4: HashMap::new(),
            bucket_bits_v6: HashMap::new(),
            global_counts_v4: [0; 33],
            global_counts_v6: [0; 129],
            config: None,
            route_mark: None,
            occupancy: Occupancy::default(),
        }
    }

    /// Entry counts after the last [`MapState::plan`].
    #[must_use]
    pub fn occupancy(&self) -> Occupancy {
        self.occupancy
    }

    /// The writes that make the maps hold `spec` (validated by the caller), and the
    /// state after them. `self` is only changed through the returned state, so a
    /// failed write leaves the old state to retry from.
    #[must_use]
    pub fn plan(&self, spec: &MarkingSpec) -> (Plan, MapState) {
        let mut next = self.clone();
        let mut plan = Plan {
            route_mark: spec.mark,
            ..Plan::default()
        };
        // Multiset changes: (prefix, +1 / -1).
        let mut deltas: Vec<(IpNet, i32)> = Vec::new();
        for (old, new) in [
            (self.lists.v4(), &spec.prefixes_v4),
            (self.lists.v6(), &spec.prefixes_v6),
        ] {
            if old.len() == new.len() {
                for (o, n) in old.iter().zip(new) {
                    if o != n {
                        deltas.push((*o, -1));
                        deltas.push((*n, 1));
                    }
                }
            } else {
                deltas.extend(old.iter().map(|p| (*p, -1)));
                deltas.extend(new.iter().map(|p| (*p, 1)));
            }
        }
        let mut appeared = Vec::new();
        let mut vanished = Vec::new();
        // Net effect per prefix first, so a prefix that only moved is untouched.
        let mut net: HashMap<IpNet, i32> = HashMap::new();
        for (p, d) in deltas {
            *net.entry(p).or_insert(0) += d;
        }
        for (p, d) in net {
            if d == 0 {
                continue;
            }
            let before = next.mult.get(&p).copied().unwrap_or(0);
            let after = u32::try_from(i64::from(before) + i64::from(d)).unwrap_or(0);
            if after == 0 {
                next.mult.remove(&p);
            } else {
                next.mult.insert(p, after);
            }
            if before == 0 && after > 0 {
                appeared.push(p);
            } else if before > 0 && after == 0 {
                vanished.push(p);
            }
        }
        appeared.sort_unstable();
        vanished.sort_unstable();

        if next.structures.phash {
            let mut touched4 = Vec::new();
            let mut touched6 = Vec::new();
            for (p, d) in appeared
                .iter()
                .map(|p| (p, 1i64))
                .chain(vanished.iter().map(|p| (p, -1)))
            {
                next.count_slot(p, d, &mut touched4, &mut touched6);
            }
            touched4.sort_unstable();
            touched4.dedup();
            touched6.sort_unstable();
            touched6.dedup();
            for b in touched4 {
                let bits = bits4(|j| next.bucket_counts_v4.get(&(b, j)).copied());
                let old = next.bucket_bits_v4.get(&b).copied().unwrap_or(0);
                if bits != old {
                    plan.buckets_v4.push((b, bits));
                }
                if bits == 0 {
                    next.bucket_bits_v4.remove(&b);
                } else {
                    next.bucket_bits_v4.insert(b, bits);
                }
            }
            for b in touched6 {
                let bits = bits6(|j| next.bucket_counts_v6.get(&(b, j)).copied());
                let old = next.bucket_bits_v6.get(&b).copied().unwrap_or_default();
                if bits != old {
                    plan.buckets_v6.push((b, bits));
                }
                if bits == Bits6::default() {
                    next.bucket_bits_v6.remove(&b);
                } else {
                    next.bucket_bits_v6.insert(b, bits);
                }
            }
        }

        let config = config_of(
            next.structures,
            spec.device_mark,
            spec.mask,
            spec.mark,
            &next.global_counts_v4,
            &next.global_counts_v6,
        );
        if next.config != Some(config) {
            plan.config = Some(config);
            next.config = Some(config);
        }

        if next.route_mark == Some(spec.mark) {
            plan.insert = appeared;
        } else {
            // A new route mark rewrites every entry.
            plan.insert = next.mult.keys().copied().collect();
            plan.insert.sort_unstable();
            next.route_mark = Some(spec.mark);
        }
        plan.remove = vanished;
        next.lists.assign(&spec.prefixes_v4, &spec.prefixes_v6);
        next.occupancy = next.count_occupancy();
        (plan, next)
    }

    /// Takes over `old`'s position index (a [`MapState::plan`] result has none: the
    /// lists are copied without it) where the lists allow, so the next delta need not
    /// rebuild it.
    pub fn adopt_index(&mut self, old: MapState) {
        let lists = std::mem::take(&mut self.lists);
        self.lists = old.lists.updated_to(&lists);
        // Built here if the old state had none (the first apply): the first delta
        // then costs what later ones do.
        self.lists.ensure_index();
    }

    /// Whether a spec was applied (a delta needs one).
    #[must_use]
    pub fn is_applied(&self) -> bool {
        self.config.is_some()
    }

    /// The writes that apply `delta` to the last spec (marks unchanged), and the
    /// state changes to [`MapState::commit_delta`] once they succeeded. Read-only and
    /// in time proportional to the delta: only its prefixes, their buckets and the
    /// global bitmaps are looked at.
    ///
    /// # Errors
    /// An added prefix is invalid or a removed one is not in the routed set (see
    /// [`PrefixLists::check`]).
    pub fn plan_delta(&self, delta: &PrefixDelta) -> Result<(Plan, StateDelta), Invalid> {
        delta.validate()?;
        let mark = self.route_mark.unwrap_or_default();
        let mut plan = Plan {
            route_mark: mark,
            ..Plan::default()
        };
        let mut out = StateDelta {
            mult: Vec::with_capacity(delta.remove.len() + delta.add.len()),
            bucket_counts_v4: Vec::new(),
            bucket_counts_v6: Vec::new(),
            global_counts_v4: self.global_counts_v4,
            global_counts_v6: self.global_counts_v6,
            occupancy: self.occupancy,
        };
        // Net effect per prefix, checked against the multiplicities (removals before
        // additions, as `PrefixDelta::applied_to` counts them).
        let mut net: HashMap<IpNet, i64> = HashMap::new();
        for (i, p) in delta.remove.iter().enumerate() {
            let d = net.entry(*p).or_insert(0);
            *d -= 1;
            let have = i64::from(self.mult.get(p).copied().unwrap_or(0));
            if have + *d < 0 {
                return Err(Invalid::new(
                    format!("remove[{i}]"),
                    format!("{p} is not in the routed set"),
                ));
            }
        }
        for p in &delta.add {
            *net.entry(*p).or_insert(0) += 1;
        }
        let mut net: Vec<(IpNet, i64)> = net.into_iter().filter(|(_, d)| *d != 0).collect();
        net.sort_unstable();
        for (p, d) in net {
            let before = self.mult.get(&p).copied().unwrap_or(0);
            let after = u32::try_from(i64::from(before) + d).unwrap_or(0);
            out.mult.push((p, after));
            if before == 0 && after > 0 {
                plan.insert.push(p);
                out.occupancy = bump_occupancy(out.occupancy, self.structures, &p, 1);
            } else if before > 0 && after == 0 {
                plan.remove.push(p);
                out.occupancy = bump_occupancy(out.occupancy, self.structures, &p, -1);
            }
        }
        if self.structures.phash {
            let mut counts4: HashMap<(u32, u32), u32> = HashMap::new();
            let mut counts6: HashMap<(u32, u32), u32> = HashMap::new();
            for (p, d) in plan
                .insert
                .iter()
                .map(|p| (p, 1i64))
                .chain(plan.remove.iter().map(|p| (p, -1)))
            {
                let bump = |c: &mut u32| *c = u32::try_from(i64::from(*c) + d).unwrap_or(0);
                match keys::slot(p) {
                    Slot::V4(_, j, Some(b)) => bump(
                        counts4
                            .entry((b, j))
                            .or_insert_with(|| self.bucket_count_v4(b, j)),
                    ),
                    Slot::V4(_, j, None) => bump(&mut out.global_counts_v4[j as usize]),
                    Slot::V6(_, j, Some(b)) => bump(
                        counts6
                            .entry((b, j))
                            .or_insert_with(|| self.bucket_count_v6(b, j)),
                    ),
                    Slot::V6(_, j, None) => bump(&mut out.global_counts_v6[j as usize]),
                }
            }
            let mut touched4: Vec<u32> = counts4.keys().map(|(b, _)| *b).collect();
            touched4.sort_unstable();
            touched4.dedup();
            for b in touched4 {
                let bits = bits4(|j| {
                    Some(
                        counts4
                            .get(&(b, j))
                            .copied()
                            .unwrap_or_else(|| self.bucket_count_v4(b, j)),
                    )
                });
                if bits != self.bucket_bits_v4.get(&b).copied().unwrap_or(0) {
                    plan.buckets_v4.push((b, bits));
                }
            }
            let mut touched6: Vec<u32> = counts6.keys().map(|(b, _)| *b).collect();
            touched6.sort_unstable();
            touched6.dedup();
            for b in touched6 {
                let bits = bits6(|j| {
                    Some(
                        counts6
                            .get(&(b, j))
                            .copied()
                            .unwrap_or_else(|| self.bucket_count_v6(b, j)),
                    )
                });
                if bits != self.bucket_bits_v6.get(&b).copied().unwrap_or_default() {
                    plan.buckets_v6.push((b, bits));
                }
            }
            out.bucket_counts_v4 = counts4.into_iter().collect();
            out.bucket_counts_v6 = counts6.into_iter().collect();
        }
        if let Some(cur) = self.config {
            let config = config_of(
                self.structures,
                cur.device_mark,
                cur.mask,
                mark,
                &out.global_counts_v4,
                &out.global_counts_v6,
            );
            if config != cur {
                plan.config = Some(config);
            }
        }
        Ok((plan, out))
    }

    /// Records that `plan` and `changes` (from [`MapState::plan_delta`] of `delta`)
    /// were written.
    pub fn commit_delta(&mut self, delta: &PrefixDelta, plan: &Plan, changes: StateDelta) {
        for (p, m) in changes.mult {
            if m == 0 {
                self.mult.remove(&p);
            } else {
                self.mult.insert(p, m);
            }
        }
        for (k, c) in changes.bucket_counts_v4 {
            if c == 0 {
                self.bucket_counts_v4.remove(&k);
            } else {
                self.bucket_counts_v4.insert(k, c);
            }
        }
        for (k, c) in changes.bucket_counts_v6 {
            if c == 0 {
                self.bucket_counts_v6.remove(&k);
            } else {
                self.bucket_counts_v6.insert(k, c);
            }
        }
        for (b, bits) in &plan.buckets_v4 {
            if *bits == 0 {
                self.bucket_bits_v4.remove(b);
            } else {
                self.bucket_bits_v4.insert(*b, *bits);
            }
        }
        for (b, bits) in &plan.buckets_v6 {
            if *bits == Bits6::default() {
                self.bucket_bits_v6.remove(b);
            } else {
                self.bucket_bits_v6.insert(*b, *bits);
            }
        }
        self.global_counts_v4 = changes.global_counts_v4;
        self.global_counts_v6 = changes.global_counts_v6;
        if plan.config.is_some() {
            self.config = plan.config;
        }
        self.occupancy = changes.occupancy;
        // Checked by `plan_delta` against the same multiset.
        let applied = self.lists.apply(delta);
        debug_assert!(applied.is_ok(), "{applied:?}");
    }

    fn bucket_count_v4(&self, b: u32, j: u32) -> u32 {
        self.bucket_counts_v4.get(&(b, j)).copied().unwrap_or(0)
    }

    fn bucket_count_v6(&self, b: u32, j: u32) -> u32 {
        self.bucket_counts_v6.get(&(b, j)).copied().unwrap_or(0)
    }

    fn count_slot(&mut self, p: &IpNet, d: i64, touched4: &mut Vec<u32>, touched6: &mut Vec<u32>) {
        let bump = |c: &mut u32| *c = u32::try_from(i64::from(*c) + d).unwrap_or(0);
        match keys::slot(p) {
            Slot::V4(_, j, Some(b)) => {
                bump(self.bucket_counts_v4.entry((b, j)).or_insert(0));
                touched4.push(b);
            }
            Slot::V4(_, j, None) => bump(&mut self.global_counts_v4[j as usize]),
            Slot::V6(_, j, Some(b)) => {
                bump(self.bucket_counts_v6.entry((b, j)).or_insert(0));
                touched6.push(b);
            }
            Slot::V6(_, j, None) => bump(&mut self.global_counts_v6[j as usize]),
        }
    }

    fn count_occupancy(&self) -> Occupancy {
        self.mult.keys().fold(Occupancy::default(), |o, p| {
            bump_occupancy(o, self.structures, p, 1)
        })
    }
}

/// State changes of a planned delta (see [`MapState::plan_delta`]).
#[derive(Debug, Clone)]
pub struct StateDelta {
    /// New multiplicities of the delta's prefixes (0: gone).
    mult: Vec<(IpNet, u32)>,
    /// New per-bucket length counts of the touched (bucket, bit)s.
    bucket_counts_v4: Vec<((u32, u32), u32)>,
    bucket_counts_v6: Vec<((u32, u32), u32)>,
    global_counts_v4: [u32; 33],
    global_counts_v6: [u32; 129],
    /// Entry counts after the delta.
    pub occupancy: Occupancy,
}

/// `o` with prefix `p` added (`d` = 1) or removed (`d` = -1).
fn bump_occupancy(mut o: Occupancy, structures: Structures, p: &IpNet, d: isize) -> Occupancy {
    let v4 = matches!(p, IpNet::V4(_));
    let bump = |t: &mut (usize, usize)| {
        let n = if v4 { &mut t.0 } else { &mut t.1 };
        *n = n.saturating_add_signed(d);
    };
    if structures.phash && (v4 || p.prefix_len() != 0) {
        bump(&mut o.phash);
    }
    if structures.lpm {
        if is_host(p) {
            bump(&mut o.hosts);
        } else {
            bump(&mut o.lpm);
        }
    }
    o
}

/// The length bitmap of an IPv4 bucket from its per-bit counts.
fn bits4(count: impl Fn(u32) -> Option<u32>) -> u64 {
    (0..=8u32)
        .filter(|j| count(*j).is_some_and(|c| c > 0))
        .fold(0u64, |acc, j| acc | (1 << j))
}

/// The length bitmap of an IPv6 bucket from its per-bit counts.
fn bits6(count: impl Fn(u32) -> Option<u32>) -> Bits6 {
    let mut bits = Bits6::default();
    for j in 0..=64u32 {
        if count(j).is_some_and(|c| c > 0) {
            if j < 64 {
                bits.lo |= 1 << j;
            } else {
                bits.hi |= 1;
            }
        }
    }
    bits
}

/// The config entry for the marks and the global length counts.
fn config_of(
    structures: Structures,
    device_mark: u32,
    mask: u32,
    mark: u32,
    global_v4: &[u32; 33],
    global_v6: &[u32; 129],
) -> Config {
    let mut config = Config {
        device_mark,
        mask,
        ..Config::default()
    };
    if structures.phash {
        for (j, c) in global_v4.iter().enumerate() {
            if *c > 0 {
                config.v4_global |= 1 << j;
            }
        }
        for (j, c) in global_v6.iter().enumerate().take(128).skip(65) {
            if *c > 0 {
                config.v6_global_hi |= 1 << (j - 64);
            }
        }
        if global_v6[128] > 0 {
            config.v6_all_mark = mark;
        }
    }
    config
}

/// Whether `p` belongs in the exact-host map (else the LPM trie).
#[must_use]
pub fn is_host_prefix(p: &IpNet) -> bool {
    is_host(p)
}

#[cfg(test)]
mod tests;
