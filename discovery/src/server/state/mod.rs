//! The server's state machine: clusters, affiliates, endpoints, subscriptions, expiry
//! and garbage collection. No I/O and no clock: every time-dependent operation takes
//! `now`, so the rules are tested on a fake clock. The gRPC service is a thin shell
//! around [`State`] behind one mutex.
//!
//! Request validation and TTL arithmetic live in `validate` and are re-exported here.

#[cfg(test)]
mod tests;
mod validate;

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use tokio::sync::mpsc;

pub use self::validate::{
    offset, ttl_nanos, validate_affiliate_id, validate_cluster_id, validate_update,
};
use super::error::RequestError;
use crate::proto::server as pb;

/// Longest cluster or affiliate ID, in bytes.
pub const MAX_ID_LEN: usize = 256;
/// Largest encrypted affiliate data blob, in bytes.
pub const MAX_DATA_LEN: usize = 2048;
/// Largest encrypted endpoint blob, in bytes.
pub const MAX_ENDPOINT_LEN: usize = 32;
/// Largest TTL a client may ask for.
pub const MAX_TTL: Duration = Duration::from_secs(30 * 60);
/// Most affiliates in one cluster.
pub const MAX_AFFILIATES: usize = 1024;
/// Most endpoints of one affiliate.
pub const MAX_ENDPOINTS: usize = 64;
/// Events queued per watcher before it is aborted as too slow.
pub const WATCH_QUEUE: usize = 32;

/// One Watch message, shared by every watcher of the cluster.
pub type Event = Arc<pb::WatchResponse>;

/// One stored endpoint blob.
#[derive(Debug, Clone)]
pub(crate) struct Endpoint {
    pub(crate) expiration: Instant,
    pub(crate) data: Box<[u8]>,
}

/// One stored affiliate: opaque blobs, each expiring on its own.
#[derive(Debug, Clone)]
pub(crate) struct Affiliate {
    pub(crate) expiration: Instant,
    pub(crate) data: Box<[u8]>,
    /// Insertion order is kept; identity is byte equality.
    pub(crate) endpoints: Vec<Endpoint>,
}

impl Affiliate {
    fn export(&self, id: &str) -> pb::Affiliate {
        pb::Affiliate {
            id: id.to_owned(),
            data: self.data.to_vec(),
            endpoints: self.endpoints.iter().map(|e| e.data.to_vec()).collect(),
        }
    }
}

struct Subscriber {
    id: u64,
    tx: mpsc::Sender<Event>,
    lost: Arc<AtomicBool>,
}

/// One cluster: affiliates and the watchers subscribed to them.
#[derive(Default)]
pub(crate) struct Cluster {
    pub(crate) affiliates: HashMap<String, Affiliate>,
    subscribers: Vec<Subscriber>,
}

impl Cluster {
    pub(crate) fn with_affiliates(affiliates: HashMap<String, Affiliate>) -> Self {
        Self {
            affiliates,
            subscribers: Vec::new(),
        }
    }

    /// Sends `event` to every watcher without blocking. A watcher whose queue is full
    /// is dropped and marked lost; one that went away is dropped silently.
    fn notify(&mut self, event: &Event) {
        self.subscribers
            .retain(|s| match s.tx.try_send(Arc::clone(event)) {
                Ok(()) => true,
                Err(mpsc::error::TrySendError::Full(_)) => {
                    s.lost.store(true, Ordering::Release);
                    false
                }
                Err(mpsc::error::TrySendError::Closed(_)) => false,
            });
    }

    fn notify_upsert(&mut self, id: &str) {
        if self.subscribers.is_empty() {
            return;
        }
        let Some(affiliate) = self.affiliates.get(id) else {
            return;
        };
        let event = Arc::new(pb::WatchResponse {
            affiliates: vec![affiliate.export(id)],
            deleted: false,
        });
        self.notify(&event);
    }

    fn notify_delete(&mut self, id: &str) {
        if self.subscribers.is_empty() {
            return;
        }
        let event = Arc::new(pb::WatchResponse {
            affiliates: vec![pb::Affiliate {
                id: id.to_owned(),
                ..pb::Affiliate::default()
            }],
            deleted: true,
        });
        self.notify(&event);
    }
}

/// A registered watcher: the snapshot to send first, then the live events.
#[derive(Debug)]
pub struct Subscription {
    /// The watched cluster.
    pub cluster_id: String,
    /// Handle for [`State::unsubscribe`].
    pub id: u64,
    /// Every affiliate at registration time (sent first, even when empty).
    pub snapshot: pb::WatchResponse,
    /// Live events, one affiliate each.
    pub events: mpsc::Receiver<Event>,
    /// Set when the subscription was dropped because its queue overflowed.
    pub lost: Arc<AtomicBool>,
}

/// What one GC pass removed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GcStats {
    /// Clusters removed (no affiliates, no watchers).
    pub clusters: usize,
    /// Affiliates removed (expired).
    pub affiliates: usize,
    /// Endpoints removed from affiliates that stay.
    pub endpoints: usize,
}

/// Sizes of the state, for gauges.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Clusters.
    pub clusters: usize,
    /// Affiliates over all clusters.
    pub affiliates: usize,
    /// Endpoints over all affiliates.
    pub endpoints: usize,
    /// Live watchers.
    pub subscriptions: usize,
}

/// One affiliate as the inspect page shows it: sizes and expiry, never contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AffiliateInfo {
    /// Affiliate ID.
    pub id: String,
    /// Length of the encrypted data.
    pub data_len: usize,
    /// Number of endpoint blobs.
    pub endpoints: usize,
    /// Seconds until the affiliate expires (negative: already expired).
    pub expires_in_secs: i64,
}

/// Signed whole seconds from `now` to `t`, truncated toward zero.
#[must_use]
pub fn signed_secs(t: Instant, now: Instant) -> i64 {
    if t >= now {
        i64::try_from((t - now).as_secs()).unwrap_or(i64::MAX)
    } else {
        -i64::try_from((now - t).as_secs()).unwrap_or(i64::MAX)
    }
}

/// All clusters of the server.
#[derive(Default)]
pub struct State {
    pub(crate) clusters: HashMap<String, Cluster>,
    next_subscriber: u64,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("counts", &self.counts())
            .finish_non_exhaustive()
    }
}

impl State {
    /// An empty state.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// AffiliateUpdate: validates, then creates or merges the affiliate and notifies
    /// watchers. A rejected request leaves the state untouched; a request that fails
    /// half-way on the endpoint limit keeps the merges made before the failure, as
    /// upstream does.
    ///
    /// # Errors
    /// Validation errors, [`RequestError::TooManyAffiliates`],
    /// [`RequestError::TooManyEndpoints`].
    pub fn update(
        &mut self,
        now: Instant,
        req: &pb::AffiliateUpdateRequest,
    ) -> Result<(), RequestError> {
        validate_update(req)?;
        let exp = offset(now, ttl_nanos(req.ttl.as_ref()));
        let cluster = self.clusters.entry(req.cluster_id.clone()).or_default();
        let id = req.affiliate_id.as_str();
        let data = req.affiliate_data.as_deref().filter(|d| !d.is_empty());
        if let Some(affiliate) = cluster.affiliates.get_mut(id) {
            let (changed, result) = apply(affiliate, exp, data, &req.affiliate_endpoints);
            if changed {
                cluster.notify_upsert(id);
            }
            result
        } else {
            if cluster.affiliates.len() >= MAX_AFFILIATES {
                return Err(RequestError::TooManyAffiliates);
            }
            // Upstream starts from the zero time: a new affiliate whose update fails
            // before setting an expiration is collected at the next GC.
            let mut affiliate = Affiliate {
                expiration: offset(now, i64::MIN),
                data: Box::default(),
                endpoints: Vec::new(),
            };
            let (_, result) = apply(&mut affiliate, exp, data, &req.affiliate_endpoints);
            cluster.affiliates.insert(id.to_owned(), affiliate);
            cluster.notify_upsert(id);
            result
        }
    }

    /// AffiliateDelete: removes the affiliate if present and notifies a delete.
    ///
    /// # Errors
    /// Validation errors only; deleting a missing affiliate succeeds.
    pub fn delete(&mut self, cluster_id: &str, affiliate_id: &str) -> Result<(), RequestError> {
        validate_cluster_id(cluster_id)?;
        validate_affiliate_id(affiliate_id)?;
        let cluster = self.clusters.entry(cluster_id.to_owned()).or_default();
        if cluster.affiliates.remove(affiliate_id).is_some() {
            cluster.notify_delete(affiliate_id);
        }
        Ok(())
    }

    /// List: every affiliate of the cluster (creates the cluster, like upstream; GC
    /// removes it again if nothing else uses it).
    ///
    /// # Errors
    /// Validation errors.
    pub fn list(&mut self, cluster_id: &str) -> Result<Vec<pb::Affiliate>, RequestError> {
        validate_cluster_id(cluster_id)?;
        let cluster = self.clusters.entry(cluster_id.to_owned()).or_default();
        Ok(cluster
            .affiliates
            .iter()
            .map(|(id, a)| a.export(id))
            .collect())
    }

    /// Watch: copies the snapshot and registers the watcher in one step, so no event
    /// falls between them. `queue` is the watcher's event queue length
    /// ([`WATCH_QUEUE`] in the server).
    ///
    /// # Errors
    /// Validation errors.
    pub fn watch(&mut self, cluster_id: &str, queue: usize) -> Result<Subscription, RequestError> {
        validate_cluster_id(cluster_id)?;
        let cluster = self.clusters.entry(cluster_id.to_owned()).or_default();
        self.next_subscriber += 1;
        let id = self.next_subscriber;
        let (tx, events) = mpsc::channel(queue.max(1));
        let lost = Arc::new(AtomicBool::new(false));
        cluster.subscribers.push(Subscriber {
            id,
            tx,
            lost: Arc::clone(&lost),
        });
        let snapshot = pb::WatchResponse {
            affiliates: cluster
                .affiliates
                .iter()
                .map(|(id, a)| a.export(id))
                .collect(),
            deleted: false,
        };
        Ok(Subscription {
            cluster_id: cluster_id.to_owned(),
            id,
            snapshot,
            events,
            lost,
        })
    }

    /// Removes a watcher (stream ended). The cluster becomes collectable once it has
    /// neither affiliates nor watchers.
    pub fn unsubscribe(&mut self, cluster_id: &str, id: u64) {
        if let Some(cluster) = self.clusters.get_mut(cluster_id) {
            cluster.subscribers.retain(|s| s.id != id);
        }
    }

    /// Drops every watcher's queue, so their streams end (server shutdown).
    pub fn close_subscriptions(&mut self) {
        for cluster in self.clusters.values_mut() {
            cluster.subscribers.clear();
        }
    }

    /// One GC pass: removes affiliates with `expiration < now`, drops endpoints with
    /// `expiration <= now` from the others, and removes clusters with neither
    /// affiliates nor watchers. A removed affiliate is notified as a delete; one that
    /// only lost endpoints as an upsert of its current state (upstream sends a delete
    /// there, which makes clients forget a live peer).
    pub fn gc(&mut self, now: Instant) -> GcStats {
        let mut stats = GcStats::default();
        for cluster in self.clusters.values_mut() {
            let mut removed = Vec::new();
            let mut trimmed = Vec::new();
            cluster.affiliates.retain(|id, a| {
                if a.expiration < now {
                    removed.push(id.clone());
                    return false;
                }
                let before = a.endpoints.len();
                a.endpoints.retain(|e| e.expiration > now);
                if a.endpoints.len() != before {
                    stats.endpoints += before - a.endpoints.len();
                    trimmed.push(id.clone());
                }
                true
            });
            stats.affiliates += removed.len();
            for id in &removed {
                cluster.notify_delete(id);
            }
            for id in &trimmed {
                cluster.notify_upsert(id);
            }
            // Watchers that went away without unsubscribing do not keep a cluster.
            cluster.subscribers.retain(|s| !s.tx.is_closed());
        }
        let before = self.clusters.len();
        self.clusters
            .retain(|_, c| !(c.affiliates.is_empty() && c.subscribers.is_empty()));
        stats.clusters = before - self.clusters.len();
        stats
    }

    /// Current sizes.
    #[must_use]
    pub fn counts(&self) -> Counts {
        let mut counts = Counts {
            clusters: self.clusters.len(),
            ..Counts::default()
        };
        for cluster in self.clusters.values() {
            counts.affiliates += cluster.affiliates.len();
            counts.subscriptions += cluster.subscribers.len();
            counts.endpoints += cluster
                .affiliates
                .values()
                .map(|a| a.endpoints.len())
                .sum::<usize>();
        }
        counts
    }

    /// Affiliates of one cluster for the inspect page, sorted by ID; `None` if the
    /// cluster does not exist (inspecting does not create it).
    #[must_use]
    pub fn inspect(&self, cluster_id: &str, now: Instant) -> Option<Vec<AffiliateInfo>> {
        let cluster = self.clusters.get(cluster_id)?;
        let mut out: Vec<_> = cluster
            .affiliates
            .iter()
            .map(|(id, a)| AffiliateInfo {
                id: id.clone(),
                data_len: a.data.len(),
                endpoints: a.endpoints.len(),
                expires_in_secs: signed_secs(a.expiration, now),
            })
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Some(out)
    }
}

/// Merges one update into an affiliate; returns whether watchers must hear of it and
/// the error that stopped the merge, if any.
fn apply(
    a: &mut Affiliate,
    exp: Instant,
    data: Option<&[u8]>,
    endpoints: &[Vec<u8>],
) -> (bool, Result<(), RequestError>) {
    let mut changed = false;
    if let Some(data) = data {
        a.data = data.into();
        // May shorten the expiration: the data's TTL is the client's latest word.
        a.expiration = exp;
        changed = true;
    }
    for blob in endpoints {
        if let Some(existing) = a.endpoints.iter_mut().find(|e| *e.data == **blob) {
            existing.expiration = existing.expiration.max(exp);
        } else if a.endpoints.len() >= MAX_ENDPOINTS {
            return (changed, Err(RequestError::TooManyEndpoints));
        } else {
            a.endpoints.push(Endpoint {
                expiration: exp,
                data: blob.as_slice().into(),
            });
            changed = true;
        }
    }
    a.expiration = a.expiration.max(exp);
    (changed, Ok(()))
}
