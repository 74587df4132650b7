//! `grpc.health.v1.Health` through a real tonic client: SERVING while up, NOT_FOUND
//! for an unknown service, and a Watch that reports NOT_SERVING when shutdown begins.

mod server_common;

use server_common::*;
use tonic::{transport::Endpoint, Code};
use wirespan_discovery::{
    proto::health::{
        health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest,
    },
    server::ServerConfig,
};

fn req(service: &str) -> HealthCheckRequest {
    HealthCheckRequest {
        service: service.into(),
    }
}

#[tokio::test]
async fn check_and_watch_follow_the_server_lifecycle() {
    // Rate limit on: probes are not subject to it.
    let server = start(ServerConfig::default()).await;
    let channel = Endpoint::from_shared(format!("http://{}", server.local_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut h = HealthClient::new(channel);
    for service in ["", "sidero.discovery.server.Cluster"] {
        for _ in 0..80 {
            let st = h.check(req(service)).await.unwrap().into_inner().status();
            assert_eq!(st, ServingStatus::Serving, "{service:?}");
        }
    }
    let err = h.check(req("nope")).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let mut unknown = h.watch(req("nope")).await.unwrap().into_inner();
    assert_eq!(
        unknown.message().await.unwrap().unwrap().status(),
        ServingStatus::ServiceUnknown
    );

    let mut watch = h.watch(req("")).await.unwrap().into_inner();
    assert_eq!(
        watch.message().await.unwrap().unwrap().status(),
        ServingStatus::Serving
    );
    let stop = tokio::spawn(server.shutdown());
    let next = tokio::time::timeout(std::time::Duration::from_secs(5), watch.message())
        .await
        .expect("NOT_SERVING within 5 s")
        .unwrap()
        .unwrap();
    assert_eq!(next.status(), ServingStatus::NotServing);
    stop.await.unwrap().unwrap();
}
