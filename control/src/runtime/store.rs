//! The in-memory, watchable resource store (`docs/runtime.md` §2).
//!
//! Per (namespace, type): a `BTreeMap` of `Arc`'d resources (List is sorted by id for
//! free) and a bounded ring of events with absolute positions. Watchers keep their own
//! position and are woken through one `Notify` per kind, so a write costs the same
//! whatever the number of watchers; a watcher that falls more than the ring's capacity
//! behind gets one `Errored` event and its watch ends.

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    sync::{Arc, Mutex, PoisonError, RwLock},
    time::SystemTime,
};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

pub use super::error::StateError;
use super::{
    channel::{KindShared, KindState},
    event::{Event, RingEvent, Tombstone, WatchOptions},
    metadata::{Kind, Metadata, Phase, Pointer},
    query::Filter,
    resource::{downcast, AnyResource, Resource, ResourceKind},
    watch::KindWatch,
};

/// Store tuning.
#[derive(Debug, Clone, Copy)]
pub struct StoreOptions {
    /// Events kept per (namespace, type) for watchers that lag.
    pub history_capacity: usize,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            history_capacity: 4096,
        }
    }
}

type KindMap = HashMap<String, HashMap<String, Arc<KindShared>>>;

/// The in-memory store. Cloning is cheap and clones share the state.
#[derive(Clone)]
pub struct Store {
    kinds: Arc<RwLock<KindMap>>,
    options: StoreOptions,
}

impl Default for Store {
    fn default() -> Self {
        Self::new(StoreOptions::default())
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// An empty store.
    #[must_use]
    pub fn new(options: StoreOptions) -> Self {
        Self {
            kinds: Arc::default(),
            options,
        }
    }

    pub(crate) fn kind(&self, namespace: &str, r#type: &str) -> Arc<KindShared> {
        {
            let kinds = self.kinds.read().unwrap_or_else(PoisonError::into_inner);
            if let Some(k) = kinds.get(namespace).and_then(|m| m.get(r#type)) {
                return Arc::clone(k);
            }
        }
        let mut kinds = self.kinds.write().unwrap_or_else(PoisonError::into_inner);
        let k = kinds
            .entry(namespace.to_owned())
            .or_default()
            .entry(r#type.to_owned())
            .or_insert_with(|| {
                Arc::new(KindShared {
                    kind: Kind::new(namespace, r#type),
                    capacity: self.options.history_capacity.max(1),
                    state: Mutex::new(KindState {
                        resources: BTreeMap::new(),
                        ring: VecDeque::new(),
                        start: 0,
                    }),
                    notify: Notify::new(),
                })
            });
        Arc::clone(k)
    }

    /// All (namespace, type) pairs that ever held a resource or a watcher, sorted.
    #[must_use]
    pub fn kinds(&self) -> Vec<Kind> {
        let kinds = self.kinds.read().unwrap_or_else(PoisonError::into_inner);
        let mut out: Vec<Kind> = kinds
            .iter()
            .flat_map(|(ns, m)| m.keys().map(move |t| Kind::new(ns.clone(), t.clone())))
            .collect();
        out.sort();
        out
    }

    /// Get (`docs/runtime.md` §2.1): an immutable snapshot of the resource.
    ///
    /// # Errors
    /// `NotFound`.
    pub fn get_dyn(&self, ptr: &Pointer) -> Result<Arc<dyn AnyResource>, StateError> {
        let k = self.kind(&ptr.namespace, &ptr.r#type);
        let st = k.lock();
        st.resources
            .get(&ptr.id)
            .cloned()
            .ok_or_else(|| StateError::NotFound {
                pointer: ptr.clone(),
            })
    }

    /// List (`docs/runtime.md` §2.1): all matching resources, sorted by id.
    #[must_use]
    pub fn list_dyn(&self, kind: &Kind, filter: &Filter) -> Vec<Arc<dyn AnyResource>> {
        let k = self.kind(&kind.namespace, &kind.r#type);
        let st = k.lock();
        st.resources
            .values()
            .filter(|r| filter.is_empty() || filter.matches(&r.metadata().id, &r.metadata().labels))
            .cloned()
            .collect()
    }

    /// Create (`docs/runtime.md` §2.1): stores `res` at version 1 with `owner`.
    ///
    /// # Errors
    /// `AlreadyExists`.
    pub fn create_dyn(&self, res: &dyn AnyResource, owner: &str) -> Result<Metadata, StateError> {
        self.create_inner(res.metadata(), owner, |md| res.with_metadata(md))
    }

    fn create_inner(
        &self,
        md: &Metadata,
        owner: &str,
        make: impl FnOnce(Metadata) -> Arc<dyn AnyResource>,
    ) -> Result<Metadata, StateError> {
        let k = self.kind(&md.namespace, &md.r#type);
        let mut st = k.lock();
        if st.resources.contains_key(&md.id) {
            return Err(StateError::AlreadyExists {
                pointer: md.pointer(),
            });
        }
        let mut new_md = md.clone();
        new_md.owner = owner.to_owned();
        new_md.version = 1;
        let now = SystemTime::now();
        new_md.created = now;
        new_md.updated = now;
        let stored = make(new_md.clone());
        st.resources.insert(new_md.id.clone(), Arc::clone(&stored));
        k.push(&mut st, RingEvent::Created(stored));
        drop(st);
        k.notify.notify_waiters();
        Ok(new_md)
    }

    /// Update (`docs/runtime.md` §2.1): `res.metadata.version` must equal the stored version.
    /// `expected_phase = None` accepts any phase.
    ///
    /// # Errors
    /// `NotFound`, `OwnerConflict`, `VersionConflict`, `PhaseConflict`.
    pub fn update_dyn(
        &self,
        res: &dyn AnyResource,
        owner: &str,
        expected_phase: Option<Phase>,
    ) -> Result<Metadata, StateError> {
        self.update_inner(res.metadata(), owner, expected_phase, |md| {
            res.with_metadata(md)
        })
    }

    fn update_inner(
        &self,
        md: &Metadata,
        owner: &str,
        expected_phase: Option<Phase>,
        make: impl FnOnce(Metadata) -> Arc<dyn AnyResource>,
    ) -> Result<Metadata, StateError> {
        let k = self.kind(&md.namespace, &md.r#type);
        let mut st = k.lock();
        let cur_md = st.owned(&md.pointer(), owner)?;
        if md.version != cur_md.version {
            return Err(StateError::VersionConflict {
                pointer: md.pointer(),
                expected: md.version,
                actual: cur_md.version,
            });
        }
        if let Some(p) = expected_phase {
            if cur_md.phase != p {
                return Err(StateError::PhaseConflict {
                    pointer: md.pointer(),
                    expected: p,
                });
            }
        }
        let mut new_md = md.clone();
        new_md.owner = cur_md.owner.clone();
        new_md.version = cur_md.version + 1;
        new_md.created = cur_md.created;
        new_md.updated = SystemTime::now();
        let stored = make(new_md.clone());
        let old = st
            .resources
            .get_mut(&md.id)
            .map(|slot| std::mem::replace(slot, Arc::clone(&stored)))
            .expect("checked above");
        k.push(&mut st, RingEvent::Updated { new: stored, old });
        drop(st);
        k.notify.notify_waiters();
        Ok(new_md)
    }

    /// Destroy (`docs/runtime.md` §2.1).
    ///
    /// # Errors
    /// `NotFound`, `OwnerConflict`, `PendingFinalizers`.
    pub fn destroy(&self, ptr: &Pointer, owner: &str) -> Result<(), StateError> {
        let k = self.kind(&ptr.namespace, &ptr.r#type);
        let mut st = k.lock();
        let md = st.owned(ptr, owner)?;
        if !md.finalizers.is_empty() {
            return Err(StateError::PendingFinalizers {
                pointer: ptr.clone(),
                finalizers: md.finalizers.to_vec(),
            });
        }
        let last = st.resources.remove(&ptr.id).expect("checked above");
        k.push(&mut st, RingEvent::Destroyed(last));
        drop(st);
        k.notify.notify_waiters();
        Ok(())
    }

    /// Watch(ptr) (`docs/runtime.md` §2.4): the current state first (`Created`, or `Destroyed` with a
    /// tombstone), then every change of that id.
    #[must_use]
    pub fn watch(&self, ptr: &Pointer) -> KindWatch {
        let k = self.kind(&ptr.namespace, &ptr.r#type);
        let st = k.lock();
        let first = match st.resources.get(&ptr.id) {
            Some(r) => Event::Created(Arc::clone(r)),
            None => Event::Destroyed(Arc::new(Tombstone(Metadata::new(
                ptr.namespace.clone(),
                ptr.r#type.clone(),
                ptr.id.clone(),
            )))),
        };
        let pos = st.head();
        drop(st);
        KindWatch::new(
            k,
            pos,
            Filter::all(),
            Some(ptr.id.clone()),
            VecDeque::from([first]),
        )
    }

    /// WatchKind (`docs/runtime.md` §2.4), optionally bootstrapped and filtered.
    #[must_use]
    pub fn watch_kind(&self, kind: &Kind, opts: WatchOptions) -> KindWatch {
        let k = self.kind(&kind.namespace, &kind.r#type);
        let st = k.lock();
        let mut pending = VecDeque::new();
        if opts.bootstrap {
            pending.extend(
                st.resources
                    .values()
                    .filter(|r| opts.filter.matches(&r.metadata().id, &r.metadata().labels))
                    .map(|r| Event::Created(Arc::clone(r))),
            );
            pending.push_back(Event::Bootstrapped);
        }
        let pos = st.head();
        drop(st);
        KindWatch::new(k, pos, opts.filter, None, pending)
    }

    // ---- typed API ----

    /// Typed Get.
    ///
    /// # Errors
    /// `NotFound`, `TypeMismatch`.
    pub fn get<K: ResourceKind>(
        &self,
        namespace: &str,
        id: &str,
    ) -> Result<Arc<Resource<K>>, StateError> {
        let ptr = Pointer::new(namespace, K::TYPE, id);
        let r = self.get_dyn(&ptr)?;
        downcast::<K>(&r).ok_or(StateError::TypeMismatch { pointer: ptr })
    }

    /// Typed List, sorted by id. Resources of another Rust type are skipped.
    #[must_use]
    pub fn list<K: ResourceKind>(&self, namespace: &str, filter: &Filter) -> Vec<Arc<Resource<K>>> {
        self.list_dyn(&Kind::new(namespace, K::TYPE), filter)
            .iter()
            .filter_map(downcast::<K>)
            .collect()
    }

    /// Typed Create.
    ///
    /// # Errors
    /// `AlreadyExists`.
    pub fn create<K: ResourceKind>(
        &self,
        res: Resource<K>,
        owner: &str,
    ) -> Result<Metadata, StateError> {
        let Resource { metadata, spec } = res;
        self.create_inner(&metadata, owner, move |md| {
            Arc::new(Resource::<K> { metadata: md, spec })
        })
    }

    /// Typed Update.
    ///
    /// # Errors
    /// See [`Store::update_dyn`].
    pub fn update<K: ResourceKind>(
        &self,
        res: Resource<K>,
        owner: &str,
        expected_phase: Option<Phase>,
    ) -> Result<Metadata, StateError> {
        let Resource { metadata, spec } = res;
        self.update_inner(&metadata, owner, expected_phase, move |md| {
            Arc::new(Resource::<K> { metadata: md, spec })
        })
    }

    /// UpdateWithConflicts (`docs/runtime.md` §2.3): read-modify-write that retries version conflicts
    /// and writes nothing when `f` changes nothing.
    ///
    /// # Errors
    /// Store errors (other than version conflicts) and errors from `f`.
    pub fn update_with_conflicts<K, E>(
        &self,
        namespace: &str,
        id: &str,
        owner: &str,
        expected_phase: Option<Phase>,
        mut f: impl FnMut(&mut Resource<K>) -> Result<(), E>,
    ) -> Result<Arc<Resource<K>>, E>
    where
        K: ResourceKind,
        E: From<StateError>,
    {
        loop {
            let cur = self.get::<K>(namespace, id)?;
            if let Some(p) = expected_phase {
                if cur.metadata.phase != p {
                    return Err(StateError::PhaseConflict {
                        pointer: cur.pointer(),
                        expected: p,
                    }
                    .into());
                }
            }
            let mut new = (*cur).clone();
            f(&mut new)?;
            if new == *cur {
                return Ok(cur);
            }
            match self.update_dyn(&new, owner, expected_phase) {
                Ok(md) => {
                    return Ok(Arc::new(Resource {
                        metadata: md,
                        spec: new.spec,
                    }));
                }
                Err(StateError::VersionConflict { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Modify (`docs/runtime.md` §2.3): create from `K::Spec::default()` when missing, else
    /// UpdateWithConflicts; `f` sees the current stored resource. No-op when unchanged.
    ///
    /// # Errors
    /// Store errors and errors from `f`.
    pub fn try_modify<K, E>(
        &self,
        namespace: &str,
        id: &str,
        owner: &str,
        expected_phase: Option<Phase>,
        mut f: impl FnMut(&mut Resource<K>) -> Result<(), E>,
    ) -> Result<Arc<Resource<K>>, E>
    where
        K: ResourceKind,
        K::Spec: Default,
        E: From<StateError>,
    {
        match self.get::<K>(namespace, id) {
            Err(StateError::NotFound { .. }) => {
                let mut new = Resource::<K>::new(namespace, id, K::Spec::default());
                f(&mut new)?;
                let md = self.create(new.clone(), owner)?;
                Ok(Arc::new(Resource {
                    metadata: md,
                    spec: new.spec,
                }))
            }
            Err(e) => Err(e.into()),
            Ok(_) => self.update_with_conflicts(namespace, id, owner, expected_phase, f),
        }
    }

    /// Infallible-callback Modify with expected phase `running`.
    ///
    /// # Errors
    /// Store errors.
    pub fn modify<K>(
        &self,
        namespace: &str,
        id: &str,
        owner: &str,
        mut f: impl FnMut(&mut Resource<K>),
    ) -> Result<Arc<Resource<K>>, StateError>
    where
        K: ResourceKind,
        K::Spec: Default,
    {
        self.try_modify::<K, StateError>(namespace, id, owner, Some(Phase::Running), |r| {
            f(r);
            Ok(())
        })
    }

    /// Metadata-only UpdateWithConflicts on a resource of any type. `owner = None` uses
    /// the resource's current owner (bypasses ownership).
    ///
    /// # Errors
    /// Store errors.
    pub fn update_metadata(
        &self,
        ptr: &Pointer,
        owner: Option<&str>,
        expected_phase: Option<Phase>,
        mut f: impl FnMut(&mut Metadata),
    ) -> Result<Metadata, StateError> {
        loop {
            let cur = self.get_dyn(ptr)?;
            let cur_md = cur.metadata();
            if let Some(p) = expected_phase {
                if cur_md.phase != p {
                    return Err(StateError::PhaseConflict {
                        pointer: ptr.clone(),
                        expected: p,
                    });
                }
            }
            let mut md = cur_md.clone();
            f(&mut md);
            if md == *cur_md {
                return Ok(md);
            }
            let owner = owner.unwrap_or(&cur_md.owner).to_owned();
            match self.update_dyn(&*cur.with_metadata(md), &owner, expected_phase) {
                Err(StateError::VersionConflict { .. }) => {}
                other => return other,
            }
        }
    }

    /// Teardown (`docs/runtime.md` §2.3): sets phase `tearingDown`; returns whether the resource is
    /// ready to be destroyed (no finalizers). Idempotent.
    ///
    /// # Errors
    /// `NotFound`, `OwnerConflict` (first call only).
    pub fn teardown(&self, ptr: &Pointer, owner: &str) -> Result<bool, StateError> {
        let cur = self.get_dyn(ptr)?;
        if cur.metadata().phase == Phase::TearingDown {
            return Ok(cur.metadata().finalizers.is_empty());
        }
        let md = self.update_metadata(ptr, Some(owner), None, |m| m.phase = Phase::TearingDown)?;
        Ok(md.finalizers.is_empty())
    }

    /// AddFinalizer (`docs/runtime.md` §2.3): bypasses ownership, any phase, no-op when present.
    ///
    /// # Errors
    /// `NotFound`.
    pub fn add_finalizer(&self, ptr: &Pointer, names: &[&str]) -> Result<Metadata, StateError> {
        self.update_metadata(ptr, None, None, |m| {
            for n in names {
                m.finalizers.add(n);
            }
        })
    }

    /// RemoveFinalizer (`docs/runtime.md` §2.3): bypasses ownership, any phase, no-op when absent.
    ///
    /// # Errors
    /// `NotFound`.
    pub fn remove_finalizer(&self, ptr: &Pointer, names: &[&str]) -> Result<Metadata, StateError> {
        self.update_metadata(ptr, None, None, |m| {
            for n in names {
                m.finalizers.remove(n);
            }
        })
    }

    /// TeardownAndDestroy (`docs/runtime.md` §2.3): teardown, wait for the finalizers to go, destroy.
    /// Succeeds if someone else destroys it meanwhile.
    ///
    /// # Errors
    /// Store errors, or `Overrun` when the watch falls behind.
    pub async fn teardown_and_destroy(&self, ptr: &Pointer, owner: &str) -> Result<(), StateError> {
        let mut w = self.watch(ptr);
        if !self.teardown(ptr, owner)? {
            loop {
                match w.recv().await {
                    Some(Event::Destroyed(_)) => return Ok(()),
                    Some(Event::Created(r) | Event::Updated { new: r, .. })
                        if r.metadata().finalizers.is_empty() =>
                    {
                        break
                    }
                    Some(Event::Errored(e)) => return Err(e),
                    Some(_) => {}
                    None => {
                        return Err(StateError::NotFound {
                            pointer: ptr.clone(),
                        })
                    }
                }
            }
        }
        match self.destroy(ptr, owner) {
            Err(StateError::NotFound { .. }) => Ok(()),
            other => other,
        }
    }

    /// WatchFor (`docs/runtime.md` §2.3): waits for the first event of `ptr` matching `pred` and
    /// returns it.
    ///
    /// # Errors
    /// `Overrun` when the watch falls behind.
    pub async fn watch_for(
        &self,
        ptr: &Pointer,
        mut pred: impl FnMut(&Event) -> bool,
    ) -> Result<Event, StateError> {
        let mut w = self.watch(ptr);
        while let Some(ev) = w.recv().await {
            if let Event::Errored(e) = ev {
                return Err(e);
            }
            if pred(&ev) {
                return Ok(ev);
            }
        }
        Err(StateError::NotFound {
            pointer: ptr.clone(),
        })
    }

    /// ContextWithTeardown (`docs/runtime.md` §2.3): a token cancelled when the resource enters
    /// `tearingDown` or is destroyed (at once if absent). Needs a tokio runtime.
    #[must_use]
    pub fn context_with_teardown(&self, ptr: &Pointer) -> CancellationToken {
        let token = CancellationToken::new();
        let store = self.clone();
        let ptr = ptr.clone();
        let t = token.clone();
        tokio::spawn(async move {
            let wait = store.watch_for(&ptr, |ev| match ev {
                Event::Destroyed(_) | Event::Errored(_) => true,
                Event::Created(r) | Event::Updated { new: r, .. } => {
                    r.metadata().phase == Phase::TearingDown
                }
                _ => false,
            });
            // Any outcome, including a failed watch, ends the context; a caller that
            // cancels the token itself ends this task.
            tokio::select! {
                _ = wait => t.cancel(),
                () = t.cancelled() => {}
            }
        });
        token
    }
}
