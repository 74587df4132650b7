//! Client of the resource API over the node's unix socket.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

use super::proto::resource_service_client::ResourceServiceClient;

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
    Ok(ResourceServiceClient::new(channel)
        .max_decoding_message_size(super::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(super::MAX_MESSAGE_BYTES))
}
