//! The state's memory budget and cluster cap: what a stored cluster and affiliate
//! cost, and what an update would add, checked before anything is touched. Pure.

use super::{Affiliate, Cluster, RequestError, State};
use crate::proto::server as pb;

/// Most clusters at once unless configured (`--max-clusters`).
pub const MAX_CLUSTERS: usize = 100_000;
/// Bytes of stored clusters and affiliates unless configured (`--state-budget-mib`):
/// 1 GiB holds ~200,000 maximal affiliates (256-byte ID, 2 KiB data, 64 endpoints)
/// or ~2 million typical ones.
pub const STATE_BUDGET: usize = 1 << 30;

/// Fixed cost of an affiliate beside its packed block: the table slot (40 bytes), the
/// allocator's share of the block and the kept-entry pointer.
pub(crate) const AFFILIATE_OVERHEAD: usize = 64;
/// Fixed cost of a cluster beside its ID: the map slot, the `Cluster` itself (its
/// tables, log handle and counters) and their first allocations.
pub(crate) const CLUSTER_OVERHEAD: usize = std::mem::size_of::<Cluster>() + 256;
/// Bytes an endpoint takes in a block beside its data (expiration and length).
const ENDPOINT_HEAD: usize = 9;

/// Bytes an empty cluster `id` takes.
#[must_use]
pub(crate) fn cluster_overhead(id: &str) -> usize {
    CLUSTER_OVERHEAD + id.len()
}

/// Bytes a cluster takes, affiliates included.
pub(crate) fn cluster_bytes(id: &str, cluster: &Cluster) -> usize {
    CLUSTER_OVERHEAD
        + id.len()
        + cluster
            .affiliates
            .iter()
            .map(Affiliate::stored_bytes)
            .sum::<usize>()
}

/// Most bytes `req` can add to `existing` (the affiliate it names, if stored): new
/// data beyond the old, endpoints not stored yet, and for a new affiliate its ID and
/// fixed cost. An upper bound (duplicates in the request are counted twice).
pub(crate) fn update_growth(
    req: &pb::AffiliateUpdateRequest,
    existing: Option<&Affiliate>,
) -> usize {
    let data = req.affiliate_data.as_deref().unwrap_or_default();
    let endpoints = |known: &dyn Fn(&[u8]) -> bool| -> usize {
        req.affiliate_endpoints
            .iter()
            .filter(|e| !known(e))
            .map(|e| ENDPOINT_HEAD + e.len())
            .sum()
    };
    match existing {
        Some(a) => data.len().saturating_sub(a.data().len()) + endpoints(&|e| a.has_endpoint(e)),
        None => {
            AFFILIATE_OVERHEAD + 4 + req.affiliate_id.len() + data.len() + endpoints(&|_| false)
        }
    }
}

impl State {
    /// Sets the cluster cap ([`MAX_CLUSTERS`] unless changed).
    pub fn set_max_clusters(&mut self, max: usize) {
        self.max_clusters = max;
    }

    /// Sets the byte budget of stored clusters and affiliates ([`STATE_BUDGET`]
    /// unless changed). Requests that would grow the state past it are refused;
    /// watchers' buffers have their own budget ([`State::set_watch_budget`]).
    pub fn set_state_budget(&mut self, budget: usize) {
        self.state_budget = budget;
    }

    /// Bytes the stored clusters and affiliates take (the budget's measure).
    #[must_use]
    pub fn stored_bytes(&self) -> usize {
        self.stored_bytes
    }

    /// Recounts [`Self::stored_bytes`] from scratch (after a load or a GC pass).
    pub(crate) fn recount_bytes(&mut self) {
        self.stored_bytes = self
            .clusters
            .iter()
            .map(|(id, c)| cluster_bytes(id, c))
            .sum();
    }

    /// Adds a cluster read from a snapshot, which takes `bytes` (checked by the
    /// loader against the same limits).
    pub(crate) fn add_loaded_cluster(&mut self, id: String, cluster: Cluster, bytes: usize) {
        self.clusters.insert(id, cluster);
        self.stored_bytes += bytes;
    }

    /// Refuses a new cluster `id` beyond the cap or the budget; counts the refusal.
    pub(crate) fn admit_cluster(&mut self, id: &str, growth: usize) -> Result<(), RequestError> {
        if self.clusters.len() >= self.max_clusters {
            self.clusters_refused += 1;
            return Err(RequestError::TooManyClusters(self.max_clusters));
        }
        self.admit_growth(CLUSTER_OVERHEAD + id.len() + growth)
    }

    /// Refuses `growth` more bytes beyond the budget; counts the refusal.
    pub(crate) fn admit_growth(&mut self, growth: usize) -> Result<(), RequestError> {
        if growth > 0 && self.stored_bytes.saturating_add(growth) > self.state_budget {
            self.budget_refused += 1;
            return Err(RequestError::StateBudget(self.state_budget));
        }
        Ok(())
    }

    /// Checks an update against the cap and the budget before it touches anything.
    pub(crate) fn admit_update(
        &mut self,
        req: &pb::AffiliateUpdateRequest,
    ) -> Result<(), RequestError> {
        let Some(cluster) = self.clusters.get(&req.cluster_id) else {
            let growth = update_growth(req, None);
            return self.admit_cluster(&req.cluster_id, growth);
        };
        let growth = update_growth(req, cluster.affiliates.get(&req.affiliate_id));
        self.admit_growth(growth)
    }
}
