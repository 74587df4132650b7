//! Mesh routing (the `Routing` trait): `FakeRouting` against rtnetlink.

use ipnet::IpNet;
use wirespan_dataplane::{
    fake::FakeRouting,
    netns::NetnsGuard,
    routing::{NetlinkRouting, Routing, RoutingSpec},
};

use crate::{
    network::{net_err, RealNet},
    runner::{nets, ret, run_parity, step, Step},
};

/// A routing side: the adapter and a link going missing.
trait RoutingSide {
    fn routing(&mut self) -> &mut dyn Routing;
    /// Makes sure `link` does not exist (the fake assumes every link exists).
    fn link_missing(&mut self, link: &str);
}

/// A side as the steps take it (`dyn RoutingSide + 'static`: each side owns what it uses).
type DynRoutingSide = dyn RoutingSide;

impl RoutingSide for FakeRouting {
    fn routing(&mut self) -> &mut dyn Routing {
        self
    }

    fn link_missing(&mut self, link: &str) {
        self.set_link_missing(link, true);
    }
}

impl RoutingSide for RealNet {
    fn routing(&mut self) -> &mut dyn Routing {
        &mut self.r
    }

    fn link_missing(&mut self, _link: &str) {}
}

/// `observe()` of the mesh link; `writes()` is not compared (see `routing_steps`).
#[derive(Debug, PartialEq)]
struct RoutingReport {
    link_present: bool,
    up: bool,
    mtu: u32,
    addresses: Vec<IpNet>,
    rules: Vec<(bool, u32, u32)>,
    routes: Vec<(IpNet, u32, u32, u32)>,
}

fn routing_report(side: &mut DynRoutingSide) -> RoutingReport {
    let st = side.routing().observe("wsmesh0").unwrap();
    let mut addresses: Vec<IpNet> = st
        .addresses
        .into_iter()
        // IPv6 link-local addresses are the kernel's own (autoconfiguration).
        .filter(|a| !matches!(a, IpNet::V6(v6) if v6.addr().segments()[0] & 0xffc0 == 0xfe80))
        .collect();
    addresses.sort();
    let (mut rules, mut routes) = (st.rules, st.routes);
    rules.sort_unstable();
    routes.sort_unstable();
    RoutingReport {
        // The ifindex is the kernel's to choose.
        link_present: st.link_index.is_some(),
        up: st.up,
        mtu: st.mtu,
        addresses,
        rules,
        routes,
    }
}

fn routing_steps() -> Vec<Step<DynRoutingSide>> {
    let apply = |s: &RoutingSpec| {
        let s = s.clone();
        move |side: &mut DynRoutingSide| {
            // Only whether it wrote: the fake does not count the objects written (it
            // reports one link write per change), and neither are `writes()` compared.
            vec![ret(
                side.routing().apply(&s).map(|c| !c.is_empty()),
                net_err,
            )]
        }
    };
    let spec = RoutingSpec {
        link: "wsmesh0".to_owned(),
        addresses: nets(&["fd7f:175a:b97c:5602::1/64", "10.99.0.1/32"]),
        ..RoutingSpec::default()
    };
    let changed = RoutingSpec {
        mtu: 1380,
        addresses: nets(&["fd7f:175a:b97c:5602::2/64"]),
        table: 181,
        rule_priority: 32501,
        route_priority: 5,
        ..spec.clone()
    };
    let v6_only = RoutingSpec {
        ipv4: false,
        ..changed.clone()
    };
    let missing = RoutingSpec {
        link: "wsgone0".to_owned(),
        ..spec.clone()
    };
    let bad = RoutingSpec {
        rule_priority: 32766,
        ..spec.clone()
    };
    let apply_missing = apply(&missing);
    vec![
        step("first apply", apply(&spec)),
        step("the same again", apply(&spec)),
        step(
            "MTU, addresses, table, priority, metric change",
            apply(&changed),
        ),
        step("IPv4 off", apply(&v6_only)),
        step("a reserved priority", apply(&bad)),
        step("a missing link", move |s: &mut DynRoutingSide| {
            s.link_missing("wsgone0");
            apply_missing(s)
        }),
        step("teardown", |s: &mut DynRoutingSide| {
            vec![ret(s.routing().teardown(), net_err)]
        }),
    ]
}

#[test]
fn routing_fake_matches_rtnetlink() {
    let ns = NetnsGuard::new("wspar").unwrap();
    ns.run("ip", &["tuntap", "add", "dev", "wsmesh0", "mode", "tun"])
        .unwrap();
    let r = NetlinkRouting::new(ns.netns()).unwrap();
    let mut real = RealNet { ns, r };
    let mut fake = FakeRouting::new();
    run_parity(&routing_steps(), &mut fake, &mut real, routing_report);
}
