//! `meta` resources: resource definitions and namespaces (`docs/runtime.md` §1.4).

use serde::{Deserialize, Serialize};

use super::NAMESPACES;
use crate::runtime::{Definition, Resource, ResourceKind, StateError, Store};

/// Namespace of definitions and namespaces.
pub const META: &str = "meta";
/// Owner of the meta resources; users cannot change them.
pub const OWNER: &str = "wirespan";

/// Resource type definitions, one resource per type, id = the type name.
#[derive(Debug)]
pub struct ResourceDefinition;

impl ResourceKind for ResourceDefinition {
    const TYPE: &'static str = "ResourceDefinitions.meta.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = META;
    type Spec = DefinitionSpec;
    fn definition() -> Definition {
        Definition::new(Self::TYPE, "ResourceDefinition", META)
            .column("Aliases", ".aliases")
            .column("Sensitive", ".sensitive")
    }
}

/// Spec of a [`ResourceDefinition`]: the definition itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct DefinitionSpec(pub Definition);

impl Default for DefinitionSpec {
    fn default() -> Self {
        Self(Definition::new("", "", ""))
    }
}

/// Namespaces, one resource per namespace.
#[derive(Debug)]
pub struct Namespace;

impl ResourceKind for Namespace {
    const TYPE: &'static str = "Namespaces.meta.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = META;
    type Spec = NamespaceSpec;
    fn definition() -> Definition {
        Definition::new(Self::TYPE, "Namespace", META)
            .alias("ns")
            .column("Description", ".description")
    }
}

/// Spec of a [`Namespace`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceSpec {
    /// What lives there.
    pub description: String,
}

/// Writes the definitions and the namespaces into `meta` (idempotent).
///
/// # Errors
/// Store errors (e.g. someone else owns a definition resource).
pub fn register(store: &Store, definitions: &[Definition]) -> Result<(), StateError> {
    for d in definitions {
        store.modify::<ResourceDefinition>(META, &d.r#type, OWNER, |r| {
            r.spec = DefinitionSpec(d.clone());
        })?;
    }
    for (ns, desc) in NAMESPACES {
        store.modify::<Namespace>(META, ns, OWNER, |r| r.spec.description = (*desc).to_owned())?;
    }
    Ok(())
}

/// All registered definitions.
#[must_use]
pub fn list(store: &Store) -> Vec<Definition> {
    store
        .list::<ResourceDefinition>(META, &crate::runtime::Filter::all())
        .iter()
        .map(|r| r.spec.0.clone())
        .collect()
}

/// Builds a definition resource (for tests and tools).
#[must_use]
pub fn definition_resource(d: Definition) -> Resource<ResourceDefinition> {
    Resource::new(META, d.r#type.clone(), DefinitionSpec(d))
}
