//! `wirespan install systemd`: writes the systemd units of `deploy/systemd/` (embedded
//! in the binary) with `ExecStart` pointing at the installed binary.

use std::path::{Path, PathBuf};

use anyhow::Context as _;

/// The binary path the unit files in the repository name.
const UNIT_BIN: &str = "/usr/local/bin/wirespan";

/// The units, by file name.
const UNITS: [(&str, &str); 2] = [
    (
        "wirespan-node.service",
        include_str!("../../deploy/systemd/wirespan-node.service"),
    ),
    (
        "wirespan-discovery.service",
        include_str!("../../deploy/systemd/wirespan-discovery.service"),
    ),
];

/// `wirespan install …`.
#[derive(Debug, clap::Subcommand)]
pub enum Install {
    /// Write the systemd units `wirespan-node.service` and `wirespan-discovery.service`
    /// into PREFIX/lib/systemd/system (then: `systemctl daemon-reload`).
    Systemd(SystemdArgs),
}

/// Options of `wirespan install systemd`.
#[derive(Debug, clap::Args)]
pub struct SystemdArgs {
    /// Installation prefix: units go to PREFIX/lib/systemd/system and run
    /// PREFIX/bin/wirespan.
    #[arg(long, value_name = "DIR", default_value = "/usr/local")]
    pub prefix: PathBuf,
    /// The binary the units run (default: PREFIX/bin/wirespan).
    #[arg(long, value_name = "PATH")]
    pub bin: Option<PathBuf>,
}

/// `unit` with every `Exec…=` line running `bin` instead of [`UNIT_BIN`].
fn render(unit: &str, bin: &Path) -> String {
    let bin = bin.to_string_lossy();
    let mut out = String::with_capacity(unit.len());
    for line in unit.lines() {
        if line.starts_with("Exec") {
            out.push_str(&line.replace(UNIT_BIN, &bin));
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

pub fn run(cmd: &Install) -> anyhow::Result<()> {
    match cmd {
        Install::Systemd(args) => systemd(args),
    }
}

fn systemd(args: &SystemdArgs) -> anyhow::Result<()> {
    let bin = args
        .bin
        .clone()
        .unwrap_or_else(|| args.prefix.join("bin/wirespan"));
    anyhow::ensure!(
        bin.is_absolute(),
        "--bin {} must be an absolute path (systemd runs it from /)",
        bin.display()
    );
    if !bin.exists() {
        eprintln!(
            "warning: {} does not exist yet; install the binary there before starting the units",
            bin.display()
        );
    }
    let dir = args.prefix.join("lib/systemd/system");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, unit) in UNITS {
        let path = dir.join(name);
        std::fs::write(&path, render(unit, &bin))
            .with_context(|| format!("writing {}", path.display()))?;
        println!("{}", path.display());
    }
    eprintln!(
        "next: `wirespan man --out {}` for the units' Documentation=, then `systemctl daemon-reload`",
        args.prefix.join("share/man/man1").display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_unit_runs_the_given_binary_and_only_exec_lines_change() {
        for (name, unit) in UNITS {
            assert!(unit.contains(&format!("ExecStart={UNIT_BIN} ")), "{name}");
            let out = render(unit, Path::new("/opt/ws/bin/wirespan"));
            assert!(out.contains("ExecStart=/opt/ws/bin/wirespan "), "{name}");
            assert!(!out.contains(&format!("ExecStart={UNIT_BIN}")), "{name}");
            assert_eq!(out.lines().count(), unit.lines().count(), "{name}");
            for (a, b) in unit.lines().zip(out.lines()) {
                if !a.starts_with("Exec") {
                    assert_eq!(a, b, "{name}");
                }
            }
        }
    }

    #[test]
    fn units_are_notify_services_that_restart_on_failure() {
        for (name, unit) in UNITS {
            for want in ["Type=notify", "Restart=on-failure", "StateDirectory="] {
                assert!(unit.lines().any(|l| l.starts_with(want)), "{name}: {want}");
            }
        }
    }
}
