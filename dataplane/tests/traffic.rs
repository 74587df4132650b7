//! Real traffic between two namespaces joined by a veth underlay, each running
//! wireguard-go with this crate's WireGuard, routing and marking adapters: packets to
//! a peer's node IP (in the routed set) are marked and cross the tunnel, packets to an
//! address outside the routed set go over the underlay in clear. IPv4 and IPv6.

use std::net::SocketAddr;

use wirespan_dataplane::{
    marking::{Marking, MarkingSpec, NftMarking, CHAIN_OUTGOING},
    netns::{unique_name, NetnsGuard},
    routing::{NetlinkRouting, Routing, RoutingSpec},
    wireguard::{
        userspace::UserspaceBackend, PresharedKey, PrivateKey, WgDevice, WgPeer, WireGuard,
    },
};

struct Node {
    ns: NetnsGuard,
    wg: UserspaceBackend,
    routing: NetlinkRouting,
    marking: NftMarking,
    dev: WgDevice,
}

fn sysctl(ns: &NetnsGuard, kv: &str) {
    ns.run("sysctl", &["-q", "-w", kv]).unwrap();
}

fn node(ns: NetnsGuard) -> Node {
    for kv in [
        "net.ipv4.conf.all.rp_filter=0",
        "net.ipv4.conf.default.rp_filter=0",
    ] {
        sysctl(&ns, kv);
    }
    let name = unique_name("wtr");
    Node {
        wg: UserspaceBackend::new(&name, ns.netns().clone()),
        routing: NetlinkRouting::new(ns.netns()).unwrap(),
        marking: NftMarking::new(ns.netns().clone()),
        dev: WgDevice {
            name,
            private_key: PrivateKey::generate(),
            listen_port: 51820,
            fwmark: 0x20,
            peers: vec![],
        },
        ns,
    }
}

/// Counters of the mark rules of the output chain: (packets, bytes) summed.
fn mark_packets(n: &mut Node) -> u64 {
    n.marking
        .observe()
        .unwrap()
        .counters
        .iter()
        .filter(|(c, _, _)| c.starts_with("wirespan:mark:"))
        .map(|(_, p, _)| *p)
        .sum()
}

fn wg_bytes(n: &mut Node) -> (u64, u64) {
    let st = n.wg.observe().unwrap();
    st.peers
        .iter()
        .fold((0, 0), |(r, t), p| (r + p.rx_bytes, t + p.tx_bytes))
}

fn ping(n: &Node, addr: &str) {
    n.ns.run("ping", &["-c", "2", "-i", "0.2", "-W", "2", addr])
        .unwrap_or_else(|e| panic!("ping {addr} from {}: {e}", n.ns.name()));
}

#[test]
fn marked_traffic_crosses_tunnel_unmarked_does_not() {
    let mut a = node(NetnsGuard::new("wstA").unwrap());
    let mut b = node(NetnsGuard::new("wstB").unwrap());

    // Underlay: veth pair, two subnets per family. The *50* addresses are the node IPs
    // (routed set); the *51* ones are outside the routed set.
    let (va, vb) = (unique_name("va"), unique_name("vb"));
    a.ns.run(
        "ip",
        &["link", "add", &va, "type", "veth", "peer", "name", &vb],
    )
    .unwrap();
    a.ns.run("ip", &["link", "set", &vb, "netns", b.ns.name()])
        .unwrap();
    for (n, dev, i) in [(&a, &va, 1), (&b, &vb, 2)] {
        for addr in [format!("192.168.50.{i}/24"), format!("192.168.51.{i}/24")] {
            n.ns.run("ip", &["addr", "add", &addr, "dev", dev]).unwrap();
        }
        for addr in [format!("fd50::{i}/64"), format!("fd51::{i}/64")] {
            n.ns.run("ip", &["addr", "add", &addr, "dev", dev, "nodad"])
                .unwrap();
        }
        n.ns.run("ip", &["link", "set", dev, "up"]).unwrap();
    }

    let psk = PresharedKey::generate();
    let peer_of = |n: &Node, i: u8| WgPeer {
        public_key: n.dev.private_key.public_key(),
        preshared_key: Some(psk.clone()),
        persistent_keepalive: 0,
        endpoint: Some(SocketAddr::new(
            format!("192.168.50.{i}").parse().unwrap(),
            51820,
        )),
        allowed_ips: vec![
            format!("192.168.50.{i}/32").parse().unwrap(),
            format!("fd50::{i}/128").parse().unwrap(),
            format!("fdaa::{i}/128").parse().unwrap(),
        ],
    };
    let pb = peer_of(&b, 2);
    let pa = peer_of(&a, 1);
    a.dev.peers = vec![pb];
    b.dev.peers = vec![pa];

    for (n, i) in [(&mut a, 2u8), (&mut b, 1u8)] {
        n.wg.apply(&n.dev).unwrap();
        n.routing
            .apply(&RoutingSpec {
                link: n.dev.name.clone(),
                addresses: vec![format!("fdaa::{}/64", 3 - i).parse().unwrap()],
                ..RoutingSpec::default()
            })
            .unwrap();
        // Placeholders first, so the routed hosts arrive as an element update (the
        // netlink batch path), not with the table.
        n.marking
            .apply(&MarkingSpec {
                prefixes_v4: vec!["192.0.2.99/32".parse().unwrap()],
                prefixes_v6: vec!["2001:db8::99/128".parse().unwrap()],
                ..MarkingSpec::default()
            })
            .unwrap();
        n.marking
            .apply(&MarkingSpec {
                prefixes_v4: vec![format!("192.168.50.{i}/32").parse().unwrap()],
                prefixes_v6: vec![format!("fd50::{i}/128").parse().unwrap()],
                ..MarkingSpec::default()
            })
            .unwrap();
    }

    // Marked destinations, IPv4 then IPv6: WireGuard and the nft mark counter move.
    for dst in ["192.168.50.2", "fd50::2"] {
        let (rx0, tx0) = wg_bytes(&mut a);
        let m0 = mark_packets(&mut a);
        ping(&a, dst);
        let (rx1, tx1) = wg_bytes(&mut a);
        let m1 = mark_packets(&mut a);
        assert!(
            tx1 > tx0 && rx1 > rx0,
            "{dst}: WireGuard counters did not move ({rx0},{tx0}) -> ({rx1},{tx1})"
        );
        assert!(m1 >= m0 + 2, "{dst}: nft mark counter {m0} -> {m1}");
    }
    // The reply path on B was marked too.
    assert!(mark_packets(&mut b) >= 4);

    // The mesh ULA goes through the connected /64, no mark needed.
    let m0 = mark_packets(&mut a);
    let (_, tx0) = wg_bytes(&mut a);
    ping(&a, "fdaa::2");
    assert!(wg_bytes(&mut a).1 > tx0);
    assert_eq!(mark_packets(&mut a), m0);

    // Unmarked destinations: the underlay in clear, WireGuard and nft untouched.
    for dst in ["192.168.51.2", "fd51::2"] {
        let w0 = wg_bytes(&mut a);
        let m0 = mark_packets(&mut a);
        ping(&a, dst);
        assert_eq!(wg_bytes(&mut a), w0, "{dst}: went through WireGuard");
        assert_eq!(mark_packets(&mut a), m0, "{dst}: was marked");
    }

    // The output chain's counters as nft reports them.
    let out =
        a.ns.run_stdout(
            "nft",
            &["list", "chain", "inet", "wirespan", CHAIN_OUTGOING],
        )
        .unwrap();
    assert!(out.contains("ip daddr @v4_hosts counter packets"), "{out}");
    assert!(
        !out.contains("ip daddr @v4_hosts counter packets 0 "),
        "{out}"
    );
}
