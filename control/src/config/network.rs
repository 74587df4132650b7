//! Network documents: `LinkConfig`, `AddressConfig`, `RouteConfig`,
//! `RoutingRuleConfig` (minimal). The config controller turns them into
//! `network-config/*Spec configuration/<key>`.
//!
//! ```yaml
//! apiVersion: v1alpha1
//! kind: LinkConfig
//! name: dummy0          # the link
//! linkKind: dummy       # create a logical link of this kind (dummy or bridge)
//! up: true              # default true
//! mtu: 1400             # optional
//! ---
//! apiVersion: v1alpha1
//! kind: AddressConfig
//! link: dummy0
//! address: 10.9.0.1/24
//! ---
//! apiVersion: v1alpha1
//! kind: RouteConfig
//! destination: 10.10.0.0/16   # omitted: default route
//! gateway: 10.9.0.254
//! link: dummy0
//! table: 254                  # default main
//! metric: 1024
//! ---
//! apiVersion: v1alpha1
//! kind: RoutingRuleConfig
//! priority: 1000
//! table: 100
//! src: 10.9.0.0/24
//! ```
//!
//! Validation rejects what the kernel would silently rewrite: a route destination or
//! rule selector with host bits set (the kernel stores the network address), and two
//! documents that map to the same spec key (see [`super::ConfigDocument::merge_key`]).

use std::net::IpAddr;

use ipnet::IpNet;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{ConfigDocument, FieldError};

fn check_ifname(field: &str, name: &str, errs: &mut Vec<FieldError>) {
    if name.is_empty() {
        errs.push(FieldError::new(field, "is required"));
    } else if name.len() > 15 || name.contains(['/', ' ', ':']) || name == "." || name == ".." {
        errs.push(FieldError::new(
            field,
            format!(
                "{name:?} is not a valid interface name (at most 15 bytes, no '/', ':' or space)"
            ),
        ));
    }
}

/// A prefix used as a selector (route destination, rule `src`/`dst`) must be its
/// network address: the kernel would store `10.0.0.0/8` for `10.0.0.1/8` and the spec
/// would never match what it reads back.
fn check_network(field: &str, net: Option<IpNet>, errs: &mut Vec<FieldError>) {
    if let Some(n) = net {
        if n.trunc() != n {
            errs.push(FieldError::new(
                field,
                format!(
                    "{n} has host bits set; the kernel would use {}: write {field}: {}",
                    n.trunc(),
                    n.trunc()
                ),
            ));
        }
    }
}

fn check_mtu(mtu: Option<u32>, errs: &mut Vec<FieldError>) {
    if let Some(m) = mtu {
        if !(68..=65535).contains(&m) {
            errs.push(FieldError::new("mtu", format!("{m} is outside 68..=65535")));
        }
    }
}

/// A link to configure (an existing one) or create (`linkKind`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LinkConfig {
    /// Interface name (also the document's name).
    ///
    /// Valid: 1–15 bytes, not `.` or `..`, no `/`, `:` or space.
    pub name: String,
    /// Kind of logical link to create. Unset: the link exists already (physical, or
    /// made by someone else) and is only configured.
    ///
    /// Valid: `dummy` or `bridge`.
    #[serde(default)]
    pub link_kind: Option<String>,
    /// Administratively up.
    #[serde(default)]
    #[schemars(extend("default" = true))]
    pub up: Option<bool>,
    /// MTU. Unset: left as it is.
    ///
    /// Valid: 68–65535.
    #[serde(default)]
    pub mtu: Option<u32>,
}

impl ConfigDocument for LinkConfig {
    const KIND: &'static str = "LinkConfig";
    const SINGLETON: bool = false;
    fn name(&self) -> Option<&str> {
        Some(&self.name)
    }
    fn validate(&self) -> Vec<FieldError> {
        let mut errs = Vec::new();
        check_ifname("name", &self.name, &mut errs);
        check_mtu(self.mtu, &mut errs);
        if let Some(k) = &self.link_kind {
            if k != "dummy" && k != "bridge" {
                errs.push(FieldError::new(
                    "linkKind",
                    format!("{k:?} is not supported (only \"dummy\" and \"bridge\")"),
                ));
            }
        }
        errs
    }
}

// One type from config document to kernel: `resources::network::Scope` is this type,
// and `controllers::network::scope_number` its one mapping to `RT_SCOPE_*`.
/// Address scope in config documents.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Valid everywhere.
    #[default]
    Global,
    /// Valid within the site (IPv6).
    Site,
    /// Valid on this link only.
    Link,
    /// Valid on this host only.
    Host,
}

/// An address on a link.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AddressConfig {
    /// Link the address goes on.
    ///
    /// Valid: an interface name (1–15 bytes, not `.` or `..`, no `/`, `:` or space).
    pub link: String,
    /// Address with prefix length (`10.9.0.1/24`).
    ///
    /// Valid: a unicast address (not unspecified, not multicast).
    #[schemars(with = "super::schema::Cidr", required)]
    pub address: Option<IpNet>,
    /// Address scope.
    #[serde(default)]
    pub scope: Scope,
}

impl ConfigDocument for AddressConfig {
    const KIND: &'static str = "AddressConfig";
    const SINGLETON: bool = false;
    fn merge_key(&self) -> Option<(&'static str, String)> {
        // The key the network config controller writes the spec under.
        Some(("link and address", address_key(&self.link, self.address)))
    }
    fn validate(&self) -> Vec<FieldError> {
        let mut errs = Vec::new();
        check_ifname("link", &self.link, &mut errs);
        match self.address {
            None => errs.push(FieldError::new("address", "is required")),
            Some(a) if a.addr().is_unspecified() || a.addr().is_multicast() => errs.push(
                FieldError::new("address", format!("{a} is not a unicast address")),
            ),
            Some(_) => {}
        }
        errs
    }
}

/// A route. It needs a `link` or a `gateway`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RouteConfig {
    /// Destination. Unset: a default route (IPv6 if the gateway is, else IPv4).
    ///
    /// Valid: a network address (no host bits set: `10.10.0.0/16`, not
    /// `10.10.0.1/16`).
    #[serde(default)]
    #[schemars(with = "Option<super::schema::Cidr>")]
    pub destination: Option<IpNet>,
    /// Gateway.
    ///
    /// Valid: of the destination's family.
    #[serde(default)]
    pub gateway: Option<IpAddr>,
    /// Preferred source address.
    ///
    /// Valid: of the destination's family.
    #[serde(default)]
    pub source: Option<IpAddr>,
    /// Outgoing link.
    ///
    /// Valid: an interface name when set; required when there is no `gateway`.
    // The YAML key stays `link` (like `AddressConfig.link`); the field has the name it
    // keeps in `RouteSpec`, `RouteStatus` and the kernel adapter (`docs/runtime.md` §4.6).
    #[serde(default, rename = "link")]
    pub out_link_name: String,
    /// Routing table.
    ///
    /// Valid: not 0 or 255, and not the mesh's table (`KubeSpanConfig.routingTable`,
    /// 180 by default).
    #[serde(default)]
    #[schemars(extend("default" = 254))]
    pub table: Option<u32>,
    /// Metric (priority).
    // The YAML key stays `metric` (Talos' machine config and `ip route` say metric); the
    // field has the name it keeps in `RouteSpec`, `RouteStatus`, the kernel adapter and
    // netlink (`RTA_PRIORITY`; `docs/runtime.md` §4.6).
    #[serde(default, rename = "metric")]
    #[schemars(extend("default" = 1024))]
    pub priority: Option<u32>,
    /// Route MTU. Unset: none (the link's).
    ///
    /// Valid: 68–65535.
    #[serde(default)]
    pub mtu: Option<u32>,
}

impl RouteConfig {
    /// IPv6 route.
    #[must_use]
    pub fn is_v6(&self) -> bool {
        self.destination
            .map(|d| d.addr().is_ipv6())
            .or(self.gateway.map(|g| g.is_ipv6()))
            .unwrap_or(false)
    }
}

/// The main routing table (a route's `table` when unset).
pub const TABLE_MAIN: u32 = 254;
/// A route's priority (YAML `metric`) when unset.
pub const DEFAULT_ROUTE_PRIORITY: u32 = 1024;

impl RouteConfig {
    /// The destination the route is programmed with: a `/0` is a default route, which
    /// the kernel keys without a destination.
    #[must_use]
    pub fn programmed_destination(&self) -> Option<IpNet> {
        self.destination.filter(|d| d.prefix_len() != 0)
    }

    /// The table, [`TABLE_MAIN`] when unset.
    #[must_use]
    pub fn table_or_main(&self) -> u32 {
        self.table.unwrap_or(TABLE_MAIN)
    }

    /// The priority, [`DEFAULT_ROUTE_PRIORITY`] when unset.
    #[must_use]
    pub fn priority_or_default(&self) -> u32 {
        self.priority.unwrap_or(DEFAULT_ROUTE_PRIORITY)
    }
}

/// The id a route's spec is written under (its merge key): what makes two routes the
/// same kernel route. The link counts only for IPv6, whose kernel routes are per link.
#[must_use]
pub fn route_key(
    table: u32,
    ipv6: bool,
    link: &str,
    gateway: Option<IpAddr>,
    destination: Option<IpNet>,
    priority: u32,
) -> String {
    let mut k = String::new();
    if table != TABLE_MAIN && table != 0 {
        k.push_str(&format!("{table}/"));
    }
    if ipv6 {
        k.push_str(&format!("{link}/"));
    }
    let family = if ipv6 { "inet6" } else { "inet4" };
    let gw = gateway.map(|g| g.to_string()).unwrap_or_default();
    let dst = destination.map(|d| d.to_string()).unwrap_or_default();
    k.push_str(&format!("{family}/{gw}/{dst}/{priority}"));
    k
}

/// The id an address's spec is written under: link and address.
#[must_use]
pub fn address_key(link: &str, address: Option<IpNet>) -> String {
    match address {
        Some(a) => format!("{link}/{a}"),
        None => format!("{link}/"),
    }
}

/// The id a routing rule's spec is written under: family and priority.
#[must_use]
pub fn rule_key(ipv6: bool, priority: u32) -> String {
    let family = if ipv6 { "inet6" } else { "inet4" };
    format!("{family}/{priority:05}")
}

impl ConfigDocument for RouteConfig {
    const KIND: &'static str = "RouteConfig";
    const SINGLETON: bool = false;
    fn merge_key(&self) -> Option<(&'static str, String)> {
        Some((
            "table, family, gateway, destination and metric (and link, for IPv6)",
            route_key(
                self.table_or_main(),
                self.is_v6(),
                &self.out_link_name,
                self.gateway,
                self.programmed_destination(),
                self.priority_or_default(),
            ),
        ))
    }
    fn validate(&self) -> Vec<FieldError> {
        let mut errs = Vec::new();
        check_network("destination", self.destination, &mut errs);
        if !self.out_link_name.is_empty() {
            check_ifname("link", &self.out_link_name, &mut errs);
        }
        if self.out_link_name.is_empty() && self.gateway.is_none() {
            errs.push(FieldError::new("link", "a route needs a link or a gateway"));
        }
        let v6 = self.is_v6();
        if let Some(g) = self.gateway {
            if g.is_ipv6() != v6 {
                errs.push(FieldError::new(
                    "gateway",
                    format!("{g} is not of the destination's family"),
                ));
            }
        }
        if let Some(s) = self.source {
            if s.is_ipv6() != v6 {
                errs.push(FieldError::new(
                    "source",
                    format!("{s} is not of the destination's family"),
                ));
            }
        }
        if let Some(t) = self.table {
            if t == 0 || t == 255 {
                errs.push(FieldError::new(
                    "table",
                    format!("{t} is reserved (unspec, local)"),
                ));
            }
        }
        check_mtu(self.mtu, &mut errs);
        errs
    }
}

/// A policy routing rule: packets matching all selectors look up `table`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RoutingRuleConfig {
    /// Priority.
    ///
    /// Valid: 1–32765, and not the mesh's rule priority
    /// (`KubeSpanConfig.rulePriority`, 32500 by default).
    pub priority: u32,
    /// Table to look up.
    ///
    /// Valid: not 0 or 255, and not the mesh's table (`KubeSpanConfig.routingTable`,
    /// 180 by default).
    pub table: u32,
    /// IPv6 rule. Ignored when `src` or `dst` is set: their family decides.
    #[serde(default)]
    pub ipv6: bool,
    /// Source match.
    ///
    /// Valid: a network address (no host bits set), of the rule's family.
    #[serde(default)]
    #[schemars(with = "Option<super::schema::Cidr>")]
    pub src: Option<IpNet>,
    /// Destination match.
    ///
    /// Valid: a network address (no host bits set), of the rule's family.
    #[serde(default)]
    #[schemars(with = "Option<super::schema::Cidr>")]
    pub dst: Option<IpNet>,
    /// Firewall mark to match (0: any).
    #[serde(default)]
    pub fw_mark: u32,
    /// Mask applied before comparing with `fwMark`.
    ///
    /// Valid: when non-zero, `fwMark` has no bits outside it.
    #[serde(default)]
    pub fw_mask: u32,
}

impl RoutingRuleConfig {
    /// IPv6 rule.
    #[must_use]
    pub fn is_v6(&self) -> bool {
        self.src
            .or(self.dst)
            .map_or(self.ipv6, |n| n.addr().is_ipv6())
    }
}

impl ConfigDocument for RoutingRuleConfig {
    const KIND: &'static str = "RoutingRuleConfig";
    const SINGLETON: bool = false;
    fn merge_key(&self) -> Option<(&'static str, String)> {
        Some(("family and priority", rule_key(self.is_v6(), self.priority)))
    }
    fn validate(&self) -> Vec<FieldError> {
        let mut errs = Vec::new();
        if !(1..=32765).contains(&self.priority) {
            errs.push(FieldError::new(
                "priority",
                format!(
                    "{} is outside 1..=32765 (0, 32766 and 32767 are the kernel's)",
                    self.priority
                ),
            ));
        }
        if matches!(self.table, 0 | 255) {
            errs.push(FieldError::new(
                "table",
                format!("{} is reserved (unspec, local)", self.table),
            ));
        }
        let v6 = self.is_v6();
        for (field, n) in [("src", self.src), ("dst", self.dst)] {
            check_network(field, n, &mut errs);
            if let Some(n) = n {
                if n.addr().is_ipv6() != v6 {
                    errs.push(FieldError::new(
                        field,
                        format!("{n} mixes address families"),
                    ));
                }
            }
        }
        if self.fw_mark & !self.fw_mask != 0 && self.fw_mask != 0 {
            errs.push(FieldError::new(
                "fwMark",
                format!("{:#x} is outside fwMask {:#x}", self.fw_mark, self.fw_mask),
            ));
        }
        errs
    }
}

/// The mesh's rule priority and routing table (`KubeSpanConfig.rulePriority` and
/// `.routingTable`, 32500 and 180 by default) belong to the mesh: its teardown removes
/// what is there, and its rule sends marked traffic to that table. A `RouteConfig` or
/// `RoutingRuleConfig` using either is rejected before anything is applied (also on
/// `apply --dry-run`, which runs the same [`super::parse`]). Reserved whether or not
/// the mesh is enabled, so enabling it later cannot collide.
pub(super) fn check_mesh_reserved(
    documents: &[(usize, super::Document)],
    errors: &mut Vec<super::DocumentError>,
) {
    use super::Document;
    let default = super::kubespan::KubeSpanConfigDocument::default();
    let mesh = documents
        .iter()
        .find_map(|(_, d)| match d {
            Document::KubeSpanConfig(k) => Some(k),
            _ => None,
        })
        .unwrap_or(&default);
    let (table, priority) = (mesh.routing_table, mesh.rule_priority);
    let reserved_table = |t: u32| {
        FieldError::new(
            "table",
            format!("{t} is the mesh's routing table (KubeSpanConfig.routingTable)"),
        )
    };
    for (position, doc) in documents {
        let mut errs = Vec::new();
        match doc {
            Document::RouteConfig(r) if r.table == Some(table) => errs.push(reserved_table(table)),
            Document::RoutingRuleConfig(r) => {
                if r.priority == priority {
                    errs.push(FieldError::new(
                        "priority",
                        format!(
                            "{priority} is the mesh's rule priority (KubeSpanConfig.rulePriority)"
                        ),
                    ));
                }
                if r.table == table {
                    errs.push(reserved_table(table));
                }
            }
            _ => {}
        }
        if !errs.is_empty() {
            errors.push(super::DocumentError {
                position: *position,
                kind: Some(doc.kind().to_owned()),
                name: doc.name().map(str::to_owned),
                errors: errs,
            });
        }
    }
}

#[cfg(test)]
mod reserved_tests {
    use crate::config::parse;

    const HEAD: &str = "apiVersion: v1alpha1\n";

    fn fields(text: &str) -> Vec<(usize, String)> {
        parse(text).map_or_else(
            |e| {
                e.documents
                    .iter()
                    .flat_map(|d| d.errors.iter().map(move |f| (d.position, f.field.clone())))
                    .collect()
            },
            |_| Vec::new(),
        )
    }

    #[test]
    fn default_mesh_priority_and_table_are_reserved() {
        let text = format!(
            "{HEAD}kind: RoutingRuleConfig\npriority: 32500\ntable: 100\n---\n\
             {HEAD}kind: RoutingRuleConfig\npriority: 1000\ntable: 180\n---\n\
             {HEAD}kind: RouteConfig\nlink: lo\ntable: 180\n---\n\
             {HEAD}kind: RouteConfig\nlink: lo\ntable: 181\n---\n\
             {HEAD}kind: RoutingRuleConfig\npriority: 1001\ntable: 181\n"
        );
        assert_eq!(
            fields(&text),
            [
                (1, "priority".to_owned()),
                (2, "table".to_owned()),
                (3, "table".to_owned())
            ]
        );
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("mesh's rule priority"), "{err}");
    }

    #[test]
    fn configured_mesh_priority_and_table_are_reserved() {
        let text = format!(
            "{HEAD}kind: RoutingRuleConfig\npriority: 32400\ntable: 100\n---\n\
             {HEAD}kind: RouteConfig\nlink: lo\ntable: 190\n---\n\
             {HEAD}kind: RoutingRuleConfig\npriority: 32500\ntable: 180\n---\n\
             {HEAD}kind: KubeSpanConfig\nroutingTable: 190\nrulePriority: 32400\n"
        );
        // The defaults are free once the mesh uses other numbers.
        assert_eq!(
            fields(&text),
            [(1, "priority".to_owned()), (2, "table".to_owned())]
        );
    }
}

#[cfg(test)]
mod tests;
