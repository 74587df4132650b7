//! `KubeSpanPeerSpecController`: WireGuard peers from the merged affiliates (spec
//! §5.2–§5.3).
//!
//! The affiliates that changed come from a [`ChangeFeed`]. The claimed prefix set of
//! each affiliate is cached by the affiliate's resource version, and only peer specs
//! whose content changed are written. When the last full pass found no overlap and no
//! duplicate key, a few changed affiliates (peers joining, leaving or changing) whose
//! keys no other peer holds and whose sets overlap no other peer's are applied to those
//! peers alone (overlap resolution then changes no other peer): O(log n) set work per
//! changed peer. Anything else takes the full pass: selection in node-ID order and
//! overlap resolution over the cached sets.
//!
//! `filters.peerEndpoints` (Talos 1.15) is applied here, to each peer's endpoints
//! before anything tries them: the peer spec holds only the endpoints this node may
//! use, so rotation and the device never see the others.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

use futures::future::BoxFuture;

use crate::{
    config::kubespan::{filter_endpoints, EndpointFilter},
    kubespan::{
        peers::{claimed_set, resolve_overlaps_after, select},
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
        Action, ChangeFeed, Controller, ControllerError, ControllerResult, ControllerRuntime,
        Input, InputKind, Output, Pointer, Resource, ResourceKind as _, Triggers,
    },
};

/// What a changed affiliate becomes: a selected peer's key and the affiliate, or none.
type Becomes = Option<(String, Arc<Resource<Affiliate>>)>;

/// At most this many changed affiliates take the incremental path.
const INCREMENTAL_MAX: usize = 16;

/// What the last full pass established, for the incremental path.
#[derive(Debug)]
struct Clean {
    local: String,
    own_key: String,
    /// This node's KubeSpan address: no peer may claim it (cloned MACs collide).
    own_address: Option<ipnet::IpNet>,
    /// node id → public key of every selected peer.
    selected: HashMap<String, String>,
    /// The reverse: public key → node id.
    keys: HashMap<String, String>,
    /// Union of every peer's claimed set (disjoint: no overlap in the last pass).
    union: PrefixSet,
    /// `filters.peerEndpoints` the specs were written with.
    peer_endpoint_filters: Option<Vec<EndpointFilter>>,
}

/// Writes one `kubespan/KubeSpanPeerSpec <public key>` per peer while the mesh is
/// enabled.
#[derive(Debug)]
pub struct KubeSpanPeerSpecController {
    /// node id → (affiliate version, spec, claimed set). A version match is confirmed
    /// by spec equality (a recreated affiliate restarts its version).
    claimed: HashMap<String, (u64, AffiliateSpec, PrefixSet)>,
    /// public key → spec last written.
    written: Option<BTreeMap<String, KubeSpanPeerSpecSpec>>,
    /// Set after a full pass without overlaps or key conflicts.
    clean: Option<Clean>,
    /// The affiliates as last seen (the feed's mirror).
    affiliates: BTreeMap<String, Arc<Resource<Affiliate>>>,
    feed: ChangeFeed<Affiliate>,
}

fn peer_spec(
    node_id: &str,
    a: &AffiliateSpec,
    (allowed_ips, removed): (Vec<ipnet::IpNet>, Vec<ipnet::IpNet>),
    peer_endpoint_filters: Option<&[EndpointFilter]>,
) -> KubeSpanPeerSpecSpec {
    let ks = a.kubespan.as_ref();
    KubeSpanPeerSpecSpec {
        node_id: node_id.to_owned(),
        label: a.nodename.clone(),
        address: ks.and_then(|k| k.address),
        allowed_ips,
        overlap_removed: removed,
        endpoints: ks
            .map(|k| filter_endpoints(&k.endpoints, peer_endpoint_filters))
            .unwrap_or_default(),
        wirespan: a.wirespan.clone(),
    }
}

impl Default for KubeSpanPeerSpecController {
    fn default() -> Self {
        Self {
            claimed: HashMap::new(),
            written: None,
            clean: None,
            affiliates: BTreeMap::new(),
            feed: ChangeFeed::new(cluster::NS),
        }
    }
}

impl KubeSpanPeerSpecController {
    /// A controller with empty caches.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The incremental path over the affiliates `ids` that changed since the last
    /// pass; `false` when the full pass is needed (nothing written then).
    fn try_incremental(
        &mut self,
        rt: &mut ControllerRuntime,
        local: &str,
        (own_key, own_address): (&str, Option<ipnet::IpNet>),
        peer_endpoint_filters: Option<&[EndpointFilter]>,
        ids: &[String],
        written: &mut BTreeMap<String, KubeSpanPeerSpecSpec>,
    ) -> Result<bool, crate::runtime::ControllerError> {
        let Some(clean) = self.clean.as_mut() else {
            return Ok(false);
        };
        if clean.local != local
            || clean.own_key != own_key
            || clean.own_address != own_address
            || clean.peer_endpoint_filters.as_deref() != peer_endpoint_filters
            || ids.len() > INCREMENTAL_MAX
        {
            return Ok(false);
        }
        // What each changed affiliate was and becomes: (id, key before, key after).
        let mut ops: Vec<(&String, Option<String>, Becomes)> = Vec::with_capacity(ids.len());
        let mut joining = std::collections::HashSet::new();
        for id in ids {
            if id == local {
                return Ok(false);
            }
            let was = clean.selected.get(id).cloned();
            let now = self.affiliates.get(id).and_then(|a| {
                let key = a.spec.kubespan.as_ref()?.public_key.clone();
                (!key.is_empty() && key != own_key).then(|| (key, Arc::clone(a)))
            });
            if let Some((key, _)) = &now {
                // A key another node holds (or takes in this batch): conflict rules.
                let taken = clean.keys.get(key).is_some_and(|holder| holder != id);
                if taken || !joining.insert(key.clone()) {
                    return Ok(false);
                }
            }
            ops.push((id, was, now));
        }
        // Every old set leaves the union, then each new one must not overlap what is
        // there (the sets are disjoint, so both steps undo exactly).
        let empty = PrefixSet::new();
        let old_set = |id: &String| self.claimed.get(id).map_or(&empty, |(_, _, set)| set);
        for (id, was, _) in &ops {
            if was.is_some() {
                clean.union.subtract(old_set(id));
            }
        }
        let mut added: Vec<PrefixSet> = Vec::with_capacity(ops.len());
        for (_, _, now) in &ops {
            let Some((_, a)) = now else { continue };
            let set = claimed_set(&a.spec);
            if set.overlaps(&clean.union) {
                for set in &added {
                    clean.union.subtract(set);
                }
                for (id, was, _) in &ops {
                    if was.is_some() {
                        clean.union.union(old_set(id));
                    }
                }
                return Ok(false);
            }
            clean.union.union(&set);
            added.push(set);
        }
        let mut added = added.into_iter();
        for (id, was, now) in ops {
            if let Some(key) = &was {
                clean.selected.remove(id);
                clean.keys.remove(key);
                if now.as_ref().is_none_or(|(k, _)| k != key) && written.remove(key).is_some() {
                    rt.destroy(&Pointer::new(NS, KubeSpanPeerSpec::TYPE, key))?;
                }
            }
            let Some((key, a)) = now else {
                match self.affiliates.get(id) {
                    Some(a) => {
                        self.claimed.insert(
                            id.clone(),
                            (a.metadata.version, a.spec.clone(), claimed_set(&a.spec)),
                        );
                    }
                    None => {
                        self.claimed.remove(id);
                    }
                }
                continue;
            };
            let set = added.next().unwrap_or_default();
            let spec = peer_spec(
                id,
                &a.spec,
                (set.to_prefixes(), Vec::new()),
                peer_endpoint_filters,
            );
            if written.get(&key) != Some(&spec) {
                rt.modify::<KubeSpanPeerSpec>(NS, &key, |r| r.spec.clone_from(&spec))?;
                written.insert(key.clone(), spec);
            }
            clean.selected.insert(id.clone(), key.clone());
            clean.keys.insert(key, id.clone());
            self.claimed
                .insert(id.clone(), (a.metadata.version, a.spec.clone(), set));
        }
        Ok(true)
    }

    fn full_pass(
        &mut self,
        local: &str,
        (own_key, own_address): (&str, Option<ipnet::IpNet>),
        peer_endpoint_filters: Option<&[EndpointFilter]>,
        affiliates: &[Arc<Resource<Affiliate>>],
    ) -> BTreeMap<String, KubeSpanPeerSpecSpec> {
        let mut desired = BTreeMap::new();
        let (selected, conflicts) = select(
            local,
            own_key,
            affiliates.iter().map(|a| (a.metadata.id.as_str(), &a.spec)),
        );
        for c in &conflicts {
            tracing::warn!(public_key = ?c.public_key, kept = %c.kept, dropped = %c.dropped,
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
        // This node's own address counts as claimed before every peer (§3.4).
        let mut reserved = PrefixSet::new();
        if let Some(a) = own_address {
            reserved.insert(&ipnet::IpNet::from(a.addr()));
        }
        let resolved = resolve_overlaps_after(
            &reserved,
            selected
                .iter()
                .filter_map(|s| self.claimed.get(s.node_id).map(|(_, _, set)| set)),
        );
        let mut overlap = false;
        let mut union = reserved.clone();
        for (s, r) in selected.iter().zip(resolved) {
            if r.allowed_ips.is_empty() {
                tracing::warn!(peer = ?s.public_key, node = ?s.node_id, "peer keeps no AllowedIPs");
            }
            if r.removed.is_empty() {
                if let Some((_, _, set)) = self.claimed.get(s.node_id) {
                    union.union(set);
                }
            } else {
                overlap = true;
                if r.removed
                    .iter()
                    .any(|p| reserved.overlaps(&PrefixSet::from_prefix(p)))
                {
                    tracing::warn!(peer = ?s.public_key, node = ?s.node_id,
                        "peer claims this node's KubeSpan address (same MAC, a cloned machine?); not routed to it");
                }
                tracing::warn!(peer = ?s.public_key, node = ?s.node_id, removed = ?r.removed,
                    "peer address overlap: ranges already claimed by an earlier peer or this node");
            }
            desired.insert(
                s.public_key.to_owned(),
                peer_spec(
                    s.node_id,
                    s.affiliate,
                    (r.allowed_ips, r.removed),
                    peer_endpoint_filters,
                ),
            );
        }
        self.clean = (!overlap && conflicts.is_empty()).then(|| Clean {
            local: local.to_owned(),
            own_key: own_key.to_owned(),
            own_address,
            selected: selected
                .iter()
                .map(|s| (s.node_id.to_owned(), s.public_key.to_owned()))
                .collect(),
            keys: selected
                .iter()
                .map(|s| (s.public_key.to_owned(), s.node_id.to_owned()))
                .collect(),
            union,
            peer_endpoint_filters: peer_endpoint_filters.map(<[_]>::to_vec),
        });
        desired
    }

    fn round(&mut self, rt: &mut ControllerRuntime) -> Result<(), ControllerError> {
        let changed = self.feed.sync(rt, &mut self.affiliates)?;
        let mut written = match self.written.take() {
            Some(w) => w,
            None => rt
                .list::<KubeSpanPeerSpec>(NS)?
                .iter()
                .map(|r| (r.metadata.id.clone(), r.spec.clone()))
                .collect(),
        };
        let config = rt
            .get_opt::<KubeSpanConfig>(NS, KUBESPAN)?
            .filter(|c| c.spec.config.enabled);
        let desired = if let Some(config) = config {
            let filters = config.spec.config.peer_endpoint_filters();
            let local = rt
                .get_opt::<NodeIdentity>(NodeIdentity::DEFAULT_NAMESPACE, LOCAL)?
                .map(|r| r.spec.node_id.clone())
                .unwrap_or_default();
            let identity = rt.get_opt::<KubeSpanIdentity>(NS, KUBESPAN)?;
            let own_key = identity
                .as_ref()
                .map(|r| r.spec.public_key.clone())
                .unwrap_or_default();
            let own = (own_key.as_str(), identity.and_then(|r| r.spec.address));
            if let Some(ids) = &changed {
                match self.try_incremental(rt, &local, own, filters.as_deref(), ids, &mut written) {
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
            }
            let affiliates: Vec<Arc<Resource<Affiliate>>> =
                self.affiliates.values().cloned().collect();
            self.full_pass(&local, own, filters.as_deref(), &affiliates)
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
    type Event = ();

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

    fn start(&mut self, _rt: &mut ControllerRuntime) -> Result<Triggers<()>, ControllerError> {
        // A restart re-reads what exists and takes the full pass.
        self.written = None;
        self.clean = None;
        self.feed.reset();
        Ok(Triggers::inputs_only())
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            self.round(rt)?;
            Ok(Action::await_change())
        })
    }
}
