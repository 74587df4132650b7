//! Kernel parameters (the `Sysctl` trait): `FakeSysctl` against `/proc/sys` of a
//! throwaway network namespace. Both refuse the same writes with the same error.

use wirespan_dataplane::{
    fake::FakeSysctl,
    netns::NetnsGuard,
    sysctl::{ProcSysctl, Sysctl},
};

use crate::runner::{ret, run_parity, step, Step};

/// A side as the steps take it (`dyn Sysctl + 'static`: each side owns what it uses).
type DynSysctl = dyn Sysctl;

/// The parameters every step's report reads (all per network namespace).
const REPORTED: [&[&str]; 3] = [
    &["net", "ipv4", "conf", "lo", "rp_filter"],
    &["net", "ipv4", "conf", "all", "rp_filter"],
    &["net", "ipv4", "ping_group_range"],
];

fn report(side: &mut DynSysctl) -> Vec<String> {
    REPORTED
        .iter()
        .map(|p| ret(side.read(p), ToString::to_string))
        .collect()
}

fn write(
    path: &'static [&'static str],
    value: &'static str,
) -> impl Fn(&mut DynSysctl) -> Vec<String> {
    move |side: &mut DynSysctl| vec![ret(side.write(path, value), ToString::to_string)]
}

const LO: &[&str] = &["net", "ipv4", "conf", "lo", "rp_filter"];

fn sysctl_steps() -> Vec<Step<DynSysctl>> {
    vec![
        step("an integer", write(LO, "2")),
        step("trailing text after the integer", write(LO, "1 loose\n")),
        step("hexadecimal", write(LO, "0x2")),
        step("octal", write(LO, "010")),
        step("negative", write(LO, "-1")),
        step("blank changes nothing", write(LO, "")),
        step("not a number", write(LO, "loose")),
        step("beyond an int", write(LO, "99999999999")),
        step(
            "an unknown parameter",
            write(&["net", "ipv4", "conf", "lo", "no_such_knob"], "0"),
        ),
        step("an unknown interface", |s: &mut DynSysctl| {
            let p = ["net", "ipv4", "conf", "nosuchlink", "rp_filter"];
            vec![
                ret(s.write(&p, "0"), ToString::to_string),
                ret(s.read(&p), ToString::to_string),
            ]
        }),
        step("a directory", |s: &mut DynSysctl| {
            let p = ["net", "ipv4", "conf", "lo"];
            vec![
                ret(s.write(&p, "0"), ToString::to_string),
                ret(s.read(&p), ToString::to_string),
            ]
        }),
        step(
            "`..` as a component",
            write(
                &["net", "ipv4", "conf", "lo", "..", "all", "rp_filter"],
                "1",
            ),
        ),
        step(
            "a component holding a slash",
            write(&["net", "ipv4", "conf", "lo/../all", "rp_filter"], "1"),
        ),
        step("an empty component", |s: &mut DynSysctl| {
            vec![ret(
                s.read(&["net", "ipv4", "conf", "", "rp_filter"]),
                ToString::to_string,
            )]
        }),
        step(
            "two integers",
            write(&["net", "ipv4", "ping_group_range"], "100 200"),
        ),
        step(
            "a word among integers",
            write(&["net", "ipv4", "ping_group_range"], "100 many"),
        ),
    ]
}

#[test]
fn sysctl_fake_matches_proc_sys() {
    let ns = NetnsGuard::new("wspar").unwrap();
    let mut real = ProcSysctl::new(ns.netns().clone());
    // The fake starts with the namespace's own values.
    let mut fake = FakeSysctl::new();
    for p in REPORTED {
        fake.set(&p.join("."), &real.read(p).unwrap());
    }
    run_parity(
        &sysctl_steps(),
        &mut fake as &mut DynSysctl,
        &mut real as &mut DynSysctl,
        report,
    );
}
