//! `KubeSpanConfigController`: the mesh settings in force from the machine config.

use futures::future::BoxFuture;

use crate::{
    config::kubespan::{KubeSpanConfigDocument as Document, KubeSpanEndpointsConfig},
    resources::{
        config::MachineConfig,
        kubespan::{KubeSpanConfig, KubeSpanConfigSpec, KUBESPAN, NS},
    },
    runtime::{
        Action, Controller, ControllerResult, ControllerRuntime, Input, Output, Pointer,
        ResourceKind as _,
    },
};

/// Writes `kubespan/KubeSpanConfig kubespan` from the `KubeSpanConfig` document
/// (defaults applied by the document type) and the union of every
/// `KubeSpanEndpointsConfig`; without a `KubeSpanConfig` document (or without a config)
/// the resource is absent: the mesh is disabled.
#[derive(Debug, Default)]
pub struct KubeSpanConfigController;

/// The effective mesh config of a machine config, `None` without a mesh document.
#[must_use]
pub fn effective(config: &crate::config::ConfigDocuments) -> Option<KubeSpanConfigSpec> {
    let doc = config.singleton::<Document>()?;
    let mut extra = Vec::new();
    for e in config
        .documents_of::<KubeSpanEndpointsConfig>()
        .flat_map(|d| &d.extra_announced_endpoints)
    {
        if !extra.contains(e) {
            extra.push(*e);
        }
    }
    Some(KubeSpanConfigSpec {
        config: doc.clone(),
        extra_announced_endpoints: extra,
    })
}

impl Controller for KubeSpanConfigController {
    type Event = ();

    fn name(&self) -> &str {
        "KubeSpanConfigController"
    }

    fn inputs(&self) -> Vec<Input> {
        vec![MachineConfig::input()]
    }

    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<KubeSpanConfig>()]
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let mc = MachineConfig::active(rt)?;
            match mc.and_then(|mc| effective(&mc.spec.config)) {
                Some(spec) => {
                    rt.modify::<KubeSpanConfig>(NS, KUBESPAN, |r| r.spec.clone_from(&spec))?;
                }
                None => {
                    let ptr = Pointer::new(NS, KubeSpanConfig::TYPE, KUBESPAN);
                    if rt.get_opt::<KubeSpanConfig>(NS, KUBESPAN)?.is_some() {
                        rt.destroy(&ptr)?;
                    }
                }
            }
            Ok(Action::await_change())
        })
    }
}
