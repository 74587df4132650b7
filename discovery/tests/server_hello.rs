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

/// A dual-stack listener on [::] sees IPv4 clients as ::ffff:a.b.c.d and reports
/// them as IPv4. Runs where IPv6 loopback exists: on this host, or else in a network
/// namespace of its own (a fresh one has `::1` on `lo`); fails when neither can be had.
#[test]
fn ipv6_and_v4_mapped_peers() {
    with_ipv6_loopback(|| async {
        let listener = tokio::net::TcpListener::bind("[::]:0").await.unwrap();
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
    });
}

fn has_ipv6_loopback() -> bool {
    std::net::TcpListener::bind("[::1]:0").is_ok()
}

/// Runs `test` on a current-thread runtime where `::1` can be bound: here, or on a
/// thread that moved into a new network namespace (freed with the thread, so nothing
/// to clean up). Panics, never skips, when neither works.
fn with_ipv6_loopback<F, Fut>(test: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let run = move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(test());
    };
    if has_ipv6_loopback() {
        return run();
    }
    let in_own_netns = std::thread::spawn(move || {
        // `unshare` moves only this thread; children it starts inherit the namespace.
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap_or_else(|e| {
            panic!(
                "this host has no IPv6 loopback and a network namespace with one cannot \
                 be made ({e}): run as root or enable IPv6 on lo"
            )
        });
        let up = std::process::Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .unwrap();
        assert!(up.success(), "ip link set lo up: {up}");
        assert!(
            has_ipv6_loopback(),
            "no IPv6 loopback even in a fresh network namespace: this kernel has no IPv6"
        );
        run();
    })
    .join();
    if let Err(panic) = in_own_netns {
        std::panic::resume_unwind(panic);
    }
}
