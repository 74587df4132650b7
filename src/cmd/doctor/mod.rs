//! `wirespan doctor`: checks this host's prerequisites for `wirespan node` — WireGuard
//! (kernel, `wirespan wireguard` or wireguard-go), nftables, BPF and tc for the eBPF fast path, the sysctls
//! that matter and the WireGuard port — and prints each as ok/warn/fail with what to
//! fix. Exit status 1 when any check fails.
//!
//! [`probe`] observes the host, [`checks`] judges without I/O.

pub mod checks;
mod probe;

use std::{fmt::Write as _, path::PathBuf};

use anyhow::Context as _;
use checks::{Finding, Level, Want, WireGuardChoice};
use wirespan_control::config::{
    self,
    kubespan::{FastPath, KubeSpanConfigDocument},
};

use super::node::WireGuardArg;

/// Options of `wirespan doctor`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The node's config: its KubeSpanConfig document gives the link name, listen
    /// port, fast path and advertised pod networks (defaults without it).
    #[arg(long, value_name = "FILE", env = "WIRESPAN_CONFIG")]
    pub config: Option<PathBuf>,
    /// WireGuard UDP port to check (default: the config's listenPort, else 51820).
    #[arg(long)]
    pub port: Option<u16>,
    /// This node forwards pod traffic into the mesh (default: when the config
    /// advertises pod networks).
    #[arg(long)]
    pub forwarding: bool,
    /// The WireGuard implementation the node is told to use (`wirespan node
    /// --wireguard`).
    #[arg(long, value_enum, default_value_t = WireGuardArg::Auto)]
    pub wireguard: WireGuardArg,
}

/// What the node will need, from the config (if any) and the flags.
fn want(args: &Args) -> anyhow::Result<Want> {
    let mesh = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let cfg =
                config::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            cfg.singleton::<KubeSpanConfigDocument>()
                .cloned()
                .unwrap_or_default()
        }
        None => KubeSpanConfigDocument::default(),
    };
    let advertised = if mesh.advertise_kubernetes_networks {
        mesh.advertised_networks.as_slice()
    } else {
        &[]
    };
    Ok(Want {
        port: args.port.unwrap_or(mesh.listen_port),
        link: mesh.link_name.clone(),
        wireguard: match args.wireguard {
            WireGuardArg::Auto => WireGuardChoice::Auto,
            WireGuardArg::Kernel => WireGuardChoice::Kernel,
            WireGuardArg::Userspace => WireGuardChoice::Userspace,
            WireGuardArg::UserspaceGo => WireGuardChoice::UserspaceGo,
        },
        ebpf: mesh.fast_path == FastPath::Ebpf,
        forward_v4: args.forwarding || advertised.iter().any(|n| n.addr().is_ipv4()),
        forward_v6: args.forwarding || advertised.iter().any(|n| n.addr().is_ipv6()),
    })
}

/// `LEVEL  CHECK  message` lines, a `fix:` line under each warning and failure, and a
/// count.
#[must_use]
pub fn render(findings: &[Finding]) -> String {
    let w = checks::CHECKS.iter().map(|c| c.len()).max().unwrap_or(0);
    let mut out = String::new();
    for f in findings {
        let _ = writeln!(
            out,
            "{:<4}  {:w$}  {}",
            f.level.as_str(),
            f.check,
            f.message
        );
        if let Some(fix) = &f.fix {
            let _ = writeln!(out, "{:4}  {:w$}  fix: {fix}", "", "");
        }
    }
    let count = |l| findings.iter().filter(|f| f.level == l).count();
    let _ = writeln!(
        out,
        "{} checks: {} ok, {} warn, {} fail",
        findings.len(),
        count(Level::Ok),
        count(Level::Warn),
        count(Level::Fail)
    );
    out
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let want = want(args)?;
    let findings = checks::evaluate(&probe::observe(&want), &want);
    print!("{}", render(&findings));
    let failed = findings.iter().filter(|f| f.level == Level::Fail).count();
    anyhow::ensure!(failed == 0, "{failed} check(s) failed");
    Ok(())
}
