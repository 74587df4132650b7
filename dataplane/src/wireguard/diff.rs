//! Whole-device diffing (pure): [`diff`] from a [`DeviceState`] to a [`WgDevice`]
//! yields the smallest [`WgUpdate`], and [`apply_update`] is its inverse view, the
//! state after the update was written.

use std::net::SocketAddr;

use ipnet::IpNet;

use super::{
    index_of, DevicePeer, DeviceState, PeerIndex, PresharedKey, PrivateKey, PublicKey, WgDevice,
    WgPeer,
};

/// Changes for one peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerUpdate {
    /// Which peer.
    pub public_key: PublicKey,
    /// Remove it (nothing else applies).
    pub remove: bool,
    /// New preshared key; `Some(None)` clears it.
    pub preshared_key: Option<Option<PresharedKey>>,
    /// New keepalive.
    pub persistent_keepalive: Option<u16>,
    /// New endpoint.
    pub endpoint: Option<SocketAddr>,
    /// Replacement allowed IPs.
    pub allowed_ips: Option<Vec<IpNet>>,
}

/// The smallest change that makes a device match the desired state.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WgUpdate {
    /// New listen port.
    pub listen_port: Option<u16>,
    /// New fwmark.
    pub fwmark: Option<u32>,
    /// New private key.
    pub private_key: Option<PrivateKey>,
    /// Peer changes, by public key.
    pub peers: Vec<PeerUpdate>,
}

impl WgUpdate {
    /// Whether nothing needs to be written.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.listen_port.is_none()
            && self.fwmark.is_none()
            && self.private_key.is_none()
            && self.peers.is_empty()
    }
}

pub(super) fn normalise(ips: &[IpNet]) -> Vec<IpNet> {
    let mut v: Vec<IpNet> = ips.iter().map(IpNet::trunc).collect();
    v.sort_unstable_by_key(|p| (p.addr(), p.prefix_len()));
    v.dedup();
    v
}

/// Computes the minimal update from `current` to `desired` (pure).
#[must_use]
pub fn diff(current: &DeviceState, desired: &WgDevice) -> WgUpdate {
    let mut up = WgUpdate::default();
    if desired.listen_port != 0 && desired.listen_port != current.listen_port {
        up.listen_port = Some(desired.listen_port);
    }
    if desired.fwmark != current.fwmark {
        up.fwmark = Some(desired.fwmark);
    }
    if current.private_key.as_ref() != Some(&desired.private_key) {
        up.private_key = Some(desired.private_key.clone());
    }
    // Fast path: the same peers in the same order (a backend keeps its remembered state
    // in the caller's order, see `align_order`): compare pairwise, no maps.
    if current.peers.len() == desired.peers.len()
        && current
            .peers
            .iter()
            .zip(&desired.peers)
            .all(|(c, d)| c.public_key == d.public_key)
    {
        up.peers.extend(
            current
                .peers
                .iter()
                .zip(&desired.peers)
                .filter_map(|(c, d)| peer_update(Some(c), d)),
        );
        up.peers.sort_by(|a, b| a.public_key.cmp(&b.public_key));
        return up;
    }
    let have: std::collections::HashMap<&PublicKey, &DevicePeer> =
        current.peers.iter().map(|p| (&p.public_key, p)).collect();
    let want: std::collections::HashSet<&PublicKey> =
        desired.peers.iter().map(|p| &p.public_key).collect();
    for p in &current.peers {
        if !want.contains(&p.public_key) {
            up.peers.push(PeerUpdate {
                public_key: p.public_key.clone(),
                remove: true,
                preshared_key: None,
                persistent_keepalive: None,
                endpoint: None,
                allowed_ips: None,
            });
        }
    }
    let removed = up.peers.len();
    up.peers.extend(
        desired
            .peers
            .iter()
            .filter_map(|p| peer_update(have.get(&p.public_key).copied(), p)),
    );
    // Deterministic order of the written lines (desired order is the caller's).
    up.peers[removed..].sort_by(|a, b| a.public_key.cmp(&b.public_key));
    up
}

/// The change that makes `cur` (absent: a new peer) into `p`, if any.
pub(super) fn peer_update(cur: Option<&DevicePeer>, p: &WgPeer) -> Option<PeerUpdate> {
    let Some(cur) = cur else {
        return Some(PeerUpdate {
            public_key: p.public_key.clone(),
            remove: false,
            preshared_key: p.preshared_key.clone().map(Some),
            persistent_keepalive: (p.persistent_keepalive != 0).then_some(p.persistent_keepalive),
            endpoint: p.endpoint,
            allowed_ips: Some(normalise(&p.allowed_ips)),
        });
    };
    if unchanged(cur, p) {
        return None;
    }
    let ips = normalise(&p.allowed_ips);
    let change = PeerUpdate {
        public_key: p.public_key.clone(),
        remove: false,
        preshared_key: (cur.preshared_key != p.preshared_key).then(|| p.preshared_key.clone()),
        persistent_keepalive: (cur.persistent_keepalive != p.persistent_keepalive)
            .then_some(p.persistent_keepalive),
        endpoint: p.endpoint.filter(|e| cur.endpoint != Some(*e)),
        allowed_ips: (normalise(&cur.allowed_ips) != ips).then_some(ips),
    };
    (change.preshared_key.is_some()
        || change.persistent_keepalive.is_some()
        || change.endpoint.is_some()
        || change.allowed_ips.is_some())
    .then_some(change)
}

/// Cheap check, without allocating, that a current peer already is as desired (the
/// steady state of almost every peer). `false` only means "compare in full".
fn unchanged(cur: &DevicePeer, p: &WgPeer) -> bool {
    cur.preshared_key == p.preshared_key
        && cur.persistent_keepalive == p.persistent_keepalive
        && p.endpoint.is_none_or(|e| cur.endpoint == Some(e))
        && (cur.allowed_ips == p.allowed_ips || same_ips(&cur.allowed_ips, &p.allowed_ips))
}

/// Whether `have` (as a device holds them: canonical, no duplicates) and `want` are the
/// same set, for short lists without allocating. `false` only means "compare in full".
fn same_ips(have: &[IpNet], want: &[IpNet]) -> bool {
    const SMALL: usize = 16;
    have.len() == want.len()
        && want.len() <= SMALL
        // Same length, every desired prefix (canonical, no duplicates) present.
        && want
            .iter()
            .enumerate()
            .all(|(i, ip)| *ip == ip.trunc() && !want[..i].contains(ip) && have.contains(ip))
}

/// Puts the peers of `state` in the order of `desired` (those `desired` does not name
/// last), and each peer's allowed IPs in the caller's order where they are the same
/// set, so the next [`diff`] against the same caller compares pairwise and slice by
/// slice. Call it on a remembered state after a successful write.
pub(crate) fn align_order(state: &mut DeviceState, desired: &WgDevice) {
    let same_order = |state: &DeviceState| {
        state.peers.len() == desired.peers.len()
            && state
                .peers
                .iter()
                .zip(&desired.peers)
                .all(|(c, d)| c.public_key == d.public_key)
    };
    if !same_order(state) {
        sort_like(state, desired);
    }
    if same_order(state) {
        for (c, d) in state.peers.iter_mut().zip(&desired.peers) {
            if c.allowed_ips != d.allowed_ips && same_ips(&c.allowed_ips, &d.allowed_ips) {
                c.allowed_ips.clone_from(&d.allowed_ips);
            }
        }
    }
}

fn sort_like(state: &mut DeviceState, desired: &WgDevice) {
    let rank: std::collections::HashMap<&PublicKey, usize> = desired
        .peers
        .iter()
        .enumerate()
        .map(|(i, p)| (&p.public_key, i))
        .collect();
    state
        .peers
        .sort_by_key(|p| rank.get(&p.public_key).copied().unwrap_or(usize::MAX));
}

/// Updates `state` to what the device holds after `up` was written successfully
/// (pure; the inverse view of [`diff`]).
pub fn apply_update(state: &mut DeviceState, up: &WgUpdate) {
    if let Some(p) = up.listen_port {
        state.listen_port = p;
    }
    if let Some(m) = up.fwmark {
        state.fwmark = m;
    }
    if let Some(k) = &up.private_key {
        state.private_key = Some(k.clone());
    }
    let removed: std::collections::HashSet<&PublicKey> = up
        .peers
        .iter()
        .filter(|p| p.remove)
        .map(|p| &p.public_key)
        .collect();
    if !removed.is_empty() {
        state.peers.retain(|p| !removed.contains(&p.public_key));
    }
    // A few changed peers (the steady state) are found by a scan; many through a map.
    let mut index: Option<PeerIndex> = (up.peers.len() > 8).then(|| index_of(state));
    for u in up.peers.iter().filter(|p| !p.remove) {
        let found = match &index {
            Some(m) => m.get(&u.public_key).copied(),
            None => state
                .peers
                .iter()
                .position(|p| p.public_key == u.public_key),
        };
        let i = found.unwrap_or_else(|| {
            state.peers.push(DevicePeer::new(u.public_key.clone()));
            let i = state.peers.len() - 1;
            if let Some(m) = &mut index {
                m.insert(u.public_key.clone(), i);
            }
            i
        });
        apply_fields(&mut state.peers[i], u);
    }
}

pub(super) fn apply_fields(peer: &mut DevicePeer, u: &PeerUpdate) {
    if let Some(k) = &u.preshared_key {
        peer.preshared_key.clone_from(k);
    }
    if let Some(k) = u.persistent_keepalive {
        peer.persistent_keepalive = k;
    }
    if let Some(e) = u.endpoint {
        peer.endpoint = Some(e);
    }
    if let Some(ips) = &u.allowed_ips {
        peer.allowed_ips.clone_from(ips);
    }
}
