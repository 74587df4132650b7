//! Prometheus metrics of the mesh (prometheus-client): peers by state, per-peer
//! handshake age and traffic, reconcile durations, controller restarts.

use std::{sync::atomic::AtomicU64, time::Duration};

use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

type Labels = Vec<(&'static str, String)>;

fn duration_histogram() -> Histogram {
    // 20 µs … ~5 s.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.000_02, 2.0, 18,
    ))
}

/// The mesh metrics; cheap to share (`Arc`).
pub struct MeshMetrics {
    registry: Registry,
    peers: Family<Labels, Gauge>,
    handshake_age: Family<Labels, Gauge<f64, AtomicU64>>,
    rx: Family<Labels, Gauge>,
    tx: Family<Labels, Gauge>,
    reconcile: Family<Labels, Histogram, fn() -> Histogram>,
    restarts: Family<Labels, Counter>,
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
}

impl MeshMetrics {
    /// Creates and registers every metric.
    #[must_use]
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let m = Self {
            peers: Family::default(),
            handshake_age: Family::default(),
            rx: Family::default(),
            tx: Family::default(),
            reconcile: Family::new_with_constructor(duration_histogram),
            restarts: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "wirespan_kubespan_peers",
            "Number of mesh peers by state",
            m.peers.clone(),
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
        Self { registry, ..m }
    }

    /// Records one reconcile of `controller`.
    pub fn observe_reconcile(&self, controller: &str, took: Duration) {
        self.reconcile
            .get_or_create(&vec![("controller", controller.to_owned())])
            .observe(took.as_secs_f64());
    }

    /// Counts a restart of `controller`.
    pub fn controller_restarted(&self, controller: &str) {
        self.restarts
            .get_or_create(&vec![("controller", controller.to_owned())])
            .inc();
    }

    /// Replaces the per-peer figures and the per-state counts.
    pub fn set_peers(&self, peers: &[PeerFigures]) {
        self.handshake_age.clear();
        self.rx.clear();
        self.tx.clear();
        let mut counts = [("up", 0i64), ("down", 0), ("unknown", 0)];
        for p in peers {
            let l: Labels = vec![("peer", p.public_key.clone()), ("label", p.label.clone())];
            if let Some(age) = p.handshake_age {
                self.handshake_age.get_or_create(&l).set(age);
            }
            self.rx.get_or_create(&l).set(p.rx);
            self.tx.get_or_create(&l).set(p.tx);
            if let Some(c) = counts.iter_mut().find(|(s, _)| *s == p.state) {
                c.1 += 1;
            }
        }
        for (state, n) in counts {
            self.peers
                .get_or_create(&vec![("state", state.to_owned())])
                .set(n);
        }
    }

    /// The text exposition.
    #[must_use]
    pub fn render(&self) -> String {
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
        }]);
        m.controller_restarted("KubeSpanManager");
        m.observe_reconcile("KubeSpanManager", Duration::from_millis(2));
        let text = m.render();
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
    }
}
