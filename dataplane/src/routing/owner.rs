//! Ownership markers: what makes a kernel object wirespan's, and which part of
//! wirespan made it. Only objects carrying these are ever changed or removed (see the
//! module doc of [`super`]).
//!
//! Two owners, told apart in the kernel by the route protocol of rules and routes and
//! by `IFA_PROTO` of addresses:
//! - the mesh ([`Owner::Mesh`], [`RTPROT_WIRESPAN`] = 211): the fwmark rules, the
//!   routes in the mesh table and the address on the mesh link, emitted by the mesh
//!   manager as operator-layer specs. The mesh's teardown removes only these, and only
//!   at the mesh's rule priority and routing table, so that objects an older wirespan
//!   wrote (which marked everything 211) are told apart by where they are.
//! - the user's network documents ([`Owner::Config`], [`RTPROT_WIRESPAN_CONFIG`] =
//!   212): `RouteConfig`, `RoutingRuleConfig` and `AddressConfig` (every layer but the
//!   operator's). The mesh never removes these.
//!
//! Both numbers are unassigned in iproute2's `rt_protos`.

use rtnetlink::packet_route::{
    address::{AddressAttribute, AddressMessage},
    link::{LinkAttribute, LinkMessage},
    route::RouteProtocol,
};

/// Route protocol (and `IFA_PROTO`) marking the mesh's rules, routes and address.
pub const RTPROT_WIRESPAN: u8 = 211;

/// Route protocol (and `IFA_PROTO`) marking rules, routes and addresses made from the
/// user's network documents.
pub const RTPROT_WIRESPAN_CONFIG: u8 = 212;

/// Alias (`ip link show` "alias") of links wirespan created.
pub const LINK_ALIAS: &str = "wirespan";

/// Which part of wirespan an object belongs to (its kernel marker).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Owner {
    /// The mesh (operator layer, from the mesh manager): protocol 211.
    Mesh,
    /// The user's network documents: protocol 212.
    #[default]
    Config,
}

impl Owner {
    /// The protocol number written on the owner's objects.
    #[must_use]
    pub fn protocol(self) -> u8 {
        match self {
            Self::Mesh => RTPROT_WIRESPAN,
            Self::Config => RTPROT_WIRESPAN_CONFIG,
        }
    }
}

/// A rule or route wirespan wrote (either owner).
pub(super) fn is_ours_proto(p: RouteProtocol) -> bool {
    matches!(u8::from(p), RTPROT_WIRESPAN | RTPROT_WIRESPAN_CONFIG)
}

/// A rule or route carrying the mesh's marker.
pub(super) fn is_mesh_proto(p: RouteProtocol) -> bool {
    u8::from(p) == RTPROT_WIRESPAN
}

/// The `IFA_PROTO` of an address, if set.
pub(super) fn addr_proto(m: &AddressMessage) -> Option<u8> {
    m.attributes.iter().find_map(|a| match a {
        AddressAttribute::Protocol(p) => Some(u8::from(*p)),
        _ => None,
    })
}

/// An address wirespan added (either owner).
pub(super) fn addr_ours(m: &AddressMessage) -> bool {
    matches!(
        addr_proto(m),
        Some(RTPROT_WIRESPAN | RTPROT_WIRESPAN_CONFIG)
    )
}

/// The link's alias; [`LINK_ALIAS`] on links we created.
pub(super) fn link_alias(msg: &LinkMessage) -> Option<&str> {
    msg.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfAlias(s) => Some(s.as_str()),
        _ => None,
    })
}
