//! Typed resources and their type-erased form held by the store.

use std::{any::Any, fmt, sync::Arc};

use serde::{de::DeserializeOwned, Deserialize, Serialize};

use super::metadata::{Metadata, Pointer};

/// One column of `wirespan get` tables: a header and a dotted path into the spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrintColumn {
    /// Column header.
    pub name: String,
    /// Dotted path into the JSON form of the spec, e.g. `.nodeId` or `.peer.endpoint`.
    #[serde(rename = "jsonPath")]
    pub json_path: String,
}

/// The static definition of a resource type (`docs/runtime.md` §1.4).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Definition {
    /// Full type name, e.g. `ResourceDefinitions.meta.wirespan.dev`.
    pub r#type: String,
    /// Singular display name, e.g. `ResourceDefinition`.
    pub display_type: String,
    /// Namespace used when the caller does not give one.
    pub default_namespace: String,
    /// Lowercase aliases (derived ones plus extras).
    pub aliases: Vec<String>,
    /// Extra columns for tables.
    pub print_columns: Vec<PrintColumn>,
    /// Sensitive types never have their spec sent unless explicitly asked for.
    pub sensitive: bool,
}

impl Definition {
    /// A definition with the aliases derived from the type name (`docs/runtime.md` §1.4): lowercase
    /// singular and plural, and the lowercased capitals with an `s` variant.
    #[must_use]
    pub fn new(r#type: &str, display_type: &str, default_namespace: &str) -> Self {
        let plural = r#type.split('.').next().unwrap_or(r#type);
        let capitals: String = plural
            .chars()
            .filter(char::is_ascii_uppercase)
            .collect::<String>()
            .to_lowercase();
        let mut aliases = Vec::new();
        for a in [
            display_type.to_lowercase(),
            plural.to_lowercase(),
            capitals.clone(),
            format!("{capitals}s"),
        ] {
            if !a.is_empty() && !aliases.contains(&a) {
                aliases.push(a);
            }
        }
        Self {
            r#type: r#type.to_owned(),
            display_type: display_type.to_owned(),
            default_namespace: default_namespace.to_owned(),
            aliases,
            print_columns: Vec::new(),
            sensitive: false,
        }
    }

    /// Adds an extra alias.
    #[must_use]
    pub fn alias(mut self, alias: &str) -> Self {
        let a = alias.to_lowercase();
        if !self.aliases.contains(&a) {
            self.aliases.push(a);
        }
        self
    }

    /// Adds a print column.
    #[must_use]
    pub fn column(mut self, name: &str, json_path: &str) -> Self {
        self.print_columns.push(PrintColumn {
            name: name.to_owned(),
            json_path: json_path.to_owned(),
        });
        self
    }

    /// Marks the type sensitive.
    #[must_use]
    pub fn sensitive(mut self) -> Self {
        self.sensitive = true;
        self
    }

    /// True when `name` (case-insensitive) is the type, its display name or an alias.
    #[must_use]
    pub fn matches(&self, name: &str) -> bool {
        let n = name.to_lowercase();
        n == self.r#type.to_lowercase()
            || n == self.display_type.to_lowercase()
            || self.aliases.contains(&n)
    }
}

/// One resource type. Implemented by a zero-sized marker type per resource type.
pub trait ResourceKind: Send + Sync + 'static {
    /// Full type name.
    const TYPE: &'static str;
    /// Default namespace.
    const DEFAULT_NAMESPACE: &'static str;
    /// The typed spec; `PartialEq` drives the Modify no-op rule.
    type Spec: Clone + PartialEq + fmt::Debug + Serialize + DeserializeOwned + Send + Sync + 'static;
    /// The type's definition (aliases, print columns, sensitivity).
    fn definition() -> Definition;
}

/// A typed resource: metadata plus spec.
pub struct Resource<K: ResourceKind> {
    /// Metadata.
    pub metadata: Metadata,
    /// Spec.
    pub spec: K::Spec,
}

impl<K: ResourceKind> Clone for Resource<K> {
    fn clone(&self) -> Self {
        Self {
            metadata: self.metadata.clone(),
            spec: self.spec.clone(),
        }
    }
}

impl<K: ResourceKind> PartialEq for Resource<K> {
    fn eq(&self, other: &Self) -> bool {
        self.metadata == other.metadata && self.spec == other.spec
    }
}

impl<K: ResourceKind> fmt::Debug for Resource<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Specs of sensitive types may carry secrets; their Debug impls must redact, but
        // do not rely on it here.
        if K::definition().sensitive {
            f.debug_struct("Resource")
                .field("metadata", &self.metadata)
                .field("spec", &"<sensitive>")
                .finish()
        } else {
            f.debug_struct("Resource")
                .field("metadata", &self.metadata)
                .field("spec", &self.spec)
                .finish()
        }
    }
}

impl<K: ResourceKind> Resource<K> {
    /// A new resource in namespace `namespace` with id `id`.
    pub fn new(namespace: impl Into<String>, id: impl Into<String>, spec: K::Spec) -> Self {
        Self {
            metadata: Metadata::new(namespace, K::TYPE, id),
            spec,
        }
    }

    /// The resource's pointer.
    #[must_use]
    pub fn pointer(&self) -> Pointer {
        self.metadata.pointer()
    }
}

/// Errors of type-erased spec serialization.
#[derive(Debug, thiserror::Error)]
pub enum SpecEncodeError {
    /// JSON encoding failed.
    #[error("encoding spec of {pointer} as JSON: {source}")]
    Json {
        /// The resource.
        pointer: Pointer,
        /// Cause.
        #[source]
        source: serde_json::Error,
    },
    /// YAML encoding failed.
    #[error("encoding spec of {pointer} as YAML: {source}")]
    Yaml {
        /// The resource.
        pointer: Pointer,
        /// Cause.
        #[source]
        source: serde_yaml_ng::Error,
    },
}

/// A resource of any type, as held by the store.
pub trait AnyResource: Send + Sync + 'static {
    /// Metadata.
    fn metadata(&self) -> &Metadata;
    /// True when `other` has the same type and equal metadata and spec.
    fn dyn_eq(&self, other: &dyn AnyResource) -> bool;
    /// A copy with different metadata and the same spec.
    fn with_metadata(&self, metadata: Metadata) -> Arc<dyn AnyResource>;
    /// The spec as a JSON value.
    ///
    /// # Errors
    /// When the spec's `Serialize` fails.
    fn spec_json(&self) -> Result<serde_json::Value, SpecEncodeError>;
    /// The spec as YAML text.
    ///
    /// # Errors
    /// When the spec's `Serialize` fails.
    fn spec_yaml(&self) -> Result<String, SpecEncodeError>;
    /// Upcast for downcasting to `Resource<K>`.
    fn as_any(&self) -> &dyn Any;
    /// Upcast of the `Arc` for downcasting to `Arc<Resource<K>>`.
    fn into_any_arc(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
}

impl<K: ResourceKind> AnyResource for Resource<K> {
    fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    fn dyn_eq(&self, other: &dyn AnyResource) -> bool {
        other
            .as_any()
            .downcast_ref::<Self>()
            .is_some_and(|o| o == self)
    }

    fn with_metadata(&self, metadata: Metadata) -> Arc<dyn AnyResource> {
        Arc::new(Self {
            metadata,
            spec: self.spec.clone(),
        })
    }

    fn spec_json(&self) -> Result<serde_json::Value, SpecEncodeError> {
        serde_json::to_value(&self.spec).map_err(|source| SpecEncodeError::Json {
            pointer: self.pointer(),
            source,
        })
    }

    fn spec_yaml(&self) -> Result<String, SpecEncodeError> {
        serde_yaml_ng::to_string(&self.spec).map_err(|source| SpecEncodeError::Yaml {
            pointer: self.pointer(),
            source,
        })
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn into_any_arc(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }
}

impl fmt::Debug for dyn AnyResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.metadata())
    }
}

/// Downcasts a stored resource to its typed form; `None` when the type differs.
#[must_use]
pub fn downcast<K: ResourceKind>(r: &Arc<dyn AnyResource>) -> Option<Arc<Resource<K>>> {
    Arc::clone(r).into_any_arc().downcast::<Resource<K>>().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_aliases_follow_the_upstream_rule() {
        let d = Definition::new(
            "ResourceDefinitions.meta.wirespan.dev",
            "ResourceDefinition",
            "meta",
        );
        assert_eq!(
            d.aliases,
            ["resourcedefinition", "resourcedefinitions", "rd", "rds"]
        );
        assert!(d.matches("RD"));
        assert!(d.matches("resourcedefinitions.meta.wirespan.dev"));
        assert!(!d.matches("r"));
    }
}
