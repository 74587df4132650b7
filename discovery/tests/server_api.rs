//! API semantics through a real tonic client: Hello, merge rules, delete, List, Watch
//! ordering, redirect.

mod server_common;

use server_common::*;
use wirespan_discovery::{proto::server::*, server::ServerConfig};

#[tokio::test]
async fn hello_reports_loopback_and_does_not_create_cluster() {
    let server = start(ServerConfig::default()).await;
    let mut c = client(&server).await;
    let resp = c
        .hello(HelloRequest {
            cluster_id: "c1".into(),
            client_version: "v1.8.3".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.client_ip, vec![127, 0, 0, 1]);
    assert_eq!(resp.redirect, None);
    assert_eq!(server.counts().clusters, 0);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn update_list_merge_and_delete() {
    let server = start(ServerConfig::default()).await;
    let mut c = client(&server).await;
    c.affiliate_update(update("c1", "af1", b"data1", &[b"e1", b"e2"], 60))
        .await
        .unwrap();
    assert_eq!(
        list(&mut c, "c1").await,
        vec![affiliate("af1", b"data1", &[b"e1", b"e2"])]
    );

    // Endpoint-only update: merged in order, data kept (absent data).
    let mut req = update("c1", "af1", b"", &[b"e3", b"e2"], 60);
    req.affiliate_data = None;
    c.affiliate_update(req).await.unwrap();
    assert_eq!(
        list(&mut c, "c1").await,
        vec![affiliate("af1", b"data1", &[b"e1", b"e2", b"e3"])]
    );
    // Present-but-empty data is treated as absent.
    c.affiliate_update(update("c1", "af1", b"", &[], 60))
        .await
        .unwrap();
    assert_eq!(list(&mut c, "c1").await[0].data, b"data1");

    // Delete of a missing affiliate succeeds; delete of af1 empties the list.
    for id in ["missing", "af1"] {
        c.affiliate_delete(AffiliateDeleteRequest {
            cluster_id: "c1".into(),
            affiliate_id: id.into(),
        })
        .await
        .unwrap();
    }
    assert!(list(&mut c, "c1").await.is_empty());
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn watch_snapshot_then_one_affiliate_per_event() {
    let server = start(ServerConfig::default()).await;
    let mut c = client(&server).await;

    // Empty snapshot is still sent first.
    let mut empty = open_watch(&mut c, "other").await;
    assert_eq!(next(&mut empty).await, WatchResponse::default());

    c.affiliate_update(update("c1", "af1", b"d1", &[b"e1"], 60))
        .await
        .unwrap();
    let mut w = open_watch(&mut c, "c1").await;
    assert_eq!(
        next(&mut w).await,
        WatchResponse {
            affiliates: vec![affiliate("af1", b"d1", &[b"e1"])],
            deleted: false
        }
    );
    c.affiliate_update(update("c1", "af2", b"d2", &[], 60))
        .await
        .unwrap();
    assert_eq!(
        next(&mut w).await,
        WatchResponse {
            affiliates: vec![affiliate("af2", b"d2", &[])],
            deleted: false
        }
    );
    // Endpoint added to af1: upsert with the full current state.
    let mut req = update("c1", "af1", b"", &[b"e2"], 60);
    req.affiliate_data = None;
    c.affiliate_update(req).await.unwrap();
    assert_eq!(
        next(&mut w).await,
        WatchResponse {
            affiliates: vec![affiliate("af1", b"d1", &[b"e1", b"e2"])],
            deleted: false
        }
    );
    c.affiliate_delete(AffiliateDeleteRequest {
        cluster_id: "c1".into(),
        affiliate_id: "af1".into(),
    })
    .await
    .unwrap();
    assert_eq!(
        next(&mut w).await,
        WatchResponse {
            affiliates: vec![Affiliate {
                id: "af1".into(),
                ..Affiliate::default()
            }],
            deleted: true
        }
    );
    // Shutdown ends the stream with OK.
    let shutdown = tokio::spawn(server.shutdown());
    let end = tokio::time::timeout(std::time::Duration::from_secs(5), w.message())
        .await
        .unwrap();
    assert!(matches!(end, Ok(None)), "{end:?}");
    shutdown.await.unwrap().unwrap();
}

#[tokio::test]
async fn redirect_is_returned_and_server_keeps_serving() {
    let server = start(ServerConfig {
        redirect_endpoint: Some("example.com:443".into()),
        ..ServerConfig::default()
    })
    .await;
    let mut c = client(&server).await;
    let resp = c
        .hello(HelloRequest {
            cluster_id: "c1".into(),
            client_version: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        resp.redirect,
        Some(RedirectMessage {
            endpoint: "example.com:443".into()
        })
    );
    assert_eq!(resp.client_ip, vec![127, 0, 0, 1]);
    c.affiliate_update(update("c1", "a", b"x", &[], 60))
        .await
        .unwrap();
    assert_eq!(list(&mut c, "c1").await.len(), 1);
    server.shutdown().await.unwrap();
}
