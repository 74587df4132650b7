//! The mesh round without I/O (`docs/kubespan.md` §8.2). [`MeshState`] holds what the
//! mesh knows between rounds (the peer specs, each peer's status and receive tracking,
//! relays, peers kept unlisted or from an earlier run) and turns a round's inputs (the
//! device as read, probe replies, server relay allocations, `now` and the settings)
//! into a [`Plan`]: the WireGuard peers or peer changes, the marking set or its delta,
//! the statuses to write, the probes to send and the next wake-up. The manager
//! (`controllers::kubespan::manager`) gathers the inputs and executes the plan.
//!
//! A *complete* round ([`MeshState::plan_complete`]) judges every peer; a *delta* round
//! ([`MeshState::plan_delta`]) only the peers whose specs changed. Both judge a peer with
//! the same two steps (`peer`): `judge` (status seeding, the receive window, the
//! rotation step, listing, probing) and `program` (path, wake-up, routed prefixes,
//! keepalive, endpoint); a delta round is a complete round's per-peer work without a
//! device read, without relays and without probes.
//!
//! By concern: `peer` is the per-peer judgement, `complete` and `delta` the two rounds,
//! `relay` the peer and server relays (§8.7, §8.8), `listing` the spec mirror, peers
//! kept unlisted (§8.10) and peers kept from an earlier run (§6.8), `round` the choice
//! between a complete and a delta round.

mod complete;
mod delta;
mod listing;
mod peer;
mod relay;
mod round;
#[cfg(test)]
mod tests;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::{Duration, SystemTime},
};

use ipnet::IpNet;
use wirespan_dataplane::{
    marking::{MarkingSpec, PrefixDelta},
    wireguard::{PeerChange, PublicKey, WgPeer},
};

pub use self::{
    relay::{ServerRelayed, DIRECT_RETRY_REARM},
    round::{choose_round, Round, DELTA_MAX, READ_DEFER_MAX},
};
use super::{
    peer_status::PeerStatus,
    relay::DirectPath,
    rotation::{Observed, RxTrack, PEER_DOWN_INTERVAL},
};
use crate::{
    resources::kubespan::{
        KubeSpanPeerSpec, KubeSpanPeerSpecSpec, KubeSpanPeerStatusSpec, ServerRelayWant,
    },
    runtime::Resource,
};

/// Persistent keepalive of Talos peers (seconds); wirespan peers get a third of
/// `peerReceiveTimeout` (`docs/kubespan.md` §8.6).
pub const PERSISTENT_KEEPALIVE: u16 = 25;

/// How long after start a device peer without a spec is kept: as long as a peer that
/// stopped handshaking counts as up, so a kept peer outlives neither.
pub const RETAIN_AFTER_START: Duration = PEER_DOWN_INTERVAL;

/// One peer as the device reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevicePeer {
    /// Endpoint, handshake and counters.
    pub observed: Observed,
    /// Its AllowedIPs.
    pub allowed_ips: Vec<IpNet>,
    /// As the device has it: an earlier run may have set a wirespan peer's shorter one.
    pub keepalive: u16,
}

/// What a complete round takes besides the mesh state, the settings and the secret.
#[derive(Debug, Default)]
pub struct CompleteInputs {
    /// This node's public key (`None`: the identity's key does not parse).
    pub own_key: Option<PublicKey>,
    /// The device as read this round, by public key (`None`: not read this round; an
    /// absent device reads as empty).
    pub device: Option<HashMap<String, DevicePeer>>,
    /// The mesh addresses whose kernels answered a probe since the last read.
    pub replied: HashSet<IpAddr>,
    /// The server relay's allocations, by public key (§8.8).
    pub allocations: HashMap<String, SocketAddr>,
}

/// What WireGuard is to be given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireGuardPlan {
    /// Exactly these peers (a complete round).
    Device(Vec<WgPeer>),
    /// These changes (a delta round).
    Peers(Vec<PeerChange>),
}

/// What the marking set is to become.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MarkingPlan {
    /// Exactly this (a complete round).
    Whole(MarkingSpec),
    /// This change (a delta round; nothing when empty).
    Delta(PrefixDelta),
}

/// A peer whose path changed (for the path-change metric).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathChange {
    /// Its public key.
    pub key: String,
    /// Its label.
    pub label: String,
}

/// What one round decided; the manager executes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The device's peers.
    pub wireguard: WireGuardPlan,
    /// The routed set.
    pub marking: MarkingPlan,
    /// The peers whose status (and harvested endpoint) may have changed: read them
    /// from [`MeshState::status`] (absent: the peer is gone).
    pub statuses: Vec<String>,
    /// Mesh addresses to probe (§8.6).
    pub probes: Vec<IpAddr>,
    /// Peers whose path changed.
    pub path_changes: Vec<PathChange>,
    /// The earliest per-peer wake-up (§8.5).
    pub wake: Option<SystemTime>,
}

/// What the mesh knows between rounds.
#[derive(Debug)]
pub struct MeshState {
    /// Peer specs as last seen (the spec feed's mirror), by public key.
    specs: BTreeMap<String, Arc<Resource<KubeSpanPeerSpec>>>,
    /// Live per-peer state (the rotation cursor), by public key.
    statuses: BTreeMap<String, PeerStatus>,
    /// Receive tracking of wirespan peers, by public key.
    rx: HashMap<String, RxTrack>,
    /// public key → (spec, peer without endpoint), so unchanged peers are not rebuilt;
    /// also the peers on the device.
    peers: HashMap<String, (KubeSpanPeerSpecSpec, WgPeer)>,
    /// Each peer's prefixes in the marking set as last planned.
    routed: HashMap<String, Vec<IpNet>>,
    /// The earliest per-peer wake-up known.
    wake: Option<SystemTime>,
    /// This node's public key (set by a complete round).
    own_key: Option<PublicKey>,
    /// Whether the device was read once since start (the read that adopts kernel
    /// state kept by an earlier run).
    adopt_checked: bool,
    /// Until when peers found on the device at start but without a spec yet are kept
    /// as they are (see `listing`).
    retain_until: Option<SystemTime>,
    /// Those peers, by public key.
    retained: BTreeMap<String, DevicePeer>,
    /// Peers whose spec vanished while their session was fresh, with their last spec,
    /// by public key (see `listing`).
    unlisted: BTreeMap<String, Arc<Resource<KubeSpanPeerSpec>>>,
    /// The direct path of each peer that takes part in relays, by public key.
    direct: HashMap<String, DirectPath>,
    /// Relayed peers as last planned: peer → relay, by public key.
    relayed: BTreeMap<String, String>,
    /// Relays are in use or needed: rounds stay complete (a delta round would write a
    /// relay's or a relayed peer's AllowedIPs without the move).
    relay_active: bool,
    /// Key ids of the peers not reachable directly (`None`: too many to publish).
    direct_down: Option<Vec<u64>>,
    /// Peers with neither a direct path nor a peer relay (asked of the server relay).
    server_wanted: Vec<ServerRelayWant>,
    /// Peers sent through the server relay, by public key.
    server_relayed: HashMap<String, ServerRelayed>,
}

impl Default for MeshState {
    fn default() -> Self {
        Self::new()
    }
}

impl MeshState {
    /// A mesh that knows nothing yet.
    #[must_use]
    pub fn new() -> Self {
        Self {
            specs: BTreeMap::new(),
            statuses: BTreeMap::new(),
            rx: HashMap::new(),
            peers: HashMap::new(),
            routed: HashMap::new(),
            wake: None,
            own_key: None,
            adopt_checked: false,
            retain_until: None,
            retained: BTreeMap::new(),
            unlisted: BTreeMap::new(),
            direct: HashMap::new(),
            relayed: BTreeMap::new(),
            relay_active: false,
            direct_down: Some(Vec::new()),
            server_wanted: Vec::new(),
            server_relayed: HashMap::new(),
        }
    }

    /// A peer's status.
    #[must_use]
    pub fn status(&self, key: &str) -> Option<&PeerStatus> {
        self.statuses.get(key)
    }

    /// Every peer's status, by public key.
    #[must_use]
    pub fn statuses(&self) -> &BTreeMap<String, PeerStatus> {
        &self.statuses
    }

    /// A listed peer's spec.
    #[must_use]
    pub fn spec(&self, key: &str) -> Option<&KubeSpanPeerSpecSpec> {
        self.specs.get(key).map(|r| &r.spec)
    }

    /// How many peers are programmed.
    #[must_use]
    pub fn peer_count(&self) -> usize {
        self.peers.len()
    }

    /// Key ids of the peers not reachable directly (`None`: too many to publish).
    #[must_use]
    pub fn direct_down(&self) -> Option<&[u64]> {
        self.direct_down.as_deref()
    }

    /// Peers to ask the server relay for.
    #[must_use]
    pub fn server_wanted(&self) -> &[ServerRelayWant] {
        &self.server_wanted
    }

    /// The earliest per-peer wake-up known.
    #[must_use]
    pub fn wake(&self) -> Option<SystemTime> {
        self.wake
    }

    /// Whether a change of peer specs alone may be a delta round: no relay is in use
    /// or needed and no peer is kept unlisted (either needs every peer looked at).
    #[must_use]
    pub fn delta_allowed(&self) -> bool {
        !self.relay_active && self.unlisted.is_empty()
    }

    /// Takes a status an earlier incarnation wrote (a restart keeps the rotation).
    pub fn adopt_status(&mut self, key: &str, status: &KubeSpanPeerStatusSpec) {
        self.statuses
            .entry(key.to_owned())
            .or_insert_with(|| PeerStatus::from(status));
    }

    /// The device is gone (torn down or renamed): every peer is built anew.
    pub fn forget_device(&mut self) {
        self.peers.clear();
    }

    /// The mesh is disabled: no peer has a status, none is kept.
    pub fn disable(&mut self) {
        self.statuses.clear();
        self.unlisted.clear();
    }
}
