//! Snapshot persistence through the running server: saved on shutdown, restored at
//! start with remaining TTLs, a corrupt file moved aside without blocking the start.

mod server_common;

use std::time::Duration;

use prost::Message;
use server_common::*;
use wirespan_discovery::{
    proto::storage::{AffiliateSnapshot, ClusterSnapshot, EndpointSnapshot},
    server::ServerConfig,
};

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
    let left: Vec<_> = std::fs::read_dir(dir.path().join("nested"))
        .unwrap()
        .collect();
    assert_eq!(left.len(), 1, "a temp file was left: {left:?}");
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

/// The save creates its temp file exclusively under an unpredictable name, without
/// following links, mode 0600: links planted where the old save wrote (`<path>.tmp`)
/// or at other likely names leave their targets alone, and the snapshot is 0600.
#[tokio::test]
async fn save_never_writes_through_a_planted_symlink() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let victim = elsewhere.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let path = dir.path().join("state.binpb");
    let planted = [
        "state.binpb.tmp",
        ".state.binpb.tmp",
        "state.binpb.new",
        ".state.binpb.0000000000000000.tmp",
    ];
    for name in planted {
        std::os::unix::fs::symlink(&victim, dir.path().join(name)).unwrap();
    }
    let server = start(config(&path)).await;
    let mut c = client(&server).await;
    c.affiliate_update(update("c", "a", b"d", &[], 60))
        .await
        .unwrap();
    server.shutdown().await.unwrap();

    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    for name in planted {
        let meta = std::fs::symlink_metadata(dir.path().join(name)).unwrap();
        assert!(meta.file_type().is_symlink(), "{name} replaced");
    }
    let meta = std::fs::symlink_metadata(&path).unwrap();
    assert!(meta.file_type().is_file());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(records(&std::fs::read(&path).unwrap())[0].id, "c");
    // No temp file is left beside it.
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), planted.len() + 1, "{names:?}");
}

/// One length-delimited field (`tag` is the key byte).
fn field(tag: u8, bytes: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    prost::encoding::encode_varint(bytes.len() as u64, &mut out);
    out.extend_from_slice(bytes);
    out
}

fn record(cluster: &ClusterSnapshot) -> Vec<u8> {
    field(0x0a, &cluster.encode_to_vec())
}

fn affiliate_snapshot(id: &str, data: &[u8], ttl_secs: i64) -> AffiliateSnapshot {
    AffiliateSnapshot {
        id: id.into(),
        expiration: None,
        data: data.to_vec(),
        endpoints: vec![],
        ttl: ttl(ttl_secs),
    }
}

/// A crafted snapshot is held to every limit a live request passes; what breaks one
/// is dropped and counted, the rest loads.
#[tokio::test]
async fn crafted_snapshot_is_held_to_request_limits() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.binpb");
    let century = 100 * 365 * 86_400;
    let mut good = ClusterSnapshot {
        id: "good".into(),
        affiliates: vec![
            affiliate_snapshot("ok", b"d", century),
            affiliate_snapshot(&"x".repeat(100_000), b"d", 60),
            affiliate_snapshot("fat", &[0; 3000], 60),
        ],
    };
    let mut with_endpoints = affiliate_snapshot("eps", b"d", 60);
    with_endpoints.endpoints = vec![
        EndpointSnapshot {
            expiration: None,
            data: vec![1; 32],
            ttl: ttl(century),
        },
        EndpointSnapshot {
            expiration: None,
            data: vec![2; 100],
            ttl: ttl(60),
        },
    ];
    good.affiliates.push(with_endpoints);
    let crowded = ClusterSnapshot {
        id: "crowded".into(),
        affiliates: (0..3000)
            .map(|i| affiliate_snapshot(&format!("a{i}"), b"d", 60))
            .collect(),
    };
    let long_id = ClusterSnapshot {
        id: "l".repeat(300),
        affiliates: vec![affiliate_snapshot("a", b"d", 60)],
    };
    let mut bytes = record(&good);
    // An affiliate ID cut in the middle of a UTF-8 sequence, in a cluster of its own,
    // and a cluster ID likewise.
    let cut_affiliate = [
        field(0x0a, "€".as_bytes().get(..2).unwrap()),
        field(0x1a, b"d"),
    ]
    .concat();
    bytes.extend(field(
        0x0a,
        &[field(0x0a, b"utf8"), field(0x12, &cut_affiliate)].concat(),
    ));
    bytes.extend(field(0x0a, &field(0x0a, &[b'c', 0xe2, 0x82])));
    bytes.extend(record(&crowded));
    bytes.extend(record(&long_id));
    for i in 0..4 {
        bytes.extend(record(&ClusterSnapshot {
            id: format!("extra{i}"),
            affiliates: vec![affiliate_snapshot("a", b"d", 60)],
        }));
    }
    std::fs::write(&path, &bytes).unwrap();

    let server = start_with_metrics(ServerConfig {
        max_clusters: 5,
        ..config(&path)
    })
    .await;
    let counts = server.counts();
    // good, crowded, extra0 to extra2 (utf8 is left empty); extra3 is over the cap.
    assert_eq!(counts.clusters, 5, "{counts:?}");
    assert_eq!(counts.affiliates, 2 + 1024 + 3, "{counts:?}");
    assert_eq!(counts.endpoints, 1, "{counts:?}");
    // 2 affiliates and 1 endpoint in good, 1 affiliate in utf8, 1 cluster (bad
    // UTF-8), 1976 affiliates in crowded, the long ID's cluster and affiliate, and
    // extra3's.
    assert_eq!(counts.snapshot_dropped, 2 + 1 + 1 + 1 + 1976 + 2 + 2);
    let dropped: f64 = server
        .metrics_text()
        .lines()
        .find_map(|l| {
            l.strip_prefix("discovery_snapshot_dropped_total ")?
                .parse()
                .ok()
        })
        .unwrap();
    assert_eq!(dropped, counts.snapshot_dropped as f64);
    let mut c = client(&server).await;
    let ids: Vec<String> = list(&mut c, "good")
        .await
        .into_iter()
        .map(|a| a.id)
        .collect();
    assert_eq!(ids, ["eps", "ok"]);
    server.shutdown().await.unwrap();

    // TTLs of a century were clamped to the largest a client may ask for.
    let saved = records(&std::fs::read(&path).unwrap());
    let good = saved.iter().find(|c| c.id == "good").unwrap();
    for a in &good.affiliates {
        assert!(a.ttl.as_ref().unwrap().seconds <= 1800, "{a:?}");
        for e in &a.endpoints {
            assert!(e.ttl.as_ref().unwrap().seconds <= 1800, "{e:?}");
        }
    }
}
