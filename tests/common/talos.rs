//! A Talos node beside a lab's wirespan nodes: its own network namespace on the lab's
//! underlay with a stock `wireguard-go`, configured with `wg` as Talos KubeSpan sets up
//! its device (PSK = cluster secret, port 51820, keepalive 25 s, its own UDP marked,
//! everything else to its peers' node addresses routed into the link by a policy rule),
//! publishing its affiliate in the upstream format ([`super::upstream`]).
//!
//! [`TalosPeer`] is a guard: on drop (also when the test panics) it stops wireguard-go,
//! removes its UAPI socket and deletes its namespace, which takes the veth into the
//! lab's underlay with it.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::Path,
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use serde_json::Value;
use wirespan_dataplane::netns::NetnsGuard;

use super::{
    upstream::{ip_bytes, publish, Affiliate, ControlPlane, IpPrefix, KubeSpan},
    WgPeer,
};

/// The mark on the Talos device's own UDP (`wg … fwmark`); the policy rule routes
/// everything without it through table [`TABLE`].
pub const FWMARK: &str = "0x5ca1";
/// The routing table of the Talos node's peer routes.
pub const TABLE: &str = "51820";
/// WireGuard port, the Talos node's and (the lab's default) every wirespan node's.
pub const PORT: u16 = 51820;
/// Talos's persistent keepalive towards every peer.
pub const KEEPALIVE: &str = "25";
/// The Talos node's nodename: the label wirespan nodes give it.
pub const NODENAME: &str = "talos-foreign";
/// Its pod CIDR, advertised whole (Talos publishes `additional_addresses`
/// unsubtracted) with the upper half excluded (`excludeAdvertisedNetworks`).
const POD_CIDR: ([u8; 4], u32) = ([10, 244, 99, 0], 24);
const POD_EXCLUDED: ([u8; 4], u32) = ([10, 244, 99, 128], 25);
/// What a peer must route to it of the pod CIDR: the half not excluded.
const POD_ROUTED: &str = "10.244.99.0/25";

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// The lab's cluster ID and the key of its blobs (the cluster secret), from the
/// cluster config file. Never printed.
pub fn cluster_identity(status: &Value) -> (String, [u8; 32]) {
    use base64::Engine as _;
    let path = status["clusterConfig"].as_str().unwrap();
    let text = std::fs::read_to_string(path).unwrap();
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let v = <serde_yaml_ng::Value as serde::Deserialize>::deserialize(doc).unwrap();
        if v["kind"].as_str() == Some("ClusterConfig") {
            let id = v["id"].as_str().unwrap().to_owned();
            let secret = base64::engine::general_purpose::STANDARD
                .decode(v["secret"].as_str().unwrap())
                .ok()
                .and_then(|k| <[u8; 32]>::try_from(k).ok())
                .expect("the lab's cluster secret is 32 bytes of base64");
            return (id, secret);
        }
    }
    panic!("no ClusterConfig in {path}");
}

/// The KubeSpan ULA of interface id `iid` in the cluster's prefix (`docs/kubespan.md` §3.1).
pub fn kubespan_ula(cluster_id: &str, iid: [u8; 8]) -> Ipv6Addr {
    use sha2::Digest as _;
    let h = sha2::Sha256::digest(cluster_id.as_bytes());
    let mut a = [0u8; 16];
    a[..8].copy_from_slice(&h[16..24]);
    a[0] = 0xfd;
    a[7] = 0x02;
    a[8..].copy_from_slice(&iid);
    Ipv6Addr::from(a)
}

/// A fresh WireGuard key pair `(private, public)` from `wg genkey | wg pubkey`.
pub fn wg_keypair() -> (String, String) {
    let private = Command::new("wg").arg("genkey").output().unwrap();
    assert!(private.status.success());
    let mut pubkey = Command::new("wg")
        .arg("pubkey")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(pubkey.stdin.as_mut().unwrap(), &private.stdout).unwrap();
    let public = pubkey.wait_with_output().unwrap();
    assert!(public.status.success());
    (
        String::from_utf8(private.stdout).unwrap().trim().to_owned(),
        String::from_utf8(public.stdout).unwrap().trim().to_owned(),
    )
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What a Talos node is made of before it starts; see [`TalosPeer::builder`].
pub struct TalosBuilder {
    underlay: String,
    discovery: SocketAddr,
    cluster_id: String,
    key: [u8; 32],
    address: Ipv4Addr,
}

impl TalosBuilder {
    /// Its address on the lab's underlay (`10.99.1.99` unless set; lab nodes are `.11` up).
    #[must_use]
    pub fn address(mut self, address: Ipv4Addr) -> Self {
        self.address = address;
        self
    }

    /// Makes the namespace with a veth on the underlay bridge, starts wireguard-go and
    /// sets up its device with no peers yet (see [`TalosPeer::peer_with`]).
    pub fn start(self) -> TalosPeer {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let netns = NetnsGuard::new("wstalos").unwrap();
        // A veth from the underlay bridge into the Talos namespace (made inside the
        // underlay, so nothing appears in the host's namespace; it goes with ours).
        let veth = format!("talos{n}");
        ip(&[
            "-n",
            &self.underlay,
            "link",
            "add",
            &veth,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            netns.name(),
        ]);
        ip(&[
            "-n",
            &self.underlay,
            "link",
            "set",
            &veth,
            "master",
            "br0",
            "up",
        ]);
        let cidr = format!("{}/24", self.address);
        ip(&["-n", netns.name(), "addr", "add", &cidr, "dev", "eth0"]);
        ip(&["-n", netns.name(), "link", "set", "eth0", "up"]);

        let (private, public_key) = wg_keypair();
        let ula = kubespan_ula(&self.cluster_id, [0, 0, 0, 0xff, 0xfe, 0, 0, 0x99]);
        let link = format!("wst{}x{n}", std::process::id());
        let child = netns
            .netns()
            .command("wireguard-go")
            .args(["-f", &link])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // The guard exists from here on: whatever fails below still cleans up.
        let talos = TalosPeer {
            link: link.clone(),
            address: IpAddr::V4(self.address),
            public_key,
            ula,
            discovery: self.discovery,
            cluster_id: self.cluster_id,
            key: self.key,
            wireguard_go: Some(child),
            secrets: tempfile::tempdir().unwrap(),
            netns,
        };
        super::wait_for_path(Path::new(&format!("/var/run/wireguard/{link}.sock")));

        // The device as Talos sets it up: key, port, mark on its own UDP.
        let (key_file, psk_file) = (talos.private_key_file(), talos.psk_file());
        std::fs::write(&key_file, &private).unwrap();
        std::fs::write(&psk_file, {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD.encode(talos.key)
        })
        .unwrap();
        let port = PORT.to_string();
        talos.run(&[
            "wg",
            "set",
            &link,
            "private-key",
            key_file.to_str().unwrap(),
            "listen-port",
            &port,
            "fwmark",
            FWMARK,
        ]);
        let ula_cidr = format!("{ula}/64");
        talos.run(&["ip", "addr", "add", &ula_cidr, "dev", &link]);
        talos.run(&["ip", "link", "set", &link, "up"]);
        // All but its own UDP looks up the peer routes (as KubeSpan's fwmark rule does).
        talos.run(&[
            "ip", "rule", "add", "not", "fwmark", FWMARK, "table", TABLE, "priority", "100",
        ]);
        talos
    }
}

/// A running Talos node; see the module documentation.
pub struct TalosPeer {
    link: String,
    address: IpAddr,
    public_key: String,
    ula: Ipv6Addr,
    discovery: SocketAddr,
    cluster_id: String,
    key: [u8; 32],
    wireguard_go: Option<Child>,
    /// The private key and PSK files `wg set` reads.
    secrets: tempfile::TempDir,
    /// Declared last: dropped after wireguard-go is stopped.
    netns: NetnsGuard,
}

impl TalosPeer {
    /// A Talos node for the lab that `lab status -o json` describes: its underlay, its
    /// discovery server, its cluster ID and secret.
    pub fn builder(status: &Value) -> TalosBuilder {
        let (cluster_id, key) = cluster_identity(status);
        TalosBuilder {
            underlay: status["underlayNamespace"].as_str().unwrap().to_owned(),
            discovery: status["discovery"]["address"]
                .as_str()
                .unwrap()
                .parse()
                .unwrap(),
            cluster_id,
            key,
            address: Ipv4Addr::new(10, 99, 1, 99),
        }
    }

    /// Its WireGuard link (in its namespace).
    pub fn link(&self) -> &str {
        &self.link
    }

    /// Its namespace.
    pub fn netns(&self) -> &NetnsGuard {
        &self.netns
    }

    /// Its node address on the underlay.
    pub fn address(&self) -> IpAddr {
        self.address
    }

    /// The one endpoint it publishes: its address and port.
    pub fn endpoint(&self) -> SocketAddr {
        SocketAddr::new(self.address, PORT)
    }

    pub fn public_key(&self) -> &str {
        &self.public_key
    }

    /// Its KubeSpan address, in the cluster's prefix.
    pub fn ula(&self) -> Ipv6Addr {
        self.ula
    }

    /// What a peer's AllowedIPs for this node must be (`docs/kubespan.md` §5.3), sorted:
    /// the pod CIDR but its excluded half, the node address, the ULA.
    pub fn allowed_ips(&self) -> Vec<String> {
        let mut v = vec![
            POD_ROUTED.to_owned(),
            format!("{}/32", self.address),
            format!("{}/128", self.ula),
        ];
        v.sort();
        v
    }

    fn private_key_file(&self) -> std::path::PathBuf {
        self.secrets.path().join("private")
    }

    fn psk_file(&self) -> std::path::PathBuf {
        self.secrets.path().join("psk")
    }

    /// Runs `args` inside its namespace and returns stdout; fails the test on an error.
    pub fn run(&self, args: &[&str]) -> String {
        let out = self
            .netns
            .run(args[0], &args[1..])
            .unwrap_or_else(|e| panic!("in the Talos namespace: {e}"));
        String::from_utf8(out.stdout).unwrap()
    }

    /// Adds the lab node `node` (its entry in `lab status -o json`) as a peer, as Talos
    /// does from the node's affiliate: PSK, keepalive 25 s, AllowedIPs = the node's
    /// address and its ULA, the node address routed into the link; and one endpoint.
    ///
    /// The endpoint: Talos tries the endpoints a peer published in order and keeps the
    /// one WireGuard handshakes on (or roams to). A wirespan node publishes its own
    /// addresses, then the public IP the discovery server observed it at
    /// (`docs/kubespan.md` §4.2). For a public node these are the same address; behind
    /// NAT its own address is a LAN address nobody outside reaches, and the observed
    /// one (the router's WAN address with the node's port) is where Talos ends up. This
    /// static configuration therefore gives the observed address (`observedAddress` in
    /// `lab status`, what the discovery server reported to the node) right away; where
    /// that is not where the node's packets come from (a symmetric NAT maps another
    /// port), only the node's handshake makes WireGuard roam to the right one, exactly
    /// as on a real Talos node.
    pub fn peer_with(&self, node: &Value) {
        let name = &node["name"];
        let addr = node["addresses"]["underlay"][0]
            .as_str()
            .unwrap_or_else(|| panic!("{name} has no underlay address: {node}"));
        let ula = node["addresses"]["kubespan"]
            .as_str()
            .unwrap_or_else(|| panic!("{name} has no KubeSpan address: {node}"))
            .split('/')
            .next()
            .unwrap();
        let observed = node["observedAddress"]
            .as_str()
            .unwrap_or_else(|| panic!("the discovery server reported no address of {name}"));
        let endpoint = SocketAddr::new(observed.parse().unwrap(), PORT).to_string();
        let psk = self.psk_file();
        self.run(&[
            "wg",
            "set",
            &self.link,
            "peer",
            node["publicKey"].as_str().unwrap(),
            "preshared-key",
            psk.to_str().unwrap(),
            "endpoint",
            &endpoint,
            "persistent-keepalive",
            KEEPALIVE,
            "allowed-ips",
            &format!("{addr}/32,{ula}/128"),
        ]);
        self.run(&[
            "ip",
            "route",
            "add",
            &format!("{addr}/32"),
            "dev",
            &self.link,
            "table",
            TABLE,
        ]);
    }

    /// Publishes its affiliate to the lab's discovery server from inside its namespace,
    /// as Talos does (Hello, then AffiliateUpdate); returns the client IP the server
    /// reflected.
    pub fn publish(&self) -> Vec<u8> {
        self.publish_as(NODENAME, &format!("{NODENAME}.example"))
    }

    /// [`Self::publish`] with another node name and host name (any text: a cluster
    /// member chooses its own).
    pub fn publish_as(&self, nodename: &str, hostname: &str) -> Vec<u8> {
        let affiliate = Affiliate {
            node_id: "7x1SuC8Ege5BGXdAfTEff5iQnlWZLfv9h1LGMxA2pYkC".into(),
            addresses: vec![ip_bytes(self.address)],
            hostname: hostname.into(),
            nodename: nodename.into(),
            machine_type: "controlplane".into(),
            operating_system: "Talos (v1.12.0)".into(),
            kubespan: Some(KubeSpan {
                public_key: self.public_key.clone(),
                address: self.ula.octets().to_vec(),
                additional_addresses: vec![IpPrefix {
                    ip: POD_CIDR.0.to_vec(),
                    bits: POD_CIDR.1,
                }],
                exclude_advertised_addresses: vec![IpPrefix {
                    ip: POD_EXCLUDED.0.to_vec(),
                    bits: POD_EXCLUDED.1,
                }],
            }),
            control_plane: Some(ControlPlane {
                api_server_port: 6443,
            }),
        };
        let (disco, cluster_id, key, endpoint) = (
            self.discovery,
            self.cluster_id.clone(),
            self.key,
            self.endpoint(),
        );
        self.netns
            .netns()
            .block_on(move || async move {
                publish(disco, &cluster_id, &key, &affiliate, &[endpoint]).await
            })
            .unwrap()
            .unwrap_or_else(|e| panic!("publishing the Talos affiliate: {e}"))
    }

    /// Its device's peers (`wg show LINK dump`).
    pub fn peers(&self) -> Vec<WgPeer> {
        super::wg_dump(&self.run(&["wg", "show", &self.link, "dump"]))
    }

    /// Its device's peer `public_key`.
    pub fn peer(&self, public_key: &str) -> WgPeer {
        self.peers()
            .into_iter()
            .find(|p| p.public_key == public_key)
            .unwrap_or_else(|| panic!("the Talos device has no peer {public_key}"))
    }
}

impl Drop for TalosPeer {
    fn drop(&mut self) {
        // SIGTERM first: wireguard-go then closes its device and removes its socket.
        if let Some(mut child) = self.wireguard_go.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap()),
                nix::sys::signal::Signal::SIGTERM,
            );
            let deadline = Instant::now() + Duration::from_secs(3);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_file(format!("/var/run/wireguard/{}.sock", self.link));
        // Then `netns` drops: whatever else runs in it is killed, the namespace deleted.
    }
}
