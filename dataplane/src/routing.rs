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
