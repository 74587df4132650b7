//! The error of the marking adapters.
//!
//! [`MarkingError::FastPath`] is the marking module's one reference to
//! [`crate::fastpath`]: an adapter that marks with both the nftables table and the
//! eBPF fast path ([`crate::kernel_marking::FastPathMarking`]) reports through the
//! [`Marking`](super::Marking) trait. The dependency runs one way: the fast path knows
//! only [`crate::markspec`], never this module.

use crate::{error::Invalid, fastpath::FastPathError};

/// Errors of the nftables adapter.
#[derive(Debug, thiserror::Error)]
pub enum MarkingError {
    /// The desired state is invalid; nothing was written.
    #[error("invalid marking spec: {0}")]
    Invalid(#[from] Invalid),
    /// `nft` could not be run.
    #[error("cannot run nft: {0}")]
    Spawn(#[source] std::io::Error),
    /// The nf_tables netlink socket failed mid-transaction; the next apply re-reads the
    /// table.
    #[error("nf_tables netlink: {0}")]
    Netlink(#[source] std::io::Error),
    /// `nft` refused a command; the kernel keeps its previous state (transactions are
    /// atomic).
    #[error("nft {op} failed: {stderr}")]
    Nft {
        /// What we asked for.
        op: &'static str,
        /// nft's message.
        stderr: String,
    },
    /// A delta was given before any spec was applied.
    #[error("a routed-set delta needs a spec applied first")]
    NotApplied,
    /// The eBPF fast path that marks forwarded traffic failed to sync its maps.
    #[error("eBPF fast path: {0}")]
    FastPath(#[source] FastPathError),
}
