//! The discovery client library (docs/discovery-protocol.md §5, §8).
//!
//! [`Client`] is a cheap, cloneable handle. [`Client::run`] (or [`Client::spawn`])
//! drives the protocol: Hello, Watch, refresh every TTL/2, reconnect with backoff,
//! follow redirects. The caller publishes with [`Client::set_local_data`] and
//! [`Client::set_other_endpoints`], and reads what others publish through
//! [`Client::subscribe`]: a `watch` channel of the whole [`DiscoveryState`]
//! (decoded affiliates, public IP, connection state). A controller that reconciles
//! the full set on every wake-up consumes this most easily: it wakes only when the
//! state really changed (refreshes with identical plaintext do not wake it), and it
//! never has to replay events after a reconnect.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use wirespan_discovery::client::{AffiliateInfo, Client, ClientConfig, ClusterSecret};
//!
//! let client = Client::new(ClientConfig {
//!     endpoint: "https://discovery.talos.dev".into(),
//!     insecure: false,
//!     ca_pem: None,
//!     cluster_id: "my-cluster".into(),
//!     secret: ClusterSecret::from_base64("cluster.secret", "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=")?,
//!     affiliate_id: "node-a".into(),
//!     ttl: Duration::from_secs(1800),
//!     client_version: "v0.1.0".into(),
//! })?;
//! let cancel = tokio_util::sync::CancellationToken::new();
//! client.spawn(cancel.clone());
//! let info = AffiliateInfo { node_id: "node-a".into(), ..AffiliateInfo::default() };
//! client.set_local_data(info, vec!["192.0.2.1:51820".parse()?])?;
//! let mut state = client.subscribe();
//! while state.changed().await.is_ok() {
//!     let now = state.borrow_and_update().clone();
//!     println!("{} peers, public IP {:?}", now.affiliates.len(), now.public_ip);
//! }
//! # Ok(())
//! # }
//! ```
//!
//! Layers: [`crypto`] (blobs), [`model`] (typed plaintext), [`machine`] (sans-IO
//! decisions, fake-clock tested), `driver` (tokio/tonic shell).

pub mod address;
pub mod backoff;
pub mod crypto;
pub(crate) mod driver;
pub mod extension;
pub mod machine;
pub mod model;
/// Wire details that rest on a presumption (one constant each).
pub mod presumed;
pub mod relay;

use std::{
    collections::BTreeMap,
    net::IpAddr,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, MutexGuard,
    },
    time::Duration,
};

use rand::{rngs::StdRng, SeedableRng};
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

pub use self::{
    address::{AddressError, ServerAddress},
    crypto::{ClusterSecret, SecretError},
    driver::keepalive_interval,
    extension::WirespanInfo,
    machine::{Affiliate, ConnectionState, LocalDataError},
    model::{AffiliateInfo, ControlPlaneInfo, Endpoint, KubeSpanInfo, MachineType},
};
use self::{
    crypto::Cipher,
    machine::{Machine, MachineSettings},
};

/// Longest TTL the server accepts (§7.8).
pub const MAX_TTL: Duration = Duration::from_secs(30 * 60);
/// Upstream default TTL.
pub const DEFAULT_TTL: Duration = MAX_TTL;

/// Everything a client needs.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Server: `host:port`, `https://h[:p]`, `http://h[:p]` or `grpc://h[:p]`.
    pub endpoint: String,
    /// Bare `host:port` uses plaintext HTTP/2 instead of TLS.
    pub insecure: bool,
    /// PEM trust roots for TLS; `None` reads the system bundle on every connect.
    pub ca_pem: Option<Vec<u8>>,
    /// Cluster ID (opaque string).
    pub cluster_id: String,
    /// Cluster secret: key of all blobs.
    pub secret: ClusterSecret,
    /// Own affiliate ID (the node ID).
    pub affiliate_id: String,
    /// TTL of published data, at most 30 min; refreshed every TTL/2.
    pub ttl: Duration,
    /// Sent in Hello; use `vMAJOR.MINOR.PATCH` so the server can count it.
    pub client_version: String,
}

/// Invalid client configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// Bad `endpoint`.
    #[error(transparent)]
    Endpoint(#[from] AddressError),
    /// A required string is empty.
    #[error("{field}: must not be empty")]
    Empty {
        /// Field name.
        field: &'static str,
    },
    /// A string is longer than the server accepts.
    #[error("{field}: {len} bytes, the server accepts at most 256")]
    TooLong {
        /// Field name.
        field: &'static str,
        /// Length.
        len: usize,
    },
    /// TTL zero or above 30 min.
    #[error("ttl: {ttl:?} is outside (0, 30 min]")]
    Ttl {
        /// The value.
        ttl: Duration,
    },
}

/// What the client currently knows; published on every real change.
#[derive(Debug, Clone, PartialEq)]
pub struct DiscoveryState {
    /// Decoded affiliates of other nodes by ID (never includes this node).
    pub affiliates: Arc<BTreeMap<String, Affiliate>>,
    /// This node's address as the server saw it (Hello `client_ip`): a public
    /// endpoint candidate.
    pub public_ip: Option<IpAddr>,
    /// Connection phase.
    pub connection: ConnectionState,
    /// Server in use (differs from the configured one after a redirect).
    pub endpoint: ServerAddress,
    /// The most recent failure (Hello, Watch or refresh) since the client last
    /// became [`ConnectionState::Connected`]; at most [`MAX_ERROR_LEN`] bytes of the
    /// server's message.
    pub last_error: Option<String>,
    /// Times the client re-published its own affiliate because someone else deleted
    /// or altered it on the server (docs/discovery-protocol.md §8.8).
    pub republishes: u64,
}

/// Longest error text kept in [`DiscoveryState::last_error`] (a hostile server
/// chooses the message).
pub const MAX_ERROR_LEN: usize = 256;

/// `run` was called while another `run` of the same client is active.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("this discovery client is already running")]
pub struct AlreadyRunning;

struct Shared {
    machine: Mutex<Machine<StdRng>>,
    notify: Notify,
    state: watch::Sender<DiscoveryState>,
    running: AtomicBool,
    ttl: Duration,
    client_version: String,
    ca_pem: Option<Vec<u8>>,
    last_error: Mutex<Option<String>>,
}

impl Shared {
    // The lock is never held across an await; a poisoned lock only means a
    // panic elsewhere, and the machine stays consistent between calls.
    fn lock(&self) -> MutexGuard<'_, Machine<StdRng>> {
        self.machine
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a failure for [`DiscoveryState::last_error`] (published with the
    /// next state).
    fn record_error(&self, what: &str, status: &tonic::Status) {
        // The server chooses the message: control characters (terminal escapes) are
        // replaced so that `wirespan get` prints it harmlessly.
        let message: String = status
            .message()
            .chars()
            .map(|c| if c.is_control() { '\u{fffd}' } else { c })
            .collect();
        let mut text = format!("{what}: {:?}: {message}", status.code());
        if text.len() > MAX_ERROR_LEN {
            let mut end = MAX_ERROR_LEN;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
        }
        *self
            .last_error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(text);
    }

    fn publish(&self) {
        let next = {
            let m = self.lock();
            let connection = m.connection_state();
            let mut last_error = self
                .last_error
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if connection == ConnectionState::Connected {
                *last_error = None;
            }
            DiscoveryState {
                affiliates: Arc::clone(m.affiliates()),
                public_ip: m.public_ip(),
                connection,
                endpoint: m.current_endpoint().clone(),
                last_error: last_error.clone(),
                republishes: m.republishes(),
            }
        };
        self.state.send_if_modified(|current| {
            let same = Arc::ptr_eq(&current.affiliates, &next.affiliates)
                || current.affiliates == next.affiliates;
            if same
                && current.public_ip == next.public_ip
                && current.connection == next.connection
                && current.endpoint == next.endpoint
                && current.last_error == next.last_error
                && current.republishes == next.republishes
            {
                return false;
            }
            *current = next;
            true
        });
    }
}

/// Handle to one discovery client (one per configured server).
#[derive(Clone)]
pub struct Client {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("state", &*self.shared.state.borrow())
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Validates the configuration and creates an idle client.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field.
    pub fn new(config: ClientConfig) -> Result<Self, ConfigError> {
        let endpoint = ServerAddress::parse("endpoint", &config.endpoint, config.insecure)?;
        for (field, value) in [
            ("cluster_id", &config.cluster_id),
            ("affiliate_id", &config.affiliate_id),
        ] {
            if value.is_empty() {
                return Err(ConfigError::Empty { field });
            }
            if value.len() > 256 {
                return Err(ConfigError::TooLong {
                    field,
                    len: value.len(),
                });
            }
        }
        if config.ttl.is_zero() || config.ttl > MAX_TTL {
            return Err(ConfigError::Ttl { ttl: config.ttl });
        }
        let machine = Machine::new(
            MachineSettings {
                endpoint: endpoint.clone(),
                cluster_id: config.cluster_id,
                affiliate_id: config.affiliate_id,
                ttl: config.ttl,
                client_version: config.client_version.clone(),
            },
            Cipher::new(&config.secret),
            StdRng::from_entropy(),
            tokio::time::Instant::now().into_std(),
        );
        let (state, _) = watch::channel(DiscoveryState {
            affiliates: Arc::new(BTreeMap::new()),
            public_ip: None,
            connection: ConnectionState::Backoff,
            endpoint,
            last_error: None,
            republishes: 0,
        });
        Ok(Self {
            shared: Arc::new(Shared {
                machine: Mutex::new(machine),
                notify: Notify::new(),
                state,
                running: AtomicBool::new(false),
                ttl: config.ttl,
                client_version: config.client_version,
                ca_pem: config.ca_pem,
                last_error: Mutex::new(None),
            }),
        })
    }

    /// Runs the protocol until `cancel` fires. Published data is not deleted on
    /// cancel (it expires after the TTL); call [`Client::delete_own_affiliate`]
    /// and let a refresh go out first for a permanent removal.
    ///
    /// # Errors
    /// [`AlreadyRunning`] if another `run` of this client is active.
    pub async fn run(&self, cancel: CancellationToken) -> Result<(), AlreadyRunning> {
        if self.shared.running.swap(true, Ordering::AcqRel) {
            return Err(AlreadyRunning);
        }
        struct Running<'a>(&'a AtomicBool);
        impl Drop for Running<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _running = Running(&self.shared.running);
        driver::run(Arc::clone(&self.shared), cancel).await;
        Ok(())
    }

    /// Spawns [`Client::run`] on the current tokio runtime.
    #[must_use]
    pub fn spawn(&self, cancel: CancellationToken) -> tokio::task::JoinHandle<()> {
        let client = self.clone();
        tokio::spawn(async move {
            if let Err(e) = client.run(cancel).await {
                tracing::warn!(error = %e, "discovery client not started");
            }
        })
    }

    /// Sets the own affiliate data and endpoints. Equal inputs are a no-op
    /// (`Ok(false)`: nothing encrypted, nothing sent); otherwise the data is
    /// encrypted once and published at once (if connected) and on every refresh.
    ///
    /// # Errors
    /// [`LocalDataError`]: too large, too many endpoints or a wrong node ID. The
    /// previously set data stays published.
    pub fn set_local_data(
        &self,
        info: AffiliateInfo,
        endpoints: Vec<Endpoint>,
    ) -> Result<bool, LocalDataError> {
        let changed = self.shared.lock().set_local_data(info, endpoints)?;
        if changed {
            self.shared.notify.notify_one();
        }
        Ok(changed)
    }

    /// Sets endpoints harvested for other affiliates (affiliate ID → endpoints),
    /// each published as an endpoints-only update for that affiliate. Returns
    /// `false` (and sends nothing) when unchanged.
    pub fn set_other_endpoints(&self, others: BTreeMap<String, Vec<Endpoint>>) -> bool {
        let changed = self.shared.lock().set_other_endpoints(others);
        if changed {
            self.shared.notify.notify_one();
        }
        changed
    }

    /// Forgets the local data and deletes the own affiliate from the server at
    /// the next refresh (repeated on every refresh until new data is set).
    pub fn delete_own_affiliate(&self) {
        self.shared.lock().delete_own_affiliate();
        self.shared.notify.notify_one();
    }

    /// The state channel: the current value at once, then every change.
    #[must_use]
    pub fn subscribe(&self) -> watch::Receiver<DiscoveryState> {
        self.shared.state.subscribe()
    }

    /// A copy of the current state.
    #[must_use]
    pub fn state(&self) -> DiscoveryState {
        self.shared.state.borrow().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ClientConfig {
        ClientConfig {
            endpoint: "127.0.0.1:3000".into(),
            insecure: true,
            ca_pem: None,
            cluster_id: "c".into(),
            secret: ClusterSecret::from_bytes([1; 32]),
            affiliate_id: "n".into(),
            ttl: DEFAULT_TTL,
            client_version: "v0.1.0".into(),
        }
    }

    #[tokio::test]
    async fn config_errors_name_the_field() {
        assert!(Client::new(config()).is_ok());
        let e = Client::new(ClientConfig {
            cluster_id: String::new(),
            ..config()
        })
        .unwrap_err();
        assert_eq!(e.to_string(), "cluster_id: must not be empty");
        let e = Client::new(ClientConfig {
            affiliate_id: "x".repeat(257),
            ..config()
        })
        .unwrap_err();
        assert_eq!(
            e,
            ConfigError::TooLong {
                field: "affiliate_id",
                len: 257
            }
        );
        let e = Client::new(ClientConfig {
            ttl: Duration::from_secs(1801),
            ..config()
        })
        .unwrap_err();
        assert!(e.to_string().starts_with("ttl: "));
        let e = Client::new(ClientConfig {
            endpoint: "nowhere".into(),
            ..config()
        })
        .unwrap_err();
        assert!(e.to_string().starts_with("endpoint: "));
    }

    #[tokio::test]
    async fn debug_output_has_no_secret() {
        let c = Client::new(config()).unwrap();
        let cfg = format!("{:?}", config());
        assert!(cfg.contains("ClusterSecret(<redacted>)"));
        assert!(!format!("{c:?}").contains("secret"));
    }

    #[tokio::test]
    async fn server_error_text_is_cut_and_stripped_of_control_characters() {
        let c = Client::new(config()).unwrap();
        let hostile = format!("\u{1b}]0;owned\u{7}\u{1b}[2J{}", "x".repeat(1000));
        c.shared
            .record_error("hello", &tonic::Status::unavailable(hostile));
        c.shared.publish();
        let e = c.state().last_error.unwrap();
        assert!(e.starts_with("hello: Unavailable: "), "{e}");
        assert!(!e.chars().any(char::is_control), "{e:?}");
        assert!(e.len() <= MAX_ERROR_LEN);
    }

    #[tokio::test]
    async fn second_run_is_refused() {
        let c = Client::new(config()).unwrap();
        let cancel = CancellationToken::new();
        let task = c.spawn(cancel.clone());
        tokio::task::yield_now().await;
        assert_eq!(c.run(cancel.clone()).await, Err(AlreadyRunning));
        cancel.cancel();
        task.await.unwrap();
        // After the first run ended, a new one may start.
        let cancel = CancellationToken::new();
        cancel.cancel();
        assert_eq!(c.run(cancel).await, Ok(()));
    }
}
