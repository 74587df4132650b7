//! Routes: decoding route messages, the mesh's default routes, and single routes of
//! the per-object configuration.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use futures::TryStreamExt;
use ipnet::IpNet;
use rtnetlink::{
    packet_route::{
        route::{
            RouteAddress, RouteAttribute, RouteMessage, RouteMetric, RouteProtocol, RouteScope,
            RouteType,
        },
        AddressFamily,
    },
    Handle, RouteMessageBuilder,
};

use super::{
    error::nl,
    link::link_index,
    owner::{is_mesh_proto, is_ours_proto, RTPROT_WIRESPAN},
    ObservedRoute, RouteKind, RouteParams, RoutingError, RoutingSpec,
};
use crate::error::Invalid;

pub(super) fn route_table(r: &RouteMessage) -> u32 {
    r.attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(r.header.table))
}

pub(super) fn route_dst(r: &RouteMessage) -> Option<IpNet> {
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

pub(super) fn route_u32(
    r: &RouteMessage,
    f: impl Fn(&RouteAttribute) -> Option<u32>,
) -> Option<u32> {
    r.attributes.iter().find_map(f)
}

pub(super) fn route_mtu(r: &RouteMessage) -> u32 {
    route_u32(r, |a| match a {
        RouteAttribute::Metrics(m) => m.iter().find_map(|m| match m {
            RouteMetric::Mtu(v) => Some(*v),
            _ => None,
        }),
        _ => None,
    })
    .unwrap_or_default()
}

pub(super) fn route_addr(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(ip) => Some(IpAddr::V4(*ip)),
        RouteAddress::Inet6(ip) => Some(IpAddr::V6(*ip)),
        _ => None,
    }
}

pub(super) fn route_priority_eq(v6: bool, a: u32, b: u32) -> bool {
    let norm = |m: u32| if v6 && m == 0 { 1024 } else { m };
    norm(a) == norm(b)
}

pub(super) fn route_kind_of(t: RouteType) -> Option<RouteKind> {
    match t {
        RouteType::Unicast => Some(RouteKind::Unicast),
        RouteType::BlackHole => Some(RouteKind::Blackhole),
        RouteType::Unreachable => Some(RouteKind::Unreachable),
        RouteType::Prohibit => Some(RouteKind::Prohibit),
        _ => None,
    }
}

pub(super) fn route_type_of(k: RouteKind) -> RouteType {
    match k {
        RouteKind::Unicast => RouteType::Unicast,
        RouteKind::Blackhole => RouteType::BlackHole,
        RouteKind::Unreachable => RouteType::Unreachable,
        RouteKind::Prohibit => RouteType::Prohibit,
    }
}

/// The mesh's routes: marked 211 and in the mesh table (an older wirespan marked the
/// routes of network documents 211 too; those are elsewhere).
pub(super) async fn mesh_routes(h: &Handle) -> Result<Vec<RouteMessage>, RoutingError> {
    let mut routes = all_routes(h).await?;
    routes.retain(|r| is_mesh_proto(r.header.protocol));
    Ok(routes)
}

pub(super) async fn all_routes(h: &Handle) -> Result<Vec<RouteMessage>, RoutingError> {
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

pub(super) fn observed_route(r: &RouteMessage) -> Option<ObservedRoute> {
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
        priority: route_u32(r, |a| match a {
            RouteAttribute::Priority(p) => Some(*p),
            _ => None,
        })
        .unwrap_or_default(),
        scope: u8::from(r.header.scope),
        kind,
        protocol: u8::from(r.header.protocol),
    })
}

pub(super) fn desired_route(spec: &RoutingSpec, index: u32, v6: bool) -> RouteMessage {
    let mut msg = if v6 {
        RouteMessageBuilder::<Ipv6Addr>::new()
            .destination_prefix(Ipv6Addr::UNSPECIFIED, 0)
            .output_interface(index)
            .table_id(spec.table)
            .priority(spec.route_priority)
            .protocol(RouteProtocol::Other(RTPROT_WIRESPAN))
            .scope(RouteScope::Universe)
            .kind(RouteType::Unicast)
            .build()
    } else {
        RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(Ipv4Addr::UNSPECIFIED, 0)
            .output_interface(index)
            .table_id(spec.table)
            .priority(spec.route_priority)
            .protocol(RouteProtocol::Other(RTPROT_WIRESPAN))
            .scope(RouteScope::Universe)
            .kind(RouteType::Unicast)
            .build()
    };
    msg.attributes
        .push(RouteAttribute::Metrics(vec![RouteMetric::Mtu(spec.mtu)]));
    msg
}

pub(super) fn route_matches(r: &RouteMessage, spec: &RoutingSpec, index: u32) -> bool {
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
            == spec.route_priority
        && route_mtu(r) == spec.mtu
}

pub(super) fn same_route_key(o: &ObservedRoute, p: &RouteParams) -> bool {
    o.destination == p.destination
        && o.gateway == p.gateway
        && o.table == p.table
        && route_priority_eq(p.destination.addr().is_ipv6(), o.priority, p.priority)
}

pub(super) fn build_route(p: &RouteParams, oif: Option<u32>) -> Result<RouteMessage, RoutingError> {
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
        .priority(p.priority)
        .protocol(RouteProtocol::from(p.owner.protocol()))
        .scope(RouteScope::from(p.scope))
        .kind(route_type_of(p.kind))
        .build();
    if p.mtu != 0 {
        msg.attributes
            .push(RouteAttribute::Metrics(vec![RouteMetric::Mtu(p.mtu)]));
    }
    Ok(msg)
}

pub(super) async fn apply_route_in_ns(h: Handle, p: RouteParams) -> Result<bool, RoutingError> {
    let oif = if p.out_link_name.is_empty() {
        None
    } else {
        Some(link_index(&h, &p.out_link_name).await?)
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
            && o.protocol == p.owner.protocol()
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

pub(super) async fn remove_route_in_ns(h: Handle, p: RouteParams) -> Result<bool, RoutingError> {
    delete_routes(&h, |r| {
        is_ours_proto(r.header.protocol)
            && observed_route(r).is_some_and(|o| same_route_key(&o, &p))
    })
    .await
}

/// Deletes the routes exactly as `o` (marker included) if `o` carries a wirespan marker.
pub(super) async fn remove_marked_route_in_ns(
    h: Handle,
    o: ObservedRoute,
) -> Result<bool, RoutingError> {
    if !is_ours_proto(o.protocol.into()) {
        return Ok(false);
    }
    delete_routes(&h, |r| observed_route(r).as_ref() == Some(&o)).await
}

/// Deletes the routes (any table) that `pick` names; whether any was.
async fn delete_routes(
    h: &Handle,
    pick: impl Fn(&RouteMessage) -> bool,
) -> Result<bool, RoutingError> {
    let mut removed = false;
    for r in all_routes(h).await? {
        if pick(&r) {
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
