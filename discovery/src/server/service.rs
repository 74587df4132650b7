//! The tonic service: a thin shell that admits a call (rate limit), hands it to the
//! [`State`](super::state::State) under its lock, and records metrics.

use std::{
    net::{IpAddr, SocketAddr},
    pin::Pin,
    sync::Arc,
    time::{Duration, Instant},
};

use futures::Stream;
use ipnet::IpNet;
use tonic::{metadata::MetadataMap, Request, Response, Status};

use super::{
    error::RequestError,
    shared::{Limit, Shared},
    state::{self, Subscription},
    DeletePolicy,
};
use crate::proto::server as pb;

/// The client's address for Hello and the rate limiter. The transport peer, unless
/// it is inside one of `trusted_proxies`: then `x-real-ip` if it parses, else the
/// right-most `x-forwarded-for` entry that is not itself a trusted proxy (entries left
/// of it are whatever the client wrote). IPv4-mapped IPv6 addresses are reported as
/// IPv4. Without trusted proxies no header is ever read.
#[must_use]
pub fn client_address(
    metadata: &MetadataMap,
    peer: Option<SocketAddr>,
    trusted_proxies: &[IpNet],
) -> Option<IpAddr> {
    let peer = peer.map(|p| p.ip().to_canonical())?;
    let trusted = |ip: &IpAddr| trusted_proxies.iter().any(|net| net.contains(ip));
    if !trusted(&peer) {
        return Some(peer);
    }
    let real_ip = metadata
        .get("x-real-ip")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<IpAddr>().ok());
    if let Some(ip) = real_ip {
        return Some(ip.to_canonical());
    }
    Some(forwarded_for(metadata, peer, &trusted))
}

/// The right-most `x-forwarded-for` hop that is not a trusted proxy, walking from
/// `peer` (trusted) leftwards; an unparseable entry stops the walk at the last hop
/// known good.
fn forwarded_for(
    metadata: &MetadataMap,
    peer: IpAddr,
    trusted: &impl Fn(&IpAddr) -> bool,
) -> IpAddr {
    let headers: Vec<&str> = metadata
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    let mut hop = peer;
    for entry in headers.iter().rev().flat_map(|h| h.rsplit(',')) {
        let Ok(ip) = entry.trim().parse::<IpAddr>() else {
            break;
        };
        hop = ip.to_canonical();
        if !trusted(&hop) {
            break;
        }
    }
    hop
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
        client_address(
            req.metadata(),
            req.remote_addr(),
            &self.shared.config.trusted_proxies,
        )
    }

    /// Rate limit: waits for a token, or fails at once if the wait would outlast the
    /// call's deadline or the debt cap. Calls with no known address are not limited.
    async fn admit<T>(&self, req: &Request<T>, limit: Limit) -> Result<(), Status> {
        if !self.shared.config.rate_limit {
            return Ok(());
        }
        let Some(addr) = self.client_address(req) else {
            return Ok(());
        };
        self.shared
            .admit(limit, addr, grpc_timeout(req.metadata()))
            .await
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
        self.admit(&req, Limit::Calls).await?;
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
        self.admit(&req, Limit::Calls).await?;
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
            self.admit(&req, Limit::Calls).await?;
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
            if self.shared.config.affiliate_delete == DeletePolicy::Refuse {
                return Err(RequestError::DeleteRefused.into());
            }
            self.admit(&req, Limit::Deletes).await?;
            self.admit(&req, Limit::Calls).await?;
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
            self.admit(&req, Limit::Calls).await?;
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
                super::watch_frames::WatchFrames::new(Arc::clone(&self.shared), sub, false).map(
                    |item| {
                        item.and_then(|bytes| {
                            <pb::WatchResponse as prost::Message>::decode(bytes)
                                .map_err(|e| Status::internal(e.to_string()))
                        })
                    },
                ),
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

    fn nets(v: &[&str]) -> Vec<IpNet> {
        v.iter().map(|n| n.parse().unwrap()).collect()
    }

    #[test]
    fn headers_count_only_from_trusted_proxies() {
        let peer: SocketAddr = "127.0.0.1:5555".parse().unwrap();
        let local = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let ip = |s: &str| Some(s.parse::<IpAddr>().unwrap());
        let both = md(&[("x-real-ip", "1.2.3.4"), ("x-forwarded-for", "5.6.7.8")]);
        // No trusted proxy: headers are never read.
        assert_eq!(client_address(&both, Some(peer), &[]), Some(local));
        // A peer outside the trusted networks is the client, whatever it says.
        let other = nets(&["10.0.0.0/8"]);
        assert_eq!(client_address(&both, Some(peer), &other), Some(local));
        // From a trusted proxy: X-Real-IP first, then X-Forwarded-For.
        let lo = nets(&["127.0.0.0/8"]);
        assert_eq!(client_address(&md(&[]), Some(peer), &lo), Some(local));
        assert_eq!(client_address(&both, Some(peer), &lo), ip("1.2.3.4"));
        let xff = md(&[("x-forwarded-for", "5.6.7.8")]);
        assert_eq!(client_address(&xff, Some(peer), &lo), ip("5.6.7.8"));
        let mapped: SocketAddr = "[::ffff:10.1.2.3]:1".parse().unwrap();
        assert_eq!(client_address(&md(&[]), Some(mapped), &lo), ip("10.1.2.3"));
        assert_eq!(client_address(&both, None, &lo), None);
    }

    #[test]
    fn forwarded_for_takes_the_right_most_untrusted_hop() {
        let peer: SocketAddr = "127.0.0.1:5555".parse().unwrap();
        let ip = |s: &str| Some(s.parse::<IpAddr>().unwrap());
        let proxies = nets(&["127.0.0.0/8", "10.0.0.0/8"]);
        // The client wrote the left-most entry itself: the proxy's view is on the right.
        let chain = md(&[("x-forwarded-for", "6.6.6.6, 5.6.7.8, 10.0.0.2")]);
        assert_eq!(client_address(&chain, Some(peer), &proxies), ip("5.6.7.8"));
        // Several headers read as one list, in order.
        let split = md(&[
            ("x-forwarded-for", "6.6.6.6"),
            ("x-forwarded-for", "5.6.7.8,10.0.0.2"),
        ]);
        assert_eq!(client_address(&split, Some(peer), &proxies), ip("5.6.7.8"));
        // Junk stops the walk at the last hop known good.
        let junk = md(&[("x-forwarded-for", "6.6.6.6, nope, 10.0.0.2")]);
        assert_eq!(client_address(&junk, Some(peer), &proxies), ip("10.0.0.2"));
        let bad_real_ip = md(&[("x-real-ip", "nope")]);
        assert_eq!(
            client_address(&bad_real_ip, Some(peer), &proxies),
            ip("127.0.0.1")
        );
        // Only proxies in the chain: the left-most.
        let all = md(&[("x-forwarded-for", "10.0.0.9, 10.0.0.2")]);
        assert_eq!(client_address(&all, Some(peer), &proxies), ip("10.0.0.9"));
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
