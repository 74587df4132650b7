//! WireGuard: desired device state in, per-peer observations out (spec §6.2).
//!
//! [`diff`] (pure) compares what the device holds with what is desired and yields the
//! smallest [`WgUpdate`]: key, port and fwmark only when changed; missing peers added,
//! extra peers removed, a changed peer updated in place (allowed IPs replaced, PSK,
//! keepalive) and its endpoint written only when the desired endpoint is set and
//! differs, so a roamed endpoint survives. Peers are never replaced wholesale.
//!
//! Backends: [`userspace::UserspaceBackend`] supervises `wireguard-go -f IFNAME` and
//! speaks the UAPI text protocol on its socket; [`kernel::KernelBackend`] uses
//! `wireguard-control` over netlink where the kernel has WireGuard. [`select`] picks one.

pub mod kernel;
pub mod uapi;
pub mod userspace;

use std::{fmt, net::SocketAddr, time::SystemTime};

use ipnet::IpNet;
use wireguard_control::Key;

use crate::{
    error::{check_ifname, Invalid},
    netns::Netns,
};

macro_rules! key_type {
    ($name:ident, $what:literal, secret = $secret:literal) => {
        #[doc = concat!("A WireGuard ", $what, " (32 bytes).")]
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name([u8; 32]);

        impl $name {
            /// From raw bytes.
            #[must_use]
            pub fn from_bytes(bytes: [u8; 32]) -> Self {
                Self(bytes)
            }

            /// The raw bytes.
            #[must_use]
            pub fn as_bytes(&self) -> &[u8; 32] {
                &self.0
            }

            /// Parses standard base64 (44 characters); the error names `field` and
            /// never echoes the input.
            ///
            /// # Errors
            /// Not a base64 32-byte key.
            pub fn from_base64(field: &str, text: &str) -> Result<Self, Invalid> {
                Key::from_base64(text.trim())
                    .map(|k| Self(k.0))
                    .map_err(|_| Invalid::new(field, concat!("not a base64 ", $what)))
            }

            /// Standard base64 text.
            #[must_use]
            pub fn to_base64(&self) -> String {
                Key(self.0).to_base64()
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                if $secret {
                    f.write_str(concat!(stringify!($name), "(<redacted>)"))
                } else {
                    write!(f, "{}({})", stringify!($name), self.to_base64())
                }
            }
        }
    };
}

key_type!(PublicKey, "public key", secret = false);
key_type!(PrivateKey, "private key", secret = true);
key_type!(PresharedKey, "preshared key", secret = true);

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_base64())
    }
}

impl PrivateKey {
    /// A fresh random private key.
    #[must_use]
    pub fn generate() -> Self {
        Self(Key::generate_private().0)
    }

    /// The matching public key.
    #[must_use]
    pub fn public_key(&self) -> PublicKey {
        PublicKey(Key(self.0).get_public().0)
    }
}

impl PresharedKey {
    /// A fresh random preshared key.
    #[must_use]
    pub fn generate() -> Self {
        Self(Key::generate_preshared().0)
    }
}

/// One desired peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WgPeer {
    /// The peer's public key (its identity).
    pub public_key: PublicKey,
    /// Preshared key (the cluster secret in KubeSpan).
    pub preshared_key: Option<PresharedKey>,
    /// Persistent keepalive in seconds, 0 = off.
    pub persistent_keepalive: u16,
    /// Endpoint to set; `None` leaves WireGuard's current (possibly roamed) one alone.
    pub endpoint: Option<SocketAddr>,
    /// Allowed IPs (host bits must be zero).
    pub allowed_ips: Vec<IpNet>,
}

/// The desired device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WgDevice {
    /// Interface name (unique per host when the UAPI socket directory is shared).
    pub name: String,
    /// Private key.
    pub private_key: PrivateKey,
    /// UDP listen port, 0 = don't care.
    pub listen_port: u16,
    /// Mark on WireGuard's own packets (0 = none).
    pub fwmark: u32,
    /// Peers.
    pub peers: Vec<WgPeer>,
}

impl WgDevice {
    /// Checks every field; nothing is written when this fails.
    ///
    /// # Errors
    /// The first invalid field.
    pub fn validate(&self) -> Result<(), Invalid> {
        check_ifname("name", &self.name)?;
        if self.private_key.0 == [0; 32] {
            return Err(Invalid::new("private_key", "must not be all zeros"));
        }
        let own = self.private_key.public_key();
        let mut seen = std::collections::HashSet::new();
        for (i, p) in self.peers.iter().enumerate() {
            validate_peer(&format!("peers[{i}]"), p, Some(&own))?;
            if !seen.insert(&p.public_key) {
                return Err(Invalid::new(
                    format!("peers[{i}].public_key"),
                    format!("duplicate peer {}", p.public_key),
                ));
            }
        }
        Ok(())
    }
}

/// The checks of one peer on its own; `at` is its path (`peers[3]`).
fn validate_peer(at: &str, p: &WgPeer, own: Option<&PublicKey>) -> Result<(), Invalid> {
    let f = |s: &str| format!("{at}.{s}");
    if p.public_key.0 == [0; 32] {
        return Err(Invalid::new(f("public_key"), "must not be all zeros"));
    }
    if Some(&p.public_key) == own {
        return Err(Invalid::new(
            f("public_key"),
            "is the device's own public key",
        ));
    }
    if let Some(ep) = p.endpoint {
        if ep.port() == 0 || ep.ip().is_unspecified() {
            return Err(Invalid::new(
                f("endpoint"),
                format!("{ep} is not a usable endpoint"),
            ));
        }
    }
    for (j, a) in p.allowed_ips.iter().enumerate() {
        if a.trunc() != *a {
            return Err(Invalid::new(
                f(&format!("allowed_ips[{j}]")),
                format!("{a} has host bits set (expected {})", a.trunc()),
            ));
        }
    }
    Ok(())
}

/// One peer's change, for [`WireGuard::apply_peers`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerChange {
    /// Make the peer exactly this (added if missing).
    Upsert(WgPeer),
    /// Remove the peer (nothing if missing).
    Remove(PublicKey),
}

impl PeerChange {
    /// The peer changed.
    #[must_use]
    pub fn public_key(&self) -> &PublicKey {
        match self {
            Self::Upsert(p) => &p.public_key,
            Self::Remove(k) => k,
        }
    }
}

/// Checks changes on their own (fields named `changes[i]…`); `own` is the device's
/// public key when known. The peers not named are not looked at.
///
/// # Errors
/// The first invalid field, or a peer named twice.
pub fn validate_changes(own: Option<&PublicKey>, changes: &[PeerChange]) -> Result<(), Invalid> {
    let mut seen = std::collections::HashSet::with_capacity(changes.len());
    for (i, c) in changes.iter().enumerate() {
        if let PeerChange::Upsert(p) = c {
            validate_peer(&format!("changes[{i}]"), p, own)?;
        }
        if !seen.insert(c.public_key()) {
            return Err(Invalid::new(
                format!("changes[{i}].public_key"),
                format!("peer {} is changed twice", c.public_key()),
            ));
        }
    }
    Ok(())
}

/// Positions of the peers of `state`, by key.
pub(crate) type PeerIndex = std::collections::HashMap<PublicKey, usize>;

pub(crate) fn index_of(state: &DeviceState) -> PeerIndex {
    state
        .peers
        .iter()
        .enumerate()
        .map(|(i, p)| (p.public_key.clone(), i))
        .collect()
}

/// The updates `changes` make to `current` (pure; `index` locates its peers): a
/// changed peer as [`diff`] would update it, a removal only of a present peer.
pub(crate) fn diff_peers(
    current: &DeviceState,
    index: &PeerIndex,
    changes: &[PeerChange],
) -> Vec<PeerUpdate> {
    changes
        .iter()
        .filter_map(|c| {
            let cur = index.get(c.public_key()).map(|i| &current.peers[*i]);
            match c {
                PeerChange::Upsert(p) => peer_update(cur, p),
                PeerChange::Remove(_) => cur.map(|_| full_update(c)),
            }
        })
        .collect()
}

/// The update that sets every field of a changed peer, without knowing its state.
pub(crate) fn full_update(c: &PeerChange) -> PeerUpdate {
    match c {
        PeerChange::Upsert(p) => PeerUpdate {
            public_key: p.public_key.clone(),
            remove: false,
            preshared_key: Some(p.preshared_key.clone()),
            persistent_keepalive: Some(p.persistent_keepalive),
            endpoint: p.endpoint,
            allowed_ips: Some(normalise(&p.allowed_ips)),
        },
        PeerChange::Remove(k) => PeerUpdate {
            public_key: k.clone(),
            remove: true,
            preshared_key: None,
            persistent_keepalive: None,
            endpoint: None,
            allowed_ips: None,
        },
    }
}

/// Updates `state` and its `index` after `updates` were written (the peer order is
/// not kept: a removed peer's place goes to the last one).
pub(crate) fn apply_peer_updates(
    state: &mut DeviceState,
    index: &mut PeerIndex,
    updates: &[PeerUpdate],
) {
    for u in updates {
        if u.remove {
            if let Some(i) = index.remove(&u.public_key) {
                state.peers.swap_remove(i);
                if let Some(moved) = state.peers.get(i) {
                    index.insert(moved.public_key.clone(), i);
                }
            }
            continue;
        }
        let i = *index.entry(u.public_key.clone()).or_insert_with(|| {
            state.peers.push(PeerState::new(u.public_key.clone()));
            state.peers.len() - 1
        });
        apply_fields(&mut state.peers[i], u);
    }
}

fn apply_fields(peer: &mut PeerState, u: &PeerUpdate) {
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

/// A peer as the device holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerState {
    /// Public key.
    pub public_key: PublicKey,
    /// Preshared key, `None` when unset (all zeros).
    pub preshared_key: Option<PresharedKey>,
    /// Endpoint WireGuard currently uses.
    pub endpoint: Option<SocketAddr>,
    /// Persistent keepalive seconds, 0 = off.
    pub persistent_keepalive: u16,
    /// Allowed IPs.
    pub allowed_ips: Vec<IpNet>,
    /// Last completed handshake.
    pub last_handshake: Option<SystemTime>,
    /// Bytes received.
    pub rx_bytes: u64,
    /// Bytes sent.
    pub tx_bytes: u64,
}

impl PeerState {
    /// A peer with only its key: no PSK, endpoint, keepalive, allowed IPs or traffic.
    #[must_use]
    pub fn new(public_key: PublicKey) -> Self {
        Self {
            public_key,
            preshared_key: None,
            endpoint: None,
            persistent_keepalive: 0,
            allowed_ips: Vec::new(),
            last_handshake: None,
            rx_bytes: 0,
            tx_bytes: 0,
        }
    }
}

/// The device as it is.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceState {
    /// Private key, if set.
    pub private_key: Option<PrivateKey>,
    /// Listen port (0 if none yet).
    pub listen_port: u16,
    /// fwmark, 0 = none.
    pub fwmark: u32,
    /// Peers.
    pub peers: Vec<PeerState>,
}

/// Per-peer observation, for status controllers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerStatus {
    /// Public key.
    pub public_key: PublicKey,
    /// Endpoint in use.
    pub endpoint: Option<SocketAddr>,
    /// Last completed handshake.
    pub last_handshake: Option<SystemTime>,
    /// Bytes received.
    pub rx_bytes: u64,
    /// Bytes sent.
    pub tx_bytes: u64,
}

/// Observed device.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WgStatus {
    /// Whether the device exists.
    pub present: bool,
    /// Public key of the device.
    pub public_key: Option<PublicKey>,
    /// Listen port.
    pub listen_port: u16,
    /// Peers, sorted by public key.
    pub peers: Vec<PeerStatus>,
}

impl From<&DeviceState> for WgStatus {
    fn from(d: &DeviceState) -> Self {
        let mut peers: Vec<PeerStatus> = d
            .peers
            .iter()
            .map(|p| PeerStatus {
                public_key: p.public_key.clone(),
                endpoint: p.endpoint,
                last_handshake: p.last_handshake,
                rx_bytes: p.rx_bytes,
                tx_bytes: p.tx_bytes,
            })
            .collect();
        peers.sort_by(|a, b| a.public_key.cmp(&b.public_key));
        Self {
            present: true,
            public_key: d.private_key.as_ref().map(PrivateKey::public_key),
            listen_port: d.listen_port,
            peers,
        }
    }
}

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

fn normalise(ips: &[IpNet]) -> Vec<IpNet> {
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
    let have: std::collections::HashMap<&PublicKey, &PeerState> =
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
fn peer_update(cur: Option<&PeerState>, p: &WgPeer) -> Option<PeerUpdate> {
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

/// Cheap check, without allocating, that a current peer already is as desired (the
/// steady state of almost every peer). `false` only means "compare in full".
fn unchanged(cur: &PeerState, p: &WgPeer) -> bool {
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
            state.peers.push(PeerState::new(u.public_key.clone()));
            let i = state.peers.len() - 1;
            if let Some(m) = &mut index {
                m.insert(u.public_key.clone(), i);
            }
            i
        });
        apply_fields(&mut state.peers[i], u);
    }
}

/// How long a backend trusts the device state it last read or wrote: within this, a
/// steady-state apply costs a diff in memory and one write, not a read of every peer.
/// Every [`WireGuard::observe`] refreshes it; any error drops it.
pub const RESYNC_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);

/// The device state a backend last read (when) or wrote, and, once a delta needed
/// it, the index of its peers and the device's public key.
#[derive(Debug, Default)]
pub(crate) struct KnownState {
    known: Option<Known>,
}

#[derive(Debug)]
struct Known {
    at: std::time::Instant,
    incarnation: u64,
    state: DeviceState,
    index: Option<(PeerIndex, Option<PublicKey>)>,
}

/// A remembered state with its peer index, for [`WireGuard::apply_peers`].
pub(crate) struct Indexed {
    pub(crate) at: std::time::Instant,
    pub(crate) state: DeviceState,
    pub(crate) index: PeerIndex,
    pub(crate) own: Option<PublicKey>,
}

impl Indexed {
    /// Indexes a state just read at `at`.
    pub(crate) fn new(at: std::time::Instant, state: DeviceState) -> Self {
        let index = index_of(&state);
        let own = state.private_key.as_ref().map(PrivateKey::public_key);
        Self {
            at,
            state,
            index,
            own,
        }
    }
}

impl KnownState {
    fn take_valid(&mut self, now: std::time::Instant, incarnation: u64) -> Option<Known> {
        self.known.take().filter(|k| {
            k.incarnation == incarnation && now.saturating_duration_since(k.at) < RESYNC_INTERVAL
        })
    }

    /// Takes the remembered state out if it was read within [`RESYNC_INTERVAL`] of
    /// `now` and the device's incarnation (daemon restarts) is unchanged; returns
    /// when it was read. Forgets it otherwise.
    pub(crate) fn take_fresh(
        &mut self,
        now: std::time::Instant,
        incarnation: u64,
    ) -> Option<(std::time::Instant, DeviceState)> {
        self.take_valid(now, incarnation).map(|k| (k.at, k.state))
    }

    /// As [`KnownState::take_fresh`], with the peer index (built if missing).
    pub(crate) fn take_fresh_indexed(
        &mut self,
        now: std::time::Instant,
        incarnation: u64,
    ) -> Option<Indexed> {
        self.take_valid(now, incarnation).map(|k| match k.index {
            Some((index, own)) => Indexed {
                at: k.at,
                state: k.state,
                index,
                own,
            },
            None => Indexed::new(k.at, k.state),
        })
    }

    /// Remembers `state`, read (or derived from a read) at `at`.
    pub(crate) fn remember(
        &mut self,
        at: std::time::Instant,
        incarnation: u64,
        state: DeviceState,
    ) {
        self.known = Some(Known {
            at,
            incarnation,
            state,
            index: None,
        });
    }

    /// Remembers an indexed state.
    pub(crate) fn remember_indexed(&mut self, incarnation: u64, k: Indexed) {
        self.known = Some(Known {
            at: k.at,
            incarnation,
            state: k.state,
            index: Some((k.index, k.own)),
        });
    }

    pub(crate) fn forget(&mut self) {
        self.known = None;
    }
}

/// Errors of the WireGuard backends.
#[derive(Debug, thiserror::Error)]
pub enum WgError {
    /// The desired state is invalid; nothing was written.
    #[error("invalid WireGuard device: {0}")]
    Invalid(#[from] Invalid),
    /// wireguard-go could not be started or did not come up.
    #[error("userspace WireGuard for {name}: {message}")]
    Daemon {
        /// Interface.
        name: String,
        /// What went wrong.
        message: String,
    },
    /// UAPI or netlink I/O failed.
    #[error("WireGuard {op} on {name}: {source}")]
    Io {
        /// What we did.
        op: &'static str,
        /// Interface.
        name: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The device refused the configuration (errno from UAPI or netlink); with the
    /// userspace backend the port is set first, so a refused port changes nothing.
    #[error("WireGuard {name} refused the configuration: errno {errno}")]
    Refused {
        /// Interface.
        name: String,
        /// errno reported.
        errno: i32,
    },
    /// The device answered something we cannot parse.
    #[error("WireGuard {name}: unparsable answer: {message}")]
    Protocol {
        /// Interface.
        name: String,
        /// Which line or field.
        message: String,
    },
    /// The backend was already torn down, or a different device name was asked for.
    #[error("WireGuard backend for {0} is not usable: {1}")]
    State(String, &'static str),
}

/// A WireGuard backend: one device.
pub trait WireGuard {
    /// Interface name.
    fn name(&self) -> &str;
    /// Creates the device if missing (link exists afterwards).
    ///
    /// # Errors
    /// Creation failed.
    fn ensure(&mut self) -> Result<(), WgError>;
    /// Creates the device if needed and applies the minimal diff to `desired`.
    /// Returns whether anything was written.
    ///
    /// # Errors
    /// Invalid state (nothing written) or a failed write.
    fn apply(&mut self, desired: &WgDevice) -> Result<bool, WgError>;
    /// Changes only the peers named (device settings and other peers untouched), with
    /// work proportional to the change. Meant after a successful [`WireGuard::apply`];
    /// returns whether anything was written.
    ///
    /// # Errors
    /// An invalid change (nothing written) or a failed write.
    fn apply_peers(&mut self, changes: &[PeerChange]) -> Result<bool, WgError>;
    /// Reads per-peer endpoint, handshake and counters (`present: false` if no device).
    ///
    /// # Errors
    /// The device could not be read.
    fn observe(&mut self) -> Result<WgStatus, WgError>;
    /// Removes the device (and stops its process). Idempotent.
    ///
    /// # Errors
    /// Removal failed.
    fn teardown(&mut self) -> Result<(), WgError>;
    /// Number of configuration writes so far.
    fn writes(&self) -> u64;
}

/// Which backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// Kernel if the kernel supports WireGuard, else userspace.
    #[default]
    Auto,
    /// Kernel (netlink).
    Kernel,
    /// Userspace (`wireguard-go`).
    Userspace,
}

/// Builds the backend for device `name` in `netns`.
///
/// # Errors
/// The kernel backend was forced but is unavailable, or the probe failed.
pub fn select(
    choice: BackendChoice,
    name: &str,
    netns: &Netns,
) -> Result<Box<dyn WireGuard + Send>, WgError> {
    let kernel = match choice {
        BackendChoice::Userspace => false,
        BackendChoice::Kernel => true,
        BackendChoice::Auto => kernel::supported(netns),
    };
    tracing::info!(
        link = name,
        backend = if kernel { "kernel" } else { "userspace" },
        "WireGuard backend"
    );
    if kernel {
        Ok(Box::new(kernel::KernelBackend::new(name, netns)?))
    } else {
        Ok(Box::new(userspace::UserspaceBackend::new(
            name,
            netns.clone(),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> PublicKey {
        PublicKey([b; 32])
    }

    fn peer(b: u8, ips: &[&str]) -> WgPeer {
        WgPeer {
            public_key: key(b),
            preshared_key: Some(PresharedKey([9; 32])),
            persistent_keepalive: 25,
            endpoint: None,
            allowed_ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
        }
    }

    fn state_of(d: &WgDevice) -> DeviceState {
        DeviceState {
            private_key: Some(d.private_key.clone()),
            listen_port: d.listen_port,
            fwmark: d.fwmark,
            peers: d
                .peers
                .iter()
                .map(|p| PeerState {
                    public_key: p.public_key.clone(),
                    preshared_key: p.preshared_key.clone(),
                    endpoint: p.endpoint,
                    persistent_keepalive: p.persistent_keepalive,
                    allowed_ips: p.allowed_ips.clone(),
                    last_handshake: None,
                    rx_bytes: 0,
                    tx_bytes: 0,
                })
                .collect(),
        }
    }

    fn device(peers: Vec<WgPeer>) -> WgDevice {
        WgDevice {
            name: "ws0".into(),
            private_key: PrivateKey([7; 32]),
            listen_port: 51820,
            fwmark: 0x20,
            peers,
        }
    }

    #[test]
    fn applying_the_diff_to_the_state_leaves_nothing_to_do() {
        let from = device(vec![
            peer(1, &["10.0.0.1/32"]),
            peer(2, &["10.0.0.2/32", "10.2.0.0/16"]),
            peer(3, &["10.0.0.3/32"]),
        ]);
        let mut to = device(vec![
            // Peer 1 gone, peer 2 changed everywhere, peer 3 same, peer 4 new.
            WgPeer {
                preshared_key: None,
                persistent_keepalive: 0,
                endpoint: Some("192.0.2.2:51820".parse().unwrap()),
                ..peer(2, &["10.0.0.2/32", "10.3.0.0/16"])
            },
            peer(3, &["10.0.0.3/32"]),
            peer(4, &["10.0.0.4/32"]),
        ]);
        to.listen_port = 51821;
        to.private_key = PrivateKey([8; 32]);
        let mut st = state_of(&from);
        let up = diff(&st, &to);
        apply_update(&mut st, &up);
        assert!(diff(&st, &to).is_empty(), "{:?}", diff(&st, &to));
        assert_eq!(st.peers.len(), 3);
        let p2 = st.peers.iter().find(|p| p.public_key == key(2)).unwrap();
        assert_eq!(p2.preshared_key, None);
        assert_eq!(p2.endpoint, to.peers[0].endpoint);
    }

    #[test]
    fn pairwise_and_keyed_diffs_agree_and_align_order_enables_pairwise() {
        let from = device(vec![
            peer(1, &["10.0.0.1/32"]),
            peer(2, &["10.0.0.2/32"]),
            peer(3, &["10.0.0.3/32"]),
        ]);
        let mut to = device(from.peers.clone());
        to.peers[1].allowed_ips = vec![
            "10.0.0.2/32".parse().unwrap(),
            "10.9.0.0/16".parse().unwrap(),
        ];
        to.peers[2].endpoint = Some("192.0.2.3:51820".parse().unwrap());
        let in_order = state_of(&from);
        let mut shuffled = state_of(&from);
        shuffled.peers.rotate_left(1);
        let pairwise = diff(&in_order, &to);
        assert_eq!(pairwise, diff(&shuffled, &to));
        assert_eq!(pairwise.peers.len(), 2);
        align_order(&mut shuffled, &to);
        assert_eq!(shuffled, in_order);
        // Peers the caller does not name go last.
        let mut extra = state_of(&device(vec![peer(9, &["10.0.0.9/32"])]));
        extra.peers.extend(state_of(&from).peers);
        align_order(&mut extra, &from);
        assert_eq!(extra.peers.last().unwrap().public_key, key(9));
    }

    #[test]
    fn known_state_expires_and_follows_incarnation() {
        let t0 = std::time::Instant::now();
        let mut k = KnownState::default();
        k.remember(t0, 0, DeviceState::default());
        assert!(k.take_fresh(t0 + RESYNC_INTERVAL / 2, 0).is_some());
        // Taken out: gone until remembered again.
        assert!(k.take_fresh(t0, 0).is_none());
        k.remember(t0, 0, DeviceState::default());
        assert!(k.take_fresh(t0 + RESYNC_INTERVAL, 0).is_none());
        k.remember(t0, 0, DeviceState::default());
        assert!(k.take_fresh(t0, 1).is_none(), "daemon restarted");
    }

    #[test]
    fn same_state_is_empty_update_regardless_of_order() {
        let d = device(vec![
            peer(1, &["10.0.0.1/32", "10.1.0.0/16"]),
            peer(2, &["10.0.0.2/32"]),
        ]);
        let mut st = state_of(&d);
        st.peers.reverse();
        st.peers[1].allowed_ips.reverse();
        assert!(diff(&st, &d).is_empty());
    }

    #[test]
    fn empty_desired_endpoint_keeps_roamed_one() {
        let d = device(vec![peer(1, &["10.0.0.1/32"])]);
        let mut st = state_of(&d);
        st.peers[0].endpoint = Some("192.0.2.7:40000".parse().unwrap());
        assert!(diff(&st, &d).is_empty());
        let mut d2 = d;
        d2.peers[0].endpoint = Some("192.0.2.8:51820".parse().unwrap());
        let up = diff(&st, &d2);
        assert_eq!(up.peers.len(), 1);
        assert_eq!(up.peers[0].endpoint, d2.peers[0].endpoint);
        assert!(up.peers[0].allowed_ips.is_none() && up.peers[0].preshared_key.is_none());
    }

    #[test]
    fn peer_changes_end_where_a_full_apply_of_the_result_would() {
        let d = device(
            (1..=6)
                .map(|b| peer(b, &[&format!("10.0.0.{b}/32")]))
                .collect(),
        );
        let mut st = state_of(&d);
        let mut index = index_of(&st);
        let mut changed = peer(2, &["10.0.0.2/32", "10.2.0.0/16"]);
        changed.endpoint = Some("192.0.2.2:51820".parse().unwrap());
        let changes = vec![
            PeerChange::Upsert(changed.clone()),
            PeerChange::Remove(key(1)),
            PeerChange::Upsert(peer(9, &["10.0.0.9/32"])),
            PeerChange::Upsert(peer(4, &["10.0.0.4/32"])), // unchanged: no update
            PeerChange::Remove(key(42)),                   // absent: no update
        ];
        validate_changes(Some(&d.private_key.public_key()), &changes).unwrap();
        let ups = diff_peers(&st, &index, &changes);
        assert_eq!(
            ups.iter().map(|u| u.public_key.clone()).collect::<Vec<_>>(),
            vec![key(2), key(1), key(9)]
        );
        apply_peer_updates(&mut st, &mut index, &ups);
        assert_eq!(index, index_of(&st), "index follows the state");
        let mut want = d;
        want.peers.retain(|p| p.public_key != key(1));
        want.peers[0] = changed;
        want.peers.push(peer(9, &["10.0.0.9/32"]));
        assert!(diff(&st, &want).is_empty(), "{:?}", diff(&st, &want));
    }

    #[test]
    fn peer_changes_are_checked_on_their_own() {
        let own = PrivateKey([7; 32]).public_key();
        let mut bad = peer(3, &["10.0.0.1/24"]);
        let e = validate_changes(Some(&own), &[PeerChange::Upsert(bad.clone())]).unwrap_err();
        assert_eq!(e.field, "changes[0].allowed_ips[0]");
        bad.allowed_ips.clear();
        let e = validate_changes(
            Some(&own),
            &[PeerChange::Remove(key(3)), PeerChange::Upsert(bad)],
        )
        .unwrap_err();
        assert_eq!(e.field, "changes[1].public_key");
        let mine = WgPeer {
            public_key: own.clone(),
            ..peer(1, &[])
        };
        let e = validate_changes(Some(&own), &[PeerChange::Upsert(mine)]).unwrap_err();
        assert!(e.problem.contains("own public key"), "{e}");
    }

    #[test]
    fn changed_allowed_ips_touch_only_that_peer() {
        let d = device(vec![peer(1, &["10.0.0.1/32"]), peer(2, &["10.0.0.2/32"])]);
        let st = state_of(&d);
        let mut d2 = d;
        d2.peers[1].allowed_ips.push("10.2.0.0/16".parse().unwrap());
        let up = diff(&st, &d2);
        assert_eq!(up.peers.len(), 1);
        assert_eq!(up.peers[0].public_key, key(2));
        assert_eq!(up.peers[0].allowed_ips.as_ref().unwrap().len(), 2);
        assert!(up.listen_port.is_none() && up.private_key.is_none() && up.fwmark.is_none());
    }

    #[test]
    fn add_remove_psk_keepalive_and_port() {
        let d = device(vec![peer(1, &["10.0.0.1/32"]), peer(2, &["10.0.0.2/32"])]);
        let st = state_of(&d);
        let mut d2 = device(vec![peer(2, &["10.0.0.2/32"]), peer(3, &["10.0.0.3/32"])]);
        d2.peers[0].preshared_key = None;
        d2.peers[0].persistent_keepalive = 0;
        d2.listen_port = 51821;
        let up = diff(&st, &d2);
        assert_eq!(up.listen_port, Some(51821));
        let by = |b: u8| up.peers.iter().find(|p| p.public_key == key(b)).unwrap();
        assert!(by(1).remove);
        assert_eq!(by(2).preshared_key, Some(None));
        assert_eq!(by(2).persistent_keepalive, Some(0));
        assert!(by(2).allowed_ips.is_none());
        assert!(!by(3).remove && by(3).allowed_ips.is_some());
        // Port 0: don't care.
        d2.listen_port = 0;
        assert!(diff(&st, &d2).listen_port.is_none());
    }

    #[test]
    fn secrets_are_redacted_in_debug() {
        let d = device(vec![peer(1, &[])]);
        let text = format!("{d:?}");
        assert!(!text.contains(&PrivateKey([7; 32]).to_base64()));
        assert!(!text.contains(&PresharedKey([9; 32]).to_base64()));
        assert!(text.contains("<redacted>"));
        assert!(text.contains(&key(1).to_base64()));
    }

    #[test]
    fn validation_names_fields() {
        let mut d = device(vec![peer(1, &["10.0.0.1/8"])]);
        assert_eq!(d.validate().unwrap_err().field, "peers[0].allowed_ips[0]");
        d.peers = vec![peer(1, &[]), peer(1, &[])];
        assert_eq!(d.validate().unwrap_err().field, "peers[1].public_key");
        d.peers = vec![];
        d.name = "way-too-long-interface".into();
        assert_eq!(d.validate().unwrap_err().field, "name");
        let e = PublicKey::from_base64("peers[0].public_key", "not-a-key").unwrap_err();
        assert_eq!(e.field, "peers[0].public_key");
        assert!(!e.to_string().contains("not-a-key"));
    }
}
