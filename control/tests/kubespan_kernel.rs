//! Kernel test of the mesh manager: the KubeSpan controllers with the real adapters
//! (userspace WireGuard, nftables) in a throwaway network namespace program a real
//! device and a real marking set from affiliates.

use std::sync::Arc;

mod kubespan_common;

use kubespan_common::{eventually, eventually_within, key, register_real, seed_cluster};
use wirespan_control::{
    controllers::kubespan::NftablesMarking,
    kubespan::clock::{Clock, FakeClock, SystemClock},
    resources::config::{MachineConfig, MachineConfigSpec},
    runtime::{Runtime, Store, StoreOptions},
    testing::Harness,
};
use wirespan_dataplane::{
    netns::{unique_name, NetnsGuard},
    wireguard::PresharedKey,
};

/// A running mesh node in a throwaway namespace: the KubeSpan controllers with
/// userspace WireGuard and nftables, the cluster secret `secret`, peers 1 and 2, the
/// mesh enabled on a uniquely named link.
struct MeshNode {
    ns: NetnsGuard,
    link: String,
    h: Harness,
    _dir: tempfile::TempDir,
}

fn start_mesh(prefix: &str, mac: &str, secret: [u8; 32], clock: Arc<dyn Clock>) -> MeshNode {
    let ns = NetnsGuard::new(prefix).unwrap();
    // A link with a MAC for the identity (namespaces have no physical link).
    ns.run(
        "ip",
        &[
            "link", "add", "d0", "address", mac, "type", "veth", "peer", "name", "d1",
        ],
    )
    .unwrap();
    let link = unique_name("wsk");
    let dir = tempfile::tempdir().unwrap();
    let store = Store::new(StoreOptions::default());
    let mut runtime = Runtime::new(store.clone());
    register_real(
        &mut runtime,
        &ns,
        dir.path(),
        Arc::new(NftablesMarking {
            netns: ns.netns().clone(),
        }),
        clock,
    );
    seed_cluster(&store, secret);
    let config = wirespan_control::config::parse(&format!(
        "apiVersion: v1alpha1\nkind: KubeSpanConfig\nenabled: true\nlinkName: {link}\n"
    ))
    .unwrap();
    store
        .modify::<MachineConfig>("config", "active", "", |r| {
            r.spec = MachineConfigSpec {
                source: "test".into(),
                document_count: 1,
                config: config.clone(),
            };
        })
        .unwrap();
    MeshNode {
        ns,
        link,
        h: Harness::start(runtime),
        _dir: dir,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manager_programs_a_real_device_and_marking_set() {
    let secret = [9u8; 32];
    let MeshNode { ns, link, h, _dir } =
        start_mesh("wsks", "00:16:3e:12:34:56", secret, Arc::new(SystemClock));

    let peers = eventually("two peers on the device", || {
        let out = ns.run_stdout("wg", &["show", &link, "dump"]).ok()?;
        let peers: Vec<Vec<String>> = out
            .lines()
            .skip(1)
            .map(|l| l.split('\t').map(str::to_owned).collect())
            .collect();
        (peers.len() == 2).then_some(peers)
    })
    .await;
    let psk = PresharedKey::from_bytes(secret).to_base64();
    for n in 1..=2u8 {
        let p = peers.iter().find(|p| p[0] == key(n)).expect("peer present");
        assert_eq!(p[1], psk);
        assert_eq!(p[2], format!("192.0.2.{n}:51820"));
        let mut ips: Vec<&str> = p[3].split(',').collect();
        ips.sort_unstable();
        let (a, b, c) = (
            format!("10.244.{n}.0/24"),
            format!("10.5.0.{n}/32"),
            format!("fd21:4de:ec13:da02::{n}/128"),
        );
        assert_eq!(ips, [a.as_str(), b.as_str(), c.as_str()]);
    }
    // Keepalive 25 s on every peer, once the higher-keyed side's first-handshake
    // deferral (about a second) is over.
    eventually("every peer kept alive", || {
        let out = ns.run_stdout("wg", &["show", &link, "dump"]).ok()?;
        let alive = out
            .lines()
            .skip(1)
            .filter(|l| l.split('\t').nth(7) == Some("25"))
            .count();
        (alive == 2).then_some(())
    })
    .await;
    let iface = ns.run_stdout("wg", &["show", &link, "dump"]).unwrap();
    let iface: Vec<&str> = iface.lines().next().unwrap().split('\t').collect();
    assert_eq!(iface[2], "51820");
    assert_eq!(iface[3], "0x20");

    // The routed set: hosts in the hash set, pod CIDRs in the interval set.
    let elements = |set: &str| -> Vec<String> {
        let out = ns
            .run_stdout("nft", &["-j", "list", "set", "inet", "wirespan", set])
            .unwrap_or_default();
        let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
        let mut found = Vec::new();
        for item in v["nftables"].as_array().into_iter().flatten() {
            for e in item["set"]["elem"].as_array().into_iter().flatten() {
                found.push(match e {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                });
            }
        }
        found
    };
    let hosts = eventually("hosts in the marking set", || {
        let h = elements("v4_hosts");
        (h.len() == 2).then_some(h)
    })
    .await;
    assert!(
        hosts.contains(&"10.5.0.1".to_owned()) && hosts.contains(&"10.5.0.2".to_owned()),
        "{hosts:?}"
    );
    // The pod CIDRs (/24) in the per-length layout's set of /24 networks.
    let nets = elements("v4_len24");
    assert_eq!(nets.len(), 2, "{nets:?}");
    assert!(nets.iter().any(|n| n.contains("10.244.1.0")), "{nets:?}");

    // Reverse-path filtering is off on the mesh link (in this namespace only).
    let rp = ns
        .run_stdout(
            "cat",
            &[&format!("/proc/sys/net/ipv4/conf/{link}/rp_filter")],
        )
        .unwrap();
    assert_eq!(rp.trim(), "0");

    // Shutdown with teardown removes the device and the table.
    h.stop().await.unwrap();
    let links = ns.run_stdout("ip", &["-j", "link", "show"]).unwrap();
    assert!(!links.contains(&format!("\"{link}\"")), "{links}");
    let tables = ns.run_stdout("nft", &["-j", "list", "tables"]).unwrap();
    assert!(!tables.contains("\"wirespan\""), "{tables}");
}

/// Issue 15 item 3: what the mesh made and someone else deleted comes back within one
/// reconcile tick (30 s): a marking set element, the whole nft table, and the mesh's
/// WireGuard link with its peers. Nothing but the manager's own timer wakes it here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manager_repairs_its_link_table_and_elements_deleted_from_outside() {
    let MeshNode { ns, link, h, _dir } = start_mesh(
        "wsdr",
        "00:16:3e:12:34:57",
        [7u8; 32],
        Arc::new(SystemClock),
    );

    let hosts = |ns: &NetnsGuard| -> Option<String> {
        ns.run_stdout(
            "nft",
            &["-j", "list", "set", "inet", "wirespan", "v4_hosts"],
        )
        .ok()
    };
    let peer_count = |ns: &NetnsGuard| -> usize {
        ns.run_stdout("wg", &["show", &link, "dump"])
            .map(|o| o.lines().skip(1).count())
            .unwrap_or(0)
    };
    // Deadlines cover one tick of the manager (30 s) with room for a loaded machine.
    let within_a_tick = std::time::Duration::from_secs(45);
    eventually_within(within_a_tick, "both hosts in the set", || {
        hosts(&ns).filter(|h| h.contains("10.5.0.1") && h.contains("10.5.0.2"))
    })
    .await;
    eventually_within(within_a_tick, "two peers", || {
        (peer_count(&ns) == 2).then_some(())
    })
    .await;

    // One element, deleted by hand.
    ns.run(
        "nft",
        &[
            "delete",
            "element",
            "inet",
            "wirespan",
            "v4_hosts",
            "{ 10.5.0.1 }",
        ],
    )
    .unwrap();
    assert!(!hosts(&ns).unwrap().contains("10.5.0.1"));
    eventually_within(within_a_tick, "the element back", || {
        hosts(&ns).filter(|h| h.contains("10.5.0.1"))
    })
    .await;

    // The whole table.
    ns.run("nft", &["delete", "table", "inet", "wirespan"])
        .unwrap();
    assert!(hosts(&ns).is_none());
    eventually_within(within_a_tick, "the table back with its elements", || {
        hosts(&ns).filter(|h| h.contains("10.5.0.1") && h.contains("10.5.0.2"))
    })
    .await;

    // The link (and with it every WireGuard peer).
    ns.run("ip", &["link", "del", &link]).unwrap();
    eventually_within(within_a_tick, "the link and its peers back", || {
        (peer_count(&ns) == 2).then_some(())
    })
    .await;
    h.stop().await.unwrap();
}

/// A wireguard-go that dies is restarted empty by the backend's supervisor, and the
/// manager applies the whole device at once instead of at its next timer: here the
/// clock is frozen, so no timer ever fires and only that wake-up brings the peers back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_return_at_once_after_wireguard_go_is_killed() {
    let clock = FakeClock::new(std::time::SystemTime::now());
    let MeshNode { ns, link, h, _dir } = start_mesh(
        "wsgk",
        "00:16:3e:12:34:58",
        [5u8; 32],
        Arc::new(clock.clone()),
    );
    let peer_count = |ns: &NetnsGuard| -> usize {
        ns.run_stdout("wg", &["show", &link, "dump"])
            .map(|o| o.lines().skip(1).count())
            .unwrap_or(0)
    };
    eventually("two peers", || (peer_count(&ns) == 2).then_some(())).await;
    let pid = |ns: &NetnsGuard| -> Option<String> {
        let out = std::process::Command::new("ip")
            .args(["netns", "pids", ns.name()])
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .find(|p| {
                std::fs::read_to_string(format!("/proc/{p}/comm"))
                    .is_ok_and(|c| c.trim() == "wireguard-go")
            })
            .map(str::to_owned)
    };
    let killed = pid(&ns).expect("wireguard-go runs in the namespace");
    std::process::Command::new("kill")
        .args(["-9", &killed])
        .status()
        .unwrap();
    eventually("a new wireguard-go", || pid(&ns).filter(|p| *p != killed)).await;
    eventually("both peers back on the new device", || {
        (peer_count(&ns) == 2).then_some(())
    })
    .await;
    h.stop().await.unwrap();
}

/// The production prober against a real peer kernel: two namespaces joined by a veth.
/// The peer's kernel answers a probe (a port unreachable) and the prober reports it as
/// that peer's; an error sent by a router on the way is not the peer's answer; a peer
/// whose firewall drops the probe is never reported, and the datagram did reach it.
#[test]
fn the_udp_prober_reports_the_replies_of_a_real_peer_kernel() {
    use std::{
        net::IpAddr,
        time::{Duration, Instant},
    };
    use wirespan_control::controllers::kubespan::manager::{Prober as _, UdpProber};
    use wirespan_dataplane::netns::NetnsThread;

    let (a, b) = (
        NetnsGuard::new("wspa").unwrap(),
        NetnsGuard::new("wspb").unwrap(),
    );
    let ok = |out: std::io::Result<std::process::Output>| {
        let out = out.unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    ok(a.run(
        "ip",
        &[
            "link",
            "add",
            "p0",
            "type",
            "veth",
            "peer",
            "name",
            "p1",
            "netns",
            b.name(),
        ],
    ));
    for (ns, dev, addr) in [(&a, "p0", "fd00:5eed::1/64"), (&b, "p1", "fd00:5eed::2/64")] {
        ok(ns.run("ip", &["addr", "add", addr, "dev", dev, "nodad"]));
        ok(ns.run("ip", &["link", "set", dev, "up"]));
    }
    // A host behind b that does not exist: b, forwarding, answers for it (address
    // unreachable), which is a router's error, not the host's.
    ok(b.run("sysctl", &["-qw", "net.ipv6.conf.all.forwarding=1"]));
    ok(a.run(
        "ip",
        &["route", "add", "fd00:beef::/64", "via", "fd00:5eed::2"],
    ));
    ok(b.run("ip", &["route", "add", "unreachable", "fd00:beef::/64"]));

    let peer: IpAddr = "fd00:5eed::2".parse().unwrap();
    let behind: IpAddr = "fd00:beef::9".parse().unwrap();
    let prober = Arc::new(UdpProber::new());
    let on_a = NetnsThread::spawn(a.netns()).unwrap();
    let probe = |to: IpAddr| {
        let p = Arc::clone(&prober);
        // The socket opens on first use, in the namespace of the thread using it.
        on_a.run(move || p.probe(to)).unwrap();
    };
    let replies_within = |d: Duration| {
        let deadline = Instant::now() + d;
        loop {
            let got = prober.kernel_replies();
            if !got.is_empty() || Instant::now() > deadline {
                return got;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };

    probe(peer);
    let got = replies_within(Duration::from_secs(5));
    assert_eq!(got, [peer].into_iter().collect(), "the peer answered");

    // ICMPv6 destination-unreachable messages a has received (each reply, and a
    // router's error), from its own counters: the event that a reply has arrived.
    let unreachables_at_a = || -> u64 {
        a.run_stdout("cat", &["/proc/net/snmp6"])
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("Icmp6InDestUnreachs")?.trim().parse().ok())
            .unwrap()
    };
    let arrival_after = |before: u64| {
        let deadline = Instant::now() + Duration::from_secs(5);
        while unreachables_at_a() <= before {
            assert!(Instant::now() < deadline, "no ICMPv6 error reached a");
            std::thread::sleep(Duration::from_millis(20));
        }
    };

    // Twice in a row, without reading in between: the second send is not lost to the
    // first reply, pending on the socket as its error when it goes out, and both
    // replies are reported.
    let before = unreachables_at_a();
    probe(peer);
    arrival_after(before);
    probe(peer);
    assert_eq!(
        replies_within(Duration::from_secs(5)),
        [peer].into_iter().collect()
    );
    let sent = b
        .run_stdout("ip", &["-6", "-j", "-s", "link", "show", "p1"])
        .unwrap();
    let rx: serde_json::Value = serde_json::from_str(&sent).unwrap();
    assert!(
        rx[0]["stats64"]["rx"]["packets"].as_u64().unwrap() >= 3,
        "{sent}"
    );

    // A router's error for a host behind it: once it has arrived, and a probe of the
    // peer sent after it has been answered and reported (the socket's errors queue in
    // order), only the peer is reported.
    let before = unreachables_at_a();
    probe(behind);
    arrival_after(before);
    probe(peer);
    assert_eq!(
        replies_within(Duration::from_secs(5)),
        [peer].into_iter().collect()
    );

    // A peer that drops the probe.
    ok(b.run(
        "nft",
        &[
            "add table inet t; add chain inet t in { type filter hook input priority 0; }; \
             add rule inet t in udp dport 9 counter drop",
        ],
    ));
    probe(peer);
    // Once the peer's firewall has counted the probe, no answer can follow.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let counted = b
            .run_stdout("nft", &["list", "chain", "inet", "t", "in"])
            .unwrap();
        if counted.contains("packets 1 ") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the probe never reached the peer: {counted}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(prober.kernel_replies().is_empty());
}
