//! Peer state, endpoint pick and the per-peer reconcile step (`docs/kubespan.md` §8), pure: the
//! time is passed in.

use std::{
    net::SocketAddr,
    time::{Duration, SystemTime},
};

use crate::resources::kubespan::{KubeSpanPeerStatusSpec, PeerState};

/// How long a fresh endpoint has to produce a handshake.
pub const ENDPOINT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(15);
/// Time without a handshake after which an established peer is down (180 + 5 + 90).
pub const PEER_DOWN_INTERVAL: Duration = Duration::from_secs(275);
/// The reconcile tick.
pub const RECONCILE_TICK: Duration = Duration::from_secs(30);

fn since(now: SystemTime, t: Option<SystemTime>) -> Duration {
    now.duration_since(t.unwrap_or(SystemTime::UNIX_EPOCH))
        .unwrap_or_default()
}

/// The state of a peer (§8.3).
#[must_use]
pub fn peer_state(
    now: SystemTime,
    last_handshake: Option<SystemTime>,
    last_endpoint_change: Option<SystemTime>,
    last_used_endpoint: Option<SocketAddr>,
) -> PeerState {
    let since_hs = since(now, last_handshake);
    let since_ec = since(now, last_endpoint_change);
    let hs_after = last_handshake.unwrap_or(SystemTime::UNIX_EPOCH)
        > last_endpoint_change.unwrap_or(SystemTime::UNIX_EPOCH);
    let state = if since_ec > PEER_DOWN_INTERVAL {
        if since_hs < PEER_DOWN_INTERVAL {
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
pub fn seed(status: &mut KubeSpanPeerStatusSpec, observed: &Observed) {
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

/// Steps 2–5 of the reconcile (§8.2) for one peer: take what the device reports
/// (`None` when the device or the peer is absent), compute the state, rotate when the
/// peer is down or was never pushed, then re-assert or keep a roamed endpoint.
pub fn step(
    status: &mut KubeSpanPeerStatusSpec,
    endpoints: &[SocketAddr],
    observed: Option<&Observed>,
    now: SystemTime,
) -> Step {
    if let Some(o) = observed {
        status.endpoint = o.endpoint;
        status.last_handshake_time = o.last_handshake;
        status.receive_bytes = i64::try_from(o.rx_bytes).unwrap_or(i64::MAX);
        status.transmit_bytes = i64::try_from(o.tx_bytes).unwrap_or(i64::MAX);
    }
    status.state = peer_state(
        now,
        status.last_handshake_time,
        status.last_endpoint_change,
        status.last_used_endpoint,
    );
    let mut out = Step::default();
    let should_change = status.state == PeerState::Down || status.last_used_endpoint.is_none();
    if should_change {
        if let Some(e) = pick(endpoints, status.last_used_endpoint, status.endpoint) {
            status.endpoint = Some(e);
            status.last_used_endpoint = Some(e);
            status.last_endpoint_change = Some(now);
            status.state = PeerState::Unknown;
            out.pushed = true;
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
    status: &KubeSpanPeerStatusSpec,
    now: SystemTime,
) -> bool {
    own_key > peer_key
        && status.last_handshake_time.is_none()
        && status
            .last_endpoint_change
            .is_some_and(|t| now.duration_since(t).unwrap_or_default() < FIRST_HANDSHAKE_DEFERRAL)
}

/// When the peer should be looked at again without waiting for the tick (§8.5): while
/// it is unknown, every [`HANDSHAKE_POLL`] until `lastEndpointChange + 15 s`, then at
/// that deadline (where it turns down and the next endpoint is pushed); while it is up,
/// when it would turn down without a new handshake.
#[must_use]
pub fn next_wake(status: &KubeSpanPeerStatusSpec, now: SystemTime) -> Option<SystemTime> {
    match (status.state, status.last_endpoint_change) {
        (PeerState::Unknown, Some(t)) => {
            let deadline = t + ENDPOINT_CONNECTION_TIMEOUT;
            Some(deadline.min(now + HANDSHAKE_POLL))
        }
        // An up peer turns down once both its last handshake and its last endpoint
        // change are older than the down interval (just past it: the rule is strict).
        (PeerState::Up, ec) => {
            let latest = status.last_handshake_time.max(ec)?;
            Some(latest + PEER_DOWN_INTERVAL + Duration::from_secs(1))
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
        assert_eq!(peer_state(now, None, None, None), PeerState::Unknown);
        // sinceEC 10 s, handshake 5 s ago
        assert_eq!(
            peer_state(now, Some(t(995)), Some(t(990)), used),
            PeerState::Up
        );
        // sinceEC 10 s, no handshake
        assert_eq!(
            peer_state(now, None, Some(t(990)), used),
            PeerState::Unknown
        );
        // sinceEC 20 s, no handshake since the change
        assert_eq!(
            peer_state(now, Some(t(970)), Some(t(980)), used),
            PeerState::Down
        );
        // sinceEC 20 s, handshake 2 s ago
        assert_eq!(
            peer_state(now, Some(t(998)), Some(t(980)), used),
            PeerState::Up
        );
        // sinceEC 400 s, sinceHS 100 s
        assert_eq!(
            peer_state(now, Some(t(900)), Some(t(600)), used),
            PeerState::Up
        );
        // sinceEC 400 s, sinceHS 300 s
        assert_eq!(
            peer_state(now, Some(t(700)), Some(t(600)), used),
            PeerState::Down
        );
        // down without a pushed endpoint is unknown
        assert_eq!(
            peer_state(now, Some(t(700)), Some(t(600)), None),
            PeerState::Unknown
        );
        // boundaries: 15 s is already in the middle band, 275 s still in it
        assert_eq!(peer_state(now, None, Some(t(985)), used), PeerState::Down);
        assert_eq!(
            peer_state(now, Some(t(726)), Some(t(725)), used),
            PeerState::Up
        );
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

    fn status() -> KubeSpanPeerStatusSpec {
        KubeSpanPeerStatusSpec {
            label: "n1".into(),
            ..KubeSpanPeerStatusSpec::default()
        }
    }

    #[test]
    fn step_first_reconcile_pushes_the_first_endpoint() {
        let (a, b) = (ep("10.0.0.1:51820"), ep("10.0.0.2:51820"));
        let mut s = status();
        let r = step(&mut s, &[a, b], None, t(0));
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
        assert_eq!(next_wake(&s, t(0)), Some(t(1)));
        assert_eq!(
            next_wake(&s, t(14) + Duration::from_millis(500)),
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
        let r = step(&mut s, &[a, b], Some(&obs), t(900));
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
        let r = step(&mut s, &[a, b], Some(&obs), t(930));
        assert!(!r.pushed);
        assert_eq!(s.state, PeerState::Up);
        assert_eq!(next_wake(&s, t(930)), Some(t(880 + 276)));
        // Unseeded (what a restart did before): the first endpoint is pushed over the
        // working one and the peer is unknown.
        let mut fresh = status();
        let r = step(&mut fresh, &[a, b], Some(&obs), t(900));
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
        let r = step(&mut s, &[a, b], Some(&obs), t(900));
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
        step(&mut s, &[a, b], None, t(0));
        let obs = Observed {
            endpoint: Some(a),
            ..Observed::default()
        };
        let r = step(&mut s, &[a, b], Some(&obs), t(10));
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
        step(&mut s, &[a, b], None, t(0));
        let obs = Observed {
            endpoint: Some(a),
            ..Observed::default()
        };
        let r = step(&mut s, &[a, b], Some(&obs), t(15));
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
        let r = step(&mut s, &[a, b], Some(&obs), t(31));
        assert_eq!(r.desired_endpoint, Some(a));
    }

    #[test]
    fn step_handshake_makes_the_peer_up_and_keeps_its_endpoint() {
        let (a, b) = (ep("10.0.0.1:51820"), ep("10.0.0.2:51820"));
        let mut s = status();
        step(&mut s, &[a, b], None, t(0));
        let obs = Observed {
            endpoint: Some(a),
            last_handshake: Some(t(3)),
            rx_bytes: 100,
            tx_bytes: 200,
        };
        let r = step(&mut s, &[a, b], Some(&obs), t(20));
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
        assert_eq!(next_wake(&s, t(20)), Some(t(3 + 275 + 1)));
        step(&mut s, &[a, b], None, t(3 + 275 + 1));
        assert_ne!(s.state, PeerState::Up);
    }

    #[test]
    fn only_the_higher_key_defers_a_new_peers_first_handshake_and_not_for_long() {
        let (a, b) = (ep("10.0.0.1:51820"), ep("10.0.0.2:51820"));
        let (low, high) = ([1u8; 32], [2u8; 32]);
        let mut s = status();
        step(&mut s, &[a, b], None, t(0));
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
        step(&mut s, &[a, b], None, t(0));
        let obs = Observed {
            endpoint: Some(roamed),
            last_handshake: Some(t(5)),
            ..Observed::default()
        };
        let r = step(&mut s, &[a, b], Some(&obs), t(20));
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
        step(&mut s, &[a], None, t(0));
        let obs = Observed {
            endpoint: Some(a),
            ..Observed::default()
        };
        let r = step(&mut s, &[a], Some(&obs), t(20));
        assert_eq!(s.state, PeerState::Down);
        assert_eq!(
            r,
            Step {
                desired_endpoint: Some(a),
                pushed: false
            }
        );
        // WireGuard lost it (link re-created): pushed again
        let r = step(&mut s, &[a], Some(&Observed::default()), t(40));
        assert_eq!(r.desired_endpoint, Some(a));
    }

    #[test]
    fn step_without_endpoints_stays_unknown_and_desires_nothing() {
        let mut s = status();
        assert_eq!(step(&mut s, &[], None, t(0)), Step::default());
        assert_eq!(s.state, PeerState::Unknown);
    }
}
