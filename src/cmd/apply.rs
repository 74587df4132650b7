//! `wirespan apply FILE`: replace a running node's config through the API. An invalid
//! config is rejected whole (every problem printed, naming document and field) and
//! the node keeps its previous config; either way the version in force is printed.
//!
//! `--mode try` puts the config in force on trial: unless `wirespan apply --confirm`
//! comes before the timeout, the node goes back to the config it had before (see
//! `docs/operations.md`, "Changing config safely").

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::Context as _;
use wirespan_control::{
    api::{client::ApiClient, proto},
    config_loader as loader,
};

use super::fleet::{self, FleetArgs};

/// How a config is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Mode {
    /// In force and last good at once (the default).
    #[default]
    Auto,
    /// In force at once, rolled back at the timeout unless confirmed with
    /// `wirespan apply --confirm`.
    Try,
}

/// The options of a config change shared by `apply`, `patch` and `edit`.
#[derive(Debug, Clone, clap::Args)]
pub struct ModeArgs {
    /// `try`: roll back unless confirmed (`wirespan apply --confirm`) within
    /// `--timeout`.
    #[arg(long, value_enum, default_value_t = Mode::Auto)]
    pub mode: Mode,
    /// With `--mode try`: how long the config stays unconfirmed before the node goes
    /// back to its earlier config (`90s`, `5m`; at most 1 day).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1m")]
    pub timeout: Duration,
    /// With `--mode try`: roll back at once when TCP connects to this `host:port` (for
    /// example the jump host you came through) fail this many times in a row.
    #[arg(long, value_name = "ADDR")]
    pub rollback_unless_reachable: Option<String>,
    /// Failed connects in a row to `--rollback-unless-reachable` that roll back.
    #[arg(long, default_value_t = loader::trial::DEFAULT_FAILURE_THRESHOLD)]
    pub failure_threshold: u32,
}

impl ModeArgs {
    /// Checks the combination before anything is sent.
    ///
    /// # Errors
    /// Trial options without `--mode try`, or a bad timeout.
    pub fn check(&self) -> anyhow::Result<()> {
        if self.mode == Mode::Auto && self.rollback_unless_reachable.is_some() {
            anyhow::bail!("--rollback-unless-reachable needs --mode try");
        }
        if self.mode == Mode::Try {
            loader::trial::check_timeout(self.timeout).map_err(anyhow::Error::msg)?;
        }
        Ok(())
    }

    /// The request for `config` (`base`: the version it was made from, if any).
    #[must_use]
    pub fn request(&self, config: String, base: &str) -> proto::ApplyConfigRequest {
        let trial = self.mode == Mode::Try;
        proto::ApplyConfigRequest {
            config,
            dry_run: false,
            mode: if trial {
                proto::ApplyMode::Try
            } else {
                proto::ApplyMode::Auto
            } as i32,
            trial_timeout_ms: if trial {
                u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX)
            } else {
                0
            },
            rollback_unless_reachable: self.rollback_unless_reachable.clone().unwrap_or_default(),
            reachability_failure_threshold: self.failure_threshold,
            base_version: base.to_owned(),
        }
    }
}

/// Options of `wirespan apply`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The multi-document YAML config file.
    #[arg(required_unless_present = "confirm")]
    pub file: Option<PathBuf>,
    /// Only validate (on the node); change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Confirm the config on trial (`--mode try`): it becomes the last good config
    /// and the rollback is disarmed. Takes no file.
    #[arg(long, conflicts_with_all = ["file", "dry_run", "mode", "rollback_unless_reachable"])]
    pub confirm: bool,
    #[command(flatten)]
    pub mode: ModeArgs,
}

pub fn run(args: &Args, fleet: &FleetArgs, socket: Option<&Path>) -> anyhow::Result<()> {
    let config = if args.confirm {
        None
    } else {
        args.mode.check()?;
        let Some(file) = &args.file else {
            anyhow::bail!("a config file is needed (or --confirm)");
        };
        // Same size cap as the node's, checked before sending.
        Some(loader::read_file(file).with_context(|| format!("reading {}", file.display()))?)
    };
    super::block_on(async {
        let targets = fleet::targets(fleet, socket).await?;
        let results = fleet::each(&targets, |mut c| {
            let req = config.as_ref().map(|config| {
                let mut req = args.mode.request(config.clone(), "");
                req.dry_run = args.dry_run;
                req
            });
            async move {
                match req {
                    Some(req) => send(&mut c, req).await,
                    None => confirm(&mut c).await,
                }
            }
        })
        .await;
        let (ok, failed) = fleet::split(results)?;
        for (node, line) in ok {
            match node {
                Some(n) => println!("{n}: {line}"),
                None => println!("{line}"),
            }
        }
        failed.into_result()
    })
}

/// `apply --confirm` on one node; the line to print.
async fn confirm(client: &mut ApiClient) -> anyhow::Result<String> {
    let resp = client
        .confirm_config(proto::ConfirmConfigRequest {})
        .await
        .map_err(|s| anyhow::anyhow!("{}", s.message()))
        .context("confirming the config trial")?
        .into_inner();
    Ok(format!(
        "config trial confirmed: version {} is the last good config",
        resp.version
    ))
}

/// Sends an `ApplyConfig`; the line that says its outcome.
///
/// # Errors
/// The call failed or the config was rejected (every problem on stderr).
pub async fn send(
    client: &mut ApiClient,
    req: proto::ApplyConfigRequest,
) -> anyhow::Result<String> {
    let dry_run = req.dry_run;
    let resp = client
        .apply_config(req)
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
    } else if !resp.trial_deadline.is_empty() {
        format!(
            "config on trial: version {} ({} documents) rolls back at {} unless confirmed with `wirespan apply --confirm`",
            resp.accepted_version, resp.documents, resp.trial_deadline
        )
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
