//! `KubeSpanPeerSpecController`: WireGuard peers from the merged affiliates (spec
//! §5.2–§5.3).
//!
//! The claimed prefix set of each affiliate is cached by the affiliate's resource
//! version, and only peer specs whose content changed are written, so one affiliate
//! change costs one set computation, one overlap pass (O(n log n) on cached sets) and
//! one write.

use std::collections::{BTreeMap, HashMap};

use futures::future::BoxFuture;

use crate::{
    kubespan::{
        peers::{claimed_set, resolve_overlaps, select},
        prefixset::PrefixSet,
    },
    resources::{
        cluster::{self, Affiliate, AffiliateSpec},
        identity::{NodeIdentity, LOCAL},
        kubespan::{
            KubeSpanConfig, KubeSpanIdentity, KubeSpanPeerSpec, KubeSpanPeerSpecSpec, KUBESPAN, NS,
        },
    },
    runtime::{
        Controller, ControllerResult, ControllerRuntime, Input, InputKind, Output, Pointer,
        ResourceKind as _,
    },
};

/// Writes one `kubespan/KubeSpanPeerSpec <public key>` per peer while the mesh is
/// enabled.
#[derive(Debug, Default)]
pub struct KubeSpanPeerSpecController {
    /// node id → (affiliate version, claimed set); a version match is re-checked
    /// against the spec only when cheap equality says so (recreated affiliates restart
    /// their version).
    claimed: HashMap<String, (u64, AffiliateSpec, PrefixSet)>,
    /// public key → spec last written.
    written: Option<BTreeMap<String, KubeSpanPeerSpecSpec>>,
}

impl KubeSpanPeerSpecController {
    /// A controller with empty caches.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    fn reconcile(&mut self, rt: &mut ControllerRuntime) -> ControllerResult {
        let written = match self.written.take() {
            Some(w) => w,
            None => rt
                .list::<KubeSpanPeerSpec>(NS)?
                .iter()
                .map(|r| (r.metadata.id.clone(), r.spec.clone()))
                .collect(),
        };
        let enabled = rt
            .get_opt::<KubeSpanConfig>(NS, KUBESPAN)?
            .is_some_and(|c| c.spec.config.enabled);
        let mut desired: BTreeMap<String, KubeSpanPeerSpecSpec> = BTreeMap::new();
        if enabled {
            let local = rt
                .get_opt::<NodeIdentity>(NodeIdentity::DEFAULT_NAMESPACE, LOCAL)?
                .map(|r| r.spec.node_id.clone())
                .unwrap_or_default();
            let own_key = rt
                .get_opt::<KubeSpanIdentity>(NS, KUBESPAN)?
                .map(|r| r.spec.public_key.clone())
                .unwrap_or_default();
            let affiliates = rt.list::<Affiliate>(cluster::NS)?;
            let (selected, conflicts) = select(
                &local,
                &own_key,
                affiliates.iter().map(|a| (a.metadata.id.as_str(), &a.spec)),
            );
            for c in &conflicts {
                tracing::warn!(public_key = %c.public_key, kept = %c.kept, dropped = %c.dropped,
                    "two affiliates claim one KubeSpan public key; keeping the first by node ID");
            }
            let versions: HashMap<&str, u64> = affiliates
                .iter()
                .map(|a| (a.metadata.id.as_str(), a.metadata.version))
                .collect();
            self.claimed
                .retain(|id, _| versions.contains_key(id.as_str()));
            for s in &selected {
                let v = versions.get(s.node_id).copied().unwrap_or_default();
                let fresh = self
                    .claimed
                    .get(s.node_id)
                    .is_some_and(|(cv, spec, _)| *cv == v && spec == s.affiliate);
                if !fresh {
                    self.claimed.insert(
                        s.node_id.to_owned(),
                        (v, s.affiliate.clone(), claimed_set(s.affiliate)),
                    );
                }
            }
            let resolved = resolve_overlaps(
                selected
                    .iter()
                    .filter_map(|s| self.claimed.get(s.node_id).map(|(_, _, set)| set)),
            );
            for (s, r) in selected.iter().zip(resolved) {
                if r.allowed_ips.is_empty() {
                    tracing::warn!(peer = %s.public_key, node = %s.node_id, "peer keeps no AllowedIPs");
                }
                if !r.removed.is_empty() {
                    tracing::warn!(peer = %s.public_key, node = %s.node_id, removed = ?r.removed,
                        "peer address overlap: ranges already claimed by an earlier peer");
                }
                let ks = s.affiliate.kubespan.as_ref();
                desired.insert(
                    s.public_key.to_owned(),
                    KubeSpanPeerSpecSpec {
                        node_id: s.node_id.to_owned(),
                        label: s.affiliate.nodename.clone(),
                        address: ks.and_then(|k| k.address),
                        allowed_ips: r.allowed_ips,
                        overlap_removed: r.removed,
                        endpoints: ks.map(|k| k.endpoints.clone()).unwrap_or_default(),
                    },
                );
            }
        } else {
            self.claimed.clear();
        }
        for id in written.keys() {
            if !desired.contains_key(id) {
                rt.destroy(&Pointer::new(NS, KubeSpanPeerSpec::TYPE, id))?;
            }
        }
        for (id, spec) in &desired {
            if written.get(id) != Some(spec) {
                rt.modify::<KubeSpanPeerSpec>(NS, id, |r| r.spec.clone_from(spec))?;
            }
        }
        self.written = Some(desired);
        Ok(())
    }
}

impl Controller for KubeSpanPeerSpecController {
    fn name(&self) -> &str {
        "KubeSpanPeerSpecController"
    }

    fn inputs(&self) -> Vec<Input> {
        vec![
            Input::id_of::<KubeSpanConfig>(NS, KUBESPAN, InputKind::Weak),
            Input::id_of::<KubeSpanIdentity>(NS, KUBESPAN, InputKind::Weak),
            Input::id_of::<NodeIdentity>(NodeIdentity::DEFAULT_NAMESPACE, LOCAL, InputKind::Weak),
            Input::of::<Affiliate>(cluster::NS, InputKind::Weak),
        ]
    }

    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<KubeSpanPeerSpec>()]
    }

    fn run<'a>(&'a mut self, rt: &'a mut ControllerRuntime) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            // A restart re-reads what exists (the cache may be stale after an error).
            self.written = None;
            while rt.next_round().await {
                self.reconcile(rt)?;
                rt.reset_restart_backoff();
            }
            Ok(())
        })
    }
}
