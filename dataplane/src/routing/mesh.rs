//! Converging the mesh's whole [`RoutingSpec`]: link MTU and up state, the link's
//! addresses, our default routes and our fwmark rules ([`Routing`] for
//! [`NetlinkRouting`]).

use ipnet::IpNet;
use rtnetlink::{
    packet_route::{route::RouteAttribute, rule::RuleAttribute, AddressFamily},
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

/// Every mesh-marked (211) rule and route is the mesh's, whatever its table or
/// priority: one that does not match the spec is stale, also when an earlier run used
/// another table or priority.
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
    let routes = mesh_routes(&h).await?;
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
        mesh_routes(&h).await?
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
    let rules = mesh_rules(&h).await?;
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
    for r in mesh_rules(&h).await? {
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
    for r in mesh_routes(&h).await? {
        if let Some(dst) = route_dst(&r) {
            let priority = route_u32(&r, |a| match a {
                RouteAttribute::Priority(p) => Some(*p),
                _ => None,
            })
            .unwrap_or_default();
            st.routes
                .push((dst, route_table(&r), priority, route_mtu(&r)));
        }
    }
    Ok(st)
}

async fn teardown_in_ns(h: Handle) -> Result<u64, RoutingError> {
    let mut n = 0;
    for r in mesh_routes(&h).await? {
        h.route()
            .del(r)
            .execute()
            .await
            .map_err(nl("delete route"))?;
        n += 1;
    }
    for r in mesh_rules(&h).await? {
        h.rule().del(r).execute().await.map_err(nl("delete rule"))?;
        n += 1;
    }
    Ok(n)
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
