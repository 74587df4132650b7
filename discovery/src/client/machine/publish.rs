//! The publish path: own data and harvested endpoints of peers, encrypted once
//! when they change, and sent as refresh batches (one at a time) whenever a refresh
//! is due (docs/discovery-protocol.md §8.4).

use std::{collections::BTreeMap, time::Instant};

use rand::RngCore;

use super::{Action, LocalData, LocalDataError, Machine, Phase, RefreshCall, MAX_ENDPOINTS};
use crate::{
    client::{
        crypto::{GCM_OVERHEAD, MAX_AFFILIATE_BLOB},
        model::{encode_endpoint, AffiliateInfo, Endpoint},
    },
    proto::server as wire,
};

impl<R: RngCore> Machine<R> {
    /// The refresh batch finished.
    pub fn refresh_done(&mut self, now: Instant, ok: bool) {
        if !self.refresh_in_flight {
            return;
        }
        self.refresh_in_flight = false;
        if ok {
            self.backoff.reset();
            self.maybe_refresh();
            self.maybe_republish(now);
        } else {
            self.refresh_due = true;
            self.actions.push_back(Action::CancelWatch);
            self.enter_backoff(now);
        }
    }

    /// Sets the own affiliate and endpoints. Returns `Ok(false)` without encrypting
    /// anything when they equal the current ones (re-encryption would produce new
    /// bytes and wake every watcher for nothing).
    ///
    /// # Errors
    /// [`LocalDataError`]; the previous local data stays published.
    pub fn set_local_data(
        &mut self,
        info: AffiliateInfo,
        endpoints: Vec<Endpoint>,
    ) -> Result<bool, LocalDataError> {
        if !self.deleted
            && self
                .local
                .as_ref()
                .is_some_and(|l| l.info == info && l.endpoints == endpoints)
        {
            return Ok(false);
        }
        if info.node_id != self.config.affiliate_id {
            return Err(LocalDataError::NodeIdMismatch {
                node_id: info.node_id,
                affiliate_id: self.config.affiliate_id.clone(),
            });
        }
        if endpoints.len() > MAX_ENDPOINTS {
            return Err(LocalDataError::TooManyEndpoints {
                count: endpoints.len(),
            });
        }
        let plaintext = info.encode();
        if plaintext.len() + GCM_OVERHEAD > MAX_AFFILIATE_BLOB {
            return Err(LocalDataError::TooLarge {
                plaintext: plaintext.len(),
            });
        }
        let data_blob = self.cipher.seal_affiliate(&plaintext, &mut self.rng);
        let endpoint_blobs = self.seal_endpoints(&endpoints);
        self.local = Some(LocalData {
            info,
            endpoints,
            data_blob,
            endpoint_blobs,
        });
        self.deleted = false;
        self.own.confirmed = false;
        self.refresh_due = true;
        self.maybe_refresh();
        Ok(true)
    }

    /// Sets endpoints observed for other affiliates (harvested), each sent as an
    /// endpoints-only update for that affiliate. Entries for the own ID and empty
    /// lists are ignored. Returns `false` when nothing changed.
    pub fn set_other_endpoints(&mut self, others: BTreeMap<String, Vec<Endpoint>>) -> bool {
        let wanted: BTreeMap<String, Vec<Endpoint>> = others
            .into_iter()
            .filter(|(id, eps)| *id != self.config.affiliate_id && !eps.is_empty())
            .map(|(id, mut eps)| {
                eps.truncate(MAX_ENDPOINTS);
                (id, eps)
            })
            .collect();
        let same = wanted.len() == self.others.len()
            && wanted
                .iter()
                .zip(&self.others)
                .all(|((a, ea), (b, (eb, _)))| a == b && ea == eb);
        if same {
            return false;
        }
        self.others = wanted
            .into_iter()
            .map(|(id, eps)| {
                let blobs = self.seal_endpoints(&eps);
                (id, (eps, blobs))
            })
            .collect();
        self.refresh_due = true;
        self.maybe_refresh();
        true
    }

    /// Forgets the local data and deletes the own affiliate at the next refresh
    /// (and every refresh after, until new local data is set).
    pub fn delete_own_affiliate(&mut self) {
        if self.deleted {
            return;
        }
        self.local = None;
        self.deleted = true;
        self.own.confirmed = false;
        self.republish_covered();
        self.refresh_due = true;
        self.maybe_refresh();
    }

    fn seal_endpoints(&self, endpoints: &[Endpoint]) -> Vec<Vec<u8>> {
        endpoints
            .iter()
            .map(|ep| {
                self.cipher
                    .seal_endpoint(&encode_endpoint(ep))
                    .expect("an Endpoint protobuf is at most 22 bytes")
            })
            .collect()
    }

    pub(super) fn maybe_refresh(&mut self) {
        if !matches!(self.phase, Phase::Watching { .. })
            || !self.refresh_due
            || self.refresh_in_flight
        {
            return;
        }
        self.refresh_due = false;
        let batch = self.refresh_batch();
        if batch.is_empty() {
            // Nothing to publish counts as a successful refresh (§8.4 step 2).
            self.backoff.reset();
            return;
        }
        self.republish_covered();
        self.refresh_in_flight = true;
        self.actions.push_back(Action::Refresh(batch));
    }

    /// The update of the own affiliate (data and own endpoints), if there is data.
    pub(super) fn own_update(&self) -> Option<RefreshCall> {
        let local = self.local.as_ref().filter(|_| !self.deleted)?;
        Some(RefreshCall::Update(wire::AffiliateUpdateRequest {
            cluster_id: self.config.cluster_id.clone(),
            affiliate_id: self.config.affiliate_id.clone(),
            affiliate_data: Some(local.data_blob.clone()),
            affiliate_endpoints: local.endpoint_blobs.clone(),
            ttl: prost_types::Duration::try_from(self.config.ttl).ok(),
        }))
    }

    fn refresh_batch(&self) -> Vec<RefreshCall> {
        let cluster_id = &self.config.cluster_id;
        if self.deleted {
            return vec![RefreshCall::Delete(wire::AffiliateDeleteRequest {
                cluster_id: cluster_id.clone(),
                affiliate_id: self.config.affiliate_id.clone(),
            })];
        }
        let Some(own) = self.own_update() else {
            return Vec::new();
        };
        let ttl = prost_types::Duration::try_from(self.config.ttl).ok();
        let mut batch = vec![own];
        for (peer, (_, blobs)) in &self.others {
            batch.push(RefreshCall::Update(wire::AffiliateUpdateRequest {
                cluster_id: cluster_id.clone(),
                affiliate_id: peer.clone(),
                affiliate_data: None,
                affiliate_endpoints: blobs.clone(),
                ttl,
            }));
        }
        batch
    }
}
