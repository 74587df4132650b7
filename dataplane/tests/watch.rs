//! Kernel test of the netlink watcher in a fresh namespace.

use std::time::Duration;

use futures::StreamExt;
use wirespan_dataplane::{
    netns::NetnsGuard,
    watch::{Change, NetEvent, Watcher},
};

fn next_matching(
    w: &mut Watcher,
    rt: &tokio::runtime::Runtime,
    f: impl Fn(&NetEvent) -> bool,
) -> NetEvent {
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                let ev = w.next().await.expect("stream ended");
                if f(&ev) {
                    return ev;
                }
            }
        })
        .await
        .expect("event not seen in 5 s")
    })
}

#[test]
fn streams_link_address_and_route_changes() {
    let ns = NetnsGuard::new("wswatch").unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut w = Watcher::start(ns.netns(), true).unwrap();

    // The dump shows lo.
    next_matching(
        &mut w,
        &rt,
        |e| matches!(e, NetEvent::Link { name, change: Change::Updated, .. } if name == "lo"),
    );

    ns.run("ip", &["tuntap", "add", "dev", "wtch0", "mode", "tun"])
        .unwrap();
    let ev = next_matching(
        &mut w,
        &rt,
        |e| matches!(e, NetEvent::Link { name, .. } if name == "wtch0"),
    );
    let NetEvent::Link { index, .. } = ev else {
        unreachable!()
    };

    ns.run("ip", &["link", "set", "wtch0", "mtu", "1420", "up"])
        .unwrap();
    next_matching(
        &mut w,
        &rt,
        |e| matches!(e, NetEvent::Link { name, up: true, mtu: 1420, .. } if name == "wtch0"),
    );

    ns.run("ip", &["addr", "add", "10.77.0.1/24", "dev", "wtch0"])
        .unwrap();
    next_matching(
        &mut w,
        &rt,
        |e| matches!(e, NetEvent::Address { change: Change::Updated, index: i, address } if *i == index && address.to_string() == "10.77.0.1/24"),
    );

    ns.run(
        "ip",
        &[
            "route",
            "add",
            "10.88.0.0/16",
            "dev",
            "wtch0",
            "table",
            "180",
            "proto",
            "211",
            "metric",
            "5",
        ],
    )
    .unwrap();
    next_matching(&mut w, &rt, |e| {
        matches!(e, NetEvent::Route { change: Change::Updated, table: 180, destination, oif: Some(o), protocol: 211, priority: 5 }
            if *o == index && destination.to_string() == "10.88.0.0/16")
    });
    ns.run("ip", &["route", "del", "10.88.0.0/16", "table", "180"])
        .unwrap();
    next_matching(&mut w, &rt, |e| {
        matches!(
            e,
            NetEvent::Route {
                change: Change::Removed,
                table: 180,
                ..
            }
        )
    });

    ns.run("ip", &["link", "del", "wtch0"]).unwrap();
    next_matching(
        &mut w,
        &rt,
        |e| matches!(e, NetEvent::Link { change: Change::Removed, name, .. } if name == "wtch0"),
    );
    drop(w);
}

/// Issue 15 item 3: rule changes (IPv4 and IPv6) are watched, so a rule deleted from
/// outside is noticed.
#[test]
fn streams_rule_changes_v4_and_v6() {
    let ns = NetnsGuard::new("wswrule").unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut w = Watcher::start(ns.netns(), false).unwrap();
    for (fam, v6) in [("-4", false), ("-6", true)] {
        let add = [
            "rule", "add", "priority", "1234", "lookup", "77", "proto", "212",
        ];
        let mut args = vec![fam];
        args.extend_from_slice(&add);
        ns.run("ip", &args).unwrap();
        next_matching(&mut w, &rt, |e| {
            *e == NetEvent::Rule {
                change: Change::Updated,
                v6,
                priority: 1234,
                table: 77,
                protocol: 212,
            }
        });
        ns.run("ip", &[fam, "rule", "del", "priority", "1234"])
            .unwrap();
        next_matching(
            &mut w,
            &rt,
            |e| matches!(e, NetEvent::Rule { change: Change::Removed, v6: x, priority: 1234, .. } if *x == v6),
        );
    }
}
