//! Hello's client address: transport peer, X-Real-IP and X-Forwarded-For from a
//! trusted proxy only, IPv6, IPv4-mapped peers, and the option to not report it.

mod server_common;

use server_common::*;
use tonic::{
    transport::{Channel, Endpoint},
    Request,
};
use wirespan_discovery::{
    proto::server::{cluster_client::ClusterClient, *},
    server::{self, ServerConfig},
};

async fn hello_ip(c: &mut ClusterClient<Channel>, headers: &[(&'static str, &str)]) -> Vec<u8> {
    let mut req = Request::new(HelloRequest {
        cluster_id: "c".into(),
        client_version: "v1.8.3".into(),
    });
    for (k, v) in headers {
        req.metadata_mut().insert(*k, v.parse().unwrap());
    }
    c.hello(req).await.unwrap().into_inner().client_ip
}

fn behind_loopback_proxy() -> ServerConfig {
    ServerConfig {
        trusted_proxies: vec!["127.0.0.0/8".parse().unwrap()],
        ..ServerConfig::default()
    }
}

#[tokio::test]
async fn headers_from_a_trusted_proxy_take_precedence_over_peer() {
    let server = start(behind_loopback_proxy()).await;
    let mut c = client(&server).await;
    assert_eq!(hello_ip(&mut c, &[]).await, [127, 0, 0, 1]);
    assert_eq!(
        hello_ip(&mut c, &[("x-real-ip", "1.2.3.4")]).await,
        [1, 2, 3, 4]
    );
    assert_eq!(
        hello_ip(&mut c, &[("x-forwarded-for", "192.168.0.0.1, 5.6.7.8")]).await,
        [5, 6, 7, 8]
    );
    assert_eq!(
        hello_ip(
            &mut c,
            &[("x-forwarded-for", "5.6.7.8"), ("x-real-ip", "1.2.3.4")]
        )
        .await,
        [1, 2, 3, 4]
    );
    let v6 = hello_ip(&mut c, &[("x-real-ip", "2001:db8::1")]).await;
    assert_eq!(v6.len(), 16);
    assert_eq!(
        hello_ip(&mut c, &[("x-real-ip", "::ffff:9.8.7.6")]).await,
        [9, 8, 7, 6]
    );
    // Garbage falls through to the peer.
    assert_eq!(
        hello_ip(&mut c, &[("x-real-ip", "not-an-ip")]).await,
        [127, 0, 0, 1]
    );
    server.shutdown().await.unwrap();
}

/// By default no proxy is trusted: the headers are ignored.
#[tokio::test]
async fn untrusted_headers_and_disabled_reporting() {
    let server = start(ServerConfig::default()).await;
    let mut c = client(&server).await;
    assert_eq!(
        hello_ip(
            &mut c,
            &[("x-real-ip", "1.2.3.4"), ("x-forwarded-for", "5.6.7.8")]
        )
        .await,
        [127, 0, 0, 1]
    );
    server.shutdown().await.unwrap();

    let server = start(ServerConfig {
        report_client_ip: false,
        ..ServerConfig::default()
    })
    .await;
    let mut c = client(&server).await;
    assert!(hello_ip(&mut c, &[]).await.is_empty());
    assert!(hello_ip(&mut c, &[("x-real-ip", "1.2.3.4")])
        .await
        .is_empty());
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn ipv6_and_v4_mapped_peers() {
    // A dual-stack listener on [::] sees IPv4 clients as ::ffff:a.b.c.d.
    let Ok(listener) = tokio::net::TcpListener::bind("[::]:0").await else {
        eprintln!("no IPv6 on this host, skipping");
        return;
    };
    let port = listener.local_addr().unwrap().port();
    let server = server::spawn(ServerConfig::default(), listener)
        .await
        .unwrap();
    let connect = |url: String| async move {
        ClusterClient::new(Endpoint::from_shared(url).unwrap().connect().await.unwrap())
    };
    let mut v4 = connect(format!("http://127.0.0.1:{port}")).await;
    assert_eq!(hello_ip(&mut v4, &[]).await, [127, 0, 0, 1]);
    let mut v6 = connect(format!("http://[::1]:{port}")).await;
    let mut expected = [0u8; 16];
    expected[15] = 1;
    assert_eq!(hello_ip(&mut v6, &[]).await, expected);
    server.shutdown().await.unwrap();
}
