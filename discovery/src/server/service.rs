//! The tonic service: a thin shell that admits a call (rate limit), hands it to the
//! [`State`] under its lock, and records metrics.

use std::{
    net::{IpAddr, SocketAddr},
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use futures::Stream;
use tokio_util::sync::CancellationToken;
use tonic::{metadata::MetadataMap, Request, Response, Status};

use super::{
    metrics::Metrics,
    ratelimit::RateLimiter,
    state::{self, State, Subscription},
    ServerConfig,
};
use crate::proto::server as pb;

/// Everything the service, the background tasks and the web pages share.
pub struct Shared {
    pub(crate) config: ServerConfig,
    pub(crate) state: Mutex<State>,
    pub(crate) limiter: Mutex<RateLimiter>,
    pub(crate) metrics: Metrics,
    pub(crate) shutdown: CancellationToken,
    /// Set (before the token is cancelled) once the server stops: what a Watch
    /// stream checks each time it waits, where the token's own check takes a lock
    /// shared by every stream.
    stopping: std::sync::atomic::AtomicBool,
    /// Serialises snapshot saves: a periodic save still running when shutdown saves
    /// must not share the temp file with it.
    pub(crate) save_lock: Mutex<()>,
}

impl Shared {
    pub fn new(config: ServerConfig, state: State, shutdown: CancellationToken) -> Self {
        Self {
            config,
            state: Mutex::new(state),
            limiter: Mutex::new(RateLimiter::default()),
            metrics: Metrics::new(),
            shutdown,
            stopping: std::sync::atomic::AtomicBool::new(false),
            save_lock: Mutex::new(()),
        }
    }

    /// Starts stopping: the flag, then the token (a stream that sees neither yet is
    /// woken by the close of its queue that follows).
    pub(crate) fn stop(&self) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.shutdown.cancel();
    }

    /// Whether [`Self::stop`] was called.
    pub(crate) fn is_stopping(&self) -> bool {
        self.stopping.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The state lock. A panic while holding it cannot leave the maps half-updated in
    /// a way later calls trip over (every operation validates first), so poisoning is
    /// ignored rather than turned into a crash of every later call.
    pub fn state(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn limiter(&self) -> MutexGuard<'_, RateLimiter> {
        self.limiter
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The client's address for Hello and the rate limiter: `x-real-ip`, then the first
/// `x-forwarded-for` entry (each only if trusted and parseable), then the transport
/// peer. IPv4-mapped IPv6 addresses are reported as IPv4.
#[must_use]
pub fn client_address(
    metadata: &MetadataMap,
    peer: Option<SocketAddr>,
    trust_x_real_ip: bool,
    trust_x_forwarded_for: bool,
) -> Option<IpAddr> {
    let header = |name: &str| metadata.get(name).and_then(|v| v.to_str().ok());
    if trust_x_real_ip {
        if let Some(ip) = header("x-real-ip").and_then(|v| v.trim().parse::<IpAddr>().ok()) {
            return Some(ip.to_canonical());
        }
    }
    if trust_x_forwarded_for {
        if let Some(ip) = header("x-forwarded-for")
            .and_then(|v| v.split(',').next())
            .and_then(|v| v.trim().parse::<IpAddr>().ok())
        {
            return Some(ip.to_canonical());
        }
    }
    peer.map(|p| p.ip().to_canonical())
}

/// Time left for the call from its `grpc-timeout` header, if any.
#[must_use]
pub fn grpc_timeout(metadata: &MetadataMap) -> Option<Duration> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

/// The `sidero.discovery.server.Cluster` implementation.
#[derive(Clone)]
pub struct ClusterService {
    pub shared: Arc<Shared>,
}

impl ClusterService {
    fn client_address<T>(&self, req: &Request<T>) -> Option<IpAddr> {
        let c = &self.shared.config;
        client_address(
            req.metadata(),
            req.remote_addr(),
            c.trust_x_real_ip,
            c.trust_x_forwarded_for,
        )
    }

    /// Rate limit: waits for a token, or fails at once if the wait would outlast the
    /// call's deadline. Calls with no known address are not limited.
    async fn admit<T>(&self, req: &Request<T>) -> Result<(), Status> {
        if !self.shared.config.rate_limit {
            return Ok(());
        }
        let Some(addr) = self.client_address(req) else {
            return Ok(());
        };
        let deadline = grpc_timeout(req.metadata());
        let wait = self
            .shared
            .limiter()
            .acquire(addr, Instant::now(), deadline)?;
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        Ok(())
    }

    pub(crate) fn record<T>(
        &self,
        method: &'static str,
        start: Instant,
        result: &Result<T, Status>,
    ) {
        let code = result
            .as_ref()
            .map_or_else(Status::code, |_| tonic::Code::Ok);
        self.shared.metrics.rpc(method, code, start.elapsed());
    }

    async fn hello_inner(
        &self,
        req: Request<pb::HelloRequest>,
    ) -> Result<Response<pb::HelloResponse>, Status> {
        self.admit(&req).await?;
        let client_ip = self.client_address(&req);
        let req = req.into_inner();
        self.shared.metrics.hello(&req.client_version);
        state::validate_cluster_id(&req.cluster_id)?;
        let config = &self.shared.config;
        Ok(Response::new(pb::HelloResponse {
            redirect: config
                .redirect_endpoint
                .as_ref()
                .map(|endpoint| pb::RedirectMessage {
                    endpoint: endpoint.clone(),
                }),
            client_ip: client_ip
                .filter(|_| config.report_client_ip)
                .map(ip_bytes)
                .unwrap_or_default(),
        }))
    }

    pub(crate) async fn watch_inner(
        &self,
        req: Request<pb::WatchRequest>,
    ) -> Result<Subscription, Status> {
        self.admit(&req).await?;
        let req = req.into_inner();
        let sub = self.shared.state().watch(
            Instant::now(),
            &req.cluster_id,
            self.shared.config.watch_queue,
        )?;
        Ok(sub)
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::WatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::cluster_server::Cluster for ClusterService {
    async fn hello(
        &self,
        req: Request<pb::HelloRequest>,
    ) -> Result<Response<pb::HelloResponse>, Status> {
        let start = Instant::now();
        let result = self.hello_inner(req).await;
        self.record("Hello", start, &result);
        result
    }

    async fn affiliate_update(
        &self,
        req: Request<pb::AffiliateUpdateRequest>,
    ) -> Result<Response<pb::AffiliateUpdateResponse>, Status> {
        let start = Instant::now();
        let result = async {
            self.admit(&req).await?;
            self.shared.state().update(Instant::now(), req.get_ref())?;
            Ok(Response::new(pb::AffiliateUpdateResponse {}))
        }
        .await;
        self.record("AffiliateUpdate", start, &result);
        result
    }

    async fn affiliate_delete(
        &self,
        req: Request<pb::AffiliateDeleteRequest>,
    ) -> Result<Response<pb::AffiliateDeleteResponse>, Status> {
        let start = Instant::now();
        let result = async {
            self.admit(&req).await?;
            let r = req.get_ref();
            self.shared
                .state()
                .delete(Instant::now(), &r.cluster_id, &r.affiliate_id)?;
            Ok(Response::new(pb::AffiliateDeleteResponse {}))
        }
        .await;
        self.record("AffiliateDelete", start, &result);
        result
    }

    async fn list(
        &self,
        req: Request<pb::ListRequest>,
    ) -> Result<Response<pb::ListResponse>, Status> {
        let start = Instant::now();
        let result = async {
            self.admit(&req).await?;
            let affiliates = self.shared.state().list(&req.get_ref().cluster_id)?;
            Ok(Response::new(pb::ListResponse { affiliates }))
        }
        .await;
        self.record("List", start, &result);
        result
    }

    type WatchStream = WatchStream;

    /// Not reached by clients: the server routes Watch to `watch::Routes`, which sends
    /// the pre-encoded events as they are. Kept (decoding them again) so the service
    /// is complete on its own.
    async fn watch(
        &self,
        req: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        use futures::StreamExt as _;
        let start = Instant::now();
        let result = self.watch_inner(req).await;
        self.record("Watch", start, &result);
        let stream: WatchStream = match result {
            Ok(sub) => Box::pin(
                super::watch::WatchFrames::new(Arc::clone(&self.shared), sub, false).map(|item| {
                    item.and_then(|bytes| {
                        <pb::WatchResponse as prost::Message>::decode(bytes)
                            .map_err(|e| Status::internal(e.to_string()))
                    })
                }),
            ),
            Err(status) => Box::pin(futures::stream::once(async move { Err(status) })),
        };
        Ok(Response::new(stream))
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn md(pairs: &[(&'static str, &str)]) -> MetadataMap {
        let mut m = MetadataMap::new();
        for (k, v) in pairs {
            m.append(*k, v.parse().unwrap());
        }
        m
    }

    #[test]
    fn client_address_precedence() {
        let peer: SocketAddr = "127.0.0.1:5555".parse().unwrap();
        let local = IpAddr::V4(Ipv4Addr::LOCALHOST);
        assert_eq!(
            client_address(&md(&[]), Some(peer), true, true),
            Some(local)
        );
        let both = md(&[("x-real-ip", "1.2.3.4"), ("x-forwarded-for", "5.6.7.8")]);
        assert_eq!(
            client_address(&both, Some(peer), true, true),
            Some("1.2.3.4".parse().unwrap())
        );
        assert_eq!(
            client_address(&both, Some(peer), false, true),
            Some("5.6.7.8".parse().unwrap())
        );
        assert_eq!(client_address(&both, Some(peer), false, false), Some(local));
        let xff = md(&[("x-forwarded-for", " 5.6.7.8 ,192.168.0.0.1")]);
        assert_eq!(
            client_address(&xff, Some(peer), true, true),
            Some("5.6.7.8".parse().unwrap())
        );
        // Unparseable headers fall through to the peer.
        let junk = md(&[("x-real-ip", "nope"), ("x-forwarded-for", "also nope")]);
        assert_eq!(client_address(&junk, Some(peer), true, true), Some(local));
        let mapped: SocketAddr = "[::ffff:10.1.2.3]:1".parse().unwrap();
        assert_eq!(
            client_address(&md(&[]), Some(mapped), true, true),
            Some("10.1.2.3".parse().unwrap())
        );
        assert_eq!(client_address(&md(&[]), None, true, true), None);
    }

    #[test]
    fn grpc_timeout_units() {
        let t = |v: &str| grpc_timeout(&md(&[("grpc-timeout", v)]));
        assert_eq!(t("1S"), Some(Duration::from_secs(1)));
        assert_eq!(t("250m"), Some(Duration::from_millis(250)));
        assert_eq!(t("2M"), Some(Duration::from_secs(120)));
        assert_eq!(t("7u"), Some(Duration::from_micros(7)));
        assert_eq!(t("S"), None);
        assert_eq!(t("1x"), None);
        assert_eq!(grpc_timeout(&md(&[])), None);
    }
}
