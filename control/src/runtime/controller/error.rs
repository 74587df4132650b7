//! Errors of controllers and the runtime: access violations (`docs/runtime.md` §3.3), a
//! controller's failure, registration conflicts, and what stops the runtime.

use crate::runtime::{metadata::Pointer, store::StateError};

/// Access violations (`docs/runtime.md` §3.3).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    /// Write to a type that is not a declared output.
    #[error("resource {type} is not an output for controller {controller:?}")]
    NotOutput {
        /// The type.
        r#type: String,
        /// The controller.
        controller: String,
    },
    /// Read of something that is neither input nor output.
    #[error(
        "attempt to query resource {target}, not input or output for controller {controller:?}"
    )]
    NotInput {
        /// What was queried (`Type(ns/id)` or `Type(ns)`).
        target: String,
        /// The controller.
        controller: String,
    },
    /// Finalizer change on something that is not a strong input.
    #[error("resource {pointer} is not a strong input for controller {controller:?}, cannot change its finalizers")]
    NotStrongInput {
        /// The resource.
        pointer: Pointer,
        /// The controller.
        controller: String,
    },
    /// `start_tracking_outputs` twice.
    #[error("controller {controller:?} is already tracking outputs")]
    AlreadyTracking {
        /// The controller.
        controller: String,
    },
    /// `cleanup_outputs` without `start_tracking_outputs`.
    #[error("controller {controller:?} is not tracking outputs")]
    NotTracking {
        /// The controller.
        controller: String,
    },
}

/// Why a controller's `start` or round failed.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// A store error.
    #[error(transparent)]
    State(#[from] StateError),
    /// An access violation.
    #[error(transparent)]
    Access(#[from] AccessError),
    /// The controller panicked.
    #[error("controller panicked: {0}")]
    Panic(String),
    /// Anything else.
    #[error(transparent)]
    Other(Box<dyn std::error::Error + Send + Sync>),
}

impl ControllerError {
    /// Wraps any error.
    pub fn other(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Other(e.into())
    }
}

/// Registration errors (`docs/runtime.md` §3.3).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistrationError {
    /// Another controller has the type as exclusive output, or this one wants exclusive
    /// where others share.
    #[error("resource {type:?} is already managed in exclusive mode by {other:?}")]
    ExclusiveConflict {
        /// The type.
        r#type: String,
        /// The other controller.
        other: String,
    },
    /// Exclusive wanted on a type already shared.
    #[error("resource {type:?} is already managed in shared mode by {other:?}")]
    SharedConflict {
        /// The type.
        r#type: String,
        /// A controller sharing it.
        other: String,
    },
    /// The same output declared twice by one controller.
    #[error("duplicate output {type:?} for controller {controller:?}")]
    DuplicateOutput {
        /// The type.
        r#type: String,
        /// The controller.
        controller: String,
    },
    /// Two controllers with one name.
    #[error("controller {0:?} is already registered")]
    DuplicateName(String),
}

/// Errors that stop the runtime.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// An input watch overran; the runtime cannot guarantee wake-ups any more.
    #[error("controller runtime watch error: {0}")]
    Watch(StateError),
}
