//! `KubeSpanPeerSpecController`: WireGuard peers from the merged affiliates (spec
//! §5.2–§5.3).
//!
//! The claimed prefix set of each affiliate is cached by the affiliate's resource
//! version, and only peer specs whose content changed are written. When the last full
//! pass found no overlap and no duplicate key, a change of a few affiliates that keep
//! their key and claim nothing another peer claims is applied to those peers alone
//! (overlap resolution then changes no other peer): O(log n) set work per changed
//! peer plus a version scan. Anything else (peers joining or leaving, keys changing,
//! overlaps) takes the full pass: selection in node-ID order and overlap resolution
//! over the cached sets.

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
        Resource, ResourceKind as _,
    },
};

/// At most this many changed affiliates take the incremental path.
const INCREMENTAL_MAX: usize = 16;

/// What the last full pass established, for the incremental path.
#[derive(Debug)]
struct Clean {
    local: String,
    own_key: String,
    /// node id → public key of every selected peer.
    selected: HashMap<String, String>,
    /// Union of every peer's claimed set (disjoint: no overlap in the last pass).
    union: PrefixSet,
}

/// Writes one `kubespan/KubeSpanPeerSpec <public key>` per peer while the mesh is
/// enabled.
#[derive(Debug, Default)]
pub struct KubeSpanPeerSpecController {
    /// node id → (affiliate version, spec, claimed set). A version match is confirmed
    /// by spec equality (a recreated affiliate restarts its version).
    claimed: HashMap<String, (u64, AffiliateSpec, PrefixSet)>,
    /// public key → spec last written.
    written: Option<BTreeMap<String, KubeSpanPeerSpecSpec>>,
    /// Set after a full pass without overlaps or key conflicts.
    clean: Option<Clean>,
}

fn peer_spec(
    node_id: &str,
    a: &AffiliateSpec,
    allowed_ips: Vec<ipnet::IpNet>,
    removed: Vec<ipnet::IpNet>,
) -> KubeSpanPeerSpecSpec {
    let ks = a.kubespan.as_ref();
    KubeSpanPeerSpecSpec {
        node_id: node_id.to_owned(),
        label: a.nodename.clone(),
        address: ks.and_then(|k| k.address),
        allowed_ips,
        overlap_removed: removed,
        endpoints: ks.map(|k| k.endpoints.clone()).unwrap_or_default(),
    }
}

impl KubeSpanPeerSpecController {
    /// A controller with empty caches.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The incremental path; `false` when the full pass is needed (nothing written).
    fn try_incremental(
        &mut self,
        rt: &mut ControllerRuntime,
        local: &str,
        own_key: &str,
        affiliates: &[std::sync::Arc<Resource<Affiliate>>],
        written: &mut BTreeMap<String, KubeSpanPeerSpecSpec>,
    ) -> Result<bool, crate::runtime::ControllerError> {
        let Some(clean) = self.clean.as_mut() else {
            return Ok(false);
        };
        if clean.local != local
            || clean.own_key != own_key
            || affiliates.len() != self.claimed.len()
        {
            return Ok(false);
        }
        let mut changed = Vec::new();
        for a in affiliates {
            let id = a.metadata.id.as_str();
            match self.claimed.get(id) {
                Some((v, spec, _)) if *v == a.metadata.version && *spec == a.spec => {}
                Some(_) => {
                    changed.push(a);
                    if changed.len() > INCREMENTAL_MAX {
                        return Ok(false);
                    }
                }
                None => return Ok(false),
            }
        }
        // Every changed affiliate must stay the same selected peer.
        for a in &changed {
            let key = a.spec.kubespan.as_ref().map(|k| k.public_key.as_str());
            let was = clean
                .selected
                .get(a.metadata.id.as_str())
                .map(String::as_str);
            if a.metadata.id == local || key.is_none() || key != was {
                return Ok(false);
            }
        }
        // Apply to the union in place; undo exactly (the sets are disjoint) if a changed
        // set overlaps another peer's.
        let mut updates: Vec<(&std::sync::Arc<Resource<Affiliate>>, PrefixSet)> =
            Vec::with_capacity(changed.len());
        for a in &changed {
            let old = &self.claimed[a.metadata.id.as_str()].2;
            let new = claimed_set(&a.spec);
            clean.union.subtract(old);
            if new.overlaps(&clean.union) {
                clean.union.union(old);
                for (b, applied) in updates.iter().rev() {
                    clean.union.subtract(applied);
                    clean.union.union(&self.claimed[b.metadata.id.as_str()].2);
                }
                return Ok(false);
            }
            clean.union.union(&new);
            updates.push((a, new));
        }
        for (a, new) in updates {
            let id = a.metadata.id.clone();
            let spec = peer_spec(&id, &a.spec, new.to_prefixes(), Vec::new());
            let key = clean.selected[&id].clone();
            if written.get(&key) != Some(&spec) {
                rt.modify::<KubeSpanPeerSpec>(NS, &key, |r| r.spec.clone_from(&spec))?;
                written.insert(key, spec);
            }
            self.claimed
                .insert(id, (a.metadata.version, a.spec.clone(), new));
        }
        Ok(true)
    }

    fn full_pass(
        &mut self,
        local: &str,
        own_key: &str,
        affiliates: &[std::sync::Arc<Resource<Affiliate>>],
    ) -> BTreeMap<String, KubeSpanPeerSpecSpec> {
        let mut desired = BTreeMap::new();
        let (selected, conflicts) = select(
            local,
            own_key,
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
        for a in affiliates {
            let id = a.metadata.id.as_str();
            let fresh = self
                .claimed
                .get(id)
                .is_some_and(|(v, spec, _)| *v == a.metadata.version && *spec == a.spec);
            if !fresh {
                self.claimed.insert(
                    id.to_owned(),
                    (a.metadata.version, a.spec.clone(), claimed_set(&a.spec)),
                );
            }
        }
        let resolved = resolve_overlaps(
            selected
                .iter()
                .filter_map(|s| self.claimed.get(s.node_id).map(|(_, _, set)| set)),
        );
        let mut overlap = false;
        let mut union = PrefixSet::new();
        for (s, r) in selected.iter().zip(resolved) {
            if r.allowed_ips.is_empty() {
                tracing::warn!(peer = %s.public_key, node = %s.node_id, "peer keeps no AllowedIPs");
            }
            if r.removed.is_empty() {
                if let Some((_, _, set)) = self.claimed.get(s.node_id) {
                    union.union(set);
                }
            } else {
                overlap = true;
                tracing::warn!(peer = %s.public_key, node = %s.node_id, removed = ?r.removed,
                    "peer address overlap: ranges already claimed by an earlier peer");
            }
            desired.insert(
                s.public_key.to_owned(),
                peer_spec(s.node_id, s.affiliate, r.allowed_ips, r.removed),
            );
        }
        self.clean = (!overlap && conflicts.is_empty()).then(|| Clean {
            local: local.to_owned(),
            own_key: own_key.to_owned(),
            selected: selected
                .iter()
                .map(|s| (s.node_id.to_owned(), s.public_key.to_owned()))
                .collect(),
            union,
        });
        desired
    }

    fn reconcile(&mut self, rt: &mut ControllerRuntime) -> ControllerResult {
        let mut written = match self.written.take() {
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
        let desired = if enabled {
            let local = rt
                .get_opt::<NodeIdentity>(NodeIdentity::DEFAULT_NAMESPACE, LOCAL)?
                .map(|r| r.spec.node_id.clone())
                .unwrap_or_default();
            let own_key = rt
                .get_opt::<KubeSpanIdentity>(NS, KUBESPAN)?
                .map(|r| r.spec.public_key.clone())
                .unwrap_or_default();
            let affiliates = rt.list::<Affiliate>(cluster::NS)?;
            match self.try_incremental(rt, &local, &own_key, &affiliates, &mut written) {
                Ok(true) => {
                    self.written = Some(written);
                    return Ok(());
                }
                Ok(false) => {}
                Err(e) => {
                    self.clean = None;
                    return Err(e);
                }
            }
            self.full_pass(&local, &own_key, &affiliates)
        } else {
            self.claimed.clear();
            self.clean = None;
            BTreeMap::new()
        };
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
            // A restart re-reads what exists and takes the full pass.
            self.written = None;
            self.clean = None;
            while rt.next_round().await {
                self.reconcile(rt)?;
                rt.reset_restart_backoff();
            }
            Ok(())
        })
    }
}
