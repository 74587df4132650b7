//! Probes (`docs/runtime.md` §7): `TCPProbeConfig`/`HTTPProbeConfig` documents become
//! `network-config/ProbeSpec configuration/<probe id>`, merged into
//! `network/ProbeSpec <probe id>`, run by [`ProbeController`] (one task per probe)
//! which publishes `network/ProbeStatus <probe id>`.
//!
//! Runner rules: first probe immediately, then on a fixed grid of the interval (the
//! period does not stretch by the probe's duration, see [`runner`]); a success resets
//! the failure count and is published; failures are published once the count reaches
//! the threshold (0 and 1: the first). A zero interval or timeout means the default.
//! The HTTP client and the proxy rules are in [`http`]; proxy settings are read from
//! the environment on every attempt (or from the [`EnvSource`] a test injects).

pub mod http;

use std::{collections::HashMap, sync::Arc, time::Duration};

use futures::future::BoxFuture;
use tokio::{net::TcpStream, sync::mpsc, time::MissedTickBehavior};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

pub use http::{no_proxy_matches, proxy_for, EnvSource, ProbeEnv, Url};

use crate::{
    config::probe::{
        or_default, HttpProbeConfig, TcpProbeConfig, DEFAULT_INTERVAL, DEFAULT_TIMEOUT,
    },
    controllers::network::merge::MergeController,
    resources::{
        config::MachineConfig,
        network::{
            ConfigLayer, HttpProbeSpec, ProbeSpec, ProbeSpecSpec, ProbeStatus, ProbeStatusSpec,
            TcpProbeSpec, NS, NS_CONFIG,
        },
    },
    runtime::{
        Action, Controller, ControllerError, ControllerResult, ControllerRuntime, Input, InputKind,
        Kind, Output, Phase, Pointer, RegistrationError, ResourceKind, Runtime, Triggers,
    },
};

/// Registers the probe config, merge and runner controllers; probes read their proxy
/// settings from the process environment.
///
/// # Errors
/// Registration conflicts.
pub fn register(runtime: &mut Runtime) -> Result<(), RegistrationError> {
    register_with_env(runtime, ProbeEnv::process_source())
}

/// [`register`] with the proxy settings taken from `env` (asked on every attempt).
///
/// # Errors
/// Registration conflicts.
pub fn register_with_env(runtime: &mut Runtime, env: EnvSource) -> Result<(), RegistrationError> {
    runtime.register(ProbeConfigController)?;
    runtime.register(MergeController::<ProbeSpec>::new())?;
    runtime.register(ProbeController::new(env))?;
    Ok(())
}

/// The spec of a `TCPProbeConfig` document.
#[must_use]
pub fn tcp_probe_spec(t: &TcpProbeConfig) -> ProbeSpecSpec {
    let (interval, timeout) = t.durations();
    ProbeSpecSpec {
        interval,
        failure_threshold: u32::try_from(t.failure_threshold).unwrap_or(0),
        tcp: Some(TcpProbeSpec {
            endpoint: t.endpoint.clone(),
            timeout,
        }),
        http: None,
        layer: ConfigLayer::Configuration,
    }
}

/// The spec of an `HTTPProbeConfig` document.
#[must_use]
pub fn http_probe_spec(h: &HttpProbeConfig) -> ProbeSpecSpec {
    let (interval, timeout) = h.durations();
    ProbeSpecSpec {
        interval,
        failure_threshold: u32::try_from(h.failure_threshold).unwrap_or(0),
        tcp: None,
        http: Some(HttpProbeSpec {
            url: h.url.clone(),
            timeout,
        }),
        layer: ConfigLayer::Configuration,
    }
}

/// Probe specs of a config's documents (validation rejects two documents with one
/// target; should they meet here anyway, they are one probe).
#[must_use]
pub fn probe_specs(cfg: &crate::config::ConfigDocuments) -> Vec<ProbeSpecSpec> {
    let mut out: Vec<ProbeSpecSpec> = Vec::new();
    let mut push = |name: &str, spec: ProbeSpecSpec| {
        if out.iter().any(|s| s.key() == spec.key()) {
            tracing::warn!(probe = name, id = %spec.key(),
                "two probe documents have the same target; they are one probe");
            return;
        }
        out.push(spec);
    };
    for t in cfg.documents_of::<TcpProbeConfig>() {
        push(&t.name, tcp_probe_spec(t));
    }
    for h in cfg.documents_of::<HttpProbeConfig>() {
        push(&h.name, http_probe_spec(h));
    }
    out
}

/// Writes `network-config/ProbeSpec configuration/<id>` (tracked).
#[derive(Debug, Default)]
pub struct ProbeConfigController;

impl Controller for ProbeConfigController {
    type Event = ();

    fn name(&self) -> &str {
        "ProbeConfigController"
    }

    fn inputs(&self) -> Vec<Input> {
        vec![MachineConfig::input()]
    }

    fn outputs(&self) -> Vec<Output> {
        vec![Output::shared::<ProbeSpec>()]
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let cfg = MachineConfig::active(rt)?;
            let specs = cfg.map(|c| probe_specs(&c.spec.config)).unwrap_or_default();
            rt.start_tracking_outputs()?;
            for spec in specs {
                let id = format!("{}/{}", ConfigLayer::Configuration.prefix(), spec.key());
                rt.modify::<ProbeSpec>(NS_CONFIG, &id, |r| r.spec = spec.clone())?;
            }
            rt.cleanup_outputs(&[Kind::new(NS_CONFIG, ProbeSpec::TYPE)])?;
            Ok(Action::await_change())
        })
    }
}

/// Failure debouncing of one runner (`docs/runtime.md` §7.2), pure.
#[derive(Debug, Clone, Default)]
pub struct Debounce {
    threshold: u32,
    failures: u32,
}

impl Debounce {
    /// A counter for `threshold` (0 and 1: the first failure is reported).
    #[must_use]
    pub fn new(threshold: u32) -> Self {
        Self {
            threshold,
            failures: 0,
        }
    }

    /// Records one outcome; returns the status to publish, if any.
    pub fn record(&mut self, outcome: Result<(), String>) -> Option<ProbeStatusSpec> {
        match outcome {
            Ok(()) => {
                self.failures = 0;
                Some(ProbeStatusSpec {
                    success: true,
                    last_error: String::new(),
                })
            }
            Err(e) => {
                self.failures = self.failures.saturating_add(1);
                (self.failures >= self.threshold.max(1)).then_some(ProbeStatusSpec {
                    success: false,
                    last_error: e,
                })
            }
        }
    }
}

/// `timeout`, or the default when zero (a spec from any source, not only the config,
/// may leave it unset; a zero timeout would fail every probe at once).
fn effective_timeout(timeout: Duration) -> Duration {
    or_default(Some(timeout), DEFAULT_TIMEOUT)
}

/// One TCP probe: connect within `timeout`, then close (SO_LINGER 1 s).
///
/// # Errors
/// The failure, as text.
pub async fn probe_tcp(spec: &TcpProbeSpec) -> Result<(), String> {
    let timeout = effective_timeout(spec.timeout);
    let stream = tokio::time::timeout(timeout, TcpStream::connect(spec.endpoint.as_str()))
        .await
        .map_err(|_| format!("dial tcp {}: i/o timeout", spec.endpoint))?
        .map_err(|e| format!("dial tcp {}: {e}", spec.endpoint))?;
    // Nothing is unsent, so the close does not block; the linger only keeps the
    // socket out of a long TIME-WAIT (`docs/runtime.md` §7.2).
    #[allow(deprecated)]
    let _ = stream.set_linger(Some(Duration::from_secs(1)));
    drop(stream);
    Ok(())
}

/// One HTTP probe attempt with the proxy settings of `env`.
///
/// # Errors
/// The failure, as text (`received non-success status code: 503`, timeouts, …).
pub async fn probe_http(spec: &HttpProbeSpec, env: &ProbeEnv) -> Result<(), String> {
    let url = Url::parse(&spec.url)?;
    let timeout = effective_timeout(spec.timeout);
    let code = tokio::time::timeout(timeout, http::get(&url, env))
        .await
        .map_err(|_| {
            format!(
                "GET {}: timeout after {timeout:?}",
                crate::resources::network::strip_userinfo(&spec.url),
            )
        })??;
    if (200..400).contains(&code) {
        Ok(())
    } else {
        Err(format!("received non-success status code: {code}"))
    }
}

/// One attempt of `spec`.
///
/// # Errors
/// The failure, as text.
pub async fn probe_once(spec: &ProbeSpecSpec, env: &ProbeEnv) -> Result<(), String> {
    match (&spec.tcp, &spec.http) {
        (Some(t), _) => probe_tcp(t).await,
        (None, Some(h)) => probe_http(h, env).await,
        (None, None) => Err("probe has neither tcp nor http".to_owned()),
    }
}

/// A runner's debounced result: the probe controller's event.
#[derive(Debug)]
pub struct Report {
    id: String,
    generation: u64,
    status: ProbeStatusSpec,
}

/// One attempt of a spec (the real one is [`probe_once`]; tests count and time them).
type Prober =
    Arc<dyn Fn(ProbeSpecSpec, ProbeEnv) -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

fn real_prober() -> Prober {
    Arc::new(|spec, env| Box::pin(async move { probe_once(&spec, &env).await }))
}

/// Probes `spec` at once and then every interval (zero: the default) until `cancel`
/// fires or the controller is gone, reporting what [`Debounce`] lets through.
///
/// The schedule is a ticker, not a sleep after each attempt, so the period does not
/// grow by the attempt's duration. Missed ticks (an attempt longer than the interval,
/// e.g. a 10 s timeout against a 1 s interval) use [`MissedTickBehavior::Skip`]: the
/// overdue attempt starts at once and later ones return to the original grid.
/// `Burst` (tokio's default) would instead fire the missed ticks back to back at a
/// target that is already slow; `Delay` would shift the grid by every overrun.
async fn runner(
    id: String,
    generation: u64,
    spec: ProbeSpecSpec,
    env: EnvSource,
    probe: Prober,
    tx: mpsc::UnboundedSender<Report>,
    cancel: CancellationToken,
) {
    let mut debounce = Debounce::new(spec.failure_threshold);
    let mut tick = tokio::time::interval(or_default(Some(spec.interval), DEFAULT_INTERVAL));
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let outcome = tokio::select! {
            () = cancel.cancelled() => return,
            o = probe(spec.clone(), env()) => o,
        };
        if let Err(e) = &outcome {
            tracing::debug!(probe = %id, error = %e, "probe failed");
        }
        if let Some(status) = debounce.record(outcome) {
            let report = Report {
                id: id.clone(),
                generation,
                status,
            };
            if tx.send(report).is_err() {
                return;
            }
        }
    }
}

struct Running {
    spec: ProbeSpecSpec,
    generation: u64,
    cancel: CancellationToken,
}

/// Runs one task per `network/ProbeSpec` and publishes `network/ProbeStatus`.
pub struct ProbeController {
    env: EnvSource,
    /// The runners, by probe id.
    running: HashMap<String, Running>,
    next_generation: u64,
    /// Where runners send their reports (the other end is this controller's event
    /// stream); replaced at every start.
    reports: Option<mpsc::UnboundedSender<Report>>,
}

impl ProbeController {
    /// A controller whose probes take their proxy settings from `env`.
    #[must_use]
    pub fn new(env: EnvSource) -> Self {
        Self {
            env,
            running: HashMap::new(),
            next_generation: 0,
            reports: None,
        }
    }

    fn stop_all(&mut self) {
        for r in self.running.values() {
            r.cancel.cancel();
        }
        self.running.clear();
    }

    /// Starts and stops runners to match the specs; removes statuses of probes that
    /// are gone.
    fn sync_runners(&mut self, rt: &mut ControllerRuntime) -> Result<(), ControllerError> {
        let specs: HashMap<String, ProbeSpecSpec> = rt
            .list::<ProbeSpec>(NS)?
            .iter()
            .filter(|r| r.metadata.phase == Phase::Running)
            .map(|r| (r.metadata.id.clone(), r.spec.clone()))
            .collect();
        self.running.retain(|id, r| {
            let keep = specs.get(id) == Some(&r.spec);
            if !keep {
                r.cancel.cancel();
            }
            keep
        });
        let Some(reports) = &self.reports else {
            return Ok(());
        };
        for (id, spec) in specs {
            if self.running.contains_key(&id) {
                continue;
            }
            self.next_generation += 1;
            let generation = self.next_generation;
            let cancel = rt.cancellation().child_token();
            let run = runner(
                id.clone(),
                generation,
                spec.clone(),
                Arc::clone(&self.env),
                real_prober(),
                reports.clone(),
                cancel.clone(),
            );
            tokio::spawn(run.in_current_span());
            self.running.insert(
                id,
                Running {
                    spec,
                    generation,
                    cancel,
                },
            );
        }
        for st in rt.list::<ProbeStatus>(NS)? {
            if !self.running.contains_key(&st.metadata.id) && st.metadata.owner == rt.name() {
                rt.destroy(&Pointer::new(NS, ProbeStatus::TYPE, &st.metadata.id))?;
            }
        }
        Ok(())
    }
}

impl Default for ProbeController {
    fn default() -> Self {
        Self::new(ProbeEnv::process_source())
    }
}

impl std::fmt::Debug for ProbeController {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProbeController").finish_non_exhaustive()
    }
}

impl Controller for ProbeController {
    type Event = Report;

    fn name(&self) -> &str {
        "ProbeController"
    }

    fn inputs(&self) -> Vec<Input> {
        vec![Input::of::<ProbeSpec>(NS, InputKind::Weak)]
    }

    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<ProbeStatus>()]
    }

    fn start(&mut self, _rt: &mut ControllerRuntime) -> Result<Triggers<Report>, ControllerError> {
        // A restart restarts every runner.
        self.stop_all();
        let (tx, rx) = mpsc::unbounded_channel::<Report>();
        self.reports = Some(tx);
        Ok(Triggers::inputs_only().with_events(Box::pin(UnboundedReceiverStream::new(rx))))
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        reports: Vec<Report>,
    ) -> BoxFuture<'a, ControllerResult<Report>> {
        Box::pin(async move {
            if reports.is_empty() {
                self.sync_runners(rt)?;
            }
            for rep in reports {
                // Late results of stopped or restarted runners are ignored.
                let current = self
                    .running
                    .get(&rep.id)
                    .is_some_and(|r| r.generation == rep.generation);
                if current {
                    rt.modify::<ProbeStatus>(NS, &rep.id, |r| r.spec = rep.status.clone())?;
                }
            }
            Ok(Action::await_change())
        })
    }

    fn stop<'a>(&'a mut self, _rt: &'a mut ControllerRuntime) -> BoxFuture<'a, ()> {
        self.stop_all();
        Box::pin(async {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Config validation rejects two probes with one merge key; it must be the id the
    /// probe's spec is written under.
    #[test]
    fn merge_keys_of_probe_documents_are_the_ids_of_their_specs() {
        use crate::config::ConfigDocument as _;
        let tcp = TcpProbeConfig {
            endpoint: "10.0.0.1:22".into(),
            ..TcpProbeConfig::default()
        };
        assert_eq!(tcp.merge_key().unwrap().1, tcp_probe_spec(&tcp).key());
        let http = HttpProbeConfig {
            url: "https://user:pw@example.com:8443/health".into(),
            ..HttpProbeConfig::default()
        };
        assert_eq!(http.merge_key().unwrap().1, http_probe_spec(&http).key());
        assert!(!http.merge_key().unwrap().1.contains("pw"));
    }

    #[test]
    fn debounce_reports_failures_at_threshold_and_one_success_resets() {
        let fail = || Err("x".to_owned());
        // (threshold, outcomes, expected reports: None / Some(success))
        type Case = (u32, Vec<Result<(), String>>, Vec<Option<bool>>);
        let cases: Vec<Case> = vec![
            (0, vec![fail(), fail()], vec![Some(false), Some(false)]),
            (1, vec![fail(), Ok(())], vec![Some(false), Some(true)]),
            (
                3,
                vec![fail(), fail(), fail(), fail()],
                vec![None, None, Some(false), Some(false)],
            ),
            (
                3,
                vec![fail(), fail(), Ok(()), fail(), fail(), fail()],
                vec![None, None, Some(true), None, None, Some(false)],
            ),
        ];
        for (threshold, outcomes, want) in cases {
            let mut d = Debounce::new(threshold);
            let got: Vec<Option<bool>> = outcomes
                .into_iter()
                .map(|o| d.record(o).map(|s| s.success))
                .collect();
            assert_eq!(got, want, "threshold {threshold}");
        }
    }

    /// Runs `runner` with a fake probe whose first attempt takes `first` (tokio time)
    /// and the others `takes`, all failing; returns the start times of the first `n`
    /// attempts, relative to the first.
    async fn attempt_starts(
        interval: Duration,
        first: Duration,
        takes: Duration,
        n: usize,
    ) -> Vec<Duration> {
        let starts = Arc::new(std::sync::Mutex::new(Vec::new()));
        let s = Arc::clone(&starts);
        let probe: Prober = Arc::new(move |_, _| {
            let mut starts = s.lock().unwrap();
            let takes = if starts.is_empty() { first } else { takes };
            starts.push(tokio::time::Instant::now());
            Box::pin(async move {
                tokio::time::sleep(takes).await;
                Err("down".to_owned())
            })
        });
        let (tx, mut rx) = mpsc::unbounded_channel();
        let cancel = CancellationToken::new();
        let spec = ProbeSpecSpec {
            interval,
            ..ProbeSpecSpec::default()
        };
        let task = tokio::spawn(runner(
            "p".into(),
            1,
            spec,
            ProbeEnv::process_source(),
            probe,
            tx,
            cancel.clone(),
        ));
        // Every failure is reported (threshold 0): one report per finished attempt.
        for _ in 0..n {
            rx.recv().await.unwrap();
        }
        cancel.cancel();
        task.await.unwrap();
        let starts = starts.lock().unwrap();
        starts[..n].iter().map(|t| *t - starts[0]).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn probes_start_on_the_interval_grid_whatever_they_take() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        // A 300 ms probe every second starts at 0, 1, 2, 3 s (a sleep after each
        // probe would drift: 0, 1.3, 2.6, 3.9 s).
        assert_eq!(
            attempt_starts(s(1), ms(300), ms(300), 4).await,
            [s(0), s(1), s(2), s(3)]
        );
        // A probe longer than the interval (3.5 s): the overdue one starts at once,
        // then the grid is kept (Skip: 4, 5 s) — no burst of the missed ticks at 3.5 s
        // (Burst), no grid shifted by the overrun (Delay: 4.5, 5.5 s).
        assert_eq!(
            attempt_starts(s(1), ms(3500), ms(10), 4).await,
            [s(0), ms(3500), s(4), s(5)]
        );
        // Zero: the default interval.
        assert_eq!(
            attempt_starts(Duration::ZERO, ms(10), ms(10), 2).await,
            [s(0), DEFAULT_INTERVAL]
        );
    }

    #[tokio::test]
    async fn zero_timeouts_mean_the_default_not_an_immediate_failure() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
                    let mut buf = [0u8; 1024];
                    let _ = s.read(&mut buf).await;
                    // A slow answer: a zero timeout taken literally fails first.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await;
                });
            }
        });
        let env = ProbeEnv::default();
        let http = HttpProbeSpec {
            url: format!("http://127.0.0.1:{port}/"),
            timeout: Duration::ZERO,
        };
        probe_http(&http, &env).await.unwrap();
        let tcp = TcpProbeSpec {
            endpoint: format!("127.0.0.1:{port}"),
            timeout: Duration::ZERO,
        };
        probe_tcp(&tcp).await.unwrap();
    }
}
