//! `wirespan bench dataplane`.

/// Options of `wirespan bench dataplane`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {}

/// Runs the benchmark and prints its report.
///
/// # Errors
/// Whatever stops the benchmark from producing a valid report.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let _ = args;
    anyhow::bail!("the dataplane benchmark is not built yet")
}
