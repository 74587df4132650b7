//! [`NetlinkRouting`]: an rtnetlink handle on a thread inside the target namespace,
//! and its per-object [`NetworkConfig`] (the mesh's [`super::Routing`] is in `mesh`).

use futures::TryStreamExt;
use rtnetlink::{packet_route::address::AddressMessage, Handle};

use super::{
    address::{
        apply_address_in_ns, observed_address, remove_address_in_ns, remove_marked_address_in_ns,
    },
    error::nl,
    link::{apply_link_in_ns, observed_link, remove_link_in_ns},
    route::{
        all_routes, apply_route_in_ns, observed_route, remove_marked_route_in_ns,
        remove_route_in_ns,
    },
    rule::{
        all_rules, apply_rule_in_ns, observed_rule, remove_marked_rule_in_ns, remove_rule_in_ns,
    },
    AddressParams, LinkParams, MarkedObject, NetworkConfig, NetworkState, RouteParams,
    RoutingError, RuleParams,
};
use crate::{
    error::check_ifname,
    netns::{Netns, NetnsThread},
};

/// Routing through rtnetlink, on a thread inside the target namespace.
#[derive(Debug)]
pub struct NetlinkRouting {
    pub(super) thread: NetnsThread,
    pub(super) handle: Handle,
    pub(super) writes: u64,
}

impl NetlinkRouting {
    /// Opens a netlink connection inside `netns`.
    ///
    /// # Errors
    /// The namespace cannot be entered or the socket not opened.
    pub fn new(netns: &Netns) -> Result<Self, RoutingError> {
        let thread = NetnsThread::spawn(netns)?;
        let handle = thread.block_on(|| async {
            let (conn, handle, _) = rtnetlink::new_connection()?;
            tokio::spawn(conn);
            Ok::<_, std::io::Error>(handle)
        })??;
        Ok(Self {
            thread,
            handle,
            writes: 0,
        })
    }

    fn run_op<T, Fut>(
        &mut self,
        f: impl FnOnce(Handle) -> Fut + Send + 'static,
    ) -> Result<T, RoutingError>
    where
        T: Send + 'static,
        Fut: std::future::Future<Output = Result<T, RoutingError>> + 'static,
    {
        let h = self.handle.clone();
        self.thread.block_on(move || f(h))?
    }

    fn count(&mut self, wrote: bool) -> bool {
        if wrote {
            self.writes += 1;
        }
        wrote
    }
}

async fn state_in_ns(h: Handle) -> Result<NetworkState, RoutingError> {
    let links: Vec<_> = h
        .link()
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(nl("get links"))?;
    let addrs: Vec<AddressMessage> = h
        .address()
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(nl("get addresses"))?;
    // This runs on the namespace's thread: the socket, and so ethtool's answers,
    // are of the same namespace as the dump.
    let sock = std::net::UdpSocket::bind("0.0.0.0:0").ok();
    let links = links
        .iter()
        .map(|m| {
            let mut l = observed_link(m);
            if let Some(sock) = &sock {
                let e = super::ethtool::info(sock, &l.name);
                (l.driver, l.speed_mbps, l.duplex) = (e.driver, e.speed_mbps, e.duplex);
            }
            l
        })
        .collect();
    Ok(NetworkState {
        links,
        addresses: addrs.iter().filter_map(observed_address).collect(),
        routes: all_routes(&h)
            .await?
            .iter()
            .filter_map(observed_route)
            .collect(),
        rules: all_rules(&h).await?.iter().map(observed_rule).collect(),
    })
}

impl NetworkConfig for NetlinkRouting {
    fn apply_link(&mut self, p: &LinkParams) -> Result<bool, RoutingError> {
        check_ifname("name", &p.name)?;
        let p = p.clone();
        let w = self.run_op(move |h| apply_link_in_ns(h, p))?;
        Ok(self.count(w))
    }

    fn remove_link(&mut self, name: &str) -> Result<bool, RoutingError> {
        let n = name.to_owned();
        let w = self.run_op(move |h| remove_link_in_ns(h, n))?;
        Ok(self.count(w))
    }

    fn apply_address(&mut self, p: &AddressParams) -> Result<bool, RoutingError> {
        let p = p.clone();
        let w = self.run_op(move |h| apply_address_in_ns(h, p))?;
        Ok(self.count(w))
    }

    fn remove_address(&mut self, p: &AddressParams) -> Result<bool, RoutingError> {
        let p = p.clone();
        let w = self.run_op(move |h| remove_address_in_ns(h, p))?;
        Ok(self.count(w))
    }

    fn apply_route(&mut self, p: &RouteParams) -> Result<bool, RoutingError> {
        let p = p.clone();
        let w = self.run_op(move |h| apply_route_in_ns(h, p))?;
        Ok(self.count(w))
    }

    fn remove_route(&mut self, p: &RouteParams) -> Result<bool, RoutingError> {
        let p = p.clone();
        let w = self.run_op(move |h| remove_route_in_ns(h, p))?;
        Ok(self.count(w))
    }

    fn apply_rule(&mut self, p: &RuleParams) -> Result<bool, RoutingError> {
        let p = p.clone();
        let w = self.run_op(move |h| apply_rule_in_ns(h, p))?;
        Ok(self.count(w))
    }

    fn remove_rule(&mut self, p: &RuleParams) -> Result<bool, RoutingError> {
        let p = p.clone();
        let w = self.run_op(move |h| remove_rule_in_ns(h, p))?;
        Ok(self.count(w))
    }

    fn remove_marked(&mut self, o: &MarkedObject) -> Result<bool, RoutingError> {
        let w = match o.clone() {
            MarkedObject::Route(r) => self.run_op(move |h| remove_marked_route_in_ns(h, r))?,
            MarkedObject::Rule(r) => self.run_op(move |h| remove_marked_rule_in_ns(h, r))?,
            MarkedObject::Address(a) => self.run_op(move |h| remove_marked_address_in_ns(h, a))?,
            // Only a link with wirespan's alias is deleted (`remove_link_in_ns`).
            MarkedObject::Link(n) => self.run_op(move |h| remove_link_in_ns(h, n))?,
        };
        Ok(self.count(w))
    }

    fn state(&mut self) -> Result<NetworkState, RoutingError> {
        self.run_op(state_in_ns)
    }
}
