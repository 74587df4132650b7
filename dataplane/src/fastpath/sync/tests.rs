//! Unit tests of the map planner.

use super::*;

const BOTH: Structures = Structures {
    phash: true,
    lpm: true,
};

fn spec(v4: &[&str], v6: &[&str]) -> MarkingSpec {
    MarkingSpec {
        prefixes_v4: v4.iter().map(|p| p.parse().unwrap()).collect(),
        prefixes_v6: v6.iter().map(|p| p.parse().unwrap()).collect(),
        ..MarkingSpec::default()
    }
}

fn nets(v: &[&str]) -> Vec<IpNet> {
    v.iter().map(|p| p.parse().unwrap()).collect()
}

#[test]
fn first_apply_inserts_everything_and_sets_bits() {
    let (plan, st) = MapState::new(BOTH).plan(&spec(
        &["10.0.0.1/32", "10.0.0.0/8", "10.244.1.0/24"],
        &["fd00::1/128", "fd00:1::/48", "::/0"],
    ));
    assert_eq!(plan.insert.len(), 6);
    assert!(plan.remove.is_empty());
    let cfg = plan.config.unwrap();
    assert_eq!(cfg.v4_global, 1 << 24); // /8
    assert_eq!(cfg.v6_global_hi, 1 << (80 - 64)); // /48
    assert_eq!(cfg.v6_all_mark, 0x40);
    assert_eq!((cfg.device_mark, cfg.mask), (0x20, 0x60));
    // /32 and /24 buckets (distinct /24s, so two buckets unless they collide).
    assert!(!plan.buckets_v4.is_empty());
    assert_eq!(plan.buckets_v6.len(), 1);
    assert_eq!(st.occupancy().phash, (3, 2));
    assert_eq!(st.occupancy().hosts, (1, 1));
    assert_eq!(st.occupancy().lpm, (2, 2));
    // Same spec again: nothing.
    let (again, _) = st.plan(&spec(
        &["10.0.0.1/32", "10.0.0.0/8", "10.244.1.0/24"],
        &["fd00::1/128", "fd00:1::/48", "::/0"],
    ));
    assert!(again.is_empty(), "{again:?}");
}

#[test]
fn one_peer_change_touches_only_its_entries() {
    let mut v4: Vec<String> = (0..10_000)
        .map(|i| format!("10.{}.{}.{}/32", i / 65536, (i / 256) % 256, i % 256))
        .collect();
    let refs: Vec<&str> = v4.iter().map(String::as_str).collect();
    let (_, st) = MapState::new(BOTH).plan(&spec(&refs, &[]));
    v4[1234] = "172.16.5.0/24".into();
    let refs: Vec<&str> = v4.iter().map(String::as_str).collect();
    let (plan, st2) = st.plan(&spec(&refs, &[]));
    assert_eq!(plan.insert, nets(&["172.16.5.0/24"]));
    assert_eq!(plan.remove, nets(&["10.0.4.210/32"]));
    assert!(plan.config.is_none());
    // At most the two buckets involved.
    assert!(plan.buckets_v4.len() <= 2, "{:?}", plan.buckets_v4);
    assert_eq!(st2.occupancy().phash.0, 10_000);
}

#[test]
fn duplicates_and_moves_are_not_rewritten() {
    let (_, st) = MapState::new(BOTH).plan(&spec(&["10.0.0.1/32", "10.0.0.1/32"], &[]));
    // One copy goes: the entry stays.
    let (plan, st) = st.plan(&spec(&["10.0.0.1/32"], &[]));
    assert!(plan.is_empty(), "{plan:?}");
    // Reordered: nothing.
    let (_, st) = st.plan(&spec(&["10.0.0.1/32", "10.0.0.2/32"], &[]));
    let (plan, _) = st.plan(&spec(&["10.0.0.2/32", "10.0.0.1/32"], &[]));
    assert!(plan.is_empty(), "{plan:?}");
}

#[test]
fn removing_the_last_prefix_of_a_length_clears_its_bit() {
    let (_, st) = MapState::new(BOTH).plan(&spec(&["10.0.0.0/8"], &[]));
    let (plan, _) = st.plan(&spec(&[], &[]));
    assert_eq!(plan.remove, nets(&["10.0.0.0/8"]));
    assert_eq!(plan.config.unwrap().v4_global, 0);
}

/// What the kernel maps hold after a sequence of plans.
#[derive(Debug, Default, PartialEq, Eq)]
struct Maps {
    entries: HashMap<IpNet, u32>,
    buckets_v4: HashMap<u32, u64>,
    buckets_v6: HashMap<u32, Bits6>,
    config: Option<Config>,
}

impl Maps {
    fn write(&mut self, plan: &Plan) {
        for p in &plan.insert {
            self.entries.insert(*p, plan.route_mark);
        }
        for (b, bits) in &plan.buckets_v4 {
            self.buckets_v4.insert(*b, *bits);
        }
        self.buckets_v4.retain(|_, bits| *bits != 0);
        for (b, bits) in &plan.buckets_v6 {
            self.buckets_v6.insert(*b, *bits);
        }
        self.buckets_v6.retain(|_, bits| *bits != Bits6::default());
        if plan.config.is_some() {
            self.config = plan.config;
        }
        for p in &plan.remove {
            self.entries.remove(p);
        }
    }
}

/// xorshift64: deterministic, no dependency.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        usize::try_from(self.0 % n as u64).unwrap_or(0)
    }
    /// Prefixes of every kind the maps treat differently: hosts, bucketed and
    /// global lengths, `::/0`; few distinct values, so duplicates and shared
    /// buckets are common.
    fn prefix_v4(&mut self) -> IpNet {
        loop {
            let p = self.prefix();
            if matches!(p, IpNet::V4(_)) {
                return p;
            }
        }
    }

    fn prefix(&mut self) -> IpNet {
        let lens4: [u8; 6] = [32, 30, 24, 16, 8, 0];
        let lens6: [u8; 6] = [128, 96, 64, 56, 48, 0];
        let p = if self.below(2) == 0 {
            let a = 0x0a00_0000_u32 | (self.below(8) as u32) << 8 | self.below(4) as u32;
            IpNet::new(std::net::Ipv4Addr::from(a).into(), lens4[self.below(6)])
        } else {
            let a = 0xfd00_u128 << 112 | (self.below(8) as u128) << 64 | self.below(4) as u128;
            IpNet::new(std::net::Ipv6Addr::from(a).into(), lens6[self.below(6)])
        };
        p.unwrap().trunc()
    }
}

#[test]
fn deltas_end_in_the_same_maps_as_a_full_apply() {
    for structures in [
        BOTH,
        Structures {
            phash: true,
            lpm: false,
        },
        Structures {
            phash: false,
            lpm: true,
        },
    ] {
        let mut r = Rng(0x9e37_79b9_7f4a_7c15);
        for _round in 0..20 {
            let mut spec = MarkingSpec::default();
            for _ in 0..r.below(12) {
                let p = r.prefix();
                match p {
                    IpNet::V4(_) => spec.prefixes_v4.push(p),
                    IpNet::V6(_) => spec.prefixes_v6.push(p),
                }
            }
            let (plan, mut st) = MapState::new(structures).plan(&spec);
            let mut maps = Maps::default();
            maps.write(&plan);
            for _step in 0..40 {
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
                    delta.add.push(r.prefix());
                }
                let (plan, changes) = st.plan_delta(&delta).unwrap();
                maps.write(&plan);
                st.commit_delta(&delta, &plan, changes);
                spec = delta.applied_to(&spec).unwrap();
                // The same maps as writing the resulting spec into empty ones.
                let (full, fresh) = MapState::new(structures).plan(&spec);
                let mut want = Maps::default();
                want.write(&full);
                assert_eq!(maps, want, "{structures:?} {delta:?}");
                assert_eq!(st.occupancy(), fresh.occupancy());
                // And a full apply on top of the deltas has nothing to write.
                let (again, _) = st.plan(&spec);
                assert!(again.is_empty(), "{again:?}");
                // Now and then a full apply with one position changed, keeping the
                // index for the deltas after it.
                if r.below(4) == 0 && !spec.prefixes_v4.is_empty() {
                    let at = r.below(spec.prefixes_v4.len());
                    spec.prefixes_v4[at] = r.prefix_v4();
                    let (plan, next) = st.plan(&spec);
                    maps.write(&plan);
                    let old = std::mem::replace(&mut st, next);
                    st.adopt_index(old);
                }
            }
        }
    }
}

#[test]
fn an_invalid_delta_names_the_entry_and_plans_nothing() {
    let (_, st) = MapState::new(BOTH).plan(&spec(&["10.0.0.1/32"], &[]));
    let p = |s: &str| s.parse::<IpNet>().unwrap();
    let bad = PrefixDelta {
        remove: vec![p("10.0.0.1/32"), p("10.0.0.1/32")],
        add: vec![],
    };
    assert_eq!(st.plan_delta(&bad).unwrap_err().field, "remove[1]");
    let bad = PrefixDelta {
        remove: vec![],
        add: vec![p("10.0.0.1/24")],
    };
    assert_eq!(st.plan_delta(&bad).unwrap_err().field, "add[0]");
    assert!(!MapState::new(BOTH).is_applied());
}

#[test]
fn a_new_route_mark_rewrites_every_entry() {
    let (_, st) = MapState::new(BOTH).plan(&spec(&["10.0.0.1/32", "10.1.0.0/16"], &[]));
    let mut s = spec(&["10.0.0.1/32", "10.1.0.0/16"], &[]);
    s.mark = 0x4000;
    s.mask = 0x6000;
    s.device_mark = 0x2000;
    let (plan, _) = st.plan(&s);
    assert_eq!(plan.insert.len(), 2);
    assert_eq!(plan.route_mark, 0x4000);
    assert_eq!(plan.config.unwrap().mask, 0x6000);
}
