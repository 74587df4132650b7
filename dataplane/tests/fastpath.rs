//! The fast-path classifier in the kernel, through BPF_PROG_TEST_RUN: crafted packets
//! (IPv4/IPv6 hits by host and by CIDR, misses, already device-marked, truncated,
//! non-IP, VLAN-tagged) against the resulting mark, return code and counters, for
//! both lookup structures; map sync (incremental at 100,000 prefixes, capacity
//! refusal); a randomised comparison of both structures with a plain reference.
//! Needs root (bpf syscall).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use rand::{rngs::StdRng, Rng, SeedableRng};
use wirespan_dataplane::{
    fastpath::{sync::Structures, testrun::udp_frame, Counters, FastPathError, MapDump, Programs},
    ipnet::IpNet,
    marking::{MarkingSpec, PrefixDelta},
};
use wirespan_ebpf::{PROG_FLOOR, PROG_LPM, PROG_PHASH};

/// TC_ACT_UNSPEC / TCX_NEXT: the classifier never decides a packet's fate.
const NEXT: i32 = -1;
const BOTH: Structures = Structures {
    phash: true,
    lpm: true,
};

fn load() -> Programs {
    Programs::load(BOTH, 1 << 18, &[PROG_PHASH, PROG_LPM, PROG_FLOOR]).unwrap()
}

fn spec(v4: &[&str], v6: &[&str]) -> MarkingSpec {
    MarkingSpec {
        prefixes_v4: v4.iter().map(|p| p.parse().unwrap()).collect(),
        prefixes_v6: v6.iter().map(|p| p.parse().unwrap()).collect(),
        ..MarkingSpec::default()
    }
}

fn frame(dst: &str) -> Vec<u8> {
    let dst: IpAddr = dst.parse().unwrap();
    let src: IpAddr = match dst {
        IpAddr::V4(_) => Ipv4Addr::new(192, 0, 2, 1).into(),
        IpAddr::V6(_) => "2001:db8::1".parse::<Ipv6Addr>().unwrap().into(),
    };
    udp_frame([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2], src, dst, 16)
}

/// Runs both lookup programs and checks they agree; returns the resulting mark.
fn mark_of(p: &Programs, packet: &[u8], mark_in: u32) -> u32 {
    let a = p.test_run(PROG_PHASH, packet, mark_in, 1).unwrap();
    let b = p.test_run(PROG_LPM, packet, mark_in, 1).unwrap();
    assert_eq!(a.retval, NEXT);
    assert_eq!(b.retval, NEXT);
    assert_eq!(a.mark, b.mark, "prefix hash and LPM disagree");
    a.mark
}

const SET_V4: &[&str] = &["10.0.0.1/32", "10.244.3.0/24", "172.16.0.0/12"];
const SET_V6: &[&str] = &["fd50::2/128", "fd00:244:3::/64", "2001:db8:100::/40"];

#[test]
fn hits_by_host_and_cidr_set_the_mark_like_nftables() {
    let mut p = load();
    p.apply(&spec(SET_V4, SET_V6)).unwrap();
    // Bits outside the mask (a CNI's) survive; bits inside are replaced.
    let other = 0x1234_0000;
    for dst in [
        "10.0.0.1",
        "10.244.3.77",
        "172.31.255.1",
        "fd50::2",
        "fd00:244:3::9",
        "2001:db8:1ff::1",
    ] {
        assert_eq!(mark_of(&p, &frame(dst), other), other | 0x40, "{dst}");
        assert_eq!(
            mark_of(&p, &frame(dst), other | 0x60),
            other | 0x40,
            "{dst}"
        );
    }
}

#[test]
fn misses_leave_the_mark_alone() {
    let mut p = load();
    p.apply(&spec(SET_V4, SET_V6)).unwrap();
    for dst in [
        "10.0.0.2",
        "10.244.4.1",
        "172.32.0.1",
        "8.8.8.8",
        "fd50::3",
        "fd00:244:4::1",
        "2001:db8:200::1",
    ] {
        assert_eq!(mark_of(&p, &frame(dst), 0x1000), 0x1000, "{dst}");
    }
}

#[test]
fn device_marked_truncated_non_ip_and_vlan_tagged_packets_pass_untouched() {
    let mut p = load();
    p.apply(&spec(SET_V4, SET_V6)).unwrap();
    let before = p.counters().unwrap();

    // WireGuard's own UDP to a peer inside the set: the loop breaker.
    assert_eq!(mark_of(&p, &frame("10.0.0.1"), 0x20), 0x20);
    assert_eq!(mark_of(&p, &frame("fd50::2"), 0x1020), 0x1020);

    // Truncated: an Ethernet header announcing IPv4/IPv6 with a short header never
    // reaches a tc program: the kernel's test run refuses it the way the stack drops
    // it before tc (the program's own bounds checks are what the verifier demands).
    for (dst, keep) in [("10.0.0.1", 14 + 19), ("fd50::2", 14 + 39)] {
        let mut short = frame(dst);
        short.truncate(keep);
        let e = p.test_run(PROG_PHASH, &short, 0, 1).unwrap_err();
        assert!(
            matches!(&e, FastPathError::TestRun { source, .. } if source.raw_os_error() == Some(22)),
            "{e}"
        );
    }
    // A full-length frame cut right after the IP header parses (it is not short).
    let mut header_only = frame("10.0.0.1");
    header_only.truncate(14 + 20);
    assert_eq!(mark_of(&p, &header_only, 0), 0x40);

    // Non-IP: ARP.
    let mut arp = frame("10.0.0.1");
    arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    assert_eq!(mark_of(&p, &arp, 0), 0);

    // IPv4 ethertype but not an IPv4 header.
    let mut bogus = frame("10.0.0.1");
    bogus[14] = 0x65;
    assert_eq!(mark_of(&p, &bogus, 0), 0);

    // VLAN-tagged (802.1Q) to a host in the set: passed on; the VLAN device's own
    // classifier sees it untagged and marks it.
    let plain = frame("10.0.0.1");
    let mut tagged = plain[..12].to_vec();
    tagged.extend_from_slice(&[0x81, 0x00, 0x00, 0x07]);
    tagged.extend_from_slice(&plain[12..]);
    assert_eq!(mark_of(&p, &tagged, 0), 0);

    let after = p.counters().unwrap();
    // Each mark_of runs two programs.
    assert_eq!(after.skipped - before.skipped, 4);
    assert_eq!(after.unparsed - before.unparsed, 2 * 3);
    assert_eq!(after.hit - before.hit, 2);
}

#[test]
fn counters_count_hits_misses_and_skips() {
    let mut p = load();
    p.apply(&spec(SET_V4, SET_V6)).unwrap();
    let c0 = p.counters().unwrap();
    p.test_run(PROG_PHASH, &frame("10.0.0.1"), 0, 5).unwrap();
    p.test_run(PROG_PHASH, &frame("10.0.0.2"), 0, 3).unwrap();
    p.test_run(PROG_PHASH, &frame("10.0.0.1"), 0x20, 2).unwrap();
    let c1 = p.counters().unwrap();
    assert_eq!(
        Counters {
            hit: c1.hit - c0.hit,
            miss: c1.miss - c0.miss,
            skipped: c1.skipped - c0.skipped,
            unparsed: c1.unparsed - c0.unparsed,
        },
        Counters {
            hit: 5,
            miss: 3,
            skipped: 2,
            unparsed: 0,
        }
    );
}

#[test]
fn marks_and_mask_follow_the_spec() {
    let mut p = load();
    let mut s = spec(&["10.0.0.0/8"], &["::/0"]);
    s.device_mark = 0x200;
    s.mark = 0x400;
    s.mask = 0x600;
    p.apply(&s).unwrap();
    assert_eq!(mark_of(&p, &frame("10.1.2.3"), 0x41), 0x441);
    assert_eq!(mark_of(&p, &frame("10.1.2.3"), 0x200), 0x200);
    // ::/0 covers every IPv6 destination.
    assert_eq!(mark_of(&p, &frame("2a00::1"), 0), 0x400);
    // Back to the defaults: every entry carries the new mark.
    p.apply(&spec(&["10.0.0.0/8"], &[])).unwrap();
    assert_eq!(mark_of(&p, &frame("10.1.2.3"), 0), 0x40);
    assert_eq!(mark_of(&p, &frame("2a00::1"), 0), 0);
}

/// `n` prefixes like the benchmark's: 90 % hosts, 10 % CIDRs, both families.
fn big_spec(n: usize) -> MarkingSpec {
    let mut s = MarkingSpec::default();
    for i in 0..n {
        let i32_ = u32::try_from(i).unwrap();
        if i % 10 == 9 {
            s.prefixes_v4
                .push(IpNet::new(Ipv4Addr::from(0x0b00_0000 + (i32_ << 8)).into(), 24).unwrap());
            s.prefixes_v6.push(
                IpNet::new(
                    Ipv6Addr::from(0xfd00_0001_u128 << 96 | u128::from(i32_) << 64).into(),
                    64,
                )
                .unwrap(),
            );
        } else {
            s.prefixes_v4
                .push(IpNet::new(Ipv4Addr::from(0x0a00_0000 + i32_).into(), 32).unwrap());
            s.prefixes_v6.push(
                IpNet::new(
                    Ipv6Addr::from(0xfd00_0002_u128 << 96 | u128::from(i32_)).into(),
                    128,
                )
                .unwrap(),
            );
        }
    }
    s
}

#[test]
fn one_peer_change_at_100k_prefixes_writes_only_that_peers_entries() {
    let mut p = load();
    let mut s = big_spec(50_000); // 50,000 per family = 100,000 prefixes
    let first = p.apply(&s).unwrap();
    assert_eq!(first.inserted, 100_000);
    assert_eq!(mark_of(&p, &frame("10.0.0.5"), 0), 0x40);
    // One "peer": its node address and pod CIDR in each family change.
    s.prefixes_v4[5] = "192.168.77.1/32".parse().unwrap();
    s.prefixes_v4[9] = "192.168.78.0/24".parse().unwrap();
    s.prefixes_v6[5] = "fd77::1/128".parse().unwrap();
    s.prefixes_v6[9] = "fd78::/64".parse().unwrap();
    let st = p.apply(&s).unwrap();
    assert_eq!((st.inserted, st.removed), (4, 4), "{st:?}");
    // Plus at most one bucket bitmap per changed prefix; no config rewrite.
    assert!(st.buckets <= 8 && !st.config, "{st:?}");
    assert_eq!(mark_of(&p, &frame("10.0.0.5"), 0), 0);
    assert_eq!(mark_of(&p, &frame("192.168.77.1"), 0), 0x40);
    assert_eq!(mark_of(&p, &frame("192.168.78.9"), 0), 0x40);
    assert_eq!(mark_of(&p, &frame("fd78::9"), 0), 0x40);
    assert_eq!(mark_of(&p, &frame("fd77::1"), 0), 0x40);
    // Unchanged: nothing written.
    assert_eq!(p.apply(&s).unwrap().writes(), 0);
}

#[test]
fn more_prefixes_than_capacity_are_refused_before_writing() {
    let mut p = Programs::load(BOTH, 4, &[PROG_PHASH, PROG_LPM]).unwrap();
    p.apply(&spec(&["10.0.0.1/32"], &[])).unwrap();
    let e = p
        .apply(&spec(
            &[
                "10.0.0.2/32",
                "10.0.0.3/32",
                "10.0.0.4/32",
                "10.0.0.5/32",
                "10.0.0.6/32",
            ],
            &[],
        ))
        .unwrap_err();
    assert!(
        matches!(e, FastPathError::Capacity { needed: 5, .. }),
        "{e}"
    );
    assert!(!e.is_unsupported());
    // The old state is intact.
    assert_eq!(mark_of(&p, &frame("10.0.0.1"), 0), 0x40);
    assert_eq!(mark_of(&p, &frame("10.0.0.2"), 0), 0);
    // An invalid spec is refused by field.
    let e = p.apply(&spec(&["10.0.0.1/8"], &[])).unwrap_err();
    assert!(e.to_string().contains("prefixes_v4[0]"), "{e}");
}

fn random_prefix(rng: &mut StdRng, v4: bool) -> IpNet {
    // Few distinct top bits, so prefixes of many lengths share buckets and overlap.
    if v4 {
        let len = *[8u8, 16, 20, 23, 24, 25, 28, 31, 32, 32, 32]
            .get(rng.gen_range(0..11))
            .unwrap();
        let a = Ipv4Addr::from(0x0a00_0000 | (rng.gen::<u32>() & 0x000f_0fff));
        IpNet::new(a.into(), len).unwrap().trunc()
    } else {
        let len = *[32u8, 48, 56, 63, 64, 65, 96, 120, 127, 128, 128]
            .get(rng.gen_range(0..11))
            .unwrap();
        let a = Ipv6Addr::from(
            0xfd00_u128 << 112
                | u128::from(rng.gen::<u8>() & 3) << 64
                | u128::from(rng.gen::<u16>()),
        );
        IpNet::new(a.into(), len).unwrap().trunc()
    }
}

#[test]
fn both_structures_agree_with_a_reference_on_random_sets() {
    let mut rng = StdRng::seed_from_u64(9);
    let mut p = load();
    for round in 0..4 {
        let mut s = MarkingSpec::default();
        for _ in 0..200 {
            s.prefixes_v4.push(random_prefix(&mut rng, true));
            s.prefixes_v6.push(random_prefix(&mut rng, false));
        }
        p.apply(&s).unwrap();
        for _ in 0..300 {
            let dst: IpAddr = if rng.gen() {
                Ipv4Addr::from(0x0a00_0000 | (rng.gen::<u32>() & 0x000f_0fff)).into()
            } else {
                Ipv6Addr::from(
                    0xfd00_u128 << 112
                        | u128::from(rng.gen::<u8>() & 3) << 64
                        | u128::from(rng.gen::<u16>()),
                )
                .into()
            };
            let want = s
                .prefixes_v4
                .iter()
                .chain(&s.prefixes_v6)
                .any(|n| n.contains(&dst));
            let got = mark_of(&p, &frame(&dst.to_string()), 0);
            assert_eq!(got == 0x40, want, "round {round}: {dst}");
        }
    }
}

/// A delta before any apply is refused; after one, a sequence of random deltas leaves
/// the kernel maps exactly as a full apply of the resulting spec into fresh maps does,
/// and lookups agree with a plain reference.
#[test]
fn deltas_leave_the_maps_as_a_full_apply_would() {
    let mut rng = StdRng::seed_from_u64(17);
    let mut p = load();
    let first = PrefixDelta {
        remove: vec![],
        add: vec!["10.0.0.1/32".parse().unwrap()],
    };
    assert!(matches!(
        p.apply_delta(&first),
        Err(FastPathError::NotApplied)
    ));
    assert_eq!(p.dump().unwrap(), MapDump::default());
    let mut s = MarkingSpec::default();
    for _ in 0..100 {
        s.prefixes_v4.push(random_prefix(&mut rng, true));
        s.prefixes_v6.push(random_prefix(&mut rng, false));
    }
    p.apply(&s).unwrap();
    for step in 0..60 {
        let mut delta = PrefixDelta::default();
        let mut left: Vec<IpNet> = s
            .prefixes_v4
            .iter()
            .chain(&s.prefixes_v6)
            .copied()
            .collect();
        for _ in 0..rng.gen_range(0..4) {
            delta
                .remove
                .push(left.swap_remove(rng.gen_range(0..left.len())));
        }
        for _ in 0..rng.gen_range(0..4) {
            let v4 = rng.gen();
            delta.add.push(random_prefix(&mut rng, v4));
        }
        p.apply_delta(&delta).unwrap();
        s = delta.applied_to(&s).unwrap();
        if step % 20 == 19 {
            let mut full = load();
            full.apply(&s).unwrap();
            assert_eq!(p.dump().unwrap(), full.dump().unwrap(), "step {step}");
            for _ in 0..100 {
                let dst: IpAddr = if rng.gen() {
                    Ipv4Addr::from(0x0a00_0000 | (rng.gen::<u32>() & 0x000f_0fff)).into()
                } else {
                    Ipv6Addr::from(
                        0xfd00_u128 << 112
                            | u128::from(rng.gen::<u8>() & 3) << 64
                            | u128::from(rng.gen::<u16>()),
                    )
                    .into()
                };
                let want = s
                    .prefixes_v4
                    .iter()
                    .chain(&s.prefixes_v6)
                    .any(|n| n.contains(&dst));
                let got = mark_of(&p, &frame(&dst.to_string()), 0);
                assert_eq!(got == 0x40, want, "step {step}: {dst}");
            }
        }
    }
}

/// An invalid delta names its entry, a delta beyond capacity is refused, and neither
/// writes anything.
#[test]
fn invalid_or_oversized_deltas_write_nothing() {
    let mut p = Programs::load(BOTH, 4, &[PROG_PHASH, PROG_LPM]).unwrap();
    p.apply(&spec(&["10.0.0.1/32", "10.0.0.2/32", "10.1.0.0/24"], &[]))
        .unwrap();
    let before = p.dump().unwrap();
    let n = |s: &str| s.parse::<IpNet>().unwrap();
    for (bad, field) in [
        (
            PrefixDelta {
                remove: vec![n("10.0.0.1/32"), n("10.0.0.9/32")],
                add: vec![],
            },
            "remove[1]",
        ),
        (
            PrefixDelta {
                remove: vec![],
                add: vec![n("10.0.0.3/32"), n("10.2.0.1/24")],
            },
            "add[1]",
        ),
    ] {
        match p.apply_delta(&bad) {
            Err(FastPathError::Invalid(e)) => assert_eq!(e.field, field, "{e}"),
            other => panic!("expected invalid {field}, got {other:?}"),
        }
    }
    let e = p
        .apply_delta(&PrefixDelta {
            remove: vec![],
            add: vec![n("10.0.0.3/32"), n("10.0.0.4/32")],
        })
        .unwrap_err();
    assert!(
        matches!(e, FastPathError::Capacity { needed: 5, .. }),
        "{e}"
    );
    assert_eq!(p.dump().unwrap(), before);
    // Within capacity (insertions are written before removals, so the maps must
    // hold both for a moment) it applies.
    p.apply_delta(&PrefixDelta {
        remove: vec![n("10.0.0.1/32")],
        add: vec![n("10.0.0.4/32")],
    })
    .unwrap();
    assert_eq!(mark_of(&p, &frame("10.0.0.1"), 0), 0);
    assert_eq!(mark_of(&p, &frame("10.0.0.4"), 0), 0x40);
}
