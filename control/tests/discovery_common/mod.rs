//! Shared helpers of the discovery controller tests: one node = its own store and
//! runtime with only the cluster controllers, inputs created directly.

#![allow(dead_code)]

use std::{collections::BTreeSet, time::Duration};

use wirespan_control::{
    config,
    controllers::cluster::{register, DiscoveryOptions},
    resources::{
        cluster::{Member, NS},
        config::{MachineConfig, MachineConfigSpec, ACTIVE},
        identity::{NodeIdentity, NodeIdentitySpec, LOCAL},
        kubespan::{
            KubeSpanConfig, KubeSpanConfigSpec, KubeSpanIdentity, KubeSpanIdentitySpec, KUBESPAN,
        },
        network::{node_address, HostnameStatus, HostnameStatusSpec, NodeAddress, NodeAddressSpec},
    },
    runtime::{
        Event, Filter, Kind, Resource, ResourceKind, Runtime, Store, StoreOptions, WatchOptions,
    },
    testing::Harness,
};

/// Deadline of every wait in these tests.
pub const WAIT: Duration = Duration::from_secs(20);

pub const CLUSTER_ID: &str = "8XuV9TZHW08DOk3bVxQjH9ih_TBKjnh-j44tsCLSBzo=";
pub const SECRET: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
pub const OTHER_SECRET: &str = "HxwdHh8AAQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRo=";

/// Creates or replaces an unowned input resource.
#[allow(clippy::needless_pass_by_value)] // callers build the spec inline
pub fn set<K: ResourceKind>(store: &Store, namespace: &str, id: &str, spec: K::Spec)
where
    K::Spec: Default + Clone,
{
    store
        .modify::<K>(namespace, id, "", |r| r.spec.clone_from(&spec))
        .unwrap();
}

/// The config text of a node: cluster, the given discovery services, KubeSpan on.
pub fn config_text(secret: &str, services: &[(&str, String)]) -> String {
    let mut text =
        format!("apiVersion: v1alpha1\nkind: ClusterConfig\nid: {CLUSTER_ID}\nsecret: {secret}\n");
    for (name, endpoint) in services {
        text.push_str(&format!(
            "---\napiVersion: v1alpha1\nkind: DiscoveryServiceConfig\nname: {name}\nendpoint: {endpoint}\n"
        ));
    }
    text.push_str("---\napiVersion: v1alpha1\nkind: KubeSpanConfig\nenabled: true\n");
    text
}

pub fn set_config(store: &Store, text: &str) {
    let parsed = config::parse(text).unwrap();
    set::<MachineConfig>(
        store,
        MachineConfig::DEFAULT_NAMESPACE,
        ACTIVE,
        MachineConfigSpec {
            source: "test".into(),
            document_count: parsed.documents.len(),
            config: parsed,
        },
    );
}

/// One node under test.
pub struct TestNode {
    pub node_id: String,
    pub store: Store,
    pub harness: Harness,
}

impl TestNode {
    /// Starts node `index` (address 10.0.0.<index+1>, hostname node-<index>).
    pub fn start(index: u8, config: &str, ttl: Duration) -> Self {
        Self::start_with(index, config, ttl, |_| {})
    }

    /// The same, with more controllers registered by `extra`.
    pub fn start_with(
        index: u8,
        config: &str,
        ttl: Duration,
        extra: impl FnOnce(&mut Runtime),
    ) -> Self {
        let store = Store::new(StoreOptions::default());
        let node_id = format!("node{index}Id");
        set::<NodeIdentity>(
            &store,
            NodeIdentity::DEFAULT_NAMESPACE,
            LOCAL,
            NodeIdentitySpec {
                node_id: node_id.clone(),
            },
        );
        let addr: ipnet::IpNet = format!("10.0.0.{}/24", index + 1).parse().unwrap();
        for id in [node_address::ROUTED, node_address::CURRENT] {
            set::<NodeAddress>(
                &store,
                NodeAddress::DEFAULT_NAMESPACE,
                id,
                NodeAddressSpec {
                    addresses: vec![addr],
                },
            );
        }
        set::<HostnameStatus>(
            &store,
            HostnameStatus::DEFAULT_NAMESPACE,
            "hostname",
            HostnameStatusSpec {
                hostname: format!("node-{index}"),
                domainname: "lab".into(),
            },
        );
        set::<KubeSpanIdentity>(
            &store,
            KubeSpanIdentity::DEFAULT_NAMESPACE,
            KUBESPAN,
            KubeSpanIdentitySpec {
                address: Some(format!("fd00:1::{:x}/128", index + 1).parse().unwrap()),
                subnet: Some("fd00:1::/64".parse().unwrap()),
                public_key: format!("{index:0>43}="),
                ..KubeSpanIdentitySpec::default()
            },
        );
        let parsed = config::parse(config).unwrap();
        let ks = parsed
            .singleton::<config::kubespan::KubeSpanConfigDocument>()
            .cloned()
            .unwrap_or_default();
        set::<KubeSpanConfig>(
            &store,
            KubeSpanConfig::DEFAULT_NAMESPACE,
            KUBESPAN,
            KubeSpanConfigSpec {
                config: ks,
                extra_announced_endpoints: Vec::new(),
            },
        );
        set_config(&store, config);
        let mut runtime = Runtime::new(store.clone());
        register(&mut runtime, DiscoveryOptions { ttl }).unwrap();
        extra(&mut runtime);
        Self {
            node_id,
            store,
            harness: Harness::start(runtime),
        }
    }

    /// Current member ids.
    pub fn members(&self) -> BTreeSet<String> {
        self.store
            .list::<Member>(NS, &Filter::all())
            .iter()
            .map(|m| m.metadata.id.clone())
            .collect()
    }

    /// Waits until `check` holds on the store, re-checking on every event of `kind`.
    pub async fn wait_until(&self, what: &str, kind: &Kind, mut check: impl FnMut(&Store) -> bool) {
        let mut w = self.store.watch_kind(kind, WatchOptions::bootstrapped());
        let ok = tokio::time::timeout(WAIT, async {
            loop {
                if check(&self.store) {
                    return;
                }
                match w.recv().await {
                    Some(Event::Errored(e)) => panic!("watch failed: {e}"),
                    None => panic!("watch ended"),
                    Some(_) => {}
                }
            }
        })
        .await;
        assert!(
            ok.is_ok(),
            "{}: {what}: timed out after {WAIT:?}",
            self.node_id
        );
    }

    /// Waits until the member set is exactly `want`.
    pub async fn wait_members(&self, want: &BTreeSet<String>) {
        let kind = Kind::new(NS, Member::TYPE);
        let mut last = BTreeSet::new();
        let mut w = self.store.watch_kind(&kind, WatchOptions::bootstrapped());
        let ok = tokio::time::timeout(WAIT, async {
            loop {
                last = self.members();
                if last == *want {
                    return;
                }
                match w.recv().await {
                    Some(Event::Errored(e)) => panic!("watch failed: {e}"),
                    None => panic!("watch ended"),
                    Some(_) => {}
                }
            }
        })
        .await;
        assert!(
            ok.is_ok(),
            "{}: members {last:?}, want {want:?} (timed out after {WAIT:?})",
            self.node_id
        );
    }
}

/// A resource for tests that write raw inputs by hand.
pub fn resource<K: ResourceKind>(namespace: &str, id: &str, spec: K::Spec) -> Resource<K> {
    Resource::new(namespace, id, spec)
}
