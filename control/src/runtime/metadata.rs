//! Resource identity and metadata (`docs/runtime.md` §1.1–§1.3).

use std::{collections::BTreeMap, fmt, time::SystemTime};

/// Lifecycle phase of a resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Phase {
    /// Normal state; new resources start here.
    #[default]
    Running,
    /// The owner started tearing the resource down; it waits for its finalizers.
    TearingDown,
}

impl Phase {
    /// The upstream spelling (`running`, `tearingDown`).
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::TearingDown => "tearingDown",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// (namespace, type): the unit of List and WatchKind.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Kind {
    /// Namespace, e.g. `network`.
    pub namespace: String,
    /// Resource type, e.g. `AddressSpecs.net.wirespan.dev`.
    pub r#type: String,
}

impl Kind {
    /// Builds a kind.
    pub fn new(namespace: impl Into<String>, r#type: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            r#type: r#type.into(),
        }
    }

    /// A pointer to one resource of this kind.
    #[must_use]
    pub fn pointer(&self, id: impl Into<String>) -> Pointer {
        Pointer {
            namespace: self.namespace.clone(),
            r#type: self.r#type.clone(),
            id: id.into(),
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({})", self.r#type, self.namespace)
    }
}

/// (namespace, type, id): the unit of Get, Watch, Destroy and Teardown.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Pointer {
    /// Namespace.
    pub namespace: String,
    /// Resource type.
    pub r#type: String,
    /// Resource id.
    pub id: String,
}

impl Pointer {
    /// Builds a pointer.
    pub fn new(
        namespace: impl Into<String>,
        r#type: impl Into<String>,
        id: impl Into<String>,
    ) -> Self {
        Self {
            namespace: namespace.into(),
            r#type: r#type.into(),
            id: id.into(),
        }
    }

    /// The kind this pointer belongs to.
    #[must_use]
    pub fn kind(&self) -> Kind {
        Kind::new(self.namespace.clone(), self.r#type.clone())
    }
}

impl fmt::Display for Pointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({}/{})", self.r#type, self.namespace, self.id)
    }
}

/// An ordered set of finalizer names; equality ignores order (`docs/runtime.md` §1.2).
#[derive(Debug, Clone, Default, Eq)]
pub struct Finalizers(Vec<String>);

impl Finalizers {
    /// Adds `name`; returns false when it was already present (no-op).
    pub fn add(&mut self, name: &str) -> bool {
        if self.0.iter().any(|f| f == name) {
            return false;
        }
        self.0.push(name.to_owned());
        true
    }

    /// Removes `name`; returns false when it was absent (no-op).
    pub fn remove(&mut self, name: &str) -> bool {
        let before = self.0.len();
        self.0.retain(|f| f != name);
        before != self.0.len()
    }

    /// True when no finalizer is set.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// True when `name` is present.
    #[must_use]
    pub fn contains(&self, name: &str) -> bool {
        self.0.iter().any(|f| f == name)
    }

    /// The finalizers in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(String::as_str)
    }

    /// The finalizers as a vector, in insertion order.
    #[must_use]
    pub fn to_vec(&self) -> Vec<String> {
        self.0.clone()
    }
}

impl PartialEq for Finalizers {
    fn eq(&self, other: &Self) -> bool {
        self.0.len() == other.0.len() && self.0.iter().all(|f| other.contains(f))
    }
}

impl<S: Into<String>> FromIterator<S> for Finalizers {
    fn from_iter<I: IntoIterator<Item = S>>(iter: I) -> Self {
        let mut f = Self::default();
        for name in iter {
            f.add(&name.into());
        }
        f
    }
}

/// Resource metadata (`docs/runtime.md` §1.2).
#[derive(Debug, Clone)]
pub struct Metadata {
    /// Namespace (immutable).
    pub namespace: String,
    /// Type (immutable).
    pub r#type: String,
    /// Id (immutable).
    pub id: String,
    /// Store-assigned version, 0 = undefined.
    pub version: u64,
    /// Managing controller, `""` = unowned.
    pub owner: String,
    /// Lifecycle phase.
    pub phase: Phase,
    /// Finalizers (an ordered set).
    pub finalizers: Finalizers,
    /// Queryable labels.
    pub labels: BTreeMap<String, String>,
    /// Non-queryable annotations.
    pub annotations: BTreeMap<String, String>,
    /// Set by the store on create.
    pub created: SystemTime,
    /// Set by the store on every write.
    pub updated: SystemTime,
}

impl Metadata {
    /// Fresh metadata for a new resource (version 0, running, unowned).
    pub fn new(
        namespace: impl Into<String>,
        r#type: impl Into<String>,
        id: impl Into<String>,
    ) -> Self {
        Self {
            namespace: namespace.into(),
            r#type: r#type.into(),
            id: id.into(),
            version: 0,
            owner: String::new(),
            phase: Phase::Running,
            finalizers: Finalizers::default(),
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            created: SystemTime::UNIX_EPOCH,
            updated: SystemTime::UNIX_EPOCH,
        }
    }

    /// The resource's pointer.
    #[must_use]
    pub fn pointer(&self) -> Pointer {
        Pointer::new(self.namespace.clone(), self.r#type.clone(), self.id.clone())
    }

    /// The resource's kind.
    #[must_use]
    pub fn kind(&self) -> Kind {
        Kind::new(self.namespace.clone(), self.r#type.clone())
    }
}

impl PartialEq for Metadata {
    /// Ignores `created`/`updated` (`docs/runtime.md` §1.2).
    fn eq(&self, o: &Self) -> bool {
        self.namespace == o.namespace
            && self.r#type == o.r#type
            && self.id == o.id
            && self.version == o.version
            && self.owner == o.owner
            && self.phase == o.phase
            && self.labels == o.labels
            && self.annotations == o.annotations
            && self.finalizers == o.finalizers
    }
}

impl fmt::Display for Metadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}({}/{}@{})",
            self.r#type, self.namespace, self.id, self.version
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finalizers_compare_as_a_set_and_add_remove_are_idempotent() {
        let mut a: Finalizers = ["x", "y"].into_iter().collect();
        let b: Finalizers = ["y", "x"].into_iter().collect();
        assert_eq!(a, b);
        assert!(!a.add("x"));
        assert!(a.remove("x"));
        assert!(!a.remove("x"));
        assert_ne!(a, b);
    }

    #[test]
    fn metadata_equality_ignores_timestamps() {
        let a = Metadata::new("ns", "T", "id");
        let mut b = a.clone();
        b.updated = SystemTime::now();
        assert_eq!(a, b);
        b.labels.insert("k".into(), "v".into());
        assert_ne!(a, b);
        assert_eq!(a.to_string(), "T(ns/id@0)");
    }
}
