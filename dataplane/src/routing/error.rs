//! Errors of the routing adapter, and the helper that tags a netlink failure with
//! the request that failed.

use crate::error::Invalid;

/// Errors of the routing adapter.
#[derive(Debug, thiserror::Error)]
pub enum RoutingError {
    /// The desired state is invalid; nothing was written.
    #[error("invalid routing spec: {0}")]
    Invalid(#[from] Invalid),
    /// The link does not exist (yet); nothing was written.
    #[error("link {0:?} not found")]
    LinkNotFound(String),
    /// A netlink request failed.
    #[error("netlink {op}: {source}")]
    Netlink {
        /// What we asked for.
        op: &'static str,
        /// The kernel's answer.
        #[source]
        source: rtnetlink::Error,
    },
    /// The namespace thread could not be used.
    #[error("network namespace: {0}")]
    Netns(#[from] std::io::Error),
}

pub(super) fn nl(op: &'static str) -> impl FnOnce(rtnetlink::Error) -> RoutingError {
    move |source| RoutingError::Netlink { op, source }
}
