//! Shared helpers of the server integration tests: a server on 127.0.0.1:0 and a real
//! tonic client connected to it over loopback.

#![allow(dead_code)]

use std::time::Duration;

use tonic::transport::{Channel, Endpoint};
use wirespan_discovery::{
    proto::server::{cluster_client::ClusterClient, *},
    server::{self, RunningServer, ServerConfig},
};

pub async fn start(config: ServerConfig) -> RunningServer {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    server::spawn(config, listener).await.unwrap()
}

pub async fn start_with_metrics(config: ServerConfig) -> RunningServer {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    server::spawn_with_metrics(config, listener, Some(metrics))
        .await
        .unwrap()
}

pub async fn client(server: &RunningServer) -> ClusterClient<Channel> {
    let channel = Endpoint::from_shared(format!("http://{}", server.local_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    ClusterClient::new(channel)
}

/// Opens a Watch on `cluster`.
pub async fn open_watch(
    client: &mut ClusterClient<Channel>,
    cluster: &str,
) -> tonic::Streaming<WatchResponse> {
    client
        .watch(WatchRequest {
            cluster_id: cluster.into(),
        })
        .await
        .unwrap()
        .into_inner()
}

pub fn ttl(secs: i64) -> Option<prost_types::Duration> {
    Some(prost_types::Duration {
        seconds: secs,
        nanos: 0,
    })
}

pub fn update(
    cluster: &str,
    affiliate: &str,
    data: &[u8],
    endpoints: &[&[u8]],
    ttl_secs: i64,
) -> AffiliateUpdateRequest {
    AffiliateUpdateRequest {
        cluster_id: cluster.into(),
        affiliate_id: affiliate.into(),
        affiliate_data: Some(data.to_vec()),
        affiliate_endpoints: endpoints.iter().map(|e| e.to_vec()).collect(),
        ttl: ttl(ttl_secs),
    }
}

pub fn affiliate(id: &str, data: &[u8], endpoints: &[&[u8]]) -> Affiliate {
    Affiliate {
        id: id.into(),
        data: data.to_vec(),
        endpoints: endpoints.iter().map(|e| e.to_vec()).collect(),
    }
}

pub fn sorted(mut v: Vec<Affiliate>) -> Vec<Affiliate> {
    v.sort_by(|a, b| a.id.cmp(&b.id));
    v
}

/// Next Watch message, failing the test after 5 s.
pub async fn next(stream: &mut tonic::Streaming<WatchResponse>) -> WatchResponse {
    tokio::time::timeout(Duration::from_secs(5), stream.message())
        .await
        .expect("watch message timed out")
        .expect("watch stream failed")
        .expect("watch stream ended")
}

pub async fn list(client: &mut ClusterClient<Channel>, cluster: &str) -> Vec<Affiliate> {
    sorted(
        client
            .list(ListRequest {
                cluster_id: cluster.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .affiliates,
    )
}

/// The value of the series named exactly `series` (name and labels) in the server's
/// metrics text; 0 when it is not rendered.
pub fn metric(server: &RunningServer, series: &str) -> f64 {
    server
        .metrics_text()
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}
