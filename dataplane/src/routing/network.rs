//! Per-object network configuration: the desired link, address, route and rule
//! params, the objects as observed in the kernel, and the [`NetworkConfig`] trait the
//! network spec and status controllers drive (netlink or fake).

use std::net::IpAddr;

use ipnet::IpNet;

use super::{Owner, RoutingError};

/// Scope numbers (`RT_SCOPE_*`) of addresses and routes.
pub mod scope {
    /// Global.
    pub const UNIVERSE: u8 = 0;
    /// Site.
    pub const SITE: u8 = 200;
    /// Link.
    pub const LINK: u8 = 253;
    /// Host.
    pub const HOST: u8 = 254;
}

/// A link to converge.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LinkParams {
    /// Interface name.
    pub name: String,
    /// Created (and removed) by wirespan; otherwise only configured.
    pub logical: bool,
    /// Kind of a logical link (`dummy` or `bridge` can be created here).
    pub kind: String,
    /// Administratively up.
    pub up: bool,
    /// MTU; 0 = leave alone.
    pub mtu: u32,
}

/// An address to converge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressParams {
    /// Link name.
    pub link: String,
    /// Address with prefix length.
    pub address: IpNet,
    /// Scope (`scope::*`).
    pub scope: u8,
    /// Whose marker the address carries.
    pub owner: Owner,
}

/// Route types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RouteKind {
    /// Forward.
    #[default]
    Unicast,
    /// Drop.
    Blackhole,
    /// Reject, unreachable.
    Unreachable,
    /// Reject, prohibited.
    Prohibit,
}

/// A route to converge. Matched by (family, destination, gateway, table, priority).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteParams {
    /// Destination (`0.0.0.0/0` or `::/0` for a default route).
    pub destination: IpNet,
    /// Gateway.
    pub gateway: Option<IpAddr>,
    /// Preferred source.
    pub source: Option<IpAddr>,
    /// Outgoing link (empty: none).
    pub out_link_name: String,
    /// Table (254 = main).
    pub table: u32,
    /// Route priority, `ip route`'s metric (IPv6: 0 means 1024).
    pub priority: u32,
    /// Scope (`scope::*`).
    pub scope: u8,
    /// Type.
    pub kind: RouteKind,
    /// Route MTU; 0 = none.
    pub mtu: u32,
    /// Whose marker the route carries.
    pub owner: Owner,
}

/// A policy rule to converge. Matched by (family, priority).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RuleParams {
    /// IPv6 rule.
    pub v6: bool,
    /// Source match.
    pub src: Option<IpNet>,
    /// Destination match.
    pub dst: Option<IpNet>,
    /// Table looked up.
    pub table: u32,
    /// Priority.
    pub priority: u32,
    /// Mark (0 = none).
    pub fw_mark: u32,
    /// Mark mask (0 = none).
    pub fw_mask: u32,
    /// Whose marker the rule carries.
    pub owner: Owner,
}

/// A link in the kernel.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ObservedLink {
    /// ifindex.
    pub index: u32,
    /// Name.
    pub name: String,
    /// `IFLA_INFO_KIND` (empty for physical links).
    pub kind: String,
    /// Hardware type (`ether`, `loopback`, `none`, …).
    pub link_type: String,
    /// Administratively up.
    pub up: bool,
    /// Operational state (`up`, `down`, `unknown`, …).
    pub oper_state: String,
    /// Carrier.
    pub carrier: bool,
    /// MTU.
    pub mtu: u32,
    /// Hardware address `aa:bb:…`.
    pub hardware_addr: String,
    /// Permanent hardware address (`IFLA_PERM_ADDRESS`), empty when not reported.
    pub perm_hardware_addr: String,
    /// `IFF_*` flags (`ifi_flags`).
    pub flags: u32,
    /// ifindex of the link's master (bridge, bond, VRF), 0 when none.
    pub master_index: u32,
    /// Queueing discipline (`IFLA_QDISC`), empty when none.
    pub qdisc: String,
    /// Driver (ethtool), empty when not reported.
    pub driver: String,
    /// Speed in Mb/s (ethtool), 0 when unknown.
    pub speed_mbps: u32,
    /// Duplex (ethtool): `full`, `half`, or empty when unknown.
    pub duplex: String,
    /// Created by wirespan.
    pub ours: bool,
}

/// An address in the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedAddress {
    /// ifindex of its link.
    pub link_index: u32,
    /// Address.
    pub address: IpNet,
    /// Scope.
    pub scope: u8,
    /// The local address: `IFA_LOCAL`, or `IFA_ADDRESS` when the kernel sends no
    /// `IFA_LOCAL` (IPv6), as `ip addr` shows it.
    pub local: Option<IpAddr>,
    /// `IFA_BROADCAST` (IPv4).
    pub broadcast: Option<IpAddr>,
    /// `IFA_F_*` flags (`IFA_FLAGS` when present, else the header's).
    pub flags: u32,
    /// Added by wirespan.
    pub ours: bool,
    /// `IFA_PROTO` (211 = the mesh's, 212 = from network documents, 0 = unset).
    pub protocol: u8,
}

/// A route in the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedRoute {
    /// Destination.
    pub destination: IpNet,
    /// Gateway.
    pub gateway: Option<IpAddr>,
    /// Preferred source.
    pub source: Option<IpAddr>,
    /// Output interface.
    pub oif: Option<u32>,
    /// Table.
    pub table: u32,
    /// Route priority (`ip route`'s metric).
    pub priority: u32,
    /// Scope.
    pub scope: u8,
    /// Type.
    pub kind: RouteKind,
    /// Protocol (211 = the mesh's, 212 = from network documents).
    pub protocol: u8,
}

/// A policy rule in the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedRule {
    /// IPv6 rule.
    pub v6: bool,
    /// Source match.
    pub src: Option<IpNet>,
    /// Destination match.
    pub dst: Option<IpNet>,
    /// Table.
    pub table: u32,
    /// Priority.
    pub priority: u32,
    /// Mark.
    pub fw_mark: u32,
    /// Mask.
    pub fw_mask: u32,
    /// Protocol (211 = the mesh's, 212 = from network documents).
    pub protocol: u8,
}

/// A kernel object as observed, for the spec controllers' start-up sweep of objects
/// the network documents made that no spec names any more
/// ([`NetworkConfig::remove_marked`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MarkedObject {
    /// A route, removed only while it is exactly as observed (marker included).
    Route(ObservedRoute),
    /// A rule, removed only while it is exactly as observed (marker included).
    Rule(ObservedRule),
    /// An address, removed only while it is on the same link with the same marker.
    Address(ObservedAddress),
    /// A logical link wirespan created (alias [`super::LINK_ALIAS`]), by name.
    Link(String),
}

/// Everything the status controllers publish.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NetworkState {
    /// Links.
    pub links: Vec<ObservedLink>,
    /// Addresses.
    pub addresses: Vec<ObservedAddress>,
    /// Routes (every table, unicast/blackhole/unreachable/prohibit only).
    pub routes: Vec<ObservedRoute>,
    /// Rules.
    pub rules: Vec<ObservedRule>,
}

/// Per-object network configuration (implemented by
/// [`NetlinkRouting`](super::NetlinkRouting) and [`crate::fake::FakeRouting`]). Every `apply_*` returns whether it wrote; a missing
/// link is [`RoutingError::LinkNotFound`] (skip and retry on the next link event).
pub trait NetworkConfig: Send {
    /// Creates a logical link if missing, then sets MTU and up/down.
    ///
    /// # Errors
    /// Missing physical link, unsupported kind, netlink failure.
    fn apply_link(&mut self, p: &LinkParams) -> Result<bool, RoutingError>;
    /// Deletes the link if wirespan created it.
    ///
    /// # Errors
    /// Netlink failure.
    fn remove_link(&mut self, name: &str) -> Result<bool, RoutingError>;
    /// Adds the address (re-adds ours on a scope change).
    ///
    /// # Errors
    /// Missing link, netlink failure.
    fn apply_address(&mut self, p: &AddressParams) -> Result<bool, RoutingError>;
    /// Removes the address if wirespan added it.
    ///
    /// # Errors
    /// Netlink failure.
    fn remove_address(&mut self, p: &AddressParams) -> Result<bool, RoutingError>;
    /// Adds or replaces (ours only) the route.
    ///
    /// # Errors
    /// Missing link, netlink failure.
    fn apply_route(&mut self, p: &RouteParams) -> Result<bool, RoutingError>;
    /// Removes our route with the same match key.
    ///
    /// # Errors
    /// Netlink failure.
    fn remove_route(&mut self, p: &RouteParams) -> Result<bool, RoutingError>;
    /// Adds the rule; our stale rules at the same (family, priority) go.
    ///
    /// # Errors
    /// Netlink failure.
    fn apply_rule(&mut self, p: &RuleParams) -> Result<bool, RoutingError>;
    /// Removes our rules at the same (family, priority).
    ///
    /// # Errors
    /// Netlink failure.
    fn remove_rule(&mut self, p: &RuleParams) -> Result<bool, RoutingError>;
    /// Removes one object as observed by [`Self::state`], only if it still carries a
    /// wirespan marker (211 or 212, or the link alias) and still matches what was
    /// observed; anything else (changed meanwhile, foreign) stays.
    ///
    /// # Errors
    /// Netlink failure.
    fn remove_marked(&mut self, o: &MarkedObject) -> Result<bool, RoutingError>;
    /// Reads links, addresses, routes and rules.
    ///
    /// # Errors
    /// Netlink failure.
    fn state(&mut self) -> Result<NetworkState, RoutingError>;
}
