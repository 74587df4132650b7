//! `wirespan gen …`: generate identities and secrets.
//!
//! Secrets go to files (mode 0600, written atomically), never to the terminal; only
//! public material is printed.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Subcommand;
use wirespan_control::resources::identity::write_atomic;
use wirespan_dataplane::wireguard::{PresharedKey, PrivateKey};

/// What to generate.
#[derive(Debug, Subcommand)]
pub enum Gen {
    /// A cluster secret (32 random bytes, base64): the discovery encryption key and the
    /// WireGuard preshared key of every peer. Written to FILE.
    Secret {
        /// Where to write the secret (mode 0600). Refuses to overwrite unless --force.
        #[arg(long, short)]
        out: PathBuf,
        /// Replace an existing file.
        #[arg(long)]
        force: bool,
    },
    /// A WireGuard private key written to FILE; prints the public key.
    Key {
        /// Where to write the private key (mode 0600). Refuses to overwrite unless --force.
        #[arg(long, short)]
        out: PathBuf,
        /// Replace an existing file.
        #[arg(long)]
        force: bool,
    },
    /// Prints the public key of a private key file.
    Pubkey {
        /// The private key file.
        #[arg(long, short)]
        key: PathBuf,
    },
    /// Prints a fresh node ID (32 random bytes, base62), as nodes generate on first start.
    NodeId,
}

pub fn run(cmd: &Gen) -> anyhow::Result<()> {
    match cmd {
        Gen::Secret { out, force } => {
            write_secret(out, *force, &PresharedKey::generate().to_base64())?;
            eprintln!("cluster secret written to {}", out.display());
        }
        Gen::Key { out, force } => {
            let key = PrivateKey::generate();
            write_secret(out, *force, &key.to_base64())?;
            println!("{}", key.public_key());
        }
        Gen::Pubkey { key } => {
            let text = std::fs::read_to_string(key)
                .with_context(|| format!("reading private key file {}", key.display()))?;
            let key = PrivateKey::from_base64(&key.display().to_string(), &text)?;
            println!("{}", key.public_key());
        }
        Gen::NodeId => println!(
            "{}",
            wirespan_control::resources::identity::generate_node_id()
        ),
    }
    Ok(())
}

fn write_secret(path: &Path, force: bool, base64: &str) -> anyhow::Result<()> {
    if !force && path.exists() {
        anyhow::bail!(
            "{} already exists; pass --force to replace it",
            path.display()
        );
    }
    write_atomic(path, format!("{base64}\n").as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}
