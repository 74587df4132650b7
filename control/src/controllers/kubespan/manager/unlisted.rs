//! Peers discovery stopped listing while their WireGuard session was fresh
//! (`docs/kubespan.md` §8.10). Anyone who knows the cluster ID can delete affiliates, so a
//! vanished peer spec alone does not cut a working tunnel: the peer keeps its last spec
//! (AllowedIPs, routes, marking) until [`keeps_unlisted`] says its session went stale,
//! and a spec that comes back takes over without a change on the device.

use std::{collections::BTreeMap, net::SocketAddr, sync::Arc, time::SystemTime};

use wirespan_dataplane::wireguard::WgPeer;

use super::KubeSpanManagerController;
use crate::{
    kubespan::{prefixset::PrefixSet, rotation::keeps_unlisted},
    runtime::{Changes, ControllerError, ControllerRuntime},
};

impl KubeSpanManagerController {
    /// Brings the spec mirror up to date, as `ChangeFeed::sync` does (`None`: filled
    /// anew, else the ids that changed). A spec that vanished for a peer with a fresh
    /// session moves to `unlisted`; one listed again leaves it.
    pub(super) fn sync_specs(
        &mut self,
        rt: &ControllerRuntime,
        now: SystemTime,
    ) -> Result<Option<Vec<String>>, ControllerError> {
        let mut vanished = Vec::new();
        let changed = match self.feed.take(rt)? {
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
        Ok(changed)
    }

    /// Removes what a peer no longer listed and no longer kept leaves behind in the
    /// manager's own state (its device peer and routes go with the round's write).
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
    pub(super) fn yield_to_listed(&self, stepped: &mut [(String, WgPeer, Option<SocketAddr>)]) {
        if self.unlisted.is_empty() {
            return;
        }
        let mut claimed = PrefixSet::new();
        for (key, peer, _) in stepped.iter() {
            if !self.unlisted.contains_key(key) {
                for p in &peer.allowed_ips {
                    claimed.insert(p);
                }
            }
        }
        for (key, peer, _) in stepped.iter_mut() {
            if self.unlisted.contains_key(key) {
                let mut kept = PrefixSet::new();
                for p in &peer.allowed_ips {
                    kept.insert(p);
                }
                kept.subtract(&claimed);
                peer.allowed_ips = kept.to_prefixes();
            }
        }
    }
}
