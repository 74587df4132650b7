//! The server under test as a child process, and client connections to it.

use std::{
    net::SocketAddr,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _};
use tonic::transport::Channel;
use wirespan_discovery::proto::server::cluster_client::ClusterClient;

use crate::bar;

/// The server as a child process, killed on drop.
pub(super) struct ServerProcess {
    child: Child,
    pub(super) addr: SocketAddr,
}

impl ServerProcess {
    pub(super) fn start(exe: &std::path::Path) -> anyhow::Result<Self> {
        Self::start_with(exe, &[])
    }

    /// A server with the per-address limits off (the capacity sections' load stands for
    /// many hosts but comes from one address) and `extra` flags.
    pub(super) fn start_with(exe: &std::path::Path, extra: &[String]) -> anyhow::Result<Self> {
        let mut args: Vec<String> = ["--no-rate-limit", "--max-connections-per-ip", "1000000"]
            .map(String::from)
            .to_vec();
        args.extend_from_slice(extra);
        Self::start_public(exe, &args)
    }

    /// A server with its default limits and `extra` flags.
    pub(super) fn start_public(exe: &std::path::Path, extra: &[String]) -> anyhow::Result<Self> {
        let addr = free_loopback_port()?;
        let child = Command::new(exe)
            .args(["--log", "warn", "discovery", "--listen"])
            .arg(addr.to_string())
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", exe.display()))?;
        let mut server = Self { child, addr };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(addr).is_err() {
            if let Some(status) = server.child.try_wait()? {
                bail!("server exited at start: {status}");
            }
            if Instant::now() > deadline {
                bail!("server did not listen on {addr} within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(server)
    }

    /// Whether the child has exited (it is reaped then).
    pub(super) fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// CPU time the server has used so far.
    pub(super) fn cpu_time(&self) -> anyhow::Result<Duration> {
        cpu_time(&format!("/proc/{}/stat", self.child.id()))
    }

    pub(super) fn rss_bytes(&self) -> anyhow::Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))?;
        let line = status
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .context("no VmRSS in /proc/PID/status")?;
        let kib: u64 = line
            .split_whitespace()
            .nth(1)
            .context("malformed VmRSS")?
            .parse()?;
        Ok(kib * 1024)
    }
}

/// A free port on 127.0.0.1; the short window until the child binds it is acceptable
/// on a benchmark machine.
pub(super) fn free_loopback_port() -> anyhow::Result<SocketAddr> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    Ok(([127, 0, 0, 1], port).into())
}

/// CPU time (user + system) of the process whose `stat` file is `path`
/// (`/proc/self/stat`: this one).
#[allow(unsafe_code)]
pub(super) fn cpu_time(path: &str) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(path)?;
    // Fields after the command name (which may hold spaces) start at state, field 3;
    // utime and stime are fields 14 and 15, in clock ticks.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("malformed /proc/PID/stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields
        .get(11..13)
        .context("short /proc/PID/stat")?
        .iter()
        .map(|f| f.parse::<u64>())
        .sum::<Result<u64, _>>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) })
        .ok()
        .filter(|&h| h > 0)
        .unwrap_or(100);
    Ok(Duration::from_nanos(ticks * 1_000_000_000 / hz))
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(super) async fn connect_channel(addr: SocketAddr) -> anyhow::Result<Channel> {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .tcp_nodelay(true)
        .connect()
        .await
        .with_context(|| format!("connecting to {addr}"))
}

/// `n` connections (one HTTP/2 connection each).
pub(super) async fn connect_channels(
    addr: SocketAddr,
    n: usize,
    what: &str,
) -> anyhow::Result<Vec<Channel>> {
    let pb = bar(n, what);
    let mut out = Vec::with_capacity(n);
    // Chunks keep the accept backlog small.
    for chunk in (0..n).collect::<Vec<_>>().chunks(64) {
        let conns = futures::future::join_all(chunk.iter().map(|_| connect_channel(addr))).await;
        for c in conns {
            out.push(c?);
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    Ok(out)
}

pub(super) async fn connect_many(
    addr: SocketAddr,
    n: usize,
    what: &str,
) -> anyhow::Result<Vec<ClusterClient<Channel>>> {
    Ok(connect_channels(addr, n, what)
        .await?
        .into_iter()
        .map(ClusterClient::new)
        .collect())
}
