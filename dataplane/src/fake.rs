//! In-memory fakes of the adapters, for testing code that drives them (controllers).
//!
//! Each fake is a cheap `Clone` handle on shared state: give one clone to the code
//! under test and keep another to inspect what it applied or to simulate the kernel
//! (a roamed endpoint, a handshake, a failure). They validate exactly as the real
//! adapters do, and count writes the same way (a no-op apply writes nothing).

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::SystemTime,
};

use futures::channel::mpsc;

use crate::{
    marking::{render, Marking, MarkingError, MarkingSpec, MarkingStatus, Ruleset},
    routing::{Routing, RoutingChanges, RoutingError, RoutingSpec, RoutingStatus},
    watch::NetEvent,
    wireguard::{
        apply_update, diff, DeviceState, PeerState, PublicKey, WgDevice, WgError, WgStatus,
        WgUpdate, WireGuard,
    },
};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Debug, Default)]
struct MarkingInner {
    spec: Option<MarkingSpec>,
    ruleset: Option<Ruleset>,
    transactions: u64,
    fail_next: Option<String>,
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
        g.spec = Some(spec.clone());
        if g.ruleset.as_ref() == Some(&rs) {
            return Ok(false);
        }
        g.ruleset = Some(rs);
        g.transactions += 1;
        Ok(true)
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
                counters: Vec::new(),
            }))
    }

    fn teardown(&mut self) -> Result<(), MarkingError> {
        let mut g = lock(&self.0);
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
        if g.spec.as_ref() == Some(spec) {
            return Ok(RoutingChanges::default());
        }
        g.spec = Some(spec.clone());
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
                .filter(|(_, on)| *on)
                .map(|(v6, _)| (v6, s.priority, s.table))
                .collect(),
            routes: Vec::new(),
        })
    }

    fn teardown(&mut self) -> Result<(), RoutingError> {
        let mut g = lock(&self.0);
        if g.spec.take().is_some() {
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

    /// Every update written so far, in order.
    #[must_use]
    pub fn updates(&self) -> Vec<WgUpdate> {
        lock(&self.inner).updates.clone()
    }

    fn with_peer(&self, key: &PublicKey, f: impl FnOnce(&mut PeerState)) {
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
        g.device = Some(dev);
        g.updates.push(up);
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
}

/// A fake netlink watcher: push events into the sender, consume the stream.
#[must_use]
pub fn watch_channel() -> (
    mpsc::UnboundedSender<NetEvent>,
    mpsc::UnboundedReceiver<NetEvent>,
) {
    mpsc::unbounded()
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
