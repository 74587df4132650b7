//! The network config controller: `LinkConfig`, `AddressConfig`, `RouteConfig`,
//! `RoutingRuleConfig`, `HostnameConfig`, `ResolverConfig` and `TimeServerConfig`
//! documents of `config/MachineConfig active` become
//! `network-config/*Spec configuration/<key>` (tracked: a removed document removes its
//! spec).

use futures::future::BoxFuture;

use crate::{
    config::{
        host::{HostnameConfig, ResolverConfig, TimeServerConfig},
        network::{AddressConfig, LinkConfig, RouteConfig, RoutingRuleConfig},
    },
    resources::{
        config::MachineConfig,
        network::{
            AddressSpec, AddressSpecSpec, ConfigLayer, Family, HostnameSpec, HostnameSpecSpec,
            LinkSpec, LinkSpecSpec, ResolverSpec, ResolverSpecSpec, RouteSpec, RouteSpecSpec,
            RouteType, RoutingRuleSpec, RoutingRuleSpecSpec, Scope, TimeServerSpec,
            TimeServerSpecSpec, NS_CONFIG,
        },
    },
    runtime::{
        Action, Controller, ControllerResult, ControllerRuntime, Input, Kind, Output, ResourceKind,
    },
};

const LAYER: ConfigLayer = ConfigLayer::Configuration;

fn raw_id(key: &str) -> String {
    format!("{}/{key}", LAYER.prefix())
}

/// Specs of the network documents of one config.
#[derive(Debug, Default, PartialEq)]
pub struct NetworkSpecs {
    /// Links.
    pub links: Vec<LinkSpecSpec>,
    /// Addresses.
    pub addresses: Vec<AddressSpecSpec>,
    /// Routes.
    pub routes: Vec<RouteSpecSpec>,
    /// Rules.
    pub rules: Vec<RoutingRuleSpecSpec>,
    /// The host name, when a `HostnameConfig` asks for one.
    pub hostname: Option<HostnameSpecSpec>,
    /// The resolvers, when a `ResolverConfig` asks for them.
    pub resolvers: Option<ResolverSpecSpec>,
    /// The time servers, when a `TimeServerConfig` asks for them.
    pub time_servers: Option<TimeServerSpecSpec>,
}

/// The spec of a `HostnameConfig` document.
#[must_use]
pub fn hostname_spec(h: &HostnameConfig) -> HostnameSpecSpec {
    let (hostname, domainname) = h.split();
    HostnameSpecSpec {
        hostname,
        domainname,
        write_etc_hostname: h.write_etc_hostname,
        layer: LAYER,
    }
}

/// The spec of a `ResolverConfig` document.
#[must_use]
pub fn resolver_spec(r: &ResolverConfig) -> ResolverSpecSpec {
    ResolverSpecSpec {
        dns_servers: r.nameservers.clone(),
        search_domains: r.search_domains.clone(),
        layer: LAYER,
    }
}

/// The spec of a `TimeServerConfig` document.
#[must_use]
pub fn time_server_spec(t: &TimeServerConfig) -> TimeServerSpecSpec {
    TimeServerSpecSpec {
        ntp_servers: t.servers.clone(),
        layer: LAYER,
    }
}

/// The spec of a `LinkConfig` document.
#[must_use]
pub fn link_spec(l: &LinkConfig) -> LinkSpecSpec {
    LinkSpecSpec {
        name: l.name.clone(),
        logical: l.link_kind.is_some(),
        up: l.up.unwrap_or(true),
        mtu: l.mtu.unwrap_or(0),
        kind: l.link_kind.clone().unwrap_or_default(),
        layer: LAYER,
    }
}

/// The spec of an `AddressConfig` document.
#[must_use]
pub fn address_spec(a: &AddressConfig) -> AddressSpecSpec {
    AddressSpecSpec {
        address: a.address,
        link_name: a.link.clone(),
        scope: a.scope,
        layer: LAYER,
    }
}

/// The spec of a `RouteConfig` document.
#[must_use]
pub fn route_spec(r: &RouteConfig) -> RouteSpecSpec {
    RouteSpecSpec {
        family: if r.is_v6() {
            Family::Inet6
        } else {
            Family::Inet4
        },
        destination: r.programmed_destination(),
        source: r.source,
        gateway: r.gateway,
        out_link_name: r.out_link_name.clone(),
        table: r.table_or_main(),
        priority: r.priority_or_default(),
        scope: if r.gateway.is_none() && r.destination.is_some_and(|d| d.prefix_len() != 0) {
            Scope::Link
        } else {
            Scope::Global
        },
        r#type: RouteType::Unicast,
        mtu: r.mtu.unwrap_or(0),
        layer: LAYER,
    }
}

/// The spec of a `RoutingRuleConfig` document.
#[must_use]
pub fn rule_spec(r: &RoutingRuleConfig) -> RoutingRuleSpecSpec {
    RoutingRuleSpecSpec {
        family: if r.is_v6() {
            Family::Inet6
        } else {
            Family::Inet4
        },
        src: r.src,
        dst: r.dst,
        table: r.table,
        priority: r.priority,
        fw_mark: r.fw_mark,
        fw_mask: r.fw_mask,
        layer: LAYER,
    }
}

/// Pure mapping of documents to configuration-layer specs.
#[must_use]
pub fn specs(cfg: &crate::config::ConfigDocuments) -> NetworkSpecs {
    NetworkSpecs {
        links: cfg.documents_of::<LinkConfig>().map(link_spec).collect(),
        addresses: cfg
            .documents_of::<AddressConfig>()
            .map(address_spec)
            .collect(),
        routes: cfg.documents_of::<RouteConfig>().map(route_spec).collect(),
        rules: cfg
            .documents_of::<RoutingRuleConfig>()
            .map(rule_spec)
            .collect(),
        hostname: cfg.singleton::<HostnameConfig>().map(hostname_spec),
        resolvers: cfg.singleton::<ResolverConfig>().map(resolver_spec),
        time_servers: cfg.singleton::<TimeServerConfig>().map(time_server_spec),
    }
}

/// Writes configuration-layer network specs (Shared outputs).
#[derive(Debug, Default)]
pub struct NetworkConfigController;

impl Controller for NetworkConfigController {
    type Event = ();

    fn name(&self) -> &str {
        "NetworkConfigController"
    }

    fn inputs(&self) -> Vec<Input> {
        vec![MachineConfig::input()]
    }

    fn outputs(&self) -> Vec<Output> {
        vec![
            Output::shared::<LinkSpec>(),
            Output::shared::<AddressSpec>(),
            Output::shared::<RouteSpec>(),
            Output::shared::<RoutingRuleSpec>(),
            Output::shared::<HostnameSpec>(),
            Output::shared::<ResolverSpec>(),
            Output::shared::<TimeServerSpec>(),
        ]
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let cfg = MachineConfig::active(rt)?;
            let s = cfg.map(|c| specs(&c.spec.config)).unwrap_or_default();
            rt.start_tracking_outputs()?;
            for spec in s.links {
                rt.modify::<LinkSpec>(NS_CONFIG, &raw_id(&spec.key()), |r| {
                    r.spec = spec.clone();
                })?;
            }
            for spec in s.addresses {
                rt.modify::<AddressSpec>(NS_CONFIG, &raw_id(&spec.key()), |r| {
                    r.spec = spec.clone();
                })?;
            }
            for spec in s.routes {
                rt.modify::<RouteSpec>(NS_CONFIG, &raw_id(&spec.key()), |r| {
                    r.spec = spec.clone();
                })?;
            }
            for spec in s.rules {
                rt.modify::<RoutingRuleSpec>(NS_CONFIG, &raw_id(&spec.key()), |r| {
                    r.spec = spec.clone();
                })?;
            }
            if let Some(spec) = s.hostname {
                rt.modify::<HostnameSpec>(NS_CONFIG, &raw_id(&spec.key()), |r| {
                    r.spec = spec.clone();
                })?;
            }
            if let Some(spec) = s.resolvers {
                rt.modify::<ResolverSpec>(NS_CONFIG, &raw_id(&spec.key()), |r| {
                    r.spec = spec.clone();
                })?;
            }
            if let Some(spec) = s.time_servers {
                rt.modify::<TimeServerSpec>(NS_CONFIG, &raw_id(&spec.key()), |r| {
                    r.spec = spec.clone();
                })?;
            }
            rt.cleanup_outputs(&[
                Kind::new(NS_CONFIG, HostnameSpec::TYPE),
                Kind::new(NS_CONFIG, ResolverSpec::TYPE),
                Kind::new(NS_CONFIG, TimeServerSpec::TYPE),
                Kind::new(NS_CONFIG, LinkSpec::TYPE),
                Kind::new(NS_CONFIG, AddressSpec::TYPE),
                Kind::new(NS_CONFIG, RouteSpec::TYPE),
                Kind::new(NS_CONFIG, RoutingRuleSpec::TYPE),
            ])?;
            Ok(Action::await_change())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{network::TABLE_MAIN, ConfigDocument as _};

    /// Config validation rejects two documents with one merge key; the key must be the
    /// id the spec is written under, or duplicates would slip through (or be invented).
    #[test]
    fn merge_keys_of_documents_are_the_ids_of_their_specs() {
        let routes = [
            RouteConfig {
                destination: Some("10.0.0.0/8".parse().unwrap()),
                gateway: Some("10.0.0.1".parse().unwrap()),
                ..RouteConfig::default()
            },
            RouteConfig {
                destination: Some("::/0".parse().unwrap()),
                out_link_name: "eth0".into(),
                table: Some(100),
                priority: Some(7),
                ..RouteConfig::default()
            },
            RouteConfig {
                gateway: Some("10.0.0.1".parse().unwrap()),
                table: Some(TABLE_MAIN),
                ..RouteConfig::default()
            },
        ];
        for r in &routes {
            assert_eq!(r.merge_key().unwrap().1, route_spec(r).key(), "{r:?}");
        }
        let a = AddressConfig {
            link: "eth0".into(),
            address: Some("fd00::1/64".parse().unwrap()),
            ..AddressConfig::default()
        };
        assert_eq!(a.merge_key().unwrap().1, address_spec(&a).key());
        let rule = RoutingRuleConfig {
            priority: 100,
            ipv6: true,
            ..RoutingRuleConfig::default()
        };
        assert_eq!(rule.merge_key().unwrap().1, rule_spec(&rule).key());
    }
}
