//! The discovered set: Watch messages decrypted and decoded into [`Affiliate`]s
//! (docs/discovery-protocol.md §8.5). What does not decrypt or decode is skipped, never fatal.

use std::{sync::Arc, time::Instant};

use rand::RngCore;

use super::{Affiliate, Machine, Phase};
use crate::{
    client::model::{decode_endpoint, AffiliateInfo},
    proto::server as wire,
};

impl<R: RngCore> Machine<R> {
    /// One Watch message arrived at `now`. Returns whether the discovered set changed.
    /// The own record is not part of the set; it is checked against the local data
    /// (see `own`).
    pub fn watch_message(&mut self, now: Instant, response: &wire::WatchResponse) -> bool {
        let Phase::Watching { snapshot_seen } = &mut self.phase else {
            return false;
        };
        let mut changed = false;
        if !*snapshot_seen {
            *snapshot_seen = true;
            self.own.confirmed = false;
            // The first message is the snapshot: it replaces everything.
            if !self.affiliates.is_empty() {
                Arc::make_mut(&mut self.affiliates).clear();
                changed = true;
            }
        }
        for wire_affiliate in &response.affiliates {
            if wire_affiliate.id == self.config.affiliate_id {
                self.own_seen(now, response.deleted, &wire_affiliate.data);
                continue;
            }
            if response.deleted {
                if self.affiliates.contains_key(&wire_affiliate.id) {
                    Arc::make_mut(&mut self.affiliates).remove(&wire_affiliate.id);
                    changed = true;
                }
                continue;
            }
            if wire_affiliate.data.is_empty() {
                continue;
            }
            let Some(affiliate) = self.decode_affiliate(wire_affiliate) else {
                continue;
            };
            if self.affiliates.get(&affiliate.id) != Some(&affiliate) {
                Arc::make_mut(&mut self.affiliates).insert(affiliate.id.clone(), affiliate);
                changed = true;
            }
        }
        changed
    }

    fn decode_affiliate(&self, wire_affiliate: &wire::Affiliate) -> Option<Affiliate> {
        let id = &wire_affiliate.id;
        let plaintext = match self.cipher.open_affiliate(&wire_affiliate.data) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(affiliate = ?id, error = %e, "skipping affiliate data that does not decrypt");
                return None;
            }
        };
        let info = match AffiliateInfo::decode(&plaintext) {
            Ok(i) => i,
            Err(e) => {
                tracing::warn!(affiliate = ?id, error = %e, "skipping affiliate data that does not decode");
                return None;
            }
        };
        if info.node_id != *id {
            tracing::warn!(affiliate = ?id, "skipping affiliate whose data names another node");
            return None;
        }
        let endpoints = wire_affiliate
            .endpoints
            .iter()
            .filter_map(|blob| {
                let decoded = self
                    .cipher
                    .open_endpoint(blob)
                    .map_err(|e| e.to_string())
                    .and_then(|pb| decode_endpoint(&pb).map_err(|e| e.to_string()));
                match decoded {
                    Ok(ep) => Some(ep),
                    Err(error) => {
                        tracing::debug!(affiliate = ?id, %error, "skipping endpoint blob");
                        None
                    }
                }
            })
            .collect();
        Some(Affiliate {
            id: id.clone(),
            info,
            endpoints,
        })
    }
}
