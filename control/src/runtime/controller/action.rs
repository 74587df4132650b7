//! What a controller tells the runtime about waiting (`docs/runtime.md` §3.1, §3.4):
//! [`Triggers`], declared once per start (an event stream, a resync period), and
//! [`Action`], returned by every round (when to run the next one).

use std::{fmt, time::Duration};

use futures::{future::BoxFuture, stream::BoxStream};
use tokio::time::Instant;

/// What wakes a controller besides its inputs, for as long as it runs: returned by
/// [`Controller::start`](super::Controller::start), which runs again after every
/// restart.
pub struct Triggers<E> {
    pub(super) events: Option<BoxStream<'static, E>>,
    pub(super) resync: Option<Duration>,
}

impl<E> Triggers<E> {
    /// Input changes (and the controller's own [`Action`]s) only.
    #[must_use]
    pub fn inputs_only() -> Self {
        Self {
            events: None,
            resync: None,
        }
    }

    /// Also wakes on every item of `events`; the items are handed to the next round.
    /// When the stream ends the controller keeps running on its other triggers.
    #[must_use]
    pub fn with_events(mut self, events: BoxStream<'static, E>) -> Self {
        self.events = Some(events);
        self
    }

    /// Also runs a round when `period` has passed since the last one ended, whatever
    /// woke it (repairs drift nothing reports).
    #[must_use]
    pub fn with_resync(mut self, period: Duration) -> Self {
        self.resync = Some(period);
        self
    }
}

impl<E> fmt::Debug for Triggers<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Triggers")
            .field("events", &self.events.is_some())
            .field("resync", &self.resync)
            .finish()
    }
}

/// When the next round runs, besides input changes, events and resync, which always
/// wake the controller early (kube-rs's `Action` in spirit).
pub struct Action<E = ()> {
    pub(super) requeue: Requeue<E>,
}

pub(super) enum Requeue<E> {
    Never,
    At(Instant),
    When(BoxFuture<'static, E>),
}

impl<E> Action<E> {
    /// Nothing scheduled: wait for a trigger.
    #[must_use]
    pub fn await_change() -> Self {
        Self {
            requeue: Requeue::Never,
        }
    }

    /// Another round after `delay` at the latest.
    #[must_use]
    pub fn requeue_after(delay: Duration) -> Self {
        Self::requeue_at(Instant::now() + delay)
    }

    /// Another round at `deadline` at the latest.
    #[must_use]
    pub fn requeue_at(deadline: Instant) -> Self {
        Self {
            requeue: Requeue::At(deadline),
        }
    }

    /// Another round when `wake` resolves (at the latest), with its output handed to
    /// that round as an event: for controllers with their own clock or a one-shot
    /// signal. Dropped unresolved if a trigger starts a round first.
    #[must_use]
    pub fn requeue_when(wake: BoxFuture<'static, E>) -> Self {
        Self {
            requeue: Requeue::When(wake),
        }
    }

    /// [`Action::requeue_after`] when `delay` is some, else [`Action::await_change`].
    #[must_use]
    pub fn requeue_after_opt(delay: Option<Duration>) -> Self {
        delay.map_or_else(Self::await_change, Self::requeue_after)
    }
}

impl<E> fmt::Debug for Action<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.requeue {
            Requeue::Never => f.write_str("Action::AwaitChange"),
            Requeue::At(t) => write!(f, "Action::RequeueAt({t:?})"),
            Requeue::When(_) => f.write_str("Action::RequeueWhen(..)"),
        }
    }
}
