//! Cluster identity, affiliate merge and members, without a discovery server.

mod discovery_common;

use std::time::Duration;

use discovery_common::{set, set_config, SECRET};
use wirespan_control::{
    controllers::cluster::{register, DiscoveryOptions},
    resources::cluster::{
        Affiliate, AffiliateSpec, ClusterIdentity, KubeSpanAffiliateSpec, Member, CLUSTER, NS,
        NS_RAW,
    },
    runtime::{Pointer, ResourceKind, Runtime, Store, StoreOptions},
    testing::{assert_no_resource, assert_resource, Harness},
};

fn start() -> Harness {
    let store = Store::new(StoreOptions::default());
    let mut runtime = Runtime::new(store);
    register(
        &mut runtime,
        DiscoveryOptions {
            ttl: Duration::from_secs(30),
        },
    )
    .unwrap();
    Harness::start(runtime)
}

#[tokio::test]
async fn cluster_identity_follows_the_cluster_config_document() {
    let h = start();
    set_config(
        &h.store,
        &format!("apiVersion: v1alpha1\nkind: ClusterConfig\nid: my-cluster\nsecret: {SECRET}\n"),
    );
    let id = assert_resource::<ClusterIdentity>(&h.store, NS, CLUSTER, |r| {
        (r.spec.cluster_id == "my-cluster")
            .then_some(())
            .ok_or("id".into())
    })
    .await;
    assert_eq!(id.spec.secret.bytes()[31], 31);
    // The secret never leaves through serialization (API/CLI).
    let json = serde_json::to_string(&id.spec).unwrap();
    assert!(!json.contains("secret"), "{json}");
    set_config(
        &h.store,
        "apiVersion: v1alpha1\nkind: KubeSpanConfig\nenabled: true\n",
    );
    assert_no_resource(&h.store, &Pointer::new(NS, ClusterIdentity::TYPE, CLUSTER)).await;
    h.stop().await.unwrap();
}

fn raw(node: &str, hostname: &str, addrs: &[&str], endpoints: &[&str]) -> AffiliateSpec {
    AffiliateSpec {
        node_id: node.into(),
        hostname: hostname.into(),
        nodename: hostname.into(),
        machine_type: "worker".into(),
        addresses: addrs.iter().map(|a| a.parse().unwrap()).collect(),
        kubespan: Some(KubeSpanAffiliateSpec {
            public_key: "k".repeat(43) + "=",
            endpoints: endpoints.iter().map(|e| e.parse().unwrap()).collect(),
            ..KubeSpanAffiliateSpec::default()
        }),
        ..AffiliateSpec::default()
    }
}

#[tokio::test]
async fn raw_affiliates_of_two_services_merge_per_node_without_last_writer_wins() {
    let h = start();
    // Written in the "wrong" order on purpose: the merge order is by source name.
    set::<Affiliate>(
        &h.store,
        NS_RAW,
        "zeta/n1",
        raw("n1", "", &["10.0.0.1", "192.0.2.1"], &["192.0.2.1:51820"]),
    );
    set::<Affiliate>(
        &h.store,
        NS_RAW,
        "alpha/n1",
        raw("n1", "n1.lab", &["10.0.0.1"], &["10.0.0.1:51820"]),
    );
    set::<Affiliate>(
        &h.store,
        NS_RAW,
        "alpha/n2",
        raw("n2", "n2.lab", &["10.0.0.2"], &[]),
    );
    let merged = assert_resource::<Affiliate>(&h.store, NS, "n1", |r| {
        let eps = &r.spec.kubespan.as_ref().ok_or("no kubespan")?.endpoints;
        (eps.len() == 2)
            .then_some(())
            .ok_or(format!("endpoints {eps:?}"))
    })
    .await;
    assert_eq!(merged.spec.hostname, "n1.lab");
    let eps: Vec<String> = merged
        .spec
        .kubespan
        .as_ref()
        .unwrap()
        .endpoints
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        eps,
        ["10.0.0.1:51820", "192.0.2.1:51820"],
        "alpha first, then zeta's new item"
    );
    assert_eq!(merged.spec.addresses.len(), 2);
    let member = assert_resource::<Member>(&h.store, NS, "n2", |_| Ok(())).await;
    assert_eq!(member.spec.hostname, "n2.lab");
    assert_eq!(member.spec.machine_type, "worker");

    // One service forgetting n1 keeps the other's view; both forgetting removes it.
    h.store
        .destroy(&Pointer::new(NS_RAW, Affiliate::TYPE, "alpha/n1"), "")
        .unwrap();
    assert_resource::<Affiliate>(&h.store, NS, "n1", |r| {
        (r.spec.addresses.len() == 2 && r.spec.hostname.is_empty())
            .then_some(())
            .ok_or(format!("{:?}", r.spec))
    })
    .await;
    h.store
        .destroy(&Pointer::new(NS_RAW, Affiliate::TYPE, "zeta/n1"), "")
        .unwrap();
    assert_no_resource(&h.store, &Pointer::new(NS, Affiliate::TYPE, "n1")).await;
    assert_no_resource(&h.store, &Pointer::new(NS, Member::TYPE, "n1")).await;
    assert_resource::<Member>(&h.store, NS, "n2", |_| Ok(())).await;
    h.stop().await.unwrap();
}
