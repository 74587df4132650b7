//! Per-client-address rate limit (15/s, burst 60) through a real gRPC client: calls
//! beyond the burst wait, and fail with RESOURCE_EXHAUSTED when the wait would
//! outlast their deadline. Headers key the limiter only from a trusted proxy.

mod server_common;

use std::time::Duration;

use server_common::*;
use tonic::{Code, Request};
use wirespan_discovery::{proto::server::*, server::ServerConfig};

fn hello(header: &'static str, ip: &str, timeout: Option<Duration>) -> Request<HelloRequest> {
    let mut req = Request::new(HelloRequest {
        cluster_id: "c".into(),
        client_version: "v1.8.3".into(),
    });
    req.metadata_mut().insert(header, ip.parse().unwrap());
    if let Some(t) = timeout {
        req.set_timeout(t);
    }
    req
}

async fn exhaust(
    c: &mut cluster_client::ClusterClient<tonic::transport::Channel>,
    header: &'static str,
    ip: &str,
) {
    // 60 calls pass from the burst (a few more may pass as tokens refill meanwhile);
    // with a 40 ms deadline a call then fails at once instead of waiting ~67 ms.
    let mut passed = 0;
    loop {
        match c
            .hello(hello(header, ip, Some(Duration::from_millis(40))))
            .await
        {
            Ok(_) => passed += 1,
            // The client's own deadline on a loaded machine, not the limiter.
            Err(status) if status.code() == Code::Cancelled => {}
            Err(status) => {
                assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
                assert_eq!(status.message(), "rate limit exceeds request timeout");
                break;
            }
        }
        assert!(passed <= 80, "the limit never kicked in");
    }
    assert!(passed >= 60, "only {passed} calls passed");
}

fn behind_loopback_proxy() -> ServerConfig {
    ServerConfig {
        trusted_proxies: vec!["127.0.0.0/8".parse().unwrap()],
        ..ServerConfig::default()
    }
}

#[tokio::test]
async fn sixty_first_call_fails_within_deadline() {
    let server = start(behind_loopback_proxy()).await;
    let mut c = client(&server).await;
    exhaust(&mut c, "x-forwarded-for", "10.9.9.9, 10.2.2.2").await;
    exhaust(&mut c, "x-real-ip", "10.1.1.1").await;

    // Without a deadline a limited caller waits for its tokens instead of failing:
    // the same exhausted address gets three answers. (How long it waits is the
    // limiter's unit tests' business, on a clock they control.)
    for _ in 0..3 {
        c.hello(hello("x-real-ip", "10.1.1.1", None)).await.unwrap();
    }
    // The limit also covers the other RPCs.
    let mut list = Request::new(ListRequest {
        cluster_id: "c".into(),
    });
    list.metadata_mut()
        .insert("x-real-ip", "10.1.1.1".parse().unwrap());
    list.set_timeout(Duration::from_millis(40));
    assert_eq!(
        c.list(list).await.unwrap_err().code(),
        Code::ResourceExhausted
    );
    // Other identities are unaffected.
    c.hello(hello("x-real-ip", "10.3.3.3", Some(Duration::from_secs(2))))
        .await
        .unwrap();
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn disabled_rate_limit_lets_bursts_through() {
    let server = start(ServerConfig {
        rate_limit: false,
        ..ServerConfig::default()
    })
    .await;
    let mut c = client(&server).await;
    for _ in 0..200 {
        c.hello(hello(
            "x-real-ip",
            "10.1.1.1",
            Some(Duration::from_millis(100)),
        ))
        .await
        .unwrap();
    }
    server.shutdown().await.unwrap();
}
