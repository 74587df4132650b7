//! Which kind of round comes next (`docs/kubespan.md` §8.2): a delta round for a few
//! changed peer specs, a complete one when the device is due for a read or anything
//! else changed, or a delta round first and the due read right after.

use std::time::{Duration, SystemTime};

use crate::kubespan::rotation::RECONCILE_TICK;

/// More changed peers than this take a complete round.
pub const DELTA_MAX: usize = 64;

/// How long a due device read may wait behind one-peer changes (see [`choose_round`]).
/// Short against every window the reads serve (a receive window is at least 6 s, a
/// probe's grace 2 s), so failure detection is late by this at most, and only while
/// peer specs keep changing.
pub const READ_DEFER_MAX: Duration = Duration::from_secs(1);

/// The kind of a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Round {
    /// Only the changed peers, on the last observation.
    Delta,
    /// A delta round now, and the due read in a complete round right after: the
    /// change does not wait for every peer to be read and judged.
    DeltaThenRead,
    /// Every peer.
    Complete {
        /// The device is read first.
        read: bool,
    },
}

/// Chooses the round at `now`. A read is due on a new device (`last_read` none), a
/// tick after the last read, or at a peer wake-up that has passed (a change can win
/// the race with the timer: judging receive windows then needs fresh counters);
/// `timer`: the loop's timer fired, which also means a read is due. `delta`: the
/// round could be a delta round over this many changed peer specs (nothing else
/// changed).
///
/// A change that could be a delta round goes first even when a read is due, unless
/// the device is new or the read overdue by [`READ_DEFER_MAX`]: at 10,000 peers a read
/// and judging every peer take tens to hundreds of milliseconds, the change a fraction
/// of one.
#[must_use]
pub fn choose_round(
    now: SystemTime,
    last_read: Option<SystemTime>,
    wake: Option<SystemTime>,
    timer: bool,
    delta: Option<usize>,
) -> Round {
    let Some(last_read) = last_read else {
        return Round::Complete { read: true };
    };
    let due_at = wake.map_or(last_read + RECONCILE_TICK, |w| {
        w.min(last_read + RECONCILE_TICK)
    });
    let read_due = timer || now >= due_at;
    match (delta, read_due) {
        (Some(_), false) => Round::Delta,
        // With nothing changed there is nothing to put first.
        (Some(n), true) if n > 0 && now < due_at + READ_DEFER_MAX => Round::DeltaThenRead,
        _ => Round::Complete { read: read_due },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ms: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000) + Duration::from_millis(ms)
    }

    const TICK_MS: u64 = 30_000;

    #[test]
    fn a_change_before_the_read_is_due_is_a_delta_round() {
        assert_eq!(
            choose_round(t(10_000), Some(t(0)), None, false, Some(1)),
            Round::Delta
        );
        assert_eq!(
            choose_round(t(10_000), Some(t(0)), Some(t(12_000)), false, Some(1)),
            Round::Delta
        );
    }

    #[test]
    fn a_change_when_the_read_is_due_goes_first_and_the_read_follows() {
        // The tick passed, a peer wake-up passed, or the timer fired with the change.
        for (now, wake, timer) in [
            (TICK_MS, None, false),
            (5_000, Some(t(4_500)), false),
            (TICK_MS, None, true),
        ] {
            assert_eq!(
                choose_round(t(now), Some(t(0)), wake, timer, Some(1)),
                Round::DeltaThenRead,
                "now {now} wake {wake:?} timer {timer}"
            );
        }
    }

    #[test]
    fn a_read_overdue_by_the_deferral_limit_waits_no_longer() {
        let limit = u64::try_from(READ_DEFER_MAX.as_millis()).unwrap_or(u64::MAX);
        assert_eq!(
            choose_round(t(TICK_MS + limit - 1), Some(t(0)), None, false, Some(1)),
            Round::DeltaThenRead
        );
        assert_eq!(
            choose_round(t(TICK_MS + limit), Some(t(0)), None, false, Some(1)),
            Round::Complete { read: true }
        );
        assert_eq!(
            choose_round(t(4_000 + limit), Some(t(0)), Some(t(4_000)), true, Some(1)),
            Round::Complete { read: true }
        );
    }

    #[test]
    fn rounds_that_cannot_be_deltas_are_complete_and_read_when_due() {
        assert_eq!(
            choose_round(t(10_000), Some(t(0)), None, false, None),
            Round::Complete { read: false }
        );
        assert_eq!(
            choose_round(t(10_000), Some(t(0)), None, true, None),
            Round::Complete { read: true }
        );
        assert_eq!(
            choose_round(t(TICK_MS), Some(t(0)), None, false, None),
            Round::Complete { read: true }
        );
        // Nothing changed: nothing to put before a due read.
        assert_eq!(
            choose_round(t(TICK_MS), Some(t(0)), None, true, Some(0)),
            Round::Complete { read: true }
        );
        assert_eq!(
            choose_round(t(10_000), Some(t(0)), None, false, Some(0)),
            Round::Delta
        );
        // A new device is read at once, change or not.
        assert_eq!(
            choose_round(t(0), None, None, false, Some(1)),
            Round::Complete { read: true }
        );
    }
}
