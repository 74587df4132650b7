//! The transport's limits and the connection counts they are checked against,
//! without I/O.

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv6Addr},
    time::Duration,
};

/// Limits of both listeners' connections and of the gRPC port's HTTP/2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransportLimits {
    /// Most open gRPC connections (admitted, handshaking or serving).
    pub max_connections: usize,
    /// Most open connections from one address (an IPv6 client counts by its /64), on
    /// each port.
    pub max_connections_per_ip: usize,
    /// Time from accept to the end of the TLS handshake and the HTTP/2 preface (gRPC
    /// port), or to the end of each request's headers (metrics port).
    pub handshake_timeout: Duration,
    /// Time a gRPC call may take until its handler answers: the whole of a unary call,
    /// and for Watch only the request (its stream then lives on).
    pub request_timeout: Duration,
    /// HTTP/2 `SETTINGS_MAX_CONCURRENT_STREAMS` (Watch streams count).
    pub max_concurrent_streams: u32,
    /// Largest gRPC request message (the largest legitimate one is ~4.7 KB).
    pub max_request_bytes: usize,
}

/// Default of [`TransportLimits::max_connections_per_ip`]: a site of a few hundred
/// nodes behind one NAT address fits (each node holds one connection).
pub const MAX_CONNECTIONS_PER_IP: usize = 256;

impl Default for TransportLimits {
    fn default() -> Self {
        Self {
            max_connections: 16_384,
            max_connections_per_ip: MAX_CONNECTIONS_PER_IP,
            handshake_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(10),
            max_concurrent_streams: 100,
            max_request_bytes: 64 << 10,
        }
    }
}

/// HTTP/2 flow-control windows and frame limits of the gRPC port: with them, what a
/// connection can make the server buffer is bounded by the streams it may open times
/// the request cap (tonic's decode buffer) plus one connection window.
pub(crate) const STREAM_WINDOW: u32 = 64 << 10;
pub(crate) const CONNECTION_WINDOW: u32 = 1 << 20;
pub(crate) const MAX_FRAME: u32 = 16 << 10;
pub(crate) const MAX_HEADER_LIST: u32 = 16 << 10;

/// Total connections of the metrics/pages port (a scraper and a few browsers).
pub const WEB_MAX_CONNECTIONS: usize = 256;

/// Descriptors kept for everything but connections and relay sockets: listeners, the
/// snapshot file, the runtime, logs.
pub const BASE_FDS: usize = 64;

/// Why a connection was refused at accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Its address holds its maximum.
    PerIp,
    /// The listener holds its maximum.
    Total,
}

impl Refused {
    /// As a metric label.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PerIp => "per_ip",
            Self::Total => "total",
        }
    }
}

/// What a client is counted by: its IPv4 address, or its IPv6 /64 (one host can hold
/// a whole /64).
#[must_use]
pub fn ip_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let s = v6.segments();
            IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
        v4 => v4,
    }
}

/// Open connections of one listener, by client.
#[derive(Debug)]
pub struct ConnectionCounts {
    max_total: usize,
    max_per_ip: usize,
    per_ip: HashMap<IpAddr, usize>,
    total: usize,
}

impl ConnectionCounts {
    /// No connection yet.
    #[must_use]
    pub fn new(max_total: usize, max_per_ip: usize) -> Self {
        Self {
            max_total,
            max_per_ip,
            per_ip: HashMap::new(),
            total: 0,
        }
    }

    /// Counts a new connection from `ip`, or says why it is refused.
    ///
    /// # Errors
    /// The cap it would exceed.
    pub fn admit(&mut self, ip: IpAddr) -> Result<(), Refused> {
        if self.total >= self.max_total {
            return Err(Refused::Total);
        }
        let n = self.per_ip.entry(ip_key(ip)).or_default();
        if *n >= self.max_per_ip {
            return Err(Refused::PerIp);
        }
        *n += 1;
        self.total += 1;
        Ok(())
    }

    /// A connection from `ip` closed.
    pub fn release(&mut self, ip: IpAddr) {
        let key = ip_key(ip);
        if let Some(n) = self.per_ip.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                self.per_ip.remove(&key);
            }
            self.total -= 1;
        }
    }

    /// Open connections.
    #[must_use]
    pub fn total(&self) -> usize {
        self.total
    }
}

/// How the descriptor limit is shared between connections and relay sockets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdPlan {
    /// Cap on gRPC connections (the configured one, lowered to fit).
    pub connections: usize,
    /// Cap on metrics-port connections.
    pub web: usize,
    /// Descriptors the relay may hold (two per allocation).
    pub relay: usize,
}

impl FdPlan {
    /// [`BASE_FDS`] and the metrics port are set aside (each at most an eighth of a
    /// small limit); gRPC connections get what they are configured for, but with the
    /// relay on at most half of the rest; the relay gets what is left. `nofile` is the
    /// soft `RLIMIT_NOFILE` (`None`: unknown, nothing is lowered).
    #[must_use]
    pub fn new(nofile: Option<u64>, max_connections: usize, relay: bool) -> Self {
        let Some(nofile) = nofile.map(|n| usize::try_from(n).unwrap_or(usize::MAX)) else {
            return Self {
                connections: max_connections,
                web: WEB_MAX_CONNECTIONS,
                relay: if relay { usize::MAX } else { 0 },
            };
        };
        let base = BASE_FDS.min(nofile / 8);
        let web = WEB_MAX_CONNECTIONS.min(nofile / 8);
        let rest = nofile - base - web;
        let connections = if relay {
            max_connections.min(rest / 2)
        } else {
            max_connections.min(rest)
        };
        Self {
            connections: connections.max(1),
            web: web.max(1),
            relay: if relay { rest - connections } else { 0 },
        }
    }
}

/// The soft `RLIMIT_NOFILE` from `/proc/self/limits`.
#[must_use]
pub fn nofile_limit() -> Option<u64> {
    parse_nofile(&std::fs::read_to_string("/proc/self/limits").ok()?)
}

fn parse_nofile(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let soft = line
        .trim_start_matches("Max open files")
        .split_whitespace()
        .next()?;
    // "unlimited" is not possible for descriptors; treat it as no known limit.
    soft.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_count_per_address_and_in_total_and_free_on_release() {
        let mut c = ConnectionCounts::new(3, 2);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        c.admit(a).unwrap();
        c.admit(a).unwrap();
        assert_eq!(c.admit(a), Err(Refused::PerIp));
        c.admit(b).unwrap();
        assert_eq!(c.admit("192.0.2.3".parse().unwrap()), Err(Refused::Total));
        c.release(a);
        c.admit("::ffff:192.0.2.1".parse().unwrap()).unwrap();
        assert_eq!(c.total(), 3);
        // Releasing an address never admitted changes nothing.
        c.release("192.0.2.9".parse().unwrap());
        assert_eq!(c.total(), 3);
    }

    #[test]
    fn ipv6_clients_count_by_their_64() {
        let mut c = ConnectionCounts::new(10, 1);
        c.admit("2001:db8:1:2::1".parse().unwrap()).unwrap();
        assert_eq!(
            c.admit("2001:db8:1:2:ffff::9".parse().unwrap()),
            Err(Refused::PerIp)
        );
        c.admit("2001:db8:1:3::1".parse().unwrap()).unwrap();
    }

    #[test]
    fn the_descriptor_limit_is_shared_and_a_small_one_split() {
        let plan = FdPlan::new(Some(65_536), 16_384, true);
        assert_eq!((plan.connections, plan.web), (16_384, WEB_MAX_CONNECTIONS));
        assert_eq!(plan.relay, 65_536 - 16_384 - WEB_MAX_CONNECTIONS - BASE_FDS);
        let small = FdPlan::new(Some(1024), 16_384, true);
        assert_eq!((small.connections, small.web, small.relay), (416, 128, 416));
        let no_relay = FdPlan::new(Some(1024), 16_384, false);
        assert_eq!((no_relay.connections, no_relay.relay), (832, 0));
        assert_eq!(FdPlan::new(None, 7, true).connections, 7);
        assert_eq!(FdPlan::new(Some(8), 7, true).connections, 3);
        assert_eq!(FdPlan::new(Some(1), 7, true).connections, 1);
    }

    #[test]
    fn the_soft_descriptor_limit_is_read() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max cpu time              unlimited            unlimited            seconds\n\
                      Max open files            1024                 524288               files\n";
        assert_eq!(parse_nofile(limits), Some(1024));
        assert_eq!(parse_nofile("Max cpu time unlimited"), None);
        assert!(nofile_limit().is_some());
    }
}
