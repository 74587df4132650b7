//! Watch events and watchers (spec §2.4).

use std::{collections::VecDeque, sync::Arc};

use super::{
    metadata::{Metadata, Pointer},
    query::Filter,
    resource::{AnyResource, SpecEncodeError},
    store::{KindShared, StateError},
};

/// A watch event.
#[derive(Debug, Clone)]
pub enum Event {
    /// The resource was created (or exists at bootstrap).
    Created(Arc<dyn AnyResource>),
    /// The resource changed.
    Updated {
        /// The new state.
        new: Arc<dyn AnyResource>,
        /// The previous state.
        old: Arc<dyn AnyResource>,
    },
    /// The resource was destroyed (last state, or a metadata-only tombstone).
    Destroyed(Arc<dyn AnyResource>),
    /// End of the bootstrap contents of a kind watch.
    Bootstrapped,
    /// The watch failed (overrun); no event follows.
    Errored(StateError),
}

impl Event {
    /// The resource the event is about, if any.
    #[must_use]
    pub fn resource(&self) -> Option<&Arc<dyn AnyResource>> {
        match self {
            Self::Created(r) | Self::Updated { new: r, .. } | Self::Destroyed(r) => Some(r),
            Self::Bootstrapped | Self::Errored(_) => None,
        }
    }
}

/// An event as kept in a kind's history ring.
#[derive(Clone)]
pub(crate) enum RingEvent {
    Created(Arc<dyn AnyResource>),
    Updated {
        new: Arc<dyn AnyResource>,
        old: Arc<dyn AnyResource>,
    },
    Destroyed(Arc<dyn AnyResource>),
}

impl RingEvent {
    fn id(&self) -> &str {
        match self {
            Self::Created(r) | Self::Updated { new: r, .. } | Self::Destroyed(r) => {
                &r.metadata().id
            }
        }
    }

    /// Applies a filter: label/id-filtered watches rewrite updates that cross the filter
    /// boundary into creates and destroys (spec §2.4).
    fn filtered(&self, filter: &Filter) -> Option<Event> {
        let m = |r: &Arc<dyn AnyResource>| filter.matches(&r.metadata().id, &r.metadata().labels);
        match self {
            Self::Created(r) => m(r).then(|| Event::Created(Arc::clone(r))),
            Self::Destroyed(r) => m(r).then(|| Event::Destroyed(Arc::clone(r))),
            Self::Updated { new, old } => match (m(old), m(new)) {
                (true, true) => Some(Event::Updated {
                    new: Arc::clone(new),
                    old: Arc::clone(old),
                }),
                (true, false) => Some(Event::Destroyed(Arc::clone(new))),
                (false, true) => Some(Event::Created(Arc::clone(new))),
                (false, false) => None,
            },
        }
    }
}

/// Options of a kind watch.
#[derive(Debug, Clone, Default)]
pub struct WatchOptions {
    /// Start with one `Created` per existing match, then `Bootstrapped`.
    pub bootstrap: bool,
    /// Label/id filter.
    pub filter: Filter,
}

impl WatchOptions {
    /// Bootstrapped, unfiltered.
    #[must_use]
    pub fn bootstrapped() -> Self {
        Self {
            bootstrap: true,
            filter: Filter::all(),
        }
    }
}

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

/// A metadata-only resource: the `Destroyed` event of a watch on a missing id.
pub(crate) struct Tombstone(pub(crate) Metadata);

impl AnyResource for Tombstone {
    fn metadata(&self) -> &Metadata {
        &self.0
    }

    fn dyn_eq(&self, other: &dyn AnyResource) -> bool {
        other
            .as_any()
            .downcast_ref::<Self>()
            .is_some_and(|o| o.0 == self.0)
    }

    fn with_metadata(&self, metadata: Metadata) -> Arc<dyn AnyResource> {
        Arc::new(Self(metadata))
    }

    fn spec_json(&self) -> Result<serde_json::Value, SpecEncodeError> {
        Ok(serde_json::Value::Null)
    }

    fn spec_yaml(&self) -> Result<String, SpecEncodeError> {
        Ok("null\n".to_owned())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn into_any_arc(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}
