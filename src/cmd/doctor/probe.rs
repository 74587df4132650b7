//! The doctor's observations of this host: the probes behind [`Facts`]. Nothing here
//! judges; nothing is left changed (the WireGuard probe removes its link, the BPF
//! probe unloads what it loaded, the port probe closes its sockets).

use std::{
    io,
    net::{Ipv4Addr, Ipv6Addr, UdpSocket},
    path::{Path, PathBuf},
    process::Command,
};

use wirespan_dataplane::{
    fastpath::{sync::Structures, Programs},
    netns::Netns,
};

use super::checks::{Facts, Module, Port, Want};

/// `name` on `PATH`, if executable.
fn which(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

fn sysctl(path: &str) -> Option<u32> {
    std::fs::read_to_string(Path::new("/proc/sys").join(path))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// (major, minor) of a release like `6.1.0-18-amd64`.
fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

fn module(name: &str, release: Option<&str>) -> Module {
    if Path::new("/sys/module").join(name).exists() {
        return Module::Present;
    }
    let Some(dir) = release.map(|r| Path::new("/lib/modules").join(r)) else {
        return Module::Unknown;
    };
    let listed = |file: &str| {
        std::fs::read_to_string(dir.join(file)).ok().map(|text| {
            text.lines().any(|l| {
                let path = l.split(':').next().unwrap_or("");
                let base = path.rsplit('/').next().unwrap_or("");
                // sch_ingress.ko, sch_ingress.ko.xz, …; module names treat - and _ alike.
                base.split('.').next().unwrap_or("").replace('-', "_") == name
            })
        })
    };
    match (listed("modules.builtin"), listed("modules.dep")) {
        (None, None) => Module::Unknown,
        (Some(true), _) | (_, Some(true)) => Module::Available,
        _ => Module::Missing,
    }
}

fn nf_tables(nft: &Path) -> Result<(), String> {
    let out = Command::new(nft)
        .args(["list", "tables"])
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    match err.lines().find(|l| !l.trim().is_empty()) {
        Some(line) => Err(line.trim().to_owned()),
        None => Err(out.status.to_string()),
    }
}

/// Loads the fast path's maps and classifiers (small maps), then drops them.
fn bpf() -> Result<(), String> {
    Programs::load(
        Structures {
            phash: true,
            lpm: false,
        },
        16,
        &[wirespan_ebpf::PROG_PHASH, wirespan_ebpf::PROG_PHASH_L3],
    )
    .map(drop)
    .map_err(|e| e.to_string())
}

fn port(port: u16, link: &str) -> Port {
    // One socket at a time: a dual-stack [::] would collide with our own 0.0.0.0.
    let v4 = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port)).map(drop);
    let v6 = v4.and_then(|()| UdpSocket::bind((Ipv6Addr::UNSPECIFIED, port)).map(drop));
    match v6 {
        Ok(()) => Port::Free,
        // No IPv6 on this host: the IPv4 bind decided.
        Err(e) if e.kind() == io::ErrorKind::AddrNotAvailable => Port::Free,
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => Port::InUse {
            mesh_link: Path::new("/sys/class/net").join(link).exists(),
        },
        Err(e) => Port::Error(e.to_string()),
    }
}

/// Observes everything [`super::checks::evaluate`] judges.
pub fn observe(want: &Want) -> Facts {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .ok()
        .map(|s| s.trim().to_owned());
    let nft = which("nft");
    let link_conf = format!("net/ipv4/conf/{}/rp_filter", want.link);
    Facts {
        root: nix::unistd::geteuid().is_root(),
        kernel_wireguard: wirespan_dataplane::wireguard::kernel::supported(&Netns::current()),
        wireguard_go: which("wireguard-go"),
        tun: Path::new("/dev/net/tun").exists(),
        nf_tables: nft.as_deref().map(nf_tables),
        nft,
        bpf: bpf(),
        kernel: release.as_deref().and_then(kernel_version),
        sch_ingress: module("sch_ingress", release.as_deref()),
        cls_bpf: module("cls_bpf", release.as_deref()),
        ip_forward: sysctl("net/ipv4/ip_forward"),
        ipv6_forwarding: sysctl("net/ipv6/conf/all/forwarding"),
        rp_filter_all: sysctl("net/ipv4/conf/all/rp_filter"),
        // A link created later starts from `default`.
        rp_filter_link: sysctl(&link_conf).or_else(|| sysctl("net/ipv4/conf/default/rp_filter")),
        src_valid_mark: sysctl("net/ipv4/conf/all/src_valid_mark"),
        port: port(want.port, &want.link),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions_parse() {
        assert_eq!(kernel_version("6.1.0-18-amd64"), Some((6, 1)));
        assert_eq!(kernel_version("6.18.44-fc-v782"), Some((6, 18)));
        assert_eq!(kernel_version("5.15"), Some((5, 15)));
        assert_eq!(kernel_version("weird"), None);
    }

    #[test]
    fn a_port_held_here_is_in_use_and_a_free_one_is_free() {
        let held = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap();
        let p = held.local_addr().unwrap().port();
        assert_eq!(port(p, "no-such-link"), Port::InUse { mesh_link: false });
        drop(held);
        assert_eq!(port(p, "no-such-link"), Port::Free);
    }
}
