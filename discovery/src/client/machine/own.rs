//! The own affiliate as Watch shows it (docs/discovery-protocol.md §8.8). The cluster
//! ID is a bearer credential: anyone who knows it can delete or overwrite this node's
//! affiliate, and its peers would then drop it. So the machine watches its own record
//! too, and re-publishes at once when someone else deleted it (an expiry looks the
//! same) or replaced its data; endpoints other nodes add are harvesting and ignored.
//!
//! The Watch stream is ordered, so a record that differs from the local data is
//! someone else's doing only once the stream has shown the local data since it was
//! set (or the stream started): earlier events may predate this node's own update.
//! Re-publishes are own-data-only updates, at most one per [`REPUBLISH_INTERVAL`];
//! later ones are coalesced into the next allowed one.

use std::time::Instant;

use rand::RngCore;

use super::{Action, Machine, Phase, REPUBLISH_INTERVAL};

/// What the machine knows of its own record on the server.
#[derive(Debug, Default)]
pub(super) struct OwnGuard {
    /// The stream showed the current local data since it was set or the stream began.
    pub(super) confirmed: bool,
    /// Why a re-publish is waiting (deleted or altered), if one is.
    pending: Option<&'static str>,
    /// When the last re-publish went out.
    last: Option<Instant>,
    /// Re-publishes sent.
    count: u64,
}

impl<R: RngCore> Machine<R> {
    /// Re-publishes of the own affiliate after someone else deleted or altered it.
    #[must_use]
    pub fn republishes(&self) -> u64 {
        self.own.count
    }

    /// Watch showed the own record: `deleted`, or with this `data` blob.
    pub(super) fn own_seen(&mut self, now: Instant, deleted: bool, data: &[u8]) {
        let Some(local) = self.local.as_ref().filter(|_| !self.deleted) else {
            return;
        };
        if !deleted && data == local.data_blob.as_slice() {
            self.own.confirmed = true;
            return;
        }
        if !std::mem::take(&mut self.own.confirmed) {
            return;
        }
        self.own.pending = Some(if deleted { "deleted" } else { "altered" });
        self.maybe_republish(now);
    }

    /// When a held-back re-publish may go out (`None`: none waits, or it waits for
    /// something other than time).
    pub(super) fn republish_at(&self) -> Option<Instant> {
        let ready = self.own.pending.is_some()
            && !self.refresh_in_flight
            && matches!(self.phase, Phase::Watching { .. });
        ready
            .then_some(self.own.last)
            .flatten()
            .map(|t| t + REPUBLISH_INTERVAL)
    }

    /// A full refresh publishes the own data too: nothing left to re-publish.
    pub(super) fn republish_covered(&mut self) {
        self.own.pending = None;
    }

    /// Sends a waiting re-publish if the connection and [`REPUBLISH_INTERVAL`] allow.
    pub(super) fn maybe_republish(&mut self, now: Instant) {
        let Some(reason) = self.own.pending else {
            return;
        };
        if self.refresh_in_flight
            || !matches!(self.phase, Phase::Watching { .. })
            || self.own.last.is_some_and(|t| now < t + REPUBLISH_INTERVAL)
        {
            return;
        }
        self.own.pending = None;
        let Some(update) = self.own_update() else {
            return;
        };
        self.own.last = Some(now);
        self.own.count += 1;
        tracing::info!(
            affiliate = %self.config.affiliate_id,
            reason,
            republishes = self.own.count,
            "own affiliate {reason} on the discovery server by someone else: re-publishing"
        );
        self.refresh_in_flight = true;
        self.actions.push_back(Action::Refresh(vec![update]));
    }
}
