//! Cluster discovery on the node (issue 8; `docs/discovery-protocol.md` §8,
//! `docs/kubespan.md` §4–§5.1).
//!
//! ```text
//! config/MachineConfig ──► ClusterIdentityController ──► cluster/ClusterIdentity cluster
//!
//! NodeIdentity, NodeAddress, HostnameStatus,            cluster-raw/Affiliate <node id>
//! KubeSpanIdentity, KubeSpanConfig, public IP ──► LocalAffiliateController ──┘
//!
//! ClusterIdentity, DiscoveryServiceConfig docs,      ┌► cluster-raw/Affiliate <service>/<node id>
//! local raw affiliate, KubeSpanEndpoint ──► DiscoveryController (one client per service)
//!                                                    └► cluster/DiscoveryServiceStatus <service>
//!
//! cluster-raw/Affiliate * ──► AffiliateMergeController ──► cluster/Affiliate <node id>
//! cluster/Affiliate * ──► MemberController ──► cluster/Member <node id>
//! ```
//!
//! Raw affiliates keep one record per (source, node): the local node's own record has
//! the bare node ID (it never collides with a `<service>/<id>` record), each discovery
//! service's records are prefixed with the service name. The merge is deterministic
//! (local first, then services by name) and never last-writer-wins.

pub mod discovery;
pub mod identity;
pub mod local;
pub mod members;
pub mod merge;

use std::collections::BTreeSet;

pub use self::{
    discovery::{DiscoveryController, DiscoveryOptions},
    identity::ClusterIdentityController,
    local::LocalAffiliateController,
    members::MemberController,
    merge::AffiliateMergeController,
};
use crate::runtime::{
    ControllerError, ControllerRuntime, Phase, RegistrationError, ResourceKind, Runtime,
};

/// Registers the cluster discovery controllers (not the node identity: the daemon
/// registers that with its state dir).
///
/// # Errors
/// Output conflicts with already registered controllers.
pub fn register(runtime: &mut Runtime, options: DiscoveryOptions) -> Result<(), RegistrationError> {
    runtime.register(ClusterIdentityController)?;
    runtime.register(LocalAffiliateController)?;
    runtime.register(DiscoveryController::new(options))?;
    runtime.register(AffiliateMergeController)?;
    runtime.register(MemberController)?;
    Ok(())
}

/// Writes `spec` to the output `namespace/id` (no-op when equal). A desired resource
/// still tearing down is destroyed first when it has no finalizers left, otherwise left
/// alone until the DestroyReady wake-up.
fn put<K>(
    rt: &mut ControllerRuntime,
    namespace: &str,
    id: &str,
    spec: &K::Spec,
) -> Result<(), ControllerError>
where
    K: ResourceKind,
    K::Spec: Clone + Default + PartialEq,
{
    if let Some(cur) = rt.get_opt::<K>(namespace, id)? {
        if cur.metadata.phase == Phase::TearingDown {
            if !cur.metadata.finalizers.is_empty() {
                return Ok(());
            }
            rt.destroy(&cur.pointer())?;
        }
    }
    rt.modify::<K>(namespace, id, |r| {
        if r.spec != *spec {
            r.spec.clone_from(spec);
        }
    })?;
    Ok(())
}

/// Tears down every output of `K` in `namespace` owned by this controller whose id is
/// not in `keep`, and destroys those without finalizers (the others are destroyed on a
/// later DestroyReady wake-up; `docs/runtime.md` §3.7).
fn retire_stale<K: ResourceKind>(
    rt: &ControllerRuntime,
    namespace: &str,
    keep: &BTreeSet<String>,
) -> Result<(), ControllerError> {
    for r in rt.list::<K>(namespace)? {
        if r.metadata.owner != rt.name() || keep.contains(&r.metadata.id) {
            continue;
        }
        if rt.teardown(&r.pointer())? {
            rt.destroy(&r.pointer())?;
        }
    }
    Ok(())
}
