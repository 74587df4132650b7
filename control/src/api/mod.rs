//! The resource API: a tonic service on a local unix socket (Get, List, Watch,
//! definitions, dependency graph) and its client.

pub mod client;
pub mod gate;
pub mod pki;
pub mod remote;
pub mod remote_server;
pub mod server;

/// Generated protobuf types and service stubs.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto {
    tonic::include_proto!("wirespan.resource.v1");
}

use crate::runtime::Definition;

/// The API methods that change the node (every other method only reads): what an
/// authorization layer or a fan-out to many nodes must treat as writes.
pub const MUTATING_METHODS: &[&str] = &["ApplyConfig", "ConfirmConfig"];

/// The API methods that only read, but return secrets (the config in force holds the
/// cluster secret, the node's private key and the API CA key): a reader may not call
/// them either, or a reader certificate would be a way to an admin one.
pub const SECRET_METHODS: &[&str] = &["GetConfig"];

/// The service's path prefix of every method.
const SERVICE_PATH: &str = "/wirespan.resource.v1.ResourceService/";

/// Whether the gRPC request path (`/wirespan.resource.v1.ResourceService/ApplyConfig`)
/// names a method of [`MUTATING_METHODS`].
#[must_use]
pub fn is_mutating(path: &str) -> bool {
    path.strip_prefix(SERVICE_PATH)
        .is_some_and(|m| MUTATING_METHODS.contains(&m))
}

/// Whether the method at `path` needs an admin: it changes the node
/// ([`MUTATING_METHODS`]) or returns secrets ([`SECRET_METHODS`]).
#[must_use]
pub fn needs_admin(path: &str) -> bool {
    is_mutating(path)
        || path
            .strip_prefix(SERVICE_PATH)
            .is_some_and(|m| SECRET_METHODS.contains(&m))
}

/// Default path of the API socket.
pub const DEFAULT_SOCKET: &str = "/run/wirespan/node.sock";

/// Largest API message, both ways: a config of [`crate::config::MAX_CONFIG_BYTES`]
/// plus room for the request's other fields, so the config's own cap (with its clear
/// error) is the one that applies.
pub const MAX_MESSAGE_BYTES: usize = crate::config::MAX_CONFIG_BYTES + 64 * 1024;

impl From<&Definition> for proto::Definition {
    fn from(d: &Definition) -> Self {
        Self {
            r#type: d.r#type.clone(),
            display_type: d.display_type.clone(),
            default_namespace: d.default_namespace.clone(),
            aliases: d.aliases.clone(),
            print_columns: d
                .print_columns
                .iter()
                .map(|c| proto::PrintColumn {
                    name: c.name.clone(),
                    json_path: c.json_path.clone(),
                })
                .collect(),
            sensitive: d.sensitive,
        }
    }
}

/// Levenshtein distance, for "did you mean" lists.
#[must_use]
pub fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != *cb))
                .min(prev[j + 1] + 1)
                .min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Resolving a user-given type name failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown resource type {name:?}; closest known names: {}", closest.join(", "))]
pub struct UnknownType {
    /// What the user asked for.
    pub name: String,
    /// The nearest type names and aliases.
    pub closest: Vec<String>,
}

/// Finds the definition for a type name, display name or alias (case-insensitive).
///
/// # Errors
/// [`UnknownType`] with the closest known names.
pub fn resolve<'a>(
    definitions: &'a [Definition],
    name: &str,
) -> Result<&'a Definition, UnknownType> {
    if let Some(d) = definitions.iter().find(|d| d.matches(name)) {
        return Ok(d);
    }
    let lower = name.to_lowercase();
    let mut candidates: Vec<(usize, String)> = definitions
        .iter()
        .flat_map(|d| {
            std::iter::once(d.display_type.clone())
                .chain(d.aliases.iter().cloned())
                .chain(std::iter::once(d.r#type.clone()))
        })
        .map(|c| {
            let c = c.to_lowercase();
            let dist = edit_distance(&lower, &c);
            // Prefix matches are as good as a close typo.
            let dist = if c.starts_with(&lower) && !lower.is_empty() {
                dist.min(1)
            } else {
                dist
            };
            (dist, c)
        })
        .collect();
    candidates.sort();
    candidates.dedup_by(|a, b| a.1 == b.1);
    Err(UnknownType {
        name: name.to_owned(),
        closest: candidates.into_iter().take(3).map(|(_, c)| c).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_aliases_case_insensitively_and_suggest() {
        let defs = crate::resources::definitions();
        assert_eq!(
            resolve(&defs, "NodeIdentity").unwrap().r#type,
            "NodeIdentities.cluster.wirespan.dev"
        );
        assert_eq!(
            resolve(&defs, "RDS").unwrap().display_type,
            "ResourceDefinition"
        );
        let e = resolve(&defs, "nodeidentty").unwrap_err();
        assert_eq!(e.closest[0], "nodeidentity", "{e}");
        assert!(e.to_string().starts_with(
            "unknown resource type \"nodeidentty\"; closest known names: nodeidentity"
        ));
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }

    #[test]
    fn the_writes_are_apply_and_confirm() {
        assert!(is_mutating(
            "/wirespan.resource.v1.ResourceService/ApplyConfig"
        ));
        assert!(is_mutating(
            "/wirespan.resource.v1.ResourceService/ConfirmConfig"
        ));
        assert!(!is_mutating(
            "/wirespan.resource.v1.ResourceService/GetConfig"
        ));
        assert!(!is_mutating("/wirespan.resource.v1.ResourceService/List"));
        assert!(!is_mutating("/other.Service/ApplyConfig"));
        assert!(needs_admin(
            "/wirespan.resource.v1.ResourceService/GetConfig"
        ));
        assert!(needs_admin(
            "/wirespan.resource.v1.ResourceService/ConfirmConfig"
        ));
        assert!(!needs_admin("/wirespan.resource.v1.ResourceService/List"));
    }
}
