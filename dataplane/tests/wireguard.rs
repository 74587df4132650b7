//! Kernel tests of the WireGuard backends, each in a fresh network namespace with a
//! uniquely named interface. The backend-independent tests run on the backend named by
//! `WIRESPAN_TEST_WIREGUARD` (`kernel` in the suite's VM tier; otherwise wireguard-go,
//! the only userspace device this crate's tests can run: this host's kernel has no
//! WireGuard); the supervisor and adoption tests are wireguard-go's own.

#[path = "support/ran.rs"]
mod ran;

use std::{
    net::UdpSocket,
    path::{Path, PathBuf},
    time::{Duration, Instant, SystemTime},
};

use wirespan_dataplane::{
    netns::{unique_name, NetnsGuard, NetnsThread},
    wireguard::{
        self, kernel,
        userspace::{self, UserspaceBackend},
        BackendChoice, PresharedKey, PrivateKey, WgDevice, WgError, WgPeer, WireGuard,
    },
};

/// `wg show IF dump`: the interface line and one line per peer, tab separated.
fn dump(ns: &NetnsGuard, ifname: &str) -> (Vec<String>, Vec<Vec<String>>) {
    let out = ns.run_stdout("wg", &["show", ifname, "dump"]).unwrap();
    let mut lines = out
        .lines()
        .map(|l| l.split('\t').map(str::to_owned).collect::<Vec<_>>());
    let first = lines.next().unwrap();
    // wireguard-go lists peers in map order.
    let mut peers: Vec<Vec<String>> = lines.collect();
    peers.sort();
    (first, peers)
}

fn peer(ips: &[&str]) -> WgPeer {
    WgPeer {
        public_key: PrivateKey::generate().public_key(),
        preshared_key: Some(PresharedKey::generate()),
        persistent_keepalive: 25,
        endpoint: None,
        allowed_ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
    }
}

/// The backend the backend-independent tests run on (`WIRESPAN_TEST_WIREGUARD`).
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

/// The backend under test for `name` in `ns`, recorded for the suite's summary.
fn backend_in(ns: &NetnsGuard, name: &str) -> Box<dyn WireGuard + Send> {
    let wg = wireguard::select(backend_under_test(), name, ns.netns()).unwrap();
    ran::record("wireguard", wg.backend());
    wg
}

fn setup(port: u16) -> (NetnsGuard, Box<dyn WireGuard + Send>, WgDevice) {
    let ns = NetnsGuard::new("wswg").unwrap();
    let name = unique_name("wst");
    let wg = backend_in(&ns, &name);
    let dev = device(name, port);
    (ns, wg, dev)
}

/// wireguard-go's own tests (its process, its reads).
fn setup_userspace(port: u16) -> (NetnsGuard, UserspaceBackend, WgDevice) {
    let ns = NetnsGuard::new("wswg").unwrap();
    let name = unique_name("wst");
    let wg = UserspaceBackend::new(&name, ns.netns().clone());
    ran::record("wireguard", "userspace-go");
    let dev = device(name, port);
    (ns, wg, dev)
}

fn device(name: String, port: u16) -> WgDevice {
    WgDevice {
        name,
        private_key: PrivateKey::generate(),
        listen_port: port,
        fwmark: 0x20,
        peers: vec![
            peer(&["10.1.0.1/32", "10.244.1.0/24"]),
            WgPeer {
                endpoint: Some("192.0.2.10:51820".parse().unwrap()),
                ..peer(&["10.1.0.2/32", "fd00:1::2/128"])
            },
        ],
    }
}

fn find<'a>(peers: &'a [Vec<String>], p: &WgPeer) -> &'a Vec<String> {
    peers
        .iter()
        .find(|l| l[0] == p.public_key.to_base64())
        .expect("peer present")
}

#[test]
fn apply_from_empty_then_noop_then_incremental() {
    let (ns, mut wg, mut dev) = setup(51820);
    assert!(wg.apply(&dev).unwrap());
    assert_eq!(wg.writes(), 1);
    let (iface, peers) = dump(&ns, &dev.name);
    assert_eq!(iface[0], dev.private_key.to_base64());
    assert_eq!(iface[1], dev.private_key.public_key().to_base64());
    assert_eq!(iface[2], "51820");
    assert_eq!(iface[3], "0x20");
    assert_eq!(peers.len(), 2);
    let p0 = find(&peers, &dev.peers[0]);
    assert_eq!(
        p0[1],
        dev.peers[0].preshared_key.as_ref().unwrap().to_base64()
    );
    assert_eq!(p0[2], "(none)");
    assert_eq!(p0[3], "10.1.0.1/32,10.244.1.0/24");
    assert_eq!(p0[7], "25");
    let p1 = find(&peers, &dev.peers[1]);
    assert_eq!(p1[2], "192.0.2.10:51820");
    assert_eq!(p1[3], "10.1.0.2/32,fd00:1::2/128");

    // Same state again, peers in another order: nothing written.
    dev.peers.reverse();
    assert!(!wg.apply(&dev).unwrap());
    assert_eq!(wg.writes(), 1);

    // Change one peer's allowed IPs, remove one, add one.
    let removed = dev.peers.remove(0);
    dev.peers[0].allowed_ips = vec![
        "10.1.0.1/32".parse().unwrap(),
        "10.245.0.0/16".parse().unwrap(),
    ];
    dev.peers[0].preshared_key = None;
    dev.peers.push(peer(&["fd00:1::3/128"]));
    assert!(wg.apply(&dev).unwrap());
    assert_eq!(wg.writes(), 2);
    let (_, peers) = dump(&ns, &dev.name);
    assert_eq!(peers.len(), 2);
    assert!(peers.iter().all(|l| l[0] != removed.public_key.to_base64()));
    let changed = find(&peers, &dev.peers[0]);
    assert_eq!(changed[1], "(none)");
    assert_eq!(changed[3], "10.1.0.1/32,10.245.0.0/16");
    assert_eq!(find(&peers, &dev.peers[1])[3], "fd00:1::3/128");

    let st = wg.observe().unwrap();
    assert!(st.present);
    assert_eq!(st.listen_port, 51820);
    assert_eq!(st.peers.len(), 2);
    // Keepalive reads back as written (the restart adoption compares it).
    assert!(
        st.peers.iter().all(|p| p.persistent_keepalive == 25),
        "{st:?}"
    );
}

/// Peer changes touch only the peers named; the device then is exactly what a full
/// apply of the result describes (so that apply writes nothing), and a bad change
/// writes nothing at all.
#[test]
fn peer_changes_write_only_those_peers() {
    use wireguard::PeerChange;
    let (ns, mut wg, mut dev) = setup(51825);
    assert!(wg.apply(&dev).unwrap());
    let (_, before) = dump(&ns, &dev.name);

    let added = peer(&["10.1.0.3/32"]);
    let mut changed = dev.peers[1].clone();
    changed.allowed_ips.push("10.245.0.0/16".parse().unwrap());
    let removed = dev.peers.remove(0);
    assert!(wg
        .apply_peers(&[
            PeerChange::Upsert(changed.clone()),
            PeerChange::Remove(removed.public_key.clone()),
            PeerChange::Upsert(added.clone()),
        ])
        .unwrap());
    assert_eq!(wg.writes(), 2);
    let (_, peers) = dump(&ns, &dev.name);
    assert_eq!(peers.len(), 2, "{peers:?}");
    assert!(peers.iter().all(|l| l[0] != removed.public_key.to_base64()));
    let c = find(&peers, &changed);
    assert_eq!(c[3], "10.1.0.2/32,10.245.0.0/16,fd00:1::2/128");
    // Its endpoint, key and keepalive are as they were.
    let was = find(&before, &changed);
    assert_eq!((&c[1], &c[2], &c[7]), (&was[1], &was[2], &was[7]));
    assert_eq!(find(&peers, &added)[3], "10.1.0.3/32");

    // Unchanged peers again: nothing written; the full state agrees with the device.
    assert!(!wg
        .apply_peers(&[PeerChange::Upsert(added.clone())])
        .unwrap());
    dev.peers = vec![changed, added];
    assert!(!wg.apply(&dev).unwrap());
    assert_eq!(wg.writes(), 2);

    // A bad change names its field and writes nothing.
    let bad = peer(&["10.9.0.1/24"]);
    let err = wg.apply_peers(&[PeerChange::Upsert(bad)]).unwrap_err();
    assert!(
        err.to_string().contains("changes[0].allowed_ips[0]"),
        "{err}"
    );
    assert_eq!(wg.writes(), 2);
    assert_eq!(dump(&ns, &dev.name).1.len(), 2);
}

#[test]
fn roamed_endpoint_is_kept_and_set_endpoint_wins() {
    let (ns, mut wg, mut dev) = setup(51820);
    wg.apply(&dev).unwrap();
    let key = dev.peers[0].public_key.to_base64();
    // WireGuard learns another endpoint (as when the peer roams).
    ns.run(
        "wg",
        &[
            "set",
            &dev.name,
            "peer",
            &key,
            "endpoint",
            "198.51.100.7:40000",
        ],
    )
    .unwrap();
    assert!(
        !wg.apply(&dev).unwrap(),
        "empty desired endpoint must not write"
    );
    let (_, peers) = dump(&ns, &dev.name);
    assert_eq!(find(&peers, &dev.peers[0])[2], "198.51.100.7:40000");
    let st = wg.observe().unwrap();
    let obs = st
        .peers
        .iter()
        .find(|p| p.public_key == dev.peers[0].public_key)
        .unwrap();
    assert_eq!(obs.endpoint, Some("198.51.100.7:40000".parse().unwrap()));

    dev.peers[0].endpoint = Some("[2001:db8::7]:51820".parse().unwrap());
    assert!(wg.apply(&dev).unwrap());
    let (_, peers) = dump(&ns, &dev.name);
    assert_eq!(find(&peers, &dev.peers[0])[2], "[2001:db8::7]:51820");
}

#[test]
fn invalid_state_writes_nothing() {
    let (ns, mut wg, dev) = setup(51820);
    wg.apply(&dev).unwrap();
    let before = dump(&ns, &dev.name);
    let mut bad = dev.clone();
    bad.peers[1].public_key = bad.peers[0].public_key.clone();
    let mut bad2 = dev.clone();
    bad2.peers[0]
        .allowed_ips
        .push("10.9.9.9/8".parse().unwrap());
    let mut bad3 = dev.clone();
    bad3.peers[0].public_key = dev.private_key.public_key();
    for (b, field) in [
        (bad, "peers[1].public_key"),
        (bad2, "peers[0].allowed_ips[2]"),
        (bad3, "peers[0].public_key"),
    ] {
        match wg.apply(&b) {
            Err(WgError::Invalid(e)) => assert_eq!(e.field, field),
            other => panic!("expected invalid {field}, got {other:?}"),
        }
    }
    let e = wirespan_dataplane::wireguard::PublicKey::from_base64("peers[0].public_key", "abc")
        .unwrap_err();
    assert_eq!(e.field, "peers[0].public_key");
    assert_eq!(wg.writes(), 1);
    assert_eq!(dump(&ns, &dev.name), before);
}

#[test]
fn refused_port_leaves_previous_state() {
    let (ns, mut wg, mut dev) = setup(51820);
    wg.apply(&dev).unwrap();
    ns.run("ip", &["link", "set", &dev.name, "up"]).unwrap();
    // Something else holds UDP 51999 in the namespace.
    let thread = NetnsThread::spawn(ns.netns()).unwrap();
    let _sock = thread
        .run(|| UdpSocket::bind("0.0.0.0:51999").unwrap())
        .unwrap();
    let before = dump(&ns, &dev.name);
    dev.listen_port = 51999;
    dev.peers.push(peer(&["10.1.0.9/32"]));
    dev.peers[0]
        .allowed_ips
        .push("10.250.0.0/16".parse().unwrap());
    let err = wg.apply(&dev).unwrap_err();
    assert!(matches!(err, WgError::Refused { .. }), "{err:?}");
    assert_eq!(
        dump(&ns, &dev.name),
        before,
        "a refused apply changed the device"
    );
}

#[test]
fn supervisor_restarts_dead_daemon_and_teardown_kills_it() {
    let (ns, mut wg, dev) = setup_userspace(0);
    wg.apply(&dev).unwrap();
    let pid = wg.pid().unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while wg.restarts() == 0 || wg.pid() == Some(pid) {
        assert!(std::time::Instant::now() < deadline, "not restarted");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // The restarted device is empty; the next apply repopulates it.
    assert!(wg.apply(&dev).unwrap());
    assert_eq!(dump(&ns, &dev.name).1.len(), 2);
    let new_pid = wg.pid().unwrap();
    wg.teardown().unwrap();
    // The process is reaped by teardown or soon after: poll, with a deadline.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while std::path::Path::new(&format!("/proc/{new_pid}")).exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "wireguard-go {new_pid} still running after teardown"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        ns.run("ip", &["link", "show", &dev.name]).is_err(),
        "link still present"
    );
    assert!(!wg.observe().unwrap().present);
}

/// wireguard-go processes serving interface `name` (`wireguard-go -f NAME`), zombies
/// left out.
fn wireguard_go_pids(name: &str) -> Vec<u32> {
    let want = format!("wireguard-go\0-f\0{name}\0");
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.ends_with(want.as_bytes()) && !zombie(*pid))
        })
        .collect()
}

fn zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
        s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z'))
    })
}

/// A daemon stopping with its kernel state kept lets go of wireguard-go; the next
/// backend for the interface adopts that process (same device, nothing rewritten, no
/// second wireguard-go) and its teardown stops it.
#[test]
fn a_kept_wireguard_go_is_adopted_not_duplicated_and_its_teardown_stops_it() {
    let (ns, mut wg, dev) = setup_userspace(0);
    wg.apply(&dev).unwrap();
    let pid = wg.pid().unwrap();
    let before = dump(&ns, &dev.name);
    Box::new(wg).keep();
    assert_eq!(
        wireguard_go_pids(&dev.name),
        vec![pid],
        "kept wireguard-go exited"
    );

    let mut wg = UserspaceBackend::new(&dev.name, ns.netns().clone());
    // The first read (before any apply) reports the kept device and its peers.
    let seen = wg.observe().unwrap();
    assert!(seen.present);
    assert_eq!(seen.peers.len(), 2);
    assert!(!wg.apply(&dev).unwrap(), "the adopted device was rewritten");
    assert_eq!(wg.writes(), 0);
    assert_eq!(wg.pid(), Some(pid));
    assert_eq!(wireguard_go_pids(&dev.name), vec![pid]);
    assert_eq!(dump(&ns, &dev.name), before);
    assert_eq!(wg.restarts(), 0);

    wg.teardown().unwrap();
    assert!(
        wireguard_go_pids(&dev.name).is_empty(),
        "adopted wireguard-go still runs"
    );
    assert!(
        ns.run("ip", &["link", "show", &dev.name]).is_err(),
        "link still present"
    );
}

/// Steady state: after the first read, applies diff against what the backend wrote
/// (no `get=1` of every peer); `observe` re-reads, so drift it sees is repaired by
/// the next apply.
#[test]
fn steady_state_applies_without_reading_and_observe_resyncs() {
    let (ns, mut wg, mut dev) = setup_userspace(51820);
    assert!(wg.apply(&dev).unwrap());
    let reads = wg.reads();
    assert!(!wg.apply(&dev).unwrap());
    dev.peers[0].allowed_ips = vec![
        "10.1.0.1/32".parse().unwrap(),
        "10.250.0.0/16".parse().unwrap(),
    ];
    assert!(wg.apply(&dev).unwrap());
    assert_eq!(wg.reads(), reads, "steady-state applies read the device");
    let (_, peers) = dump(&ns, &dev.name);
    assert_eq!(find(&peers, &dev.peers[0])[3], "10.1.0.1/32,10.250.0.0/16");

    // Someone removes a peer behind our back; observe sees it, apply restores it.
    let key = dev.peers[1].public_key.to_base64();
    ns.run("wg", &["set", &dev.name, "peer", &key, "remove"])
        .unwrap();
    assert_eq!(wg.observe().unwrap().peers.len(), 1);
    assert!(wg.apply(&dev).unwrap());
    let (_, peers) = dump(&ns, &dev.name);
    assert_eq!(peers.len(), 2);
    assert_eq!(find(&peers, &dev.peers[1])[2], "192.0.2.10:51820");
}

/// Whether this kernel can make a WireGuard link, asked with `ip` (independent of the
/// crate's own probe).
fn kernel_has_wireguard(ns: &NetnsGuard) -> bool {
    let ok = ns
        .run("ip", &["link", "add", "wsprobe0", "type", "wireguard"])
        .is_ok();
    if ok {
        ns.run("ip", &["link", "del", "wsprobe0"]).unwrap();
    }
    ok
}

/// Auto selection takes the kernel when it has WireGuard and `wirespan wireguard`
/// otherwise: either way the device works, and a `wirespan wireguard` process runs in
/// the namespace exactly when the kernel lacks WireGuard. (The node runs its own
/// executable; a test binary is not one, so the test names the workspace's `wirespan`,
/// which sits beside the test binaries' `deps/` folder.)
#[test]
fn auto_selection_follows_kernel_support() {
    let ns = NetnsGuard::new("wswg").unwrap();
    let kernel = kernel_has_wireguard(&ns);
    assert_eq!(kernel::supported(ns.netns()), kernel);
    let name = unique_name("wsa");
    let wirespan = wirespan_binary();
    assert!(
        kernel || wirespan.exists(),
        "{} is not built (cargo build -p wirespan)",
        wirespan.display()
    );
    let mut wg =
        wireguard::select_with_binary(BackendChoice::Auto, &name, ns.netns(), Some(&wirespan))
            .unwrap();
    let dev = WgDevice {
        name: name.clone(),
        private_key: PrivateKey::generate(),
        listen_port: 51821,
        fwmark: 0x20,
        peers: vec![peer(&["10.1.0.1/32"])],
    };
    assert!(wg.apply(&dev).unwrap());
    assert!(!wg.apply(&dev).unwrap());
    let (iface, peers) = dump(&ns, &name);
    assert_eq!(iface[1], dev.private_key.public_key().to_base64());
    assert_eq!(peers.len(), 1);
    let pids = ns.run_stdout("ip", &["netns", "pids", ns.name()]).unwrap();
    let userspace = pids.split_whitespace().any(|pid| {
        std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|c| c.split('\0').nth(1) == Some("wireguard"))
    });
    assert_eq!(userspace, !kernel, "kernel WireGuard: {kernel}");
    wg.teardown().unwrap();
    assert!(ns.run("ip", &["link", "show", &name]).is_err());
}

/// The workspace's `wirespan` executable, beside the test binaries' `deps/` folder.
fn wirespan_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .and_then(Path::parent)
        .unwrap()
        .join("wirespan")
}

/// Starts `wirespan wireguard` for `name` in `ns` (killed with the namespace) and
/// waits for its UAPI socket; returns its pid.
fn start_kept_device(ns: &NetnsGuard, program: &str, args: &[&str], name: &str) -> u32 {
    let pid = ns.spawn(program, args).unwrap();
    let socket = Path::new(userspace::DEFAULT_SOCKET_DIR).join(format!("{name}.sock"));
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(
            Instant::now() < deadline,
            "{program} never served {}",
            socket.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    pid
}

/// The pids in `ns` whose command line is `PROGRAM ARG…` with `arg` among the arguments.
fn pids_running(ns: &NetnsGuard, arg: &str) -> Vec<u32> {
    let pids = ns.run_stdout("ip", &["netns", "pids", ns.name()]).unwrap();
    pids.split_whitespace()
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.split('\0').skip(1).any(|a| a == arg))
        })
        .map(|p| p.parse().unwrap())
        .collect()
}

/// A `wirespan wireguard` left running (a restart with kernel state kept, or started
/// before the WireGuard module was loaded) holds the link: `auto` adopts it whether or
/// not the kernel has WireGuard, so do `userspace` and `userspace-go`, each reporting
/// what runs (`userspace`), never starting a second device; `kernel` is refused once
/// with an error naming the flag, the link and the program.
#[test]
fn a_kept_wirespan_wireguard_is_adopted_by_every_userspace_choice_and_refused_by_kernel() {
    let ns = NetnsGuard::new("wswg").unwrap();
    let name = unique_name("wsk");
    let wirespan = wirespan_binary();
    let bin = wirespan.to_str().unwrap();
    let pid = start_kept_device(&ns, bin, &["wireguard", "--foreground", &name], &name);
    let dev = device(name.clone(), 0);
    for choice in [
        BackendChoice::Auto,
        BackendChoice::Userspace,
        BackendChoice::UserspaceGo,
    ] {
        let mut wg =
            wireguard::select_with_binary(choice, &name, ns.netns(), Some(&wirespan)).unwrap();
        wg.apply(&dev).unwrap();
        assert_eq!(wg.backend(), "userspace", "asked {choice:?}");
        assert_eq!(pids_running(&ns, &name), vec![pid], "asked {choice:?}");
        assert!(!wg.apply(&dev).unwrap(), "the adopted device was rewritten");
        Box::new(wg).keep();
    }
    let err = match wireguard::select_with_binary(
        BackendChoice::Kernel,
        &name,
        ns.netns(),
        Some(&wirespan),
    ) {
        Err(e @ WgError::WrongBackend { .. }) => e.to_string(),
        other => panic!(
            "kernel over a userspace device: {:?}",
            other.map(|w| w.backend())
        ),
    };
    for part in [
        "--wireguard kernel",
        &name,
        "wirespan wireguard",
        &pid.to_string(),
    ] {
        assert!(err.contains(part), "{part:?} not in {err}");
    }
    assert_eq!(
        pids_running(&ns, &name),
        vec![pid],
        "the refusal touched the device"
    );
    let (_, peers) = dump(&ns, &name);
    assert_eq!(peers.len(), 2);
}

/// A kept wireguard-go adopted by a node asked for `userspace` is reported as
/// `userspace-go` (what runs), not as what was asked for.
#[test]
fn a_kept_wireguard_go_adopted_by_userspace_is_reported_as_wireguard_go() {
    let ns = NetnsGuard::new("wswg").unwrap();
    let name = unique_name("wsk");
    let pid = start_kept_device(&ns, "wireguard-go", &["-f", &name], &name);
    let wirespan = wirespan_binary();
    let mut wg =
        wireguard::select_with_binary(BackendChoice::Userspace, &name, ns.netns(), Some(&wirespan))
            .unwrap();
    assert!(wg.observe().unwrap().present);
    assert_eq!(wg.backend(), "userspace-go");
    wg.apply(&device(name.clone(), 0)).unwrap();
    assert_eq!(wireguard_go_pids(&name), vec![pid]);
    wg.teardown().unwrap();
}

/// A TUN of the mesh link's name that no device process serves (its process was
/// killed) is removed when the backend is chosen, and the device then starts clean.
#[test]
fn a_stale_tun_nobody_serves_is_removed_and_the_device_starts_clean() {
    let ns = NetnsGuard::new("wswg").unwrap();
    let name = unique_name("wss");
    ns.run("ip", &["tuntap", "add", "dev", &name, "mode", "tun"])
        .unwrap();
    let wirespan = wirespan_binary();
    let mut wg =
        wireguard::select_with_binary(BackendChoice::Auto, &name, ns.netns(), Some(&wirespan))
            .unwrap();
    assert!(
        ns.run("ip", &["link", "show", &name]).is_err(),
        "the stale TUN was kept"
    );
    let dev = device(name.clone(), 0);
    assert!(wg.apply(&dev).unwrap());
    let (iface, peers) = dump(&ns, &name);
    assert_eq!(iface[1], dev.private_key.public_key().to_base64());
    assert_eq!(peers.len(), 2);
    wg.teardown().unwrap();
}

/// Hostile input to a running `wirespan wireguard`, seen through the node's backend:
/// garbage datagrams to its port are dropped and counted in [`WireGuard::drops`]
/// (what the node exports as `wirespan_kubespan_wireguard_dropped`), a bad `set`
/// on its socket is answered with an errno and changes nothing, and the device keeps
/// serving. wireguard-go counts nothing the backend can read (`None`).
#[test]
fn hostile_input_is_counted_in_the_drops_and_changes_nothing() {
    use std::io::{BufRead as _, BufReader, Write as _};

    let ns = NetnsGuard::new("wswg").unwrap();
    ns.run("ip", &["link", "set", "lo", "up"]).unwrap();
    let name = unique_name("wsd");
    let wirespan = wirespan_binary();
    let mut wg =
        wireguard::select_with_binary(BackendChoice::Userspace, &name, ns.netns(), Some(&wirespan))
            .unwrap();
    let dev = device(name.clone(), 51841);
    assert!(wg.apply(&dev).unwrap());
    assert_eq!(wg.drops().unwrap().invalid_datagrams, 0);
    let before = wg.observe().unwrap();

    NetnsThread::spawn(ns.netns())
        .unwrap()
        .run(|| {
            let s = UdpSocket::bind("127.0.0.1:0").unwrap();
            let mut bad_init = vec![1u8, 0, 0, 0];
            bad_init.resize(148, 0xa5);
            for d in [&[0xffu8; 3][..], &bad_init, &[4u8; 64][..], &[9u8; 200][..]] {
                s.send_to(d, "127.0.0.1:51841").unwrap();
            }
        })
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while wg.drops().unwrap().invalid_datagrams < 4 {
        assert!(Instant::now() < deadline, "drops: {:?}", wg.drops());
        std::thread::sleep(Duration::from_millis(20));
    }

    let socket = Path::new(userspace::DEFAULT_SOCKET_DIR).join(format!("{name}.sock"));
    let mut stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
    stream
        .write_all(b"set=1\nlisten_port=51842\nprivate_key=zz\n\n")
        .unwrap();
    let mut answer = String::new();
    BufReader::new(stream).read_line(&mut answer).unwrap();
    assert!(
        answer.starts_with("errno=") && answer != "errno=0\n",
        "{answer:?}"
    );
    assert_eq!(
        wg.observe().unwrap(),
        before,
        "a refused set changed the device"
    );
    assert!(!wg.apply(&dev).unwrap(), "the device drifted");
    wg.teardown().unwrap();

    let (_ns, mut go, dev) = setup_userspace(0);
    go.apply(&dev).unwrap();
    assert_eq!(go.drops(), None);
}

/// Forcing the kernel backend where the kernel has no WireGuard fails with an error
/// naming the link and leaves nothing behind; where it has, the kernel backend applies
/// incrementally like the userspace one.
#[test]
fn forced_kernel_backend() {
    let ns = NetnsGuard::new("wswg").unwrap();
    let name = unique_name("wsk");
    let mut wg = wireguard::select(BackendChoice::Kernel, &name, ns.netns()).unwrap();
    let mut dev = WgDevice {
        name: name.clone(),
        private_key: PrivateKey::generate(),
        listen_port: 51822,
        fwmark: 0x20,
        peers: vec![peer(&["10.1.0.1/32"])],
    };
    if !kernel_has_wireguard(&ns) {
        let err = wg.apply(&dev).unwrap_err().to_string();
        assert!(err.contains(&name), "{err}");
        assert!(ns.run("ip", &["link", "show", &name]).is_err());
        return;
    }
    assert!(wg.apply(&dev).unwrap());
    assert!(!wg.apply(&dev).unwrap());
    dev.peers.push(peer(&["10.1.0.2/32"]));
    assert!(wg.apply(&dev).unwrap());
    let (_, peers) = dump(&ns, &name);
    assert_eq!(peers.len(), 2);
    wg.teardown().unwrap();
    assert!(ns.run("ip", &["link", "show", &name]).is_err());
}

/// A peer removed behind the backend's back is seen by `observe` and restored by the
/// next apply, its endpoint included.
#[test]
fn a_peer_removed_behind_our_back_is_restored() {
    let (ns, mut wg, dev) = setup(51826);
    assert!(wg.apply(&dev).unwrap());
    let key = dev.peers[1].public_key.to_base64();
    ns.run("wg", &["set", &dev.name, "peer", &key, "remove"])
        .unwrap();
    assert_eq!(wg.observe().unwrap().peers.len(), 1);
    assert!(wg.apply(&dev).unwrap());
    let (_, peers) = dump(&ns, &dev.name);
    assert_eq!(peers.len(), 2);
    assert_eq!(find(&peers, &dev.peers[1])[2], "192.0.2.10:51820");
}

/// One side of [`two_devices_handshake_count_traffic_and_learn_the_roamed_endpoint`].
struct Side {
    ns: NetnsGuard,
    wg: Box<dyn WireGuard + Send>,
    dev: WgDevice,
}

impl Side {
    fn new(prefix: &str, port: u16) -> Self {
        let ns = NetnsGuard::new(prefix).unwrap();
        let name = unique_name("wsh");
        let wg = backend_in(&ns, &name);
        let dev = WgDevice {
            name,
            private_key: PrivateKey::generate(),
            listen_port: port,
            fwmark: 0x20,
            peers: Vec::new(),
        };
        let side = Self { ns, wg, dev };
        side.ns.run("ip", &["link", "set", "lo", "up"]).unwrap();
        side
    }

    fn status_of(&mut self, other: &WgDevice) -> wireguard::PeerStatus {
        let key = other.private_key.public_key();
        self.wg
            .observe()
            .unwrap()
            .peers
            .into_iter()
            .find(|p| p.public_key == key)
            .expect("peer present")
    }
}

/// Two devices in two namespaces: a handshake and traffic show as a recent last
/// handshake and non-zero counters on both sides; the side with no endpoint for its
/// peer learns the one the peer came from (roaming); an in-place peer update keeps
/// handshake and counters (the receive-window detector reads them), a removal and
/// re-add starts them from nothing.
#[test]
fn two_devices_handshake_count_traffic_and_learn_the_roamed_endpoint() {
    let mut a = Side::new("wshA", 51830);
    let mut b = Side::new("wshB", 51831);
    let (va, vb) = (unique_name("ha"), unique_name("hb"));
    a.ns.run(
        "ip",
        &["link", "add", &va, "type", "veth", "peer", "name", &vb],
    )
    .unwrap();
    a.ns.run("ip", &["link", "set", &vb, "netns", b.ns.name()])
        .unwrap();
    for (side, veth, under) in [(&a, &va, "192.168.77.1/24"), (&b, &vb, "192.168.77.2/24")] {
        side.ns
            .run("ip", &["addr", "add", under, "dev", veth])
            .unwrap();
        side.ns.run("ip", &["link", "set", veth, "up"]).unwrap();
    }
    // A knows B's key but not where it is; B knows A's endpoint.
    a.dev.peers = vec![WgPeer {
        public_key: b.dev.private_key.public_key(),
        preshared_key: None,
        persistent_keepalive: 0,
        endpoint: None,
        allowed_ips: vec!["10.77.0.2/32".parse().unwrap()],
    }];
    b.dev.peers = vec![WgPeer {
        public_key: a.dev.private_key.public_key(),
        preshared_key: None,
        persistent_keepalive: 0,
        endpoint: Some("192.168.77.1:51830".parse().unwrap()),
        allowed_ips: vec!["10.77.0.1/32".parse().unwrap()],
    }];
    for (side, overlay) in [(&mut a, "10.77.0.1/24"), (&mut b, "10.77.0.2/24")] {
        assert!(side.wg.apply(&side.dev).unwrap());
        side.ns
            .run("ip", &["addr", "add", overlay, "dev", &side.dev.name])
            .unwrap();
        side.ns
            .run("ip", &["link", "set", &side.dev.name, "up"])
            .unwrap();
    }
    let before = a.status_of(&b.dev);
    assert_eq!(before.last_handshake, None, "{before:?}");
    assert_eq!((before.rx_bytes, before.tx_bytes), (0, 0), "{before:?}");

    let started = SystemTime::now() - Duration::from_secs(1);
    b.ns.run("ping", &["-c", "3", "-i", "0.2", "-W", "3", "10.77.0.1"])
        .unwrap();
    let ended = SystemTime::now() + Duration::from_secs(1);
    let (a_sees, b_sees) = (a.status_of(&b.dev), b.status_of(&a.dev));
    for seen in [&a_sees, &b_sees] {
        let at = seen.last_handshake.expect("a handshake");
        assert!(
            started <= at && at <= ended,
            "handshake at {at:?}: {seen:?}"
        );
        assert!(seen.rx_bytes > 0 && seen.tx_bytes > 0, "{seen:?}");
    }
    assert_eq!(
        a_sees.endpoint,
        Some("192.168.77.2:51831".parse().unwrap()),
        "A did not learn where B came from"
    );

    // In place: another allowed IP for B. Handshake and counters stay.
    a.dev.peers[0]
        .allowed_ips
        .push("10.78.0.0/16".parse().unwrap());
    assert!(a
        .wg
        .apply_peers(&[wireguard::PeerChange::Upsert(a.dev.peers[0].clone())])
        .unwrap());
    let updated = a.status_of(&b.dev);
    assert_eq!(updated.last_handshake, a_sees.last_handshake);
    assert!(
        updated.rx_bytes >= a_sees.rx_bytes,
        "{a_sees:?} -> {updated:?}"
    );
    assert_eq!(
        updated.endpoint, a_sees.endpoint,
        "the roamed endpoint was lost"
    );

    // Removed and added again: a new peer as far as WireGuard knows.
    let peer = a.dev.peers.remove(0);
    assert!(a.wg.apply(&a.dev).unwrap());
    assert!(a.wg.observe().unwrap().peers.is_empty());
    a.dev.peers.push(peer);
    assert!(a.wg.apply(&a.dev).unwrap());
    let fresh = a.status_of(&b.dev);
    assert_eq!(fresh.last_handshake, None, "{fresh:?}");
    assert_eq!((fresh.rx_bytes, fresh.tx_bytes), (0, 0), "{fresh:?}");
    a.wg.teardown().unwrap();
    b.wg.teardown().unwrap();
}
