//! What a controller declares: its inputs (a kind or one id of it, and how changes
//! wake it, `docs/runtime.md` §3.2) and its outputs (exclusive or shared, `docs/runtime.md` §3.3).

use crate::runtime::resource::ResourceKind;

/// How an input wakes its controller (`docs/runtime.md` §3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InputKind {
    /// Any change; read access.
    Weak,
    /// Any change; read access and finalizers.
    Strong,
    /// Only a tearing-down resource without finalizers.
    DestroyReady,
}

/// A declared input: a kind, optionally one id of it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Input {
    /// Namespace.
    pub namespace: String,
    /// Type.
    pub r#type: String,
    /// One id only (Get of that id only).
    pub id: Option<String>,
    /// Wake-up kind.
    pub kind: InputKind,
}

impl Input {
    /// A kind-wide input of type `K`.
    #[must_use]
    pub fn of<K: ResourceKind>(namespace: &str, kind: InputKind) -> Self {
        Self {
            namespace: namespace.to_owned(),
            r#type: K::TYPE.to_owned(),
            id: None,
            kind,
        }
    }

    /// An id-specific input of type `K`.
    #[must_use]
    pub fn id_of<K: ResourceKind>(namespace: &str, id: &str, kind: InputKind) -> Self {
        Self {
            id: Some(id.to_owned()),
            ..Self::of::<K>(namespace, kind)
        }
    }

    pub(super) fn covers(&self, namespace: &str, r#type: &str, id: Option<&str>) -> bool {
        self.namespace == namespace
            && self.r#type == r#type
            && match (&self.id, id) {
                (None, _) => true,
                (Some(a), Some(b)) => a == b,
                (Some(_), None) => false,
            }
    }
}

/// Output mode (`docs/runtime.md` §3.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutputKind {
    /// The only controller writing this type.
    Exclusive,
    /// One of several controllers writing this type, each its own resources.
    Shared,
}

/// A declared output: a type, in any namespace.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Output {
    /// Type.
    pub r#type: String,
    /// Mode.
    pub kind: OutputKind,
}

impl Output {
    /// An exclusive output of type `K`.
    #[must_use]
    pub fn exclusive<K: ResourceKind>() -> Self {
        Self {
            r#type: K::TYPE.to_owned(),
            kind: OutputKind::Exclusive,
        }
    }

    /// A shared output of type `K`.
    #[must_use]
    pub fn shared<K: ResourceKind>() -> Self {
        Self {
            r#type: K::TYPE.to_owned(),
            kind: OutputKind::Shared,
        }
    }
}
