//! `cluster/Member <node id>` from every merged affiliate.

use std::collections::BTreeSet;

use futures::future::BoxFuture;

use super::{put, retire_stale};
use crate::{
    resources::cluster::{Affiliate, AffiliateSpec, Member, MemberSpec, NS},
    runtime::{
        Action, Controller, ControllerResult, ControllerRuntime, Input, InputKind, Output, Phase,
    },
};

/// The member view of a merged affiliate.
#[must_use]
pub fn member_of(affiliate: &AffiliateSpec) -> MemberSpec {
    MemberSpec {
        node_id: affiliate.node_id.clone(),
        hostname: affiliate.hostname.clone(),
        nodename: affiliate.nodename.clone(),
        machine_type: affiliate.machine_type.clone(),
        operating_system: affiliate.operating_system.clone(),
        addresses: affiliate.addresses.clone(),
    }
}

/// One member per merged affiliate, id = node ID (unique, unlike node names).
#[derive(Debug, Default)]
pub struct MemberController;

impl Controller for MemberController {
    type Event = ();

    fn name(&self) -> &str {
        "cluster.MemberController"
    }

    fn inputs(&self) -> Vec<Input> {
        vec![
            Input::of::<Affiliate>(NS, InputKind::Weak),
            Input::of::<Member>(NS, InputKind::DestroyReady),
        ]
    }

    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<Member>()]
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let mut keep = BTreeSet::new();
            for a in rt.list::<Affiliate>(NS)? {
                // An affiliate on its way out is no longer a member.
                if a.metadata.phase != Phase::Running {
                    continue;
                }
                put::<Member>(rt, NS, &a.metadata.id, &member_of(&a.spec))?;
                keep.insert(a.metadata.id.clone());
            }
            retire_stale::<Member>(rt, NS, &keep)?;
            Ok(Action::await_change())
        })
    }
}
