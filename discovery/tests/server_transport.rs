//! The transport limits through the real server over loopback sockets: connections
//! that never finish their handshake or their request are closed or cancelled, Watch
//! streams are not, HTTP/2 streams per connection and request sizes are capped, and
//! connections beyond the per-address or total cap are closed at accept, on both ports.

mod server_common;

use std::{net::SocketAddr, time::Duration};

use bytes::Bytes;
use server_common::{client, metric, next, open_watch, update};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpSocket, TcpStream},
    time::Instant,
};
use tonic::{transport::Endpoint, Code};
use wirespan_discovery::{
    proto::server::{cluster_client::ClusterClient, HelloRequest},
    server::{transport::TransportLimits, RunningServer, ServerConfig},
};

/// Short timeouts, so the tests take seconds.
fn config(limits: TransportLimits) -> ServerConfig {
    ServerConfig {
        transport: TransportLimits {
            handshake_timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(1),
            ..limits
        },
        ..ServerConfig::default()
    }
}

/// A TCP connection to `to` from the loopback address `from`.
async fn connect_from(from: &str, to: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket
        .bind(SocketAddr::new(from.parse().unwrap(), 0))
        .unwrap();
    socket.connect(to).await.unwrap()
}

/// How long until the server closes `stream` (EOF or reset), failing after `limit`.
async fn closed_within(stream: &mut TcpStream, limit: Duration) -> Duration {
    let start = Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout_at(start + limit, stream.read(&mut buf)).await {
            Err(_) => panic!("still open after {limit:?}"),
            Ok(Ok(0) | Err(_)) => return start.elapsed(),
            // The server's SETTINGS, an HTTP error page: keep reading.
            Ok(Ok(_)) => {}
        }
    }
}

async fn hello_from(server: &RunningServer, from: &str) -> Result<(), tonic::Status> {
    let channel = Endpoint::from_shared(format!("http://{}", server.local_addr()))
        .unwrap()
        .local_address(Some(from.parse().unwrap()))
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    ClusterClient::new(channel)
        .hello(HelloRequest {
            cluster_id: "c".into(),
            client_version: "v1".into(),
        })
        .await
        .map(drop)
}

#[tokio::test]
async fn a_connection_without_the_http2_preface_is_closed_after_the_handshake_timeout() {
    let server = server_common::start(config(TransportLimits::default())).await;
    let mut silent = connect_from("127.0.0.1", server.local_addr()).await;
    let mut partial = connect_from("127.0.0.1", server.local_addr()).await;
    partial.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    let took = closed_within(&mut silent, Duration::from_secs(5)).await;
    assert!(took >= Duration::from_millis(900), "closed after {took:?}");
    closed_within(&mut partial, Duration::from_secs(5)).await;
    assert_eq!(
        metric(
            &server,
            "discovery_connections_timed_out_total{listener=\"grpc\"}"
        ),
        2.0
    );
    // A real client is served.
    hello_from(&server, "127.0.0.1").await.unwrap();
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_tls_connection_that_never_finishes_its_handshake_is_closed() {
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("c.pem"), cert.cert.pem()).unwrap();
    std::fs::write(dir.path().join("k.pem"), cert.key_pair.serialize_pem()).unwrap();
    let server = server_common::start(ServerConfig {
        tls: Some(wirespan_discovery::server::TlsFiles {
            cert: dir.path().join("c.pem"),
            key: dir.path().join("k.pem"),
        }),
        ..config(TransportLimits::default())
    })
    .await;
    let mut silent = connect_from("127.0.0.1", server.local_addr()).await;
    // The start of a TLS record, never finished.
    let mut partial = connect_from("127.0.0.1", server.local_addr()).await;
    partial.write_all(&[0x16, 0x03, 0x01, 0x02]).await.unwrap();
    closed_within(&mut silent, Duration::from_secs(5)).await;
    closed_within(&mut partial, Duration::from_secs(5)).await;
    server.shutdown().await.unwrap();
}

/// An h2 client on a raw connection: it can leave a request body unfinished.
async fn h2_client(server: &RunningServer) -> h2::client::SendRequest<Bytes> {
    let tcp = TcpStream::connect(server.local_addr()).await.unwrap();
    let (send, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    send
}

/// The stream cap the server announces in its SETTINGS frame, read on a raw HTTP/2
/// connection once one call has had its answer (the server's SETTINGS precede it).
async fn advertised_stream_cap(server: &RunningServer) -> usize {
    let mut h2 = h2_client(server).await.ready().await.unwrap();
    let (response, _body) = h2.send_request(grpc_request("Hello"), true).unwrap();
    tokio::time::timeout(Duration::from_secs(5), response)
        .await
        .expect("the server answers")
        .unwrap();
    h2.current_max_send_streams()
}

fn grpc_request(method: &str) -> http::Request<()> {
    http::Request::post(format!(
        "http://localhost/sidero.discovery.server.Cluster/{method}"
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(())
    .unwrap()
}

#[tokio::test]
async fn a_request_whose_body_never_completes_is_cancelled_and_watch_streams_live_on() {
    let server = server_common::start(config(TransportLimits::default())).await;
    let mut c = client(&server).await;
    let mut watch = open_watch(&mut c, "c").await;
    next(&mut watch).await;

    let mut h2 = h2_client(&server).await.ready().await.unwrap();
    let (response, mut body) = h2.send_request(grpc_request("Hello"), false).unwrap();
    // A message of 100 bytes is announced; 10 arrive, the rest never does.
    let mut partial = vec![0u8, 0, 0, 0, 100];
    partial.extend([0u8; 10]);
    body.send_data(Bytes::from(partial), false).unwrap();
    let response = tokio::time::timeout(Duration::from_secs(5), response)
        .await
        .expect("an answer within 5 s")
        .unwrap();
    let status = tonic::Status::from_header_map(response.headers()).expect("a grpc-status");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert_eq!(
        metric(&server, "discovery_grpc_requests_timed_out_total"),
        1.0
    );

    // The Watch opened before is past the request timeout and still delivers.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    c.affiliate_update(update("c", "a", b"d", &[], 60))
        .await
        .unwrap();
    assert_eq!(next(&mut watch).await.affiliates[0].id, "a");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_request_over_the_size_cap_is_refused_before_it_is_buffered() {
    // The request timeout out of the way: the refusal must come from the cap.
    let mut config = config(TransportLimits::default());
    config.transport.request_timeout = Duration::from_secs(60);
    let server = server_common::start(config).await;
    let mut c = client(&server).await;
    let big = vec![0u8; 100 << 10];
    let status = c
        .affiliate_update(update("c", "a", &big, &[], 60))
        .await
        .unwrap_err();
    // Without the cap the state would see it and answer "affiliate data is too big".
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");

    // A client that announces 3.9 MiB is refused on the announcement.
    let mut h2 = h2_client(&server).await.ready().await.unwrap();
    let (response, mut body) = h2
        .send_request(grpc_request("AffiliateUpdate"), false)
        .unwrap();
    let announced: u32 = 3_900 << 10;
    let mut head = vec![0u8];
    head.extend(announced.to_be_bytes());
    body.send_data(Bytes::from(head), false).unwrap();
    let response = tokio::time::timeout(Duration::from_secs(5), response)
        .await
        .expect("refused on the announcement")
        .unwrap();
    let status = tonic::Status::from_header_map(response.headers()).expect("a grpc-status");
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn one_connection_holds_at_most_the_stream_cap_watch_streams_included() {
    let server = server_common::start(config(TransportLimits {
        max_concurrent_streams: 10,
        ..TransportLimits::default()
    }))
    .await;
    let mut c = client(&server).await;
    let mut watches = Vec::new();
    for _ in 0..10 {
        let mut w = open_watch(&mut c, "c").await;
        next(&mut w).await;
        watches.push(w);
    }
    // The cap is the server's SETTINGS_MAX_CONCURRENT_STREAMS: a client holds its
    // eleventh call until a stream ends (checked on the wire, not by waiting for a
    // call that must not be served).
    assert_eq!(advertised_stream_cap(&server).await, 10);
    let hello = {
        let mut c = c.clone();
        tokio::spawn(async move {
            c.hello(HelloRequest {
                cluster_id: "c".into(),
                client_version: "v1".into(),
            })
            .await
        })
    };
    drop(watches.pop());
    tokio::time::timeout(Duration::from_secs(5), hello)
        .await
        .expect("served once a stream ended")
        .unwrap()
        .unwrap();
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn connections_beyond_the_per_address_cap_are_closed_at_accept() {
    let server = server_common::start_with_metrics(config(TransportLimits {
        max_connections_per_ip: 2,
        handshake_timeout: Duration::from_secs(30),
        ..TransportLimits::default()
    }))
    .await;
    for (port, listener) in [
        (server.local_addr(), "grpc"),
        (server.metrics_addr().unwrap(), "web"),
    ] {
        let _held = [
            connect_from("127.0.0.1", port).await,
            connect_from("127.0.0.1", port).await,
        ];
        let mut third = connect_from("127.0.0.1", port).await;
        closed_within(&mut third, Duration::from_secs(3)).await;
        assert_eq!(
            metric(
                &server,
                &format!(
                    "discovery_connections_refused_total{{listener=\"{listener}\",reason=\"per_ip\"}}"
                )
            ),
            1.0
        );
    }
    // Another address is served while 127.0.0.1 is at its cap on the gRPC port.
    let _held = [
        connect_from("127.0.0.1", server.local_addr()).await,
        connect_from("127.0.0.1", server.local_addr()).await,
    ];
    hello_from(&server, "127.0.0.2").await.unwrap();
    assert!(hello_from(&server, "127.0.0.1").await.is_err());
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn connections_beyond_the_total_cap_are_closed_at_accept() {
    let server = server_common::start(config(TransportLimits {
        max_connections: 2,
        handshake_timeout: Duration::from_secs(30),
        ..TransportLimits::default()
    }))
    .await;
    let mut held = vec![
        connect_from("127.0.0.1", server.local_addr()).await,
        connect_from("127.0.0.2", server.local_addr()).await,
    ];
    let mut third = connect_from("127.0.0.3", server.local_addr()).await;
    closed_within(&mut third, Duration::from_secs(3)).await;
    assert_eq!(
        metric(
            &server,
            "discovery_connections_refused_total{listener=\"grpc\",reason=\"total\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(&server, "discovery_connections{listener=\"grpc\"}"),
        2.0
    );
    // A closed connection frees its place.
    drop(held.pop());
    let deadline = Instant::now() + Duration::from_secs(5);
    while hello_from(&server, "127.0.0.4").await.is_err() {
        assert!(Instant::now() < deadline, "no place freed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_metrics_port_slowloris_is_closed_after_the_header_timeout() {
    let server = server_common::start_with_metrics(config(TransportLimits::default())).await;
    let port = server.metrics_addr().unwrap();
    let mut slow = connect_from("127.0.0.1", port).await;
    slow.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let trickle = async {
        for i in 0..40 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if slow
                .write_all(format!("X-{i}: y\r\n").as_bytes())
                .await
                .is_err()
            {
                return;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), trickle)
        .await
        .expect("trickled headers stop being taken within 5 s");
    closed_within(&mut slow, Duration::from_secs(5)).await;
    let mut idle = connect_from("127.0.0.1", port).await;
    closed_within(&mut idle, Duration::from_secs(5)).await;
    assert_eq!(
        metric(
            &server,
            "discovery_connections_timed_out_total{listener=\"web\"}"
        ),
        2.0
    );
    // A complete request is answered.
    let mut ok = connect_from("127.0.0.1", port).await;
    ok.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    ok.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    server.shutdown().await.unwrap();
}
