//! The delta round: only the peers whose specs changed are stepped (without a device
//! read) and written, as WireGuard peer changes and a routed-set delta, so its work
//! is proportional to the change, not to the mesh.

use std::time::SystemTime;

use wirespan_dataplane::{
    marking::PrefixDelta,
    wireguard::{PeerChange, PresharedKey, WgPeer},
};

use super::{blocking, keepalive, wg_error, KubeSpanManagerController, ManagerError};
use crate::{
    config::kubespan::KubeSpanConfig as Settings,
    kubespan::{
        peers::routed_prefixes,
        rotation::{next_wake, note_listing, seed, step, RxRule, RECONCILE_TICK},
    },
    resources::{
        cluster::ClusterIdentity,
        kubespan::{KubeSpanPeerStatusSpec, PeerPath, PeerState},
    },
    runtime::{ControllerError, ControllerRuntime, Resource},
};

impl KubeSpanManagerController {
    /// A delta round over the peers `keys` (see [`Self::reconcile`]).
    pub(super) async fn delta_round(
        &mut self,
        rt: &mut ControllerRuntime,
        s: &Settings,
        cluster: &Resource<ClusterIdentity>,
        keys: &[String],
        now: SystemTime,
    ) -> Result<Option<SystemTime>, ControllerError> {
        let psk = PresharedKey::from_bytes(*cluster.spec.secret.bytes());
        let mut changes = Vec::with_capacity(keys.len());
        let mut delta = PrefixDelta::default();
        let mut wake = self.wake;
        for key in keys {
            let spec = self.specs.get(key).map(|r| r.spec.clone());
            let peer = spec
                .as_ref()
                .and_then(|spec| self.peer_of(key, spec, &psk, s));
            let (Some(spec), Some(peer)) = (spec, peer) else {
                // Gone (or never a valid peer).
                self.statuses.remove(key);
                self.rx.remove(key);
                if let Some((_, p)) = self.peers.remove(key) {
                    changes.push(PeerChange::Remove(p.public_key));
                }
                if let Some(old) = self.routed.remove(key) {
                    delta.remove.extend(old);
                }
                continue;
            };
            // A spec for a peer the device kept from an earlier run: its status starts
            // from what the device had (no endpoint pushed over a working one).
            let retained = self.retained.remove(key);
            let st = self.statuses.entry(key.clone()).or_insert_with(|| {
                let mut st = KubeSpanPeerStatusSpec {
                    label: spec.label.clone(),
                    ..KubeSpanPeerStatusSpec::default()
                };
                if let Some(r) = &retained {
                    seed(&mut st, &r.observed);
                }
                st
            });
            // No device read here: the tracking judges by the last read (a passed
            // wake-up makes the round a complete one with a read).
            let window = super::complete::rx_window_of(s, &spec);
            let mut track = super::complete::rx_track(&mut self.rx, key, window, 0, now);
            let rule = track
                .as_deref_mut()
                .zip(window)
                .map(|(track, window)| RxRule { track, window });
            let step = step(st, &spec.endpoints, None, now, s.peer_down_interval, rule);
            // Listed (again): a peer kept while unlisted is an ordinary one now.
            note_listing(st, true, now);
            // No relay is in use in a delta round (see `relay_active`).
            let path = if st.state == PeerState::Up {
                PeerPath::Direct
            } else {
                PeerPath::None
            };
            super::relay::set_path(self.deps.metrics.as_deref(), key, st, path);
            st.via.clear();
            let rx = track.as_deref().zip(window);
            if let Some(w) = next_wake(st, now, s.peer_down_interval, rx) {
                wake = Some(wake.map_or(w, |x| x.min(w)));
            }
            let routed = routed_prefixes(
                !s.allow_down_peer_bypass,
                &peer.allowed_ips,
                st.state == PeerState::Up,
            );
            changes.push(PeerChange::Upsert(WgPeer {
                endpoint: step.desired_endpoint,
                persistent_keepalive: keepalive(self.own_key.as_ref(), &peer, st, now),
                ..peer
            }));
            let old = self
                .routed
                .insert(key.clone(), routed.clone())
                .unwrap_or_default();
            if old != routed {
                delta.remove.extend(old);
                delta.add.extend(routed);
            }
        }
        let wg = self
            .wg
            .take()
            .unwrap_or_else(|| unreachable!("checked by the caller"));
        let (wg, res) = blocking(wg, move |w| w.apply_peers(&changes)).await?;
        self.wg = Some(wg);
        res.map_err(|source| wg_error(&s.link_name, source))?;
        if !delta.is_empty() {
            let m = self
                .marking
                .take()
                .unwrap_or_else(|| unreachable!("set by a complete round"));
            let (m, res) = blocking(m, move |m| m.marking.apply_delta(&delta)).await?;
            self.marking = Some(m);
            res.map_err(|e| ControllerError::other(ManagerError::Marking(e)))?;
        }
        for key in keys {
            self.write_status(rt, key)?;
            self.write_harvested(rt, s, key)?;
        }
        self.write_manager_status(rt, s)?;
        self.wake = wake;
        let tick = self.last_read.map(|t| t + RECONCILE_TICK);
        Ok(match (wake, tick) {
            (Some(w), Some(t)) => Some(w.min(t)),
            (w, t) => w.or(t),
        })
    }
}
