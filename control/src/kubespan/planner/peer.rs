//! The per-peer judgement both rounds share: `judge` steps a peer's status (§8.2 steps
//! 1–5, §8.6, §8.10), `program` decides what the device and the marking set get for it
//! (path, wake-up, routed prefixes, keepalive, endpoint: §7, §8.5, §8.7, §8.8).

use std::{
    collections::{btree_map::Entry, BTreeMap, HashMap},
    net::{IpAddr, SocketAddr},
    time::{Duration, SystemTime},
};

use ipnet::IpNet;
use wirespan_dataplane::wireguard::{PresharedKey, PublicKey, WgPeer};

use super::{
    relay::{relayed_keepalive, relayed_wake, ServerRelayed},
    MeshState, PathChange, PERSISTENT_KEEPALIVE,
};
use crate::{
    config::kubespan::KubeSpanConfigDocument as Settings,
    kubespan::{
        peer_status::PeerStatus,
        peers::routed_prefixes,
        relay::DirectPath,
        rotation::{
            defers_first_handshake, next_wake, note_listing, rx_window, seed, step, unlisted_until,
            wirespan_keepalive, Observed, RxRule, RxTrack,
        },
    },
    resources::kubespan::{KubeSpanPeerSpecSpec, PeerPath, PeerState},
};

/// What a round knows of one peer besides its status.
#[derive(Debug, Clone, Copy)]
pub(super) struct Facts<'a> {
    /// Its public key.
    pub key: &'a str,
    /// Its spec (the last one, for a peer kept unlisted).
    pub spec: &'a KubeSpanPeerSpecSpec,
    /// Listed by discovery (else kept unlisted, §8.10).
    pub listed: bool,
    /// What this round's read shows of it (`None`: no read, or not on the device).
    pub seen: Option<Observed>,
    /// What a new status starts from: the peer as the device held it at start (§6.8).
    pub held: Option<Observed>,
    /// Whether its kernel answered a probe since the last read.
    pub replied: bool,
    /// Whether the round may probe it. Delta rounds do not: they judge by the last
    /// read, and a passed wake-up makes the next round a complete one.
    pub may_probe: bool,
}

/// The outcome of [`judge`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Judged {
    /// The endpoint to program (`None`: keep WireGuard's).
    pub desired_endpoint: Option<SocketAddr>,
    /// The peer stays (always when listed; while its session is fresh otherwise).
    pub stays: bool,
    /// Its mesh address, to probe now.
    pub probe: Option<IpAddr>,
}

/// Steps one peer's status: a new status (seeded from what the device held), the
/// receive window of a wirespan peer, the rotation step, listing, and whether to probe.
pub(super) fn judge(
    statuses: &mut BTreeMap<String, PeerStatus>,
    rx: &mut HashMap<String, RxTrack>,
    f: &Facts<'_>,
    s: &Settings,
    now: SystemTime,
) -> Judged {
    let st = match statuses.entry(f.key.to_owned()) {
        Entry::Occupied(e) => e.into_mut(),
        Entry::Vacant(e) => {
            let mut st = PeerStatus {
                label: f.spec.label.clone(),
                ..PeerStatus::default()
            };
            // A peer the device already has (kept by an earlier run): its status starts
            // from it (no endpoint pushed over a working one).
            if let Some(o) = f.seen.as_ref().or(f.held.as_ref()) {
                seed(&mut st, o);
            }
            e.insert(st)
        }
    };
    let window = rx_window_of(s, f.spec);
    let mut track = rx_track(rx, f.key, window, f.seen.map_or(0, |o| o.rx_bytes), now);
    if let Some(t) = track.as_deref_mut().filter(|_| f.spec.address.is_some()) {
        t.note_reply(f.replied);
    }
    let rule = track
        .as_deref_mut()
        .zip(window)
        .map(|(track, window)| RxRule { track, window });
    let stepped = step(
        st,
        &f.spec.endpoints,
        f.seen.as_ref(),
        now,
        s.peer_down_interval,
        rule,
    );
    let stays = note_listing(st, f.listed, now);
    let mut probe = None;
    if let (true, true, Some(t), Some(w)) = (stays, f.may_probe, track, window) {
        if st.state == PeerState::Up && t.take_probe(now, w) {
            probe = f.spec.address;
        }
    }
    Judged {
        desired_endpoint: stepped.desired_endpoint,
        stays,
        probe,
    }
}

/// How a peer's traffic goes this round besides directly (§8.7, §8.8).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Route<'a> {
    /// Through this peer relay: its label.
    pub relay: Option<&'a str>,
    /// Through the server relay.
    pub server: Option<&'a ServerRelayed>,
}

/// The outcome of [`program`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Programmed {
    /// The WireGuard peer (a relayed peer's prefixes still to be moved to its relay).
    pub peer: WgPeer,
    /// Its part of the routed set.
    pub routed: Vec<IpNet>,
    /// When to look at it again.
    pub wake: Option<SystemTime>,
}

/// What else [`program`] takes of the peer.
#[derive(Debug, Clone, Copy)]
pub(super) struct Programming<'a> {
    /// Its public key.
    pub key: &'a str,
    /// Its WireGuard peer without endpoint.
    pub base: &'a WgPeer,
    /// The endpoint [`judge`] wants.
    pub desired_endpoint: Option<SocketAddr>,
    /// Its receive tracking and window (wirespan peers).
    pub rx: Option<(&'a RxTrack, Duration)>,
    /// Its direct path (peers that take part in relays).
    pub direct: Option<&'a DirectPath>,
    /// How its traffic goes.
    pub route: Route<'a>,
}

/// Decides what the device and the marking set get for a judged peer, and sets the
/// status's path and via: its endpoint and keepalive, its routed prefixes (§7; a
/// relayed peer is reachable through its relay, a server-relayed one once handshakes
/// through the relay work), and its next wake-up (§8.5).
pub(super) fn program(
    st: &mut PeerStatus,
    p: &Programming<'_>,
    own_key: Option<&PublicKey>,
    s: &Settings,
    now: SystemTime,
    path_changes: &mut Vec<PathChange>,
) -> Programmed {
    let Route { relay, server } = p.route;
    let path = match (st.state, relay, server) {
        (_, Some(_), _) => PeerPath::Relay,
        (_, None, Some(_)) => PeerPath::Server,
        (PeerState::Up, None, None) => PeerPath::Direct,
        _ => PeerPath::None,
    };
    if path != st.path {
        path_changes.push(PathChange {
            key: p.key.to_owned(),
            label: st.label.clone(),
        });
        st.path = path;
    }
    st.via = relay
        .map(str::to_owned)
        .or_else(|| server.map(|r| r.endpoint.to_string()))
        .unwrap_or_default();
    let next = if relay.is_some() {
        relayed_wake(st, now)
    } else if let Some(r) = server {
        r.wake(now)
            .into_iter()
            .chain(next_wake(st, now, s.peer_down_interval, p.rx))
            .min()
    } else {
        next_wake(st, now, s.peer_down_interval, p.rx)
    };
    let down_at = p
        .direct
        .and_then(|d| d.down_at(now, s.peer_receive_timeout));
    // A kept peer is dropped when its session is too old to carry data.
    let stale_at = if st.retained_reason.is_empty() {
        None
    } else {
        unlisted_until(st)
    };
    let wake = next.into_iter().chain(down_at).chain(stale_at).min();
    // Through the server relay only once handshakes through it work: a relay
    // allocation says nothing of whether the peer is alive.
    let reachable = st.state == PeerState::Up || relay.is_some();
    let routed = routed_prefixes(!s.allow_down_peer_bypass, &p.base.allowed_ips, reachable);
    let persistent_keepalive = if relay.is_some() {
        relayed_keepalive(p.base.persistent_keepalive, st, now)
    } else if let Some(r) = server {
        r.keepalive(p.base.persistent_keepalive, now)
    } else {
        keepalive(own_key, p.base, st, now)
    };
    Programmed {
        peer: WgPeer {
            endpoint: server.map(|r| r.endpoint).or(p.desired_endpoint),
            persistent_keepalive,
            ..p.base.clone()
        },
        routed,
        wake,
    }
}

/// The keepalive to program for a peer now (0 while its first handshake is deferred).
fn keepalive(
    own_key: Option<&PublicKey>,
    peer: &WgPeer,
    status: &PeerStatus,
    now: SystemTime,
) -> u16 {
    let defer = own_key.is_some_and(|own| {
        defers_first_handshake(own.as_bytes(), peer.public_key.as_bytes(), status, now)
    });
    if defer {
        0
    } else {
        peer.persistent_keepalive
    }
}

/// The receive tracking of a peer with a receive `window` (started at `rx_bytes`), or
/// none for a Talos peer, whose tracking is dropped.
fn rx_track<'a>(
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
pub(super) fn rx_window_of(s: &Settings, spec: &KubeSpanPeerSpecSpec) -> Option<Duration> {
    spec.wirespan.as_ref().map(|w| {
        rx_window(
            s.peer_receive_timeout,
            Duration::from_secs(u64::from(w.persistent_keepalive_secs)),
        )
    })
}

impl MeshState {
    /// The WireGuard peer for a spec, without endpoint (cached while the spec and the
    /// secret stay); `None` for a spec whose id is not a public key.
    pub(super) fn peer_of(
        &mut self,
        key: &str,
        spec: &KubeSpanPeerSpecSpec,
        psk: &PresharedKey,
        s: &Settings,
    ) -> Option<WgPeer> {
        let persistent_keepalive = if spec.wirespan.is_some() {
            wirespan_keepalive(s.peer_receive_timeout)
        } else {
            PERSISTENT_KEEPALIVE
        };
        if let Some((cached, peer)) = self.peers.get(key) {
            if cached == spec
                && peer.preshared_key.as_ref() == Some(psk)
                && peer.persistent_keepalive == persistent_keepalive
            {
                return Some(peer.clone());
            }
        }
        let Ok(public_key) = PublicKey::from_base64("publicKey", key) else {
            tracing::warn!(peer = ?key, "peer spec id is not a WireGuard public key; skipped");
            return None;
        };
        let peer = WgPeer {
            public_key,
            preshared_key: Some(psk.clone()),
            persistent_keepalive,
            endpoint: None,
            allowed_ips: spec.allowed_ips.clone(),
        };
        self.peers
            .insert(key.to_owned(), (spec.clone(), peer.clone()));
        Some(peer)
    }
}
