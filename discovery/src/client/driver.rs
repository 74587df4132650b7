//! The tokio shell around [`Machine`]: executes its actions with tonic and feeds
//! results, Watch messages and the time back. All decisions live in the machine.

use std::{future::Future, pin::Pin, sync::Arc, time::Duration};

use futures::StreamExt as _;
use tokio_util::sync::CancellationToken;
use tonic::{
    transport::{Certificate, Channel, ClientTlsConfig},
    Request, Status, Streaming,
};

use super::{
    address::ServerAddress,
    machine::{Action, RefreshCall},
    Shared,
};
use crate::proto::server::{self as wire, cluster_client::ClusterClient};

/// Deadline of one Hello (upstream value).
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Deadline of one whole refresh batch (upstream value).
pub const REFRESH_TIMEOUT: Duration = Duration::from_secs(30);
/// TCP connect timeout.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an HTTP/2 ping may go unanswered before the connection is dropped.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// Largest Watch/List message accepted. Above gRPC's 4 MiB default because a
/// maximal cluster's snapshot is ≈ 4.4 MB (docs/discovery-protocol.md §1).
pub const MAX_MESSAGE: usize = 16 * 1024 * 1024;

/// HTTP/2 ping interval for a TTL: `max(10 s, TTL / 10)` (§1). The server must
/// tolerate pings 10 s apart, so never go below that.
#[must_use]
pub fn keepalive_interval(ttl: Duration) -> Duration {
    (ttl / 10).max(Duration::from_secs(10))
}

/// Files tried, in order, for the system trust roots (after `$SSL_CERT_FILE`).
const SYSTEM_ROOTS: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

/// A channel that could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// Endpoint URI or TLS configuration rejected by tonic.
    #[error("discovery channel to {endpoint}: {source}")]
    Transport {
        /// Target.
        endpoint: String,
        /// tonic's error.
        #[source]
        source: tonic::transport::Error,
    },
    /// TLS requested but no trust roots were found.
    #[error(
        "no TLS trust roots: set $SSL_CERT_FILE or install a CA bundle in one of {SYSTEM_ROOTS:?}"
    )]
    NoRoots,
}

fn system_roots() -> Result<Certificate, ChannelError> {
    let env = std::env::var_os("SSL_CERT_FILE").map(std::path::PathBuf::from);
    env.into_iter()
        .chain(SYSTEM_ROOTS.iter().map(std::path::PathBuf::from))
        .find_map(|path| std::fs::read(path).ok())
        .map(Certificate::from_pem)
        .ok_or(ChannelError::NoRoots)
}

/// Builds a lazily connecting channel; TLS roots are read anew every time, so a
/// reconnect picks up a rotated CA bundle.
pub(crate) fn build_channel(
    address: &ServerAddress,
    ttl: Duration,
    client_version: &str,
    ca_pem: Option<&[u8]>,
) -> Result<Channel, ChannelError> {
    let transport = |source| ChannelError::Transport {
        endpoint: address.to_string(),
        source,
    };
    let mut endpoint = tonic::transport::Endpoint::from_shared(address.uri())
        .map_err(transport)?
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(keepalive_interval(ttl))
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(false)
        .tcp_nodelay(true)
        .user_agent(format!("wirespan-discovery-client/{client_version}"))
        .map_err(transport)?;
    if address.tls {
        let roots = match ca_pem {
            Some(pem) => Certificate::from_pem(pem),
            None => system_roots()?,
        };
        endpoint = endpoint
            .tls_config(
                ClientTlsConfig::new()
                    .domain_name(address.host.clone())
                    .ca_certificate(roots),
            )
            .map_err(transport)?;
    }
    Ok(endpoint.connect_lazy())
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The calls in flight; dropping a future cancels its call.
#[derive(Default)]
struct Io {
    client: Option<ClusterClient<Channel>>,
    hello: Option<BoxFuture<Result<wire::HelloResponse, Status>>>,
    watch_open: Option<BoxFuture<Result<Streaming<wire::WatchResponse>, Status>>>,
    watch: Option<Streaming<wire::WatchResponse>>,
    refresh: Option<BoxFuture<Result<(), Status>>>,
}

impl Io {
    fn cancel_watch(&mut self) {
        self.watch_open = None;
        self.watch = None;
        self.refresh = None;
    }

    fn execute(&mut self, action: Action, shared: &Shared) {
        match action {
            Action::Connect(address) => {
                *self = Self::default();
                match build_channel(
                    &address,
                    shared.ttl,
                    &shared.client_version,
                    shared.ca_pem.as_deref(),
                ) {
                    Ok(channel) => {
                        self.client = Some(
                            ClusterClient::new(channel).max_decoding_message_size(MAX_MESSAGE),
                        );
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot set up discovery channel"),
                }
            }
            Action::Hello(request) => {
                let Some(mut client) = self.client.clone() else {
                    self.hello = Some(Box::pin(async {
                        Err(Status::unavailable("no discovery channel"))
                    }));
                    return;
                };
                self.hello = Some(Box::pin(async move {
                    let mut request = Request::new(request);
                    request.set_timeout(HELLO_TIMEOUT);
                    match tokio::time::timeout(HELLO_TIMEOUT, client.hello(request)).await {
                        Ok(result) => result.map(tonic::Response::into_inner),
                        Err(_) => Err(Status::deadline_exceeded("hello timed out")),
                    }
                }));
            }
            Action::Watch(request) => {
                let Some(mut client) = self.client.clone() else {
                    self.watch_open = Some(Box::pin(async {
                        Err(Status::unavailable("no discovery channel"))
                    }));
                    return;
                };
                self.watch_open = Some(Box::pin(async move {
                    client.watch(request).await.map(tonic::Response::into_inner)
                }));
            }
            Action::CancelWatch => self.cancel_watch(),
            Action::Refresh(batch) => {
                let Some(mut client) = self.client.clone() else {
                    self.refresh = Some(Box::pin(async {
                        Err(Status::unavailable("no discovery channel"))
                    }));
                    return;
                };
                self.refresh = Some(Box::pin(async move {
                    let deadline = tokio::time::Instant::now() + REFRESH_TIMEOUT;
                    let calls = async {
                        for call in batch {
                            let left =
                                deadline.saturating_duration_since(tokio::time::Instant::now());
                            match call {
                                RefreshCall::Update(u) => {
                                    let mut request = Request::new(u);
                                    request.set_timeout(left);
                                    client.affiliate_update(request).await?;
                                }
                                RefreshCall::Delete(d) => {
                                    let mut request = Request::new(d);
                                    request.set_timeout(left);
                                    client.affiliate_delete(request).await?;
                                }
                            }
                        }
                        Ok(())
                    };
                    match tokio::time::timeout_at(deadline, calls).await {
                        Ok(result) => result,
                        Err(_) => Err(Status::deadline_exceeded("refresh timed out")),
                    }
                }));
            }
        }
    }
}

async fn optional<T>(future: &mut Option<BoxFuture<T>>) -> T {
    match future {
        Some(f) => f.as_mut().await,
        None => std::future::pending().await,
    }
}

async fn next_message(
    stream: &mut Option<Streaming<wire::WatchResponse>>,
) -> Option<Result<wire::WatchResponse, Status>> {
    match stream {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

/// Runs the client until `cancel` fires.
pub(super) async fn run(shared: Arc<Shared>, cancel: CancellationToken) {
    let mut io = Io::default();
    shared.lock().reset_connection(now());
    loop {
        let (actions, timeout) = {
            let mut machine = shared.lock();
            machine.handle_timeout(now());
            let actions: Vec<Action> = std::iter::from_fn(|| machine.poll_action()).collect();
            (actions, machine.poll_timeout())
        };
        for action in actions {
            tracing::trace!(action = action.kind(), "discovery client action");
            io.execute(action, &shared);
        }
        shared.publish();
        tokio::select! {
            () = cancel.cancelled() => {
                // Calls are dropped with `io`; subscribers must not keep seeing
                // "connected" from a client that stopped.
                shared.lock().reset_connection(now());
                shared.publish();
                return;
            }
            () = tokio::time::sleep_until(timeout.into()) => {}
            () = shared.notify.notified() => {}
            result = optional(&mut io.hello) => {
                io.hello = None;
                match result {
                    Ok(response) => shared.lock().hello_succeeded(now(), &response),
                    Err(status) => {
                        tracing::warn!(code = ?status.code(), message = status.message(), "discovery hello failed");
                        shared.record_error("hello", &status);
                        io.client = None;
                        shared.lock().hello_failed(now());
                    }
                }
            }
            result = optional(&mut io.watch_open) => {
                io.watch_open = None;
                match result {
                    Ok(stream) => io.watch = Some(stream),
                    Err(status) => {
                        tracing::warn!(code = ?status.code(), message = status.message(), "discovery watch failed");
                        shared.record_error("watch", &status);
                        io.cancel_watch();
                        shared.lock().watch_ended(now());
                    }
                }
            }
            message = next_message(&mut io.watch) => match message {
                Some(Ok(response)) => {
                    shared.lock().watch_message(now(), &response);
                }
                other => {
                    match other {
                        Some(Err(status)) if status.code() != tonic::Code::Cancelled => {
                            tracing::warn!(code = ?status.code(), message = status.message(), "discovery watch ended");
                            shared.record_error("watch", &status);
                        }
                        _ => tracing::info!("discovery watch ended"),
                    }
                    io.cancel_watch();
                    shared.lock().watch_ended(now());
                }
            },
            result = optional(&mut io.refresh) => {
                io.refresh = None;
                if let Err(status) = &result {
                    tracing::warn!(code = ?status.code(), message = status.message(), "discovery refresh failed");
                    shared.record_error("refresh", status);
                }
                shared.lock().refresh_done(now(), result.is_ok());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keepalive_follows_ttl_with_ten_second_floor() {
        assert_eq!(
            keepalive_interval(Duration::from_secs(1800)),
            Duration::from_secs(180)
        );
        assert_eq!(
            keepalive_interval(Duration::from_secs(60)),
            Duration::from_secs(10)
        );
        assert_eq!(
            keepalive_interval(Duration::from_secs(1)),
            Duration::from_secs(10)
        );
    }

    #[tokio::test]
    async fn plaintext_channel_builds_lazily_without_a_server() {
        let plain = ServerAddress::parse("e", "http://127.0.0.1:1", false).unwrap();
        assert!(build_channel(&plain, Duration::from_secs(60), "v0.1.0", None).is_ok());
    }
}
