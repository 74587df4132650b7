//! Network controllers through the real runtime: merge (with a foreign finalizer),
//! config → merge → spec → fake kernel → status → NodeAddress, and the same in a
//! network namespace with the real netlink adapter.

use std::sync::{Arc, Mutex};

use wirespan_control::{
    config,
    controllers::network::{self, merge::MergeController, Deps, NetlinkFeed},
    resources::{
        config::{MachineConfig, MachineConfigSpec, ACTIVE},
        network::{
            AddressSpec, AddressSpecSpec, AddressStatus, ConfigLayer, LinkSpec, LinkSpecSpec,
            LinkStatus, NodeAddress, NS, NS_CONFIG,
        },
    },
    runtime::{Kind, Phase, Pointer, Resource, ResourceKind, Runtime, Store, StoreOptions},
    testing::{assert_length, assert_no_resource, assert_resource, Harness},
};
use wirespan_dataplane::{
    fake::FakeNetwork,
    netns::NetnsGuard,
    routing::{scope, NetlinkRouting},
};

fn set_config(store: &Store, text: &str) {
    let cfg = config::parse(text).unwrap();
    store
        .modify::<MachineConfig>("config", ACTIVE, "", |r| {
            r.spec = MachineConfigSpec {
                source: "test".into(),
                document_count: cfg.documents.len(),
                config: cfg.clone(),
            };
        })
        .unwrap();
}

fn addr_spec(ip: &str, layer: ConfigLayer) -> AddressSpecSpec {
    AddressSpecSpec {
        address: Some(ip.parse().unwrap()),
        link_name: "eth0".into(),
        layer,
        ..AddressSpecSpec::default()
    }
}

#[tokio::test]
async fn merged_spec_waits_for_foreign_finalizer_then_recreates() {
    let store = Store::new(StoreOptions::default());
    let mut rt = Runtime::new(store.clone());
    rt.register(MergeController::<AddressSpec>::new()).unwrap();
    let h = Harness::start(rt);
    let raw = |id: &str, s| Resource::<AddressSpec>::new(NS_CONFIG, id, s);
    store
        .create(
            raw(
                "operator/eth0/10.0.0.1/24",
                addr_spec("10.0.0.1/24", ConfigLayer::Operator),
            ),
            "src",
        )
        .unwrap();
    store
        .create(
            raw(
                "configuration/eth0/10.0.0.1/24",
                addr_spec("10.0.0.1/24", ConfigLayer::Configuration),
            ),
            "src",
        )
        .unwrap();
    let merged = assert_resource::<AddressSpec>(&store, NS, "eth0/10.0.0.1/24", |r| {
        (r.spec.layer == ConfigLayer::Configuration)
            .then_some(())
            .ok_or("not configuration".into())
    })
    .await;
    store
        .add_finalizer(&merged.pointer(), &["foreign"])
        .unwrap();

    // Higher layer goes: the lower one wins again (no teardown needed).
    store
        .destroy(
            &Pointer::new(
                NS_CONFIG,
                AddressSpec::TYPE,
                "configuration/eth0/10.0.0.1/24",
            ),
            "src",
        )
        .unwrap();
    assert_resource::<AddressSpec>(&store, NS, "eth0/10.0.0.1/24", |r| {
        (r.spec.layer == ConfigLayer::Operator)
            .then_some(())
            .ok_or("not operator".into())
    })
    .await;

    // Last source goes: tearing down, held by the finalizer.
    store
        .destroy(
            &Pointer::new(NS_CONFIG, AddressSpec::TYPE, "operator/eth0/10.0.0.1/24"),
            "src",
        )
        .unwrap();
    assert_resource::<AddressSpec>(&store, NS, "eth0/10.0.0.1/24", |r| {
        (r.metadata.phase == Phase::TearingDown)
            .then_some(())
            .ok_or("running".into())
    })
    .await;
    // It comes back while tearing down: the controller waits for the finalizer.
    store
        .create(
            raw(
                "configuration/eth0/10.0.0.1/24",
                addr_spec("10.0.0.1/24", ConfigLayer::Configuration),
            ),
            "src",
        )
        .unwrap();
    store
        .remove_finalizer(&merged.pointer(), &["foreign"])
        .unwrap();
    assert_resource::<AddressSpec>(&store, NS, "eth0/10.0.0.1/24", |r| {
        (r.metadata.phase == Phase::Running && r.spec.layer == ConfigLayer::Configuration)
            .then_some(())
            .ok_or(format!("{:?} {:?}", r.metadata.phase, r.spec.layer))
    })
    .await;
    h.stop().await.unwrap();
}

fn fake_deps(fake: &FakeNetwork) -> Deps {
    Deps {
        net: Arc::new(Mutex::new(fake.clone())),
        feed: Arc::new(fake.clone()),
    }
}

#[tokio::test]
async fn config_to_fake_kernel_to_status_and_node_addresses() {
    let fake = FakeNetwork::new();
    fake.add_link("eth0", "ether");
    fake.add_foreign_address("eth0", "192.168.5.5/24".parse().unwrap(), scope::UNIVERSE);
    let store = Store::new(StoreOptions::default());
    let mut rt = Runtime::new(store.clone());
    network::register(&mut rt, &fake_deps(&fake)).unwrap();
    let h = Harness::start(rt);

    set_config(
        &store,
        "apiVersion: v1alpha1\nkind: AddressConfig\nlink: eth0\naddress: 10.0.0.1/24\n---\n\
         apiVersion: v1alpha1\nkind: AddressConfig\nlink: eth0\naddress: 192.168.5.5/24\n---\n\
         apiVersion: v1alpha1\nkind: AddressConfig\nlink: late0\naddress: 10.7.0.1/24\n---\n\
         apiVersion: v1alpha1\nkind: LinkConfig\nname: dummy7\nlinkKind: dummy\nmtu: 1400\n",
    );
    assert_resource::<AddressStatus>(&store, NS, "eth0/10.0.0.1/24", |_| Ok(())).await;
    assert_resource::<LinkStatus>(&store, NS, "dummy7", |r| {
        (r.spec.mtu == 1400 && r.spec.up)
            .then_some(())
            .ok_or(format!("{:?}", r.spec))
    })
    .await;
    assert_resource::<NodeAddress>(&store, NS, "routed", |r| {
        let want: Vec<ipnet::IpNet> = vec![
            "10.0.0.1/24".parse().unwrap(),
            "192.168.5.5/24".parse().unwrap(),
        ];
        (r.spec.addresses == want)
            .then_some(())
            .ok_or(format!("{:?}", r.spec.addresses))
    })
    .await;
    assert_resource::<NodeAddress>(&store, NS, "default", |_| Ok(())).await;
    assert!(!fake
        .snapshot()
        .addresses
        .iter()
        .any(|a| a.address.to_string() == "10.7.0.1/24"));

    // The missing link appears: its address follows (link event retry).
    fake.add_link("late0", "ether");
    assert_resource::<AddressStatus>(&store, NS, "late0/10.7.0.1/24", |_| Ok(())).await;

    // Documents removed: our address and link go, the foreign address stays.
    set_config(
        &store,
        "apiVersion: v1alpha1\nkind: LinkConfig\nname: eth0\n",
    );
    assert_no_resource(
        &store,
        &Pointer::new(NS, AddressStatus::TYPE, "eth0/10.0.0.1/24"),
    )
    .await;
    assert_no_resource(&store, &Pointer::new(NS, LinkStatus::TYPE, "dummy7")).await;
    assert_no_resource(
        &store,
        &Pointer::new(NS, AddressSpec::TYPE, "eth0/10.0.0.1/24"),
    )
    .await;
    assert_resource::<AddressStatus>(&store, NS, "eth0/192.168.5.5/24", |_| Ok(())).await;
    assert_length(&store, &Kind::new(NS, AddressSpec::TYPE), 0).await;
    // eth0 (physical, not ours) survives its spec.
    assert_resource::<LinkSpec>(&store, NS, "eth0", |_| Ok(())).await;
    assert_resource::<LinkStatus>(&store, NS, "eth0", |_| Ok(())).await;
    h.stop().await.unwrap();
}

/// A link whose carrier drops: its status says so, its address leaves the node's
/// current and routed addresses (what the mesh announces), and both come back with it.
#[tokio::test]
async fn a_link_going_down_shows_in_its_status_and_node_addresses_and_recovers() {
    let fake = FakeNetwork::new();
    fake.add_link("eth0", "ether");
    fake.add_link("eth1", "ether");
    let store = Store::new(StoreOptions::default());
    let mut rt = Runtime::new(store.clone());
    network::register(&mut rt, &fake_deps(&fake)).unwrap();
    let h = Harness::start(rt);
    set_config(
        &store,
        "apiVersion: v1alpha1\nkind: AddressConfig\nlink: eth0\naddress: 10.0.0.1/24\n---\n\
         apiVersion: v1alpha1\nkind: AddressConfig\nlink: eth1\naddress: 10.1.0.1/24\n",
    );
    let routed = |want: &'static [&'static str]| {
        move |r: &Resource<NodeAddress>| {
            let got: Vec<String> = r.spec.addresses.iter().map(ToString::to_string).collect();
            (got == want).then_some(()).ok_or(format!("{got:?}"))
        }
    };
    let link_up = |up: bool| {
        move |r: &Resource<LinkStatus>| {
            (r.spec.is_up() == up)
                .then_some(())
                .ok_or(format!("{:?}", r.spec))
        }
    };
    assert_resource(
        &store,
        NS,
        "routed",
        routed(&["10.0.0.1/24", "10.1.0.1/24"]),
    )
    .await;

    fake.set_oper_state("eth1", "down");
    let down = assert_resource(&store, NS, "eth1", link_up(false)).await;
    assert_eq!(down.spec.oper_state, "down");
    assert_resource(&store, NS, "routed", routed(&["10.0.0.1/24"])).await;
    assert_resource(&store, NS, "current", routed(&["10.0.0.1/24"])).await;
    // The address itself stays configured on the link.
    assert_resource::<AddressStatus>(&store, NS, "eth1/10.1.0.1/24", |_| Ok(())).await;

    fake.set_oper_state("eth1", "up");
    assert_resource(&store, NS, "eth1", link_up(true)).await;
    assert_resource(
        &store,
        NS,
        "routed",
        routed(&["10.0.0.1/24", "10.1.0.1/24"]),
    )
    .await;
    h.stop().await.unwrap();
}

#[tokio::test]
async fn operator_layer_overrides_link_fields_field_wise() {
    let fake = FakeNetwork::new();
    fake.add_link("kubespan", "none");
    let store = Store::new(StoreOptions::default());
    let mut rt = Runtime::new(store.clone());
    network::register(&mut rt, &fake_deps(&fake)).unwrap();
    let h = Harness::start(rt);
    store
        .create(
            Resource::<LinkSpec>::new(
                NS_CONFIG,
                "operator/kubespan",
                LinkSpecSpec {
                    name: "kubespan".into(),
                    up: true,
                    mtu: 1420,
                    layer: ConfigLayer::Operator,
                    ..LinkSpecSpec::default()
                },
            ),
            "KubeSpanManagerController",
        )
        .unwrap();
    set_config(
        &store,
        "apiVersion: v1alpha1\nkind: LinkConfig\nname: kubespan\nup: false\nmtu: 1380\n",
    );
    assert_resource::<LinkStatus>(&store, NS, "kubespan", |r| {
        (r.spec.mtu == 1380 && r.spec.up)
            .then_some(())
            .ok_or(format!("{:?}", r.spec))
    })
    .await;
    h.stop().await.unwrap();
}

/// The network controllers on the real netlink adapter in `ns`, woken by its kernel
/// events: the store and the running harness.
fn start_in(ns: &NetnsGuard) -> (Store, Harness) {
    let deps = Deps {
        net: Arc::new(Mutex::new(NetlinkRouting::new(ns.netns()).unwrap())),
        feed: Arc::new(NetlinkFeed(ns.netns().clone())),
    };
    let store = Store::new(StoreOptions::default());
    let mut rt = Runtime::new(store.clone());
    network::register(&mut rt, &deps).unwrap();
    (store, Harness::start(rt))
}

fn ip_json(ns: &NetnsGuard, args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&ns.run_stdout("ip", args).unwrap()).unwrap()
}

fn has_addr(ns: &NetnsGuard, link: &str, ip: &str) -> bool {
    ip_json(ns, &["-j", "addr", "show", "dev", link])
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
        .any(|a| a["local"] == ip)
}

fn has_route(ns: &NetnsGuard, dst: &str) -> bool {
    ip_json(ns, &["-j", "route", "show", "table", "all"])
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["dst"] == dst)
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_addresses_and_routes_follow_specs_and_foreign_objects_survive() {
    let ns = NetnsGuard::new("wsnet").unwrap();
    // No dummy module on every kernel: a veth pair, both ends up (carrier).
    ns.run(
        "ip",
        &[
            "link", "add", "dum0", "type", "veth", "peer", "name", "dum0p",
        ],
    )
    .unwrap();
    ns.run("ip", &["link", "set", "dum0p", "up"]).unwrap();
    ns.run("ip", &["link", "set", "dum0", "up"]).unwrap();
    ns.run("ip", &["addr", "add", "10.50.0.9/24", "dev", "dum0"])
        .unwrap();
    ns.run(
        "ip",
        &[
            "route",
            "add",
            "10.70.0.0/16",
            "via",
            "10.50.0.1",
            "dev",
            "dum0",
        ],
    )
    .unwrap();
    let (store, h) = start_in(&ns);

    // Also a spec for the foreign address: satisfied by it, never removed.
    set_config(
        &store,
        "apiVersion: v1alpha1\nkind: AddressConfig\nlink: dum0\naddress: 10.50.0.1/24\n---\n\
         apiVersion: v1alpha1\nkind: AddressConfig\nlink: dum0\naddress: 10.50.0.9/24\n---\n\
         apiVersion: v1alpha1\nkind: RouteConfig\ndestination: 10.60.0.0/16\ngateway: 10.50.0.2\nlink: dum0\n---\n\
         apiVersion: v1alpha1\nkind: RoutingRuleConfig\npriority: 1234\ntable: 100\nsrc: 10.50.0.0/24\n",
    );
    until("address 10.50.0.1", || has_addr(&ns, "dum0", "10.50.0.1")).await;
    until("route 10.60.0.0/16", || has_route(&ns, "10.60.0.0/16")).await;
    until("rule 1234", || {
        ns.run_stdout("ip", &["rule", "show"])
            .unwrap()
            .contains("1234:")
    })
    .await;
    assert_resource::<AddressStatus>(&store, NS, "dum0/10.50.0.1/24", |_| Ok(())).await;
    assert_resource::<NodeAddress>(&store, NS, "routed", |r| {
        r.spec
            .addresses
            .contains(&"10.50.0.1/24".parse().unwrap())
            .then_some(())
            .ok_or(format!("{:?}", r.spec.addresses))
    })
    .await;

    set_config(
        &store,
        "apiVersion: v1alpha1\nkind: LinkConfig\nname: dum0\n",
    );
    until("address removal", || !has_addr(&ns, "dum0", "10.50.0.1")).await;
    until("route removal", || !has_route(&ns, "10.60.0.0/16")).await;
    until("rule removal", || {
        !ns.run_stdout("ip", &["rule", "show"])
            .unwrap()
            .contains("1234:")
    })
    .await;
    assert_length(&store, &Kind::new(NS, AddressSpec::TYPE), 0).await;
    assert!(
        has_addr(&ns, "dum0", "10.50.0.9"),
        "foreign address removed"
    );
    assert!(has_route(&ns, "10.70.0.0/16"), "foreign route removed");
    assert_no_resource(
        &store,
        &Pointer::new(NS, AddressStatus::TYPE, "dum0/10.50.0.1/24"),
    )
    .await;
    h.stop().await.unwrap();
}

#[test]
fn cli_names_of_the_issue_resolve_to_the_intended_types() {
    let defs = wirespan_control::resources::definitions();
    for (name, display) in [
        ("links", "LinkStatus"),
        ("addresses", "AddressStatus"),
        ("routes", "RouteStatus"),
        ("routingrules", "RoutingRuleStatus"),
        ("nodeaddresses", "NodeAddress"),
        ("probespecs", "ProbeSpec"),
        ("probestatuses", "ProbeStatus"),
        ("linkspecs", "LinkSpec"),
        ("addressspecs", "AddressSpec"),
        ("routespecs", "RouteSpec"),
        ("routingrulespecs", "RoutingRuleSpec"),
        ("resolvers", "ResolverStatus"),
        ("hostname", "HostnameStatus"),
    ] {
        let d = wirespan_control::api::resolve(&defs, name).unwrap();
        assert_eq!(d.display_type, display, "{name}");
        assert!(!d.print_columns.is_empty(), "{name} has no columns");
    }
}

#[tokio::test]
async fn merge_survives_flapping_raw_specs_under_a_foreign_finalizer() {
    use rand::{Rng as _, SeedableRng as _};
    let store = Store::new(StoreOptions::default());
    let mut rt = Runtime::new(store.clone());
    rt.register(MergeController::<AddressSpec>::new()).unwrap();
    let h = Harness::start(rt);
    let raw_id = |layer: ConfigLayer| format!("{}/eth0/10.0.0.1/24", layer.prefix());
    let layers = [ConfigLayer::Operator, ConfigLayer::Configuration];
    store
        .create(
            Resource::<AddressSpec>::new(
                NS_CONFIG,
                raw_id(layers[0]),
                addr_spec("10.0.0.1/24", layers[0]),
            ),
            "src",
        )
        .unwrap();
    let merged = assert_resource::<AddressSpec>(&store, NS, "eth0/10.0.0.1/24", |_| Ok(())).await;
    store
        .add_finalizer(&merged.pointer(), &["foreign"])
        .unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut present = [true, false];
    for _ in 0..300 {
        let i = rng.gen_range(0..layers.len());
        let ptr = Pointer::new(NS_CONFIG, AddressSpec::TYPE, raw_id(layers[i]));
        if present[i] {
            store.destroy(&ptr, "src").unwrap();
        } else {
            store
                .create(
                    Resource::<AddressSpec>::new(
                        NS_CONFIG,
                        raw_id(layers[i]),
                        addr_spec("10.0.0.1/24", layers[i]),
                    ),
                    "src",
                )
                .unwrap();
        }
        present[i] = !present[i];
        if rng.gen_bool(0.1) {
            tokio::task::yield_now().await;
        }
    }
    // End state: the operator layer only.
    for (i, layer) in layers.iter().enumerate() {
        let ptr = Pointer::new(NS_CONFIG, AddressSpec::TYPE, raw_id(*layer));
        let want = *layer == ConfigLayer::Operator;
        if present[i] && !want {
            store.destroy(&ptr, "src").unwrap();
        } else if !present[i] && want {
            store
                .create(
                    Resource::<AddressSpec>::new(
                        NS_CONFIG,
                        raw_id(*layer),
                        addr_spec("10.0.0.1/24", *layer),
                    ),
                    "src",
                )
                .unwrap();
        }
    }
    store
        .remove_finalizer(&merged.pointer(), &["foreign"])
        .unwrap();
    assert_resource::<AddressSpec>(&store, NS, "eth0/10.0.0.1/24", |r| {
        (r.metadata.phase == Phase::Running && r.spec.layer == ConfigLayer::Operator)
            .then_some(())
            .ok_or(format!("{:?} {:?}", r.metadata.phase, r.spec.layer))
    })
    .await;
    h.stop().await.unwrap();
}

/// A namespace with a veth pair `dum0`/`dum0p` up and 10.50.0.9/24 on `dum0`.
fn veth_ns(name: &str) -> NetnsGuard {
    let ns = NetnsGuard::new(name).unwrap();
    ns.run(
        "ip",
        &[
            "link", "add", "dum0", "type", "veth", "peer", "name", "dum0p",
        ],
    )
    .unwrap();
    ns.run("ip", &["link", "set", "dum0p", "up"]).unwrap();
    ns.run("ip", &["link", "set", "dum0", "up"]).unwrap();
    ns.run("ip", &["addr", "add", "10.50.0.9/24", "dev", "dum0"])
        .unwrap();
    ns
}

fn route_specs(store: &Store) -> Vec<Arc<Resource<network_res::RouteSpec>>> {
    store.list::<network_res::RouteSpec>(NS, &wirespan_control::runtime::Filter::all())
}

use wirespan_control::resources::network as network_res;

/// Issue 15 item 4: one route the kernel rejects (unreachable gateway) does not keep
/// the good ones out; the bad one carries its error, the good ones none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_bad_route_does_not_stall_the_others_and_shows_its_error() {
    let ns = veth_ns("wsbad");
    let (store, h) = start_in(&ns);
    let route = |dst: &str, gw: &str| {
        format!(
            "apiVersion: v1alpha1\nkind: RouteConfig\ndestination: {dst}\ngateway: {gw}\nlink: dum0\n"
        )
    };
    // The bad one sorts first among the merged specs.
    set_config(
        &store,
        &[
            route("10.1.0.0/16", "10.99.0.1"),
            route("10.61.0.0/16", "10.50.0.2"),
            route("10.62.0.0/16", "10.50.0.3"),
            route("10.63.0.0/16", "10.50.0.4"),
        ]
        .join("---\n"),
    );
    for dst in ["10.61.0.0/16", "10.62.0.0/16", "10.63.0.0/16"] {
        until(dst, || has_route(&ns, dst)).await;
    }
    assert!(!has_route(&ns, "10.1.0.0/16"));
    until("the bad route's error", || {
        route_specs(&store).iter().any(|r| {
            r.spec.destination == Some("10.1.0.0/16".parse().unwrap())
                && r.metadata
                    .annotations
                    .get(network::spec::ERROR_ANNOTATION)
                    .is_some_and(|e| e.contains("add route"))
        })
    })
    .await;
    for r in route_specs(&store) {
        if r.spec.destination != Some("10.1.0.0/16".parse().unwrap()) {
            assert_eq!(
                r.metadata.annotations.get(network::spec::ERROR_ANNOTATION),
                None,
                "{}",
                r.metadata.id
            );
        }
    }
    // Fixed in the config: the error goes.
    set_config(&store, &route("10.1.0.0/16", "10.50.0.5"));
    until("the fixed route", || has_route(&ns, "10.1.0.0/16")).await;
    until("the error cleared", || {
        route_specs(&store).iter().all(|r| {
            !r.metadata
                .annotations
                .contains_key(network::spec::ERROR_ANNOTATION)
        })
    })
    .await;
    h.stop().await.unwrap();
}

/// A feed that never fires: only the resync timer wakes the spec controllers.
struct SilentFeed;

impl network::KernelEvents for SilentFeed {
    fn subscribe(&self) -> std::io::Result<futures::stream::BoxStream<'static, ()>> {
        use futures::StreamExt as _;
        Ok(futures::stream::pending().boxed())
    }
}

/// Issue 15 item 3: drift is repaired by the resync timer alone (no kernel events):
/// the mesh rule (32500 → 180) and a table-180 route (operator layer), a configured
/// rule, route and address, each deleted from outside, come back within a period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resync_repairs_objects_deleted_from_outside() {
    let ns = veth_ns("wsdrift");
    let deps = Deps {
        net: Arc::new(Mutex::new(NetlinkRouting::new(ns.netns()).unwrap())),
        feed: Arc::new(SilentFeed),
    };
    let store = Store::new(StoreOptions::default());
    let mut rt = Runtime::new(store.clone());
    network::register_with_resync(&mut rt, &deps, std::time::Duration::from_millis(300)).unwrap();
    let h = Harness::start(rt);
    set_config(
        &store,
        "apiVersion: v1alpha1\nkind: AddressConfig\nlink: dum0\naddress: 10.50.0.1/24\n---\n\
         apiVersion: v1alpha1\nkind: RouteConfig\ndestination: 10.60.0.0/16\ngateway: 10.50.0.2\nlink: dum0\n---\n\
         apiVersion: v1alpha1\nkind: RoutingRuleConfig\npriority: 1234\ntable: 100\nsrc: 10.50.0.0/24\n",
    );
    // The mesh's rule and route, as the mesh manager emits them.
    let mesh_route = network_res::RouteSpecSpec {
        family: network_res::Family::Inet4,
        out_link_name: "dum0".into(),
        table: 180,
        priority: 1,
        layer: ConfigLayer::Operator,
        ..network_res::RouteSpecSpec::default()
    };
    let mesh_rule = network_res::RoutingRuleSpecSpec {
        family: network_res::Family::Inet4,
        table: 180,
        priority: 32500,
        fw_mark: 0x40,
        fw_mask: 0x60,
        layer: ConfigLayer::Operator,
        ..network_res::RoutingRuleSpecSpec::default()
    };
    store
        .create(
            Resource::<network_res::RouteSpec>::new(
                NS_CONFIG,
                format!("operator/{}", mesh_route.key()),
                mesh_route,
            ),
            "mesh",
        )
        .unwrap();
    store
        .create(
            Resource::<network_res::RoutingRuleSpec>::new(
                NS_CONFIG,
                format!("operator/{}", mesh_rule.key()),
                mesh_rule,
            ),
            "mesh",
        )
        .unwrap();
    let rule = |prio: &str| {
        let out = ns.run_stdout("ip", &["rule", "show"]).unwrap();
        out.lines().any(|l| l.starts_with(&format!("{prio}:")))
    };
    let table180 = |ns: &NetnsGuard| {
        !ns.run_stdout("ip", &["route", "show", "table", "180"])
            .unwrap()
            .trim()
            .is_empty()
    };
    until("address", || has_addr(&ns, "dum0", "10.50.0.1")).await;
    until("route", || has_route(&ns, "10.60.0.0/16")).await;
    until("rule 1234", || rule("1234")).await;
    until("mesh rule", || rule("32500")).await;
    until("table 180 route", || table180(&ns)).await;

    ns.run("ip", &["rule", "del", "priority", "32500"]).unwrap();
    ns.run("ip", &["route", "flush", "table", "180"]).unwrap();
    ns.run("ip", &["rule", "del", "priority", "1234"]).unwrap();
    ns.run("ip", &["route", "del", "10.60.0.0/16"]).unwrap();
    ns.run("ip", &["addr", "del", "10.50.0.1/24", "dev", "dum0"])
        .unwrap();
    until("mesh rule repaired", || rule("32500")).await;
    until("table 180 route repaired", || table180(&ns)).await;
    until("rule 1234 repaired", || rule("1234")).await;
    until("route repaired", || has_route(&ns, "10.60.0.0/16")).await;
    until("address repaired", || has_addr(&ns, "dum0", "10.50.0.1")).await;
    h.stop().await.unwrap();
}

/// The error annotation of the `T` spec whose id contains `part`, once there is one.
fn spec_error<T: ResourceKind>(store: &Store, part: &str) -> Option<String> {
    store
        .list::<T>(NS, &wirespan_control::runtime::Filter::all())
        .iter()
        .find(|r| r.metadata.id.contains(part))?
        .metadata
        .annotations
        .get(network::spec::ERROR_ANNOTATION)
        .cloned()
}

/// Issue 15 item 4, one kernel rejection of each kind next to good objects: a missing
/// physical link, an MTU above what the device allows (a VXLAN link over a 1500-byte
/// veth takes at most 1450), a route source that is not a local address. Each bad object carries its own error; the good address
/// and route are applied regardless; fixing the config clears the errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_kernel_rejection_shows_on_its_object_and_the_rest_is_applied() {
    let ns = veth_ns("wsrej");
    ns.run(
        "ip",
        &[
            "link", "add", "vx0", "type", "vxlan", "id", "5", "dev", "dum0", "dstport", "4789",
        ],
    )
    .unwrap();
    let (store, h) = start_in(&ns);
    let good = "apiVersion: v1alpha1\nkind: AddressConfig\nlink: dum0\naddress: 10.50.0.1/24\n---\n\
                apiVersion: v1alpha1\nkind: RouteConfig\ndestination: 10.61.0.0/16\ngateway: 10.50.0.2\nlink: dum0\n";
    let bad = "apiVersion: v1alpha1\nkind: LinkConfig\nname: nosuch0\nmtu: 1400\n---\n\
               apiVersion: v1alpha1\nkind: LinkConfig\nname: vx0\nmtu: 9000\n---\n\
               apiVersion: v1alpha1\nkind: RouteConfig\ndestination: 10.62.0.0/16\ngateway: 10.50.0.2\nsource: 10.9.9.9\nlink: dum0\n";
    set_config(&store, &format!("{good}---\n{bad}"));

    until("the good address", || has_addr(&ns, "dum0", "10.50.0.1")).await;
    until("the good route", || has_route(&ns, "10.61.0.0/16")).await;
    let mut errors = Vec::new();
    for (kind, part) in [("link", "nosuch0"), ("link", "vx0"), ("route", "10.62.0.0")] {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
        let e = loop {
            let e = if kind == "link" {
                spec_error::<LinkSpec>(&store, part)
            } else {
                spec_error::<network_res::RouteSpec>(&store, part)
            };
            if let Some(e) = e {
                break e;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no error on the {kind} {part}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        };
        errors.push(e);
    }
    assert!(errors[0].contains("nosuch0"), "missing link: {}", errors[0]);
    assert!(
        !errors[1].is_empty(),
        "MTU above the maximum: {}",
        errors[1]
    );
    assert!(
        errors[2].contains("add route"),
        "non-local source: {}",
        errors[2]
    );
    assert!(!has_route(&ns, "10.62.0.0/16"));
    let mtu = ip_json(&ns, &["-j", "link", "show", "vx0"])[0]["mtu"]
        .as_u64()
        .unwrap();
    assert_eq!(mtu, 1450, "the rejected MTU left the link as it was");
    // The good objects carry no error.
    assert_eq!(spec_error::<AddressSpec>(&store, "10.50.0.1"), None);
    assert_eq!(
        spec_error::<network_res::RouteSpec>(&store, "10.61.0.0"),
        None
    );

    // Fixed: the errors go and the route appears.
    set_config(
        &store,
        &format!(
            "{good}---\napiVersion: v1alpha1\nkind: RouteConfig\ndestination: 10.62.0.0/16\ngateway: 10.50.0.2\nsource: 10.50.0.1\nlink: dum0\n"
        ),
    );
    until("the fixed route", || has_route(&ns, "10.62.0.0/16")).await;
    until("no error left", || {
        spec_error::<LinkSpec>(&store, "").is_none()
            && spec_error::<network_res::RouteSpec>(&store, "").is_none()
    })
    .await;
    h.stop().await.unwrap();
}

/// A kernel feed that ends at once (a netlink socket that closed).
struct EndedFeed;

impl network::KernelEvents for EndedFeed {
    fn subscribe(&self) -> std::io::Result<futures::stream::BoxStream<'static, ()>> {
        use futures::StreamExt as _;
        Ok(futures::stream::empty().boxed())
    }
}

/// Issue 32 item 2: when its event stream ends, the status controller keeps its 30 s
/// resync (the runtime's one behaviour, `docs/runtime.md` §3.4), as the spec
/// controllers always did; its old private loop stopped resyncing instead.
#[tokio::test(start_paused = true)]
async fn status_controller_resyncs_after_its_event_stream_ended() {
    let fake = FakeNetwork::new();
    fake.add_link("eth0", "ether");
    let deps = Deps {
        net: Arc::new(Mutex::new(fake.clone())),
        feed: Arc::new(EndedFeed),
    };
    let store = Store::new(StoreOptions::default());
    let mut rt = Runtime::new(store.clone());
    rt.register(network::status::NetworkStatusController::new(deps))
        .unwrap();
    let h = Harness::start(rt);
    let has = |link: &str| store.get::<LinkStatus>(NS, link).is_ok();
    // On the paused clock, time moves only to the runtime's timers.
    while !has("eth0") {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    fake.add_link("eth1", "ether");
    tokio::time::sleep(std::time::Duration::from_secs(29)).await;
    assert!(!has("eth1"), "no event, so nothing before the resync");
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert!(
        has("eth1"),
        "the resync after the stream's end read the kernel"
    );
    h.stop().await.unwrap();
}

/// `ip -j link` and `ip -j addr` of a namespace, for comparing with the statuses.
fn ip_link_and_addr(ns: &NetnsGuard) -> (serde_json::Value, serde_json::Value) {
    (ip_json(ns, &["-j", "link"]), ip_json(ns, &["-j", "addr"]))
}

/// Why the statuses disagree with `ip -j`, if they do.
fn status_mismatch(
    st: &network::status::Statuses,
    links: &serde_json::Value,
    addrs: &serde_json::Value,
) -> Option<String> {
    use std::collections::BTreeSet;
    let index_of = |name: &str| {
        st.links
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, l)| l.index)
    };
    for l in links.as_array().unwrap() {
        let name = l["ifname"].as_str().unwrap();
        let Some((_, ours)) = st.links.iter().find(|(n, _)| n == name) else {
            return Some(format!("no LinkStatus {name}"));
        };
        // `ip` leaves RUNNING out and adds NO-CARRIER / M-DOWN of its own.
        let ip_flags: BTreeSet<&str> = l["flags"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|f| f.as_str())
            .filter(|f| !["NO-CARRIER", "M-DOWN"].contains(f))
            .collect();
        let our_flags: BTreeSet<&str> = ours
            .flags
            .iter()
            .map(String::as_str)
            .filter(|f| *f != "RUNNING")
            .collect();
        let master = l["master"].as_str().map_or(Some(0), index_of);
        let perm_ok = match l["permaddr"].as_str() {
            Some(p) => ours.perm_hardware_addr == p,
            None => {
                ours.perm_hardware_addr.is_empty() || ours.perm_hardware_addr == ours.hardware_addr
            }
        };
        if ip_flags != our_flags
            || master != Some(ours.master_index)
            || l["qdisc"].as_str().unwrap_or("") != ours.qdisc
            || l["address"].as_str().unwrap_or("") != ours.hardware_addr
            || !perm_ok
        {
            return Some(format!("link {name}: ip {l} vs ours {ours:?}"));
        }
    }
    const ADDRESS_FLAGS: [&str; 11] = [
        "secondary",
        "temporary",
        "nodad",
        "optimistic",
        "dadfailed",
        "home",
        "deprecated",
        "tentative",
        "mngtmpaddr",
        "noprefixroute",
        "stable-privacy",
    ];
    for link in addrs.as_array().unwrap() {
        let name = link["ifname"].as_str().unwrap();
        for a in link["addr_info"].as_array().unwrap() {
            let local: std::net::IpAddr = a["local"].as_str().unwrap().parse().unwrap();
            // Only the test's own addresses: the kernel's link-local ones change
            // flags (DAD) on their own.
            if !["10.70.0.1", "fd70::1", "10.71.0.1", "127.0.0.1"]
                .contains(&local.to_string().as_str())
            {
                continue;
            }
            let Some((_, ours)) = st
                .addresses
                .iter()
                .find(|(_, s)| s.link_name == name && s.local == Some(local))
            else {
                return Some(format!("no AddressStatus for {name} {local}"));
            };
            let scope = serde_json::to_value(ours.scope).unwrap();
            let broadcast = a["broadcast"].as_str().map(|b| b.parse().unwrap());
            let flags_ok = ADDRESS_FLAGS
                .iter()
                .all(|f| a[*f].as_bool().unwrap_or(false) == ours.flags.iter().any(|o| o == f))
                && a["dynamic"].as_bool().unwrap_or(false)
                    != ours.flags.iter().any(|o| o == "permanent");
            if scope != a["scope"] || broadcast != ours.broadcast || !flags_ok {
                return Some(format!("address {name} {local}: ip {a} vs ours {ours:?}"));
            }
        }
    }
    None
}

/// Issue 33 item 4: LinkStatus (flags, master, qdisc, hardware and permanent address)
/// and AddressStatus (local, peer, broadcast, flags, scope) say what `ip -j link` and
/// `ip -j addr` say, in a throwaway namespace with a bridge, a port, a point-to-point
/// address and IPv6 flags.
#[test]
fn link_and_address_statuses_match_ip_json() {
    use wirespan_dataplane::routing::NetworkConfig as _;
    let ns = NetnsGuard::new("wsstat").unwrap();
    for cmd in [
        "link add br0 type bridge",
        "link add d0 type veth peer name d0p",
        "link set d0 master br0",
        "link set d0p up",
        "link set d0 up",
        "link set br0 up",
        "link set lo up",
        "addr add 10.70.0.1/24 broadcast 10.70.0.255 dev br0",
        "addr add fd70::1/64 dev br0 nodad noprefixroute",
        "addr add 10.71.0.1 peer 10.71.0.2/32 dev d0",
    ] {
        ns.run("ip", &cmd.split(' ').collect::<Vec<_>>()).unwrap();
    }
    let mut net = NetlinkRouting::new(ns.netns()).unwrap();
    // The kernel may still be settling (bridge carrier); compare only when `ip` saw
    // the same thing before and after the read.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let before = ip_link_and_addr(&ns);
        let st = network::status::statuses(&net.state().unwrap());
        if ip_link_and_addr(&ns) == before {
            let br0 = &st.links.iter().find(|(n, _)| n == "br0").unwrap().1;
            let d0 = &st.links.iter().find(|(n, _)| n == "d0").unwrap().1;
            assert_eq!(d0.master_index, br0.index);
            // ethtool, from a socket in the namespace.
            assert_eq!(
                (d0.driver.as_str(), d0.speed_mbps, d0.duplex.as_str()),
                ("veth", 10_000, "full"),
                "{d0:?}"
            );
            assert_eq!(br0.driver, "bridge", "{br0:?}");
            if let Some(why) = status_mismatch(&st, &before.0, &before.1) {
                panic!("{why}");
            }
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "ip output never settled"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

fn has_rule(ns: &NetnsGuard, priority: u32) -> bool {
    ip_json(ns, &["-j", "rule", "show"])
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["priority"] == priority)
}

/// The start-up sweep (`docs/runtime.md` §4.5): kernel objects an earlier run made
/// from network documents (marker 212, the link alias) that the config in force no
/// longer names go after the settle time; the mesh's (211), foreign ones and those
/// the config names stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_sweep_removes_leftover_config_objects_only() {
    use wirespan_dataplane::routing::{AddressParams, LinkParams, NetworkConfig, Owner};
    const SETTLE: std::time::Duration = std::time::Duration::from_secs(2);
    let ns = NetnsGuard::new("wssweep").unwrap();
    let ip = |args: &str| {
        ns.run("ip", &args.split(' ').collect::<Vec<_>>()).unwrap();
    };
    ip("link add dum0 type veth peer name dum0p");
    ip("link set dum0p up");
    ip("link set dum0 up");
    ip("addr add 10.50.0.9/24 dev dum0");
    // "A previous run": a stale route and rule from documents, one the config still
    // names, the mesh's, and the operator's own.
    ip("route add 10.61.0.0/16 via 10.50.0.1 dev dum0 proto 212");
    ip("route add 10.62.0.0/16 via 10.50.0.1 dev dum0 proto 212");
    ip("route add 10.63.0.0/16 via 10.50.0.1 dev dum0");
    ip("route add 10.64.0.0/16 via 10.50.0.1 dev dum0 proto 211");
    ip("rule add priority 1300 from 10.50.0.0/24 table 100 proto 212");
    ip("rule add priority 1301 from 10.50.0.0/24 table 100 proto 211");
    ip("rule add priority 1302 from 10.50.0.0/24 table 100");
    // iproute2 6.1 cannot mark addresses: the adapter writes them as a run would.
    let mut net = NetlinkRouting::new(ns.netns()).unwrap();
    net.apply_link(&LinkParams {
        name: "br-old".into(),
        logical: true,
        kind: "bridge".into(),
        up: true,
        mtu: 0,
    })
    .unwrap();
    net.apply_address(&AddressParams {
        link: "dum0".into(),
        address: "10.50.0.77/24".parse().unwrap(),
        scope: scope::UNIVERSE,
        owner: Owner::Config,
    })
    .unwrap();
    drop(net);

    let deps = Deps {
        net: Arc::new(Mutex::new(NetlinkRouting::new(ns.netns()).unwrap())),
        feed: Arc::new(NetlinkFeed(ns.netns().clone())),
    };
    let store = Store::new(StoreOptions::default());
    let mut rt = Runtime::new(store.clone());
    network::register_with_sweep_settle(&mut rt, &deps, SETTLE).unwrap();
    let h = Harness::start(rt);
    let loaded = tokio::time::Instant::now();
    set_config(
        &store,
        "apiVersion: v1alpha1\nkind: RouteConfig\ndestination: 10.62.0.0/16\ngateway: 10.50.0.1\nlink: dum0\n",
    );
    until("the named route's spec", || route_specs(&store).len() == 1).await;
    // Within the settle time the leftovers are still there.
    assert!(
        has_route(&ns, "10.61.0.0/16"),
        "swept before the settle time"
    );
    assert!(has_rule(&ns, 1300), "swept before the settle time");

    let deadline = std::time::Duration::from_secs(10);
    until_within("stale route gone", deadline, || {
        !has_route(&ns, "10.61.0.0/16")
    })
    .await;
    assert!(
        loaded.elapsed() >= SETTLE,
        "swept after {:?}",
        loaded.elapsed()
    );
    until_within("stale rule gone", deadline, || !has_rule(&ns, 1300)).await;
    until_within("stale address gone", deadline, || {
        !has_addr(&ns, "dum0", "10.50.0.77")
    })
    .await;
    until_within("stale bridge gone", deadline, || {
        ns.run("ip", &["link", "show", "br-old"]).is_err()
    })
    .await;
    for dst in ["10.62.0.0/16", "10.63.0.0/16", "10.64.0.0/16"] {
        assert!(has_route(&ns, dst), "{dst} removed");
    }
    assert!(has_rule(&ns, 1301), "the mesh's rule removed");
    assert!(has_rule(&ns, 1302), "a foreign rule removed");
    assert!(
        has_addr(&ns, "dum0", "10.50.0.9"),
        "foreign address removed"
    );
    h.stop().await.unwrap();
}

async fn until_within(what: &str, limit: std::time::Duration, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
