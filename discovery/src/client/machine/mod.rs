//! The client's decision logic as a sans-IO state machine (docs/discovery-protocol.md §8.3–8.5).
//!
//! The machine owns the local data (already encrypted), the discovered affiliates
//! and the connection phase. The driver feeds it RPC results, Watch messages and
//! the current time, and executes the [`Action`]s it emits; [`Machine::poll_timeout`]
//! says when to call [`Machine::handle_timeout`] next. Nothing here sleeps, reads a
//! clock or touches a socket, so tests run it on a fake clock.
//!
//! The machine's parts, by concern: `connection` (backoff, Hello, redirects,
//! Watch), `publish` (own data and harvested endpoints, encrypted, sent as refresh
//! batches), `discovered` (Watch messages into decoded affiliates), `own` (the own
//! affiliate as Watch shows it: re-published when someone else deleted or altered
//! it). This file holds the types, the timers and the accessors.

mod connection;
mod discovered;
mod own;
mod publish;
#[cfg(test)]
mod tests;

use std::{
    collections::{BTreeMap, VecDeque},
    net::IpAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use rand::RngCore;

use super::{
    address::ServerAddress,
    backoff::Backoff,
    crypto::{Cipher, GCM_OVERHEAD, MAX_AFFILIATE_BLOB},
    model::{AffiliateInfo, Endpoint},
};
use crate::proto::server as wire;

/// Consecutive redirects followed before falling back to the configured endpoint.
pub const MAX_REDIRECTS: u32 = 5;
/// Endpoints per affiliate the server keeps (§7.8); more own endpoints are refused.
pub const MAX_ENDPOINTS: usize = 64;
/// At most one re-publish of the own affiliate per this interval (see `own`); later
/// ones are coalesced into the next allowed one. Far below the server's per-address
/// rate limit, so an attacker who deletes the affiliate in a loop cannot make this
/// node hammer the server.
pub const REPUBLISH_INTERVAL: Duration = Duration::from_secs(1);

/// Static parameters of the machine.
#[derive(Debug, Clone)]
pub struct MachineSettings {
    /// Configured server (redirects replace it in memory only).
    pub endpoint: ServerAddress,
    /// Cluster ID (opaque).
    pub cluster_id: String,
    /// Own affiliate ID (the node ID).
    pub affiliate_id: String,
    /// TTL sent with every update; refreshes run every `ttl / 2`.
    pub ttl: Duration,
    /// Version string for Hello.
    pub client_version: String,
}

/// A decoded affiliate of another node.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Affiliate {
    /// Affiliate ID on the server (equals `info.node_id`).
    pub id: String,
    /// Decrypted data.
    pub info: AffiliateInfo,
    /// Every endpoint blob that decrypted and decoded, in server order.
    pub endpoints: Vec<Endpoint>,
}

/// Where the client is in its connection cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConnectionState {
    /// Waiting out the reconnect backoff (also before the very first Hello).
    Backoff,
    /// Hello sent, or Watch opened and its snapshot not yet received.
    Connecting,
    /// The Watch snapshot arrived; the discovered set is live.
    Connected,
}

/// Something the driver must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Drop the current channel and every call on it, and open a new (lazy)
    /// channel to this address; re-read TLS roots.
    Connect(ServerAddress),
    /// Send Hello (10 s deadline); report with [`Machine::hello_succeeded`] or
    /// [`Machine::hello_failed`].
    Hello(wire::HelloRequest),
    /// Open the Watch stream (no deadline); feed messages to
    /// [`Machine::watch_message`] and its end to [`Machine::watch_ended`].
    Watch(wire::WatchRequest),
    /// Drop the Watch stream and any refresh in flight (the channel stays).
    CancelWatch,
    /// Send these calls one after the other under one 30 s deadline; the first
    /// error aborts the batch. Report with [`Machine::refresh_done`].
    Refresh(Vec<RefreshCall>),
}

impl Action {
    /// Short name for logs (the requests carry blobs that logs do not need).
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Connect(_) => "connect",
            Self::Hello(_) => "hello",
            Self::Watch(_) => "watch",
            Self::CancelWatch => "cancel-watch",
            Self::Refresh(_) => "refresh",
        }
    }
}

/// One call of a refresh batch.
#[derive(Debug, Clone, PartialEq)]
pub enum RefreshCall {
    /// Create or update an affiliate (own data, or endpoints only for a peer).
    Update(wire::AffiliateUpdateRequest),
    /// Delete the own affiliate.
    Delete(wire::AffiliateDeleteRequest),
}

/// Local data that cannot be published. Nothing already published is changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LocalDataError {
    /// Encrypted data above the server limit. Wirespan refuses rather than trims:
    /// silently dropping addresses would change peers' AllowedIPs.
    #[error(
        "affiliate data of {plaintext} bytes encrypts to {} bytes, above the server limit of {MAX_AFFILIATE_BLOB}; publish fewer addresses",
        plaintext + GCM_OVERHEAD
    )]
    TooLarge {
        /// Plaintext protobuf length.
        plaintext: usize,
    },
    /// More own endpoints than the server keeps per affiliate.
    #[error("{count} endpoints given, the server keeps at most {MAX_ENDPOINTS}")]
    TooManyEndpoints {
        /// Endpoints given.
        count: usize,
    },
    /// `node_id` differs from the client's affiliate ID; receivers would drop it.
    #[error(
        "affiliate node_id {node_id:?} differs from the client's affiliate ID {affiliate_id:?}"
    )]
    NodeIdMismatch {
        /// The data's node ID.
        node_id: String,
        /// The configured affiliate ID.
        affiliate_id: String,
    },
}

#[derive(Debug, Clone)]
struct LocalData {
    info: AffiliateInfo,
    endpoints: Vec<Endpoint>,
    data_blob: Vec<u8>,
    endpoint_blobs: Vec<Vec<u8>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    Backoff { until: Instant },
    Hello,
    Watching { snapshot_seen: bool },
}

/// The client state machine.
#[derive(Debug)]
pub struct Machine<R> {
    config: MachineSettings,
    cipher: Cipher,
    rng: R,
    backoff: Backoff,
    endpoint: ServerAddress,
    redirects: u32,
    connected: bool,
    phase: Phase,
    refresh_due: bool,
    refresh_in_flight: bool,
    next_tick: Instant,
    local: Option<LocalData>,
    deleted: bool,
    others: BTreeMap<String, (Vec<Endpoint>, Vec<Vec<u8>>)>,
    affiliates: Arc<BTreeMap<String, Affiliate>>,
    public_ip: Option<IpAddr>,
    actions: VecDeque<Action>,
    own: own::OwnGuard,
}

impl<R: RngCore> Machine<R> {
    /// A machine that starts in backoff: the first Hello also waits one delay.
    pub fn new(config: MachineSettings, cipher: Cipher, mut rng: R, now: Instant) -> Self {
        let mut backoff = Backoff::new();
        let until = now + backoff.next(&mut rng);
        Self {
            endpoint: config.endpoint.clone(),
            next_tick: now + config.ttl / 2,
            config,
            cipher,
            rng,
            backoff,
            redirects: 0,
            connected: false,
            phase: Phase::Backoff { until },
            refresh_due: true,
            refresh_in_flight: false,
            local: None,
            deleted: false,
            others: BTreeMap::new(),
            affiliates: Arc::new(BTreeMap::new()),
            public_ip: None,
            actions: VecDeque::new(),
            own: own::OwnGuard::default(),
        }
    }

    /// Next action for the driver, in order.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// When [`Machine::handle_timeout`] must be called next.
    #[must_use]
    pub fn poll_timeout(&self) -> Instant {
        let at = match self.phase {
            Phase::Backoff { until } => until.min(self.next_tick),
            _ => self.next_tick,
        };
        self.republish_at().map_or(at, |r| r.min(at))
    }

    /// Advances timers: the refresh ticker (every TTL/2), the backoff and a
    /// re-publish held back by [`REPUBLISH_INTERVAL`].
    pub fn handle_timeout(&mut self, now: Instant) {
        if now >= self.next_tick {
            self.refresh_due = true;
            let period = (self.config.ttl / 2).max(Duration::from_millis(1));
            while self.next_tick <= now {
                self.next_tick += period;
            }
        }
        if let Phase::Backoff { until } = self.phase {
            if now >= until {
                if !self.connected {
                    self.actions
                        .push_back(Action::Connect(self.endpoint.clone()));
                    self.connected = true;
                }
                self.actions.push_back(Action::Hello(wire::HelloRequest {
                    cluster_id: self.config.cluster_id.clone(),
                    client_version: self.config.client_version.clone(),
                }));
                self.phase = Phase::Hello;
            }
        }
        self.maybe_refresh();
        self.maybe_republish(now);
    }

    /// Decoded affiliates of other nodes by ID.
    #[must_use]
    pub fn affiliates(&self) -> &Arc<BTreeMap<String, Affiliate>> {
        &self.affiliates
    }

    /// Last `client_ip` reported by Hello.
    #[must_use]
    pub fn public_ip(&self) -> Option<IpAddr> {
        self.public_ip
    }

    /// Current phase of the connection cycle.
    #[must_use]
    pub fn connection_state(&self) -> ConnectionState {
        match self.phase {
            Phase::Backoff { .. } => ConnectionState::Backoff,
            Phase::Hello
            | Phase::Watching {
                snapshot_seen: false,
            } => ConnectionState::Connecting,
            Phase::Watching {
                snapshot_seen: true,
            } => ConnectionState::Connected,
        }
    }

    /// The server currently used (differs from the configured one after a redirect).
    #[must_use]
    pub fn current_endpoint(&self) -> &ServerAddress {
        &self.endpoint
    }
}
