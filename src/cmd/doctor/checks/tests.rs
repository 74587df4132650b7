use super::*;

/// A host where the node runs as well as it can.
fn healthy() -> Facts {
    Facts {
        root: true,
        kernel_wireguard: true,
        wireguard_go: None,
        tun: true,
        nft: Some("/usr/sbin/nft".into()),
        nf_tables: Some(Ok(())),
        bpf: Ok(()),
        kernel: Some((6, 8)),
        sch_ingress: Module::Unknown,
        cls_bpf: Module::Unknown,
        ip_forward: Some(1),
        ipv6_forwarding: Some(1),
        rp_filter_all: Some(0),
        rp_filter_link: Some(2),
        src_valid_mark: Some(1),
        port: Port::Free,
    }
}

fn ebpf_forwarding() -> Want {
    Want {
        ebpf: true,
        forward_v4: true,
        forward_v6: true,
        ..Want::default()
    }
}

fn get(findings: &[Finding], check: &str) -> Finding {
    findings.iter().find(|f| f.check == check).unwrap().clone()
}

fn level(f: &Facts, w: &Want, check: &str) -> Level {
    get(&evaluate(f, w), check).level
}

#[test]
fn a_healthy_host_is_all_ok_with_one_finding_per_check_in_order() {
    let findings = evaluate(&healthy(), &ebpf_forwarding());
    let names: Vec<_> = findings.iter().map(|f| f.check).collect();
    assert_eq!(names, CHECKS);
    for f in &findings {
        assert_eq!(f.level, Level::Ok, "{f:?}");
        assert!(f.fix.is_none(), "{f:?}");
    }
}

#[test]
fn every_warning_and_failure_says_what_to_fix() {
    let mut f = healthy();
    f.root = false;
    f.kernel_wireguard = false;
    f.nft = None;
    f.nf_tables = None;
    f.bpf = Err("EPERM".into());
    f.kernel = Some((5, 10));
    f.sch_ingress = Module::Missing;
    f.ip_forward = Some(0);
    f.rp_filter_all = Some(1);
    f.rp_filter_link = Some(1);
    f.src_valid_mark = Some(0);
    f.port = Port::InUse { mesh_link: false };
    for finding in evaluate(&f, &ebpf_forwarding()) {
        if finding.check != "nf_tables" {
            assert_ne!(finding.level, Level::Ok, "{finding:?}");
        }
        if finding.level == Level::Fail {
            assert!(finding.fix.is_some(), "{finding:?}");
        }
    }
}

#[test]
fn wireguard_kernel_or_userspace_fallback() {
    let w = Want::default();
    let mut f = healthy();
    f.kernel_wireguard = false;
    f.wireguard_go = Some("/usr/bin/wireguard-go".into());
    let got = get(&evaluate(&f, &w), "wireguard");
    assert_eq!(got.level, Level::Warn);
    assert!(
        got.message.contains("will run `wirespan wireguard`"),
        "{got:?}"
    );
    let go = Want {
        wireguard: WireGuardChoice::UserspaceGo,
        ..Want::default()
    };
    let got = get(&evaluate(&f, &go), "wireguard");
    assert_eq!(got.level, Level::Ok);
    assert!(
        got.message
            .contains("wireguard-go at /usr/bin/wireguard-go"),
        "{got:?}"
    );
    // Forced kernel: fail; forced userspace: fine.
    let kernel = Want {
        wireguard: WireGuardChoice::Kernel,
        ..Want::default()
    };
    assert_eq!(level(&f, &kernel, "wireguard"), Level::Fail);
    let user = Want {
        wireguard: WireGuardChoice::Userspace,
        ..Want::default()
    };
    assert_eq!(level(&f, &user, "wireguard"), Level::Ok);
    // No TUN device: no userspace device at all.
    f.tun = false;
    assert_eq!(level(&f, &w, "wireguard"), Level::Fail);
    assert_eq!(level(&f, &user, "wireguard"), Level::Fail);
    assert_eq!(level(&f, &go, "wireguard"), Level::Fail);
    // No wireguard-go: only `userspace-go` needs it.
    f.tun = true;
    f.wireguard_go = None;
    assert_eq!(level(&f, &w, "wireguard"), Level::Warn);
    assert_eq!(level(&f, &user, "wireguard"), Level::Ok);
    let got = get(&evaluate(&f, &go), "wireguard");
    assert_eq!(got.level, Level::Fail);
    assert!(got.fix.unwrap().contains("apt-get install wireguard-go"));
}

#[test]
fn nftables_binary_and_kernel_support() {
    let w = Want::default();
    let mut f = healthy();
    f.nf_tables = Some(Err("Operation not permitted".into()));
    let got = get(&evaluate(&f, &w), "nf_tables");
    assert_eq!(got.level, Level::Fail);
    assert!(got.message.contains("Operation not permitted"));
    f.nft = None;
    f.nf_tables = None;
    assert_eq!(level(&f, &w, "nft"), Level::Fail);
    assert_eq!(level(&f, &w, "nf_tables"), Level::Warn);
}

#[test]
fn bpf_and_tc_matter_only_for_the_ebpf_fast_path() {
    let nft = Want::default();
    let ebpf = ebpf_forwarding();
    let mut f = healthy();
    f.bpf = Err("Operation not permitted".into());
    assert_eq!(level(&f, &nft, "bpf"), Level::Ok);
    assert_eq!(level(&f, &ebpf, "bpf"), Level::Warn);
    // tcx from 6.6; before it clsact + cls_bpf.
    f.kernel = Some((6, 1));
    assert_eq!(level(&f, &ebpf, "tc"), Level::Warn, "unknown modules");
    f.sch_ingress = Module::Present;
    f.cls_bpf = Module::Available;
    assert_eq!(level(&f, &ebpf, "tc"), Level::Ok);
    f.cls_bpf = Module::Missing;
    assert_eq!(level(&f, &ebpf, "tc"), Level::Warn);
    assert_eq!(level(&f, &nft, "tc"), Level::Ok);
}

#[test]
fn forwarding_is_required_only_when_pod_networks_are_advertised() {
    let mut f = healthy();
    f.ip_forward = Some(0);
    f.ipv6_forwarding = Some(0);
    assert_eq!(level(&f, &Want::default(), "ip_forward"), Level::Ok);
    let v6 = Want {
        forward_v6: true,
        ..Want::default()
    };
    let got = get(&evaluate(&f, &v6), "ip_forward");
    assert_eq!(got.level, Level::Fail);
    let fix = got.fix.unwrap();
    assert!(fix.contains("net.ipv6.conf.all.forwarding=1"), "{fix}");
    assert!(!fix.contains("net.ipv4.ip_forward"), "{fix}");
    f.ipv6_forwarding = Some(1);
    assert_eq!(level(&f, &v6, "ip_forward"), Level::Ok);
}

#[test]
fn host_wide_rp_filter_fails_whatever_the_link_has_and_src_valid_mark_follows_it() {
    let w = Want::default();
    let mut f = healthy();
    // The link's own value is the daemon's to set (0): only `all` counts, and loose
    // is no better than strict on a link without an IPv4 address.
    f.rp_filter_all = Some(0);
    f.rp_filter_link = Some(2);
    assert_eq!(level(&f, &w, "rp_filter"), Level::Ok);
    for all in [1, 2] {
        f.rp_filter_all = Some(all);
        let got = get(&evaluate(&f, &w), "rp_filter");
        assert_eq!(got.level, Level::Fail);
        assert!(got.fix.unwrap().contains("net.ipv4.conf.all.rp_filter=0"));
    }
    f.rp_filter_all = None;
    f.rp_filter_link = None;
    assert_eq!(level(&f, &w, "rp_filter"), Level::Warn);

    f.src_valid_mark = Some(0);
    f.rp_filter_all = Some(2);
    assert_eq!(level(&f, &w, "src_valid_mark"), Level::Warn);
    f.rp_filter_all = Some(0);
    assert_eq!(level(&f, &w, "src_valid_mark"), Level::Ok);
}

#[test]
fn a_taken_port_fails_unless_the_mesh_itself_holds_it() {
    let w = Want {
        port: 51999,
        ..Want::default()
    };
    let mut f = healthy();
    f.port = Port::InUse { mesh_link: false };
    let got = get(&evaluate(&f, &w), "listen_port");
    assert_eq!(got.level, Level::Fail);
    assert!(got.message.contains("51999"));
    f.port = Port::InUse { mesh_link: true };
    assert_eq!(level(&f, &w, "listen_port"), Level::Ok);
    f.port = Port::Error("EACCES".into());
    assert_eq!(level(&f, &w, "listen_port"), Level::Warn);
}
