//! Handshake load control, sans-IO: when the device counts as under load, and how
//! many handshake messages one source may have handled a second then. As in the
//! kernel and wireguard-go, load is a backlog of handshake messages (with a second of
//! hysteresis), and under load each source (an IPv4 address, an IPv6 /64) gets 20
//! handshakes a second with a burst of 5, after its cookie proved the address. Beyond
//! them, more than [`UNCHALLENGED_PER_SECOND`] handshake messages in a second also
//! count as load (no backlog builds while the reader keeps up, at a Diffie-Hellman
//! per message), and cookie replies themselves are held to the same per-source rate
//! while the source table has room.

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
/// Handshake messages a second the device takes without cookies. A mesh of 10,000
/// peers rekeys about 85 a second; a flood is many times this.
pub const UNCHALLENGED_PER_SECOND: usize = 1_000;

const NANOS_PER_PACKET: u64 = 1_000_000_000 / PACKETS_PER_SECOND;
const BUCKET_NANOS: u64 = NANOS_PER_PACKET * PACKETS_BURSTABLE;
/// Idle sources are forgotten after this long (their bucket is full again by then).
const SOURCE_IDLE: Duration = Duration::from_secs(1);

/// Whether the device is under load.
#[derive(Debug, Default, Clone, Copy)]
pub struct Load {
    until: Option<Instant>,
    /// Messages counted in the second that began at `window`.
    window: Option<Instant>,
    in_window: usize,
}

impl Load {
    /// Takes a batch of `batch` handshake messages (`backlog`: more were waiting
    /// behind it, the receive queue is not keeping up) and answers whether the device
    /// is under load: a backlog, or more than [`UNCHALLENGED_PER_SECOND`] messages
    /// within a second, and for [`UNDER_LOAD_AFTER`] after either.
    pub fn under_load(&mut self, batch: usize, backlog: bool, now: Instant) -> bool {
        if self
            .window
            .is_none_or(|w| now.saturating_duration_since(w) >= Duration::from_secs(1))
        {
            self.window = Some(now);
            self.in_window = 0;
        }
        self.in_window += batch;
        if backlog || self.in_window > UNCHALLENGED_PER_SECOND {
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
    /// True when `ip` may have one more handshake message handled now; a new source
    /// while [`MAX_SOURCES`] are tracked may not.
    pub fn allow(&mut self, ip: IpAddr, now: Instant) -> bool {
        self.take(ip, now, false)
    }

    /// As [`Self::allow`], but a source the full table cannot track is allowed: for
    /// cookie replies, which a flood from more sources than that must not deny to
    /// every newcomer.
    pub fn allow_untracked(&mut self, ip: IpAddr, now: Instant) -> bool {
        self.take(ip, now, true)
    }

    fn take(&mut self, ip: IpAddr, now: Instant, when_full: bool) -> bool {
        self.sweep(now);
        let key = source_key(ip);
        if !self.buckets.contains_key(&key) && self.buckets.len() >= MAX_SOURCES {
            return when_full;
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
    fn load_holds_a_second_after_the_backlog_clears() {
        let now = Instant::now();
        let mut load = Load::default();
        assert!(!load.under_load(1, false, now));
        assert!(load.under_load(64, true, now));
        assert!(load.under_load(1, false, now + Duration::from_millis(999)));
        assert!(!load.under_load(1, false, now + UNDER_LOAD_AFTER));
    }

    #[test]
    fn more_than_a_thousand_messages_in_a_second_are_load_without_a_backlog() {
        let now = Instant::now();
        let mut load = Load::default();
        // 64 a batch, every 60 ms: about 1,070 a second, each batch all there was.
        let mut t = now;
        let mut first_loaded = None;
        for i in 0..40 {
            if load.under_load(64, false, t) && first_loaded.is_none() {
                first_loaded = Some(i);
            }
            t += Duration::from_millis(60);
        }
        assert_eq!(
            first_loaded,
            Some(15),
            "the 16th batch passes 1,000 within the second"
        );
        // A steady 500 a second is not load.
        let mut calm = Load::default();
        let loaded =
            (0..100).any(|i| calm.under_load(50, false, now + Duration::from_millis(100 * i)));
        assert!(!loaded);
    }

    #[test]
    fn a_full_table_refuses_new_sources_their_handshakes_but_not_their_cookies() {
        let now = Instant::now();
        let mut l = SourceLimiter::default();
        for i in 0..MAX_SOURCES as u32 {
            assert!(l.allow(IpAddr::V4(i.into()), now));
        }
        let newcomer: IpAddr = "255.255.255.255".parse().unwrap();
        assert!(!l.allow(newcomer, now));
        assert!(l.allow_untracked(newcomer, now));
    }
}
