//! How late the server's runtime runs: the grace a stalled-looking watcher gets.

use std::{
    sync::{Mutex, MutexGuard},
    time::{Duration, Instant},
};

/// How far behind the server's own runtime is. A watcher whose stream the server
/// did not get to run took nothing through no fault of its own; under a burst that
/// keeps the server's workers busy (a join storm) it would otherwise be dropped as
/// stalled, reconnect, and add a snapshot to the very load that delayed it. The
/// stall timeout is therefore extended by how late the runtime runs what it was
/// given: the lateness of the server's periodic task, and the wait of a probe task
/// queued from outside the runtime. The probe waits in the runtime's shared queue,
/// where woken streams wait too once the workers' own queues overflow, while a
/// timer's task is run next by the worker that fires it, so the periodic task alone
/// can be on time while streams wait seconds. The latest lateness is kept, halving
/// every [`LAG_HALF_LIFE`]; a tick or probe still waiting counts as late by its age.
/// A stream's progress from one take to the next passes through the runtime's queue
/// up to [`LAG_HOPS`] times, so the grace is that many times the lateness.
#[derive(Debug, Default)]
pub struct RuntimeLag(Mutex<LagTicks>);

/// How fast a lateness seen once stops counting: halved per this much time.
pub const LAG_HALF_LIFE: Duration = Duration::from_secs(1);

/// Runtime queue passes between two takes of a stream: its data written by the
/// connection's task, the client's WINDOW_UPDATE read by it, the stream's task woken
/// to take the next piece.
pub const LAG_HOPS: u32 = 3;

#[derive(Debug, Default)]
struct LagTicks {
    /// When the periodic task last ran, and its interval.
    last: Option<(Instant, Duration)>,
    /// The lateness kept, and when it was seen.
    late: Option<(Duration, Instant)>,
    /// When the probe now queued was queued.
    probe: Option<Instant>,
}

impl LagTicks {
    /// The kept lateness as it counts at `now`.
    fn late_at(&self, now: Instant) -> Duration {
        self.late.map_or(Duration::ZERO, |(late, at)| {
            let halvings =
                now.saturating_duration_since(at).as_secs_f64() / LAG_HALF_LIFE.as_secs_f64();
            late.mul_f64(0.5f64.powf(halvings))
        })
    }

    fn saw(&mut self, now: Instant, late: Duration) {
        if late >= self.late_at(now) {
            self.late = Some((late, now));
        }
    }
}

impl RuntimeLag {
    fn lock(&self) -> MutexGuard<'_, LagTicks> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The periodic task ran at `now`, `late` after it was due, and runs again
    /// `every` later.
    pub fn tick(&self, now: Instant, late: Duration, every: Duration) {
        let mut t = self.lock();
        t.saw(now, late);
        t.last = Some((now, every));
    }

    /// A probe is queued at `at`; false (nothing to queue) while one still waits.
    pub fn probe_queued(&self, at: Instant) -> bool {
        let mut t = self.lock();
        if t.probe.is_some() {
            return false;
        }
        t.probe = Some(at);
        true
    }

    /// The queued probe ran at `now`.
    pub fn probe_ran(&self, now: Instant) {
        let mut t = self.lock();
        if let Some(at) = t.probe.take() {
            t.saw(now, now.saturating_duration_since(at));
        }
    }

    /// What the stall timeout is extended by at `now`.
    pub fn grace(&self, now: Instant) -> Duration {
        let t = self.lock();
        let overdue = t.last.map_or(Duration::ZERO, |(at, every)| {
            now.saturating_duration_since(at + every)
        });
        let waiting = t
            .probe
            .map_or(Duration::ZERO, |at| now.saturating_duration_since(at));
        t.late_at(now).max(overdue).max(waiting) * LAG_HOPS
    }
}
