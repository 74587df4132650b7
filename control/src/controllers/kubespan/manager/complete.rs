//! The complete round (`docs/kubespan.md` §8.2): the device read (when due), the plan
//! for every peer (`MeshState::plan_complete`), the whole device and marking set
//! applied, every output written, and the marking adapter chosen for the configured
//! fast path.

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    time::{Instant, SystemTime},
};

use wirespan_dataplane::{
    marking::MarkingSpec,
    sysctl::MeshRpFilter,
    wireguard::{PresharedKey, PrivateKey, PublicKey, WgDevice, WgError, WgPeer},
};

use super::{blocking, wg_error, ActiveMarking, KubeSpanManagerController, ManagerError};
use crate::{
    config::kubespan::{FastPath, KubeSpanConfigDocument as Settings},
    controllers::kubespan::metrics::PeerFigures,
    kubespan::{
        planner::{CompleteInputs, DevicePeer, MarkingPlan, Plan, WireGuardPlan},
        rotation::{Observed, RECONCILE_TICK},
    },
    resources::{
        cluster::ClusterIdentity,
        kubespan::{KubeSpanIdentity, KubeSpanRelayEndpoint, NS},
    },
    runtime::{ControllerError, ControllerRuntime, Resource},
};

impl KubeSpanManagerController {
    /// A complete round (see [`Self::reconcile`]); `read`: read the device first.
    pub(super) async fn complete_round(
        &mut self,
        rt: &mut ControllerRuntime,
        s: &Settings,
        identity: &Resource<KubeSpanIdentity>,
        cluster: &Resource<ClusterIdentity>,
        read: bool,
    ) -> Result<Option<SystemTime>, ControllerError> {
        if !self.ensure_device(s).await? {
            // Refused (logged once): nothing to drive; the status says why, and the
            // link is looked at again each tick in case it was freed.
            self.write_manager_status(rt, s)?;
            return Ok(Some(self.deps.clock.now() + RECONCILE_TICK));
        }
        let now = self.deps.clock.now();
        let read = read || self.kernel.last_read.is_none();
        // Phase times for the debug log: at 10,000 peers the round takes long enough
        // that where it goes matters (see `choose_round`).
        let started = Instant::now();
        // Probe replies are taken before the device is read: a reply the counter shows
        // is then known to be one (§8.6).
        let replied = match self.deps.prober.as_ref() {
            Some(p) if read => p.kernel_replies(),
            _ => HashSet::new(),
        };
        // §8.2 step 2: what the device reports.
        let device = if read {
            Some(self.read_device(&s.link_name, now).await?)
        } else {
            None
        };
        let t_read = started.elapsed();
        let allocations = rt
            .list::<KubeSpanRelayEndpoint>(NS)?
            .iter()
            .filter_map(|r| Some((r.metadata.id.clone(), r.spec.endpoint?)))
            .collect();
        let inputs = CompleteInputs {
            own_key: PublicKey::from_base64("publicKey", &identity.spec.public_key).ok(),
            device,
            replied,
            allocations,
        };
        let psk = PresharedKey::from_bytes(*cluster.spec.secret.bytes());
        let plan = self.mesh.plan_complete(inputs, s, &psk, now);
        let t_judged = started.elapsed();
        self.note_plan(&plan);
        let Plan {
            wireguard: WireGuardPlan::Device(peers),
            marking: MarkingPlan::Whole(marking),
            statuses,
            wake,
            ..
        } = plan
        else {
            unreachable!("a complete plan is whole");
        };
        self.apply_device(s, identity, peers).await?;
        let t_wireguard = started.elapsed();
        self.rp_filter_off(&s.link_name).await?;
        self.apply_marking(s, marking).await?;
        let t_marking = started.elapsed();
        self.write_complete(rt, s, identity, &statuses, read, now)?;
        tracing::debug!(
            peers = statuses.len(),
            read,
            ?t_read,
            ?t_judged,
            ?t_wireguard,
            ?t_marking,
            total = ?started.elapsed(),
            "complete round (cumulative phase times)"
        );
        let tick = now + RECONCILE_TICK;
        Ok(Some(wake.map_or(tick, |w| w.min(tick))))
    }

    /// Creates the WireGuard backend for the configured link, tearing the old one down
    /// when the link was renamed. `false`: the backend asked for cannot run the link
    /// as it is ([`WgError::WrongBackend`]): logged once and kept for the status, not
    /// an error that would restart the manager in a loop.
    async fn ensure_device(&mut self, s: &Settings) -> Result<bool, ControllerError> {
        if self.kernel.link != s.link_name {
            if self.kernel.wg.is_some() {
                tracing::info!(old = %self.kernel.link, new = %s.link_name, "mesh link renamed");
                self.teardown_kernel().await;
            }
            self.kernel.wg = None;
            self.mesh.forget_device();
            self.kernel.link.clone_from(&s.link_name);
        }
        if self.kernel.wg.is_none() {
            self.kernel.last_read = None;
            let wg = match self.deps.wireguard.create(&s.link_name) {
                Ok(wg) => wg,
                Err(e @ WgError::WrongBackend { .. }) => {
                    let why = e.to_string();
                    if self.kernel.refused.as_ref() != Some(&why) {
                        tracing::error!(link = %s.link_name, error = %why, "WireGuard backend refused");
                    }
                    self.kernel.refused = Some(why);
                    return Ok(false);
                }
                Err(source) => return Err(wg_error(&s.link_name, source)),
            };
            self.kernel.refused = None;
            self.kernel.wg_recreated = wg.recreated();
            self.kernel.wg = Some(wg);
        }
        Ok(true)
    }

    /// Reads the device: its peers by public key (none when it is absent or the read
    /// failed, which is logged).
    async fn read_device(
        &mut self,
        link: &str,
        now: SystemTime,
    ) -> Result<HashMap<String, DevicePeer>, ControllerError> {
        let wg = self
            .kernel
            .wg
            .take()
            .unwrap_or_else(|| unreachable!("created first"));
        let (wg, (observed, drops)) = blocking(wg, |w| (w.observe(), w.drops())).await?;
        self.kernel.wg = Some(wg);
        if let Some(m) = &self.deps.metrics {
            m.set_wireguard_drops(drops);
        }
        self.kernel.last_read = Some(now);
        Ok(match observed {
            Ok(st) if st.present => st
                .peers
                .into_iter()
                .map(|p| {
                    (
                        p.public_key.to_base64(),
                        DevicePeer {
                            observed: Observed {
                                endpoint: p.endpoint,
                                last_handshake: p.last_handshake,
                                rx_bytes: p.rx_bytes,
                                tx_bytes: p.tx_bytes,
                            },
                            allowed_ips: p.allowed_ips,
                            keepalive: p.persistent_keepalive,
                        },
                    )
                })
                .collect(),
            Ok(_) => HashMap::new(),
            Err(e) => {
                tracing::warn!(link, error = %e, "reading the WireGuard device failed");
                HashMap::new()
            }
        })
    }

    /// Counts the plan's path changes and sends its probes.
    pub(super) fn note_plan(&self, plan: &Plan) {
        if let Some(m) = &self.deps.metrics {
            for c in &plan.path_changes {
                m.path_changed(&c.key, &c.label);
            }
        }
        if let Some(prober) = self
            .deps
            .prober
            .as_ref()
            .filter(|_| !plan.probes.is_empty())
        {
            tracing::debug!(peers = plan.probes.len(), "probing wirespan peers");
            for to in &plan.probes {
                prober.probe(*to);
            }
        }
    }

    /// Step 6: the whole device.
    async fn apply_device(
        &mut self,
        s: &Settings,
        identity: &Resource<KubeSpanIdentity>,
        peers: Vec<WgPeer>,
    ) -> Result<(), ControllerError> {
        let device = WgDevice {
            name: s.link_name.clone(),
            private_key: PrivateKey::from_bytes(*identity.spec.private_key.bytes()),
            listen_port: s.listen_port,
            fwmark: s.device_mark,
            peers,
        };
        let wg = self
            .kernel
            .wg
            .take()
            .unwrap_or_else(|| unreachable!("created first"));
        let (wg, res) = blocking(wg, move |w| w.apply(&device)).await?;
        self.kernel.wg = Some(wg);
        res.map(drop)
            .map_err(|source| wg_error(&s.link_name, source))
    }

    /// Step 6: the whole marking set, through the adapter for the configured fast path.
    async fn apply_marking(
        &mut self,
        s: &Settings,
        spec: MarkingSpec,
    ) -> Result<(), ControllerError> {
        let marked = (spec.prefixes_v4.len(), spec.prefixes_v6.len());
        self.ensure_marking(s.fast_path, &s.link_name);
        let m = self
            .kernel
            .marking
            .take()
            .unwrap_or_else(|| unreachable!("set above"));
        let (m, res) = blocking(m, move |m| m.marking.apply(&spec)).await?;
        self.kernel.marking = Some(m);
        res.map_err(|e| ControllerError::other(ManagerError::Marking(e)))?;
        if let (Some(metrics), Some(m)) = (&self.deps.metrics, &self.kernel.marking) {
            let in_use = match m.in_use {
                FastPath::Nftables => "nftables",
                FastPath::Ebpf => "ebpf",
            };
            metrics.set_marking(in_use, m.in_use != m.configured, marked.0, marked.1);
        }
        Ok(())
    }

    /// Writes every output of a complete round: statuses (and those of gone peers),
    /// link, address, routes and rules (step 7), harvested endpoints (§9), the manager
    /// status, and the per-peer metrics after a read.
    fn write_complete(
        &mut self,
        rt: &mut ControllerRuntime,
        s: &Settings,
        identity: &Resource<KubeSpanIdentity>,
        statuses: &[String],
        read: bool,
        now: SystemTime,
    ) -> Result<(), ControllerError> {
        for key in statuses {
            self.write_status(rt, key)?;
        }
        // Everything live was written, so more written than live means some are gone.
        if self.written.statuses.len() > self.mesh.statuses().len() {
            let gone: Vec<String> = self
                .written
                .statuses
                .keys()
                .filter(|id| self.mesh.status(id).is_none())
                .cloned()
                .collect();
            for key in &gone {
                self.write_status(rt, key)?;
            }
        }
        // No-op writes are suppressed.
        self.write_network_specs(rt, s, identity.spec.address)?;
        let mut keys: BTreeSet<String> = self.written.endpoints.keys().cloned().collect();
        if s.harvest_extra_endpoints {
            keys.extend(self.mesh.statuses().keys().cloned());
        }
        for key in &keys {
            self.write_harvested(rt, s, key)?;
        }
        self.write_manager_status(rt, s)?;
        if let Some(metrics) = self.deps.metrics.as_ref().filter(|_| read) {
            let figures: Vec<PeerFigures> = self
                .mesh
                .statuses()
                .iter()
                .map(|(k, st)| PeerFigures {
                    public_key: k.clone(),
                    label: st.label.clone(),
                    state: st.state.as_str(),
                    handshake_age: st
                        .last_handshake_time
                        .and_then(|t| now.duration_since(t).ok())
                        .map(|d| d.as_secs_f64()),
                    rx: st.receive_bytes,
                    tx: st.transmit_bytes,
                    path: st.path.as_str(),
                })
                .collect();
            metrics.set_peers(&figures);
        }
        Ok(())
    }

    /// Turns reverse-path filtering off on the mesh link (now that it exists; see
    /// `wirespan_dataplane::sysctl`), or again after drift; refuses, naming the
    /// sysctl, if it cannot or if host-wide filtering would override it.
    async fn rp_filter_off(&mut self, link: &str) -> Result<(), ControllerError> {
        let Some(sysctl) = self.deps.sysctl.clone() else {
            return Ok(());
        };
        let link = link.to_owned();
        let (rp, res) = blocking(self.kernel.rp_filter.take(), move |rp| match rp {
            Some(rp) => rp.ensure(&*sysctl).map(drop),
            None => MeshRpFilter::apply(&*sysctl, &link).map(|r| {
                if let Some(previous) = r.previous() {
                    tracing::info!(
                        link,
                        previous,
                        "reverse-path filtering turned off on the mesh link (rp_filter=0)"
                    );
                }
                *rp = Some(r);
            }),
        })
        .await?;
        self.kernel.rp_filter = rp;
        res.map_err(|e| ControllerError::other(ManagerError::Sysctl(e)))
    }

    fn ensure_marking(&mut self, configured: FastPath, link: &str) -> &mut ActiveMarking {
        if self
            .kernel
            .marking
            .as_ref()
            .is_some_and(|m| m.configured != configured || m.link != link)
        {
            // A fast-path change: the new adapter replaces the table it finds.
            self.kernel.marking = None;
        }
        self.kernel.marking.get_or_insert_with(|| {
            let c = self.deps.marking.create(configured, link);
            if !c.note.is_empty() {
                tracing::warn!(configured = ?configured, in_use = ?c.fast_path, note = %c.note, "marking fast path fallback");
            }
            ActiveMarking {
                marking: c.marking,
                configured,
                link: link.to_owned(),
                in_use: c.fast_path,
                note: c.note,
            }
        })
    }
}
