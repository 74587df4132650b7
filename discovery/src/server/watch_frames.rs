//! A registered watcher's messages as a stream, polled straight from the Watch response
//! body (framed) or through the generated service (whole messages).

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Instant,
};

use bytes::Bytes;
use futures::Stream;
use tonic::Status;

use super::{
    error::RequestError,
    shared::Shared,
    state::{CatchUp, Next, Subscription, WatchQueue},
};

/// Unsubscribes when the Watch stream is dropped (client went away or stream ended).
struct WatchGuard {
    shared: Arc<Shared>,
    cluster_id: String,
    id: u64,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.shared.state().unsubscribe(&self.cluster_id, self.id);
    }
}

/// A registered watcher's messages: the snapshot first, then its queue (or its
/// cluster's event log) until the queue is closed or lost; whole messages, or
/// (`framed`) body frames of at most [`FRAME`](super::state::encode::FRAME) bytes
/// with the gRPC message prefix. Polled straight from the response body: no
/// future or boxed stream between the transport and the queue.
pub(crate) struct WatchFrames {
    framed: bool,
    queue: Arc<WatchQueue>,
    done: bool,
    guard: WatchGuard,
}

impl WatchFrames {
    pub(crate) fn new(shared: Arc<Shared>, sub: Subscription, framed: bool) -> Self {
        // Always first, even when empty: clients know the snapshot by its position.
        // It waits in the queue, where an abort can free it.
        sub.queue.send_first(sub.snapshot);
        Self {
            framed,
            queue: sub.queue,
            done: false,
            guard: WatchGuard {
                shared,
                cluster_id: sub.cluster_id,
                id: sub.id,
            },
        }
    }
}

impl Stream for WatchFrames {
    type Item = Result<Bytes, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        loop {
            // Before the look at the queue: whatever changes after it wakes us.
            self.queue.register(cx.waker());
            let now = Instant::now();
            let next = if self.framed {
                self.queue.next_frame(now)
            } else {
                self.queue.next(now)
            };
            match next {
                Next::Send(event) => return Poll::Ready(Some(Ok(event))),
                Next::CatchUp => {
                    let g = &self.guard;
                    let done = g.shared.state().catch_up(now, &g.cluster_id, g.id);
                    match done {
                        CatchUp::Gone => {
                            self.done = true;
                            return Poll::Ready(None);
                        }
                        CatchUp::FromState => self.guard.shared.metrics.watch_catch_up(),
                        CatchUp::Rejoined | CatchUp::FromLog => {}
                    }
                }
                Next::Lost => {
                    self.done = true;
                    self.guard.shared.metrics.watch_aborted();
                    return Poll::Ready(Some(Err(RequestError::LostUpdate.into())));
                }
                Next::Closed => {
                    self.done = true;
                    return Poll::Ready(None);
                }
                Next::Wait => {
                    // Stopping sets the flag, then closes every registered queue
                    // (which wakes its stream); a watcher registered after that sees
                    // the flag here. A load: waiting on the shutdown token instead
                    // would register every waiting stream with the one token shared
                    // by all of them at each event, and even its check takes the
                    // token's lock.
                    if self.guard.shared.is_stopping() {
                        self.done = true;
                        return Poll::Ready(None);
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}
