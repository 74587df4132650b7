//! Test helpers for controller tests (`docs/runtime.md` §8): assert-eventually on the store, the
//! runtime harness (re-exported from [`crate::runtime`], where it lives), and small
//! resource kinds.
//!
//! The assertions watch the resource(s) and re-run the check on every event until it
//! passes or the timeout expires; on timeout they panic with the last failure.

use std::{sync::Arc, time::Duration};

use serde::{Deserialize, Serialize};

pub use crate::runtime::Harness;
use crate::runtime::{
    Definition, Event, Kind, Pointer, Resource, ResourceKind, Store, WatchOptions,
};

/// Default per-assertion timeout.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// Waits until `ns/id` of type `K` exists and `check` passes; returns it.
///
/// # Panics
/// On timeout, with the last failure.
pub async fn assert_resource<K: ResourceKind>(
    store: &Store,
    namespace: &str,
    id: &str,
    mut check: impl FnMut(&Resource<K>) -> Result<(), String>,
) -> Arc<Resource<K>> {
    let ptr = Pointer::new(namespace, K::TYPE, id);
    let mut w = store.watch(&ptr);
    let mut last = String::from("no event yet");
    let res = tokio::time::timeout(TIMEOUT, async {
        loop {
            match w.recv().await {
                Some(Event::Errored(e)) => panic!("watch of {ptr} failed: {e}"),
                None => panic!("watch of {ptr} ended"),
                Some(Event::Destroyed(_)) => last = format!("{ptr} does not exist"),
                Some(ev) => {
                    if let Some(r) = ev.resource().and_then(crate::runtime::downcast::<K>) {
                        match check(&r) {
                            Ok(()) => return r,
                            Err(e) => last = e,
                        }
                    }
                }
            }
        }
    })
    .await;
    match res {
        Ok(r) => r,
        Err(_) => panic!("assert_resource {ptr} timed out after {TIMEOUT:?}: {last}"),
    }
}

/// Waits until the resource does not exist (passes on the initial tombstone).
///
/// # Panics
/// On timeout.
pub async fn assert_no_resource(store: &Store, ptr: &Pointer) {
    let mut w = store.watch(ptr);
    let res = tokio::time::timeout(TIMEOUT, async {
        loop {
            match w.recv().await {
                Some(Event::Destroyed(_)) => return,
                Some(Event::Errored(e)) => panic!("watch of {ptr} failed: {e}"),
                None => panic!("watch of {ptr} ended"),
                Some(_) => {}
            }
        }
    })
    .await;
    assert!(
        res.is_ok(),
        "assert_no_resource {ptr}: still exists after {TIMEOUT:?}"
    );
}

/// Waits until the kind holds exactly `n` resources (counted via a bootstrap watch).
///
/// # Panics
/// On timeout, with the last count.
pub async fn assert_length(store: &Store, kind: &Kind, n: usize) {
    let mut w = store.watch_kind(kind, WatchOptions::bootstrapped());
    let mut ids = std::collections::BTreeSet::new();
    let mut bootstrapped = false;
    let res = tokio::time::timeout(TIMEOUT, async {
        loop {
            match w.recv().await {
                Some(Event::Created(r)) => {
                    ids.insert(r.metadata().id.clone());
                }
                Some(Event::Destroyed(r)) => {
                    ids.remove(&r.metadata().id);
                }
                Some(Event::Bootstrapped) => bootstrapped = true,
                Some(Event::Updated { .. }) => {}
                Some(Event::Errored(e)) => panic!("watch of {kind} failed: {e}"),
                None => panic!("watch of {kind} ended"),
            }
            if bootstrapped && ids.len() == n {
                return;
            }
        }
    })
    .await;
    assert!(
        res.is_ok(),
        "assert_length {kind}: want {n}, have {}",
        ids.len()
    );
}

/// Test kind: an integer spec.
#[derive(Debug)]
pub struct IntResource;

impl ResourceKind for IntResource {
    const TYPE: &'static str = "IntResources.test.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = "default";
    type Spec = IntSpec;
    fn definition() -> Definition {
        Definition::new(Self::TYPE, "IntResource", Self::DEFAULT_NAMESPACE)
            .column("Value", ".value")
    }
}

/// Spec of [`IntResource`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IntSpec {
    /// The value.
    pub value: i64,
}

/// Test kind: a string spec.
#[derive(Debug)]
pub struct StrResource;

impl ResourceKind for StrResource {
    const TYPE: &'static str = "StrResources.test.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = "default";
    type Spec = StrSpec;
    fn definition() -> Definition {
        Definition::new(Self::TYPE, "StrResource", Self::DEFAULT_NAMESPACE)
            .column("Value", ".value")
    }
}

/// Spec of [`StrResource`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StrSpec {
    /// The value.
    pub value: String,
}

/// Shorthand for an [`IntResource`].
#[must_use]
pub fn int(namespace: &str, id: &str, value: i64) -> Resource<IntResource> {
    Resource::new(namespace, id, IntSpec { value })
}
