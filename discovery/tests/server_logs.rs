//! The server's logs carry no cluster ID (a bearer credential: whoever knows it can
//! publish and delete) and no line a client can forge: a real server with the relay
//! on, every RPC and a snapshot load and save, captured at trace level.

mod server_common;

use std::{
    io::Write,
    sync::{Arc, Mutex},
};

use prost::Message as _;
use server_common::*;
use tonic::{transport::Endpoint, Request};
use wirespan_discovery::{
    proto::{
        relay::{relay_client::RelayClient, AllocateRequest},
        server::*,
        storage::{AffiliateSnapshot, ClusterSnapshot},
    },
    redact::cluster_tag,
    server::relay::{table::RelayLimits, RelayConfig},
    server::ServerConfig,
};

const SECRET: &str = "secret-cluster-1f2e3d4c";
const FORGED: &str = "2026-01-01T00:00:00.000000Z  INFO forged: evil line";

/// Everything logged, shared with the subscriber.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Capture {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// A snapshot whose first record has an affiliate with an over-long ID (dropped,
/// with a warning) and whose second repeats the cluster (corrupt: moved aside).
fn hostile_snapshot() -> Vec<u8> {
    let cluster = ClusterSnapshot {
        id: SECRET.into(),
        affiliates: vec![AffiliateSnapshot {
            id: "x".repeat(300),
            expiration: None,
            data: vec![1],
            endpoints: vec![],
            ttl: ttl(60),
        }],
    };
    let mut one = vec![0x0a];
    prost::encoding::encode_varint(cluster.encoded_len() as u64, &mut one);
    cluster.encode(&mut one).unwrap();
    [one.clone(), one].concat()
}

async fn allocate(
    server: &wirespan_discovery::server::RunningServer,
    cluster: &str,
    me: &str,
    peer: &str,
    from: &str,
) {
    let channel = Endpoint::from_shared(format!("http://{}", server.local_addr()))
        .unwrap()
        .local_address(Some(from.parse().unwrap()))
        .connect()
        .await
        .unwrap();
    let req = Request::new(AllocateRequest {
        cluster_id: cluster.into(),
        affiliate_id: me.into(),
        peer_affiliate_id: peer.into(),
        pair_token: vec![7; 32],
    });
    RelayClient::new(channel).allocate(req).await.unwrap();
}

#[tokio::test]
async fn no_cluster_id_and_no_forged_line_in_the_logs() {
    let capture = Capture::default();
    let writer = capture.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter("wirespan_discovery=trace")
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.binpb");
    std::fs::write(&path, hostile_snapshot()).unwrap();
    let server = start(ServerConfig {
        snapshot_path: Some(path.clone()),
        relay: Some(RelayConfig {
            bind: "127.0.0.1".parse().unwrap(),
            address: None,
            limits: RelayLimits::default(),
        }),
        ..ServerConfig::default()
    })
    .await;
    let mut c = client(&server).await;
    let newline = format!("evil\n{FORGED}");
    for cluster in [SECRET, newline.as_str()] {
        c.hello(HelloRequest {
            cluster_id: cluster.into(),
            client_version: format!("v1.0.0\n{FORGED}"),
        })
        .await
        .unwrap();
        for node in ["a", "b"] {
            c.affiliate_update(update(cluster, node, b"d", &[], 60))
                .await
                .unwrap();
        }
        let mut w = open_watch(&mut c, cluster).await;
        next(&mut w).await;
        list(&mut c, cluster).await;
        allocate(&server, cluster, "a", "b", "127.0.0.1").await;
        allocate(&server, cluster, "b", "a", "127.0.0.2").await;
    }
    c.affiliate_delete(AffiliateDeleteRequest {
        cluster_id: SECRET.into(),
        affiliate_id: "a".into(),
    })
    .await
    .unwrap();
    server.gc_now();
    server.shutdown().await.unwrap();

    let log = capture.text();
    // The paths that name a cluster were taken, by its tag.
    assert!(log.contains("snapshot entry dropped"), "{log}");
    assert!(log.contains("relay allocation created"), "{log}");
    assert!(log.contains(&cluster_tag(&newline)), "{log}");
    assert!(log.contains(&cluster_tag(SECRET)), "{log}");
    assert!(!log.contains(SECRET), "a cluster ID was logged:\n{log}");
    assert!(
        !log.contains("evil"),
        "a client's cluster ID was logged:\n{log}"
    );
    let forged: Vec<&str> = log
        .lines()
        .filter(|l| l.starts_with("2026-01-01"))
        .collect();
    assert!(forged.is_empty(), "forged lines: {forged:?}");
}
