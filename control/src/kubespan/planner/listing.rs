//! Which peers the mesh holds: the peer specs as the feed delivers them, peers
//! discovery stopped listing while their WireGuard session was fresh (§8.10), and
//! peers the device held at start without a spec yet (§6.8).
//!
//! Unlisted: anyone who knows the cluster ID can delete affiliates, so a vanished peer
//! spec alone does not cut a working tunnel. The peer keeps its last spec (AllowedIPs,
//! routes, marking) until `keeps_unlisted` says its session went stale, and a spec
//! that comes back takes over without a change on the device.
//!
//! Kept from start: after a restart the specs come back only when discovery answers,
//! and removing a peer the device kept meanwhile would cut a working tunnel. It stays
//! as the device has it (minus prefixes a peer with a spec claims) until its spec
//! arrives, when its status is seeded from it, or until [`RETAIN_AFTER_START`] passed.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
    time::{Duration, SystemTime},
};

use ipnet::IpNet;
use wirespan_dataplane::wireguard::{PresharedKey, PublicKey, WgPeer};

use super::{DevicePeer, MeshState, RETAIN_AFTER_START};
use crate::{
    kubespan::{
        peers::routed_prefixes,
        prefixset::PrefixSet,
        rotation::{keeps_unlisted, peer_state},
    },
    resources::kubespan::{KubeSpanPeerSpec, PeerState},
    runtime::Changes,
};

/// A peer a complete round judged and keeps, before relays and programming.
#[derive(Debug)]
pub(super) struct Kept {
    /// Its public key.
    pub key: String,
    /// Its WireGuard peer without endpoint.
    pub base: WgPeer,
    /// The endpoint the judgement wants.
    pub desired_endpoint: Option<std::net::SocketAddr>,
}

impl MeshState {
    /// Brings the spec mirror up to date with the feed's `changes` (returns `None`:
    /// filled anew, else the ids that changed). A spec that vanished for a peer with a
    /// fresh session moves to the unlisted peers; one listed again leaves them.
    pub fn sync_specs(
        &mut self,
        changes: Changes<KubeSpanPeerSpec>,
        now: SystemTime,
    ) -> Option<Vec<String>> {
        let mut vanished = Vec::new();
        let changed = match changes {
            Changes::All(all) => {
                let fresh: BTreeMap<_, _> = all
                    .into_iter()
                    .map(|r| (r.metadata.id.clone(), r))
                    .collect();
                let old = std::mem::replace(&mut self.specs, fresh);
                vanished.extend(old.into_iter().filter(|(k, _)| !self.specs.contains_key(k)));
                None
            }
            Changes::Some(changes) => {
                for (id, r) in &changes {
                    match r {
                        Some(r) => {
                            self.specs.insert(id.clone(), Arc::clone(r));
                        }
                        None => vanished.extend(self.specs.remove_entry(id)),
                    }
                }
                Some(changes.into_keys().collect())
            }
        };
        if !self.unlisted.is_empty() {
            let specs = &self.specs;
            self.unlisted.retain(|k, r| {
                let back = specs.contains_key(k);
                if back {
                    tracing::info!(peer = %r.spec.label, "kept peer listed by discovery again");
                }
                !back
            });
        }
        for (key, spec) in vanished {
            if self
                .statuses
                .get(&key)
                .is_some_and(|st| keeps_unlisted(st, now))
            {
                tracing::info!(
                    peer = %spec.spec.label,
                    "peer no longer listed by discovery: kept while its WireGuard session is fresh"
                );
                self.unlisted.insert(key, spec);
            }
        }
        changed
    }

    /// Removes what a peer no longer listed and no longer kept leaves behind (its
    /// device peer and routes go with the round's plan).
    pub(super) fn drop_unlisted(&mut self, key: &str) {
        if let Some(r) = self.unlisted.remove(key) {
            tracing::info!(peer = %r.spec.label, "kept peer's session went stale: removed");
        }
        self.statuses.remove(key);
        self.peers.remove(key);
        self.rx.remove(key);
        self.direct.remove(key);
    }

    /// Kept peers give up every prefix a listed peer claims: WireGuard gives a prefix
    /// to one peer only, and the listed one is the one discovery vouches for now (a
    /// node that changed its key, say).
    pub(super) fn yield_to_listed(&self, kept: &mut [Kept]) {
        if self.unlisted.is_empty() {
            return;
        }
        let mut claimed = PrefixSet::new();
        for k in kept.iter().filter(|k| !self.unlisted.contains_key(&k.key)) {
            for p in &k.base.allowed_ips {
                claimed.insert(p);
            }
        }
        for k in kept
            .iter_mut()
            .filter(|k| self.unlisted.contains_key(&k.key))
        {
            let mut own = PrefixSet::new();
            for p in &k.base.allowed_ips {
                own.insert(p);
            }
            own.subtract(&claimed);
            k.base.allowed_ips = own.to_prefixes();
        }
    }

    /// Notes a device read: the first since start adopts the peers an earlier run kept
    /// (`--on-stop keep`) rather than replacing them.
    pub(super) fn note_read(&mut self, device: &HashMap<String, DevicePeer>, now: SystemTime) {
        if self.adopt_checked {
            return;
        }
        self.adopt_checked = true;
        if !device.is_empty() {
            tracing::info!(
                peers = device.len(),
                "adopting the peers the WireGuard device kept"
            );
            self.retain_until = Some(now + RETAIN_AFTER_START);
        }
    }

    /// Keeps the device's peers without a spec while within [`RETAIN_AFTER_START`]:
    /// appends them to `wg_peers` and `order` as the device has them, with their routed
    /// prefixes, minus any prefix a peer with a spec claims (WireGuard gives a prefix to
    /// one peer only; two claimants would take it from each other on every write).
    pub(super) fn retain_device_peers(
        &mut self,
        device: Option<HashMap<String, DevicePeer>>,
        (psk, force, down_interval): (&PresharedKey, bool, Duration),
        now: SystemTime,
        wg_peers: &mut Vec<WgPeer>,
        routed: &mut Vec<(String, Vec<IpNet>)>,
    ) {
        if self.retain_until.is_none_or(|t| now >= t) {
            if !self.retained.is_empty() {
                tracing::info!(
                    peers = self.retained.len(),
                    "dropping device peers that got no spec since start"
                );
            }
            self.retain_until = None;
            self.retained.clear();
            return;
        }
        let (specs, unlisted) = (&self.specs, &self.unlisted);
        let spec_less = |k: &String| !specs.contains_key(k) && !unlisted.contains_key(k);
        match device {
            Some(d) => {
                self.retained = d.into_iter().filter(|(k, _)| spec_less(k)).collect();
            }
            None => self.retained.retain(|k, _| spec_less(k)),
        }
        if self.retained.is_empty() {
            return;
        }
        let mut claimed = PrefixSet::new();
        for p in wg_peers.iter().flat_map(|p| &p.allowed_ips) {
            claimed.insert(p);
        }
        for (key, r) in &self.retained {
            let Ok(public_key) = PublicKey::from_base64("publicKey", key) else {
                continue;
            };
            let mut own = PrefixSet::new();
            for p in &r.allowed_ips {
                own.insert(p);
            }
            own.subtract(&claimed);
            let allowed_ips = own.to_prefixes();
            let up = peer_state(
                now,
                r.observed.last_handshake,
                None,
                r.observed.endpoint,
                down_interval,
            ) == PeerState::Up;
            routed.push((key.clone(), routed_prefixes(force, &allowed_ips, up)));
            wg_peers.push(WgPeer {
                public_key,
                preshared_key: Some(psk.clone()),
                persistent_keepalive: r.keepalive,
                endpoint: None,
                allowed_ips,
            });
        }
    }
}
