//! The server relay's allocations, without I/O: who may send on which side of which
//! pair, where a datagram goes, limits and expiry. Time is passed in.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use super::RelayError;
use crate::server::transport::limits::ip_key;

/// Longest cluster or affiliate id (the discovery service's own limit).
pub const ID_MAX: usize = 256;

pub use crate::relay::TOKEN_LEN;

/// What limits the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayLimits {
    /// Most allocations at once.
    pub max_allocations: usize,
    /// Most allocation sides bound to one address (one node behind it per side); an
    /// IPv6 address counts by its /64, which one host can hold whole.
    pub max_per_address: usize,
    /// Most allocations of one cluster.
    pub max_per_cluster: usize,
    /// Descriptors the relay may hold, two per allocation; the server lowers it to what
    /// the descriptor limit leaves after connections, so the relay is refused before
    /// accept and Hello run out of descriptors.
    pub max_fds: usize,
    /// Bytes per second one allocation forwards, both directions together.
    pub rate: u64,
    /// Bytes one allocation may forward at once above the rate.
    pub burst: u64,
    /// An allocation without a datagram forwarded or a refresh for this long ends.
    pub idle: Duration,
}

impl Default for RelayLimits {
    fn default() -> Self {
        Self {
            max_allocations: 1024,
            max_per_address: 256,
            max_per_cluster: 256,
            max_fds: usize::MAX,
            rate: 8 << 20,
            burst: 1 << 20,
            idle: Duration::from_secs(300),
        }
    }
}

/// A validated allocation request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairRequest {
    /// Cluster id.
    pub cluster_id: String,
    /// Calling node.
    pub affiliate_id: String,
    /// Other node.
    pub peer_affiliate_id: String,
    /// Pair token.
    pub token: [u8; TOKEN_LEN],
}

impl PairRequest {
    /// Checks the request's fields, naming the first bad one.
    ///
    /// # Errors
    /// [`RelayError::InvalidField`] naming the field and the problem.
    pub fn new(
        cluster_id: String,
        affiliate_id: String,
        peer_affiliate_id: String,
        token: &[u8],
    ) -> Result<Self, RelayError> {
        let id = |field: &'static str, v: &str| -> Result<(), RelayError> {
            if v.is_empty() {
                return Err(RelayError::InvalidField(field, "is empty".into()));
            }
            if v.len() > ID_MAX {
                return Err(RelayError::InvalidField(
                    field,
                    format!("is {} bytes, more than {ID_MAX}", v.len()),
                ));
            }
            Ok(())
        };
        id("cluster_id", &cluster_id)?;
        id("affiliate_id", &affiliate_id)?;
        id("peer_affiliate_id", &peer_affiliate_id)?;
        if affiliate_id == peer_affiliate_id {
            return Err(RelayError::InvalidField(
                "peer_affiliate_id",
                "is the calling node itself".into(),
            ));
        }
        let token: [u8; TOKEN_LEN] = token.try_into().map_err(|_| {
            RelayError::InvalidField(
                "pair_token",
                format!("is {} bytes, not {TOKEN_LEN}", token.len()),
            )
        })?;
        Ok(Self {
            cluster_id,
            affiliate_id,
            peer_affiliate_id,
            token,
        })
    }

    /// The pair, whichever node asks, and which side the caller is (0: the lower id).
    fn key(&self) -> (PairKey, usize) {
        let (lo, hi, side) = if self.affiliate_id < self.peer_affiliate_id {
            (&self.affiliate_id, &self.peer_affiliate_id, 0)
        } else {
            (&self.peer_affiliate_id, &self.affiliate_id, 1)
        };
        (
            PairKey {
                cluster: self.cluster_id.clone(),
                lo: lo.clone(),
                hi: hi.clone(),
                token: self.token,
            },
            side,
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PairKey {
    cluster: String,
    lo: String,
    hi: String,
    token: [u8; TOKEN_LEN],
}

/// Id of an allocation (never reused).
pub type AllocationId = u64;

/// One side of an allocation: the port its node sends to, the address it must send
/// from, and where it was heard (its NAT's mapping towards the relay). The port is
/// learned once per allocate call of the side's node: the first datagram from the
/// bound address after the call fixes it, and datagrams from other ports of that
/// address are dropped until the node calls again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Side {
    /// Relay port this side's node sends to.
    pub port: u16,
    /// The node's observed address; `None` until the node allocates.
    pub bound: Option<IpAddr>,
    /// Where the node's datagrams come from (and the other side's go to).
    pub learned: Option<SocketAddr>,
    /// Whether the next datagram from `bound` sets `learned`.
    pub learning: bool,
}

#[derive(Debug)]
struct Allocation {
    key: PairKey,
    sides: [Side; 2],
    last_active: Instant,
    tokens: f64,
    refilled: Instant,
}

/// What an allocate call got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// The allocation.
    pub id: AllocationId,
    /// The caller's side.
    pub side: usize,
    /// The port the caller sends to.
    pub port: u16,
    /// Whether the allocation was made by this call (its sockets are new).
    pub created: bool,
}

/// Why a datagram was not forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dropped {
    /// The allocation is gone.
    Unknown,
    /// It came from another address than the side's node.
    Source,
    /// It came from the side's address but not from its learned port.
    Port,
    /// The other side's node has not sent anything yet (its address is unknown).
    PeerUnknown,
    /// Over the allocation's rate.
    Rate,
}

impl Dropped {
    /// As a metric label.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::Source => "source",
            Self::Port => "port",
            Self::PeerUnknown => "peer_unknown",
            Self::Rate => "rate",
        }
    }
}

/// Every allocation of one relay.
#[derive(Debug)]
pub struct Table {
    limits: RelayLimits,
    by_key: HashMap<PairKey, AllocationId>,
    allocations: HashMap<AllocationId, Allocation>,
    per_address: HashMap<IpAddr, usize>,
    per_cluster: HashMap<String, usize>,
    next_id: AllocationId,
}

impl Table {
    /// An empty table.
    #[must_use]
    pub fn new(limits: RelayLimits) -> Self {
        Self {
            limits,
            by_key: HashMap::new(),
            allocations: HashMap::new(),
            per_address: HashMap::new(),
            per_cluster: HashMap::new(),
            next_id: 1,
        }
    }

    /// The limits in force.
    #[must_use]
    pub fn limits(&self) -> RelayLimits {
        self.limits
    }

    /// Number of allocations.
    #[must_use]
    pub fn len(&self) -> usize {
        self.allocations.len()
    }

    /// Whether there is none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.allocations.is_empty()
    }

    /// Creates or refreshes the pair's allocation and binds the caller's side to its
    /// observed address. `bind` makes the two sockets of a new allocation and returns
    /// their ports; it is called only when the allocation is new and allowed.
    ///
    /// # Errors
    /// [`RelayError::Exhausted`] over a limit; whatever `bind` fails with.
    pub fn allocate(
        &mut self,
        req: &PairRequest,
        observed: IpAddr,
        now: Instant,
        bind: impl FnOnce() -> Result<[u16; 2], RelayError>,
    ) -> Result<Grant, RelayError> {
        let observed = observed.to_canonical();
        let (key, side) = req.key();
        let (id, created) = match self.by_key.get(&key) {
            Some(&id) => (id, false),
            None => {
                self.check_new(&key.cluster)?;
                self.check_address(observed)?;
                let ports = bind()?;
                let id = self.next_id;
                self.next_id += 1;
                let side_of = |port| Side {
                    port,
                    bound: None,
                    learned: None,
                    learning: false,
                };
                *self.per_cluster.entry(key.cluster.clone()).or_default() += 1;
                self.allocations.insert(
                    id,
                    Allocation {
                        key: key.clone(),
                        sides: [side_of(ports[0]), side_of(ports[1])],
                        last_active: now,
                        tokens: self.limits.burst as f64,
                        refilled: now,
                    },
                );
                self.by_key.insert(key, id);
                (id, true)
            }
        };
        let bound = self.allocations[&id].sides[side].bound;
        if bound != Some(observed) {
            // A node whose public address changed moves its side with it.
            self.check_address(observed)?;
            if let Some(old) = bound {
                self.release_address(old);
            }
            *self.per_address.entry(ip_key(observed)).or_default() += 1;
            let s = &mut self.allocations.get_mut(&id).expect("looked up").sides[side];
            s.bound = Some(observed);
            s.learned = None;
        }
        let a = self.allocations.get_mut(&id).expect("looked up");
        a.last_active = now;
        // Each call re-opens learning: a node whose NAT mapping moved calls again.
        a.sides[side].learning = true;
        Ok(Grant {
            id,
            side,
            port: a.sides[side].port,
            created,
        })
    }

    /// Whether one more allocation fits the total, the cluster's share and the
    /// descriptor budget.
    fn check_new(&self, cluster: &str) -> Result<(), RelayError> {
        let limits = self.limits;
        if self.allocations.len() >= limits.max_allocations {
            return Err(RelayError::Exhausted(format!(
                "the relay holds its maximum of {} allocations",
                limits.max_allocations
            )));
        }
        if self.per_cluster.get(cluster).copied().unwrap_or(0) >= limits.max_per_cluster {
            return Err(RelayError::Exhausted(format!(
                "the cluster holds its maximum of {} relay allocations",
                limits.max_per_cluster
            )));
        }
        if (self.allocations.len() + 1).saturating_mul(2) > limits.max_fds {
            return Err(RelayError::Exhausted(format!(
                "the relay's budget of {} file descriptors (2 per allocation) is used up",
                limits.max_fds
            )));
        }
        Ok(())
    }

    fn check_address(&self, ip: IpAddr) -> Result<(), RelayError> {
        if self.per_address.get(&ip_key(ip)).copied().unwrap_or(0) >= self.limits.max_per_address {
            return Err(RelayError::Exhausted(format!(
                "{ip} holds its maximum of {} relay allocations",
                self.limits.max_per_address
            )));
        }
        Ok(())
    }

    fn release_address(&mut self, ip: IpAddr) {
        let key = ip_key(ip);
        if let Some(n) = self.per_address.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                self.per_address.remove(&key);
            }
        }
    }

    /// A datagram of `len` bytes from `src` arrived on `side` of allocation `id`: where
    /// it goes (out of the other side's socket), or why it is dropped.
    ///
    /// # Errors
    /// The reason it is dropped.
    pub fn datagram(
        &mut self,
        id: AllocationId,
        side: usize,
        src: SocketAddr,
        len: usize,
        now: Instant,
    ) -> Result<SocketAddr, Dropped> {
        let limits = self.limits;
        let a = self.allocations.get_mut(&id).ok_or(Dropped::Unknown)?;
        let src = SocketAddr::new(src.ip().to_canonical(), src.port());
        let me = &mut a.sides[side];
        if me.bound != Some(src.ip()) {
            return Err(Dropped::Source);
        }
        // A symmetric NAT's mapping is only known once it sends; after that, another
        // port of the same address is someone else until the node allocates again.
        if me.learning {
            me.learned = Some(src);
            me.learning = false;
        } else if me.learned != Some(src) {
            return Err(Dropped::Port);
        }
        let to = a.sides[1 - side].learned.ok_or(Dropped::PeerUnknown)?;
        let elapsed = now.saturating_duration_since(a.refilled).as_secs_f64();
        a.tokens = (a.tokens + elapsed * limits.rate as f64).min(limits.burst as f64);
        a.refilled = now;
        if a.tokens < len as f64 {
            return Err(Dropped::Rate);
        }
        a.tokens -= len as f64;
        a.last_active = now;
        Ok(to)
    }

    /// Ends the allocations idle for longer than the limit; returns their ids.
    pub fn expire(&mut self, now: Instant) -> Vec<AllocationId> {
        let idle = self.limits.idle;
        let gone: Vec<AllocationId> = self
            .allocations
            .iter()
            .filter(|(_, a)| now.saturating_duration_since(a.last_active) > idle)
            .map(|(id, _)| *id)
            .collect();
        for id in &gone {
            if let Some(a) = self.allocations.remove(id) {
                if let Some(n) = self.per_cluster.get_mut(&a.key.cluster) {
                    *n -= 1;
                    if *n == 0 {
                        self.per_cluster.remove(&a.key.cluster);
                    }
                }
                self.by_key.remove(&a.key);
                for ip in a.sides.iter().filter_map(|s| s.bound) {
                    self.release_address(ip);
                }
            }
        }
        gone
    }

    /// The sides of an allocation.
    #[must_use]
    pub fn sides(&self, id: AllocationId) -> Option<[Side; 2]> {
        self.allocations.get(&id).map(|a| a.sides)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(me: &str, peer: &str, token: u8) -> PairRequest {
        PairRequest::new("c".into(), me.into(), peer.into(), &[token; 32]).unwrap()
    }

    fn ports(a: u16) -> impl FnOnce() -> Result<[u16; 2], RelayError> {
        move || Ok([a, a + 1])
    }

    const A: &str = "198.51.100.1";
    const B: &str = "203.0.113.2";

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn at(s: &str, port: u16) -> SocketAddr {
        SocketAddr::new(ip(s), port)
    }

    #[test]
    fn bad_fields_are_named() {
        let err = |c: &str, a: &str, p: &str, t: &[u8]| {
            PairRequest::new(c.into(), a.into(), p.into(), t)
                .unwrap_err()
                .to_string()
        };
        assert!(err("", "a", "b", &[0; 32]).contains("cluster_id is empty"));
        assert!(err("c", &"x".repeat(257), "b", &[0; 32]).contains("affiliate_id is 257 bytes"));
        assert!(err("c", "a", "a", &[0; 32]).contains("peer_affiliate_id is the calling node"));
        assert!(err("c", "a", "b", &[0; 31]).contains("pair_token is 31 bytes, not 32"));
    }

    #[test]
    fn both_nodes_share_one_allocation_and_datagrams_cross_once_both_sent() {
        let mut t = Table::new(RelayLimits::default());
        let now = Instant::now();
        let ga = t
            .allocate(&req("a", "b", 1), ip(A), now, ports(40000))
            .unwrap();
        let gb = t
            .allocate(&req("b", "a", 1), ip(B), now, || panic!("no second bind"))
            .unwrap();
        assert_eq!(
            (ga.id, ga.side, ga.port, ga.created),
            (gb.id, 0, 40000, true)
        );
        assert_eq!((gb.side, gb.port, gb.created), (1, 40001, false));
        // a's NAT maps some port; b has not sent yet.
        assert_eq!(
            t.datagram(ga.id, 0, at(A, 7001), 148, now),
            Err(Dropped::PeerUnknown)
        );
        // b sends: it goes to where a was heard from, and back.
        assert_eq!(t.datagram(ga.id, 1, at(B, 9002), 92, now), Ok(at(A, 7001)));
        assert_eq!(t.datagram(ga.id, 0, at(A, 7001), 32, now), Ok(at(B, 9002)));
        // Another port of a's address is dropped and redirects nothing...
        assert_eq!(
            t.datagram(ga.id, 0, at(A, 7555), 32, now),
            Err(Dropped::Port)
        );
        assert_eq!(t.datagram(ga.id, 1, at(B, 9002), 32, now), Ok(at(A, 7001)));
        // ...until a allocates again (its NAT's mapping moved): then it is followed.
        t.allocate(&req("a", "b", 1), ip(A), now, ports(0)).unwrap();
        assert_eq!(t.datagram(ga.id, 0, at(A, 7555), 32, now), Ok(at(B, 9002)));
        assert_eq!(t.datagram(ga.id, 1, at(B, 9002), 32, now), Ok(at(A, 7555)));
        assert_eq!(
            t.datagram(ga.id, 0, at(A, 7001), 32, now),
            Err(Dropped::Port)
        );
    }

    #[test]
    fn only_the_sides_node_may_send_and_other_tokens_get_their_own_pair() {
        let mut t = Table::new(RelayLimits::default());
        let now = Instant::now();
        let g = t
            .allocate(&req("a", "b", 1), ip(A), now, ports(40000))
            .unwrap();
        t.allocate(&req("b", "a", 1), ip(B), now, ports(0)).unwrap();
        // b's address on a's side, a stranger anywhere: dropped, nothing learned.
        assert_eq!(t.datagram(g.id, 0, at(B, 1), 10, now), Err(Dropped::Source));
        assert_eq!(
            t.datagram(g.id, 1, at("192.0.2.9", 1), 10, now),
            Err(Dropped::Source)
        );
        assert_eq!(t.sides(g.id).unwrap()[0].learned, None);
        // Someone without the cluster secret presents another token: another pair.
        let other = t
            .allocate(&req("a", "b", 2), ip("192.0.2.9"), now, ports(50000))
            .unwrap();
        assert_ne!(other.id, g.id);
        assert!(other.created);
        // IPv4-mapped IPv6 is the same node.
        let mapped: IpAddr = format!("::ffff:{A}").parse().unwrap();
        t.datagram(g.id, 1, at(B, 2), 10, now).unwrap_err();
        assert_eq!(
            t.datagram(g.id, 0, SocketAddr::new(mapped, 5), 10, now),
            Ok(at(B, 2))
        );
    }

    #[test]
    fn a_node_whose_address_changed_moves_its_side() {
        let mut t = Table::new(RelayLimits::default());
        let now = Instant::now();
        let g = t
            .allocate(&req("a", "b", 1), ip(A), now, ports(40000))
            .unwrap();
        t.allocate(&req("a", "b", 1), ip("192.0.2.50"), now, ports(0))
            .unwrap();
        assert_eq!(t.sides(g.id).unwrap()[0].bound, Some(ip("192.0.2.50")));
        assert_eq!(t.datagram(g.id, 0, at(A, 1), 10, now), Err(Dropped::Source));
        assert!(!t.per_address.contains_key(&ip(A)));
    }

    #[test]
    fn limits_refuse_new_pairs_and_the_rate_drops_beyond_the_burst() {
        let limits = RelayLimits {
            max_allocations: 2,
            max_per_address: 1,
            max_per_cluster: 2,
            max_fds: 4,
            rate: 1000,
            burst: 1500,
            idle: Duration::from_secs(60),
        };
        let mut t = Table::new(limits);
        let now = Instant::now();
        let g = t.allocate(&req("a", "b", 1), ip(A), now, ports(1)).unwrap();
        let e = t
            .allocate(&req("a", "c", 1), ip(A), now, ports(3))
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("198.51.100.1 holds its maximum of 1"),
            "{e}"
        );
        t.allocate(&req("b", "a", 1), ip(B), now, ports(0)).unwrap();
        t.allocate(&req("x", "y", 1), ip("2001:db8::1"), now, ports(5))
            .unwrap();
        // Another address of the same IPv6 /64 is the same client.
        let e = t
            .allocate(&req("y", "x", 1), ip("2001:db8::ffff"), now, ports(0))
            .unwrap_err();
        assert!(e.to_string().contains("holds its maximum of 1"), "{e}");
        let e = t
            .allocate(&req("x", "z", 1), ip("192.0.2.4"), now, ports(7))
            .unwrap_err();
        assert!(e.to_string().contains("maximum of 2 allocations"), "{e}");
        t.datagram(g.id, 1, at(B, 2), 0, now).unwrap_err();
        assert!(t.datagram(g.id, 0, at(A, 1), 1400, now).is_ok());
        assert_eq!(t.datagram(g.id, 0, at(A, 1), 200, now), Err(Dropped::Rate));
        // 0.2 s refills 200 bytes.
        let later = now + Duration::from_millis(200);
        assert!(t.datagram(g.id, 0, at(A, 1), 200, later).is_ok());
    }

    #[test]
    fn a_cluster_and_the_descriptor_budget_cap_new_allocations() {
        let mut t = Table::new(RelayLimits {
            max_per_cluster: 1,
            max_fds: 5,
            ..RelayLimits::default()
        });
        let now = Instant::now();
        let in_cluster = |c: &str, me: &str| {
            PairRequest::new(c.into(), me.into(), "peer".into(), &[1; 32]).unwrap()
        };
        t.allocate(&in_cluster("c1", "a"), ip(A), now, ports(1))
            .unwrap();
        let e = t
            .allocate(&in_cluster("c1", "b"), ip(B), now, ports(3))
            .unwrap_err();
        assert!(
            e.to_string().contains("cluster holds its maximum of 1"),
            "{e}"
        );
        t.allocate(&in_cluster("c2", "a"), ip(A), now, ports(5))
            .unwrap();
        // Three allocations would take 6 descriptors.
        let e = t
            .allocate(&in_cluster("c3", "a"), ip(A), now, ports(7))
            .unwrap_err();
        assert!(
            e.to_string().contains("budget of 5 file descriptors"),
            "{e}"
        );
        // Expiry frees the cluster's share.
        assert_eq!(t.expire(now + Duration::from_secs(301)).len(), 2);
        t.allocate(&in_cluster("c1", "b"), ip(B), now, ports(9))
            .unwrap();
    }

    #[test]
    fn idle_allocations_expire_and_free_their_addresses() {
        let mut t = Table::new(RelayLimits {
            idle: Duration::from_secs(60),
            ..RelayLimits::default()
        });
        let now = Instant::now();
        let g = t.allocate(&req("a", "b", 1), ip(A), now, ports(1)).unwrap();
        t.allocate(&req("b", "a", 1), ip(B), now, ports(0)).unwrap();
        t.datagram(g.id, 1, at(B, 2), 10, now).unwrap_err();
        // Traffic keeps it alive.
        let t1 = now + Duration::from_secs(50);
        t.datagram(g.id, 0, at(A, 1), 10, t1).unwrap();
        assert!(t.expire(now + Duration::from_secs(100)).is_empty());
        assert_eq!(t.expire(t1 + Duration::from_secs(61)), [g.id]);
        assert!(t.is_empty() && t.per_address.is_empty());
        assert_eq!(t.datagram(g.id, 0, at(A, 1), 10, t1), Err(Dropped::Unknown));
        // The pair can allocate again, and gets a new allocation.
        let again = t.allocate(&req("a", "b", 1), ip(A), t1, ports(9)).unwrap();
        assert!(again.created && again.id != g.id);
    }
}
