//! `wirespan man --out DIR`: roff man pages, one per command and subcommand
//! (`wirespan.1`, `wirespan-node.1`, `wirespan-gen-cluster.1`, …).

use std::{io::Write as _, path::PathBuf};

use anyhow::Context as _;

/// Options of `wirespan man`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Directory to write the pages to (created if missing).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

/// The command and its visible subcommands, depth first.
fn commands(cmd: &clap::Command, out: &mut Vec<clap::Command>) {
    out.push(cmd.clone());
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        commands(sub, out);
    }
}

/// Writes every page into `args.out` and prints the paths written.
pub fn run(args: &Args, cmd: clap::Command) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    // Built, so that subcommands carry their display names (`wirespan-gen-cluster`).
    let mut cmd = cmd.disable_help_subcommand(true);
    cmd.build();
    let mut all = Vec::new();
    commands(&cmd, &mut all);
    let mut stdout = std::io::stdout().lock();
    for c in all {
        let path = clap_mangen::Man::new(c)
            .generate_to(&args.out)
            .with_context(|| format!("writing a man page to {}", args.out.display()))?;
        writeln!(stdout, "{}", path.display())?;
    }
    Ok(())
}
