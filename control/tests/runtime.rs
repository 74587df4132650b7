//! Controller runtime conformance (`docs/runtime.md` §8, second bullet) with small test controllers.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use futures::future::BoxFuture;
use wirespan_control::{
    runtime::{
        AccessError, Controller, ControllerError, ControllerResult, ControllerRuntime, Filter,
        Input, InputKind, Kind, LabelTerm, Output, Phase, Pointer, RegistrationError, Resource,
        ResourceKind, Runtime, RuntimeError, Store, StoreOptions,
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
    fn run<'a>(&'a mut self, rt: &'a mut ControllerRuntime) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            while rt.next_round().await {
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
                rt.reset_restart_backoff();
            }
            Ok(())
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

/// Starts with no inputs and adds one in `run`.
struct Dynamic;

impl Controller for Dynamic {
    fn name(&self) -> &str {
        "DynamicController"
    }
    fn inputs(&self) -> Vec<Input> {
        vec![]
    }
    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<StrResource>()]
    }
    fn run<'a>(&'a mut self, rt: &'a mut ControllerRuntime) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            // Not an input yet: reading is rejected.
            assert!(matches!(
                rt.list::<IntResource>("dyn"),
                Err(ControllerError::Access(AccessError::NotInput { .. }))
            ));
            rt.update_inputs(vec![Input::of::<IntResource>("dyn", InputKind::Weak)]);
            while rt.next_round().await {
                let n = rt.list::<IntResource>("dyn")?.len();
                rt.modify::<StrResource>(OUT, "count", |r| r.spec.value = n.to_string())?;
            }
            Ok(())
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
    fn name(&self) -> &str {
        self.0
    }
    fn inputs(&self) -> Vec<Input> {
        vec![Input::of::<IntResource>(IN, InputKind::Weak)]
    }
    fn outputs(&self) -> Vec<Output> {
        vec![Output::shared::<StrResource>()]
    }
    fn run<'a>(&'a mut self, rt: &'a mut ControllerRuntime) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let filter = Filter::labels(vec![LabelTerm::equal("sum", "yes")]);
            while rt.next_round().await {
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
            }
            Ok(())
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
    fn name(&self) -> &str {
        "FlakyController"
    }
    fn inputs(&self) -> Vec<Input> {
        vec![]
    }
    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<StrResource>()]
    }
    fn run<'a>(&'a mut self, rt: &'a mut ControllerRuntime) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            while rt.next_round().await {
                match self.0.fetch_add(1, Ordering::SeqCst) {
                    0 => panic!("first run panics"),
                    1 => return Err(ControllerError::other("second run fails")),
                    n => {
                        rt.modify::<StrResource>(OUT, "flaky", |r| r.spec.value = n.to_string())?;
                    }
                }
            }
            Ok(())
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
    fn name(&self) -> &str {
        "MirrorController"
    }
    fn inputs(&self) -> Vec<Input> {
        vec![Input::of::<IntResource>(IN, InputKind::Weak)]
    }
    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<StrResource>()]
    }
    fn run<'a>(&'a mut self, rt: &'a mut ControllerRuntime) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            while rt.next_round().await {
                rt.start_tracking_outputs()?;
                for i in rt.list::<IntResource>(IN)? {
                    let v = i.spec.value.to_string();
                    rt.modify::<StrResource>(OUT, &i.metadata.id, |r| r.spec.value.clone_from(&v))?;
                }
                rt.cleanup_outputs(&[strs()])?;
            }
            Ok(())
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
    fn name(&self) -> &str {
        "Trespasser"
    }
    fn inputs(&self) -> Vec<Input> {
        vec![Input::id_of::<IntResource>(IN, "only", InputKind::Weak)]
    }
    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<StrResource>()]
    }
    fn run<'a>(&'a mut self, rt: &'a mut ControllerRuntime) -> BoxFuture<'a, ControllerResult> {
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
            Ok(())
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
    fn name(&self) -> &str {
        self.0
    }
    fn inputs(&self) -> Vec<Input> {
        vec![]
    }
    fn outputs(&self) -> Vec<Output> {
        self.1.clone()
    }
    fn run<'a>(&'a mut self, _rt: &'a mut ControllerRuntime) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async { Ok(()) })
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
    fn name(&self) -> &str {
        self.name
    }
    fn inputs(&self) -> Vec<Input> {
        vec![self.input.clone()]
    }
    fn outputs(&self) -> Vec<Output> {
        vec![]
    }
    fn run<'a>(&'a mut self, rt: &'a mut ControllerRuntime) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            while rt.next_round().await {
                self.rounds.fetch_add(1, Ordering::SeqCst);
            }
            Ok(())
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

/// Waits on its wake-up and on an external channel in one select (sub-task pattern).
struct Selecting(Option<tokio::sync::mpsc::Receiver<i64>>);

impl Controller for Selecting {
    fn name(&self) -> &str {
        "SelectingController"
    }
    fn inputs(&self) -> Vec<Input> {
        vec![]
    }
    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<IntResource>()]
    }
    fn run<'a>(&'a mut self, rt: &'a mut ControllerRuntime) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let mut rx = self.0.take().expect("runs once");
            loop {
                tokio::select! {
                    () = rt.cancelled() => return Ok(()),
                    () = rt.changed() => {
                        rt.modify::<IntResource>(OUT, "wakeups", |r| r.spec.value += 1)?;
                    }
                    Some(v) = rx.recv() => {
                        rt.modify::<IntResource>(OUT, "result", |r| r.spec.value = v)?;
                        rt.queue_reconcile();
                    }
                }
            }
        })
    }
}

#[tokio::test]
async fn wake_up_is_usable_in_select_with_sub_task_results() {
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
    // queue_reconcile from the result branch produced a second wake-up.
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
