//! Talking to many nodes: the client config (`~/.wirespan/config`, contexts of
//! endpoints, nodes and credentials), the `-e/-n/--context/--wirespanconfig` flags,
//! `wirespan config …`, and running one request against every `-n` node.
//!
//! Without any of those flags and without a client config, commands use the local
//! socket as they always did.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use wirespan_control::{
    api::client::{connect_channel, connect_remote, for_node, ApiClient, Credentials},
    files::write_atomic,
    secret::SecretString,
};

/// The fleet flags (before the command: `wirespan -n node2,node3 get peers`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct FleetArgs {
    /// Remote API endpoints to connect to (`host[:port]`, comma-separated; the first
    /// that answers is used). Overrides the context's.
    #[arg(short = 'e', long, value_delimiter = ',')]
    pub endpoints: Vec<String>,
    /// Nodes to run the command on, through the endpoint (comma-separated hostnames or
    /// addresses). Overrides the context's.
    #[arg(short = 'n', long, value_delimiter = ',')]
    pub nodes: Vec<String>,
    /// Context of the client config to use (default: its current context).
    #[arg(long)]
    pub context: Option<String>,
    /// The client config file.
    #[arg(long, env = "WIRESPANCONFIG", value_name = "FILE")]
    pub wirespanconfig: Option<PathBuf>,
}

/// One context: where to connect and with which certificate.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Context {
    /// Remote API endpoints.
    #[serde(default)]
    pub endpoints: Vec<String>,
    /// Default target nodes.
    #[serde(default)]
    pub nodes: Vec<String>,
    /// The cluster API CA certificate (PEM).
    pub ca: String,
    /// The client certificate (PEM).
    pub crt: String,
    /// The client key (PEM).
    pub key: String,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("endpoints", &self.endpoints)
            .field("nodes", &self.nodes)
            .field("key", &wirespan_control::secret::REDACTED)
            .finish_non_exhaustive()
    }
}

/// The client config file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientConfig {
    /// The current context.
    #[serde(default)]
    pub context: String,
    /// Contexts by name.
    #[serde(default)]
    pub contexts: BTreeMap<String, Context>,
}

impl ClientConfig {
    /// Reads a client config; `Ok(None)` when the file does not exist.
    ///
    /// # Errors
    /// Unreadable or invalid (the message never quotes the file).
    pub fn load(path: &Path) -> anyhow::Result<Option<Self>> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        serde_yaml_ng::from_str(&text)
            .map(Some)
            // serde's message may quote a value; the location is enough.
            .map_err(|e| {
                let at = e
                    .location()
                    .map(|l| format!(" at line {}", l.line()))
                    .unwrap_or_default();
                anyhow::anyhow!("{} is not a valid client config{at}", path.display())
            })
    }

    /// Writes the config (mode 0600, atomically).
    ///
    /// # Errors
    /// I/O.
    pub fn save(&self, path: &Path) -> anyhow::Result<()> {
        wirespan_control::files::create_private_parent(path)
            .with_context(|| format!("creating the directory of {}", path.display()))?;
        write_atomic(path, serde_yaml_ng::to_string(self)?.as_bytes())
            .with_context(|| format!("writing {}", path.display()))
    }

    /// Adds the contexts of `other`; a name already here gets a `-N` suffix. Returns
    /// the names the added contexts got.
    pub fn merge(&mut self, other: ClientConfig) -> Vec<String> {
        let mut added = Vec::new();
        for (name, ctx) in other.contexts {
            let mut unique = name.clone();
            let mut n = 1;
            while self.contexts.contains_key(&unique) {
                unique = format!("{name}-{n}");
                n += 1;
            }
            if other.context == name && self.context.is_empty() {
                self.context.clone_from(&unique);
            }
            self.contexts.insert(unique.clone(), ctx);
            added.push(unique);
        }
        added
    }
}

/// The client config path: the flag or `WIRESPANCONFIG`, else `~/.wirespan/config`.
#[must_use]
pub fn config_path(args: &FleetArgs) -> PathBuf {
    args.wirespanconfig.clone().unwrap_or_else(|| {
        let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
        PathBuf::from(home).join(".wirespan/config")
    })
}

/// One node a command runs on.
#[derive(Debug, Clone)]
pub struct Target {
    /// The NODE column (`None` for the local socket).
    pub node: Option<String>,
    /// Its client.
    pub client: ApiClient,
}

/// Whether the command goes to remote nodes: any fleet flag, or a client config and no
/// explicit `--socket`.
fn wants_remote(args: &FleetArgs, socket_given: bool, config_exists: bool) -> bool {
    !args.endpoints.is_empty()
        || !args.nodes.is_empty()
        || args.context.is_some()
        || (config_exists && !socket_given)
}

/// The nodes a command runs on: one per `-n` node (through the first endpoint that
/// answers), or the endpoint itself, or the local socket.
///
/// # Errors
/// No usable context, or no endpoint answered.
pub async fn targets(args: &FleetArgs, socket: Option<&Path>) -> anyhow::Result<Vec<Target>> {
    let path = config_path(args);
    let config = ClientConfig::load(&path)?;
    if !wants_remote(args, socket.is_some(), config.is_some()) {
        let socket = socket.unwrap_or(Path::new(wirespan_control::api::DEFAULT_SOCKET));
        let client = for_node(connect_channel(socket).await?, None)?;
        return Ok(vec![Target { node: None, client }]);
    }
    let config = config.with_context(|| {
        format!(
            "no client config at {}: create one with `wirespan gen client` (or drop -e/-n/--context to use the local socket)",
            path.display()
        )
    })?;
    let name = args.context.as_deref().unwrap_or(&config.context);
    let ctx = config.contexts.get(name).with_context(|| {
        format!(
            "{}: no context {name:?} (`wirespan config contexts` lists them)",
            path.display()
        )
    })?;
    let endpoints = if args.endpoints.is_empty() {
        &ctx.endpoints
    } else {
        &args.endpoints
    };
    let nodes = if args.nodes.is_empty() {
        &ctx.nodes
    } else {
        &args.nodes
    };
    anyhow::ensure!(
        !endpoints.is_empty(),
        "context {name:?} has no endpoints: pass -e ENDPOINT"
    );
    let creds = Credentials {
        ca_pem: ctx.ca.clone(),
        cert_pem: ctx.crt.clone(),
        key_pem: SecretString::new(ctx.key.clone()),
    };
    let mut last = None;
    for endpoint in endpoints {
        match connect_remote(endpoint, &creds).await {
            Ok(channel) => {
                if nodes.is_empty() {
                    let client = for_node(channel, None)?;
                    return Ok(vec![Target {
                        node: Some(endpoint.clone()),
                        client,
                    }]);
                }
                return nodes
                    .iter()
                    .map(|n| {
                        Ok(Target {
                            node: Some(n.clone()),
                            client: for_node(channel.clone(), Some(n))?,
                        })
                    })
                    .collect();
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.map_or_else(|| anyhow::anyhow!("no endpoint"), Into::into))
}

/// Runs `f` on every target at once; results in target order.
pub async fn each<T, F, Fut>(targets: &[Target], f: F) -> Vec<(Option<String>, anyhow::Result<T>)>
where
    F: Fn(ApiClient) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let results = futures::future::join_all(targets.iter().map(|t| f(t.client.clone()))).await;
    targets
        .iter()
        .map(|t| t.node.clone())
        .zip(results)
        .collect()
}

/// The nodes' results: what worked, and how many failed (each failed node's error is
/// printed as `NODE: error`). A single node without a name (the local socket or one
/// endpoint) returns its error as it is.
///
/// # Errors
/// The one target's error.
pub fn split<T>(
    results: Vec<(Option<String>, anyhow::Result<T>)>,
) -> anyhow::Result<(NodeResults<T>, Failed)> {
    let total = results.len();
    let mut ok = Vec::new();
    let mut failed = 0;
    for (node, r) in results {
        match r {
            Ok(v) => ok.push((node, v)),
            Err(e) if total == 1 => return Err(e),
            Err(e) => {
                failed += 1;
                eprintln!("{}: {e:#}", node.as_deref().unwrap_or("local"));
            }
        }
    }
    Ok((ok, Failed { failed, total }))
}

/// Per node (`None`: the local socket), what it returned.
pub type NodeResults<T> = Vec<(Option<String>, T)>;

/// How many nodes failed; [`Failed::into_result`] after printing the others.
#[derive(Debug, Clone, Copy)]
pub struct Failed {
    failed: usize,
    total: usize,
}

impl Failed {
    /// How many nodes were asked.
    #[must_use]
    pub fn total(self) -> usize {
        self.total
    }

    /// An error when any node failed (so the exit status says so).
    ///
    /// # Errors
    /// Any node failed.
    pub fn into_result(self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.failed == 0,
            "{} of {} node(s) failed",
            self.failed,
            self.total
        );
        Ok(())
    }
}

/// `wirespan config …`.
#[derive(Debug, clap::Subcommand)]
pub enum ConfigCmd {
    /// List the contexts (`*` marks the current one).
    Contexts,
    /// Make a context the current one.
    UseContext {
        /// The context.
        name: String,
    },
    /// Add a context: a copy of the current context's credentials with other
    /// endpoints and nodes (given with -e and -n before `config`).
    Add {
        /// The new context's name.
        name: String,
    },
    /// Add every context of another client config (e.g. one `wirespan gen client`
    /// wrote); names already present get a `-N` suffix.
    Merge {
        /// The client config to merge in.
        file: PathBuf,
    },
}

/// Runs `wirespan config …` on the client config.
///
/// # Errors
/// A missing context or file, or I/O.
pub fn run_config(cmd: &ConfigCmd, args: &FleetArgs) -> anyhow::Result<()> {
    let path = config_path(args);
    let mut config = ClientConfig::load(&path)?.unwrap_or_default();
    match cmd {
        ConfigCmd::Contexts => {
            println!("CURRENT   NAME   ENDPOINTS   NODES");
            for (name, ctx) in &config.contexts {
                let mark = if *name == config.context { "*" } else { "" };
                println!(
                    "{mark:9} {name}   {}   {}",
                    ctx.endpoints.join(","),
                    ctx.nodes.join(",")
                );
            }
            return Ok(());
        }
        ConfigCmd::UseContext { name } => {
            anyhow::ensure!(
                config.contexts.contains_key(name),
                "{}: no context {name:?}",
                path.display()
            );
            config.context.clone_from(name);
        }
        ConfigCmd::Add { name } => {
            anyhow::ensure!(
                !config.contexts.contains_key(name),
                "context {name:?} exists already"
            );
            let current = config
                .contexts
                .get(&config.context)
                .cloned()
                .with_context(|| {
                    format!(
                        "{}: no current context to copy credentials from",
                        path.display()
                    )
                })?;
            let ctx = Context {
                endpoints: args.endpoints.clone(),
                nodes: args.nodes.clone(),
                ..current
            };
            config.contexts.insert(name.clone(), ctx);
        }
        ConfigCmd::Merge { file } => {
            let other = ClientConfig::load(file)?
                .with_context(|| format!("{} does not exist", file.display()))?;
            let added = config.merge(other);
            eprintln!("added context(s): {}", added.join(", "));
        }
    }
    config.save(&path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(e: &str) -> Context {
        Context {
            endpoints: vec![e.into()],
            key: "-----BEGIN PRIVATE KEY-----".into(),
            ..Default::default()
        }
    }

    #[test]
    fn merging_keeps_both_contexts_of_one_name() {
        let mut a = ClientConfig {
            context: "lab".into(),
            contexts: [("lab".to_owned(), ctx("a"))].into(),
        };
        let b = ClientConfig {
            context: "lab".into(),
            contexts: [("lab".to_owned(), ctx("b"))].into(),
        };
        assert_eq!(a.merge(b), ["lab-1"]);
        assert_eq!(a.context, "lab");
        assert_eq!(a.contexts["lab-1"].endpoints, ["b"]);
        assert!(
            !format!("{:?}", a).contains("PRIVATE"),
            "Debug hides the key"
        );
    }

    #[test]
    fn the_local_socket_is_used_without_flags_or_config() {
        let none = FleetArgs::default();
        assert!(!wants_remote(&none, false, false));
        assert!(wants_remote(&none, false, true), "a client config");
        assert!(
            !wants_remote(&none, true, true),
            "an explicit --socket wins"
        );
        let n = FleetArgs {
            nodes: vec!["node2".into()],
            ..Default::default()
        };
        assert!(wants_remote(&n, true, false));
    }
}
