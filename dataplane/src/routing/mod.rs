//! Policy routing for the mesh link (`docs/kubespan.md` §6.3–§6.5): the link's up state, MTU and
//! addresses; `fwmark MARK/MASK lookup TABLE` rules at a priority; default routes in
//! that table via the link.
//!
//! Ownership: every rule and route this adapter writes carries a route protocol of
//! its own, [`RTPROT_WIRESPAN`] (211) for the mesh's and [`RTPROT_WIRESPAN_CONFIG`]
//! (212) for those from the user's network documents (both unassigned in iproute2's
//! `rt_protos`; `ip rule` and `ip route` show `proto 211` / `proto 212`; see
//! `owner`). Only objects with one of those protocols are ever changed or removed; a
//! foreign rule at the same priority or a foreign route in the same table is left
//! alone. The mesh's teardown removes only 211 objects at the mesh's priority and in
//! its table. (Upstream uses `proto static` for its routes; the protocol is local
//! state, not part of interop.) Addresses: the mesh link belongs to the mesh, so every
//! address on it except IPv6 link-local converges to the desired list.
//!
//! Besides the whole mesh spec ([`Routing`]), [`NetworkConfig`] configures any link,
//! address, route and routing rule, one object at a time, for the network spec
//! controllers. Same ownership rule: routes and rules carry protocol 211 or 212 (by
//! the params' [`Owner`]), addresses carry the same number as `IFA_PROTO` and logical links wirespan created carry the alias
//! [`LINK_ALIAS`]; only such objects are ever removed or replaced. Objects someone
//! else made are left alone, also when a spec describes the same object (the spec is
//! then satisfied by the foreign one).
//!
//! Layout, in the spirit of rtnetlink (one module per kernel object kind):
//! - `spec`: the mesh's desired state [`RoutingSpec`], what an apply reports, and the
//!   [`Routing`] trait;
//! - `network`: per-object params, observed objects and the [`NetworkConfig`] trait;
//! - `owner`: the markers that make an object ours;
//! - `link`, `address`, `route`, `rule`: reading, matching and writing one kind;
//! - `mesh`: converging a whole [`RoutingSpec`] (`impl Routing for NetlinkRouting`);
//! - `netlink`: the [`NetlinkRouting`] handle and `impl NetworkConfig` for it;
//! - `error`: [`RoutingError`].
//!
//! Kernel tests live in `dataplane/tests/routing.rs`.

mod address;
mod error;
mod ethtool;
mod link;
mod mesh;
mod netlink;
mod network;
mod owner;
mod route;
mod rule;
mod spec;

pub use error::RoutingError;
pub use netlink::NetlinkRouting;
pub use network::{
    scope, AddressParams, LinkParams, MarkedObject, NetworkConfig, NetworkState, ObservedAddress,
    ObservedLink, ObservedRoute, ObservedRule, RouteKind, RouteParams, RuleParams,
};
pub use owner::{Owner, LINK_ALIAS, RTPROT_WIRESPAN, RTPROT_WIRESPAN_CONFIG};
pub use spec::{Routing, RoutingChanges, RoutingSpec, RoutingStatus};
