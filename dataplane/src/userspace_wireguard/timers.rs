//! The WireGuard timer rules for one peer, sans-IO: every event and every tick takes
//! `now`, and the answer says what the device must send or drop. The Noise core
//! (`boringtun::noise::Tunn`) does the cryptography; its own clock-reading timer
//! routine is never called, so these rules are the only ones in force and a test can
//! drive them on a fake clock.
//!
//! The constants and rules are the protocol's (section 6 of the WireGuard paper).

use std::time::{Duration, Instant};

/// A session's initiator starts a new handshake when sending on a key this old.
pub const REKEY_AFTER_TIME: Duration = Duration::from_secs(120);
/// No packet is sent or accepted on a key this old.
pub const REJECT_AFTER_TIME: Duration = Duration::from_secs(180);
/// A handshake is retried for this long, then given up until new traffic asks again.
pub const REKEY_ATTEMPT_TIME: Duration = Duration::from_secs(90);
/// An unanswered handshake initiation is resent after this long.
pub const REKEY_TIMEOUT: Duration = Duration::from_secs(5);
/// A peer that received data and sent nothing back for this long sends a keepalive.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// What the device must do for a peer after an event or a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimerAction {
    /// Nothing is due.
    Idle,
    /// Send a (new) handshake initiation.
    SendHandshake,
    /// Send an empty transport packet.
    SendKeepalive,
    /// Drop every key of the peer: the newest one reached `REJECT_AFTER_TIME`.
    ExpireKeys,
    /// The handshake was retried for `REKEY_ATTEMPT_TIME` without an answer: drop
    /// its state and the packets waiting for it, until traffic asks again.
    GiveUp,
}

#[derive(Debug, Clone, Copy)]
struct Session {
    established: Instant,
    initiator: bool,
}

#[derive(Debug, Clone, Copy)]
struct Attempt {
    started: Instant,
    /// When the last initiation is resent if unanswered: `REKEY_TIMEOUT` after it,
    /// plus a random jitter, so two peers' retries do not stay in step.
    retry_due: Instant,
}

/// The timer state of one peer.
#[derive(Debug, Clone, Default)]
pub struct PeerTimers {
    session: Option<Session>,
    attempt: Option<Attempt>,
    last_sent: Option<Instant>,
    /// When an authenticated packet last went out or came in: the persistent
    /// keepalive counts from it (either direction keeps a NAT mapping open).
    last_traversal: Option<Instant>,
    /// A keepalive is due at this time unless something is sent first.
    keepalive_due: Option<Instant>,
    /// A new handshake is due at this time unless something is received first.
    handshake_due: Option<Instant>,
    persistent_keepalive: Option<Duration>,
}

impl PeerTimers {
    /// Timers with the given persistent keepalive interval (0 turns it off).
    pub fn new(persistent_keepalive_secs: u16) -> Self {
        let mut t = Self::default();
        t.set_persistent_keepalive(persistent_keepalive_secs);
        t
    }

    /// Changes the persistent keepalive interval (0 turns it off).
    pub fn set_persistent_keepalive(&mut self, secs: u16) {
        self.persistent_keepalive = (secs > 0).then(|| Duration::from_secs(secs.into()));
    }

    /// True when a session key exists and is younger than `REJECT_AFTER_TIME`.
    pub fn has_usable_session(&self, now: Instant) -> bool {
        self.session
            .is_some_and(|s| now.saturating_duration_since(s.established) < REJECT_AFTER_TIME)
    }

    /// True while a handshake initiation is waiting for its response.
    pub fn handshake_in_progress(&self) -> bool {
        self.attempt.is_some()
    }

    /// A handshake initiation went out (a first one or a retry); it is resent after
    /// `REKEY_TIMEOUT` plus `jitter` (the caller draws it, up to a third of a second).
    pub fn on_handshake_sent(&mut self, now: Instant, jitter: Duration) {
        let started = self.attempt.map_or(now, |a| a.started);
        self.attempt = Some(Attempt {
            started,
            retry_due: now + REKEY_TIMEOUT + jitter,
        });
        self.on_packet_sent(now);
    }

    /// A handshake completed: as initiator (response received) or responder
    /// (initiation answered).
    pub fn on_session_established(&mut self, now: Instant, initiator: bool) {
        self.session = Some(Session {
            established: now,
            initiator,
        });
        // A session from either side ends our attempt (simultaneous initiations).
        self.attempt = None;
    }

    /// Any other authenticated packet went out: a keepalive or a handshake response.
    pub fn on_packet_sent(&mut self, now: Instant) {
        self.last_sent = Some(now);
        self.last_traversal = Some(now);
        self.keepalive_due = None;
    }

    /// A data packet went out. Returns `SendHandshake` when the key is due for renewal.
    pub fn on_data_sent(&mut self, now: Instant) -> TimerAction {
        self.on_packet_sent(now);
        if self.handshake_due.is_none() {
            self.handshake_due = Some(now + KEEPALIVE_TIMEOUT + REKEY_TIMEOUT);
        }
        match self.session {
            Some(s)
                if s.initiator
                    && now.saturating_duration_since(s.established) >= REKEY_AFTER_TIME =>
            {
                self.wants_handshake()
            }
            _ => TimerAction::Idle,
        }
    }

    /// Any authenticated packet (handshake, keepalive or data) arrived.
    pub fn on_authenticated_received(&mut self, now: Instant) {
        self.handshake_due = None;
        self.last_traversal = Some(now);
    }

    /// A data packet (not a keepalive) arrived. Returns `SendHandshake` when the
    /// initiator's key is close to `REJECT_AFTER_TIME`.
    pub fn on_data_received(&mut self, now: Instant) -> TimerAction {
        self.on_authenticated_received(now);
        if self.keepalive_due.is_none() {
            self.keepalive_due = Some(now + KEEPALIVE_TIMEOUT);
        }
        match self.session {
            Some(s)
                if s.initiator
                    && now.saturating_duration_since(s.established)
                        >= REJECT_AFTER_TIME - KEEPALIVE_TIMEOUT - REKEY_TIMEOUT =>
            {
                self.wants_handshake()
            }
            _ => TimerAction::Idle,
        }
    }

    /// A handshake is wanted; none is started while one is already in flight.
    fn wants_handshake(&self) -> TimerAction {
        if self.attempt.is_some() {
            TimerAction::Idle
        } else {
            TimerAction::SendHandshake
        }
    }

    /// When `tick` next has something to do (`now` if it has now), or `None` when
    /// nothing is pending. The device sleeps until the earliest deadline of its peers
    /// instead of ticking on a fixed period.
    pub fn next_deadline(&self, now: Instant) -> Option<Instant> {
        let mut due: Option<Instant> = None;
        let mut at = |t: Instant| due = Some(due.map_or(t, |d| d.min(t)));
        if let Some(s) = self.session {
            at(s.established + REJECT_AFTER_TIME);
        }
        if let Some(a) = self.attempt {
            // While a handshake runs, `tick` does nothing else.
            at(a.started + REKEY_ATTEMPT_TIME);
            at(a.retry_due);
            return due;
        }
        if let Some(t) = self.handshake_due {
            at(t);
        }
        if let (Some(t), Some(_)) = (self.keepalive_due, self.session) {
            at(t);
        }
        if let Some(interval) = self.persistent_keepalive {
            at(self.last_traversal.map_or(now, |t| t + interval));
        }
        due
    }

    /// What is due at `now`. The device calls it at the earliest `next_deadline` of
    /// its peers and carries out the answer, reporting what it sent through the
    /// `on_*` events.
    pub fn tick(&mut self, now: Instant) -> TimerAction {
        if let Some(s) = self.session {
            if now.saturating_duration_since(s.established) >= REJECT_AFTER_TIME {
                self.session = None;
                self.keepalive_due = None;
                return TimerAction::ExpireKeys;
            }
        }
        if let Some(a) = self.attempt {
            if now.saturating_duration_since(a.started) >= REKEY_ATTEMPT_TIME {
                // Give up until traffic asks for a session again.
                self.attempt = None;
                self.handshake_due = None;
                return TimerAction::GiveUp;
            } else if now >= a.retry_due {
                return TimerAction::SendHandshake;
            }
            return TimerAction::Idle;
        }
        if self.handshake_due.is_some_and(|due| now >= due) {
            self.handshake_due = None;
            return TimerAction::SendHandshake;
        }
        if self.keepalive_due.is_some_and(|due| now >= due) && self.has_usable_session(now) {
            return TimerAction::SendKeepalive;
        }
        if let Some(interval) = self.persistent_keepalive {
            if self
                .last_traversal
                .is_none_or(|t| now.saturating_duration_since(t) >= interval)
            {
                return TimerAction::SendKeepalive;
            }
        }
        TimerAction::Idle
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake clock: seconds after a fixed start.
    struct Clock(Instant);
    impl Clock {
        fn at(&self, secs: u64) -> Instant {
            self.0 + Duration::from_secs(secs)
        }
    }

    fn established(initiator: bool) -> (Clock, PeerTimers) {
        let clock = Clock(Instant::now());
        let mut t = PeerTimers::new(0);
        if initiator {
            t.on_handshake_sent(clock.at(0), Duration::ZERO);
        }
        t.on_session_established(clock.at(0), initiator);
        (clock, t)
    }

    #[test]
    fn initiator_rekeys_on_send_after_120_seconds_only() {
        let (clock, mut t) = established(true);
        assert_eq!(t.on_data_sent(clock.at(119)), TimerAction::Idle);
        t.on_authenticated_received(clock.at(0));
        assert_eq!(t.on_data_sent(clock.at(120)), TimerAction::SendHandshake);
    }

    #[test]
    fn responder_never_rekeys_on_send() {
        let (clock, mut t) = established(false);
        assert_eq!(t.on_data_sent(clock.at(150)), TimerAction::Idle);
    }

    #[test]
    fn initiator_rekeys_on_receive_at_165_seconds() {
        let (clock, mut t) = established(true);
        assert_eq!(t.on_data_received(clock.at(164)), TimerAction::Idle);
        assert_eq!(
            t.on_data_received(clock.at(165)),
            TimerAction::SendHandshake
        );
    }

    #[test]
    fn keys_are_rejected_after_180_seconds() {
        let (clock, mut t) = established(false);
        assert!(t.has_usable_session(clock.at(179)));
        assert_ne!(t.tick(clock.at(179)), TimerAction::ExpireKeys);
        assert!(!t.has_usable_session(clock.at(180)));
        assert_eq!(t.tick(clock.at(180)), TimerAction::ExpireKeys);
        // Once: the keys are gone.
        assert_ne!(t.tick(clock.at(181)), TimerAction::ExpireKeys);
    }

    #[test]
    fn a_new_session_restarts_the_reject_clock() {
        let (clock, mut t) = established(true);
        t.on_session_established(clock.at(150), true);
        assert!(t.has_usable_session(clock.at(300)));
        assert_eq!(t.tick(clock.at(330)), TimerAction::ExpireKeys);
    }

    #[test]
    fn keepalive_follows_received_data_after_10_silent_seconds() {
        let (clock, mut t) = established(false);
        t.on_data_received(clock.at(1));
        assert_eq!(t.tick(clock.at(10)), TimerAction::Idle);
        assert_eq!(t.tick(clock.at(11)), TimerAction::SendKeepalive);
        t.on_packet_sent(clock.at(11));
        assert_eq!(t.tick(clock.at(30)), TimerAction::Idle);
    }

    #[test]
    fn sending_anything_cancels_the_keepalive() {
        let (clock, mut t) = established(false);
        t.on_data_received(clock.at(1));
        t.on_data_sent(clock.at(5));
        t.on_authenticated_received(clock.at(0));
        assert_eq!(t.tick(clock.at(12)), TimerAction::Idle);
    }

    #[test]
    fn unanswered_data_starts_a_handshake_after_15_seconds() {
        let (clock, mut t) = established(false);
        t.on_data_sent(clock.at(1));
        assert_eq!(t.tick(clock.at(15)), TimerAction::Idle);
        assert_eq!(t.tick(clock.at(16)), TimerAction::SendHandshake);
    }

    #[test]
    fn initiation_is_retried_every_5_seconds_and_given_up_after_90() {
        let clock = Clock(Instant::now());
        let mut t = PeerTimers::new(0);
        t.on_handshake_sent(clock.at(0), Duration::ZERO);
        assert_eq!(t.tick(clock.at(4)), TimerAction::Idle);
        assert_eq!(t.tick(clock.at(5)), TimerAction::SendHandshake);
        let mut now = 5;
        while now < 90 {
            t.on_handshake_sent(clock.at(now), Duration::ZERO);
            now += 5;
        }
        assert_eq!(t.tick(clock.at(90)), TimerAction::GiveUp);
        assert!(!t.handshake_in_progress());
        assert_eq!(t.tick(clock.at(200)), TimerAction::Idle);
    }

    /// Steps second by second: `next_deadline` names exactly the first second at which
    /// `tick` acts.
    fn assert_deadline_is_next_action(t: &mut PeerTimers, clock: &Clock, from: u64, to: u64) {
        let due = t.next_deadline(clock.at(from));
        let first_action = (from..to).find(|s| t.clone().tick(clock.at(*s)) != TimerAction::Idle);
        assert_eq!(
            due.map(|d| (d - clock.0).as_secs()),
            first_action,
            "from {from}"
        );
    }

    #[test]
    fn the_next_deadline_is_when_tick_next_acts() {
        let clock = Clock(Instant::now());
        let mut t = PeerTimers::new(0);
        assert_eq!(
            t.next_deadline(clock.at(0)),
            None,
            "nothing pending: no wake-up"
        );
        t.on_handshake_sent(clock.at(0), Duration::ZERO);
        assert_deadline_is_next_action(&mut t, &clock, 0, 10);
        t.on_session_established(clock.at(1), true);
        assert_deadline_is_next_action(&mut t, &clock, 1, 400);
        t.on_data_received(clock.at(2));
        assert_deadline_is_next_action(&mut t, &clock, 2, 400);
        t.on_data_sent(clock.at(3));
        assert_deadline_is_next_action(&mut t, &clock, 3, 400);
        // A handshake started while data awaits an answer: nothing but the attempt
        // counts until it ends (the data's deadline at 18 s passes silently).
        let mut waiting = t.clone();
        waiting.on_handshake_sent(clock.at(17), Duration::ZERO);
        assert_deadline_is_next_action(&mut waiting, &clock, 17, 400);
        t.on_authenticated_received(clock.at(0));
        assert_deadline_is_next_action(&mut t, &clock, 3, 400);
        let mut p = PeerTimers::new(25);
        assert_eq!(p.next_deadline(clock.at(7)), Some(clock.at(7)), "due now");
        p.on_packet_sent(clock.at(7));
        assert_deadline_is_next_action(&mut p, &clock, 7, 100);
    }

    #[test]
    fn persistent_keepalive_fires_after_its_interval_of_silence() {
        let clock = Clock(Instant::now());
        let mut t = PeerTimers::new(25);
        t.on_handshake_sent(clock.at(0), Duration::ZERO);
        t.on_session_established(clock.at(0), true);
        t.on_authenticated_received(clock.at(0));
        assert_eq!(t.tick(clock.at(24)), TimerAction::Idle);
        assert_eq!(t.tick(clock.at(25)), TimerAction::SendKeepalive);
        t.on_packet_sent(clock.at(25));
        assert_eq!(t.tick(clock.at(49)), TimerAction::Idle);
        assert_eq!(t.tick(clock.at(50)), TimerAction::SendKeepalive);
    }

    #[test]
    fn retries_carry_their_jitter() {
        let clock = Clock(Instant::now());
        let mut t = PeerTimers::new(0);
        t.on_handshake_sent(clock.at(0), Duration::from_millis(300));
        assert_eq!(
            t.next_deadline(clock.at(0)),
            Some(clock.at(5) + Duration::from_millis(300))
        );
        assert_eq!(t.tick(clock.at(5)), TimerAction::Idle);
        assert_eq!(
            t.tick(clock.at(5) + Duration::from_millis(300)),
            TimerAction::SendHandshake
        );
    }

    #[test]
    fn received_packets_also_put_off_the_persistent_keepalive() {
        let clock = Clock(Instant::now());
        let mut t = PeerTimers::new(25);
        t.on_handshake_sent(clock.at(0), Duration::ZERO);
        t.on_session_established(clock.at(0), true);
        t.on_authenticated_received(clock.at(20));
        assert_eq!(t.tick(clock.at(25)), TimerAction::Idle, "heard 5 s ago");
        assert_eq!(t.next_deadline(clock.at(25)), Some(clock.at(45)));
        assert_eq!(t.tick(clock.at(45)), TimerAction::SendKeepalive);
    }
}
