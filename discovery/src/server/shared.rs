//! What the gRPC service, the Watch streams, the relay, the background tasks and the
//! web pages share: config, state, rate limiters, metrics and the shutdown signal, and
//! the admission of a call against a per-address limiter.

use std::{
    net::IpAddr,
    sync::{Mutex, MutexGuard},
    time::{Duration, Instant},
};

use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::{
    error::RequestError, metrics::Metrics, ratelimit::RateLimiter, state::State, ServerConfig,
};

/// Everything the service, the background tasks and the web pages share.
pub struct Shared {
    pub(crate) config: ServerConfig,
    pub(crate) state: Mutex<State>,
    pub(crate) limiter: Mutex<RateLimiter>,
    /// AffiliateDelete's own per-address limit (beside `limiter`).
    delete_limiter: Mutex<RateLimiter>,
    pub(crate) metrics: Metrics,
    pub(crate) shutdown: CancellationToken,
    /// Set (before the token is cancelled) once the server stops: what a Watch
    /// stream checks each time it waits, where the token's own check takes a lock
    /// shared by every stream.
    stopping: std::sync::atomic::AtomicBool,
    /// Serialises snapshot saves: a periodic save still running when shutdown saves
    /// must not share the temp file with it.
    pub(crate) save_lock: Mutex<()>,
}

impl Shared {
    pub fn new(config: ServerConfig, state: State, shutdown: CancellationToken) -> Self {
        Self {
            config,
            state: Mutex::new(state),
            limiter: Mutex::new(RateLimiter::default()),
            delete_limiter: Mutex::new(RateLimiter::for_deletes()),
            metrics: Metrics::new(),
            shutdown,
            stopping: std::sync::atomic::AtomicBool::new(false),
            save_lock: Mutex::new(()),
        }
    }

    /// Starts stopping: the flag, then the token (a stream that sees neither yet is
    /// woken by the close of its queue that follows).
    pub(crate) fn stop(&self) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.shutdown.cancel();
    }

    /// Whether [`Self::stop`] was called.
    pub(crate) fn is_stopping(&self) -> bool {
        self.stopping.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The state lock. A panic while holding it cannot leave the maps half-updated in
    /// a way later calls trip over (every operation validates first), so poisoning is
    /// ignored rather than turned into a crash of every later call.
    pub fn state(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn limiter(&self, limit: Limit) -> MutexGuard<'_, RateLimiter> {
        let limiter = match limit {
            Limit::Calls => &self.limiter,
            Limit::Deletes => &self.delete_limiter,
        };
        limiter
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes a token of `limit` for `addr`, waiting for a reserved one if need be; a
    /// call dropped while it waits (cancelled, deadline passed) gives it back.
    ///
    /// # Errors
    /// RESOURCE_EXHAUSTED if the wait would outlast `deadline` or the debt cap.
    pub(crate) async fn admit(
        &self,
        limit: Limit,
        addr: IpAddr,
        deadline: Option<Duration>,
    ) -> Result<(), Status> {
        let (grant, buckets) = {
            let mut limiter = self.limiter(limit);
            (
                limiter.acquire(addr, Instant::now(), deadline),
                limiter.len(),
            )
        };
        self.metrics.rate_limit_buckets(limit.label(), buckets);
        let grant = grant.map_err(|rejection| {
            self.metrics
                .rate_limit_rejected(limit.label(), rejection.label());
            Status::from(RequestError::from(rejection))
        })?;
        self.metrics
            .rate_limit_evicted(limit.label(), grant.evicted);
        if grant.wait.is_zero() {
            return Ok(());
        }
        let mut refund = RefundOnDrop {
            shared: self,
            limit,
            addr,
            armed: true,
        };
        tokio::time::sleep(grant.wait).await;
        refund.armed = false;
        Ok(())
    }

    /// Stops the old limiter entries from piling up (every minute).
    pub(crate) fn cleanup_limiters(&self, now: Instant) {
        self.limiter(Limit::Calls).cleanup(now);
        self.limiter(Limit::Deletes).cleanup(now);
    }
}

/// Which per-address limiter a call draws from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Limit {
    /// Every RPC (upstream's 15/s, burst 60).
    Calls,
    /// AffiliateDelete, in addition.
    Deletes,
}

impl Limit {
    fn label(self) -> &'static str {
        match self {
            Self::Calls => "calls",
            Self::Deletes => "deletes",
        }
    }
}

/// Hands a reserved token back unless the call got to use it.
struct RefundOnDrop<'a> {
    shared: &'a Shared,
    limit: Limit,
    addr: IpAddr,
    armed: bool,
}

impl Drop for RefundOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.shared
                .limiter(self.limit)
                .refund(self.addr, Instant::now());
            self.shared.metrics.rate_limit_refunded(self.limit.label());
        }
    }
}
