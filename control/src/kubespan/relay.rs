//! Peer relays (`docs/kubespan.md` §8.7), without I/O: when a peer's direct path counts
//! as down, what a node publishes about its own paths, and which node relays a pair.
//!
//! WireGuard's cryptokey routing accepts a packet only from the peer whose AllowedIPs
//! hold its source, so both ends of a pair must route through the same relay. The choice
//! is therefore a function of what both see alike: each node's published extension
//! (whether it relays, and which peers it cannot reach directly) and the two public
//! keys, ranked by a fixed hash (rendezvous hashing: a relay that goes away moves only
//! the pairs it carried).

use std::time::{Duration, SystemTime};

use crate::resources::kubespan::PeerState;

/// Most peers a node lists as not directly reachable; with more it offers no relay
/// (the list must fit the 2 KiB affiliate, and such a node is a poor relay anyway).
pub const DIRECT_DOWN_MAX: usize = 64;

/// The id of a WireGuard public key in relay data: its first 8 bytes, big-endian.
#[must_use]
pub fn key_id(key: &[u8; 32]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&key[..8]);
    u64::from_be_bytes(b)
}

/// The direct path to one peer, as the relay choice sees it: down once the peer has
/// been not `up` for the patience, or at once when an `up` peer was declared down (its
/// receive window, §8.6, already waited).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DirectPath {
    /// Since when the peer is not `up` (`None`: it is up).
    not_up_since: Option<SystemTime>,
    /// The peer left `up`: the path failed, rather than never worked yet.
    failed: bool,
    /// The state last observed.
    last: Option<PeerState>,
}

impl DirectPath {
    /// Takes the peer's state after a step.
    pub fn observe(&mut self, state: PeerState, now: SystemTime) {
        if state == PeerState::Up {
            *self = Self {
                last: Some(state),
                ..Self::default()
            };
            return;
        }
        if self.not_up_since.is_none() {
            self.not_up_since = Some(now);
            self.failed = self.last == Some(PeerState::Up);
        }
        self.last = Some(state);
    }

    /// Whether the direct path counts as down at `now`.
    #[must_use]
    pub fn down(&self, now: SystemTime, patience: Duration) -> bool {
        self.not_up_since
            .is_some_and(|t| self.failed || now.duration_since(t).unwrap_or_default() >= patience)
    }

    /// When the path will count as down, if it is not up and not down yet.
    #[must_use]
    pub fn down_at(&self, now: SystemTime, patience: Duration) -> Option<SystemTime> {
        self.not_up_since
            .filter(|_| !self.down(now, patience))
            .map(|t| t + patience)
    }
}

/// A node that could relay a pair, as the choosing node sees it.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    /// Its public key.
    pub key: &'a [u8; 32],
    /// It offers to relay (its published extension says so).
    pub offered: bool,
    /// The peers it cannot reach directly (published key ids).
    pub direct_down: &'a [u64],
    /// The choosing node reaches it directly (its peer state is `up`).
    pub up: bool,
}

/// The rank of `relay` for the pair {`a`, `b`}: FNV-1a (64 bit) over the lower key, the
/// higher key and the relay's key. Fixed by this function, not by a library's hasher,
/// so nodes running different builds rank alike.
#[must_use]
pub fn rank(a: &[u8; 32], b: &[u8; 32], relay: &[u8; 32]) -> u64 {
    let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in lo.iter().chain(hi).chain(relay) {
        h ^= u64::from(*byte);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The relay for the pair (`own`, `peer`): of the candidates that offer to relay, reach
/// both ends directly by what they publish and are `up` from here, the one of lowest
/// rank (ties by key). Both ends compute the same while they see the same affiliates.
#[must_use]
pub fn choose<'a>(
    own: &[u8; 32],
    peer: &[u8; 32],
    candidates: impl IntoIterator<Item = Candidate<'a>>,
) -> Option<&'a [u8; 32]> {
    let (own_id, peer_id) = (key_id(own), key_id(peer));
    candidates
        .into_iter()
        .filter(|c| {
            c.offered
                && c.up
                && c.key != own
                && c.key != peer
                && !c.direct_down.contains(&own_id)
                && !c.direct_down.contains(&peer_id)
        })
        .min_by_key(|c| (rank(own, peer, c.key), *c.key))
        .map(|c| c.key)
}

/// What a node publishes as its not-directly-reachable peers: their key ids, sorted;
/// `None` when more than [`DIRECT_DOWN_MAX`] (the node then offers no relay).
#[must_use]
pub fn published_down(ids: impl IntoIterator<Item = u64>) -> Option<Vec<u64>> {
    let mut v: Vec<u64> = ids.into_iter().collect();
    v.sort_unstable();
    v.dedup();
    (v.len() <= DIRECT_DOWN_MAX).then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000 + secs)
    }

    fn key(n: u8) -> [u8; 32] {
        let mut k = [0u8; 32];
        k[0] = n;
        k[31] = n.wrapping_mul(7);
        k
    }

    #[test]
    fn a_path_never_up_is_down_after_the_patience_one_that_failed_at_once() {
        let p = Duration::from_secs(30);
        let mut d = DirectPath::default();
        d.observe(PeerState::Unknown, t(0));
        assert!(!d.down(t(29), p));
        assert_eq!(d.down_at(t(29), p), Some(t(30)));
        assert!(d.down(t(30), p));
        assert_eq!(d.down_at(t(30), p), None);
        d.observe(PeerState::Up, t(40));
        assert!(!d.down(t(100), p));
        assert_eq!(d.down_at(t(100), p), None);
        // Declared down after being up: the window already waited.
        d.observe(PeerState::Unknown, t(200));
        assert!(d.down(t(200), p));
        // Rotation keeps it down; a handshake brings it back.
        d.observe(PeerState::Down, t(215));
        assert!(d.down(t(215), p));
        d.observe(PeerState::Up, t(220));
        assert!(!d.down(t(220), p));
    }

    #[test]
    fn both_ends_choose_the_same_relay_and_only_one_that_reaches_both() {
        let (a, b) = (key(1), key(2));
        let relays = [key(3), key(4), key(5), key(6)];
        let cands = |down: &'static [u64]| {
            relays.iter().map(move |k| Candidate {
                key: k,
                offered: true,
                direct_down: down,
                up: true,
            })
        };
        let from_a = choose(&a, &b, cands(&[])).unwrap();
        let from_b = choose(&b, &a, cands(&[])).unwrap();
        assert_eq!(from_a, from_b);
        // The lowest rank wins, whatever the order the candidates come in.
        let best = relays.iter().min_by_key(|k| rank(&a, &b, k)).unwrap();
        assert_eq!(from_a, best);
        let reversed: Vec<_> = cands(&[]).collect::<Vec<_>>().into_iter().rev().collect();
        assert_eq!(choose(&a, &b, reversed), Some(best));
        // A candidate that cannot reach one end, does not offer, or is not up from
        // here is passed over.
        let others: Vec<Candidate<'_>> = relays
            .iter()
            .map(|k| Candidate {
                key: k,
                offered: k != best,
                direct_down: &[],
                up: true,
            })
            .collect();
        assert_ne!(choose(&a, &b, others), Some(best));
        let down_b = [key_id(&b)];
        let only_best_down: Vec<Candidate<'_>> = relays
            .iter()
            .map(|k| Candidate {
                key: k,
                offered: true,
                direct_down: if k == best { &down_b } else { &[] },
                up: true,
            })
            .collect();
        assert_ne!(choose(&a, &b, only_best_down), Some(best));
        let none_up = relays.iter().map(|k| Candidate {
            key: k,
            offered: true,
            direct_down: &[],
            up: false,
        });
        assert_eq!(choose(&a, &b, none_up), None);
        // Neither end relays for itself.
        let ends = [a, b];
        let selves = ends.iter().map(|k| Candidate {
            key: k,
            offered: true,
            direct_down: &[],
            up: true,
        });
        assert_eq!(choose(&a, &b, selves), None);
    }

    #[test]
    fn the_rank_is_fixed_across_builds() {
        // FNV-1a over 96 bytes; a changed function would split pairs between nodes
        // running different versions.
        assert_eq!(
            rank(&key(1), &key(2), &key(3)),
            rank(&key(2), &key(1), &key(3))
        );
        assert_eq!(rank(&[0; 32], &[0; 32], &[0; 32]), 0x0243_cfa8_4518_5aa5);
    }

    #[test]
    fn the_published_list_is_sorted_and_bounded() {
        assert_eq!(published_down([5, 1, 5, 3]), Some(vec![1, 3, 5]));
        assert_eq!(published_down(0..64), Some((0..64).collect()));
        assert_eq!(published_down(0..65), None);
        assert_eq!(key_id(&key(1)), 0x0100_0000_0000_0000);
    }
}
