//! Marking: `FakeMarking` against nftables.

use std::collections::BTreeMap;

use wirespan_dataplane::{
    fake::FakeMarking,
    marking::{
        expected_state, parse_table, render, Marking, MarkingError, MarkingSpec, NftMarking,
        PrefixDelta, SetLayout, TableState,
    },
    netns::NetnsGuard,
};

use crate::runner::{invalid, nets, ret, run_parity, step, Step};

/// A marking side: the adapter, every `inet` table read behind its back, and someone
/// else deleting a table.
trait MarkingSide {
    fn marking(&mut self) -> &mut dyn Marking;
    /// Every table of family `inet` by name, as [`parse_table`] reads it.
    fn tables(&mut self) -> BTreeMap<String, TableState>;
    fn delete_table(&mut self, name: &str);
}

/// A side as the steps take it (`dyn MarkingSide + 'static`: each side owns what it uses).
type DynMarkingSide = dyn MarkingSide;

struct FakeNft(FakeMarking);

impl MarkingSide for FakeNft {
    fn marking(&mut self) -> &mut dyn Marking {
        &mut self.0
    }

    /// The table the fake holds, as the kernel would list it: the rendering of the
    /// spec it last applied, while present.
    fn tables(&mut self) -> BTreeMap<String, TableState> {
        let present = self.0.observe().unwrap().present;
        self.0
            .spec()
            .filter(|_| present)
            .map(|s| (s.table.clone(), expected_state(&render(&s))))
            .into_iter()
            .collect()
    }

    fn delete_table(&mut self, _name: &str) {
        self.0.flush();
    }
}

struct RealNft {
    ns: NetnsGuard,
    m: NftMarking,
}

impl MarkingSide for RealNft {
    fn marking(&mut self) -> &mut dyn Marking {
        &mut self.m
    }

    fn tables(&mut self) -> BTreeMap<String, TableState> {
        let list: serde_json::Value = serde_json::from_str(
            &self
                .ns
                .run_stdout("nft", &["-j", "list", "tables", "inet"])
                .unwrap(),
        )
        .unwrap();
        list["nftables"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|o| o["table"]["name"].as_str())
            .map(|t| {
                let json = self
                    .ns
                    .run_stdout("nft", &["-j", "list", "table", "inet", t])
                    .unwrap();
                let mut st = parse_table(&json).expect("our table parses");
                // Packet counters are the kernel's (compared in `observe`).
                st.counters.clear();
                (t.to_owned(), st)
            })
            .collect()
    }

    fn delete_table(&mut self, name: &str) {
        self.ns
            .run("nft", &["delete", "table", "inet", name])
            .unwrap();
    }
}

#[derive(Debug, PartialEq)]
struct MarkingReport {
    present: bool,
    elements: Vec<(String, usize)>,
    counters: Vec<(String, u64, u64)>,
    tables: BTreeMap<String, TableState>,
    transactions: u64,
}

fn marking_report(side: &mut DynMarkingSide) -> MarkingReport {
    let st = side.marking().observe().unwrap();
    let mut elements = st.elements;
    elements.sort();
    MarkingReport {
        present: st.present,
        elements,
        counters: st.counters,
        tables: side.tables(),
        transactions: side.marking().transactions(),
    }
}

fn marking_err(e: &MarkingError) -> String {
    match e {
        MarkingError::Invalid(e) => invalid(e),
        MarkingError::NotApplied => "NotApplied".to_owned(),
        other => other.to_string(),
    }
}

/// A step applying `spec`.
fn apply(spec: &MarkingSpec) -> impl Fn(&mut DynMarkingSide) -> Vec<String> + 'static {
    let spec = spec.clone();
    move |side: &mut DynMarkingSide| vec![ret(side.marking().apply(&spec), marking_err)]
}

/// A step applying a delta.
fn delta(remove: &[&str], add: &[&str]) -> impl Fn(&mut DynMarkingSide) -> Vec<String> + 'static {
    let d = PrefixDelta {
        remove: nets(remove),
        add: nets(add),
    };
    move |side: &mut DynMarkingSide| vec![ret(side.marking().apply_delta(&d), marking_err)]
}

fn teardown(side: &mut DynMarkingSide) -> Vec<String> {
    vec![ret(side.marking().teardown(), marking_err)]
}

fn marking_steps() -> Vec<Step<DynMarkingSide>> {
    let spec = MarkingSpec {
        prefixes_v4: nets(&[
            "10.1.0.1/32",
            "10.1.0.2/32",
            "10.244.0.0/16",
            "10.244.1.0/24", // inside the /16: dropped from the interval set
        ]),
        prefixes_v6: nets(&["fd00:1::1/128", "2001:db8::/32"]),
        ..MarkingSpec::default()
    };
    let adjacent = MarkingSpec {
        // Adjacent and duplicate prefixes: stored as given, never merged.
        prefixes_v4: nets(&[
            "10.1.0.1/32",
            "10.1.0.1/32",
            "10.50.0.0/25",
            "10.50.0.128/25",
        ]),
        ..spec.clone()
    };
    let mtu = MarkingSpec {
        mtu: 1380,
        mark: 0x100,
        mask: 0x120,
        device_mark: 0x20,
        ..adjacent.clone()
    };
    let interval = MarkingSpec {
        layout: SetLayout::Interval,
        ..mtu.clone()
    };
    let renamed = MarkingSpec {
        table: "wirespan2".to_owned(),
        ..interval.clone()
    };
    let bad = MarkingSpec {
        prefixes_v4: nets(&["10.1.0.1/24"]),
        ..renamed.clone()
    };
    vec![
        step("a delta before any apply", delta(&[], &["10.9.0.0/16"])),
        step("observe before any apply", |_: &mut DynMarkingSide| {
            Vec::new()
        }),
        step("first apply: hosts and nets of both families", apply(&spec)),
        step("the same spec again", apply(&spec)),
        step(
            "delta: add hosts and CIDRs of both families",
            delta(
                &[],
                &[
                    "10.1.0.3/32",
                    "10.245.0.0/16",
                    "fd00:1::3/128",
                    "fd00:9::/48",
                ],
            ),
        ),
        step(
            "delta: remove a host and a CIDR, add one in its place",
            delta(&["10.1.0.2/32", "10.245.0.0/16"], &["10.246.0.0/16"]),
        ),
        step(
            "delta: empty the IPv6 sets (rules go with them)",
            delta(
                &[
                    "fd00:1::1/128",
                    "fd00:1::3/128",
                    "2001:db8::/32",
                    "fd00:9::/48",
                ],
                &[],
            ),
        ),
        step(
            "delta: remove something absent",
            delta(&["10.77.0.0/16"], &[]),
        ),
        step("delta: host bits set", delta(&[], &["10.1.0.1/24"])),
        step("an empty delta", delta(&[], &[])),
        step("adjacent and duplicate prefixes", apply(&adjacent)),
        step("MTU and marks change", apply(&mtu)),
        step("interval layout", apply(&interval)),
        step("someone deletes the table", |s: &mut DynMarkingSide| {
            s.delete_table("wirespan");
            Vec::new()
        }),
        step("the next apply recreates it", apply(&interval)),
        step("the table is renamed", apply(&renamed)),
        step("an invalid spec writes nothing", apply(&bad)),
        step("teardown, twice", |s: &mut DynMarkingSide| {
            [teardown(s), teardown(s)].concat()
        }),
        step("apply after teardown", apply(&spec)),
        step("teardown again", teardown),
    ]
}

#[test]
fn marking_fake_matches_nftables() {
    let (mut fake, mut real) = marking_sides();
    run_parity(&marking_steps(), &mut fake, &mut real, marking_report);
}

fn marking_sides() -> (FakeNft, RealNft) {
    let ns = NetnsGuard::new("wspar").unwrap();
    let m = NftMarking::new(ns.netns().clone());
    (FakeNft(FakeMarking::new()), RealNft { ns, m })
}

// Differences once found in the real adapter, fixed there; each test is the shortest
// scenario that showed one.

#[test]
fn marking_delta_after_an_invalid_spec() {
    let spec = MarkingSpec {
        prefixes_v4: nets(&["10.1.0.1/32"]),
        ..MarkingSpec::default()
    };
    let bad = MarkingSpec {
        mtu: 10,
        ..spec.clone()
    };
    let steps = vec![
        step("apply", apply(&spec)),
        step("an invalid spec writes nothing", apply(&bad)),
        step(
            "a delta applies to the spec last applied",
            delta(&[], &["10.9.0.0/16"]),
        ),
    ];
    let (mut fake, mut real) = marking_sides();
    run_parity(&steps, &mut fake, &mut real, marking_report);
}

#[test]
fn marking_delta_after_teardown() {
    let spec = MarkingSpec {
        prefixes_v4: nets(&["10.1.0.1/32"]),
        ..MarkingSpec::default()
    };
    let steps = vec![
        step("apply", apply(&spec)),
        step("teardown", teardown),
        step("a delta after teardown", delta(&[], &["10.9.0.0/16"])),
    ];
    let (mut fake, mut real) = marking_sides();
    run_parity(&steps, &mut fake, &mut real, marking_report);
}
