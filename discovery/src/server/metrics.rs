//! Prometheus metrics of the discovery server (prometheus-client), named as upstream
//! where upstream has the metric.

use std::time::Duration;

use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

use super::state::{Counts, GcStats};

type Labels = Vec<(&'static str, String)>;

/// Methods whose successful calls have their series made at start (also exported at
/// zero from then on).
const RPC_METHODS: &[&str] = &[
    "Hello",
    "AffiliateUpdate",
    "AffiliateDelete",
    "List",
    "Watch",
];

fn method_labels(method: &str) -> Labels {
    vec![("grpc_method", method.to_owned())]
}

fn rpc_labels(method: &str, code: tonic::Code) -> Labels {
    let mut labels = method_labels(method);
    labels.push(("grpc_code", format!("{code:?}")));
    labels
}

fn latency_histogram() -> Histogram {
    // 50 µs … ~1.6 s.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.000_05, 2.0, 16,
    ))
}

/// All metrics of one server.
pub struct Metrics {
    registry: Registry,
    clusters: Gauge,
    affiliates: Gauge,
    endpoints: Gauge,
    subscriptions: Gauge,
    gc_runs: Counter,
    gc_clusters: Counter,
    gc_affiliates: Counter,
    hello: Family<Labels, Counter>,
    rpc_handled: Family<Labels, Counter>,
    rpc_latency: Family<Labels, Histogram, fn() -> Histogram>,
    storage_ops: Family<Labels, Counter>,
    /// The series a successful RPC of each method updates, looked up once: a
    /// `Family` lookup allocates and hashes a label vector on every call, a cost the
    /// AffiliateUpdate hot path should not pay.
    ok_series: Vec<(&'static str, Counter, Histogram)>,
    watch_aborted: Counter,
    watch_catch_ups: Counter,
    watch_bytes: Gauge,
    watch_budget_aborts: Counter,
    watch_lagged: Counter,
    watch_log_bytes: Gauge,
    stored_bytes: Gauge,
    clusters_refused: Counter,
    budget_refused: Counter,
    snapshot_dropped: Counter,
    rate_limit_rejected: Family<Labels, Counter>,
    rate_limit_evicted: Family<Labels, Counter>,
    rate_limit_refunded: Family<Labels, Counter>,
    rate_limit_buckets: Family<Labels, Gauge>,
    /// Client-version labels handed out so far (see [`MAX_VERSION_LABELS`]).
    version_labels: std::sync::Mutex<std::collections::HashSet<String>>,
    /// The server relay's series (at zero while it is off).
    pub relay: RelayMetrics,
    /// Connection caps, handshake and request timeouts of both listeners.
    pub transport: super::transport::TransportMetrics,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric.
    #[must_use]
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let m = Self {
            clusters: Gauge::default(),
            affiliates: Gauge::default(),
            endpoints: Gauge::default(),
            subscriptions: Gauge::default(),
            gc_runs: Counter::default(),
            gc_clusters: Counter::default(),
            gc_affiliates: Counter::default(),
            hello: Family::default(),
            rpc_handled: Family::default(),
            rpc_latency: Family::new_with_constructor(latency_histogram),
            storage_ops: Family::default(),
            ok_series: Vec::new(),
            watch_aborted: Counter::default(),
            watch_catch_ups: Counter::default(),
            watch_bytes: Gauge::default(),
            watch_budget_aborts: Counter::default(),
            watch_lagged: Counter::default(),
            watch_log_bytes: Gauge::default(),
            stored_bytes: Gauge::default(),
            clusters_refused: Counter::default(),
            budget_refused: Counter::default(),
            snapshot_dropped: Counter::default(),
            rate_limit_rejected: Family::default(),
            rate_limit_evicted: Family::default(),
            rate_limit_refunded: Family::default(),
            rate_limit_buckets: Family::default(),
            version_labels: std::sync::Mutex::default(),
            relay: RelayMetrics::default(),
            transport: super::transport::TransportMetrics::default(),
            registry: Registry::default(),
        };
        m.relay.register(&mut registry);
        m.transport.register(&mut registry);
        registry.register(
            "discovery_state_clusters",
            "Number of clusters",
            m.clusters.clone(),
        );
        registry.register(
            "discovery_state_affiliates",
            "Number of affiliates over all clusters",
            m.affiliates.clone(),
        );
        registry.register(
            "discovery_state_endpoints",
            "Number of endpoints over all affiliates",
            m.endpoints.clone(),
        );
        registry.register(
            "discovery_state_subscriptions",
            "Number of open Watch subscriptions",
            m.subscriptions.clone(),
        );
        registry.register(
            "discovery_state_gc_runs",
            "Garbage collection passes",
            m.gc_runs.clone(),
        );
        registry.register(
            "discovery_state_gc_clusters",
            "Clusters removed by garbage collection",
            m.gc_clusters.clone(),
        );
        registry.register(
            "discovery_state_gc_affiliates",
            "Affiliates removed by garbage collection",
            m.gc_affiliates.clone(),
        );
        registry.register(
            "discovery_server_hello_requests",
            "Hello requests by client version (vMAJOR.MINOR)",
            m.hello.clone(),
        );
        registry.register(
            "grpc_server_handled",
            "RPCs completed, by method and status code",
            m.rpc_handled.clone(),
        );
        registry.register(
            "grpc_server_handling_seconds",
            "RPC handling latency (Watch: until the stream is set up)",
            m.rpc_latency.clone(),
        );
        registry.register(
            "discovery_storage_operations",
            "Snapshot operations by operation and status",
            m.storage_ops.clone(),
        );
        registry.register(
            "discovery_watch_aborted",
            "Watch streams ended with ABORTED (a stalled watcher lost updates)",
            m.watch_aborted.clone(),
        );
        registry.register(
            "discovery_watch_held_bytes",
            "Bytes of snapshots and catch-up batches held for watchers (the byte budget's measure)",
            m.watch_bytes.clone(),
        );
        registry.register(
            "discovery_watch_budget_aborts",
            "Watchers aborted because the held bytes exceeded the budget (also counted in discovery_watch_aborted once their stream ends)",
            m.watch_budget_aborts.clone(),
        );
        registry.register(
            "discovery_watch_catch_ups",
            "Catch-ups made from the state for watchers that fell behind further than their cluster's event log reaches back",
            m.watch_catch_ups.clone(),
        );
        registry.register(
            "discovery_watch_lagged",
            "Watchers whose queue overflowed while they kept reading, switched to their cluster's event log",
            m.watch_lagged.clone(),
        );
        registry.register(
            "discovery_watch_log_bytes",
            "Bytes of recent events kept in the clusters' event logs for watchers that fell behind",
            m.watch_log_bytes.clone(),
        );
        m.register_limits(&mut registry);
        // At zero from the start: a family without series is not rendered at all,
        // and `increase()` needs the zero to see the first operation.
        for operation in ["save", "load"] {
            for status in ["success", "error"] {
                let _ = m.storage_ops.get_or_create(&vec![
                    ("operation", operation.to_owned()),
                    ("status", status.to_owned()),
                ]);
            }
        }
        let ok_series = RPC_METHODS
            .iter()
            .map(|&method| {
                let handled = m
                    .rpc_handled
                    .get_or_create(&rpc_labels(method, tonic::Code::Ok))
                    .clone();
                let latency = m.rpc_latency.get_or_create(&method_labels(method)).clone();
                (method, handled, latency)
            })
            .collect();
        Self {
            registry,
            ok_series,
            ..m
        }
    }

    /// Registers the series of the server's limits (rate limiter, state budget).
    fn register_limits(&self, registry: &mut Registry) {
        registry.register(
            "discovery_state_bytes",
            "Bytes the stored clusters and affiliates take (the --state-budget-mib measure)",
            self.stored_bytes.clone(),
        );
        registry.register(
            "discovery_state_clusters_refused",
            "Requests refused because they would create a cluster beyond --max-clusters",
            self.clusters_refused.clone(),
        );
        registry.register(
            "discovery_state_budget_refused",
            "Requests refused because they would grow the state past --state-budget-mib",
            self.budget_refused.clone(),
        );
        registry.register(
            "discovery_snapshot_dropped",
            "Clusters, affiliates and endpoints dropped from the snapshot at load for breaking a limit",
            self.snapshot_dropped.clone(),
        );
        registry.register(
            "discovery_ratelimit_rejected",
            "Calls refused by a per-address rate limiter, by limiter and reason (deadline: the wait outlasts the call's deadline; debt: over 1 s of calls queued)",
            self.rate_limit_rejected.clone(),
        );
        registry.register(
            "discovery_ratelimit_evicted",
            "Rate-limit buckets evicted to make room for new addresses, by limiter",
            self.rate_limit_evicted.clone(),
        );
        registry.register(
            "discovery_ratelimit_refunded",
            "Reserved rate-limit tokens given back by calls cancelled while they waited, by limiter",
            self.rate_limit_refunded.clone(),
        );
        registry.register(
            "discovery_ratelimit_buckets",
            "Rate-limit buckets held, by limiter",
            self.rate_limit_buckets.clone(),
        );
        for limiter in ["calls", "deletes"] {
            for reason in ["deadline", "debt"] {
                let _ = self.rate_limit_rejected.get_or_create(&vec![
                    ("limiter", limiter.to_owned()),
                    ("reason", reason.to_owned()),
                ]);
            }
            let _ = self
                .rate_limit_evicted
                .get_or_create(&limiter_labels(limiter));
            let _ = self
                .rate_limit_refunded
                .get_or_create(&limiter_labels(limiter));
            let _ = self
                .rate_limit_buckets
                .get_or_create(&limiter_labels(limiter));
        }
    }

    /// Counts a call refused by the rate limiter `limiter` for `reason`.
    pub fn rate_limit_rejected(&self, limiter: &'static str, reason: &'static str) {
        self.rate_limit_rejected
            .get_or_create(&vec![
                ("limiter", limiter.to_owned()),
                ("reason", reason.to_owned()),
            ])
            .inc();
    }

    /// Counts buckets evicted from `limiter`.
    pub fn rate_limit_evicted(&self, limiter: &'static str, evicted: usize) {
        if evicted > 0 {
            self.rate_limit_evicted
                .get_or_create(&limiter_labels(limiter))
                .inc_by(evicted as u64);
        }
    }

    /// Counts a token given back to `limiter`.
    pub fn rate_limit_refunded(&self, limiter: &'static str) {
        self.rate_limit_refunded
            .get_or_create(&limiter_labels(limiter))
            .inc();
    }

    /// Sets how many buckets `limiter` holds.
    pub fn rate_limit_buckets(&self, limiter: &'static str, buckets: usize) {
        self.rate_limit_buckets
            .get_or_create(&limiter_labels(limiter))
            .set(gauge(buckets));
    }

    /// Counts a Watch stream aborted for lost updates.
    pub fn watch_aborted(&self) {
        self.watch_aborted.inc();
    }

    /// Counts a catch-up sent to a lagging watcher.
    pub fn watch_catch_up(&self) {
        self.watch_catch_ups.inc();
    }

    /// Counts one Hello under its version label.
    pub fn hello(&self, client_version: &str) {
        let label = self.bounded_version_label(client_version);
        self.hello
            .get_or_create(&vec![("client_version", label)])
            .inc();
    }

    /// [`version_label`], or `other` once [`MAX_VERSION_LABELS`] distinct labels
    /// were handed out: clients choose their version string, so without a cap they
    /// could make a series each.
    fn bounded_version_label(&self, client_version: &str) -> String {
        let label = version_label(client_version);
        let mut seen = self
            .version_labels
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if seen.contains(&label) {
            return label;
        }
        if seen.len() >= MAX_VERSION_LABELS {
            return OTHER_VERSIONS.into();
        }
        seen.insert(label.clone());
        label
    }

    /// Records one finished RPC.
    pub fn rpc(&self, method: &'static str, code: tonic::Code, elapsed: Duration) {
        if code == tonic::Code::Ok {
            if let Some((_, handled, latency)) = self.ok_series.iter().find(|s| s.0 == method) {
                handled.inc();
                latency.observe(elapsed.as_secs_f64());
                return;
            }
        }
        self.rpc_handled
            .get_or_create(&rpc_labels(method, code))
            .inc();
        self.rpc_latency
            .get_or_create(&method_labels(method))
            .observe(elapsed.as_secs_f64());
    }

    /// Records one GC pass.
    pub fn gc(&self, stats: GcStats) {
        self.gc_runs.inc();
        self.gc_clusters.inc_by(stats.clusters as u64);
        self.gc_affiliates.inc_by(stats.affiliates as u64);
    }

    /// Records one snapshot operation (`save` / `load`) and its outcome.
    pub fn storage(&self, operation: &'static str, ok: bool) {
        let status = if ok { "success" } else { "error" };
        self.storage_ops
            .get_or_create(&vec![
                ("operation", operation.to_owned()),
                ("status", status.to_owned()),
            ])
            .inc();
    }

    /// Renders the text exposition with the state gauges set from `counts`.
    #[must_use]
    pub fn render(&self, counts: Counts) -> String {
        self.clusters.set(gauge(counts.clusters));
        self.affiliates.set(gauge(counts.affiliates));
        self.endpoints.set(gauge(counts.endpoints));
        self.subscriptions.set(gauge(counts.subscriptions));
        self.watch_bytes.set(gauge(counts.watch_bytes));
        self.watch_log_bytes.set(gauge(counts.watch_log_bytes));
        self.stored_bytes.set(gauge(counts.stored_bytes));
        // The state keeps the totals; the counters catch up to them.
        for (counter, total) in [
            (&self.watch_budget_aborts, counts.watch_budget_aborts),
            (&self.watch_lagged, counts.watch_lagged),
            (&self.clusters_refused, counts.clusters_refused),
            (&self.budget_refused, counts.budget_refused),
            (&self.snapshot_dropped, counts.snapshot_dropped),
        ] {
            counter.inc_by(total.saturating_sub(counter.get()));
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

fn limiter_labels(limiter: &str) -> Labels {
    vec![("limiter", limiter.to_owned())]
}

/// Most distinct `client_version` labels; later new versions count as
/// [`OTHER_VERSIONS`].
pub const MAX_VERSION_LABELS: usize = 32;
/// The label of versions beyond [`MAX_VERSION_LABELS`].
pub const OTHER_VERSIONS: &str = "other";

fn gauge(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The `client_version` label: `vMAJOR.MINOR`, `-pre` appended when the version had a
/// `-suffix`, else `unknown`. MAJOR (≤ 2 chars) and MINOR (≤ 3 chars) must be digits
/// here (upstream only checks lengths) so the label set stays bounded whatever
/// clients send.
#[must_use]
pub fn version_label(version: &str) -> String {
    let (base, pre) = match version.split_once('-') {
        Some((base, _)) => (base, true),
        None => (version, false),
    };
    let Some(rest) = base.strip_prefix('v') else {
        return "unknown".into();
    };
    let Some((major, after)) = rest.split_once('.') else {
        return "unknown".into();
    };
    let Some((minor, _)) = after.split_once('.') else {
        return "unknown".into();
    };
    let digits = |s: &str, max: usize| {
        !s.is_empty() && s.len() <= max && s.bytes().all(|b| b.is_ascii_digit())
    };
    if !digits(major, 2) || !digits(minor, 3) {
        return "unknown".into();
    }
    format!("v{major}.{minor}{}", if pre { "-pre" } else { "" })
}

/// The relay's metrics, registered with the server's.
#[derive(Debug, Clone, Default)]
pub struct RelayMetrics {
    pub(crate) allocations: Gauge,
    allocated: Family<Vec<(&'static str, String)>, Counter>,
    datagrams: Family<Vec<(&'static str, String)>, Counter>,
    pub(crate) bytes: Counter,
}

impl RelayMetrics {
    /// Registers every series.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "discovery_relay_allocations",
            "Server relay allocations (node pairs) in use",
            self.allocations.clone(),
        );
        registry.register(
            "discovery_relay_allocate_requests",
            "Relay allocate calls by result (created, refreshed, refused, absent)",
            self.allocated.clone(),
        );
        registry.register(
            "discovery_relay_datagrams",
            "Datagrams the relay received, by result (forwarded, or why dropped)",
            self.datagrams.clone(),
        );
        registry.register(
            "discovery_relay_forwarded_bytes",
            "Bytes the relay forwarded",
            self.bytes.clone(),
        );
    }

    pub(crate) fn datagram(&self, result: &'static str) {
        self.datagrams
            .get_or_create(&vec![("result", result.to_owned())])
            .inc();
    }

    pub(crate) fn allocate(&self, result: &'static str) {
        self.allocated
            .get_or_create(&vec![("result", result.to_owned())])
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_labels() {
        assert_eq!(version_label("v1.8.3"), "v1.8");
        assert_eq!(version_label("v1.8.0-beta.1"), "v1.8-pre");
        assert_eq!(version_label("v1.2"), "unknown");
        assert_eq!(version_label(""), "unknown");
        assert_eq!(version_label("v12.345.6"), "v12.345");
        assert_eq!(version_label("v123.4.5"), "unknown");
        assert_eq!(version_label("v1.2345.6"), "unknown");
        assert_eq!(version_label("1.8.3"), "unknown");
        assert_eq!(version_label("va.b.c"), "unknown");
    }

    #[test]
    fn render_has_state_gauges_and_counters() {
        let m = Metrics::new();
        m.hello("v1.8.3");
        m.rpc("Hello", tonic::Code::Ok, Duration::from_millis(1));
        let text = m.render(Counts {
            clusters: 2,
            affiliates: 3,
            endpoints: 4,
            subscriptions: 5,
            watch_lagged: 6,
            watch_log_bytes: 7,
            ..Counts::default()
        });
        assert!(text.contains("discovery_state_clusters 2"), "{text}");
        assert!(text.contains("discovery_watch_lagged_total 6"), "{text}");
        assert!(text.contains("discovery_watch_log_bytes 7"), "{text}");
        assert!(text.contains("discovery_state_subscriptions 5"), "{text}");
        assert!(
            text.contains("discovery_server_hello_requests_total{client_version=\"v1.8\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("grpc_server_handled_total{grpc_method=\"Hello\",grpc_code=\"Ok\"} 1"),
            "{text}"
        );
    }
}
