//! What runs a node's WireGuard device, decided from what already holds the link
//! ([`choose`], pure) and the facts gathered from the namespace ([`link_facts`],
//! [`serving_device`]).
//!
//! A link can outlive the daemon that made it: a restart with kernel state kept leaves
//! the kernel link or the userspace device process running, and a userspace device
//! started before the WireGuard module was loaded keeps running after. So the link is
//! looked at before the kernel: a `wireguard` link is the kernel's; a TUN whose UAPI
//! socket answers (from a process in the same namespace) is a userspace device to
//! adopt, whatever implementation it is; a TUN nobody serves is stale and removed.
//! An explicit choice the link contradicts is refused with an error naming the flag
//! and the link, once, instead of a backend that fails on every use.

use std::path::Path;

use super::{
    userspace::{implementation_of, same_netns, socket_owner, UserspaceImpl, DEFAULT_SOCKET_DIR},
    BackendChoice,
};
use crate::netns::Netns;

/// What holds the link name now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkFacts {
    /// No such link.
    Absent,
    /// A kernel WireGuard link (kind `wireguard`).
    WireGuard,
    /// A TUN (a userspace device's, live or stale).
    Tun,
    /// Any other kind (not one a wirespan node makes).
    Other(String),
}

/// A userspace device process serving the link's UAPI socket, in the link's namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceFacts {
    /// Which program it is.
    pub implementation: UserspaceImpl,
    /// Its pid (`SO_PEERCRED` of the socket).
    pub pid: u32,
}

/// What to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Run {
    /// The kernel backend.
    Kernel,
    /// Start this userspace implementation.
    Start(UserspaceImpl),
    /// Adopt the running userspace device (restarting what was asked for if it dies).
    Adopt(DeviceFacts),
}

/// The decision of [`choose`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// The link is stale (a TUN nobody serves): remove it first.
    pub remove_stale_link: bool,
    /// What runs the device.
    pub run: Run,
}

/// Why the asked-for backend cannot run the link as it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// What was asked for.
    pub asked: BackendChoice,
    /// What holds the link, in words.
    pub held_by: String,
}

/// Decides what runs the device: the link first (see the module docs), then what was
/// asked for, then (for `auto` on a clean start) whether the kernel has WireGuard.
///
/// # Errors
/// The link is held by something the explicit `asked` cannot drive (a userspace
/// device for `kernel`, a kernel link for `userspace`/`userspace-go`), or it is a
/// link of another kind.
pub fn choose(
    link: &LinkFacts,
    device: Option<DeviceFacts>,
    asked: BackendChoice,
    kernel_has_wg: bool,
) -> Result<Decision, Mismatch> {
    let mismatch = |held_by: String| Mismatch { asked, held_by };
    let keep = |run| Decision {
        remove_stale_link: false,
        run,
    };
    match (link, device, asked) {
        (LinkFacts::WireGuard, _, BackendChoice::Userspace | BackendChoice::UserspaceGo) => {
            Err(mismatch("a kernel WireGuard link".to_owned()))
        }
        (LinkFacts::WireGuard, _, BackendChoice::Auto | BackendChoice::Kernel) => {
            Ok(keep(Run::Kernel))
        }
        (LinkFacts::Other(kind), ..) => Err(mismatch(format!("a link of kind {kind:?}"))),
        (_, Some(dev), BackendChoice::Kernel) => Err(mismatch(format!(
            "a userspace device served by {} (pid {})",
            dev.implementation.program(),
            dev.pid
        ))),
        (_, Some(dev), _) => Ok(keep(Run::Adopt(dev))),
        (LinkFacts::Absent | LinkFacts::Tun, None, _) => Ok(Decision {
            remove_stale_link: *link == LinkFacts::Tun,
            run: fresh(asked, kernel_has_wg),
        }),
    }
}

/// What a clean start runs.
fn fresh(asked: BackendChoice, kernel_has_wg: bool) -> Run {
    match asked {
        BackendChoice::Auto if kernel_has_wg => Run::Kernel,
        BackendChoice::Kernel => Run::Kernel,
        BackendChoice::Auto | BackendChoice::Userspace => Run::Start(UserspaceImpl::Wirespan),
        BackendChoice::UserspaceGo => Run::Start(UserspaceImpl::WireguardGo),
    }
}

/// What holds link `name` in `netns` (from `ip -d -j link show`).
///
/// # Errors
/// `ip` could not be run or its answer not parsed.
pub fn link_facts(netns: &Netns, name: &str) -> std::io::Result<LinkFacts> {
    let out = netns.run("ip", &["-d", "-j", "link", "show"])?;
    parse_link_facts(&out.stdout, name)
}

/// [`link_facts`] from the JSON `ip -d -j link show` prints.
fn parse_link_facts(json: &[u8], name: &str) -> std::io::Result<LinkFacts> {
    let links: Vec<serde_json::Value> =
        serde_json::from_slice(json).map_err(std::io::Error::other)?;
    let Some(link) = links.iter().find(|l| l["ifname"] == name) else {
        return Ok(LinkFacts::Absent);
    };
    Ok(match link["linkinfo"]["info_kind"].as_str() {
        Some("wireguard") => LinkFacts::WireGuard,
        Some("tun") => LinkFacts::Tun,
        Some(kind) => LinkFacts::Other(kind.to_owned()),
        None => LinkFacts::Other("device".to_owned()),
    })
}

/// The userspace device process serving link `name`'s UAPI socket in the default
/// socket directory, if one answers from `netns` (a process in another namespace
/// holding the name is left to the backend, which refuses it with its own error).
#[must_use]
pub fn serving_device(netns: &Netns, name: &str) -> Option<DeviceFacts> {
    let path = Path::new(DEFAULT_SOCKET_DIR).join(format!("{name}.sock"));
    let pid = socket_owner(&path)?;
    if !same_netns(pid, netns).unwrap_or(false) {
        return None;
    }
    Some(DeviceFacts {
        implementation: implementation_of(pid),
        pid,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wireguard::userspace::implementation_from_cmdline;

    const WIRESPAN: DeviceFacts = DeviceFacts {
        implementation: UserspaceImpl::Wirespan,
        pid: 42,
    };
    const GO: DeviceFacts = DeviceFacts {
        implementation: UserspaceImpl::WireguardGo,
        pid: 43,
    };
    const ALL: [BackendChoice; 4] = [
        BackendChoice::Auto,
        BackendChoice::Kernel,
        BackendChoice::Userspace,
        BackendChoice::UserspaceGo,
    ];

    fn run(link: &LinkFacts, dev: Option<DeviceFacts>, asked: BackendChoice, wg: bool) -> Run {
        let d = choose(link, dev, asked, wg).unwrap();
        assert!(!d.remove_stale_link, "{link:?} {dev:?} {asked:?}");
        d.run
    }

    #[test]
    fn auto_adopts_a_served_tun_even_where_the_kernel_has_wireguard() {
        for wg in [true, false] {
            for dev in [WIRESPAN, GO] {
                assert_eq!(
                    run(&LinkFacts::Tun, Some(dev), BackendChoice::Auto, wg),
                    Run::Adopt(dev)
                );
            }
        }
    }

    #[test]
    fn userspace_choices_adopt_whichever_implementation_runs() {
        for asked in [BackendChoice::Userspace, BackendChoice::UserspaceGo] {
            for dev in [WIRESPAN, GO] {
                assert_eq!(
                    run(&LinkFacts::Tun, Some(dev), asked, false),
                    Run::Adopt(dev)
                );
            }
        }
    }

    #[test]
    fn a_kernel_link_is_the_kernels_for_auto_and_refused_by_userspace() {
        for wg_probe in [true, false] {
            assert_eq!(
                run(&LinkFacts::WireGuard, None, BackendChoice::Auto, wg_probe),
                Run::Kernel
            );
        }
        assert_eq!(
            run(&LinkFacts::WireGuard, None, BackendChoice::Kernel, true),
            Run::Kernel
        );
        for asked in [BackendChoice::Userspace, BackendChoice::UserspaceGo] {
            let err = choose(&LinkFacts::WireGuard, None, asked, true).unwrap_err();
            assert_eq!(err.asked, asked);
            assert_eq!(err.held_by, "a kernel WireGuard link");
        }
    }

    #[test]
    fn kernel_refuses_a_served_tun_naming_its_program() {
        let err = choose(&LinkFacts::Tun, Some(GO), BackendChoice::Kernel, true).unwrap_err();
        assert_eq!(
            err.held_by,
            "a userspace device served by wireguard-go (pid 43)"
        );
        let err = choose(&LinkFacts::Tun, Some(WIRESPAN), BackendChoice::Kernel, true).unwrap_err();
        assert!(
            err.held_by.contains("wirespan wireguard"),
            "{}",
            err.held_by
        );
    }

    #[test]
    fn a_tun_nobody_serves_is_removed_then_chosen_as_on_a_clean_start() {
        for asked in ALL {
            for wg in [true, false] {
                let clean = choose(&LinkFacts::Absent, None, asked, wg).unwrap();
                let stale = choose(&LinkFacts::Tun, None, asked, wg).unwrap();
                assert!(!clean.remove_stale_link);
                assert!(stale.remove_stale_link);
                assert_eq!(clean.run, stale.run, "{asked:?} kernel WireGuard {wg}");
            }
        }
    }

    #[test]
    fn a_clean_start_runs_the_kernel_then_wirespan_wireguard() {
        let clean = |asked, wg| run(&LinkFacts::Absent, None, asked, wg);
        assert_eq!(clean(BackendChoice::Auto, true), Run::Kernel);
        assert_eq!(
            clean(BackendChoice::Auto, false),
            Run::Start(UserspaceImpl::Wirespan)
        );
        assert_eq!(clean(BackendChoice::Kernel, false), Run::Kernel);
        assert_eq!(
            clean(BackendChoice::Userspace, true),
            Run::Start(UserspaceImpl::Wirespan)
        );
        assert_eq!(
            clean(BackendChoice::UserspaceGo, true),
            Run::Start(UserspaceImpl::WireguardGo)
        );
    }

    #[test]
    fn a_link_of_another_kind_is_refused_not_removed() {
        for asked in ALL {
            let err = choose(&LinkFacts::Other("dummy".into()), None, asked, true).unwrap_err();
            assert_eq!(err.held_by, "a link of kind \"dummy\"");
        }
    }

    #[test]
    fn link_kinds_from_ip_json() {
        let json = br#"[{"ifindex":1,"ifname":"lo","flags":[]},
            {"ifindex":5,"ifname":"kubespan","linkinfo":{"info_kind":"tun","info_data":{"type":"tun"}}},
            {"ifindex":6,"ifname":"wg0","linkinfo":{"info_kind":"wireguard"}},
            {"ifindex":7,"ifname":"d0","linkinfo":{"info_kind":"dummy"}}]"#;
        let facts = |n| parse_link_facts(json, n).unwrap();
        assert_eq!(facts("kubespan"), LinkFacts::Tun);
        assert_eq!(facts("wg0"), LinkFacts::WireGuard);
        assert_eq!(facts("d0"), LinkFacts::Other("dummy".into()));
        assert_eq!(facts("lo"), LinkFacts::Other("device".into()));
        assert_eq!(facts("nope"), LinkFacts::Absent);
        assert!(parse_link_facts(b"not json", "x").is_err());
    }

    #[test]
    fn implementations_from_command_lines() {
        let imp = |s: &str| implementation_from_cmdline(s.as_bytes());
        assert_eq!(
            imp("/usr/bin/wirespan\0wireguard\0--foreground\0kubespan\0"),
            UserspaceImpl::Wirespan
        );
        assert_eq!(
            imp("/tmp/target/debug/wirespan\0wireguard\0kubespan\0"),
            UserspaceImpl::Wirespan
        );
        assert_eq!(
            imp("wireguard-go\0-f\0kubespan\0"),
            UserspaceImpl::WireguardGo
        );
        assert_eq!(
            imp("/usr/bin/wireguard-go\0wireguard\0"),
            UserspaceImpl::WireguardGo
        );
        assert_eq!(imp(""), UserspaceImpl::WireguardGo);
    }
}
