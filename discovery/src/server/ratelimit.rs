//! Per-client-address token buckets with "wait, not reject" semantics (like Go's
//! `rate.Limiter.Wait`): a call takes a token if one is there, otherwise reserves the
//! next one and waits for it, unless that wait would outlast the call's deadline.
//! Pure: time is passed in.

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
/// Most buckets kept. Beyond it (spoofed headers from many "addresses" within one
/// cleanup period) new addresses share one overflow bucket, so memory stays bounded.
pub const MAX_BUCKETS: usize = 100_000;

/// Key of the shared overflow bucket (an address no client can have).
const OVERFLOW: IpAddr = IpAddr::V6(Ipv6Addr::UNSPECIFIED);

#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// May go negative: reserved tokens that callers are waiting for.
    tokens: f64,
    last: Instant,
}

/// Token buckets keyed by client address.
#[derive(Debug)]
pub struct RateLimiter {
    rate: f64,
    burst: f64,
    buckets: HashMap<IpAddr, Bucket>,
}

impl RateLimiter {
    /// A limiter refilling `rate` tokens per second up to `burst`.
    #[must_use]
    pub fn new(rate: f64, burst: f64) -> Self {
        Self {
            rate,
            burst,
            buckets: HashMap::new(),
        }
    }

    /// Takes one token for `key` at `now`. Returns how long the caller must wait
    /// before proceeding (zero if a token was there).
    ///
    /// # Errors
    /// [`RequestError::RateLimited`] if `deadline` (time left for the call) is shorter
    /// than the wait; then nothing is consumed.
    pub fn acquire(
        &mut self,
        key: IpAddr,
        now: Instant,
        deadline: Option<Duration>,
    ) -> Result<Duration, RequestError> {
        let key = if self.buckets.len() >= MAX_BUCKETS && !self.buckets.contains_key(&key) {
            OVERFLOW
        } else {
            key
        };
        let (rate, burst) = (self.rate, self.burst);
        let bucket = self.buckets.entry(key).or_insert(Bucket {
            tokens: burst,
            last: now,
        });
        let tokens = refill(bucket, now, rate, burst) - 1.0;
        let wait = if tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-tokens / rate)
        };
        if deadline.is_some_and(|d| wait > d) {
            return Err(RequestError::RateLimited);
        }
        bucket.tokens = tokens;
        bucket.last = now.max(bucket.last);
        Ok(wait)
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

    #[test]
    fn burst_then_wait_then_reject_at_deadline() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::default();
        for _ in 0..60 {
            assert_eq!(
                rl.acquire(A, t0, Some(Duration::from_secs(1))),
                Ok(Duration::ZERO)
            );
        }
        // 61st: one token arrives after 1/15 s; a 50 ms deadline is too short.
        assert_eq!(
            rl.acquire(A, t0, Some(Duration::from_millis(50))),
            Err(RequestError::RateLimited)
        );
        // The rejection consumed nothing: the wait is still 1/15 s.
        let wait = rl.acquire(A, t0, Some(Duration::from_secs(1))).unwrap();
        assert!((wait.as_secs_f64() - 1.0 / 15.0).abs() < 1e-6, "{wait:?}");
        // Without a deadline the caller waits for the reserved token: 2/15 s now.
        let wait = rl.acquire(A, t0, None).unwrap();
        assert!((wait.as_secs_f64() - 2.0 / 15.0).abs() < 1e-6, "{wait:?}");
        // Other addresses have their own bucket.
        assert_eq!(rl.acquire(B, t0, Some(Duration::ZERO)), Ok(Duration::ZERO));
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
        assert_eq!(rl.acquire(A, t1, Some(Duration::ZERO)), Ok(Duration::ZERO));
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
    fn bucket_count_is_bounded() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::new(1.0, 1.0);
        for i in 0..(MAX_BUCKETS as u32 + 10) {
            let _ = rl.acquire(IpAddr::V4(i.into()), t0, Some(Duration::ZERO));
        }
        assert_eq!(rl.len(), MAX_BUCKETS + 1);
    }
}
