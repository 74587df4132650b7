//! Kernel test of the eBPF fast path under the mesh manager: with `fastPath: ebpf` the
//! tc classifier is attached to every interface but the mesh link and `lo`, the
//! nftables prerouting chain has no set lookup (the output chain keeps it) and the
//! status says `ebpf`; switching back to `nftables` detaches the classifier and
//! restores the prerouting lookup. Userspace WireGuard in a throwaway namespace.

use std::{collections::BTreeMap, sync::Arc};

use aya::programs::{SchedClassifier, TcAttachType};
mod kubespan_common;

use kubespan_common::{eventually, register_real, seed_cluster};
use wirespan_control::kubespan::clock::SystemClock;
use wirespan_control::{
    controllers::kubespan::KernelMarkingFactory,
    resources::{
        config::{MachineConfig, MachineConfigSpec},
        kubespan::KubeSpanManagerStatus,
    },
    runtime::{Runtime, Store, StoreOptions},
    testing::Harness,
};
use wirespan_dataplane::{
    kernel_marking::KernelMarking,
    netns::{unique_name, NetnsGuard, NetnsThread},
};

fn tcx_ingress_programs(ns: &NetnsGuard, dev: &str) -> usize {
    let dev = dev.to_owned();
    NetnsThread::spawn(ns.netns())
        .unwrap()
        .run(move || SchedClassifier::query_tcx(&dev, TcAttachType::Ingress).map(|(_, p)| p.len()))
        .unwrap()
        .unwrap_or(0)
}

/// hook → whether a rule of a chain on that hook looks a set up (`@set`).
fn set_lookups_by_hook(ns: &NetnsGuard) -> Option<BTreeMap<String, bool>> {
    let out = ns
        .run_stdout("nft", &["-j", "list", "table", "inet", "wirespan"])
        .ok()?;
    let v: serde_json::Value = serde_json::from_str(&out).ok()?;
    let items = v["nftables"].as_array()?;
    let mut hooks = BTreeMap::new();
    for c in items.iter().filter_map(|i| i.get("chain")) {
        if let (Some(name), Some(hook)) = (c["name"].as_str(), c["hook"].as_str()) {
            hooks.insert(name.to_owned(), hook.to_owned());
        }
    }
    let mut lookups: BTreeMap<String, bool> = hooks.values().map(|h| (h.clone(), false)).collect();
    for r in items.iter().filter_map(|i| i.get("rule")) {
        let Some(hook) = r["chain"].as_str().and_then(|c| hooks.get(c)) else {
            continue;
        };
        if r["expr"].to_string().contains("\"@") {
            lookups.insert(hook.clone(), true);
        }
    }
    Some(lookups)
}

fn config(link: &str, fast_path: &str) -> MachineConfigSpec {
    MachineConfigSpec {
        source: "test".into(),
        document_count: 1,
        config: wirespan_control::config::parse(&format!(
            "apiVersion: v1alpha1\nkind: KubeSpanConfig\nenabled: true\nlinkName: {link}\nfastPath: {fast_path}\n"
        ))
        .unwrap(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ebpf_fast_path_replaces_the_prerouting_lookup_and_switches_back() {
    let ns = NetnsGuard::new("wsfp").unwrap();
    ns.run(
        "ip",
        &[
            "link",
            "add",
            "d0",
            "address",
            "00:16:3e:12:34:57",
            "type",
            "veth",
            "peer",
            "name",
            "d1",
        ],
    )
    .unwrap();
    ns.run("ip", &["link", "set", "d0", "up"]).unwrap();
    ns.run("ip", &["link", "set", "d1", "up"]).unwrap();
    let link = unique_name("wsf");
    let dir = tempfile::tempdir().unwrap();
    let store = Store::new(StoreOptions::default());
    let mut runtime = Runtime::new(store.clone());
    register_real(
        &mut runtime,
        &ns,
        dir.path(),
        Arc::new(KernelMarkingFactory {
            marking: KernelMarking {
                netns: ns.netns().clone(),
            },
            metrics: None,
        }),
        Arc::new(SystemClock),
    );
    seed_cluster(&store, [9u8; 32]);
    store
        .modify::<MachineConfig>("config", "active", "", |r| {
            r.spec = config(&link, "ebpf");
        })
        .unwrap();
    let h = Harness::start(runtime);
    let status = |store: &Store| {
        store
            .get::<KubeSpanManagerStatus>("kubespan", "kubespan")
            .ok()
            .map(|r| r.spec.clone())
    };

    let st = eventually("manager status with two peers", || {
        status(&store).filter(|s| s.peers == 2)
    })
    .await;
    assert_eq!(st.fast_path, "ebpf", "{st:?}");
    assert_eq!(st.note, "", "{st:?}");
    let lookups = eventually("marking table", || set_lookups_by_hook(&ns)).await;
    assert_eq!(lookups.get("prerouting"), Some(&false), "{lookups:?}");
    assert_eq!(lookups.get("output"), Some(&true), "{lookups:?}");
    assert_eq!(tcx_ingress_programs(&ns, "d0"), 1);
    assert_eq!(tcx_ingress_programs(&ns, "d1"), 1);
    // The mesh link too: a relay marks what it forwards from one peer to another.
    eventually("classifier on the mesh link", || {
        (tcx_ingress_programs(&ns, &link) == 1).then_some(())
    })
    .await;
    assert_eq!(tcx_ingress_programs(&ns, "lo"), 0);

    // Back to nftables: classifier gone, prerouting lookup back.
    store
        .modify::<MachineConfig>("config", "active", "", |r| {
            r.spec = config(&link, "nftables");
        })
        .unwrap();
    eventually("status says nftables", || {
        status(&store).filter(|s| s.fast_path == "nftables")
    })
    .await;
    eventually("prerouting lookup restored", || {
        set_lookups_by_hook(&ns).filter(|l| l.get("prerouting") == Some(&true))
    })
    .await;
    eventually("classifier detached", || {
        (tcx_ingress_programs(&ns, "d0") == 0
            && tcx_ingress_programs(&ns, "d1") == 0
            && tcx_ingress_programs(&ns, &link) == 0)
            .then_some(())
    })
    .await;
    let lookups = set_lookups_by_hook(&ns).unwrap();
    assert_eq!(lookups.get("output"), Some(&true), "{lookups:?}");

    h.stop().await.unwrap();
    let tables = ns.run_stdout("nft", &["-j", "list", "tables"]).unwrap();
    assert!(!tables.contains("\"wirespan\""), "{tables}");
}
