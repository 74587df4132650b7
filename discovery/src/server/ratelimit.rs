//! Per-client-address token buckets with "wait, not reject" semantics (like Go's
//! `rate.Limiter.Wait`): a call takes a token if one is there, otherwise reserves the
//! next one and waits for it, unless that wait would outlast the call's deadline or
//! the bucket's debt cap. A caller that gives up while it waits hands its token back
//! ([`RateLimiter::refund`]). Pure: time is passed in.

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv6Addr},
    time::{Duration, Instant},
};

use super::error::RequestError;

/// Upstream refill rate, tokens per second.
pub const RATE: f64 = 15.0;
/// Upstream bucket capacity.
pub const BURST: f64 = 60.0;
/// Longest a caller may be made to wait: reservations beyond this much refill are
/// refused at once, so an address's debt (and a victim's lock-out, if someone spends
/// its tokens) never exceeds it.
pub const MAX_WAIT: Duration = Duration::from_secs(1);
/// Most buckets kept. A new address beyond it evicts the fullest buckets (the ones
/// that carry the least information), so memory stays bounded and no address shares
/// another's bucket.
pub const MAX_BUCKETS: usize = 100_000;

/// AffiliateDelete's own limit, per address: a node deletes its affiliate once, when
/// it leaves, so one a second with a burst of 5 never slows a real node, while a
/// stranger deleting a cluster's affiliates gets 1/15 of the update rate.
pub const DELETE_RATE: f64 = 1.0;
/// AffiliateDelete's burst (see [`DELETE_RATE`]).
pub const DELETE_BURST: f64 = 5.0;

#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// May go negative (down to the debt cap): reserved tokens that callers are
    /// waiting for.
    tokens: f64,
    last: Instant,
}

/// A token taken by [`RateLimiter::acquire`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// How long the caller must wait before proceeding (zero if a token was there).
    pub wait: Duration,
    /// Buckets evicted to make room for this caller's.
    pub evicted: usize,
}

/// Why [`RateLimiter::acquire`] refused a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// The wait would outlast the call's deadline.
    Deadline,
    /// The wait would exceed [`MAX_WAIT`].
    Debt,
}

impl Rejection {
    /// The metric label.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            Self::Deadline => "deadline",
            Self::Debt => "debt",
        }
    }
}

impl From<Rejection> for RequestError {
    fn from(rejection: Rejection) -> Self {
        match rejection {
            Rejection::Deadline => RequestError::RateLimited,
            Rejection::Debt => RequestError::RateLimitDebt,
        }
    }
}

/// Token buckets keyed by client address (IPv6 by its /64: one host's share).
#[derive(Debug)]
pub struct RateLimiter {
    rate: f64,
    burst: f64,
    max_buckets: usize,
    buckets: HashMap<IpAddr, Bucket>,
}

/// The bucket key of `ip`: IPv4 as is, IPv6 by its /64 (a host gets a whole /64, so
/// per-address buckets would give it 2^64 of them).
#[must_use]
pub fn bucket_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let prefix = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(Ipv6Addr::from(prefix))
        }
        v4 => v4,
    }
}

impl RateLimiter {
    /// A limiter refilling `rate` tokens per second up to `burst`.
    #[must_use]
    pub fn new(rate: f64, burst: f64) -> Self {
        Self::with_capacity(rate, burst, MAX_BUCKETS)
    }

    /// Like [`Self::new`], keeping at most `max_buckets` buckets.
    #[must_use]
    pub fn with_capacity(rate: f64, burst: f64, max_buckets: usize) -> Self {
        Self {
            rate,
            burst,
            max_buckets: max_buckets.max(1),
            buckets: HashMap::new(),
        }
    }

    /// The limiter of AffiliateDelete ([`DELETE_RATE`], [`DELETE_BURST`]).
    #[must_use]
    pub fn for_deletes() -> Self {
        Self::new(DELETE_RATE, DELETE_BURST)
    }

    /// Takes one token for `ip` at `now`.
    ///
    /// # Errors
    /// [`Rejection::Debt`] if the wait would exceed [`MAX_WAIT`], else
    /// [`Rejection::Deadline`] if `deadline` (time left for the call) is shorter than
    /// the wait; then nothing is consumed.
    pub fn acquire(
        &mut self,
        ip: IpAddr,
        now: Instant,
        deadline: Option<Duration>,
    ) -> Result<Grant, Rejection> {
        let key = bucket_key(ip);
        let tokens = match self.buckets.get_mut(&key) {
            Some(bucket) => refill(bucket, now, self.rate, self.burst),
            None => self.burst,
        } - 1.0;
        let wait = if tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-tokens / self.rate)
        };
        if wait > MAX_WAIT {
            return Err(Rejection::Debt);
        }
        if deadline.is_some_and(|d| wait > d) {
            return Err(Rejection::Deadline);
        }
        let evicted = if self.buckets.contains_key(&key) {
            0
        } else {
            self.make_room(now)
        };
        let bucket = self.buckets.entry(key).or_insert(Bucket {
            tokens: self.burst,
            last: now,
        });
        bucket.tokens = tokens;
        bucket.last = now.max(bucket.last);
        Ok(Grant { wait, evicted })
    }

    /// Gives back the token a caller of [`Self::acquire`] reserved and did not use
    /// (it gave up while waiting). Capped at the burst; nothing if the bucket is gone.
    pub fn refund(&mut self, ip: IpAddr, now: Instant) {
        let (rate, burst) = (self.rate, self.burst);
        if let Some(bucket) = self.buckets.get_mut(&bucket_key(ip)) {
            bucket.tokens = (refill(bucket, now, rate, burst) + 1.0).min(burst);
            bucket.last = now.max(bucket.last);
        }
    }

    /// With the table full: drops the buckets that are full again, then, if that
    /// freed nothing, the fullest eighth (least recently used among equals), so an
    /// eviction pass runs once per many new addresses. Returns how many were evicted
    /// (full buckets dropped are not evictions: they hold nothing).
    fn make_room(&mut self, now: Instant) -> usize {
        if self.buckets.len() < self.max_buckets {
            return 0;
        }
        self.cleanup(now);
        if self.buckets.len() < self.max_buckets {
            return 0;
        }
        let (rate, burst) = (self.rate, self.burst);
        let mut ranked: Vec<(f64, Instant, IpAddr)> = self
            .buckets
            .iter()
            .map(|(k, b)| (refill(&mut b.clone(), now, rate, burst), b.last, *k))
            .collect();
        let count = (self.max_buckets / 8).max(1);
        // Fullest first, then the least recently used.
        ranked.select_nth_unstable_by(count - 1, |a, b| {
            b.0.total_cmp(&a.0).then_with(|| a.1.cmp(&b.1))
        });
        for (_, _, key) in &ranked[..count] {
            self.buckets.remove(key);
        }
        count
    }

    /// Drops buckets that are full again (called every minute).
    pub fn cleanup(&mut self, now: Instant) {
        let (rate, burst) = (self.rate, self.burst);
        self.buckets
            .retain(|_, b| refill(&mut b.clone(), now, rate, burst) < burst);
    }

    /// Number of buckets held.
    #[must_use]
    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    /// Whether no bucket is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }
}

impl Default for RateLimiter {
    fn default() -> Self {
        Self::new(RATE, BURST)
    }
}

/// Tokens in `b` at `now` (without storing them).
fn refill(b: &mut Bucket, now: Instant, rate: f64, burst: f64) -> f64 {
    let elapsed = now.saturating_duration_since(b.last).as_secs_f64();
    (b.tokens + elapsed * rate).min(burst)
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));

    fn wait(rl: &mut RateLimiter, ip: IpAddr, now: Instant, d: Option<Duration>) -> Duration {
        rl.acquire(ip, now, d).unwrap().wait
    }

    #[test]
    fn burst_then_wait_then_reject_at_deadline() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::default();
        for _ in 0..60 {
            assert_eq!(
                wait(&mut rl, A, t0, Some(Duration::from_secs(1))),
                Duration::ZERO
            );
        }
        // 61st: one token arrives after 1/15 s; a 50 ms deadline is too short.
        assert_eq!(
            rl.acquire(A, t0, Some(Duration::from_millis(50))),
            Err(Rejection::Deadline)
        );
        // The rejection consumed nothing: the wait is still 1/15 s.
        let w = wait(&mut rl, A, t0, Some(Duration::from_secs(1)));
        assert!((w.as_secs_f64() - 1.0 / 15.0).abs() < 1e-6, "{w:?}");
        // Without a deadline the caller waits for the reserved token: 2/15 s now.
        let w = wait(&mut rl, A, t0, None);
        assert!((w.as_secs_f64() - 2.0 / 15.0).abs() < 1e-6, "{w:?}");
        // Other addresses have their own bucket.
        assert_eq!(wait(&mut rl, B, t0, Some(Duration::ZERO)), Duration::ZERO);
    }

    #[test]
    fn debt_is_capped_at_one_second_and_rejections_consume_nothing() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::default();
        for _ in 0..60 + 15 {
            rl.acquire(A, t0, None).unwrap();
        }
        // The 76th would wait 16/15 s: refused at once, even without a deadline.
        for _ in 0..1000 {
            assert_eq!(rl.acquire(A, t0, None), Err(Rejection::Debt));
        }
        // One second later the debt is paid and a token is there again.
        let t1 = t0 + Duration::from_secs(1) + Duration::from_millis(70);
        assert_eq!(wait(&mut rl, A, t1, Some(Duration::ZERO)), Duration::ZERO);
    }

    #[test]
    fn refunded_reservations_are_given_back() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::default();
        for _ in 0..60 {
            rl.acquire(A, t0, None).unwrap();
        }
        // 1,500 callers reserve and give up: each hands its token back.
        for _ in 0..1500 {
            assert!(rl.acquire(A, t0, None).unwrap().wait > Duration::ZERO);
            rl.refund(A, t0);
        }
        let w = wait(&mut rl, A, t0, None);
        assert!((w.as_secs_f64() - 1.0 / 15.0).abs() < 1e-6, "{w:?}");
        // A refund never lifts a bucket above its burst.
        let later = t0 + Duration::from_secs(3600);
        rl.refund(A, later);
        for _ in 0..60 {
            assert_eq!(
                wait(&mut rl, A, later, Some(Duration::ZERO)),
                Duration::ZERO
            );
        }
        assert!(rl.acquire(A, later, Some(Duration::ZERO)).is_err());
    }

    #[test]
    fn refills_at_rate_up_to_burst() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::new(1.0, 60.0);
        for _ in 0..60 {
            rl.acquire(A, t0, Some(Duration::ZERO)).unwrap();
        }
        assert!(rl.acquire(A, t0, Some(Duration::from_millis(999))).is_err());
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(wait(&mut rl, A, t1, Some(Duration::ZERO)), Duration::ZERO);
        assert!(rl.acquire(A, t1, Some(Duration::ZERO)).is_err());
        // After a long pause the bucket holds `burst`, not more.
        let t2 = t1 + Duration::from_secs(3600);
        for _ in 0..60 {
            rl.acquire(A, t2, Some(Duration::ZERO)).unwrap();
        }
        assert!(rl.acquire(A, t2, Some(Duration::ZERO)).is_err());
    }

    #[test]
    fn cleanup_drops_only_full_buckets() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::default();
        rl.acquire(A, t0, None).unwrap();
        rl.acquire(B, t0 + Duration::from_secs(10), None).unwrap();
        // A is full again 1/15 s after its call; B at t0 + 10 s has just used a token.
        rl.cleanup(t0 + Duration::from_secs(10));
        assert_eq!(rl.len(), 1);
        rl.cleanup(t0 + Duration::from_secs(11));
        assert!(rl.is_empty());
    }

    #[test]
    fn a_full_table_evicts_the_fullest_instead_of_sharing_a_bucket() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::with_capacity(1.0, 3.0, 80);
        // The victim spends its whole burst; 79 others take one token each.
        for _ in 0..3 {
            rl.acquire(A, t0, Some(Duration::ZERO)).unwrap();
        }
        for i in 0..79u32 {
            rl.acquire(IpAddr::V4((0x0b00_0000 + i).into()), t0, None)
                .unwrap();
        }
        assert_eq!(rl.len(), 80);
        // Newcomers evict the fullest (not the victim, which is empty) and each get
        // their own full bucket.
        let mut evicted = 0;
        for i in 0..1000u32 {
            let ip = IpAddr::V4((0x0c00_0000 + i).into());
            let grant = rl.acquire(ip, t0, Some(Duration::ZERO)).unwrap();
            evicted += grant.evicted;
            assert!(rl.len() <= 80);
        }
        assert!(evicted >= 1000 - 80, "{evicted}");
        assert!(rl.acquire(A, t0, Some(Duration::ZERO)).is_err());
    }

    #[test]
    fn ipv6_is_limited_per_64() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::new(1.0, 1.0);
        rl.acquire("2001:db8::1".parse().unwrap(), t0, None)
            .unwrap();
        assert!(rl
            .acquire(
                "2001:db8::ffff:2".parse().unwrap(),
                t0,
                Some(Duration::ZERO)
            )
            .is_err());
        rl.acquire("2001:db8:0:1::1".parse().unwrap(), t0, Some(Duration::ZERO))
            .unwrap();
    }
}
