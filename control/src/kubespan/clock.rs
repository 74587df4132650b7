//! The time source of the mesh controllers: the system clock, or a fake one that tests
//! advance by hand (sleepers wake when it passes their deadline).

#[cfg(any(test, feature = "testing"))]
use std::sync::Arc;
use std::time::SystemTime;

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

/// A clock that moves only when told to (tests only).
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Clone)]
pub struct FakeClock(Arc<watch::Sender<SystemTime>>);

#[cfg(any(test, feature = "testing"))]
impl FakeClock {
    /// A clock at `start`.
    #[must_use]
    pub fn new(start: SystemTime) -> Self {
        Self(Arc::new(watch::Sender::new(start)))
    }

    /// Moves the clock forward, waking sleepers whose deadline passed.
    pub fn advance(&self, by: std::time::Duration) {
        self.0.send_modify(|t| *t += by);
    }
}

#[cfg(any(test, feature = "testing"))]
impl Clock for FakeClock {
    fn now(&self) -> SystemTime {
        *self.0.borrow()
    }

    fn sleep_until(&self, deadline: SystemTime) -> BoxFuture<'static, ()> {
        let mut rx = self.0.subscribe();
        Box::pin(async move {
            if rx.wait_for(|t| *t >= deadline).await.is_err() {
                // Clock dropped: never wake.
                std::future::pending::<()>().await;
            }
        })
    }
}
