//! A node's side of the server relay: one `Allocate` call, and the UDP endpoint its
//! WireGuard sends to for the peer.

use std::{net::SocketAddr, time::Duration};

use tonic::Code;

use crate::{
    client::{address::ServerAddress, driver::build_channel},
    proto::relay::{relay_client::RelayClient, AllocateRequest},
};

/// What a node asks the relay for.
#[derive(Debug, Clone)]
pub struct AllocateCall<'a> {
    /// The discovery service (`host:port` or URL, as configured).
    pub endpoint: &'a str,
    /// Plaintext for a bare `host:port`.
    pub insecure: bool,
    /// Cluster id.
    pub cluster_id: &'a str,
    /// Cluster secret (the pair token is derived from it; it is never sent).
    pub secret: &'a [u8; 32],
    /// This node's affiliate id.
    pub node_id: &'a str,
    /// The peer's affiliate id.
    pub peer_node_id: &'a str,
    /// Limit of the whole call.
    pub timeout: Duration,
}

/// A granted allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayEndpoint {
    /// Where this node's WireGuard sends the peer's packets.
    pub endpoint: SocketAddr,
    /// How long the allocation lives without use or refresh.
    pub ttl: Duration,
}

/// Why no allocation was made.
#[derive(Debug, thiserror::Error)]
pub enum AllocateError {
    /// The server does not offer the relay.
    #[error("the discovery service offers no relay")]
    NotOffered,
    /// The endpoint is not a valid discovery address.
    #[error(transparent)]
    Address(#[from] crate::client::address::AddressError),
    /// The channel could not be built.
    #[error("{0}")]
    Channel(String),
    /// The server refused or the call failed.
    #[error("relay allocate: {code:?}: {message}")]
    Call {
        /// Status code.
        code: Code,
        /// Its message.
        message: String,
    },
    /// The server's answer was unusable.
    #[error("relay allocate: {0}")]
    Answer(String),
}

/// Asks the relay at `call.endpoint` for the pair's allocation.
///
/// # Errors
/// [`AllocateError`]; [`AllocateError::NotOffered`] for a server without the relay.
pub async fn allocate(call: &AllocateCall<'_>) -> Result<RelayEndpoint, AllocateError> {
    let address = ServerAddress::parse("endpoint", call.endpoint, call.insecure)?;
    let channel = build_channel(
        &address,
        Duration::from_secs(60),
        env!("CARGO_PKG_VERSION"),
        None,
    )
    .map_err(|e| AllocateError::Channel(e.to_string()))?;
    let token = crate::relay::pair_token(
        call.secret,
        call.cluster_id,
        call.node_id,
        call.peer_node_id,
    );
    let mut req = tonic::Request::new(AllocateRequest {
        cluster_id: call.cluster_id.to_owned(),
        affiliate_id: call.node_id.to_owned(),
        peer_affiliate_id: call.peer_node_id.to_owned(),
        pair_token: token.to_vec(),
    });
    req.set_timeout(call.timeout);
    let answer = tokio::time::timeout(call.timeout, RelayClient::new(channel).allocate(req))
        .await
        .map_err(|_| AllocateError::Call {
            code: Code::DeadlineExceeded,
            message: format!("no answer within {:?}", call.timeout),
        })?
        .map_err(|s| match s.code() {
            Code::Unimplemented => AllocateError::NotOffered,
            code => AllocateError::Call {
                code,
                message: s.message().chars().take(200).collect(),
            },
        })?
        .into_inner();
    let port = u16::try_from(answer.port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| AllocateError::Answer(format!("port {} is not a UDP port", answer.port)))?;
    let ip = if answer.address.is_empty() {
        // The address this node reaches the server at.
        tokio::net::lookup_host((address.host.as_str(), address.port))
            .await
            .map_err(|e| AllocateError::Answer(format!("resolving {}: {e}", address.host)))?
            .next()
            .ok_or_else(|| AllocateError::Answer(format!("{} has no address", address.host)))?
            .ip()
    } else {
        answer.address.parse().map_err(|_| {
            AllocateError::Answer(format!("address {:?} is not an IP", answer.address))
        })?
    };
    Ok(RelayEndpoint {
        endpoint: SocketAddr::new(ip.to_canonical(), port),
        ttl: Duration::from_secs(answer.ttl_seconds.into()),
    })
}
