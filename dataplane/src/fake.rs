//! In-memory fakes of the adapters, for testing code that drives them (controllers).
//!
//! Each fake is a cheap `Clone` handle on shared state: give one clone to the code
//! under test and keep another to inspect what it applied or to simulate the kernel
//! (a roamed endpoint, a handshake, a failure). They validate exactly as the real
//! adapters do, and count writes the same way (a no-op apply writes nothing).

use ipnet::IpNet;
use std::{
    net::SocketAddr,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::SystemTime,
};

use futures::channel::mpsc;

use crate::{
    marking::{render, Marking, MarkingError, MarkingSpec, MarkingStatus, PrefixDelta, Ruleset},
    routing::{
        AddressParams, LinkParams, MarkedObject, NetworkConfig, NetworkState, ObservedAddress,
        ObservedLink, ObservedRoute, ObservedRule, RouteParams, Routing, RoutingChanges,
        RoutingError, RoutingSpec, RoutingStatus, RuleParams, RTPROT_WIRESPAN,
    },
    watch::NetEvent,
    wireguard::{
        apply_peer_updates, apply_update, diff, diff_peers, index_of, validate_changes, DevicePeer,
        DeviceState, PeerChange, PrivateKey, PublicKey, WgDevice, WgError, WgStatus, WgUpdate,
        WireGuard,
    },
};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Debug, Default)]
struct MarkingInner {
    spec: Option<MarkingSpec>,
    /// Calls of `apply_delta`.
    deltas: u64,
    ruleset: Option<Ruleset>,
    transactions: u64,
    fail_next: Option<String>,
    teardowns: u64,
}

/// Fake nftables marking.
#[derive(Debug, Clone, Default)]
pub struct FakeMarking(Arc<Mutex<MarkingInner>>);

impl FakeMarking {
    /// An empty fake.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The last successfully applied spec.
    #[must_use]
    pub fn spec(&self) -> Option<MarkingSpec> {
        lock(&self.0).spec.clone()
    }

    /// Makes the next apply fail as nft would (state kept).
    pub fn fail_next(&self, message: &str) {
        lock(&self.0).fail_next = Some(message.to_owned());
    }

    /// How often `apply_delta` was called.
    #[must_use]
    pub fn deltas(&self) -> u64 {
        lock(&self.0).deltas
    }

    /// How often `teardown` was called.
    #[must_use]
    pub fn teardowns(&self) -> u64 {
        lock(&self.0).teardowns
    }

    /// Simulates someone deleting the table.
    pub fn flush(&self) {
        let mut g = lock(&self.0);
        g.ruleset = None;
    }
}

impl Marking for FakeMarking {
    fn apply(&mut self, spec: &MarkingSpec) -> Result<bool, MarkingError> {
        spec.validate()?;
        let mut g = lock(&self.0);
        if let Some(stderr) = g.fail_next.take() {
            return Err(MarkingError::Nft {
                op: "apply",
                stderr,
            });
        }
        let rs = render(spec);
        // A renamed table: the real adapter deletes the old one in its own transaction.
        if g.spec.as_ref().is_some_and(|old| old.table != spec.table) {
            g.transactions += 1;
        }
        g.spec = Some(spec.clone());
        if g.ruleset.as_ref() == Some(&rs) {
            return Ok(false);
        }
        g.ruleset = Some(rs);
        g.transactions += 1;
        Ok(true)
    }

    fn apply_delta(&mut self, delta: &PrefixDelta) -> Result<bool, MarkingError> {
        let spec = {
            let mut g = lock(&self.0);
            g.deltas += 1;
            let last = g.spec.as_ref().ok_or(MarkingError::NotApplied)?;
            delta.applied_to(last)?
        };
        self.apply(&spec)
    }

    fn observe(&mut self) -> Result<MarkingStatus, MarkingError> {
        let g = lock(&self.0);
        Ok(g.ruleset
            .as_ref()
            .map_or_else(MarkingStatus::default, |rs| MarkingStatus {
                present: true,
                elements: rs
                    .sets
                    .iter()
                    .map(|s| (s.name.to_owned(), s.elements.len()))
                    .collect(),
                // The kernel lists a counter for each counting rule; no traffic here.
                counters: rs
                    .chains
                    .iter()
                    .flat_map(|c| &c.rules)
                    .filter(|r| {
                        r.statements
                            .iter()
                            .any(|s| matches!(s, nftables::stmt::Statement::Counter(_)))
                    })
                    .map(|r| (r.comment.clone(), 0, 0))
                    .collect(),
            }))
    }

    fn teardown(&mut self) -> Result<(), MarkingError> {
        let mut g = lock(&self.0);
        g.teardowns += 1;
        if g.ruleset.take().is_some() {
            g.transactions += 1;
        }
        g.spec = None;
        Ok(())
    }

    fn transactions(&self) -> u64 {
        lock(&self.0).transactions
    }
}

#[derive(Debug, Default)]
struct RoutingInner {
    spec: Option<RoutingSpec>,
    /// Rules and routes removed by `teardown`; the link keeps MTU and addresses.
    torn_down: bool,
    missing_links: Vec<String>,
    writes: u64,
}

/// Fake routing: every link exists unless marked missing.
#[derive(Debug, Clone, Default)]
pub struct FakeRouting(Arc<Mutex<RoutingInner>>);

impl FakeRouting {
    /// An empty fake.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The last successfully applied spec.
    #[must_use]
    pub fn spec(&self) -> Option<RoutingSpec> {
        lock(&self.0).spec.clone()
    }

    /// Makes `link` absent (applies naming it fail with `LinkNotFound`) or present.
    pub fn set_link_missing(&self, link: &str, missing: bool) {
        let mut g = lock(&self.0);
        g.missing_links.retain(|l| l != link);
        if missing {
            g.missing_links.push(link.to_owned());
        }
    }
}

impl Routing for FakeRouting {
    fn apply(&mut self, spec: &RoutingSpec) -> Result<RoutingChanges, RoutingError> {
        spec.validate()?;
        let mut g = lock(&self.0);
        if g.missing_links.contains(&spec.link) {
            return Err(RoutingError::LinkNotFound(spec.link.clone()));
        }
        if g.spec.as_ref() == Some(spec) && !g.torn_down {
            return Ok(RoutingChanges::default());
        }
        g.spec = Some(spec.clone());
        g.torn_down = false;
        g.writes += 1;
        Ok(RoutingChanges {
            link: 1,
            ..RoutingChanges::default()
        })
    }

    fn observe(&mut self, link: &str) -> Result<RoutingStatus, RoutingError> {
        let g = lock(&self.0);
        let Some(s) = g.spec.as_ref().filter(|s| s.link == link) else {
            return Ok(RoutingStatus::default());
        };
        Ok(RoutingStatus {
            link_index: Some(1),
            up: true,
            mtu: s.mtu,
            addresses: s.addresses.clone(),
            rules: [(false, s.ipv4), (true, s.ipv6)]
                .into_iter()
                .filter(|(_, on)| *on && !g.torn_down)
                .map(|(v6, _)| (v6, s.rule_priority, s.table))
                .collect(),
            // The default route of each enabled family, as the real adapter reports it.
            routes: [(false, s.ipv4), (true, s.ipv6)]
                .into_iter()
                .filter(|(_, on)| *on && !g.torn_down)
                .map(|(v6, _)| {
                    let default = if v6 {
                        IpNet::V6(ipnet::Ipv6Net::default())
                    } else {
                        IpNet::V4(ipnet::Ipv4Net::default())
                    };
                    (default, s.table, s.route_priority, s.mtu)
                })
                .collect(),
        })
    }

    fn teardown(&mut self) -> Result<(), RoutingError> {
        let mut g = lock(&self.0);
        if g.spec.is_some() && !g.torn_down {
            g.torn_down = true;
            g.writes += 1;
        }
        Ok(())
    }

    fn writes(&self) -> u64 {
        lock(&self.0).writes
    }
}

#[derive(Debug, Default)]
struct WgInner {
    device: Option<DeviceState>,
    writes: u64,
    /// Calls of `apply_peers`.
    peer_applies: u64,
    updates: Vec<WgUpdate>,
    fail_next: Option<i32>,
}

/// Fake WireGuard device.
#[derive(Debug, Clone)]
pub struct FakeWireGuard {
    name: String,
    inner: Arc<Mutex<WgInner>>,
}

impl FakeWireGuard {
    /// A fake device called `name` (absent until the first apply).
    #[must_use]
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            inner: Arc::new(Mutex::new(WgInner::default())),
        }
    }

    /// The device as it is now.
    #[must_use]
    pub fn device(&self) -> Option<DeviceState> {
        lock(&self.inner).device.clone()
    }

    /// How often `apply_peers` (the per-peer delta) was called.
    #[must_use]
    pub fn peer_applies(&self) -> u64 {
        lock(&self.inner).peer_applies
    }

    /// Every update written so far, in order.
    #[must_use]
    pub fn updates(&self) -> Vec<WgUpdate> {
        lock(&self.inner).updates.clone()
    }

    fn with_peer(&self, key: &PublicKey, f: impl FnOnce(&mut DevicePeer)) {
        let mut g = lock(&self.inner);
        if let Some(p) = g
            .device
            .as_mut()
            .and_then(|d| d.peers.iter_mut().find(|p| &p.public_key == key))
        {
            f(p);
        }
    }

    /// Simulates the peer reaching us from `endpoint` (WireGuard roaming).
    pub fn roam(&self, key: &PublicKey, endpoint: SocketAddr) {
        self.with_peer(key, |p| p.endpoint = Some(endpoint));
    }

    /// Simulates a completed handshake and traffic.
    pub fn handshake(&self, key: &PublicKey, at: SystemTime, rx_bytes: u64, tx_bytes: u64) {
        self.with_peer(key, |p| {
            p.last_handshake = Some(at);
            p.rx_bytes = rx_bytes;
            p.tx_bytes = tx_bytes;
        });
    }

    /// Makes the next write fail with `errno` (state kept).
    pub fn fail_next(&self, errno: i32) {
        lock(&self.inner).fail_next = Some(errno);
    }

    /// Simulates the device vanishing (process died, link deleted).
    pub fn vanish(&self) {
        lock(&self.inner).device = None;
    }
}

/// WireGuard keeps allowed IPs in a trie mapping each prefix to one peer: a prefix
/// written for a peer is taken from any other peer holding it, the last write wins.
fn move_allowed_ips(dev: &mut DeviceState, written: &[crate::wireguard::PeerUpdate]) {
    let mut owner = std::collections::HashMap::new();
    for u in written.iter().filter(|u| !u.remove) {
        for ip in u.allowed_ips.iter().flatten() {
            owner.insert(*ip, &u.public_key);
        }
    }
    if owner.is_empty() {
        return;
    }
    for p in &mut dev.peers {
        p.allowed_ips
            .retain(|ip| owner.get(ip).is_none_or(|k| *k == &p.public_key));
    }
}

impl WireGuard for FakeWireGuard {
    fn name(&self) -> &str {
        &self.name
    }

    fn ensure(&mut self) -> Result<(), WgError> {
        lock(&self.inner)
            .device
            .get_or_insert_with(DeviceState::default);
        Ok(())
    }

    fn apply(&mut self, desired: &WgDevice) -> Result<bool, WgError> {
        desired.validate()?;
        self.ensure()?;
        let mut g = lock(&self.inner);
        let current = g.device.clone().unwrap_or_default();
        let up = diff(&current, desired);
        if up.is_empty() {
            return Ok(false);
        }
        if let Some(errno) = g.fail_next.take() {
            return Err(WgError::Refused {
                name: self.name.clone(),
                errno,
            });
        }
        let mut dev = current;
        apply_update(&mut dev, &up);
        move_allowed_ips(&mut dev, &up.peers);
        g.device = Some(dev);
        g.updates.push(up);
        g.writes += 1;
        Ok(true)
    }

    fn apply_peers(&mut self, changes: &[PeerChange]) -> Result<bool, WgError> {
        let mut g = lock(&self.inner);
        g.peer_applies += 1;
        if changes.is_empty() {
            return Ok(false);
        }
        // As the real backends do, a missing device is created first.
        let mut dev = g.device.get_or_insert_with(DeviceState::default).clone();
        let own = dev.private_key.as_ref().map(PrivateKey::public_key);
        validate_changes(own.as_ref(), changes)?;
        let mut index = index_of(&dev);
        let peers = diff_peers(&dev, &index, changes);
        if peers.is_empty() {
            return Ok(false);
        }
        if let Some(errno) = g.fail_next.take() {
            return Err(WgError::Refused {
                name: self.name.clone(),
                errno,
            });
        }
        apply_peer_updates(&mut dev, &mut index, &peers);
        move_allowed_ips(&mut dev, &peers);
        g.device = Some(dev);
        g.updates.push(WgUpdate {
            peers,
            ..WgUpdate::default()
        });
        g.writes += 1;
        Ok(true)
    }

    fn observe(&mut self) -> Result<WgStatus, WgError> {
        Ok(lock(&self.inner)
            .device
            .as_ref()
            .map(WgStatus::from)
            .unwrap_or_default())
    }

    fn teardown(&mut self) -> Result<(), WgError> {
        lock(&self.inner).device = None;
        Ok(())
    }

    fn writes(&self) -> u64 {
        lock(&self.inner).writes
    }

    fn backend(&self) -> &'static str {
        "fake"
    }
}

/// A fake netlink watcher: push events into the sender, consume the stream.
#[must_use]
pub fn watch_channel() -> (
    mpsc::UnboundedSender<NetEvent>,
    mpsc::UnboundedReceiver<NetEvent>,
) {
    mpsc::unbounded()
}

#[derive(Debug, Default)]
struct NetworkInner {
    state: NetworkState,
    next_index: u32,
    writes: u64,
}

/// Fake per-object network configuration with the real adapter's ownership rules:
/// links added with [`FakeNetwork::add_link`] and addresses, routes and rules added
/// with the `add_foreign_*` helpers are "someone else's" and never removed.
#[derive(Debug, Clone)]
pub struct FakeNetwork {
    inner: Arc<Mutex<NetworkInner>>,
    changes: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Default for FakeNetwork {
    fn default() -> Self {
        Self::new()
    }
}

impl FakeNetwork {
    /// A fake with only `lo` (index 1, up).
    #[must_use]
    pub fn new() -> Self {
        let f = Self {
            inner: Arc::new(Mutex::new(NetworkInner {
                next_index: 1,
                ..NetworkInner::default()
            })),
            changes: Arc::new(tokio::sync::watch::channel(0).0),
        };
        f.add_link("lo", "loopback");
        f
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    /// A receiver bumped on every change (like a netlink event).
    #[must_use]
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Adds a foreign (physical) link, up with carrier; returns its index.
    pub fn add_link(&self, name: &str, link_type: &str) -> u32 {
        let idx = {
            let mut g = lock(&self.inner);
            let idx = g.next_index;
            g.next_index += 1;
            g.state.links.push(ObservedLink {
                index: idx,
                name: name.to_owned(),
                link_type: link_type.to_owned(),
                up: true,
                oper_state: "up".to_owned(),
                carrier: true,
                mtu: 1500,
                ..ObservedLink::default()
            });
            idx
        };
        self.changed();
        idx
    }

    /// Changes a link's oper state (`up`, `down`, …).
    pub fn set_oper_state(&self, name: &str, oper: &str) {
        if let Some(l) = lock(&self.inner)
            .state
            .links
            .iter_mut()
            .find(|l| l.name == name)
        {
            oper.clone_into(&mut l.oper_state);
        }
        self.changed();
    }

    /// Adds an address nobody owns (as `ip addr add` would).
    pub fn add_foreign_address(&self, link: &str, address: IpNet, scope: u8) {
        {
            let mut g = lock(&self.inner);
            let Some(idx) = g
                .state
                .links
                .iter()
                .find(|l| l.name == link)
                .map(|l| l.index)
            else {
                return;
            };
            g.state.addresses.push(ObservedAddress {
                link_index: idx,
                address,
                scope,
                local: Some(address.addr()),
                broadcast: None,
                flags: 0x80,
                ours: false,
                protocol: 0,
            });
        }
        self.changed();
    }

    /// Removes a link and everything on it (as `ip link del` would).
    pub fn remove_link_externally(&self, name: &str) {
        {
            let mut g = lock(&self.inner);
            let Some(idx) = g
                .state
                .links
                .iter()
                .find(|l| l.name == name)
                .map(|l| l.index)
            else {
                return;
            };
            g.state.links.retain(|l| l.index != idx);
            g.state.addresses.retain(|a| a.link_index != idx);
            g.state.routes.retain(|r| r.oif != Some(idx));
        }
        self.changed();
    }

    /// A copy of the current state.
    #[must_use]
    pub fn snapshot(&self) -> NetworkState {
        lock(&self.inner).state.clone()
    }

    /// Number of writes so far.
    #[must_use]
    pub fn writes(&self) -> u64 {
        lock(&self.inner).writes
    }

    fn write<T>(&self, f: impl FnOnce(&mut NetworkInner) -> Result<bool, T>) -> Result<bool, T> {
        let wrote = {
            let mut g = lock(&self.inner);
            let w = f(&mut g)?;
            if w {
                g.writes += 1;
            }
            w
        };
        if wrote {
            self.changed();
        }
        Ok(wrote)
    }
}

fn fake_index(g: &NetworkInner, name: &str) -> Result<u32, RoutingError> {
    g.state
        .links
        .iter()
        .find(|l| l.name == name)
        .map(|l| l.index)
        .ok_or_else(|| RoutingError::LinkNotFound(name.to_owned()))
}

fn fake_route_key(o: &ObservedRoute, p: &RouteParams) -> bool {
    let norm = |m: u32| {
        if p.destination.addr().is_ipv6() && m == 0 {
            1024
        } else {
            m
        }
    };
    o.destination == p.destination
        && o.gateway == p.gateway
        && o.table == p.table
        && norm(o.priority) == norm(p.priority)
}

impl NetworkConfig for FakeNetwork {
    fn apply_link(&mut self, p: &LinkParams) -> Result<bool, RoutingError> {
        crate::error::check_ifname("name", &p.name)?;
        self.write(|g| {
            if let Some(l) = g.state.links.iter_mut().find(|l| l.name == p.name) {
                let mut w = false;
                if p.mtu != 0 && l.mtu != p.mtu {
                    l.mtu = p.mtu;
                    w = true;
                }
                if l.up != p.up {
                    l.up = p.up;
                    l.oper_state = if p.up { "unknown" } else { "down" }.to_owned();
                    w = true;
                    if !p.up {
                        // The kernel flushes the routes through a link going down, and
                        // its IPv6 addresses (`keep_addr_on_down` is 0 by default).
                        let idx = l.index;
                        g.state.routes.retain(|r| r.oif != Some(idx));
                        g.state
                            .addresses
                            .retain(|a| a.link_index != idx || a.address.addr().is_ipv4());
                    }
                }
                return Ok(w);
            }
            if !p.logical {
                return Err(RoutingError::LinkNotFound(p.name.clone()));
            }
            if p.kind != "dummy" && p.kind != "bridge" {
                return Err(
                    crate::Invalid::new("kind", format!("cannot create {:?}", p.kind)).into(),
                );
            }
            let idx = g.next_index;
            g.next_index += 1;
            g.state.links.push(ObservedLink {
                index: idx,
                name: p.name.clone(),
                kind: p.kind.clone(),
                link_type: "ether".to_owned(),
                up: p.up,
                oper_state: if p.up { "unknown" } else { "down" }.to_owned(),
                carrier: true,
                mtu: if p.mtu == 0 { 1500 } else { p.mtu },
                ours: true,
                ..ObservedLink::default()
            });
            Ok(true)
        })
    }

    fn remove_link(&mut self, name: &str) -> Result<bool, RoutingError> {
        let ours = lock(&self.inner)
            .state
            .links
            .iter()
            .any(|l| l.name == name && l.ours);
        if ours {
            self.remove_link_externally(name);
            lock(&self.inner).writes += 1;
        }
        Ok(ours)
    }

    fn apply_address(&mut self, p: &AddressParams) -> Result<bool, RoutingError> {
        self.write(|g| {
            let idx = fake_index(g, &p.link)?;
            if let Some(a) = g
                .state
                .addresses
                .iter_mut()
                .find(|a| a.link_index == idx && a.address == p.address)
            {
                if a.scope == p.scope || !a.ours {
                    return Ok(false);
                }
                a.scope = p.scope;
                return Ok(true);
            }
            g.state.addresses.push(ObservedAddress {
                link_index: idx,
                address: p.address,
                scope: p.scope,
                local: Some(p.address.addr()),
                broadcast: None,
                flags: 0x80,
                ours: true,
                protocol: p.owner.protocol(),
            });
            Ok(true)
        })
    }

    fn remove_address(&mut self, p: &AddressParams) -> Result<bool, RoutingError> {
        self.write(|g| {
            let Ok(idx) = fake_index(g, &p.link) else {
                return Ok(false);
            };
            let before = g.state.addresses.len();
            g.state
                .addresses
                .retain(|a| !(a.link_index == idx && a.address == p.address && a.ours));
            Ok(g.state.addresses.len() != before)
        })
    }

    fn apply_route(&mut self, p: &RouteParams) -> Result<bool, RoutingError> {
        self.write(|g| {
            let oif = if p.out_link_name.is_empty() {
                None
            } else {
                Some(fake_index(g, &p.out_link_name)?)
            };
            let want = ObservedRoute {
                destination: p.destination,
                gateway: p.gateway,
                source: p.source,
                oif,
                table: p.table,
                // The kernel stores IPv6 metric 0 as 1024.
                priority: if p.destination.addr().is_ipv6() && p.priority == 0 {
                    1024
                } else {
                    p.priority
                },
                scope: p.scope,
                kind: p.kind,
                protocol: RTPROT_WIRESPAN,
            };
            if let Some(r) = g.state.routes.iter_mut().find(|r| fake_route_key(r, p)) {
                if r.protocol != RTPROT_WIRESPAN || *r == want {
                    return Ok(false);
                }
                *r = want;
                return Ok(true);
            }
            g.state.routes.push(want);
            Ok(true)
        })
    }

    fn remove_route(&mut self, p: &RouteParams) -> Result<bool, RoutingError> {
        self.write(|g| {
            let before = g.state.routes.len();
            g.state
                .routes
                .retain(|r| !(fake_route_key(r, p) && r.protocol == RTPROT_WIRESPAN));
            Ok(g.state.routes.len() != before)
        })
    }

    fn apply_rule(&mut self, p: &RuleParams) -> Result<bool, RoutingError> {
        self.write(|g| {
            let want = ObservedRule {
                v6: p.v6,
                src: p.src,
                dst: p.dst,
                table: p.table,
                priority: p.priority,
                fw_mark: p.fw_mark,
                // The kernel matches a mark without a mask under all ones.
                fw_mask: if p.fw_mark != 0 && p.fw_mask == 0 {
                    u32::MAX
                } else {
                    p.fw_mask
                },
                protocol: RTPROT_WIRESPAN,
            };
            if g.state.rules.contains(&want) {
                return Ok(false);
            }
            g.state.rules.retain(|r| {
                !(r.v6 == p.v6 && r.priority == p.priority && r.protocol == RTPROT_WIRESPAN)
            });
            g.state.rules.push(want);
            Ok(true)
        })
    }

    fn remove_rule(&mut self, p: &RuleParams) -> Result<bool, RoutingError> {
        self.write(|g| {
            let before = g.state.rules.len();
            g.state.rules.retain(|r| {
                !(r.v6 == p.v6 && r.priority == p.priority && r.protocol == RTPROT_WIRESPAN)
            });
            Ok(g.state.rules.len() != before)
        })
    }

    fn remove_marked(&mut self, o: &MarkedObject) -> Result<bool, RoutingError> {
        if let MarkedObject::Link(name) = o {
            return self.remove_link(name);
        }
        self.write(|g| {
            let ours =
                |p: u8| matches!(p, RTPROT_WIRESPAN | crate::routing::RTPROT_WIRESPAN_CONFIG);
            let before = (
                g.state.routes.len(),
                g.state.rules.len(),
                g.state.addresses.len(),
            );
            match o {
                MarkedObject::Route(r) if ours(r.protocol) => g.state.routes.retain(|x| x != r),
                MarkedObject::Rule(r) if ours(r.protocol) => g.state.rules.retain(|x| x != r),
                MarkedObject::Address(a) if ours(a.protocol) => g.state.addresses.retain(|x| {
                    !(x.link_index == a.link_index
                        && x.address == a.address
                        && x.protocol == a.protocol)
                }),
                _ => {}
            }
            Ok(before
                != (
                    g.state.routes.len(),
                    g.state.rules.len(),
                    g.state.addresses.len(),
                ))
        })
    }

    fn state(&mut self) -> Result<NetworkState, RoutingError> {
        Ok(self.snapshot())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wireguard::{PrivateKey, WgPeer};

    #[test]
    fn fake_wireguard_diffs_like_the_real_one() {
        let mut wg = FakeWireGuard::new("ws0");
        let handle = wg.clone();
        let pk = PrivateKey::generate().public_key();
        let dev = WgDevice {
            name: "ws0".into(),
            private_key: PrivateKey::generate(),
            listen_port: 51820,
            fwmark: 0x20,
            peers: vec![WgPeer {
                public_key: pk.clone(),
                preshared_key: None,
                persistent_keepalive: 25,
                endpoint: None,
                allowed_ips: vec!["10.0.0.1/32".parse().unwrap()],
            }],
        };
        assert!(wg.apply(&dev).unwrap());
        assert!(!wg.apply(&dev).unwrap());
        handle.roam(&pk, "192.0.2.1:1".parse().unwrap());
        assert!(!wg.apply(&dev).unwrap(), "roamed endpoint kept");
        handle.fail_next(98);
        let mut d2 = dev;
        d2.listen_port = 1;
        assert!(matches!(
            wg.apply(&d2),
            Err(WgError::Refused { errno: 98, .. })
        ));
        assert_eq!(handle.device().unwrap().listen_port, 51820);
        assert_eq!(wg.writes(), 1);
        let st = wg.observe().unwrap();
        assert_eq!(st.peers[0].endpoint, Some("192.0.2.1:1".parse().unwrap()));
    }

    #[test]
    fn fake_marking_and_routing_count_writes() {
        let mut m = FakeMarking::new();
        let s = MarkingSpec::default();
        assert!(m.apply(&s).unwrap());
        assert!(!m.apply(&s).unwrap());
        m.flush();
        assert!(m.apply(&s).unwrap());
        assert_eq!(m.transactions(), 2);
        assert!(m.apply(&MarkingSpec { mtu: 10, ..s }).is_err());

        let mut r = FakeRouting::new();
        let rs = RoutingSpec::default();
        r.set_link_missing("kubespan", true);
        assert!(matches!(r.apply(&rs), Err(RoutingError::LinkNotFound(_))));
        r.set_link_missing("kubespan", false);
        assert!(!r.apply(&rs).unwrap().is_empty());
        assert!(r.apply(&rs).unwrap().is_empty());
        assert_eq!(r.writes(), 1);
        assert_eq!(r.observe("kubespan").unwrap().rules.len(), 2);
    }
}

/// Fake kernel parameters: a map by dotted name, refusing what `/proc/sys` refuses
/// with the error the real adapter ([`crate::sysctl::ProcSysctl`]) returns: a path
/// that is not plain names, an absent parameter (`ENOENT`), a directory (`EISDIR`: a
/// prefix of a parameter's name), a non-integer to an integer parameter (`EINVAL`),
/// and any write once [`FakeSysctl::refuse_writes`] is on (`EROFS`).
///
/// A parameter is an integer one when its value is whitespace-separated integers.
/// Like the kernel's `proc_dointvec`, a write parses integers from the start of the
/// value (decimal, `0x` hexadecimal or `0` octal, within `i32`), ignores what follows
/// the last one the parameter holds, and changes nothing when the value is blank.
#[derive(Debug, Clone, Default)]
pub struct FakeSysctl(Arc<Mutex<(std::collections::BTreeMap<String, String>, bool)>>);

impl FakeSysctl {
    /// An empty fake.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` (dotted) as if the kernel had it.
    pub fn set(&self, key: &str, value: &str) {
        lock(&self.0).0.insert(key.to_owned(), value.to_owned());
    }

    /// The value of `key` (dotted).
    #[must_use]
    pub fn get(&self, key: &str) -> Option<String> {
        lock(&self.0).0.get(key).cloned()
    }

    /// Makes every write fail as a read-only `/proc/sys` would.
    pub fn refuse_writes(&self, refuse: bool) {
        lock(&self.0).1 = refuse;
    }
}

fn sysctl_io(op: &'static str, key: String, errno: i32) -> crate::sysctl::SysctlError {
    crate::sysctl::SysctlError::Io {
        op,
        key,
        source: std::io::Error::from_raw_os_error(errno),
    }
}

/// The errno `/proc/sys` gives for a name that is not a parameter: `EISDIR` when
/// parameters live under it, `ENOENT` otherwise.
fn absent_errno(map: &std::collections::BTreeMap<String, String>, key: &str) -> i32 {
    let dir = format!("{key}.");
    if map
        .range(dir.clone()..)
        .next()
        .is_some_and(|(k, _)| k.starts_with(&dir))
    {
        libc::EISDIR
    } else {
        libc::ENOENT
    }
}

/// An integer as `proc_dointvec` reads one (base from the prefix, `i32` range).
fn kernel_int(token: &str) -> Option<i32> {
    let (negative, digits) = match token.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, token.strip_prefix('+').unwrap_or(token)),
    };
    let magnitude = if let Some(hex) = digits
        .strip_prefix("0x")
        .or_else(|| digits.strip_prefix("0X"))
    {
        i64::from_str_radix(hex, 16).ok()?
    } else if digits.len() > 1 && digits.starts_with('0') {
        i64::from_str_radix(&digits[1..], 8).ok()?
    } else {
        digits.parse::<i64>().ok()?
    };
    i32::try_from(if negative { -magnitude } else { magnitude }).ok()
}

/// The value an integer parameter holding `old` has after writing `value`, or
/// `None` when the kernel refuses it (`EINVAL`); `old` unchanged for a blank value.
fn integer_write(old: &str, value: &str) -> Option<String> {
    let held = old.split_whitespace().count();
    let given: Vec<&str> = value.split_whitespace().take(held).collect();
    if given.is_empty() {
        return Some(old.to_owned());
    }
    let mut ints = given
        .iter()
        .map(|t| kernel_int(t).map(|i| i.to_string()))
        .collect::<Option<Vec<_>>>()?;
    // Values not given keep theirs.
    ints.extend(old.split_whitespace().skip(ints.len()).map(str::to_owned));
    Some(ints.join("\t"))
}

fn is_integer_value(v: &str) -> bool {
    let mut tokens = v.split_whitespace().peekable();
    tokens.peek().is_some() && tokens.all(|t| kernel_int(t).is_some())
}

impl crate::sysctl::Sysctl for FakeSysctl {
    fn read(&self, path: &[&str]) -> Result<String, crate::sysctl::SysctlError> {
        crate::sysctl::check_path(path)?;
        let key = crate::sysctl::dotted(path);
        let g = lock(&self.0);
        match g.0.get(&key) {
            Some(v) => Ok(v.clone()),
            None => Err(sysctl_io("read", key.clone(), absent_errno(&g.0, &key))),
        }
    }

    fn write(&self, path: &[&str], value: &str) -> Result<(), crate::sysctl::SysctlError> {
        crate::sysctl::check_path(path)?;
        let key = crate::sysctl::dotted(path);
        let mut g = lock(&self.0);
        let Some(old) = g.0.get(&key).cloned() else {
            let errno = absent_errno(&g.0, &key);
            return Err(sysctl_io("write", key, errno));
        };
        if g.1 {
            return Err(sysctl_io("write", key, libc::EROFS));
        }
        let new = if is_integer_value(&old) {
            integer_write(&old, value)
                .ok_or_else(|| sysctl_io("write", key.clone(), libc::EINVAL))?
        } else {
            value.trim_end_matches('\n').to_owned()
        };
        g.0.insert(key, new);
        Ok(())
    }
}
