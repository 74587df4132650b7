//! Controller runtime conformance (`docs/runtime.md` §8, second bullet) with small test controllers.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use futures::future::BoxFuture;
use tokio_stream::wrappers::ReceiverStream;
use wirespan_control::{
    runtime::{
        AccessError, Action, Controller, ControllerError, ControllerResult, ControllerRuntime,
        Filter, Input, InputKind, Kind, LabelTerm, Output, Phase, Pointer, RegistrationError,
        Resource, ResourceKind, Runtime, RuntimeError, Store, StoreOptions, Triggers,
    },
    testing::{
        assert_length, assert_no_resource, assert_resource, int, Harness, IntResource, StrResource,
    },
};

const IN: &str = "in";
const OUT: &str = "out";

fn strs() -> Kind {
    Kind::new(OUT, StrResource::TYPE)
}

/// int → string with the finalizer protocol: strong input, DestroyReady on its output.
struct IntToStr;

impl Controller for IntToStr {
    type Event = ();

    fn name(&self) -> &str {
        "IntToStrController"
    }
    fn inputs(&self) -> Vec<Input> {
        vec![
            Input::of::<IntResource>(IN, InputKind::Strong),
            Input::of::<StrResource>(OUT, InputKind::DestroyReady),
        ]
    }
    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<StrResource>()]
    }
    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let name = rt.name().to_owned();
            for i in rt.list::<IntResource>(IN)? {
                let ptr = i.pointer();
                let out = Pointer::new(OUT, StrResource::TYPE, &i.metadata.id);
                if i.metadata.phase == Phase::Running {
                    rt.add_finalizer(&ptr, &[&name])?;
                    let v = i.spec.value.to_string();
                    rt.modify::<StrResource>(OUT, &i.metadata.id, |r| {
                        r.spec.value.clone_from(&v);
                    })?;
                } else {
                    let gone = match rt.get_opt::<StrResource>(OUT, &out.id)? {
                        None => true,
                        Some(_) => {
                            let ready = rt.teardown(&out)?;
                            if ready {
                                rt.destroy(&out)?;
                            }
                            ready
                        }
                    };
                    if gone {
                        rt.remove_finalizer(&ptr, &[&name])?;
                    }
                }
            }
            Ok(Action::await_change())
        })
    }
}

#[tokio::test]
async fn int_to_str_with_finalizers() {
    let mut rt = Runtime::new(Store::default());
    rt.register(IntToStr).unwrap();
    let h = Harness::start(rt);
    let s = h.store.clone();
    s.create(int(IN, "one", 1), "").unwrap();
    assert_resource::<StrResource>(&s, OUT, "one", |r| {
        if r.spec.value == "1" {
            Ok(())
        } else {
            Err(format!("value {:?}", r.spec.value))
        }
    })
    .await;
    s.modify::<IntResource>(IN, "one", "", |r| r.spec.value = 2)
        .unwrap();
    assert_resource::<StrResource>(&s, OUT, "one", |r| {
        if r.spec.value == "2" {
            Ok(())
        } else {
            Err(format!("value {:?}", r.spec.value))
        }
    })
    .await;
    assert_resource::<IntResource>(&s, IN, "one", |r| {
        if r.metadata.finalizers.contains("IntToStrController") {
            Ok(())
        } else {
            Err("no finalizer".into())
        }
    })
    .await;
    let p = Pointer::new(IN, IntResource::TYPE, "one");
    // The input cannot go while the controller holds it; teardown propagates.
    s.teardown_and_destroy(&p, "").await.unwrap();
    assert_no_resource(&s, &Pointer::new(OUT, StrResource::TYPE, "one")).await;
    h.stop().await.unwrap();
}

/// Starts with no inputs and adds one in `start`.
struct Dynamic;

impl Controller for Dynamic {
    type Event = ();

    fn start(&mut self, rt: &mut ControllerRuntime) -> Result<Triggers<()>, ControllerError> {
        // Not an input yet: reading is rejected.
        assert!(matches!(
            rt.list::<IntResource>("dyn"),
            Err(ControllerError::Access(AccessError::NotInput { .. }))
        ));
        rt.update_inputs(vec![Input::of::<IntResource>("dyn", InputKind::Weak)]);
        Ok(Triggers::inputs_only())
    }
    fn name(&self) -> &str {
        "DynamicController"
    }
    fn inputs(&self) -> Vec<Input> {
        vec![]
    }
    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<StrResource>()]
    }
    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let n = rt.list::<IntResource>("dyn")?.len();
            rt.modify::<StrResource>(OUT, "count", |r| r.spec.value = n.to_string())?;
            Ok(Action::await_change())
        })
    }
}

#[tokio::test]
async fn inputs_added_during_run() {
    let mut rt = Runtime::new(Store::default());
    rt.register(Dynamic).unwrap();
    let graph = rt.graph();
    let h = Harness::start(rt);
    let s = h.store.clone();
    assert_resource::<StrResource>(&s, OUT, "count", |r| {
        if r.spec.value == "0" {
            Ok(())
        } else {
            Err(r.spec.value.clone())
        }
    })
    .await;
    s.create(int("dyn", "a", 1), "").unwrap();
    s.create(int("dyn", "b", 1), "").unwrap();
    assert_resource::<StrResource>(&s, OUT, "count", |r| {
        if r.spec.value == "2" {
            Ok(())
        } else {
            Err(r.spec.value.clone())
        }
    })
    .await;
    assert!(graph
        .edges()
        .iter()
        .any(|e| e.namespace == "dyn" && e.controller == "DynamicController"));
    h.stop().await.unwrap();
}

/// Sums ints labelled `sum=yes` into a shared output.
struct Sum(&'static str);

impl Controller for Sum {
    type Event = ();

    fn name(&self) -> &str {
        self.0
    }
    fn inputs(&self) -> Vec<Input> {
        vec![Input::of::<IntResource>(IN, InputKind::Weak)]
    }
    fn outputs(&self) -> Vec<Output> {
        vec![Output::shared::<StrResource>()]
    }
    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let filter = Filter::labels(vec![LabelTerm::equal("sum", "yes")]);
            let sum: i64 = rt
                .list_filtered::<IntResource>(IN, &filter)?
                .iter()
                .map(|r| r.spec.value)
                .sum();
            let id = self.0.to_owned();
            rt.modify::<StrResource>(OUT, &id, |r| r.spec.value = sum.to_string())?;
            // Shared output: a resource created by the other controller is not ours.
            let other = if id == "SumA" { "SumB" } else { "SumA" };
            if rt.get_opt::<StrResource>(OUT, other)?.is_some() {
                let e = rt
                    .modify::<StrResource>(OUT, other, |r| r.spec.value = "x".into())
                    .unwrap_err();
                assert!(
                    matches!(e, ControllerError::State(ref s) if s.is_conflict()),
                    "{e}"
                );
            }
            Ok(Action::await_change())
        })
    }
}

#[tokio::test]
async fn label_filtered_sum_with_shared_output() {
    let mut rt = Runtime::new(Store::default());
    rt.register(Sum("SumA")).unwrap();
    rt.register(Sum("SumB")).unwrap();
    let h = Harness::start(rt);
    let s = h.store.clone();
    for (id, v, sel) in [("a", 1, "yes"), ("b", 10, "no"), ("c", 100, "yes")] {
        let mut r = int(IN, id, v);
        r.metadata.labels.insert("sum".into(), sel.into());
        s.create(r, "").unwrap();
    }
    for c in ["SumA", "SumB"] {
        assert_resource::<StrResource>(&s, OUT, c, |r| {
            if r.spec.value == "101" {
                Ok(())
            } else {
                Err(r.spec.value.clone())
            }
        })
        .await;
    }
    assert_eq!(
        s.get::<StrResource>(OUT, "SumA").unwrap().metadata.owner,
        "SumA"
    );
    h.stop().await.unwrap();
}

/// Panics on the first run, errors on the second, then works.
struct Flaky(Arc<AtomicUsize>);

impl Controller for Flaky {
    type Event = ();

    fn name(&self) -> &str {
        "FlakyController"
    }
    fn inputs(&self) -> Vec<Input> {
        vec![]
    }
    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<StrResource>()]
    }
    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            match self.0.fetch_add(1, Ordering::SeqCst) {
                0 => panic!("first run panics"),
                1 => return Err(ControllerError::other("second run fails")),
                n => {
                    rt.modify::<StrResource>(OUT, "flaky", |r| r.spec.value = n.to_string())?;
                }
            }
            Ok(Action::await_change())
        })
    }
}

#[tokio::test(start_paused = true)]
async fn panicking_and_failing_controllers_restart_with_backoff() {
    let runs = Arc::new(AtomicUsize::new(0));
    let mut rt = Runtime::new(Store::default());
    rt.register(Flaky(Arc::clone(&runs))).unwrap();
    rt.register(Dynamic).unwrap_err(); // same output type, exclusive: rejected
    let healthy = Arc::new(AtomicUsize::new(0));
    rt.register(RoundCounter::weak(&healthy)).unwrap();
    let h = Harness::start(rt);
    let start = tokio::time::Instant::now();
    assert_resource::<StrResource>(&h.store, OUT, "flaky", |r| {
        if r.spec.value == "2" {
            Ok(())
        } else {
            Err(r.spec.value.clone())
        }
    })
    .await;
    // Two restarts: at least 0.25 s + 0.375 s of (paused, auto-advanced) backoff.
    assert!(
        start.elapsed() >= Duration::from_millis(625),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    // The failures did not take the runtime down: another controller still reacts.
    let before = healthy.load(Ordering::SeqCst);
    h.store.create(int(IN, "poke", 1), "").unwrap();
    tokio::time::timeout(Duration::from_secs(10), async {
        while healthy.load(Ordering::SeqCst) == before {
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap();
    h.stop().await.unwrap();
}

/// Mirrors ints into strs with tracked cleanup.
struct Mirror;

impl Controller for Mirror {
    type Event = ();

    fn name(&self) -> &str {
        "MirrorController"
    }
    fn inputs(&self) -> Vec<Input> {
        vec![Input::of::<IntResource>(IN, InputKind::Weak)]
    }
    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<StrResource>()]
    }
    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            rt.start_tracking_outputs()?;
            for i in rt.list::<IntResource>(IN)? {
                let v = i.spec.value.to_string();
                rt.modify::<StrResource>(OUT, &i.metadata.id, |r| r.spec.value.clone_from(&v))?;
            }
            rt.cleanup_outputs(&[strs()])?;
            Ok(Action::await_change())
        })
    }
}

#[tokio::test]
async fn tracked_cleanup_removes_outputs_of_gone_inputs() {
    let mut rt = Runtime::new(Store::default());
    rt.register(Mirror).unwrap();
    let h = Harness::start(rt);
    let s = h.store.clone();
    // An unowned resource of the output type is not touched by cleanup.
    s.create(
        Resource::<StrResource>::new(OUT, "user", Default::default()),
        "",
    )
    .unwrap();
    s.create(int(IN, "a", 1), "").unwrap();
    s.create(int(IN, "b", 2), "").unwrap();
    assert_length(&s, &strs(), 3).await;
    s.destroy(&Pointer::new(IN, IntResource::TYPE, "a"), "")
        .unwrap();
    assert_no_resource(&s, &Pointer::new(OUT, StrResource::TYPE, "a")).await;
    assert_length(&s, &strs(), 2).await;
    h.stop().await.unwrap();
}

/// Tries forbidden reads and writes and reports the errors.
struct Trespasser(Arc<Mutex<Vec<String>>>);

impl Controller for Trespasser {
    type Event = ();

    fn name(&self) -> &str {
        "Trespasser"
    }
    fn inputs(&self) -> Vec<Input> {
        vec![Input::id_of::<IntResource>(IN, "only", InputKind::Weak)]
    }
    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<StrResource>()]
    }
    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let mut errs = vec![rt
                .modify::<IntResource>(IN, "x", |r| r.spec.value = 1)
                .unwrap_err()
                .to_string()];
            errs.push(rt.list::<IntResource>(IN).unwrap_err().to_string());
            errs.push(rt.get::<IntResource>(IN, "other").unwrap_err().to_string());
            errs.push(
                rt.get::<IntResource>("elsewhere", "only")
                    .unwrap_err()
                    .to_string(),
            );
            // Allowed: the id-specific input, and outputs in any namespace.
            assert!(rt
                .get::<IntResource>(IN, "only")
                .unwrap_err()
                .to_string()
                .contains("doesn't exist"));
            rt.list::<StrResource>("any-namespace")?;
            errs.push(
                rt.add_finalizer(&Pointer::new(IN, IntResource::TYPE, "only"), &["f"])
                    .unwrap_err()
                    .to_string(),
            );
            *self.0.lock().unwrap() = errs;
            Ok(Action::await_change())
        })
    }
}

#[tokio::test]
async fn undeclared_reads_and_writes_are_rejected() {
    let errs = Arc::new(Mutex::new(Vec::new()));
    let mut rt = Runtime::new(Store::default());
    rt.register(Trespasser(Arc::clone(&errs))).unwrap();
    let h = Harness::start(rt);
    tokio::time::timeout(Duration::from_secs(10), async {
        while errs.lock().unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
    let errs = errs.lock().unwrap().clone();
    assert_eq!(
        errs[0],
        "resource IntResources.test.wirespan.dev is not an output for controller \"Trespasser\""
    );
    assert!(
        errs[1].starts_with(
            "attempt to query resource IntResources.test.wirespan.dev(in), not input or output"
        ),
        "{}",
        errs[1]
    );
    assert!(
        errs[2].contains("(in/other), not input or output"),
        "{}",
        errs[2]
    );
    assert!(errs[3].contains("(elsewhere/only)"), "{}", errs[3]);
    assert!(errs[4].contains("not a strong input"), "{}", errs[4]);
    assert!(h.store.get::<IntResource>(IN, "x").is_err());
    h.stop().await.unwrap();
}

struct Outputs(&'static str, Vec<Output>);

impl Controller for Outputs {
    type Event = ();

    fn name(&self) -> &str {
        self.0
    }
    fn inputs(&self) -> Vec<Input> {
        vec![]
    }
    fn outputs(&self) -> Vec<Output> {
        self.1.clone()
    }
    fn reconcile<'a>(
        &'a mut self,
        _rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async { Ok(Action::await_change()) })
    }
}

#[test]
fn registration_conflicts() {
    let mut rt = Runtime::new(Store::default());
    rt.register(Outputs("A", vec![Output::exclusive::<IntResource>()]))
        .unwrap();
    assert_eq!(
        rt.register(Outputs("B", vec![Output::exclusive::<IntResource>()]))
            .unwrap_err()
            .to_string(),
        "resource \"IntResources.test.wirespan.dev\" is already managed in exclusive mode by \"A\""
    );
    assert!(matches!(
        rt.register(Outputs("B", vec![Output::shared::<IntResource>()])),
        Err(RegistrationError::ExclusiveConflict { .. })
    ));
    rt.register(Outputs("S1", vec![Output::shared::<StrResource>()]))
        .unwrap();
    rt.register(Outputs("S2", vec![Output::shared::<StrResource>()]))
        .unwrap();
    assert!(matches!(
        rt.register(Outputs("X", vec![Output::exclusive::<StrResource>()])),
        Err(RegistrationError::SharedConflict { .. })
    ));
    assert!(matches!(
        rt.register(Outputs(
            "D",
            vec![
                Output::shared::<StrResource>(),
                Output::shared::<StrResource>()
            ]
        )),
        Err(RegistrationError::DuplicateOutput { .. })
    ));
    assert!(matches!(
        rt.register(Outputs("A", vec![])),
        Err(RegistrationError::DuplicateName(_))
    ));
}

/// Counts the rounds of a controller with one input and no outputs.
struct RoundCounter {
    name: &'static str,
    input: Input,
    rounds: Arc<AtomicUsize>,
}

impl RoundCounter {
    /// Wakes on every change of an `IntResource` in `IN`.
    fn weak(rounds: &Arc<AtomicUsize>) -> Self {
        Self {
            name: "Counter",
            input: Input::of::<IntResource>(IN, InputKind::Weak),
            rounds: Arc::clone(rounds),
        }
    }
}

impl Controller for RoundCounter {
    type Event = ();

    fn name(&self) -> &str {
        self.name
    }
    fn inputs(&self) -> Vec<Input> {
        vec![self.input.clone()]
    }
    fn outputs(&self) -> Vec<Output> {
        vec![]
    }
    fn reconcile<'a>(
        &'a mut self,
        _rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            self.rounds.fetch_add(1, Ordering::SeqCst);
            Ok(Action::await_change())
        })
    }
}

#[tokio::test]
async fn wake_ups_coalesce() {
    let rounds = Arc::new(AtomicUsize::new(0));
    let mut rt = Runtime::new(Store::default());
    rt.register(RoundCounter::weak(&rounds)).unwrap();
    let h = Harness::start(rt);
    // Let the first (registration) round run.
    while rounds.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    // 500 writes without yielding: the controller cannot run in between.
    for i in 0..500 {
        h.store.create(int(IN, &format!("r{i}"), i), "").unwrap();
    }
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    let n = rounds.load(Ordering::SeqCst);
    assert!((2..=3).contains(&n), "rounds: {n}");
    h.stop().await.unwrap();
}

#[tokio::test]
async fn watch_overrun_stops_the_runtime() {
    let rounds = Arc::new(AtomicUsize::new(0));
    let mut rt = Runtime::new(Store::new(StoreOptions {
        history_capacity: 10,
    }));
    rt.register(RoundCounter::weak(&rounds)).unwrap();
    let h = Harness::start(rt);
    while rounds.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    for i in 0..10_000 {
        h.store.create(int(IN, &format!("r{i}"), i), "").unwrap();
    }
    let err = h.wait_stopped(Duration::from_secs(10)).await.unwrap_err();
    assert!(matches!(err, RuntimeError::Watch(_)));
    assert!(
        err.to_string()
            .starts_with("controller runtime watch error: buffer overrun"),
        "{err}"
    );
}

#[test]
fn dependency_graph_edges_are_sorted_outputs_first() {
    let mut rt = Runtime::new(Store::default());
    rt.register(IntToStr).unwrap();
    let edges = rt.dependency_graph();
    let kinds: Vec<String> = edges
        .iter()
        .map(|e| format!("{:?} {} {}", e.kind, e.namespace, e.r#type))
        .collect();
    assert_eq!(
        kinds,
        [
            "OutputExclusive  StrResources.test.wirespan.dev",
            "InputStrong in IntResources.test.wirespan.dev",
            "InputDestroyReady out StrResources.test.wirespan.dev",
        ]
    );
}

async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn destroy_ready_wakes_only_when_tearing_down_without_finalizers() {
    let rounds = Arc::new(AtomicUsize::new(0));
    let mut rt = Runtime::new(Store::default());
    rt.register(RoundCounter {
        name: "DestroyReadyCounter",
        input: Input::of::<StrResource>(OUT, InputKind::DestroyReady),
        rounds: Arc::clone(&rounds),
    })
    .unwrap();
    let h = Harness::start(rt);
    let s = h.store.clone();
    settle().await;
    assert_eq!(rounds.load(Ordering::SeqCst), 1, "registration round");
    let p = Pointer::new(OUT, StrResource::TYPE, "x");
    s.create(
        Resource::<StrResource>::new(OUT, "x", Default::default()),
        "o",
    )
    .unwrap();
    s.modify::<StrResource>(OUT, "x", "o", |r| r.spec.value = "1".into())
        .unwrap();
    s.add_finalizer(&p, &["f"]).unwrap();
    assert!(!s.teardown(&p, "o").unwrap());
    settle().await;
    assert_eq!(
        rounds.load(Ordering::SeqCst),
        1,
        "woken before destroy-ready"
    );
    s.remove_finalizer(&p, &["f"]).unwrap();
    settle().await;
    assert_eq!(
        rounds.load(Ordering::SeqCst),
        2,
        "not woken when destroy-ready"
    );
    h.stop().await.unwrap();
}

/// Woken by its inputs and by the items of a channel given to the runtime as its event
/// stream (a sub-task's results).
struct Selecting(Option<tokio::sync::mpsc::Receiver<i64>>);

impl Controller for Selecting {
    type Event = i64;

    fn name(&self) -> &str {
        "SelectingController"
    }
    fn inputs(&self) -> Vec<Input> {
        vec![]
    }
    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<IntResource>()]
    }
    fn start(&mut self, _rt: &mut ControllerRuntime) -> Result<Triggers<i64>, ControllerError> {
        let rx = self.0.take().expect("starts once");
        Ok(Triggers::inputs_only().with_events(Box::pin(ReceiverStream::new(rx))))
    }
    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        results: Vec<i64>,
    ) -> BoxFuture<'a, ControllerResult<i64>> {
        Box::pin(async move {
            if results.is_empty() {
                rt.modify::<IntResource>(OUT, "wakeups", |r| r.spec.value += 1)?;
            }
            for v in results {
                rt.modify::<IntResource>(OUT, "result", |r| r.spec.value = v)?;
                rt.queue_reconcile();
            }
            Ok(Action::await_change())
        })
    }
}

#[tokio::test]
async fn event_stream_items_reach_a_round_of_their_own() {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let mut rt = Runtime::new(Store::default());
    rt.register(Selecting(Some(rx))).unwrap();
    let h = Harness::start(rt);
    let s = h.store.clone();
    assert_resource::<IntResource>(&s, OUT, "wakeups", |r| {
        if r.spec.value == 1 {
            Ok(())
        } else {
            Err(r.spec.value.to_string())
        }
    })
    .await;
    tx.send(42).await.unwrap();
    assert_resource::<IntResource>(&s, OUT, "result", |r| {
        if r.spec.value == 42 {
            Ok(())
        } else {
            Err(r.spec.value.to_string())
        }
    })
    .await;
    // queue_reconcile from the events' round produced a second wake-up.
    assert_resource::<IntResource>(&s, OUT, "wakeups", |r| {
        if r.spec.value == 2 {
            Ok(())
        } else {
            Err(r.spec.value.to_string())
        }
    })
    .await;
    h.stop().await.unwrap();
}

// The runtime's waiting (`docs/runtime.md` §3.4), on tokio's paused clock: time moves
// only when every task waits, straight to the next timer, so the instants a round
// starts at are exact.

/// What a [`Scheduled`] controller saw, shared with the test.
struct Log {
    /// The number of rounds, for waiting without moving the clock.
    count: tokio::sync::watch::Sender<usize>,
    /// When each round started, since the test's start.
    rounds: Vec<Duration>,
    /// Events each round got.
    events: Vec<Vec<u32>>,
    starts: usize,
    stops: usize,
}

fn new_log() -> Arc<Mutex<Log>> {
    Arc::new(Mutex::new(Log {
        count: tokio::sync::watch::Sender::new(0),
        rounds: Vec::new(),
        events: Vec::new(),
        starts: 0,
        stops: 0,
    }))
}

type Plan = Box<dyn FnMut(usize) -> Result<Action<u32>, ControllerError> + Send>;

/// A controller whose `n`th round returns `plan(n)`; woken by ints in `IN` and by
/// whatever its `triggers` say.
struct Scheduled {
    epoch: tokio::time::Instant,
    log: Arc<Mutex<Log>>,
    plan: Plan,
    triggers: Option<Box<dyn FnMut() -> Triggers<u32> + Send>>,
}

impl Scheduled {
    fn new(
        log: &Arc<Mutex<Log>>,
        plan: impl FnMut(usize) -> Result<Action<u32>, ControllerError> + Send + 'static,
    ) -> Self {
        Self {
            epoch: tokio::time::Instant::now(),
            log: Arc::clone(log),
            plan: Box::new(plan),
            triggers: None,
        }
    }

    fn with_triggers(mut self, t: impl FnMut() -> Triggers<u32> + Send + 'static) -> Self {
        self.triggers = Some(Box::new(t));
        self
    }
}

impl Controller for Scheduled {
    type Event = u32;

    fn name(&self) -> &str {
        "ScheduledController"
    }
    fn inputs(&self) -> Vec<Input> {
        vec![Input::of::<IntResource>(IN, InputKind::Weak)]
    }
    fn outputs(&self) -> Vec<Output> {
        vec![]
    }
    fn start(&mut self, _rt: &mut ControllerRuntime) -> Result<Triggers<u32>, ControllerError> {
        self.log.lock().unwrap().starts += 1;
        Ok(self
            .triggers
            .as_mut()
            .map_or_else(Triggers::inputs_only, |t| t()))
    }
    fn reconcile<'a>(
        &'a mut self,
        _rt: &'a mut ControllerRuntime,
        events: Vec<u32>,
    ) -> BoxFuture<'a, ControllerResult<u32>> {
        Box::pin(async move {
            let n = {
                let mut log = self.log.lock().unwrap();
                log.rounds.push(self.epoch.elapsed());
                log.events.push(events);
                let n = log.rounds.len();
                log.count.send_replace(n);
                n
            };
            tracing::info!(round = n, "scheduled round");
            (self.plan)(n)
        })
    }
    fn stop<'a>(&'a mut self, _rt: &'a mut ControllerRuntime) -> BoxFuture<'a, ()> {
        self.log.lock().unwrap().stops += 1;
        Box::pin(async {})
    }
}

/// Waits until the controller has run `n` rounds; the clock moves only to the
/// runtime's own timers meanwhile.
async fn rounds_reach(log: &Arc<Mutex<Log>>, n: usize) -> Vec<Duration> {
    let mut count = log.lock().unwrap().count.subscribe();
    let reached = tokio::time::timeout(Duration::from_secs(24 * 3600), count.wait_for(|c| *c >= n));
    if reached.await.is_err() {
        panic!("fewer than {n} rounds: {:?}", log.lock().unwrap().rounds);
    }
    log.lock().unwrap().rounds.clone()
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[tokio::test(start_paused = true)]
async fn requeue_after_runs_the_next_round_at_that_time() {
    let log = new_log();
    let mut rt = Runtime::new(Store::default());
    rt.register(Scheduled::new(&log, |_| {
        Ok(Action::requeue_after(secs(10)))
    }))
    .unwrap();
    let h = Harness::start(rt);
    let rounds = rounds_reach(&log, 3).await;
    assert_eq!(rounds[..3], [secs(0), secs(10), secs(20)], "{rounds:?}");
    h.stop().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn an_input_change_wakes_before_the_requeue_time() {
    let log = new_log();
    let mut rt = Runtime::new(Store::default());
    rt.register(Scheduled::new(&log, |_| {
        Ok(Action::requeue_after(secs(60)))
    }))
    .unwrap();
    let h = Harness::start(rt);
    rounds_reach(&log, 1).await;
    tokio::time::sleep(secs(5)).await;
    h.store.create(int(IN, "poke", 1), "").unwrap();
    let rounds = rounds_reach(&log, 2).await;
    assert_eq!(rounds[1], secs(5), "{rounds:?}");
    // The change replaced the requeue: the next timed round is 60 s after it.
    let rounds = rounds_reach(&log, 3).await;
    assert_eq!(rounds[2], secs(65), "{rounds:?}");
    h.stop().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_failed_round_backs_off_and_restarts_the_controller() {
    let log = new_log();
    let mut rt = Runtime::new(Store::default());
    rt.register(Scheduled::new(&log, |n| {
        if n == 1 {
            Err(ControllerError::other("first round fails"))
        } else {
            Ok(Action::await_change())
        }
    }))
    .unwrap();
    let h = Harness::start(rt);
    let rounds = rounds_reach(&log, 2).await;
    // `runtime::backoff`'s first delay: 0.5 s ± 50 %.
    assert!(
        rounds[1] >= Duration::from_millis(250) && rounds[1] <= Duration::from_millis(750),
        "{rounds:?}"
    );
    assert_eq!(log.lock().unwrap().starts, 2, "start runs again on restart");
    // No round without a reason after the restart's own.
    tokio::time::sleep(secs(3600)).await;
    assert_eq!(log.lock().unwrap().rounds.len(), 2);
    h.stop().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn shutdown_stops_a_waiting_controller_and_runs_its_stop() {
    let log = new_log();
    let mut rt = Runtime::new(Store::default());
    rt.register(Scheduled::new(&log, |_| {
        Ok(Action::requeue_after(secs(3600)))
    }))
    .unwrap();
    let h = Harness::start(rt);
    rounds_reach(&log, 1).await;
    // On the paused clock a runtime that waited for the requeue would take an hour.
    tokio::time::timeout(secs(1), h.stop())
        .await
        .expect("the waiting controller stops at once")
        .unwrap();
    let log = log.lock().unwrap();
    assert_eq!((log.rounds.len(), log.stops), (1, 1));
}

#[tokio::test(start_paused = true)]
async fn requeue_when_hands_its_output_to_the_round() {
    let log = new_log();
    let mut rt = Runtime::new(Store::default());
    rt.register(Scheduled::new(&log, |n| {
        Ok(if n == 1 {
            Action::requeue_when(Box::pin(async {
                tokio::time::sleep(secs(7)).await;
                7
            }))
        } else {
            Action::await_change()
        })
    }))
    .unwrap();
    let h = Harness::start(rt);
    let rounds = rounds_reach(&log, 2).await;
    assert_eq!(rounds[1], secs(7));
    assert_eq!(log.lock().unwrap().events[1], [7]);
    h.stop().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn events_wake_with_their_items_and_the_resync_outlives_the_stream() {
    let log = new_log();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<u32>();
    let mut rx = Some(rx);
    let mut rt = Runtime::new(Store::default());
    rt.register(
        Scheduled::new(&log, |_| Ok(Action::await_change())).with_triggers(move || {
            let rx = rx.take().expect("one start");
            Triggers::inputs_only()
                .with_events(Box::pin(
                    tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
                ))
                .with_resync(secs(30))
        }),
    )
    .unwrap();
    let h = Harness::start(rt);
    rounds_reach(&log, 1).await;
    tokio::time::sleep(secs(1)).await;
    // Items sent together reach one round together.
    tx.send(1).unwrap();
    tx.send(2).unwrap();
    rounds_reach(&log, 2).await;
    assert_eq!(log.lock().unwrap().events[1], [1, 2]);
    // The stream ends: the controller keeps its resync, 30 s after the last round.
    drop(tx);
    let rounds = rounds_reach(&log, 4).await;
    assert_eq!(rounds[1..4], [secs(1), secs(31), secs(61)], "{rounds:?}");
    h.stop().await.unwrap();
}

/// A `MakeWriter` collecting formatted log lines.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Self;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

#[tokio::test(start_paused = true)]
async fn a_controllers_log_lines_carry_its_name() {
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(captured.clone())
        .with_ansi(false)
        .finish();
    // This test's runtime is single-threaded: the default covers every task.
    let _guard = tracing::subscriber::set_default(subscriber);
    let log = new_log();
    let mut rt = Runtime::new(Store::default());
    rt.register(Scheduled::new(&log, |n| {
        if n == 1 {
            Err(ControllerError::other("first round fails"))
        } else {
            Ok(Action::await_change())
        }
    }))
    .unwrap();
    let h = Harness::start(rt);
    rounds_reach(&log, 2).await;
    h.stop().await.unwrap();
    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    for what in ["scheduled round", "controller failed, restarting"] {
        let line = text
            .lines()
            .find(|l| l.contains(what))
            .unwrap_or_else(|| panic!("no {what:?} line in:\n{text}"));
        assert!(
            line.contains("controller{controller=ScheduledController}"),
            "{line}"
        );
    }
}
