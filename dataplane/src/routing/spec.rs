//! The mesh's desired routing state ([`RoutingSpec`]), what an apply reports, and the
//! [`Routing`] trait the mesh manager drives (netlink or fake).

use ipnet::IpNet;

use super::RoutingError;
use crate::error::{check_ifname, check_mtu, Invalid};

/// Desired routing state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingSpec {
    /// The mesh link (created by the WireGuard backend).
    pub link: String,
    /// Link MTU, also the MTU of the routes (1280 ..= 65535).
    pub mtu: u32,
    /// Addresses on the link (the ULA as a /64).
    pub addresses: Vec<IpNet>,
    /// Routing table of the mesh routes.
    pub table: u32,
    /// Priority of the fwmark rules (0, 32766 and 32767 are the kernel's).
    pub rule_priority: u32,
    /// Mark the rules match.
    pub fw_mark: u32,
    /// Mask the rules match under.
    pub fw_mask: u32,
    /// Priority (`ip route`'s metric) of the default routes.
    pub route_priority: u32,
    /// Program IPv4 rule and route.
    pub ipv4: bool,
    /// Program IPv6 rule and route.
    pub ipv6: bool,
}

impl Default for RoutingSpec {
    fn default() -> Self {
        Self {
            link: "kubespan".to_owned(),
            mtu: crate::DEFAULT_MTU,
            addresses: Vec::new(),
            table: crate::ROUTE_TABLE,
            rule_priority: crate::RULE_PRIORITY,
            fw_mark: crate::MESH_MARK,
            fw_mask: crate::MARK_MASK,
            route_priority: 1,
            ipv4: true,
            ipv6: true,
        }
    }
}

impl RoutingSpec {
    /// Checks every field; nothing is written when this fails.
    ///
    /// # Errors
    /// The first invalid field.
    pub fn validate(&self) -> Result<(), Invalid> {
        check_ifname("link", &self.link)?;
        check_mtu("mtu", self.mtu)?;
        if matches!(self.rule_priority, 0 | 32766 | 32767) {
            return Err(Invalid::new(
                "rule_priority",
                format!(
                    "{} is reserved by the kernel (0, 32766, 32767)",
                    self.rule_priority
                ),
            ));
        }
        if matches!(self.table, 0 | 253..=255) {
            return Err(Invalid::new(
                "table",
                format!("{} is reserved (unspec, default, main, local)", self.table),
            ));
        }
        if self.fw_mask == 0 || self.fw_mark & !self.fw_mask != 0 || self.fw_mark == 0 {
            return Err(Invalid::new(
                "fw_mark",
                format!(
                    "{:#x} must be non-zero and inside fw_mask {:#x}",
                    self.fw_mark, self.fw_mask
                ),
            ));
        }
        for (i, a) in self.addresses.iter().enumerate() {
            let field = format!("addresses[{i}]");
            if a.addr().is_unspecified() || a.addr().is_multicast() {
                return Err(Invalid::new(field, format!("{a} is not a unicast address")));
            }
            if matches!(a, IpNet::V4(_)) && !self.ipv4 || matches!(a, IpNet::V6(_)) && !self.ipv6 {
                return Err(Invalid::new(field, format!("{a} is of a disabled family")));
            }
        }
        Ok(())
    }
}

/// Observed routing state.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RoutingStatus {
    /// Link index, if the link exists.
    pub link_index: Option<u32>,
    /// Link administratively up.
    pub up: bool,
    /// Link MTU.
    pub mtu: u32,
    /// Addresses on the link.
    pub addresses: Vec<IpNet>,
    /// Our rules: (family is v6, priority, table).
    pub rules: Vec<(bool, u32, u32)>,
    /// Our routes: (destination, table, priority, mtu).
    pub routes: Vec<(IpNet, u32, u32, u32)>,
}

/// What one apply changed (counts), for logs and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RoutingChanges {
    /// Link attribute writes (up, MTU).
    pub link: u32,
    /// Addresses added or removed.
    pub addresses: u32,
    /// Rules added or removed.
    pub rules: u32,
    /// Routes added, replaced or removed.
    pub routes: u32,
}

impl RoutingChanges {
    /// Whether nothing was written.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// The routing adapter interface (implemented by
/// [`NetlinkRouting`](super::NetlinkRouting) and the fake).
pub trait Routing {
    /// Converges link, addresses, rules and routes to `spec`.
    ///
    /// # Errors
    /// Invalid spec or missing link (nothing written), or a netlink failure (objects
    /// already in place stay; a retry converges).
    fn apply(&mut self, spec: &RoutingSpec) -> Result<RoutingChanges, RoutingError>;
    /// Reads link, addresses, and the mesh's rules and routes (every one marked 211).
    ///
    /// # Errors
    /// Netlink failure.
    fn observe(&mut self, link: &str) -> Result<RoutingStatus, RoutingError>;
    /// Removes the mesh's rules and routes: every one marked 211, whatever its table
    /// or priority (an earlier run may have used others); the link goes with the
    /// WireGuard backend. Objects from network documents (212) and foreign ones stay.
    ///
    /// # Errors
    /// Netlink failure.
    fn teardown(&mut self) -> Result<(), RoutingError>;
    /// Number of netlink writes so far.
    fn writes(&self) -> u64;
}
