//! Snapshot persistence through the running server: saved on shutdown, restored at
//! start with remaining TTLs, a corrupt file moved aside without blocking the start.

mod server_common;

use std::time::Duration;

use prost::Message;
use server_common::*;
use wirespan_discovery::{proto::storage::ClusterSnapshot, server::ServerConfig};

fn config(path: &std::path::Path) -> ServerConfig {
    ServerConfig {
        snapshot_path: Some(path.to_owned()),
        ..ServerConfig::default()
    }
}

/// Decodes a record stream (`0x0A varint(len) ClusterSnapshot`…).
fn records(mut bytes: &[u8]) -> Vec<ClusterSnapshot> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        assert_eq!(bytes[0], 0x0a);
        bytes = &bytes[1..];
        let len = prost::encoding::decode_varint(&mut bytes).unwrap() as usize;
        out.push(ClusterSnapshot::decode(&bytes[..len]).unwrap());
        bytes = &bytes[len..];
    }
    out
}

#[tokio::test]
async fn round_trip_through_shutdown_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nested/state.binpb");
    let server = start(config(&path)).await;
    let mut c = client(&server).await;
    // Vector (e)'s content: endpoint `aa` with 600 s, data `01 02` with 1800 s.
    let mut ep = update("c1", "a1", b"", &[&[0xaa]], 600);
    ep.affiliate_data = None;
    c.affiliate_update(ep).await.unwrap();
    c.affiliate_update(update("c1", "a1", &[1, 2], &[], 1800))
        .await
        .unwrap();
    c.affiliate_update(update("c2", "b", b"bb", &[b"e1", b"e2"], 100))
        .await
        .unwrap();
    server.shutdown().await.unwrap();

    let bytes = std::fs::read(&path).unwrap();
    assert!(!dir.path().join("nested/state.binpb.tmp").exists());
    let mut snap = records(&bytes);
    snap.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(snap.len(), 2);
    let c1 = &snap[0];
    assert_eq!(c1.id, "c1");
    let a1 = &c1.affiliates[0];
    assert_eq!(a1.data, [1, 2]);
    assert!(a1.expiration.is_none(), "only ttl is written");
    let ttl = a1.ttl.as_ref().unwrap();
    assert!((1799..=1800).contains(&ttl.seconds), "{ttl:?}");
    assert_eq!(ttl.nanos, 0, "whole seconds");
    assert_eq!(a1.endpoints[0].data, [0xaa]);
    assert!((599..=600).contains(&a1.endpoints[0].ttl.as_ref().unwrap().seconds));
    // Same layout as vector (e) apart from the TTL seconds that elapsed.
    let c1_record = {
        let mut v = vec![0x0a];
        prost::encoding::encode_varint(c1.encoded_len() as u64, &mut v);
        c1.encode(&mut v).unwrap();
        v
    };
    if ttl.seconds == 1800 && a1.endpoints[0].ttl.as_ref().unwrap().seconds == 600 {
        assert_eq!(
            c1_record,
            [
                0x0a, 0x1d, 0x0a, 0x02, 0x63, 0x31, 0x12, 0x17, 0x0a, 0x02, 0x61, 0x31, 0x1a, 0x02,
                0x01, 0x02, 0x22, 0x08, 0x12, 0x01, 0xaa, 0x1a, 0x03, 0x08, 0xd8, 0x04, 0x2a, 0x03,
                0x08, 0x88, 0x0e
            ]
        );
    }

    // Restart: the state is back.
    let server = start(config(&path)).await;
    let mut c = client(&server).await;
    assert_eq!(
        list(&mut c, "c1").await,
        vec![affiliate("a1", &[1, 2], &[&[0xaa]])]
    );
    assert_eq!(
        list(&mut c, "c2").await,
        vec![affiliate("b", b"bb", &[b"e1", b"e2"])]
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn periodic_save() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.binpb");
    let server = start(ServerConfig {
        snapshot_interval: Duration::from_secs(1),
        ..config(&path)
    })
    .await;
    let mut c = client(&server).await;
    c.affiliate_update(update("c", "a", b"d", &[], 60))
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !path.exists() {
        assert!(std::time::Instant::now() < deadline, "no periodic save");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(records(&std::fs::read(&path).unwrap())[0].id, "c");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn corrupt_snapshot_is_moved_aside_and_server_starts_empty() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.binpb");
    // A valid record followed by a truncated one.
    let good = {
        let server = start(config(&path)).await;
        let mut c = client(&server).await;
        c.affiliate_update(update("c", "a", b"d", &[], 60))
            .await
            .unwrap();
        server.shutdown().await.unwrap();
        std::fs::read(&path).unwrap()
    };
    let mut bad = good.clone();
    bad.extend_from_slice(&good[..good.len() - 3]);
    std::fs::write(&path, &bad).unwrap();

    let server = start(config(&path)).await;
    assert_eq!(server.counts().affiliates, 0, "nothing half-loaded");
    let moved: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("state.binpb.corrupt-"))
        .collect();
    assert_eq!(moved.len(), 1, "{moved:?}");
    assert_eq!(std::fs::read(dir.path().join(&moved[0])).unwrap(), bad);
    let mut c = client(&server).await;
    assert!(list(&mut c, "c").await.is_empty());
    c.affiliate_update(update("c", "fresh", b"d", &[], 60))
        .await
        .unwrap();
    server.shutdown().await.unwrap();
    // A fresh snapshot replaced the bad one.
    assert_eq!(
        records(&std::fs::read(&path).unwrap())[0].affiliates[0].id,
        "fresh"
    );

    // Pure garbage too.
    std::fs::write(&path, b"\xff\xff garbage").unwrap();
    let server = start(config(&path)).await;
    assert_eq!(server.counts().clusters, 0);
    server.shutdown().await.unwrap();
}

fn saves(server: &wirespan_discovery::server::RunningServer) -> u32 {
    let text = server.metrics_text();
    text.lines()
        .find(|l| {
            l.starts_with("discovery_storage_operations_total")
                && l.contains("operation=\"save\"")
                && l.contains("status=\"success\"")
        })
        .map_or(0, |l| l.rsplit(' ').next().unwrap().parse().unwrap())
}

/// The save schedule on tokio's paused clock: 10-min interval, +13 min ⇒ 1 save,
/// +10 min ⇒ 2, shutdown ⇒ 3.
#[tokio::test(start_paused = true)]
async fn save_schedule_on_a_paused_clock() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.binpb");
    let server = start(config(&path)).await;
    assert_eq!(saves(&server), 0);
    tokio::time::sleep(Duration::from_secs(13 * 60)).await;
    wait_for_saves(&server, 1).await;
    tokio::time::sleep(Duration::from_secs(10 * 60)).await;
    wait_for_saves(&server, 2).await;
    // The third save is the one at shutdown: the file comes back after removal.
    std::fs::remove_file(&path).unwrap();
    server.shutdown().await.unwrap();
    assert!(path.exists());
}

async fn wait_for_saves(server: &wirespan_discovery::server::RunningServer, n: u32) {
    // The save itself runs on a blocking thread, outside the paused clock.
    for _ in 0..200 {
        if saves(server) >= n {
            assert_eq!(saves(server), n);
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
        tokio::task::yield_now().await;
    }
    panic!("expected {n} saves, saw {}", saves(server));
}
