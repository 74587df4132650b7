//! Policy rules: decoding rule messages, the mesh's fwmark rules, and single rules of
//! the per-object configuration.

use futures::TryStreamExt;
use ipnet::IpNet;
use rtnetlink::{
    packet_route::{
        route::RouteProtocol,
        rule::{RuleAction, RuleAttribute, RuleMessage},
        AddressFamily,
    },
    Handle, IpVersion,
};

use super::{
    error::nl,
    owner::{is_mesh_proto, is_ours_proto, RTPROT_WIRESPAN},
    ObservedRule, RoutingError, RoutingSpec, RuleParams,
};

pub(super) fn rule_table(r: &RuleMessage) -> u32 {
    r.attributes
        .iter()
        .find_map(|a| match a {
            RuleAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(r.header.table))
}

pub(super) fn rule_field(
    r: &RuleMessage,
    f: impl Fn(&RuleAttribute) -> Option<u32>,
) -> Option<u32> {
    r.attributes.iter().find_map(f)
}

pub(super) fn rule_net(r: &RuleMessage, src: bool) -> Option<IpNet> {
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

/// The mesh's rules: marked 211 and at the mesh's priority or looking up its table
/// (an older wirespan marked the rules of network documents 211 too).
pub(super) async fn mesh_rules(h: &Handle) -> Result<Vec<RuleMessage>, RoutingError> {
    let mut rules = all_rules(h).await?;
    rules.retain(|r| {
        r.attributes
            .iter()
            .any(|a| matches!(a, RuleAttribute::Protocol(p) if is_mesh_proto(*p)))
    });
    Ok(rules)
}

pub(super) async fn all_rules(h: &Handle) -> Result<Vec<RuleMessage>, RoutingError> {
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

pub(super) fn observed_rule(r: &RuleMessage) -> ObservedRule {
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
        fw_mark: rule_field(r, |a| match a {
            RuleAttribute::FwMark(p) => Some(*p),
            _ => None,
        })
        .unwrap_or_default(),
        fw_mask: rule_field(r, |a| match a {
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

pub(super) fn rule_matches(r: &RuleMessage, spec: &RoutingSpec) -> bool {
    let v6 = r.header.family == AddressFamily::Inet6;
    let want_family = if v6 { spec.ipv6 } else { spec.ipv4 };
    want_family
        && r.header.action == RuleAction::ToTable
        && rule_table(r) == spec.table
        && rule_field(r, |a| match a {
            RuleAttribute::Priority(p) => Some(*p),
            _ => None,
        }) == Some(spec.rule_priority)
        && rule_field(r, |a| match a {
            RuleAttribute::FwMark(p) => Some(*p),
            _ => None,
        }) == Some(spec.fw_mark)
        && rule_field(r, |a| match a {
            RuleAttribute::FwMask(p) => Some(*p),
            _ => None,
        }) == Some(spec.fw_mask)
}

pub(super) fn rule_equal(o: &ObservedRule, p: &RuleParams) -> bool {
    o.v6 == p.v6
        && o.src == p.src
        && o.dst == p.dst
        && o.table == p.table
        && o.priority == p.priority
        && o.fw_mark == p.fw_mark
        && effective_mask(o.fw_mark, o.fw_mask) == effective_mask(p.fw_mark, p.fw_mask)
}

/// The mask the kernel matches with: a mark given without a mask is matched whole
/// (the kernel stores, and reports back, all ones).
fn effective_mask(fwmark: u32, fwmask: u32) -> u32 {
    if fwmark != 0 && fwmask == 0 {
        u32::MAX
    } else {
        fwmask
    }
}

pub(super) async fn add_rule(h: &Handle, spec: &RoutingSpec, v6: bool) -> Result<(), RoutingError> {
    let base = h
        .rule()
        .add()
        .priority(spec.rule_priority)
        .fw_mark(spec.fw_mark)
        .table_id(spec.table)
        .action(RuleAction::ToTable);
    let extra = [
        RuleAttribute::FwMask(spec.fw_mask),
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

pub(super) async fn apply_rule_in_ns(h: Handle, p: RuleParams) -> Result<bool, RoutingError> {
    let mut changed = false;
    let mut present = false;
    for r in all_rules(&h).await? {
        let o = observed_rule(&r);
        if o.v6 != p.v6 || o.priority != p.priority {
            continue;
        }
        let ours = is_ours_proto(o.protocol.into());
        if rule_equal(&o, &p) && (!ours || o.protocol == p.owner.protocol()) {
            present = true;
        } else if ours {
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
    let mut extra = vec![RuleAttribute::Protocol(RouteProtocol::from(
        p.owner.protocol(),
    ))];
    if p.fw_mark != 0 {
        extra.push(RuleAttribute::FwMark(p.fw_mark));
    }
    if p.fw_mask != 0 {
        extra.push(RuleAttribute::FwMask(p.fw_mask));
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

pub(super) async fn remove_rule_in_ns(h: Handle, p: RuleParams) -> Result<bool, RoutingError> {
    let mut removed = false;
    for r in all_rules(&h).await? {
        let o = observed_rule(&r);
        if o.v6 == p.v6 && o.priority == p.priority && is_ours_proto(o.protocol.into()) {
            h.rule().del(r).execute().await.map_err(nl("delete rule"))?;
            removed = true;
        }
    }
    Ok(removed)
}

/// Deletes the rules exactly as `o` (marker included) if `o` carries a wirespan marker.
pub(super) async fn remove_marked_rule_in_ns(
    h: Handle,
    o: ObservedRule,
) -> Result<bool, RoutingError> {
    if !is_ours_proto(o.protocol.into()) {
        return Ok(false);
    }
    let mut removed = false;
    for r in all_rules(&h).await? {
        if observed_rule(&r) == o {
            h.rule().del(r).execute().await.map_err(nl("delete rule"))?;
            removed = true;
        }
    }
    Ok(removed)
}
