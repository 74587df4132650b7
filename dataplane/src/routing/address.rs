//! Addresses: reading a link's addresses and adding/removing single ones.

use futures::TryStreamExt;
use ipnet::IpNet;
use rtnetlink::{
    packet_route::address::{AddressAttribute, AddressMessage},
    Handle,
};

use super::{
    error::nl,
    link::{find_link, link_index},
    owner::{addr_ours, addr_proto, RTPROT_WIRESPAN, RTPROT_WIRESPAN_CONFIG},
    AddressParams, ObservedAddress, RoutingError,
};

pub(super) fn addr_of(msg: &AddressMessage) -> Option<IpNet> {
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

pub(super) fn observed_address(m: &AddressMessage) -> Option<ObservedAddress> {
    let mut flags = u32::from(m.header.flags.bits());
    let (mut local, mut broadcast) = (None, None);
    for a in &m.attributes {
        match a {
            AddressAttribute::Local(ip) => local = Some(*ip),
            AddressAttribute::Broadcast(ip) => broadcast = Some(std::net::IpAddr::V4(*ip)),
            AddressAttribute::Flags(f) => flags = f.bits(),
            _ => {}
        }
    }
    addr_of(m).map(|address| ObservedAddress {
        link_index: m.header.index,
        address,
        scope: u8::from(m.header.scope),
        // IPv6 addresses come with IFA_ADDRESS only, which is then the local one.
        local: local.or(Some(address.addr())),
        broadcast,
        flags,
        ours: addr_ours(m),
        protocol: addr_proto(m).unwrap_or_default(),
    })
}

pub(super) async fn link_addresses(
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

pub(super) async fn apply_address_in_ns(h: Handle, p: AddressParams) -> Result<bool, RoutingError> {
    use rtnetlink::packet_route::address::AddressProtocol;
    let index = link_index(&h, &p.link).await?;
    let have = link_addresses(&h, index).await?;
    if let Some((_, msg)) = have.iter().find(|(a, _)| *a == p.address) {
        let same =
            u8::from(msg.header.scope) == p.scope && addr_proto(msg) == Some(p.owner.protocol());
        if same || !addr_ours(msg) {
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
        .push(AddressAttribute::Protocol(AddressProtocol::from(
            p.owner.protocol(),
        )));
    match req.execute().await {
        Ok(()) => Ok(true),
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::EEXIST => Ok(false),
        Err(e) => Err(nl("add address")(e)),
    }
}

pub(super) async fn remove_address_in_ns(
    h: Handle,
    p: AddressParams,
) -> Result<bool, RoutingError> {
    let Some(link) = find_link(&h, &p.link).await? else {
        return Ok(false);
    };
    delete_addresses(&h, link.index, |a, msg| *a == p.address && addr_ours(msg)).await
}

/// Deletes the address `o` if it is still on its link with the same wirespan marker.
pub(super) async fn remove_marked_address_in_ns(
    h: Handle,
    o: ObservedAddress,
) -> Result<bool, RoutingError> {
    if !matches!(o.protocol, RTPROT_WIRESPAN | RTPROT_WIRESPAN_CONFIG) {
        return Ok(false);
    }
    delete_addresses(&h, o.link_index, |a, msg| {
        *a == o.address && addr_proto(msg) == Some(o.protocol)
    })
    .await
}

/// Deletes the addresses of link `index` that `pick` names; whether any was.
async fn delete_addresses(
    h: &Handle,
    index: u32,
    pick: impl Fn(&IpNet, &AddressMessage) -> bool,
) -> Result<bool, RoutingError> {
    let mut removed = false;
    for (a, msg) in link_addresses(h, index).await? {
        if pick(&a, &msg) {
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
