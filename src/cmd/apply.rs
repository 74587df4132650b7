//! `wirespan apply FILE`: replace a running node's config through the API. An invalid
//! config is rejected whole (every problem printed, naming document and field) and
//! the node keeps its previous config; either way the version in force is printed.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use wirespan_control::{
    api::{client::ApiClient, proto},
    config_loader as loader,
};

use super::fleet::FleetArgs;

/// Options of `wirespan apply`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The multi-document YAML config file.
    pub file: PathBuf,
    /// Only validate (on the node); change nothing.
    #[arg(long)]
    pub dry_run: bool,
}

pub fn run(args: &Args, fleet: &FleetArgs, socket: Option<&Path>) -> anyhow::Result<()> {
    // Same size cap as the node's, checked before sending.
    let config = loader::read_file(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    super::block_on(async {
        let targets = super::fleet::targets(fleet, socket).await?;
        let results = super::fleet::each(&targets, |c| apply(c, &config, args.dry_run)).await;
        let (ok, failed) = super::fleet::split(results)?;
        for (node, line) in ok {
            match node {
                Some(n) => println!("{n}: {line}"),
                None => println!("{line}"),
            }
        }
        failed.into_result()
    })
}

/// Applies `config` on one node; the line to print.
async fn apply(mut client: ApiClient, config: &str, dry_run: bool) -> anyhow::Result<String> {
    let resp = client
        .apply_config(proto::ApplyConfigRequest {
            config: config.to_owned(),
            dry_run,
        })
        .await
        .map_err(|s| anyhow::anyhow!("ApplyConfig: {} ({:?})", s.message(), s.code()))?
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
    Ok(if dry_run {
        "config is valid".to_owned()
    } else if resp.changed {
        format!(
            "config applied: version {} ({} documents)",
            resp.accepted_version, resp.documents
        )
    } else {
        format!(
            "config unchanged: version {} in force",
            resp.accepted_version
        )
    })
}
