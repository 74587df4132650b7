//! The client's decision logic as a sans-IO state machine (discovery-wire.md §8.3–8.5).
//!
//! The machine owns the local data (already encrypted), the discovered affiliates
//! and the connection phase. The driver feeds it RPC results, Watch messages and
//! the current time, and executes the [`Action`]s it emits; [`Machine::poll_timeout`]
//! says when to call [`Machine::handle_timeout`] next. Nothing here sleeps, reads a
//! clock or touches a socket, so tests run it on a fake clock.

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
    model::{decode_endpoint, encode_endpoint, AffiliateInfo, Endpoint},
};
use crate::proto::server as wire;

/// Consecutive redirects followed before falling back to the configured endpoint.
pub const MAX_REDIRECTS: u32 = 5;
/// Endpoints per affiliate the server keeps (§7.8); more own endpoints are refused.
pub const MAX_ENDPOINTS: usize = 64;

/// Static parameters of the machine.
#[derive(Debug, Clone)]
pub struct MachineConfig {
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
    config: MachineConfig,
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
}

impl<R: RngCore> Machine<R> {
    /// A machine that starts in backoff: the first Hello also waits one delay.
    pub fn new(config: MachineConfig, cipher: Cipher, mut rng: R, now: Instant) -> Self {
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
        }
    }

    /// Next action for the driver, in order.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// When [`Machine::handle_timeout`] must be called next.
    #[must_use]
    pub fn poll_timeout(&self) -> Instant {
        match self.phase {
            Phase::Backoff { until } => until.min(self.next_tick),
            _ => self.next_tick,
        }
    }

    /// Advances timers: the refresh ticker (every TTL/2) and the backoff.
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
    }

    /// Starts a new connection cycle (the driver was restarted): any call in
    /// flight is forgotten, the channel is rebuilt after one backoff delay.
    pub fn reset_connection(&mut self, now: Instant) {
        self.connected = false;
        self.refresh_in_flight = false;
        self.refresh_due = true;
        // A delay also precedes the first Hello of a run started long after the
        // machine was created (the initial delay has expired by then).
        match self.phase {
            Phase::Backoff { until } if until > now => {}
            _ => self.enter_backoff(now),
        }
        self.actions.clear();
    }

    /// Hello answered.
    pub fn hello_succeeded(&mut self, now: Instant, response: &wire::HelloResponse) {
        if self.phase != Phase::Hello {
            return;
        }
        // Like upstream, the latest Hello wins: a server that stopped reporting
        // the address clears it rather than leaving a stale candidate.
        self.public_ip = parse_client_ip(&response.client_ip);
        if let Some(redirect) = response
            .redirect
            .as_ref()
            .filter(|r| !r.endpoint.is_empty())
        {
            if self.redirects >= MAX_REDIRECTS {
                if self.endpoint != self.config.endpoint {
                    tracing::warn!(
                        redirects = self.redirects,
                        endpoint = %self.config.endpoint,
                        "too many consecutive redirects, falling back to the configured endpoint"
                    );
                    self.endpoint = self.config.endpoint.clone();
                    self.connected = false;
                    self.enter_backoff(now);
                    return;
                }
                // The redirecting instance keeps serving every RPC (§7.5), so
                // stay on it for this session instead of cycling forever.
                tracing::warn!(
                    redirects = self.redirects,
                    "ignoring redirect after too many consecutive redirects"
                );
            } else {
                match self.endpoint.redirected(&redirect.endpoint) {
                    Ok(next) => {
                        tracing::info!(from = %self.endpoint, to = %next, "discovery server redirected");
                        self.redirects += 1;
                        self.endpoint = next;
                        self.connected = false;
                        self.enter_backoff(now);
                        return;
                    }
                    // Same reasoning: the current server still works.
                    Err(e) => tracing::warn!(error = %e, "ignoring invalid redirect"),
                }
            }
        }
        self.redirects = 0;
        self.actions.push_back(Action::Watch(wire::WatchRequest {
            cluster_id: self.config.cluster_id.clone(),
        }));
        self.phase = Phase::Watching {
            snapshot_seen: false,
        };
        self.maybe_refresh();
    }

    /// Hello failed (error status, deadline, transport error). The channel is
    /// dropped, which also re-reads TLS roots; after a redirect the configured
    /// endpoint is tried next (it will redirect again if it still wants to).
    pub fn hello_failed(&mut self, now: Instant) {
        if self.phase != Phase::Hello {
            return;
        }
        self.connected = false;
        if self.endpoint != self.config.endpoint {
            self.endpoint = self.config.endpoint.clone();
        }
        self.enter_backoff(now);
    }

    /// One Watch message arrived. Returns whether the discovered set changed.
    pub fn watch_message(&mut self, response: &wire::WatchResponse) -> bool {
        let Phase::Watching { snapshot_seen } = &mut self.phase else {
            return false;
        };
        let mut changed = false;
        if !*snapshot_seen {
            *snapshot_seen = true;
            // The first message is the snapshot: it replaces everything.
            if !self.affiliates.is_empty() {
                Arc::make_mut(&mut self.affiliates).clear();
                changed = true;
            }
        }
        for wire_affiliate in &response.affiliates {
            if wire_affiliate.id == self.config.affiliate_id {
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

    /// The Watch stream failed or ended: back to backoff and Hello on the same
    /// channel, then a refresh.
    pub fn watch_ended(&mut self, now: Instant) {
        if !matches!(self.phase, Phase::Watching { .. }) {
            return;
        }
        if self.refresh_in_flight {
            self.actions.push_back(Action::CancelWatch);
            self.refresh_in_flight = false;
        }
        self.refresh_due = true;
        self.enter_backoff(now);
    }

    /// The refresh batch finished.
    pub fn refresh_done(&mut self, now: Instant, ok: bool) {
        if !self.refresh_in_flight {
            return;
        }
        self.refresh_in_flight = false;
        if ok {
            self.backoff.reset();
            self.maybe_refresh();
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
        self.refresh_due = true;
        self.maybe_refresh();
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

    fn enter_backoff(&mut self, now: Instant) {
        let delay = self.backoff.next(&mut self.rng);
        tracing::debug!(delay_ms = delay.as_millis(), endpoint = %self.endpoint, "discovery reconnect backoff");
        self.phase = Phase::Backoff { until: now + delay };
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

    fn maybe_refresh(&mut self) {
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
        self.refresh_in_flight = true;
        self.actions.push_back(Action::Refresh(batch));
    }

    fn refresh_batch(&self) -> Vec<RefreshCall> {
        let cluster_id = &self.config.cluster_id;
        if self.deleted {
            return vec![RefreshCall::Delete(wire::AffiliateDeleteRequest {
                cluster_id: cluster_id.clone(),
                affiliate_id: self.config.affiliate_id.clone(),
            })];
        }
        let Some(local) = &self.local else {
            return Vec::new();
        };
        let ttl = prost_types::Duration::try_from(self.config.ttl).ok();
        let mut batch = vec![RefreshCall::Update(wire::AffiliateUpdateRequest {
            cluster_id: cluster_id.clone(),
            affiliate_id: self.config.affiliate_id.clone(),
            affiliate_data: Some(local.data_blob.clone()),
            affiliate_endpoints: local.endpoint_blobs.clone(),
            ttl,
        })];
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

    fn decode_affiliate(&self, wire_affiliate: &wire::Affiliate) -> Option<Affiliate> {
        let id = &wire_affiliate.id;
        let plaintext = match self.cipher.open_affiliate(&wire_affiliate.data) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(affiliate = %id, error = %e, "skipping affiliate data that does not decrypt");
                return None;
            }
        };
        let info = match AffiliateInfo::decode(&plaintext) {
            Ok(i) => i,
            Err(e) => {
                tracing::warn!(affiliate = %id, error = %e, "skipping affiliate data that does not decode");
                return None;
            }
        };
        if info.node_id != *id {
            tracing::warn!(affiliate = %id, "skipping affiliate whose data names another node");
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
                        tracing::debug!(affiliate = %id, %error, "skipping endpoint blob");
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

fn parse_client_ip(bytes: &[u8]) -> Option<IpAddr> {
    match bytes.len() {
        4 => Some(IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?)),
        16 => Some(IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?).to_canonical()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use rand::{rngs::StdRng, SeedableRng};

    use super::*;
    use crate::client::{
        crypto::ClusterSecret,
        model::{KubeSpanInfo, MachineType},
    };

    const TTL: Duration = Duration::from_secs(1800);

    fn secret() -> ClusterSecret {
        ClusterSecret::from_bytes([3; 32])
    }

    fn config() -> MachineConfig {
        MachineConfig {
            endpoint: ServerAddress::parse("endpoint", "http://disco.example:3000", false).unwrap(),
            cluster_id: "c1".into(),
            affiliate_id: "self".into(),
            ttl: TTL,
            client_version: "v0.1.0".into(),
        }
    }

    fn machine(now: Instant) -> Machine<StdRng> {
        Machine::new(
            config(),
            Cipher::new(&secret()),
            StdRng::seed_from_u64(1),
            now,
        )
    }

    fn info(id: &str) -> AffiliateInfo {
        AffiliateInfo {
            node_id: id.into(),
            addresses: vec!["10.0.0.1".parse().unwrap()],
            hostname: format!("{id}.example"),
            nodename: id.into(),
            machine_type: MachineType::Worker,
            operating_system: "test".into(),
            kubespan: Some(KubeSpanInfo {
                public_key: "PUB".into(),
                address: "fd00::1".parse().unwrap(),
                additional_addresses: vec![],
            }),
            control_plane: None,
        }
    }

    fn ep(s: &str) -> Endpoint {
        s.parse().unwrap()
    }

    fn drain<R: RngCore>(m: &mut Machine<R>) -> Vec<Action> {
        std::iter::from_fn(|| m.poll_action()).collect()
    }

    /// Runs the backoff and a successful Hello; returns the time after it.
    fn connect<R: RngCore>(m: &mut Machine<R>, now: Instant, client_ip: &[u8]) -> Instant {
        let now = m.poll_timeout().max(now);
        m.handle_timeout(now);
        let actions = drain(m);
        assert!(
            matches!(actions.last(), Some(Action::Hello(_))),
            "expected Hello, got {actions:?}"
        );
        m.hello_succeeded(
            now,
            &wire::HelloResponse {
                redirect: None,
                client_ip: client_ip.to_vec(),
            },
        );
        now
    }

    fn own_update(actions: &[Action]) -> wire::AffiliateUpdateRequest {
        for a in actions {
            if let Action::Refresh(batch) = a {
                if let RefreshCall::Update(u) = &batch[0] {
                    return u.clone();
                }
            }
        }
        panic!("no refresh in {actions:?}");
    }

    fn sealed(id: &str, key: &ClusterSecret, eps: &[&str]) -> wire::Affiliate {
        let c = Cipher::new(key);
        let mut rng = StdRng::seed_from_u64(9);
        wire::Affiliate {
            id: id.into(),
            data: c.seal_affiliate(&info(id).encode(), &mut rng),
            endpoints: eps
                .iter()
                .map(|e| c.seal_endpoint(&encode_endpoint(&ep(e))).unwrap())
                .collect(),
        }
    }

    #[test]
    fn first_hello_waits_one_backoff_and_connects() {
        let t0 = Instant::now();
        let mut m = machine(t0);
        assert_eq!(m.connection_state(), ConnectionState::Backoff);
        let first = m.poll_timeout() - t0;
        assert!(first >= Duration::from_millis(250) && first <= Duration::from_millis(750));
        m.handle_timeout(t0 + first - Duration::from_millis(1));
        assert!(drain(&mut m).is_empty(), "nothing before the backoff ends");
        m.handle_timeout(t0 + first);
        let actions = drain(&mut m);
        assert_eq!(
            actions,
            vec![
                Action::Connect(config().endpoint),
                Action::Hello(wire::HelloRequest {
                    cluster_id: "c1".into(),
                    client_version: "v0.1.0".into()
                })
            ]
        );
        assert_eq!(m.connection_state(), ConnectionState::Connecting);
        m.hello_succeeded(
            t0 + first,
            &wire::HelloResponse {
                redirect: None,
                client_ip: vec![192, 0, 2, 7],
            },
        );
        assert_eq!(m.public_ip(), Some("192.0.2.7".parse().unwrap()));
        assert_eq!(
            drain(&mut m),
            vec![Action::Watch(wire::WatchRequest {
                cluster_id: "c1".into()
            })],
            "no local data yet: no refresh"
        );
        assert!(!m.watch_message(&wire::WatchResponse::default()));
        assert_eq!(m.connection_state(), ConnectionState::Connected);
    }

    #[test]
    fn publishes_own_data_and_endpoints_then_refreshes_at_half_ttl() {
        let t0 = Instant::now();
        let mut m = machine(t0);
        assert!(m
            .set_local_data(
                info("self"),
                vec![ep("1.2.3.4:51820"), ep("[2001:db8::1]:51820")]
            )
            .unwrap());
        assert!(drain(&mut m).is_empty(), "not connected: nothing sent yet");
        let now = connect(&mut m, t0, &[127, 0, 0, 1]);
        let actions = drain(&mut m);
        let update = own_update(&actions);
        assert_eq!(update.affiliate_id, "self");
        assert_eq!(
            update.ttl,
            Some(prost_types::Duration {
                seconds: 1800,
                nanos: 0
            })
        );
        let cipher = Cipher::new(&secret());
        let data = update.affiliate_data.clone().unwrap();
        assert_eq!(
            AffiliateInfo::decode(&cipher.open_affiliate(&data).unwrap()).unwrap(),
            info("self")
        );
        assert_eq!(update.affiliate_endpoints.len(), 2);
        assert_eq!(update.affiliate_endpoints[0].len(), 16);
        assert_eq!(update.affiliate_endpoints[1].len(), 32);
        m.refresh_done(now, true);
        assert!(drain(&mut m).is_empty());

        // The ticker fires TTL/2 after start: the same blob goes out again.
        assert_eq!(m.poll_timeout(), t0 + TTL / 2);
        m.handle_timeout(t0 + TTL / 2 - Duration::from_secs(1));
        assert!(drain(&mut m).is_empty());
        m.handle_timeout(t0 + TTL / 2);
        let again = own_update(&drain(&mut m));
        assert_eq!(again, update, "refresh resends identical bytes");
        m.refresh_done(t0 + TTL / 2, true);
        assert_eq!(m.poll_timeout(), t0 + TTL);
    }

    #[test]
    fn unchanged_local_data_is_not_reencrypted_or_resent() {
        let t0 = Instant::now();
        let mut m = machine(t0);
        let now = connect(&mut m, t0, &[]);
        assert!(m
            .set_local_data(info("self"), vec![ep("1.2.3.4:1")])
            .unwrap());
        let first = own_update(&drain(&mut m));
        m.refresh_done(now, true);
        assert!(!m
            .set_local_data(info("self"), vec![ep("1.2.3.4:1")])
            .unwrap());
        assert!(drain(&mut m).is_empty(), "equal data: no RPC");
        assert!(m
            .set_local_data(info("self"), vec![ep("1.2.3.4:2")])
            .unwrap());
        let second = own_update(&drain(&mut m));
        assert_ne!(first.affiliate_data, second.affiliate_data, "fresh nonce");
        assert_ne!(first.affiliate_endpoints, second.affiliate_endpoints);
    }

    #[test]
    fn change_during_refresh_triggers_one_more_refresh() {
        let t0 = Instant::now();
        let mut m = machine(t0);
        let now = connect(&mut m, t0, &[]);
        m.set_local_data(info("self"), vec![]).unwrap();
        assert!(matches!(
            drain(&mut m)[..],
            [Action::Watch(_), Action::Refresh(_)]
        ));
        m.set_local_data(info("self"), vec![ep("1.1.1.1:1")])
            .unwrap();
        assert!(drain(&mut m).is_empty(), "one batch at a time");
        m.refresh_done(now, true);
        let update = own_update(&drain(&mut m));
        assert_eq!(update.affiliate_endpoints.len(), 1);
    }

    #[test]
    fn refused_local_data_keeps_the_previous() {
        let t0 = Instant::now();
        let mut m = machine(t0);
        let now = connect(&mut m, t0, &[]);
        m.set_local_data(info("self"), vec![]).unwrap();
        let before = own_update(&drain(&mut m));
        m.refresh_done(now, true);

        let mut big = info("self");
        big.addresses = (0..200u32)
            .map(|i| {
                IpAddr::V6(std::net::Ipv6Addr::from(
                    (0x2001_0db8_u128 << 96) | u128::from(i),
                ))
            })
            .collect();
        let err = m.set_local_data(big, vec![]).unwrap_err();
        assert!(matches!(err, LocalDataError::TooLarge { .. }), "{err}");
        assert!(err.to_string().contains("above the server limit of 2048"));
        let err = m
            .set_local_data(info("self"), vec![ep("1.1.1.1:1"); 65])
            .unwrap_err();
        assert_eq!(err, LocalDataError::TooManyEndpoints { count: 65 });
        let err = m.set_local_data(info("other"), vec![]).unwrap_err();
        assert!(matches!(err, LocalDataError::NodeIdMismatch { .. }));
        assert!(drain(&mut m).is_empty());

        m.handle_timeout(t0 + TTL / 2);
        assert_eq!(own_update(&drain(&mut m)), before);
    }

    #[test]
    fn other_endpoints_are_endpoint_only_updates() {
        let t0 = Instant::now();
        let mut m = machine(t0);
        let now = connect(&mut m, t0, &[]);
        m.set_local_data(info("self"), vec![ep("1.2.3.4:1")])
            .unwrap();
        drain(&mut m);
        m.refresh_done(now, true);
        let others = BTreeMap::from([
            ("peer-b".to_string(), vec![ep("5.6.7.8:51820")]),
            ("self".to_string(), vec![ep("9.9.9.9:1")]),
            ("peer-c".to_string(), vec![]),
        ]);
        assert!(m.set_other_endpoints(others.clone()));
        let actions = drain(&mut m);
        let Some(Action::Refresh(batch)) = actions.first() else {
            panic!("{actions:?}")
        };
        assert_eq!(
            batch.len(),
            2,
            "own + peer-b; own ID and empty lists dropped"
        );
        let RefreshCall::Update(peer) = &batch[1] else {
            panic!()
        };
        assert_eq!(peer.affiliate_id, "peer-b");
        assert_eq!(peer.affiliate_data, None);
        let cipher = Cipher::new(&secret());
        assert_eq!(
            decode_endpoint(&cipher.open_endpoint(&peer.affiliate_endpoints[0]).unwrap()).unwrap(),
            ep("5.6.7.8:51820")
        );
        m.refresh_done(now, true);
        assert!(!m.set_other_endpoints(others), "unchanged: no refresh");
        assert!(drain(&mut m).is_empty());
    }

    #[test]
    fn delete_is_sent_on_every_refresh_until_new_data() {
        let t0 = Instant::now();
        let mut m = machine(t0);
        let now = connect(&mut m, t0, &[]);
        m.set_local_data(info("self"), vec![]).unwrap();
        drain(&mut m);
        m.refresh_done(now, true);
        m.delete_own_affiliate();
        let delete = Action::Refresh(vec![RefreshCall::Delete(wire::AffiliateDeleteRequest {
            cluster_id: "c1".into(),
            affiliate_id: "self".into(),
        })]);
        assert_eq!(drain(&mut m), vec![delete.clone()]);
        m.refresh_done(now, true);
        m.handle_timeout(t0 + TTL / 2);
        assert_eq!(drain(&mut m), vec![delete]);
        m.refresh_done(t0 + TTL / 2, true);
        assert!(
            m.set_local_data(info("self"), vec![]).unwrap(),
            "same data after delete is sent"
        );
        own_update(&drain(&mut m));
    }

    #[test]
    fn failures_back_off_growing_and_reset_after_refresh() {
        let t0 = Instant::now();
        let mut m = machine(t0);
        m.set_local_data(info("self"), vec![]).unwrap();
        let mut now = m.poll_timeout();
        m.handle_timeout(now);
        assert!(matches!(
            drain(&mut m)[..],
            [Action::Connect(_), Action::Hello(_)]
        ));
        // Hello fails 4 times: each delay is within ±50 % of a growing interval,
        // and each retry reconnects (new channel).
        let mut interval = Duration::from_millis(750);
        for _ in 0..4 {
            m.hello_failed(now);
            assert_eq!(m.connection_state(), ConnectionState::Backoff);
            let delay = m.poll_timeout() - now;
            assert!(
                delay >= interval / 2 && delay <= interval * 3 / 2,
                "{delay:?} vs {interval:?}"
            );
            now += delay;
            m.handle_timeout(now);
            assert!(matches!(
                drain(&mut m)[..],
                [Action::Connect(_), Action::Hello(_)]
            ));
            interval = interval.mul_f64(1.5);
        }
        m.hello_succeeded(now, &wire::HelloResponse::default());
        let actions = drain(&mut m);
        assert!(matches!(
            actions[..],
            [Action::Watch(_), Action::Refresh(_)]
        ));
        // Refresh fails: watch cancelled, backoff, Hello on the same channel.
        m.refresh_done(now, false);
        assert_eq!(drain(&mut m), vec![Action::CancelWatch]);
        let delay = m.poll_timeout() - now;
        assert!(delay >= interval / 2, "still growing: {delay:?}");
        now += delay;
        m.handle_timeout(now);
        assert!(
            matches!(drain(&mut m)[..], [Action::Hello(_)]),
            "no reconnect"
        );
        m.hello_succeeded(now, &wire::HelloResponse::default());
        assert!(matches!(
            drain(&mut m)[..],
            [Action::Watch(_), Action::Refresh(_)]
        ));
        m.refresh_done(now, true);
        // After success the backoff restarts from 0.5 s.
        m.watch_ended(now);
        let delay = m.poll_timeout() - now;
        assert!(delay <= Duration::from_millis(750), "{delay:?}");
        // And a refresh follows the next Hello even without new data.
        now += delay;
        m.handle_timeout(now);
        m.hello_succeeded(now, &wire::HelloResponse::default());
        assert!(matches!(
            drain(&mut m)[..],
            [Action::Hello(_), Action::Watch(_), Action::Refresh(_)]
        ));
    }

    #[test]
    fn redirect_is_followed_and_capped() {
        let t0 = Instant::now();
        let mut m = machine(t0);
        let mut now = m.poll_timeout();
        m.handle_timeout(now);
        drain(&mut m);
        let redirect = wire::HelloResponse {
            redirect: Some(wire::RedirectMessage {
                endpoint: "other.example:4000".into(),
            }),
            client_ip: vec![1, 2, 3, 4],
        };
        m.hello_succeeded(now, &redirect);
        assert_eq!(m.public_ip(), Some("1.2.3.4".parse().unwrap()));
        // An IPv4-mapped 16-byte address is reported as IPv4.
        let mut mapped = vec![0u8; 10];
        mapped.extend_from_slice(&[0xff, 0xff, 1, 2, 3, 4]);
        assert_eq!(parse_client_ip(&mapped), Some("1.2.3.4".parse().unwrap()));
        assert_eq!(parse_client_ip(&[1, 2, 3]), None);
        assert_eq!(m.connection_state(), ConnectionState::Backoff);
        now = m.poll_timeout();
        m.handle_timeout(now);
        let target = ServerAddress::parse("e", "http://other.example:4000", false).unwrap();
        assert!(
            matches!(&drain(&mut m)[..], [Action::Connect(a), Action::Hello(_)] if *a == target)
        );
        assert_eq!(m.current_endpoint(), &target);
        // The target keeps redirecting (to itself): after MAX_REDIRECTS the
        // configured endpoint is used, and its redirect is then ignored.
        for _ in 1..MAX_REDIRECTS {
            m.hello_succeeded(now, &redirect);
            now = m.poll_timeout();
            m.handle_timeout(now);
            drain(&mut m);
            assert_eq!(m.current_endpoint(), &target);
        }
        m.hello_succeeded(now, &redirect);
        now = m.poll_timeout();
        m.handle_timeout(now);
        assert!(
            matches!(&drain(&mut m)[..], [Action::Connect(a), Action::Hello(_)] if *a == config().endpoint)
        );
        m.hello_succeeded(now, &redirect);
        assert!(
            matches!(drain(&mut m)[..], [Action::Watch(_)]),
            "stays on the configured server"
        );
        assert_eq!(m.current_endpoint(), &config().endpoint);

        // Next session: redirects are followed again; a plain answer at the target
        // is where the client stays.
        m.watch_ended(now);
        now = m.poll_timeout();
        m.handle_timeout(now);
        drain(&mut m);
        m.hello_succeeded(now, &redirect);
        now = m.poll_timeout();
        m.handle_timeout(now);
        drain(&mut m);
        assert_eq!(m.current_endpoint(), &target);
        m.hello_succeeded(now, &wire::HelloResponse::default());
        assert!(matches!(drain(&mut m)[..], [Action::Watch(_)]));
        assert_eq!(m.current_endpoint(), &target);
        assert_eq!(m.public_ip(), None, "a Hello without client_ip clears it");
    }

    #[test]
    fn invalid_redirect_is_ignored() {
        let t0 = Instant::now();
        let mut m = machine(t0);
        let now = m.poll_timeout();
        m.handle_timeout(now);
        drain(&mut m);
        m.hello_succeeded(
            now,
            &wire::HelloResponse {
                redirect: Some(wire::RedirectMessage {
                    endpoint: "no-port".into(),
                }),
                client_ip: vec![],
            },
        );
        assert!(matches!(drain(&mut m)[..], [Action::Watch(_)]));
        assert_eq!(m.current_endpoint(), &config().endpoint);
    }

    #[test]
    fn watch_messages_apply_as_spec_section_8_5() {
        let t0 = Instant::now();
        let mut m = machine(t0);
        connect(&mut m, t0, &[]);
        let key = secret();
        let wrong = ClusterSecret::from_bytes([4; 32]);
        let mut partial = sealed("b", &key, &["1.1.1.1:1", "[2001:db8::2]:2"]);
        partial.endpoints.push(vec![0; 15]);
        partial.endpoints.push(vec![0; 16]);
        let snapshot = wire::WatchResponse {
            affiliates: vec![
                sealed("a", &key, &["10.0.0.1:51820"]),
                partial,
                sealed("self", &key, &[]),
                sealed("stranger", &wrong, &[]),
                wire::Affiliate {
                    id: "empty".into(),
                    ..Default::default()
                },
                wire::Affiliate {
                    id: "liar".into(),
                    ..sealed("a", &key, &[])
                },
            ],
            deleted: false,
        };
        assert!(m.watch_message(&snapshot));
        let ids: Vec<&String> = m.affiliates().keys().collect();
        assert_eq!(ids, ["a", "b"]);
        assert_eq!(m.affiliates()["a"].info, info("a"));
        assert_eq!(m.affiliates()["a"].endpoints, vec![ep("10.0.0.1:51820")]);
        assert_eq!(
            m.affiliates()["b"].endpoints,
            vec![ep("1.1.1.1:1"), ep("[2001:db8::2]:2")],
            "undecodable endpoint blobs are dropped one by one"
        );

        // A corrupt update keeps the previous copy; an identical one changes nothing.
        let mut corrupt = sealed("a", &key, &[]);
        corrupt.data[20] ^= 1;
        assert!(!m.watch_message(&wire::WatchResponse {
            affiliates: vec![corrupt],
            deleted: false
        }));
        assert_eq!(m.affiliates()["a"].endpoints.len(), 1);
        assert!(!m.watch_message(&wire::WatchResponse {
            affiliates: vec![sealed("a", &key, &["10.0.0.1:51820"])],
            deleted: false
        }));
        // Upsert replaces the entry (endpoints included).
        assert!(m.watch_message(&wire::WatchResponse {
            affiliates: vec![sealed("a", &key, &[])],
            deleted: false
        }));
        assert!(m.affiliates()["a"].endpoints.is_empty());
        // Delete removes.
        assert!(m.watch_message(&wire::WatchResponse {
            affiliates: vec![wire::Affiliate {
                id: "a".into(),
                ..Default::default()
            }],
            deleted: true
        }));
        assert!(!m.affiliates().contains_key("a"));

        // A new stream's snapshot replaces everything.
        m.watch_ended(t0);
        connect(&mut m, t0, &[]);
        assert!(m.watch_message(&wire::WatchResponse {
            affiliates: vec![sealed("c", &key, &[])],
            deleted: false
        }));
        let ids: Vec<&String> = m.affiliates().keys().collect();
        assert_eq!(ids, ["c"]);
    }

    #[test]
    fn restart_waits_a_backoff_and_reconnects() {
        let t0 = Instant::now();
        let mut m = machine(t0);
        let now = connect(&mut m, t0, &[]);
        m.set_local_data(info("self"), vec![]).unwrap();
        drain(&mut m);
        // The driver stopped and starts again much later: calls in flight are gone.
        let later = now + Duration::from_secs(600);
        m.reset_connection(later);
        assert_eq!(m.connection_state(), ConnectionState::Backoff);
        assert!(m.poll_timeout() > later, "a delay before the first Hello");
        let at = m.poll_timeout();
        m.handle_timeout(at);
        assert!(matches!(
            drain(&mut m)[..],
            [Action::Connect(_), Action::Hello(_)]
        ));
        m.refresh_done(at, true);
        m.hello_succeeded(at, &wire::HelloResponse::default());
        assert!(
            matches!(drain(&mut m)[..], [Action::Watch(_), Action::Refresh(_)]),
            "the earlier refresh result was ignored and the data is republished"
        );
    }

    #[test]
    fn stale_results_are_ignored() {
        let t0 = Instant::now();
        let mut m = machine(t0);
        m.hello_succeeded(t0, &wire::HelloResponse::default());
        m.refresh_done(t0, false);
        assert!(!m.watch_message(&wire::WatchResponse {
            affiliates: vec![sealed("a", &secret(), &[])],
            deleted: false
        }));
        assert!(drain(&mut m).is_empty());
        assert!(m.affiliates().is_empty());
        assert_eq!(m.connection_state(), ConnectionState::Backoff);
    }
}
