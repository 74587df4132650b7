//! The active machine config as a resource (`config/MachineConfig active`), and what
//! became of the latest config offered to the node (`config/ConfigStatus current`).

use serde::{Deserialize, Serialize};

use std::sync::Arc;

use crate::{
    config::ConfigDocuments,
    runtime::{
        ControllerError, ControllerRuntime, Definition, Input, InputKind, Resource, ResourceKind,
    },
};

/// The config in force. Written by the config loader (file, reload, API apply) only
/// after the whole file validated; derived config controllers read it.
#[derive(Debug)]
pub struct MachineConfig;

/// Id of the one config resource.
pub const ACTIVE: &str = "active";

impl ResourceKind for MachineConfig {
    const TYPE: &'static str = "MachineConfigs.config.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = "config";
    type Spec = MachineConfigSpec;
    fn definition() -> Definition {
        // Sensitive: documents may carry the cluster secret (redacted when serialized,
        // but the type says what it holds).
        Definition::new(Self::TYPE, "MachineConfig", Self::DEFAULT_NAMESPACE)
            .column("Documents", ".documentCount")
            .column("Source", ".source")
            .sensitive()
    }
}

/// Spec of [`MachineConfig`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MachineConfigSpec {
    /// Where it came from (file path or `api`).
    pub source: String,
    /// Number of documents.
    pub document_count: usize,
    /// The documents.
    pub config: ConfigDocuments,
}

impl MachineConfig {
    /// The input every config-derived controller declares: the active config, weak.
    #[must_use]
    pub fn input() -> Input {
        Input::id_of::<Self>(Self::DEFAULT_NAMESPACE, ACTIVE, InputKind::Weak)
    }

    /// The active config, if one was loaded.
    ///
    /// # Errors
    /// Access errors (the caller did not declare [`MachineConfig::input`]).
    pub fn active(rt: &ControllerRuntime) -> Result<Option<Arc<Resource<Self>>>, ControllerError> {
        rt.get_opt::<Self>(Self::DEFAULT_NAMESPACE, ACTIVE)
    }
}

/// What the node did with the configs offered to it (file, reload, API apply): the one
/// in force and the latest rejection. Written by the config loader.
#[derive(Debug)]
pub struct ConfigStatus;

/// Id of the one config status.
pub const CURRENT: &str = "current";

impl ResourceKind for ConfigStatus {
    const TYPE: &'static str = "ConfigStatuses.config.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = "config";
    type Spec = ConfigStatusSpec;
    fn definition() -> Definition {
        // Derived aliases: configstatus, configstatuses, cs.
        Definition::new(Self::TYPE, "ConfigStatus", Self::DEFAULT_NAMESPACE)
            .column("Accepted", ".acceptedVersion")
            .column("Source", ".source")
            .column("LastAttempt", ".lastAttempt")
            .column("TrialDeadline", ".trialDeadline")
            .column("LastErrorTime", ".lastErrorTime")
            .column("LastError", ".lastError")
    }
}

/// Outcome of the latest config offered to the node.
pub mod attempt {
    /// The latest config offered is the one in force.
    pub const ACCEPTED: &str = "accepted";
    /// The latest config offered was rejected; an older one stays in force.
    pub const REJECTED: &str = "rejected";
}

/// Spec of [`ConfigStatus`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConfigStatusSpec {
    /// Where the config in force came from: the config file, `api`, or the last good
    /// copy in the state dir.
    pub source: String,
    /// Version of the config in force: the first 16 hex digits of the SHA-256 of its
    /// text (`sha256sum FILE | cut -c1-16`); stable across restarts.
    pub accepted_version: String,
    /// When it was accepted (RFC 3339).
    pub accepted_time: String,
    /// Number of documents of the config in force.
    pub documents: usize,
    /// `accepted` or `rejected`: what became of the latest config offered.
    pub last_attempt: String,
    /// Every problem of the latest rejected config (kept after a later success, with
    /// its time, so it can still be read).
    pub last_error: String,
    /// Where the rejected config came from.
    pub last_error_source: String,
    /// When it was rejected (RFC 3339).
    pub last_error_time: String,
    /// Version of the config on trial (`wirespan apply --mode try`), which is the one
    /// in force until it is confirmed or rolled back; empty when there is no trial.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trial_version: String,
    /// When the trial rolls back unless confirmed (RFC 3339).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trial_deadline: String,
    /// The version a rollback of the trial goes back to.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trial_previous_version: String,
    /// The trial's `--rollback-unless-reachable` endpoint, if any.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trial_reachability: String,
    /// What became of the latest trial: `confirmed …`, `rolled back to … : why`,
    /// `ended by a plain apply …`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub last_trial: String,
    /// When the latest trial ended (RFC 3339).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub last_trial_time: String,
}
