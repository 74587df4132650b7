//! `KubeSpanIdentityController`: the WireGuard key (generated once, persisted 0600 in
//! the state dir) and the KubeSpan address from the cluster ID and a link's MAC
//! (`docs/kubespan.md` §2, §3, §14).

use std::{
    fs,
    path::{Path, PathBuf},
    sync::Arc,
};

use futures::future::BoxFuture;
use ipnet::{IpNet, Ipv6Net};
use wirespan_dataplane::{netns::Netns, wireguard::PrivateKey};

use crate::{
    files::{ensure_private_dir, write_atomic},
    kubespan::ula::{cluster_prefix, node_address, parse_mac, PURPOSE_KUBESPAN},
    resources::{
        cluster::{ClusterIdentity, CLUSTER},
        kubespan::{KubeSpanConfig, KubeSpanIdentity, KubeSpanIdentitySpec, KUBESPAN, NS},
    },
    runtime::{
        Action, Controller, ControllerError, ControllerResult, ControllerRuntime, Input, InputKind,
        Output, Pointer, ResourceKind as _,
    },
    secret::Key32,
};

/// A network link as far as the identity cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkInfo {
    /// Interface name.
    pub name: String,
    /// Hardware address (empty if none).
    pub mac: Vec<u8>,
    /// Ethernet without a link kind (not veth, bridge, …).
    pub physical: bool,
}

/// Lists the links of the node's network namespace.
pub trait LinkSource: Send + Sync + std::fmt::Debug {
    /// Every link.
    ///
    /// # Errors
    /// The kernel could not be asked.
    fn links(&self) -> std::io::Result<Vec<LinkInfo>>;
}

/// Links from `ip -j -d link show` in a namespace.
#[derive(Debug, Clone)]
pub struct IpLinkSource(pub Netns);

impl LinkSource for IpLinkSource {
    fn links(&self) -> std::io::Result<Vec<LinkInfo>> {
        let out = self.0.run_stdout("ip", &["-j", "-d", "link", "show"])?;
        let v: serde_json::Value = serde_json::from_str(&out)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        Ok(v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| {
                let name = l.get("ifname")?.as_str()?.to_owned();
                let mac = l
                    .get("address")
                    .and_then(|a| a.as_str())
                    .and_then(parse_mac)
                    .unwrap_or_default();
                let ether = l.get("link_type").and_then(|t| t.as_str()) == Some("ether");
                let kind = l.get("linkinfo").and_then(|i| i.get("info_kind")).is_some();
                Some(LinkInfo {
                    name,
                    mac,
                    physical: ether && !kind,
                })
            })
            .collect())
    }
}

/// Chooses the link whose MAC derives the address (`docs/kubespan.md` §3.2, §14): an explicit
/// `identity_link`; else the first physical link by name; else the first link by name
/// with a 6-byte MAC other than `lo` and the mesh link.
#[must_use]
pub fn choose_link<'a>(
    links: &'a [LinkInfo],
    explicit: Option<&str>,
    mesh_link: &str,
) -> Option<&'a LinkInfo> {
    if let Some(name) = explicit {
        return links.iter().find(|l| l.name == name);
    }
    let mut sorted: Vec<&LinkInfo> = links
        .iter()
        .filter(|l| l.name != "lo" && l.name != mesh_link)
        .collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    sorted
        .iter()
        .find(|l| l.physical && !l.mac.is_empty())
        .or_else(|| sorted.iter().find(|l| l.mac.len() == 6 && l.mac != [0; 6]))
        .copied()
}

/// Errors of the identity.
#[derive(Debug, thiserror::Error)]
pub enum MeshIdentityError {
    /// The key file could not be read or written.
    #[error("KubeSpan key file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The key file holds something that is not a key (contents never shown).
    #[error("KubeSpan key file {path}: not a base64 WireGuard private key")]
    Invalid {
        /// The file.
        path: PathBuf,
    },
    /// No link to derive the address from.
    #[error("no link with a usable hardware address for the KubeSpan address ({0})")]
    NoLink(String),
    /// The chosen link's address cannot make an EUI-64.
    #[error("link {link}: {source}")]
    Mac {
        /// The link.
        link: String,
        /// Cause.
        #[source]
        source: crate::kubespan::ula::BadMac,
    },
}

/// File name of the WireGuard private key in the state dir.
pub const KEY_FILE: &str = "kubespan.key";

/// Loads the private key from `dir/kubespan.key`, generating and persisting it (0600,
/// atomically) when missing.
///
/// # Errors
/// I/O errors and a file that is not a key.
pub fn load_or_generate_key(dir: &Path) -> Result<PrivateKey, MeshIdentityError> {
    let path = dir.join(KEY_FILE);
    let io = |source| MeshIdentityError::Io {
        path: path.clone(),
        source,
    };
    match fs::read_to_string(&path) {
        Ok(s) => PrivateKey::from_base64("privateKey", s.trim())
            .map_err(|_| MeshIdentityError::Invalid { path: path.clone() }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            ensure_private_dir(dir).map_err(io)?;
            let key = PrivateKey::generate();
            write_atomic(&path, format!("{}\n", key.to_base64()).as_bytes()).map_err(io)?;
            tracing::info!(path = %path.display(), public_key = %key.public_key(), "generated KubeSpan key");
            Ok(key)
        }
        Err(e) => Err(io(e)),
    }
}

/// Publishes `kubespan/KubeSpanIdentity kubespan` while the mesh is enabled and the
/// cluster identity exists; recomputed on every change of either.
#[derive(Debug)]
pub struct KubeSpanIdentityController {
    state_dir: PathBuf,
    links: Arc<dyn LinkSource>,
}

impl KubeSpanIdentityController {
    /// A controller keeping the key in `state_dir` and reading links from `links`.
    #[must_use]
    pub fn new(state_dir: PathBuf, links: Arc<dyn LinkSource>) -> Self {
        Self { state_dir, links }
    }
}

impl Controller for KubeSpanIdentityController {
    type Event = ();

    fn name(&self) -> &str {
        "KubeSpanIdentityController"
    }

    fn inputs(&self) -> Vec<Input> {
        vec![
            Input::id_of::<KubeSpanConfig>(NS, KUBESPAN, InputKind::Weak),
            Input::id_of::<ClusterIdentity>(
                crate::resources::cluster::NS,
                CLUSTER,
                InputKind::Weak,
            ),
        ]
    }

    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<KubeSpanIdentity>()]
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let cfg = rt
                .get_opt::<KubeSpanConfig>(NS, KUBESPAN)?
                .filter(|c| c.spec.config.enabled);
            let cluster = rt.get_opt::<ClusterIdentity>(crate::resources::cluster::NS, CLUSTER)?;
            let (Some(cfg), Some(cluster)) = (cfg, cluster) else {
                if rt.get_opt::<KubeSpanIdentity>(NS, KUBESPAN)?.is_some() {
                    rt.destroy(&Pointer::new(NS, KubeSpanIdentity::TYPE, KUBESPAN))?;
                }
                return Ok(Action::await_change());
            };
            let dir = self.state_dir.clone();
            let links = Arc::clone(&self.links);
            let (key, links) = tokio::task::spawn_blocking(move || {
                load_or_generate_key(&dir).map(|k| (k, links.links()))
            })
            .await
            .map_err(ControllerError::other)?
            .map_err(ControllerError::other)?;
            let links = links.map_err(ControllerError::other)?;
            let c = &cfg.spec.config;
            let link =
                choose_link(&links, c.identity_link.as_deref(), &c.link_name).ok_or_else(|| {
                    ControllerError::other(MeshIdentityError::NoLink(
                        c.identity_link
                            .as_deref()
                            .map_or("none found".to_owned(), |l| {
                                format!("identityLink {l:?} not found")
                            }),
                    ))
                })?;
            let prefix = cluster_prefix(&cluster.spec.cluster_id, PURPOSE_KUBESPAN);
            let address = node_address(prefix, &link.mac).map_err(|source| {
                ControllerError::other(MeshIdentityError::Mac {
                    link: link.name.clone(),
                    source,
                })
            })?;
            let spec = KubeSpanIdentitySpec {
                address: Some(IpNet::V6(Ipv6Net::new(address, 128).unwrap_or_default())),
                subnet: Some(IpNet::V6(prefix)),
                public_key: key.public_key().to_base64(),
                mac_source_link: link.name.clone(),
                private_key: Key32(*key.as_bytes()),
            };
            rt.modify::<KubeSpanIdentity>(NS, KUBESPAN, |r| r.spec.clone_from(&spec))?;
            Ok(Action::await_change())
        })
    }
}
