//! The status controller (`docs/runtime.md` §4.5): publishes what the kernel has as
//! `LinkStatus <name>`, `AddressStatus <link>/<prefix>`, `RouteStatus <route key>` and
//! `RoutingRuleStatus <family>/<priority>`, re-read on every netlink event (and every
//! 30 s). Routes of the local table (255) are left out.

use std::{collections::HashMap, time::Duration};

use futures::future::BoxFuture;
use wirespan_dataplane::routing::NetworkState;

use super::{route_type_of, scope_of, Deps};
use crate::{
    resources::network::{
        AddressStatus, AddressStatusSpec, Family, LinkStatus, LinkStatusSpec, RouteSpecSpec,
        RouteStatus, RouteStatusSpec, RoutingRuleStatus, RoutingRuleStatusSpec, NS,
    },
    runtime::{
        Action, Controller, ControllerError, ControllerResult, ControllerRuntime, Input, Kind,
        Output, ResourceKind, Triggers,
    },
};

/// Resync period: a round this long after the last one when nothing woke it.
const RESYNC: Duration = Duration::from_secs(30);
/// The kernel's local routing table.
const TABLE_LOCAL: u32 = 255;

/// Statuses computed from one kernel snapshot, by id.
#[derive(Debug, Default, PartialEq)]
pub struct Statuses {
    /// Links.
    pub links: Vec<(String, LinkStatusSpec)>,
    /// Addresses.
    pub addresses: Vec<(String, AddressStatusSpec)>,
    /// Routes.
    pub routes: Vec<(String, RouteStatusSpec)>,
    /// Rules.
    pub rules: Vec<(String, RoutingRuleStatusSpec)>,
}

/// `IFF_*` bits by the names `ip link` prints (`IFF_RUNNING` included, which `ip`
/// leaves out).
const LINK_FLAGS: [(u32, &str); 19] = [
    (1 << 0, "UP"),
    (1 << 1, "BROADCAST"),
    (1 << 2, "DEBUG"),
    (1 << 3, "LOOPBACK"),
    (1 << 4, "POINTOPOINT"),
    (1 << 5, "NOTRAILERS"),
    (1 << 6, "RUNNING"),
    (1 << 7, "NOARP"),
    (1 << 8, "PROMISC"),
    (1 << 9, "ALLMULTI"),
    (1 << 10, "MASTER"),
    (1 << 11, "SLAVE"),
    (1 << 12, "MULTICAST"),
    (1 << 13, "PORTSEL"),
    (1 << 14, "AUTOMEDIA"),
    (1 << 15, "DYNAMIC"),
    (1 << 16, "LOWER_UP"),
    (1 << 17, "DORMANT"),
    (1 << 18, "ECHO"),
];

/// The names of the set `IFF_*` bits, in bit order.
#[must_use]
pub fn link_flag_names(flags: u32) -> Vec<String> {
    LINK_FLAGS
        .iter()
        .filter(|(bit, _)| flags & bit != 0)
        .map(|(_, n)| (*n).to_owned())
        .collect()
}

/// The names of the set `IFA_F_*` bits, in bit order, as `ip addr` prints them (bit
/// 0 is `temporary` on IPv6 and `secondary` on IPv4).
#[must_use]
pub fn address_flag_names(flags: u32, ipv6: bool) -> Vec<String> {
    let names: [(u32, &str); 12] = [
        (0x01, if ipv6 { "temporary" } else { "secondary" }),
        (0x02, "nodad"),
        (0x04, "optimistic"),
        (0x08, "dadfailed"),
        (0x10, "home"),
        (0x20, "deprecated"),
        (0x40, "tentative"),
        (0x80, "permanent"),
        (0x100, "mngtmpaddr"),
        (0x200, "noprefixroute"),
        (0x400, "autojoin"),
        (0x800, "stable-privacy"),
    ];
    names
        .iter()
        .filter(|(bit, _)| flags & bit != 0)
        .map(|(_, n)| (*n).to_owned())
        .collect()
}

/// Pure mapping of a kernel snapshot to statuses.
#[must_use]
pub fn statuses(st: &NetworkState) -> Statuses {
    let names: HashMap<u32, &str> = st
        .links
        .iter()
        .map(|l| (l.index, l.name.as_str()))
        .collect();
    let mut out = Statuses::default();
    for l in &st.links {
        out.links.push((
            l.name.clone(),
            LinkStatusSpec {
                name: l.name.clone(),
                index: l.index,
                kind: l.kind.clone(),
                r#type: l.link_type.clone(),
                up: l.up,
                oper_state: l.oper_state.clone(),
                carrier: l.carrier,
                mtu: l.mtu,
                hardware_addr: l.hardware_addr.clone(),
                perm_hardware_addr: l.perm_hardware_addr.clone(),
                flags: link_flag_names(l.flags),
                master_index: l.master_index,
                qdisc: l.qdisc.clone(),
                driver: l.driver.clone(),
                speed_mbps: l.speed_mbps,
                duplex: l.duplex.clone(),
                physical: l.kind.is_empty() && l.link_type != "loopback",
            },
        ));
    }
    for a in &st.addresses {
        let Some(link) = names.get(&a.link_index) else {
            continue;
        };
        out.addresses.push((
            format!("{link}/{}", a.address),
            AddressStatusSpec {
                address: Some(a.address),
                link_name: (*link).to_owned(),
                link_index: a.link_index,
                family: Family::of(a.address.addr()),
                scope: scope_of(a.scope),
                local: a.local,
                broadcast: a.broadcast,
                flags: address_flag_names(a.flags, a.address.addr().is_ipv6()),
            },
        ));
    }
    for r in st.routes.iter().filter(|r| r.table != TABLE_LOCAL) {
        let family = Family::of(r.destination.addr());
        let spec = RouteStatusSpec {
            family,
            destination: (r.destination.prefix_len() != 0).then_some(r.destination),
            source: r.source,
            gateway: r.gateway,
            out_link_name: r
                .oif
                .and_then(|i| names.get(&i))
                .map(|n| (*n).to_owned())
                .unwrap_or_default(),
            table: r.table,
            priority: r.priority,
            scope: scope_of(r.scope),
            r#type: route_type_of(r.kind),
            protocol: r.protocol,
        };
        let key = RouteSpecSpec {
            family,
            destination: spec.destination,
            gateway: spec.gateway,
            out_link_name: spec.out_link_name.clone(),
            table: spec.table,
            priority: spec.priority,
            ..RouteSpecSpec::default()
        }
        .key();
        out.routes.push((key, spec));
    }
    for r in &st.rules {
        let family = if r.v6 { Family::Inet6 } else { Family::Inet4 };
        out.rules.push((
            crate::config::network::rule_key(r.v6, r.priority),
            RoutingRuleStatusSpec {
                family,
                src: r.src,
                dst: r.dst,
                table: r.table,
                priority: r.priority,
                fw_mark: r.fw_mark,
                fw_mask: r.fw_mask,
                protocol: r.protocol,
            },
        ));
    }
    out
}

/// Publishes kernel state (no inputs; netlink-triggered; tracked outputs).
#[derive(Debug)]
pub struct NetworkStatusController {
    deps: Deps,
}

impl NetworkStatusController {
    /// A controller reading `deps.net`, woken by `deps.feed`.
    #[must_use]
    pub fn new(deps: Deps) -> Self {
        Self { deps }
    }
}

impl Controller for NetworkStatusController {
    type Event = ();

    fn name(&self) -> &str {
        "NetworkStatusController"
    }

    fn inputs(&self) -> Vec<Input> {
        Vec::new()
    }

    fn outputs(&self) -> Vec<Output> {
        vec![
            Output::exclusive::<LinkStatus>(),
            // Shared: other controllers may publish external addresses (`docs/runtime.md` §4.5).
            Output::shared::<AddressStatus>(),
            Output::exclusive::<RouteStatus>(),
            Output::exclusive::<RoutingRuleStatus>(),
        ]
    }

    fn start(&mut self, _rt: &mut ControllerRuntime) -> Result<Triggers<()>, ControllerError> {
        let events = self.deps.feed.subscribe().map_err(ControllerError::other)?;
        Ok(Triggers::inputs_only()
            .with_events(events)
            .with_resync(RESYNC))
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            self.round(rt).await?;
            Ok(Action::await_change())
        })
    }
}

impl NetworkStatusController {
    async fn round(&mut self, rt: &mut ControllerRuntime) -> Result<(), ControllerError> {
        let state = super::read_state(&self.deps.net).await?;
        let st = statuses(&state);
        rt.start_tracking_outputs()?;
        for (id, spec) in st.links {
            rt.modify::<LinkStatus>(NS, &id, |r| r.spec = spec.clone())?;
        }
        for (id, spec) in st.addresses {
            rt.modify::<AddressStatus>(NS, &id, |r| r.spec = spec.clone())?;
        }
        for (id, spec) in st.routes {
            rt.modify::<RouteStatus>(NS, &id, |r| r.spec = spec.clone())?;
        }
        for (id, spec) in st.rules {
            rt.modify::<RoutingRuleStatus>(NS, &id, |r| r.spec = spec.clone())?;
        }
        rt.cleanup_outputs(&[
            Kind::new(NS, LinkStatus::TYPE),
            Kind::new(NS, AddressStatus::TYPE),
            Kind::new(NS, RouteStatus::TYPE),
            Kind::new(NS, RoutingRuleStatus::TYPE),
        ])?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_are_named_as_ip_names_them() {
        assert_eq!(
            link_flag_names(0x1_1043),
            ["UP", "BROADCAST", "RUNNING", "MULTICAST", "LOWER_UP"]
        );
        assert_eq!(
            address_flag_names(0x280, false),
            ["permanent", "noprefixroute"]
        );
        assert_eq!(address_flag_names(0x01, true), ["temporary"]);
        assert_eq!(address_flag_names(0x01, false), ["secondary"]);
    }
}
