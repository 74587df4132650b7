//! What a lab is made of, as plain data: names of its namespaces and files, its
//! addresses, and the config documents of its nodes. No I/O here.
//!
//! Every kernel object of lab `NAME` lives in a network namespace called
//! `wsl-NAME-ROLE` (ROLE: `underlay`, `disco`, `nodeI`, `routerI`: the NAT router in
//! front of node I), and every file under
//! `/run/wirespan-lab/NAME`; `down` finds them by that prefix alone. Lab names are
//! lowercase letters and digits only, so one lab's prefix never matches another's.

use std::{
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};
use wirespan_control::config::{
    self, kubespan::FastPath, kubespan::KubeSpanConfigDocument, API_VERSION,
};

pub use super::topology::{node_name, MAX_NODES};
use super::topology::{Nat, Topology};

/// Where every lab keeps its files (a private bind mount of itself, so namespace
/// files can be bound inside).
pub const LAB_ROOT: &str = "/run/wirespan-lab";
/// Port of the discovery server's gRPC API.
pub const DISCOVERY_PORT: u16 = 3000;
/// Port of the discovery server's metrics and inspect pages.
pub const DISCOVERY_METRICS_PORT: u16 = 2122;
/// Port of each node daemon's metrics (`--metrics-listen`), on the loopback of the
/// node's namespace: reachable with `lab exec`, not over the underlay.
pub const NODE_METRICS_PORT: u16 = 9620;
/// The node's underlay link (inside its namespace).
pub const NODE_LINK: &str = "eth0";

/// A valid lab name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabName(String);

impl LabName {
    /// Checks `name`: 1 to 16 lowercase ASCII letters and digits.
    ///
    /// # Errors
    /// A message naming the problem.
    pub fn parse(name: &str) -> Result<Self, String> {
        if name.is_empty() || name.len() > 16 {
            return Err(format!("lab name {name:?} must be 1 to 16 characters long"));
        }
        if !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        {
            return Err(format!(
                "lab name {name:?} may only contain lowercase letters and digits"
            ));
        }
        Ok(Self(name.to_owned()))
    }

    /// The name.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Prefix of every network namespace of this lab.
    #[must_use]
    pub fn netns_prefix(&self) -> String {
        format!("wsl-{}-", self.0)
    }

    /// The network namespace of `role`.
    #[must_use]
    pub fn netns(&self, role: &str) -> String {
        format!("{}{role}", self.netns_prefix())
    }

    /// True when `netns` belongs to this lab (prefix and a role this tool creates).
    #[must_use]
    pub fn owns_netns(&self, netns: &str) -> bool {
        netns
            .strip_prefix(&self.netns_prefix())
            .is_some_and(is_role)
    }

    /// The lab's directory.
    #[must_use]
    pub fn dir(&self) -> PathBuf {
        Path::new(LAB_ROOT).join(&self.0)
    }
}

impl std::fmt::Display for LabName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn is_role(role: &str) -> bool {
    role == "underlay"
        || role == "disco"
        || role
            .strip_prefix("node")
            .or_else(|| role.strip_prefix("router"))
            .is_some_and(|i| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()))
}

/// Underlay addresses of host number `host` (`.host` / `::host`): two IPv4 addresses
/// in separate /24s (so one can be blackholed) and one IPv6.
#[must_use]
pub fn underlay_addresses(host: u8) -> Vec<(IpAddr, u8)> {
    vec![
        (IpAddr::V4(Ipv4Addr::new(10, 99, 1, host)), 24),
        (IpAddr::V4(Ipv4Addr::new(10, 99, 2, host)), 24),
        (
            IpAddr::V6(Ipv6Addr::new(0xfd99, 0x1ab, 0, 0, 0, 0, 0, u16::from(host))),
            64,
        ),
    ]
}

/// Host number of the discovery server on the underlay.
pub const DISCOVERY_HOST: u8 = 2;

/// Host number of node `i` (from 1).
#[must_use]
pub fn node_host(i: usize) -> u8 {
    u8::try_from(10 + i).expect("at most MAX_NODES nodes")
}

/// The discovery server's gRPC address.
#[must_use]
pub fn discovery_address() -> SocketAddr {
    SocketAddr::new(underlay_addresses(DISCOVERY_HOST)[0].0, DISCOVERY_PORT)
}

/// The discovery server's metrics address.
#[must_use]
pub fn discovery_metrics_address() -> SocketAddr {
    SocketAddr::new(
        underlay_addresses(DISCOVERY_HOST)[0].0,
        DISCOVERY_METRICS_PORT,
    )
}

/// A node daemon's metrics address, inside the node's namespace.
#[must_use]
pub fn node_metrics_address() -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), NODE_METRICS_PORT)
}

/// Where every lab node serves the remote API (`--api-listen`): all addresses.
#[must_use]
pub fn node_api_address() -> SocketAddr {
    SocketAddr::new(
        IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        wirespan_control::api::client::DEFAULT_PORT,
    )
}

/// A lab's client config for `role` (`admin.yaml`, `reader.yaml` in the lab dir).
#[must_use]
pub fn client_config_path(dir: &Path, role: wirespan_control::api::pki::Role) -> PathBuf {
    dir.join(format!("{}.yaml", role.as_str()))
}

/// Generated cluster secrets; never printed.
pub struct ClusterSecrets {
    /// Cluster id (base64 of 32 random bytes).
    pub id: String,
    /// Cluster secret (base64 of 32 random bytes).
    pub secret: String,
    /// The cluster API CA (certificate and key, PEM): the nodes' `--api-listen`
    /// certificates and the lab's client configs come from it.
    pub api_ca: Option<(String, String)>,
}

/// The cluster config file shared by every node: ClusterConfig and one
/// DiscoveryServiceConfig.
#[must_use]
pub fn cluster_config(secrets: &ClusterSecrets, discovery_endpoint: &str) -> String {
    // Base64 never contains a quote: single-quoted scalars are exact.
    let mut s = String::new();
    let _ = write!(
        s,
        "apiVersion: {API_VERSION}\nkind: ClusterConfig\nid: '{}'\nsecret: '{}'\n---\n\
         apiVersion: {API_VERSION}\nkind: DiscoveryServiceConfig\nname: lab\nendpoint: {discovery_endpoint}\n",
        secrets.id, secrets.secret
    );
    if let Some((cert, key)) = &secrets.api_ca {
        // Inserted into the ClusterConfig document, before its `---`.
        let block = |t: &str| t.lines().map(|l| format!("  {l}\n")).collect::<String>();
        let at = s.find("---\n").unwrap_or(s.len());
        s.insert_str(
            at,
            &format!("apiCaCert: |\n{}apiCaKey: |\n{}", block(cert), block(key)),
        );
    }
    s
}

/// A node's config file: the cluster documents plus its KubeSpanConfig
/// (`peer_receive_timeout`: `None` keeps the default).
///
/// # Errors
/// The KubeSpanConfig could not be serialized.
pub fn node_config(
    cluster: &str,
    fast_path: FastPath,
    peer_receive_timeout: Option<std::time::Duration>,
) -> Result<String, serde_yaml_ng::Error> {
    let defaults = KubeSpanConfigDocument::default();
    let kubespan = KubeSpanConfigDocument {
        enabled: true,
        fast_path,
        peer_receive_timeout: peer_receive_timeout.unwrap_or(defaults.peer_receive_timeout),
        ..defaults
    };
    let body = serde_yaml_ng::to_string(&kubespan)?;
    Ok(format!(
        "{cluster}---\napiVersion: {API_VERSION}\nkind: KubeSpanConfig\n{body}"
    ))
}

/// Validates a generated config file as the node will read it.
///
/// # Errors
/// The config error (which never contains the secret).
pub fn validate(text: &str) -> Result<config::ConfigDocuments, config::ConfigError> {
    config::parse(text)
}

/// The lab as recorded in its state file (`state.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LabState {
    /// Lab name.
    pub name: String,
    /// Lab directory.
    pub dir: PathBuf,
    /// The cluster config file (ClusterConfig, DiscoveryServiceConfig).
    pub cluster_config: PathBuf,
    /// Marking implementation of the nodes.
    pub fast_path: String,
    /// WireGuard implementation asked of the nodes (`auto`, `kernel`, `userspace`,
    /// `userspace-go`;
    /// empty in labs made before the option: their daemons run `auto`).
    #[serde(default)]
    pub wireguard: String,
    /// The underlay's namespace (the bridge).
    pub underlay_namespace: String,
    /// The discovery server.
    pub discovery: DiscoveryState,
    /// The nodes.
    pub nodes: Vec<NodeState>,
    /// The topology's name (`flat` when empty: labs made before topologies).
    #[serde(default)]
    pub topology: String,
    /// Pairs of node names that exchange no UDP.
    #[serde(default)]
    pub blocked: Vec<[String; 2]>,
}

impl LabState {
    /// The lab's topology, for the reachability rule.
    #[must_use]
    pub fn topology(&self) -> Topology {
        let index = |n: &str| self.nodes.iter().position(|x| x.name == n);
        Topology {
            name: if self.topology.is_empty() {
                "flat".into()
            } else {
                self.topology.clone()
            },
            nodes: self.nodes.iter().map(|n| n.nat).collect(),
            blocked: self
                .blocked
                .iter()
                .filter_map(|[a, b]| {
                    let (a, b) = (index(a)?, index(b)?);
                    Some((a.min(b), a.max(b)))
                })
                .collect(),
        }
    }
}

/// The discovery server of a lab.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiscoveryState {
    /// Its network namespace.
    pub namespace: String,
    /// gRPC address.
    pub address: SocketAddr,
    /// Endpoint URL the nodes use.
    pub endpoint: String,
    /// Metrics and inspect pages.
    pub metrics_address: SocketAddr,
    /// Process id.
    pub pid: u32,
    /// Log file.
    pub log: PathBuf,
}

/// One node of a lab.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeState {
    /// Node name (also its hostname).
    pub name: String,
    /// Network namespace.
    pub namespace: String,
    /// Mount namespace file.
    pub mount_namespace: PathBuf,
    /// UTS namespace file.
    pub uts_namespace: PathBuf,
    /// The daemon's API socket.
    pub socket: PathBuf,
    /// The daemon's config file.
    pub config: PathBuf,
    /// The daemon's state directory.
    pub state_dir: PathBuf,
    /// The daemon's log.
    pub log: PathBuf,
    /// The daemon's process id.
    pub pid: u32,
    /// Underlay link inside the namespace.
    pub link: String,
    /// Underlay addresses (IPv4 first); behind NAT, its LAN address.
    pub underlay: Vec<IpAddr>,
    /// Where the node sits (`none`: on the underlay).
    #[serde(default)]
    pub nat: Nat,
    /// Its NAT router, when behind NAT.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router: Option<RouterState>,
}

impl NodeState {
    /// The addresses the rest of the lab sees it at: its own, or its router's WAN.
    #[must_use]
    pub fn public_addresses(&self) -> &[IpAddr] {
        self.router.as_ref().map_or(&self.underlay, |r| &r.wan)
    }
}

/// A node's NAT router.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RouterState {
    /// Its network namespace.
    pub namespace: String,
    /// WAN addresses (on the underlay).
    pub wan: Vec<IpAddr>,
    /// LAN address (the node's default gateway).
    pub lan: IpAddr,
}

/// Paths of node `name` inside `dir`.
#[must_use]
pub fn node_dir(dir: &Path, name: &str) -> PathBuf {
    dir.join(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lab_names_are_checked_and_prefixes_never_overlap() {
        assert!(LabName::parse("lab").is_ok());
        assert!(LabName::parse("t123x4").is_ok());
        for bad in ["", "Lab", "a-b", "a_b", "a.b", "abcdefghijklmnopq"] {
            assert!(LabName::parse(bad).is_err(), "{bad:?} accepted");
        }
        let a = LabName::parse("a").unwrap();
        assert_eq!(a.netns("node1"), "wsl-a-node1");
        assert!(a.owns_netns("wsl-a-node1"));
        assert!(a.owns_netns("wsl-a-node12"));
        assert!(a.owns_netns("wsl-a-underlay"));
        assert!(a.owns_netns("wsl-a-disco"));
        assert!(a.owns_netns("wsl-a-router3"));
        assert!(!a.owns_netns("wsl-a-router"));
        // Another lab, or something not made by the lab.
        assert!(!a.owns_netns("wsl-ab-node1"));
        assert!(!a.owns_netns("wsl-a-b-node1"));
        assert!(!a.owns_netns("wsl-a-node"));
        assert!(!a.owns_netns("wsl-a-nodex"));
        assert!(!a.owns_netns("wsl-a-shell"));
    }

    #[test]
    fn addresses_are_distinct_and_private() {
        let mut all = underlay_addresses(DISCOVERY_HOST);
        for i in 1..=MAX_NODES {
            all.extend(underlay_addresses(node_host(i)));
        }
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n);
        for (a, _) in &all {
            match a {
                IpAddr::V4(v4) => assert!(v4.is_private(), "{v4}"),
                IpAddr::V6(v6) => assert_eq!(v6.segments()[0] & 0xfe00, 0xfc00, "{v6}"),
            }
        }
        assert_eq!(discovery_address().to_string(), "10.99.1.2:3000");
    }

    #[test]
    fn generated_configs_validate_and_carry_the_choices() {
        let secrets = ClusterSecrets {
            id: "8XuV9TZHW08DOk3bVxQjH9ih+TBKjnh/j44tsCLSBzo=".into(),
            secret: "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=".into(),
            api_ca: None,
        };
        let cluster = cluster_config(&secrets, "http://10.99.1.2:3000");
        let c = validate(&cluster).unwrap();
        let cc = c.singleton::<config::cluster::ClusterConfig>().unwrap();
        assert_eq!(cc.id, secrets.id);
        assert_eq!(cc.secret.expose(), secrets.secret);
        let node = node_config(
            &cluster,
            FastPath::Ebpf,
            Some(std::time::Duration::from_secs(6)),
        )
        .unwrap();
        let n = validate(&node).unwrap();
        let ks = n.singleton::<KubeSpanConfigDocument>().unwrap();
        assert!(ks.enabled);
        assert_eq!(ks.fast_path, FastPath::Ebpf);
        assert_eq!(ks.peer_receive_timeout, std::time::Duration::from_secs(6));
        let ds: Vec<_> = n
            .documents_of::<config::cluster::DiscoveryServiceConfig>()
            .collect();
        assert_eq!(ds.len(), 1);
        assert_eq!(ds[0].endpoint, "http://10.99.1.2:3000");
    }
}
