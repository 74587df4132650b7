//! Peer relays in the planner (`docs/kubespan.md` §8.7, §8.8): which peers go through
//! which relay this round, what the node publishes for others to choose by, and the
//! keepalive that keeps retrying a relayed peer's direct path.

use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
    time::{Duration, SystemTime},
};

use super::MeshState;
use crate::{
    config::kubespan::KubeSpanConfigDocument as Settings,
    kubespan::{
        peer_status::PeerStatus,
        relay::{choose, key_id, published_down, Candidate, DirectPath},
        rotation::ENDPOINT_CONNECTION_TIMEOUT,
    },
    resources::kubespan::{KubeSpanPeerSpecSpec, PeerState, ServerRelayWant},
};

/// How long a relayed peer's keepalive is held at 0 at the start of each retry cycle:
/// the write that turns it on again makes WireGuard initiate a handshake on the direct
/// path at once (a peer without AllowedIPs has nothing else to send, and WireGuard
/// gives up retrying a handshake nothing asks for), and WireGuard retries it every 5 s
/// within the cycle.
pub const DIRECT_RETRY_REARM: Duration = Duration::from_secs(1);

/// How often a relayed peer's direct path is tried again: one endpoint's try, so a
/// peer with several endpoints rotates through them at the same pace as before.
const DIRECT_RETRY_CYCLE: Duration = ENDPOINT_CONNECTION_TIMEOUT;

/// Whether this node and the peer route through relays for each other.
pub(super) fn relay_user(s: &Settings, spec: &KubeSpanPeerSpecSpec) -> bool {
    s.peer_relay && spec.wirespan.as_ref().is_some_and(|w| w.relay_user)
}

/// Where `now` falls in the relayed peer's retry cycles, which start at its last
/// endpoint push: the time since the current cycle began.
fn retry_phase(st: &PeerStatus, now: SystemTime) -> Option<(SystemTime, Duration)> {
    let t = st.last_endpoint_change?;
    let since = now.duration_since(t).unwrap_or_default();
    let cycle = DIRECT_RETRY_CYCLE.as_nanos();
    let phase = Duration::from_nanos(u64::try_from(since.as_nanos() % cycle).unwrap_or(0));
    Some((now - phase, phase))
}

/// The keepalive of a relayed peer (see [`DIRECT_RETRY_REARM`]).
pub(super) fn relayed_keepalive(keepalive: u16, st: &PeerStatus, now: SystemTime) -> u16 {
    match retry_phase(st, now) {
        Some((_, phase)) if phase < DIRECT_RETRY_REARM => 0,
        _ => keepalive,
    }
}

/// When to look at a relayed peer again: to turn its keepalive back on, a second
/// later to see whether that handshake came through, then at the start of the next
/// retry cycle (no per-second handshake poll: its traffic flows through the relay).
pub(super) fn relayed_wake(st: &PeerStatus, now: SystemTime) -> Option<SystemTime> {
    let (start, _) = retry_phase(st, now)?;
    [
        start + DIRECT_RETRY_REARM,
        start + 2 * DIRECT_RETRY_REARM,
        start + DIRECT_RETRY_CYCLE,
    ]
    .into_iter()
    .find(|w| *w > now)
    .filter(|_| st.state != PeerState::Up)
}

/// A peer sent through the server relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerRelayed {
    /// The relay's endpoint for this node's side.
    pub endpoint: SocketAddr,
    /// Since when (its keepalive is held at 0 for [`DIRECT_RETRY_REARM`] after it, so
    /// the write that turns it on starts a handshake through the relay).
    pub since: SystemTime,
    /// The peer's own endpoints then: when they change, the direct path is tried again.
    pub endpoints: Vec<SocketAddr>,
}

impl ServerRelayed {
    /// The keepalive while relayed through the server.
    pub fn keepalive(&self, keepalive: u16, now: SystemTime) -> u16 {
        if now.duration_since(self.since).unwrap_or_default() < DIRECT_RETRY_REARM {
            0
        } else {
            keepalive
        }
    }

    /// When to turn the keepalive on.
    pub fn wake(&self, now: SystemTime) -> Option<SystemTime> {
        Some(self.since + DIRECT_RETRY_REARM).filter(|w| *w > now)
    }
}

impl MeshState {
    /// Whether the peer stays on the server relay. It leaves when its endpoints
    /// changed (a new address, a new NAT mapping published) or when its packets arrive
    /// straight from it (the device roamed away from the relay's endpoint: the peer
    /// reached this node directly); its direct path is then tried again from the start.
    pub(super) fn on_server_relay(
        &mut self,
        key: &str,
        endpoints: &[SocketAddr],
        device_endpoint: Option<SocketAddr>,
    ) -> bool {
        let Some(r) = self.server_relayed.get(key) else {
            return false;
        };
        let why = if r.endpoints != endpoints {
            "peer published new endpoints"
        } else if device_endpoint.is_some_and(|e| e != r.endpoint) {
            "peer reached this node directly"
        } else {
            return true;
        };
        tracing::info!(peer = ?key, why, "trying the direct path again");
        self.server_relayed.remove(key);
        self.direct.insert(key.to_owned(), DirectPath::default());
        false
    }

    /// The peers that need the server relay (direct path down, no peer relay), and
    /// which of them have an allocation: those go through it from this round on.
    pub(super) fn server_relays(
        &mut self,
        allocations: &HashMap<String, SocketAddr>,
        relays: &BTreeMap<String, String>,
        patience: Duration,
        now: SystemTime,
    ) {
        let mut wanted = Vec::new();
        let mut using = HashMap::new();
        for (key, d) in &self.direct {
            if !d.down(now, patience) || relays.contains_key(key) {
                continue;
            }
            let Some(spec) = self.specs.get(key) else {
                continue;
            };
            wanted.push(ServerRelayWant {
                public_key: key.clone(),
                affiliate_id: spec.spec.node_id.clone(),
            });
            if let Some(endpoint) = allocations.get(key) {
                let r = match self.server_relayed.remove(key) {
                    Some(r) if r.endpoint == *endpoint => r,
                    _ => {
                        tracing::info!(peer = ?spec.spec.label, relay = %endpoint, "no direct path and no peer relay: traffic goes through the server relay");
                        ServerRelayed {
                            endpoint: *endpoint,
                            since: now,
                            endpoints: spec.spec.endpoints.clone(),
                        }
                    }
                };
                using.insert(key.clone(), r);
            }
        }
        for key in self
            .server_relayed
            .keys()
            .filter(|k| !using.contains_key(*k))
        {
            tracing::info!(peer = ?key, "peer no longer on the server relay");
        }
        wanted.sort_by(|a, b| a.public_key.cmp(&b.public_key));
        self.server_wanted = wanted;
        self.server_relayed = using;
    }

    /// The relay of each peer whose direct path is down and that has one, both by
    /// public key (base64).
    pub(super) fn choose_relays(&self, s: &Settings, now: SystemTime) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        let Some(own) = self.own_key.as_ref().map(|k| *k.as_bytes()) else {
            return out;
        };
        if !s.peer_relay {
            return out;
        }
        let down: Vec<(&String, [u8; 32])> = self
            .direct
            .iter()
            .filter(|(_, d)| d.down(now, s.peer_receive_timeout))
            .filter_map(|(k, _)| {
                self.peers
                    .get(k)
                    .map(|(_, p)| (k, *p.public_key.as_bytes()))
            })
            .collect();
        if down.is_empty() {
            return out;
        }
        let candidates: Vec<(&String, [u8; 32], &[u64], bool)> = self
            .specs
            .iter()
            .filter_map(|(k, r)| {
                let w = r.spec.wirespan.as_ref().filter(|w| w.relay_offered)?;
                let (_, p) = self.peers.get(k)?;
                let up = self
                    .statuses
                    .get(k)
                    .is_some_and(|st| st.state == PeerState::Up);
                Some((k, *p.public_key.as_bytes(), w.direct_down.as_slice(), up))
            })
            .collect();
        for (peer, peer_key) in down {
            let chosen = choose(
                &own,
                &peer_key,
                candidates
                    .iter()
                    .map(|(_, key, direct_down, up)| Candidate {
                        key,
                        offered: true,
                        direct_down,
                        up: *up,
                    }),
            );
            if let Some(relay) = chosen
                .and_then(|c| candidates.iter().find(|(_, key, ..)| key == c))
                .map(|(k, ..)| (*k).clone())
            {
                out.insert(peer.clone(), relay);
            }
        }
        out
    }

    /// Records this round's relays: logs the changes, and whether relays keep the
    /// next rounds complete.
    pub(super) fn note_relays(
        &mut self,
        relays: BTreeMap<String, String>,
        now: SystemTime,
        patience: Duration,
    ) {
        let label = |k: &String| {
            self.statuses
                .get(k)
                .map_or_else(|| k.clone(), |st| st.label.clone())
        };
        for (peer, relay) in &relays {
            if self.relayed.get(peer) != Some(relay) {
                tracing::info!(peer = ?label(peer), relay = ?label(relay), "peer not reachable directly: traffic goes through a relay");
            }
        }
        for peer in self.relayed.keys().filter(|k| !relays.contains_key(*k)) {
            let direct = self
                .statuses
                .get(peer)
                .is_some_and(|st| st.state == PeerState::Up);
            tracing::info!(peer = ?label(peer), direct, "peer no longer relayed");
        }
        let down: Vec<u64> = self
            .direct
            .iter()
            .filter(|(_, d)| d.down(now, patience))
            .filter_map(|(k, _)| self.peers.get(k))
            .map(|(_, p)| key_id(p.public_key.as_bytes()))
            .collect();
        self.relay_active = !relays.is_empty() || !down.is_empty();
        self.direct_down = published_down(down);
        self.relayed = relays;
    }
}
