//! `wirespan docs config [--out FILE]`: the configuration reference, rendered from the
//! config document types (committed as `docs/config-reference.md`; a test fails when
//! the committed copy is stale).

use std::path::PathBuf;

use anyhow::Context as _;
use wirespan_control::config::{reference, Document};

/// Documentation generated from the code.
#[derive(Debug, clap::Subcommand)]
pub enum Docs {
    /// The configuration reference (every document kind, field, type, default and
    /// validation rule), as markdown.
    Config(Args),
}

/// Options of `wirespan docs config`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Write to FILE instead of stdout.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

pub fn run(docs: &Docs) -> anyhow::Result<()> {
    let Docs::Config(args) = docs;
    let text = reference::markdown(&Document::reference());
    match &args.out {
        Some(path) => {
            std::fs::write(path, &text).with_context(|| format!("writing {}", path.display()))
        }
        None => {
            print!("{text}");
            Ok(())
        }
    }
}
