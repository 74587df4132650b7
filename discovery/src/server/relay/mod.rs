//! The server relay (`docs/discovery-protocol.md` §7.14): a blind UDP relay for WireGuard
//! packets between the two nodes of a pair that reach each other by no other path.
//! It never holds a key: it forwards datagrams between two UDP sockets per pair, each
//! accepting only its node's observed address.
//!
//! - [`table`]: allocations, limits and forwarding decisions, without I/O.
//! - [`Relay`]: the sockets and their forwarding tasks; `RelayService`: the
//!   `wirespan.relay.v1.Relay` gRPC service the nodes allocate through.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

use tokio::net::UdpSocket;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

pub mod table;

use super::{client_address, metrics::RelayMetrics, shared::Shared};
use crate::proto::relay as pb;
use table::{AllocationId, Dropped, Grant, PairRequest, RelayLimits, Table};

/// Largest datagram forwarded (a jumbo-frame WireGuard packet fits).
const DATAGRAM_MAX: usize = 9216;

/// How often idle allocations are looked for.
const EXPIRE_EVERY: Duration = Duration::from_secs(10);

/// Why an allocation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RelayError {
    /// A request field is invalid.
    #[error("{0} {1}")]
    InvalidField(&'static str, String),
    /// A limit is reached.
    #[error("{0}")]
    Exhausted(String),
    /// The server could not make the pair's sockets.
    #[error("binding a relay socket: {0}")]
    Bind(String),
    /// The caller's address is unknown (it is what the allocation binds to).
    #[error("the client's address is unknown")]
    NoAddress,
    /// The cluster, or one of the pair's affiliates, is not on the server: the relay
    /// serves only pairs of live affiliates.
    #[error("{0}")]
    Absent(&'static str),
}

impl From<RelayError> for Status {
    fn from(e: RelayError) -> Self {
        let code = match e {
            RelayError::InvalidField(..) => tonic::Code::InvalidArgument,
            RelayError::Exhausted(_) => tonic::Code::ResourceExhausted,
            RelayError::Bind(_) => tonic::Code::Unavailable,
            RelayError::NoAddress | RelayError::Absent(_) => tonic::Code::FailedPrecondition,
        };
        Status::new(code, e.to_string())
    }
}

/// Options of the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayConfig {
    /// Address the pair sockets bind to.
    pub bind: IpAddr,
    /// Address nodes are told to send to; `None`: the address they reached the server at.
    pub address: Option<IpAddr>,
    /// Limits.
    pub limits: RelayLimits,
}

struct RelayInner {
    config: RelayConfig,
    table: Mutex<Table>,
    tasks: Mutex<HashMap<AllocationId, CancellationToken>>,
    metrics: RelayMetrics,
    stop: CancellationToken,
}

impl RelayInner {
    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn tasks(&self) -> MutexGuard<'_, HashMap<AllocationId, CancellationToken>> {
        self.tasks.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A running relay: its allocations and their forwarding tasks.
#[derive(Clone)]
pub struct Relay {
    inner: Arc<RelayInner>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Relay {
    /// A relay with no allocations; its expiry task runs until `stop`. Must be called
    /// on a tokio runtime.
    #[must_use]
    pub fn start(config: RelayConfig, metrics: RelayMetrics, stop: CancellationToken) -> Self {
        let relay = Self {
            inner: Arc::new(RelayInner {
                config,
                table: Mutex::new(Table::new(config.limits)),
                tasks: Mutex::new(HashMap::new()),
                metrics,
                stop,
            }),
        };
        tokio::spawn(expire_loop(Arc::clone(&relay.inner)));
        relay
    }

    /// Number of allocations.
    #[must_use]
    pub fn allocations(&self) -> usize {
        self.inner.table().len()
    }

    /// Creates or refreshes a pair's allocation for a caller observed at `observed`.
    ///
    /// # Errors
    /// Over a limit, or the sockets could not be bound.
    pub fn allocate(&self, req: &PairRequest, observed: IpAddr) -> Result<Grant, RelayError> {
        let inner = &self.inner;
        let mut sockets = None;
        let grant = inner.table().allocate(req, observed, Instant::now(), || {
            let bind = || {
                let s = std::net::UdpSocket::bind(SocketAddr::new(inner.config.bind, 0))
                    .map_err(|e| RelayError::Bind(e.to_string()))?;
                s.set_nonblocking(true)
                    .map_err(|e| RelayError::Bind(e.to_string()))?;
                let port = s
                    .local_addr()
                    .map_err(|e| RelayError::Bind(e.to_string()))?
                    .port();
                Ok::<_, RelayError>((s, port))
            };
            let (a, pa) = bind()?;
            let (b, pb) = bind()?;
            sockets = Some([a, b]);
            Ok([pa, pb])
        });
        let grant = match grant {
            Ok(g) => g,
            Err(e) => {
                inner.metrics.allocate("refused");
                return Err(e);
            }
        };
        if let (true, Some([a, b])) = (grant.created, sockets) {
            let to_tokio = |s| {
                UdpSocket::from_std(s).map_err(|e: std::io::Error| RelayError::Bind(e.to_string()))
            };
            let socks = [Arc::new(to_tokio(a)?), Arc::new(to_tokio(b)?)];
            let stop = inner.stop.child_token();
            inner.tasks().insert(grant.id, stop.clone());
            tokio::spawn(forward(Arc::clone(inner), grant.id, socks, stop));
            inner.metrics.allocations.set(gauge(inner.table().len()));
            inner.metrics.allocate("created");
            tracing::info!(
                allocation = grant.id,
                cluster = %crate::redact::cluster_tag(&req.cluster_id),
                observed = %observed,
                port = grant.port,
                "relay allocation created"
            );
        } else {
            inner.metrics.allocate("refreshed");
        }
        Ok(grant)
    }
}

fn gauge(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Forwards one allocation's datagrams until it expires or the server stops.
async fn forward(
    inner: Arc<RelayInner>,
    id: AllocationId,
    socks: [Arc<UdpSocket>; 2],
    stop: CancellationToken,
) {
    let mut bufs = [vec![0u8; DATAGRAM_MAX], vec![0u8; DATAGRAM_MAX]];
    // A socket bound to `::` serves IPv4 too, addressed as IPv4-mapped IPv6.
    let v6 = socks[0].local_addr().is_ok_and(|a| a.is_ipv6());
    loop {
        let [b0, b1] = &mut bufs;
        let (side, received) = tokio::select! {
            () = stop.cancelled() => return,
            r = socks[0].recv_from(b0) => (0, r),
            r = socks[1].recv_from(b1) => (1, r),
        };
        let (len, src) = match received {
            Ok(r) => r,
            Err(e) => {
                // ICMP errors surface here (a peer's port closed); the socket stays usable.
                tracing::debug!(allocation = id, side, error = %e, "relay receive failed");
                continue;
            }
        };
        let verdict = inner.table().datagram(id, side, src, len, Instant::now());
        match verdict {
            Ok(to) => match socks[1 - side]
                .send_to(&bufs[side][..len], on_socket(to, v6))
                .await
            {
                Ok(_) => {
                    inner.metrics.datagram("forwarded");
                    inner.metrics.bytes.inc_by(len as u64);
                }
                Err(e) => {
                    inner.metrics.datagram("send_error");
                    tracing::debug!(allocation = id, error = %e, "relay send failed");
                }
            },
            Err(why) => inner.metrics.datagram(why.as_str()),
        }
        if matches!(verdict, Err(Dropped::Unknown)) {
            return;
        }
    }
}

/// `to` as a socket of the given family addresses it.
fn on_socket(to: SocketAddr, v6: bool) -> SocketAddr {
    match to {
        SocketAddr::V4(a) if v6 => SocketAddr::new(IpAddr::V6(a.ip().to_ipv6_mapped()), a.port()),
        _ => to,
    }
}

async fn expire_loop(inner: Arc<RelayInner>) {
    let mut tick = tokio::time::interval(EXPIRE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = inner.stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let gone = inner.table().expire(Instant::now());
        if gone.is_empty() {
            continue;
        }
        let mut tasks = inner.tasks();
        for id in &gone {
            if let Some(t) = tasks.remove(id) {
                t.cancel();
            }
        }
        drop(tasks);
        inner.metrics.allocations.set(gauge(inner.table().len()));
        tracing::info!(allocations = gone.len(), "idle relay allocations ended");
    }
}

/// The `wirespan.relay.v1.Relay` service.
#[derive(Clone)]
pub struct RelayService {
    pub(crate) relay: Relay,
    pub(crate) shared: Arc<Shared>,
}

impl RelayService {
    async fn allocate_inner(
        &self,
        req: Request<pb::AllocateRequest>,
    ) -> Result<Response<pb::AllocateResponse>, Status> {
        // The transport peer, never a header: the sides are bound to this address.
        let observed =
            client_address(req.metadata(), req.remote_addr(), &[]).ok_or(RelayError::NoAddress)?;
        if self.shared.config.rate_limit {
            let deadline = super::grpc_timeout(req.metadata());
            self.shared
                .admit(super::shared::Limit::Calls, observed, deadline)
                .await?;
        }
        let r = req.into_inner();
        let pair = PairRequest::new(
            r.cluster_id,
            r.affiliate_id,
            r.peer_affiliate_id,
            &r.pair_token,
        )?;
        self.check_present(&pair)?;
        let grant = self.relay.allocate(&pair, observed)?;
        let config = &self.relay.inner.config;
        Ok(Response::new(pb::AllocateResponse {
            port: u32::from(grant.port),
            address: config.address.map(|a| a.to_string()).unwrap_or_default(),
            ttl_seconds: u32::try_from(config.limits.idle.as_secs()).unwrap_or(u32::MAX),
            observed_address: observed.to_string(),
        }))
    }
}

impl RelayService {
    /// Refuses a pair unless both nodes are live affiliates of a cluster the server
    /// holds: the relay is no proxy for strangers.
    fn check_present(&self, pair: &PairRequest) -> Result<(), RelayError> {
        let absent = self.shared.state().relay_pair_absent(
            &pair.cluster_id,
            &pair.affiliate_id,
            &pair.peer_affiliate_id,
            Instant::now(),
        );
        let Some(field) = absent else {
            return Ok(());
        };
        self.relay.inner.metrics.allocate("absent");
        Err(RelayError::Absent(match field {
            "cluster_id" => "cluster_id names no cluster on this server",
            "affiliate_id" => "affiliate_id is not a live affiliate of the cluster",
            _ => "peer_affiliate_id is not a live affiliate of the cluster",
        }))
    }
}

#[tonic::async_trait]
impl pb::relay_server::Relay for RelayService {
    async fn allocate(
        &self,
        req: Request<pb::AllocateRequest>,
    ) -> Result<Response<pb::AllocateResponse>, Status> {
        let start = Instant::now();
        let result = self.allocate_inner(req).await;
        let code = result
            .as_ref()
            .map_or_else(Status::code, |_| tonic::Code::Ok);
        self.shared.metrics.rpc("Allocate", code, start.elapsed());
        result
    }
}
