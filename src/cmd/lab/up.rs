//! `wirespan lab up`: builds the underlay, starts the discovery server and one daemon
//! per node, then waits until every peer that can connect directly is up.

use std::{
    fs,
    net::{IpAddr, SocketAddr},
    os::unix::fs::{DirBuilderExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    process::Child,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use wirespan_control::{
    config::{
        kubespan::{FastPath, KubeSpanConfigDocument},
        ConfigDocument as _,
    },
    files::write_atomic,
};
use wirespan_dataplane::{netns::Netns, wireguard::PresharedKey};

use super::super::node::KERNEL_WIREGUARD_MISSING;
use super::{
    backends::{wireguard_name, WireGuardPlan},
    host, observe, ping,
    plan::{self, LabName, LabState, NodeState, RouterState},
    status,
    topology::{self, Nat, Topology},
};

/// Options of `up`.
#[derive(Debug)]
pub struct Options {
    /// The nodes, where they sit and which pairs are blocked.
    pub topology: Topology,
    /// Marking implementation.
    pub fast_path: FastPath,
    /// WireGuard implementation of each daemon.
    pub wireguard: WireGuardPlan,
    /// How long to wait for every peer to be up.
    pub timeout: Duration,
    /// Return once the daemons answer, without waiting for the mesh.
    pub no_wait: bool,
    /// Leave out the how-to-look-around lines (scripts print their own).
    pub no_hints: bool,
    /// nftables ruleset loaded into the underlay namespace before the daemons start.
    pub underlay_nft: Option<PathBuf>,
    /// The nodes' `peerReceiveTimeout` (`None`: the default).
    pub peer_receive_timeout: Option<Duration>,
}

/// How long a process may take to start answering. Generous: in the suite's VM tier
/// (QEMU without KVM on a loaded machine) a daemon took longer than 15 s; a daemon
/// that exits is reported at once whatever this is.
const START_TIMEOUT: Duration = Duration::from_secs(60);

pub fn run(name: &LabName, opts: &Options) -> anyhow::Result<()> {
    let leftovers: Vec<String> = host::netns_list()
        .into_iter()
        .filter(|n| name.owns_netns(n))
        .collect();
    if !leftovers.is_empty() || name.dir().exists() {
        anyhow::bail!(
            "lab {name} already exists ({}); remove it first with `wirespan lab down --name {name}`",
            if leftovers.is_empty() {
                name.dir().display().to_string()
            } else {
                leftovers.join(", ")
            }
        );
    }
    if let Some(f) = &opts.underlay_nft {
        // Checked before anything is made: a typo must not leave a half-built lab.
        fs::metadata(f).with_context(|| format!("--underlay-nft {}", f.display()))?;
    }
    if let Some(t) = opts.peer_receive_timeout {
        // The node's own check, before anything is made.
        let kubespan = KubeSpanConfigDocument {
            peer_receive_timeout: t,
            ..KubeSpanConfigDocument::default()
        };
        let errors = kubespan.validate();
        if let Some(e) = errors.iter().find(|e| e.field == "peerReceiveTimeout") {
            anyhow::bail!("--peer-receive-timeout: {}", e.message);
        }
    }
    // Forced kernel WireGuard where the kernel has none: every daemon would refuse to
    // start; say so before anything is made.
    let node_names: Vec<String> = (1..=opts.topology.nodes.len())
        .map(plan::node_name)
        .collect();
    opts.wireguard
        .check_nodes(&node_names)
        .map_err(anyhow::Error::msg)?;
    if opts.wireguard.any_kernel() && !wirespan_dataplane::wireguard::kernel::supported_on_host() {
        anyhow::bail!("{KERNEL_WIREGUARD_MISSING}");
    }
    let started = Instant::now();
    let state = build(name, opts).with_context(|| {
        format!(
            "lab {name} is partly up; look at the logs in {} and remove it with `wirespan lab down --name {name}`",
            name.dir().display()
        )
    })?;
    eprintln!(
        "lab {name}: {} nodes started in {:.1}s",
        state.nodes.len(),
        started.elapsed().as_secs_f64()
    );
    let views = if opts.no_wait {
        super::block_on(status::observe_all(&state))
    } else {
        let views = super::block_on(wait_for_peers(name, &state, opts.timeout))?;
        let relayed = status::expected_relayed(&state);
        let server = status::expected_server_relayed(&state);
        let mut line = format!(
            "lab {name}: every peer {} {:.1}s after start",
            if relayed.is_empty() && server.is_empty() {
                "up"
            } else {
                "as expected"
            },
            started.elapsed().as_secs_f64()
        );
        if !relayed.is_empty() {
            line.push_str(&format!("; through a relay: {}", relayed.join(", ")));
        }
        if !server.is_empty() {
            line.push_str(&format!(
                "; through the server relay: {}",
                server.join(", ")
            ));
        }
        eprintln!("{line}");
        views
    };
    print!("{}", status::render_nodes(&state, &views));
    println!();
    print!("{}", ping_matrix(&state, &views));
    if !opts.no_hints {
        println!();
        print!("{}", hints(&state));
    }
    Ok(())
}

fn mkdir_private(dir: &Path) -> anyhow::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))
}

fn write_config(path: &Path, text: &str) -> anyhow::Result<()> {
    plan::validate(text).with_context(|| format!("generated config {}", path.display()))?;
    write_atomic(path, text.as_bytes()).with_context(|| format!("writing {}", path.display()))?;
    // write_atomic creates 0600 files; make sure even if that ever changes.
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))?;
    Ok(())
}

/// Adds namespace `netns` with `lo` up and a veth to the underlay bridge.
fn add_host_netns(
    name: &LabName,
    role: &str,
    addresses: &[(IpAddr, u8)],
) -> anyhow::Result<String> {
    let ns = name.netns(role);
    let underlay = name.netns("underlay");
    host::run("ip", &["netns", "add", &ns])?;
    host::ip_in(&ns, &["link", "set", "lo", "up"])?;
    // The veth is made inside the underlay namespace, its peer moved straight into the
    // node's: nothing ever appears in the host's namespace.
    host::ip_in(
        &underlay,
        &[
            "link",
            "add",
            role,
            "type",
            "veth",
            "peer",
            "name",
            plan::NODE_LINK,
            "netns",
            &ns,
        ],
    )?;
    host::ip_in(&underlay, &["link", "set", role, "master", "br0", "up"])?;
    for (addr, len) in addresses {
        let cidr = format!("{addr}/{len}");
        let mut args = vec!["addr", "add", &cidr, "dev", plan::NODE_LINK];
        if addr.is_ipv6() {
            args.push("nodad");
        }
        host::ip_in(&ns, &args)?;
    }
    host::ip_in(&ns, &["link", "set", plan::NODE_LINK, "up"])?;
    Ok(ns)
}

/// Makes node `i`'s NAT router (WAN on the underlay bridge at the address the node
/// would have had, LAN to the node) and the node's namespace behind it, its default
/// route via the router. Returns the node's namespace, LAN address and router.
fn add_natted_node(
    name: &LabName,
    i: usize,
    nat: Nat,
    dir: &Path,
) -> anyhow::Result<(String, IpAddr, RouterState)> {
    // IPv4 only: the NAT is IPv4's (the node has no IPv6 beyond its link).
    let wan: Vec<(IpAddr, u8)> = plan::underlay_addresses(plan::node_host(i))
        .into_iter()
        .filter(|(a, _)| a.is_ipv4())
        .collect();
    let router = add_host_netns(name, &topology::router_role(i), &wan)?;
    host::run(
        "ip",
        &[
            "netns",
            "exec",
            &router,
            "sysctl",
            "-qw",
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
        ],
    )?;
    let ns = name.netns(&plan::node_name(i));
    host::run("ip", &["netns", "add", &ns])?;
    host::ip_in(&ns, &["link", "set", "lo", "up"])?;
    host::ip_in(
        &router,
        &[
            "link",
            "add",
            topology::ROUTER_LAN_LINK,
            "type",
            "veth",
            "peer",
            "name",
            plan::NODE_LINK,
            "netns",
            &ns,
        ],
    )?;
    let (gw, lan) = topology::lan_addresses(i);
    host::ip_in(
        &router,
        &[
            "addr",
            "add",
            &format!("{gw}/24"),
            "dev",
            topology::ROUTER_LAN_LINK,
        ],
    )?;
    host::ip_in(&router, &["link", "set", topology::ROUTER_LAN_LINK, "up"])?;
    host::ip_in(
        &ns,
        &["addr", "add", &format!("{lan}/24"), "dev", plan::NODE_LINK],
    )?;
    host::ip_in(&ns, &["link", "set", plan::NODE_LINK, "up"])?;
    host::ip_in(&ns, &["route", "add", "default", "via", &gw.to_string()])?;
    let rules = dir.join(format!("{}.nft", topology::router_role(i)));
    write_atomic(&rules, topology::router_nft(nat).as_bytes())
        .with_context(|| format!("writing {}", rules.display()))?;
    host::run(
        "ip",
        &["netns", "exec", &router, "nft", "-f", path_str(&rules)?],
    )
    .with_context(|| format!("loading the NAT rules of {router}"))?;
    Ok((
        ns,
        IpAddr::V4(lan),
        RouterState {
            namespace: router,
            wan: wan.iter().map(|(a, _)| *a).collect(),
            lan: IpAddr::V4(gw),
        },
    ))
}

/// Drops UDP between the public addresses of each blocked pair on the underlay
/// bridge, before any daemon starts.
fn load_blocks(
    underlay: &str,
    topology: &Topology,
    nodes: &[NodeState],
    dir: &Path,
) -> anyhow::Result<()> {
    let pairs: Vec<(Vec<IpAddr>, Vec<IpAddr>)> = topology
        .blocked
        .iter()
        .map(|(a, b)| {
            (
                nodes[*a].public_addresses().to_vec(),
                nodes[*b].public_addresses().to_vec(),
            )
        })
        .collect();
    let Some(rules) = topology::block_nft(&pairs) else {
        return Ok(());
    };
    let path = dir.join("blocked.nft");
    write_atomic(&path, rules.as_bytes()).with_context(|| format!("writing {}", path.display()))?;
    host::run(
        "ip",
        &["netns", "exec", underlay, "nft", "-f", path_str(&path)?],
    )
    .context("loading the blocked pairs' rules into the underlay")?;
    Ok(())
}

fn build(name: &LabName, opts: &Options) -> anyhow::Result<LabState> {
    let exe = std::env::current_exe().context("finding the wirespan binary")?;
    let exe = exe
        .to_str()
        .context("non-UTF-8 path of the binary")?
        .to_owned();
    host::ensure_private_mount(Path::new(plan::LAB_ROOT))?;
    let dir = name.dir();
    mkdir_private(&dir)?;
    let ns_dir = dir.join("ns");
    mkdir_private(&ns_dir)?;

    // Secrets: generated here, written 0600, never printed.
    let ca = wirespan_control::api::pki::generate_ca(std::time::SystemTime::now())?;
    let secrets = plan::ClusterSecrets {
        id: PresharedKey::generate().to_base64(),
        secret: PresharedKey::generate().to_base64(),
        api_ca: Some((ca.cert_pem, ca.key_pem.expose().to_owned())),
    };
    let discovery = plan::discovery_address();
    let endpoint = format!("http://{discovery}");
    let cluster_text = plan::cluster_config(&secrets, &endpoint);
    let cluster_config = dir.join("cluster.yaml");
    write_config(&cluster_config, &cluster_text)?;
    write_client_configs(&dir, &cluster_config)?;

    let underlay = create_underlay(name, opts)?;

    let (disco_ns, disco_log, mut disco) = start_discovery(name, &exe, &dir)?;

    // The nodes' namespaces.
    let supports_config = super::node_has_config_flag();
    fs::create_dir_all("/run/wireguard").context("creating /run/wireguard")?;
    let mut nodes = Vec::new();
    let setup = NodeSetup {
        lab: name,
        dir: &dir,
        ns_dir: &ns_dir,
        cluster_text: &cluster_text,
        behind_nat: opts.topology.nodes.iter().any(|n| *n != Nat::None),
    };
    for (i, nat) in (1..=opts.topology.nodes.len()).zip(opts.topology.nodes.clone()) {
        nodes.push(add_node(&setup, opts, i, nat)?);
    }
    load_blocks(&underlay, &opts.topology, &nodes, &dir)?;

    // The discovery server answers on the underlay, seen from node1.
    wait_for_tcp(&nodes[0].namespace, discovery, &mut disco, &disco_log)?;

    let mut children = start_nodes(&mut nodes, &exe, opts, supports_config)?;
    let state = LabState {
        name: name.as_str().to_owned(),
        dir,
        cluster_config,
        fast_path: match opts.fast_path {
            FastPath::Nftables => "nftables".into(),
            FastPath::Ebpf => "ebpf".into(),
        },
        wireguard: opts.wireguard.to_string(),
        underlay_namespace: underlay,
        topology: opts.topology.name.clone(),
        blocked: opts
            .topology
            .blocked
            .iter()
            .map(|(a, b)| [plan::node_name(a + 1), plan::node_name(b + 1)])
            .collect(),
        discovery: plan::DiscoveryState {
            namespace: disco_ns,
            address: discovery,
            endpoint,
            metrics_address: plan::discovery_metrics_address(),
            pid: disco.id(),
            log: disco_log,
        },
        nodes,
    };
    super::save_state(&state)?;
    if !supports_config {
        eprintln!(
            "warning: this build's `wirespan node` has no --config flag: the daemons run \
             without the lab's config (no cluster, no KubeSpan); the peers will not come up"
        );
    }
    for (n, child) in state.nodes.iter().zip(&mut children) {
        wait_for_api(n, child)?;
    }
    Ok(state)
}

/// The underlay: a bridge in its own namespace, with `--underlay-nft` loaded.
fn create_underlay(name: &LabName, opts: &Options) -> anyhow::Result<String> {
    let underlay = name.netns("underlay");
    host::run("ip", &["netns", "add", &underlay])?;
    host::ip_in(&underlay, &["link", "set", "lo", "up"])?;
    host::ip_in(&underlay, &["link", "add", "br0", "type", "bridge"])?;
    host::ip_in(&underlay, &["link", "set", "br0", "up"])?;
    if let Some(rules) = &opts.underlay_nft {
        // Before any daemon runs, so the very first packets already meet the rules.
        host::run(
            "nsenter",
            &[
                &format!("--net=/run/netns/{underlay}"),
                "--",
                "nft",
                "-f",
                path_str(rules)?,
            ],
        )
        .with_context(|| format!("loading --underlay-nft {}", rules.display()))?;
    }
    Ok(underlay)
}

/// Starts the discovery server (with its relay) in its own namespace on the underlay.
fn start_discovery(
    name: &LabName,
    exe: &str,
    dir: &Path,
) -> anyhow::Result<(String, PathBuf, Child)> {
    let disco_ns = add_host_netns(
        name,
        "disco",
        &plan::underlay_addresses(plan::DISCOVERY_HOST),
    )?;
    let disco_log = dir.join("discovery.log");
    let listen = SocketAddr::new(IpAddr::from([0u16; 8]), plan::DISCOVERY_PORT).to_string();
    let metrics =
        SocketAddr::new(IpAddr::from([0u16; 8]), plan::DISCOVERY_METRICS_PORT).to_string();
    let disco = host::spawn_detached(
        &disco_ns,
        None,
        &[
            exe,
            "discovery",
            "--listen",
            &listen,
            "--metrics-listen",
            &metrics,
            // Pairs that nothing else connects (both behind symmetric NATs, no node
            // reaching both) go through it.
            "--relay",
        ],
        &disco_log,
    )?;
    Ok((disco_ns, disco_log, disco))
}

/// What every node of a lab is made with.
struct NodeSetup<'a> {
    lab: &'a LabName,
    dir: &'a Path,
    ns_dir: &'a Path,
    cluster_text: &'a str,
    /// Some node is behind a NAT (public nodes then need a default route).
    behind_nat: bool,
}

/// Node `i`: its network namespace (public or behind a NAT router), sysctls, config
/// and its own mount and UTS namespaces. The daemon is started later.
fn add_node(
    setup: &NodeSetup<'_>,
    opts: &Options,
    i: usize,
    nat: Nat,
) -> anyhow::Result<NodeState> {
    let node = plan::node_name(i);
    let (ns, addresses, router) = if nat == Nat::None {
        let addresses: Vec<IpAddr> = plan::underlay_addresses(plan::node_host(i))
            .iter()
            .map(|(a, _)| *a)
            .collect();
        let cidrs = plan::underlay_addresses(plan::node_host(i));
        let ns = add_host_netns(setup.lab, &node, &cidrs)?;
        if setup.behind_nat {
            // Like any host on the internet, a default route: the reply to a LAN
            // address behind a NAT needs one before KubeSpan's mark reroutes it
            // into the tunnel (without, the first lookup fails: no route).
            host::ip_in(&ns, &["route", "add", "default", "dev", plan::NODE_LINK])?;
        }
        (ns, addresses, None)
    } else {
        let (ns, lan, router) = add_natted_node(setup.lab, i, nat, setup.dir)?;
        (ns, vec![lan], Some(router))
    };
    // Like a systemd host (its 50-default.conf): every new link, the mesh link
    // included, starts with loose reverse-path filtering, which the daemon turns
    // off on the mesh link. `all` is the host policy the daemon requires to be 0
    // (a new namespace copies the host's IPv4 `all`, which may be strict).
    host::run(
        "ip",
        &[
            "netns",
            "exec",
            &ns,
            "sysctl",
            "-qw",
            "net.ipv4.conf.default.rp_filter=2",
            "net.ipv4.conf.all.rp_filter=0",
            // Forwarding on, as on a Kubernetes node: it makes the node a relay
            // for pairs that cannot connect directly.
            "net.ipv4.ip_forward=1",
            "net.ipv6.conf.all.forwarding=1",
        ],
    )?;
    let node_dir = plan::node_dir(setup.dir, &node);
    mkdir_private(&node_dir)?;
    let config = node_dir.join("config.yaml");
    write_config(
        &config,
        &plan::node_config(
            setup.cluster_text,
            opts.fast_path,
            opts.peer_receive_timeout,
        )?,
    )?;
    // Its own mount namespace (a private /run/wireguard: the UAPI sockets) and UTS
    // namespace (hostname = node name), kept alive by bind mounts in the lab dir.
    let mnt = setup.ns_dir.join(format!("{node}.mnt"));
    let uts = setup.ns_dir.join(format!("{node}.uts"));
    for f in [&mnt, &uts] {
        fs::File::create(f).with_context(|| format!("creating {}", f.display()))?;
    }
    let (m, u) = (path_str(&mnt)?, path_str(&uts)?);
    host::run(
        "unshare",
        &[
            &format!("--mount={m}"),
            &format!("--uts={u}"),
            "--propagation",
            "private",
            "true",
        ],
    )?;
    mount_in(
        m,
        None,
        &["-t", "tmpfs", "-o", "mode=0700"],
        "/run/wireguard",
    )?;
    // A sysfs of the node's network namespace (as `ip netns exec` mounts), so
    // /sys/class/net shows the node's links, and a bpffs of its own, so pinned
    // BPF objects of one node never meet another's.
    mount_in(m, Some(ns.as_ref()), &["-t", "sysfs"], "/sys")?;
    mount_in(m, None, &["-t", "bpf"], "/sys/fs/bpf")?;
    host::run("nsenter", &[&format!("--uts={u}"), "--", "hostname", &node])?;
    Ok(NodeState {
        name: node,
        namespace: ns,
        mount_namespace: mnt,
        uts_namespace: uts,
        socket: node_dir.join("api.sock"),
        config,
        state_dir: node_dir.join("state"),
        log: node_dir.join("node.log"),
        pid: 0,
        link: plan::NODE_LINK.to_owned(),
        underlay: addresses,
        nat,
        router,
    })
}

/// Starts every node's daemon in its namespaces.
fn start_nodes(
    nodes: &mut [NodeState],
    exe: &str,
    opts: &Options,
    supports_config: bool,
) -> anyhow::Result<Vec<Child>> {
    let mut children: Vec<Child> = Vec::new();
    for n in nodes.iter_mut() {
        let host_root = n.state_dir.with_file_name("host");
        fs::create_dir_all(&host_root)
            .with_context(|| format!("creating {}", host_root.display()))?;
        let mut args = vec![
            exe.to_owned(),
            "--socket".into(),
            path_str(&n.socket)?.to_owned(),
            "node".into(),
            "--state-dir".into(),
            path_str(&n.state_dir)?.to_owned(),
            "--metrics-listen".into(),
            plan::node_metrics_address().to_string(),
            "--wireguard".into(),
            wireguard_name(opts.wireguard.for_node(&n.name)).into(),
            // Every address of the node: loopback (the lab's client configs), the
            // underlay and the mesh address (the proxy).
            "--api-listen".into(),
            plan::node_api_address().to_string(),
            // Host documents (HostnameConfig, ResolverConfig, TimeServerConfig) act on
            // the node's own directory, never on the machine's /etc.
            "--host-root".into(),
            path_str(&host_root)?.to_owned(),
        ];
        if supports_config {
            args.extend(["--config".into(), path_str(&n.config)?.to_owned()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let child = host::spawn_detached(
            &n.namespace,
            Some((&n.mount_namespace, &n.uts_namespace)),
            &args,
            &n.log,
        )?;
        n.pid = child.id();
        children.push(child);
    }
    Ok(children)
}

/// The lab's client configs for the remote API (`admin.yaml`, `reader.yaml`): endpoint
/// the node's own API on loopback, so they work inside `lab exec` on any node.
fn write_client_configs(dir: &Path, cluster_config: &Path) -> anyhow::Result<()> {
    use wirespan_control::api::pki::Role;
    let endpoint = format!("127.0.0.1:{}", plan::node_api_address().port());
    for role in [Role::Admin, Role::Reader] {
        let config = crate::cmd::gen::client_config(
            cluster_config,
            role,
            std::slice::from_ref(&endpoint),
            &[],
            Some(&format!("lab-{}", role.as_str())),
        )?;
        config.save(&plan::client_config_path(dir, role))?;
    }
    Ok(())
}

fn path_str(p: &Path) -> anyhow::Result<&str> {
    p.to_str()
        .with_context(|| format!("non-UTF-8 path {}", p.display()))
}

fn exited(child: &mut Child, what: &str, log: &Path) -> anyhow::Result<()> {
    if let Some(status) = child.try_wait()? {
        anyhow::bail!(
            "{what} exited ({status}); last lines of {}:\n{}",
            log.display(),
            host::log_tail(log, 20)
        );
    }
    Ok(())
}

fn wait_for_tcp(
    from_ns: &str,
    addr: SocketAddr,
    child: &mut Child,
    log: &Path,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + START_TIMEOUT;
    let netns = Netns::named(from_ns);
    loop {
        exited(child, "the discovery server", log)?;
        let ok = netns
            .block_on(move || async move {
                tokio::time::timeout(
                    Duration::from_millis(500),
                    tokio::net::TcpStream::connect(addr),
                )
                .await
                .is_ok_and(|r| r.is_ok())
            })
            .unwrap_or(false);
        if ok {
            return Ok(());
        }
        if Instant::now() > deadline {
            anyhow::bail!(
                "the discovery server does not answer on {addr} from {from_ns}; see {}",
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn wait_for_api(node: &NodeState, child: &mut Child) -> anyhow::Result<()> {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        exited(child, &format!("the daemon of {}", node.name), &node.log)?;
        let api = super::block_on(async {
            wirespan_control::api::client::connect(&node.socket)
                .await
                .is_ok()
        });
        if api {
            return Ok(());
        }
        if Instant::now() > deadline {
            anyhow::bail!(
                "the daemon of {} does not answer on {}; see {}",
                node.name,
                node.socket.display(),
                node.log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Polls every node until each sees every node it can reach directly as an `up` peer
/// (`status::pending`), with a progress bar; on timeout names each such peer not up.
async fn wait_for_peers(
    name: &LabName,
    state: &LabState,
    timeout: Duration,
) -> anyhow::Result<Vec<observe::NodeView>> {
    let n = state.nodes.len();
    let total = (n * n.saturating_sub(1)) as u64;
    // Behind NAT some peers are only waited to be known, not up.
    let what = if state.topology().unreachable().is_empty() {
        "peers up"
    } else {
        "peers as expected"
    };
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template(&format!(
            "{{spinner}} [{{elapsed}}] {{bar:30}} {{pos}}/{{len}} {what}  {{msg}}"
        ))
        .expect("valid template"),
    );
    bar.enable_steady_tick(Duration::from_millis(100));
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let views = status::observe_all(state).await;
        let pending = status::pending(state, &views);
        let waiting: usize = pending.iter().map(|(_, p)| p.len()).sum();
        bar.set_position(total - waiting as u64);
        if let Some((node, p)) = pending.iter().find(|(_, p)| !p.is_empty()) {
            bar.set_message(format!("{node} waits for {}", p[0]));
        }
        if waiting == 0 {
            bar.finish_and_clear();
            return Ok(views);
        }
        for node in &state.nodes {
            if !host::alive(i32::try_from(node.pid).unwrap_or(0)) {
                bar.abandon();
                anyhow::bail!(
                    "the daemon of {} exited; last lines of {}:\n{}\nthe lab is left up; \
                     remove it with `wirespan lab down --name {name}`",
                    node.name,
                    node.log.display(),
                    host::log_tail(&node.log, 20)
                );
            }
        }
        if tokio::time::Instant::now() >= deadline {
            bar.abandon();
            for (node, p) in &pending {
                for line in p {
                    eprintln!("{node}: peer {line}");
                }
            }
            anyhow::bail!(
                "not every peer is reached as the topology expects after {}; the lab is left up for inspection \
                 (`wirespan lab status --name {name}`, logs in {}/node*/node.log); \
                 remove it with `wirespan lab down --name {name}`",
                humantime::format_duration(timeout),
                state.dir.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Every node pings every other node's first underlay address (public nodes only)
/// and KubeSpan address.
fn ping_matrix(state: &LabState, views: &[observe::NodeView]) -> String {
    let names: Vec<String> = state.nodes.iter().map(|n| n.name.clone()).collect();
    let targets: [(&str, Vec<Option<IpAddr>>); 2] = [
        (
            "underlay",
            state
                .nodes
                .iter()
                // A node behind NAT has no underlay address of its own to ping.
                .map(|n| n.underlay.first().copied().filter(|_| n.router.is_none()))
                .collect(),
        ),
        (
            "kubespan",
            views.iter().map(|v| v.kubespan_address).collect(),
        ),
    ];
    let mut probes = Vec::new();
    let mut slots = Vec::new();
    for (t, (_, addrs)) in targets.iter().enumerate() {
        for (i, from) in state.nodes.iter().enumerate() {
            for (j, to) in addrs.iter().enumerate() {
                if let (true, Some(a)) = (i != j, to) {
                    probes.push((from.namespace.clone(), *a));
                    slots.push((t, i, j));
                }
            }
        }
    }
    let results = ping::ping_all(&probes);
    let mut cells = vec![vec![vec![None; names.len()]; names.len()]; 2];
    for ((t, i, j), r) in slots.into_iter().zip(results) {
        cells[t][i][j] = Some(r);
    }
    let mut out = String::new();
    for (t, (title, _)) in targets.iter().enumerate() {
        out.push_str(&ping::render(&format!("ping {title}"), &names, &cells[t]));
    }
    out
}

fn hints(state: &LabState) -> String {
    let exe = std::env::current_exe()
        .map(|e| e.display().to_string())
        .unwrap_or_else(|_| "wirespan".into());
    let lab = if state.name == super::DEFAULT_NAME {
        format!("{exe} lab")
    } else {
        format!("{exe} lab --name {}", state.name)
    };
    let n1 = &state.nodes[0];
    format!(
        "Look around:\n  \
         {lab} status [-o json]                  # every node's peers and their state\n  \
         {lab} exec {node} -- wirespan get peers  # any command inside a node\n  \
         {lab} exec {node} -- wirespan -n {others} get peers  # other nodes through {node} (remote API)\n  \
         {lab} exec {node} -- wg show kubespan    # the node's WireGuard device\n  \
         logs: {dir}/node*/node.log, {dir}/discovery.log\n{routers}\
         Tear down:\n  \
         {lab} down\n",
        node = n1.name,
        others = if state.nodes.len() > 1 {
            state.nodes[1..].iter().map(|n| n.name.as_str()).collect::<Vec<_>>().join(",")
        } else {
            n1.name.clone()
        },
        dir = state.dir.display(),
        routers = state
            .nodes
            .iter()
            .find_map(|n| n.router.as_ref())
            .map(|r| format!(
                "  ip netns exec {ns} cat /proc/net/nf_conntrack   # a NAT router's translations\n",
                ns = r.namespace
            ))
            .unwrap_or_default(),
    )
}

/// Mounts a `wirespan-lab` filesystem at `target` in the node's mount namespace `m`,
/// seen from its network namespace `net` where the filesystem depends on it (sysfs).
fn mount_in(m: &str, net: Option<&str>, fs_args: &[&str], target: &str) -> anyhow::Result<()> {
    let mut args = Vec::new();
    if let Some(ns) = net {
        args.push(format!("--net=/run/netns/{ns}"));
    }
    args.push(format!("--mount={m}"));
    args.extend(["--", "mount"].map(String::from));
    args.extend(fs_args.iter().map(|a| (*a).to_owned()));
    args.extend(["wirespan-lab", target].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    host::run("nsenter", &args).map(drop)
}
