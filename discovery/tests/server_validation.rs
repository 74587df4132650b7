//! Every validation rule and limit through a real gRPC client: status code, message,
//! and no state change.

mod server_common;

use server_common::*;
use tonic::Code;
use wirespan_discovery::{proto::server::*, server::ServerConfig};

fn assert_status<T: std::fmt::Debug>(r: Result<T, tonic::Status>, code: Code, msg: &str) {
    let status = r.expect_err("request must fail");
    assert_eq!(status.code(), code, "{status:?}");
    assert_eq!(status.message(), msg, "{status:?}");
}

#[tokio::test]
async fn cluster_id_rules_apply_to_every_rpc() {
    let server = start(ServerConfig::default()).await;
    let mut c = client(&server).await;
    for (cluster, msg) in [
        (String::new(), "cluster ID can't be empty"),
        ("x".repeat(257), "cluster ID is too long"),
        ("x".repeat(1024), "cluster ID is too long"),
    ] {
        assert_status(
            c.hello(HelloRequest {
                cluster_id: cluster.clone(),
                client_version: "v1.8.3".into(),
            })
            .await,
            Code::InvalidArgument,
            msg,
        );
        assert_status(
            c.affiliate_update(update(&cluster, "a", b"d", &[], 60))
                .await,
            Code::InvalidArgument,
            msg,
        );
        assert_status(
            c.affiliate_delete(AffiliateDeleteRequest {
                cluster_id: cluster.clone(),
                affiliate_id: "a".into(),
            })
            .await,
            Code::InvalidArgument,
            msg,
        );
        assert_status(
            c.list(ListRequest {
                cluster_id: cluster.clone(),
            })
            .await,
            Code::InvalidArgument,
            msg,
        );
        // Watch opens, and the error arrives on the first receive.
        let mut stream = c
            .watch(WatchRequest {
                cluster_id: cluster.clone(),
            })
            .await
            .expect("watch call opens")
            .into_inner();
        assert_status(stream.message().await, Code::InvalidArgument, msg);
    }
    // 256 bytes is allowed.
    c.affiliate_update(update(&"x".repeat(256), &"y".repeat(256), b"d", &[], 60))
        .await
        .unwrap();
    assert_eq!(server.counts().affiliates, 1);
    assert_eq!(server.counts().clusters, 1);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn update_and_delete_rules_in_order() {
    let server = start(ServerConfig::default()).await;
    let mut c = client(&server).await;
    let big_endpoint = vec![0u8; 33];
    let cases: Vec<(AffiliateUpdateRequest, &str)> = vec![
        (
            update("c", "", b"d", &[], 60),
            "affiliate ID can't be empty",
        ),
        (
            update("c", &"a".repeat(257), b"d", &[], 60),
            "affiliate ID is too long",
        ),
        (
            update("c", &"a".repeat(1024), b"d", &[], 60),
            "affiliate ID is too long",
        ),
        (
            // Data is checked before endpoints.
            update("c", "a", &[0; 2049], &[&big_endpoint], 60),
            "affiliate data is too big",
        ),
        (
            update("c", "a", b"d", &[b"ok", &big_endpoint], 60),
            "affiliate endpoint is too big",
        ),
        (update("c", "a", b"d", &[], 1801), "ttl is too large"),
    ];
    for (req, msg) in cases {
        assert_status(c.affiliate_update(req).await, Code::InvalidArgument, msg);
    }
    assert_eq!(
        server.counts().affiliates,
        0,
        "rejected updates touch nothing"
    );

    for (id, msg) in [
        (String::new(), "affiliate ID can't be empty"),
        ("a".repeat(257), "affiliate ID is too long"),
    ] {
        assert_status(
            c.affiliate_delete(AffiliateDeleteRequest {
                cluster_id: "c".into(),
                affiliate_id: id,
            })
            .await,
            Code::InvalidArgument,
            msg,
        );
    }
    // Boundaries pass: 2048-byte data, 32-byte endpoint, 30 min TTL, no TTL at all.
    c.affiliate_update(update("c", "a", &[0; 2048], &[&[0; 32]], 1800))
        .await
        .unwrap();
    let mut no_ttl = update("c", "b", b"d", &[], 0);
    no_ttl.ttl = None;
    c.affiliate_update(no_ttl).await.unwrap();
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn affiliate_and_endpoint_limits() {
    let server = start(ServerConfig {
        rate_limit: false,
        ..ServerConfig::default()
    })
    .await;
    let mut c = client(&server).await;
    for i in 0..1024 {
        c.affiliate_update(update("c", &format!("a{i}"), b"d", &[], 60))
            .await
            .unwrap();
    }
    assert_status(
        c.affiliate_update(update("c", "a1024", b"d", &[], 60))
            .await,
        Code::ResourceExhausted,
        "too many affiliates in the cluster",
    );
    assert_eq!(server.counts().affiliates, 1024);

    let blobs: Vec<Vec<u8>> = (0..64u32).map(|i| i.to_be_bytes().to_vec()).collect();
    let refs: Vec<&[u8]> = blobs.iter().map(Vec::as_slice).collect();
    c.affiliate_update(update("c", "a0", b"d", &refs, 60))
        .await
        .unwrap();
    assert_status(
        c.affiliate_update(update("c", "a0", b"d", &[b"65th"], 60))
            .await,
        Code::ResourceExhausted,
        "too many endpoints in the affiliate",
    );
    // Re-sending a known endpoint is still fine at the limit.
    c.affiliate_update(update("c", "a0", b"d", &[b"\0\0\0\x05"], 60))
        .await
        .unwrap();
    assert_eq!(server.counts().endpoints, 64);
    server.shutdown().await.unwrap();
}
