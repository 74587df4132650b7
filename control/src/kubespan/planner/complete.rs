//! The complete round (`docs/kubespan.md` §8.2): every peer judged against what the
//! device reports (when it was read), relays chosen, and the whole device and marking
//! set planned.

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
    sync::Arc,
    time::SystemTime,
};

use ipnet::IpNet;
use wirespan_dataplane::{
    marking::{MarkingSpec, DEFAULT_TABLE},
    wireguard::{PresharedKey, WgPeer},
};

use super::{
    listing::Kept,
    peer::{judge, program, rx_window_of, Facts, Programming, Route},
    relay::relay_user,
    CompleteInputs, MarkingPlan, MeshState, PathChange, Plan, WireGuardPlan,
};
use crate::{
    config::kubespan::KubeSpanConfigDocument as Settings,
    kubespan::peers::routed_set,
    resources::kubespan::{KubeSpanPeerSpec, PeerState},
    runtime::Resource,
};

/// What programming the judged peers gives.
struct Programmed {
    wg_peers: Vec<WgPeer>,
    /// Each peer's part of the routed set, in device order.
    routed: Vec<(String, Vec<IpNet>)>,
    wake: Option<SystemTime>,
    path_changes: Vec<PathChange>,
}

impl MeshState {
    /// Plans a complete round at `now` (see the module documentation).
    pub fn plan_complete(
        &mut self,
        inputs: CompleteInputs,
        s: &Settings,
        psk: &PresharedKey,
        now: SystemTime,
    ) -> Plan {
        if let Some(device) = &inputs.device {
            self.note_read(device, now);
        }
        self.own_key.clone_from(&inputs.own_key);
        let (mut kept, probes) = self.judge_all(&inputs, s, psk, now);
        self.yield_to_listed(&mut kept);
        // §8.7: peers not reachable directly go through a relay both ends choose alike;
        // §8.8: those without one through the server relay, where it granted one.
        let relays = self.choose_relays(s, now);
        self.server_relays(&inputs.allocations, &relays, s.peer_receive_timeout, now);
        let mut programmed = self.program_all(&kept, &relays, s, now);
        self.note_relays(relays, now, s.peer_receive_timeout);
        self.retain_device_peers(
            inputs.device,
            (psk, !s.allow_down_peer_bypass, s.peer_down_interval),
            now,
            &mut programmed.wg_peers,
            &mut programmed.routed,
        );
        self.forget_gone();
        let (prefixes_v4, prefixes_v6) =
            routed_set(programmed.routed.iter().map(|(_, p)| p.as_slice()));
        self.routed = programmed.routed.into_iter().collect();
        self.wake = programmed.wake;
        Plan {
            wireguard: WireGuardPlan::Device(programmed.wg_peers),
            marking: MarkingPlan::Whole(MarkingSpec {
                table: DEFAULT_TABLE.to_owned(),
                device_mark: s.device_mark,
                mark: s.route_mark,
                mask: s.mark_mask,
                mtu: s.mtu,
                prefixes_v4,
                prefixes_v6,
                ..MarkingSpec::default()
            }),
            statuses: self.statuses.keys().cloned().collect(),
            probes,
            path_changes: programmed.path_changes,
            wake: programmed.wake,
        }
    }

    /// Judges every peer, listed ones first, then those kept though unlisted; drops
    /// kept peers whose session went stale. Returns the peers kept and the probes.
    fn judge_all(
        &mut self,
        inputs: &CompleteInputs,
        s: &Settings,
        psk: &PresharedKey,
        now: SystemTime,
    ) -> (Vec<Kept>, Vec<IpAddr>) {
        let specs: Vec<Arc<Resource<KubeSpanPeerSpec>>> = self
            .specs
            .values()
            .chain(self.unlisted.values())
            .cloned()
            .collect();
        let mut kept = Vec::with_capacity(specs.len());
        let mut probes = Vec::new();
        let mut stale = Vec::new();
        for r in &specs {
            let key = r.metadata.id.as_str();
            let Some(base) = self.peer_of(key, &r.spec, psk, s) else {
                continue;
            };
            // Without a read (or without the peer on the device) the status keeps its
            // last observation.
            let seen = inputs
                .device
                .as_ref()
                .and_then(|d| d.get(key))
                .map(|d| d.observed);
            let facts = Facts {
                key,
                spec: &r.spec,
                listed: !self.unlisted.contains_key(key),
                seen,
                held: self.retained.get(key).map(|d| d.observed),
                replied: r.spec.address.is_some_and(|a| inputs.replied.contains(&a)),
                may_probe: true,
            };
            let judged = judge(&mut self.statuses, &mut self.rx, &facts, s, now);
            if !judged.stays {
                stale.push(key.to_owned());
                continue;
            }
            probes.extend(judged.probe);
            self.observe_direct(key, &r.spec, seen, s, now);
            kept.push(Kept {
                key: key.to_owned(),
                base,
                desired_endpoint: judged.desired_endpoint,
            });
        }
        for key in &stale {
            self.drop_unlisted(key);
        }
        (kept, probes)
    }

    /// Notes the direct path of a peer that takes part in relays (§8.7): up through
    /// the server relay says nothing of it.
    fn observe_direct(
        &mut self,
        key: &str,
        spec: &crate::resources::kubespan::KubeSpanPeerSpecSpec,
        seen: Option<crate::kubespan::rotation::Observed>,
        s: &Settings,
        now: SystemTime,
    ) {
        if !relay_user(s, spec) {
            self.direct.remove(key);
            return;
        }
        let state = self.statuses.get(key).map(|st| st.state);
        let device_endpoint = seen.and_then(|o| o.endpoint);
        let on_server = self.on_server_relay(key, &spec.endpoints, device_endpoint);
        if let Some(state) = state.filter(|st| !(on_server && *st == PeerState::Up)) {
            self.direct
                .entry(key.to_owned())
                .or_default()
                .observe(state, now);
        }
    }

    /// Programs every kept peer (see `peer::program`), then moves each relayed peer's
    /// prefixes to its relay's WireGuard peer; the peer keeps its endpoint and
    /// keepalive, which retry the direct path.
    fn program_all(
        &mut self,
        kept: &[Kept],
        relays: &BTreeMap<String, String>,
        s: &Settings,
        now: SystemTime,
    ) -> Programmed {
        let mut out = Programmed {
            wg_peers: Vec::with_capacity(kept.len()),
            routed: Vec::with_capacity(kept.len()),
            wake: None,
            path_changes: Vec::new(),
        };
        let mut at: HashMap<&str, usize> = HashMap::with_capacity(kept.len());
        for k in kept {
            let relay_label = relays
                .get(&k.key)
                .and_then(|r| self.statuses.get(r))
                .map(|r| r.label.clone());
            let relayed = relays.contains_key(&k.key);
            let window = self
                .specs
                .get(&k.key)
                .or_else(|| self.unlisted.get(&k.key))
                .and_then(|r| rx_window_of(s, &r.spec));
            let Some(st) = self.statuses.get_mut(&k.key) else {
                continue;
            };
            let p = Programming {
                key: &k.key,
                base: &k.base,
                desired_endpoint: k.desired_endpoint,
                rx: self.rx.get(&k.key).zip(window),
                direct: self.direct.get(&k.key),
                route: Route {
                    // A relay without a status still relays (its label is unknown).
                    relay: relay_label.as_deref().or(relayed.then_some("")),
                    server: self.server_relayed.get(&k.key),
                },
            };
            let programmed = program(st, &p, self.own_key.as_ref(), s, now, &mut out.path_changes);
            out.wake = out.wake.into_iter().chain(programmed.wake).min();
            at.insert(&k.key, out.wg_peers.len());
            out.wg_peers.push(programmed.peer);
            out.routed.push((k.key.clone(), programmed.routed));
        }
        for (peer, relay) in relays {
            let (Some(&p), Some(&r)) = (at.get(peer.as_str()), at.get(relay.as_str())) else {
                continue;
            };
            let moved = std::mem::take(&mut out.wg_peers[p].allowed_ips);
            out.wg_peers[r].allowed_ips.extend(moved);
        }
        out
    }

    /// Forgets peers that went away: every spec has a status now, so there are more
    /// statuses than specs exactly when some are stale (no lookups otherwise).
    fn forget_gone(&mut self) {
        let live = self.specs.len() + self.unlisted.len();
        if self.statuses.len() > live
            || self.peers.len() > live
            || self.rx.len() > live
            || self.direct.len() > live
        {
            let (listed, kept) = (&self.specs, &self.unlisted);
            let known = |k: &String| listed.contains_key(k) || kept.contains_key(k);
            self.statuses.retain(|k, _| known(k));
            self.peers.retain(|k, _| known(k));
            self.rx.retain(|k, _| known(k));
            self.direct.retain(|k, _| known(k));
        }
    }
}
