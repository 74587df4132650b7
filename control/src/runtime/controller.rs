//! Controllers and the controller runtime (spec §3).

use std::{
    collections::{HashMap, HashSet},
    future::Future,
    panic::AssertUnwindSafe,
    sync::{Arc, Mutex, PoisonError, RwLock},
};

use futures::{future::BoxFuture, FutureExt as _};
use tokio::sync::{mpsc, Notify};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use super::{
    backoff::Backoff,
    graph::{sort_edges, Edge, EdgeKind},
    metadata::{Kind, Metadata, Phase, Pointer},
    query::Filter,
    resource::{AnyResource, Resource, ResourceKind},
    store::{StateError, Store},
    watch::{Event, WatchOptions},
};

/// How an input wakes its controller (spec §3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InputKind {
    /// Any change; read access.
    Weak,
    /// Any change; read access and finalizers.
    Strong,
    /// Only a tearing-down resource without finalizers.
    DestroyReady,
}

/// A declared input: a kind, optionally one id of it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Input {
    /// Namespace.
    pub namespace: String,
    /// Type.
    pub r#type: String,
    /// One id only (Get of that id only).
    pub id: Option<String>,
    /// Wake-up kind.
    pub kind: InputKind,
}

impl Input {
    /// A kind-wide input of type `K`.
    #[must_use]
    pub fn of<K: ResourceKind>(namespace: &str, kind: InputKind) -> Self {
        Self {
            namespace: namespace.to_owned(),
            r#type: K::TYPE.to_owned(),
            id: None,
            kind,
        }
    }

    /// An id-specific input of type `K`.
    #[must_use]
    pub fn id_of<K: ResourceKind>(namespace: &str, id: &str, kind: InputKind) -> Self {
        Self {
            id: Some(id.to_owned()),
            ..Self::of::<K>(namespace, kind)
        }
    }

    fn covers(&self, namespace: &str, r#type: &str, id: Option<&str>) -> bool {
        self.namespace == namespace
            && self.r#type == r#type
            && match (&self.id, id) {
                (None, _) => true,
                (Some(a), Some(b)) => a == b,
                (Some(_), None) => false,
            }
    }
}

/// Output mode (spec §3.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutputKind {
    /// The only controller writing this type.
    Exclusive,
    /// One of several controllers writing this type, each its own resources.
    Shared,
}

/// A declared output: a type, in any namespace.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Output {
    /// Type.
    pub r#type: String,
    /// Mode.
    pub kind: OutputKind,
}

impl Output {
    /// An exclusive output of type `K`.
    #[must_use]
    pub fn exclusive<K: ResourceKind>() -> Self {
        Self {
            r#type: K::TYPE.to_owned(),
            kind: OutputKind::Exclusive,
        }
    }

    /// A shared output of type `K`.
    #[must_use]
    pub fn shared<K: ResourceKind>() -> Self {
        Self {
            r#type: K::TYPE.to_owned(),
            kind: OutputKind::Shared,
        }
    }
}

/// Access violations (spec §3.3).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    /// Write to a type that is not a declared output.
    #[error("resource {type} is not an output for controller {controller:?}")]
    NotOutput {
        /// The type.
        r#type: String,
        /// The controller.
        controller: String,
    },
    /// Read of something that is neither input nor output.
    #[error(
        "attempt to query resource {target}, not input or output for controller {controller:?}"
    )]
    NotInput {
        /// What was queried (`Type(ns/id)` or `Type(ns)`).
        target: String,
        /// The controller.
        controller: String,
    },
    /// Finalizer change on something that is not a strong input.
    #[error("resource {pointer} is not a strong input for controller {controller:?}, cannot change its finalizers")]
    NotStrongInput {
        /// The resource.
        pointer: Pointer,
        /// The controller.
        controller: String,
    },
    /// `start_tracking_outputs` twice.
    #[error("controller {controller:?} is already tracking outputs")]
    AlreadyTracking {
        /// The controller.
        controller: String,
    },
    /// `cleanup_outputs` without `start_tracking_outputs`.
    #[error("controller {controller:?} is not tracking outputs")]
    NotTracking {
        /// The controller.
        controller: String,
    },
}

/// Why a controller's `run` failed.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// A store error.
    #[error(transparent)]
    State(#[from] StateError),
    /// An access violation.
    #[error(transparent)]
    Access(#[from] AccessError),
    /// The controller panicked.
    #[error("controller panicked: {0}")]
    Panic(String),
    /// Anything else.
    #[error(transparent)]
    Other(Box<dyn std::error::Error + Send + Sync>),
}

impl ControllerError {
    /// Wraps any error.
    pub fn other(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Other(e.into())
    }
}

/// Result of a controller's `run`.
pub type ControllerResult = Result<(), ControllerError>;

/// A controller (spec §3.1). `run` returning `Ok` finishes it; an error or panic
/// restarts it with backoff, on the same object.
pub trait Controller: Send + 'static {
    /// Unique name; also the owner of what it writes.
    fn name(&self) -> &str;
    /// Initial inputs (more can be added with [`ControllerRuntime::update_inputs`]).
    fn inputs(&self) -> Vec<Input>;
    /// Outputs (static).
    fn outputs(&self) -> Vec<Output>;
    /// The long-running body.
    fn run<'a>(&'a mut self, rt: &'a mut ControllerRuntime) -> BoxFuture<'a, ControllerResult>;
}

/// Registration errors (spec §3.3).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistrationError {
    /// Another controller has the type as exclusive output, or this one wants exclusive
    /// where others share.
    #[error("resource {type:?} is already managed in exclusive mode by {other:?}")]
    ExclusiveConflict {
        /// The type.
        r#type: String,
        /// The other controller.
        other: String,
    },
    /// Exclusive wanted on a type already shared.
    #[error("resource {type:?} is already managed in shared mode by {other:?}")]
    SharedConflict {
        /// The type.
        r#type: String,
        /// A controller sharing it.
        other: String,
    },
    /// The same output declared twice by one controller.
    #[error("duplicate output {type:?} for controller {controller:?}")]
    DuplicateOutput {
        /// The type.
        r#type: String,
        /// The controller.
        controller: String,
    },
    /// Two controllers with one name.
    #[error("controller {0:?} is already registered")]
    DuplicateName(String),
}

/// Errors that stop the runtime.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// An input watch overran; the runtime cannot guarantee wake-ups any more.
    #[error("controller runtime watch error: {0}")]
    Watch(StateError),
}

struct Handle {
    name: String,
    outputs: Vec<Output>,
    inputs: RwLock<Vec<Input>>,
    wake: Notify,
    backoff: Mutex<Backoff>,
}

impl Handle {
    fn inputs(&self) -> std::sync::RwLockReadGuard<'_, Vec<Input>> {
        self.inputs.read().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Clone)]
struct Dep {
    handle: Arc<Handle>,
    id: Option<String>,
    kind: InputKind,
}

struct Running {
    tracker: TaskTracker,
    cancel: CancellationToken,
    fatal: mpsc::UnboundedSender<StateError>,
}

/// Called with a controller's name each time it is restarted after an error or panic.
pub type RestartHook = Arc<dyn Fn(&str) + Send + Sync>;

struct Shared {
    store: Store,
    on_restart: RwLock<Option<RestartHook>>,
    handles: RwLock<Vec<Arc<Handle>>>,
    deps: RwLock<HashMap<Kind, Vec<Dep>>>,
    watched: Mutex<HashSet<Kind>>,
    running: Mutex<Option<Running>>,
}

impl Shared {
    fn add_deps(&self, handle: &Arc<Handle>, inputs: &[Input]) {
        let mut deps = self.deps.write().unwrap_or_else(PoisonError::into_inner);
        for i in inputs {
            deps.entry(Kind::new(i.namespace.clone(), i.r#type.clone()))
                .or_default()
                .push(Dep {
                    handle: Arc::clone(handle),
                    id: i.id.clone(),
                    kind: i.kind,
                });
        }
    }

    /// Opens the one aggregated watch of `kind` if not open yet (never closed).
    fn ensure_watch(self: &Arc<Self>, kind: &Kind) {
        let running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(running) = running.as_ref() else {
            return;
        };
        if !self
            .watched
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(kind.clone())
        {
            return;
        }
        let watch = self.store.watch_kind(kind, WatchOptions::default());
        let shared = Arc::clone(self);
        let cancel = running.cancel.clone();
        let fatal = running.fatal.clone();
        let kind = kind.clone();
        running.tracker.spawn(async move {
            fan_out(shared, kind, watch, cancel, fatal).await;
        });
    }

    fn edges(&self) -> Vec<Edge> {
        let handles = self.handles.read().unwrap_or_else(PoisonError::into_inner);
        let mut edges = Vec::new();
        for h in handles.iter() {
            for o in &h.outputs {
                edges.push(Edge {
                    controller: h.name.clone(),
                    namespace: String::new(),
                    r#type: o.r#type.clone(),
                    id: None,
                    kind: match o.kind {
                        OutputKind::Exclusive => EdgeKind::OutputExclusive,
                        OutputKind::Shared => EdgeKind::OutputShared,
                    },
                });
            }
            for i in h.inputs().iter() {
                edges.push(Edge {
                    controller: h.name.clone(),
                    namespace: i.namespace.clone(),
                    r#type: i.r#type.clone(),
                    id: i.id.clone(),
                    kind: match i.kind {
                        InputKind::Weak => EdgeKind::InputWeak,
                        InputKind::Strong => EdgeKind::InputStrong,
                        InputKind::DestroyReady => EdgeKind::InputDestroyReady,
                    },
                });
            }
        }
        sort_edges(&mut edges);
        edges.dedup();
        edges
    }
}

/// Drains one input kind's watch and wakes the dependent controllers. Waking never
/// blocks (capacity-1 slots), so slow controllers cannot make this watch overrun.
async fn fan_out(
    shared: Arc<Shared>,
    kind: Kind,
    mut watch: super::watch::KindWatch,
    cancel: CancellationToken,
    fatal: mpsc::UnboundedSender<StateError>,
) {
    let mut batch = Vec::new();
    // id -> (phase, finalizers empty): latest state wins within a batch.
    let mut latest: HashMap<String, (Phase, bool)> = HashMap::new();
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            ok = watch.recv_batch(&mut batch) => if !ok { return },
        }
        for ev in batch.drain(..) {
            if let Event::Errored(e) = ev {
                let _ = fatal.send(e);
                return;
            }
            if let Some(r) = ev.resource() {
                let md = r.metadata();
                latest.insert(md.id.clone(), (md.phase, md.finalizers.is_empty()));
            }
        }
        let deps = shared
            .deps
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&kind)
            .cloned()
            .unwrap_or_default();
        for (id, (phase, fin_empty)) in latest.drain() {
            for d in &deps {
                if d.id.as_ref().is_some_and(|x| *x != id) {
                    continue;
                }
                if d.kind == InputKind::DestroyReady && !(phase == Phase::TearingDown && fin_empty)
                {
                    continue;
                }
                d.handle.wake.notify_one();
            }
        }
    }
}

/// A cloneable view of the runtime's dependency graph, usable while it runs.
#[derive(Clone)]
pub struct GraphSource(Arc<Shared>);

impl std::fmt::Debug for GraphSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GraphSource")
    }
}

impl GraphSource {
    /// Current edges, sorted (spec §3.9).
    #[must_use]
    pub fn edges(&self) -> Vec<Edge> {
        self.0.edges()
    }
}

/// The controller runtime: register controllers, then `run`.
pub struct Runtime {
    shared: Arc<Shared>,
    pending: Vec<(Box<dyn Controller>, Arc<Handle>)>,
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

    /// Registers a controller, validating its outputs (spec §3.3).
    ///
    /// # Errors
    /// Exclusive/shared conflicts, duplicate outputs or names.
    pub fn register(&mut self, controller: impl Controller) -> Result<(), RegistrationError> {
        self.register_boxed(Box::new(controller))
    }

    /// [`Runtime::register`] for a boxed controller.
    ///
    /// # Errors
    /// See [`Runtime::register`].
    pub fn register_boxed(
        &mut self,
        controller: Box<dyn Controller>,
    ) -> Result<(), RegistrationError> {
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
        // One wake-up queued at registration (spec §3.4).
        handle.wake.notify_one();
        self.shared.add_deps(&handle, &inputs);
        self.shared
            .handles
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Arc::clone(&handle));
        self.pending.push((controller, handle));
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

    /// Current edges (spec §3.9).
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
        for (ctrl, handle) in self.pending {
            let rt = ControllerRuntime {
                shared: Arc::clone(&self.shared),
                handle,
                cancel: child.clone(),
                tracked: None,
            };
            tracker.spawn(run_controller(ctrl, rt));
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

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

async fn run_controller(mut ctrl: Box<dyn Controller>, mut rt: ControllerRuntime) {
    let name = rt.handle.name.clone();
    let mut crashes: u64 = 0;
    loop {
        let res = AssertUnwindSafe(ctrl.run(&mut rt)).catch_unwind().await;
        rt.tracked = None;
        let err = match res {
            Ok(Ok(())) => {
                tracing::debug!(controller = %name, "controller finished");
                return;
            }
            Ok(Err(e)) => e,
            Err(p) => ControllerError::Panic(panic_message(&*p)),
        };
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
        let delay = {
            let mut b = rt
                .handle
                .backoff
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            b.next_delay_rng(&mut rand::thread_rng())
        };
        tracing::error!(controller = %name, error = %err, crashes, ?delay, "controller failed, restarting");
        tokio::select! {
            () = rt.cancel.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
        rt.handle.wake.notify_one();
    }
}

/// The per-controller handle given to `run`: typed store access with the controller's
/// name as owner and the spec §3.3 checks, wake-ups, backoff and output tracking.
pub struct ControllerRuntime {
    shared: Arc<Shared>,
    handle: Arc<Handle>,
    cancel: CancellationToken,
    tracked: Option<HashSet<Pointer>>,
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

    /// Resolves on the next wake-up (capacity 1: triggers while one is pending coalesce).
    /// Owned, so it can sit in a `select!` next to other `&mut self` work.
    pub fn changed(&self) -> impl Future<Output = ()> + Send + 'static {
        let h = Arc::clone(&self.handle);
        async move { h.wake.notified().await }
    }

    /// Resolves when the runtime shuts down.
    pub fn cancelled(&self) -> impl Future<Output = ()> + Send + 'static {
        self.cancel.clone().cancelled_owned()
    }

    /// The runtime's cancellation token (for sub-tasks).
    #[must_use]
    pub fn cancellation(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Waits for the next wake-up; false when the runtime is shutting down.
    pub async fn next_round(&self) -> bool {
        tokio::select! {
            biased;
            () = self.cancelled() => false,
            () = self.changed() => true,
        }
    }

    /// Wakes this controller (from netlink, timers, sub-tasks).
    pub fn queue_reconcile(&self) {
        self.handle.wake.notify_one();
    }

    /// A cloneable trigger that wakes this controller, for sub-tasks.
    #[must_use]
    pub fn waker(&self) -> Waker {
        Waker(Arc::clone(&self.handle))
    }

    /// Resets the restart backoff (after a successful round).
    pub fn reset_restart_backoff(&self) {
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

    /// Starts recording every Create/Update/Modify of this round (spec §3.6).
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
    /// round, stops tracking and resets the backoff (spec §3.6).
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
        self.reset_restart_backoff();
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
