//! Handshake load control, sans-IO: when the device counts as under load, and how
//! many handshake messages one source may have handled a second then. As in the
//! kernel and wireguard-go: load is the handshake queue's depth (with a second of
//! hysteresis), and under load each source (an IPv4 address, an IPv6 /64) gets 20
//! handshakes a second with a burst of 5, after its cookie proved the address.

use std::{
    collections::HashMap,
    net::IpAddr,
    time::{Duration, Instant},
};

/// Handshake messages a source may have handled per second under load.
pub const PACKETS_PER_SECOND: u64 = 20;
/// The burst a source may send at once.
pub const PACKETS_BURSTABLE: u64 = 5;
/// Sources tracked at most; a new source beyond it is refused until the table ages.
pub const MAX_SOURCES: usize = 1 << 16;
/// The device stays under load this long after the queue drained below the mark.
pub const UNDER_LOAD_AFTER: Duration = Duration::from_secs(1);

const NANOS_PER_PACKET: u64 = 1_000_000_000 / PACKETS_PER_SECOND;
const BUCKET_NANOS: u64 = NANOS_PER_PACKET * PACKETS_BURSTABLE;
/// Idle sources are forgotten after this long (their bucket is full again by then).
const SOURCE_IDLE: Duration = Duration::from_secs(1);

/// Whether the device is under load.
#[derive(Debug, Default, Clone, Copy)]
pub struct Load {
    until: Option<Instant>,
}

impl Load {
    /// Updates the state with the handshake queue's depth and answers whether the
    /// device is under load: at an eighth of the queue's capacity, and for
    /// [`UNDER_LOAD_AFTER`] after that.
    pub fn under_load(&mut self, queued: usize, capacity: usize, now: Instant) -> bool {
        if queued >= (capacity / 8).max(1) {
            self.until = Some(now + UNDER_LOAD_AFTER);
            return true;
        }
        self.until.is_some_and(|u| now < u)
    }
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: u64,
    last: Instant,
}

/// A token bucket per source.
#[derive(Debug, Default)]
pub struct SourceLimiter {
    buckets: HashMap<SourceKey, Bucket>,
    last_sweep: Option<Instant>,
}

/// An IPv4 address, or an IPv6 address's /64 (one host often has a whole /64).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum SourceKey {
    V4([u8; 4]),
    V6([u8; 8]),
}

fn source_key(ip: IpAddr) -> SourceKey {
    match ip {
        IpAddr::V4(v4) => SourceKey::V4(v4.octets()),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => SourceKey::V4(v4.octets()),
            None => SourceKey::V6(v6.octets()[..8].try_into().expect("8 bytes")),
        },
    }
}

impl SourceLimiter {
    /// True when `ip` may have one more handshake message handled now.
    pub fn allow(&mut self, ip: IpAddr, now: Instant) -> bool {
        self.sweep(now);
        let key = source_key(ip);
        if !self.buckets.contains_key(&key) && self.buckets.len() >= MAX_SOURCES {
            return false;
        }
        let bucket = self.buckets.entry(key).or_insert(Bucket {
            tokens: BUCKET_NANOS,
            last: now,
        });
        let elapsed = u64::try_from(now.saturating_duration_since(bucket.last).as_nanos())
            .unwrap_or(u64::MAX);
        bucket.tokens = bucket.tokens.saturating_add(elapsed).min(BUCKET_NANOS);
        bucket.last = now;
        if bucket.tokens >= NANOS_PER_PACKET {
            bucket.tokens -= NANOS_PER_PACKET;
            true
        } else {
            false
        }
    }

    /// Forgets sources idle for a second, at most once a second.
    fn sweep(&mut self, now: Instant) {
        if self
            .last_sweep
            .is_some_and(|t| now.saturating_duration_since(t) < SOURCE_IDLE)
        {
            return;
        }
        self.last_sweep = Some(now);
        self.buckets
            .retain(|_, b| now.saturating_duration_since(b.last) < SOURCE_IDLE);
    }

    /// Sources tracked now.
    pub fn sources(&self) -> usize {
        self.buckets.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_gets_its_burst_then_twenty_a_second() {
        let now = Instant::now();
        let mut l = SourceLimiter::default();
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        let allowed = (0..20).filter(|_| l.allow(ip, now)).count();
        assert_eq!(allowed as u64, PACKETS_BURSTABLE);
        let other: IpAddr = "192.0.2.2".parse().unwrap();
        assert!(l.allow(other, now), "another source has its own bucket");
        // Over one second, one more every 50 ms.
        let allowed = (1..=100)
            .filter(|i| l.allow(ip, now + Duration::from_millis(10 * i)))
            .count();
        assert_eq!(allowed as u64, PACKETS_PER_SECOND);
    }

    #[test]
    fn an_ipv6_64_is_one_source_and_idle_sources_are_forgotten() {
        let now = Instant::now();
        let mut l = SourceLimiter::default();
        for i in 0..10u16 {
            let ip = IpAddr::V6(std::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 1, 0, 0, 0, i));
            l.allow(ip, now);
        }
        assert_eq!(l.sources(), 1);
        l.allow("192.0.2.1".parse().unwrap(), now + SOURCE_IDLE);
        assert_eq!(l.sources(), 1, "the IPv6 source was swept");
    }

    #[test]
    fn load_holds_a_second_after_the_queue_drains() {
        let now = Instant::now();
        let mut load = Load::default();
        assert!(!load.under_load(10, 4096, now));
        assert!(load.under_load(512, 4096, now));
        assert!(load.under_load(0, 4096, now + Duration::from_millis(999)));
        assert!(!load.under_load(0, 4096, now + UNDER_LOAD_AFTER));
    }
}
