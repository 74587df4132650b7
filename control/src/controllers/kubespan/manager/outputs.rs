//! What the manager writes to the store besides driving the kernel: peer statuses,
//! harvested endpoints (§9), the manager status, and the link, address, routes and
//! rules as operator-layer network specs (§8.2 step 7). Each write is suppressed when
//! it would not change what was last written; outputs left by an earlier incarnation
//! are adopted, so a restart neither rewrites nor leaks them.

use std::collections::BTreeSet;

use ipnet::{IpNet, Ipv6Net};

use super::KubeSpanManagerController;
use crate::{
    config::kubespan::{FastPath, KubeSpanConfigDocument as Settings},
    kubespan::{peer_status::PeerStatus, peers::harvest, relay::DIRECT_DOWN_MAX},
    resources::{
        kubespan::{
            KubeSpanEndpoint, KubeSpanEndpointSpec, KubeSpanManagerStatus, KubeSpanPeerStatus,
            KubeSpanPeerStatusSpec, PeerState, KUBESPAN, NS,
        },
        network::{
            AddressSpec, ConfigLayer, Family, LinkSpec, RouteSpec, RouteType, RoutingRuleSpec,
            Scope, NS_CONFIG,
        },
    },
    runtime::{ControllerError, ControllerRuntime, Pointer, ResourceKind},
};

impl KubeSpanManagerController {
    /// Destroys every output this controller wrote (the mesh is disabled).
    pub(super) fn destroy_outputs(
        &mut self,
        rt: &mut ControllerRuntime,
    ) -> Result<(), ControllerError> {
        for id in std::mem::take(&mut self.written.statuses).keys() {
            rt.destroy(&Pointer::new(NS, KubeSpanPeerStatus::TYPE, id))?;
        }
        for id in std::mem::take(&mut self.written.endpoints).keys() {
            rt.destroy(&Pointer::new(NS, KubeSpanEndpoint::TYPE, id))?;
        }
        for (ty, id) in std::mem::take(&mut self.written.specs) {
            rt.destroy(&Pointer::new(NS_CONFIG, ty, &id))?;
        }
        if rt.get_opt::<KubeSpanManagerStatus>(NS, KUBESPAN)?.is_some() {
            rt.destroy(&Pointer::new(NS, KubeSpanManagerStatus::TYPE, KUBESPAN))?;
        }
        Ok(())
    }

    /// Reads what a previous incarnation of this controller left in the store.
    pub(super) fn adopt_outputs(&mut self, rt: &ControllerRuntime) -> Result<(), ControllerError> {
        let name = rt.name().to_owned();
        for r in rt.list::<KubeSpanPeerStatus>(NS)? {
            self.written
                .statuses
                .insert(r.metadata.id.clone(), PeerStatus::from(&r.spec));
            self.mesh.adopt_status(&r.metadata.id, &r.spec);
        }
        for r in rt.list::<KubeSpanEndpoint>(NS)? {
            self.written
                .endpoints
                .insert(r.metadata.id.clone(), r.spec.clone());
        }
        macro_rules! adopt {
            ($k:ty) => {
                for r in rt.list::<$k>(NS_CONFIG)? {
                    if r.metadata.owner == name {
                        self.written
                            .specs
                            .insert((<$k>::TYPE, r.metadata.id.clone()));
                    }
                }
            };
        }
        adopt!(LinkSpec);
        adopt!(AddressSpec);
        adopt!(RouteSpec);
        adopt!(RoutingRuleSpec);
        Ok(())
    }

    pub(super) fn write_network_specs(
        &mut self,
        rt: &mut ControllerRuntime,
        s: &Settings,
        address: Option<IpNet>,
    ) -> Result<(), ControllerError> {
        let mut want: BTreeSet<(&'static str, String)> = BTreeSet::new();
        let layer = ConfigLayer::Operator;
        let link = s.link_name.clone();
        let id = operator_id(&link);
        rt.modify::<LinkSpec>(NS_CONFIG, &id, |r| {
            r.spec.name.clone_from(&link);
            r.spec.logical = false;
            r.spec.up = true;
            r.spec.mtu = s.mtu;
            r.spec.kind = String::new();
            r.spec.layer = layer;
        })?;
        want.insert((LinkSpec::TYPE, id));
        if let Some(IpNet::V6(a)) = address {
            let on_link = IpNet::V6(Ipv6Net::new(a.addr(), 64).unwrap_or(a));
            let spec = crate::resources::network::AddressSpecSpec {
                address: Some(on_link),
                link_name: link.clone(),
                scope: Scope::Global,
                layer,
            };
            let id = operator_id(&spec.key());
            rt.modify::<AddressSpec>(NS_CONFIG, &id, |r| r.spec.clone_from(&spec))?;
            want.insert((AddressSpec::TYPE, id));
        }
        for family in [Family::Inet4, Family::Inet6] {
            let route = crate::resources::network::RouteSpecSpec {
                family,
                destination: None,
                source: None,
                gateway: None,
                out_link_name: link.clone(),
                table: s.routing_table,
                priority: 1,
                scope: Scope::Global,
                r#type: RouteType::Unicast,
                mtu: s.mtu,
                layer,
            };
            let id = operator_id(&route.key());
            rt.modify::<RouteSpec>(NS_CONFIG, &id, |r| r.spec.clone_from(&route))?;
            want.insert((RouteSpec::TYPE, id));
            let rule = crate::resources::network::RoutingRuleSpecSpec {
                family,
                src: None,
                dst: None,
                table: s.routing_table,
                priority: s.rule_priority,
                fw_mark: s.route_mark,
                fw_mask: s.mark_mask,
                layer,
            };
            let id = operator_id(&rule.key());
            rt.modify::<RoutingRuleSpec>(NS_CONFIG, &id, |r| r.spec.clone_from(&rule))?;
            want.insert((RoutingRuleSpec::TYPE, id));
        }
        for (ty, id) in self.written.specs.difference(&want) {
            rt.destroy(&Pointer::new(NS_CONFIG, *ty, id))?;
        }
        self.written.specs = want;
        Ok(())
    }

    /// Writes a peer's status if it changed, or destroys it when the peer is gone.
    pub(super) fn write_status(
        &mut self,
        rt: &mut ControllerRuntime,
        key: &str,
    ) -> Result<(), ControllerError> {
        match self.mesh.status(key) {
            Some(st) => {
                if self.written.statuses.get(key) != Some(st) {
                    let spec = KubeSpanPeerStatusSpec::from(st);
                    rt.modify::<KubeSpanPeerStatus>(NS, key, |r| r.spec.clone_from(&spec))?;
                    self.written.statuses.insert(key.to_owned(), st.clone());
                }
            }
            None => {
                if self.written.statuses.remove(key).is_some() {
                    rt.destroy(&Pointer::new(NS, KubeSpanPeerStatus::TYPE, key))?;
                }
            }
        }
        Ok(())
    }

    /// Publishes or withdraws a peer's harvested endpoint (§9).
    pub(super) fn write_harvested(
        &mut self,
        rt: &mut ControllerRuntime,
        s: &Settings,
        key: &str,
    ) -> Result<(), ControllerError> {
        let want = s
            .harvest_extra_endpoints
            .then(|| {
                let spec = self.mesh.spec(key)?;
                let st = self.mesh.status(key)?;
                harvest(std::iter::once((
                    key,
                    spec.node_id.as_str(),
                    st.state == PeerState::Up,
                    st.endpoint,
                )))
                .pop()
            })
            .flatten()
            .map(|h| KubeSpanEndpointSpec {
                affiliate_id: h.node_id,
                endpoint: Some(h.endpoint),
            });
        match want {
            Some(e) => {
                if self.written.endpoints.get(key) != Some(&e) {
                    rt.modify::<KubeSpanEndpoint>(NS, key, |r| r.spec.clone_from(&e))?;
                    self.written.endpoints.insert(key.to_owned(), e);
                }
            }
            None => {
                if self.written.endpoints.remove(key).is_some() {
                    rt.destroy(&Pointer::new(NS, KubeSpanEndpoint::TYPE, key))?;
                }
            }
        }
        Ok(())
    }

    pub(super) fn write_manager_status(
        &self,
        rt: &mut ControllerRuntime,
        s: &Settings,
    ) -> Result<(), ControllerError> {
        let (in_use, note) = self
            .kernel
            .marking
            .as_ref()
            .map_or((s.fast_path, ""), |m| (m.in_use, m.note.as_str()));
        let note = self.kernel.refused.as_deref().unwrap_or(note);
        let (relay_offered, relay_note) = self.relay_offer(s);
        let direct_down = self.mesh.direct_down().unwrap_or_default().to_vec();
        let wireguard = self.kernel.wg.as_ref().map_or("", |w| w.backend());
        if let Some(metrics) = self.deps.metrics.as_ref().filter(|_| !wireguard.is_empty()) {
            metrics.set_wireguard(wireguard);
        }
        rt.modify::<KubeSpanManagerStatus>(NS, KUBESPAN, |r| {
            r.spec.link_name.clone_from(&s.link_name);
            wireguard.clone_into(&mut r.spec.wireguard);
            r.spec.fast_path = match in_use {
                FastPath::Nftables => "nftables".to_owned(),
                FastPath::Ebpf => "ebpf".to_owned(),
            };
            r.spec.peers = self.mesh.peer_count();
            note.clone_into(&mut r.spec.note);
            r.spec.relay_offered = relay_offered;
            r.spec.relay_note.clone_from(&relay_note);
            r.spec.direct_down.clone_from(&direct_down);
            r.spec.server_relay_wanted = self.mesh.server_wanted().to_vec();
        })?;
        Ok(())
    }

    /// Whether this node forwards for others, and why not when relays are on but it
    /// does not.
    pub(super) fn relay_offer(&self, s: &Settings) -> (bool, String) {
        if !s.peer_relay {
            return (false, String::new());
        }
        if self.mesh.direct_down().is_none() {
            return (
                false,
                format!("more than {DIRECT_DOWN_MAX} peers are not reachable directly"),
            );
        }
        let Some(sysctl) = &self.deps.sysctl else {
            return (true, String::new());
        };
        let on = |path: &[&str]| sysctl.read(path).is_ok_and(|v| v == "1");
        if on(&["net", "ipv4", "ip_forward"]) && on(&["net", "ipv6", "conf", "all", "forwarding"]) {
            (true, String::new())
        } else {
            (
                false,
                "IP forwarding is off (net.ipv4.ip_forward, net.ipv6.conf.all.forwarding)"
                    .to_owned(),
            )
        }
    }
}

/// The id of an operator-layer network spec for `key`.
fn operator_id(key: &str) -> String {
    format!("{}/{key}", ConfigLayer::Operator.prefix())
}
