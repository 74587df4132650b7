//! The chaos run's edge to the lab: doing and undoing faults (signals, restarts, links,
//! nft rules, `apply`) and reading what the invariants are checked against.

use std::{
    ffi::OsString,
    fs::OpenOptions,
    net::IpAddr,
    os::unix::ffi::OsStringExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use nix::{sys::signal::Signal, unistd::Pid};
use serde_json::Value;
use wirespan_control::{config::kubespan::KubeSpanConfigDocument, files::write_atomic};
use wirespan_dataplane::netns::Netns;

use super::{
    invariants::{self, Expected, Kernel, Probe, Secret},
    schedule::{Fault, FaultKind},
};
use crate::cmd::lab::{
    host, observe, ping,
    plan::{LabName, LabState},
    status,
};

/// How long a process may take to die after SIGKILL/SIGTERM, or a removed node to
/// leave the others' devices.
const SETTLE: Duration = Duration::from_secs(30);
/// Name of the nft table the blackhole puts in the underlay namespace.
const BLACKHOLE_TABLE: &str = "wirespan_chaos";

/// A process's command line and environment, read from `/proc` while it runs: a
/// restart is then exactly the launch `lab up` made, whatever flags it used.
#[derive(Debug, Clone)]
struct Launch {
    argv: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
}

impl Launch {
    fn of(pid: u32) -> anyhow::Result<Self> {
        let split = |bytes: Vec<u8>| -> Vec<OsString> {
            bytes
                .split(|b| *b == 0)
                .filter(|s| !s.is_empty())
                .map(|s| OsString::from_vec(s.to_vec()))
                .collect()
        };
        let argv = split(
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .with_context(|| format!("reading the command line of process {pid}"))?,
        );
        let env = split(
            std::fs::read(format!("/proc/{pid}/environ"))
                .with_context(|| format!("reading the environment of process {pid}"))?,
        )
        .into_iter()
        .filter_map(|kv| {
            let kv = kv.into_vec();
            let eq = kv.iter().position(|b| *b == b'=')?;
            Some((
                OsString::from_vec(kv[..eq].to_vec()),
                OsString::from_vec(kv[eq + 1..].to_vec()),
            ))
        })
        .collect();
        anyhow::ensure!(!argv.is_empty(), "process {pid} has no command line");
        Ok(Self { argv, env })
    }
}

/// What a node must keep across faults: its identity and addresses.
#[derive(Debug, Clone)]
struct Baseline {
    public_key: String,
    kubespan: Option<IpAddr>,
}

/// A running lab under chaos.
pub struct ChaosLab {
    pub state: LabState,
    exe: PathBuf,
    nodes: Vec<Launch>,
    discovery: Launch,
    baseline: Vec<Baseline>,
    children: Vec<Child>,
    secrets: Vec<Secret>,
    kubespan: KubeSpanConfigDocument,
}

fn nsenter_node(n: &crate::cmd::lab::plan::NodeState, args: &[&str]) -> anyhow::Result<String> {
    let net = format!("--net=/run/netns/{}", n.namespace);
    let mnt = format!("--mount={}", n.mount_namespace.display());
    let mut all = vec![net.as_str(), mnt.as_str(), "--"];
    all.extend_from_slice(args);
    host::run("nsenter", &all)
}

fn json_of(text: &str) -> anyhow::Result<Value> {
    serde_json::from_str(if text.trim().is_empty() { "[]" } else { text })
        .context("decoding JSON output")
}

fn signal(pid: u32, sig: Signal) -> anyhow::Result<()> {
    let pid = i32::try_from(pid).context("pid out of range")?;
    nix::sys::signal::kill(Pid::from_raw(pid), sig).with_context(|| format!("{sig} to {pid}"))
}

/// The value of `key: '…'` / `key: …` on its own line of a YAML text.
fn yaml_scalar(text: &str, key: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .map(|v| v.trim().trim_matches('\'').trim_matches('"').to_owned())
}

impl ChaosLab {
    /// Reads the lab's state, its secrets and every daemon's launch.
    pub fn open(name: &LabName) -> anyhow::Result<Self> {
        let state = super::super::load_state(name)?;
        let exe = std::env::current_exe().context("finding the wirespan binary")?;
        let nodes = state
            .nodes
            .iter()
            .map(|n| {
                Launch::of(n.pid).with_context(|| {
                    format!("the daemon of {} (pid {}) does not run", n.name, n.pid)
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let discovery =
            Launch::of(state.discovery.pid).context("the discovery server does not run")?;
        let cluster = std::fs::read_to_string(&state.cluster_config)
            .with_context(|| format!("reading {}", state.cluster_config.display()))?;
        let mut secrets = Vec::new();
        if let Some(s) = yaml_scalar(&cluster, "secret") {
            secrets.push(Secret::new("the cluster secret", &s));
        }
        for n in &state.nodes {
            let key = n.state_dir.join("kubespan.key");
            let text = std::fs::read_to_string(&key)
                .with_context(|| format!("reading {}", key.display()))?;
            secrets.push(Secret::new(&format!("{}'s private key", n.name), &text));
        }
        Ok(Self {
            state,
            exe,
            nodes,
            discovery,
            baseline: Vec::new(),
            children: Vec::new(),
            secrets,
            kubespan: KubeSpanConfigDocument::default(),
        })
    }

    /// Remembers every node's identity; later checks expect the same.
    pub fn record_baseline(&mut self) -> anyhow::Result<()> {
        let views = super::super::block_on(status::observe_all(&self.state));
        self.baseline = views
            .iter()
            .zip(&self.state.nodes)
            .map(|(v, n)| {
                anyhow::ensure!(
                    !v.public_key.is_empty(),
                    "{} has no KubeSpan identity",
                    n.name
                );
                Ok(Baseline {
                    public_key: v.public_key.clone(),
                    kubespan: v.kubespan_address,
                })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(())
    }

    /// Reaps the daemons this run started that have exited.
    fn reap(&mut self) {
        self.children
            .retain_mut(|c| !matches!(c.try_wait(), Ok(Some(_))));
    }

    fn wait_dead(&mut self, pid: u32, what: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + SETTLE;
        let p = i32::try_from(pid).context("pid out of range")?;
        loop {
            self.reap();
            if !host::alive(p) {
                return Ok(());
            }
            anyhow::ensure!(Instant::now() < deadline, "{what} (pid {pid}) does not die");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts `launch` detached in the given namespaces as `lab up` does, its output
    /// appended to `log` (the earlier lines stay for the secret check).
    fn spawn(
        &mut self,
        netns: &str,
        mount_uts: Option<(PathBuf, PathBuf)>,
        launch: &Launch,
        log: &Path,
    ) -> anyhow::Result<u32> {
        let out = OpenOptions::new()
            .append(true)
            .create(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        let err = out.try_clone()?;
        let mut cmd = Command::new("setsid");
        cmd.arg("nsenter").arg(format!("--net=/run/netns/{netns}"));
        if let Some((mnt, uts)) = mount_uts {
            cmd.arg(format!("--mount={}", mnt.display()))
                .arg(format!("--uts={}", uts.display()));
        }
        let child = cmd
            .arg("--")
            .args(&launch.argv)
            .env_clear()
            .envs(launch.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {:?} in {netns}", launch.argv))?;
        let pid = child.id();
        self.children.push(child);
        Ok(pid)
    }

    fn restart_node(&mut self, i: usize) -> anyhow::Result<()> {
        let n = self.state.nodes[i].clone();
        let launch = self.nodes[i].clone();
        let pid = self.spawn(
            &n.namespace,
            Some((n.mount_namespace.clone(), n.uts_namespace.clone())),
            &launch,
            &n.log,
        )?;
        self.state.nodes[i].pid = pid;
        // `lab status` and `lab down` see the new daemon.
        super::super::save_state(&self.state)
    }

    /// Does `fault` and undoes it after its hold. `Ok(Some(reason))` when it could not
    /// apply to this lab (no userspace WireGuard process with the kernel backend).
    pub fn inject(&mut self, fault: &Fault) -> anyhow::Result<Option<String>> {
        let i = fault.node;
        let node = self.state.nodes[i].clone();
        match fault.kind {
            FaultKind::KillDaemon | FaultKind::RemoveNode => {
                let (sig, how) = if fault.kind == FaultKind::KillDaemon {
                    (Signal::SIGKILL, "killed")
                } else {
                    (Signal::SIGTERM, "stopped")
                };
                let stopped = signal(node.pid, sig).and_then(|()| {
                    self.wait_dead(node.pid, &format!("the daemon of {}", node.name))
                });
                let mut problems = Vec::new();
                if fault.kind == FaultKind::RemoveNode && stopped.is_ok() {
                    // A stopped daemon takes its mesh down with it.
                    problems = self.mesh_left_behind(&node);
                }
                std::thread::sleep(fault.hold);
                // Started again whatever happened, unless it still runs.
                if !host::alive(i32::try_from(node.pid).unwrap_or(0)) {
                    self.restart_node(i)?;
                }
                stopped.with_context(|| format!("{} {how}", node.name))?;
                anyhow::ensure!(problems.is_empty(), "{}", problems.join("; "));
            }
            FaultKind::KillWireguard => {
                let wg: Vec<i32> = host::netns_pids(&node.namespace)
                    .into_iter()
                    .filter(|p| is_userspace_wireguard(*p))
                    .collect();
                let Some(&pid) = wg.first() else {
                    return Ok(Some(format!(
                        "no userspace WireGuard process in {} (kernel WireGuard)",
                        node.name
                    )));
                };
                let pid = u32::try_from(pid).context("pid out of range")?;
                signal(pid, Signal::SIGKILL)?;
                self.wait_dead(pid, &format!("the WireGuard process of {}", node.name))?;
            }
            FaultKind::RestartDiscovery => {
                let d = self.state.discovery.clone();
                signal(d.pid, Signal::SIGKILL)?;
                self.wait_dead(d.pid, "the discovery server")?;
                std::thread::sleep(fault.hold);
                let launch = self.discovery.clone();
                self.state.discovery.pid = self.spawn(&d.namespace, None, &launch, &d.log)?;
                super::super::save_state(&self.state)?;
            }
            FaultKind::LinkFlap => {
                let u = &self.state.underlay_namespace;
                host::ip_in(u, &["link", "set", &node.name, "down"])?;
                std::thread::sleep(fault.hold);
                host::ip_in(u, &["link", "set", &node.name, "up"])?;
            }
            FaultKind::Blackhole => self.blackhole(&node, fault.hold)?,
            FaultKind::ApplyConfig => self.apply_mtu_change(&node)?,
        }
        Ok(None)
    }

    /// What a stopped daemon left of its mesh in its namespace (it must remove its
    /// device, routing rules and marking table when it stops).
    fn mesh_left_behind(&self, node: &crate::cmd::lab::plan::NodeState) -> Vec<String> {
        let mut v = Vec::new();
        let link = &self.kubespan.link_name;
        if host::ip_in(&node.namespace, &["link", "show", link]).is_ok() {
            v.push(format!("{} stopped but its link {link} is left", node.name));
        }
        let prio = self.kubespan.rule_priority;
        for family in ["-4", "-6"] {
            let rules = nsenter_node(node, &["ip", "-j", family, "rule"])
                .ok()
                .and_then(|t| json_of(&t).ok())
                .map(|j| invariants::parse_ip_rules(&j))
                .unwrap_or_default();
            if rules.contains(&u64::from(prio)) {
                v.push(format!(
                    "{} stopped but its {family} rule {prio} is left",
                    node.name
                ));
            }
        }
        if self.nftables()
            && nsenter_node(node, &["nft", "list", "table", "inet", "wirespan"]).is_ok()
        {
            v.push(format!("{} stopped but its nft table is left", node.name));
        }
        v
    }

    fn blackhole(
        &self,
        node: &crate::cmd::lab::plan::NodeState,
        hold: Duration,
    ) -> anyhow::Result<()> {
        let port = self.kubespan.listen_port;
        let (v4, v6): (Vec<IpAddr>, Vec<IpAddr>) = node.underlay.iter().partition(|a| a.is_ipv4());
        let list = |a: &[IpAddr]| {
            a.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut rules = String::new();
        if !v4.is_empty() {
            rules.push_str(&format!(
                "    ip daddr {{ {} }} udp dport {port} drop\n",
                list(&v4)
            ));
        }
        if !v6.is_empty() {
            rules.push_str(&format!(
                "    ip6 daddr {{ {} }} udp dport {port} drop\n",
                list(&v6)
            ));
        }
        // A bridge table: the underlay is a bridge, its forward hook sees node to node.
        let ruleset = format!(
            "table bridge {BLACKHOLE_TABLE} {{\n  chain forward {{\n    \
             type filter hook forward priority 0; policy accept;\n{rules}  }}\n}}\n"
        );
        let file = self.state.dir.join("chaos-blackhole.nft");
        std::fs::write(&file, ruleset).with_context(|| format!("writing {}", file.display()))?;
        let net = format!("--net=/run/netns/{}", self.state.underlay_namespace);
        let f = file.to_str().context("non-UTF-8 lab dir")?;
        host::run("nsenter", &[&net, "--", "nft", "-f", f])?;
        std::thread::sleep(hold);
        host::run(
            "nsenter",
            &[
                &net,
                "--",
                "nft",
                "delete",
                "table",
                "bridge",
                BLACKHOLE_TABLE,
            ],
        )?;
        let _ = std::fs::remove_file(&file);
        Ok(())
    }

    /// The MTU of the IPv4 default route in the mesh table of `node`.
    fn route_mtu(&self, node: &crate::cmd::lab::plan::NodeState) -> Option<u64> {
        let table = self.kubespan.routing_table.to_string();
        let out = nsenter_node(
            node,
            &["ip", "-j", "-4", "-d", "route", "show", "table", &table],
        )
        .ok()?;
        let v = json_of(&out).ok()?;
        v.as_array()?.iter().find_map(|r| {
            r["metrics"]
                .as_array()?
                .iter()
                .find_map(|m| m["mtu"].as_u64())
        })
    }

    /// `wirespan apply` of the node's config with another MTU, waits until the mesh
    /// route carries it, then the same back.
    fn apply_mtu_change(&self, node: &crate::cmd::lab::plan::NodeState) -> anyhow::Result<()> {
        let original = std::fs::read_to_string(&node.config)
            .with_context(|| format!("reading {}", node.config.display()))?;
        let mtu: u64 = yaml_scalar(&original, "mtu")
            .and_then(|m| m.parse().ok())
            .with_context(|| format!("no mtu in {}", node.config.display()))?;
        // Down by 20, staying above IPv6's minimum of 1280.
        let changed_mtu = if mtu >= 1300 { mtu - 20 } else { mtu + 20 };
        let changed = original.replacen(&format!("mtu: {mtu}"), &format!("mtu: {changed_mtu}"), 1);
        // The file holds the cluster secret: 0600 (write_atomic), removed after.
        let file = node.config.with_file_name("chaos-apply.yaml");
        for (text, want) in [(&changed, changed_mtu), (&original, mtu)] {
            write_atomic(&file, text.as_bytes())
                .with_context(|| format!("writing {}", file.display()))?;
            let out = Command::new(&self.exe)
                .arg("--socket")
                .arg(&node.socket)
                .arg("apply")
                .arg(&file)
                .stdin(Stdio::null())
                .output()
                .context("running wirespan apply")?;
            anyhow::ensure!(
                out.status.success(),
                "wirespan apply on {}: {}: {}",
                node.name,
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
            let deadline = Instant::now() + SETTLE;
            while self.route_mtu(node) != Some(want) {
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "{}: the mesh route's MTU is {:?} {}s after applying MTU {want}",
                    node.name,
                    self.route_mtu(node),
                    SETTLE.as_secs()
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        let _ = std::fs::remove_file(&file);
        Ok(())
    }

    fn kernel(&self, node: &crate::cmd::lab::plan::NodeState) -> anyhow::Result<Kernel> {
        let run = |args: &[&str]| nsenter_node(node, args);
        let table = self.kubespan.routing_table.to_string();
        let mut k = Kernel {
            wg_peers: invariants::parse_wg_dump(&run(&[
                "wg",
                "show",
                &self.kubespan.link_name,
                "dump",
            ])?),
            ..Kernel::default()
        };
        if self.nftables() {
            k.inet_tables =
                invariants::parse_nft_tables(&json_of(&run(&["nft", "-j", "list", "tables"])?)?);
            if k.inet_tables.iter().any(|t| t == "wirespan") {
                (k.sets, k.rules) = invariants::parse_nft_table(&json_of(&run(&[
                    "nft", "-j", "list", "table", "inet", "wirespan",
                ])?)?);
            }
        }
        for (i, family) in ["-4", "-6"].into_iter().enumerate() {
            k.ip_rules[i] =
                invariants::parse_ip_rules(&json_of(&run(&["ip", "-j", family, "rule"])?)?);
            k.routes[i] = invariants::parse_routes(&json_of(&run(&[
                "ip", "-j", family, "route", "show", "table", &table,
            ])?)?);
        }
        Ok(k)
    }

    fn nftables(&self) -> bool {
        self.state.fast_path == "nftables"
    }

    /// What must hold once the lab has recovered, one line per problem: every daemon
    /// runs with its identity, every peer is up, the discovery server answers, the
    /// kernel objects are exactly as expected, every node pings every other. Cheap
    /// checks first; the first failing group ends the round.
    pub fn transient_problems(&mut self) -> Vec<String> {
        self.reap();
        let mut v = Vec::new();
        for n in &self.state.nodes {
            if !host::alive(i32::try_from(n.pid).unwrap_or(0)) {
                v.push(format!("the daemon of {} does not run", n.name));
            }
        }
        if !host::alive(i32::try_from(self.state.discovery.pid).unwrap_or(0)) {
            v.push("the discovery server does not run".into());
        }
        if !v.is_empty() {
            return v;
        }
        let views = super::super::block_on(status::observe_all(&self.state));
        for ((n, view), base) in self.state.nodes.iter().zip(&views).zip(&self.baseline) {
            if view.api && view.public_key != base.public_key {
                v.push(format!("{} has a new public key", n.name));
            }
            if view.api && view.kubespan_address != base.kubespan {
                v.push(format!("{} has a new KubeSpan address", n.name));
            }
        }
        for (node, pending) in status::pending(&self.state, &views) {
            v.extend(pending.into_iter().map(|p| format!("{node}: peer {p}")));
        }
        if !self.discovery_answers() {
            v.push(format!(
                "the discovery server does not answer on {}",
                self.state.discovery.address
            ));
        }
        if !v.is_empty() {
            return v;
        }
        for (i, n) in self.state.nodes.iter().enumerate() {
            let exp = self.expected(i);
            match self.kernel(n) {
                Ok(k) => v.extend(invariants::check_kernel(&exp, &k)),
                Err(e) => v.push(format!("{}: reading the kernel: {e:#}", n.name)),
            }
        }
        if !v.is_empty() {
            return v;
        }
        invariants::ping_failures(&self.ping_matrix(&views))
    }

    fn expected(&self, i: usize) -> Expected {
        let others = || {
            self.state
                .nodes
                .iter()
                .zip(&self.baseline)
                .enumerate()
                .filter(move |(j, _)| *j != i)
                .map(|(_, x)| x)
        };
        Expected {
            node: self.state.nodes[i].name.clone(),
            peers: others().map(|(_, b)| b.public_key.clone()).collect(),
            hosts: others().flat_map(|(n, _)| n.underlay.clone()).collect(),
            rule_priority: u64::from(self.kubespan.rule_priority),
            nftables: self.nftables(),
        }
    }

    fn discovery_answers(&self) -> bool {
        let addr = self.state.discovery.address;
        let Some(from) = self.state.nodes.first() else {
            return false;
        };
        Netns::named(&from.namespace)
            .block_on(move || async move {
                tokio::time::timeout(
                    Duration::from_millis(500),
                    tokio::net::TcpStream::connect(addr),
                )
                .await
                .is_ok_and(|r| r.is_ok())
            })
            .unwrap_or(false)
    }

    /// Every ordered pair of nodes, to the first underlay address (routed through the
    /// mesh: it is in the marking sets) and to the KubeSpan address.
    fn ping_matrix(&self, views: &[observe::NodeView]) -> Vec<Probe> {
        let mut meta = Vec::new();
        let mut probes = Vec::new();
        for (i, from) in self.state.nodes.iter().enumerate() {
            for (j, to) in self.state.nodes.iter().enumerate() {
                if i == j {
                    continue;
                }
                let addrs = to
                    .underlay
                    .first()
                    .copied()
                    .into_iter()
                    .chain(views.get(j).and_then(|v| v.kubespan_address));
                for a in addrs {
                    probes.push((from.namespace.clone(), a));
                    meta.push((from.name.clone(), to.name.clone(), a));
                }
            }
        }
        let results = ping::ping_all(&probes);
        meta.into_iter()
            .zip(results)
            .map(|((from, to, address), r)| Probe {
                from,
                to,
                address,
                ok: r.is_some(),
            })
            .collect()
    }

    /// What may never happen, even for a moment: a secret in a log, a daemon over the
    /// memory limit. Also returns each daemon's resident memory.
    pub fn lasting_problems(&self, rss_limit: u64) -> (Vec<String>, Vec<(String, u64)>) {
        let mut v = Vec::new();
        let mut logs: Vec<(String, &Path)> = self
            .state
            .nodes
            .iter()
            .map(|n| (format!("{}'s log", n.name), n.log.as_path()))
            .collect();
        logs.push((
            "the discovery server's log".into(),
            self.state.discovery.log.as_path(),
        ));
        for (what, path) in logs {
            let bytes = std::fs::read(path).unwrap_or_default();
            let text = String::from_utf8_lossy(&bytes);
            for label in invariants::secrets_in(&text, &self.secrets) {
                v.push(format!("{label} appears in {what} ({})", path.display()));
            }
        }
        let mut rss = Vec::new();
        let procs = self
            .state
            .nodes
            .iter()
            .map(|n| (n.name.clone(), n.pid))
            .chain([("discovery".to_owned(), self.state.discovery.pid)]);
        for (name, pid) in procs {
            let Some(bytes) = std::fs::read_to_string(format!("/proc/{pid}/status"))
                .ok()
                .and_then(|s| invariants::parse_rss(&s))
            else {
                continue;
            };
            if bytes > rss_limit {
                v.push(format!(
                    "{name}'s daemon uses {} MiB, over the limit of {} MiB",
                    bytes >> 20,
                    rss_limit >> 20
                ));
            }
            rss.push((name, bytes));
        }
        (v, rss)
    }
}

impl Drop for ChaosLab {
    fn drop(&mut self) {
        // The daemons this run started keep running (as `lab up`'s do); only the
        // blackhole must not outlive an aborted run.
        let net = format!("--net=/run/netns/{}", self.state.underlay_namespace);
        let _ = Command::new("nsenter")
            .args([
                &net,
                "--",
                "nft",
                "delete",
                "table",
                "bridge",
                BLACKHOLE_TABLE,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Whether process `pid` is a userspace WireGuard device: `wireguard-go`, or
/// `wirespan wireguard` (any executable whose first argument is `wireguard`).
fn is_userspace_wireguard(pid: i32) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let mut args = cmdline.split(|b| *b == 0);
    let program = args.next().unwrap_or_default();
    let base = program.rsplit(|b| *b == b'/').next().unwrap_or_default();
    base == b"wireguard-go" || args.next() == Some(b"wireguard".as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_scalars_are_read_unquoted() {
        let text = "kind: ClusterConfig\nid: 'abc'\nsecret: 'x/y+z='\n---\nmtu: 1420\n";
        assert_eq!(yaml_scalar(text, "secret").as_deref(), Some("x/y+z="));
        assert_eq!(yaml_scalar(text, "mtu").as_deref(), Some("1420"));
        assert_eq!(yaml_scalar(text, "listenPort"), None);
    }
}
