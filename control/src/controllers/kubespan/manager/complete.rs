//! The complete round (`docs/kubespan.md` §8.2): every peer stepped against what the device
//! reports (when it is read), the whole device and marking set applied, every output
//! written, and the marking adapter chosen for the configured fast path.

use std::{
    collections::{btree_map::Entry, BTreeSet, HashMap, HashSet},
    net::IpAddr,
    sync::Arc,
    time::{Duration, SystemTime},
};

use ipnet::IpNet;
use wirespan_dataplane::{
    marking::{MarkingSpec, DEFAULT_TABLE},
    sysctl::MeshRpFilter,
    wireguard::{PresharedKey, PrivateKey, PublicKey, WgDevice, WgPeer},
};

use super::{
    blocking, keepalive,
    relay::{relay_user, relayed_keepalive, relayed_wake, set_path},
    wg_error, ActiveMarking, KubeSpanManagerController, ManagerError, Retained, RETAIN_AFTER_START,
};
use crate::{
    config::kubespan::{FastPath, KubeSpanConfig as Settings},
    controllers::kubespan::metrics::PeerFigures,
    kubespan::{
        peers::routed_prefixes,
        prefixset::PrefixSet,
        rotation::{
            next_wake, note_listing, peer_state, rx_window, seed, step, unlisted_until, Observed,
            RxRule, RxTrack, RECONCILE_TICK,
        },
    },
    resources::{
        cluster::ClusterIdentity,
        kubespan::{
            KubeSpanIdentity, KubeSpanPeerSpec, KubeSpanPeerStatusSpec, KubeSpanRelayEndpoint,
            PeerPath, PeerState, NS,
        },
    },
    runtime::{ControllerError, ControllerRuntime, Resource},
};

impl KubeSpanManagerController {
    /// A complete round (see [`Self::reconcile`]); `read`: read the device first.
    #[allow(clippy::too_many_lines)]
    pub(super) async fn complete_round(
        &mut self,
        rt: &mut ControllerRuntime,
        s: &Settings,
        identity: &Resource<KubeSpanIdentity>,
        cluster: &Resource<ClusterIdentity>,
        read: bool,
    ) -> Result<Option<SystemTime>, ControllerError> {
        if self.wg_link != s.link_name {
            if self.wg.is_some() {
                tracing::info!(old = %self.wg_link, new = %s.link_name, "mesh link renamed");
                self.teardown_kernel().await;
            }
            self.wg = None;
            self.peers.clear();
            self.wg_link.clone_from(&s.link_name);
        }
        if self.wg.is_none() {
            self.last_read = None;
            let wg = self
                .deps
                .wireguard
                .create(&s.link_name)
                .map_err(|source| wg_error(&s.link_name, source))?;
            self.wg_recreated = wg.recreated();
            self.wg = Some(wg);
        }
        let now = self.deps.clock.now();
        let read = read || self.last_read.is_none();
        // Phase times for the debug log: at 10,000 peers the round takes long enough
        // that where it goes matters (see `choose_round`).
        let started = std::time::Instant::now();
        // Probe replies are taken before the device is read: a reply the counter shows
        // is then known to be one (§8.6).
        let replied = match self.deps.prober.as_ref() {
            Some(p) if read => p.kernel_replies(),
            _ => HashSet::new(),
        };

        // §8.2 step 2: what the device reports.
        let observed = if read {
            let wg = self
                .wg
                .take()
                .unwrap_or_else(|| unreachable!("created above"));
            let (wg, observed) = blocking(wg, |w| w.observe()).await?;
            self.wg = Some(wg);
            self.last_read = Some(now);
            Some(observed)
        } else {
            None
        };
        let observed: Option<HashMap<String, Retained>> =
            observed.map(|observed| match observed {
                Ok(st) if st.present => st
                    .peers
                    .into_iter()
                    .map(|p| {
                        (
                            p.public_key.to_base64(),
                            Retained {
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
                    tracing::warn!(link = %s.link_name, error = %e, "reading the WireGuard device failed");
                    HashMap::new()
                }
            });
        let t_read = started.elapsed();
        if let Some(o) = observed.as_ref().filter(|_| !self.adopt_checked) {
            // The first read since start: peers already there were kept by an earlier
            // run (`--on-stop keep`); they are adopted, not replaced.
            self.adopt_checked = true;
            if !o.is_empty() {
                tracing::info!(link = %s.link_name, peers = o.len(), "adopting the peers the WireGuard device kept");
                self.retain_until = Some(now + RETAIN_AFTER_START);
            }
        }

        // Step 1, 3–5: statuses and desired endpoints.
        self.own_key = PublicKey::from_base64("publicKey", &identity.spec.public_key).ok();
        let psk = PresharedKey::from_bytes(*cluster.spec.secret.bytes());
        // Listed peers first, then those kept though unlisted (see `unlisted`).
        let specs: Vec<Arc<Resource<KubeSpanPeerSpec>>> = self
            .specs
            .values()
            .chain(self.unlisted.values())
            .cloned()
            .collect();
        let mut stale: Vec<String> = Vec::new();
        let force = !s.allow_down_peer_bypass;
        let mut stepped: Vec<(String, WgPeer, Option<std::net::SocketAddr>)> =
            Vec::with_capacity(specs.len());
        let mut probes: Vec<IpAddr> = Vec::new();
        for r in &specs {
            let key = &r.metadata.id;
            let Some(base) = self.peer_of(key, &r.spec, &psk, s) else {
                continue;
            };
            // Without a read (or without the peer on the device) the status keeps its
            // last observation.
            let seen = observed
                .as_ref()
                .and_then(|o| o.get(key))
                .map(|r| &r.observed);
            let st = match self.statuses.entry(key.clone()) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => {
                    let mut st = KubeSpanPeerStatusSpec {
                        label: r.spec.label.clone(),
                        ..KubeSpanPeerStatusSpec::default()
                    };
                    // A peer the device already has (kept by an earlier run).
                    if let Some(o) = seen.or_else(|| self.retained.get(key).map(|r| &r.observed)) {
                        seed(&mut st, o);
                    }
                    e.insert(st)
                }
            };
            let window = rx_window_of(s, &r.spec);
            let mut track = rx_track(
                &mut self.rx,
                key,
                window,
                seen.map_or(0, |o| o.rx_bytes),
                now,
            );
            if let (Some(t), Some(addr)) = (track.as_deref_mut(), r.spec.address) {
                t.note_reply(replied.contains(&addr));
            }
            let rule = track
                .as_deref_mut()
                .zip(window)
                .map(|(track, window)| RxRule { track, window });
            let step = step(st, &r.spec.endpoints, seen, now, s.peer_down_interval, rule);
            if !note_listing(st, !self.unlisted.contains_key(key), now) {
                stale.push(key.clone());
                continue;
            }
            if let (Some(t), Some(w)) = (track, window) {
                if st.state == PeerState::Up && t.take_probe(now, w) {
                    probes.extend(r.spec.address);
                }
            }
            if relay_user(s, &r.spec) {
                // Up through the server relay says nothing of the direct path.
                let state = st.state;
                let device_endpoint = seen.and_then(|o| o.endpoint);
                let on_server = self.on_server_relay(key, &r.spec.endpoints, device_endpoint);
                if !(on_server && state == PeerState::Up) {
                    self.direct
                        .entry(key.clone())
                        .or_default()
                        .observe(state, now);
                }
            } else {
                self.direct.remove(key);
            }
            stepped.push((key.clone(), base, step.desired_endpoint));
        }

        for key in &stale {
            self.drop_unlisted(key);
        }
        self.yield_to_listed(&mut stepped);
        let t_judged = started.elapsed();
        // §8.7: peers not reachable directly go through a relay both ends choose alike;
        // §8.8: those without one through the server relay, where it granted one.
        let relays = self.choose_relays(s, now);
        let allocations: HashMap<String, std::net::SocketAddr> = rt
            .list::<KubeSpanRelayEndpoint>(NS)?
            .iter()
            .filter_map(|r| Some((r.metadata.id.clone(), r.spec.endpoint?)))
            .collect();
        self.server_relays(&allocations, &relays, s.peer_receive_timeout, now);
        let mut wg_peers = Vec::with_capacity(stepped.len());
        let (mut v4, mut v6) = (Vec::new(), Vec::new());
        let mut routed = HashMap::with_capacity(stepped.len());
        let mut wake: Option<SystemTime> = None;
        let mut at: HashMap<&str, usize> = HashMap::with_capacity(stepped.len());
        for (key, base, desired_endpoint) in &stepped {
            let relay = relays.get(key);
            let server = self.server_relayed.get(key);
            let via = relay
                .and_then(|r| self.statuses.get(r))
                .map(|r| r.label.clone())
                .or_else(|| server.map(|r| r.endpoint.to_string()));
            let Some(st) = self.statuses.get_mut(key) else {
                continue;
            };
            let path = match (st.state, relay, server) {
                (_, Some(_), _) => PeerPath::Relay,
                (_, None, Some(_)) => PeerPath::Server,
                (PeerState::Up, None, None) => PeerPath::Direct,
                _ => PeerPath::None,
            };
            set_path(self.deps.metrics.as_deref(), key, st, path);
            st.via = via.unwrap_or_default();
            let window = self
                .specs
                .get(key)
                .or_else(|| self.unlisted.get(key))
                .and_then(|r| rx_window_of(s, &r.spec));
            let rx = self.rx.get(key).zip(window);
            let next = if relay.is_some() {
                relayed_wake(st, now)
            } else if let Some(r) = server {
                r.wake(now)
                    .into_iter()
                    .chain(next_wake(st, now, s.peer_down_interval, rx))
                    .min()
            } else {
                next_wake(st, now, s.peer_down_interval, rx)
            };
            let down_at = self
                .direct
                .get(key)
                .and_then(|d| d.down_at(now, s.peer_receive_timeout));
            // A kept peer is dropped when its session is too old to carry data.
            let stale_at = if st.retained_reason.is_empty() {
                None
            } else {
                unlisted_until(st)
            };
            for w in next.into_iter().chain(down_at).chain(stale_at) {
                wake = Some(wake.map_or(w, |x: SystemTime| x.min(w)));
            }
            // Through the server relay only once handshakes through it work: a relay
            // allocation says nothing of whether the peer is alive.
            let reachable = st.state == PeerState::Up || relay.is_some();
            let prefixes = routed_prefixes(force, &base.allowed_ips, reachable);
            for p in &prefixes {
                match p {
                    IpNet::V4(_) => v4.push(*p),
                    IpNet::V6(_) => v6.push(*p),
                }
            }
            routed.insert(key.clone(), prefixes);
            let persistent_keepalive = if relay.is_some() {
                relayed_keepalive(base.persistent_keepalive, st, now)
            } else if let Some(r) = server {
                r.keepalive(base.persistent_keepalive, now)
            } else {
                keepalive(self.own_key.as_ref(), base, st, now)
            };
            at.insert(key, wg_peers.len());
            wg_peers.push(WgPeer {
                endpoint: server.map(|r| r.endpoint).or(*desired_endpoint),
                persistent_keepalive,
                ..base.clone()
            });
        }
        // A relayed peer's prefixes move to its relay's WireGuard peer; the peer keeps
        // its endpoint and keepalive, which retry the direct path.
        for (peer, relay) in &relays {
            let (Some(&p), Some(&r)) = (at.get(peer.as_str()), at.get(relay.as_str())) else {
                continue;
            };
            let moved = std::mem::take(&mut wg_peers[p].allowed_ips);
            wg_peers[r].allowed_ips.extend(moved);
        }
        self.note_relays(relays, now, s.peer_receive_timeout);

        if let Some(prober) = self.deps.prober.as_ref().filter(|_| !probes.is_empty()) {
            tracing::debug!(peers = probes.len(), "probing wirespan peers");
            for to in probes {
                prober.probe(to);
            }
        }

        self.retain_device_peers(
            observed.as_ref(),
            &psk,
            (force, s.peer_down_interval),
            now,
            &mut wg_peers,
            &mut routed,
        );
        for p in self.retained.keys().filter_map(|k| routed.get(k)).flatten() {
            match p {
                IpNet::V4(_) => v4.push(*p),
                IpNet::V6(_) => v6.push(*p),
            }
        }

        // Statuses of peers that went away: every spec has a status now, so there are
        // more statuses than specs exactly when some are stale (no lookups otherwise).
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

        // Step 6: device, routed set, statuses.
        let device = WgDevice {
            name: s.link_name.clone(),
            private_key: PrivateKey::from_bytes(*identity.spec.private_key.bytes()),
            listen_port: s.listen_port,
            fwmark: s.device_mark,
            peers: wg_peers,
        };
        let wg = self.wg.take().unwrap_or_else(|| unreachable!("set above"));
        let (wg, res) = blocking(wg, move |w| w.apply(&device)).await?;
        self.wg = Some(wg);
        res.map_err(|source| wg_error(&s.link_name, source))?;
        let t_wireguard = started.elapsed();
        self.rp_filter_off(&s.link_name).await?;
        let marking_spec = MarkingSpec {
            table: DEFAULT_TABLE.to_owned(),
            device_mark: s.device_mark,
            mark: s.route_mark,
            mask: s.mark_mask,
            mtu: s.mtu,
            prefixes_v4: v4,
            prefixes_v6: v6,
            ..MarkingSpec::default()
        };
        let marked = (
            marking_spec.prefixes_v4.len(),
            marking_spec.prefixes_v6.len(),
        );
        self.ensure_marking(s.fast_path, &s.link_name);
        let m = self
            .marking
            .take()
            .unwrap_or_else(|| unreachable!("set above"));
        let (m, res) = blocking(m, move |m| m.marking.apply(&marking_spec)).await?;
        self.marking = Some(m);
        res.map_err(|e| ControllerError::other(ManagerError::Marking(e)))?;
        if let (Some(metrics), Some(m)) = (&self.deps.metrics, &self.marking) {
            let in_use = match m.in_use {
                FastPath::Nftables => "nftables",
                FastPath::Ebpf => "ebpf",
            };
            metrics.set_marking(in_use, m.in_use != m.configured, marked.0, marked.1);
        }
        self.routed = routed;
        let t_marking = started.elapsed();

        let keys: Vec<String> = self.statuses.keys().cloned().collect();
        for key in &keys {
            self.write_status(rt, key)?;
        }
        // Everything live was written, so more written than live means some are gone.
        if self.written_statuses.len() > self.statuses.len() {
            let gone: Vec<String> = self
                .written_statuses
                .keys()
                .filter(|id| !self.statuses.contains_key(*id))
                .cloned()
                .collect();
            for key in &gone {
                self.write_status(rt, key)?;
            }
        }

        // Step 7: link, address, routes, rules (no-op writes are suppressed).
        self.write_network_specs(rt, s, identity.spec.address)?;

        // §9 harvest.
        let mut keys: BTreeSet<String> = self.written_endpoints.keys().cloned().collect();
        if s.harvest_extra_endpoints {
            keys.extend(self.statuses.keys().cloned());
        }
        for key in &keys {
            self.write_harvested(rt, s, key)?;
        }

        self.write_manager_status(rt, s)?;

        if let Some(metrics) = self.deps.metrics.as_ref().filter(|_| read) {
            let figures: Vec<PeerFigures> = self
                .statuses
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
        tracing::debug!(
            peers = self.statuses.len(),
            read,
            ?t_read,
            ?t_judged,
            ?t_wireguard,
            ?t_marking,
            total = ?started.elapsed(),
            "complete round (cumulative phase times)"
        );
        self.wake = wake;
        let tick = now + RECONCILE_TICK;
        Ok(Some(wake.map_or(tick, |w| w.min(tick))))
    }

    /// Keeps the device's peers without a spec while within [`RETAIN_AFTER_START`]
    /// (see [`Retained`]): adds them to `wg_peers` as the device has them, with their
    /// routed prefixes, minus any prefix a peer with a spec claims (WireGuard gives a
    /// prefix to one peer only; two claimants would take it from each other on every
    /// write).
    fn retain_device_peers(
        &mut self,
        observed: Option<&HashMap<String, Retained>>,
        psk: &PresharedKey,
        (force, down_interval): (bool, Duration),
        now: SystemTime,
        wg_peers: &mut Vec<WgPeer>,
        routed: &mut HashMap<String, Vec<IpNet>>,
    ) {
        if self.retain_until.is_none_or(|t| now >= t) {
            if !self.retained.is_empty() {
                tracing::info!(
                    peers = self.retained.len(),
                    "dropping device peers that got no spec since start"
                );
            }
            self.retain_until = None;
            self.retained.clear();
            return;
        }
        match observed {
            Some(o) => {
                self.retained = o
                    .iter()
                    .filter(|(k, _)| {
                        !self.specs.contains_key(*k) && !self.unlisted.contains_key(*k)
                    })
                    .map(|(k, r)| (k.clone(), r.clone()))
                    .collect();
            }
            None => self
                .retained
                .retain(|k, _| !self.specs.contains_key(k) && !self.unlisted.contains_key(k)),
        }
        if self.retained.is_empty() {
            return;
        }
        let mut claimed = PrefixSet::new();
        for p in wg_peers.iter().flat_map(|p| &p.allowed_ips) {
            claimed.insert(p);
        }
        for (key, r) in &self.retained {
            let Ok(public_key) = PublicKey::from_base64("publicKey", key) else {
                continue;
            };
            let mut kept = PrefixSet::new();
            for p in &r.allowed_ips {
                kept.insert(p);
            }
            kept.subtract(&claimed);
            let allowed_ips = kept.to_prefixes();
            let up = peer_state(
                now,
                r.observed.last_handshake,
                None,
                r.observed.endpoint,
                down_interval,
            ) == PeerState::Up;
            routed.insert(key.clone(), routed_prefixes(force, &allowed_ips, up));
            wg_peers.push(WgPeer {
                public_key,
                preshared_key: Some(psk.clone()),
                persistent_keepalive: r.keepalive,
                endpoint: None,
                allowed_ips,
            });
        }
    }

    /// Turns reverse-path filtering off on the mesh link (now that it exists; see
    /// `wirespan_dataplane::sysctl`), or again after drift; refuses, naming the
    /// sysctl, if it cannot or if host-wide filtering would override it.
    async fn rp_filter_off(&mut self, link: &str) -> Result<(), ControllerError> {
        let Some(sysctl) = self.deps.sysctl.clone() else {
            return Ok(());
        };
        let link = link.to_owned();
        let (rp, res) = blocking(self.rp_filter.take(), move |rp| match rp {
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
        self.rp_filter = rp;
        res.map_err(|e| ControllerError::other(ManagerError::Sysctl(e)))
    }

    fn ensure_marking(&mut self, configured: FastPath, link: &str) -> &mut ActiveMarking {
        if self
            .marking
            .as_ref()
            .is_some_and(|m| m.configured != configured || m.link != link)
        {
            // A fast-path change: the new adapter replaces the table it finds.
            self.marking = None;
        }
        self.marking.get_or_insert_with(|| {
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

/// The receive tracking of a peer with a receive `window` (started at `rx_bytes`), or
/// none for a Talos peer, whose tracking is dropped.
pub(super) fn rx_track<'a>(
    rx: &'a mut HashMap<String, RxTrack>,
    key: &str,
    window: Option<Duration>,
    rx_bytes: u64,
    now: SystemTime,
) -> Option<&'a mut RxTrack> {
    if window.is_some() {
        Some(
            rx.entry(key.to_owned())
                .or_insert_with(|| RxTrack::new(rx_bytes, now)),
        )
    } else {
        rx.remove(key);
        None
    }
}

/// The receive window of a peer: `None` for a Talos peer (no wirespan extension).
pub(super) fn rx_window_of(
    s: &Settings,
    spec: &crate::resources::kubespan::KubeSpanPeerSpecSpec,
) -> Option<Duration> {
    spec.wirespan.as_ref().map(|w| {
        rx_window(
            s.peer_receive_timeout,
            Duration::from_secs(u64::from(w.persistent_keepalive_secs)),
        )
    })
}
