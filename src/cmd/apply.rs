//! `wirespan apply FILE`: replace a running node's config through the API. An invalid
//! config is rejected whole (every problem printed, naming document and field) and
//! the node keeps its previous config; either way the version in force is printed.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use wirespan_control::{
    api::{client::connect, proto},
    config_loader as loader,
};

/// Options of `wirespan apply`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The multi-document YAML config file.
    pub file: PathBuf,
    /// Only validate (on the node); change nothing.
    #[arg(long)]
    pub dry_run: bool,
}

pub fn run(args: &Args, socket: &Path) -> anyhow::Result<()> {
    // Same size cap as the node's, checked before sending.
    let config = loader::read_file(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    super::block_on(async {
        let mut client = connect(socket).await?;
        let resp = client
            .apply_config(proto::ApplyConfigRequest {
                config,
                dry_run: args.dry_run,
            })
            .await
            .context("ApplyConfig")?
            .into_inner();
        if !resp.errors.is_empty() {
            for e in &resp.errors {
                eprintln!("{e}");
            }
            let kept = if resp.accepted_version.is_empty() {
                String::new()
            } else {
                format!(" (version {})", resp.accepted_version)
            };
            anyhow::bail!(
                "config rejected ({} error(s)); the node keeps its previous config{kept}",
                resp.errors.len()
            );
        }
        if args.dry_run {
            println!("config is valid");
        } else if resp.changed {
            println!(
                "config applied: version {} ({} documents)",
                resp.accepted_version, resp.documents
            );
        } else {
            println!(
                "config unchanged: version {} in force",
                resp.accepted_version
            );
        }
        Ok(())
    })
}
