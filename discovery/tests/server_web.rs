//! The metrics listener (scrape, landing page, inspect page) and TLS serving.

mod server_common;

use std::net::SocketAddr;

use server_common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
use wirespan_discovery::{
    proto::server::{cluster_client::ClusterClient, *},
    server::{self, ServerConfig, TlsFiles},
};

/// Minimal HTTP/1.1 GET; returns (status code, body).
async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out.split_once("\r\n\r\n").unwrap().1.to_owned();
    (status, body)
}

#[tokio::test]
async fn metrics_landing_and_inspect() {
    let server = start_with_metrics(ServerConfig::default()).await;
    let web = server.metrics_addr().unwrap();
    let mut c = client(&server).await;
    c.hello(HelloRequest {
        cluster_id: "c".into(),
        client_version: "v1.8.3".into(),
    })
    .await
    .unwrap();
    c.affiliate_update(update(
        "c",
        "node-<b>",
        b"SECRETBLOB",
        &[b"EP1", b"EP2"],
        60,
    ))
    .await
    .unwrap();
    let _ = c
        .affiliate_update(update("", "x", b"d", &[], 60))
        .await
        .unwrap_err();
    let mut w = open_watch(&mut c, "c").await;
    next(&mut w).await;

    let (status, text) = get(web, "/metrics").await;
    assert_eq!(status, 200);
    for line in [
        "discovery_state_clusters 1",
        "discovery_state_affiliates 1",
        "discovery_state_endpoints 2",
        "discovery_state_subscriptions 1",
        "discovery_server_hello_requests_total{client_version=\"v1.8\"} 1",
        "grpc_server_handled_total{grpc_method=\"AffiliateUpdate\",grpc_code=\"Ok\"} 1",
        "grpc_server_handled_total{grpc_method=\"AffiliateUpdate\",grpc_code=\"InvalidArgument\"} 1",
        "discovery_state_gc_runs_total 1",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    assert!(
        text.contains("grpc_server_handling_seconds_bucket"),
        "{text}"
    );

    let (status, page) = get(web, "/").await;
    assert_eq!(status, 200);
    assert!(page.contains("id=\"affiliates\">1<"), "{page}");

    let (status, page) = get(web, "/inspect?clusterID=c").await;
    assert_eq!(status, 200);
    assert!(page.contains("node-&lt;b&gt;"), "IDs are escaped: {page}");
    assert!(page.contains("<td>10</td><td>2</td>"), "{page}");
    assert!(
        !page.contains("SECRETBLOB") && !page.contains("EP1"),
        "{page}"
    );
    assert!(!page.contains(&hex_of(b"SECRETBLOB")), "{page}");

    let (status, _) = get(web, "/inspect?clusterID=nope").await;
    assert_eq!(status, 404);
    assert_eq!(
        server.counts().clusters,
        1,
        "inspect does not create clusters"
    );
    server.shutdown().await.unwrap();
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[tokio::test]
async fn tls_with_self_signed_certificate() {
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cert_path = dir.path().join("cert.pem");
    let key_path = dir.path().join("key.pem");
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.key_pair.serialize_pem()).unwrap();

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = server::spawn(
        ServerConfig {
            tls: Some(TlsFiles {
                cert: cert_path,
                key: key_path,
            }),
            ..ServerConfig::default()
        },
        listener,
    )
    .await
    .unwrap();
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(cert.cert.pem()))
        .domain_name("localhost");
    let channel = Endpoint::from_shared(format!("https://{}", server.local_addr()))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = ClusterClient::new(channel);
    let resp = c
        .hello(HelloRequest {
            cluster_id: "c".into(),
            client_version: "v1.8.3".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.client_ip, [127, 0, 0, 1]);
    let mut w = open_watch(&mut c, "c").await;
    next(&mut w).await;
    c.affiliate_update(update("c", "a", b"d", &[], 60))
        .await
        .unwrap();
    assert_eq!(next(&mut w).await.affiliates[0].id, "a");

    // A plaintext client cannot talk to the TLS listener.
    let plain = Endpoint::from_shared(format!("http://{}", server.local_addr()))
        .unwrap()
        .connect()
        .await;
    if let Ok(channel) = plain {
        assert!(ClusterClient::new(channel)
            .hello(HelloRequest {
                cluster_id: "c".into(),
                client_version: String::new(),
            })
            .await
            .is_err());
    }
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn unreadable_tls_files_fail_the_start() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let err = server::spawn(
        ServerConfig {
            tls: Some(TlsFiles {
                cert: "/nonexistent/cert.pem".into(),
                key: "/nonexistent/key.pem".into(),
            }),
            ..ServerConfig::default()
        },
        listener,
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("/nonexistent/cert.pem"), "{err}");
}

#[tokio::test]
async fn tls_negotiates_h2_only() {
    use std::sync::Arc;

    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("c.pem"), cert.cert.pem()).unwrap();
    std::fs::write(dir.path().join("k.pem"), cert.key_pair.serialize_pem()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = server::spawn(
        ServerConfig {
            tls: Some(TlsFiles {
                cert: dir.path().join("c.pem"),
                key: dir.path().join("k.pem"),
            }),
            ..ServerConfig::default()
        },
        listener,
    )
    .await
    .unwrap();

    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.cert.der().clone()).unwrap();
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let tcp = tokio::net::TcpStream::connect(server.local_addr())
        .await
        .unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    drop(tls);
    server.shutdown().await.unwrap();
}
