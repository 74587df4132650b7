//! `wirespan completions SHELL`: the shell completion script on stdout, generated from
//! the same command definition the binary parses with, so it never lags behind.

use std::io::Write as _;

/// Options of `wirespan completions`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Shell to complete for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// Writes the completion script for `args.shell` to stdout.
pub fn run(args: &Args, mut cmd: clap::Command) -> anyhow::Result<()> {
    // Into memory first: the generator panics on a write error (a closed pipe).
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut cmd, "wirespan", &mut script);
    let mut out = std::io::stdout().lock();
    out.write_all(&script)?;
    out.flush()?;
    Ok(())
}
