//! One controller's life under the runtime (`docs/runtime.md` §3.4, §3.5): start it,
//! wait for what its [`Triggers`] and last [`Action`] name, run a round inside its
//! span, and after an error or panic back off and start it again.

use std::{panic::AssertUnwindSafe, sync::PoisonError};

use futures::{future::BoxFuture, stream::BoxStream, FutureExt as _, StreamExt as _};
use tokio::time::Instant;
use tracing::Instrument as _;

use super::{
    action::{Action, Requeue, Triggers},
    Controller, ControllerError, ControllerRuntime,
};

/// A registered controller, type-erased: runs it until the runtime stops.
pub(super) type Driver = Box<dyn FnOnce(ControllerRuntime) -> BoxFuture<'static, ()> + Send>;

/// Erases `ctrl`'s event type.
pub(super) fn driver<C: Controller>(ctrl: C) -> Driver {
    Box::new(move |rt| Box::pin(drive(ctrl, rt)))
}

/// Most events handed to one round; the rest go to the next.
const MAX_EVENTS_PER_ROUND: usize = 1024;

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

/// Why a controller's rounds ended.
enum Exit {
    /// The runtime is shutting down.
    Cancelled,
    /// `start` or a round failed or panicked.
    Failed(ControllerError),
}

async fn drive<C: Controller>(mut ctrl: C, mut rt: ControllerRuntime) {
    let name = rt.handle.name.clone();
    // Every line the controller logs, in its rounds and hooks, carries its name.
    let span = tracing::info_span!("controller", controller = %name);
    let mut crashes: u64 = 0;
    loop {
        let err = match rounds(&mut ctrl, &mut rt, &span).await {
            Exit::Cancelled => {
                ctrl.stop(&mut rt).instrument(span.clone()).await;
                return;
            }
            Exit::Failed(e) => e,
        };
        rt.tracked = None;
        if rt.cancel.is_cancelled() {
            // Errors caused by shutdown count as a clean exit.
            return;
        }
        crashes += 1;
        let hook = rt
            .shared
            .on_restart
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(hook) = hook {
            hook(&name);
        }
        let delay = rt
            .handle
            .backoff
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .next(&mut rand::thread_rng());
        span.in_scope(|| {
            tracing::error!(error = %err, crashes, ?delay, "controller failed, restarting");
        });
        tokio::select! {
            () = rt.cancel.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
        // A restart begins with a round, like the first start.
        rt.handle.wake.notify_one();
    }
}

async fn rounds<C: Controller>(
    ctrl: &mut C,
    rt: &mut ControllerRuntime,
    span: &tracing::Span,
) -> Exit {
    let started = std::panic::catch_unwind(AssertUnwindSafe(|| span.in_scope(|| ctrl.start(rt))));
    let triggers = match started {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => return Exit::Failed(e),
        Err(p) => return Exit::Failed(ControllerError::Panic(panic_message(&*p))),
    };
    let mut waiting = Waiting::new(triggers);
    loop {
        let Some(events) = waiting.next(rt).instrument(span.clone()).await else {
            return Exit::Cancelled;
        };
        let round = AssertUnwindSafe(ctrl.reconcile(rt, events))
            .catch_unwind()
            .instrument(span.clone())
            .await;
        match round {
            Ok(Ok(action)) => {
                waiting.after_round(action);
                rt.reset_restart_backoff();
            }
            Ok(Err(e)) => return Exit::Failed(e),
            Err(p) => return Exit::Failed(ControllerError::Panic(panic_message(&*p))),
        }
    }
}

/// What a controller waits for between two rounds.
struct Waiting<E> {
    events: Option<BoxStream<'static, E>>,
    resync: Option<std::time::Duration>,
    resync_at: Option<Instant>,
    requeue: Requeue<E>,
}

/// What ended one wait.
enum Woken<E> {
    Cancelled,
    Round(Vec<E>),
    StreamEnded,
}

impl<E: Send + 'static> Waiting<E> {
    fn new(triggers: Triggers<E>) -> Self {
        Self {
            events: triggers.events,
            resync: triggers.resync,
            resync_at: triggers.resync.map(|p| Instant::now() + p),
            requeue: Requeue::Never,
        }
    }

    fn after_round(&mut self, action: Action<E>) {
        self.requeue = action.requeue;
        self.resync_at = self.resync.map(|p| Instant::now() + p);
    }

    /// The events of the next round, or `None` when the runtime shuts down. Prefers,
    /// in order: shutdown, an input change, stream events, the requeue future, the
    /// earliest of the requeue time and the resync.
    async fn next(&mut self, rt: &ControllerRuntime) -> Option<Vec<E>> {
        loop {
            match self.wait_once(rt).await {
                Woken::Cancelled => return None,
                Woken::Round(events) => return Some(events),
                Woken::StreamEnded => {
                    // One behaviour for every controller: the stream's end is not an
                    // error, and input changes, requeues and the resync go on.
                    tracing::debug!("event stream ended; other triggers continue");
                    self.events = None;
                }
            }
        }
    }

    async fn wait_once(&mut self, rt: &ControllerRuntime) -> Woken<E> {
        let deadline = match (&self.requeue, self.resync_at) {
            (Requeue::At(t), Some(r)) => Some((*t).min(r)),
            (Requeue::At(t), None) => Some(*t),
            (_, r) => r,
        };
        let timer = async move {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        let requeue = &mut self.requeue;
        let when = async move {
            match requeue {
                Requeue::When(f) => f.await,
                _ => std::future::pending().await,
            }
        };
        let events = &mut self.events;
        let item = async move {
            match events {
                Some(s) => s.next().await.map(|first| (first, s)),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = rt.cancel.cancelled() => Woken::Cancelled,
            () = rt.handle.wake.notified() => Woken::Round(Vec::new()),
            next = item => match next {
                Some((first, stream)) => {
                    let mut batch = vec![first];
                    // Whatever else is ready goes to the same round.
                    while batch.len() < MAX_EVENTS_PER_ROUND {
                        match stream.next().now_or_never() {
                            Some(Some(e)) => batch.push(e),
                            _ => break,
                        }
                    }
                    Woken::Round(batch)
                }
                None => Woken::StreamEnded,
            },
            e = when => Woken::Round(vec![e]),
            () = timer => Woken::Round(Vec::new()),
        }
    }
}
