//! Attaching the fast-path classifier in a throwaway namespace: every interface but
//! `lo` and the excluded one, interfaces created later too; real packets counted as
//! hits; teardown leaves no program attached, and never a qdisc or filter it did not
//! add. Needs root.
//!
//! The attach mode expected is the one this kernel offers, decided from its release
//! (tcx came in Linux 6.6), not from the product's own detection: on this host tcx, in
//! the suite's VM tier (Debian's 6.1) a cls_bpf filter on a clsact qdisc.

#[path = "support/ran.rs"]
mod ran;

use std::time::{Duration, Instant};

use aya::programs::{SchedClassifier, TcAttachType};
use wirespan_dataplane::{
    fastpath::{AttachMode, FastPath, FastPathConfig, Interfaces},
    marking::MarkingSpec,
    netns::{unique_name, NetnsGuard, NetnsThread},
};

/// The attach mode this kernel offers, from its release: tcx from Linux 6.6 on.
fn expected_mode() -> AttachMode {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut parts = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    let mode = if (major, minor) >= (6, 6) {
        AttachMode::Tcx
    } else {
        AttachMode::Clsact
    };
    ran::record(
        "attach",
        match mode {
            AttachMode::Tcx => "tcx",
            AttachMode::Clsact => "clsact",
        },
    );
    mode
}

/// Our classifiers on `dev`'s ingress, counted where the expected mode puts them:
/// tcx links, or direct-action cls_bpf filters (`tc filter show`; the foreign filters
/// these tests add are classic BPF, shown as `bytecode`).
fn programs(ns: &NetnsGuard, dev: &str) -> usize {
    match expected_mode() {
        AttachMode::Tcx => tcx_programs(ns, dev),
        AttachMode::Clsact => ns
            .run_stdout("tc", &["filter", "show", "dev", dev, "ingress"])
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("direct-action"))
            .count(),
    }
}

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
    let mode = expected_mode();
    assert!(
        fp.interfaces().iter().all(|i| i.mode == mode),
        "expected {mode:?}: {:?}",
        fp.interfaces()
    );
    assert_eq!(programs(&a, &va), 1);
    assert_eq!(programs(&a, &excluded), 0);
    assert_eq!(programs(&a, "lo"), 0);

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
    assert_eq!(programs(&a, &later), 1);
    // And one that goes away is forgotten.
    a.run("ip", &["link", "del", &later]).unwrap();
    eventually("the deleted interface is forgotten", || {
        !names(&fp).contains(&later)
    });

    fp.teardown().unwrap();
    assert_eq!(programs(&a, &va), 0);
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
    assert_eq!(fp.interfaces()[0].mode, expected_mode());
    assert_eq!(programs(&a, &one), 0);
    assert_eq!(programs(&a, &two), 1);
    // Dropping detaches as well.
    drop(fp);
    assert_eq!(programs(&a, &two), 0);
}

/// A foreign classic-BPF filter (what other software on the host would own) on
/// `dev`'s ingress, adding the clsact qdisc if there is none.
fn add_foreign_filter(ns: &NetnsGuard, dev: &str) {
    if !qdiscs(ns, dev).contains("clsact") {
        ns.run("tc", &["qdisc", "add", "dev", dev, "clsact"])
            .unwrap();
    }
    ns.run(
        "tc",
        &[
            "filter",
            "add",
            "dev",
            dev,
            "ingress",
            "pref",
            "1",
            "bpf",
            "bytecode",
            "1,6 0 0 0,",
        ],
    )
    .unwrap();
}

fn qdiscs(ns: &NetnsGuard, dev: &str) -> String {
    ns.run_stdout("tc", &["qdisc", "show", "dev", dev]).unwrap()
}

fn foreign_filters(ns: &NetnsGuard, dev: &str) -> usize {
    ns.run_stdout("tc", &["filter", "show", "dev", dev, "ingress"])
        .unwrap()
        .lines()
        .filter(|l| l.contains("bytecode"))
        .count()
}

/// The clsact qdisc is shared with other software: a qdisc that was there before is
/// left with its filters, and one the fast path added is kept when someone else put a
/// filter on it meanwhile. Only our own filters go. (On a tcx kernel the fast path
/// never touches either; the VM tier runs this on clsact.)
#[test]
fn teardown_never_removes_a_qdisc_or_filter_it_did_not_add() {
    let a = NetnsGuard::new("wsfpQ").unwrap();
    let (before, after) = (unique_name("fq"), unique_name("fr"));
    a.run(
        "ip",
        &[
            "link", "add", &before, "type", "veth", "peer", "name", &after,
        ],
    )
    .unwrap();
    add_foreign_filter(&a, &before);
    let fp = FastPath::attach(
        a.netns(),
        FastPathConfig {
            interfaces: Interfaces::Only(vec![before.clone(), after.clone()]),
            ..FastPathConfig::default()
        },
    )
    .unwrap();
    let mode = expected_mode();
    assert!(fp.interfaces().iter().all(|i| i.mode == mode));
    assert_eq!((programs(&a, &before), programs(&a, &after)), (1, 1));
    // Someone else uses the qdisc the fast path added (or adds one on tcx).
    add_foreign_filter(&a, &after);

    fp.teardown().unwrap();
    for dev in [&before, &after] {
        assert_eq!(programs(&a, dev), 0, "{dev}: our filter left");
        assert_eq!(foreign_filters(&a, dev), 1, "{dev}: a foreign filter went");
        assert!(qdiscs(&a, dev).contains("clsact"), "{dev}: the qdisc went");
    }

    // Alone on a qdisc it added, the fast path removes it again.
    let (alone, alone_peer) = (unique_name("fs"), unique_name("ft"));
    a.run(
        "ip",
        &[
            "link",
            "add",
            &alone,
            "type",
            "veth",
            "peer",
            "name",
            &alone_peer,
        ],
    )
    .unwrap();
    let fp = FastPath::attach(
        a.netns(),
        FastPathConfig {
            interfaces: Interfaces::Only(vec![alone.clone()]),
            ..FastPathConfig::default()
        },
    )
    .unwrap();
    assert_eq!(programs(&a, &alone), 1);
    fp.teardown().unwrap();
    assert_eq!(programs(&a, &alone), 0);
    assert!(
        !qdiscs(&a, &alone).contains("clsact"),
        "{}",
        qdiscs(&a, &alone)
    );
}
