//! Converging the mesh's whole [`RoutingSpec`]: link MTU and up state, the link's
//! addresses, our default routes and our fwmark rules ([`Routing`] for
//! [`NetlinkRouting`]).

use ipnet::IpNet;
use rtnetlink::{
    packet_route::{
        route::{RouteAttribute, RouteMessage},
        rule::RuleAttribute,
        AddressFamily,
    },
    Handle, LinkUnspec,
};

use super::{
    address::link_addresses,
    error::nl,
    link::find_link,
    route::{
        desired_route, mesh_routes, route_dst, route_matches, route_mtu, route_table, route_u32,
    },
    rule::{add_rule, mesh_rules, rule_field, rule_matches, rule_table},
    NetlinkRouting, Routing, RoutingChanges, RoutingError, RoutingSpec, RoutingStatus,
};

/// The mesh's routes in `spec`'s table and, when it moved, in the `previous` one.
async fn mesh_routes_of(
    h: &Handle,
    spec: &RoutingSpec,
    previous: Option<(u32, u32)>,
) -> Result<Vec<RouteMessage>, RoutingError> {
    let mut routes = mesh_routes(h, spec.table).await?;
    if let Some((table, _)) = previous.filter(|(t, _)| *t != spec.table) {
        routes.extend(mesh_routes(h, table).await?);
    }
    Ok(routes)
}

/// `previous` is the (table, priority) of the last apply: when the spec moves the mesh
/// to another table or priority, the objects at the old ones are stale too.
async fn apply_in_ns(
    h: Handle,
    spec: RoutingSpec,
    previous: Option<(u32, u32)>,
) -> Result<RoutingChanges, RoutingError> {
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
    let routes = mesh_routes_of(&h, &spec, previous).await?;
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
        mesh_routes_of(&h, &spec, previous).await?
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
    let mut rules = mesh_rules(&h, spec.table, spec.priority).await?;
    if let Some((table, priority)) = previous.filter(|p| *p != (spec.table, spec.priority)) {
        for r in mesh_rules(&h, table, priority).await? {
            if !rules.contains(&r) {
                rules.push(r);
            }
        }
    }
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

async fn observe_in_ns(
    h: Handle,
    name: String,
    table: u32,
    priority: u32,
) -> Result<RoutingStatus, RoutingError> {
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
    for r in mesh_rules(&h, table, priority).await? {
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
    for r in mesh_routes(&h, table).await? {
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

async fn teardown_in_ns(h: Handle, table: u32, priority: u32) -> Result<u64, RoutingError> {
    let mut n = 0;
    for r in mesh_routes(&h, table).await? {
        h.route()
            .del(r)
            .execute()
            .await
            .map_err(nl("delete route"))?;
        n += 1;
    }
    for r in mesh_rules(&h, table, priority).await? {
        h.rule().del(r).execute().await.map_err(nl("delete rule"))?;
        n += 1;
    }
    Ok(n)
}

impl Routing for NetlinkRouting {
    fn apply(&mut self, spec: &RoutingSpec) -> Result<RoutingChanges, RoutingError> {
        spec.validate()?;
        let (h, s, previous) = (self.handle.clone(), spec.clone(), self.applied);
        let ch = self
            .thread
            .block_on(move || apply_in_ns(h, s, previous))??;
        self.applied = Some((spec.table, spec.priority));
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
        let (t, p) = self
            .applied
            .unwrap_or((crate::ROUTE_TABLE, crate::RULE_PRIORITY));
        self.thread.block_on(move || observe_in_ns(h, l, t, p))?
    }

    fn teardown(&mut self, table: u32, priority: u32) -> Result<(), RoutingError> {
        let h = self.handle.clone();
        let n = self
            .thread
            .block_on(move || teardown_in_ns(h, table, priority))??;
        self.writes += n;
        Ok(())
    }

    fn writes(&self) -> u64 {
        self.writes
    }
}
