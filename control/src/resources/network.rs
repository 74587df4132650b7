//! Network spec resources shared by every source (config, the mesh manager) and the
//! merged results (`docs/runtime.md` §4), and `NodeAddress` (§6).
//!
//! Raw specs live in `network-config` with ids `<layer>/<key>`; merged specs in
//! `network` with ids `<key>` (the `key()` of each spec). Status types and the
//! controllers live with the network controllers.

use std::{net::IpAddr, time::Duration};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

pub use crate::config::probe::strip_userinfo;
use crate::runtime::{Definition, ResourceKind};

/// Namespace of raw per-source specs.
pub const NS_CONFIG: &str = "network-config";
/// Namespace of merged specs, statuses, node addresses and probes.
pub const NS: &str = "network";

/// Where a spec came from; higher layers win merges. Only the layers something
/// produces exist (`docs/runtime.md` §4.2 says why there is no `default`, `cmdline` or
/// `platform` layer).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum ConfigLayer {
    /// Operators: the mesh manager.
    Operator,
    /// The machine config (the default: a spec built without a layer is the user's,
    /// and its kernel objects carry the config's marker).
    #[default]
    Configuration,
}

impl ConfigLayer {
    /// The id prefix of raw specs of this layer.
    #[must_use]
    pub fn prefix(self) -> &'static str {
        match self {
            Self::Operator => "operator",
            Self::Configuration => "configuration",
        }
    }
}

/// Address family.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// IPv4.
    #[default]
    Inet4,
    /// IPv6.
    Inet6,
}

impl Family {
    /// Family of an address.
    #[must_use]
    pub fn of(ip: IpAddr) -> Self {
        if ip.is_ipv4() {
            Self::Inet4
        } else {
            Self::Inet6
        }
    }
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Inet4 => "inet4",
            Self::Inet6 => "inet6",
        })
    }
}

/// Address or route scope: one type from config document to kernel.
pub use crate::config::network::Scope;

macro_rules! network_kind {
    ($kind:ident, $spec:ty, $ty:literal, $display:literal, $ns:expr, [$($col:literal => $path:literal),*]) => {
        network_kind!($kind, $spec, $ty, $display, $ns, [$($col => $path),*], aliases []);
    };
    ($kind:ident, $spec:ty, $ty:literal, $display:literal, $ns:expr, [$($col:literal => $path:literal),*], aliases [$($alias:literal),*]) => {
        #[doc = concat!("`", $display, "` resources.")]
        #[derive(Debug)]
        pub struct $kind;

        impl ResourceKind for $kind {
            const TYPE: &'static str = $ty;
            const DEFAULT_NAMESPACE: &'static str = $ns;
            type Spec = $spec;
            fn definition() -> Definition {
                Definition::new(Self::TYPE, $display, Self::DEFAULT_NAMESPACE)
                    $(.alias($alias))*
                    $(.column($col, $path))*
            }
        }
    };
}

network_kind!(LinkSpec, LinkSpecSpec, "LinkSpecs.net.wirespan.dev", "LinkSpec", NS,
    ["Name" => ".name", "Logical" => ".logical", "Up" => ".up", "MTU" => ".mtu", "Layer" => ".layer", "Error" => ".metadata.annotations.error"],
    aliases ["linkspecs"]);
network_kind!(AddressSpec, AddressSpecSpec, "AddressSpecs.net.wirespan.dev", "AddressSpec", NS,
    ["Address" => ".address", "Link" => ".linkName", "Scope" => ".scope", "Layer" => ".layer", "Error" => ".metadata.annotations.error"],
    aliases ["addressspecs"]);
network_kind!(RouteSpec, RouteSpecSpec, "RouteSpecs.net.wirespan.dev", "RouteSpec", NS,
    ["Destination" => ".destination", "Gateway" => ".gateway", "Link" => ".outLinkName", "Table" => ".table", "Metric" => ".priority", "Layer" => ".layer", "Error" => ".metadata.annotations.error"],
    aliases ["routespecs"]);
network_kind!(RoutingRuleSpec, RoutingRuleSpecSpec, "RoutingRuleSpecs.net.wirespan.dev", "RoutingRuleSpec", NS,
    ["Priority" => ".priority", "Src" => ".src", "Dst" => ".dst", "FwMark" => ".fwMark", "Table" => ".table", "Layer" => ".layer", "Error" => ".metadata.annotations.error"],
    aliases ["routingrulespecs"]);
network_kind!(HostnameStatus, HostnameStatusSpec, "HostnameStatuses.net.wirespan.dev", "HostnameStatus", NS,
    ["Hostname" => ".hostname", "Domainname" => ".domainname"],
    aliases ["hostname"]);
network_kind!(ResolverStatus, ResolverStatusSpec, "ResolverStatuses.net.wirespan.dev", "ResolverStatus", NS,
    ["Servers" => ".dnsServers", "Search" => ".searchDomains"],
    aliases ["resolvers"]);
network_kind!(HostnameSpec, HostnameSpecSpec, "HostnameSpecs.net.wirespan.dev", "HostnameSpec", NS,
    ["Hostname" => ".hostname", "Domainname" => ".domainname", "EtcHostname" => ".writeEtcHostname", "Layer" => ".layer", "Error" => ".metadata.annotations.error"],
    aliases ["hostnamespecs"]);
network_kind!(ResolverSpec, ResolverSpecSpec, "ResolverSpecs.net.wirespan.dev", "ResolverSpec", NS,
    ["Servers" => ".dnsServers", "Search" => ".searchDomains", "Layer" => ".layer", "Error" => ".metadata.annotations.error"],
    aliases ["resolverspecs"]);
network_kind!(TimeServerSpec, TimeServerSpecSpec, "TimeServerSpecs.net.wirespan.dev", "TimeServerSpec", NS,
    ["Servers" => ".ntpServers", "Layer" => ".layer", "Error" => ".metadata.annotations.error"],
    aliases ["timeserverspecs"]);
network_kind!(TimeServerStatus, TimeServerStatusSpec, "TimeServerStatuses.net.wirespan.dev", "TimeServerStatus", NS,
    ["Servers" => ".ntpServers", "Service" => ".service"],
    aliases ["timeservers", "timeserverstatuses"]);
network_kind!(NodeAddress, NodeAddressSpec, "NodeAddresses.net.wirespan.dev", "NodeAddress", NS,
    ["Addresses" => ".addresses"],
    aliases ["nodeaddresses"]);
network_kind!(NodeAddressFilter, NodeAddressFilterSpec, "NodeAddressFilters.net.wirespan.dev", "NodeAddressFilter", NS,
    ["Include" => ".includeSubnets", "Exclude" => ".excludeSubnets"],
    aliases ["nodeaddressfilters"]);
network_kind!(LinkStatus, LinkStatusSpec, "LinkStatuses.net.wirespan.dev", "LinkStatus", NS,
    ["Index" => ".index", "Kind" => ".kind", "Up" => ".up", "Oper" => ".operState", "MTU" => ".mtu"],
    aliases ["links", "link", "linkstatuses"]);
network_kind!(AddressStatus, AddressStatusSpec, "AddressStatuses.net.wirespan.dev", "AddressStatus", NS,
    ["Address" => ".address", "Link" => ".linkName", "Scope" => ".scope"],
    aliases ["addresses", "address", "addressstatuses"]);
network_kind!(RouteStatus, RouteStatusSpec, "RouteStatuses.net.wirespan.dev", "RouteStatus", NS,
    ["Destination" => ".destination", "Gateway" => ".gateway", "Link" => ".outLinkName", "Table" => ".table", "Metric" => ".priority"],
    aliases ["routes", "route", "routestatuses"]);
network_kind!(RoutingRuleStatus, RoutingRuleStatusSpec, "RoutingRuleStatuses.net.wirespan.dev", "RoutingRuleStatus", NS,
    ["Priority" => ".priority", "Src" => ".src", "Dst" => ".dst", "FwMark" => ".fwMark", "Table" => ".table"],
    aliases ["routingrules", "routingrule", "rules", "routingrulestatuses"]);
network_kind!(ProbeSpec, ProbeSpecSpec, "ProbeSpecs.net.wirespan.dev", "ProbeSpec", NS,
    ["Interval" => ".interval", "Threshold" => ".failureThreshold", "TCP" => ".tcp.endpoint", "HTTP" => ".http.url", "Layer" => ".layer"],
    aliases ["probespecs"]);
network_kind!(NetworkStatus, NetworkStatusSpec, "NetworkStatuses.net.wirespan.dev", "NetworkStatus", NS,
    ["Address" => ".addressReady", "Connectivity" => ".connectivityReady", "Hostname" => ".hostnameReady", "Mesh" => ".meshReady", "Peers Up" => ".peersUp", "Peers" => ".peers"],
    aliases ["netstatus"]);
network_kind!(ProbeStatus, ProbeStatusSpec, "ProbeStatuses.net.wirespan.dev", "ProbeStatus", NS,
    ["Success" => ".success", "LastError" => ".lastError"],
    aliases ["probestatuses", "probes"]);

/// A link to configure. Field-wise merge: a higher layer overrides only non-zero
/// fields. Logical links (kind set) are created and deleted; physical ones (and links
/// another adapter creates, like the WireGuard link) are only configured.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LinkSpecSpec {
    /// Interface name.
    pub name: String,
    /// Created and deleted by wirespan (`kind` says what to create).
    pub logical: bool,
    /// Administratively up.
    pub up: bool,
    /// MTU; 0 = leave alone.
    pub mtu: u32,
    /// Link kind for logical links (`dummy`, …); empty for physical links.
    pub kind: String,
    /// Source layer.
    pub layer: ConfigLayer,
}

impl LinkSpecSpec {
    /// Merge key: the link name.
    #[must_use]
    pub fn key(&self) -> String {
        self.name.clone()
    }
}

/// An address on a link.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AddressSpecSpec {
    /// Address with prefix length (`10.0.0.1/24`).
    pub address: Option<IpNet>,
    /// Link.
    pub link_name: String,
    /// Scope.
    pub scope: Scope,
    /// Source layer.
    pub layer: ConfigLayer,
}

impl AddressSpecSpec {
    /// Merge key `<link>/<prefix>`.
    #[must_use]
    pub fn key(&self) -> String {
        crate::config::network::address_key(&self.link_name, self.address)
    }
}

/// Route type.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RouteType {
    /// Forward via a gateway or link.
    #[default]
    Unicast,
    /// Silently drop.
    Blackhole,
    /// Reject with unreachable.
    Unreachable,
    /// Reject with prohibited.
    Prohibit,
}

/// A route.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RouteSpecSpec {
    /// Family.
    pub family: Family,
    /// Destination; `None` = default route.
    pub destination: Option<IpNet>,
    /// Preferred source address.
    pub source: Option<IpAddr>,
    /// Gateway.
    pub gateway: Option<IpAddr>,
    /// Outgoing link.
    pub out_link_name: String,
    /// Table (254 = main).
    pub table: u32,
    /// Metric.
    pub priority: u32,
    /// Scope.
    pub scope: Scope,
    /// Type.
    pub r#type: RouteType,
    /// Route MTU; 0 = none.
    pub mtu: u32,
    /// Source layer.
    pub layer: ConfigLayer,
}

pub use crate::config::network::TABLE_MAIN;

impl RouteSpecSpec {
    /// Merge key (`docs/runtime.md` §4.2): `[<table>/ unless main][<link>/ if inet6]<family>/<gateway>/<destination>/<priority>`.
    #[must_use]
    pub fn key(&self) -> String {
        crate::config::network::route_key(
            self.table,
            self.family == Family::Inet6,
            &self.out_link_name,
            self.gateway,
            self.destination,
            self.priority,
        )
    }
}

/// A policy routing rule (`from SRC to DST fwmark M/MASK lookup TABLE`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RoutingRuleSpecSpec {
    /// Family.
    pub family: Family,
    /// Source match.
    pub src: Option<IpNet>,
    /// Destination match.
    pub dst: Option<IpNet>,
    /// Table to look up.
    pub table: u32,
    /// Priority (unique per family).
    pub priority: u32,
    /// Firewall mark to match (0 = any).
    pub fw_mark: u32,
    /// Mask of the mark.
    pub fw_mask: u32,
    /// Source layer.
    pub layer: ConfigLayer,
}

impl RoutingRuleSpecSpec {
    /// Merge key `<family>/<priority as 5 digits>`.
    #[must_use]
    pub fn key(&self) -> String {
        crate::config::network::rule_key(self.family == Family::Inet6, self.priority)
    }
}

/// Id of the one hostname status.
pub const HOSTNAME: &str = "hostname";

/// The node's hostname as the kernel has it (`network/HostnameStatus hostname`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HostnameStatusSpec {
    /// Short host name.
    pub hostname: String,
    /// Domain name (may be empty).
    pub domainname: String,
}

impl HostnameStatusSpec {
    /// `hostname.domainname`, or the hostname alone.
    #[must_use]
    pub fn fqdn(&self) -> String {
        if self.domainname.is_empty() {
            self.hostname.clone()
        } else {
            format!("{}.{}", self.hostname, self.domainname)
        }
    }
}

/// Id of the one hostname spec.
pub const HOSTNAME_SPEC: &str = HOSTNAME;

/// The host name a document asks for (`network/HostnameSpec hostname`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HostnameSpecSpec {
    /// Short host name, set with `sethostname` in the node's UTS namespace.
    pub hostname: String,
    /// Domain name, set with `setdomainname` (may be empty).
    pub domainname: String,
    /// Also write `/etc/hostname` (the node manages the host).
    pub write_etc_hostname: bool,
    /// Source layer.
    pub layer: ConfigLayer,
}

impl HostnameSpecSpec {
    /// Merge key: there is one host name.
    #[must_use]
    pub fn key(&self) -> String {
        HOSTNAME.into()
    }
}

/// The resolvers a document asks for (`network/ResolverSpec resolvers`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResolverSpecSpec {
    /// Name servers in order.
    pub dns_servers: Vec<IpAddr>,
    /// Search domains in order.
    pub search_domains: Vec<String>,
    /// Source layer.
    pub layer: ConfigLayer,
}

impl ResolverSpecSpec {
    /// Merge key: there is one resolver list.
    #[must_use]
    pub fn key(&self) -> String {
        RESOLVERS.into()
    }
}

/// Id of the one time server spec and status.
pub const TIME_SERVERS: &str = "timeservers";

/// The time servers a document asks for (`network/TimeServerSpec timeservers`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TimeServerSpecSpec {
    /// NTP servers (names or addresses) in order.
    pub ntp_servers: Vec<String>,
    /// Source layer.
    pub layer: ConfigLayer,
}

impl TimeServerSpecSpec {
    /// Merge key: there is one time server list.
    #[must_use]
    pub fn key(&self) -> String {
        TIME_SERVERS.into()
    }
}

/// The time servers the host's time service is configured with, read back from its
/// configuration files (`network/TimeServerStatus timeservers`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TimeServerStatusSpec {
    /// Servers in force, in order.
    pub ntp_servers: Vec<String>,
    /// The time service they were read from (`chrony` or `systemd-timesyncd`).
    pub service: String,
}

/// Well-known `NodeAddress` ids.
pub mod node_address {
    /// The first kernel address (sticky).
    pub const DEFAULT: &str = "default";
    /// Addresses on up links plus external ones.
    pub const CURRENT: &str = "current";
    /// Addresses on up links, without external ones.
    pub const ROUTED: &str = "routed";
    /// Every address ever seen.
    pub const ACCUMULATIVE: &str = "accumulative";
}

/// A sorted list of the node's addresses (`docs/kubespan.md` §6).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeAddressSpec {
    /// The addresses with their prefix lengths.
    pub addresses: Vec<IpNet>,
}

/// Id of the one resolver status.
pub const RESOLVERS: &str = "resolvers";

/// The resolvers the node uses (`network/ResolverStatus resolvers`, from
/// `/etc/resolv.conf`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResolverStatusSpec {
    /// Name servers in file order.
    pub dns_servers: Vec<IpAddr>,
    /// Search domains in file order.
    pub search_domains: Vec<String>,
}

/// Which addresses a filtered `NodeAddress` keeps (`routed-<id>`, `current-<id>`,
/// `accumulative-<id>`): in some include subnet (when there are includes) and in no
/// exclude subnet.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeAddressFilterSpec {
    /// Keep only addresses inside one of these (empty = all).
    pub include_subnets: Vec<IpNet>,
    /// Drop addresses inside any of these.
    pub exclude_subnets: Vec<IpNet>,
}

impl NodeAddressFilterSpec {
    /// Whether the filter keeps `addr`.
    #[must_use]
    pub fn keeps(&self, addr: &IpNet) -> bool {
        let ip = addr.addr();
        (self.include_subnets.is_empty() || self.include_subnets.iter().any(|n| n.contains(&ip)))
            && !self.exclude_subnets.iter().any(|n| n.contains(&ip))
    }
}

/// A link as the kernel has it (`network/LinkStatus <name>`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LinkStatusSpec {
    /// Interface name.
    pub name: String,
    /// ifindex.
    pub index: u32,
    /// Link kind (`dummy`, `wireguard`, …; empty for physical links).
    pub kind: String,
    /// Hardware type (`ether`, `loopback`, `none`, …).
    pub r#type: String,
    /// Administratively up.
    pub up: bool,
    /// Operational state (`up`, `down`, `unknown`, …).
    pub oper_state: String,
    /// Carrier present.
    pub carrier: bool,
    /// MTU.
    pub mtu: u32,
    /// Hardware address (`aa:bb:…`), empty when none.
    pub hardware_addr: String,
    /// Permanent hardware address, empty when the driver reports none.
    pub perm_hardware_addr: String,
    /// Interface flags as `ip link` names them (`UP`, `BROADCAST`, `LOWER_UP`, …).
    pub flags: Vec<String>,
    /// ifindex of the master (bridge, bond, VRF); 0 when none.
    pub master_index: u32,
    /// Queueing discipline (`noqueue`, `fq_codel`, …), empty when none.
    pub qdisc: String,
    /// Driver as ethtool reports it (`veth`, `bridge`, `e1000e`, …), empty when not
    /// reported.
    pub driver: String,
    /// Link speed in Mb/s (ethtool); 0 when unknown.
    pub speed_mbps: u32,
    /// Duplex (ethtool): `full`, `half`, or empty when unknown.
    pub duplex: String,
    /// Physical (no link kind and not loopback).
    pub physical: bool,
}

impl LinkStatusSpec {
    /// Spec §6 step 1: oper state up or unknown, and carrier present on physical links.
    #[must_use]
    pub fn is_up(&self) -> bool {
        matches!(self.oper_state.as_str(), "up" | "unknown") && (!self.physical || self.carrier)
    }
}

/// An address as the kernel has it (`network/AddressStatus <link>/<prefix>`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AddressStatusSpec {
    /// Address with prefix length.
    pub address: Option<IpNet>,
    /// Link name.
    pub link_name: String,
    /// ifindex of the link.
    pub link_index: u32,
    /// Family.
    pub family: Family,
    /// Scope.
    pub scope: Scope,
    /// The local address as `ip addr` shows it (`IFA_LOCAL`, or `IFA_ADDRESS` for
    /// IPv6). `address` is the same address with its prefix length (the key of the
    /// whole model); a point-to-point peer is not kept.
    pub local: Option<IpAddr>,
    /// Broadcast address (IPv4).
    pub broadcast: Option<IpAddr>,
    /// Address flags as `ip addr` names them (`permanent`, `noprefixroute`,
    /// `secondary`/`temporary`, …).
    pub flags: Vec<String>,
}

/// A route as the kernel has it (`network/RouteStatus <route key>`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RouteStatusSpec {
    /// Family.
    pub family: Family,
    /// Destination; `None` = default route.
    pub destination: Option<IpNet>,
    /// Preferred source.
    pub source: Option<IpAddr>,
    /// Gateway.
    pub gateway: Option<IpAddr>,
    /// Outgoing link.
    pub out_link_name: String,
    /// Table.
    pub table: u32,
    /// Metric.
    pub priority: u32,
    /// Scope.
    pub scope: Scope,
    /// Type.
    pub r#type: RouteType,
    /// Route protocol number (211 = wirespan).
    pub protocol: u8,
}

/// A routing rule as the kernel has it (`network/RoutingRuleStatus <family>/<priority>`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RoutingRuleStatusSpec {
    /// Family.
    pub family: Family,
    /// Source match.
    pub src: Option<IpNet>,
    /// Destination match.
    pub dst: Option<IpNet>,
    /// Table looked up.
    pub table: u32,
    /// Priority.
    pub priority: u32,
    /// Firewall mark.
    pub fw_mark: u32,
    /// Mark mask.
    pub fw_mask: u32,
    /// Route protocol number (211 = wirespan).
    pub protocol: u8,
}

/// A TCP probe: connect to `endpoint` within `timeout`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TcpProbeSpec {
    /// `host:port`.
    pub endpoint: String,
    /// Connect timeout.
    #[serde(with = "crate::config::duration")]
    pub timeout: Duration,
}

/// An HTTP probe: GET `url` within `timeout`; 200–399 is success.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpProbeSpec {
    /// `http://…` or `https://…`, with credentials if the probe needs them; they are
    /// serialized (the resource API, `get probespecs`) as `<redacted>`, the prober uses
    /// the value itself.
    #[serde(serialize_with = "serialize_redacted_url")]
    pub url: String,
    /// Timeout of the whole request up to the status line.
    #[serde(with = "crate::config::duration")]
    pub timeout: Duration,
}

/// A connectivity probe (exactly one of `tcp` and `http` is set).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProbeSpecSpec {
    /// Time between probes.
    #[serde(with = "crate::config::duration")]
    pub interval: Duration,
    /// Consecutive failures before a failure is reported (0 and 1: the first).
    pub failure_threshold: u32,
    /// TCP probe.
    pub tcp: Option<TcpProbeSpec>,
    /// HTTP probe.
    pub http: Option<HttpProbeSpec>,
    /// Source layer.
    pub layer: ConfigLayer,
}

impl ProbeSpecSpec {
    /// Merge key (`docs/runtime.md` §4.2): `tcp:<endpoint>` or `http:<url without userinfo>`.
    #[must_use]
    pub fn key(&self) -> String {
        if let Some(t) = &self.tcp {
            crate::config::probe::tcp_probe_key(&t.endpoint)
        } else if let Some(h) = &self.http {
            crate::config::probe::http_probe_key(&h.url)
        } else {
            String::new()
        }
    }
}

/// `scheme://user:pass@host/…` as `scheme://<redacted>@host/…`; URLs without
/// credentials unchanged.
#[must_use]
pub fn redact_userinfo(url: &str) -> String {
    let stripped = strip_userinfo(url);
    if stripped == url {
        return stripped;
    }
    match stripped.split_once("://") {
        Some((scheme, rest)) => format!("{scheme}://{}@{rest}", crate::secret::REDACTED),
        None => stripped,
    }
}

fn serialize_redacted_url<S: serde::Serializer>(url: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&redact_userinfo(url))
}

/// Id of the one network status.
pub const NETWORK_STATUS: &str = "status";

/// How ready the node's network is (`network/NetworkStatus status`; Talos's
/// `network.Status` without `etcFilesReady`, plus the mesh).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkStatusSpec {
    /// The node has at least one current address.
    pub address_ready: bool,
    /// Every probe succeeds; with no probe, a default route exists in the main table.
    pub connectivity_ready: bool,
    /// The hostname is known.
    pub hostname_ready: bool,
    /// The mesh is enabled in the config.
    pub mesh_enabled: bool,
    /// The mesh is enabled, its link is programmed and every peer is up.
    pub mesh_ready: bool,
    /// Mesh peers.
    pub peers: usize,
    /// Mesh peers that are up.
    pub peers_up: usize,
}

/// A probe's result (`network/ProbeStatus <probe id>`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProbeStatusSpec {
    /// The last reported outcome.
    pub success: bool,
    /// Error of the last reported failure (empty on success).
    pub last_error: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_keys_follow_the_spec() {
        let r = RouteSpecSpec {
            family: Family::Inet6,
            out_link_name: "kubespan".into(),
            table: 180,
            priority: 1,
            ..RouteSpecSpec::default()
        };
        assert_eq!(r.key(), "180/kubespan/inet6///1");
        let r = RouteSpecSpec {
            destination: Some("10.0.0.0/8".parse().unwrap()),
            gateway: Some("10.0.0.1".parse().unwrap()),
            table: TABLE_MAIN,
            priority: 1024,
            ..RouteSpecSpec::default()
        };
        assert_eq!(r.key(), "inet4/10.0.0.1/10.0.0.0/8/1024");
        let rule = RoutingRuleSpecSpec {
            priority: 32500,
            ..RoutingRuleSpecSpec::default()
        };
        assert_eq!(rule.key(), "inet4/32500");
        let a = AddressSpecSpec {
            address: Some("fd00::1/64".parse().unwrap()),
            link_name: "kubespan".into(),
            ..AddressSpecSpec::default()
        };
        assert_eq!(a.key(), "kubespan/fd00::1/64");
        assert!(ConfigLayer::Configuration > ConfigLayer::Operator);
        let p = ProbeSpecSpec {
            http: Some(HttpProbeSpec {
                url: "https://user:pw@example.com:8443/health?x=1".into(),
                timeout: Duration::from_secs(1),
            }),
            ..ProbeSpecSpec::default()
        };
        assert_eq!(p.key(), "http:https://example.com:8443/health?x=1");
        // Shown without the credentials; the spec itself keeps them for the prober.
        let shown = serde_json::to_value(&p).unwrap();
        assert_eq!(
            shown["http"]["url"],
            "https://<redacted>@example.com:8443/health?x=1"
        );
        assert!(!shown.to_string().contains("pw"), "{shown}");
        assert_eq!(
            p.http.as_ref().unwrap().url,
            "https://user:pw@example.com:8443/health?x=1"
        );
        assert_eq!(redact_userinfo("http://a/b@c"), "http://a/b@c");
        let p = ProbeSpecSpec {
            tcp: Some(TcpProbeSpec {
                endpoint: "10.0.0.1:22".into(),
                timeout: Duration::from_secs(1),
            }),
            ..ProbeSpecSpec::default()
        };
        assert_eq!(p.key(), "tcp:10.0.0.1:22");
    }
}
