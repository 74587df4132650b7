//! Shared by the mesh's kernel tests: affiliates to feed, polling, and the KubeSpan
//! controllers registered with the real adapters for one namespace.

#![allow(dead_code)]

use std::{path::Path, sync::Arc, time::Duration};

use wirespan_control::{
    controllers::kubespan::{
        identity::IpLinkSource,
        manager::{ManagerDeps, MarkingFactory, OnStop},
        register, Deps, KernelWireGuard,
    },
    kubespan::clock::Clock,
    resources::{
        cluster::{
            Affiliate, AffiliateSpec, ClusterIdentity, ClusterIdentitySpec, KubeSpanAffiliateSpec,
        },
        identity::{NodeIdentity, NodeIdentitySpec},
    },
    runtime::{Resource, Runtime, Store},
    secret::Key32,
};
use wirespan_dataplane::{
    netns::NetnsGuard,
    sysctl::ProcSysctl,
    wireguard::{BackendChoice, PublicKey},
};

/// Public key of test peer `n`.
pub fn key(n: u8) -> String {
    PublicKey::from_bytes([n; 32]).to_base64()
}

/// Test peer `n`: a node address, a pod CIDR, a ULA and one endpoint.
pub fn affiliate(n: u8) -> AffiliateSpec {
    AffiliateSpec {
        node_id: format!("node{n}"),
        nodename: format!("n{n}"),
        addresses: vec![format!("10.5.0.{n}").parse().unwrap()],
        kubespan: Some(KubeSpanAffiliateSpec {
            public_key: key(n),
            address: Some(format!("fd21:4de:ec13:da02::{n}").parse().unwrap()),
            additional_addresses: vec![format!("10.244.{n}.0/24").parse().unwrap()],
            exclude_advertised_networks: Vec::new(),
            endpoints: vec![format!("192.0.2.{n}:51820").parse().unwrap()],
        }),
        ..AffiliateSpec::default()
    }
}

/// Polls `f` (a blocking probe of the namespace) until it returns `Some`.
pub async fn eventually<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    eventually_within(Duration::from_secs(20), what, f).await
}

/// [`eventually`] with a deadline of `limit` from now.
pub async fn eventually_within<T>(
    limit: Duration,
    what: &str,
    mut f: impl FnMut() -> Option<T>,
) -> T {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Registers the KubeSpan controllers as the daemon does, for `ns`: userspace
/// WireGuard, the given marking and clock, teardown on stop.
pub fn register_real(
    runtime: &mut Runtime,
    ns: &NetnsGuard,
    state_dir: &Path,
    marking: Arc<dyn MarkingFactory>,
    clock: Arc<dyn Clock>,
) {
    register(
        runtime,
        Deps {
            state_dir: state_dir.to_owned(),
            links: Arc::new(IpLinkSource(ns.netns().clone())),
            manager: ManagerDeps {
                wireguard: Arc::new(KernelWireGuard {
                    netns: ns.netns().clone(),
                    choice: BackendChoice::UserspaceGo,
                    wirespan_binary: None,
                }),
                marking,
                routing_cleanup: None,
                clock,
                metrics: None,
                on_stop: OnStop::Teardown,
                sysctl: Some(Arc::new(ProcSysctl::new(ns.netns().clone()))),
                prober: None,
            },
        },
    )
    .unwrap();
}

/// What the other controllers would have produced: the cluster identity (secret
/// `secret`), this node's identity (`node0`) and the affiliates of peers 1 and 2.
pub fn seed_cluster(store: &Store, secret: [u8; 32]) {
    store
        .create(
            Resource::<ClusterIdentity>::new(
                "cluster",
                "cluster",
                ClusterIdentitySpec {
                    cluster_id: "test-cluster-id".into(),
                    secret: Key32(secret),
                },
            ),
            "",
        )
        .unwrap();
    store
        .create(
            Resource::<NodeIdentity>::new(
                "cluster",
                "local",
                NodeIdentitySpec {
                    node_id: "node0".into(),
                },
            ),
            "",
        )
        .unwrap();
    for n in 1..=2 {
        let a = affiliate(n);
        store
            .modify::<Affiliate>("cluster", &a.node_id, "", |r| r.spec = a.clone())
            .unwrap();
    }
}
