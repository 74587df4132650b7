//! `wirespan bench runtime`: resource store throughput and controller-chain latency.
//!
//! Measures, in one run: real updates/s through the store (Modify with a changed
//! spec) with 0, 4 and 64 kind watchers draining every event; no-op Modify/s; and the
//! time for a change to propagate through a chain of 5 controllers. Targets (2-core
//! machine, release build) are printed next to the measured values.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

use crate::sanity::Sanity;
use wirespan_control::runtime::{
    Action, Controller, ControllerResult, ControllerRuntime, Definition, Event, Harness, Input,
    InputKind, Kind, Output, ResourceKind, Runtime, Store, StoreOptions, WatchOptions,
};

/// Options of `wirespan bench runtime`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Updates per watcher configuration.
    #[arg(long, default_value_t = 300_000)]
    pub updates: u64,
    /// No-op modifies.
    #[arg(long, default_value_t = 1_000_000)]
    pub noops: u64,
    /// Changes sent through the controller chain.
    #[arg(long, default_value_t = 2_000)]
    pub chain_rounds: usize,
    /// Distinct resource ids the updates rotate over.
    #[arg(long, default_value_t = 1_000)]
    pub ids: u64,
    /// A few seconds' smoke run with small counts (the test suite runs it once); its
    /// figures are not the benchmark's.
    #[arg(long)]
    pub quick: bool,
}

impl Args {
    /// The counts actually used: small ones with `--quick`.
    fn effective(&self) -> Self {
        if self.quick {
            Self {
                updates: self.updates.min(20_000),
                noops: self.noops.min(50_000),
                chain_rounds: self.chain_rounds.min(200),
                ..self.clone()
            }
        } else {
            self.clone()
        }
    }
}

const NS: &str = "bench";

/// The kind the store benchmarks write: an integer spec, the smallest that a real
/// update changes. The bench defines its own kinds rather than borrowing test ones.
#[derive(Debug)]
pub struct BenchResource;

impl ResourceKind for BenchResource {
    const TYPE: &'static str = "BenchResources.bench.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = NS;
    type Spec = BenchSpec;
    fn definition() -> Definition {
        Definition::new(Self::TYPE, "BenchResource", NS).column("Value", ".value")
    }
}

/// Spec of [`BenchResource`] and of the chain stages.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BenchSpec {
    /// The value.
    pub value: i64,
}

/// Runs the benchmark and prints its report.
///
/// # Errors
/// Whatever stops the benchmark from producing a valid report.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let args = &args.effective();
    crate::quick_notice(args.quick);
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cpus)
        .enable_all()
        .build()?;
    println!(
        "wirespan bench runtime: {cpus} CPUs, {} build, {} updates over {} ids, {} no-op modifies, {} chain rounds",
        if cfg!(debug_assertions) { "DEBUG (numbers not meaningful)" } else { "release" },
        args.updates,
        args.ids,
        args.noops,
        args.chain_rounds
    );
    let mut rows: Vec<(String, String, String, Option<bool>)> = Vec::new();
    let mut update_rates = Vec::new();
    for watchers in [0usize, 4, 64] {
        let r = updates(&rt, args, watchers)?;
        update_rates.push((watchers, r));
        let (target, ok) = if watchers == 4 {
            ("≥ 100k/s".to_owned(), Some(r >= 100_000.0))
        } else {
            ("—".to_owned(), None)
        };
        rows.push((
            format!("updates/s, {watchers} kind watchers"),
            rate(r),
            target,
            ok,
        ));
    }
    let (n, noop_version) = noops(args);
    rows.push((
        "no-op modify/s".into(),
        rate(n),
        "≥ 500k/s".into(),
        Some(n >= 500_000.0),
    ));
    let (median, p99) = rt.block_on(chain(args.chain_rounds))?;
    rows.push((
        "5-controller chain, median".into(),
        format!("{median:.1?}"),
        "< 1 ms".into(),
        Some(median < Duration::from_millis(1)),
    ));
    rows.push((
        "5-controller chain, p99".into(),
        format!("{p99:.1?}"),
        "—".into(),
        None,
    ));

    println!();
    println!(
        "{:<34} {:>14}   {:<10} result",
        "metric", "measured", "target"
    );
    for (name, measured, target, ok) in &rows {
        let res = match ok {
            Some(true) => "ok",
            Some(false) => "MISSED",
            None => "",
        };
        println!("{name:<34} {measured:>14}   {target:<10} {res}");
    }
    judge(&update_rates, n, noop_version).into_result()?;
    Ok(())
}

/// What shows the runtime broken: a rate of nothing, or a no-op modify that wrote
/// (`noop_version`: the resource's version after them all; only the first modify
/// writes).
fn judge(update_rates: &[(usize, f64)], noop_rate: f64, noop_version: u64) -> Sanity {
    let mut s = Sanity::new("runtime");
    for (watchers, r) in update_rates {
        s.positive_rate(&format!("updates with {watchers} kind watchers"), *r);
    }
    s.positive_rate("no-op modifies", noop_rate);
    s.require(noop_version == 1, || {
        format!(
            "modifies that changed nothing wrote: the resource is at version {noop_version}, not 1"
        )
    });
    s
}

fn rate(per_sec: f64) -> String {
    if per_sec >= 1e6 {
        format!("{:.2}M/s", per_sec / 1e6)
    } else {
        format!("{:.1}k/s", per_sec / 1e3)
    }
}

/// Real updates (Modify with a changed spec) while `watchers` kind watchers drain every
/// event; the clock stops when the writer is done and every watcher has seen every
/// event. The store has no back-pressure (a watcher that falls a whole history behind
/// is overrun, by design), so the writer here paces itself to keep the slowest
/// watcher within half the history: the figure is the rate that all watchers sustain.
fn updates(rt: &tokio::runtime::Runtime, args: &Args, watchers: usize) -> anyhow::Result<f64> {
    const HISTORY: usize = 1 << 16;
    let store = Store::new(StoreOptions {
        history_capacity: HISTORY,
    });
    let kind = Kind::new(NS, BenchResource::TYPE);
    for id in 0..args.ids {
        store.modify::<BenchResource>(NS, &id.to_string(), "bench", |r| r.spec.value = -1)?;
    }
    let ids: Vec<String> = (0..args.ids).map(|i| i.to_string()).collect();
    let progress: Arc<Vec<AtomicU64>> =
        Arc::new((0..watchers).map(|_| AtomicU64::new(0)).collect());
    let mut tasks = Vec::new();
    for k in 0..watchers {
        let mut w = store.watch_kind(&kind, WatchOptions::default());
        let progress = Arc::clone(&progress);
        let total = args.updates;
        tasks.push(rt.spawn(async move {
            let mut batch = Vec::new();
            let mut n = 0u64;
            while n < total {
                if !w.recv_batch(&mut batch).await {
                    anyhow::bail!("watch ended");
                }
                for ev in batch.drain(..) {
                    match ev {
                        Event::Errored(e) => anyhow::bail!("watcher: {e}"),
                        _ => n += 1,
                    }
                }
                progress[k].store(n, Ordering::Relaxed);
            }
            Ok(())
        }));
    }
    let max_lag = (HISTORY / 2) as u64;
    let start = Instant::now();
    for i in 0..args.updates {
        if i % 1024 == 0 {
            while progress
                .iter()
                .map(|p| p.load(Ordering::Relaxed))
                .min()
                .is_some_and(|slowest| i - slowest > max_lag)
            {
                std::thread::yield_now();
            }
        }
        let id = &ids[usize::try_from(i % args.ids)?];
        let v = i64::try_from(i)?;
        store.modify::<BenchResource>(NS, id, "bench", |r| r.spec.value = v)?;
    }
    for t in tasks {
        rt.block_on(t)??;
    }
    let elapsed = start.elapsed();
    #[allow(clippy::cast_precision_loss)]
    Ok(args.updates as f64 / elapsed.as_secs_f64())
}

/// Modify that changes nothing: Get + copy + compare, no write, no event. Returns the
/// rate and the resource's version after them (1 unless a no-op wrote).
fn noops(args: &Args) -> (f64, u64) {
    let store = Store::default();
    let mut version = store
        .modify::<BenchResource>(NS, "x", "bench", |r| r.spec.value = 7)
        .map_or(0, |r| r.metadata.version);
    let start = Instant::now();
    for _ in 0..args.noops {
        if let Ok(r) = store.modify::<BenchResource>(NS, "x", "bench", |r| r.spec.value = 7) {
            version = r.metadata.version;
        }
    }
    #[allow(clippy::cast_precision_loss)]
    let r = args.noops as f64 / start.elapsed().as_secs_f64();
    (r, version)
}

/// Spec of the chain stages: the value copied down the chain.
type StageSpec = BenchSpec;

macro_rules! stages {
    ($($name:ident = $ty:literal),*) => {$(
        /// A chain stage type.
        #[derive(Debug)]
        pub struct $name;
        impl ResourceKind for $name {
            const TYPE: &'static str = $ty;
            const DEFAULT_NAMESPACE: &'static str = NS;
            type Spec = StageSpec;
            fn definition() -> Definition {
                Definition::new(Self::TYPE, stringify!($name), NS)
            }
        }
    )*};
}

stages!(
    Stage0 = "Stage0s.bench.wirespan.dev",
    Stage1 = "Stage1s.bench.wirespan.dev",
    Stage2 = "Stage2s.bench.wirespan.dev",
    Stage3 = "Stage3s.bench.wirespan.dev",
    Stage4 = "Stage4s.bench.wirespan.dev",
    Stage5 = "Stage5s.bench.wirespan.dev"
);

/// Copies `I` into `O` (id `v`) on every wake-up.
struct Copy<I, O>(String, std::marker::PhantomData<(I, O)>);

impl<I, O> Controller for Copy<I, O>
where
    I: ResourceKind<Spec = StageSpec>,
    O: ResourceKind<Spec = StageSpec>,
{
    type Event = ();

    fn name(&self) -> &str {
        &self.0
    }
    fn inputs(&self) -> Vec<Input> {
        vec![Input::id_of::<I>(NS, "v", InputKind::Weak)]
    }
    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<O>()]
    }
    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> Pin<Box<dyn Future<Output = ControllerResult> + Send + 'a>> {
        Box::pin(async move {
            if let Some(i) = rt.get_opt::<I>(NS, "v")? {
                let v = i.spec.value;
                rt.modify::<O>(NS, "v", |r| r.spec.value = v)?;
            }
            Ok(Action::await_change())
        })
    }
}

fn copy<I, O>(i: usize) -> Copy<I, O> {
    Copy(format!("Stage{i}Controller"), std::marker::PhantomData)
}

async fn chain(rounds: usize) -> anyhow::Result<(Duration, Duration)> {
    let store = Store::default();
    let mut runtime = Runtime::new(store.clone());
    runtime.register(copy::<Stage0, Stage1>(1))?;
    runtime.register(copy::<Stage1, Stage2>(2))?;
    runtime.register(copy::<Stage2, Stage3>(3))?;
    runtime.register(copy::<Stage3, Stage4>(4))?;
    runtime.register(copy::<Stage4, Stage5>(5))?;
    let h = Harness::start(runtime);
    let end = wirespan_control::runtime::Pointer::new(NS, Stage5::TYPE, "v");
    let mut w = store.watch(&end);
    let mut lat = Vec::with_capacity(rounds);
    // Round 0 warms up (first creates along the chain).
    for k in 0..=i64::try_from(rounds)? {
        let start = Instant::now();
        store.modify::<Stage0>(NS, "v", "", |r| r.spec.value = k + 1)?;
        loop {
            let ev = tokio::time::timeout(Duration::from_secs(10), w.recv())
                .await
                .map_err(|_| {
                    anyhow::anyhow!("chain did not propagate value {} within 10 s", k + 1)
                })?
                .ok_or_else(|| anyhow::anyhow!("watch ended"))?;
            if let Event::Errored(e) = &ev {
                anyhow::bail!("chain watch: {e}");
            }
            let done = ev
                .resource()
                .and_then(wirespan_control::runtime::downcast::<Stage5>)
                .is_some_and(|r| r.spec.value == k + 1);
            if done {
                break;
            }
        }
        if k > 0 {
            lat.push(start.elapsed());
        }
    }
    h.stop().await?;
    lat.sort_unstable();
    let median = lat[lat.len() / 2];
    let p99 = lat[(lat.len() * 99 / 100).min(lat.len() - 1)];
    Ok((median, p99))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_of_nothing_or_a_no_op_that_wrote_is_broken_and_slow_figures_are_not() {
        let slow = [(0, 1.0), (4, 0.5), (64, 0.1)];
        assert!(judge(&slow, 3.0, 1).problems().is_empty());
        let problems = judge(&[(0, 10.0), (4, 0.0)], 5.0, 1).problems().to_vec();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("4 kind watchers"), "{problems:?}");
        let problems = judge(&slow, 5.0, 1001).problems().to_vec();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("version 1001"), "{problems:?}");
    }
}
