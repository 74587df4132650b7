//! Client of the resource API: over the node's unix socket, or over mutual TLS to a
//! node's `--api-listen` address (with the target node in a header, for the proxy).

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

use super::proto::resource_service_client::ResourceServiceClient;
use crate::secret::SecretString;

/// A client whose requests name their target node (`x-wirespan-node`), if any.
pub type ApiClient = ResourceServiceClient<tonic::codegen::InterceptedService<Channel, NodeTarget>>;

/// Adds the target node header to every request.
#[derive(Debug, Clone, Default)]
pub struct NodeTarget(Option<tonic::metadata::AsciiMetadataValue>);

impl tonic::service::Interceptor for NodeTarget {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut()
                .insert(super::gate::NODE_HEADER, v.clone());
        }
        Ok(req)
    }
}

/// A client on `channel` whose requests go to `node` (`None`: the endpoint itself).
///
/// # Errors
/// A node name that cannot be a header value.
pub fn for_node(channel: Channel, node: Option<&str>) -> Result<ApiClient, ConnectError> {
    let target = node
        .map(|n| {
            n.parse().map_err(|_| ConnectError::Remote {
                endpoint: String::new(),
                reason: format!("node name {n:?} is not printable ASCII"),
            })
        })
        .transpose()?;
    Ok(
        ResourceServiceClient::with_interceptor(channel, NodeTarget(target))
            .max_decoding_message_size(super::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(super::MAX_MESSAGE_BYTES),
    )
}

/// A client's credentials for the remote API (PEM).
#[derive(Debug, Clone)]
pub struct Credentials {
    /// The cluster API CA certificate.
    pub ca_pem: String,
    /// The client certificate.
    pub cert_pem: String,
    /// The client key.
    pub key_pem: SecretString,
}

/// Connects to a node's remote API at `endpoint` (`host:port`, IPv6 in brackets; the
/// port defaults to [`DEFAULT_PORT`]).
///
/// # Errors
/// [`ConnectError::Remote`] (TLS refusals included); never contains the key.
pub async fn connect_remote(endpoint: &str, creds: &Credentials) -> Result<Channel, ConnectError> {
    let err = |reason: String| ConnectError::Remote {
        endpoint: endpoint.to_owned(),
        reason,
    };
    let with_port = if endpoint.parse::<std::net::SocketAddr>().is_ok()
        || endpoint
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.contains(':') && p.parse::<u16>().is_ok())
    {
        endpoint.to_owned()
    } else if endpoint.parse::<std::net::Ipv6Addr>().is_ok() {
        format!("[{endpoint}]:{DEFAULT_PORT}")
    } else {
        format!("{endpoint}:{DEFAULT_PORT}")
    };
    let host = with_port
        .rsplit_once(':')
        .map_or(with_port.as_str(), |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(&creds.ca_pem))
        .identity(tonic::transport::Identity::from_pem(
            &creds.cert_pem,
            creds.key_pem.expose(),
        ))
        .domain_name(host);
    Endpoint::from_shared(format!("https://{with_port}"))
        .map_err(|e| err(e.to_string()))?
        .tls_config(tls)
        .map_err(|e| err(e.to_string()))?
        .connect_timeout(std::time::Duration::from_secs(10))
        .connect()
        .await
        .map_err(|e| err(error_chain(&e)))
}

/// An error and its causes on one line (the TLS alert is in a cause).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// The remote API's default port.
pub const DEFAULT_PORT: u16 = 50_100;

/// Connecting to the node failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// No node serves on the socket.
    #[error("node is not running: no API at {path} ({reason}); start it with `wirespan node` (or pass --socket / WIRESPAN_SOCKET)")]
    NotRunning {
        /// The socket path.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// The remote API could not be reached or refused the connection.
    #[error("node API at {endpoint}: {reason}")]
    Remote {
        /// The endpoint.
        endpoint: String,
        /// What failed.
        reason: String,
    },
    /// Permission denied (the socket is root only).
    #[error(
        "cannot open the node's API socket {path}: permission denied (it is root only: mode 0600)"
    )]
    PermissionDenied {
        /// The socket path.
        path: PathBuf,
    },
}

/// Connects to the API socket at `path`.
///
/// # Errors
/// [`ConnectError`].
pub async fn connect(path: &Path) -> Result<ResourceServiceClient<Channel>, ConnectError> {
    Ok(ResourceServiceClient::new(connect_channel(path).await?)
        .max_decoding_message_size(super::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(super::MAX_MESSAGE_BYTES))
}

/// Connects a channel to the API socket at `path`.
///
/// # Errors
/// [`ConnectError`].
pub async fn connect_channel(path: &Path) -> Result<Channel, ConnectError> {
    let path = path.to_owned();
    // Connect once eagerly to turn a missing socket into a clear message.
    if let Err(e) = tokio::net::UnixStream::connect(&path).await {
        return Err(if e.kind() == std::io::ErrorKind::PermissionDenied {
            ConnectError::PermissionDenied { path }
        } else {
            ConnectError::NotRunning {
                reason: e.to_string(),
                path,
            }
        });
    }
    let p = path.clone();
    // The URI is required by tonic but unused: the connector ignores it.
    let channel = Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = p.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(p).await?))
            }
        }))
        .await
        .map_err(|e| ConnectError::NotRunning {
            reason: e.to_string(),
            path,
        })?;
    Ok(channel)
}
