//! The time source of the mesh controllers: the system clock, or a fake one that tests
//! advance by hand (sleepers wake when it passes their deadline).

use std::time::SystemTime;
#[cfg(any(test, feature = "testing"))]
use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, PoisonError,
    },
};

use futures::future::BoxFuture;
#[cfg(any(test, feature = "testing"))]
use tokio::sync::watch;

/// Wall-clock time and sleeping until a wall-clock deadline.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Now.
    fn now(&self) -> SystemTime;
    /// Resolves at or after `deadline`.
    fn sleep_until(&self, deadline: SystemTime) -> BoxFuture<'static, ()>;
}

/// The system clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }

    fn sleep_until(&self, deadline: SystemTime) -> BoxFuture<'static, ()> {
        let d = deadline
            .duration_since(SystemTime::now())
            .unwrap_or_default();
        Box::pin(tokio::time::sleep(d))
    }
}

/// A clock that moves only when told to (tests only). It knows its sleepers, so a
/// test can wait until the code under test has handled an advance (see
/// [`FakeClock::settled`]) instead of sleeping for a while.
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Clone)]
pub struct FakeClock {
    now: Arc<watch::Sender<SystemTime>>,
    /// Deadlines of the live `sleep_until` futures, by a serial number.
    sleepers: Arc<Mutex<BTreeMap<u64, SystemTime>>>,
    next_sleeper: Arc<AtomicU64>,
}

#[cfg(any(test, feature = "testing"))]
impl FakeClock {
    /// A clock at `start`.
    #[must_use]
    pub fn new(start: SystemTime) -> Self {
        Self {
            now: Arc::new(watch::Sender::new(start)),
            sleepers: Arc::default(),
            next_sleeper: Arc::default(),
        }
    }

    /// Moves the clock forward, waking sleepers whose deadline passed.
    pub fn advance(&self, by: std::time::Duration) {
        self.now.send_modify(|t| *t += by);
    }

    /// Whether every sleeper's deadline is still ahead and there is at least one: the
    /// code that sleeps on this clock has handled every advance so far and waits for
    /// the next deadline (a woken sleeper is gone once its loop runs, and the loop's
    /// next sleep is ahead).
    #[must_use]
    pub fn settled(&self) -> bool {
        let now = self.now();
        let sleepers = self.sleepers.lock().unwrap_or_else(PoisonError::into_inner);
        !sleepers.is_empty() && sleepers.values().all(|d| *d > now)
    }
}

/// Removes its sleeper from the clock's list when the sleep future goes.
#[cfg(any(test, feature = "testing"))]
struct Sleeper {
    id: u64,
    sleepers: Arc<Mutex<BTreeMap<u64, SystemTime>>>,
}

#[cfg(any(test, feature = "testing"))]
impl Drop for Sleeper {
    fn drop(&mut self) {
        self.sleepers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.id);
    }
}

#[cfg(any(test, feature = "testing"))]
impl Clock for FakeClock {
    fn now(&self) -> SystemTime {
        *self.now.borrow()
    }

    fn sleep_until(&self, deadline: SystemTime) -> BoxFuture<'static, ()> {
        let id = self.next_sleeper.fetch_add(1, Ordering::Relaxed);
        self.sleepers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, deadline);
        let registered = Sleeper {
            id,
            sleepers: Arc::clone(&self.sleepers),
        };
        let mut rx = self.now.subscribe();
        Box::pin(async move {
            let _registered = registered;
            if rx.wait_for(|t| *t >= deadline).await.is_err() {
                // Clock dropped: never wake.
                std::future::pending::<()>().await;
            }
        })
    }
}
