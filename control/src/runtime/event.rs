//! What watches deliver: [`Event`]s, the events as kept in a kind's history
//! (`RingEvent`), [`WatchOptions`], and the tombstone a watch of a missing id starts
//! with. Shared by the store (which records events) and watches (which read them).

use std::sync::Arc;

use super::{
    error::StateError,
    metadata::Metadata,
    query::Filter,
    resource::{AnyResource, SpecEncodeError},
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
    pub(crate) fn id(&self) -> &str {
        match self {
            Self::Created(r) | Self::Updated { new: r, .. } | Self::Destroyed(r) => {
                &r.metadata().id
            }
        }
    }

    /// Applies a filter: label/id-filtered watches rewrite updates that cross the filter
    /// boundary into creates and destroys (`docs/runtime.md` §2.4).
    pub(crate) fn filtered(&self, filter: &Filter) -> Option<Event> {
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
