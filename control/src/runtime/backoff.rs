//! Controller restart backoff (`docs/runtime.md` §3.5), as a pure function of a jitter sample.

use std::time::Duration;

/// First restart interval.
pub const INITIAL_INTERVAL: Duration = Duration::from_millis(500);
/// Growth per restart.
pub const MULTIPLIER: f64 = 1.5;
/// Cap of the (un-jittered) interval; the jittered delay can reach 1.5 × this.
pub const MAX_INTERVAL: Duration = Duration::from_secs(60);

/// Exponential backoff with ±50 % jitter; never gives up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    interval: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            interval: INITIAL_INTERVAL,
        }
    }
}

impl Backoff {
    /// The un-jittered interval the next delay is drawn around.
    #[must_use]
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// The next delay for a jitter sample `unit` in `[0, 1]`: uniform in
    /// `[0.5·i, 1.5·i]`; then the interval grows ×1.5 up to [`MAX_INTERVAL`].
    pub fn next_delay(&mut self, unit: f64) -> Duration {
        let i = self.interval;
        let delay = i.mul_f64(0.5 + unit.clamp(0.0, 1.0));
        self.interval = i.mul_f64(MULTIPLIER).min(MAX_INTERVAL);
        delay
    }

    /// The next delay with jitter drawn from `rng`.
    pub fn next_delay_rng(&mut self, rng: &mut impl rand::Rng) -> Duration {
        self.next_delay(rng.gen_range(0.0..=1.0))
    }

    /// Back to the initial interval.
    pub fn reset(&mut self) {
        self.interval = INITIAL_INTERVAL;
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn grows_by_half_with_jitter_bounds_and_cap() {
        let mut b = Backoff::default();
        assert_eq!(b.next_delay(0.5), Duration::from_millis(500));
        assert_eq!(b.next_delay(0.0), Duration::from_millis(375));
        assert_eq!(b.next_delay(1.0), Duration::from_micros(1_687_500));
        for _ in 0..30 {
            b.next_delay(0.5);
        }
        assert_eq!(b.interval(), MAX_INTERVAL);
        assert_eq!(b.next_delay(1.0), Duration::from_secs(90));
        assert_eq!(b.next_delay(0.0), Duration::from_secs(30));
        b.reset();
        assert_eq!(b.interval(), INITIAL_INTERVAL);
    }

    #[test]
    fn seeded_rng_stays_within_jitter_window() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut b = Backoff::default();
        for _ in 0..50 {
            let i = b.interval();
            let d = b.next_delay_rng(&mut rng);
            assert!(d >= i.mul_f64(0.5) && d <= i.mul_f64(1.5), "{d:?} vs {i:?}");
        }
    }
}
