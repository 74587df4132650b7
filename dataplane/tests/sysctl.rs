//! Kernel test of the sysctl adapter: reverse-path filtering on a link of a throwaway
//! network namespace (`/proc/sys/net` is per namespace; the host's is never touched).

use wirespan_dataplane::{
    netns::{unique_name, NetnsGuard},
    sysctl::{effective_rp_filter, LooseRpFilter, ProcSysctl, Sysctl as _},
    wireguard::{userspace::UserspaceBackend, WireGuard as _},
};

/// `/proc/sys/net/ipv4/conf/IF/rp_filter` as a process inside the namespace reads it.
fn rp_filter(ns: &NetnsGuard, iface: &str) -> u8 {
    ns.run_stdout("cat", &[&format!("/proc/sys/net/ipv4/conf/{iface}/rp_filter")])
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn the_mesh_link_is_loose_while_applied_even_under_a_strict_all_and_restored_after() {
    let host_all = std::fs::read_to_string("/proc/sys/net/ipv4/conf/all/rp_filter").unwrap();
    let ns = NetnsGuard::new("wsrp").unwrap();
    // The mesh link itself (wireguard-go here), stopped by its drop.
    let link = unique_name("wsk");
    let mut wg = UserspaceBackend::new(&link, ns.netns().clone());
    wg.ensure().unwrap();
    // The distribution default this guards against: strict everywhere.
    ns.run("sysctl", &["-qw", "net.ipv4.conf.all.rp_filter=1"])
        .unwrap();
    ns.run("sysctl", &["-qw", &format!("net.ipv4.conf.{link}.rp_filter=1")])
        .unwrap();
    let sysctl = ProcSysctl::new(ns.netns().clone());
    assert_eq!(
        sysctl.read(&["net", "ipv4", "conf", &link, "rp_filter"]).unwrap(),
        "1"
    );

    let rp = LooseRpFilter::apply(&sysctl, &link).unwrap();
    assert_eq!(rp_filter(&ns, &link), 2);
    assert_eq!(rp_filter(&ns, "all"), 1, "`all` is not the daemon's to change");
    // The kernel filters with max(all, link): loose.
    assert_eq!(effective_rp_filter(rp_filter(&ns, "all"), rp_filter(&ns, &link)), 2);

    rp.restore(&sysctl).unwrap();
    assert_eq!(rp_filter(&ns, &link), 1);
    assert_eq!(
        std::fs::read_to_string("/proc/sys/net/ipv4/conf/all/rp_filter").unwrap(),
        host_all,
        "the host's namespace was changed"
    );
    wg.teardown().unwrap();
}

#[test]
fn a_missing_link_is_refused_naming_the_sysctl() {
    let ns = NetnsGuard::new("wsrp").unwrap();
    let e = LooseRpFilter::apply(&ProcSysctl::new(ns.netns().clone()), "nosuchlink")
        .unwrap_err()
        .to_string();
    assert!(e.contains("net.ipv4.conf.nosuchlink.rp_filter=2"), "{e}");
}
