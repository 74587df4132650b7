//! What changed in one input kind since a controller last looked, so a controller
//! can do work proportional to the change instead of re-reading every resource.
//!
//! A [`ChangeFeed`] keeps a kind watch of its own. Its first [`ChangeFeed::take`] (and
//! the first after the watch overran its history) lists the kind; every later one
//! returns the ids written since, coalesced: the latest state of each, or `None` for a
//! destroyed one.

use std::{collections::BTreeMap, marker::PhantomData, sync::Arc};

use super::{
    controller::{ControllerError, ControllerRuntime},
    metadata::Kind,
    resource::{downcast, Resource, ResourceKind},
    watch::{Event, KindWatch, WatchOptions},
};

/// The changes [`ChangeFeed::take`] found.
#[derive(Debug)]
pub enum Changes<K: ResourceKind> {
    /// Start over from this complete list (sorted by id).
    All(Vec<Arc<Resource<K>>>),
    /// Only these ids changed: their state now, `None` when destroyed.
    Some(BTreeMap<String, Option<Arc<Resource<K>>>>),
}

impl<K: ResourceKind> Changes<K> {
    /// Nothing changed.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        matches!(self, Self::Some(m) if m.is_empty())
    }
}

/// Changes of one kind (namespace and type) for one controller.
#[derive(Debug)]
pub struct ChangeFeed<K: ResourceKind> {
    namespace: String,
    watch: Option<KindWatch>,
    events: Vec<Event>,
    _kind: PhantomData<fn() -> K>,
}

impl<K: ResourceKind> ChangeFeed<K> {
    /// A feed of `K` in `namespace`; nothing is watched until the first take.
    #[must_use]
    pub fn new(namespace: &str) -> Self {
        Self {
            namespace: namespace.to_owned(),
            watch: None,
            events: Vec::new(),
            _kind: PhantomData,
        }
    }

    /// Forgets the position: the next take lists everything again.
    pub fn reset(&mut self) {
        self.watch = None;
    }

    /// Brings `mirror` (id → resource) up to date: `None` when it was filled anew
    /// from a full list, else the ids that changed (sorted).
    ///
    /// # Errors
    /// As [`ChangeFeed::take`].
    pub fn sync(
        &mut self,
        rt: &ControllerRuntime,
        mirror: &mut BTreeMap<String, Arc<Resource<K>>>,
    ) -> Result<Option<Vec<String>>, ControllerError> {
        Ok(match self.take(rt)? {
            Changes::All(all) => {
                *mirror = all
                    .into_iter()
                    .map(|r| (r.metadata.id.clone(), r))
                    .collect();
                None
            }
            Changes::Some(changes) => {
                for (id, r) in &changes {
                    match r {
                        Some(r) => mirror.insert(id.clone(), Arc::clone(r)),
                        None => mirror.remove(id),
                    };
                }
                Some(changes.into_keys().collect())
            }
        })
    }

    /// What changed since the previous take. The kind must be an input (or output) of
    /// the controller, as for a list.
    ///
    /// # Errors
    /// Access violations.
    pub fn take(&mut self, rt: &ControllerRuntime) -> Result<Changes<K>, ControllerError> {
        if let Some(w) = self.watch.as_mut() {
            self.events.clear();
            if w.drain_now(&mut self.events) {
                let mut out = BTreeMap::new();
                for ev in self.events.drain(..) {
                    match ev {
                        Event::Created(r) | Event::Updated { new: r, .. } => {
                            if let Some(r) = downcast::<K>(&r) {
                                out.insert(r.metadata.id.clone(), Some(r));
                            }
                        }
                        Event::Destroyed(r) => {
                            out.insert(r.metadata().id.clone(), None);
                        }
                        Event::Bootstrapped | Event::Errored(_) => {}
                    }
                }
                return Ok(Changes::Some(out));
            }
            tracing::debug!(
                controller = rt.name(),
                kind = K::TYPE,
                "change feed overran; listing again"
            );
        }
        // Watch first, then list: a write in between shows up in both, never in neither.
        let kind = Kind::new(self.namespace.clone(), K::TYPE);
        let watch = rt
            .store_for_watch()
            .watch_kind(&kind, WatchOptions::default());
        let all = rt.list::<K>(&self.namespace)?;
        self.watch = Some(watch);
        Ok(Changes::All(all))
    }
}
