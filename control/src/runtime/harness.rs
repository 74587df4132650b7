//! [`Harness`]: a [`Runtime`] running on a spawned task, with a handle to stop it.
//!
//! Tests and the benchmarks (`wirespan bench`) start controllers this way; it lives in
//! the runtime, not in `testing`, because the bench crate is product code and must not
//! depend on test helpers.

use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{Runtime, RuntimeError, Store};

/// A running runtime; [`Harness::stop`] cancels it and waits for all tasks, and
/// dropping it cancels it without waiting.
#[derive(Debug)]
pub struct Harness {
    /// The store.
    pub store: Store,
    cancel: CancellationToken,
    join: Option<JoinHandle<Result<(), RuntimeError>>>,
}

impl Harness {
    /// Spawns `runtime.run`.
    #[must_use]
    pub fn start(runtime: Runtime) -> Self {
        let store = runtime.store().clone();
        let cancel = CancellationToken::new();
        let join = tokio::spawn(runtime.run(cancel.clone()));
        Self {
            store,
            cancel,
            join: Some(join),
        }
    }

    /// Cancels the runtime and returns its result.
    ///
    /// # Panics
    /// If the runtime task panicked.
    pub async fn stop(mut self) -> Result<(), RuntimeError> {
        self.cancel.cancel();
        self.join
            .take()
            .expect("not stopped")
            .await
            .expect("runtime task panicked")
    }

    /// Waits for the runtime to stop by itself (e.g. on a watch error).
    ///
    /// # Panics
    /// If the runtime task panicked or does not stop within `timeout`.
    pub async fn wait_stopped(mut self, timeout: Duration) -> Result<(), RuntimeError> {
        let join = self.join.take().expect("not stopped");
        tokio::time::timeout(timeout, join)
            .await
            .expect("runtime did not stop")
            .expect("runtime task panicked")
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
