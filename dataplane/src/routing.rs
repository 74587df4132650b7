//! Policy routing for the mesh link (spec §6.3–§6.5): the link's up state, MTU and
//! addresses; `fwmark MARK/MASK lookup TABLE` rules at a priority; default routes in
//! that table via the link.
//!
//! Ownership: every rule and route this adapter writes carries the route protocol
//! [`RTPROT_WIRESPAN`] (211, unassigned in iproute2's `rt_protos`), so `ip rule` and
//! `ip route` show `proto 211`. Only objects with that protocol are ever changed or
//! removed; a foreign rule at the same priority or a foreign route in the same table
//! is left alone. (Upstream uses `proto static` for its routes; the protocol is local
//! state, not part of interop.) Addresses: the mesh link belongs to the mesh, so every
//! address on it except IPv6 link-local converges to the desired list.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use futures::TryStreamExt;
use ipnet::IpNet;
use rtnetlink::{
    packet_route::{
        address::{AddressAttribute, AddressMessage},
        link::{LinkAttribute, LinkFlags},
        route::{
            RouteAddress, RouteAttribute, RouteMessage, RouteMetric, RouteProtocol, RouteScope,
            RouteType,
        },
        rule::{RuleAction, RuleAttribute, RuleMessage},
        AddressFamily,
    },
    Handle, IpVersion, LinkUnspec, RouteMessageBuilder,
};

use crate::{
    error::{check_ifname, check_mtu, Invalid},
    netns::{Netns, NetnsThread},
};

/// Route protocol number marking rules and routes as ours.
pub const RTPROT_WIRESPAN: u8 = 211;

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
    pub priority: u32,
    /// Mark the rules match.
    pub fwmark: u32,
    /// Mask the rules match under.
    pub fwmask: u32,
    /// Metric of the default routes.
    pub metric: u32,
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
            priority: crate::RULE_PRIORITY,
            fwmark: crate::MESH_MARK,
            fwmask: crate::MARK_MASK,
            metric: 1,
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
        if matches!(self.priority, 0 | 32766 | 32767) {
            return Err(Invalid::new(
                "priority",
                format!(
                    "{} is reserved by the kernel (0, 32766, 32767)",
                    self.priority
                ),
            ));
        }
        if matches!(self.table, 0 | 253..=255) {
            return Err(Invalid::new(
                "table",
                format!("{} is reserved (unspec, default, main, local)", self.table),
            ));
        }
        if self.fwmask == 0 || self.fwmark & !self.fwmask != 0 || self.fwmark == 0 {
            return Err(Invalid::new(
                "fwmark",
                format!(
                    "{:#x} must be non-zero and inside fwmask {:#x}",
                    self.fwmark, self.fwmask
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

/// Errors of the routing adapter.
#[derive(Debug, thiserror::Error)]
pub enum RoutingError {
    /// The desired state is invalid; nothing was written.
    #[error("invalid routing spec: {0}")]
    Invalid(#[from] Invalid),
    /// The link does not exist (yet); nothing was written.
    #[error("link {0:?} not found")]
    LinkNotFound(String),
    /// A netlink request failed.
    #[error("netlink {op}: {source}")]
    Netlink {
        /// What we asked for.
        op: &'static str,
        /// The kernel's answer.
        #[source]
        source: rtnetlink::Error,
    },
    /// The namespace thread could not be used.
    #[error("network namespace: {0}")]
    Netns(#[from] std::io::Error),
}

fn nl(op: &'static str) -> impl FnOnce(rtnetlink::Error) -> RoutingError {
    move |source| RoutingError::Netlink { op, source }
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
    /// Our routes: (destination, table, metric, mtu).
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

/// The routing adapter interface (implemented by [`NetlinkRouting`] and the fake).
pub trait Routing {
    /// Converges link, addresses, rules and routes to `spec`.
    ///
    /// # Errors
    /// Invalid spec or missing link (nothing written), or a netlink failure (objects
    /// already in place stay; a retry converges).
    fn apply(&mut self, spec: &RoutingSpec) -> Result<RoutingChanges, RoutingError>;
    /// Reads link, addresses, our rules and our routes.
    ///
    /// # Errors
    /// Netlink failure.
    fn observe(&mut self, link: &str) -> Result<RoutingStatus, RoutingError>;
    /// Removes our rules and routes (the link goes with the WireGuard backend).
    ///
    /// # Errors
    /// Netlink failure.
    fn teardown(&mut self) -> Result<(), RoutingError>;
    /// Number of netlink writes so far.
    fn writes(&self) -> u64;
}

/// Routing through rtnetlink, on a thread inside the target namespace.
#[derive(Debug)]
pub struct NetlinkRouting {
    thread: NetnsThread,
    handle: Handle,
    writes: u64,
}

#[derive(Debug, Clone)]
struct Link {
    index: u32,
    up: bool,
    mtu: u32,
}

async fn find_link(h: &Handle, name: &str) -> Result<Option<Link>, RoutingError> {
    let mut req = h.link().get().match_name(name.to_owned()).execute();
    match req.try_next().await {
        Ok(Some(msg)) => {
            let mtu = msg
                .attributes
                .iter()
                .find_map(|a| match a {
                    LinkAttribute::Mtu(m) => Some(*m),
                    _ => None,
                })
                .unwrap_or_default();
            Ok(Some(Link {
                index: msg.header.index,
                up: msg.header.flags.contains(LinkFlags::Up),
                mtu,
            }))
        }
        Ok(None) => Ok(None),
        // ENODEV: no such link.
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => Ok(None),
        Err(e) => Err(nl("get link")(e)),
    }
}

fn addr_of(msg: &AddressMessage) -> Option<IpNet> {
    let ip = msg.attributes.iter().find_map(|a| match a {
        AddressAttribute::Local(ip) => Some(*ip),
        _ => None,
    });
    let ip = ip.or_else(|| {
        msg.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        })
    })?;
    IpNet::new(ip, msg.header.prefix_len).ok()
}

async fn link_addresses(
    h: &Handle,
    index: u32,
) -> Result<Vec<(IpNet, AddressMessage)>, RoutingError> {
    let msgs: Vec<AddressMessage> = h
        .address()
        .get()
        .set_link_index_filter(index)
        .execute()
        .try_collect()
        .await
        .map_err(nl("get addresses"))?;
    Ok(msgs
        .into_iter()
        .filter(|m| m.header.index == index)
        .filter_map(|m| addr_of(&m).map(|a| (a, m)))
        .collect())
}

fn is_ours_proto(p: RouteProtocol) -> bool {
    p == RouteProtocol::Other(RTPROT_WIRESPAN)
}

fn rule_table(r: &RuleMessage) -> u32 {
    r.attributes
        .iter()
        .find_map(|a| match a {
            RuleAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(r.header.table))
}

fn rule_field(r: &RuleMessage, f: impl Fn(&RuleAttribute) -> Option<u32>) -> Option<u32> {
    r.attributes.iter().find_map(f)
}

async fn our_rules(h: &Handle) -> Result<Vec<RuleMessage>, RoutingError> {
    let mut out = Vec::new();
    for v in [IpVersion::V4, IpVersion::V6] {
        let rules: Vec<RuleMessage> = h
            .rule()
            .get(v)
            .execute()
            .try_collect()
            .await
            .map_err(nl("get rules"))?;
        out.extend(rules.into_iter().filter(|r| {
            r.attributes
                .iter()
                .any(|a| matches!(a, RuleAttribute::Protocol(p) if is_ours_proto(*p)))
        }));
    }
    Ok(out)
}

fn route_table(r: &RouteMessage) -> u32 {
    r.attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(r.header.table))
}

fn route_dst(r: &RouteMessage) -> Option<IpNet> {
    let len = r.header.destination_prefix_length;
    let addr = r.attributes.iter().find_map(|a| match a {
        RouteAttribute::Destination(RouteAddress::Inet(ip)) => Some(IpAddr::V4(*ip)),
        RouteAttribute::Destination(RouteAddress::Inet6(ip)) => Some(IpAddr::V6(*ip)),
        _ => None,
    });
    let addr = addr.or(match r.header.address_family {
        AddressFamily::Inet => Some(IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
        AddressFamily::Inet6 => Some(IpAddr::V6(Ipv6Addr::UNSPECIFIED)),
        _ => None,
    })?;
    IpNet::new(addr, len).ok()
}

fn route_u32(r: &RouteMessage, f: impl Fn(&RouteAttribute) -> Option<u32>) -> Option<u32> {
    r.attributes.iter().find_map(f)
}

fn route_mtu(r: &RouteMessage) -> u32 {
    route_u32(r, |a| match a {
        RouteAttribute::Metrics(m) => m.iter().find_map(|m| match m {
            RouteMetric::Mtu(v) => Some(*v),
            _ => None,
        }),
        _ => None,
    })
    .unwrap_or_default()
}

async fn our_routes(h: &Handle) -> Result<Vec<RouteMessage>, RoutingError> {
    let mut out = Vec::new();
    for msg in [
        RouteMessageBuilder::<Ipv4Addr>::new().build(),
        RouteMessageBuilder::<Ipv6Addr>::new().build(),
    ] {
        let routes: Vec<RouteMessage> = h
            .route()
            .get(msg)
            .execute()
            .try_collect()
            .await
            .map_err(nl("get routes"))?;
        out.extend(
            routes
                .into_iter()
                .filter(|r| is_ours_proto(r.header.protocol)),
        );
    }
    Ok(out)
}

fn desired_route(spec: &RoutingSpec, index: u32, v6: bool) -> RouteMessage {
    let mut msg = if v6 {
        RouteMessageBuilder::<Ipv6Addr>::new()
            .destination_prefix(Ipv6Addr::UNSPECIFIED, 0)
            .output_interface(index)
            .table_id(spec.table)
            .priority(spec.metric)
            .protocol(RouteProtocol::Other(RTPROT_WIRESPAN))
            .scope(RouteScope::Universe)
            .kind(RouteType::Unicast)
            .build()
    } else {
        RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(Ipv4Addr::UNSPECIFIED, 0)
            .output_interface(index)
            .table_id(spec.table)
            .priority(spec.metric)
            .protocol(RouteProtocol::Other(RTPROT_WIRESPAN))
            .scope(RouteScope::Universe)
            .kind(RouteType::Unicast)
            .build()
    };
    msg.attributes
        .push(RouteAttribute::Metrics(vec![RouteMetric::Mtu(spec.mtu)]));
    msg
}

fn route_matches(r: &RouteMessage, spec: &RoutingSpec, index: u32) -> bool {
    let v6 = r.header.address_family == AddressFamily::Inet6;
    let want_family = if v6 { spec.ipv6 } else { spec.ipv4 };
    want_family
        && route_table(r) == spec.table
        && route_dst(r).is_some_and(|d| d.prefix_len() == 0)
        && route_u32(r, |a| match a {
            RouteAttribute::Oif(i) => Some(*i),
            _ => None,
        }) == Some(index)
        && route_u32(r, |a| match a {
            RouteAttribute::Priority(p) => Some(*p),
            _ => None,
        })
        .unwrap_or_default()
            == spec.metric
        && route_mtu(r) == spec.mtu
}

fn rule_matches(r: &RuleMessage, spec: &RoutingSpec) -> bool {
    let v6 = r.header.family == AddressFamily::Inet6;
    let want_family = if v6 { spec.ipv6 } else { spec.ipv4 };
    want_family
        && r.header.action == RuleAction::ToTable
        && rule_table(r) == spec.table
        && rule_field(r, |a| match a {
            RuleAttribute::Priority(p) => Some(*p),
            _ => None,
        }) == Some(spec.priority)
        && rule_field(r, |a| match a {
            RuleAttribute::FwMark(p) => Some(*p),
            _ => None,
        }) == Some(spec.fwmark)
        && rule_field(r, |a| match a {
            RuleAttribute::FwMask(p) => Some(*p),
            _ => None,
        }) == Some(spec.fwmask)
}

async fn add_rule(h: &Handle, spec: &RoutingSpec, v6: bool) -> Result<(), RoutingError> {
    let base = h
        .rule()
        .add()
        .priority(spec.priority)
        .fw_mark(spec.fwmark)
        .table_id(spec.table)
        .action(RuleAction::ToTable);
    let extra = [
        RuleAttribute::FwMask(spec.fwmask),
        RuleAttribute::Protocol(RouteProtocol::Other(RTPROT_WIRESPAN)),
    ];
    if v6 {
        let mut req = base.v6();
        req.message_mut().attributes.extend(extra);
        req.execute().await.map_err(nl("add rule"))
    } else {
        let mut req = base.v4();
        req.message_mut().attributes.extend(extra);
        req.execute().await.map_err(nl("add rule"))
    }
}

async fn apply_in_ns(h: Handle, spec: RoutingSpec) -> Result<RoutingChanges, RoutingError> {
    let mut ch = RoutingChanges::default();
    let link = find_link(&h, &spec.link)
        .await?
        .ok_or_else(|| RoutingError::LinkNotFound(spec.link.clone()))?;

    // Link: MTU, then up.
    if link.mtu != spec.mtu || !link.up {
        h.link()
            .set(
                LinkUnspec::new_with_index(link.index)
                    .mtu(spec.mtu)
                    .up()
                    .build(),
            )
            .execute()
            .await
            .map_err(nl("set link"))?;
        ch.link += 1;
    }

    // Addresses: add missing before removing extra ones.
    let have = link_addresses(&h, link.index).await?;
    for a in &spec.addresses {
        if !have.iter().any(|(h, _)| h == a) {
            h.address()
                .add(link.index, a.addr(), a.prefix_len())
                .execute()
                .await
                .map_err(nl("add address"))?;
            ch.addresses += 1;
        }
    }
    for (a, msg) in have {
        let link_local = matches!(a, IpNet::V6(v6) if v6.addr().segments()[0] & 0xffc0 == 0xfe80);
        if !link_local && !spec.addresses.contains(&a) {
            h.address()
                .del(msg)
                .execute()
                .await
                .map_err(nl("delete address"))?;
            ch.addresses += 1;
        }
    }

    // Routes: replace desired (atomic per route), then drop our stale ones.
    let routes = our_routes(&h).await?;
    for v6 in [false, true] {
        let wanted = if v6 { spec.ipv6 } else { spec.ipv4 };
        let present = routes.iter().any(|r| {
            (r.header.address_family == AddressFamily::Inet6) == v6
                && route_matches(r, &spec, link.index)
        });
        if wanted && !present {
            h.route()
                .add(desired_route(&spec, link.index, v6))
                .replace()
                .execute()
                .await
                .map_err(nl("add route"))?;
            ch.routes += 1;
        }
    }
    // Re-read after writes: a replace may have consumed a stale route already.
    let routes = if ch.routes > 0 {
        our_routes(&h).await?
    } else {
        routes
    };
    for r in routes {
        if !route_matches(&r, &spec, link.index) {
            h.route()
                .del(r)
                .execute()
                .await
                .map_err(nl("delete route"))?;
            ch.routes += 1;
        }
    }

    // Rules: add desired, then drop our stale ones.
    let rules = our_rules(&h).await?;
    for v6 in [false, true] {
        let wanted = if v6 { spec.ipv6 } else { spec.ipv4 };
        let present = rules
            .iter()
            .any(|r| (r.header.family == AddressFamily::Inet6) == v6 && rule_matches(r, &spec));
        if wanted && !present {
            add_rule(&h, &spec, v6).await?;
            ch.rules += 1;
        }
    }
    for r in rules {
        if !rule_matches(&r, &spec) {
            h.rule().del(r).execute().await.map_err(nl("delete rule"))?;
            ch.rules += 1;
        }
    }
    Ok(ch)
}

async fn observe_in_ns(h: Handle, name: String) -> Result<RoutingStatus, RoutingError> {
    let mut st = RoutingStatus::default();
    if let Some(link) = find_link(&h, &name).await? {
        st.link_index = Some(link.index);
        st.up = link.up;
        st.mtu = link.mtu;
        st.addresses = link_addresses(&h, link.index)
            .await?
            .into_iter()
            .map(|(a, _)| a)
            .collect();
    }
    for r in our_rules(&h).await? {
        st.rules.push((
            r.header.family == AddressFamily::Inet6,
            rule_field(&r, |a| match a {
                RuleAttribute::Priority(p) => Some(*p),
                _ => None,
            })
            .unwrap_or_default(),
            rule_table(&r),
        ));
    }
    for r in our_routes(&h).await? {
        if let Some(dst) = route_dst(&r) {
            let metric = route_u32(&r, |a| match a {
                RouteAttribute::Priority(p) => Some(*p),
                _ => None,
            })
            .unwrap_or_default();
            st.routes
                .push((dst, route_table(&r), metric, route_mtu(&r)));
        }
    }
    Ok(st)
}

async fn teardown_in_ns(h: Handle) -> Result<u64, RoutingError> {
    let mut n = 0;
    for r in our_routes(&h).await? {
        h.route()
            .del(r)
            .execute()
            .await
            .map_err(nl("delete route"))?;
        n += 1;
    }
    for r in our_rules(&h).await? {
        h.rule().del(r).execute().await.map_err(nl("delete rule"))?;
        n += 1;
    }
    Ok(n)
}

impl NetlinkRouting {
    /// Opens a netlink connection inside `netns`.
    ///
    /// # Errors
    /// The namespace cannot be entered or the socket not opened.
    pub fn new(netns: &Netns) -> Result<Self, RoutingError> {
        let thread = NetnsThread::spawn(netns)?;
        let handle = thread.block_on(|| async {
            let (conn, handle, _) = rtnetlink::new_connection()?;
            tokio::spawn(conn);
            Ok::<_, std::io::Error>(handle)
        })??;
        Ok(Self {
            thread,
            handle,
            writes: 0,
        })
    }
}

impl Routing for NetlinkRouting {
    fn apply(&mut self, spec: &RoutingSpec) -> Result<RoutingChanges, RoutingError> {
        spec.validate()?;
        let (h, s) = (self.handle.clone(), spec.clone());
        let ch = self.thread.block_on(move || apply_in_ns(h, s))??;
        let n = ch.link + ch.addresses + ch.rules + ch.routes;
        self.writes += u64::from(n);
        if n > 0 {
            tracing::info!(link = %spec.link, link_writes = ch.link, addresses = ch.addresses,
                rules = ch.rules, routes = ch.routes, "routing converged");
        }
        Ok(ch)
    }

    fn observe(&mut self, link: &str) -> Result<RoutingStatus, RoutingError> {
        let (h, l) = (self.handle.clone(), link.to_owned());
        self.thread.block_on(move || observe_in_ns(h, l))?
    }

    fn teardown(&mut self) -> Result<(), RoutingError> {
        let h = self.handle.clone();
        let n = self.thread.block_on(move || teardown_in_ns(h))??;
        self.writes += n;
        Ok(())
    }

    fn writes(&self) -> u64 {
        self.writes
    }
}

// ---------------------------------------------------------------------------------
// Generic network configuration: any link, address, route and routing rule, one
// object at a time, for the network spec controllers. Same ownership rule as above:
// routes and rules carry protocol 211, addresses carry `IFA_PROTO` 211 and logical
// links wirespan created carry the alias [`LINK_ALIAS`]; only such objects are ever
// removed or replaced. Objects someone else made are left alone, also when a spec
// describes the same object (the spec is then satisfied by the foreign one).
// ---------------------------------------------------------------------------------

/// Alias (`ip link show` "alias") of links wirespan created.
pub const LINK_ALIAS: &str = "wirespan";

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

/// A route to converge. Matched by (family, destination, gateway, table, metric).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteParams {
    /// Destination (`0.0.0.0/0` or `::/0` for a default route).
    pub destination: IpNet,
    /// Gateway.
    pub gateway: Option<IpAddr>,
    /// Preferred source.
    pub source: Option<IpAddr>,
    /// Outgoing link (empty: none).
    pub out_link: String,
    /// Table (254 = main).
    pub table: u32,
    /// Metric (IPv6: 0 means 1024).
    pub metric: u32,
    /// Scope (`scope::*`).
    pub scope: u8,
    /// Type.
    pub kind: RouteKind,
    /// Route MTU; 0 = none.
    pub mtu: u32,
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
    pub fwmark: u32,
    /// Mark mask (0 = none).
    pub fwmask: u32,
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
    /// Added by wirespan.
    pub ours: bool,
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
    /// Metric.
    pub metric: u32,
    /// Scope.
    pub scope: u8,
    /// Type.
    pub kind: RouteKind,
    /// Protocol (211 = ours).
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
    pub fwmark: u32,
    /// Mask.
    pub fwmask: u32,
    /// Protocol (211 = ours).
    pub protocol: u8,
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

/// Per-object network configuration (implemented by [`NetlinkRouting`] and
/// [`crate::fake::FakeRouting`]). Every `apply_*` returns whether it wrote; a missing
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
    /// Reads links, addresses, routes and rules.
    ///
    /// # Errors
    /// Netlink failure.
    fn state(&mut self) -> Result<NetworkState, RoutingError>;
}

fn route_metric_eq(v6: bool, a: u32, b: u32) -> bool {
    let norm = |m: u32| if v6 && m == 0 { 1024 } else { m };
    norm(a) == norm(b)
}

fn route_kind_of(t: RouteType) -> Option<RouteKind> {
    match t {
        RouteType::Unicast => Some(RouteKind::Unicast),
        RouteType::BlackHole => Some(RouteKind::Blackhole),
        RouteType::Unreachable => Some(RouteKind::Unreachable),
        RouteType::Prohibit => Some(RouteKind::Prohibit),
        _ => None,
    }
}

fn route_type_of(k: RouteKind) -> RouteType {
    match k {
        RouteKind::Unicast => RouteType::Unicast,
        RouteKind::Blackhole => RouteType::BlackHole,
        RouteKind::Unreachable => RouteType::Unreachable,
        RouteKind::Prohibit => RouteType::Prohibit,
    }
}

fn route_addr(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(ip) => Some(IpAddr::V4(*ip)),
        RouteAddress::Inet6(ip) => Some(IpAddr::V6(*ip)),
        _ => None,
    }
}

fn observed_route(r: &RouteMessage) -> Option<ObservedRoute> {
    let kind = route_kind_of(r.header.kind)?;
    let destination = route_dst(r)?;
    let gateway = r.attributes.iter().find_map(|a| match a {
        RouteAttribute::Gateway(g) => route_addr(g),
        _ => None,
    });
    let source = r.attributes.iter().find_map(|a| match a {
        RouteAttribute::PrefSource(g) => route_addr(g),
        _ => None,
    });
    Some(ObservedRoute {
        destination,
        gateway,
        source,
        oif: route_u32(r, |a| match a {
            RouteAttribute::Oif(i) => Some(*i),
            _ => None,
        }),
        table: route_table(r),
        metric: route_u32(r, |a| match a {
            RouteAttribute::Priority(p) => Some(*p),
            _ => None,
        })
        .unwrap_or_default(),
        scope: u8::from(r.header.scope),
        kind,
        protocol: u8::from(r.header.protocol),
    })
}

fn rule_net(r: &RuleMessage, src: bool) -> Option<IpNet> {
    let len = if src {
        r.header.src_len
    } else {
        r.header.dst_len
    };
    r.attributes
        .iter()
        .find_map(|a| match (a, src) {
            (RuleAttribute::Source(ip), true) | (RuleAttribute::Destination(ip), false) => {
                Some(*ip)
            }
            _ => None,
        })
        .and_then(|ip| IpNet::new(ip, len).ok())
}

fn observed_rule(r: &RuleMessage) -> ObservedRule {
    ObservedRule {
        v6: r.header.family == AddressFamily::Inet6,
        src: rule_net(r, true),
        dst: rule_net(r, false),
        table: rule_table(r),
        priority: rule_field(r, |a| match a {
            RuleAttribute::Priority(p) => Some(*p),
            _ => None,
        })
        .unwrap_or_default(),
        fwmark: rule_field(r, |a| match a {
            RuleAttribute::FwMark(p) => Some(*p),
            _ => None,
        })
        .unwrap_or_default(),
        fwmask: rule_field(r, |a| match a {
            RuleAttribute::FwMask(p) => Some(*p),
            _ => None,
        })
        .unwrap_or_default(),
        protocol: r
            .attributes
            .iter()
            .find_map(|a| match a {
                RuleAttribute::Protocol(p) => Some(u8::from(*p)),
                _ => None,
            })
            .unwrap_or_default(),
    }
}

fn link_alias(msg: &rtnetlink::packet_route::link::LinkMessage) -> Option<&str> {
    msg.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfAlias(s) => Some(s.as_str()),
        _ => None,
    })
}

fn observed_link(msg: &rtnetlink::packet_route::link::LinkMessage) -> ObservedLink {
    use rtnetlink::packet_route::link::{LinkInfo, LinkLayerType};
    let mut l = ObservedLink {
        index: msg.header.index,
        up: msg.header.flags.contains(LinkFlags::Up),
        ours: link_alias(msg) == Some(LINK_ALIAS),
        link_type: match msg.header.link_layer_type {
            LinkLayerType::Ether => "ether".to_owned(),
            LinkLayerType::Loopback => "loopback".to_owned(),
            LinkLayerType::None => "none".to_owned(),
            other => format!("{other:?}").to_lowercase(),
        },
        ..ObservedLink::default()
    };
    for a in &msg.attributes {
        match a {
            LinkAttribute::IfName(n) => l.name.clone_from(n),
            LinkAttribute::Mtu(m) => l.mtu = *m,
            LinkAttribute::Carrier(c) => l.carrier = *c != 0,
            LinkAttribute::OperState(s) => l.oper_state = s.to_string().to_lowercase(),
            LinkAttribute::Address(hw) => {
                l.hardware_addr = hw
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<Vec<_>>()
                    .join(":");
            }
            LinkAttribute::LinkInfo(infos) => {
                for i in infos {
                    if let LinkInfo::Kind(k) = i {
                        l.kind = k.to_string();
                    }
                }
            }
            _ => {}
        }
    }
    l
}

async fn link_index(h: &Handle, name: &str) -> Result<u32, RoutingError> {
    Ok(find_link(h, name)
        .await?
        .ok_or_else(|| RoutingError::LinkNotFound(name.to_owned()))?
        .index)
}

async fn apply_link_in_ns(h: Handle, p: LinkParams) -> Result<bool, RoutingError> {
    use rtnetlink::packet_route::link::InfoKind;
    let Some(link) = find_link(&h, &p.name).await? else {
        if !p.logical {
            return Err(RoutingError::LinkNotFound(p.name));
        }
        let kind = match p.kind.as_str() {
            "dummy" => InfoKind::Dummy,
            "bridge" => InfoKind::Bridge,
            other => {
                return Err(Invalid::new(
                    "kind",
                    format!("cannot create links of kind {other:?} (only dummy and bridge)"),
                )
                .into())
            }
        };
        let mut b = rtnetlink::LinkMessageBuilder::<LinkUnspec>::new_with_info_kind(kind)
            .name(p.name.clone());
        if p.mtu != 0 {
            b = b.mtu(p.mtu);
        }
        if p.up {
            b = b.up();
        }
        h.link()
            .add(b.build())
            .execute()
            .await
            .map_err(nl("add link"))?;
        // The kernel ignores IFLA_IFALIAS on creation: mark the link in a second step.
        let created = find_link(&h, &p.name)
            .await?
            .ok_or_else(|| RoutingError::LinkNotFound(p.name.clone()))?;
        h.link()
            .set(
                LinkUnspec::new_with_index(created.index)
                    .alias(LINK_ALIAS)
                    .build(),
            )
            .execute()
            .await
            .map_err(nl("set link alias"))?;
        return Ok(true);
    };
    let mut changed = false;
    if p.mtu != 0 && link.mtu != p.mtu {
        h.link()
            .set(LinkUnspec::new_with_index(link.index).mtu(p.mtu).build())
            .execute()
            .await
            .map_err(nl("set link mtu"))?;
        changed = true;
    }
    if link.up != p.up {
        let b = LinkUnspec::new_with_index(link.index);
        let b = if p.up { b.up() } else { b.down() };
        h.link()
            .set(b.build())
            .execute()
            .await
            .map_err(nl("set link state"))?;
        changed = true;
    }
    Ok(changed)
}

async fn remove_link_in_ns(h: Handle, name: String) -> Result<bool, RoutingError> {
    let mut req = h.link().get().match_name(name.clone()).execute();
    let msg = match req.try_next().await {
        Ok(Some(m)) => m,
        Ok(None) => return Ok(false),
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => {
            return Ok(false)
        }
        Err(e) => return Err(nl("get link")(e)),
    };
    if link_alias(&msg) != Some(LINK_ALIAS) {
        tracing::debug!(link = %name, "not removing a link wirespan did not create");
        return Ok(false);
    }
    h.link()
        .del(msg.header.index)
        .execute()
        .await
        .map_err(nl("delete link"))?;
    Ok(true)
}

fn addr_ours(m: &AddressMessage) -> bool {
    m.attributes
        .iter()
        .any(|a| matches!(a, AddressAttribute::Protocol(p) if u8::from(*p) == RTPROT_WIRESPAN))
}

async fn apply_address_in_ns(h: Handle, p: AddressParams) -> Result<bool, RoutingError> {
    use rtnetlink::packet_route::address::AddressProtocol;
    let index = link_index(&h, &p.link).await?;
    let have = link_addresses(&h, index).await?;
    if let Some((_, msg)) = have.iter().find(|(a, _)| *a == p.address) {
        if u8::from(msg.header.scope) == p.scope || !addr_ours(msg) {
            return Ok(false);
        }
        h.address()
            .del(msg.clone())
            .execute()
            .await
            .map_err(nl("delete address"))?;
    }
    let mut req = h
        .address()
        .add(index, p.address.addr(), p.address.prefix_len());
    req.message_mut().header.scope = p.scope.into();
    req.message_mut()
        .attributes
        .push(AddressAttribute::Protocol(AddressProtocol::Other(
            RTPROT_WIRESPAN,
        )));
    match req.execute().await {
        Ok(()) => Ok(true),
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::EEXIST => Ok(false),
        Err(e) => Err(nl("add address")(e)),
    }
}

async fn remove_address_in_ns(h: Handle, p: AddressParams) -> Result<bool, RoutingError> {
    let Some(link) = find_link(&h, &p.link).await? else {
        return Ok(false);
    };
    let mut removed = false;
    for (a, msg) in link_addresses(&h, link.index).await? {
        if a == p.address && addr_ours(&msg) {
            h.address()
                .del(msg)
                .execute()
                .await
                .map_err(nl("delete address"))?;
            removed = true;
        }
    }
    Ok(removed)
}

async fn all_routes(h: &Handle) -> Result<Vec<RouteMessage>, RoutingError> {
    let mut out = Vec::new();
    for msg in [
        RouteMessageBuilder::<Ipv4Addr>::new().build(),
        RouteMessageBuilder::<Ipv6Addr>::new().build(),
    ] {
        let routes: Vec<RouteMessage> = h
            .route()
            .get(msg)
            .execute()
            .try_collect()
            .await
            .map_err(nl("get routes"))?;
        out.extend(routes);
    }
    Ok(out)
}

fn same_route_key(o: &ObservedRoute, p: &RouteParams) -> bool {
    o.destination == p.destination
        && o.gateway == p.gateway
        && o.table == p.table
        && route_metric_eq(p.destination.addr().is_ipv6(), o.metric, p.metric)
}

fn build_route(p: &RouteParams, oif: Option<u32>) -> Result<RouteMessage, RoutingError> {
    let bad =
        |e: &dyn std::fmt::Display| RoutingError::Invalid(Invalid::new("route", e.to_string()));
    let mut b = RouteMessageBuilder::<IpAddr>::new()
        .destination_prefix(p.destination.addr(), p.destination.prefix_len())
        .map_err(|e| bad(&e))?;
    if let Some(g) = p.gateway {
        b = b.gateway(g).map_err(|e| bad(&e))?;
    }
    if let Some(s) = p.source {
        b = b.pref_source(s).map_err(|e| bad(&e))?;
    }
    if let Some(i) = oif {
        b = b.output_interface(i);
    }
    let mut msg = b
        .table_id(p.table)
        .priority(p.metric)
        .protocol(RouteProtocol::Other(RTPROT_WIRESPAN))
        .scope(RouteScope::from(p.scope))
        .kind(route_type_of(p.kind))
        .build();
    if p.mtu != 0 {
        msg.attributes
            .push(RouteAttribute::Metrics(vec![RouteMetric::Mtu(p.mtu)]));
    }
    Ok(msg)
}

async fn apply_route_in_ns(h: Handle, p: RouteParams) -> Result<bool, RoutingError> {
    let oif = if p.out_link.is_empty() {
        None
    } else {
        Some(link_index(&h, &p.out_link).await?)
    };
    let routes = all_routes(&h).await?;
    let matching: Vec<(ObservedRoute, u32)> = routes
        .iter()
        .filter_map(|r| observed_route(r).map(|o| (o, route_mtu(r))))
        .filter(|(o, _)| same_route_key(o, &p))
        .collect();
    if let Some((o, _)) = matching
        .iter()
        .find(|(o, _)| !is_ours_proto(o.protocol.into()))
    {
        tracing::warn!(destination = %o.destination, table = o.table,
            "a route wirespan did not create has the same key; leaving it alone");
        return Ok(false);
    }
    let equal = matching.iter().any(|(o, mtu)| {
        o.oif == oif
            && o.source == p.source
            && o.scope == p.scope
            && o.kind == p.kind
            && *mtu == p.mtu
    });
    if equal {
        return Ok(false);
    }
    h.route()
        .add(build_route(&p, oif)?)
        .replace()
        .execute()
        .await
        .map_err(nl("add route"))?;
    Ok(true)
}

async fn remove_route_in_ns(h: Handle, p: RouteParams) -> Result<bool, RoutingError> {
    let mut removed = false;
    for r in all_routes(&h).await? {
        if !is_ours_proto(r.header.protocol) {
            continue;
        }
        if observed_route(&r).is_some_and(|o| same_route_key(&o, &p)) {
            h.route()
                .del(r)
                .execute()
                .await
                .map_err(nl("delete route"))?;
            removed = true;
        }
    }
    Ok(removed)
}

async fn all_rules(h: &Handle) -> Result<Vec<RuleMessage>, RoutingError> {
    let mut out = Vec::new();
    for v in [IpVersion::V4, IpVersion::V6] {
        let rules: Vec<RuleMessage> = h
            .rule()
            .get(v)
            .execute()
            .try_collect()
            .await
            .map_err(nl("get rules"))?;
        out.extend(rules);
    }
    Ok(out)
}

fn rule_equal(o: &ObservedRule, p: &RuleParams) -> bool {
    o.v6 == p.v6
        && o.src == p.src
        && o.dst == p.dst
        && o.table == p.table
        && o.priority == p.priority
        && o.fwmark == p.fwmark
        && o.fwmask == p.fwmask
}

async fn apply_rule_in_ns(h: Handle, p: RuleParams) -> Result<bool, RoutingError> {
    let mut changed = false;
    let mut present = false;
    for r in all_rules(&h).await? {
        let o = observed_rule(&r);
        if o.v6 != p.v6 || o.priority != p.priority {
            continue;
        }
        if rule_equal(&o, &p) {
            present = true;
        } else if o.protocol == RTPROT_WIRESPAN {
            h.rule().del(r).execute().await.map_err(nl("delete rule"))?;
            changed = true;
        }
    }
    if present {
        return Ok(changed);
    }
    let base = h
        .rule()
        .add()
        .priority(p.priority)
        .table_id(p.table)
        .action(RuleAction::ToTable);
    let mut extra = vec![RuleAttribute::Protocol(RouteProtocol::Other(
        RTPROT_WIRESPAN,
    ))];
    if p.fwmark != 0 {
        extra.push(RuleAttribute::FwMark(p.fwmark));
    }
    if p.fwmask != 0 {
        extra.push(RuleAttribute::FwMask(p.fwmask));
    }
    let fill = |m: &mut RuleMessage| {
        m.attributes.extend(extra.iter().cloned());
        if let Some(s) = p.src {
            m.header.src_len = s.prefix_len();
            m.attributes.push(RuleAttribute::Source(s.addr()));
        }
        if let Some(d) = p.dst {
            m.header.dst_len = d.prefix_len();
            m.attributes.push(RuleAttribute::Destination(d.addr()));
        }
    };
    let res = if p.v6 {
        let mut req = base.v6();
        fill(req.message_mut());
        req.execute().await
    } else {
        let mut req = base.v4();
        fill(req.message_mut());
        req.execute().await
    };
    res.map_err(nl("add rule"))?;
    Ok(true)
}

async fn remove_rule_in_ns(h: Handle, p: RuleParams) -> Result<bool, RoutingError> {
    let mut removed = false;
    for r in all_rules(&h).await? {
        let o = observed_rule(&r);
        if o.v6 == p.v6 && o.priority == p.priority && o.protocol == RTPROT_WIRESPAN {
            h.rule().del(r).execute().await.map_err(nl("delete rule"))?;
            removed = true;
        }
    }
    Ok(removed)
}

async fn state_in_ns(h: Handle) -> Result<NetworkState, RoutingError> {
    let links: Vec<_> = h
        .link()
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(nl("get links"))?;
    let addrs: Vec<AddressMessage> = h
        .address()
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(nl("get addresses"))?;
    Ok(NetworkState {
        links: links.iter().map(observed_link).collect(),
        addresses: addrs
            .iter()
            .filter_map(|m| {
                addr_of(m).map(|address| ObservedAddress {
                    link_index: m.header.index,
                    address,
                    scope: u8::from(m.header.scope),
                    ours: addr_ours(m),
                })
            })
            .collect(),
        routes: all_routes(&h)
            .await?
            .iter()
            .filter_map(observed_route)
            .collect(),
        rules: all_rules(&h).await?.iter().map(observed_rule).collect(),
    })
}

impl NetlinkRouting {
    fn run_op<T, Fut>(
        &mut self,
        f: impl FnOnce(Handle) -> Fut + Send + 'static,
    ) -> Result<T, RoutingError>
    where
        T: Send + 'static,
        Fut: std::future::Future<Output = Result<T, RoutingError>> + 'static,
    {
        let h = self.handle.clone();
        self.thread.block_on(move || f(h))?
    }

    fn count(&mut self, wrote: bool) -> bool {
        if wrote {
            self.writes += 1;
        }
        wrote
    }
}

impl NetworkConfig for NetlinkRouting {
    fn apply_link(&mut self, p: &LinkParams) -> Result<bool, RoutingError> {
        check_ifname("name", &p.name)?;
        let p = p.clone();
        let w = self.run_op(move |h| apply_link_in_ns(h, p))?;
        Ok(self.count(w))
    }

    fn remove_link(&mut self, name: &str) -> Result<bool, RoutingError> {
        let n = name.to_owned();
        let w = self.run_op(move |h| remove_link_in_ns(h, n))?;
        Ok(self.count(w))
    }

    fn apply_address(&mut self, p: &AddressParams) -> Result<bool, RoutingError> {
        let p = p.clone();
        let w = self.run_op(move |h| apply_address_in_ns(h, p))?;
        Ok(self.count(w))
    }

    fn remove_address(&mut self, p: &AddressParams) -> Result<bool, RoutingError> {
        let p = p.clone();
        let w = self.run_op(move |h| remove_address_in_ns(h, p))?;
        Ok(self.count(w))
    }

    fn apply_route(&mut self, p: &RouteParams) -> Result<bool, RoutingError> {
        let p = p.clone();
        let w = self.run_op(move |h| apply_route_in_ns(h, p))?;
        Ok(self.count(w))
    }

    fn remove_route(&mut self, p: &RouteParams) -> Result<bool, RoutingError> {
        let p = p.clone();
        let w = self.run_op(move |h| remove_route_in_ns(h, p))?;
        Ok(self.count(w))
    }

    fn apply_rule(&mut self, p: &RuleParams) -> Result<bool, RoutingError> {
        let p = p.clone();
        let w = self.run_op(move |h| apply_rule_in_ns(h, p))?;
        Ok(self.count(w))
    }

    fn remove_rule(&mut self, p: &RuleParams) -> Result<bool, RoutingError> {
        let p = p.clone();
        let w = self.run_op(move |h| remove_rule_in_ns(h, p))?;
        Ok(self.count(w))
    }

    fn state(&mut self) -> Result<NetworkState, RoutingError> {
        self.run_op(state_in_ns)
    }
}
