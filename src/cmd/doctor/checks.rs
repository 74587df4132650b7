//! The doctor's judgement, without I/O: what was observed on the host ([`Facts`]) and
//! what the node will need ([`Want`]) become one [`Finding`] per check.

use std::path::PathBuf;

/// Every check, in the order they are printed.
pub const CHECKS: [&str; 10] = [
    "privileges",
    "wireguard",
    "nft",
    "nf_tables",
    "bpf",
    "tc",
    "ip_forward",
    "rp_filter",
    "src_valid_mark",
    "listen_port",
];

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Nothing to do.
    Ok,
    /// The node runs, but not as well as it could (a fallback, a risk).
    Warn,
    /// The node will not work as configured.
    Fail,
}

impl Level {
    /// `ok`, `warn` or `fail`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Warn => "warn",
            Self::Fail => "fail",
        }
    }
}

/// The outcome of one check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// One of [`CHECKS`].
    pub check: &'static str,
    pub level: Level,
    /// What was found.
    pub message: String,
    /// What to do about it (warn and fail only).
    pub fix: Option<String>,
}

/// Whether a kernel module is there, as far as can be told without loading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Module {
    /// In `/sys/module`: loaded, or built in.
    Present,
    /// Built in or loadable per `/lib/modules/$(uname -r)`.
    Available,
    /// Neither: `/lib/modules/$(uname -r)` does not list it.
    Missing,
    /// No `/lib/modules/$(uname -r)` to look in.
    Unknown,
}

/// Whether the WireGuard UDP port could be bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Port {
    Free,
    /// Taken; `mesh_link` when the mesh link exists (the node itself holds it).
    InUse {
        mesh_link: bool,
    },
    /// Binding failed for another reason.
    Error(String),
}

/// Which WireGuard the node is told to use (`wirespan node --wireguard`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WireGuardChoice {
    #[default]
    Auto,
    Kernel,
    /// `wirespan wireguard`.
    Userspace,
    /// wireguard-go.
    UserspaceGo,
}

/// What the node will need, from its config and flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Want {
    pub port: u16,
    pub link: String,
    pub wireguard: WireGuardChoice,
    /// `fastPath: ebpf`.
    pub ebpf: bool,
    /// The node forwards IPv4 pod traffic.
    pub forward_v4: bool,
    /// The node forwards IPv6 pod traffic.
    pub forward_v6: bool,
}

impl Default for Want {
    fn default() -> Self {
        Self {
            port: 51820,
            link: "kubespan".into(),
            wireguard: WireGuardChoice::Auto,
            ebpf: false,
            forward_v4: false,
            forward_v6: false,
        }
    }
}

/// What was observed on the host. `None` for a sysctl that could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    /// Effective uid 0.
    pub root: bool,
    /// The kernel created (and removed) a WireGuard link.
    pub kernel_wireguard: bool,
    /// `wireguard-go` on `PATH`.
    pub wireguard_go: Option<PathBuf>,
    /// `/dev/net/tun` exists (both userspace devices need it).
    pub tun: bool,
    /// `nft` on `PATH`.
    pub nft: Option<PathBuf>,
    /// `nft list tables`: `Ok`, or its error; `None` when not run (no `nft`).
    pub nf_tables: Option<Result<(), String>>,
    /// Loading the fast path's maps and classifier: `Ok`, or the error.
    pub bpf: Result<(), String>,
    /// Kernel release (major, minor).
    pub kernel: Option<(u32, u32)>,
    /// `sch_ingress` (the clsact qdisc) and `cls_bpf`, for kernels without tcx.
    pub sch_ingress: Module,
    pub cls_bpf: Module,
    pub ip_forward: Option<u32>,
    pub ipv6_forwarding: Option<u32>,
    pub rp_filter_all: Option<u32>,
    /// `rp_filter` of the mesh link, or of `default` while the link does not exist.
    pub rp_filter_link: Option<u32>,
    pub src_valid_mark: Option<u32>,
    pub port: Port,
}

fn finding(check: &'static str, level: Level, message: impl Into<String>) -> Finding {
    Finding {
        check,
        level,
        message: message.into(),
        fix: None,
    }
}

fn with_fix(mut f: Finding, fix: impl Into<String>) -> Finding {
    f.fix = Some(fix.into());
    f
}

fn privileges(f: &Facts) -> Finding {
    if f.root {
        finding("privileges", Level::Ok, "running as root")
    } else {
        with_fix(
            finding(
                "privileges",
                Level::Warn,
                "not root: the WireGuard, nftables and BPF probes need CAP_NET_ADMIN and CAP_BPF and may fail for that alone",
            ),
            "run `sudo wirespan doctor`",
        )
    }
}

fn wireguard(f: &Facts, w: &Want) -> Finding {
    const C: &str = "wireguard";
    const TUN_FIX: &str = "load the tun module (`modprobe tun`) or create /dev/net/tun";
    // `wirespan wireguard` is this executable: it needs only the TUN device.
    let ours = if f.tun {
        Ok("`wirespan wireguard` (this executable)".to_owned())
    } else {
        Err(("/dev/net/tun is missing".to_owned(), TUN_FIX))
    };
    let go = match (&f.wireguard_go, f.tun) {
        (Some(p), true) => Ok(format!("wireguard-go at {}", p.display())),
        (Some(_), false) => Err((
            "wireguard-go is installed but /dev/net/tun is missing".to_owned(),
            TUN_FIX,
        )),
        (None, _) => Err((
            "wireguard-go is not on PATH".to_owned(),
            "install wireguard-go (Debian: `apt-get install wireguard-go`), or use --wireguard userspace",
        )),
    };
    let kernel_fix = "load the module (`modprobe wireguard`) or use a kernel with CONFIG_WIREGUARD (Linux >= 5.6)";
    match (w.wireguard, f.kernel_wireguard) {
        (WireGuardChoice::Auto | WireGuardChoice::Kernel, true) => finding(
            C,
            Level::Ok,
            format!("kernel WireGuard available (tested on {TESTED_KERNEL_WIREGUARD})"),
        ),
        (WireGuardChoice::Kernel, false) => with_fix(
            finding(
                C,
                Level::Fail,
                "--wireguard kernel, but the kernel cannot create a WireGuard link",
            ),
            kernel_fix,
        ),
        (WireGuardChoice::Auto, false) => match ours {
            Ok(what) => with_fix(
                finding(
                    C,
                    Level::Warn,
                    format!("no kernel WireGuard: the node will run {what} (userspace)"),
                ),
                kernel_fix,
            ),
            Err((why, fix)) => with_fix(
                finding(C, Level::Fail, format!("no kernel WireGuard, and {why}")),
                format!("{kernel_fix}; or {fix}"),
            ),
        },
        (WireGuardChoice::Userspace, _) => userspace_finding(C, ours),
        (WireGuardChoice::UserspaceGo, _) => userspace_finding(C, go),
    }
}

fn userspace_finding(check: &'static str, found: Result<String, (String, &str)>) -> Finding {
    match found {
        Ok(what) => finding(check, Level::Ok, what),
        Err((why, fix)) => with_fix(finding(check, Level::Fail, why), fix),
    }
}

fn nft(f: &Facts) -> [Finding; 2] {
    let binary = match &f.nft {
        Some(p) => finding("nft", Level::Ok, format!("{}", p.display())),
        None => with_fix(
            finding(
                "nft",
                Level::Fail,
                "nft is not on PATH (the node marks mesh traffic with it)",
            ),
            "install nftables (Debian: `apt-get install nftables`)",
        ),
    };
    let tables = match &f.nf_tables {
        None => finding("nf_tables", Level::Warn, "not checked: no nft"),
        Some(Ok(())) => finding("nf_tables", Level::Ok, "`nft list tables` works"),
        Some(Err(e)) => with_fix(
            finding(
                "nf_tables",
                Level::Fail,
                format!("`nft list tables` failed: {e}"),
            ),
            "load nf_tables (`modprobe nf_tables`) and run with CAP_NET_ADMIN",
        ),
    };
    [binary, tables]
}

fn bpf(f: &Facts, w: &Want) -> Finding {
    match (&f.bpf, w.ebpf) {
        (Ok(()), _) => finding("bpf", Level::Ok, "bpf() permitted: the fast-path classifier loads"),
        (Err(e), false) => finding(
            "bpf",
            Level::Ok,
            format!("unavailable ({e}); not needed with fastPath: nftables"),
        ),
        (Err(e), true) => with_fix(
            finding(
                "bpf",
                Level::Warn,
                format!("fastPath: ebpf, but the classifier does not load ({e}): the node will mark with nftables"),
            ),
            "run with CAP_BPF and CAP_PERFMON on Linux >= 5.8 (CAP_SYS_ADMIN before), with BPF syscall support (CONFIG_BPF_SYSCALL)",
        ),
    }
}

/// The kernels the suite runs each path on (`docs/operations.md`, "Kernels tested"):
/// the host's for wireguard-go and tcx, Debian 12's in the VM tier for kernel
/// WireGuard and clsact.
const TESTED_KERNEL_WIREGUARD: &str = "Debian 12's Linux 6.1";
const TESTED_TCX: &str = "Linux 6.18";
const TESTED_CLSACT: &str = "Debian 12's Linux 6.1";

fn tc(f: &Facts, w: &Want) -> Finding {
    if let Some((maj, min)) = f.kernel {
        if (maj, min) >= (6, 6) {
            return finding(
                "tc",
                Level::Ok,
                format!("tcx (Linux {maj}.{min}; tested on {TESTED_TCX})"),
            );
        }
    }
    let level = if w.ebpf { Level::Warn } else { Level::Ok };
    let needed = if w.ebpf {
        ""
    } else {
        "; not needed with fastPath: nftables"
    };
    match (f.sch_ingress, f.cls_bpf) {
        (Module::Present | Module::Available, Module::Present | Module::Available) => {
            finding(
                "tc",
                Level::Ok,
                format!("no tcx (Linux < 6.6): the fast path uses the clsact qdisc and cls_bpf, both available (tested on {TESTED_CLSACT})"),
            )
        }
        (Module::Unknown, _) | (_, Module::Unknown) => with_fix(
            finding(
                "tc",
                level,
                format!("no tcx (Linux < 6.6) and cannot tell whether clsact (sch_ingress) and cls_bpf exist{needed}"),
            ),
            "check CONFIG_NET_SCH_INGRESS and CONFIG_NET_CLS_BPF",
        ),
        _ => with_fix(
            finding(
                "tc",
                level,
                format!("no tcx (Linux < 6.6) and no clsact (sch_ingress) or cls_bpf module{needed}"),
            ),
            "use a kernel with CONFIG_NET_SCH_INGRESS and CONFIG_NET_CLS_BPF, or fastPath: nftables",
        ),
    }
}

fn ip_forward(f: &Facts, w: &Want) -> Finding {
    const C: &str = "ip_forward";
    let mut missing = Vec::new();
    if w.forward_v4 && f.ip_forward != Some(1) {
        missing.push("net.ipv4.ip_forward=1");
    }
    if w.forward_v6 && f.ipv6_forwarding != Some(1) {
        missing.push("net.ipv6.conf.all.forwarding=1");
    }
    let shown = |v: Option<u32>| v.map_or("?".to_owned(), |v| v.to_string());
    let now = format!(
        "net.ipv4.ip_forward={}, net.ipv6.conf.all.forwarding={}",
        shown(f.ip_forward),
        shown(f.ipv6_forwarding)
    );
    if !missing.is_empty() {
        let set = missing.join(" ");
        return with_fix(
            finding(
                C,
                Level::Fail,
                format!("{now}: this node forwards pod traffic into the mesh"),
            ),
            format!("`sysctl -w {set}`, and persist it in /etc/sysctl.d/"),
        );
    }
    if w.forward_v4 || w.forward_v6 {
        finding(C, Level::Ok, now)
    } else {
        finding(
            C,
            Level::Ok,
            format!("{now} (no pod networks advertised: forwarding not needed)"),
        )
    }
}

/// The mesh link carries no IPv4 address, and on such a link the kernel's
/// reverse-path check, strict or loose, drops every packet whose source is routed
/// elsewhere: every peer's IPv4 traffic. The daemon turns it off on the link itself
/// (`net.ipv4.conf.LINK.rp_filter=0`, restored on teardown); the kernel applies the
/// larger of that and `all`, which is host-wide policy the daemon refuses rather than
/// changes. So only `all` decides.
fn rp_filter(f: &Facts, w: &Want) -> Finding {
    const C: &str = "rp_filter";
    let link = &w.link;
    match f.rp_filter_all {
        None => finding(C, Level::Warn, "cannot read net.ipv4.conf.all.rp_filter"),
        Some(0) => finding(
            C,
            Level::Ok,
            match f.rp_filter_link {
                Some(0) => format!("off on {link} (net.ipv4.conf.all.rp_filter=0)"),
                _ => format!(
                    "net.ipv4.conf.all.rp_filter=0; the daemon turns filtering off on {link}"
                ),
            },
        ),
        Some(v) => with_fix(
            finding(
                C,
                Level::Fail,
                format!("net.ipv4.conf.all.rp_filter={v}: the kernel filters {link} with the larger of this and the link's own value, and {link} has no IPv4 address, so peers' IPv4 traffic is dropped; the daemon refuses to run the mesh"),
            ),
            "`sysctl -w net.ipv4.conf.all.rp_filter=0` and persist it in /etc/sysctl.d/ (the daemon sets the mesh link's own value)".to_owned(),
        ),
    }
}

fn src_valid_mark(f: &Facts) -> Finding {
    const C: &str = "src_valid_mark";
    match (f.src_valid_mark, f.rp_filter_all) {
        (Some(1), _) => finding(C, Level::Ok, "net.ipv4.conf.all.src_valid_mark=1"),
        (Some(_), Some(0)) => finding(
            C,
            Level::Ok,
            "net.ipv4.conf.all.src_valid_mark=0 (not needed with rp_filter off)",
        ),
        (Some(v), _) => with_fix(
            finding(
                C,
                Level::Warn,
                format!("net.ipv4.conf.all.src_valid_mark={v}: reverse-path checks ignore the mesh's fwmark"),
            ),
            "`sysctl -w net.ipv4.conf.all.src_valid_mark=1` (as wg-quick does), and persist it in /etc/sysctl.d/",
        ),
        (None, _) => finding(C, Level::Warn, "cannot read net.ipv4.conf.all.src_valid_mark"),
    }
}

fn listen_port(f: &Facts, w: &Want) -> Finding {
    const C: &str = "listen_port";
    let (port, link) = (w.port, &w.link);
    match &f.port {
        Port::Free => finding(C, Level::Ok, format!("UDP {port} is free")),
        Port::InUse { mesh_link: true } => finding(
            C,
            Level::Ok,
            format!("UDP {port} is in use, and {link} exists: the mesh is running"),
        ),
        Port::InUse { mesh_link: false } => with_fix(
            finding(C, Level::Fail, format!("UDP {port} is taken by another socket")),
            format!("find it (`ss -ulpn sport = :{port}`, `wg show`) and stop it, or set another listenPort in the KubeSpanConfig document"),
        ),
        Port::Error(e) => finding(C, Level::Warn, format!("cannot test UDP {port}: {e}")),
    }
}

/// One finding per check, in [`CHECKS`] order.
#[must_use]
pub fn evaluate(f: &Facts, w: &Want) -> Vec<Finding> {
    let [nft, nf_tables] = nft(f);
    vec![
        privileges(f),
        wireguard(f, w),
        nft,
        nf_tables,
        bpf(f, w),
        tc(f, w),
        ip_forward(f, w),
        rp_filter(f, w),
        src_valid_mark(f),
        listen_port(f, w),
    ]
}

#[cfg(test)]
mod tests;
