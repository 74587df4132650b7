//! Kernel test of the sysctl adapter: reverse-path filtering on the mesh link in a throwaway
//! network namespace (`/proc/sys/net` is per namespace; the host's is never touched).

use wirespan_dataplane::{
    netns::{unique_name, NetnsGuard},
    sysctl::{effective_rp_filter, MeshRpFilter, ProcSysctl, Sysctl as _},
    wireguard::{userspace::UserspaceBackend, WireGuard as _},
};

/// `/proc/sys/net/ipv4/conf/IF/rp_filter` as a process inside the namespace reads it.
fn rp_filter(ns: &NetnsGuard, iface: &str) -> u8 {
    ns.run_stdout(
        "cat",
        &[&format!("/proc/sys/net/ipv4/conf/{iface}/rp_filter")],
    )
    .unwrap()
    .trim()
    .parse()
    .unwrap()
}

#[test]
fn the_mesh_link_filters_nothing_while_applied_and_gets_its_value_back_after() {
    let host = std::fs::read_to_string("/proc/sys/net/ipv4/conf/default/rp_filter").unwrap();
    let ns = NetnsGuard::new("wsrp").unwrap();
    // systemd's default: every new link loose.
    ns.run("sysctl", &["-qw", "net.ipv4.conf.default.rp_filter=2"])
        .unwrap();
    // The mesh link itself (wireguard-go here), stopped by its drop.
    let link = unique_name("wsk");
    let mut wg = UserspaceBackend::new(&link, ns.netns().clone());
    wg.ensure().unwrap();
    assert_eq!(rp_filter(&ns, &link), 2);
    let sysctl = ProcSysctl::new(ns.netns().clone());
    assert_eq!(
        sysctl
            .read(&["net", "ipv4", "conf", &link, "rp_filter"])
            .unwrap(),
        "2"
    );

    let rp = MeshRpFilter::apply(&sysctl, &link).unwrap();
    assert_eq!(rp_filter(&ns, &link), 0);
    // The kernel filters with max(all, link): nothing.
    assert_eq!(
        effective_rp_filter(rp_filter(&ns, "all"), rp_filter(&ns, &link)),
        0
    );

    rp.restore(&sysctl).unwrap();
    assert_eq!(rp_filter(&ns, &link), 2);
    assert_eq!(
        std::fs::read_to_string("/proc/sys/net/ipv4/conf/default/rp_filter").unwrap(),
        host,
        "the host's namespace was changed"
    );
    wg.teardown().unwrap();
}

#[test]
fn host_wide_filtering_is_refused_naming_it_and_a_missing_link_naming_its_sysctl() {
    let ns = NetnsGuard::new("wsrp").unwrap();
    let sysctl = ProcSysctl::new(ns.netns().clone());
    let e = MeshRpFilter::apply(&sysctl, "nosuchlink")
        .unwrap_err()
        .to_string();
    assert!(e.contains("net.ipv4.conf.nosuchlink.rp_filter=0"), "{e}");
    ns.run("sysctl", &["-qw", "net.ipv4.conf.all.rp_filter=1"])
        .unwrap();
    let e = MeshRpFilter::apply(&sysctl, "lo").unwrap_err().to_string();
    assert!(e.contains("net.ipv4.conf.all.rp_filter is 1"), "{e}");
    assert_eq!(
        rp_filter(&ns, "all"),
        1,
        "`all` is not the daemon's to change"
    );
}
