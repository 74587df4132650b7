//! Peer state, endpoint pick and the per-peer reconcile step (`docs/kubespan.md` §8), pure: the
//! time is passed in.

use std::{
    net::SocketAddr,
    time::{Duration, SystemTime},
};

use crate::{kubespan::peer_status::PeerStatus, resources::kubespan::PeerState};

/// How long a fresh endpoint has to produce a handshake.
pub const ENDPOINT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(15);
pub use crate::config::kubespan::PEER_DOWN_INTERVAL;
/// How long a wirespan peer that was sent a probe has to answer: WireGuard sends a
/// keepalive at the latest 10 s after it received data without sending any
/// (`KEEPALIVE_TIMEOUT`, kernel and wireguard-go alike), plus a margin for latency.
pub const PROBE_GRACE: Duration = Duration::from_secs(12);
/// How long a peer whose kernel is known to answer the probe has to answer: the
/// ICMPv6 error comes back at once, through the tunnel; the rest is a margin for a
/// loaded host.
pub const REPLY_PROBE_GRACE: Duration = Duration::from_secs(2);
/// WireGuard's session lifetime (`REJECT_AFTER_TIME`): no data is accepted on keys
/// older than this.
pub const REJECT_AFTER_TIME: Duration = Duration::from_secs(180);
/// The reconcile tick.
pub const RECONCILE_TICK: Duration = Duration::from_secs(30);

fn since(now: SystemTime, t: Option<SystemTime>) -> Duration {
    now.duration_since(t.unwrap_or(SystemTime::UNIX_EPOCH))
        .unwrap_or_default()
}

/// The state of a peer (§8.3); `down_interval` is the configured peer-down interval
/// ([`PEER_DOWN_INTERVAL`] by default).
#[must_use]
pub fn peer_state(
    now: SystemTime,
    last_handshake: Option<SystemTime>,
    last_endpoint_change: Option<SystemTime>,
    last_used_endpoint: Option<SocketAddr>,
    down_interval: Duration,
) -> PeerState {
    let since_hs = since(now, last_handshake);
    let since_ec = since(now, last_endpoint_change);
    let hs_after = last_handshake.unwrap_or(SystemTime::UNIX_EPOCH)
        > last_endpoint_change.unwrap_or(SystemTime::UNIX_EPOCH);
    let state = if since_ec > down_interval {
        if since_hs < down_interval {
            PeerState::Up
        } else {
            PeerState::Down
        }
    } else if since_ec < ENDPOINT_CONNECTION_TIMEOUT {
        if hs_after {
            PeerState::Up
        } else {
            PeerState::Unknown
        }
    } else if hs_after {
        PeerState::Up
    } else {
        PeerState::Down
    };
    if state == PeerState::Down && last_used_endpoint.is_none() {
        PeerState::Unknown
    } else {
        state
    }
}

/// The next endpoint to try (§8.4), or none.
#[must_use]
pub fn pick(
    endpoints: &[SocketAddr],
    last_used: Option<SocketAddr>,
    endpoint: Option<SocketAddr>,
) -> Option<SocketAddr> {
    let n = endpoints.len();
    if n == 0 {
        return None;
    }
    let Some(last) = last_used else {
        return Some(endpoints[0]);
    };
    match endpoints.iter().position(|e| *e == last) {
        Some(0) if n == 1 && endpoint == Some(last) => None,
        Some(i) => Some(endpoints[(i + 1) % n]),
        None => Some(endpoints[0]),
    }
}

/// What the device reports for a peer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Observed {
    /// Endpoint in use.
    pub endpoint: Option<SocketAddr>,
    /// Last handshake.
    pub last_handshake: Option<SystemTime>,
    /// Bytes received.
    pub rx_bytes: u64,
    /// Bytes sent.
    pub tx_bytes: u64,
}

/// Seeds a new status from what the device already holds for the peer (a restart with
/// kernel state kept): the endpoint in use becomes the last one used, changed at no
/// known time, so [`peer_state`] judges the peer by its handshake alone. A peer with a
/// recent handshake is then `up` at once and keeps its endpoint (nothing is pushed); one
/// without continues the rotation from the endpoint it was on. Without an endpoint on
/// the device the status stays empty (the peer is new: first endpoint pushed).
pub fn seed(status: &mut PeerStatus, observed: &Observed) {
    let Some(endpoint) = observed.endpoint else {
        return;
    };
    status.endpoint = Some(endpoint);
    status.last_used_endpoint = Some(endpoint);
    status.last_endpoint_change = None;
    status.last_handshake_time = observed.last_handshake;
    status.receive_bytes = i64::try_from(observed.rx_bytes).unwrap_or(i64::MAX);
    status.transmit_bytes = i64::try_from(observed.tx_bytes).unwrap_or(i64::MAX);
}

/// Outcome of [`step`] for one peer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Step {
    /// Endpoint to program; `None` = leave WireGuard's (roamed or none) as is.
    pub desired_endpoint: Option<SocketAddr>,
    /// A new endpoint was pushed (step 4).
    pub pushed: bool,
}

/// Whether a peer's kernel answers the probe at once (an ICMPv6 port unreachable;
/// learned, per peer): one that does is given [`REPLY_PROBE_GRACE`] to answer a probe,
/// any other [`PROBE_GRACE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KernelReply {
    /// Not known yet: the next read probes the peer to learn it.
    #[default]
    Unknown,
    /// Its kernel answered a probe.
    Answers,
    /// The peer sent data after a probe, but its kernel did not answer (a firewall
    /// drops the probe or the error).
    Ignores,
}

/// The receive rule of a wirespan peer (`docs/kubespan.md` §8.6): when its received-byte
/// counter last moved, and whether it was sent a probe since.
///
/// WireGuard's persistent keepalive is reset by packets in either direction, so on an
/// idle tunnel one side may send every keepalive and the other none: silence alone
/// does not prove a dead peer. After half the window of silence the node therefore
/// sends the peer a probe through the tunnel (a UDP datagram to a port nothing
/// listens on: a live peer's kernel answers with an ICMPv6 error at once, its
/// WireGuard with a keepalive within 10 s); the peer is silent, and down, only when the
/// window has passed and the probe had its grace to be answered ([`REPLY_PROBE_GRACE`]
/// for a peer whose kernel is known to answer, else [`PROBE_GRACE`]).
///
/// The counter is read at wake-ups, so the last packet is known only to lie between
/// the read before the counter last moved (`moved_after`) and the read that saw it
/// move (`since`). Silence is counted from `moved_after`: the probe is what protects a
/// live peer from being judged early, and counting from `since` would add up to a
/// read interval to every failover. Reads come every quarter window while the counter
/// moves, which bounds that interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RxTrack {
    /// The counter as last read.
    pub rx_bytes: u64,
    /// When it was first read with that value (or the window restarted).
    pub since: SystemTime,
    /// The read before `since` (or `since` itself when the window restarted): the
    /// counter last moved after it.
    pub moved_after: SystemTime,
    /// The last read.
    pub last_read: SystemTime,
    /// When a probe was sent during this silence.
    pub probed: Option<SystemTime>,
    /// Whether the peer's kernel answers probes; kept across windows.
    pub reply: KernelReply,
    /// The last probe since the counter moved, and whether its kernel reply came.
    pub reply_probe: Option<(SystemTime, bool)>,
    /// The counter moved since tracking began or the window restarted (the last
    /// endpoint push).
    pub moved: bool,
}

impl RxTrack {
    /// Tracking from `rx_bytes`, read at `now`.
    #[must_use]
    pub fn new(rx_bytes: u64, now: SystemTime) -> Self {
        Self {
            rx_bytes,
            since: now,
            moved_after: now,
            last_read: now,
            probed: None,
            reply: KernelReply::Unknown,
            reply_probe: None,
            moved: false,
        }
    }

    /// A new window from `rx_bytes` at `now`: only what was learned of the peer's
    /// kernel carries over.
    fn next_window(&self, rx_bytes: u64, now: SystemTime) -> Self {
        Self {
            reply: self.reply,
            ..Self::new(rx_bytes, now)
        }
    }

    /// A device read: any change of the counter (a reset too) ends the silence. Data
    /// that came after a probe its kernel did not answer shows a peer whose kernel
    /// does not.
    pub fn observe(&mut self, rx_bytes: u64, now: SystemTime) {
        if rx_bytes == self.rx_bytes {
            self.last_read = self.last_read.max(now);
            return;
        }
        let unanswered = matches!(self.reply_probe,
            Some((sent, false)) if since(now, Some(sent)) >= REPLY_PROBE_GRACE);
        *self = Self {
            moved_after: self.last_read.min(now),
            moved: true,
            ..self.next_window(rx_bytes, now)
        };
        if unanswered {
            self.reply = KernelReply::Ignores;
        }
    }

    /// Whether the peer's kernel answered a probe since the last read; call before
    /// [`RxTrack::observe`] with the same read.
    pub fn note_reply(&mut self, answered: bool) {
        if let (true, Some((_, got))) = (answered, self.reply_probe.as_mut()) {
            *got = true;
            self.reply = KernelReply::Answers;
        }
    }

    /// Starts a new window (a new endpoint was pushed).
    pub fn restart(&mut self, now: SystemTime) {
        *self = self.next_window(self.rx_bytes, now);
    }

    /// How long a probe has to be answered.
    #[must_use]
    pub fn grace(&self) -> Duration {
        if self.reply == KernelReply::Answers {
            REPLY_PROBE_GRACE
        } else {
            PROBE_GRACE
        }
    }

    /// Nothing received for `window`, and a probe went unanswered.
    #[must_use]
    pub fn silent(&self, now: SystemTime, window: Duration) -> bool {
        since(now, Some(self.moved_after)) >= window
            && self
                .probed
                .is_some_and(|p| since(now, Some(p)) >= self.grace())
    }

    /// Whether to probe the peer now: half the window silent and not yet probed, or
    /// whether its kernel answers is not known yet. Marks it probed when so.
    pub fn take_probe(&mut self, now: SystemTime, window: Duration) -> bool {
        let silence = self.probed.is_none()
            && now > self.since
            && since(now, Some(self.moved_after)) >= window / 2;
        let learn = self.reply == KernelReply::Unknown && self.reply_probe.is_none();
        if silence {
            self.probed = Some(now);
        }
        if silence || learn {
            self.reply_probe = Some((now, false));
        }
        silence || learn
    }

    /// When to read the device next for this peer: to see whether the counter still
    /// moves (every quarter window), to probe it, or to judge it.
    #[must_use]
    pub fn next_wake(&self, window: Duration) -> SystemTime {
        match self.probed {
            None => (self.since + window / 4).max(self.moved_after + window / 2),
            // Judged then, unless a read every quarter window sees the counter move.
            Some(p) => (self.moved_after + window)
                .max(p + self.grace())
                .min(self.last_read + window / 4),
        }
    }
}

/// The receive rule for one wirespan peer in [`step`]: its tracking and its window.
#[derive(Debug)]
pub struct RxRule<'a> {
    /// The peer's tracking.
    pub track: &'a mut RxTrack,
    /// Its window: the configured one, or longer for a peer whose keepalive is slow.
    pub window: Duration,
}

/// The receive window for a wirespan peer that advertises `peer_keepalive`: the
/// configured `window`, but never less than three of the peer's keepalives (a peer
/// with another configuration is not judged faster than it sends).
#[must_use]
pub fn rx_window(window: Duration, peer_keepalive: Duration) -> Duration {
    window.max(peer_keepalive * 3)
}

/// The persistent keepalive towards wirespan peers for a receive window: three per
/// window, at least one second.
#[must_use]
pub fn wirespan_keepalive(window: Duration) -> u16 {
    u16::try_from((window / 3).as_secs())
        .unwrap_or(u16::MAX)
        .max(1)
}

/// Steps 2–5 of the reconcile (§8.2) for one peer: take what the device reports
/// (`None` when the device or the peer is absent), compute the state, rotate when the
/// peer is down or was never pushed, then re-assert or keep a roamed endpoint. For a
/// wirespan peer (`rx` given) an up peer whose receive window passed in silence is
/// down (§8.6), whatever its last handshake, and an unknown one whose counter moved
/// since the push is up.
pub fn step(
    status: &mut PeerStatus,
    endpoints: &[SocketAddr],
    observed: Option<&Observed>,
    now: SystemTime,
    down_interval: Duration,
    mut rx: Option<RxRule<'_>>,
) -> Step {
    if let Some(o) = observed {
        status.endpoint = o.endpoint;
        status.last_handshake_time = o.last_handshake;
        status.receive_bytes = i64::try_from(o.rx_bytes).unwrap_or(i64::MAX);
        status.transmit_bytes = i64::try_from(o.tx_bytes).unwrap_or(i64::MAX);
        if let Some(r) = rx.as_mut() {
            r.track.observe(o.rx_bytes, now);
        }
    }
    status.state = peer_state(
        now,
        status.last_handshake_time,
        status.last_endpoint_change,
        status.last_used_endpoint,
        down_interval,
    );
    let session = status
        .last_handshake_time
        .is_some_and(|h| since(now, Some(h)) < REJECT_AFTER_TIME);
    if status.state != PeerState::Up && session && rx.as_ref().is_some_and(|r| r.track.moved) {
        // The peer's packets arrive since the push, on a session that predates it and so
        // needs no new handshake: the path works (a relayed pair whose direct path
        // healed before its session expired would otherwise wait for the rekey, up to
        // two minutes). Only while such a session can carry data: a peer that reaches
        // this node but never gets an answer sends handshake initiations, which move
        // the counter too.
        status.state = PeerState::Up;
    }
    if status.state == PeerState::Up && rx.as_ref().is_some_and(|r| r.track.silent(now, r.window)) {
        status.state = PeerState::Down;
    }
    let mut out = Step::default();
    let should_change = status.state == PeerState::Down || status.last_used_endpoint.is_none();
    if should_change {
        if let Some(e) = pick(endpoints, status.last_used_endpoint, status.endpoint) {
            status.endpoint = Some(e);
            status.last_used_endpoint = Some(e);
            status.last_endpoint_change = Some(now);
            status.state = PeerState::Unknown;
            out.pushed = true;
            if let Some(r) = rx.as_mut() {
                r.track.restart(now);
            }
        }
    }
    if let Some(last) = status.last_used_endpoint {
        if status.endpoint.is_none() || status.endpoint == Some(last) {
            status.endpoint = Some(last);
            out.desired_endpoint = Some(last);
        }
    }
    out
}

/// How often the device is read while a pushed endpoint awaits its first handshake:
/// WireGuard reports handshakes to nobody, so without this a peer that connected in
/// 1 s would show `unknown` until the 15 s deadline.
pub const HANDSHAKE_POLL: Duration = Duration::from_secs(1);

/// How long the side with the higher public key leaves a new peer's first handshake
/// to the other side (see [`defers_first_handshake`]).
pub const FIRST_HANDSHAKE_DEFERRAL: Duration = Duration::from_secs(1);

/// Whether to hold back the keepalive, and so the handshake initiation, towards a peer
/// never handshaken with, just after its endpoint was pushed. Two nodes that learn of
/// each other at once both initiate at once (a new peer with a keepalive sends one
/// immediately); each answers the other's initiation, which replaces its own initiator
/// state, so neither completes until WireGuard retries 5 s later. The side with the
/// higher public key therefore waits [`FIRST_HANDSHAKE_DEFERRAL`] for the other's
/// initiation, which it answers; then it initiates itself (a peer that cannot reach
/// this node, behind NAT, still gets connected).
#[must_use]
pub fn defers_first_handshake(
    own_key: &[u8; 32],
    peer_key: &[u8; 32],
    status: &PeerStatus,
    now: SystemTime,
) -> bool {
    own_key > peer_key
        && status.last_handshake_time.is_none()
        && status
            .last_endpoint_change
            .is_some_and(|t| now.duration_since(t).unwrap_or_default() < FIRST_HANDSHAKE_DEFERRAL)
}

/// What the status of a peer kept by [`keeps_unlisted`] says.
pub const UNLISTED_KEPT: &str = "not listed by discovery; kept while its session is fresh";

/// Whether a peer that discovery no longer lists stays programmed (`docs/kubespan.md`
/// §8.10): while its WireGuard session is fresh, that is while [`step`] judges it up
/// (for a wirespan peer: something received within its receive window) and its last
/// handshake is recent enough for the session to carry data ([`REJECT_AFTER_TIME`]).
/// The cluster ID is a bearer credential of the upstream protocol: anyone who knows it
/// can delete affiliates, so a missing listing alone must not cut a working tunnel.
/// Once the session goes stale the peer is removed as any unlisted one.
#[must_use]
pub fn keeps_unlisted(status: &PeerStatus, now: SystemTime) -> bool {
    status.state == PeerState::Up && unlisted_until(status).is_some_and(|t| now < t)
}

/// When a kept unlisted peer's session is too old to carry data, whatever else happens.
#[must_use]
pub fn unlisted_until(status: &PeerStatus) -> Option<SystemTime> {
    status.last_handshake_time.map(|h| h + REJECT_AFTER_TIME)
}

/// Notes in `status` whether the peer is `listed` by discovery; returns whether the
/// peer stays (always when listed; see [`keeps_unlisted`] otherwise).
pub fn note_listing(status: &mut PeerStatus, listed: bool, now: SystemTime) -> bool {
    let keep = listed || keeps_unlisted(status, now);
    status.retained_reason.clear();
    if !listed && keep {
        UNLISTED_KEPT.clone_into(&mut status.retained_reason);
    }
    keep
}

/// When the peer should be looked at again without waiting for the tick (§8.5): while
/// it is unknown, every [`HANDSHAKE_POLL`] until `lastEndpointChange + 15 s`, then at
/// that deadline (where it turns down and the next endpoint is pushed); while it is up,
/// when it would turn down without a new handshake, and for a wirespan peer (`rx`)
/// when it is to be probed or judged by its receive window.
#[must_use]
pub fn next_wake(
    status: &PeerStatus,
    now: SystemTime,
    down_interval: Duration,
    rx: Option<(&RxTrack, Duration)>,
) -> Option<SystemTime> {
    match (status.state, status.last_endpoint_change) {
        (PeerState::Unknown, Some(t)) => {
            let deadline = t + ENDPOINT_CONNECTION_TIMEOUT;
            Some(deadline.min(now + HANDSHAKE_POLL))
        }
        // An up peer turns down once both its last handshake and its last endpoint
        // change are older than the down interval (just past it: the rule is strict).
        (PeerState::Up, ec) => {
            let latest = status.last_handshake_time.max(ec)?;
            let handshake = latest + down_interval + Duration::from_secs(1);
            Some(rx.map_or(handshake, |(t, w)| handshake.min(t.next_wake(w))))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000 + secs)
    }
    fn ep(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn state_vectors() {
        let now = t(1000);
        let used = Some(ep("192.0.2.1:51820"));
        // never pushed
        assert_eq!(
            peer_state(now, None, None, None, PEER_DOWN_INTERVAL),
            PeerState::Unknown
        );
        // sinceEC 10 s, handshake 5 s ago
        assert_eq!(
            peer_state(now, Some(t(995)), Some(t(990)), used, PEER_DOWN_INTERVAL),
            PeerState::Up
        );
        // sinceEC 10 s, no handshake
        assert_eq!(
            peer_state(now, None, Some(t(990)), used, PEER_DOWN_INTERVAL),
            PeerState::Unknown
        );
        // sinceEC 20 s, no handshake since the change
        assert_eq!(
            peer_state(now, Some(t(970)), Some(t(980)), used, PEER_DOWN_INTERVAL),
            PeerState::Down
        );
        // sinceEC 20 s, handshake 2 s ago
        assert_eq!(
            peer_state(now, Some(t(998)), Some(t(980)), used, PEER_DOWN_INTERVAL),
            PeerState::Up
        );
        // sinceEC 400 s, sinceHS 100 s
        assert_eq!(
            peer_state(now, Some(t(900)), Some(t(600)), used, PEER_DOWN_INTERVAL),
            PeerState::Up
        );
        // sinceEC 400 s, sinceHS 300 s
        assert_eq!(
            peer_state(now, Some(t(700)), Some(t(600)), used, PEER_DOWN_INTERVAL),
            PeerState::Down
        );
        // down without a pushed endpoint is unknown
        assert_eq!(
            peer_state(now, Some(t(700)), Some(t(600)), None, PEER_DOWN_INTERVAL),
            PeerState::Unknown
        );
        // boundaries: 15 s is already in the middle band, 275 s still in it
        assert_eq!(
            peer_state(now, None, Some(t(985)), used, PEER_DOWN_INTERVAL),
            PeerState::Down
        );
        assert_eq!(
            peer_state(now, Some(t(726)), Some(t(725)), used, PEER_DOWN_INTERVAL),
            PeerState::Up
        );
    }

    #[test]
    fn an_unlisted_peer_is_kept_while_up_with_a_session_that_carries_data() {
        let up = PeerStatus {
            state: PeerState::Up,
            last_handshake_time: Some(t(1000)),
            ..PeerStatus::default()
        };
        let mut st = up.clone();
        assert!(note_listing(&mut st, false, t(1010)));
        assert_eq!(st.retained_reason, UNLISTED_KEPT);
        // Listed again: the reason goes, the peer stays.
        assert!(note_listing(&mut st, true, t(1011)));
        assert_eq!(st.retained_reason, "");
        // The session is too old to carry data (up by the handshake rule alone).
        assert!(keeps_unlisted(&up, t(1179)));
        assert!(!keeps_unlisted(&up, t(1180)));
        assert_eq!(unlisted_until(&up), Some(t(1180)));
        let mut stale = up.clone();
        assert!(!note_listing(&mut stale, false, t(1180)));
        assert_eq!(stale.retained_reason, "");
        // Down or unknown (a wirespan peer silent for its receive window is down).
        for state in [PeerState::Down, PeerState::Unknown] {
            let st = PeerStatus {
                state,
                ..up.clone()
            };
            assert!(!keeps_unlisted(&st, t(1001)), "{state:?}");
        }
        let never = PeerStatus {
            last_handshake_time: None,
            ..up
        };
        assert!(!keeps_unlisted(&never, t(1001)));
    }

    #[test]
    fn pick_vectors() {
        let (a, b, c, x) = (
            ep("10.0.0.1:1"),
            ep("10.0.0.2:1"),
            ep("10.0.0.3:1"),
            ep("10.0.0.9:1"),
        );
        let abc = [a, b, c];
        assert_eq!(pick(&abc, None, None), Some(a));
        assert_eq!(pick(&abc, Some(a), Some(a)), Some(b));
        assert_eq!(pick(&abc, Some(c), Some(c)), Some(a));
        assert_eq!(pick(&abc, Some(x), None), Some(a));
        assert_eq!(pick(&[a], Some(a), Some(a)), None);
        assert_eq!(pick(&[a], Some(a), None), Some(a));
        assert_eq!(pick(&[b], Some(a), Some(a)), Some(b));
        assert_eq!(pick(&[], None, None), None);
    }

    fn status() -> PeerStatus {
        PeerStatus {
            label: "n1".into(),
            ..PeerStatus::default()
        }
    }

    #[test]
    fn step_first_reconcile_pushes_the_first_endpoint() {
        let (a, b) = (ep("10.0.0.1:51820"), ep("10.0.0.2:51820"));
        let mut s = status();
        let r = step(&mut s, &[a, b], None, t(0), PEER_DOWN_INTERVAL, None);
        assert_eq!(
            r,
            Step {
                desired_endpoint: Some(a),
                pushed: true
            }
        );
        assert_eq!(s.state, PeerState::Unknown);
        assert_eq!(s.last_used_endpoint, Some(a));
        assert_eq!(s.last_endpoint_change, Some(t(0)));
        // Polled every second for the handshake, never past the 15 s deadline.
        assert_eq!(next_wake(&s, t(0), PEER_DOWN_INTERVAL, None), Some(t(1)));
        assert_eq!(
            next_wake(
                &s,
                t(14) + Duration::from_millis(500),
                PEER_DOWN_INTERVAL,
                None
            ),
            Some(t(15))
        );
    }

    #[test]
    fn a_seeded_peer_with_a_recent_handshake_is_up_and_keeps_its_roamed_endpoint() {
        let (a, b, roamed) = (
            ep("10.0.0.1:51820"),
            ep("10.0.0.2:51820"),
            ep("198.51.100.7:40000"),
        );
        let obs = Observed {
            endpoint: Some(roamed),
            last_handshake: Some(t(880)),
            rx_bytes: 10,
            tx_bytes: 20,
        };
        let mut s = status();
        seed(&mut s, &obs);
        let r = step(
            &mut s,
            &[a, b],
            Some(&obs),
            t(900),
            PEER_DOWN_INTERVAL,
            None,
        );
        assert_eq!(
            r,
            Step {
                desired_endpoint: Some(roamed),
                pushed: false
            }
        );
        assert_eq!(s.state, PeerState::Up);
        assert_eq!(s.last_endpoint_change, None);
        // Still up past the 15 s connection timeout, down only 275 s after the handshake.
        let r = step(
            &mut s,
            &[a, b],
            Some(&obs),
            t(930),
            PEER_DOWN_INTERVAL,
            None,
        );
        assert!(!r.pushed);
        assert_eq!(s.state, PeerState::Up);
        assert_eq!(
            next_wake(&s, t(930), PEER_DOWN_INTERVAL, None),
            Some(t(880 + 276))
        );
        // Unseeded (what a restart did before): the first endpoint is pushed over the
        // working one and the peer is unknown.
        let mut fresh = status();
        let r = step(
            &mut fresh,
            &[a, b],
            Some(&obs),
            t(900),
            PEER_DOWN_INTERVAL,
            None,
        );
        assert!(r.pushed);
        assert_eq!(fresh.state, PeerState::Unknown);
    }

    #[test]
    fn a_seeded_peer_without_a_handshake_continues_the_rotation_and_one_without_endpoint_is_new() {
        let (a, b) = (ep("10.0.0.1:51820"), ep("10.0.0.2:51820"));
        let obs = Observed {
            endpoint: Some(a),
            ..Observed::default()
        };
        let mut s = status();
        seed(&mut s, &obs);
        let r = step(
            &mut s,
            &[a, b],
            Some(&obs),
            t(900),
            PEER_DOWN_INTERVAL,
            None,
        );
        assert_eq!(r.desired_endpoint, Some(b));
        assert!(r.pushed);
        let mut s = status();
        seed(&mut s, &Observed::default());
        assert_eq!(s, status());
    }

    #[test]
    fn step_unknown_within_timeout_reasserts_without_rotating() {
        let (a, b) = (ep("10.0.0.1:51820"), ep("10.0.0.2:51820"));
        let mut s = status();
        step(&mut s, &[a, b], None, t(0), PEER_DOWN_INTERVAL, None);
        let obs = Observed {
            endpoint: Some(a),
            ..Observed::default()
        };
        let r = step(&mut s, &[a, b], Some(&obs), t(10), PEER_DOWN_INTERVAL, None);
        assert_eq!(
            r,
            Step {
                desired_endpoint: Some(a),
                pushed: false
            }
        );
        assert_eq!(s.state, PeerState::Unknown);
    }

    #[test]
    fn step_rotates_to_the_second_endpoint_after_timeout_without_handshake() {
        let (a, b) = (ep("10.0.0.1:51820"), ep("10.0.0.2:51820"));
        let mut s = status();
        step(&mut s, &[a, b], None, t(0), PEER_DOWN_INTERVAL, None);
        let obs = Observed {
            endpoint: Some(a),
            ..Observed::default()
        };
        let r = step(&mut s, &[a, b], Some(&obs), t(15), PEER_DOWN_INTERVAL, None);
        assert_eq!(
            r,
            Step {
                desired_endpoint: Some(b),
                pushed: true
            }
        );
        assert_eq!(s.last_endpoint_change, Some(t(15)));
        assert_eq!(s.state, PeerState::Unknown);
        // and wraps back to the first after another timeout
        let obs = Observed {
            endpoint: Some(b),
            ..Observed::default()
        };
        let r = step(&mut s, &[a, b], Some(&obs), t(31), PEER_DOWN_INTERVAL, None);
        assert_eq!(r.desired_endpoint, Some(a));
    }

    #[test]
    fn step_handshake_makes_the_peer_up_and_keeps_its_endpoint() {
        let (a, b) = (ep("10.0.0.1:51820"), ep("10.0.0.2:51820"));
        let mut s = status();
        step(&mut s, &[a, b], None, t(0), PEER_DOWN_INTERVAL, None);
        let obs = Observed {
            endpoint: Some(a),
            last_handshake: Some(t(3)),
            rx_bytes: 100,
            tx_bytes: 200,
        };
        let r = step(&mut s, &[a, b], Some(&obs), t(20), PEER_DOWN_INTERVAL, None);
        assert_eq!(s.state, PeerState::Up);
        assert_eq!(
            r,
            Step {
                desired_endpoint: Some(a),
                pushed: false
            }
        );
        assert_eq!((s.receive_bytes, s.transmit_bytes), (100, 200));
        // Looked at again just after it would turn down without a new handshake.
        assert_eq!(
            next_wake(&s, t(20), PEER_DOWN_INTERVAL, None),
            Some(t(3 + 275 + 1))
        );
        step(
            &mut s,
            &[a, b],
            None,
            t(3 + 275 + 1),
            PEER_DOWN_INTERVAL,
            None,
        );
        assert_ne!(s.state, PeerState::Up);
    }

    #[test]
    fn only_the_higher_key_defers_a_new_peers_first_handshake_and_not_for_long() {
        let (a, b) = (ep("10.0.0.1:51820"), ep("10.0.0.2:51820"));
        let (low, high) = ([1u8; 32], [2u8; 32]);
        let mut s = status();
        step(&mut s, &[a, b], None, t(0), PEER_DOWN_INTERVAL, None);
        assert!(defers_first_handshake(&high, &low, &s, t(0)));
        assert!(!defers_first_handshake(&low, &high, &s, t(0)));
        // Only for the deferral: the 1 s handshake poll then turns the keepalive on.
        let just_before = t(0) + FIRST_HANDSHAKE_DEFERRAL - Duration::from_millis(1);
        assert!(defers_first_handshake(&high, &low, &s, just_before));
        assert!(!defers_first_handshake(
            &high,
            &low,
            &s,
            t(0) + FIRST_HANDSHAKE_DEFERRAL
        ));
        // A peer once handshaken with is never deferred, even after a new endpoint.
        s.last_handshake_time = Some(t(1));
        s.last_endpoint_change = Some(t(100));
        assert!(!defers_first_handshake(&high, &low, &s, t(100)));
    }

    #[test]
    fn step_keeps_a_roamed_endpoint() {
        let (a, b, roamed) = (
            ep("10.0.0.1:51820"),
            ep("10.0.0.2:51820"),
            ep("198.51.100.7:40000"),
        );
        let mut s = status();
        step(&mut s, &[a, b], None, t(0), PEER_DOWN_INTERVAL, None);
        let obs = Observed {
            endpoint: Some(roamed),
            last_handshake: Some(t(5)),
            ..Observed::default()
        };
        let r = step(&mut s, &[a, b], Some(&obs), t(20), PEER_DOWN_INTERVAL, None);
        assert_eq!(
            r,
            Step {
                desired_endpoint: None,
                pushed: false
            }
        );
        assert_eq!(s.endpoint, Some(roamed));
        assert_eq!(s.state, PeerState::Up);
    }

    #[test]
    fn step_single_endpoint_that_is_down_cannot_rotate_but_is_reasserted() {
        let a = ep("10.0.0.1:51820");
        let mut s = status();
        step(&mut s, &[a], None, t(0), PEER_DOWN_INTERVAL, None);
        let obs = Observed {
            endpoint: Some(a),
            ..Observed::default()
        };
        let r = step(&mut s, &[a], Some(&obs), t(20), PEER_DOWN_INTERVAL, None);
        assert_eq!(s.state, PeerState::Down);
        assert_eq!(
            r,
            Step {
                desired_endpoint: Some(a),
                pushed: false
            }
        );
        // WireGuard lost it (link re-created): pushed again
        let r = step(
            &mut s,
            &[a],
            Some(&Observed::default()),
            t(40),
            PEER_DOWN_INTERVAL,
            None,
        );
        assert_eq!(r.desired_endpoint, Some(a));
    }

    #[test]
    fn step_without_endpoints_stays_unknown_and_desires_nothing() {
        let mut s = status();
        assert_eq!(
            step(&mut s, &[], None, t(0), PEER_DOWN_INTERVAL, None),
            Step::default()
        );
        assert_eq!(s.state, PeerState::Unknown);
    }

    #[test]
    fn the_default_down_interval_is_275_s_and_a_configured_one_replaces_it() {
        let used = Some(ep("192.0.2.1:51820"));
        let default = crate::config::kubespan::KubeSpanConfigDocument::default().peer_down_interval;
        // Handshake at 0, endpoint pushed long before: judged by the handshake alone.
        let state = |at, interval| {
            peer_state(
                t(at),
                Some(t(0)),
                Some(t(0) - Duration::from_secs(1000)),
                used,
                interval,
            )
        };
        assert_eq!(state(274, default), PeerState::Up);
        assert_eq!(state(276, default), PeerState::Down);
        let shorter = Duration::from_secs(150);
        assert_eq!(state(149, shorter), PeerState::Up);
        assert_eq!(state(151, shorter), PeerState::Down);
        let mut s = status();
        s.state = PeerState::Up;
        s.last_handshake_time = Some(t(0));
        assert_eq!(next_wake(&s, t(10), shorter, None), Some(t(151)));
    }

    /// A simulated peer behind `a`, reached over `[a, b]` and read by the node at its
    /// wake-ups (at least every tick). The peer handshakes every 120 s while alive, sends
    /// a keepalive every `keepalive` (none: it is the side whose keepalive timer the
    /// node's own keepalives keep resetting) and answers a probe 10 s later (WireGuard's
    /// passive keepalive, the latest it comes), and within a second too when it
    /// `answers`. Returns (read time, state, pushed).
    fn simulate(
        window: Option<Duration>,
        keepalive: Option<u64>,
        answers: bool,
        dies_at: Option<u64>,
        until: u64,
    ) -> Vec<(u64, PeerState, bool)> {
        let (a, b) = (ep("10.0.0.1:51820"), ep("10.0.0.2:51820"));
        let alive = |at: u64| dies_at.is_none_or(|d| at < d);
        let mut s = status();
        step(&mut s, &[a, b], None, t(0), PEER_DOWN_INTERVAL, None);
        let mut track = RxTrack::new(0, t(0));
        let mut replies: Vec<u64> = Vec::new();
        let mut kernel_replies: Vec<u64> = Vec::new();
        let mut out = Vec::new();
        let (mut last, mut now) = (0, 1);
        while now <= until {
            // What the peer sends, it sends only while alive.
            let sent = |r: &&u64| **r <= now && alive(**r);
            let mut rx = replies.iter().filter(sent).count() as u64;
            rx += kernel_replies.iter().filter(sent).count() as u64;
            if let Some(k) = keepalive {
                rx += (1..=now).filter(|i| i % k == 0 && alive(*i)).count() as u64;
            }
            let handshake = (1..=now).rev().find(|i| i % 120 == 1 && alive(*i));
            let obs = Observed {
                endpoint: s.last_used_endpoint,
                last_handshake: handshake.map(t),
                rx_bytes: rx * 32,
                tx_bytes: 0,
            };
            if window.is_some() {
                track.note_reply(
                    kernel_replies
                        .iter()
                        .any(|r| *r > last && *r <= now && alive(*r)),
                );
            }
            let rule = window.map(|w| RxRule {
                track: &mut track,
                window: w,
            });
            let r = step(
                &mut s,
                &[a, b],
                Some(&obs),
                t(now),
                PEER_DOWN_INTERVAL,
                rule,
            );
            out.push((now, s.state, r.pushed));
            if let Some(w) = window {
                if s.state == PeerState::Up && track.take_probe(t(now), w) && alive(now) {
                    replies.push(now + 10);
                    if answers {
                        kernel_replies.push(now + 1);
                    }
                }
            }
            let rx_wake = window.map(|w| (&track, w));
            let wake = next_wake(&s, t(now), PEER_DOWN_INTERVAL, rx_wake)
                .map_or(t(now) + RECONCILE_TICK, |w| w.min(t(now) + RECONCILE_TICK));
            let secs = wake.duration_since(t(0)).unwrap().as_secs();
            last = now;
            now = secs.max(now + 1);
        }
        out
    }

    /// The windows and peers the failure detector is simulated with: the default and
    /// the minimum window, a peer whose kernel answers probes and one that
    /// ignores them, keepalives a third of the window or none.
    fn detector_cases() -> Vec<(Duration, bool, Option<u64>)> {
        let mut cases = Vec::new();
        for w in [30, 6] {
            for answers in [true, false] {
                for keepalive in [Some(w / 3), None] {
                    cases.push((Duration::from_secs(w), answers, keepalive));
                }
            }
        }
        cases
    }

    #[test]
    fn an_idle_healthy_wirespan_peer_never_flaps_even_when_it_sends_no_keepalive() {
        for (w, answers, keepalive) in detector_cases() {
            let reads = simulate(Some(w), keepalive, answers, None, 6 * 3600);
            assert!(reads.len() > 700, "{}", reads.len());
            let bad: Vec<_> = reads
                .iter()
                .filter(|(at, st, pushed)| *at > 2 && (*st != PeerState::Up || *pushed))
                .collect();
            assert!(
                bad.is_empty(),
                "{w:?} answers {answers} keepalive {keepalive:?}: {:?}",
                &bad[..bad.len().min(5)]
            );
        }
    }

    #[test]
    fn a_dead_wirespan_peer_is_down_within_the_window_and_rotated() {
        for (w, answers, keepalive) in detector_cases() {
            for death in 1000..1010 {
                let reads = simulate(Some(w), keepalive, answers, Some(death), 1200);
                let (down_at, _, pushed) = *reads
                    .iter()
                    .find(|(at, st, _)| *at > death && *st != PeerState::Up)
                    .expect("declared down");
                // Within the window of its last packet, wherever it falls between
                // reads; a peer whose kernel does not answer when its probe's grace is over.
                let limit = if answers {
                    w
                } else {
                    w.max(w / 2 + PROBE_GRACE)
                };
                assert!(
                    down_at <= death + limit.as_secs(),
                    "{w:?} answers {answers} keepalive {keepalive:?} {death}: {down_at}"
                );
                // Rotation moved on to the next endpoint in the same step.
                assert!(pushed, "{w:?} answers {answers} keepalive {keepalive:?}");
            }
        }
    }

    #[test]
    fn a_wirespan_peer_whose_packets_arrive_after_a_push_is_up_without_a_new_handshake() {
        let (a, b) = (ep("10.0.0.1:51820"), ep("10.0.0.2:51820"));
        let w = Duration::from_secs(6);
        let mut s = status();
        let mut track = RxTrack::new(0, t(0));
        let mut read = |s: &mut PeerStatus, at: u64, rx: u64| {
            let obs = Observed {
                endpoint: Some(a),
                // A session from before the push, still valid: no new handshake.
                last_handshake: Some(t(1)),
                rx_bytes: rx,
                tx_bytes: 0,
            };
            let rule = RxRule {
                track: &mut track,
                window: w,
            };
            step(
                s,
                &[a, b],
                Some(&obs),
                t(at),
                PEER_DOWN_INTERVAL,
                Some(rule),
            );
            s.state
        };
        // Pushed at 2; nothing arrives: unknown, then down at the deadline.
        assert_eq!(read(&mut s, 2, 100), PeerState::Unknown);
        assert_eq!(read(&mut s, 3, 100), PeerState::Unknown);
        assert_eq!(read(&mut s, 18, 100), PeerState::Unknown, "pushed the next");
        assert_eq!(s.last_used_endpoint, Some(b));
        // Keepalives arrive on the old session: up at once, and it stays up past the
        // endpoint's deadline while they keep coming.
        assert_eq!(read(&mut s, 19, 132), PeerState::Up);
        assert_eq!(read(&mut s, 35, 164), PeerState::Up);
        assert_eq!(s.last_used_endpoint, Some(b));
        // Once the session is past its lifetime, what moves the counter can only be
        // handshake initiations that get no answer: not up.
        assert_ne!(read(&mut s, 182, 196), PeerState::Up);
    }

    #[test]
    fn whether_a_peers_kernel_answers_is_learned_from_its_replies_and_kept() {
        let w = Duration::from_secs(6);
        let mut track = RxTrack::new(0, t(0));
        assert_eq!(track.grace(), PROBE_GRACE);
        // Not known: the first read probes to learn it, without a silence.
        assert!(track.take_probe(t(1), w));
        assert_eq!(track.probed, None);
        assert!(!track.take_probe(t(1), w), "one learning probe at a time");
        track.note_reply(true);
        track.observe(32, t(2));
        assert_eq!(track.reply, KernelReply::Answers);
        assert_eq!(track.grace(), REPLY_PROBE_GRACE);
        // A reply that came without a probe says nothing.
        let mut fresh = RxTrack::new(0, t(0));
        fresh.note_reply(true);
        assert_eq!(fresh.reply, KernelReply::Unknown);
        // A firewall starts dropping the probes: data after an unanswered one.
        assert!(track.take_probe(t(5), w), "half the window silent");
        track.note_reply(false);
        track.observe(64, t(15));
        assert_eq!(track.reply, KernelReply::Ignores);
        assert_eq!(track.grace(), PROBE_GRACE);
        // Kept across a pushed endpoint; a later answered probe learns it again.
        track.restart(t(16));
        assert_eq!(track.reply, KernelReply::Ignores);
        assert!(!track.take_probe(t(17), w), "known, not silent");
        assert!(track.take_probe(t(19), w));
        track.note_reply(true);
        assert_eq!(track.reply, KernelReply::Answers);
    }

    #[test]
    fn a_talos_peer_is_judged_by_its_handshake_alone() {
        let reads = simulate(None, Some(25), false, Some(1000), 1400);
        let down_at = reads
            .iter()
            .find(|(at, st, _)| *at > 1000 && *st != PeerState::Up)
            .expect("declared down")
            .0;
        // Last handshake at 961 (every 120 s from 1): down 275 s after it, not before.
        assert!(down_at > 961 + 275, "{down_at}");
        assert!(down_at <= 961 + 276 + 1, "{down_at}");
    }

    #[test]
    fn the_window_is_never_shorter_than_three_peer_keepalives() {
        let w = Duration::from_secs(30);
        assert_eq!(rx_window(w, Duration::from_secs(10)), w);
        assert_eq!(
            rx_window(w, Duration::from_secs(25)),
            Duration::from_secs(75)
        );
        assert_eq!(wirespan_keepalive(w), 10);
        assert_eq!(wirespan_keepalive(Duration::from_secs(2)), 1);
    }
}
