//! Store errors ([`StateError`], `docs/runtime.md` §2.2), at the bottom of the store/watch
//! layering (see the module doc of [`super`]): the store returns them, a watch ends
//! with one, controllers wrap them.

use super::metadata::{Phase, Pointer};

/// Store errors (`docs/runtime.md` §2.2); every variant names the resource.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// The resource does not exist.
    #[error("resource {pointer} doesn't exist")]
    NotFound {
        /// The resource.
        pointer: Pointer,
    },
    /// Create of an existing resource.
    #[error("resource {pointer} already exists")]
    AlreadyExists {
        /// The resource.
        pointer: Pointer,
    },
    /// Update with a version other than the stored one.
    #[error(
        "resource {pointer} update conflict: expected version {expected}, actual version {actual}"
    )]
    VersionConflict {
        /// The resource.
        pointer: Pointer,
        /// The version the caller sent.
        expected: u64,
        /// The stored version.
        actual: u64,
    },
    /// The caller is not the resource's owner.
    #[error("resource {pointer} is owned by {owner:?}")]
    OwnerConflict {
        /// The resource.
        pointer: Pointer,
        /// The stored owner.
        owner: String,
    },
    /// The resource is not in the expected phase.
    #[error("resource {pointer} is not in phase {expected}")]
    PhaseConflict {
        /// The resource.
        pointer: Pointer,
        /// The phase the caller expected.
        expected: Phase,
    },
    /// Destroy while finalizers are set.
    #[error("resource {pointer} has pending finalizers {finalizers:?}")]
    PendingFinalizers {
        /// The resource.
        pointer: Pointer,
        /// The finalizers still set.
        finalizers: Vec<String>,
    },
    /// A resume position that the store does not know.
    #[error("invalid bookmark for {pointer}")]
    InvalidBookmark {
        /// The kind (empty id).
        pointer: Pointer,
    },
    /// A watcher fell behind the kind's history.
    #[error("buffer overrun: watcher of {pointer} fell more than {capacity} events behind")]
    Overrun {
        /// The kind (empty id).
        pointer: Pointer,
        /// History capacity.
        capacity: usize,
    },
    /// The stored resource is not of the requested Rust type.
    #[error("resource {pointer} is not of the requested type")]
    TypeMismatch {
        /// The resource.
        pointer: Pointer,
    },
}

impl StateError {
    /// Upstream classifies all these as conflicts.
    #[must_use]
    pub fn is_conflict(&self) -> bool {
        matches!(
            self,
            Self::AlreadyExists { .. }
                | Self::VersionConflict { .. }
                | Self::OwnerConflict { .. }
                | Self::PhaseConflict { .. }
                | Self::PendingFinalizers { .. }
        )
    }

    /// True for `NotFound`.
    #[must_use]
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::NotFound { .. })
    }

    /// True for `PhaseConflict`.
    #[must_use]
    pub fn is_phase_conflict(&self) -> bool {
        matches!(self, Self::PhaseConflict { .. })
    }
}
