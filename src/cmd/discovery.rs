//! `wirespan discovery`: the discovery server.

/// Options of `wirespan discovery`.
#[derive(Debug, clap::Args)]
pub struct Args {}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let _ = args;
    anyhow::bail!("the discovery server is not built yet")
}
