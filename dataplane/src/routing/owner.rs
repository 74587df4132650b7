//! Ownership markers: what makes a kernel object wirespan's. Only objects carrying
//! these are ever changed or removed (see the module doc of [`super`]).

use rtnetlink::packet_route::{
    address::{AddressAttribute, AddressMessage},
    link::{LinkAttribute, LinkMessage},
    route::RouteProtocol,
};

/// Route protocol number marking rules and routes as ours.
pub const RTPROT_WIRESPAN: u8 = 211;

/// Alias (`ip link show` "alias") of links wirespan created.
pub const LINK_ALIAS: &str = "wirespan";

/// A rule or route we wrote.
pub(super) fn is_ours_proto(p: RouteProtocol) -> bool {
    p == RouteProtocol::Other(RTPROT_WIRESPAN)
}

/// An address we added (`IFA_PROTO`).
pub(super) fn addr_ours(m: &AddressMessage) -> bool {
    m.attributes
        .iter()
        .any(|a| matches!(a, AddressAttribute::Protocol(p) if u8::from(*p) == RTPROT_WIRESPAN))
}

/// The link's alias; [`LINK_ALIAS`] on links we created.
pub(super) fn link_alias(msg: &LinkMessage) -> Option<&str> {
    msg.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfAlias(s) => Some(s.as_str()),
        _ => None,
    })
}
