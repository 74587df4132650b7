//! [`ControllerRuntime`], the handle a controller's rounds get: store access checked
//! against its declared inputs and outputs (`docs/runtime.md` §3.3), wake-ups, restart backoff and
//! output tracking (`docs/runtime.md` §3.6); and [`Waker`] for its sub-tasks.

use std::{
    collections::HashSet,
    sync::{Arc, PoisonError},
};

use tokio_util::sync::CancellationToken;

use super::{
    registry::{Handle, Shared},
    AccessError, ControllerError, Input, InputKind,
};
use crate::runtime::{
    metadata::{Kind, Metadata, Phase, Pointer},
    query::Filter,
    resource::{AnyResource, Resource, ResourceKind},
    store::{StateError, Store},
};

/// The per-controller handle given to `start`, `reconcile` and `stop`: typed store access with the controller's
/// name as owner and the `docs/runtime.md` §3.3 checks, wake-ups, backoff and output tracking.
pub struct ControllerRuntime {
    pub(super) shared: Arc<Shared>,
    pub(super) handle: Arc<Handle>,
    pub(super) cancel: CancellationToken,
    pub(super) tracked: Option<HashSet<Pointer>>,
}

impl std::fmt::Debug for ControllerRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControllerRuntime")
            .field("controller", &self.handle.name)
            .finish_non_exhaustive()
    }
}

impl ControllerRuntime {
    /// The controller's name (its owner string).
    #[must_use]
    pub fn name(&self) -> &str {
        &self.handle.name
    }

    /// The runtime's cancellation token (for sub-tasks; the runtime itself stops the
    /// controller's rounds).
    #[must_use]
    pub fn cancellation(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Queues a round (coalesced with any already queued).
    pub fn queue_reconcile(&self) {
        self.handle.wake.notify_one();
    }

    /// A cloneable trigger that queues a round of this controller, for sub-tasks whose
    /// number changes while it runs (a fixed source is a [`Triggers`](super::Triggers)
    /// event stream).
    #[must_use]
    pub fn waker(&self) -> Waker {
        Waker(Arc::clone(&self.handle))
    }

    /// Resets the restart backoff (the runtime does after every successful round).
    pub(super) fn reset_restart_backoff(&self) {
        self.handle
            .backoff
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .reset();
    }

    /// Adds inputs (never removes) and wakes the controller once.
    pub fn update_inputs(&self, inputs: Vec<Input>) {
        let new: Vec<Input> = {
            let mut cur = self
                .handle
                .inputs
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            let new: Vec<Input> = inputs.into_iter().filter(|i| !cur.contains(i)).collect();
            cur.extend(new.iter().cloned());
            new
        };
        self.shared.add_deps(&self.handle, &new);
        for i in &new {
            self.shared
                .ensure_watch(&Kind::new(i.namespace.clone(), i.r#type.clone()));
        }
        self.queue_reconcile();
    }

    fn is_output(&self, r#type: &str) -> bool {
        self.handle.outputs.iter().any(|o| o.r#type == r#type)
    }

    fn check_read(
        &self,
        namespace: &str,
        r#type: &str,
        id: Option<&str>,
    ) -> Result<(), AccessError> {
        if self.is_output(r#type)
            || self
                .handle
                .inputs()
                .iter()
                .any(|i| i.covers(namespace, r#type, id))
        {
            return Ok(());
        }
        Err(AccessError::NotInput {
            target: match id {
                Some(id) => format!("{type}({namespace}/{id})", type = r#type),
                None => format!("{type}({namespace})", type = r#type),
            },
            controller: self.handle.name.clone(),
        })
    }

    fn check_write(&self, r#type: &str) -> Result<(), AccessError> {
        if self.is_output(r#type) {
            Ok(())
        } else {
            Err(AccessError::NotOutput {
                r#type: r#type.to_owned(),
                controller: self.handle.name.clone(),
            })
        }
    }

    fn check_finalizer(&self, ptr: &Pointer) -> Result<(), AccessError> {
        let ok = self.handle.inputs().iter().any(|i| {
            i.kind == InputKind::Strong && i.covers(&ptr.namespace, &ptr.r#type, Some(&ptr.id))
        });
        if ok {
            Ok(())
        } else {
            Err(AccessError::NotStrongInput {
                pointer: ptr.clone(),
                controller: self.handle.name.clone(),
            })
        }
    }

    fn track(&mut self, ptr: Pointer) {
        if let Some(t) = &mut self.tracked {
            t.insert(ptr);
        }
    }

    /// Get of an input or output.
    ///
    /// # Errors
    /// Access violations and store errors.
    pub fn get<K: ResourceKind>(
        &self,
        namespace: &str,
        id: &str,
    ) -> Result<Arc<Resource<K>>, ControllerError> {
        self.check_read(namespace, K::TYPE, Some(id))?;
        Ok(self.shared.store.get::<K>(namespace, id)?)
    }

    /// Get that maps NotFound to `None`.
    ///
    /// # Errors
    /// Access violations and other store errors.
    pub fn get_opt<K: ResourceKind>(
        &self,
        namespace: &str,
        id: &str,
    ) -> Result<Option<Arc<Resource<K>>>, ControllerError> {
        match self.get::<K>(namespace, id) {
            Err(ControllerError::State(StateError::NotFound { .. })) => Ok(None),
            other => other.map(Some),
        }
    }

    /// List of a kind-wide input or an output, sorted by id.
    ///
    /// # Errors
    /// Access violations.
    pub fn list<K: ResourceKind>(
        &self,
        namespace: &str,
    ) -> Result<Vec<Arc<Resource<K>>>, ControllerError> {
        self.list_filtered::<K>(namespace, &Filter::all())
    }

    /// Filtered List.
    ///
    /// # Errors
    /// Access violations.
    pub fn list_filtered<K: ResourceKind>(
        &self,
        namespace: &str,
        filter: &Filter,
    ) -> Result<Vec<Arc<Resource<K>>>, ControllerError> {
        self.check_read(namespace, K::TYPE, None)?;
        Ok(self.shared.store.list::<K>(namespace, filter))
    }

    /// Modify an output (create if missing, no-op if unchanged; owner = this controller).
    ///
    /// # Errors
    /// Access violations and store errors (OwnerConflict, PhaseConflict …).
    pub fn modify<K>(
        &mut self,
        namespace: &str,
        id: &str,
        mut f: impl FnMut(&mut Resource<K>),
    ) -> Result<Arc<Resource<K>>, ControllerError>
    where
        K: ResourceKind,
        K::Spec: Default,
    {
        self.try_modify::<K>(namespace, id, Some(Phase::Running), |r| {
            f(r);
            Ok(())
        })
    }

    /// Modify with a fallible callback and an explicit expected phase (`None` = any).
    ///
    /// # Errors
    /// Access violations, store errors and errors from `f`.
    pub fn try_modify<K>(
        &mut self,
        namespace: &str,
        id: &str,
        expected_phase: Option<Phase>,
        f: impl FnMut(&mut Resource<K>) -> Result<(), ControllerError>,
    ) -> Result<Arc<Resource<K>>, ControllerError>
    where
        K: ResourceKind,
        K::Spec: Default,
    {
        self.check_write(K::TYPE)?;
        self.track(Pointer::new(namespace, K::TYPE, id));
        let name = self.handle.name.clone();
        self.shared
            .store
            .try_modify::<K, ControllerError>(namespace, id, &name, expected_phase, f)
    }

    /// Create an output owned by this controller.
    ///
    /// # Errors
    /// Access violations and `AlreadyExists`.
    pub fn create<K: ResourceKind>(
        &mut self,
        res: Resource<K>,
    ) -> Result<Metadata, ControllerError> {
        self.check_write(K::TYPE)?;
        self.track(res.pointer());
        Ok(self.shared.store.create(res, &self.handle.name)?)
    }

    /// Escape hatch: create an output without owner.
    ///
    /// # Errors
    /// Access violations and `AlreadyExists`.
    pub fn create_unowned<K: ResourceKind>(
        &mut self,
        res: Resource<K>,
    ) -> Result<Metadata, ControllerError> {
        self.check_write(K::TYPE)?;
        Ok(self.shared.store.create(res, "")?)
    }

    /// Update an output (version must match).
    ///
    /// # Errors
    /// Access violations and store errors.
    pub fn update<K: ResourceKind>(
        &mut self,
        res: Resource<K>,
    ) -> Result<Metadata, ControllerError> {
        self.check_write(K::TYPE)?;
        self.track(res.pointer());
        Ok(self
            .shared
            .store
            .update(res, &self.handle.name, Some(Phase::Running))?)
    }

    /// Teardown of an output; true when ready to destroy.
    ///
    /// # Errors
    /// Access violations and store errors.
    pub fn teardown(&self, ptr: &Pointer) -> Result<bool, ControllerError> {
        self.check_write(&ptr.r#type)?;
        Ok(self.shared.store.teardown(ptr, &self.handle.name)?)
    }

    /// Destroy an output owned by this controller.
    ///
    /// # Errors
    /// Access violations and store errors.
    pub fn destroy(&self, ptr: &Pointer) -> Result<(), ControllerError> {
        self.destroy_with_owner(ptr, &self.handle.name.clone())
    }

    /// Escape hatch: destroy an output with an explicit owner (e.g. `""`).
    ///
    /// # Errors
    /// Access violations and store errors.
    pub fn destroy_with_owner(&self, ptr: &Pointer, owner: &str) -> Result<(), ControllerError> {
        self.check_write(&ptr.r#type)?;
        Ok(self.shared.store.destroy(ptr, owner)?)
    }

    /// Adds finalizers to a strong input (no-op when present).
    ///
    /// # Errors
    /// Access violations and store errors.
    pub fn add_finalizer(&self, ptr: &Pointer, names: &[&str]) -> Result<(), ControllerError> {
        self.check_finalizer(ptr)?;
        self.shared.store.add_finalizer(ptr, names)?;
        Ok(())
    }

    /// Removes finalizers from a strong input (no-op when absent).
    ///
    /// # Errors
    /// Access violations and store errors.
    pub fn remove_finalizer(&self, ptr: &Pointer, names: &[&str]) -> Result<(), ControllerError> {
        self.check_finalizer(ptr)?;
        self.shared.store.remove_finalizer(ptr, names)?;
        Ok(())
    }

    /// Sets (`Some`) or clears (`None`) an annotation on a strong input, like a
    /// finalizer bypassing ownership: how a controller that applies a resource reports
    /// back on it (the network spec controllers' per-object `error`). No write when
    /// unchanged.
    ///
    /// # Errors
    /// Access violations and store errors.
    pub fn set_annotation(
        &self,
        ptr: &Pointer,
        key: &str,
        value: Option<&str>,
    ) -> Result<(), ControllerError> {
        self.check_finalizer(ptr)?;
        self.shared
            .store
            .update_metadata(ptr, None, None, |m| match value {
                Some(v) => {
                    m.annotations.insert(key.to_owned(), v.to_owned());
                }
                None => {
                    m.annotations.remove(key);
                }
            })?;
        Ok(())
    }

    /// Starts recording every Create/Update/Modify of this round (`docs/runtime.md` §3.6).
    ///
    /// # Errors
    /// `AlreadyTracking`.
    pub fn start_tracking_outputs(&mut self) -> Result<(), ControllerError> {
        if self.tracked.is_some() {
            return Err(AccessError::AlreadyTracking {
                controller: self.handle.name.clone(),
            }
            .into());
        }
        self.tracked = Some(HashSet::new());
        Ok(())
    }

    /// Destroys every resource of `kinds` owned by this controller and not written this
    /// round and stops tracking (`docs/runtime.md` §3.6).
    ///
    /// # Errors
    /// `NotTracking`, access violations and store errors (e.g. pending finalizers).
    pub fn cleanup_outputs(&mut self, kinds: &[Kind]) -> Result<(), ControllerError> {
        let Some(tracked) = self.tracked.take() else {
            return Err(AccessError::NotTracking {
                controller: self.handle.name.clone(),
            }
            .into());
        };
        for kind in kinds {
            self.check_write(&kind.r#type)?;
            for r in self.shared.store.list_dyn(kind, &Filter::all()) {
                let md = r.metadata();
                if md.owner == self.handle.name && !tracked.contains(&md.pointer()) {
                    self.shared
                        .store
                        .destroy(&md.pointer(), &self.handle.name)?;
                }
            }
        }
        Ok(())
    }

    /// Read-only access to the store without the §3.3 checks, for sub-tasks that only
    /// need to clone it. Writes must still go through this handle.
    #[must_use]
    pub fn store_for_watch(&self) -> &Store {
        &self.shared.store
    }

    /// The type-erased stored resource (checked like `get`).
    ///
    /// # Errors
    /// Access violations and store errors.
    pub fn get_dyn(&self, ptr: &Pointer) -> Result<Arc<dyn AnyResource>, ControllerError> {
        self.check_read(&ptr.namespace, &ptr.r#type, Some(&ptr.id))?;
        Ok(self.shared.store.get_dyn(ptr)?)
    }
}

/// Wakes one controller; cloneable and `Send`, for sub-tasks.
#[derive(Clone)]
pub struct Waker(Arc<Handle>);

impl std::fmt::Debug for Waker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Waker({})", self.0.name)
    }
}

impl Waker {
    /// Queues a wake-up (coalesced).
    pub fn wake(&self) {
        self.0.wake.notify_one();
    }
}
