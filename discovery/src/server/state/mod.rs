//! The server's state machine: clusters, affiliates, endpoints, subscriptions, expiry
//! and garbage collection. No I/O and no clock: every time-dependent operation takes
//! `now`, so the rules are tested on a fake clock. The gRPC service is a thin shell
//! around [`State`] behind one mutex.
//!
//! Request validation and TTL arithmetic live in `validate` and are re-exported here;
//! watch delivery (queues, catch-up, event encoding) in `watch`, the clusters' logs
//! of recent events for watchers that fell behind in `event_log`.

mod budget;
mod encode;
mod entry;
mod event_log;
mod lag;
mod meter;
mod record;
#[cfg(test)]
mod tests;
mod validate;
pub mod watch;

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex, Weak},
    time::{Duration, Instant},
};

use bytes::{Bytes, BytesMut};

pub(crate) use self::budget::cluster_overhead;
pub use self::budget::{MAX_CLUSTERS, STATE_BUDGET};
pub use self::validate::{
    offset, ttl_nanos, validate_affiliate_id, validate_cluster_id, validate_update,
};
pub use self::{
    entry::Batch,
    lag::RuntimeLag,
    meter::WatchBytes,
    watch::{Next, WatchQueue, WATCH_STALL},
};
use self::{
    entry::{BatchParts, Entry},
    event_log::{EventLog, SEGMENT},
    watch::{lock, Message, Pushed},
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
/// Most affiliates in one cluster (upstream's limit; the server's default).
pub const MAX_AFFILIATES: usize = 1024;
/// Most endpoints of one affiliate.
pub const MAX_ENDPOINTS: usize = 64;
/// Events queued per watcher before it is aborted as too slow.
pub const WATCH_QUEUE: usize = 32;
/// Bytes of snapshots and catch-up batches the server holds for watchers before it
/// aborts the slowest of them (see [`State::set_watch_budget`]).
pub const WATCH_BUDGET: usize = 256 << 20;

/// One encoded Watch message with its gRPC prefix, shared by every watcher of the
/// cluster.
pub type Event = Bytes;

pub(crate) use self::record::{Affiliate, Affiliates, Endpoint};

impl Affiliate {
    fn export(&self) -> pb::Affiliate {
        pb::Affiliate {
            id: self.id().to_owned(),
            data: self.data().to_vec(),
            endpoints: self.endpoints().map(|e| e.data.to_vec()).collect(),
        }
    }
}

struct Subscriber {
    id: u64,
    queue: Arc<WatchQueue>,
    /// The queue lags (see [`Pushed::Lagging`]): its stream reads the cluster's
    /// event log until it has read it all and rejoins its queue, or gets a catch-up
    /// from the state once the log no longer reaches back to it. Kept here, beside the ID, so an event
    /// passes over a lagging watcher without reaching for its queue: in a burst
    /// most watchers of a large cluster lag, and a visit to each of 10,000 queues
    /// per event is what kept the state lock busy.
    lagging: bool,
}

impl Subscriber {
    /// The stream holds the other reference; without it nobody reads.
    fn gone(&self) -> bool {
        Arc::strong_count(&self.queue) == 1
    }
}

/// One cluster: affiliates and the watchers subscribed to them.
#[derive(Default)]
pub(crate) struct Cluster {
    pub(crate) affiliates: Affiliates,
    subscribers: Vec<Subscriber>,
    /// Sequence number of the last event (every change is one).
    seq: u64,
    /// Deletions a lagging watcher may still need for its catch-up: (seq, ID), oldest
    /// first; trimmed to what the slowest watcher has not taken yet.
    tombstones: VecDeque<(u64, Box<str>)>,
    /// Tombstone count that triggers the next trim.
    trim_at: usize,
    /// The events since the slowest watcher's position, for lagging watchers to
    /// read (shared with every watcher's queue).
    log: Arc<Mutex<EventLog>>,
    /// Watchers switched to the log so far.
    lagged: u64,
    /// Events were logged since the log was last dropped.
    logged: bool,
    /// The last snapshot made and the event it was made after: watchers that
    /// register before the next event share it. Weak, so it lives only as long as a
    /// watcher still holds it.
    snapshot: Option<(u64, Weak<BatchParts>)>,
}

/// Tombstones kept before the first trim is tried.
const TOMBSTONE_TRIM: usize = 4096;

/// Bytes of events a cluster's log may keep whatever its size (see
/// [`Cluster::log_limit`]).
const LOG_MIN: usize = 4 * SEGMENT;

impl Cluster {
    pub(crate) fn with_affiliates(affiliates: Affiliates) -> Self {
        Self {
            affiliates,
            ..Self::default()
        }
    }

    /// Queues `event` for every watcher that does not lag, without blocking. A
    /// watcher that stalled with a full queue is dropped and marked lost; one that
    /// went away is dropped silently. Lagging watchers are left to the event log and
    /// to the periodic stall check.
    fn notify(&mut self, seq: u64, event: &Event, now: Instant) {
        let lagged = &mut self.lagged;
        self.subscribers.retain_mut(|s| {
            if s.lagging {
                // It reads the event from the log; a stall meanwhile is the
                // periodic check's to find.
                return true;
            }
            if s.gone() {
                return false;
            }
            match s.queue.push(seq, event, now) {
                Pushed::Queued => true,
                Pushed::Lagging => {
                    s.lagging = true;
                    *lagged += 1;
                    true
                }
                Pushed::Dropped => false,
            }
        });
    }

    fn notify_upsert(&mut self, id: &str, now: Instant, meter: &Arc<WatchBytes>) {
        self.seq += 1;
        let seq = self.seq;
        let Some(affiliate) = self.affiliates.get_mut(id) else {
            return;
        };
        affiliate.changed = seq;
        if self.subscribers.is_empty() {
            self.drop_log();
            return;
        }
        let event = encode::encode_event(id, affiliate);
        affiliate.set_entry(Entry::new(event.clone(), meter));
        self.log_event(seq, &event, now);
        self.notify(seq, &event, now);
    }

    fn notify_delete(&mut self, id: &str, now: Instant) {
        self.seq += 1;
        if self.subscribers.is_empty() {
            // A watcher registered later starts after this event.
            self.drop_log();
            return;
        }
        let seq = self.seq;
        let mut buf = encode::framed(id.len() + 8);
        encode::put_deleted(&mut buf, id);
        encode::put_deleted_flag(&mut buf);
        encode::seal(&mut buf);
        let event = buf.freeze();
        self.log_event(seq, &event, now);
        self.notify(seq, &event, now);
        self.tombstones.push_back((seq, id.into()));
        if self.tombstones.len() >= self.trim_at.max(TOMBSTONE_TRIM) {
            self.trim_tombstones();
            self.trim_at = self.tombstones.len() * 2;
        }
    }

    /// Drops the log's events once no watcher is left to read them (without its lock
    /// when there are none: clusters without watchers take most updates).
    fn drop_log(&mut self) {
        if std::mem::take(&mut self.logged) {
            lock(&self.log).clear();
        }
    }

    /// Appends the event to the log, and trims the log when it has grown enough for
    /// a trim to be due.
    fn log_event(&mut self, seq: u64, event: &Event, now: Instant) {
        self.logged = true;
        let mut log = lock(&self.log);
        log.append(seq, event, now);
        let limit = self.log_limit(&log);
        let due = log.trim_due();
        if !due && log.bytes() > limit {
            // Over the limit between two trims (readers that stopped pin the log):
            // the oldest segments go, needed or not.
            log.trim(0, limit);
        }
        drop(log);
        if due {
            // Queue locks are taken without the log's (readers take them the other
            // way round).
            let oldest = self.oldest_delivered();
            lock(&self.log).trim(oldest + 1, limit);
        }
    }

    /// Most bytes the event log keeps: twice the cluster's encoded size as the log's
    /// events average it, so a watcher that fell behind by up to a whole cluster of
    /// changes reads them from the log; at least [`LOG_MIN`].
    fn log_limit(&self, log: &EventLog) -> usize {
        let average = log.bytes() / log.len().max(1);
        (2 * self.affiliates.len() * average).max(LOG_MIN)
    }

    /// The last event every watcher has taken.
    fn oldest_delivered(&self) -> u64 {
        self.subscribers
            .iter()
            .map(|s| s.queue.delivered())
            .min()
            .unwrap_or(self.seq)
    }

    /// Drops tombstones every watcher has already passed.
    fn trim_tombstones(&mut self) {
        let oldest = self.oldest_delivered();
        while self
            .tombstones
            .front()
            .is_some_and(|(seq, _)| *seq <= oldest)
        {
            self.tombstones.pop_front();
        }
    }

    /// The catch-up of a watcher that took every event up to `since`: the current
    /// state of each affiliate changed after it and a delete for each affiliate
    /// removed after it, in event order, several affiliates per message. Upserts are
    /// batches of the affiliates' kept entries, not copies.
    fn catch_up(&mut self, since: u64, meter: &Arc<WatchBytes>) -> Vec<(u64, Message)> {
        enum Item<'a> {
            Upsert(Arc<Entry>),
            Delete(&'a str),
        }
        let mut items: Vec<(u64, Item<'_>)> = self
            .affiliates
            .iter_mut()
            .filter(|a| a.changed > since)
            .map(|a| (a.changed, Item::Upsert(entry(a, meter))))
            .collect();
        items.extend(
            self.tombstones
                .iter()
                .filter(|(seq, _)| *seq > since)
                .map(|(seq, id)| (*seq, Item::Delete(id))),
        );
        let items = in_event_order(items, since, self.seq);
        let mut out = Vec::new();
        // The message being gathered: entries (upserts) or a buffer (deletes).
        let mut entries: Vec<Arc<Entry>> = Vec::new();
        let mut deletes = encode::framed(0);
        let mut size = 0;
        let mut last = since;
        let mut flush = |entries: &mut Vec<Arc<Entry>>, deletes: &mut BytesMut, at: u64| {
            if !entries.is_empty() {
                let batch = Batch::new(std::mem::take(entries), meter);
                out.push((at, Message::Parts(batch)));
            } else if deletes.len() > encode::PREFIX {
                let mut buf = std::mem::replace(deletes, encode::framed(0));
                encode::put_deleted_flag(&mut buf);
                encode::seal(&mut buf);
                out.push((at, Message::Flat(meter::counted(buf, meter))));
            }
        };
        for (seq, item) in items {
            let is_delete = matches!(item, Item::Delete(_));
            // One message holds either upserts or deletes (the flag covers all).
            let kind_changes = if is_delete {
                !entries.is_empty()
            } else {
                deletes.len() > encode::PREFIX
            };
            if kind_changes || size >= watch::CATCH_UP_BATCH {
                flush(&mut entries, &mut deletes, last);
                size = 0;
            }
            match item {
                Item::Upsert(entry) => {
                    size += entry.len() - encode::PREFIX;
                    entries.push(entry);
                }
                Item::Delete(id) => {
                    let before = deletes.len();
                    encode::put_deleted(&mut deletes, id);
                    size += deletes.len() - before;
                }
            }
            last = seq;
        }
        flush(&mut entries, &mut deletes, self.seq);
        if let Some(end) = out.last_mut() {
            end.0 = self.seq;
        }
        out
    }

    /// Every affiliate as one encoded `WatchResponse` (the snapshot), shared with the
    /// watchers that registered since the last event and still hold it. It is made of
    /// the affiliates' kept entries; those missing (changed while nobody watched) are
    /// encoded now and kept for the next snapshot.
    fn snapshot(&mut self, meter: &Arc<WatchBytes>) -> Batch {
        if let Some((seq, weak)) = &self.snapshot {
            if *seq == self.seq {
                if let Some(shared) = Batch::upgrade(weak) {
                    return shared;
                }
            }
        }
        let entries = self
            .affiliates
            .iter_mut()
            .map(|a| entry(a, meter))
            .collect();
        let shared = Batch::new(entries, meter);
        self.snapshot = Some((self.seq, shared.downgrade()));
        shared
    }
}

/// `items` (each with the distinct sequence number of an event in `since+1..=seq`)
/// in event order. They usually cover most of that span (a lagging watcher's
/// catch-up during a burst), so they are placed by sequence number in one pass;
/// a sparse span is sorted instead.
fn in_event_order<T>(items: Vec<(u64, T)>, since: u64, seq: u64) -> Vec<(u64, T)> {
    let span = usize::try_from(seq.saturating_sub(since)).unwrap_or(usize::MAX);
    let placeable =
        span <= items.len().saturating_mul(4) && items.iter().all(|(s, _)| *s > since && *s <= seq);
    if !placeable {
        let mut items = items;
        items.sort_unstable_by_key(|(s, _)| *s);
        return items;
    }
    let mut slots: Vec<Option<(u64, T)>> = std::iter::repeat_with(|| None).take(span).collect();
    let mut clashes = Vec::new();
    for (s, item) in items {
        let slot = &mut slots[usize::try_from(s - since - 1).unwrap_or(usize::MAX)];
        if slot.is_some() {
            clashes.push((s, item));
        } else {
            *slot = Some((s, item));
        }
    }
    let mut ordered: Vec<(u64, T)> = slots.into_iter().flatten().collect();
    if !clashes.is_empty() {
        // Not expected (one event, one number); kept correct all the same.
        ordered.extend(clashes);
        ordered.sort_by_key(|(s, _)| *s);
    }
    ordered
}

/// The affiliate's kept entry; encoded and kept now if it changed while nobody
/// watched.
fn entry(a: &mut Affiliate, meter: &Arc<WatchBytes>) -> Arc<Entry> {
    if let Some(entry) = a.entry() {
        return Arc::clone(entry);
    }
    let entry = Entry::new(encode::encode_event(a.id(), a), meter);
    a.set_entry(Arc::clone(&entry));
    entry
}

/// What [`State::catch_up`] did for a lagging watcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CatchUp {
    /// It had read every event: back on its queue.
    Rejoined,
    /// Events came after what it read: it reads on from the log.
    FromLog,
    /// The log no longer reached back to it: its queue holds a catch-up made from
    /// the state.
    FromState,
    /// It is no longer registered: its stream ends.
    Gone,
}

/// A registered watcher: the snapshot to send first, then the live events.
#[derive(Debug)]
pub struct Subscription {
    /// The watched cluster.
    pub cluster_id: String,
    /// Handle for [`State::unsubscribe`] and [`State::catch_up`].
    pub id: u64,
    /// Every affiliate at registration time as an encoded `WatchResponse` (sent first,
    /// even when empty).
    pub snapshot: Batch,
    /// Live events.
    pub queue: Arc<WatchQueue>,
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
    /// Bytes of snapshots and catch-up batches held for watchers.
    pub watch_bytes: usize,
    /// Watchers aborted because those bytes exceeded the budget.
    pub watch_budget_aborts: u64,
    /// Watchers switched to their cluster's event log (queue overflowed while they
    /// kept reading), since the start.
    pub watch_lagged: u64,
    /// Bytes of events kept in the clusters' event logs.
    pub watch_log_bytes: usize,
    /// Bytes the stored clusters and affiliates take (the state budget's measure).
    pub stored_bytes: usize,
    /// Requests refused because they would create a cluster beyond the cap.
    pub clusters_refused: u64,
    /// Requests refused because they would grow the state past its budget.
    pub budget_refused: u64,
    /// Clusters, affiliates and endpoints dropped from the snapshot at load for
    /// breaking a limit.
    pub snapshot_dropped: u64,
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
pub struct State {
    pub(crate) clusters: HashMap<String, Cluster>,
    next_subscriber: u64,
    max_affiliates: usize,
    watch_stall: Duration,
    watch_bytes: Arc<WatchBytes>,
    watch_budget: usize,
    watch_budget_aborts: u64,
    /// Switches to the event log counted by clusters since collected.
    watch_lagged_collected: u64,
    /// Over the budget, no watcher can become slow enough to abort before this
    /// (from the last scan of them): until then a scan would find nothing.
    budget_quiet_until: Option<Instant>,
    runtime_lag: Arc<RuntimeLag>,
    max_clusters: usize,
    state_budget: usize,
    /// Kept up to date by every change (see `budget`).
    stored_bytes: usize,
    clusters_refused: u64,
    budget_refused: u64,
    pub(crate) snapshot_dropped: u64,
}

impl Default for State {
    fn default() -> Self {
        Self {
            clusters: HashMap::new(),
            next_subscriber: 0,
            max_affiliates: MAX_AFFILIATES,
            watch_stall: WATCH_STALL,
            watch_bytes: Arc::default(),
            watch_budget: WATCH_BUDGET,
            watch_budget_aborts: 0,
            watch_lagged_collected: 0,
            budget_quiet_until: None,
            runtime_lag: Arc::default(),
            max_clusters: MAX_CLUSTERS,
            state_budget: STATE_BUDGET,
            stored_bytes: 0,
            clusters_refused: 0,
            budget_refused: 0,
            snapshot_dropped: 0,
        }
    }
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

    /// Sets the per-cluster affiliate cap ([`MAX_AFFILIATES`] unless changed).
    pub fn set_max_affiliates(&mut self, max: usize) {
        self.max_affiliates = max;
    }

    /// Sets how long a watcher with a full queue may take nothing before it is
    /// aborted ([`WATCH_STALL`] unless changed).
    pub fn set_watch_stall(&mut self, stall: Duration) {
        self.watch_stall = stall;
    }

    /// Sets the byte budget for snapshots and catch-up batches held for watchers
    /// ([`WATCH_BUDGET`] unless changed). Above it, watchers that hold such bytes and
    /// took nothing for the stall timeout are aborted, least recently active first,
    /// until the held bytes fit again. Watchers that keep reading are never aborted,
    /// so the budget can be exceeded for up to the stall timeout.
    pub fn set_watch_budget(&mut self, budget: usize) {
        self.watch_budget = budget;
    }

    /// Bytes of snapshots and catch-up batches currently held for watchers (by the
    /// state or by streams not done sending them).
    #[must_use]
    pub fn watch_bytes(&self) -> usize {
        self.watch_bytes.get()
    }

    /// AffiliateUpdate: validates, then creates or merges the affiliate and notifies
    /// watchers. A rejected request leaves the state untouched; a request that fails
    /// half-way on the endpoint limit keeps the merges made before the failure, as
    /// upstream does.
    ///
    /// # Errors
    /// Validation errors, [`RequestError::TooManyClusters`] and
    /// [`RequestError::StateBudget`] (checked before anything changes),
    /// [`RequestError::TooManyAffiliates`], [`RequestError::TooManyEndpoints`].
    pub fn update(
        &mut self,
        now: Instant,
        req: &pb::AffiliateUpdateRequest,
    ) -> Result<(), RequestError> {
        validate_update(req)?;
        self.admit_update(req)?;
        let exp = offset(now, ttl_nanos(req.ttl.as_ref()));
        // Looked up before `entry`, which would copy the ID on every update.
        let mut before = 0;
        if !self.clusters.contains_key(&req.cluster_id) {
            self.clusters
                .insert(req.cluster_id.clone(), Cluster::default());
            self.stored_bytes += budget::CLUSTER_OVERHEAD + req.cluster_id.len();
        }
        let Some(cluster) = self.clusters.get_mut(&req.cluster_id) else {
            unreachable!("inserted above");
        };
        let id = req.affiliate_id.as_str();
        let data = req.affiliate_data.as_deref().filter(|d| !d.is_empty());
        let result = if let Some(affiliate) = cluster.affiliates.get_mut(id) {
            before = affiliate.stored_bytes();
            let (changed, result) = apply(affiliate, exp, data, &req.affiliate_endpoints);
            if changed {
                cluster.notify_upsert(id, now, &self.watch_bytes);
            }
            result
        } else {
            if cluster.affiliates.len() >= self.max_affiliates {
                return Err(RequestError::TooManyAffiliates);
            }
            // Upstream starts from the zero time: a new affiliate whose update fails
            // before setting an expiration is collected at the next GC.
            let mut affiliate = Affiliate::new(id, offset(now, i64::MIN), &[], []);
            let (_, result) = apply(&mut affiliate, exp, data, &req.affiliate_endpoints);
            cluster.affiliates.insert(affiliate);
            cluster.notify_upsert(id, now, &self.watch_bytes);
            result
        };
        let after = cluster
            .affiliates
            .get(id)
            .map_or(0, Affiliate::stored_bytes);
        self.stored_bytes = (self.stored_bytes + after).saturating_sub(before);
        result
    }

    /// AffiliateDelete: removes the affiliate if present and notifies a delete.
    ///
    /// # Errors
    /// Validation errors only; deleting a missing affiliate succeeds.
    pub fn delete(
        &mut self,
        now: Instant,
        cluster_id: &str,
        affiliate_id: &str,
    ) -> Result<(), RequestError> {
        validate_cluster_id(cluster_id)?;
        validate_affiliate_id(affiliate_id)?;
        // A delete in a missing cluster creates nothing (upstream creates an empty
        // cluster, which GC removes again): no cluster to count against the cap.
        let Some(cluster) = self.clusters.get_mut(cluster_id) else {
            return Ok(());
        };
        if let Some(removed) = cluster.affiliates.remove(affiliate_id) {
            self.stored_bytes = self.stored_bytes.saturating_sub(removed.stored_bytes());
            cluster.notify_delete(affiliate_id, now);
        }
        Ok(())
    }

    /// List: every affiliate of the cluster (a missing cluster lists empty; upstream
    /// creates it and GC removes it again, which only spends the cluster cap).
    ///
    /// # Errors
    /// Validation errors.
    pub fn list(&mut self, cluster_id: &str) -> Result<Vec<pb::Affiliate>, RequestError> {
        validate_cluster_id(cluster_id)?;
        Ok(self
            .clusters
            .get(cluster_id)
            .map(|c| c.affiliates.iter().map(Affiliate::export).collect())
            .unwrap_or_default())
    }

    /// Watch: copies the snapshot and registers the watcher in one step, so no event
    /// falls between them. `queue` is the watcher's event queue length
    /// ([`WATCH_QUEUE`] in the server).
    ///
    /// # Errors
    /// Validation errors; [`RequestError::TooManyClusters`] or
    /// [`RequestError::StateBudget`] for a new cluster beyond the limits.
    pub fn watch(
        &mut self,
        now: Instant,
        cluster_id: &str,
        queue: usize,
    ) -> Result<Subscription, RequestError> {
        validate_cluster_id(cluster_id)?;
        if !self.clusters.contains_key(cluster_id) {
            self.admit_cluster(cluster_id, 0)?;
            self.stored_bytes += budget::CLUSTER_OVERHEAD + cluster_id.len();
        }
        let cluster = self.clusters.entry(cluster_id.to_owned()).or_default();
        self.next_subscriber += 1;
        let id = self.next_subscriber;
        let queue = Arc::new(WatchQueue::new(
            queue,
            self.watch_stall,
            Arc::clone(&self.runtime_lag),
            Arc::clone(&cluster.log),
            cluster.seq,
            now,
        ));
        cluster.subscribers.push(Subscriber {
            id,
            queue: Arc::clone(&queue),
            lagging: false,
        });
        let snapshot = cluster.snapshot(&self.watch_bytes);
        self.enforce_budget(now);
        Ok(Subscription {
            cluster_id: cluster_id.to_owned(),
            id,
            snapshot,
            queue,
        })
    }

    /// For a lagging watcher at the end of its cluster's event log or behind what
    /// it keeps (see [`watch`]): back on its queue if it has read every event, left
    /// to the log if an event came meanwhile, else its queue filled with a catch-up
    /// made from the state. Runs under the state lock, so no event falls between.
    pub fn catch_up(&mut self, now: Instant, cluster_id: &str, id: u64) -> CatchUp {
        let Some(cluster) = self.clusters.get_mut(cluster_id) else {
            return CatchUp::Gone;
        };
        // Registered in ID order, and removals keep it.
        let Ok(i) = cluster.subscribers.binary_search_by_key(&id, |s| s.id) else {
            return CatchUp::Gone;
        };
        let queue = Arc::clone(&cluster.subscribers[i].queue);
        let Some(since) = queue.lagging_since() else {
            return CatchUp::Rejoined;
        };
        let log = lock(&cluster.log);
        let next = log.position(since + 1);
        let end = log.end();
        drop(log);
        match next {
            Some(at) if at < end => return CatchUp::FromLog,
            Some(_) if since == cluster.seq => {
                cluster.subscribers[i].lagging = false;
                queue.rejoin(now);
                return CatchUp::Rejoined;
            }
            _ => {}
        }
        cluster.subscribers[i].lagging = false;
        queue.fill_catch_up(cluster.catch_up(since, &self.watch_bytes), now);
        self.enforce_budget(now);
        CatchUp::FromState
    }

    /// Removes a watcher (stream ended). The cluster becomes collectable once it has
    /// neither affiliates nor watchers.
    pub fn unsubscribe(&mut self, cluster_id: &str, id: u64) {
        if let Some(cluster) = self.clusters.get_mut(cluster_id) {
            if let Ok(i) = cluster.subscribers.binary_search_by_key(&id, |s| s.id) {
                cluster.subscribers.remove(i);
            }
        }
    }

    /// Ends every watcher's stream with OK (server shutdown).
    pub fn close_subscriptions(&mut self) {
        for cluster in self.clusters.values_mut() {
            for s in cluster.subscribers.drain(..) {
                s.queue.close();
            }
        }
    }

    /// How late the server's runtime runs (shared with every watcher's queue).
    #[must_use]
    pub fn runtime_lag(&self) -> Arc<RuntimeLag> {
        Arc::clone(&self.runtime_lag)
    }

    /// The server's periodic task ran at `now`, `late` after it was due, and runs
    /// again `every` later: how far behind the server itself is, which watchers
    /// are not dropped for ([`RuntimeLag`]).
    pub fn runtime_tick(&mut self, now: Instant, late: Duration, every: Duration) {
        self.runtime_lag.tick(now, late, every);
    }

    /// Aborts watchers that stopped reading while events wait for them (the check
    /// also runs on every new event).
    pub fn check_stalled(&mut self, now: Instant) {
        for cluster in self.clusters.values_mut() {
            cluster
                .subscribers
                .retain(|s| !s.gone() && s.queue.check_stalled(now));
        }
        self.enforce_budget(now);
    }

    /// Over the budget: aborts watchers that hold snapshot or catch-up bytes and
    /// took nothing for the stall timeout, least recently active first, until the
    /// held bytes fit. Whatever a watcher shares with others is freed only once they
    /// let go too, hence the check after each abort.
    fn enforce_budget(&mut self, now: Instant) {
        if self.watch_bytes.get() <= self.watch_budget
            || self.budget_quiet_until.is_some_and(|t| now < t)
        {
            return;
        }
        // Watchers that hold bytes: the slow ones (no progress for the stall
        // timeout) are candidates; the others say when the next could be.
        let mut slow: Vec<(Instant, Arc<WatchQueue>)> = Vec::new();
        let mut next_slow: Option<Instant> = None;
        let stall = self.watch_stall + self.runtime_lag.grace(now);
        for s in self.clusters.values().flat_map(|c| &c.subscribers) {
            let Some(t) = s.queue.holding_since().filter(|_| !s.gone()) else {
                continue;
            };
            if now.saturating_duration_since(t) >= stall {
                slow.push((t, Arc::clone(&s.queue)));
            } else {
                next_slow = Some(next_slow.map_or(t, |n| n.min(t)));
            }
        }
        // A watcher becomes a holder only with fresh progress (registration,
        // catch-up), so none unseen here can turn slow before `next_slow`.
        self.budget_quiet_until = next_slow.map(|t| t + stall);
        if slow.is_empty() {
            return;
        }
        slow.sort_by_key(|(t, _)| *t);
        let mut spared = false;
        for (_, queue) in slow {
            if self.watch_bytes.get() <= self.watch_budget {
                spared = true;
                break;
            }
            queue.abort();
            self.watch_budget_aborts += 1;
        }
        if spared {
            // Slow watchers are left: look again next time.
            self.budget_quiet_until = None;
        }
        for cluster in self.clusters.values_mut() {
            cluster
                .subscribers
                .retain(|s| !s.gone() && !s.queue.is_lost());
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
            cluster.affiliates.retain(|a| {
                if a.expiration() < now {
                    removed.push(a.id().to_owned());
                    return false;
                }
                let dropped = a.retain_endpoints(|expiration| expiration > now);
                if dropped > 0 {
                    stats.endpoints += dropped;
                    trimmed.push(a.id().to_owned());
                }
                true
            });
            stats.affiliates += removed.len();
            for id in &removed {
                cluster.notify_delete(id, now);
            }
            for id in &trimmed {
                cluster.notify_upsert(id, now, &self.watch_bytes);
            }
            // Watchers that went away without unsubscribing do not keep a cluster.
            cluster.subscribers.retain(|s| !s.gone());
            cluster.trim_tombstones();
        }
        let before = self.clusters.len();
        let mut lagged = 0;
        self.clusters.retain(|_, c| {
            let keep = !(c.affiliates.is_empty() && c.subscribers.is_empty());
            if !keep {
                lagged += c.lagged;
            }
            keep
        });
        self.watch_lagged_collected += lagged;
        stats.clusters = before - self.clusters.len();
        self.recount_bytes();
        stats
    }

    /// Current sizes.
    #[must_use]
    pub fn counts(&self) -> Counts {
        let mut counts = Counts {
            clusters: self.clusters.len(),
            watch_bytes: self.watch_bytes.get(),
            watch_budget_aborts: self.watch_budget_aborts,
            watch_lagged: self.watch_lagged_collected,
            stored_bytes: self.stored_bytes,
            clusters_refused: self.clusters_refused,
            budget_refused: self.budget_refused,
            snapshot_dropped: self.snapshot_dropped,
            ..Counts::default()
        };
        for cluster in self.clusters.values() {
            counts.watch_lagged += cluster.lagged;
            counts.watch_log_bytes += lock(&cluster.log).bytes();
            counts.affiliates += cluster.affiliates.len();
            counts.subscriptions += cluster.subscribers.len();
            counts.endpoints += cluster
                .affiliates
                .iter()
                .map(Affiliate::endpoint_count)
                .sum::<usize>();
        }
        counts
    }

    /// Which of a relay pair's two affiliates is not a live affiliate of the cluster
    /// (`Some("cluster_id")` if the cluster is unknown), or `None` if both are.
    #[must_use]
    pub fn relay_pair_absent(
        &self,
        cluster_id: &str,
        affiliate_id: &str,
        peer_affiliate_id: &str,
        now: Instant,
    ) -> Option<&'static str> {
        let Some(cluster) = self.clusters.get(cluster_id) else {
            return Some("cluster_id");
        };
        let live = |id: &str| {
            cluster
                .affiliates
                .get(id)
                .is_some_and(|a| a.expiration() > now)
        };
        if !live(affiliate_id) {
            return Some("affiliate_id");
        }
        (!live(peer_affiliate_id)).then_some("peer_affiliate_id")
    }

    /// Affiliates of one cluster for the inspect page, sorted by ID; `None` if the
    /// cluster does not exist (inspecting does not create it).
    #[must_use]
    pub fn inspect(&self, cluster_id: &str, now: Instant) -> Option<Vec<AffiliateInfo>> {
        let cluster = self.clusters.get(cluster_id)?;
        let mut out: Vec<_> = cluster
            .affiliates
            .iter()
            .map(|a| AffiliateInfo {
                id: a.id().to_owned(),
                data_len: a.data().len(),
                endpoints: a.endpoint_count(),
                expires_in_secs: signed_secs(a.expiration(), now),
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
        a.set_data(data);
        // May shorten the expiration: the data's TTL is the client's latest word.
        a.set_expiration(exp);
        changed = true;
    }
    for blob in endpoints {
        if a.extend_endpoint(blob, exp) {
            // Known: only its life was extended.
        } else if a.endpoint_count() >= MAX_ENDPOINTS {
            return (changed, Err(RequestError::TooManyEndpoints));
        } else {
            a.push_endpoint(blob, exp);
            changed = true;
        }
    }
    a.set_expiration(a.expiration().max(exp));
    (changed, Ok(()))
}
