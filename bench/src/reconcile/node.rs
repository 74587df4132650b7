//! One benchmark node: a throwaway network namespace running the KubeSpan
//! controllers over the timed adapters, the affiliates fed to it, and the waits on
//! its applies.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use tokio::sync::mpsc;
use wirespan_control::{
    config::kubespan::FastPath,
    controllers::kubespan::{
        identity::IpLinkSource,
        manager::{ManagerDeps, OnStop},
        register, Deps, KernelMarkingFactory, KernelWireGuard,
    },
    kubespan::clock::SystemClock,
    resources::{
        cluster::{AffiliateSpec, ClusterIdentity, ClusterIdentitySpec, KubeSpanAffiliateSpec},
        config::{MachineConfig, MachineConfigSpec},
        identity::{NodeIdentity, NodeIdentitySpec},
        kubespan::{KubeSpanPeerStatus, PeerState, NS},
        network::{AddressSpec, LinkSpec, RouteSpec, RoutingRuleSpec, NS_CONFIG},
    },
    runtime::{Harness, Resource, Runtime, Store, StoreOptions},
    secret::Key32,
};
use wirespan_dataplane::{
    ipnet::{IpNet, Ipv4Net},
    kernel_marking::KernelMarking,
    netns::{unique_name, NetnsGuard},
    routing::{NetlinkRouting, Routing, RoutingSpec},
    wireguard::{BackendChoice, PublicKey},
};

use super::{
    fast_path_name,
    timed::{Applied, Probe, TimedMarkingFactory, TimedWgFactory},
};

/// The WireGuard public key of peer `i`.
pub(super) fn key(i: usize) -> PublicKey {
    let mut b = [0x5au8; 32];
    b[..8].copy_from_slice(&(i as u64).to_be_bytes());
    PublicKey::from_bytes(b)
}

/// `a.hi.lo.last`, where `hi.lo` are the low 16 bits of `i`.
pub(super) fn v4(a: u8, i: usize, last: u8) -> Ipv4Addr {
    let [.., hi, lo] = (i as u64).to_be_bytes();
    Ipv4Addr::new(a, hi, lo, last)
}

/// Peer `i`'s affiliate: a node address, a ULA, a /24 and one endpoint.
pub(super) fn affiliate(i: usize) -> AffiliateSpec {
    let ula = Ipv6Addr::from(0xfd21_04de_ec13_da02_0000_0000_0000_0000u128 | (i as u128 + 1));
    AffiliateSpec {
        node_id: format!("node{i:06}"),
        nodename: format!("n{i}"),
        addresses: vec![IpAddr::V4(v4(100, i, 1))],
        kubespan: Some(KubeSpanAffiliateSpec {
            public_key: key(i).to_base64(),
            address: Some(IpAddr::V6(ula)),
            additional_addresses: vec![IpNet::V4(
                Ipv4Net::new(v4(10, i, 0), 24).unwrap_or_default(),
            )],
            exclude_advertised_networks: Vec::new(),
            endpoints: vec![SocketAddr::new(IpAddr::V4(v4(192, i, 2)), 51820)],
        }),
        ..AffiliateSpec::default()
    }
}

/// A running node under test, with the receiving end of its adapters' reports.
pub(super) struct Node {
    _ns: NetnsGuard,
    _dir: TempDir,
    pub(super) harness: Harness,
    pub(super) store: Store,
    pub(super) rx: mpsc::UnboundedReceiver<Applied>,
    pub(super) probe: Probe,
    pub(super) chosen: Arc<Mutex<Option<(FastPath, String)>>>,
    ns: wirespan_dataplane::netns::Netns,
    link: String,
}

/// A state dir removed on drop.
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Starts a node for `n` peers with `fast_path` configured.
pub(super) fn start(n: usize, fast_path: FastPath) -> anyhow::Result<Node> {
    let ns = NetnsGuard::new("wsrb").context("creating a network namespace (root?)")?;
    ns.run(
        "ip",
        &[
            "link",
            "add",
            "b0",
            "address",
            "02:00:00:00:00:01",
            "type",
            "veth",
            "peer",
            "name",
            "b1",
        ],
    )?;
    let link = unique_name("wsb");
    let dir = TempDir(std::env::temp_dir().join(unique_name("wirespan-bench-reconcile")));
    let (tx, rx) = mpsc::unbounded_channel();
    let probe: Probe = Arc::default();
    let chosen = Arc::default();
    // N affiliates written at once must not overrun the runtime's watches (the
    // default history is 4,096 events per kind): the peer specs and statuses follow.
    let store = Store::new(StoreOptions {
        history_capacity: (4 * n).max(StoreOptions::default().history_capacity),
    });
    let mut runtime = Runtime::new(store.clone());
    register(
        &mut runtime,
        Deps {
            state_dir: dir.0.clone(),
            links: Arc::new(IpLinkSource(ns.netns().clone())),
            manager: ManagerDeps {
                wireguard: Arc::new(TimedWgFactory {
                    inner: KernelWireGuard {
                        netns: ns.netns().clone(),
                        choice: BackendChoice::UserspaceGo,
                        wirespan_binary: None,
                    },
                    tx: tx.clone(),
                    probe: Arc::clone(&probe),
                }),
                marking: Arc::new(TimedMarkingFactory {
                    inner: KernelMarkingFactory {
                        marking: KernelMarking {
                            netns: ns.netns().clone(),
                        },
                        metrics: None,
                    },
                    tx,
                    probe: Arc::clone(&probe),
                    chosen: Arc::clone(&chosen),
                }),
                routing_cleanup: None,
                clock: Arc::new(SystemClock),
                metrics: None,
                on_stop: OnStop::Teardown,
                sysctl: None,
                prober: None,
            },
        },
    )?;
    store.create(
        Resource::<ClusterIdentity>::new(
            "cluster",
            "cluster",
            ClusterIdentitySpec {
                cluster_id: "bench-cluster".into(),
                secret: Key32([3; 32]),
            },
        ),
        "",
    )?;
    store.create(
        Resource::<NodeIdentity>::new(
            "cluster",
            "local",
            NodeIdentitySpec {
                node_id: "local".into(),
            },
        ),
        "",
    )?;
    let config = wirespan_control::config::parse(&format!(
        "apiVersion: v1alpha1\nkind: KubeSpanConfig\nenabled: true\nlinkName: {link}\nfastPath: {}\n",
        fast_path_name(fast_path)
    ))?;
    store.modify::<MachineConfig>("config", "active", "", |r| {
        r.spec = MachineConfigSpec {
            source: "bench".into(),
            document_count: 1,
            config: config.clone(),
        };
    })?;
    let harness = Harness::start(runtime);
    Ok(Node {
        ns: ns.netns().clone(),
        _ns: ns,
        _dir: dir,
        harness,
        store,
        rx,
        probe,
        chosen,
        link,
    })
}

impl Node {
    /// Waits until a WireGuard apply and a marking apply satisfy `wg` and `nft`;
    /// returns when the later finished and each one's duration.
    pub(super) async fn wait(
        &mut self,
        limit: Duration,
        wg: impl Fn(usize, bool) -> bool,
        nft: impl Fn(usize, bool) -> bool,
    ) -> anyhow::Result<(Instant, Duration, Duration)> {
        let (mut w, mut m) = (None, None);
        let deadline = tokio::time::Instant::now() + limit;
        while w.is_none() || m.is_none() {
            let ev = tokio::time::timeout_at(deadline, self.rx.recv())
                .await
                .context("timed out waiting for the manager's applies")?
                .context("adapters gone")?;
            match ev {
                Applied::WireGuard {
                    at,
                    took,
                    peers,
                    probe,
                } if wg(peers, probe) => {
                    w = Some((at, took));
                }
                Applied::Marking {
                    at,
                    took,
                    prefixes,
                    probe,
                } if nft(prefixes, probe) => {
                    m = Some((at, took));
                }
                _ => {}
            }
        }
        let (w, m) = (
            w.unwrap_or_else(|| unreachable!()),
            m.unwrap_or_else(|| unreachable!()),
        );
        Ok((w.0.max(m.0), w.1, m.1))
    }

    /// Waits until no peer awaits its first handshake any more (the bench's peers
    /// never answer, so each turns `down` 15 s after its endpoint was pushed): until
    /// then the manager re-reads the whole device every second, and a one-peer change
    /// would be timed against that instead of against a settled mesh.
    pub(super) async fn settle(&self, n: usize, limit: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            let statuses = self
                .store
                .list::<KubeSpanPeerStatus>(NS, &Default::default());
            let waiting = statuses
                .iter()
                .filter(|s| s.spec.state == PeerState::Unknown)
                .count();
            if statuses.len() == n && waiting == 0 {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{waiting} of {} peers still await a first handshake after {limit:?}",
                statuses.len()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Applies the link, address, routes and rules the manager emitted.
    pub(super) fn apply_routing(&self) -> anyhow::Result<Duration> {
        let link = self.store.list::<LinkSpec>(NS_CONFIG, &Default::default());
        let mtu = link.first().map_or(1420, |l| l.spec.mtu);
        let addresses = self
            .store
            .list::<AddressSpec>(NS_CONFIG, &Default::default())
            .iter()
            .filter_map(|a| a.spec.address)
            .collect();
        let route = self.store.list::<RouteSpec>(NS_CONFIG, &Default::default());
        let rule = self
            .store
            .list::<RoutingRuleSpec>(NS_CONFIG, &Default::default());
        let (table, rule_priority, fw_mark, fw_mask) =
            rule.first().map_or((180, 32500, 0x40, 0x60), |r| {
                (
                    r.spec.table,
                    r.spec.priority,
                    r.spec.fw_mark,
                    r.spec.fw_mask,
                )
            });
        anyhow::ensure!(
            route.len() == 2 && rule.len() == 2,
            "manager emitted {} routes and {} rules",
            route.len(),
            rule.len()
        );
        let spec = RoutingSpec {
            link: self.link.clone(),
            mtu,
            addresses,
            table,
            rule_priority,
            fw_mark,
            fw_mask,
            ..RoutingSpec::default()
        };
        let mut routing = NetlinkRouting::new(&self.ns)?;
        let t = Instant::now();
        routing.apply(&spec)?;
        Ok(t.elapsed())
    }
}
