//! The planner on a fake clock: each per-peer rule of `docs/kubespan.md` is a case of
//! one table, driven through complete rounds (times are milliseconds after a fixed
//! start; nothing sleeps).

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::{Duration, SystemTime},
};

use ipnet::IpNet;
use wirespan_dataplane::wireguard::{PeerChange, PresharedKey, PublicKey, WgPeer};

use super::{
    CompleteInputs, DevicePeer, MarkingPlan, MeshState, Plan, WireGuardPlan, RETAIN_AFTER_START,
};
use crate::{
    config::kubespan::KubeSpanConfigDocument as Settings,
    kubespan::rotation::{Observed, UNLISTED_KEPT},
    resources::{
        cluster::WirespanAffiliateSpec,
        kubespan::{KubeSpanPeerSpec, KubeSpanPeerSpecSpec, PeerPath, PeerState, NS},
    },
    runtime::{Changes, Resource},
};

/// The peer's endpoints, then the server relay's endpoint for this node.
const EP: [&str; 4] = [
    "192.0.2.1:51820",
    "192.0.2.2:51820",
    "192.0.2.3:51820",
    "198.51.100.1:3478",
];
const RELAY: usize = 3;
const PREFIX: &str = "10.0.0.2/32";
/// The peer's KubeSpan ULA: in its AllowedIPs, never in the routed set (§7).
const ULA: &str = "fd7f:175a:b97c:5602::2/128";
const MESH_ADDRESS: &str = "fd7f:175a:b97c:5602::2";

fn t(ms: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000) + Duration::from_millis(ms)
}

fn ep(i: usize) -> SocketAddr {
    EP[i].parse().unwrap()
}

fn key(b: u8) -> String {
    PublicKey::from_bytes([b; 32]).to_base64()
}

/// The peer's key: between the two own keys the cases use.
const PEER: u8 = 0x50;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Talos,
    Wirespan,
    /// A wirespan peer that takes part in relays.
    RelayUser,
}

/// How a case is set up.
#[derive(Debug, Clone, Copy)]
struct Setup {
    kind: Kind,
    /// `allowDownPeerBypass`.
    bypass: bool,
    /// This node's key is higher than the peer's (it defers first handshakes).
    own_higher: bool,
    /// The server relay granted an allocation for the peer.
    allocation: bool,
}

const TALOS: Setup = Setup {
    kind: Kind::Talos,
    bypass: false,
    own_higher: false,
    allocation: false,
};
const WIRESPAN: Setup = Setup {
    kind: Kind::Wirespan,
    ..TALOS
};

/// One step of a case.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// A complete round at this time, reading the device.
    Read(u64, Device),
    /// A complete round at this time without a read.
    NoRead(u64),
    /// Discovery stops listing the peer (then a round without a read at this time).
    Unlist(u64),
}

/// What the device shows of the peer.
#[derive(Debug, Clone, Copy)]
enum Device {
    /// Not on the device.
    Absent,
    /// On it: endpoint (index into `EP`), last handshake (ms), received bytes.
    Peer(Option<usize>, Option<u64>, u64),
}

/// What the last round must show; `None` fields are not checked.
#[derive(Debug, Clone, Copy)]
struct Want {
    state: PeerState,
    /// The endpoint programmed (index into `EP`; `None`: WireGuard's is kept).
    endpoint: Option<usize>,
    /// The peer's prefix is in the marking set.
    routed: bool,
    keepalive: u16,
    path: PeerPath,
    /// The earliest wake-up (ms).
    wake: Option<Option<u64>>,
    /// Probes the last round sends.
    probes: usize,
    /// The status says the peer is kept though unlisted.
    retained: bool,
}

const UP: Want = Want {
    state: PeerState::Up,
    endpoint: Some(0),
    routed: true,
    keepalive: 25,
    path: PeerPath::Direct,
    wake: None,
    probes: 0,
    retained: false,
};
const UNKNOWN: Want = Want {
    state: PeerState::Unknown,
    path: PeerPath::None,
    ..UP
};

struct Case {
    rule: &'static str,
    setup: Setup,
    steps: &'static [Step],
    /// `None`: the peer is gone (no status, no device peer, no routes).
    want: Option<Want>,
}

use Device::{Absent, Peer};
use Step::{NoRead, Read, Unlist};

/// Pushed at 0, handshake at 500, counter moved by 1000: a wirespan peer that is up.
const WIRESPAN_UP: [Step; 2] = [Read(0, Absent), Read(1_000, Peer(Some(0), Some(500), 100))];

#[allow(clippy::too_many_lines)]
fn cases() -> Vec<Case> {
    vec![
        Case {
            rule: "§8.2 step 4: a new peer gets its first endpoint and is unknown, re-read every second",
            setup: TALOS,
            steps: &[Read(0, Absent)],
            want: Some(Want { wake: Some(Some(1_000)), ..UNKNOWN }),
        },
        Case {
            rule: "§8.3: a handshake after the push within 15 s is up; looked at again just after it would turn down",
            setup: TALOS,
            steps: &[Read(0, Absent), Read(2_000, Peer(Some(0), Some(1_500), 100))],
            want: Some(Want { wake: Some(Some(1_500 + 276_000)), ..UP }),
        },
        Case {
            rule: "§8.3, §8.4: no handshake 15 s after the push is down: the next endpoint is pushed",
            setup: TALOS,
            steps: &[Read(0, Absent), Read(15_000, Peer(Some(0), None, 0))],
            want: Some(Want { endpoint: Some(1), wake: Some(Some(16_000)), ..UNKNOWN }),
        },
        Case {
            rule: "§8.3: an up peer turns down 275 s after its last handshake and rotates",
            setup: TALOS,
            steps: &[
                Read(0, Absent),
                Read(2_000, Peer(Some(0), Some(1_500), 100)),
                Read(277_500, Peer(Some(0), Some(1_500), 100)),
            ],
            want: Some(Want { endpoint: Some(1), ..UNKNOWN }),
        },
        Case {
            rule: "§8.2 step 5: WireGuard roamed elsewhere: its endpoint is kept (none programmed)",
            setup: TALOS,
            steps: &[Read(0, Absent), Read(2_000, Peer(Some(2), Some(1_500), 100))],
            want: Some(Want { endpoint: None, ..UP }),
        },
        Case {
            rule: "§8.2 step 5: the device lost the endpoint (recreated): the pushed one is re-applied",
            setup: TALOS,
            steps: &[Read(0, Absent), Read(2_000, Peer(None, None, 0))],
            want: Some(UNKNOWN),
        },
        Case {
            rule: "§8.2: a round without a read judges by the last observation",
            setup: TALOS,
            steps: &[Read(0, Absent), Read(2_000, Peer(Some(0), Some(1_500), 100)), NoRead(3_000)],
            want: Some(UP),
        },
        Case {
            rule: "§7: with forceRouting a peer that is not up is routed (its traffic is dropped, not leaked)",
            setup: TALOS,
            steps: &[Read(0, Absent)],
            want: Some(UNKNOWN),
        },
        Case {
            rule: "§7: with allowDownPeerBypass a peer that is not up is not routed",
            setup: Setup { bypass: true, ..TALOS },
            steps: &[Read(0, Absent)],
            want: Some(Want { routed: false, ..UNKNOWN }),
        },
        Case {
            rule: "§7: with allowDownPeerBypass an up peer is routed",
            setup: Setup { bypass: true, ..TALOS },
            steps: &[Read(0, Absent), Read(2_000, Peer(Some(0), Some(1_500), 100))],
            want: Some(UP),
        },
        Case {
            rule: "§8.5: the higher key holds its keepalive to a never-handshaken peer for 1 s",
            setup: Setup { own_higher: true, ..TALOS },
            steps: &[Read(0, Absent)],
            want: Some(Want { keepalive: 0, ..UNKNOWN }),
        },
        Case {
            rule: "§8.5: after the deferral the higher key initiates too",
            setup: Setup { own_higher: true, ..TALOS },
            steps: &[Read(0, Absent), Read(1_000, Peer(Some(0), None, 0))],
            want: Some(UNKNOWN),
        },
        Case {
            rule: "§8.5: the lower key never defers",
            setup: TALOS,
            steps: &[Read(0, Absent)],
            want: Some(UNKNOWN),
        },
        Case {
            rule: "§8.6: a wirespan peer's keepalive is a third of peerReceiveTimeout",
            setup: WIRESPAN,
            steps: &[Read(0, Absent)],
            want: Some(Want { keepalive: 6, ..UNKNOWN }),
        },
        Case {
            rule: "§8.6: a wirespan peer is probed once when it comes up (does its kernel answer?)",
            setup: WIRESPAN,
            steps: &WIRESPAN_UP,
            want: Some(Want { keepalive: 6, probes: 1, ..UP }),
        },
        Case {
            rule: "§8.6: a counter silent for half the window: probed, still up",
            setup: WIRESPAN,
            steps: &[WIRESPAN_UP[0], WIRESPAN_UP[1], Read(10_000, Peer(Some(0), Some(500), 100))],
            want: Some(Want { keepalive: 6, probes: 1, ..UP }),
        },
        Case {
            rule: "§8.6: silent for the window with the probe's grace passed: down, next endpoint pushed",
            setup: WIRESPAN,
            steps: &[
                WIRESPAN_UP[0],
                WIRESPAN_UP[1],
                Read(10_000, Peer(Some(0), Some(500), 100)),
                Read(22_000, Peer(Some(0), Some(500), 100)),
            ],
            want: Some(Want { endpoint: Some(1), keepalive: 6, ..UNKNOWN }),
        },
        Case {
            rule: "§8.6: a counter that keeps moving keeps the peer up, unprobed",
            setup: WIRESPAN,
            steps: &[
                WIRESPAN_UP[0],
                WIRESPAN_UP[1],
                Read(10_000, Peer(Some(0), Some(500), 200)),
                Read(22_000, Peer(Some(0), Some(500), 300)),
            ],
            want: Some(Want { keepalive: 6, ..UP }),
        },
        Case {
            rule: "§8.3: data since the push on a session that predates it (under 180 s old) is up",
            setup: WIRESPAN,
            steps: &[
                WIRESPAN_UP[0],
                WIRESPAN_UP[1],
                Read(10_000, Peer(Some(0), Some(500), 100)),
                Read(22_000, Peer(Some(0), Some(500), 100)),
                Read(23_000, Peer(Some(1), Some(500), 150)),
            ],
            // Probed at once: the push began a new window.
            want: Some(Want { endpoint: Some(1), keepalive: 6, probes: 1, ..UP }),
        },
        Case {
            rule: "§8.3: a Talos peer is judged by handshakes alone (no receive window)",
            setup: TALOS,
            steps: &[
                Read(0, Absent),
                Read(1_000, Peer(Some(0), Some(500), 100)),
                Read(22_000, Peer(Some(0), Some(500), 100)),
            ],
            want: Some(UP),
        },
        Case {
            rule: "§8.10: an unlisted peer with a fresh session is kept, and says so",
            setup: TALOS,
            steps: &[Read(0, Absent), Read(2_000, Peer(Some(0), Some(1_500), 100)), Unlist(3_000)],
            want: Some(Want { retained: true, wake: Some(Some(1_500 + 180_000)), ..UP }),
        },
        Case {
            rule: "§8.10: a kept peer goes when its session is 180 s old",
            setup: TALOS,
            steps: &[
                Read(0, Absent),
                Read(2_000, Peer(Some(0), Some(1_500), 100)),
                Unlist(3_000),
                Read(181_500, Peer(Some(0), Some(1_500), 100)),
            ],
            want: None,
        },
        Case {
            rule: "§8.10: a peer unlisted without a fresh session goes at once",
            setup: TALOS,
            steps: &[Read(0, Absent), Unlist(1_000)],
            want: None,
        },
        Case {
            rule: "§8.7, §8.8: a relay user down for the window with no peer relay takes the server relay's allocation",
            setup: Setup { kind: Kind::RelayUser, allocation: true, ..TALOS },
            steps: &[Read(0, Absent), Read(15_000, Peer(Some(0), None, 0)), Read(20_000, Peer(Some(1), None, 0))],
            want: Some(Want {
                endpoint: Some(RELAY),
                keepalive: 0,
                path: PeerPath::Server,
                ..UNKNOWN
            }),
        },
        Case {
            rule: "§8.8: a second after the move the keepalive starts a handshake through the relay",
            setup: Setup { kind: Kind::RelayUser, allocation: true, ..TALOS },
            steps: &[
                Read(0, Absent),
                Read(15_000, Peer(Some(0), None, 0)),
                Read(20_000, Peer(Some(1), None, 0)),
                Read(21_000, Peer(Some(RELAY), None, 0)),
            ],
            want: Some(Want {
                endpoint: Some(RELAY),
                keepalive: 6,
                path: PeerPath::Server,
                ..UNKNOWN
            }),
        },
        Case {
            rule: "§8.7: a relay user whose path is not down yet stays direct",
            setup: Setup { kind: Kind::RelayUser, allocation: true, ..TALOS },
            steps: &[Read(0, Absent), Read(15_000, Peer(Some(0), None, 0))],
            want: Some(Want { endpoint: Some(1), keepalive: 6, ..UNKNOWN }),
        },
    ]
}

/// A mesh with one peer and the inputs a case controls.
struct Harness {
    mesh: MeshState,
    settings: Settings,
    psk: PresharedKey,
    setup: Setup,
}

fn peer_spec(kind: Kind) -> KubeSpanPeerSpecSpec {
    KubeSpanPeerSpecSpec {
        node_id: "node-2".to_owned(),
        label: "peer".to_owned(),
        address: Some(MESH_ADDRESS.parse().unwrap()),
        allowed_ips: vec![PREFIX.parse().unwrap(), ULA.parse().unwrap()],
        overlap_removed: Vec::new(),
        endpoints: EP[..3].iter().map(|e| e.parse().unwrap()).collect(),
        wirespan: (kind != Kind::Talos).then(|| WirespanAffiliateSpec {
            version: 1,
            persistent_keepalive_secs: 6,
            relay_user: kind == Kind::RelayUser,
            ..WirespanAffiliateSpec::default()
        }),
    }
}

fn listed(specs: &[(String, KubeSpanPeerSpecSpec)]) -> Changes<KubeSpanPeerSpec> {
    Changes::All(
        specs
            .iter()
            .map(|(k, s)| Arc::new(Resource::new(NS, k.clone(), s.clone())))
            .collect(),
    )
}

impl Harness {
    fn new(setup: Setup) -> Self {
        let mut mesh = MeshState::new();
        mesh.sync_specs(listed(&[(key(PEER), peer_spec(setup.kind))]), t(0));
        Self {
            mesh,
            settings: Settings {
                enabled: true,
                allow_down_peer_bypass: setup.bypass,
                ..Settings::default()
            },
            psk: PresharedKey::from_bytes([7; 32]),
            setup,
        }
    }

    fn inputs(&self, device: Option<HashMap<String, DevicePeer>>) -> CompleteInputs {
        let own = if self.setup.own_higher { 0xf0 } else { 0x10 };
        let mut allocations = HashMap::new();
        if self.setup.allocation {
            allocations.insert(key(PEER), ep(RELAY));
        }
        CompleteInputs {
            own_key: Some(PublicKey::from_bytes([own; 32])),
            device,
            replied: std::collections::HashSet::new(),
            allocations,
        }
    }

    fn step(&mut self, step: Step) -> Plan {
        let (at, device) = match step {
            Read(at, d) => (at, Some(device_of(d))),
            NoRead(at) => (at, None),
            Unlist(at) => {
                self.mesh.sync_specs(listed(&[]), t(at));
                (at, None)
            }
        };
        let inputs = self.inputs(device);
        self.mesh
            .plan_complete(inputs, &self.settings, &self.psk, t(at))
    }
}

fn device_of(d: Device) -> HashMap<String, DevicePeer> {
    let mut out = HashMap::new();
    if let Peer(endpoint, handshake, rx) = d {
        out.insert(
            key(PEER),
            DevicePeer {
                observed: Observed {
                    endpoint: endpoint.map(ep),
                    last_handshake: handshake.map(t),
                    rx_bytes: rx,
                    tx_bytes: rx,
                },
                allowed_ips: Vec::new(),
                keepalive: 0,
            },
        );
    }
    out
}

fn device_peers(plan: &Plan) -> &[WgPeer] {
    match &plan.wireguard {
        WireGuardPlan::Device(peers) => peers,
        WireGuardPlan::Peers(_) => panic!("a complete round plans the whole device"),
    }
}

fn routed(plan: &Plan) -> Vec<IpNet> {
    match &plan.marking {
        MarkingPlan::Whole(spec) => spec
            .prefixes_v4
            .iter()
            .chain(&spec.prefixes_v6)
            .copied()
            .collect(),
        MarkingPlan::Delta(_) => panic!("a complete round plans the whole marking set"),
    }
}

#[test]
fn each_per_peer_rule() {
    let prefix: IpNet = PREFIX.parse().unwrap();
    let ula: IpNet = ULA.parse().unwrap();
    for case in cases() {
        let rule = case.rule;
        let mut h = Harness::new(case.setup);
        let mut plan = None;
        for step in case.steps {
            plan = Some(h.step(*step));
        }
        let plan = plan.expect("a case has steps");
        let marked = routed(&plan);
        assert!(!marked.contains(&ula), "{rule}: a ULA is never routed");
        let Some(want) = case.want else {
            assert!(h.mesh.status(&key(PEER)).is_none(), "{rule}: status gone");
            assert!(device_peers(&plan).is_empty(), "{rule}: device peer gone");
            assert!(marked.is_empty(), "{rule}: routes gone");
            assert!(plan.statuses.is_empty(), "{rule}");
            continue;
        };
        let st = h.mesh.status(&key(PEER)).expect("status");
        let [peer] = device_peers(&plan) else {
            panic!("{rule}: one device peer, got {:?}", device_peers(&plan));
        };
        assert_eq!(st.state, want.state, "{rule}: state");
        assert_eq!(peer.endpoint, want.endpoint.map(ep), "{rule}: endpoint");
        assert_eq!(marked.contains(&prefix), want.routed, "{rule}: routed");
        assert_eq!(peer.allowed_ips, vec![prefix, ula], "{rule}: AllowedIPs");
        assert_eq!(
            peer.persistent_keepalive, want.keepalive,
            "{rule}: keepalive"
        );
        assert_eq!(st.path, want.path, "{rule}: path");
        let mesh_address: IpAddr = MESH_ADDRESS.parse().unwrap();
        assert_eq!(
            plan.probes,
            vec![mesh_address; want.probes],
            "{rule}: probes"
        );
        let reason = if want.retained { UNLISTED_KEPT } else { "" };
        assert_eq!(st.retained_reason, reason, "{rule}: retained");
        if let Some(wake) = want.wake {
            assert_eq!(plan.wake, wake.map(t), "{rule}: wake-up");
        }
        assert_eq!(plan.statuses, vec![key(PEER)], "{rule}: statuses to write");
    }
}

/// A delta round judges a changed peer as a complete round without a read would: the
/// same status, device peer and routed prefixes (one per-peer judgement).
#[test]
fn a_delta_round_judges_a_peer_as_a_complete_round_without_a_read() {
    for setup in [
        TALOS,
        WIRESPAN,
        Setup {
            bypass: true,
            ..TALOS
        },
    ] {
        let mut delta = Harness::new(setup);
        let mut complete = Harness::new(setup);
        for h in [&mut delta, &mut complete] {
            h.step(Read(0, Absent));
            h.step(Read(2_000, Peer(Some(0), Some(1_500), 100)));
        }
        // The peer publishes other endpoints; its current one is gone, but it is up.
        let mut spec = peer_spec(setup.kind);
        spec.endpoints = vec![ep(2)];
        for h in [&mut delta, &mut complete] {
            h.mesh
                .sync_specs(listed(&[(key(PEER), spec.clone())]), t(3_000));
        }
        let d = delta
            .mesh
            .plan_delta(&[key(PEER)], &delta.settings, &delta.psk, t(3_000));
        let c = complete.step(NoRead(3_000));
        let WireGuardPlan::Peers(changes) = &d.wireguard else {
            panic!("a delta round plans peer changes");
        };
        assert_eq!(
            changes,
            &device_peers(&c)
                .iter()
                .cloned()
                .map(PeerChange::Upsert)
                .collect::<Vec<_>>(),
            "{setup:?}"
        );
        assert_eq!(
            delta.mesh.status(&key(PEER)),
            complete.mesh.status(&key(PEER))
        );
        assert_eq!(d.path_changes, c.path_changes);
        assert_eq!(d.wake, c.wake, "{setup:?}");
        // Routed before and after alike: no marking change.
        let MarkingPlan::Delta(m) = &d.marking else {
            panic!("a delta round plans a marking delta");
        };
        assert!(m.is_empty(), "{setup:?}: {m:?}");
    }
}

#[test]
fn a_delta_round_removes_a_gone_peer_and_its_routes() {
    let mut h = Harness::new(TALOS);
    h.step(Read(0, Absent));
    h.mesh.sync_specs(
        Changes::Some([(key(PEER), None)].into_iter().collect()),
        t(1_000),
    );
    let plan = h
        .mesh
        .plan_delta(&[key(PEER)], &h.settings, &h.psk, t(1_000));
    assert_eq!(
        plan.wireguard,
        WireGuardPlan::Peers(vec![PeerChange::Remove(PublicKey::from_bytes([PEER; 32]))])
    );
    let MarkingPlan::Delta(m) = &plan.marking else {
        panic!("a delta round plans a marking delta");
    };
    assert_eq!(m.remove, vec![PREFIX.parse::<IpNet>().unwrap()]);
    assert!(m.add.is_empty());
    assert!(h.mesh.status(&key(PEER)).is_none());
    assert_eq!(plan.statuses, vec![key(PEER)]);
}

/// §6.8: a peer the device held at start without a spec stays, as the device has it,
/// until its spec arrives (its status is then seeded: nothing pushed over a working
/// endpoint) or until `RETAIN_AFTER_START` passed.
#[test]
fn a_device_peer_kept_from_an_earlier_run_is_adopted_then_dropped_or_seeded() {
    let held = || {
        let mut d = device_of(Peer(Some(2), Some(0), 100));
        d.get_mut(&key(PEER)).unwrap().allowed_ips = vec![PREFIX.parse().unwrap()];
        d.get_mut(&key(PEER)).unwrap().keepalive = 6;
        d
    };
    let start = |h: &mut Harness| {
        h.mesh.sync_specs(listed(&[]), t(0));
        let inputs = h.inputs(Some(held()));
        h.mesh.plan_complete(inputs, &h.settings, &h.psk, t(1_000))
    };
    // Kept as the device has it.
    let mut h = Harness::new(TALOS);
    let plan = start(&mut h);
    let [peer] = device_peers(&plan) else {
        panic!("the held peer is kept: {:?}", device_peers(&plan));
    };
    assert_eq!((peer.endpoint, peer.persistent_keepalive), (None, 6));
    assert_eq!(routed(&plan), vec![PREFIX.parse::<IpNet>().unwrap()]);
    // Dropped once the retention passed without a spec.
    let late = t(1_000) + RETAIN_AFTER_START;
    let inputs = h.inputs(Some(held()));
    let plan = h.mesh.plan_complete(inputs, &h.settings, &h.psk, late);
    assert!(device_peers(&plan).is_empty());
    // Its spec arrives in time: seeded from the device, up, endpoint kept.
    let mut h = Harness::new(TALOS);
    start(&mut h);
    h.mesh
        .sync_specs(listed(&[(key(PEER), peer_spec(Kind::Talos))]), t(2_000));
    let plan = h
        .mesh
        .plan_delta(&[key(PEER)], &h.settings, &h.psk, t(2_000));
    let st = h.mesh.status(&key(PEER)).unwrap();
    assert_eq!(st.state, PeerState::Up);
    assert_eq!(st.last_used_endpoint, Some(ep(2)));
    let WireGuardPlan::Peers(changes) = &plan.wireguard else {
        panic!("a delta round plans peer changes");
    };
    let [PeerChange::Upsert(peer)] = changes.as_slice() else {
        panic!("one upsert: {changes:?}");
    };
    assert_eq!(peer.endpoint, Some(ep(2)));
}

/// §8.10: a kept peer gives up every prefix a listed peer claims.
#[test]
fn a_kept_unlisted_peer_yields_its_prefixes_to_a_listed_one() {
    let mut h = Harness::new(TALOS);
    h.step(Read(0, Absent));
    h.step(Read(2_000, Peer(Some(0), Some(1_500), 100)));
    // The node comes back under a new key claiming the same prefix.
    let new_key = key(0x60);
    h.mesh.sync_specs(
        listed(&[(new_key.clone(), peer_spec(Kind::Talos))]),
        t(3_000),
    );
    let plan = h.step(NoRead(3_000));
    let peers = device_peers(&plan);
    let of = |k: &str| {
        let pk = PublicKey::from_base64("k", k).unwrap();
        peers.iter().find(|p| p.public_key == pk).unwrap().clone()
    };
    let ula: IpNet = ULA.parse().unwrap();
    assert_eq!(of(&new_key).allowed_ips, vec![PREFIX.parse().unwrap(), ula]);
    assert!(of(&key(PEER)).allowed_ips.is_empty());
    assert_eq!(
        h.mesh.status(&key(PEER)).unwrap().retained_reason,
        UNLISTED_KEPT
    );
}

/// §8.7: a relay user whose direct path is down for the window goes through a peer
/// that offers to relay and is up: its prefixes move to the relay's WireGuard peer
/// (and stay routed), it keeps its endpoint to retry the direct path, and rounds stay
/// complete.
#[test]
fn a_peer_down_for_the_window_goes_through_a_relay_that_is_up() {
    let relay_key = key(0x60);
    let relay_prefix: IpNet = "10.0.0.3/32".parse().unwrap();
    let relay_endpoint: SocketAddr = "192.0.2.9:51820".parse().unwrap();
    let relay_spec = KubeSpanPeerSpecSpec {
        node_id: "node-3".to_owned(),
        label: "relay".to_owned(),
        address: None,
        allowed_ips: vec![relay_prefix],
        endpoints: vec![relay_endpoint],
        wirespan: Some(WirespanAffiliateSpec {
            version: 1,
            persistent_keepalive_secs: 6,
            relay_user: true,
            relay_offered: true,
            ..WirespanAffiliateSpec::default()
        }),
        ..KubeSpanPeerSpecSpec::default()
    };
    let mut h = Harness::new(Setup {
        kind: Kind::RelayUser,
        ..TALOS
    });
    h.mesh.sync_specs(
        listed(&[
            (key(PEER), peer_spec(Kind::RelayUser)),
            (relay_key.clone(), relay_spec),
        ]),
        t(0),
    );
    let mut round = |at: u64, peer: Device, relay_rx: u64| {
        let mut device = device_of(peer);
        let relay = Observed {
            endpoint: Some(relay_endpoint),
            last_handshake: Some(t(500)),
            rx_bytes: relay_rx,
            tx_bytes: relay_rx,
        };
        if at > 0 {
            device.insert(
                relay_key.clone(),
                DevicePeer {
                    observed: relay,
                    allowed_ips: Vec::new(),
                    keepalive: 6,
                },
            );
        }
        let inputs = h.inputs(Some(device));
        let plan = h.mesh.plan_complete(inputs, &h.settings, &h.psk, t(at));
        (plan, h.mesh.delta_allowed())
    };
    round(0, Absent, 0);
    round(1_000, Peer(Some(0), None, 0), 100);
    let (plan, _) = round(15_000, Peer(Some(0), None, 0), 200);
    // Not down for the window yet: direct, on its next endpoint.
    assert!(
        device_peers(&plan)
            .iter()
            .all(|p| !p.allowed_ips.is_empty()),
        "no move yet"
    );
    let (plan, delta_allowed) = round(20_000, Peer(Some(1), None, 0), 300);
    let st = h.mesh.status(&key(PEER)).unwrap();
    assert_eq!((st.path, st.via.as_str()), (PeerPath::Relay, "relay"));
    let peers = device_peers(&plan);
    let of = |k: &str| {
        let pk = PublicKey::from_base64("k", k).unwrap();
        peers.iter().find(|p| p.public_key == pk).unwrap()
    };
    assert!(of(&key(PEER)).allowed_ips.is_empty());
    assert_eq!(
        of(&key(PEER)).endpoint,
        Some(ep(1)),
        "retries its direct path"
    );
    let prefix: IpNet = PREFIX.parse().unwrap();
    // All of its AllowedIPs move, its ULA too (the ULA is never routed, §7).
    let ula: IpNet = ULA.parse().unwrap();
    assert_eq!(of(&relay_key).allowed_ips, vec![relay_prefix, prefix, ula]);
    assert!(
        routed(&plan).contains(&prefix),
        "relayed prefixes stay routed"
    );
    assert!(!delta_allowed, "relays keep rounds complete");
    assert!(
        h.mesh.server_wanted().is_empty(),
        "a peer relay, not the server's"
    );
}
