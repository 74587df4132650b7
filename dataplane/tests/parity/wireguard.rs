//! WireGuard: `FakeWireGuard` against the backend named by `WIRESPAN_TEST_WIREGUARD`
//! (wireguard-go by default: this host's kernel has no WireGuard; the suite's VM tier
//! runs it against kernel WireGuard).

use std::net::SocketAddr;

use ipnet::IpNet;
use wirespan_dataplane::{
    fake::FakeWireGuard,
    netns::{unique_name, NetnsGuard},
    wireguard::{
        self as wireguard, BackendChoice, DeviceState, PeerChange, PresharedKey, PrivateKey,
        PublicKey, WgDevice, WgError, WgPeer, WireGuard,
    },
};

use crate::runner::{invalid, net, nets, ret, run_parity, step, Step};

/// A WireGuard side: the adapter, a full read of the device and the simulation of a
/// peer roaming.
trait WgSide {
    fn wg(&mut self) -> &mut dyn WireGuard;
    /// Every field of the device, read behind the adapter's back; `None`: no device.
    fn device(&self) -> Option<DeviceView>;
    /// The peer reaches us from `endpoint` (WireGuard learns it).
    fn roam(&self, key: &PublicKey, endpoint: SocketAddr);
}

/// A side as the steps take it (`dyn WgSide + 'static`: each side owns what it uses).
type DynWgSide = dyn WgSide;

/// The whole device, comparable across sides.
#[derive(Debug, PartialEq)]
struct DeviceView {
    public_key: Option<String>,
    listen_port: Option<u16>,
    fwmark: u32,
    /// Sorted by public key: wireguard-go lists peers in map order, the fake in the
    /// order of its writes (a removal moves the last peer into the gap).
    peers: Vec<PeerView>,
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct PeerView {
    public_key: String,
    preshared_key: Option<String>,
    endpoint: Option<SocketAddr>,
    /// Sorted: WireGuard keeps allowed IPs in a trie and lists them in its own order.
    allowed_ips: Vec<IpNet>,
    persistent_keepalive: u16,
    // Last handshake and counters are compared in `observe()`'s report (nobody
    // answers the initiations sent to these endpoints: none and zero on both sides;
    // a real handshake is `wireguard.rs`'s two-device test).
}

impl From<&DeviceState> for DeviceView {
    fn from(d: &DeviceState) -> Self {
        let mut peers: Vec<PeerView> = d
            .peers
            .iter()
            .map(|p| {
                let mut allowed_ips = p.allowed_ips.clone();
                allowed_ips.sort();
                PeerView {
                    public_key: p.public_key.to_base64(),
                    preshared_key: p.preshared_key.as_ref().map(PresharedKey::to_base64),
                    endpoint: p.endpoint,
                    allowed_ips,
                    persistent_keepalive: p.persistent_keepalive,
                }
            })
            .collect();
        peers.sort();
        Self {
            public_key: d.private_key.as_ref().map(|k| k.public_key().to_base64()),
            listen_port: port(d.listen_port),
            fwmark: d.fwmark,
            peers,
        }
    }
}

struct FakeWg(FakeWireGuard);

impl WgSide for FakeWg {
    fn wg(&mut self) -> &mut dyn WireGuard {
        &mut self.0
    }

    fn device(&self) -> Option<DeviceView> {
        self.0.device().as_ref().map(DeviceView::from)
    }

    fn roam(&self, key: &PublicKey, endpoint: SocketAddr) {
        self.0.roam(key, endpoint);
    }
}

struct RealWg {
    ns: NetnsGuard,
    wg: Box<dyn WireGuard + Send>,
}

impl RealWg {
    /// `wg show IF dump` (tab separated): the interface line, then one per peer.
    fn dump(&self) -> Option<Vec<Vec<String>>> {
        let out = self
            .ns
            .run_stdout("wg", &["show", self.wg.name(), "dump"])
            .ok()?;
        Some(
            out.lines()
                .map(|l| l.split('\t').map(str::to_owned).collect())
                .collect(),
        )
    }
}

/// A listen port the scenario set, `None` for one WireGuard chose: wireguard-go binds
/// a random port in the kernel's ephemeral range (32768–60999) until one is set, the
/// fake reports 0. The scenario only sets ports below that range.
fn port(p: u16) -> Option<u16> {
    (p != 0 && !(32768..=60999).contains(&p)).then_some(p)
}

/// `(none)` / `off` in `wg show dump` as `None`.
fn field(s: &str) -> Option<&str> {
    (s != "(none)" && s != "off").then_some(s)
}

impl WgSide for RealWg {
    fn wg(&mut self) -> &mut dyn WireGuard {
        self.wg.as_mut()
    }

    fn device(&self) -> Option<DeviceView> {
        let lines = self.dump()?;
        let (iface, peers) = lines.split_first()?;
        let mut peers: Vec<PeerView> = peers
            .iter()
            .map(|l| {
                let mut allowed_ips: Vec<IpNet> = field(&l[3])
                    .map(|s| s.split(',').map(net).collect())
                    .unwrap_or_default();
                allowed_ips.sort();
                PeerView {
                    public_key: l[0].clone(),
                    preshared_key: field(&l[1]).map(str::to_owned),
                    endpoint: field(&l[2]).map(|e| e.parse().unwrap()),
                    allowed_ips,
                    persistent_keepalive: field(&l[7]).map_or(0, |k| k.parse().unwrap()),
                }
            })
            .collect();
        peers.sort();
        Some(DeviceView {
            public_key: field(&iface[1]).map(str::to_owned),
            listen_port: port(iface[2].parse().unwrap()),
            fwmark: field(&iface[3]).map_or(0, |m| {
                u32::from_str_radix(m.trim_start_matches("0x"), 16).unwrap()
            }),
            peers,
        })
    }

    fn roam(&self, key: &PublicKey, endpoint: SocketAddr) {
        let (k, e) = (key.to_base64(), endpoint.to_string());
        self.ns
            .run("wg", &["set", self.wg.name(), "peer", &k, "endpoint", &e])
            .unwrap();
    }
}

/// What a WireGuard side reports after a step.
#[derive(Debug, PartialEq)]
struct WgReport {
    observed: ObservedWg,
    device: Option<DeviceView>,
    writes: u64,
}

/// `observe()`.
#[derive(Debug, PartialEq)]
struct ObservedWg {
    present: bool,
    public_key: Option<PublicKey>,
    listen_port: Option<u16>,
    /// (public key, endpoint, last handshake, rx and tx bytes, keepalive).
    peers: Vec<ObservedPeer>,
}

type ObservedPeer = (
    PublicKey,
    Option<SocketAddr>,
    Option<std::time::SystemTime>,
    (u64, u64),
    u16,
);

fn wg_report(side: &mut DynWgSide) -> WgReport {
    let st = side.wg().observe().unwrap();
    WgReport {
        observed: ObservedWg {
            present: st.present,
            public_key: st.public_key,
            listen_port: port(st.listen_port),
            peers: st
                .peers
                .into_iter()
                .map(|p| {
                    (
                        p.public_key,
                        p.endpoint,
                        p.last_handshake,
                        (p.rx_bytes, p.tx_bytes),
                        p.persistent_keepalive,
                    )
                })
                .collect(),
        },
        device: side.device(),
        writes: side.wg().writes(),
    }
}

fn wg_err(e: &WgError) -> String {
    match e {
        WgError::Invalid(e) => invalid(e),
        WgError::Refused { errno, .. } => format!("Refused({errno})"),
        WgError::State(_, why) => format!("State({why})"),
        other => other.to_string(),
    }
}

fn wg_peer(ips: &[&str]) -> WgPeer {
    WgPeer {
        public_key: PrivateKey::generate().public_key(),
        preshared_key: Some(PresharedKey::generate()),
        persistent_keepalive: 25,
        endpoint: None,
        allowed_ips: nets(ips),
    }
}

fn wg_steps(name: &str) -> Vec<Step<DynWgSide>> {
    let apply = |d: &WgDevice| {
        let d = d.clone();
        move |s: &mut DynWgSide| vec![ret(s.wg().apply(&d), wg_err)]
    };
    let apply_peers =
        |c: Vec<PeerChange>| move |s: &mut DynWgSide| vec![ret(s.wg().apply_peers(&c), wg_err)];

    let (a, b, c) = (
        WgPeer {
            endpoint: Some("192.0.2.1:51820".parse().unwrap()),
            ..wg_peer(&["10.1.0.1/32", "10.244.1.0/24", "fd00:1::1/128"])
        },
        WgPeer {
            preshared_key: None,
            persistent_keepalive: 0,
            ..wg_peer(&["10.1.0.2/32"])
        },
        WgPeer {
            endpoint: Some("[2001:db8::3]:51820".parse().unwrap()),
            ..wg_peer(&["10.1.0.3/32", "10.244.3.0/24"])
        },
    );
    let d = wg_peer(&["10.1.0.4/32"]);
    let e = wg_peer(&["10.1.0.5/32", "10.1.0.0/16"]);
    let dev = WgDevice {
        name: name.to_owned(),
        private_key: PrivateKey::generate(),
        listen_port: 31820,
        fwmark: 0x20,
        peers: vec![a.clone(), b, c.clone()],
    };

    let mut reordered = dev.clone();
    reordered.peers.reverse();
    reordered.peers[0].allowed_ips.reverse();

    // Peer a: PSK dropped, keepalive off, allowed IPs changed, a new endpoint.
    let mut changed = dev.clone();
    changed.peers[0] = WgPeer {
        preshared_key: None,
        persistent_keepalive: 0,
        endpoint: Some("192.0.2.11:51821".parse().unwrap()),
        allowed_ips: nets(&["10.1.0.1/32", "10.245.0.0/16"]),
        ..a.clone()
    };
    // Peer b: a PSK and keepalive appear.
    changed.peers[1].preshared_key = Some(PresharedKey::generate());
    changed.peers[1].persistent_keepalive = 15;

    let mut no_endpoint = changed.clone();
    no_endpoint.peers[2].endpoint = None;

    let mut b2 = changed.peers[1].clone();
    b2.allowed_ips.push(net("10.246.0.0/16"));

    let mut bad_peer = wg_peer(&["10.9.0.1/24"]);
    bad_peer.endpoint = None;
    let mut duplicate = changed.clone();
    duplicate.peers[1].public_key = duplicate.peers[0].public_key.clone();

    // After the peer changes: b2, c and d (a removed, e added then removed).
    let mut settings = WgDevice {
        peers: vec![b2.clone(), changed.peers[2].clone(), d.clone()],
        ..changed.clone()
    };
    settings.listen_port = 31821;
    settings.fwmark = 0x21;
    settings.private_key = PrivateKey::generate();

    // b also claims d's address: WireGuard gives it to the peer written last.
    let mut moved = settings.clone();
    moved.peers[0].allowed_ips.push(net("10.1.0.4/32"));
    let mut c_takes = settings.peers[1].clone();
    c_takes.allowed_ips.push(net("10.1.0.4/32"));
    let only_d = WgDevice {
        peers: vec![d.clone()],
        ..settings.clone()
    };
    let (c_key, a_key, e_key) = (c.public_key, a.public_key, e.public_key.clone());

    vec![
        step(
            "apply_peers before any apply",
            apply_peers(vec![PeerChange::Upsert(d.clone())]),
        ),
        step("no peer changes", apply_peers(Vec::new())),
        step("ensure creates an empty device", |s: &mut DynWgSide| {
            vec![ret(s.wg().ensure(), wg_err)]
        }),
        step("first apply: key, port, fwmark, three peers", apply(&dev)),
        step(
            "the same device again, peers and allowed IPs reordered",
            apply(&reordered),
        ),
        step(
            "change two peers: PSK, keepalive, allowed IPs, endpoint",
            apply(&changed),
        ),
        step("peer c roams", move |s: &mut DynWgSide| {
            s.roam(&c_key, "198.51.100.7:40000".parse().unwrap());
            Vec::new()
        }),
        step(
            "an apply without c's endpoint keeps the roamed one",
            apply(&no_endpoint),
        ),
        step(
            "apply_peers: change b, remove a, add d and e, remove an absent peer",
            apply_peers(vec![
                PeerChange::Upsert(b2.clone()),
                PeerChange::Remove(a_key.clone()),
                PeerChange::Upsert(d.clone()),
                PeerChange::Upsert(e.clone()),
                PeerChange::Remove(PrivateKey::generate().public_key()),
            ]),
        ),
        step(
            "apply_peers: unchanged peers and absent removals write nothing",
            apply_peers(vec![PeerChange::Upsert(d), PeerChange::Remove(a_key)]),
        ),
        step(
            "apply_peers: an invalid change writes nothing",
            apply_peers(vec![
                PeerChange::Remove(e_key.clone()),
                PeerChange::Upsert(bad_peer),
            ]),
        ),
        step(
            "apply_peers: a peer named twice writes nothing",
            apply_peers(vec![
                PeerChange::Remove(e_key.clone()),
                PeerChange::Upsert(e),
            ]),
        ),
        step(
            "apply_peers: remove e",
            apply_peers(vec![PeerChange::Remove(e_key)]),
        ),
        step(
            "an invalid device (a duplicate peer) writes nothing",
            apply(&duplicate),
        ),
        step(
            "a whole-device apply changing port, fwmark and key",
            apply(&settings),
        ),
        step(
            "an allowed IP also given to another peer moves to it",
            apply(&moved),
        ),
        step(
            "apply_peers: and again to a third",
            apply_peers(vec![PeerChange::Upsert(c_takes)]),
        ),
        step(
            "a whole-device apply keeping one peer removes the others",
            apply(&only_d),
        ),
        step("teardown removes the device", |s: &mut DynWgSide| {
            vec![
                ret(s.wg().teardown(), wg_err),
                ret(s.wg().teardown(), wg_err),
            ]
        }),
        step("an apply after teardown recreates it", apply(&only_d)),
    ]
}

/// The real side's backend: `WIRESPAN_TEST_WIREGUARD` (wireguard-go by default).
fn backend_under_test() -> BackendChoice {
    match std::env::var("WIRESPAN_TEST_WIREGUARD").as_deref() {
        Ok("kernel") => BackendChoice::Kernel,
        // This crate's tests cannot run the `wirespan` binary (another package's), so
        // every userspace name runs wireguard-go here; `wirespan wireguard` is tested
        // through the binary (`tests/userspace_wireguard.rs`, the labs).
        Ok("userspace" | "userspace-go" | "auto") | Err(_) => BackendChoice::UserspaceGo,
        Ok(other) => {
            panic!("WIRESPAN_TEST_WIREGUARD={other}: kernel, userspace, userspace-go or auto")
        }
    }
}

#[test]
fn wireguard_fake_matches_the_real_backend() {
    let name = unique_name("wsp");
    let ns = NetnsGuard::new("wspar").unwrap();
    let wg = wireguard::select(backend_under_test(), &name, ns.netns()).unwrap();
    crate::ran::record("wireguard", wg.backend());
    let mut real = RealWg { ns, wg };
    let mut fake = FakeWg(FakeWireGuard::new(&name));
    run_parity(&wg_steps(&name), &mut fake, &mut real, wg_report);
    real.wg.teardown().unwrap();
}
