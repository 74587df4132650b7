//! The fault schedule: which fault comes next, on which node, for how long. A pure
//! function of the seed and the node count, so a run replays with the same `--seed`.

use std::time::Duration;

use serde::Serialize;

/// A small xorshift64* generator. Not `rand`: its generators may change their output
/// between versions, and a seed must replay the same faults on any build.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed` (any value, 0 too: splitmix64 spreads it to a non-zero
    /// state).
    #[must_use]
    pub fn new(seed: u64) -> Self {
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        Self(if z == 0 { 1 } else { z })
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n` (`n` > 0), without modulo bias worth speaking of.
    pub fn below(&mut self, n: u64) -> u64 {
        let wide = u128::from(self.next_u64()) * u128::from(n);
        u64::try_from(wide >> 64).expect("the high half of a u128 fits a u64")
    }

    /// A duration in `lo..=hi`, in whole milliseconds.
    pub fn between(&mut self, lo: Duration, hi: Duration) -> Duration {
        let lo_ms = u64::try_from(lo.as_millis()).unwrap_or(u64::MAX);
        let hi_ms = u64::try_from(hi.as_millis()).unwrap_or(u64::MAX);
        Duration::from_millis(lo_ms + self.below(hi_ms.saturating_sub(lo_ms) + 1))
    }
}

/// The kinds of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// kill -9 of a node daemon, then started again as `lab up` started it.
    KillDaemon,
    /// kill -9 of a node's userspace WireGuard process (`wirespan wireguard` or
    /// wireguard-go); the daemon must bring the device back.
    KillWireguard,
    /// kill -9 of the discovery server, then started again.
    RestartDiscovery,
    /// A node's underlay link down, then up.
    LinkFlap,
    /// A node's WireGuard port dropped on the underlay, then let through again.
    Blackhole,
    /// A config change through `wirespan apply` (the MTU), then back.
    ApplyConfig,
    /// A node's daemon stopped (the others drop it), then started again.
    RemoveNode,
}

impl FaultKind {
    /// Every kind, in report order.
    pub const ALL: [Self; 7] = [
        Self::KillDaemon,
        Self::KillWireguard,
        Self::RestartDiscovery,
        Self::LinkFlap,
        Self::Blackhole,
        Self::ApplyConfig,
        Self::RemoveNode,
    ];

    /// The kind's name in reports.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::KillDaemon => "kill-daemon",
            Self::KillWireguard => "kill-wireguard",
            Self::RestartDiscovery => "restart-discovery",
            Self::LinkFlap => "link-flap",
            Self::Blackhole => "blackhole",
            Self::ApplyConfig => "apply-config",
            Self::RemoveNode => "remove-node",
        }
    }

    /// How long the fault lasts before it is undone (the process stays dead, the link
    /// down, the port dropped): short enough that many faults fit in a run, and for
    /// the blackhole long enough that WireGuard retransmits into it.
    #[must_use]
    pub fn hold_range(self) -> (Duration, Duration) {
        let ms = Duration::from_millis;
        match self {
            Self::KillDaemon | Self::RemoveNode | Self::RestartDiscovery => (ms(0), ms(2000)),
            Self::KillWireguard | Self::ApplyConfig => (ms(0), ms(0)),
            Self::LinkFlap => (ms(500), ms(4000)),
            Self::Blackhole => (ms(2000), ms(6000)),
        }
    }

    /// True when the fault acts on one node (the discovery server is not a node).
    #[must_use]
    pub fn has_node(self) -> bool {
        self != Self::RestartDiscovery
    }
}

/// One planned fault.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fault {
    /// Its number in the run, from 1.
    pub seq: usize,
    /// What happens.
    pub kind: FaultKind,
    /// Index of the node it hits (0 when the kind has no node).
    pub node: usize,
    /// How long it lasts before it is undone.
    #[serde(with = "millis")]
    pub hold: Duration,
}

mod millis {
    use std::time::Duration;

    pub fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
}

/// The faults of a run, drawn one at a time. Kinds come in rounds: each round is a
/// shuffle of every kind, so a short run meets every kind once per seven faults
/// and a long one meets each kind equally often.
#[derive(Debug, Clone)]
pub struct Schedule {
    rng: Rng,
    nodes: usize,
    round: Vec<FaultKind>,
    seq: usize,
}

impl Schedule {
    /// The schedule of `seed` for a lab of `nodes` nodes (at least one).
    #[must_use]
    pub fn new(seed: u64, nodes: usize) -> Self {
        Self {
            rng: Rng::new(seed),
            nodes: nodes.max(1),
            round: Vec::new(),
            seq: 0,
        }
    }
}

impl Iterator for Schedule {
    type Item = Fault;

    fn next(&mut self) -> Option<Fault> {
        if self.round.is_empty() {
            self.round = FaultKind::ALL.to_vec();
            // Fisher–Yates; popped from the back.
            for i in (1..self.round.len()).rev() {
                let j = usize::try_from(self.rng.below(i as u64 + 1)).expect("below i+1");
                self.round.swap(i, j);
            }
        }
        let kind = self.round.pop().expect("refilled above");
        let node = if kind.has_node() {
            usize::try_from(self.rng.below(self.nodes as u64)).expect("below nodes")
        } else {
            0
        };
        let (lo, hi) = kind.hold_range();
        let hold = self.rng.between(lo, hi);
        self.seq += 1;
        Some(Fault {
            seq: self.seq,
            kind,
            node,
            hold,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_faults_and_another_seed_others() {
        let a: Vec<Fault> = Schedule::new(7, 5).take(50).collect();
        let b: Vec<Fault> = Schedule::new(7, 5).take(50).collect();
        assert_eq!(a, b);
        let c: Vec<Fault> = Schedule::new(8, 5).take(50).collect();
        assert_ne!(a, c);
        // Seed 0 is a seed like any other.
        let z: Vec<Fault> = Schedule::new(0, 5).take(50).collect();
        assert_ne!(z, a);
        assert!(z.iter().map(|f| f.node).collect::<BTreeSet<_>>().len() > 1);
    }

    #[test]
    fn every_kind_comes_in_each_round_of_seven_and_every_node_is_hit() {
        for seed in 0..20 {
            let faults: Vec<Fault> = Schedule::new(seed, 3).take(70).collect();
            for round in faults.chunks(7) {
                let kinds: BTreeSet<FaultKind> = round.iter().map(|f| f.kind).collect();
                assert_eq!(kinds.len(), 7, "seed {seed}: {round:?}");
            }
            let nodes: BTreeSet<usize> = faults
                .iter()
                .filter(|f| f.kind.has_node())
                .map(|f| f.node)
                .collect();
            assert_eq!(nodes, BTreeSet::from([0, 1, 2]), "seed {seed}");
            assert_eq!(
                faults.iter().map(|f| f.seq).collect::<Vec<_>>(),
                (1..=70).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn holds_stay_in_their_kinds_range_and_vary() {
        let faults: Vec<Fault> = Schedule::new(3, 4).take(700).collect();
        for f in &faults {
            let (lo, hi) = f.kind.hold_range();
            assert!(f.hold >= lo && f.hold <= hi, "{f:?}");
        }
        let blackholes: BTreeSet<Duration> = faults
            .iter()
            .filter(|f| f.kind == FaultKind::Blackhole)
            .map(|f| f.hold)
            .collect();
        assert!(blackholes.len() > 10);
    }

    #[test]
    fn below_covers_its_range_only() {
        let mut r = Rng::new(1);
        let seen: BTreeSet<u64> = (0..1000).map(|_| r.below(5)).collect();
        assert_eq!(seen, BTreeSet::from([0, 1, 2, 3, 4]));
    }
}
