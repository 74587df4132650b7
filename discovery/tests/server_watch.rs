//! Watch behaviour over real gRPC: expiry with a short TTL and fast GC, convergence of
//! many watching clients, slow-watcher abort, and client keepalive pings.

mod server_common;

use std::time::{Duration, Instant};

use server_common::*;
use tonic::{transport::Endpoint, Code, Request};
use wirespan_discovery::{
    proto::server::{cluster_client::ClusterClient, *},
    server::ServerConfig,
};

#[tokio::test]
async fn one_second_ttl_expires_via_gc() {
    let server = start(ServerConfig {
        gc_interval: Duration::from_millis(200),
        ..ServerConfig::default()
    })
    .await;
    let mut c = client(&server).await;
    let mut w = open_watch(&mut c, "c").await;
    assert!(next(&mut w).await.affiliates.is_empty());
    c.affiliate_update(update("c", "short", b"d", &[], 1))
        .await
        .unwrap();
    c.affiliate_update(update("c", "long", b"d", &[b"e"], 60))
        .await
        .unwrap();
    // An endpoint with 1 s TTL on the long-lived affiliate.
    let mut ep = update("c", "long", b"", &[b"short-ep"], 1);
    ep.affiliate_data = None;
    c.affiliate_update(ep).await.unwrap();
    for _ in 0..3 {
        next(&mut w).await;
    }
    // Both expiries arrive (each `next` has its own hang deadline); when is the
    // GC's business, not this test's.
    let mut deleted = false;
    let mut trimmed = false;
    while !(deleted && trimmed) {
        let ev = next(&mut w).await;
        let a = &ev.affiliates[0];
        if ev.deleted {
            assert_eq!(a.id, "short");
            deleted = true;
        } else {
            // Endpoint-only expiry arrives as an upsert of the current state.
            assert_eq!(a.id, "long");
            assert_eq!(a.endpoints, vec![b"e".to_vec()]);
            trimmed = true;
        }
    }
    assert_eq!(
        list(&mut c, "c").await,
        vec![affiliate("long", b"d", &[b"e"])]
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn cluster_removed_only_without_affiliates_and_watchers() {
    let server = start(ServerConfig::default()).await;
    let mut c = client(&server).await;
    // List creates no cluster (upstream creates one for GC to remove).
    list(&mut c, "read-only").await;
    let mut w = open_watch(&mut c, "watched").await;
    next(&mut w).await;
    assert_eq!(server.counts().clusters, 1);
    assert_eq!(server.gc_now().clusters, 0);
    assert_eq!(server.counts().clusters, 1);
    drop(w);
    // The server notices the cancelled stream shortly after.
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.counts().subscriptions > 0 {
        assert!(Instant::now() < deadline, "watcher never unsubscribed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(server.gc_now().clusters, 1);
    assert_eq!(server.counts().clusters, 0);
    server.shutdown().await.unwrap();
}

fn with_ip<T>(msg: T, ip: &str) -> Request<T> {
    let mut req = Request::new(msg);
    req.metadata_mut().insert("x-real-ip", ip.parse().unwrap());
    req
}

/// n clients (each its own address via X-Real-IP from a trusted loopback proxy, so
/// the default rate limit applies per client): each watches, publishes its own
/// endpoint and an "other" endpoint for its neighbour; every client ends up holding n−1 peers with 2 endpoints each. How
/// fast is `wirespan bench discovery`'s business; the deadline here only bounds a hang.
async fn converge(n: usize) {
    let server = start(ServerConfig {
        trusted_proxies: vec!["127.0.0.0/8".parse().unwrap()],
        ..ServerConfig::default()
    })
    .await;
    let url = format!("http://{}", server.local_addr());
    let mut tasks = Vec::new();
    for i in 0..n {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let ip = format!("10.0.{}.{}", i / 250, i % 250 + 1);
            let channel = Endpoint::from_shared(url).unwrap().connect().await.unwrap();
            let mut c = ClusterClient::new(channel);
            c.hello(with_ip(
                HelloRequest {
                    cluster_id: "conv".into(),
                    client_version: "v1.8.3".into(),
                },
                &ip,
            ))
            .await
            .unwrap();
            let mut w = c
                .watch(with_ip(
                    WatchRequest {
                        cluster_id: "conv".into(),
                    },
                    &ip,
                ))
                .await
                .unwrap()
                .into_inner();
            let me = format!("node-{i}");
            let own = format!("own-{i}").into_bytes();
            c.affiliate_update(with_ip(update("conv", &me, b"data", &[&own], 10), &ip))
                .await
                .unwrap();
            let neighbour = format!("node-{}", (i + 1) % n);
            let mut other = update(
                "conv",
                &neighbour,
                b"",
                &[format!("via-{i}").as_bytes()],
                10,
            );
            other.affiliate_data = None;
            c.affiliate_update(with_ip(other, &ip)).await.unwrap();

            let mut peers = std::collections::HashMap::<String, Affiliate>::new();
            let mut first = true;
            loop {
                let ok = peers.len() == n - 1
                    && peers
                        .values()
                        .all(|a| a.endpoints.len() == 2 && !a.data.is_empty());
                if ok {
                    return;
                }
                let msg = next(&mut w).await;
                if first {
                    peers.clear();
                    first = false;
                }
                for a in msg.affiliates {
                    if a.id == me {
                        continue;
                    }
                    if msg.deleted {
                        peers.remove(&a.id);
                    } else {
                        peers.insert(a.id.clone(), a);
                    }
                }
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("the cluster never converged")
            .unwrap();
    }
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn converge_5() {
    converge(5).await;
}

#[tokio::test]
async fn converge_15() {
    converge(15).await;
}

#[tokio::test]
async fn converge_50() {
    converge(50).await;
}

#[tokio::test]
async fn slow_watcher_is_aborted_fast_one_sees_everything() {
    let server = start(ServerConfig {
        rate_limit: false,
        watch_stall: Duration::from_millis(300),
        ..ServerConfig::default()
    })
    .await;
    let url = format!("http://{}", server.local_addr());
    // A small HTTP/2 window on the slow client so the server's queue, not the
    // transport buffers, absorbs the backlog.
    let slow_channel = Endpoint::from_shared(url.clone())
        .unwrap()
        .initial_stream_window_size(65_535)
        .initial_connection_window_size(65_535)
        .connect()
        .await
        .unwrap();
    let mut slow = ClusterClient::new(slow_channel)
        .watch(WatchRequest {
            cluster_id: "c".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(next(&mut slow).await.affiliates.is_empty());
    let mut c = client(&server).await;
    let mut fast = open_watch(&mut c, "c").await;
    next(&mut fast).await;

    const EVENTS: usize = 300;
    let data = vec![7u8; 2048];
    let reader = tokio::spawn(async move {
        let mut seen = 0;
        while seen < EVENTS {
            next(&mut fast).await;
            seen += 1;
        }
        (seen, fast)
    });
    for i in 0..EVENTS {
        c.affiliate_update(update("c", &format!("a{}", i % 10), &data, &[], 60))
            .await
            .unwrap();
    }
    let (seen, _fast) = reader.await.unwrap();
    assert_eq!(seen, EVENTS);
    // Its queue is full and it takes nothing for longer than the stall timeout
    // (a watcher that keeps reading is never aborted; see the unit tests).
    tokio::time::sleep(Duration::from_secs(1)).await;

    // The slow one gets what was buffered, then ABORTED.
    let mut received = 0;
    let status = loop {
        match tokio::time::timeout(Duration::from_secs(5), slow.message())
            .await
            .unwrap()
        {
            Ok(Some(_)) => received += 1,
            Ok(None) => panic!("stream ended with OK after {received} messages"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), Code::Aborted);
    assert_eq!(status.message(), "subscription canceled: lost update");
    assert!(received < EVENTS, "{received}");
    assert_eq!(server.counts().subscriptions, 1);
    let text = server.metrics_text();
    assert!(
        text.contains("discovery_watch_aborted_total 1\n"),
        "the abort is counted:\n{text}"
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn frequent_client_pings_do_not_break_the_connection() {
    let server = start(ServerConfig::default()).await;
    // Pings every second: ten times more often than upstream's enforcement minimum.
    let channel = Endpoint::from_shared(format!("http://{}", server.local_addr()))
        .unwrap()
        .http2_keep_alive_interval(Duration::from_secs(1))
        .keep_alive_timeout(Duration::from_secs(1))
        .keep_alive_while_idle(true)
        .connect()
        .await
        .unwrap();
    let mut c = ClusterClient::new(channel);
    let mut w = open_watch(&mut c, "c").await;
    next(&mut w).await;
    tokio::time::sleep(Duration::from_millis(3500)).await;
    c.affiliate_update(update("c", "a", b"d", &[], 60))
        .await
        .unwrap();
    assert_eq!(next(&mut w).await.affiliates[0].id, "a");
    server.shutdown().await.unwrap();
}
