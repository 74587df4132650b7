//! The active machine config as a resource (`config/MachineConfig active`).

use serde::{Deserialize, Serialize};

use std::sync::Arc;

use crate::{
    config::MachineConfig as Documents,
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
    pub config: Documents,
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
