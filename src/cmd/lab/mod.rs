//! `wirespan lab`: a local mesh on one machine. Each node is a network namespace with
//! its own mount namespace (a private `/run/wireguard`, its own `/sys` and bpffs) and
//! UTS namespace (hostname = node name), on a bridge in an underlay namespace, with a
//! discovery server in a namespace of its own. Nothing is routed to the host's network.

mod backends;
mod chaos;
mod down;
mod host;
mod observe;
mod ping;
mod plan;
mod status;
mod topology;
mod up;

use std::{path::PathBuf, process::Stdio, time::Duration};

use anyhow::Context as _;
use clap::Subcommand;
use wirespan_control::{config::kubespan::FastPath, files::write_atomic};

use self::plan::{LabName, LabState};

/// The lab's name when `--name` is not given.
const DEFAULT_NAME: &str = "lab";

/// Options of `wirespan lab`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Name of the lab (lowercase letters and digits); several labs can run at once.
    #[arg(long, global = true, env = "WIRESPAN_LAB", default_value = DEFAULT_NAME)]
    name: String,
    #[command(subcommand)]
    command: Lab,
}

/// Marking implementation of the lab's nodes.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum FastPathArg {
    Nftables,
    Ebpf,
}

/// Output of `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Output {
    Table,
    Json,
}

#[derive(Debug, Subcommand)]
enum Lab {
    /// Create the lab and start its daemons; wait until every pair of nodes that can
    /// connect directly is up (the others only until they know each other: they are
    /// reported as expected unreachable until relays), then print a summary and a
    /// ping matrix.
    Up {
        /// Number of nodes (default 3; a topology file sets its own).
        #[arg(long)]
        nodes: Option<usize>,
        /// Where the nodes sit: `flat` (all on the underlay), `cone` (each behind a
        /// port-preserving NAT router), `symmetric` (each behind a NAT that maps every
        /// destination to a new port), `mixed` (public, cone, cone, symmetric,
        /// repeating by node number), or a YAML file: `nodes: [{nat: none}, {nat:
        /// cone}, {nat: symmetric}, …]` and `block: [[node1, node2], …]` (pairs that
        /// exchange no UDP). Pairs that need a relay (symmetric facing a NAT, blocked)
        /// are not waited up, only until they know each other.
        #[arg(long, value_name = "NAME|FILE", default_value = "flat")]
        topology: String,
        /// Marking implementation of the nodes.
        #[arg(long, value_enum, default_value_t = FastPathArg::Nftables)]
        fast_path: FastPathArg,
        /// WireGuard implementation of every node (`auto`: kernel where the kernel has
        /// WireGuard, else `wirespan wireguard`; `kernel`; `userspace`: `wirespan
        /// wireguard`; `userspace-go`: wireguard-go), or one per node:
        /// `node1=kernel,node2=userspace-go` (nodes not named run `auto`, or the bare
        /// value in the list). `lab status` shows which one runs.
        #[arg(long, value_name = "WHICH|NODE=WHICH,...", default_value = "auto")]
        wireguard: backends::WireGuardPlan,
        /// How long to wait for the peers to be up (the lab stays up on timeout).
        #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
        timeout: Duration,
        /// Return once the daemons answer, without waiting for the mesh.
        #[arg(long)]
        no_wait: bool,
        /// Leave out the how-to-look-around lines (scripts print their own).
        #[arg(long)]
        no_hints: bool,
        /// An nftables ruleset (`nft -f` syntax) loaded into the underlay namespace
        /// before any daemon starts: a firewall or blackhole between the nodes. The
        /// underlay is a bridge, so rules go in a `bridge` family table, e.g.
        /// `ip daddr 10.99.1.12 udp dport 51820 drop` in a forward chain cuts node2's
        /// first endpoint. Inspect its counters with
        /// `ip netns exec wsl-NAME-underlay nft list ruleset`.
        #[arg(long, value_name = "FILE")]
        underlay_nft: Option<PathBuf>,
        /// The nodes' `peerReceiveTimeout` (how long a wirespan peer may send nothing
        /// before it is down; 6s–5m, default 30s).
        #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
        peer_receive_timeout: Option<Duration>,
    },
    /// Every node's peers with their state.
    Status {
        /// Output format (`json` for scripts: lab dir, config, namespaces, sockets,
        /// addresses, keys and peer states).
        #[arg(short = 'o', long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Run a command inside a node's namespaces (network, mount, hostname), with
    /// WIRESPAN_SOCKET set to the node's API socket.
    Exec {
        /// Node name (`node1`, …).
        node: String,
        /// The command and its arguments (after `--`).
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Inject faults at random into the running lab (daemons, wireguard-go and the
    /// discovery server killed, links flapped, endpoints blackholed, configs applied,
    /// nodes removed and added back), check after each that the mesh recovers and
    /// nothing is duplicated or leaked, and report recovery times; non-zero exit on
    /// any violation. The same --seed replays the same faults.
    Chaos {
        /// No new fault starts after this long, counted from the first fault.
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        duration: Duration,
        /// Keep starting faults past --duration until this many have run, skipped ones
        /// not counted (on a slow machine, such as an emulated VM, a short duration
        /// may fit only one or two).
        #[arg(long, default_value_t = 0)]
        min_faults: usize,
        /// Seed of the fault schedule (printed in the report: replay with it).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// The number of nodes the lab must have (a check; the lab is `lab up`'s).
        #[arg(long)]
        nodes: Option<usize>,
        /// How long the lab may take to recover from one fault.
        #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
        recovery_timeout: Duration,
        /// Most resident memory any daemon may use, in MiB.
        #[arg(long, default_value_t = 256)]
        rss_limit_mib: u64,
        /// Report format.
        #[arg(short = 'o', long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Remove everything the lab made (also after a crash); idempotent.
    Down {
        /// First wait until process PID has exited (however it ends, SIGKILL too):
        /// a watchdog that removes the lab of a script or test that dies.
        #[arg(long, value_name = "PID")]
        after_exit: Option<i32>,
    },
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let name = LabName::parse(&args.name).map_err(anyhow::Error::msg)?;
    match &args.command {
        Lab::Up {
            nodes,
            topology,
            fast_path,
            wireguard,
            timeout,
            no_wait,
            no_hints,
            underlay_nft,
            peer_receive_timeout,
        } => up::run(
            &name,
            &up::Options {
                topology: load_topology(topology, *nodes)?,
                fast_path: match fast_path {
                    FastPathArg::Nftables => FastPath::Nftables,
                    FastPathArg::Ebpf => FastPath::Ebpf,
                },
                wireguard: wireguard.clone(),
                timeout: *timeout,
                no_wait: *no_wait,
                no_hints: *no_hints,
                underlay_nft: underlay_nft.clone(),
                peer_receive_timeout: *peer_receive_timeout,
            },
        ),
        Lab::Status { output } => {
            let state = load_state(&name)?;
            let views = block_on(status::observe_all(&state));
            if *output == Output::Json {
                println!(
                    "{}",
                    crate::cmd::get::escape_document(
                        &serde_json::to_string_pretty(&status::to_json(&state, &views))?,
                        crate::cmd::get::Format::Json
                    )
                );
            } else {
                print!("{}", status::render_nodes(&state, &views));
                println!();
                print!("{}", status::render_peers(&state, &views));
            }
            Ok(())
        }
        Lab::Exec { node, command } => {
            let state = load_state(&name)?;
            let Some(n) = state.nodes.iter().find(|n| &n.name == node) else {
                let names: Vec<&str> = state.nodes.iter().map(|n| n.name.as_str()).collect();
                anyhow::bail!(
                    "lab {name} has no node {node:?} (nodes: {})",
                    names.join(", ")
                );
            };
            let status = std::process::Command::new("nsenter")
                .arg(format!("--net=/run/netns/{}", n.namespace))
                .arg(format!("--mount={}", n.mount_namespace.display()))
                .arg(format!("--uts={}", n.uts_namespace.display()))
                .arg("--")
                .args(command)
                .env("WIRESPAN_SOCKET", &n.socket)
                // `wirespan -n node2,node3 get peers` from any node, as admin.
                .env(
                    "WIRESPANCONFIG",
                    plan::client_config_path(&state.dir, wirespan_control::api::pki::Role::Admin),
                )
                .env("PATH", path_with_this_binary())
                .stdin(Stdio::inherit())
                .status()
                .with_context(|| format!("running nsenter for {node}"))?;
            // The command's own exit code is the answer.
            std::process::exit(status.code().unwrap_or(1));
        }
        Lab::Chaos {
            duration,
            min_faults,
            seed,
            nodes,
            recovery_timeout,
            rss_limit_mib,
            output,
        } => chaos::run(
            &name,
            &chaos::Options {
                duration: *duration,
                min_faults: *min_faults,
                seed: *seed,
                nodes: *nodes,
                recovery_timeout: *recovery_timeout,
                rss_limit: rss_limit_mib.saturating_mul(1 << 20),
                json: *output == Output::Json,
            },
        ),
        Lab::Down { after_exit } => {
            if let Some(pid) = after_exit {
                down::wait_for_exit(*pid)?;
            }
            down::run(&name)
        }
    }
}

/// The topology of `--topology` (a built-in name or a file) with `--nodes`.
fn load_topology(arg: &str, nodes: Option<usize>) -> anyhow::Result<topology::Topology> {
    if topology::BUILTIN.contains(&arg) {
        let n = nodes.unwrap_or(3);
        if n == 0 || n > plan::MAX_NODES {
            anyhow::bail!("--nodes {n} must be 1 to {}", plan::MAX_NODES);
        }
        return Ok(topology::builtin(arg, n).expect("a built-in name"));
    }
    let text = std::fs::read_to_string(arg).with_context(|| {
        format!(
            "--topology {arg}: neither a built-in topology ({}) nor a readable file",
            topology::BUILTIN.join(", ")
        )
    })?;
    let t = topology::parse(arg, &text).map_err(|e| anyhow::anyhow!("--topology {arg}: {e}"))?;
    if let Some(n) = nodes.filter(|n| *n != t.nodes.len()) {
        anyhow::bail!(
            "--nodes {n}: topology {arg} has {} nodes (leave --nodes out)",
            t.nodes.len()
        );
    }
    Ok(t)
}

/// `PATH` with this binary's directory first, so `wirespan` inside `exec` is this one.
fn path_with_this_binary() -> std::ffi::OsString {
    let mut dirs: Vec<PathBuf> = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(PathBuf::from))
        .into_iter()
        .collect();
    if let Some(path) = std::env::var_os("PATH") {
        dirs.extend(std::env::split_paths(&path));
    }
    std::env::join_paths(dirs).unwrap_or_default()
}

fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("building a current-thread runtime")
        .block_on(f)
}

fn state_path(name: &LabName) -> PathBuf {
    name.dir().join("state.json")
}

/// Writes the state file atomically (0600).
fn save_state(state: &LabState) -> anyhow::Result<()> {
    let name = LabName::parse(&state.name).map_err(anyhow::Error::msg)?;
    let path = state_path(&name);
    write_atomic(&path, serde_json::to_string_pretty(state)?.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

fn load_state(name: &LabName) -> anyhow::Result<LabState> {
    let path = state_path(name);
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "no lab {name}: cannot read {} (create one with `wirespan lab up --name {name}`; \
             `wirespan lab down --name {name}` removes leftovers of a crashed one)",
            path.display()
        )
    })?;
    serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))
}

/// True when this build's `wirespan node` takes `--config` (added with the config
/// loader); the lab then passes each node its config file.
fn node_has_config_flag() -> bool {
    let cmd = <super::node::Args as clap::Args>::augment_args(clap::Command::new("node"));
    let found = cmd.get_arguments().any(|a| a.get_long() == Some("config"));
    found
}
