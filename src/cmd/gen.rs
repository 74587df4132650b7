//! `wirespan gen …`: generate identities and secrets.
//!
//! Secrets go to files (mode 0600, written atomically), never to the terminal; only
//! public material is printed.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Subcommand;
use wirespan_control::{
    api::pki::{self, Role},
    files::write_atomic,
};
use wirespan_dataplane::wireguard::{PresharedKey, PrivateKey};

use super::fleet::ClientConfig;

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
    /// A cluster config file (0600): a `ClusterConfig` document with a fresh cluster ID
    /// and secret (upstream formats: URL-safe and standard base64 of 32 random bytes)
    /// and a fresh cluster API CA (`apiCaCert`, `apiCaKey`: nodes started with
    /// `--api-listen` issue their certificates from it), plus one
    /// `DiscoveryServiceConfig` per `--discovery`. Usable as it is with
    /// `wirespan node --config FILE`; more documents (e.g. `KubeSpanConfig`) may be
    /// appended. Nothing secret is printed.
    Cluster {
        /// Where to write the config (mode 0600). Refuses to overwrite unless --force.
        #[arg(long, short)]
        out: PathBuf,
        /// A discovery service: `URL` (http:// or https://) or `NAME=URL`; repeatable.
        /// Without it no discovery service is contacted (there is no public default).
        /// The name defaults to the URL's host and port.
        #[arg(long = "discovery", value_name = "[NAME=]URL")]
        discovery: Vec<String>,
        /// Replace an existing file.
        #[arg(long)]
        force: bool,
    },
    /// A client config (0600) for the remote API: one context with endpoints, nodes,
    /// the cluster API CA and a client certificate and key signed by it, carrying the
    /// role. Merge it into `~/.wirespan/config` with `wirespan config merge FILE`, or
    /// point `WIRESPANCONFIG` at it.
    Client {
        /// The cluster config holding the API CA (`wirespan gen cluster` wrote it).
        #[arg(long, value_name = "FILE")]
        cluster: PathBuf,
        /// What the certificate may do: `admin` (everything) or `reader` (no apply).
        #[arg(long, value_parser = ["admin", "reader"])]
        role: String,
        /// Where to write the client config. Refuses to overwrite unless --force.
        #[arg(long, short)]
        out: PathBuf,
        /// The context's endpoints (`host[:port]`, comma-separated).
        #[arg(long = "endpoint", value_delimiter = ',')]
        endpoints: Vec<String>,
        /// The context's default nodes (comma-separated).
        #[arg(long = "node", value_delimiter = ',')]
        nodes: Vec<String>,
        /// The context's name (default: the role).
        #[arg(long)]
        context: Option<String>,
        /// Replace an existing file.
        #[arg(long)]
        force: bool,
    },
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
        Gen::Cluster {
            out,
            discovery,
            force,
        } => {
            let text = cluster_config(discovery)?;
            write_file(out, *force, &text)?;
            eprintln!(
                "cluster config with {} discovery service(s) and an API CA written to {}",
                discovery.len(),
                out.display()
            );
        }
        Gen::Client {
            cluster,
            role,
            out,
            endpoints,
            nodes,
            context,
            force,
        } => {
            let role = Role::parse(role).context("--role must be admin or reader")?;
            let config = client_config(cluster, role, endpoints, nodes, context.as_deref())?;
            if !force && out.exists() {
                anyhow::bail!(
                    "{} already exists; pass --force to replace it",
                    out.display()
                );
            }
            config.save(out)?;
            eprintln!(
                "client config (role {}, context {}) written to {}",
                role.as_str(),
                config.context,
                out.display()
            );
        }
    }
    Ok(())
}

/// A client config with one context holding a fresh certificate for `role` issued
/// by the API CA of the cluster config at `cluster`.
pub fn client_config(
    cluster: &Path,
    role: Role,
    endpoints: &[String],
    nodes: &[String],
    context: Option<&str>,
) -> anyhow::Result<ClientConfig> {
    let text = std::fs::read_to_string(cluster)
        .with_context(|| format!("reading {}", cluster.display()))?;
    // Errors name documents and fields and never echo a secret.
    let docs = wirespan_control::config::parse(&text)
        .map_err(|e| anyhow::anyhow!("{}: {e}", cluster.display()))?;
    let cc = docs
        .singleton::<wirespan_control::config::cluster::ClusterConfig>()
        .with_context(|| format!("{} has no ClusterConfig document", cluster.display()))?;
    let (Some(ca_cert), Some(ca_key)) = (&cc.api_ca_cert, &cc.api_ca_key) else {
        anyhow::bail!(
            "{}: its ClusterConfig has no API CA (apiCaCert/apiCaKey); a config from `wirespan gen cluster` has one",
            cluster.display()
        );
    };
    let name = context.unwrap_or(role.as_str()).to_owned();
    let issued = pki::issue(
        ca_key,
        role,
        &format!("wirespan-{}", role.as_str()),
        &[],
        std::time::SystemTime::now(),
        pki::CLIENT_LIFETIME,
    )?;
    let ctx = super::fleet::Context {
        endpoints: endpoints.to_vec(),
        nodes: nodes.to_vec(),
        ca: ca_cert.clone(),
        crt: issued.cert_pem,
        key: issued.key_pem.expose().to_owned(),
    };
    Ok(ClientConfig {
        context: name.clone(),
        contexts: [(name, ctx)].into(),
    })
}

/// `text` as a YAML literal block indented by two spaces.
fn yaml_block(text: &str) -> String {
    text.lines().map(|l| format!("  {l}\n")).collect()
}

/// Discovery service name from a URL: host and port with every character outside
/// `[A-Za-z0-9-_.]` replaced by `-`.
fn service_name(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    rest.trim_end_matches('/')
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '-'
            }
        })
        .collect::<String>()
        .trim_matches('-')
        .to_owned()
}

/// The config text; validated with the node's own parser before anything is written,
/// so the file always loads.
fn cluster_config(discovery: &[String]) -> anyhow::Result<String> {
    // Upstream: the cluster ID is URL-safe base64, the secret standard base64.
    let id: String = PresharedKey::generate()
        .to_base64()
        .chars()
        .map(|c| match c {
            '+' => '-',
            '/' => '_',
            c => c,
        })
        .collect();
    let secret = PresharedKey::generate().to_base64();
    let ca = pki::generate_ca(std::time::SystemTime::now())?;
    let mut text = format!(
        "# Generated by `wirespan gen cluster`. Contains the cluster secret and the API CA key: keep it 0600.\n\
         apiVersion: v1alpha1\nkind: ClusterConfig\nid: {id}\nsecret: {secret}\n\
         apiCaCert: |\n{}apiCaKey: |\n{}",
        yaml_block(&ca.cert_pem),
        yaml_block(ca.key_pem.expose()),
    );
    let mut names = std::collections::BTreeSet::new();
    for entry in discovery {
        let (name, url) = match entry.split_once('=') {
            Some((name, url)) if !name.contains("://") => (name.to_owned(), url),
            _ => (service_name(entry), entry.as_str()),
        };
        if !names.insert(name.clone()) {
            anyhow::bail!("--discovery {entry:?}: service name {name:?} is used twice; give names with NAME=URL");
        }
        text.push_str(&format!(
            "---\napiVersion: v1alpha1\nkind: DiscoveryServiceConfig\nname: {name}\nendpoint: {url}\n"
        ));
    }
    if let Err(e) = wirespan_control::config::parse(&text) {
        // Errors name documents and fields and never echo the secret.
        anyhow::bail!("invalid --discovery: {e}");
    }
    Ok(text)
}

fn write_secret(path: &Path, force: bool, base64: &str) -> anyhow::Result<()> {
    write_file(path, force, &format!("{base64}\n"))
}

fn write_file(path: &Path, force: bool, contents: &str) -> anyhow::Result<()> {
    if !force && path.exists() {
        anyhow::bail!(
            "{} already exists; pass --force to replace it",
            path.display()
        );
    }
    write_atomic(path, contents.as_bytes()).with_context(|| format!("writing {}", path.display()))
}
