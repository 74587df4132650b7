//! Attaching the fast-path classifier in a throwaway namespace: every interface but
//! `lo` and the excluded one, interfaces created later too; real packets counted as
//! hits; teardown leaves no program attached. Needs root.

use std::time::{Duration, Instant};

use aya::programs::{SchedClassifier, TcAttachType};
use wirespan_dataplane::{
    fastpath::{AttachMode, FastPath, FastPathConfig, Interfaces},
    marking::MarkingSpec,
    netns::{unique_name, NetnsGuard, NetnsThread},
};

fn tcx_programs(ns: &NetnsGuard, dev: &str) -> usize {
    let dev = dev.to_owned();
    NetnsThread::spawn(ns.netns())
        .unwrap()
        .run(move || SchedClassifier::query_tcx(&dev, TcAttachType::Ingress).map(|(_, p)| p.len()))
        .unwrap()
        .unwrap()
}

fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "not within 10 s: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn classifier_on_every_interface_but_excluded_ones_including_later_ones() {
    let a = NetnsGuard::new("wsfpA").unwrap();
    let b = NetnsGuard::new("wsfpB").unwrap();
    let (va, vb, excluded, excluded_peer, later, later_peer) = (
        unique_name("fa"),
        unique_name("fb"),
        unique_name("fx"),
        unique_name("fy"),
        unique_name("fl"),
        unique_name("fm"),
    );
    a.run(
        "ip",
        &["link", "add", &va, "type", "veth", "peer", "name", &vb],
    )
    .unwrap();
    a.run("ip", &["link", "set", &vb, "netns", b.name()])
        .unwrap();
    // No dummy interfaces here (no modules): veth pairs, one end excluded.
    a.run(
        "ip",
        &[
            "link",
            "add",
            &excluded,
            "type",
            "veth",
            "peer",
            "name",
            &excluded_peer,
        ],
    )
    .unwrap();
    a.run("ip", &["addr", "add", "192.168.60.1/24", "dev", &va])
        .unwrap();
    a.run("ip", &["link", "set", &va, "up"]).unwrap();
    b.run("ip", &["addr", "add", "192.168.60.2/24", "dev", &vb])
        .unwrap();
    b.run("ip", &["link", "set", &vb, "up"]).unwrap();

    let fp = FastPath::attach(
        a.netns(),
        FastPathConfig {
            interfaces: Interfaces::all_except([excluded.clone()]),
            ..FastPathConfig::default()
        },
    )
    .unwrap();
    let names = |fp: &FastPath| {
        fp.interfaces()
            .into_iter()
            .map(|i| i.name)
            .collect::<Vec<_>>()
    };
    let mut want = vec![va.clone(), excluded_peer];
    want.sort();
    let mut have = names(&fp);
    have.sort();
    assert_eq!(have, want);
    assert!(fp.interfaces().iter().all(|i| i.mode == AttachMode::Tcx));
    assert_eq!(tcx_programs(&a, &va), 1);
    assert_eq!(tcx_programs(&a, &excluded), 0);
    assert_eq!(tcx_programs(&a, "lo"), 0);

    // Packets from B to A's address (in the set) arrive on A's veth: hits.
    fp.apply(&MarkingSpec {
        prefixes_v4: vec!["192.168.60.1/32".parse().unwrap()],
        ..MarkingSpec::default()
    })
    .unwrap();
    let before = fp.counters().unwrap();
    b.run("ping", &["-c", "3", "-i", "0.2", "-W", "2", "192.168.60.1"])
        .unwrap();
    let after = fp.counters().unwrap();
    assert!(after.hit >= before.hit + 3, "{before:?} -> {after:?}");
    // A reader (what the metrics hold) sees the same counters, and nothing once the
    // fast path is gone.
    let reader = fp.counter_reader();
    let read = reader.read().expect("the fast path is attached");
    assert!(read.hit >= after.hit, "{after:?} then {read:?}");

    // An interface created later gets the classifier too.
    a.run(
        "ip",
        &[
            "link",
            "add",
            &later,
            "type",
            "veth",
            "peer",
            "name",
            &later_peer,
        ],
    )
    .unwrap();
    eventually("the new interfaces are attached", || {
        let n = names(&fp);
        n.contains(&later) && n.contains(&later_peer)
    });
    assert_eq!(tcx_programs(&a, &later), 1);
    // And one that goes away is forgotten.
    a.run("ip", &["link", "del", &later]).unwrap();
    eventually("the deleted interface is forgotten", || {
        !names(&fp).contains(&later)
    });

    fp.teardown().unwrap();
    assert_eq!(tcx_programs(&a, &va), 0);
    assert_eq!(reader.read(), None);
}

#[test]
fn only_selects_the_listed_interfaces() {
    let a = NetnsGuard::new("wsfpO").unwrap();
    let (one, two) = (unique_name("fo"), unique_name("ft"));
    a.run(
        "ip",
        &["link", "add", &one, "type", "veth", "peer", "name", &two],
    )
    .unwrap();
    let fp = FastPath::attach(
        a.netns(),
        FastPathConfig {
            interfaces: Interfaces::Only(vec![two.clone()]),
            ..FastPathConfig::default()
        },
    )
    .unwrap();
    assert_eq!(fp.interfaces().len(), 1);
    assert_eq!(fp.interfaces()[0].name, two);
    assert_eq!(tcx_programs(&a, &one), 0);
    // Dropping detaches as well.
    drop(fp);
    assert_eq!(tcx_programs(&a, &two), 0);
}
