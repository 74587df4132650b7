//! Links: lookup by name, observation, and creating/configuring/removing the
//! logical links wirespan owns.

use futures::TryStreamExt;
use rtnetlink::{
    packet_route::link::{LinkAttribute, LinkFlags, LinkMessage},
    Handle, LinkUnspec,
};

use super::{
    error::nl,
    owner::{link_alias, LINK_ALIAS},
    LinkParams, ObservedLink, RoutingError,
};
use crate::error::Invalid;

/// What the mesh adapter needs of a link.
#[derive(Debug, Clone)]
pub(super) struct Link {
    pub(super) index: u32,
    pub(super) up: bool,
    pub(super) mtu: u32,
}

pub(super) async fn find_link(h: &Handle, name: &str) -> Result<Option<Link>, RoutingError> {
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

pub(super) async fn link_index(h: &Handle, name: &str) -> Result<u32, RoutingError> {
    Ok(find_link(h, name)
        .await?
        .ok_or_else(|| RoutingError::LinkNotFound(name.to_owned()))?
        .index)
}

fn hex_colons(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

pub(super) fn observed_link(msg: &LinkMessage) -> ObservedLink {
    use rtnetlink::packet_route::link::{LinkInfo, LinkLayerType};
    let mut l = ObservedLink {
        index: msg.header.index,
        up: msg.header.flags.contains(LinkFlags::Up),
        flags: msg.header.flags.bits(),
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
            LinkAttribute::Address(hw) => l.hardware_addr = hex_colons(hw),
            LinkAttribute::PermAddress(hw) => l.perm_hardware_addr = hex_colons(hw),
            LinkAttribute::Controller(i) => l.master_index = *i,
            LinkAttribute::Qdisc(q) => l.qdisc.clone_from(q),
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

pub(super) async fn apply_link_in_ns(h: Handle, p: LinkParams) -> Result<bool, RoutingError> {
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

pub(super) async fn remove_link_in_ns(h: Handle, name: String) -> Result<bool, RoutingError> {
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
