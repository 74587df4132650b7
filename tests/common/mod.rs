//! Helpers of the CLI tests: a resource API served in-process on a temp socket, and
//! child processes of the real binary that are always killed.

#![allow(dead_code)]

pub mod discovery;
pub mod lab;
#[path = "../../dataplane/tests/support/ran.rs"]
pub mod ran;
pub mod talos;
pub mod upstream;

use std::{
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use tokio_util::sync::CancellationToken;
use wirespan_control::{
    api::server::{bind, serve, ResourceApi},
    runtime::Store,
};

pub const BIN: &str = env!("CARGO_BIN_EXE_wirespan");

/// The binary run inside the throwaway namespace `ns` (`ip netns exec` execs it, so
/// the child is the binary itself). A node daemon programs the network it runs in:
/// tests never run one in the host's.
pub fn bin_in(ns: &wirespan_dataplane::netns::NetnsGuard) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns.name(), BIN]);
    c
}

/// The API served from this process over `store`; stopped and the socket removed on drop.
pub struct Server {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    cancel: CancellationToken,
    rt: Option<tokio::runtime::Runtime>,
}

impl Server {
    pub fn start(store: Store) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("node.sock");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let cancel = CancellationToken::new();
        let listener = {
            let _g = rt.enter();
            bind(&socket).unwrap()
        };
        let (c, s) = (cancel.clone(), socket.clone());
        rt.spawn(async move { serve(listener, &s, ResourceApi::new(store, None), c).await });
        Self {
            dir,
            socket,
            cancel,
            rt: Some(rt),
        }
    }

    pub fn cli(&self, args: &[&str]) -> Output {
        cli(&self.socket, args)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.cancel.cancel();
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

pub fn cli(socket: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("--socket")
        .arg(socket)
        .args(args)
        .env_remove("WIRESPAN_SOCKET")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap()
}

pub fn stdout(o: &Output) -> String {
    assert!(
        o.status.success(),
        "failed: {}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

/// A child process killed (and reaped) on drop, even when the test panics.
pub struct ChildGuard(pub Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Spawns the binary with stdout piped line by line into a channel.
pub fn spawn_lines(socket: &Path, args: &[&str]) -> (ChildGuard, mpsc::Receiver<String>) {
    let mut child = Command::new(BIN)
        .arg("--socket")
        .arg(socket)
        .args(args)
        .env_remove("WIRESPAN_SOCKET")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    (ChildGuard(child), rx)
}

/// Next line matching `pred` within 10 s; lines before it are skipped.
pub fn expect_line(rx: &mpsc::Receiver<String>, what: &str, pred: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) if pred(&l) => return l,
            Ok(l) => seen.push(l),
            Err(_) => panic!("no line {what} within 10 s; saw {seen:#?}"),
        }
    }
}

/// Waits until `path` exists.
pub fn wait_for_path(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} did not appear",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One peer of a WireGuard device as `wg show … dump` lists it; the preshared key is
/// left out (it is the cluster secret), so this is safe to print.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WgPeer {
    pub public_key: String,
    /// `ip:port`, or `(none)`.
    pub endpoint: String,
    /// Sorted.
    pub allowed_ips: Vec<String>,
    /// Unix seconds of the latest handshake, 0 for none.
    pub latest_handshake: u64,
    pub rx: u64,
    pub tx: u64,
}

impl WgPeer {
    /// Seconds since the latest handshake; `None` when there was none.
    pub fn handshake_age(&self) -> Option<u64> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        (self.latest_handshake > 0).then(|| now.saturating_sub(self.latest_handshake))
    }
}

/// The peers in the output of `wg show DEVICE dump` (its first line is the device's).
pub fn wg_dump(dump: &str) -> Vec<WgPeer> {
    dump.lines()
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            let mut allowed_ips: Vec<String> = f[3]
                .split(',')
                .filter(|a| !a.is_empty() && *a != "(none)")
                .map(str::to_owned)
                .collect();
            allowed_ips.sort();
            WgPeer {
                public_key: f[0].to_owned(),
                endpoint: f[2].to_owned(),
                allowed_ips,
                latest_handshake: f[4].parse().unwrap(),
                rx: f[5].parse().unwrap(),
                tx: f[6].parse().unwrap(),
            }
        })
        .collect()
}
