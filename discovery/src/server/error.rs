//! Domain errors of the discovery server and their one mapping to gRPC status codes.

use std::path::PathBuf;

/// A request the server refuses. The `Display` text is the upstream status message,
/// verbatim: clients and conformance tests observe it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// `cluster_id` is empty.
    #[error("cluster ID can't be empty")]
    ClusterIdEmpty,
    /// `cluster_id` is longer than 256 bytes.
    #[error("cluster ID is too long")]
    ClusterIdTooLong,
    /// `affiliate_id` is empty.
    #[error("affiliate ID can't be empty")]
    AffiliateIdEmpty,
    /// `affiliate_id` is longer than 256 bytes.
    #[error("affiliate ID is too long")]
    AffiliateIdTooLong,
    /// `affiliate_data` is longer than 2048 bytes.
    #[error("affiliate data is too big")]
    DataTooBig,
    /// One `affiliate_endpoints` blob is longer than 32 bytes.
    #[error("affiliate endpoint is too big")]
    EndpointTooBig,
    /// `ttl` is above 30 minutes.
    #[error("ttl is too large")]
    TtlTooLarge,
    /// The cluster already holds 1024 affiliates.
    #[error("too many affiliates in the cluster")]
    TooManyAffiliates,
    /// The affiliate already holds 64 endpoints.
    #[error("too many endpoints in the affiliate")]
    TooManyEndpoints,
    /// Waiting for a rate-limit token would outlast the call's deadline.
    #[error("rate limit exceeds request timeout")]
    RateLimited,
    /// The address already has a second of calls queued behind the rate limit.
    #[error("rate limit exceeded: this address already has 1 s of calls queued")]
    RateLimitDebt,
    /// The server refuses AffiliateDelete (`--affiliate-delete refuse`).
    #[error("affiliate deletes are refused by this server (--affiliate-delete refuse); the affiliate expires at the end of its TTL")]
    DeleteRefused,
    /// A new cluster would exceed the server's cluster cap.
    #[error("too many clusters on the server (limit {0}, --max-clusters)")]
    TooManyClusters(usize),
    /// The request would grow the stored state past its memory budget.
    #[error("server state memory budget of {0} bytes exhausted (--state-budget-mib)")]
    StateBudget(usize),
    /// The watcher's queue overflowed and its subscription was dropped.
    #[error("subscription canceled: lost update")]
    LostUpdate,
}

impl From<RequestError> for tonic::Status {
    fn from(err: RequestError) -> Self {
        let code = match err {
            RequestError::ClusterIdEmpty
            | RequestError::ClusterIdTooLong
            | RequestError::AffiliateIdEmpty
            | RequestError::AffiliateIdTooLong
            | RequestError::DataTooBig
            | RequestError::EndpointTooBig
            | RequestError::TtlTooLarge => tonic::Code::InvalidArgument,
            RequestError::TooManyAffiliates
            | RequestError::TooManyEndpoints
            | RequestError::RateLimited
            | RequestError::RateLimitDebt
            | RequestError::TooManyClusters(_)
            | RequestError::StateBudget(_) => tonic::Code::ResourceExhausted,
            RequestError::DeleteRefused => tonic::Code::PermissionDenied,
            RequestError::LostUpdate => tonic::Code::Aborted,
        };
        tonic::Status::new(code, err.to_string())
    }
}

/// Failures to start, run or stop the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The listener's local address could not be read.
    #[error("reading the listener's local address")]
    LocalAddr(#[source] std::io::Error),
    /// A TLS certificate or key file could not be read.
    #[error("reading TLS file {path}")]
    TlsFile {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The TLS certificate or key is not usable.
    #[error("TLS material: {0}")]
    Tls(String),
    /// The gRPC transport failed (bad TLS material, accept loop error).
    #[error("gRPC transport")]
    Transport(#[from] tonic::transport::Error),
    /// The metrics/web listener failed.
    #[error("metrics listener")]
    Web(#[source] std::io::Error),
    /// Saving the snapshot failed.
    #[error("saving snapshot")]
    Snapshot(#[from] SnapshotError),
    /// A server task panicked.
    #[error("server task failed: {0}")]
    Task(String),
}

/// Failures to read or write the snapshot file.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// Filesystem error on the snapshot file or its temp file.
    #[error("{op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a valid snapshot.
    #[error("corrupt snapshot at byte {offset}: {reason}")]
    Corrupt {
        /// Byte offset of the bad record.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
}
