//! Reconnect backoff with the defaults of `cenkalti/backoff` v4, which the upstream
//! client uses (docs/discovery-protocol.md §8.6): start at 0.5 s, randomise ±50 %, grow ×1.5
//! up to 60 s, never give up. The control runtime restarts failed controllers on the
//! same schedule with this same type (`wirespan_control::runtime::backoff`).

use std::time::Duration;

use rand::Rng;

/// First interval.
pub const INITIAL_INTERVAL: Duration = Duration::from_millis(500);
/// Growth factor per attempt.
pub const MULTIPLIER: f64 = 1.5;
/// Jitter: each delay is drawn from `interval × [1 − r, 1 + r]`.
pub const RANDOMIZATION: f64 = 0.5;
/// Cap of the (un-jittered) interval; jittered delays can reach 1.5 × this.
pub const MAX_INTERVAL: Duration = Duration::from_secs(60);

/// Exponential backoff state. Pure: randomness comes from the caller.
#[derive(Debug, Clone, PartialEq)]
pub struct Backoff {
    interval: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

impl Backoff {
    /// A fresh backoff at the initial interval.
    #[must_use]
    pub fn new() -> Self {
        Self {
            interval: INITIAL_INTERVAL,
        }
    }

    /// The interval the next delay is drawn around.
    #[must_use]
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Next delay, using `unit` ∈ [0, 1] as the random draw (0 gives the lower
    /// bound, 1 the upper), then grows the interval.
    pub fn next_with(&mut self, unit: f64) -> Duration {
        let unit = unit.clamp(0.0, 1.0);
        let iv = self.interval.as_secs_f64();
        let low = iv * (1.0 - RANDOMIZATION);
        let high = iv * (1.0 + RANDOMIZATION);
        let delay = Duration::from_secs_f64(low + unit * (high - low));
        self.interval = Duration::from_secs_f64(iv * MULTIPLIER).min(MAX_INTERVAL);
        delay
    }

    /// Next delay with a uniform draw from `rng`, then grows the interval.
    pub fn next(&mut self, rng: &mut impl Rng) -> Duration {
        self.next_with(rng.gen_range(0.0..=1.0))
    }

    /// Back to the initial interval (after a successful refresh).
    pub fn reset(&mut self) {
        self.interval = INITIAL_INTERVAL;
    }
}

#[cfg(test)]
mod tests {
    use rand::{rngs::StdRng, SeedableRng};

    use super::*;

    fn ms(d: Duration) -> u128 {
        d.as_millis()
    }

    #[test]
    fn bounds_grow_by_one_and_a_half() {
        let mut low = Backoff::new();
        let mut high = Backoff::new();
        let mut mid = Backoff::new();
        let lows: Vec<u128> = (0..4).map(|_| ms(low.next_with(0.0))).collect();
        let highs: Vec<u128> = (0..4).map(|_| ms(high.next_with(1.0))).collect();
        let mids: Vec<u128> = (0..4).map(|_| ms(mid.next_with(0.5))).collect();
        assert_eq!(lows, vec![250, 375, 562, 843]);
        assert_eq!(highs, vec![750, 1125, 1687, 2531]);
        assert_eq!(mids, vec![500, 750, 1125, 1687]);
    }

    #[test]
    fn capped_at_sixty_seconds_with_jitter_up_to_ninety() {
        let mut b = Backoff::new();
        for _ in 0..30 {
            b.next_with(0.5);
        }
        assert_eq!(b.interval(), MAX_INTERVAL);
        assert_eq!(b.clone().next_with(1.0), Duration::from_secs(90));
        assert_eq!(b.clone().next_with(0.0), Duration::from_secs(30));
        b.next_with(0.3);
        assert_eq!(b.interval(), MAX_INTERVAL, "never grows past the cap");
    }

    #[test]
    fn reset_returns_to_initial() {
        let mut b = Backoff::new();
        b.next_with(0.5);
        b.next_with(0.5);
        b.reset();
        assert_eq!(b.next_with(0.5), INITIAL_INTERVAL);
    }

    #[test]
    fn random_draws_stay_in_range() {
        let mut rng = StdRng::seed_from_u64(42);
        let mut b = Backoff::new();
        let mut seen_below = false;
        let mut seen_above = false;
        for _ in 0..200 {
            let iv = b.interval();
            let d = b.next(&mut rng);
            assert!(
                d >= iv / 2 && d <= iv * 3 / 2,
                "{d:?} outside ±50 % of {iv:?}"
            );
            seen_below |= d < iv;
            seen_above |= d > iv;
            if b.interval() == MAX_INTERVAL {
                b.reset();
            }
        }
        assert!(seen_below && seen_above, "jitter must go both ways");
    }
}
