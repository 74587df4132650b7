//! `cluster/ClusterIdentity cluster` from the `ClusterConfig` document.

use std::collections::BTreeSet;

use futures::future::BoxFuture;

use super::{put, retire_stale};
use crate::{
    config::cluster::ClusterConfig,
    resources::{
        cluster::{ClusterIdentity, ClusterIdentitySpec, CLUSTER, NS},
        config::MachineConfig,
    },
    runtime::{Action, Controller, ControllerResult, ControllerRuntime, Input, InputKind, Output},
};

/// Publishes the cluster identity (ID and secret) while the active config has a
/// `ClusterConfig` document; removes it when the document goes away.
#[derive(Debug, Default)]
pub struct ClusterIdentityController;

impl Controller for ClusterIdentityController {
    type Event = ();

    fn name(&self) -> &str {
        "cluster.ClusterIdentityController"
    }

    fn inputs(&self) -> Vec<Input> {
        vec![
            MachineConfig::input(),
            Input::of::<ClusterIdentity>(NS, InputKind::DestroyReady),
        ]
    }

    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<ClusterIdentity>()]
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let config = MachineConfig::active(rt)?;
            let desired = config.as_ref().and_then(|c| {
                let doc = c.spec.config.singleton::<ClusterConfig>()?;
                // Valid documents always decode; a config that did not validate never
                // becomes active.
                let secret = doc.secret_key()?;
                Some(ClusterIdentitySpec {
                    cluster_id: doc.id.clone(),
                    secret,
                })
            });
            let mut keep = BTreeSet::new();
            if let Some(spec) = desired {
                put::<ClusterIdentity>(rt, NS, CLUSTER, &spec)?;
                keep.insert(CLUSTER.to_owned());
            }
            retire_stale::<ClusterIdentity>(rt, NS, &keep)?;
            Ok(Action::await_change())
        })
    }
}
