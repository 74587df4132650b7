//! Controller tests: the real runtime with fake adapters, links and clock.

use std::{
    net::{IpAddr, SocketAddr},
    os::unix::fs::PermissionsExt as _,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use wirespan_dataplane::{
    fake::{FakeMarking, FakeSysctl, FakeWireGuard},
    fastpath::FastPathError,
    kernel_marking::{compose, Classifier},
    marking::{Marking as _, MarkingSpec, PrefixDelta, PreroutingMarking},
    wireguard::{DeviceState, PublicKey, WgError, WireGuard},
};

use super::{
    choice_of,
    identity::{LinkInfo, LinkSource},
    manager::{ManagerDeps, MarkingChoice, MarkingFactory, OnStop, Prober, WireGuardFactory},
    prerouting_of, register, Deps,
};
use crate::{
    config::kubespan::FastPath,
    kubespan::clock::{Clock as _, FakeClock},
    resources::{
        cluster::{
            AffiliateSpec, ClusterIdentity, ClusterIdentitySpec, KubeSpanAffiliateSpec,
            WirespanAffiliateSpec,
        },
        config::{MachineConfig, MachineConfigSpec},
        identity::{NodeIdentity, NodeIdentitySpec},
        kubespan::{
            KubeSpanConfig, KubeSpanIdentity, KubeSpanManagerStatus, KubeSpanPeerSpec,
            KubeSpanPeerStatus, PeerPath, PeerState, KUBESPAN, NS,
        },
        network::{LinkSpec, RouteSpec, RoutingRuleSpec, NS_CONFIG},
    },
    runtime::{Kind, Pointer, Resource, ResourceKind as _, Runtime, Store, StoreOptions},
    secret::Key32,
    testing::{assert_length, assert_no_resource, assert_resource, Harness, TIMEOUT},
};

/// Kernel writes that fail, and kernel state that goes away.
mod failures;

#[derive(Debug)]
struct FakeLinks(Vec<LinkInfo>);

impl LinkSource for FakeLinks {
    fn links(&self) -> std::io::Result<Vec<LinkInfo>> {
        Ok(self.0.clone())
    }
}

#[derive(Debug, Clone)]
struct FakeWgFactory(FakeWireGuard);

/// A mesh link the fake factory refuses, as `wireguard::select` refuses a link held by
/// a backend other than the one asked for.
const REFUSED_LINK: &str = "heldlink";

impl WireGuardFactory for FakeWgFactory {
    fn create(&self, link: &str) -> Result<Box<dyn WireGuard + Send>, WgError> {
        if link == REFUSED_LINK {
            return Err(WgError::WrongBackend {
                name: link.to_owned(),
                asked: "kernel",
                held_by: "a userspace device served by wireguard-go (pid 7)".to_owned(),
            });
        }
        Ok(Box::new(self.0.clone()))
    }
}

#[derive(Debug, Clone)]
struct FakeMarkingFactory(FakeMarking);

/// A classifier that is never attached (tests have no eBPF).
struct NoClassifier;

impl Classifier for NoClassifier {
    fn apply(&mut self, _spec: &MarkingSpec) -> Result<bool, FastPathError> {
        Ok(false)
    }

    fn apply_delta(&mut self, _delta: &PrefixDelta) -> Result<bool, FastPathError> {
        Ok(false)
    }

    fn teardown(self) -> Result<(), FastPathError> {
        Ok(())
    }
}

impl MarkingFactory for FakeMarkingFactory {
    fn create(&self, fast_path: FastPath, _link: &str) -> MarkingChoice {
        choice_of(compose(self.0.clone(), prerouting_of(fast_path), || {
            Err::<NoClassifier, _>(FastPathError::Unsupported {
                what: "bpf syscall".into(),
                source: "not in tests".into(),
            })
        }))
    }
}

const CLUSTER_ID: &str = "test-cluster-id";
const SECRET: [u8; 32] = [7; 32];

struct Mesh {
    h: Harness,
    wg: FakeWireGuard,
    marking: FakeMarking,
    clock: FakeClock,
    sysctl: FakeSysctl,
    probes: RecordingProber,
    /// The controllers restarted after an error, in order (the runtime's restart hook).
    restarts: Arc<Mutex<Vec<String>>>,
    _dir: tempfile::TempDir,
}

/// Records the mesh addresses probed; no peer's kernel answers.
#[derive(Debug, Clone, Default)]
struct RecordingProber(Arc<Mutex<Vec<IpAddr>>>);

impl Prober for RecordingProber {
    fn probe(&self, to: IpAddr) {
        self.0.lock().unwrap().push(to);
    }

    fn kernel_replies(&self) -> std::collections::HashSet<IpAddr> {
        std::collections::HashSet::new()
    }
}

impl RecordingProber {
    fn sent(&self) -> Vec<IpAddr> {
        self.0.lock().unwrap().clone()
    }
}

const RP_FILTER: &str = "net.ipv4.conf.kubespan.rp_filter";

fn config(extra: &str) -> MachineConfigSpec {
    let enabled = if extra.contains("enabled:") {
        ""
    } else {
        "enabled: true\n"
    };
    let text = format!("apiVersion: v1alpha1\nkind: KubeSpanConfig\n{enabled}{extra}");
    let config = crate::config::parse(&text).unwrap();
    MachineConfigSpec {
        source: "test".into(),
        document_count: config.documents.len(),
        config,
    }
}

fn set_config(store: &Store, spec: &MachineConfigSpec) {
    store
        .modify::<MachineConfig>("config", "active", "", |r| r.spec = spec.clone())
        .unwrap();
}

fn key(n: u8) -> String {
    PublicKey::from_bytes([n; 32]).to_base64()
}

fn affiliate(n: u8, endpoints: &[&str]) -> AffiliateSpec {
    AffiliateSpec {
        node_id: format!("node{n}"),
        nodename: format!("n{n}"),
        addresses: vec![format!("10.5.0.{n}").parse().unwrap()],
        kubespan: Some(KubeSpanAffiliateSpec {
            public_key: key(n),
            address: Some(format!("fd21:4de:ec13:da02::{n}").parse().unwrap()),
            additional_addresses: vec![format!("10.244.{n}.0/24").parse().unwrap()],
            exclude_advertised_networks: Vec::new(),
            endpoints: endpoints.iter().map(|e| e.parse().unwrap()).collect(),
        }),
        ..AffiliateSpec::default()
    }
}

fn set_affiliate(store: &Store, a: &AffiliateSpec) {
    store
        .modify::<crate::resources::cluster::Affiliate>("cluster", &a.node_id, "", |r| {
            r.spec = a.clone();
        })
        .unwrap();
}

fn start(extra_config: &str, dir: tempfile::TempDir) -> Mesh {
    start_over(
        extra_config,
        dir,
        FakeWireGuard::new("kubespan"),
        FakeMarking::new(),
        FakeClock::new(SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000)),
    )
}

/// A node over kernel state that may already exist (`wg`, `marking`): a restart.
fn start_over(
    extra_config: &str,
    dir: tempfile::TempDir,
    wg: FakeWireGuard,
    marking: FakeMarking,
    clock: FakeClock,
) -> Mesh {
    let store = Store::new(StoreOptions::default());
    let mut runtime = Runtime::new(store.clone());
    let restarts = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&restarts);
    runtime.on_controller_restart(Arc::new(move |name: &str| {
        seen.lock().unwrap().push(name.to_owned());
    }));
    // systemd's default for a new link (loose), host-wide filtering off.
    let sysctl = FakeSysctl::new();
    let probes = RecordingProber::default();
    sysctl.set(RP_FILTER, "2");
    sysctl.set("net.ipv4.conf.all.rp_filter", "0");
    register(
        &mut runtime,
        Deps {
            state_dir: dir.path().to_owned(),
            links: Arc::new(FakeLinks(vec![
                LinkInfo {
                    name: "lo".into(),
                    mac: vec![0; 6],
                    physical: false,
                },
                LinkInfo {
                    name: "veth0".into(),
                    mac: vec![0x00, 0x16, 0x3e, 0x12, 0x34, 0x56],
                    physical: false,
                },
            ])),
            manager: ManagerDeps {
                wireguard: Arc::new(FakeWgFactory(wg.clone())),
                marking: Arc::new(FakeMarkingFactory(marking.clone())),
                routing_cleanup: None,
                clock: Arc::new(clock.clone()),
                metrics: None,
                on_stop: OnStop::Keep,
                sysctl: Some(Arc::new(sysctl.clone())),
                prober: Some(Arc::new(probes.clone())),
            },
        },
    )
    .unwrap();
    store
        .create(
            Resource::<ClusterIdentity>::new(
                "cluster",
                "cluster",
                ClusterIdentitySpec {
                    cluster_id: CLUSTER_ID.into(),
                    secret: Key32(SECRET),
                },
            ),
            "",
        )
        .unwrap();
    store
        .create(
            Resource::<NodeIdentity>::new(
                "cluster",
                "local",
                NodeIdentitySpec {
                    node_id: "node0".into(),
                },
            ),
            "",
        )
        .unwrap();
    set_config(&store, &config(extra_config));
    Mesh {
        h: Harness::start(runtime),
        wg,
        marking,
        clock,
        sysctl,
        probes,
        restarts,
        _dir: dir,
    }
}

/// Polls `f` until it returns `Some` or the deadline passes.
async fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until the manager has handled every advance of `clock` (see
/// [`FakeClock::settled`]).
async fn settled(clock: &FakeClock) {
    eventually("the manager waiting on the clock again", || {
        clock.settled().then_some(())
    })
    .await;
}

fn device_peers(wg: &FakeWireGuard) -> usize {
    wg.device().map_or(0, |d: DeviceState| d.peers.len())
}

#[tokio::test]
async fn config_controller_unions_extra_endpoints_and_absent_document_disables() {
    let m = start(
        "mtu: 1400\n---\napiVersion: v1alpha1\nkind: KubeSpanEndpointsConfig\nextraAnnouncedEndpoints: [\"192.0.2.1:51820\"]\n---\napiVersion: v1alpha1\nkind: KubeSpanEndpointsConfig\nextraAnnouncedEndpoints: [\"192.0.2.1:51820\", \"192.0.2.2:4000\"]\n",
        tempfile::tempdir().unwrap(),
    );
    assert_resource::<KubeSpanConfig>(&m.h.store, NS, KUBESPAN, |r| {
        let want: Vec<SocketAddr> = vec![
            "192.0.2.1:51820".parse().unwrap(),
            "192.0.2.2:4000".parse().unwrap(),
        ];
        if r.spec.config.mtu == 1400
            && r.spec.config.listen_port == 51820
            && r.spec.extra_announced_endpoints == want
        {
            Ok(())
        } else {
            Err(format!("{:?}", r.spec))
        }
    })
    .await;
    let cfg =
        crate::config::parse("apiVersion: v1alpha1\nkind: KubeSpanEndpointsConfig\n").unwrap();
    set_config(
        &m.h.store,
        &MachineConfigSpec {
            source: "test".into(),
            document_count: 1,
            config: cfg,
        },
    );
    assert_no_resource(
        &m.h.store,
        &Pointer::new(NS, KubeSpanConfig::TYPE, KUBESPAN),
    )
    .await;
    m.h.stop().await.unwrap();
}

#[tokio::test]
async fn identity_derives_the_ula_from_the_veth_mac_and_reuses_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_owned();
    let m = start("", dir);
    let first = assert_resource::<KubeSpanIdentity>(&m.h.store, NS, KUBESPAN, |r| {
        if r.spec.address.is_some() {
            Ok(())
        } else {
            Err("no address".into())
        }
    })
    .await;
    assert_eq!(
        first.spec.address.unwrap().to_string(),
        "fd21:4de:ec13:da02:216:3eff:fe12:3456/128"
    );
    assert_eq!(
        first.spec.subnet.unwrap().to_string(),
        "fd21:4de:ec13:da02::/64"
    );
    assert_eq!(first.spec.mac_source_link, "veth0");
    let json = serde_json::to_string(&first.spec).unwrap();
    let file = std::fs::read_to_string(path.join(super::identity::KEY_FILE)).unwrap();
    assert!(
        !json.contains(file.trim()),
        "private key leaked into the resource"
    );
    assert!(!format!("{:?}", first.spec).contains(file.trim()));
    let mode = std::fs::metadata(path.join(super::identity::KEY_FILE))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let m2_dir = m._dir;
    m.h.stop().await.unwrap();
    // A second daemon over the same state dir: same key.
    let m2 = start("", m2_dir);
    assert_resource::<KubeSpanIdentity>(&m2.h.store, NS, KUBESPAN, |r| {
        if r.spec.public_key == first.spec.public_key {
            Ok(())
        } else {
            Err("new key".into())
        }
    })
    .await;
    m2.h.stop().await.unwrap();
}

#[tokio::test]
async fn peers_from_affiliates_with_psk_keepalive_and_per_peer_updates() {
    let m = start("", tempfile::tempdir().unwrap());
    let store = &m.h.store;
    for n in 1..=3 {
        set_affiliate(store, &affiliate(n, &["192.0.2.1:51820"]));
    }
    // The local node's own affiliate never becomes a peer.
    set_affiliate(
        store,
        &AffiliateSpec {
            node_id: "node0".into(),
            ..affiliate(0, &[])
        },
    );
    assert_length(store, &Kind::new(NS, KubeSpanPeerSpec::TYPE), 3).await;
    assert_length(store, &Kind::new(NS, KubeSpanPeerStatus::TYPE), 3).await;
    let dev = eventually("3 device peers", || {
        (device_peers(&m.wg) == 3).then(|| m.wg.device().unwrap())
    })
    .await;
    // The side with the higher key leaves a new peer's first handshake to the other
    // for a moment (no keepalive), then keeps it alive like every peer.
    let own = store
        .get::<KubeSpanIdentity>(NS, KUBESPAN)
        .unwrap()
        .spec
        .public_key
        .clone();
    let own = PublicKey::from_base64("own", &own).unwrap();
    for p in &dev.peers {
        assert_eq!(p.preshared_key.as_ref().unwrap().as_bytes(), &SECRET);
        let deferred = own.as_bytes() > p.public_key.as_bytes();
        assert_eq!(
            p.persistent_keepalive,
            if deferred { 0 } else { 25 },
            "{p:?}"
        );
        assert_eq!(p.endpoint, Some("192.0.2.1:51820".parse().unwrap()));
    }
    m.clock
        .advance(crate::kubespan::rotation::FIRST_HANDSHAKE_DEFERRAL);
    eventually("every peer kept alive after the deferral", || {
        m.wg.device()
            .filter(|d| d.peers.iter().all(|p| p.persistent_keepalive == 25))
    })
    .await;
    let p2 = dev
        .peers
        .iter()
        .find(|p| p.public_key.to_base64() == key(2))
        .unwrap();
    let got: Vec<String> = p2.allowed_ips.iter().map(ToString::to_string).collect();
    assert_eq!(
        got,
        ["10.5.0.2/32", "10.244.2.0/24", "fd21:4de:ec13:da02::2/128"]
    );
    // Network specs of the operator layer.
    assert_resource::<LinkSpec>(store, NS_CONFIG, "operator/kubespan", |r| {
        if r.spec.up && r.spec.mtu == 1420 && !r.spec.logical {
            Ok(())
        } else {
            Err(format!("{:?}", r.spec))
        }
    })
    .await;
    assert_resource::<RouteSpec>(store, NS_CONFIG, "operator/180/inet4///1", |_| Ok(())).await;
    assert_resource::<RouteSpec>(store, NS_CONFIG, "operator/180/kubespan/inet6///1", |_| {
        Ok(())
    })
    .await;
    assert_resource::<RoutingRuleSpec>(store, NS_CONFIG, "operator/inet6/32500", |r| {
        if r.spec.fw_mark == 0x40 && r.spec.fw_mask == 0x60 && r.spec.table == 180 {
            Ok(())
        } else {
            Err(format!("{:?}", r.spec))
        }
    })
    .await;
    assert_resource::<crate::resources::network::AddressSpec>(
        store,
        NS_CONFIG,
        "operator/kubespan/fd21:4de:ec13:da02:216:3eff:fe12:3456/64",
        |_| Ok(()),
    )
    .await;

    // One affiliate changes: one peer update, through the delta path.
    let before = m.wg.updates().len();
    let (peer_applies, deltas) = (m.wg.peer_applies(), m.marking.deltas());
    let mut a2 = affiliate(2, &["192.0.2.1:51820"]);
    a2.kubespan.as_mut().unwrap().additional_addresses = vec!["10.245.0.0/16".parse().unwrap()];
    set_affiliate(store, &a2);
    let ups = eventually("an update with the new AllowedIPs", || {
        let ups = m.wg.updates();
        ups[before..]
            .iter()
            .any(|u| {
                u.peers.iter().any(|p| {
                    p.allowed_ips
                        .as_ref()
                        .is_some_and(|ips| ips.contains(&"10.245.0.0/16".parse().unwrap()))
                })
            })
            .then_some(ups)
    })
    .await;
    for u in &ups[before..] {
        assert!(
            u.peers.iter().all(|p| p.public_key.to_base64() == key(2)),
            "{u:?}"
        );
    }
    assert!(m.wg.peer_applies() > peer_applies, "not a delta round");
    assert!(
        m.marking.deltas() > deltas,
        "the routed set did not change by a delta"
    );
    let routed = routed_v4(&m.marking.spec().unwrap());
    assert!(
        routed.contains(&"10.245.0.0/16".to_owned())
            && !routed.contains(&"10.244.2.0/24".to_owned()),
        "{routed:?}"
    );

    // Removed affiliate: peer, spec and status go.
    store
        .destroy(
            &Pointer::new(
                "cluster",
                crate::resources::cluster::Affiliate::TYPE,
                "node3",
            ),
            "",
        )
        .unwrap();
    assert_no_resource(store, &Pointer::new(NS, KubeSpanPeerStatus::TYPE, key(3))).await;
    eventually("peer 3 removed from the device", || {
        (device_peers(&m.wg) == 2).then_some(())
    })
    .await;
    m.h.stop().await.unwrap();
}

fn routed_v4(spec: &MarkingSpec) -> Vec<String> {
    spec.prefixes_v4.iter().map(ToString::to_string).collect()
}

#[tokio::test]
async fn bypass_marks_only_up_peers_and_follows_state_changes() {
    let m = start("allowDownPeerBypass: true\n", tempfile::tempdir().unwrap());
    let store = &m.h.store;
    set_affiliate(store, &affiliate(1, &["192.0.2.1:51820"]));
    set_affiliate(store, &affiliate(2, &["192.0.2.2:51820"]));
    eventually("marking applied with no peer up", || {
        m.marking
            .spec()
            .filter(|_| device_peers(&m.wg) == 2)
            .filter(|s| s.prefixes_v4.is_empty())
    })
    .await;
    // Peer 1 handshakes; the next reconcile (the 15 s timer) marks it.
    let pk1 = PublicKey::from_bytes([1; 32]);
    m.wg.handshake(&pk1, m.clock.now() + Duration::from_secs(1), 10, 20);
    m.clock.advance(Duration::from_secs(16));
    let spec = eventually("peer 1 in the routed set", || {
        m.marking.spec().filter(|s| !s.prefixes_v4.is_empty())
    })
    .await;
    assert_eq!(routed_v4(&spec), ["10.5.0.1/32", "10.244.1.0/24"]);
    assert_resource::<KubeSpanPeerStatus>(store, NS, &key(1), |r| {
        if r.spec.state == PeerState::Up && r.spec.receive_bytes == 10 {
            Ok(())
        } else {
            Err(format!("{:?}", r.spec))
        }
    })
    .await;
    // Bypass off: every peer is marked regardless of state.
    set_config(store, &config(""));
    let spec = eventually("all peers in the routed set", || {
        m.marking.spec().filter(|s| s.prefixes_v4.len() == 4)
    })
    .await;
    assert_eq!(
        routed_v4(&spec),
        [
            "10.5.0.1/32",
            "10.244.1.0/24",
            "10.5.0.2/32",
            "10.244.2.0/24"
        ]
    );
    m.h.stop().await.unwrap();
}

#[tokio::test]
async fn rotation_moves_to_the_second_endpoint_when_the_first_never_handshakes() {
    let m = start("", tempfile::tempdir().unwrap());
    let store = &m.h.store;
    set_affiliate(
        store,
        &affiliate(1, &["192.0.2.1:51820", "198.51.100.1:51820"]),
    );
    let first: SocketAddr = "192.0.2.1:51820".parse().unwrap();
    let second: SocketAddr = "198.51.100.1:51820".parse().unwrap();
    assert_resource::<KubeSpanPeerStatus>(store, NS, &key(1), |r| {
        if r.spec.last_used_endpoint == Some(first) && r.spec.state == PeerState::Unknown {
            Ok(())
        } else {
            Err(format!("{:?}", r.spec))
        }
    })
    .await;
    eventually("first endpoint programmed", || {
        m.wg.device()
            .and_then(|d| d.peers.first().and_then(|p| p.endpoint))
            .filter(|e| *e == first)
    })
    .await;
    // 15 s without a handshake: down, and the timer (not the 30 s tick) rotates.
    m.clock.advance(Duration::from_secs(15));
    assert_resource::<KubeSpanPeerStatus>(store, NS, &key(1), |r| {
        if r.spec.last_used_endpoint == Some(second) && r.spec.state == PeerState::Unknown {
            Ok(())
        } else {
            Err(format!("{:?}", r.spec))
        }
    })
    .await;
    eventually("second endpoint programmed", || {
        m.wg.device()
            .and_then(|d| d.peers.first().and_then(|p| p.endpoint))
            .filter(|e| *e == second)
    })
    .await;
    m.h.stop().await.unwrap();
}

/// §8.6: a wirespan peer gets a keepalive of a third of the receive window, is probed
/// after half a window of silence and is down (and rotated) when the window passes in
/// silence, though its handshake is recent; a Talos peer beside it keeps 25 s and its
/// state, and is never probed.
#[tokio::test]
async fn a_silent_wirespan_peer_is_probed_then_down_while_a_talos_peer_is_not() {
    let m = start("peerReceiveTimeout: 30s\n", tempfile::tempdir().unwrap());
    let store = &m.h.store;
    let (first, second): (SocketAddr, SocketAddr) = (
        "192.0.2.1:51820".parse().unwrap(),
        "198.51.100.1:51820".parse().unwrap(),
    );
    let ours = AffiliateSpec {
        wirespan: Some(WirespanAffiliateSpec {
            version: 1,
            persistent_keepalive_secs: 10,
            ..WirespanAffiliateSpec::default()
        }),
        ..affiliate(1, &["192.0.2.1:51820", "198.51.100.1:51820"])
    };
    set_affiliate(store, &ours);
    set_affiliate(store, &affiliate(2, &["192.0.2.2:51820"]));
    let (k1, k2) = (
        PublicKey::from_bytes([1; 32]),
        PublicKey::from_bytes([2; 32]),
    );
    eventually("both peers on the device", || {
        (device_peers(&m.wg) == 2).then_some(())
    })
    .await;
    // Both handshake after their endpoint was pushed (strictly later, §8.3); the
    // first-handshake deferral (1 s) is over by then.
    m.clock.advance(Duration::from_secs(1));
    let now = m.clock.now();
    m.wg.handshake(&k1, now, 100, 100);
    m.wg.handshake(&k2, now, 100, 100);
    m.clock.advance(Duration::from_secs(1));
    for n in [1, 2] {
        assert_resource::<KubeSpanPeerStatus>(store, NS, &key(n), |r| {
            (r.spec.state == PeerState::Up)
                .then_some(())
                .ok_or_else(|| format!("{:?}", r.spec))
        })
        .await;
    }
    let keepalives = eventually("keepalives 10 s (wirespan) and 25 s (Talos)", || {
        let d = m.wg.device()?;
        let of = |k: &PublicKey| {
            d.peers
                .iter()
                .find(|p| p.public_key == *k)
                .map(|p| p.persistent_keepalive)
        };
        let got = (of(&k1)?, of(&k2)?);
        (got == (10, 25)).then_some(got)
    })
    .await;
    assert_eq!(keepalives, (10, 25));
    // Up: peer 1 (and only it) is probed once at its mesh address, to learn whether
    // it answers echo requests.
    let ula1: IpAddr = "fd21:4de:ec13:da02::1".parse().unwrap();
    eventually("peer 1 probed to learn", || {
        (m.probes.sent() == [ula1]).then_some(())
    })
    .await;

    // Half a window without receiving: probed again.
    m.clock.advance(Duration::from_secs(15));
    eventually("peer 1 probed", || {
        (m.probes.sent() == [ula1, ula1]).then_some(())
    })
    .await;
    // The rest of the window, still nothing (the handshake is 31 s old): down and
    // rotated to the second endpoint; the Talos peer, just as silent, stays up.
    m.clock.advance(Duration::from_secs(15));
    assert_resource::<KubeSpanPeerStatus>(store, NS, &key(1), |r| {
        (r.spec.last_used_endpoint == Some(second) && r.spec.state == PeerState::Unknown)
            .then_some(())
            .ok_or_else(|| format!("{:?}", r.spec))
    })
    .await;
    let talos = peer_status(store, 2).unwrap();
    assert_eq!(talos.state, PeerState::Up, "{talos:?}");
    assert_eq!(m.probes.sent(), [ula1, ula1]);
    assert_ne!(first, second);
    m.h.stop().await.unwrap();
}

#[tokio::test]
async fn disable_tears_everything_down_and_reenable_restores_it() {
    let m = start("fastPath: ebpf\n", tempfile::tempdir().unwrap());
    let store = &m.h.store;
    set_affiliate(store, &affiliate(1, &["192.0.2.1:51820"]));
    eventually("device with a peer", || {
        (device_peers(&m.wg) == 1).then_some(())
    })
    .await;
    // The status names the WireGuard implementation the device runs on.
    assert_resource::<KubeSpanManagerStatus>(store, NS, KUBESPAN, |r| {
        if r.spec.fast_path == "nftables"
            && r.spec.note.contains("eBPF")
            && r.spec.wireguard == "fake"
        {
            Ok(())
        } else {
            Err(format!("{:?}", r.spec))
        }
    })
    .await;
    // Reverse-path filtering is off on the mesh link while the mesh runs.
    assert_eq!(m.sysctl.get(RP_FILTER).as_deref(), Some("0"));
    set_config(store, &config("enabled: false\n"));
    eventually("device removed", || m.wg.device().is_none().then_some(())).await;
    eventually("rp_filter restored", || {
        (m.sysctl.get(RP_FILTER).as_deref() == Some("2")).then_some(())
    })
    .await;
    eventually("marking removed", || {
        m.marking.spec().is_none().then_some(())
    })
    .await;
    assert_length(store, &Kind::new(NS, KubeSpanPeerStatus::TYPE), 0).await;
    assert_length(store, &Kind::new(NS, KubeSpanPeerSpec::TYPE), 0).await;
    assert_length(store, &Kind::new(NS_CONFIG, LinkSpec::TYPE), 0).await;
    assert_length(store, &Kind::new(NS_CONFIG, RouteSpec::TYPE), 0).await;
    assert_no_resource(store, &Pointer::new(NS, KubeSpanIdentity::TYPE, KUBESPAN)).await;
    // Re-enable: everything comes back, and the tick runs again.
    set_config(store, &config(""));
    eventually("device back", || (device_peers(&m.wg) == 1).then_some(())).await;
    eventually("rp_filter off again", || {
        (m.sysctl.get(RP_FILTER).as_deref() == Some("0")).then_some(())
    })
    .await;
    m.h.stop().await.unwrap();
}

#[tokio::test]
async fn a_mesh_link_whose_rp_filter_cannot_be_turned_off_is_refused_until_it_can() {
    let m = start("", tempfile::tempdir().unwrap());
    m.sysctl.refuse_writes(true);
    let store = &m.h.store;
    set_affiliate(store, &affiliate(1, &["192.0.2.1:51820"]));
    // The device is written, then the round stops at the sysctl (an error, retried
    // with backoff): no marking, no routes into a link that would drop replies.
    eventually("device with a peer", || {
        (device_peers(&m.wg) == 1).then_some(())
    })
    .await;
    assert!(
        m.marking.spec().is_none(),
        "marking applied despite rp_filter on"
    );
    assert_eq!(m.sysctl.get(RP_FILTER).as_deref(), Some("2"));
    assert_length(store, &Kind::new(NS_CONFIG, RouteSpec::TYPE), 0).await;
    // Host-wide filtering is refused too, and left alone.
    m.sysctl.refuse_writes(false);
    m.sysctl.set("net.ipv4.conf.all.rp_filter", "1");
    m.clock.advance(Duration::from_secs(31));
    assert!(
        m.marking.spec().is_none(),
        "marking applied despite all.rp_filter=1"
    );
    m.sysctl.set("net.ipv4.conf.all.rp_filter", "0");
    eventually("rp_filter off once it can be set, then the marking", || {
        (m.sysctl.get(RP_FILTER).as_deref() == Some("0") && m.marking.spec().is_some())
            .then_some(())
    })
    .await;
    assert_eq!(
        m.sysctl.get("net.ipv4.conf.all.rp_filter").as_deref(),
        Some("0")
    );
    m.h.stop().await.unwrap();
}

#[tokio::test]
async fn peer_endpoint_filter_drops_endpoints_before_they_are_tried() {
    let m = start(
        "filters:\n  peerEndpoints: [\"0.0.0.0/0\", \"!192.168.0.0/16\"]\n",
        tempfile::tempdir().unwrap(),
    );
    let store = &m.h.store;
    let endpoints = |r: &Resource<KubeSpanPeerSpec>| -> Vec<String> {
        r.spec.endpoints.iter().map(ToString::to_string).collect()
    };
    set_affiliate(
        store,
        &affiliate(1, &["192.168.1.1:51820", "203.0.113.1:51820"]),
    );
    assert_resource::<KubeSpanPeerSpec>(store, NS, &key(1), |r| {
        (endpoints(r) == ["203.0.113.1:51820"])
            .then_some(())
            .ok_or(format!("{:?}", r.spec.endpoints))
    })
    .await;
    // The device is given the endpoint that passed, never the filtered one.
    let want: SocketAddr = "203.0.113.1:51820".parse().unwrap();
    eventually("the peer on the device with the kept endpoint", || {
        m.wg.device()?
            .peers
            .iter()
            .find(|p| p.public_key.to_base64() == key(1))
            .filter(|p| p.endpoint == Some(want))
            .map(|_| ())
    })
    .await;
    // A peer whose every endpoint is filtered keeps its spec, with nothing to try
    // (the incremental path filters too).
    set_affiliate(store, &affiliate(2, &["192.168.2.2:51820"]));
    assert_resource::<KubeSpanPeerSpec>(store, NS, &key(2), |r| {
        r.spec
            .endpoints
            .is_empty()
            .then_some(())
            .ok_or(format!("{:?}", r.spec.endpoints))
    })
    .await;
    // Dropping the filter re-reads every peer's endpoints, with no affiliate change.
    set_config(store, &config(""));
    assert_resource::<KubeSpanPeerSpec>(store, NS, &key(2), |r| {
        (endpoints(r) == ["192.168.2.2:51820"])
            .then_some(())
            .ok_or(format!("{:?}", r.spec.endpoints))
    })
    .await;
    assert_resource::<KubeSpanPeerSpec>(store, NS, &key(1), |r| {
        (endpoints(r) == ["192.168.1.1:51820", "203.0.113.1:51820"])
            .then_some(())
            .ok_or(format!("{:?}", r.spec.endpoints))
    })
    .await;
    m.h.stop().await.unwrap();
}

#[tokio::test]
async fn peer_specs_follow_changes_incrementally_and_fall_back_on_overlap() {
    let m = start("", tempfile::tempdir().unwrap());
    let store = &m.h.store;
    for n in 1..=3 {
        set_affiliate(store, &affiliate(n, &["192.0.2.1:51820"]));
    }
    assert_length(store, &Kind::new(NS, KubeSpanPeerSpec::TYPE), 3).await;
    let allowed = |r: &Resource<KubeSpanPeerSpec>| -> Vec<String> {
        r.spec.allowed_ips.iter().map(ToString::to_string).collect()
    };
    // A disjoint change (incremental path).
    let mut a3 = affiliate(3, &["192.0.2.1:51820"]);
    a3.kubespan.as_mut().unwrap().additional_addresses = vec!["10.99.0.0/16".parse().unwrap()];
    set_affiliate(store, &a3);
    assert_resource::<KubeSpanPeerSpec>(store, NS, &key(3), |r| {
        let got = allowed(r);
        (got == ["10.5.0.3/32", "10.99.0.0/16", "fd21:4de:ec13:da02::3/128"])
            .then_some(())
            .ok_or(format!("{got:?}"))
    })
    .await;
    // Peer 3 now claims peer 1's pod CIDR: the earlier node keeps it (full pass).
    a3.kubespan.as_mut().unwrap().additional_addresses = vec!["10.244.0.0/16".parse().unwrap()];
    set_affiliate(store, &a3);
    assert_resource::<KubeSpanPeerSpec>(store, NS, &key(3), |r| {
        let removed: Vec<String> = r
            .spec
            .overlap_removed
            .iter()
            .map(ToString::to_string)
            .collect();
        (removed == ["10.244.1.0/24", "10.244.2.0/24"])
            .then_some(())
            .ok_or(format!("{removed:?} {:?}", allowed(r)))
    })
    .await;
    let p1 = m.h.store.get::<KubeSpanPeerSpec>(NS, &key(1)).unwrap();
    assert_eq!(
        allowed(&p1),
        ["10.5.0.1/32", "10.244.1.0/24", "fd21:4de:ec13:da02::1/128"]
    );
    // And back: the overlap is gone again.
    a3.kubespan.as_mut().unwrap().additional_addresses = vec!["10.3.0.0/16".parse().unwrap()];
    set_affiliate(store, &a3);
    assert_resource::<KubeSpanPeerSpec>(store, NS, &key(3), |r| {
        (r.spec.overlap_removed.is_empty() && allowed(r).contains(&"10.3.0.0/16".to_owned()))
            .then_some(())
            .ok_or(format!("{:?}", r.spec))
    })
    .await;
    // Peer 1 then changes incrementally again.
    let mut a1 = affiliate(1, &["192.0.2.1:51820"]);
    a1.kubespan.as_mut().unwrap().additional_addresses = vec!["10.77.0.0/16".parse().unwrap()];
    set_affiliate(store, &a1);
    assert_resource::<KubeSpanPeerSpec>(store, NS, &key(1), |r| {
        allowed(r)
            .contains(&"10.77.0.0/16".to_owned())
            .then_some(())
            .ok_or(format!("{:?}", r.spec))
    })
    .await;
    m.h.stop().await.unwrap();
}

#[tokio::test]
async fn ebpf_attach_failure_falls_back_to_nftables_marking_with_a_note() {
    let m = start("fastPath: ebpf\n", tempfile::tempdir().unwrap());
    let store = &m.h.store;
    set_affiliate(store, &affiliate(1, &["192.0.2.1:51820"]));
    let spec = eventually("marking applied", || {
        m.marking.spec().filter(|s| !s.prefixes_v4.is_empty())
    })
    .await;
    // Plain nftables marking: the prerouting set lookups stay.
    assert_eq!(spec.prerouting, PreroutingMarking::Nftables);
    assert_resource::<KubeSpanManagerStatus>(store, NS, KUBESPAN, |r| {
        if r.spec.fast_path == "nftables"
            && r.spec.note.contains("eBPF fast path unsupported")
            && r.spec.note.contains("marking with nftables")
        {
            Ok(())
        } else {
            Err(format!("{:?}", r.spec))
        }
    })
    .await;
    m.h.stop().await.unwrap();
}

/// Random joins, leaves, key moves and overlapping claims: after every step the peer
/// specs equal a full pass over the same affiliates, whichever path produced them.
#[tokio::test]
async fn peer_specs_after_random_changes_equal_a_full_pass() {
    use crate::kubespan::peers::{claimed_set, resolve_overlaps, select};
    use std::collections::BTreeMap;

    let m = start("", tempfile::tempdir().unwrap());
    let store = &m.h.store;
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut rnd = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let cidrs = [
        "10.1.0.0/16",
        "10.1.2.0/24",
        "10.2.0.0/16",
        "10.3.0.0/24",
        "10.4.0.0/24",
        "10.6.0.0/24",
        "10.7.0.0/24",
        "10.8.0.0/24",
    ];
    let mut live: BTreeMap<String, AffiliateSpec> = BTreeMap::new();
    for step in 0..120 {
        let n = 1 + u8::try_from(rnd(10)).unwrap();
        let id = format!("node{n}");
        if rnd(4) == 0 && live.contains_key(&id) {
            store
                .destroy(
                    &Pointer::new("cluster", crate::resources::cluster::Affiliate::TYPE, &id),
                    "",
                )
                .unwrap();
            live.remove(&id);
        } else {
            let mut a = affiliate(n, &["192.0.2.1:51820"]);
            let ks = a.kubespan.as_mut().unwrap();
            if rnd(8) == 0 {
                // Another node's key: a conflict the first node ID wins.
                ks.public_key = key(1 + u8::try_from(rnd(10)).unwrap());
            }
            // Mostly disjoint per-node ranges, sometimes shared ones.
            ks.additional_addresses = if rnd(3) == 0 {
                vec![cidrs[usize::try_from(rnd(8)).unwrap()].parse().unwrap()]
            } else {
                vec![format!("10.{}.{}.0/24", 100 + n, rnd(4)).parse().unwrap()]
            };
            set_affiliate(store, &a);
            live.insert(id, a);
        }
        let (selected, _) = select("node0", "", live.iter().map(|(id, a)| (id.as_str(), a)));
        let sets: Vec<_> = selected.iter().map(|s| claimed_set(s.affiliate)).collect();
        let want: BTreeMap<String, Vec<String>> = selected
            .iter()
            .zip(resolve_overlaps(&sets))
            .map(|(s, r)| {
                (
                    s.public_key.to_owned(),
                    r.allowed_ips.iter().map(ToString::to_string).collect(),
                )
            })
            .collect();
        let mut last = BTreeMap::new();
        let settled = tokio::time::timeout(TIMEOUT, async {
            loop {
                last = store
                    .list::<KubeSpanPeerSpec>(NS, &crate::runtime::Filter::all())
                    .iter()
                    .map(|r| {
                        (
                            r.metadata.id.clone(),
                            r.spec.allowed_ips.iter().map(ToString::to_string).collect(),
                        )
                    })
                    .collect::<BTreeMap<String, Vec<String>>>();
                if last == want {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
        .await;
        assert!(
            settled.is_ok(),
            "step {step}: peer specs differ from a full pass\n got {last:?}\nwant {want:?}"
        );
    }
    m.h.stop().await.unwrap();
}

/// A peer with this node's KubeSpan address (a cloned MAC) keeps its other ranges but
/// not that address, and the spec says what was withheld (`docs/kubespan.md` §3.4).
#[tokio::test]
async fn a_peer_claiming_this_nodes_address_does_not_get_it() {
    let m = start("", tempfile::tempdir().unwrap());
    let store = &m.h.store;
    let own: std::net::IpAddr = "fd21:4de:ec13:da02:216:3eff:fe12:3456".parse().unwrap();
    set_affiliate(store, &affiliate(1, &["192.0.2.1:51820"]));
    let mut clone = affiliate(2, &["192.0.2.2:51820"]);
    clone.kubespan.as_mut().unwrap().address = Some(own);
    set_affiliate(store, &clone);
    assert_resource::<KubeSpanPeerSpec>(store, NS, &key(2), |r| {
        let allowed: Vec<String> = r.spec.allowed_ips.iter().map(ToString::to_string).collect();
        let removed: Vec<String> = r
            .spec
            .overlap_removed
            .iter()
            .map(ToString::to_string)
            .collect();
        (allowed == ["10.5.0.2/32", "10.244.2.0/24"] && removed == [format!("{own}/128")])
            .then_some(())
            .ok_or(format!("allowed {allowed:?} removed {removed:?}"))
    })
    .await;
    // Once it has its own address again, nothing is withheld (and peer 1 never changed).
    set_affiliate(store, &affiliate(2, &["192.0.2.2:51820"]));
    assert_resource::<KubeSpanPeerSpec>(store, NS, &key(2), |r| {
        (r.spec.overlap_removed.is_empty() && r.spec.allowed_ips.len() == 3)
            .then_some(())
            .ok_or(format!("{:?}", r.spec))
    })
    .await;
    let p1 = store.get::<KubeSpanPeerSpec>(NS, &key(1)).unwrap();
    assert!(p1.spec.overlap_removed.is_empty(), "{:?}", p1.spec);
    m.h.stop().await.unwrap();
}

/// Every endpoint a WireGuard write set, by peer, from update `from` on.
fn endpoint_writes(wg: &FakeWireGuard, from: usize) -> Vec<(String, SocketAddr)> {
    wg.updates()[from..]
        .iter()
        .flat_map(|u| &u.peers)
        .filter_map(|p| p.endpoint.map(|e| (p.public_key.to_base64(), e)))
        .collect()
}

fn device_endpoint(wg: &FakeWireGuard, key: &PublicKey) -> Option<SocketAddr> {
    wg.device()?
        .peers
        .iter()
        .find(|p| &p.public_key == key)?
        .endpoint
}

fn peer_status(store: &Store, n: u8) -> Option<crate::resources::kubespan::KubeSpanPeerStatusSpec> {
    store
        .get::<KubeSpanPeerStatus>(NS, &key(n))
        .ok()
        .map(|r| r.spec.clone())
}

#[tokio::test]
async fn a_restart_over_kept_kernel_state_adopts_peers_without_pushing_rotating_or_dropping() {
    let eps = ["192.0.2.1:51820", "192.0.2.2:51820"];
    let m = start("", tempfile::tempdir().unwrap());
    for n in 1..=3 {
        set_affiliate(&m.h.store, &affiliate(n, &eps));
    }
    eventually("3 device peers", || {
        (device_peers(&m.wg) == 3).then_some(())
    })
    .await;
    let k: Vec<PublicKey> = (0..=3)
        .map(|n| PublicKey::from_base64("k", &key(n)).unwrap())
        .collect();
    // Peer 1 reached us from behind a NAT (roamed); all three handshook.
    let roamed: SocketAddr = "198.51.100.7:40000".parse().unwrap();
    m.wg.roam(&k[1], roamed);
    m.clock.advance(Duration::from_secs(1));
    let hs = m.clock.now();
    for key in &k[1..] {
        m.wg.handshake(key, hs, 1000, 2000);
    }
    // The next poll sees the handshakes: every peer up and kept alive.
    m.clock.advance(Duration::from_secs(1));
    eventually("every peer up and kept alive", || {
        let up =
            (1..=3).all(|n| peer_status(&m.h.store, n).is_some_and(|s| s.state == PeerState::Up));
        m.wg.device()
            .filter(|d| up && d.peers.iter().all(|p| p.persistent_keepalive == 25))
    })
    .await;
    let (wg, marking, dir) = (m.wg.clone(), m.marking.clone(), m._dir);
    m.h.stop().await.unwrap();
    let before = wg.device().unwrap();

    // The daemon comes back 20 s later (`--on-stop keep`): discovery has not answered
    // yet, so no peer has a spec.
    let writes = wg.updates().len();
    let transactions = marking.transactions();
    let m = start_over(
        "",
        dir,
        wg.clone(),
        marking.clone(),
        FakeClock::new(hs + Duration::from_secs(20)),
    );
    let store = &m.h.store;
    assert_resource::<KubeSpanManagerStatus>(store, NS, KUBESPAN, |_| Ok(())).await;
    assert_eq!(
        wg.device().unwrap(),
        before,
        "the kept device was rewritten"
    );
    assert_eq!(wg.updates().len(), writes);
    assert_eq!(
        marking.transactions(),
        transactions,
        "the marking table was torn down or rewritten"
    );

    // Peers 1 and 2 come back from discovery; peer 3 does not (it left meanwhile).
    for n in 1..=2 {
        set_affiliate(store, &affiliate(n, &eps));
    }
    for n in 1..=2 {
        let st = eventually("the peer's status", || peer_status(store, n)).await;
        assert_eq!(st.state, PeerState::Up, "peer {n}: {st:?}");
        assert_eq!(st.last_handshake_time, Some(hs));
    }
    assert_eq!(device_endpoint(&wg, &k[1]), Some(roamed));
    // Past the 15 s connection timeout, a tick with a device read (peer 2's new
    // counters show it): nobody is down, nothing rotated.
    m.clock.advance(Duration::from_secs(31));
    wg.handshake(&k[2], hs + Duration::from_secs(40), 5000, 6000);
    eventually("a read of the device", || {
        peer_status(store, 2).filter(|s| s.receive_bytes == 5000)
    })
    .await;
    for n in 1..=2 {
        assert_eq!(peer_status(store, n).unwrap().state, PeerState::Up);
    }
    assert_eq!(
        endpoint_writes(&wg, writes),
        vec![],
        "an endpoint was pushed"
    );
    assert_eq!(device_endpoint(&wg, &k[1]), Some(roamed));
    assert_eq!(
        device_peers(&wg),
        3,
        "peer 3 was dropped before its grace ran out"
    );

    // Peer 3 never got a spec: gone once the grace after start has passed.
    for key in &k[1..=2] {
        wg.handshake(key, m.clock.now(), 7000, 8000);
    }
    m.clock.advance(super::manager::RETAIN_AFTER_START);
    eventually("peer 3 removed", || (device_peers(&wg) == 2).then_some(())).await;
    assert!(wg
        .device()
        .unwrap()
        .peers
        .iter()
        .all(|p| p.public_key != k[3]));
    m.h.stop().await.unwrap();
}

fn manager_reconciles(metrics: &super::metrics::MeshMetrics) -> u64 {
    metrics
        .render()
        .lines()
        .find(|l| {
            l.starts_with("wirespan_controller_reconcile_seconds_count")
                && l.contains(super::manager::NAME)
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn a_mesh_config_not_derived_yet_is_not_a_disabled_mesh() {
    // Marking kept by an earlier run.
    let marking = FakeMarking::new();
    let mut m = marking.clone();
    m.apply(&MarkingSpec::default()).unwrap();
    let metrics = Arc::new(super::metrics::MeshMetrics::new());
    let store = Store::new(StoreOptions::default());
    let mut runtime = Runtime::new(store.clone());
    // The manager alone: the machine config turns the mesh on, but nothing derives
    // `KubeSpanConfig` from it (the moment after start, before the config controller
    // has run).
    runtime
        .register(super::manager::KubeSpanManagerController::new(
            ManagerDeps {
                wireguard: Arc::new(FakeWgFactory(FakeWireGuard::new("kubespan"))),
                marking: Arc::new(FakeMarkingFactory(marking.clone())),
                routing_cleanup: None,
                clock: Arc::new(FakeClock::new(SystemTime::UNIX_EPOCH)),
                metrics: Some(Arc::clone(&metrics)),
                on_stop: OnStop::Keep,
                sysctl: None,
                prober: None,
            },
        ))
        .unwrap();
    set_config(&store, &config(""));
    let h = Harness::start(runtime);
    eventually("a reconcile of the manager", || {
        (manager_reconciles(&metrics) >= 1).then_some(())
    })
    .await;
    assert_eq!(
        marking.teardowns(),
        0,
        "torn down before the config was derived"
    );
    assert!(marking.spec().is_some());
    // A config without a mesh document is a disabled mesh: what the earlier run kept
    // goes.
    let cfg =
        crate::config::parse("apiVersion: v1alpha1\nkind: KubeSpanEndpointsConfig\n").unwrap();
    set_config(
        &store,
        &MachineConfigSpec {
            source: "test".into(),
            document_count: 1,
            config: cfg,
        },
    );
    eventually("the kept marking torn down", || {
        (marking.teardowns() == 1).then_some(())
    })
    .await;
    h.stop().await.unwrap();
}

/// The allowed IPs the device holds for `key`, as text.
fn device_allowed(wg: &FakeWireGuard, key: &PublicKey) -> Vec<String> {
    wg.device()
        .and_then(|d| d.peers.into_iter().find(|p| p.public_key == *key))
        .map(|p| p.allowed_ips.iter().map(ToString::to_string).collect())
        .unwrap_or_default()
}

/// §8.7: peer 1's direct path never comes up; once the receive window has passed,
/// its traffic goes through peer 2 (a wirespan node offering to relay, up here, and
/// reaching peer 1): peer 1's prefixes move onto peer 2 on the device, the status says
/// `relay via n2`, this node publishes peer 1 as not directly reachable, and each
/// endpoint push holds peer 1's keepalive at 0 for a moment and turns it on again so
/// WireGuard retries the direct handshake. When that handshake succeeds the prefixes
/// move back and the path is direct again.
#[tokio::test]
async fn a_peer_without_a_direct_path_goes_through_a_relay_and_comes_back_direct() {
    let m = start("peerReceiveTimeout: 30s\n", tempfile::tempdir().unwrap());
    m.sysctl.set("net.ipv4.ip_forward", "1");
    m.sysctl.set("net.ipv6.conf.all.forwarding", "1");
    let store = &m.h.store;
    let ext = |offered: bool| WirespanAffiliateSpec {
        version: 1,
        persistent_keepalive_secs: 10,
        relay_user: true,
        relay_offered: offered,
        ..WirespanAffiliateSpec::default()
    };
    set_affiliate(
        store,
        &AffiliateSpec {
            wirespan: Some(ext(false)),
            ..affiliate(1, &["192.0.2.1:51820"])
        },
    );
    set_affiliate(
        store,
        &AffiliateSpec {
            wirespan: Some(ext(true)),
            ..affiliate(2, &["192.0.2.2:51820"])
        },
    );
    let (k1, k2) = (
        PublicKey::from_bytes([1; 32]),
        PublicKey::from_bytes([2; 32]),
    );
    eventually("both peers on the device", || {
        (device_peers(&m.wg) == 2).then_some(())
    })
    .await;
    let own1 = ["10.244.1.0/24", "fd21:4de:ec13:da02::1/128"];
    assert!(own1
        .iter()
        .all(|p| device_allowed(&m.wg, &k1).contains(&(*p).to_owned())));
    // Peer 2 answers all along; peer 1 never does.
    let mut rx = 100;
    for _ in 0..4 {
        m.clock.advance(Duration::from_secs(9));
        rx += 100;
        m.wg.handshake(&k2, m.clock.now(), rx, rx);
        assert_resource::<KubeSpanPeerStatus>(store, NS, &key(2), |r| {
            (r.spec.state == PeerState::Up)
                .then_some(())
                .ok_or_else(|| format!("{:?}", r.spec))
        })
        .await;
    }
    assert_resource::<KubeSpanPeerStatus>(store, NS, &key(1), |r| {
        (r.spec.path == PeerPath::Relay && r.spec.via == "n2" && r.spec.state != PeerState::Up)
            .then_some(())
            .ok_or_else(|| format!("{:?}", r.spec))
    })
    .await;
    let relayed = eventually("peer 1's prefixes on peer 2", || {
        let on2 = device_allowed(&m.wg, &k2);
        (own1.iter().all(|p| on2.contains(&(*p).to_owned()))
            && device_allowed(&m.wg, &k1).is_empty())
        .then_some(on2)
    })
    .await;
    assert!(
        relayed.contains(&"fd21:4de:ec13:da02::2/128".to_owned()),
        "{relayed:?}"
    );
    assert_resource::<KubeSpanManagerStatus>(store, NS, KUBESPAN, |r| {
        (r.spec.relay_offered && r.spec.direct_down == [0x0101_0101_0101_0101])
            .then_some(())
            .ok_or_else(|| format!("{:?}", r.spec))
    })
    .await;
    // The direct path keeps being retried: each cycle (15 s from the last endpoint
    // push) starts with the keepalive off, then on again (the write that makes
    // WireGuard initiate).
    let keepalives = || -> Vec<u16> {
        m.wg.updates()
            .iter()
            .flat_map(|u| &u.peers)
            .filter(|p| p.public_key == k1)
            .filter_map(|p| p.persistent_keepalive)
            .collect()
    };
    let before = keepalives().len();
    m.clock.advance(Duration::from_secs(9)); // 45 s: the fourth cycle starts
    m.wg.handshake(&k2, m.clock.now(), rx + 100, rx + 100);
    eventually("keepalive held at 0 after the push", || {
        keepalives()[before..].contains(&0).then_some(())
    })
    .await;
    m.clock.advance(Duration::from_secs(1));
    eventually("keepalive on again", || {
        keepalives()[before..].ends_with(&[0, 10]).then_some(())
    })
    .await;
    // The direct handshake succeeds: back to direct, prefixes back on peer 1.
    m.wg.handshake(&k1, m.clock.now(), 50, 50);
    m.clock.advance(Duration::from_secs(1));
    assert_resource::<KubeSpanPeerStatus>(store, NS, &key(1), |r| {
        (r.spec.path == PeerPath::Direct && r.spec.via.is_empty() && r.spec.state == PeerState::Up)
            .then_some(())
            .ok_or_else(|| format!("{:?}", r.spec))
    })
    .await;
    eventually("peer 1's prefixes back on peer 1", || {
        let on1 = device_allowed(&m.wg, &k1);
        let on2 = device_allowed(&m.wg, &k2);
        (own1
            .iter()
            .all(|p| on1.contains(&(*p).to_owned()) && !on2.contains(&(*p).to_owned())))
        .then_some(())
    })
    .await;
    assert_resource::<KubeSpanManagerStatus>(store, NS, KUBESPAN, |r| {
        r.spec
            .direct_down
            .is_empty()
            .then_some(())
            .ok_or_else(|| format!("{:?}", r.spec))
    })
    .await;
    m.h.stop().await.unwrap();
}

fn destroy_affiliate(store: &Store, n: u8) {
    store
        .destroy(
            &Pointer::new(
                "cluster",
                crate::resources::cluster::Affiliate::TYPE,
                format!("node{n}"),
            ),
            "",
        )
        .unwrap();
}

/// §8.10: a peer discovery stops listing (anyone with the cluster ID can delete its
/// affiliate) stays, with its AllowedIPs and routes, while its session is fresh, and
/// says why in its status; listed again it is an ordinary peer without a device change;
/// once its session goes stale (its receive window passes in silence) it is removed. A
/// peer that never handshook is removed at once, as before.
#[tokio::test]
async fn an_unlisted_peer_with_a_fresh_session_is_kept_until_it_goes_stale() {
    use crate::kubespan::rotation::UNLISTED_KEPT;
    let m = start("peerReceiveTimeout: 30s\n", tempfile::tempdir().unwrap());
    let store = &m.h.store;
    let ours = AffiliateSpec {
        wirespan: Some(WirespanAffiliateSpec {
            version: 1,
            persistent_keepalive_secs: 10,
            ..WirespanAffiliateSpec::default()
        }),
        ..affiliate(1, &["192.0.2.1:51820"])
    };
    set_affiliate(store, &ours);
    set_affiliate(store, &affiliate(2, &["192.0.2.2:51820"]));
    let k1 = PublicKey::from_bytes([1; 32]);
    eventually("both peers on the device", || {
        (device_peers(&m.wg) == 2).then_some(())
    })
    .await;
    m.clock.advance(Duration::from_secs(1));
    let mut rx = 100;
    m.wg.handshake(&k1, m.clock.now(), rx, 100);
    m.clock.advance(Duration::from_secs(1));
    assert_resource::<KubeSpanPeerStatus>(store, NS, &key(1), |r| {
        (r.spec.state == PeerState::Up)
            .then_some(())
            .ok_or_else(|| format!("{:?}", r.spec))
    })
    .await;
    let allowed = device_allowed(&m.wg, &k1);
    assert!(allowed.contains(&"10.244.1.0/24".to_owned()), "{allowed:?}");

    // Both affiliates vanish: peer 2 (never handshook) goes, peer 1 stays as it was.
    destroy_affiliate(store, 1);
    destroy_affiliate(store, 2);
    assert_no_resource(store, &Pointer::new(NS, KubeSpanPeerStatus::TYPE, key(2))).await;
    assert_no_resource(store, &Pointer::new(NS, KubeSpanPeerSpec::TYPE, key(1))).await;
    eventually("peer 2 removed from the device", || {
        (device_peers(&m.wg) == 1).then_some(())
    })
    .await;
    assert_resource::<KubeSpanPeerStatus>(store, NS, &key(1), |r| {
        (r.spec.retained_reason == UNLISTED_KEPT && r.spec.state == PeerState::Up)
            .then_some(())
            .ok_or_else(|| format!("{:?}", r.spec))
    })
    .await;
    assert_eq!(device_allowed(&m.wg, &k1), allowed);
    assert!(routed_v4(&m.marking.spec().unwrap()).contains(&"10.244.1.0/24".to_owned()));

    // Traffic keeps coming for several receive windows (the device is read as its
    // rules say): kept all along.
    for _ in 0..16 {
        m.clock.advance(Duration::from_secs(5));
        rx += 100;
        m.wg.handshake(&k1, m.clock.now(), rx, 100);
        settled(&m.clock).await;
        let st = peer_status(store, 1).unwrap();
        assert_eq!(st.retained_reason, UNLISTED_KEPT, "{st:?}");
        assert_eq!(st.state, PeerState::Up, "{st:?}");
        assert_eq!(device_allowed(&m.wg, &k1), allowed);
    }
    eventually("reads saw the traffic", || {
        peer_status(store, 1).filter(|s| s.receive_bytes >= 1000)
    })
    .await;

    // Listed again: the reason goes, nothing on the device changes.
    let writes = m.wg.updates().len();
    set_affiliate(store, &ours);
    eventually("the reason cleared", || {
        peer_status(store, 1).filter(|s| s.retained_reason.is_empty())
    })
    .await;
    assert_eq!(
        endpoint_writes(&m.wg, writes),
        vec![],
        "an endpoint was pushed"
    );
    assert!(
        m.wg.updates()[writes..]
            .iter()
            .flat_map(|u| &u.peers)
            .all(|p| !p.remove),
        "the peer was removed and re-added"
    );
    assert_eq!(device_allowed(&m.wg, &k1), allowed);

    // Unlisted again, and silent from now on: removed once its window passed.
    destroy_affiliate(store, 1);
    eventually("kept again", || {
        peer_status(store, 1).filter(|s| s.retained_reason == UNLISTED_KEPT)
    })
    .await;
    for _ in 0..8 {
        m.clock.advance(Duration::from_secs(10));
        settled(&m.clock).await;
    }
    assert_no_resource(store, &Pointer::new(NS, KubeSpanPeerStatus::TYPE, key(1))).await;
    eventually("peer 1 removed from the device", || {
        (device_peers(&m.wg) == 0).then_some(())
    })
    .await;
    assert!(!routed_v4(&m.marking.spec().unwrap()).contains(&"10.244.1.0/24".to_owned()));
    m.h.stop().await.unwrap();
}
