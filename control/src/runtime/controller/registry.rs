//! The state the runtime shares with every controller handle: the registered
//! controllers (their inputs, outputs, wake-up and backoff), who depends on which
//! kind, and one aggregated watch per input kind fanned out into wake-ups.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex, PoisonError, RwLock},
};

use tokio::sync::{mpsc, Notify};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use super::{Input, InputKind, Output, OutputKind};
use crate::runtime::{
    backoff::Backoff,
    graph::{sort_edges, Edge, EdgeKind},
    metadata::{Kind, Phase},
    store::{StateError, Store},
    watch::{Event, KindWatch, WatchOptions},
};

pub(super) struct Handle {
    pub(super) name: String,
    pub(super) outputs: Vec<Output>,
    pub(super) inputs: RwLock<Vec<Input>>,
    pub(super) wake: Notify,
    pub(super) backoff: Mutex<Backoff>,
}

impl Handle {
    pub(super) fn inputs(&self) -> std::sync::RwLockReadGuard<'_, Vec<Input>> {
        self.inputs.read().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Clone)]
pub(super) struct Dep {
    pub(super) handle: Arc<Handle>,
    pub(super) id: Option<String>,
    pub(super) kind: InputKind,
}

pub(super) struct Running {
    pub(super) tracker: TaskTracker,
    pub(super) cancel: CancellationToken,
    pub(super) fatal: mpsc::UnboundedSender<StateError>,
}

/// Called with a controller's name each time it is restarted after an error or panic.
pub type RestartHook = Arc<dyn Fn(&str) + Send + Sync>;

pub(super) struct Shared {
    pub(super) store: Store,
    pub(super) on_restart: RwLock<Option<RestartHook>>,
    pub(super) handles: RwLock<Vec<Arc<Handle>>>,
    pub(super) deps: RwLock<HashMap<Kind, Vec<Dep>>>,
    pub(super) watched: Mutex<HashSet<Kind>>,
    pub(super) running: Mutex<Option<Running>>,
}

impl Shared {
    pub(super) fn add_deps(&self, handle: &Arc<Handle>, inputs: &[Input]) {
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
    pub(super) fn ensure_watch(self: &Arc<Self>, kind: &Kind) {
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

    pub(super) fn edges(&self) -> Vec<Edge> {
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
    mut watch: KindWatch,
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
pub struct GraphSource(pub(super) Arc<Shared>);

impl std::fmt::Debug for GraphSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GraphSource")
    }
}

impl GraphSource {
    /// Current edges, sorted (`docs/runtime.md` §3.9).
    #[must_use]
    pub fn edges(&self) -> Vec<Edge> {
        self.0.edges()
    }
}
