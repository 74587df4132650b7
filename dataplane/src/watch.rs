//! A netlink watcher: a [`Stream`] of typed link, address, route and policy-rule
//! changes in one namespace (rules: IPv4 and IPv6, so a rule deleted from outside is
//! noticed and repaired), optionally preceded by a dump of the current state (so a status
//! controller can build its view from the stream alone).
//!
//! The netlink socket is opened on a dedicated thread inside the namespace; it
//! subscribes before dumping, so no change between dump and stream is lost (a change
//! may be reported twice, which level-triggered consumers absorb). Dropping the
//! [`Watcher`] stops the thread.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    pin::Pin,
    task::{Context, Poll},
    thread::JoinHandle,
};

use futures::{
    channel::{mpsc, oneshot},
    Stream, StreamExt, TryStreamExt,
};
use ipnet::IpNet;
use rtnetlink::{
    packet_core::NetlinkPayload,
    packet_route::{
        address::{AddressAttribute, AddressMessage},
        link::{LinkAttribute, LinkFlags, LinkMessage, State},
        route::{RouteAddress, RouteAttribute, RouteMessage},
        rule::{RuleAttribute, RuleMessage},
        AddressFamily, RouteNetlinkMessage,
    },
    MulticastGroup, RouteMessageBuilder,
};

use crate::netns::Netns;

/// Whether an object appeared (or changed) or went away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// New or updated.
    Updated,
    /// Removed.
    Removed,
}

/// One typed change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetEvent {
    /// A link.
    Link {
        /// Updated or removed.
        change: Change,
        /// ifindex.
        index: u32,
        /// Name.
        name: String,
        /// Administratively up.
        up: bool,
        /// Operational state up (or unknown, as for tun devices with a reader).
        oper_up: bool,
        /// MTU.
        mtu: u32,
    },
    /// An address.
    Address {
        /// Updated or removed.
        change: Change,
        /// ifindex.
        index: u32,
        /// Address and prefix length.
        address: IpNet,
    },
    /// A route.
    Route {
        /// Updated or removed.
        change: Change,
        /// Table.
        table: u32,
        /// Destination.
        destination: IpNet,
        /// Output interface.
        oif: Option<u32>,
        /// Route protocol.
        protocol: u8,
        /// Route priority (`ip route`'s metric).
        priority: u32,
    },
    /// A policy rule.
    Rule {
        /// Updated or removed.
        change: Change,
        /// IPv6 rule.
        v6: bool,
        /// Priority.
        priority: u32,
        /// Table looked up.
        table: u32,
        /// Protocol.
        protocol: u8,
    },
}

fn rule_event(change: Change, m: &RuleMessage) -> NetEvent {
    let mut ev = (0, u32::from(m.header.table), 0);
    for a in &m.attributes {
        match a {
            RuleAttribute::Priority(p) => ev.0 = *p,
            RuleAttribute::Table(t) => ev.1 = *t,
            RuleAttribute::Protocol(p) => ev.2 = u8::from(*p),
            _ => {}
        }
    }
    NetEvent::Rule {
        change,
        v6: m.header.family == AddressFamily::Inet6,
        priority: ev.0,
        table: ev.1,
        protocol: ev.2,
    }
}

fn link_event(change: Change, m: &LinkMessage) -> NetEvent {
    let mut name = String::new();
    let mut mtu = 0;
    let mut oper = State::Unknown;
    for a in &m.attributes {
        match a {
            LinkAttribute::IfName(n) => name.clone_from(n),
            LinkAttribute::Mtu(v) => mtu = *v,
            LinkAttribute::OperState(s) => oper = *s,
            _ => {}
        }
    }
    NetEvent::Link {
        change,
        index: m.header.index,
        name,
        up: m.header.flags.contains(LinkFlags::Up),
        oper_up: matches!(oper, State::Up | State::Unknown)
            && m.header.flags.contains(LinkFlags::LowerUp),
        mtu,
    }
}

fn address_event(change: Change, m: &AddressMessage) -> Option<NetEvent> {
    let pick = |local: bool| {
        m.attributes.iter().find_map(|a| match a {
            AddressAttribute::Local(ip) if local => Some(*ip),
            AddressAttribute::Address(ip) if !local => Some(*ip),
            _ => None,
        })
    };
    let ip = pick(true).or_else(|| pick(false))?;
    Some(NetEvent::Address {
        change,
        index: m.header.index,
        address: IpNet::new(ip, m.header.prefix_len).ok()?,
    })
}

fn route_event(change: Change, m: &RouteMessage) -> Option<NetEvent> {
    let mut table = u32::from(m.header.table);
    let mut dst: Option<IpAddr> = None;
    let mut oif = None;
    let mut priority = 0;
    for a in &m.attributes {
        match a {
            RouteAttribute::Table(t) => table = *t,
            RouteAttribute::Destination(RouteAddress::Inet(ip)) => dst = Some((*ip).into()),
            RouteAttribute::Destination(RouteAddress::Inet6(ip)) => dst = Some((*ip).into()),
            RouteAttribute::Oif(i) => oif = Some(*i),
            RouteAttribute::Priority(p) => priority = *p,
            _ => {}
        }
    }
    let dst = match (dst, m.header.address_family) {
        (Some(d), _) => d,
        (None, rtnetlink::packet_route::AddressFamily::Inet) => Ipv4Addr::UNSPECIFIED.into(),
        (None, rtnetlink::packet_route::AddressFamily::Inet6) => Ipv6Addr::UNSPECIFIED.into(),
        _ => return None,
    };
    Some(NetEvent::Route {
        change,
        table,
        destination: IpNet::new(dst, m.header.destination_prefix_length).ok()?,
        oif,
        protocol: u8::from(m.header.protocol),
        priority,
    })
}

/// Converts one netlink notification to an event (`None` for anything else).
#[must_use]
pub fn to_event(msg: &RouteNetlinkMessage) -> Option<NetEvent> {
    match msg {
        RouteNetlinkMessage::NewLink(m) => Some(link_event(Change::Updated, m)),
        RouteNetlinkMessage::DelLink(m) => Some(link_event(Change::Removed, m)),
        RouteNetlinkMessage::NewAddress(m) => address_event(Change::Updated, m),
        RouteNetlinkMessage::DelAddress(m) => address_event(Change::Removed, m),
        RouteNetlinkMessage::NewRoute(m) => route_event(Change::Updated, m),
        RouteNetlinkMessage::DelRoute(m) => route_event(Change::Removed, m),
        RouteNetlinkMessage::NewRule(m) => Some(rule_event(Change::Updated, m)),
        RouteNetlinkMessage::DelRule(m) => Some(rule_event(Change::Removed, m)),
        _ => None,
    }
}

/// A stream of [`NetEvent`]s from one namespace.
#[derive(Debug)]
pub struct Watcher {
    events: mpsc::UnboundedReceiver<NetEvent>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Watcher {
    /// Starts watching `netns`. With `dump`, the current links, addresses and routes
    /// are emitted first as [`Change::Updated`].
    ///
    /// # Errors
    /// The namespace cannot be entered or the socket not opened.
    pub fn start(netns: &Netns, dump: bool) -> std::io::Result<Self> {
        let file = netns.path().map(std::fs::File::open).transpose()?;
        let (tx, rx) = mpsc::unbounded();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<std::io::Result<()>>();
        let thread = std::thread::Builder::new()
            .name("netlink-watch".into())
            .spawn(move || {
                let setup = (|| {
                    if let Some(f) = &file {
                        nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET)?;
                    }
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                })();
                let rt = match setup {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                rt.block_on(run(tx, stop_rx, dump, ready_tx));
            })?;
        ready_rx
            .recv()
            .map_err(|_| std::io::Error::other("watcher thread died during setup"))??;
        Ok(Self {
            events: rx,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }
}

async fn run(
    tx: mpsc::UnboundedSender<NetEvent>,
    stop: oneshot::Receiver<()>,
    dump: bool,
    ready: std::sync::mpsc::Sender<std::io::Result<()>>,
) {
    let groups = [
        MulticastGroup::Link,
        MulticastGroup::Ipv4Ifaddr,
        MulticastGroup::Ipv6Ifaddr,
        MulticastGroup::Ipv4Route,
        MulticastGroup::Ipv6Route,
        MulticastGroup::Ipv4Rule,
        MulticastGroup::Ipv6Rule,
    ];
    let (conn, handle, mut messages) = match rtnetlink::new_multicast_connection(&groups) {
        Ok(c) => c,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    tokio::spawn(conn);
    let _ = ready.send(Ok(()));
    if dump {
        let send = |e: Option<NetEvent>| {
            if let Some(e) = e {
                let _ = tx.unbounded_send(e);
            }
        };
        let mut links = handle.link().get().execute();
        while let Ok(Some(m)) = links.try_next().await {
            send(Some(link_event(Change::Updated, &m)));
        }
        let mut addrs = handle.address().get().execute();
        while let Ok(Some(m)) = addrs.try_next().await {
            send(address_event(Change::Updated, &m));
        }
        for req in [
            RouteMessageBuilder::<Ipv4Addr>::new().build(),
            RouteMessageBuilder::<Ipv6Addr>::new().build(),
        ] {
            let mut routes = handle.route().get(req).execute();
            while let Ok(Some(m)) = routes.try_next().await {
                send(route_event(Change::Updated, &m));
            }
        }
    }
    let forward = async {
        while let Some((msg, _)) = messages.next().await {
            if let NetlinkPayload::InnerMessage(inner) = msg.payload {
                if let Some(ev) = to_event(&inner) {
                    if tx.unbounded_send(ev).is_err() {
                        return;
                    }
                }
            }
        }
    };
    tokio::select! {
        () = forward => {}
        _ = stop => {}
    }
}

impl Stream for Watcher {
    type Item = NetEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<NetEvent>> {
        self.events.poll_next_unpin(cx)
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
