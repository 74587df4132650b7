//! Watchers (`docs/runtime.md` §2.4): a [`KindWatch`] reads one kind's channel from its own
//! position, filtered to one id or by labels. It knows nothing of the store that
//! opened it. The event types are in `event` and re-exported here.

use std::{collections::VecDeque, sync::Arc};

pub use super::event::{Event, WatchOptions};
use super::{channel::KindShared, error::StateError, metadata::Pointer, query::Filter};

/// A watcher of one kind (or one id of it). Read it with [`KindWatch::recv`] or, for
/// aggregated delivery, [`KindWatch::recv_batch`].
pub struct KindWatch {
    shared: Arc<KindShared>,
    pos: u64,
    filter: Filter,
    id: Option<String>,
    pending: VecDeque<Event>,
    done: bool,
}

impl std::fmt::Debug for KindWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KindWatch")
            .field("kind", &self.shared.kind)
            .field("pos", &self.pos)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl KindWatch {
    pub(crate) fn new(
        shared: Arc<KindShared>,
        pos: u64,
        filter: Filter,
        id: Option<String>,
        pending: VecDeque<Event>,
    ) -> Self {
        Self {
            shared,
            pos,
            filter,
            id,
            pending,
            done: false,
        }
    }

    /// Moves everything new into `pending`; true if something arrived or the watch ended.
    fn collect(&mut self) -> bool {
        let st = self.shared.lock();
        if self.pos < st.start {
            self.pending.push_back(Event::Errored(StateError::Overrun {
                pointer: Pointer::new(
                    self.shared.kind.namespace.clone(),
                    self.shared.kind.r#type.clone(),
                    "",
                ),
                capacity: self.shared.capacity,
            }));
            self.done = true;
            return true;
        }
        let head = st.head();
        if head == self.pos {
            return false;
        }
        let skip = usize::try_from(self.pos - st.start).unwrap_or(usize::MAX);
        let before = self.pending.len();
        for ev in st.ring.range(skip..) {
            if self.id.as_deref().is_some_and(|id| id != ev.id()) {
                continue;
            }
            if let Some(e) = ev.filtered(&self.filter) {
                self.pending.push_back(e);
            }
        }
        self.pos = head;
        self.pending.len() > before
    }

    async fn wait(&mut self) {
        loop {
            let shared = Arc::clone(&self.shared);
            let notified = shared.notify.notified();
            tokio::pin!(notified);
            // Register before checking, so a write between the check and the await is
            // not missed.
            notified.as_mut().enable();
            if self.collect() {
                return;
            }
            notified.await;
        }
    }

    /// The next event; `None` once the watch has ended (after an `Errored`).
    pub async fn recv(&mut self) -> Option<Event> {
        if self.pending.is_empty() {
            if self.done {
                return None;
            }
            self.wait().await;
        }
        self.pending.pop_front()
    }

    /// Appends whatever is pending now to `out`, without waiting. Returns false once
    /// the watch has ended (the `Errored` event is then the last one appended).
    pub fn drain_now(&mut self, out: &mut Vec<Event>) -> bool {
        if !self.done {
            self.collect();
        }
        out.extend(self.pending.drain(..));
        !self.done
    }

    /// Aggregated delivery: appends everything pending (at least one event) to `out`.
    /// Returns false once the watch has ended.
    pub async fn recv_batch(&mut self, out: &mut Vec<Event>) -> bool {
        if self.pending.is_empty() {
            if self.done {
                return false;
            }
            self.wait().await;
        }
        out.extend(self.pending.drain(..));
        true
    }
}
