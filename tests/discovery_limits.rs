//! The real `wirespan discovery` binary under resource attacks (issue 35): one HTTP/2
//! connection holding 100 unfinished multi-MiB request bodies does not grow its memory,
//! and under a small descriptor limit a full relay is refused with RESOURCE_EXHAUSTED
//! while Hello keeps working.

mod common;

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use bytes::Bytes;
use common::discovery::Discovery;
use tonic::{
    transport::{Channel, Endpoint},
    Code,
};
use wirespan_discovery::proto::{
    relay::{relay_client::RelayClient, AllocateRequest},
    server::{cluster_client::ClusterClient, AffiliateUpdateRequest, HelloRequest},
};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Opens `streams` AffiliateUpdate calls on one connection, each announcing a
/// message of `announced` bytes and sending `sent` of them, never the rest. Returns
/// the connection (kept open by the caller) and the calls answered within `wait`.
async fn unfinished_bodies(
    server: SocketAddr,
    streams: usize,
    announced: u32,
    sent: usize,
    wait: Duration,
) -> (h2::client::SendRequest<Bytes>, usize) {
    let tcp = tokio::net::TcpStream::connect(server).await.unwrap();
    let (send, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    // One buffer shared by every stream: the client's own memory stays small.
    let body = Bytes::from(vec![0u8; sent]);
    let mut head = vec![0u8];
    head.extend(announced.to_be_bytes());
    let head = Bytes::from(head);
    let mut answers = Vec::new();
    for _ in 0..streams {
        let mut send = send.clone().ready().await.unwrap();
        let request =
            http::Request::post("http://localhost/sidero.discovery.server.Cluster/AffiliateUpdate")
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(())
                .unwrap();
        let (response, mut stream) = send.send_request(request, false).unwrap();
        stream.send_data(head.clone(), false).unwrap();
        stream.send_data(body.clone(), false).unwrap();
        answers.push((response, stream));
    }
    let deadline = tokio::time::Instant::now() + wait;
    let mut answered = 0;
    for (response, _stream) in answers {
        if tokio::time::timeout_at(deadline, response).await.is_ok() {
            answered += 1;
        }
    }
    (send, answered)
}

#[test]
fn a_connection_holding_100_unfinished_big_bodies_does_not_grow_the_servers_memory() {
    let server = Discovery::start();
    runtime().block_on(async {
        // A call first, so the runtime's own start-up allocations are behind us.
        let mut c = ClusterClient::new(channel(server.grpc).await);
        c.hello(hello()).await.unwrap();
        let before = server.rss_kib();
        // 3.9 MiB announced and all but one byte sent on each of 100 streams: refused
        // on the announcement, before anything is buffered.
        let (_held, answered) = unfinished_bodies(
            server.grpc,
            100,
            3_900 << 10,
            (3_900 << 10) - 1,
            Duration::from_secs(5),
        )
        .await;
        let big = server.rss_kib();
        // The most the limits allow: 100 bodies just under the 64 KiB cap, unfinished
        // until the request timeout cancels them.
        let (_held2, _) =
            unfinished_bodies(server.grpc, 100, 63 << 10, 62 << 10, Duration::from_secs(1)).await;
        let capped = server.rss_kib();
        eprintln!(
            "RSS before {before} KiB; after 100 unfinished 3.9 MiB bodies {big} KiB; \
             after 100 more unfinished 62 KiB bodies {capped} KiB"
        );
        assert_eq!(answered, 100, "every oversized call is refused at once");
        assert!(
            big < before + 16 * 1024,
            "RSS grew from {before} to {big} KiB"
        );
        assert!(
            capped < before + 32 * 1024,
            "RSS grew from {before} to {capped} KiB"
        );
        // The server still serves.
        c.hello(hello()).await.unwrap();
    });
}

async fn channel(server: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{server}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

fn hello() -> HelloRequest {
    HelloRequest {
        cluster_id: "c".into(),
        client_version: "v1".into(),
    }
}

fn join(id: &str) -> AffiliateUpdateRequest {
    AffiliateUpdateRequest {
        cluster_id: "c".into(),
        affiliate_id: id.into(),
        affiliate_data: Some(b"d".to_vec()),
        affiliate_endpoints: Vec::new(),
        ttl: Some(prost_types::Duration {
            seconds: 600,
            nanos: 0,
        }),
    }
}

#[test]
fn under_a_small_descriptor_limit_a_full_relay_is_refused_and_hello_keeps_working() {
    // 300 descriptors: the server keeps half of what is left after its base and the
    // metrics port for connections; the relay gets the rest.
    let server = Discovery::start_with(&["--relay"], Some(300));
    runtime().block_on(async {
        let mut c = ClusterClient::new(channel(server.grpc).await);
        let peers: Vec<String> = (0..200).map(|i| format!("p{i}")).collect();
        c.affiliate_update(join("a")).await.unwrap();
        let mut relay = RelayClient::new(channel(server.grpc).await);
        let start = Instant::now();
        let mut granted = 0;
        let refusal = loop {
            let peer = &peers[granted];
            c.affiliate_update(join(peer)).await.unwrap();
            let call = relay
                .allocate(AllocateRequest {
                    cluster_id: "c".into(),
                    affiliate_id: "a".into(),
                    peer_affiliate_id: peer.clone(),
                    pair_token: vec![1; 32],
                })
                .await;
            match call {
                Ok(_) => granted += 1,
                Err(status) => break status,
            }
            assert!(granted < peers.len(), "the relay was never full");
            assert!(start.elapsed() < Duration::from_secs(60));
        };
        assert_eq!(
            refusal.code(),
            Code::ResourceExhausted,
            "{refusal:?} after {granted} allocations:\n{}",
            server.log_text()
        );
        assert!(
            refusal.message().contains("file descriptors"),
            "{refusal:?}"
        );
        assert!(granted >= 40, "only {granted} allocations");
        // New connections still say Hello.
        for _ in 0..20 {
            ClusterClient::new(channel(server.grpc).await)
                .hello(hello())
                .await
                .unwrap();
        }
    });
}

#[test]
fn a_zero_connection_limit_is_refused_naming_the_flag() {
    for flag in [
        "--max-connections",
        "--max-connections-per-ip",
        "--max-concurrent-streams",
        "--relay-max-per-cluster",
    ] {
        let out = std::process::Command::new(common::BIN)
            .args(["discovery", "--listen", "127.0.0.1:0", flag, "0"])
            .env_remove("NOTIFY_SOCKET")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} 0 was accepted");
        assert!(
            stderr.contains(&format!("{flag} must be positive")),
            "{flag}: {stderr}"
        );
    }
    let out = std::process::Command::new(common::BIN)
        .args([
            "discovery",
            "--listen",
            "127.0.0.1:0",
            "--request-timeout",
            "0s",
        ])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--request-timeout must be positive"));
}
