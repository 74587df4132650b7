//! Discovery controllers of several nodes against the project's real discovery server
//! on loopback (each node = its own store and runtime with only the cluster
//! controllers; the inputs of other helpers are created directly).

mod discovery_common;

use std::{collections::BTreeSet, net::SocketAddr, time::Duration};

use aes::cipher::{Array, BlockCipherEncrypt, KeyInit};
use aes_gcm::{aead::Aead, Aes256Gcm};
use discovery_common::{config_text, set, TestNode, CLUSTER_ID, OTHER_SECRET, SECRET};
use tokio::net::TcpListener;
use wirespan_control::{
    controllers::kubespan::peer_spec::KubeSpanPeerSpecController,
    resources::{
        cluster::{Affiliate, DiscoveryServiceStatus, Member, NS},
        kubespan::{self, KubeSpanPeerSpec},
        network::{HostnameStatus, HostnameStatusSpec},
    },
    runtime::{Filter, Kind, ResourceKind},
};
use wirespan_discovery::{
    proto::server::{cluster_client::ClusterClient, AffiliateUpdateRequest, ListRequest},
    server::{self, RunningServer, ServerConfig},
};

const TTL: Duration = Duration::from_secs(30);

async fn start_server_on(listener: TcpListener, redirect: Option<String>) -> RunningServer {
    server::spawn(
        ServerConfig {
            rate_limit: false,
            redirect_endpoint: redirect,
            ..ServerConfig::default()
        },
        listener,
    )
    .await
    .unwrap()
}

async fn start_server() -> RunningServer {
    start_server_on(TcpListener::bind("127.0.0.1:0").await.unwrap(), None).await
}

fn url(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

fn ids(nodes: &[TestNode]) -> BTreeSet<String> {
    nodes.iter().map(|n| n.node_id.clone()).collect()
}

fn start_nodes(n: u8, services: &[(&str, String)]) -> Vec<TestNode> {
    (0..n)
        .map(|i| TestNode::start(i, &config_text(SECRET, services), TTL))
        .collect()
}

async fn stop_all(nodes: Vec<TestNode>) {
    for n in nodes {
        n.harness.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_converge_and_publish_their_endpoints_and_public_ip() {
    let server = start_server().await;
    let nodes = start_nodes(2, &[("lab", url(server.local_addr()))]);
    let want = ids(&nodes);
    for n in &nodes {
        n.wait_members(&want).await;
    }
    let a = &nodes[0];
    let status_kind = Kind::new(NS, DiscoveryServiceStatus::TYPE);
    a.wait_until("status connected with public IP", &status_kind, |s| {
        s.get::<DiscoveryServiceStatus>(NS, "lab").is_ok_and(|st| {
            st.spec.connected
                && st.spec.public_ip == Some("127.0.0.1".parse().unwrap())
                && st.spec.affiliate_count == 1
                && st.spec.last_error.is_none()
        })
    })
    .await;
    // Node 1's affiliate as node 0 sees it: its routed address, hostname and the
    // endpoints of `docs/discovery-protocol.md` §4.2 (current address, then the Hello-reported public IP).
    let affiliate_kind = Kind::new(NS, Affiliate::TYPE);
    let peer = nodes[1].node_id.clone();
    a.wait_until("peer endpoints", &affiliate_kind, |s| {
        s.get::<Affiliate>(NS, &peer).is_ok_and(|r| {
            r.spec.kubespan.as_ref().is_some_and(|k| {
                k.endpoints
                    == [
                        "10.0.0.2:51820".parse().unwrap(),
                        "127.0.0.1:51820".parse().unwrap(),
                    ]
            })
        })
    })
    .await;
    let b = a.store.get::<Affiliate>(NS, &peer).unwrap();
    assert_eq!(b.spec.hostname, "node-1.lab");
    assert_eq!(b.spec.nodename, "node-1");
    // Its routed address and its KubeSpan ULA (published as upstream does).
    assert_eq!(
        b.spec.addresses,
        ["10.0.0.2", "fd00:1::2"].map(|a| a.parse::<std::net::IpAddr>().unwrap())
    );
    let ks = b.spec.kubespan.as_ref().unwrap();
    assert_eq!(ks.address, Some("fd00:1::2".parse().unwrap()));
    assert_eq!(ks.public_key, format!("{:0>43}=", 1));
    let m = a.store.get::<Member>(NS, &a.node_id).unwrap();
    assert_eq!(
        m.spec.hostname, "node-0.lab",
        "the local node is a member too"
    );
    assert!(m.spec.operating_system.starts_with("wirespan (v"));
    stop_all(nodes).await;
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_nodes_converge_to_the_same_member_set() {
    let server = start_server().await;
    let nodes = start_nodes(5, &[("lab", url(server.local_addr()))]);
    let want = ids(&nodes);
    for n in &nodes {
        n.wait_members(&want).await;
    }
    assert_eq!(server.counts().affiliates, 5);
    stop_all(nodes).await;
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_the_wrong_secret_is_ignored_while_the_others_work() {
    let server = start_server().await;
    let services = [("lab", url(server.local_addr()))];
    let mut nodes = start_nodes(2, &services);
    let want = ids(&nodes);
    for n in &nodes {
        n.wait_members(&want).await;
    }
    let bad = TestNode::start(2, &config_text(OTHER_SECRET, &services), TTL);
    bad.wait_members(&BTreeSet::from([bad.node_id.clone()]))
        .await;
    // The bad node's blob is on the server and was sent to every watcher before the
    // hostname change below; once node 0 has seen that change it has also processed
    // (and rejected) the bad blob.
    let deadline = tokio::time::Instant::now() + discovery_common::WAIT;
    while server.counts().affiliates < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "bad node never published"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    set::<HostnameStatus>(
        &nodes[1].store,
        HostnameStatus::DEFAULT_NAMESPACE,
        "hostname",
        HostnameStatusSpec {
            hostname: "renamed".into(),
            domainname: String::new(),
        },
    );
    let peer = nodes[1].node_id.clone();
    nodes[0]
        .wait_until("rename seen", &Kind::new(NS, Member::TYPE), |s| {
            s.get::<Member>(NS, &peer)
                .is_ok_and(|m| m.spec.hostname == "renamed")
        })
        .await;
    assert_eq!(nodes[0].members(), want);
    assert_eq!(bad.members(), BTreeSet::from([bad.node_id.clone()]));
    nodes.push(bad);
    stop_all(nodes).await;
    server.shutdown().await.unwrap();
}

// --- An affiliate encoded straight from the spec (docs/discovery-protocol.md §4, §5) ---

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push(u8::try_from(v & 0x7f).unwrap() | 0x80);
        v >>= 7;
    }
    out.push(u8::try_from(v).unwrap());
}

fn bytes_field(field: u64, data: &[u8], out: &mut Vec<u8>) {
    varint(field << 3 | 2, out);
    varint(data.len() as u64, out);
    out.extend_from_slice(data);
}

fn varint_field(field: u64, v: u64, out: &mut Vec<u8>) {
    varint(field << 3, out);
    varint(v, out);
}

const KEY: [u8; 32] = {
    let mut k = [0u8; 32];
    let mut i = 0;
    while i < 32 {
        k[i] = i as u8;
        i += 1;
    }
    k
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_affiliate_encoded_from_the_spec_is_decoded() {
    let server = start_server().await;
    // The node also runs the mesh's peer-spec controller: the foreign affiliate must
    // become a WireGuard peer spec exactly as a Talos node's would.
    let node = TestNode::start_with(
        0,
        &config_text(SECRET, &[("lab", url(server.local_addr()))]),
        TTL,
        |rt| rt.register(KubeSpanPeerSpecController::new()).unwrap(),
    );

    // Affiliate { node_id, addresses, hostname, nodename, machine_type, os, kubespan, control_plane }
    let mut kubespan = Vec::new();
    bytes_field(1, format!("{:B>43}=", "").as_bytes(), &mut kubespan);
    bytes_field(
        2,
        &"fd00:1::99".parse::<std::net::Ipv6Addr>().unwrap().octets(),
        &mut kubespan,
    );
    let mut prefix = Vec::new();
    bytes_field(1, &[10, 244, 9, 0], &mut prefix);
    varint_field(2, 24, &mut prefix);
    bytes_field(3, &prefix, &mut kubespan);
    let mut cp = Vec::new();
    varint_field(1, 6443, &mut cp);
    let mut pb = Vec::new();
    bytes_field(1, b"talosNode", &mut pb);
    bytes_field(2, &[192, 0, 2, 10], &mut pb);
    bytes_field(
        2,
        &"2001:db8::10"
            .parse::<std::net::Ipv6Addr>()
            .unwrap()
            .octets(),
        &mut pb,
    );
    bytes_field(2, &[1, 2, 3], &mut pb); // wrong length: only this item is skipped
    bytes_field(3, b"talos-1.example", &mut pb);
    bytes_field(4, b"talos-1", &mut pb);
    bytes_field(5, b"controlplane", &mut pb);
    bytes_field(6, b"Talos (v1.9.0)", &mut pb);
    bytes_field(7, &kubespan, &mut pb);
    bytes_field(8, &cp, &mut pb);
    bytes_field(99, b"unknown field, ignored", &mut pb);

    // AES-256-GCM: nonce ‖ ciphertext ‖ tag, no associated data.
    let nonce = [7u8; 12];
    let sealed = Aes256Gcm::new(&Array::from(KEY))
        .encrypt(&Array::from(nonce), pb.as_slice())
        .unwrap();
    let data = [nonce.as_slice(), &sealed].concat();

    // Endpoint blob: len(pb) ‖ pb, zero-padded to 16, AES-256-ECB.
    let mut ep = Vec::new();
    bytes_field(1, &[192, 0, 2, 10], &mut ep);
    varint_field(2, 51820, &mut ep);
    let mut block = [0u8; 16];
    block[0] = u8::try_from(ep.len()).unwrap();
    block[1..=ep.len()].copy_from_slice(&ep);
    let mut block = Array::from(block);
    aes::Aes256::new(&Array::from(KEY)).encrypt_block(&mut block);

    let mut grpc = ClusterClient::connect(url(server.local_addr()))
        .await
        .unwrap();
    grpc.affiliate_update(AffiliateUpdateRequest {
        cluster_id: CLUSTER_ID.into(),
        affiliate_id: "talosNode".into(),
        affiliate_data: Some(data),
        affiliate_endpoints: vec![block.to_vec()],
        ttl: Some(prost_types_duration(60)),
    })
    .await
    .unwrap();

    node.wait_until("foreign affiliate", &Kind::new(NS, Affiliate::TYPE), |s| {
        s.get::<Affiliate>(NS, "talosNode").is_ok()
    })
    .await;
    let a = node.store.get::<Affiliate>(NS, "talosNode").unwrap();
    assert_eq!(a.spec.node_id, "talosNode");
    assert_eq!(a.spec.hostname, "talos-1.example");
    assert_eq!(a.spec.nodename, "talos-1");
    assert_eq!(a.spec.machine_type, "controlplane");
    assert_eq!(a.spec.operating_system, "Talos (v1.9.0)");
    let addrs: Vec<String> = a.spec.addresses.iter().map(ToString::to_string).collect();
    assert_eq!(addrs, ["192.0.2.10", "2001:db8::10"]);
    let ks = a.spec.kubespan.as_ref().unwrap();
    assert_eq!(ks.public_key, format!("{:B>43}=", ""));
    assert_eq!(ks.address, Some("fd00:1::99".parse().unwrap()));
    assert_eq!(
        ks.additional_addresses,
        ["10.244.9.0/24".parse::<ipnet::IpNet>().unwrap()]
    );
    assert_eq!(
        ks.endpoints,
        ["192.0.2.10:51820".parse::<SocketAddr>().unwrap()]
    );
    assert_eq!(a.spec.control_plane.as_ref().unwrap().api_server_port, 6443);

    // Spec §5.3: pod CIDR, node addresses as host routes, the ULA; endpoints as sent.
    let key = format!("{:B>43}=", "");
    node.wait_until(
        "the Talos node as a peer",
        &Kind::new(kubespan::NS, KubeSpanPeerSpec::TYPE),
        |s| s.get::<KubeSpanPeerSpec>(kubespan::NS, &key).is_ok(),
    )
    .await;
    let peer = node
        .store
        .get::<KubeSpanPeerSpec>(kubespan::NS, &key)
        .unwrap();
    let allowed: Vec<String> = peer
        .spec
        .allowed_ips
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        allowed,
        [
            "10.244.9.0/24",
            "192.0.2.10/32",
            "2001:db8::10/128",
            "fd00:1::99/128"
        ]
    );
    assert_eq!(peer.spec.label, "talos-1");
    assert_eq!(
        peer.spec.endpoints,
        ["192.0.2.10:51820".parse::<SocketAddr>().unwrap()]
    );
    node.harness.stop().await.unwrap();
    server.shutdown().await.unwrap();
}

fn prost_types_duration(secs: i64) -> prost_types::Duration {
    prost_types::Duration {
        seconds: secs,
        nanos: 0,
    }
}

async fn list(addr: SocketAddr) -> BTreeSet<String> {
    let mut grpc = ClusterClient::connect(url(addr)).await.unwrap();
    grpc.list(ListRequest {
        cluster_id: CLUSTER_ID.into(),
    })
    .await
    .unwrap()
    .into_inner()
    .affiliates
    .into_iter()
    .map(|a| a.id)
    .collect()
}

/// Polls `f` against a deadline (for state outside any store).
async fn eventually<F: std::future::Future<Output = bool>>(what: &str, mut f: impl FnMut() -> F) {
    let deadline = tokio::time::Instant::now() + discovery_common::WAIT;
    while !f().await {
        assert!(tokio::time::Instant::now() < deadline, "{what}: timed out");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_clients_reconnect_and_republish() {
    let server = start_server().await;
    let addr = server.local_addr();
    let nodes = start_nodes(2, &[("lab", url(addr))]);
    let want = ids(&nodes);
    for n in &nodes {
        n.wait_members(&want).await;
    }
    server.shutdown().await.unwrap();
    // The fresh server starts empty; only the clients' republishing fills it.
    let server = start_server_on(TcpListener::bind(addr).await.unwrap(), None).await;
    assert_eq!(server.counts().affiliates, 0);
    eventually("republished", || {
        let want = want.clone();
        async move { list(addr).await == want }
    })
    .await;
    for n in &nodes {
        n.wait_members(&want).await;
        n.wait_until(
            "connected again",
            &Kind::new(NS, DiscoveryServiceStatus::TYPE),
            |s| {
                s.get::<DiscoveryServiceStatus>(NS, "lab")
                    .is_ok_and(|st| st.spec.connected)
            },
        )
        .await;
    }
    stop_all(nodes).await;
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirect_is_followed() {
    let target = start_server().await;
    let redirector = start_server_on(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        Some(target.local_addr().to_string()),
    )
    .await;
    let nodes = start_nodes(2, &[("lab", url(redirector.local_addr()))]);
    let want = ids(&nodes);
    for n in &nodes {
        n.wait_members(&want).await;
    }
    assert_eq!(list(target.local_addr()).await, want);
    assert!(list(redirector.local_addr()).await.is_empty());
    let st = nodes[0]
        .store
        .get::<DiscoveryServiceStatus>(NS, "lab")
        .unwrap();
    assert_eq!(st.spec.current_endpoint, url(target.local_addr()));
    assert_eq!(st.spec.endpoint, url(redirector.local_addr()));
    stop_all(nodes).await;
    redirector.shutdown().await.unwrap();
    target.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_services_one_down_still_converge() {
    let up = start_server().await;
    let down_addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let nodes = start_nodes(3, &[("down", url(down_addr)), ("up", url(up.local_addr()))]);
    let want = ids(&nodes);
    for n in &nodes {
        n.wait_members(&want).await;
        n.wait_until(
            "down service reports an error",
            &Kind::new(NS, DiscoveryServiceStatus::TYPE),
            |s| {
                s.get::<DiscoveryServiceStatus>(NS, "down")
                    .is_ok_and(|st| !st.spec.connected && st.spec.last_error.is_some())
            },
        )
        .await;
    }
    // Raw records come only from the working service.
    let raw: Vec<String> = nodes[0]
        .store
        .list::<Affiliate>(wirespan_control::resources::cluster::NS_RAW, &Filter::all())
        .iter()
        .map(|r| r.metadata.id.clone())
        .collect();
    assert!(
        raw.iter()
            .all(|id| id.starts_with("up/") || *id == nodes[0].node_id),
        "{raw:?}"
    );
    assert_eq!(raw.len(), 3);
    stop_all(nodes).await;
    up.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unchanged_local_data_is_not_reencrypted_and_harvested_endpoints_are_published() {
    use wirespan_control::resources::kubespan::{KubeSpanEndpoint, KubeSpanEndpointSpec};
    use wirespan_discovery::proto::server::WatchRequest;

    let server = start_server().await;
    let addr = server.local_addr();
    let nodes = start_nodes(2, &[("lab", url(addr))]);
    let want = ids(&nodes);
    for n in &nodes {
        n.wait_members(&want).await;
    }
    let (a, b) = (&nodes[0], &nodes[1]);
    // Wait until both nodes published their final data (public IP endpoint included).
    for n in &nodes {
        let peer = if n.node_id == a.node_id {
            &b.node_id
        } else {
            &a.node_id
        };
        n.wait_until(
            "peer has both endpoints",
            &Kind::new(NS, Affiliate::TYPE),
            |s| {
                s.get::<Affiliate>(NS, peer).is_ok_and(|r| {
                    r.spec
                        .kubespan
                        .as_ref()
                        .is_some_and(|k| k.endpoints.len() == 2)
                })
            },
        )
        .await;
    }
    let mut grpc = ClusterClient::connect(url(addr)).await.unwrap();
    let mut watch = grpc
        .watch(WatchRequest {
            cluster_id: CLUSTER_ID.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let snapshot = watch.message().await.unwrap().unwrap();
    assert_eq!(snapshot.affiliates.len(), 2);

    // A harvested endpoint for b wakes a's discovery controller, which hands the same
    // local data to its client again; it must not be re-encrypted (`docs/discovery-protocol.md` §8.7).
    set::<KubeSpanEndpoint>(
        &a.store,
        KubeSpanEndpoint::DEFAULT_NAMESPACE,
        &format!("{:0>43}=", 1),
        KubeSpanEndpointSpec {
            affiliate_id: b.node_id.clone(),
            endpoint: Some("192.0.2.77:51820".parse().unwrap()),
        },
    );
    let a_blob = snapshot
        .affiliates
        .iter()
        .find(|x| x.id == a.node_id)
        .map(|x| x.data.clone())
        .unwrap();
    // The refresh resends a's data (the server announces every data update, as
    // upstream does), but it must be the very same bytes: no new nonce.
    let deadline = tokio::time::Instant::now() + discovery_common::WAIT;
    loop {
        let next = tokio::time::timeout_at(deadline, watch.message())
            .await
            .expect("b's harvested endpoint never arrived")
            .unwrap()
            .unwrap();
        for x in &next.affiliates {
            if x.id == a.node_id {
                assert_eq!(x.data, a_blob, "a re-encrypted unchanged local data");
            }
        }
        if next
            .affiliates
            .iter()
            .any(|x| x.id == b.node_id && x.endpoints.len() == 3)
        {
            break;
        }
    }
    // And a sees the harvested endpoint on b's record.
    a.wait_until(
        "harvested endpoint visible",
        &Kind::new(NS, Affiliate::TYPE),
        |s| {
            s.get::<Affiliate>(NS, &b.node_id).is_ok_and(|r| {
                r.spec
                    .kubespan
                    .as_ref()
                    .is_some_and(|k| k.endpoints.contains(&"192.0.2.77:51820".parse().unwrap()))
            })
        },
    )
    .await;
    stop_all(nodes).await;
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_service_stops_its_client_and_removes_what_it_discovered() {
    let (s1, s2) = (start_server().await, start_server().await);
    let both = [("one", url(s1.local_addr())), ("two", url(s2.local_addr()))];
    let nodes = start_nodes(2, &both);
    let want = ids(&nodes);
    for n in &nodes {
        n.wait_members(&want).await;
    }
    let a = &nodes[0];
    let raw_kind = Kind::new(
        wirespan_control::resources::cluster::NS_RAW,
        Affiliate::TYPE,
    );
    let raw_ids = |s: &wirespan_control::runtime::Store| -> BTreeSet<String> {
        s.list::<Affiliate>(wirespan_control::resources::cluster::NS_RAW, &Filter::all())
            .iter()
            .map(|r| r.metadata.id.clone())
            .collect()
    };
    let peer = nodes[1].node_id.clone();
    a.wait_until("records from both services", &raw_kind, |s| {
        raw_ids(s).len() == 3
    })
    .await;

    // Drop service "two": its records and status go, "one" keeps the member set.
    discovery_common::set_config(&a.store, &config_text(SECRET, &both[..1]));
    a.wait_until("only service one", &raw_kind, |s| {
        raw_ids(s) == BTreeSet::from([a.node_id.clone(), format!("one/{peer}")])
    })
    .await;
    a.wait_until(
        "status of two removed",
        &Kind::new(NS, DiscoveryServiceStatus::TYPE),
        |s| s.get::<DiscoveryServiceStatus>(NS, "two").is_err(),
    )
    .await;
    assert_eq!(a.members(), want);

    // No service at all: nothing is published or discovered.
    discovery_common::set_config(&a.store, &config_text(SECRET, &[]));
    a.wait_members(&BTreeSet::new()).await;
    assert!(raw_ids(&a.store).is_empty());
    stop_all(nodes).await;
    s1.shutdown().await.unwrap();
    s2.shutdown().await.unwrap();
}
