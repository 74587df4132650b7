//! The server relay through real sockets on loopback: two nodes of a pair allocate
//! through gRPC (each from its own loopback address, the address the relay binds its
//! side to) and exchange datagrams through their ports; strangers, other ports of a
//! node's address, pairs the server does not know, bad requests and limits are
//! refused; a server without the relay answers UNIMPLEMENTED.

mod server_common;

use server_common::metric;
use std::{net::SocketAddr, time::Duration};

use tokio::net::UdpSocket;
use tonic::{
    transport::{Channel, Endpoint},
    Code, Request,
};
use wirespan_discovery::{
    proto::{
        relay::{relay_client::RelayClient, AllocateRequest, AllocateResponse},
        server::HelloRequest,
    },
    server::relay::{table::RelayLimits, RelayConfig},
    server::{RunningServer, ServerConfig},
};

fn relay_config(limits: RelayLimits) -> ServerConfig {
    ServerConfig {
        relay: Some(RelayConfig {
            bind: "127.0.0.1".parse().unwrap(),
            address: None,
            limits,
        }),
        ..ServerConfig::default()
    }
}

/// A channel to the server from the loopback address `from`.
async fn channel_from(server: &RunningServer, from: &str) -> Channel {
    Endpoint::from_shared(format!("http://{}", server.local_addr()))
        .unwrap()
        .local_address(Some(from.parse().unwrap()))
        .connect()
        .await
        .unwrap()
}

async fn client(server: &RunningServer) -> RelayClient<Channel> {
    RelayClient::new(channel_from(server, "127.0.0.1").await)
}

/// Makes `ids` live affiliates of `cluster`: the relay serves only those.
async fn join(server: &RunningServer, cluster: &str, ids: &[&str]) {
    let mut c = server_common::client(server).await;
    for id in ids {
        c.affiliate_update(server_common::update(cluster, id, b"d", &[], 600))
            .await
            .unwrap();
    }
}

fn request(me: &str, peer: &str, token: &[u8]) -> Request<AllocateRequest> {
    Request::new(AllocateRequest {
        cluster_id: "cluster".into(),
        affiliate_id: me.into(),
        peer_affiliate_id: peer.into(),
        pair_token: token.to_vec(),
    })
}

/// An allocate call for `me` from the loopback address `ip`.
async fn allocate(
    server: &RunningServer,
    me: &str,
    peer: &str,
    ip: &str,
) -> Result<AllocateResponse, tonic::Status> {
    RelayClient::new(channel_from(server, ip).await)
        .allocate(request(me, peer, &[7; 32]))
        .await
        .map(tonic::Response::into_inner)
}

async fn recv(sock: &UdpSocket) -> (Vec<u8>, SocketAddr) {
    let mut buf = [0u8; 2048];
    let (n, from) = tokio::time::timeout(Duration::from_secs(10), sock.recv_from(&mut buf))
        .await
        .expect("a datagram within 10 s")
        .unwrap();
    (buf[..n].to_vec(), from)
}

/// Polls the metrics until `prefix` reaches `want`.
async fn metric_reaches(server: &RunningServer, prefix: &str, want: f64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while metric(server, prefix) < want {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{prefix} stayed below {want}:\n{}",
            server.metrics_text()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The two relay ports of a pair allocated from 127.0.0.1 (a) and 127.0.0.2 (b), and a
/// socket of each node whose source the relay has learned.
struct Pair {
    port_a: SocketAddr,
    port_b: SocketAddr,
    sock_a: UdpSocket,
    sock_b: UdpSocket,
}

impl Pair {
    /// a sends first (dropped: b is not known yet), then b, whose datagram reaches a
    /// out of a's port.
    async fn learned(server: &RunningServer, a: &AllocateResponse, b: &AllocateResponse) -> Self {
        let port_a: SocketAddr = format!("127.0.0.1:{}", a.port).parse().unwrap();
        let port_b: SocketAddr = format!("127.0.0.1:{}", b.port).parse().unwrap();
        let sock_a = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let sock_b = UdpSocket::bind("127.0.0.2:0").await.unwrap();
        sock_a.send_to(b"a1", port_a).await.unwrap();
        metric_reaches(
            server,
            "discovery_relay_datagrams_total{result=\"peer_unknown\"}",
            1.0,
        )
        .await;
        sock_b.send_to(b"b1", port_b).await.unwrap();
        assert_eq!(recv(&sock_a).await, (b"b1".to_vec(), port_a));
        Self {
            port_a,
            port_b,
            sock_a,
            sock_b,
        }
    }
}

#[tokio::test]
async fn a_pair_exchanges_datagrams_through_its_ports_and_strangers_are_dropped() {
    let server = server_common::start(relay_config(RelayLimits::default())).await;
    join(&server, "cluster", &["node-a", "node-b"]).await;
    let a = allocate(&server, "node-a", "node-b", "127.0.0.1")
        .await
        .unwrap();
    let b = allocate(&server, "node-b", "node-a", "127.0.0.2")
        .await
        .unwrap();
    assert_ne!(a.port, b.port);
    assert_eq!((a.address.as_str(), a.ttl_seconds), ("", 300));
    assert_eq!(
        (a.observed_address.as_str(), b.observed_address.as_str()),
        ("127.0.0.1", "127.0.0.2")
    );
    // A refresh returns the same port.
    let again = allocate(&server, "node-a", "node-b", "127.0.0.1")
        .await
        .unwrap();
    assert_eq!(again.port, a.port);
    assert_eq!(metric(&server, "discovery_relay_allocations"), 1.0);

    let Pair {
        port_a,
        port_b,
        sock_a,
        sock_b,
    } = Pair::learned(&server, &a, &b).await;
    let stranger = UdpSocket::bind("127.0.0.3:0").await.unwrap();
    sock_a.send_to(b"a2", port_a).await.unwrap();
    assert_eq!(recv(&sock_b).await, (b"a2".to_vec(), port_b));
    // A stranger on either port is dropped; the pair's next datagram is what arrives.
    stranger.send_to(b"evil", port_a).await.unwrap();
    stranger.send_to(b"evil", port_b).await.unwrap();
    metric_reaches(
        &server,
        "discovery_relay_datagrams_total{result=\"source\"}",
        2.0,
    )
    .await;
    sock_a.send_to(b"a3", port_a).await.unwrap();
    assert_eq!(recv(&sock_b).await.0, b"a3");
    assert_eq!(
        metric(
            &server,
            "discovery_relay_datagrams_total{result=\"forwarded\"}"
        ),
        3.0
    );
    assert_eq!(
        metric(&server, "discovery_relay_forwarded_bytes_total"),
        6.0
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn bad_requests_name_the_field_and_allocate_nothing() {
    let server = server_common::start(relay_config(RelayLimits::default())).await;
    let mut c = client(&server).await;
    let status = c.allocate(request("a", "b", &[1; 31])).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(status.message(), "pair_token is 31 bytes, not 32");
    let status = allocate(&server, "a", "a", "127.0.0.1").await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().starts_with("peer_affiliate_id"),
        "{status:?}"
    );
    let status = allocate(&server, "", "b", "127.0.0.1").await.unwrap_err();
    assert_eq!(status.message(), "affiliate_id is empty");
    assert_eq!(metric(&server, "discovery_relay_allocations"), 0.0);
    assert_eq!(
        metric(
            &server,
            "grpc_server_handled_total{grpc_method=\"Allocate\",grpc_code=\"InvalidArgument\"}"
        ),
        3.0
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn limits_refuse_new_pairs_with_resource_exhausted() {
    let limits = RelayLimits {
        max_allocations: 1,
        ..RelayLimits::default()
    };
    let server = server_common::start(relay_config(limits)).await;
    join(&server, "cluster", &["a", "b", "c"]).await;
    allocate(&server, "a", "b", "127.0.0.1").await.unwrap();
    let status = allocate(&server, "a", "c", "127.0.0.1").await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(
        status.message().contains("maximum of 1 allocations"),
        "{status:?}"
    );
    // The pair that has one still refreshes it.
    allocate(&server, "b", "a", "127.0.0.2").await.unwrap();
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_server_without_the_relay_answers_unimplemented() {
    let server = server_common::start(ServerConfig::default()).await;
    let status = allocate(&server, "a", "b", "127.0.0.1").await.unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn allocate_is_refused_unless_both_nodes_are_live_affiliates_of_a_known_cluster() {
    let server = server_common::start(relay_config(RelayLimits::default())).await;
    // No such cluster: no free UDP proxy for strangers.
    let status = allocate(&server, "a", "b", "127.0.0.1").await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(status.message().starts_with("cluster_id"), "{status:?}");
    join(&server, "cluster", &["a"]).await;
    let status = allocate(&server, "x", "a", "127.0.0.1").await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(status.message().starts_with("affiliate_id"), "{status:?}");
    let status = allocate(&server, "a", "b", "127.0.0.1").await.unwrap_err();
    assert!(
        status.message().starts_with("peer_affiliate_id"),
        "{status:?}"
    );
    assert_eq!(metric(&server, "discovery_relay_allocations"), 0.0);
    assert_eq!(
        metric(
            &server,
            "discovery_relay_allocate_requests_total{result=\"absent\"}"
        ),
        3.0
    );
    join(&server, "cluster", &["b"]).await;
    allocate(&server, "a", "b", "127.0.0.1").await.unwrap();
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_cluster_holds_at_most_its_share_of_allocations() {
    let server = server_common::start(relay_config(RelayLimits {
        max_per_cluster: 1,
        ..RelayLimits::default()
    }))
    .await;
    join(&server, "cluster", &["a", "b", "c"]).await;
    allocate(&server, "a", "b", "127.0.0.1").await.unwrap();
    let status = allocate(&server, "a", "c", "127.0.0.1").await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(
        status.message().contains("cluster holds its maximum of 1"),
        "{status:?}"
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_full_descriptor_budget_refuses_allocations_and_hello_still_works() {
    let server = server_common::start(relay_config(RelayLimits {
        max_fds: 6,
        ..RelayLimits::default()
    }))
    .await;
    let peers = ["p1", "p2", "p3", "p4"];
    join(&server, "cluster", &["a"]).await;
    join(&server, "cluster", &peers).await;
    for peer in &peers[..3] {
        allocate(&server, "a", peer, "127.0.0.1").await.unwrap();
    }
    let status = allocate(&server, "a", "p4", "127.0.0.1").await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(
        status.message().contains("budget of 6 file descriptors"),
        "{status:?}"
    );
    // Allocated pairs still refresh, and a new connection says Hello.
    allocate(&server, "p1", "a", "127.0.0.2").await.unwrap();
    let mut c = server_common::client(&server).await;
    c.hello(HelloRequest {
        cluster_id: "cluster".into(),
        client_version: "v1".into(),
    })
    .await
    .unwrap();
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn another_port_of_a_nodes_address_does_not_redirect_the_pair_until_it_allocates_again() {
    let server = server_common::start(relay_config(RelayLimits::default())).await;
    join(&server, "cluster", &["node-a", "node-b"]).await;
    let a = allocate(&server, "node-a", "node-b", "127.0.0.1")
        .await
        .unwrap();
    let b = allocate(&server, "node-b", "node-a", "127.0.0.2")
        .await
        .unwrap();
    let Pair {
        port_a,
        port_b,
        sock_a,
        sock_b,
    } = Pair::learned(&server, &a, &b).await;
    // Another socket on node a's address: its NAT's next mapping, or an attacker there.
    let other = UdpSocket::bind("127.0.0.1:0").await.unwrap();

    other.send_to(b"hijack", port_a).await.unwrap();
    metric_reaches(
        &server,
        "discovery_relay_datagrams_total{result=\"port\"}",
        1.0,
    )
    .await;
    sock_b.send_to(b"b2", port_b).await.unwrap();
    assert_eq!(recv(&sock_a).await.0, b"b2");

    // Node a allocates again (its mapping moved): its next datagram's port is learned.
    allocate(&server, "node-a", "node-b", "127.0.0.1")
        .await
        .unwrap();
    other.send_to(b"a2", port_a).await.unwrap();
    assert_eq!(recv(&sock_b).await.0, b"a2");
    sock_b.send_to(b"b3", port_b).await.unwrap();
    assert_eq!(recv(&other).await.0, b"b3");
    server.shutdown().await.unwrap();
}

/// Finding: allocations that only claimed a node's address in `X-Real-IP` used up that
/// address's share and locked the node out. Sides bind to the connection's address.
#[tokio::test]
async fn a_header_naming_another_address_binds_nothing_to_it() {
    let limits = RelayLimits {
        max_per_address: 2,
        ..RelayLimits::default()
    };
    let server = server_common::start(relay_config(limits)).await;
    join(
        &server,
        "cluster",
        &["node-a", "node-b", "node-c", "node-d"],
    )
    .await;
    let mut attacker = RelayClient::new(channel_from(&server, "127.0.0.3").await);
    for peer in ["node-c", "node-d"] {
        let mut req = request("node-a", peer, &[1; 32]);
        for header in ["x-real-ip", "x-forwarded-for"] {
            req.metadata_mut()
                .insert(header, "127.0.0.2".parse().unwrap());
        }
        let granted = attacker.allocate(req).await.unwrap().into_inner();
        assert_eq!(granted.observed_address, "127.0.0.3");
    }
    // The address the headers named still has its whole share.
    allocate(&server, "node-b", "node-a", "127.0.0.2")
        .await
        .unwrap();
    allocate(&server, "node-b", "node-c", "127.0.0.2")
        .await
        .unwrap();
    // The attacker's own address has used its share.
    let refused = allocate(&server, "node-c", "node-d", "127.0.0.3")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
}
