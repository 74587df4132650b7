//! placeholder
#[derive(Debug, clap::Args)]
pub struct Args {}
pub fn run(_: &Args) -> anyhow::Result<()> {
    Ok(())
}
