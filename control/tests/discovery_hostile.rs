//! A hostile discovery server (garbage blobs, odd IDs, an endless stream, oversized
//! messages) cannot crash the node or pollute its affiliates.

mod discovery_common;

use std::{collections::BTreeSet, net::SocketAddr, pin::Pin, time::Duration};

use discovery_common::{config_text, TestNode, SECRET};
use futures::{Stream, StreamExt as _};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use wirespan_control::{
    resources::cluster::{DiscoveryServiceStatus, Member, NS, NS_RAW},
    runtime::{Filter, Kind, ResourceKind},
};
use wirespan_discovery::{
    client::{crypto::Cipher, AffiliateInfo, ClusterSecret},
    proto::server::{
        self as pb,
        cluster_server::{Cluster, ClusterServer},
    },
    server::{self, ServerConfig},
};

const TTL: Duration = Duration::from_secs(30);
const OVERSIZED: usize = 17 << 20;

#[derive(Clone, Copy)]
enum Mode {
    /// Snapshot of garbage plus one valid affiliate, then garbage forever.
    GarbageForever,
    /// One message above the client's 16 MiB limit, on every Watch.
    Oversized,
}

#[derive(Clone)]
struct Hostile {
    mode: Mode,
    valid: pb::Affiliate,
}

fn garbage(i: u64) -> pb::Affiliate {
    let n = usize::try_from(i % 97).unwrap();
    pb::Affiliate {
        id: match i % 4 {
            0 => String::new(),
            1 => "x/".repeat(600),
            2 => format!("garbage{i}"),
            _ => "validPeer".into(), // garbage for a known ID must not replace it
        },
        data: (0..n * 23).map(|b| (b as u8) ^ (i as u8)).collect(),
        endpoints: vec![vec![0xAB; 15], vec![i as u8; 16], vec![0; 48], Vec::new()],
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::WatchResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl Cluster for Hostile {
    async fn hello(
        &self,
        _: tonic::Request<pb::HelloRequest>,
    ) -> Result<tonic::Response<pb::HelloResponse>, tonic::Status> {
        // A client IP of an impossible length.
        Ok(tonic::Response::new(pb::HelloResponse {
            redirect: None,
            client_ip: vec![1, 2, 3, 4, 5, 6, 7],
        }))
    }

    async fn affiliate_update(
        &self,
        _: tonic::Request<pb::AffiliateUpdateRequest>,
    ) -> Result<tonic::Response<pb::AffiliateUpdateResponse>, tonic::Status> {
        Ok(tonic::Response::new(pb::AffiliateUpdateResponse {}))
    }

    async fn affiliate_delete(
        &self,
        _: tonic::Request<pb::AffiliateDeleteRequest>,
    ) -> Result<tonic::Response<pb::AffiliateDeleteResponse>, tonic::Status> {
        Ok(tonic::Response::new(pb::AffiliateDeleteResponse {}))
    }

    async fn list(
        &self,
        _: tonic::Request<pb::ListRequest>,
    ) -> Result<tonic::Response<pb::ListResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("no"))
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        _: tonic::Request<pb::WatchRequest>,
    ) -> Result<tonic::Response<WatchStream>, tonic::Status> {
        let stream: WatchStream = match self.mode {
            Mode::GarbageForever => {
                let mut snapshot: Vec<pb::Affiliate> = (0..40).map(garbage).collect();
                snapshot.push(self.valid.clone());
                let first = pb::WatchResponse {
                    affiliates: snapshot,
                    deleted: false,
                };
                Box::pin(futures::stream::once(async { Ok(first) }).chain(
                    futures::stream::iter(40u64..).map(|i| {
                        Ok(pb::WatchResponse {
                            affiliates: vec![garbage(i), garbage(i + 1)],
                            deleted: false,
                        })
                    }),
                ))
            }
            Mode::Oversized => Box::pin(
                futures::stream::once(async {
                    Ok(pb::WatchResponse {
                        affiliates: vec![pb::Affiliate {
                            id: "big".into(),
                            data: vec![0x5A; OVERSIZED],
                            endpoints: Vec::new(),
                        }],
                        deleted: false,
                    })
                })
                .chain(futures::stream::pending()),
            ),
        };
        Ok(tonic::Response::new(stream))
    }
}

async fn start_hostile(mode: Mode, cancel: CancellationToken) -> SocketAddr {
    let key: [u8; 32] = std::array::from_fn(|i| u8::try_from(i).unwrap());
    let info = AffiliateInfo {
        node_id: "validPeer".into(),
        hostname: "valid.example".into(),
        ..AffiliateInfo::default()
    };
    let valid = pb::Affiliate {
        id: "validPeer".into(),
        data: Cipher::new(&ClusterSecret::from_bytes(key))
            .seal_affiliate(&info.encode(), &mut rand::thread_rng()),
        endpoints: Vec::new(),
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(
                ClusterServer::new(Hostile { mode, valid }).max_encoding_message_size(usize::MAX),
            )
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                cancel.cancelled_owned(),
            ),
    );
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_an_endless_stream_leave_only_the_valid_affiliate() {
    let cancel = CancellationToken::new();
    let addr = start_hostile(Mode::GarbageForever, cancel.clone()).await;
    let node = TestNode::start(
        0,
        &config_text(SECRET, &[("evil", format!("http://{addr}"))]),
        TTL,
    );
    node.wait_members(&BTreeSet::from([node.node_id.clone(), "validPeer".into()]))
        .await;
    node.wait_until(
        "connected",
        &Kind::new(NS, DiscoveryServiceStatus::TYPE),
        |s| {
            s.get::<DiscoveryServiceStatus>(NS, "evil").is_ok_and(|st| {
                st.spec.connected && st.spec.affiliate_count == 1 && st.spec.public_ip.is_none()
            })
        },
    )
    .await;
    // The flood goes on; the node stays responsive: a local change still propagates.
    discovery_common::set::<wirespan_control::resources::network::HostnameStatus>(
        &node.store,
        "network",
        "hostname",
        wirespan_control::resources::network::HostnameStatusSpec {
            hostname: "still-alive".into(),
            domainname: String::new(),
        },
    );
    let me = node.node_id.clone();
    node.wait_until("local change", &Kind::new(NS, Member::TYPE), |s| {
        s.get::<Member>(NS, &me)
            .is_ok_and(|m| m.spec.hostname == "still-alive")
    })
    .await;
    let valid = node.store.get::<Member>(NS, "validPeer").unwrap();
    assert_eq!(
        valid.spec.hostname, "valid.example",
        "garbage for its ID kept the good copy"
    );
    let raw: Vec<String> = node
        .store
        .list::<wirespan_control::resources::cluster::Affiliate>(NS_RAW, &Filter::all())
        .iter()
        .map(|r| r.metadata.id.clone())
        .collect();
    assert_eq!(raw, vec!["evil/validPeer".to_owned(), node.node_id.clone()]);
    node.harness.stop().await.unwrap();
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_messages_are_refused_and_a_second_service_still_works() {
    let cancel = CancellationToken::new();
    let evil = start_hostile(Mode::Oversized, cancel.clone()).await;
    let good = server::spawn(
        ServerConfig {
            rate_limit: false,
            ..ServerConfig::default()
        },
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
    )
    .await
    .unwrap();
    let services = [
        ("evil", format!("http://{evil}")),
        ("good", format!("http://{}", good.local_addr())),
    ];
    let nodes: Vec<TestNode> = (0..2)
        .map(|i| TestNode::start(i, &config_text(SECRET, &services), TTL))
        .collect();
    let want: BTreeSet<String> = nodes.iter().map(|n| n.node_id.clone()).collect();
    for n in &nodes {
        n.wait_members(&want).await;
        n.wait_until(
            "oversized refused",
            &Kind::new(NS, DiscoveryServiceStatus::TYPE),
            |s| {
                s.get::<DiscoveryServiceStatus>(NS, "evil").is_ok_and(|st| {
                    !st.spec.connected
                        && st
                            .spec
                            .last_error
                            .as_deref()
                            .is_some_and(|e| e.starts_with("watch: ") && e.len() <= 256)
                })
            },
        )
        .await;
    }
    for n in nodes {
        n.harness.stop().await.unwrap();
    }
    good.shutdown().await.unwrap();
    cancel.cancel();
}
