//! The delta round: only the peers whose specs changed are judged (on the last read)
//! and planned, as WireGuard peer changes and a routed-set delta, so its work is
//! proportional to the change, not to the mesh. It runs only while no relay is in use
//! and no peer is kept unlisted ([`MeshState::delta_allowed`]).

use std::{sync::Arc, time::SystemTime};

use wirespan_dataplane::{
    marking::PrefixDelta,
    wireguard::{PeerChange, PresharedKey},
};

use super::{
    peer::{judge, program, rx_window_of, Facts, Programming, Route},
    MarkingPlan, MeshState, Plan, WireGuardPlan,
};
use crate::config::kubespan::KubeSpanConfigDocument as Settings;

impl MeshState {
    /// Plans a delta round over the peers `keys` at `now`.
    pub fn plan_delta(
        &mut self,
        keys: &[String],
        s: &Settings,
        psk: &PresharedKey,
        now: SystemTime,
    ) -> Plan {
        let mut changes = Vec::with_capacity(keys.len());
        let mut delta = PrefixDelta::default();
        let mut wake = self.wake;
        let mut path_changes = Vec::new();
        for key in keys {
            let spec = self.specs.get(key).map(Arc::clone);
            let peer = spec
                .as_ref()
                .and_then(|r| self.peer_of(key, &r.spec, psk, s));
            let (Some(r), Some(base)) = (spec, peer) else {
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
            // from what the device had.
            let held = self.retained.remove(key).map(|d| d.observed);
            let facts = Facts {
                key,
                spec: &r.spec,
                listed: true,
                seen: None,
                held,
                replied: false,
                may_probe: false,
            };
            let judged = judge(&mut self.statuses, &mut self.rx, &facts, s, now);
            let window = rx_window_of(s, &r.spec);
            let Some(st) = self.statuses.get_mut(key) else {
                continue;
            };
            let p = Programming {
                key,
                base: &base,
                desired_endpoint: judged.desired_endpoint,
                rx: self.rx.get(key).zip(window),
                direct: self.direct.get(key),
                // No relay is in use in a delta round.
                route: Route::default(),
            };
            let programmed = program(st, &p, self.own_key.as_ref(), s, now, &mut path_changes);
            wake = wake.into_iter().chain(programmed.wake).min();
            changes.push(PeerChange::Upsert(programmed.peer));
            let old = self
                .routed
                .insert(key.clone(), programmed.routed.clone())
                .unwrap_or_default();
            if old != programmed.routed {
                delta.remove.extend(old);
                delta.add.extend(programmed.routed);
            }
        }
        self.wake = wake;
        Plan {
            wireguard: WireGuardPlan::Peers(changes),
            marking: MarkingPlan::Delta(delta),
            statuses: keys.to_vec(),
            probes: Vec::new(),
            path_changes,
            wake,
        }
    }
}
