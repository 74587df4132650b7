//! The discovery client against the project's real discovery server on loopback.

mod server_common;

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use aes::cipher::{Array, BlockCipherEncrypt, KeyInit};
use aes_gcm::{aead::Aead, Aes256Gcm};
use anyhow::{bail, Context, Result};
use server_common::metric;
use tokio::{net::TcpListener, sync::watch};
use tokio_util::sync::CancellationToken;
use wirespan_discovery::{
    client::{
        crypto::Cipher, AffiliateInfo, Client, ClientConfig, ClusterSecret, ConnectionState,
        DiscoveryState, KubeSpanInfo, MachineType,
    },
    proto::server::{
        cluster_client::ClusterClient, AffiliateDeleteRequest, AffiliateUpdateRequest, ListRequest,
    },
    server::{self, RunningServer, ServerConfig, TlsFiles},
};

const WAIT: Duration = Duration::from_secs(15);

fn secret() -> ClusterSecret {
    ClusterSecret::from_bytes(std::array::from_fn(|i| u8::try_from(i).unwrap()))
}

async fn start_server(redirect: Option<String>) -> Result<RunningServer> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    start_on(listener, redirect).await
}

async fn start_on(listener: TcpListener, redirect: Option<String>) -> Result<RunningServer> {
    let config = ServerConfig {
        rate_limit: false,
        redirect_endpoint: redirect,
        ..ServerConfig::default()
    };
    Ok(server::spawn(config, listener).await?)
}

struct Node {
    client: Client,
    state: watch::Receiver<DiscoveryState>,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Node {
    fn start(server: SocketAddr, cluster: &str, id: &str, key: ClusterSecret) -> Result<Self> {
        Self::with_config(config(&format!("http://{server}"), cluster, id, key))
    }

    fn with_config(config: ClientConfig) -> Result<Self> {
        let client = Client::new(config)?;
        let cancel = CancellationToken::new();
        let task = client.spawn(cancel.clone());
        Ok(Self {
            state: client.subscribe(),
            client,
            cancel,
            task,
        })
    }

    async fn wait_for(&mut self, what: &str, f: impl Fn(&DiscoveryState) -> bool) -> Result<()> {
        let ok = matches!(
            tokio::time::timeout(WAIT, self.state.wait_for(|s| f(s))).await,
            Ok(Ok(_))
        );
        if !ok {
            bail!("{what}: timed out; last state {:#?}", *self.state.borrow());
        }
        Ok(())
    }

    async fn stop(self) {
        self.cancel.cancel();
        let _ = self.task.await;
    }
}

fn config(endpoint: &str, cluster: &str, id: &str, key: ClusterSecret) -> ClientConfig {
    ClientConfig {
        endpoint: endpoint.into(),
        insecure: true,
        ca_pem: None,
        cluster_id: cluster.into(),
        secret: key,
        affiliate_id: id.into(),
        ttl: Duration::from_secs(60),
        client_version: "v0.1.0".into(),
    }
}

fn info(id: &str, n: u8) -> AffiliateInfo {
    AffiliateInfo {
        node_id: id.into(),
        addresses: vec![IpAddr::from([10, 0, 0, n])],
        hostname: format!("{id}.test"),
        nodename: id.into(),
        machine_type: MachineType::Worker,
        operating_system: "wirespan (test)".into(),
        kubespan: Some(KubeSpanInfo {
            public_key: format!("key-{id}"),
            address: format!("fd00::{n}").parse().unwrap(),
            additional_addresses: vec![format!("10.244.{n}.0/24").parse().unwrap()],
            exclude_advertised_networks: vec![],
        }),
        control_plane: None,
        wirespan: None,
    }
}

fn v4_endpoint(n: u8) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, n], 51820))
}

fn v6_endpoint(n: u8) -> SocketAddr {
    format!("[2001:db8::{n}]:51820").parse().unwrap()
}

/// Every node sees exactly the others, with their data.
async fn converge(nodes: &mut [Node], ids: &[String]) -> Result<()> {
    for (i, node) in nodes.iter_mut().enumerate() {
        let mut expected: Vec<String> = ids.iter().filter(|x| **x != ids[i]).cloned().collect();
        expected.sort(); // the map iterates in key order
        node.wait_for(&format!("{} sees the others", ids[i]), |s| {
            s.affiliates.keys().cloned().collect::<Vec<_>>() == expected
        })
        .await?;
    }
    Ok(())
}

#[tokio::test]
async fn two_clients_see_each_other_updates_and_deletes() -> Result<()> {
    let server = start_server(None).await?;
    let addr = server.local_addr();
    let mut a = Node::start(addr, "two", "node-a", secret())?;
    let mut b = Node::start(addr, "two", "node-b", secret())?;
    a.wait_for("a connected", |s| {
        s.connection == ConnectionState::Connected
    })
    .await?;
    assert!(
        a.state.borrow().affiliates.is_empty(),
        "empty snapshot first"
    );
    assert_eq!(
        a.state.borrow().public_ip,
        Some(IpAddr::from([127, 0, 0, 1])),
        "Hello client_ip is reported"
    );

    assert!(a
        .client
        .set_local_data(info("node-a", 1), vec![v4_endpoint(1)])?);
    assert!(b.client.set_local_data(info("node-b", 2), vec![])?);
    b.wait_for("b sees a", |s| s.affiliates.contains_key("node-a"))
        .await?;
    let seen = b.state.borrow().affiliates["node-a"].clone();
    assert_eq!(seen.info, info("node-a", 1));
    assert_eq!(seen.endpoints, vec![v4_endpoint(1)]);
    a.wait_for("a sees b", |s| s.affiliates.contains_key("node-b"))
        .await?;

    // Equal data: not sent again (b's view does not change).
    let version_before = b.state.borrow().clone();
    assert!(!a
        .client
        .set_local_data(info("node-a", 1), vec![v4_endpoint(1)])?);

    // An endpoint added later propagates.
    assert!(a
        .client
        .set_local_data(info("node-a", 1), vec![v4_endpoint(1), v6_endpoint(1)])?);
    b.wait_for("b sees a's second endpoint", |s| {
        s.affiliates
            .get("node-a")
            .is_some_and(|x| x.endpoints == [v4_endpoint(1), v6_endpoint(1)])
    })
    .await?;
    assert_ne!(*b.state.borrow(), version_before);

    // Delete propagates.
    a.client.delete_own_affiliate();
    b.wait_for("b sees a deleted", |s| !s.affiliates.contains_key("node-a"))
        .await?;

    // A stopped client no longer reports itself connected.
    let state = a.client.subscribe();
    a.stop().await;
    assert_eq!(state.borrow().connection, ConnectionState::Backoff);
    b.stop().await;
    server.shutdown().await?;
    Ok(())
}

/// Spec §9: n clients, each publishing an own IPv4 endpoint and an "other" IPv6
/// endpoint for its neighbour; everyone sees n−1 peers with exactly 2 endpoints.
/// The data the server lists for `id` in cluster `prey`.
async fn data_of(
    raw: &mut ClusterClient<tonic::transport::Channel>,
    id: &str,
) -> Result<Option<Vec<u8>>> {
    let list = raw
        .list(ListRequest {
            cluster_id: "prey".into(),
        })
        .await?
        .into_inner();
    Ok(list
        .affiliates
        .into_iter()
        .find(|x| x.id == id)
        .map(|x| x.data))
}

/// Someone else (a raw client with the cluster ID) deletes and then overwrites a
/// node's affiliate: the node re-publishes it at once, and its peer sees it back.
#[tokio::test]
async fn a_deleted_or_overwritten_own_affiliate_is_republished() -> Result<()> {
    let server = start_server(None).await?;
    let addr = server.local_addr();
    let mut a = Node::start(addr, "prey", "node-a", secret())?;
    let mut b = Node::start(addr, "prey", "node-b", secret())?;
    a.client
        .set_local_data(info("node-a", 1), vec![v4_endpoint(1)])?;
    b.wait_for("b sees a", |s| s.affiliates.contains_key("node-a"))
        .await?;
    let mut raw = ClusterClient::connect(format!("http://{addr}")).await?;
    let published = data_of(&mut raw, "node-a").await?.context("a listed")?;
    raw.affiliate_delete(AffiliateDeleteRequest {
        cluster_id: "prey".into(),
        affiliate_id: "node-a".into(),
    })
    .await?;
    a.wait_for("a re-published", |s| s.republishes == 1).await?;
    let deadline = tokio::time::Instant::now() + WAIT;
    while data_of(&mut raw, "node-a").await? != Some(published.clone()) {
        assert!(tokio::time::Instant::now() < deadline, "a not listed again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    b.wait_for("b sees a again", |s| s.affiliates.contains_key("node-a"))
        .await?;

    // Data the attacker cannot encrypt replaces it: back to what a published.
    raw.affiliate_update(AffiliateUpdateRequest {
        cluster_id: "prey".into(),
        affiliate_id: "node-a".into(),
        affiliate_data: Some(vec![0; 64]),
        affiliate_endpoints: vec![],
        ttl: None,
    })
    .await?;
    a.wait_for("a re-published again", |s| s.republishes == 2)
        .await?;
    let deadline = tokio::time::Instant::now() + WAIT;
    while data_of(&mut raw, "node-a").await? != Some(published.clone()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a's data not restored"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(b.state.borrow().republishes, 0, "b was not touched");
    a.stop().await;
    b.stop().await;
    server.shutdown().await?;
    Ok(())
}

async fn cluster_with_harvested_endpoints_converges(n: u8) -> Result<()> {
    let server = start_server(None).await?;
    let cluster = format!("harvest-{n}");
    let ids: Vec<String> = (0..n).map(|i| format!("node-{i}")).collect();
    let mut nodes = Vec::new();
    for i in 0..n {
        let node = Node::start(
            server.local_addr(),
            &cluster,
            &ids[usize::from(i)],
            secret(),
        )?;
        node.client
            .set_local_data(info(&ids[usize::from(i)], i + 1), vec![v4_endpoint(i + 1)])?;
        // Each node reports an IPv6 endpoint for its neighbour, as harvesting would.
        let next = (i + 1) % n;
        node.client.set_other_endpoints(BTreeMap::from([(
            ids[usize::from(next)].clone(),
            vec![v6_endpoint(next + 1)],
        )]));
        nodes.push(node);
    }
    converge(&mut nodes, &ids).await?;
    for (i, node) in nodes.iter_mut().enumerate() {
        node.wait_for(&format!("{} sees 2 endpoints per peer", ids[i]), |s| {
            s.affiliates.iter().all(|(id, a)| {
                let k: u8 = id.trim_start_matches("node-").parse().unwrap();
                // Server order is arrival order: own and harvested updates race.
                let mut got = a.endpoints.clone();
                got.sort();
                got == [v4_endpoint(k + 1), v6_endpoint(k + 1)]
            })
        })
        .await?;
    }
    for node in nodes {
        node.stop().await;
    }
    server.shutdown().await?;
    Ok(())
}

#[tokio::test]
async fn five_clients_with_harvested_endpoints_converge() -> Result<()> {
    cluster_with_harvested_endpoints_converges(5).await?;
    Ok(())
}

#[tokio::test]
async fn fifteen_clients_with_harvested_endpoints_converge() -> Result<()> {
    cluster_with_harvested_endpoints_converges(15).await?;
    Ok(())
}

/// 50 watchers each receive ~100 events in a burst, which can exceed the server's
/// 32-event watch queue; an aborted watcher recovers through a fresh Hello and
/// snapshot. (Like every test here, bounded only by the generous wait timeout:
/// speed targets belong in benchmarks.)
#[tokio::test]
async fn fifty_clients_with_harvested_endpoints_converge() -> Result<()> {
    cluster_with_harvested_endpoints_converges(50).await?;
    Ok(())
}

/// An affiliate built in the test straight from the spec's byte layout (hand-made
/// protobuf, AES-GCM and AES-ECB from the cipher crates, not the client's encoder)
/// is decoded by the client.
#[tokio::test]
async fn affiliate_encoded_from_spec_bytes_is_decoded() -> Result<()> {
    let server = start_server(None).await?;
    let addr = server.local_addr();
    let key: [u8; 32] = std::array::from_fn(|i| u8::try_from(i).unwrap());

    // Spec §6 (c) plaintext: node_id "node-a", addresses [10.0.0.1], hostname "a",
    // kubespan {public_key "PUBKEY=", address fd00::1}; then an unknown field 15.
    let mut plaintext = Vec::new();
    plaintext.extend_from_slice(&[0x0a, 6]);
    plaintext.extend_from_slice(b"node-a");
    plaintext.extend_from_slice(&[0x12, 4, 10, 0, 0, 1]);
    plaintext.extend_from_slice(&[0x1a, 1, b'a']);
    plaintext.extend_from_slice(&[0x3a, 0x1b, 0x0a, 7]);
    plaintext.extend_from_slice(b"PUBKEY=");
    plaintext.extend_from_slice(&[0x12, 16, 0xfd]);
    plaintext.extend_from_slice(&[0; 14]);
    plaintext.push(1);
    plaintext.extend_from_slice(&[0x7a, 2, b'x', b'y']);
    let nonce = [7u8; 12];
    let gcm = Aes256Gcm::new(&Array::from(key));
    let mut data = nonce.to_vec();
    data.extend(
        gcm.encrypt(&Array::from(nonce), plaintext.as_slice())
            .unwrap(),
    );

    // Spec §6 (a) endpoint 1.2.3.4:5678: length byte, protobuf, zero padding, ECB.
    let mut block = Array::from([
        0x09, 0x0a, 0x04, 1, 2, 3, 4, 0x10, 0xae, 0x2c, 0, 0, 0, 0, 0, 0,
    ]);
    aes::Aes256::new(&Array::from(key)).encrypt_block(&mut block);
    assert_eq!(
        block.as_slice(),
        [
            0xbc, 0x14, 0x90, 0x92, 0xd7, 0x74, 0x78, 0xce, 0xce, 0x88, 0x09, 0xc3, 0xe0, 0x15,
            0x38, 0x00
        ],
        "spec vector (a)"
    );

    let mut raw = ClusterClient::connect(format!("http://{addr}")).await?;
    raw.affiliate_update(AffiliateUpdateRequest {
        cluster_id: "bytes".into(),
        affiliate_id: "node-a".into(),
        affiliate_data: Some(data),
        affiliate_endpoints: vec![block.to_vec()],
        ttl: Some(prost_types::Duration {
            seconds: 60,
            nanos: 0,
        }),
    })
    .await?;

    let mut b = Node::start(addr, "bytes", "node-b", secret())?;
    b.wait_for("b decodes the hand-made affiliate", |s| {
        s.affiliates.contains_key("node-a")
    })
    .await?;
    let a = b.state.borrow().affiliates["node-a"].clone();
    assert_eq!(
        a.info,
        AffiliateInfo {
            node_id: "node-a".into(),
            addresses: vec![IpAddr::from([10, 0, 0, 1])],
            hostname: "a".into(),
            kubespan: Some(KubeSpanInfo {
                public_key: "PUBKEY=".into(),
                address: "fd00::1".parse().unwrap(),
                additional_addresses: vec![],
                exclude_advertised_networks: vec![],
            }),
            ..AffiliateInfo::default()
        }
    );
    assert_eq!(a.endpoints, vec!["1.2.3.4:5678".parse::<SocketAddr>()?]);
    b.stop().await;
    server.shutdown().await?;
    Ok(())
}

#[tokio::test]
async fn client_with_wrong_secret_is_ignored_while_others_work() -> Result<()> {
    let server = start_server(None).await?;
    let addr = server.local_addr();
    let mut a = Node::start(addr, "mixed", "node-a", secret())?;
    let mut b = Node::start(addr, "mixed", "node-b", secret())?;
    let mut x = Node::start(
        addr,
        "mixed",
        "node-x",
        ClusterSecret::from_bytes([0xee; 32]),
    )?;
    a.client
        .set_local_data(info("node-a", 1), vec![v4_endpoint(1)])?;
    b.client
        .set_local_data(info("node-b", 2), vec![v4_endpoint(2)])?;
    x.client
        .set_local_data(info("node-x", 9), vec![v4_endpoint(9)])?;
    a.wait_for("a sees b", |s| s.affiliates.contains_key("node-b"))
        .await?;
    b.wait_for("b sees a", |s| s.affiliates.contains_key("node-a"))
        .await?;
    x.wait_for("x connected", |s| {
        s.connection == ConnectionState::Connected
    })
    .await?;

    // x's data is on the server, yet nobody with the right key shows it.
    let mut raw = ClusterClient::connect(format!("http://{addr}")).await?;
    let listed = raw
        .list(ListRequest {
            cluster_id: "mixed".into(),
        })
        .await?
        .into_inner();
    assert_eq!(listed.affiliates.len(), 3);
    for node in [&a, &b] {
        let keys: Vec<String> = node.state.borrow().affiliates.keys().cloned().collect();
        assert!(!keys.contains(&"node-x".to_string()), "{keys:?}");
    }
    assert!(x.state.borrow().affiliates.is_empty(), "x decrypts nothing");
    for n in [a, b, x] {
        n.stop().await;
    }
    server.shutdown().await?;
    Ok(())
}

#[tokio::test]
async fn server_restart_on_same_port_reconnects_and_republishes() -> Result<()> {
    let server = start_server(None).await?;
    let addr = server.local_addr();
    let mut a = Node::start(addr, "restart", "node-a", secret())?;
    let mut b = Node::start(addr, "restart", "node-b", secret())?;
    a.client
        .set_local_data(info("node-a", 1), vec![v4_endpoint(1)])?;
    b.client
        .set_local_data(info("node-b", 2), vec![v4_endpoint(2)])?;
    a.wait_for("a sees b", |s| s.affiliates.contains_key("node-b"))
        .await?;
    b.wait_for("b sees a", |s| s.affiliates.contains_key("node-a"))
        .await?;

    server.shutdown().await?;
    a.wait_for("a notices", |s| s.connection != ConnectionState::Connected)
        .await?;

    // Same port, empty state (no snapshot file).
    let listener = TcpListener::bind(addr).await.context("rebind same port")?;
    let server = start_on(listener, None).await?;
    a.wait_for("a reconnected", |s| {
        s.connection == ConnectionState::Connected
    })
    .await?;
    b.wait_for("b reconnected", |s| {
        s.connection == ConnectionState::Connected
    })
    .await?;

    // Both republished without being told to: the new server holds both.
    let mut raw = ClusterClient::connect(format!("http://{addr}")).await?;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let listed = raw
            .list(ListRequest {
                cluster_id: "restart".into(),
            })
            .await?
            .into_inner();
        let mut ids: Vec<String> = listed.affiliates.into_iter().map(|a| a.id).collect();
        ids.sort();
        if ids == ["node-a", "node-b"] {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            bail!("server after restart holds {ids:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    a.wait_for("a sees b again", |s| s.affiliates.contains_key("node-b"))
        .await?;
    b.wait_for("b sees a again", |s| s.affiliates.contains_key("node-a"))
        .await?;
    a.stop().await;
    b.stop().await;
    server.shutdown().await?;
    Ok(())
}

#[tokio::test]
async fn redirect_is_followed() -> Result<()> {
    let target = start_server(None).await?;
    let target_addr = target.local_addr();
    let redirector = start_server(Some(target_addr.to_string())).await?;
    let mut a = Node::start(redirector.local_addr(), "redir", "node-a", secret())?;
    let mut b = Node::start(redirector.local_addr(), "redir", "node-b", secret())?;
    a.client.set_local_data(info("node-a", 1), vec![])?;
    b.client.set_local_data(info("node-b", 2), vec![])?;
    for (name, node) in [("a", &mut a), ("b", &mut b)] {
        node.wait_for(&format!("{name} on the target"), |s| {
            s.connection == ConnectionState::Connected && s.endpoint.port == target_addr.port()
        })
        .await?;
    }
    a.wait_for("a sees b", |s| s.affiliates.contains_key("node-b"))
        .await?;
    b.wait_for("b sees a", |s| s.affiliates.contains_key("node-a"))
        .await?;

    // Data went to the target, not to the redirecting instance.
    let mut raw = ClusterClient::connect(format!("http://{}", redirector.local_addr())).await?;
    let listed = raw
        .list(ListRequest {
            cluster_id: "redir".into(),
        })
        .await?
        .into_inner();
    assert!(listed.affiliates.is_empty(), "{listed:?}");

    // The old server drains; updates still propagate through the target.
    redirector.shutdown().await?;
    a.client
        .set_local_data(info("node-a", 1), vec![v4_endpoint(1)])?;
    b.wait_for("b sees a's new endpoint", |s| {
        s.affiliates
            .get("node-a")
            .is_some_and(|x| x.endpoints == [v4_endpoint(1)])
    })
    .await?;
    a.stop().await;
    b.stop().await;
    target.shutdown().await?;
    Ok(())
}

#[tokio::test]
async fn stopped_client_with_short_ttl_disappears_via_gc() -> Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let server = server::spawn(
        ServerConfig {
            rate_limit: false,
            gc_interval: Duration::from_millis(200),
            ..ServerConfig::default()
        },
        listener,
    )
    .await?;
    let addr = format!("http://{}", server.local_addr());
    let short = Node::with_config(ClientConfig {
        ttl: Duration::from_secs(1),
        ..config(&addr, "gc", "short", secret())
    })?;
    let mut watcher = Node::start(server.local_addr(), "gc", "watcher", secret())?;
    short.client.set_local_data(info("short", 1), vec![])?;
    watcher
        .wait_for("watcher sees short", |s| s.affiliates.contains_key("short"))
        .await?;
    // While running, refreshes every TTL/2 keep it alive past several TTLs: wait for
    // the server to take four updates (the first would have expired after two), then
    // for a GC pass after the last, and GC must have removed nothing.
    let updates = r#"grpc_server_handled_total{grpc_method="AffiliateUpdate",grpc_code="Ok"}"#;
    let gc_runs = "discovery_state_gc_runs_total";
    let gc_removed = "discovery_state_gc_affiliates_total";
    poll("four affiliate updates", || metric(&server, updates) >= 4.0).await?;
    let runs = metric(&server, gc_runs);
    poll("a GC pass after them", || metric(&server, gc_runs) > runs).await?;
    assert_eq!(
        metric(&server, gc_removed),
        0.0,
        "GC removed a refreshed affiliate"
    );
    assert!(watcher.state.borrow().affiliates.contains_key("short"));
    short.stop().await;
    watcher
        .wait_for("short expires", |s| !s.affiliates.contains_key("short"))
        .await?;
    assert_eq!(metric(&server, gc_removed), 1.0);
    watcher.stop().await;
    server.shutdown().await?;
    Ok(())
}

/// Polls `done` until it holds or [`WAIT`] passes.
async fn poll(what: &str, mut done: impl FnMut() -> bool) -> Result<()> {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !done() {
        if tokio::time::Instant::now() > deadline {
            bail!("{what}: timed out");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// A CA and a leaf for `localhost`/127.0.0.1, made with the openssl CLI.
fn make_certs(dir: &std::path::Path) -> Result<Vec<u8>> {
    let run = |args: &[&str]| -> Result<()> {
        match std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
        {
            Ok(out) if out.status.success() => Ok(()),
            Ok(out) => bail!("openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                bail!("the openssl CLI is missing (scripts/setup.sh installs it)")
            }
            Err(e) => Err(e.into()),
        }
    };
    std::fs::write(
        dir.join("leaf.ext"),
        "basicConstraints=CA:FALSE\nsubjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )?;
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let steps: [Vec<&str>; 3] = [
        [
            &["req", "-x509"][..],
            &ec,
            &[
                "-subj",
                "/CN=test-ca",
                "-days",
                "1",
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
            ],
        ]
        .concat(),
        [
            &["req"][..],
            &ec,
            &[
                "-subj",
                "/CN=localhost",
                "-keyout",
                "leaf.key",
                "-out",
                "leaf.csr",
            ],
        ]
        .concat(),
        vec![
            "x509",
            "-req",
            "-in",
            "leaf.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            "leaf.ext",
            "-out",
            "leaf.pem",
        ],
    ];
    for step in &steps {
        run(step)?;
    }
    Ok(std::fs::read(dir.join("ca.pem"))?)
}

#[tokio::test]
async fn tls_endpoint_with_custom_roots() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let ca = make_certs(dir.path())?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let server = server::spawn(
        ServerConfig {
            rate_limit: false,
            tls: Some(TlsFiles {
                cert: dir.path().join("leaf.pem"),
                key: dir.path().join("leaf.key"),
            }),
            ..ServerConfig::default()
        },
        listener,
    )
    .await?;
    let url = format!("https://localhost:{}", server.local_addr().port());
    let mut a = Node::with_config(ClientConfig {
        ca_pem: Some(ca.clone()),
        ..config(&url, "tls", "node-a", secret())
    })?;
    let mut b = Node::with_config(ClientConfig {
        ca_pem: Some(ca),
        // Bare host:port means TLS unless `insecure`.
        insecure: false,
        ..config(
            &format!("localhost:{}", server.local_addr().port()),
            "tls",
            "node-b",
            secret(),
        )
    })?;
    a.client.set_local_data(info("node-a", 1), vec![])?;
    b.client.set_local_data(info("node-b", 2), vec![])?;
    a.wait_for("a sees b over TLS", |s| s.affiliates.contains_key("node-b"))
        .await?;
    b.wait_for("b sees a over TLS", |s| s.affiliates.contains_key("node-a"))
        .await?;

    // A client that does not trust the CA never connects (and never panics).
    let other_dir = tempfile::tempdir()?;
    let wrong_ca = make_certs(other_dir.path())?;
    let mut c = Node::with_config(ClientConfig {
        ca_pem: Some(wrong_ca),
        ..config(&url, "tls", "node-c", secret())
    })?;
    c.client.set_local_data(info("node-c", 3), vec![])?;
    c.wait_for("c's connection attempt fails", |s| s.last_error.is_some())
        .await?;
    let error = c.state.borrow().last_error.clone().unwrap_or_default();
    assert!(error.contains("certificate"), "{error}");
    assert_ne!(c.state.borrow().connection, ConnectionState::Connected);
    // Nothing of c reached the server: the cluster holds a and b only.
    assert_eq!(metric(&server, "discovery_state_affiliates"), 2.0);
    assert!(!a.state.borrow().affiliates.contains_key("node-c"));
    for n in [a, b, c] {
        n.stop().await;
    }
    server.shutdown().await?;
    Ok(())
}

/// With a one-event watch queue the server aborts watchers on every burst; the
/// clients must recover (re-Hello, fresh snapshot) until everyone converges.
#[tokio::test]
async fn aborted_watchers_recover_with_a_fresh_snapshot() -> Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let server = server::spawn(
        ServerConfig {
            rate_limit: false,
            watch_queue: 1,
            ..ServerConfig::default()
        },
        listener,
    )
    .await?;
    let ids: Vec<String> = (0..8).map(|i| format!("node-{i}")).collect();
    let mut nodes = Vec::new();
    for (i, id) in (1u8..).zip(&ids) {
        let node = Node::start(server.local_addr(), "abort", id, secret())?;
        node.client
            .set_local_data(info(id, i), vec![v4_endpoint(i)])?;
        nodes.push(node);
    }
    converge(&mut nodes, &ids).await?;

    // A burst of concurrent updates overflows every one-event queue.
    let cipher = Cipher::new(&secret());
    let mut rng = rand::thread_rng();
    let raw = ClusterClient::connect(format!("http://{}", server.local_addr())).await?;
    let mut burst = tokio::task::JoinSet::new();
    let mut all = ids.clone();
    for k in 0..30u8 {
        let id = format!("burst-{k:02}");
        all.push(id.clone());
        let data = cipher.seal_affiliate(&info(&id, 100 + k).encode(), &mut rng);
        let mut raw = raw.clone();
        burst.spawn(async move {
            raw.affiliate_update(AffiliateUpdateRequest {
                cluster_id: "abort".into(),
                affiliate_id: id,
                affiliate_data: Some(data),
                affiliate_endpoints: vec![],
                ttl: Some(prost_types::Duration {
                    seconds: 60,
                    nanos: 0,
                }),
            })
            .await
        });
    }
    while let Some(result) = burst.join_next().await {
        result??;
    }
    converge(&mut nodes, &all).await?;
    for node in nodes {
        node.stop().await;
    }
    server.shutdown().await?;
    Ok(())
}
