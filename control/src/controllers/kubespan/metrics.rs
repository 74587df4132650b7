//! Prometheus metrics of the node (prometheus-client): peers by state, per-peer
//! state, handshake age and traffic, the marking fast path, its prefixes and the eBPF
//! classifier's packet counters, the config status, reconcile durations, controller
//! restarts.

use std::{sync::atomic::AtomicU64, time::Duration};

use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

use wirespan_dataplane::{fastpath::Counters, wireguard::DeviceDrops};
use wirespan_discovery::text::escape_label_value;

type Labels = Vec<(&'static str, String)>;

/// A label set with every value escaped for the text exposition: prometheus-client
/// writes label values as given, and some (peer labels) are nodenames that other
/// cluster members chose. Every label set of this module is built here.
fn labels(pairs: &[(&'static str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (*k, escape_label_value(v).into_owned()))
        .collect()
}

fn duration_histogram() -> Histogram {
    // 20 µs … ~5 s.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.000_02, 2.0, 18,
    ))
}

/// Refreshes gauges that mirror state kept elsewhere, just before each scrape.
pub type Collector = Box<dyn Fn(&MeshMetrics) + Send + Sync>;

/// Reads the eBPF classifier's packet counters; `None` once the classifier is gone.
pub type PacketCounterSource = Box<dyn Fn() -> Option<Counters> + Send + Sync>;

/// The classifier's counter kinds, as the `result` label says them.
const PACKET_RESULTS: [&str; 4] = ["hit", "miss", "skipped", "unparsed"];

fn by_result(c: &Counters) -> [u64; 4] {
    [c.hit, c.miss, c.skipped, c.unparsed]
}

/// The classifier being read and its counters as last mirrored.
struct PacketSource {
    read: PacketCounterSource,
    last: [u64; 4],
}

/// The mesh metrics; cheap to share (`Arc`).
pub struct MeshMetrics {
    registry: Registry,
    peers: Family<Labels, Gauge>,
    peer_up: Family<Labels, Gauge>,
    peer_path: Family<Labels, Gauge>,
    peer_path_changes: Family<Labels, Counter>,
    fast_path: Family<Labels, Gauge>,
    wireguard: Family<Labels, Gauge>,
    wireguard_drops: Family<Labels, Gauge>,
    fast_path_fallback: Gauge,
    fast_path_packets: Family<Labels, Counter>,
    packet_source: std::sync::Mutex<Option<PacketSource>>,
    marked_prefixes: Family<Labels, Gauge>,
    config_accepted: Gauge,
    config_documents: Gauge,
    config_info: Family<Labels, Gauge>,
    collector: std::sync::Mutex<Option<Collector>>,
    handshake_age: Family<Labels, Gauge<f64, AtomicU64>>,
    rx: Family<Labels, Gauge>,
    tx: Family<Labels, Gauge>,
    reconcile: Family<Labels, Histogram, fn() -> Histogram>,
    restarts: Family<Labels, Counter>,
    republishes: Family<Labels, Counter>,
    /// Each discovery service's re-publish count as last mirrored.
    republishes_seen: std::sync::Mutex<std::collections::HashMap<String, u64>>,
}

impl std::fmt::Debug for MeshMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshMetrics").finish_non_exhaustive()
    }
}

impl Default for MeshMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// One peer's figures for [`MeshMetrics::set_peers`].
#[derive(Debug, Clone)]
pub struct PeerFigures {
    /// Public key.
    pub public_key: String,
    /// Nodename.
    pub label: String,
    /// up/down/unknown.
    pub state: &'static str,
    /// Seconds since the last handshake (`None`: never).
    pub handshake_age: Option<f64>,
    /// Bytes received.
    pub rx: i64,
    /// Bytes sent.
    pub tx: i64,
    /// How traffic reaches it: direct, relay or none.
    pub path: &'static str,
}

impl MeshMetrics {
    /// Creates and registers every metric.
    #[must_use]
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let m = Self {
            peers: Family::default(),
            peer_up: Family::default(),
            peer_path: Family::default(),
            peer_path_changes: Family::default(),
            fast_path: Family::default(),
            wireguard: Family::default(),
            wireguard_drops: Family::default(),
            fast_path_fallback: Gauge::default(),
            fast_path_packets: Family::default(),
            packet_source: std::sync::Mutex::new(None),
            marked_prefixes: Family::default(),
            config_accepted: Gauge::default(),
            config_documents: Gauge::default(),
            config_info: Family::default(),
            collector: std::sync::Mutex::new(None),
            handshake_age: Family::default(),
            rx: Family::default(),
            tx: Family::default(),
            reconcile: Family::new_with_constructor(duration_histogram),
            restarts: Family::default(),
            republishes: Family::default(),
            republishes_seen: std::sync::Mutex::default(),
            registry: Registry::default(),
        };
        registry.register(
            "wirespan_kubespan_peers",
            "Number of mesh peers by state",
            m.peers.clone(),
        );
        registry.register(
            "wirespan_kubespan_peer_up",
            "1 when the peer is up, 0 when down or unknown",
            m.peer_up.clone(),
        );
        registry.register(
            "wirespan_kubespan_peer_path",
            "How traffic reaches the peer: 1 for the path in use (direct, relay, server, none)",
            m.peer_path.clone(),
        );
        registry.register(
            "wirespan_kubespan_peer_path_changes",
            "Times the path to the peer changed (direct, relay, server, none)",
            m.peer_path_changes.clone(),
        );
        registry.register(
            "wirespan_kubespan_wireguard",
            "WireGuard implementation running the mesh link (1): kernel, userspace (wirespan wireguard) or userspace-go (wireguard-go)",
            m.wireguard.clone(),
        );
        registry.register(
            "wirespan_kubespan_wireguard_dropped",
            "Input the userspace WireGuard device (wirespan wireguard) dropped since its process started, by reason: invalid_datagram (malformed or unauthenticated), spoofed (source outside the peer's allowed IPs), unroutable (TUN packet with no peer, key or endpoint), replayed_initiation (an authentic initiation not newer than one taken, or too soon after it), rate_limited_handshake (over its source's rate under load)",
            m.wireguard_drops.clone(),
        );
        registry.register(
            "wirespan_kubespan_fast_path",
            "Marking fast path in use (1) by implementation",
            m.fast_path.clone(),
        );
        registry.register(
            "wirespan_kubespan_fast_path_fallback",
            "1 when the configured fast path could not be used and another one runs",
            m.fast_path_fallback.clone(),
        );
        registry.register(
            "wirespan_kubespan_fast_path_packets",
            "Packets the eBPF classifier saw, by result: hit (destination routed through \
             the mesh: marked), miss, skipped (carried the device mark), unparsed",
            m.fast_path_packets.clone(),
        );
        // At zero from the start: `increase()` needs the zero to see the first packets.
        for r in PACKET_RESULTS {
            let _ = m.fast_path_packets.get_or_create(&labels(&[("result", r)]));
        }
        registry.register(
            "wirespan_kubespan_marked_prefixes",
            "Prefixes in the marking set (traffic to them goes through the mesh), by family",
            m.marked_prefixes.clone(),
        );
        registry.register(
            "wirespan_config_last_attempt_accepted",
            "1 when the latest config offered was accepted, 0 when it was rejected",
            m.config_accepted.clone(),
        );
        registry.register(
            "wirespan_config_documents",
            "Documents in the config in force",
            m.config_documents.clone(),
        );
        registry.register(
            "wirespan_config_info",
            "The config in force: its version (SHA-256 prefix) and source; always 1",
            m.config_info.clone(),
        );
        registry.register(
            "wirespan_kubespan_peer_handshake_age_seconds",
            "Seconds since the peer's last WireGuard handshake",
            m.handshake_age.clone(),
        );
        registry.register(
            "wirespan_kubespan_peer_receive_bytes",
            "Bytes received from the peer",
            m.rx.clone(),
        );
        registry.register(
            "wirespan_kubespan_peer_transmit_bytes",
            "Bytes sent to the peer",
            m.tx.clone(),
        );
        registry.register(
            "wirespan_controller_reconcile_seconds",
            "Duration of one controller reconcile",
            m.reconcile.clone(),
        );
        registry.register(
            "wirespan_controller_restarts",
            "Controller restarts after an error or panic",
            m.restarts.clone(),
        );
        registry.register(
            "wirespan_discovery_own_republishes",
            "Re-publishes of this node's affiliate after someone else deleted or altered \
             it on the discovery server, by service",
            m.republishes.clone(),
        );
        Self { registry, ..m }
    }

    /// Mirrors each discovery service's re-publish count (`service`, count since its
    /// client started); the exported counter keeps rising across client restarts.
    pub fn set_discovery_republishes(&self, counts: &[(String, u64)]) {
        let mut seen = self
            .republishes_seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (service, now) in counts {
            let last = seen.insert(service.clone(), *now).unwrap_or(0);
            // Less than before: the client restarted from zero.
            let delta = now.checked_sub(last).unwrap_or(*now);
            self.republishes
                .get_or_create(&vec![("service", service.clone())])
                .inc_by(delta);
        }
    }

    /// Records one reconcile of `controller`.
    pub fn observe_reconcile(&self, controller: &str, took: Duration) {
        let l = labels(&[("controller", controller)]);
        self.reconcile.get_or_create(&l).observe(took.as_secs_f64());
        // The restart counter at zero from the first reconcile on: a family without
        // series is not rendered, and `increase()` needs the zero to see the first one.
        let _ = self.restarts.get_or_create(&l);
    }

    /// Counts a restart of `controller`.
    pub fn controller_restarted(&self, controller: &str) {
        self.restarts
            .get_or_create(&labels(&[("controller", controller)]))
            .inc();
    }

    /// Replaces the per-peer figures and the per-state counts.
    pub fn set_peers(&self, peers: &[PeerFigures]) {
        self.handshake_age.clear();
        self.rx.clear();
        self.tx.clear();
        self.peer_up.clear();
        self.peer_path.clear();
        let mut counts = [("up", 0i64), ("down", 0), ("unknown", 0)];
        for p in peers {
            let l = labels(&[("peer", &p.public_key), ("label", &p.label)]);
            if let Some(age) = p.handshake_age {
                self.handshake_age.get_or_create(&l).set(age);
            }
            self.peer_up
                .get_or_create(&l)
                .set(i64::from(p.state == "up"));
            self.rx.get_or_create(&l).set(p.rx);
            self.tx.get_or_create(&l).set(p.tx);
            let with_path = labels(&[
                ("peer", &p.public_key),
                ("label", &p.label),
                ("path", p.path),
            ]);
            self.peer_path.get_or_create(&with_path).set(1);
            if let Some(c) = counts.iter_mut().find(|(s, _)| *s == p.state) {
                c.1 += 1;
            }
        }
        for (state, n) in counts {
            self.peers
                .get_or_create(&labels(&[("state", state)]))
                .set(n);
        }
    }

    /// Counts a change of the path to a peer.
    pub fn path_changed(&self, public_key: &str, label: &str) {
        self.peer_path_changes
            .get_or_create(&labels(&[("peer", public_key), ("label", label)]))
            .inc();
    }

    /// Sets the marking figures: the fast path in use (`nftables`/`ebpf`), whether it
    /// is a fallback from the configured one, and the marked prefixes per family.
    pub fn set_marking(&self, in_use: &str, fallback: bool, v4: usize, v6: usize) {
        for fp in ["nftables", "ebpf"] {
            self.fast_path
                .get_or_create(&labels(&[("fast_path", fp)]))
                .set(i64::from(fp == in_use));
        }
        self.fast_path_fallback.set(i64::from(fallback));
        for (family, n) in [("ipv4", v4), ("ipv6", v6)] {
            self.marked_prefixes
                .get_or_create(&labels(&[("family", family)]))
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Sets the WireGuard implementation running the link (`kernel`, `userspace`,
    /// `userspace-go`): one series at 1, the others at 0.
    pub fn set_wireguard(&self, implementation: &str) {
        for w in ["kernel", "userspace", "userspace-go"] {
            self.wireguard
                .get_or_create(&labels(&[("implementation", w)]))
                .set(i64::from(w == implementation));
        }
    }

    /// Sets what the userspace device dropped (gauges: the device's own counters,
    /// which start again with its process); `None` (the kernel, wireguard-go, or the
    /// device could not be asked) removes the series.
    pub fn set_wireguard_drops(&self, drops: Option<DeviceDrops>) {
        let Some(d) = drops else {
            self.wireguard_drops.clear();
            return;
        };
        for (reason, n) in [
            ("invalid_datagram", d.invalid_datagrams),
            ("spoofed", d.spoofed_packets),
            ("unroutable", d.unroutable_packets),
            ("replayed_initiation", d.replayed_initiations),
            ("rate_limited_handshake", d.rate_limited_handshakes),
        ] {
            self.wireguard_drops
                .get_or_create(&labels(&[("reason", reason)]))
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Sets the config status figures.
    pub fn set_config(&self, accepted: bool, documents: usize, version: &str, source: &str) {
        self.config_accepted.set(i64::from(accepted));
        self.config_documents
            .set(i64::try_from(documents).unwrap_or(i64::MAX));
        // One series: the version in force.
        self.config_info.clear();
        self.config_info
            .get_or_create(&labels(&[("version", version), ("source", source)]))
            .set(1);
    }

    /// Mirrors the counters of a newly attached classifier from now on (replacing any
    /// earlier one; `None`: no classifier). The exported counters keep rising across
    /// classifiers: a new one's counts are added from its zero.
    pub fn set_fast_path_counters(&self, source: Option<PacketCounterSource>) {
        *self
            .packet_source
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            source.map(|read| PacketSource { read, last: [0; 4] });
    }

    /// Adds what the classifier counted since the last scrape.
    fn mirror_packets(&self) {
        let mut guard = self
            .packet_source
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(src) = guard.as_mut() else {
            return;
        };
        let Some(now) = (src.read)() else {
            // The classifier is gone (torn down, replaced by nftables).
            *guard = None;
            return;
        };
        for ((r, now), last) in PACKET_RESULTS
            .iter()
            .zip(by_result(&now))
            .zip(src.last.iter_mut())
        {
            // The map only grows while the classifier lives; less means it was reloaded.
            let delta = now.checked_sub(*last).unwrap_or(now);
            self.fast_path_packets
                .get_or_create(&labels(&[("result", r)]))
                .inc_by(delta);
            *last = now;
        }
    }

    /// Installs the function run before each render (replacing any earlier one).
    pub fn set_collector(&self, collector: Collector) {
        *self
            .collector
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(collector);
    }

    /// The text exposition.
    #[must_use]
    pub fn render(&self) -> String {
        if let Some(c) = self
            .collector
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
        {
            c(self);
        }
        self.mirror_packets();
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// Serves `GET /metrics` (the text exposition) on `listener` until `cancel`; any
/// other path is 404. One short HTTP/1.1 exchange per connection.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: std::sync::Arc<MeshMetrics>,
    cancel: tokio_util::sync::CancellationToken,
) {
    loop {
        let (mut conn, _) = tokio::select! {
            () = cancel.cancelled() => return,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics listener accept failed");
                    continue;
                }
            },
        };
        let metrics = std::sync::Arc::clone(&metrics);
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
            let mut buf = Vec::with_capacity(1024);
            let mut chunk = [0u8; 1024];
            let read = tokio::time::timeout(Duration::from_secs(5), async {
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 16 * 1024 {
                    match conn.read(&mut chunk).await {
                        Ok(0) | Err(_) => return false,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                true
            })
            .await;
            if !matches!(read, Ok(true)) {
                return;
            }
            let line = String::from_utf8_lossy(&buf);
            let path = line.split_whitespace().nth(1).unwrap_or("");
            let (status, body) = if line.starts_with("GET ")
                && (path == "/metrics" || path.starts_with("/metrics?"))
            {
                ("200 OK", metrics.render())
            } else {
                ("404 Not Found", "not found\n".to_owned())
            };
            let head = format!(
                "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4; charset=utf-8\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = conn.write_all(head.as_bytes()).await;
            let _ = conn.write_all(body.as_bytes()).await;
            let _ = conn.shutdown().await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_peers_by_state_and_restarts() {
        let m = MeshMetrics::new();
        m.set_peers(&[PeerFigures {
            public_key: "k".into(),
            label: "n1".into(),
            state: "up",
            handshake_age: Some(3.0),
            rx: 10,
            tx: 20,
            path: "relay",
        }]);
        m.path_changed("k", "n1");
        m.controller_restarted("KubeSpanManager");
        m.observe_reconcile("KubeSpanManager", Duration::from_millis(2));
        m.observe_reconcile("Other", Duration::from_millis(2));
        let text = m.render();
        assert!(
            text.contains("wirespan_controller_restarts_total{controller=\"Other\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("wirespan_kubespan_peers{state=\"up\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("wirespan_kubespan_peers{state=\"down\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("wirespan_controller_restarts_total{controller=\"KubeSpanManager\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("wirespan_kubespan_peer_transmit_bytes{peer=\"k\",label=\"n1\"} 20"),
            "{text}"
        );
        assert!(
            text.contains("wirespan_kubespan_peer_up{peer=\"k\",label=\"n1\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("wirespan_kubespan_peer_path{peer=\"k\",label=\"n1\",path=\"relay\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("wirespan_kubespan_peer_path_changes_total{peer=\"k\",label=\"n1\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn discovery_republishes_keep_rising_across_client_restarts() {
        let m = MeshMetrics::new();
        let line =
            |n: u64| format!("wirespan_discovery_own_republishes_total{{service=\"d\"}} {n}");
        m.set_discovery_republishes(&[("d".into(), 3)]);
        assert!(m.render().contains(&line(3)), "{}", m.render());
        m.set_discovery_republishes(&[("d".into(), 5)]);
        assert!(m.render().contains(&line(5)));
        // The client restarted: its count starts from zero again.
        m.set_discovery_republishes(&[("d".into(), 1)]);
        assert!(m.render().contains(&line(6)));
    }

    #[test]
    fn mirrors_the_classifier_counters_as_rising_counters() {
        let m = MeshMetrics::new();
        let line = |r: &str, n: u64| {
            format!("wirespan_kubespan_fast_path_packets_total{{result=\"{r}\"}} {n}")
        };
        let text = m.render();
        for r in PACKET_RESULTS {
            assert!(text.contains(&line(r, 0)), "{text}");
        }
        let now = std::sync::Arc::new(std::sync::Mutex::new(Some(Counters {
            hit: 5,
            miss: 2,
            skipped: 1,
            unparsed: 0,
        })));
        let src = std::sync::Arc::clone(&now);
        m.set_fast_path_counters(Some(Box::new(move || *src.lock().unwrap())));
        let text = m.render();
        for (r, n) in [("hit", 5), ("miss", 2), ("skipped", 1), ("unparsed", 0)] {
            assert!(text.contains(&line(r, n)), "{r} {n}: {text}");
        }
        now.lock().unwrap().as_mut().unwrap().hit = 9;
        assert!(m.render().contains(&line("hit", 9)));
        // A new classifier starts from zero: its counts are added, the export keeps rising.
        let fresh = std::sync::Arc::new(Counters {
            hit: 3,
            ..Counters::default()
        });
        m.set_fast_path_counters(Some(Box::new(move || Some(*fresh))));
        assert!(m.render().contains(&line("hit", 12)));
        // Gone: the counters stay where they were.
        m.set_fast_path_counters(Some(Box::new(|| None)));
        assert!(m.render().contains(&line("hit", 12)));
        assert!(m.render().contains(&line("miss", 2)));
    }

    #[test]
    fn the_userspace_devices_drops_are_gauges_gone_with_the_device() {
        let m = MeshMetrics::new();
        m.set_wireguard_drops(Some(DeviceDrops {
            invalid_datagrams: 4,
            spoofed_packets: 1,
            unroutable_packets: 0,
            replayed_initiations: 2,
            rate_limited_handshakes: 7,
        }));
        let text = m.render();
        for line in [
            "wirespan_kubespan_wireguard_dropped{reason=\"invalid_datagram\"} 4",
            "wirespan_kubespan_wireguard_dropped{reason=\"spoofed\"} 1",
            "wirespan_kubespan_wireguard_dropped{reason=\"unroutable\"} 0",
            "wirespan_kubespan_wireguard_dropped{reason=\"replayed_initiation\"} 2",
            "wirespan_kubespan_wireguard_dropped{reason=\"rate_limited_handshake\"} 7",
        ] {
            assert!(text.contains(line), "{line}: {text}");
        }
        m.set_wireguard_drops(None);
        assert!(!m.render().contains("wireguard_dropped{"));
    }

    #[test]
    fn renders_marking_and_the_config_from_the_collector() {
        let m = MeshMetrics::new();
        m.set_marking("nftables", true, 3, 2);
        m.set_wireguard("userspace-go");
        m.set_wireguard("userspace");
        let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let c = std::sync::Arc::clone(&calls);
        m.set_collector(Box::new(move |m| {
            let n = c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            m.set_config(n > 0, 4, &format!("v{n}"), "file");
        }));
        let first = m.render();
        assert!(
            first.contains("wirespan_config_last_attempt_accepted 0"),
            "{first}"
        );
        let text = m.render();
        for line in [
            "wirespan_kubespan_fast_path{fast_path=\"nftables\"} 1",
            "wirespan_kubespan_fast_path{fast_path=\"ebpf\"} 0",
            "wirespan_kubespan_fast_path_fallback 1",
            "wirespan_kubespan_wireguard{implementation=\"userspace\"} 1",
            "wirespan_kubespan_wireguard{implementation=\"userspace-go\"} 0",
            "wirespan_kubespan_wireguard{implementation=\"kernel\"} 0",
            "wirespan_kubespan_marked_prefixes{family=\"ipv4\"} 3",
            "wirespan_kubespan_marked_prefixes{family=\"ipv6\"} 2",
            "wirespan_config_last_attempt_accepted 1",
            "wirespan_config_documents 4",
            "wirespan_config_info{version=\"v1\",source=\"file\"} 1",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        assert!(
            !text.contains("version=\"v0\""),
            "one config series: {text}"
        );
    }

    #[test]
    fn a_peer_label_cannot_forge_a_series() {
        let m = MeshMetrics::new();
        m.set_peers(&[PeerFigures {
            public_key: "k\\".into(),
            label: "n\"} 1\nforged_series 1\n".into(),
            state: "up",
            handshake_age: None,
            rx: 1,
            tx: 2,
            path: "direct",
        }]);
        m.path_changed("k", "x\"}\nforged_series 1\n");
        let text = m.render();
        assert!(
            !text.lines().any(|l| l.starts_with("forged_series")),
            "{text}"
        );
        assert!(
            text.contains(
                "wirespan_kubespan_peer_up{peer=\"k\\\\\",label=\"n\\\"} 1\\nforged_series 1\\n\"} 1"
            ),
            "{text}"
        );
    }
}
