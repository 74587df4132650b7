//! [`Runtime`]: registering controllers (with the output checks of `docs/runtime.md` §3.3), and
//! starting one driver per controller (`drive`), until shutdown or a watch overrun.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex, PoisonError, RwLock},
};

use tokio::sync::{mpsc, Notify};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use super::{
    drive::{driver, Driver},
    registry::{GraphSource, Handle, Running, Shared},
    Controller, ControllerRuntime, OutputKind, RegistrationError, RestartHook, RuntimeError,
};
use crate::runtime::{graph::Edge, metadata::Kind, store::Store};

/// The controller runtime: register controllers, then `run`.
pub struct Runtime {
    shared: Arc<Shared>,
    pending: Vec<(Driver, Arc<Handle>)>,
    outputs: HashMap<String, Vec<(String, OutputKind)>>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime").finish_non_exhaustive()
    }
}

impl Runtime {
    /// A runtime over `store`.
    #[must_use]
    pub fn new(store: Store) -> Self {
        Self {
            shared: Arc::new(Shared {
                store,
                on_restart: RwLock::default(),
                handles: RwLock::default(),
                deps: RwLock::default(),
                watched: Mutex::default(),
                running: Mutex::default(),
            }),
            pending: Vec::new(),
            outputs: HashMap::new(),
        }
    }

    /// The store.
    #[must_use]
    pub fn store(&self) -> &Store {
        &self.shared.store
    }

    /// Registers a controller, validating its outputs (`docs/runtime.md` §3.3).
    ///
    /// # Errors
    /// Exclusive/shared conflicts, duplicate outputs or names.
    pub fn register<C: Controller>(&mut self, controller: C) -> Result<(), RegistrationError> {
        let name = controller.name().to_owned();
        if self.pending.iter().any(|(_, h)| h.name == name) {
            return Err(RegistrationError::DuplicateName(name));
        }
        let outputs = controller.outputs();
        let mut seen = HashSet::new();
        for o in &outputs {
            if !seen.insert(o.r#type.clone()) {
                return Err(RegistrationError::DuplicateOutput {
                    r#type: o.r#type.clone(),
                    controller: name,
                });
            }
            if let Some(existing) = self.outputs.get(&o.r#type) {
                if let Some((other, _)) = existing.iter().find(|(_, k)| *k == OutputKind::Exclusive)
                {
                    return Err(RegistrationError::ExclusiveConflict {
                        r#type: o.r#type.clone(),
                        other: other.clone(),
                    });
                }
                if o.kind == OutputKind::Exclusive {
                    if let Some((other, _)) = existing.first() {
                        return Err(RegistrationError::SharedConflict {
                            r#type: o.r#type.clone(),
                            other: other.clone(),
                        });
                    }
                }
            }
        }
        for o in &outputs {
            self.outputs
                .entry(o.r#type.clone())
                .or_default()
                .push((name.clone(), o.kind));
        }
        let inputs = controller.inputs();
        let handle = Arc::new(Handle {
            name,
            outputs,
            inputs: RwLock::new(inputs.clone()),
            wake: Notify::new(),
            backoff: Mutex::default(),
        });
        // One wake-up queued at registration (`docs/runtime.md` §3.4).
        handle.wake.notify_one();
        self.shared.add_deps(&handle, &inputs);
        self.shared
            .handles
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Arc::clone(&handle));
        self.pending.push((driver(controller), handle));
        Ok(())
    }

    /// Sets the hook told about every controller restart (for metrics).
    pub fn on_controller_restart(&self, hook: RestartHook) {
        *self
            .shared
            .on_restart
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Some(hook);
    }

    /// The dependency graph, live while the runtime runs.
    #[must_use]
    pub fn graph(&self) -> GraphSource {
        GraphSource(Arc::clone(&self.shared))
    }

    /// Current edges (`docs/runtime.md` §3.9).
    #[must_use]
    pub fn dependency_graph(&self) -> Vec<Edge> {
        self.shared.edges()
    }

    /// Runs every controller until `cancel` fires (then waits for all of them) or an
    /// input watch overruns.
    ///
    /// # Errors
    /// `RuntimeError::Watch` on overrun.
    pub async fn run(self, cancel: CancellationToken) -> Result<(), RuntimeError> {
        let child = cancel.child_token();
        let tracker = TaskTracker::new();
        let (fatal_tx, mut fatal_rx) = mpsc::unbounded_channel();
        *self
            .shared
            .running
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Running {
            tracker: tracker.clone(),
            cancel: child.clone(),
            fatal: fatal_tx,
        });
        // Watches first, so no change between a controller's first round and its watch
        // is lost.
        let kinds: Vec<Kind> = self
            .shared
            .deps
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .cloned()
            .collect();
        for k in &kinds {
            self.shared.ensure_watch(k);
        }
        for (drive, handle) in self.pending {
            let rt = ControllerRuntime {
                shared: Arc::clone(&self.shared),
                handle,
                cancel: child.clone(),
                tracked: None,
            };
            tracker.spawn(drive(rt));
        }
        let res = tokio::select! {
            () = child.cancelled() => Ok(()),
            Some(e) = fatal_rx.recv() => Err(RuntimeError::Watch(e)),
        };
        child.cancel();
        tracker.close();
        tracker.wait().await;
        self.shared
            .running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        res
    }
}
