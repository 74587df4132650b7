//! `wirespan bench runtime`.

/// Options of `wirespan bench runtime`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {}

/// Runs the benchmark and prints its report.
///
/// # Errors
/// Whatever stops the benchmark from producing a valid report.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let _ = args;
    anyhow::bail!("the runtime benchmark is not built yet")
}
