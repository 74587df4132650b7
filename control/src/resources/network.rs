//! Network spec resources shared by every source (config, the mesh manager) and the
//! merged results (spec `resource-runtime.md` §4), and `NodeAddress` (§6).
//!
//! Raw specs live in `network-config` with ids `<layer>/<key>`; merged specs in
//! `network` with ids `<key>` (the `key()` of each spec). Status types and the
//! controllers live with the network controllers.

use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::runtime::{Definition, ResourceKind};

/// Namespace of raw per-source specs.
pub const NS_CONFIG: &str = "network-config";
/// Namespace of merged specs, statuses, node addresses and probes.
pub const NS: &str = "network";

/// Where a spec came from; higher layers win merges.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum ConfigLayer {
    /// Built-in defaults.
    #[default]
    Default,
    /// Kernel command line.
    Cmdline,
    /// Platform (cloud metadata).
    Platform,
    /// Operators (DHCP, VIP, the mesh manager).
    Operator,
    /// The machine config.
    Configuration,
}

impl ConfigLayer {
    /// The id prefix of raw specs of this layer.
    #[must_use]
    pub fn prefix(self) -> &'static str {
        match self {
            Self::Default => "default",
            Self::Cmdline => "cmdline",
            Self::Platform => "platform",
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

/// Address or route scope.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Global.
    #[default]
    Global,
    /// Site.
    Site,
    /// Link.
    Link,
    /// Host.
    Host,
}

macro_rules! network_kind {
    ($kind:ident, $spec:ty, $ty:literal, $display:literal, $ns:expr, [$($col:literal => $path:literal),*]) => {
        #[doc = concat!("`", $display, "` resources.")]
        #[derive(Debug)]
        pub struct $kind;

        impl ResourceKind for $kind {
            const TYPE: &'static str = $ty;
            const DEFAULT_NAMESPACE: &'static str = $ns;
            type Spec = $spec;
            fn definition() -> Definition {
                Definition::new(Self::TYPE, $display, Self::DEFAULT_NAMESPACE)
                    $(.column($col, $path))*
            }
        }
    };
}

network_kind!(LinkSpec, LinkSpecSpec, "LinkSpecs.net.wirespan.dev", "LinkSpec", NS,
    ["Name" => ".name", "Up" => ".up", "MTU" => ".mtu", "Layer" => ".layer"]);
network_kind!(AddressSpec, AddressSpecSpec, "AddressSpecs.net.wirespan.dev", "AddressSpec", NS,
    ["Address" => ".address", "Link" => ".linkName", "Layer" => ".layer"]);
network_kind!(RouteSpec, RouteSpecSpec, "RouteSpecs.net.wirespan.dev", "RouteSpec", NS,
    ["Destination" => ".destination", "Gateway" => ".gateway", "Link" => ".outLinkName", "Table" => ".table", "Layer" => ".layer"]);
network_kind!(RoutingRuleSpec, RoutingRuleSpecSpec, "RoutingRuleSpecs.net.wirespan.dev", "RoutingRuleSpec", NS,
    ["Priority" => ".priority", "FwMark" => ".fwMark", "Table" => ".table", "Layer" => ".layer"]);
network_kind!(HostnameStatus, HostnameStatusSpec, "HostnameStatuses.net.wirespan.dev", "HostnameStatus", NS,
    ["Hostname" => ".hostname", "Domainname" => ".domainname"]);
network_kind!(NodeAddress, NodeAddressSpec, "NodeAddresses.net.wirespan.dev", "NodeAddress", NS,
    ["Addresses" => ".addresses"]);

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
        match self.address {
            Some(a) => format!("{}/{a}", self.link_name),
            None => format!("{}/", self.link_name),
        }
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

/// Main routing table.
pub const TABLE_MAIN: u32 = 254;

impl RouteSpecSpec {
    /// Merge key (spec §4.2): `[<table>/ unless main][<link>/ if inet6]<family>/<gateway>/<destination>/<priority>`.
    #[must_use]
    pub fn key(&self) -> String {
        let mut k = String::new();
        if self.table != TABLE_MAIN && self.table != 0 {
            k.push_str(&format!("{}/", self.table));
        }
        if self.family == Family::Inet6 {
            k.push_str(&format!("{}/", self.out_link_name));
        }
        let gw = self.gateway.map(|g| g.to_string()).unwrap_or_default();
        let dst = self.destination.map(|d| d.to_string()).unwrap_or_default();
        k.push_str(&format!("{}/{gw}/{dst}/{}", self.family, self.priority));
        k
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
        format!("{}/{:05}", self.family, self.priority)
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

/// A sorted list of the node's addresses (spec §6).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeAddressSpec {
    /// The addresses with their prefix lengths.
    pub addresses: Vec<IpNet>,
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
    }
}
