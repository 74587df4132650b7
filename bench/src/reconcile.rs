//! `wirespan bench reconcile`: the whole KubeSpan controller chain against the real
//! kernel — affiliates in the store → peer specs → the manager → userspace WireGuard
//! (wireguard-go) and the marking (the eBPF fast path with nftables for local traffic,
//! or nftables alone), in a throwaway network namespace.
//!
//! For each fast path and size N: N affiliates arrive at once, timed until WireGuard
//! holds N peers and the marking set every routed prefix (then the routes and rules the
//! manager emitted as specs are applied with the routing adapter, timed apart, since
//! the network controllers that normally apply them are another part); then one
//! affiliate at a time changes a pod CIDR, timed until both the WireGuard peer and the
//! marking carry the new prefix, once the mesh has settled (no peer awaiting a first
//! handshake, so no per-second device reads). The adapters are wrapped to timestamp their applies
//! (whole-state or delta), so the report splits a change into WireGuard apply, marking
//! apply and the rest (the controllers). Needs root, `ip`, `nft` and `wireguard-go`.

use std::{
    collections::HashSet,
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
        manager::{ManagerDeps, MarkingChoice, MarkingFactory, OnStop, WireGuardFactory},
        register, Deps, KernelMarking, KernelWireGuard,
    },
    kubespan::clock::SystemClock,
    resources::{
        cluster::{
            Affiliate, AffiliateSpec, ClusterIdentity, ClusterIdentitySpec, KubeSpanAffiliateSpec,
        },
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
    marking::{Marking, MarkingError, MarkingSpec, MarkingStatus, PrefixDelta},
    netns::{unique_name, NetnsGuard},
    routing::{NetlinkRouting, Routing, RoutingSpec},
    wireguard::{BackendChoice, PeerChange, PublicKey, WgDevice, WgError, WgStatus, WireGuard},
};

use crate::bar;

/// Options of `wirespan bench reconcile`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Peer counts.
    #[arg(long, value_delimiter = ',', default_values_t = vec![100, 1_000, 10_000])]
    pub sizes: Vec<usize>,
    /// One-peer changes timed at each size.
    #[arg(long, default_value_t = 40)]
    pub changes: usize,
    /// Marking fast paths to run, each over every size: `ebpf` (the tc classifier for
    /// forwarded traffic plus nftables for local traffic) and `nftables`.
    #[arg(long, value_delimiter = ',', default_values_t = vec!["ebpf".to_owned(), "nftables".to_owned()])]
    pub fast_path: Vec<String>,
    /// Small and fast (sizes 20 and 100, 5 changes): a smoke run for tests.
    #[arg(long)]
    pub quick: bool,
}

fn fast_path_of(name: &str) -> anyhow::Result<FastPath> {
    match name {
        "ebpf" => Ok(FastPath::Ebpf),
        "nftables" => Ok(FastPath::Nftables),
        other => anyhow::bail!("--fast-path: {other:?} is not one of ebpf, nftables"),
    }
}

fn fast_path_name(f: FastPath) -> &'static str {
    match f {
        FastPath::Ebpf => "ebpf",
        FastPath::Nftables => "nftables",
    }
}

/// A prefix to look for in the next applies.
type Probe = Arc<Mutex<Option<(PublicKey, IpNet)>>>;

fn probed(p: &Probe) -> Option<(PublicKey, IpNet)> {
    p.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}

#[derive(Debug, Clone, Copy)]
enum Applied {
    WireGuard {
        at: Instant,
        took: Duration,
        peers: usize,
        probe: bool,
    },
    Marking {
        at: Instant,
        took: Duration,
        prefixes: usize,
        probe: bool,
    },
}

struct TimedWg {
    inner: Box<dyn WireGuard + Send>,
    /// The peers the device holds after the applies so far.
    keys: HashSet<PublicKey>,
    tx: mpsc::UnboundedSender<Applied>,
    probe: Probe,
}

impl TimedWg {
    fn probed(&self) -> Option<(PublicKey, IpNet)> {
        probed(&self.probe)
    }
}

impl WireGuard for TimedWg {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn ensure(&mut self) -> Result<(), WgError> {
        self.inner.ensure()
    }
    fn apply(&mut self, desired: &WgDevice) -> Result<bool, WgError> {
        let t = Instant::now();
        let r = self.inner.apply(desired);
        let took = t.elapsed();
        if r.is_ok() {
            self.keys = desired.peers.iter().map(|p| p.public_key.clone()).collect();
        }
        let probe = self.probed().is_some_and(|(k, net)| {
            desired
                .peers
                .iter()
                .any(|p| p.public_key == k && p.allowed_ips.contains(&net))
        });
        let _ = self.tx.send(Applied::WireGuard {
            at: Instant::now(),
            took,
            peers: self.keys.len(),
            probe,
        });
        r
    }
    fn apply_peers(&mut self, changes: &[PeerChange]) -> Result<bool, WgError> {
        let t = Instant::now();
        let r = self.inner.apply_peers(changes);
        let took = t.elapsed();
        if r.is_ok() {
            for c in changes {
                match c {
                    PeerChange::Upsert(p) => self.keys.insert(p.public_key.clone()),
                    PeerChange::Remove(k) => self.keys.remove(k),
                };
            }
        }
        let probe = self.probed().is_some_and(|(k, net)| {
            changes.iter().any(|c| {
                matches!(c, PeerChange::Upsert(p) if p.public_key == k && p.allowed_ips.contains(&net))
            })
        });
        let _ = self.tx.send(Applied::WireGuard {
            at: Instant::now(),
            took,
            peers: self.keys.len(),
            probe,
        });
        r
    }
    fn observe(&mut self) -> Result<WgStatus, WgError> {
        self.inner.observe()
    }
    fn teardown(&mut self) -> Result<(), WgError> {
        self.inner.teardown()
    }
    fn writes(&self) -> u64 {
        self.inner.writes()
    }
}

#[derive(Debug)]
struct TimedWgFactory {
    inner: KernelWireGuard,
    tx: mpsc::UnboundedSender<Applied>,
    probe: Probe,
}

impl WireGuardFactory for TimedWgFactory {
    fn create(&self, link: &str) -> Result<Box<dyn WireGuard + Send>, WgError> {
        Ok(Box::new(TimedWg {
            inner: self.inner.create(link)?,
            keys: HashSet::new(),
            tx: self.tx.clone(),
            probe: Arc::clone(&self.probe),
        }))
    }
}

struct TimedMarking {
    inner: Box<dyn Marking + Send>,
    /// Prefixes in the routed set after the applies so far.
    prefixes: usize,
    tx: mpsc::UnboundedSender<Applied>,
    probe: Probe,
}

impl Marking for TimedMarking {
    fn apply(&mut self, spec: &MarkingSpec) -> Result<bool, MarkingError> {
        let t = Instant::now();
        let r = self.inner.apply(spec);
        let took = t.elapsed();
        if r.is_ok() {
            self.prefixes = spec.prefixes_v4.len() + spec.prefixes_v6.len();
        }
        let probe = probed(&self.probe).is_some_and(|(_, net)| spec.prefixes_v4.contains(&net));
        let _ = self.tx.send(Applied::Marking {
            at: Instant::now(),
            took,
            prefixes: self.prefixes,
            probe,
        });
        r
    }
    fn apply_delta(&mut self, delta: &PrefixDelta) -> Result<bool, MarkingError> {
        let t = Instant::now();
        let r = self.inner.apply_delta(delta);
        let took = t.elapsed();
        if r.is_ok() {
            self.prefixes = (self.prefixes + delta.add.len()).saturating_sub(delta.remove.len());
        }
        let probe = probed(&self.probe).is_some_and(|(_, net)| delta.add.contains(&net));
        let _ = self.tx.send(Applied::Marking {
            at: Instant::now(),
            took,
            prefixes: self.prefixes,
            probe,
        });
        r
    }
    fn observe(&mut self) -> Result<MarkingStatus, MarkingError> {
        self.inner.observe()
    }
    fn teardown(&mut self) -> Result<(), MarkingError> {
        self.inner.teardown()
    }
    fn transactions(&self) -> u64 {
        self.inner.transactions()
    }
}

#[derive(Debug)]
struct TimedMarkingFactory {
    inner: KernelMarking,
    tx: mpsc::UnboundedSender<Applied>,
    probe: Probe,
    /// What the manager got: (fast path in use, note).
    chosen: Arc<Mutex<Option<(FastPath, String)>>>,
}

impl MarkingFactory for TimedMarkingFactory {
    fn create(&self, fast_path: FastPath, link: &str) -> MarkingChoice {
        let c = self.inner.create(fast_path, link);
        *self
            .chosen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some((c.fast_path, c.note.clone()));
        MarkingChoice {
            marking: Box::new(TimedMarking {
                inner: c.marking,
                prefixes: 0,
                tx: self.tx.clone(),
                probe: Arc::clone(&self.probe),
            }),
            ..c
        }
    }
}

fn key(i: usize) -> PublicKey {
    let mut b = [0x5au8; 32];
    b[..8].copy_from_slice(&(i as u64).to_be_bytes());
    PublicKey::from_bytes(b)
}

fn v4(a: u8, i: usize, last: u8) -> Ipv4Addr {
    let [.., hi, lo] = (i as u64).to_be_bytes();
    Ipv4Addr::new(a, hi, lo, last)
}

fn affiliate(i: usize) -> AffiliateSpec {
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

struct SizeFigures {
    fast_path: FastPath,
    n: usize,
    from_empty: Duration,
    routing: Duration,
    change: Vec<Duration>,
    change_wg: Vec<Duration>,
    change_nft: Vec<Duration>,
}

struct Node {
    _ns: NetnsGuard,
    _dir: TempDir,
    harness: Harness,
    store: Store,
    rx: mpsc::UnboundedReceiver<Applied>,
    probe: Probe,
    chosen: Arc<Mutex<Option<(FastPath, String)>>>,
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

fn node(n: usize, fast_path: FastPath) -> anyhow::Result<Node> {
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
                        choice: BackendChoice::Userspace,
                    },
                    tx: tx.clone(),
                    probe: Arc::clone(&probe),
                }),
                marking: Arc::new(TimedMarkingFactory {
                    inner: KernelMarking {
                        netns: ns.netns().clone(),
                    },
                    tx,
                    probe: Arc::clone(&probe),
                    chosen: Arc::clone(&chosen),
                }),
                routing_cleanup: None,
                clock: Arc::new(SystemClock),
                metrics: None,
                on_stop: OnStop::Teardown,
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
    async fn wait(
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
    async fn settle(&self, n: usize, limit: Duration) -> anyhow::Result<()> {
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
    fn apply_routing(&self) -> anyhow::Result<Duration> {
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
        let (table, priority, fwmark, fwmask) =
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
            priority,
            fwmark,
            fwmask,
            ..RoutingSpec::default()
        };
        let mut routing = NetlinkRouting::new(&self.ns)?;
        let t = Instant::now();
        routing.apply(&spec)?;
        Ok(t.elapsed())
    }
}

async fn measure(n: usize, changes: usize, fast_path: FastPath) -> anyhow::Result<SizeFigures> {
    let pb = bar(
        changes + 1,
        &format!("{}, N={n}", fast_path_name(fast_path)),
    );
    let mut node = node(n, fast_path)?;
    // The manager's first apply: device up, no peers.
    node.wait(Duration::from_secs(30), |p, _| p == 0, |_, _| true)
        .await?;
    let chosen = node
        .chosen
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    match chosen {
        Some((f, _)) if f == fast_path => {}
        Some((_, note)) => anyhow::bail!(
            "the {} fast path is not in use: {note}",
            fast_path_name(fast_path)
        ),
        None => anyhow::bail!("the manager built no marking"),
    }
    let t0 = Instant::now();
    for i in 0..n {
        let a = affiliate(i);
        node.store
            .modify::<Affiliate>("cluster", &a.node_id, "", |r| r.spec = a.clone())?;
    }
    // Every peer routes its host /32 and its /24 (ULAs route via the /64).
    let (done, _, _) = node
        .wait(Duration::from_secs(120), |p, _| p == n, |x, _| x == 2 * n)
        .await?;
    let from_empty = done - t0;
    let routing = node.apply_routing()?;
    node.settle(n, Duration::from_secs(60)).await?;
    pb.inc(1);
    let (mut change, mut change_wg, mut change_nft) = (Vec::new(), Vec::new(), Vec::new());
    for c in 0..changes {
        let i = (c * 7919) % n;
        let net = IpNet::V4(Ipv4Net::new(v4(11, c, 0), 24).unwrap_or_default());
        *node
            .probe
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((key(i), net));
        while node.rx.try_recv().is_ok() {}
        let mut a = affiliate(i);
        if let Some(ks) = a.kubespan.as_mut() {
            ks.additional_addresses = vec![net];
        }
        let t = Instant::now();
        node.store
            .modify::<Affiliate>("cluster", &a.node_id, "", |r| r.spec = a.clone())?;
        let (done, wg, nft) = node
            .wait(Duration::from_secs(30), |_, p| p, |_, p| p)
            .await?;
        change.push(done - t);
        change_wg.push(wg);
        change_nft.push(nft);
        pb.inc(1);
    }
    pb.finish_and_clear();
    node.harness.stop().await?;
    Ok(SizeFigures {
        fast_path,
        n,
        from_empty,
        routing,
        change,
        change_wg,
        change_nft,
    })
}

fn median(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort_unstable();
    v[v.len() / 2]
}

fn p99(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort_unstable();
    v[(v.len() * 99).div_ceil(100).saturating_sub(1)]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// Runs the benchmark and prints its report.
///
/// # Errors
/// Not root, a missing tool, or the chain not converging in time.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let (sizes, changes) = if args.quick {
        (vec![20, 100], 5)
    } else {
        (args.sizes.clone(), args.changes)
    };
    anyhow::ensure!(
        !sizes.is_empty() && changes >= 1,
        "need sizes and at least one change"
    );
    let fast_paths = args
        .fast_path
        .iter()
        .map(|f| fast_path_of(f))
        .collect::<anyhow::Result<Vec<_>>>()?;
    anyhow::ensure!(!fast_paths.is_empty(), "--fast-path: give at least one");
    println!(
        "wirespan bench reconcile: {} build, controllers + userspace WireGuard + marking ({}), {} one-peer changes per size",
        if cfg!(debug_assertions) { "DEBUG (numbers not meaningful)" } else { "release" },
        args.fast_path.join(", "),
        changes
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut figures = Vec::new();
    for &f in &fast_paths {
        for &n in &sizes {
            figures.push(rt.block_on(measure(n, changes, f))?);
        }
    }
    println!();
    println!(
        "{:<60} {:>14}   {:<9} result",
        "metric", "measured", "target"
    );
    let mut missed = 0;
    let mut row = |name: String, measured: String, target: &str, ok: Option<bool>| {
        let res = match ok {
            Some(true) => "ok",
            Some(false) => {
                missed += 1;
                "MISSED"
            }
            None => "",
        };
        println!("{name:<60} {measured:>14}   {target:<9} {res}");
    };
    for f in &figures {
        let fp = fast_path_name(f.fast_path);
        let (target, ok) = match f.n {
            1_000 => ("< 2 s", Some(f.from_empty < Duration::from_secs(2))),
            10_000 => ("< 20 s", Some(f.from_empty < Duration::from_secs(20))),
            _ => ("—", None),
        };
        row(
            format!("{fp} N={}: all arrive → WG peers + marking set", f.n),
            ms(f.from_empty),
            target,
            ok,
        );
        row(
            format!("{fp} N={}: then link, address, routes, rules", f.n),
            ms(f.routing),
            "—",
            None,
        );
        let med = median(&f.change);
        row(
            format!("{fp} N={}: one-peer change, median", f.n),
            ms(med),
            "< 50 ms",
            Some(med < Duration::from_millis(50)),
        );
        row(
            format!("{fp} N={}: one-peer change, p99", f.n),
            ms(p99(&f.change)),
            "—",
            None,
        );
        row(
            format!("{fp} N={}: of which WG apply / marking apply", f.n),
            format!(
                "{} / {}",
                ms(median(&f.change_wg)),
                ms(median(&f.change_nft))
            ),
            "—",
            None,
        );
    }
    for &fast_path in &fast_paths {
        let of: Vec<&SizeFigures> = figures
            .iter()
            .filter(|f| f.fast_path == fast_path)
            .collect();
        let (Some(a), Some(b)) = (of.first(), of.last()) else {
            continue;
        };
        if b.n <= a.n {
            continue;
        }
        let fp = fast_path_name(fast_path);
        let ratio = median(&b.change).as_secs_f64() / median(&a.change).as_secs_f64().max(1e-9);
        // The target is set for the eBPF fast path; with nftables only the kernel's
        // interval-set commit may grow, shown by the row below.
        let (target, ok) = match fast_path {
            FastPath::Ebpf => ("≤ 2×", Some(ratio <= 2.0)),
            FastPath::Nftables => ("—", None),
        };
        row(
            format!("{fp}: one-peer change N={} / N={}", b.n, a.n),
            format!("{ratio:.2}×"),
            target,
            ok,
        );
        let without = |f: &SizeFigures| median(&f.change).saturating_sub(median(&f.change_nft));
        let ratio = without(b).as_secs_f64() / without(a).as_secs_f64().max(1e-9);
        row(
            format!("{fp}: same without the marking apply N={} / N={}", b.n, a.n),
            format!("{ratio:.2}×"),
            "≤ 2×",
            Some(ratio <= 2.0),
        );
    }
    if missed > 0 {
        println!("\n{missed} target(s) missed");
    }
    Ok(())
}
