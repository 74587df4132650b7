//! Userspace WireGuard: a supervised userspace device process running inside the
//! target namespace, configured over its UAPI socket `SOCKET_DIR/IFNAME.sock`. Two
//! implementations speak that contract ([`UserspaceImpl`]): `wirespan wireguard
//! --foreground IFNAME` (our own device) and `wireguard-go -f IFNAME`.
//!
//! The supervisor thread polls the child; if it dies unexpectedly it is restarted
//! (with a short backoff) and the next apply re-reads the now empty device and writes
//! everything again. Teardown and drop stop the supervisor and kill the child by pid
//! (through its `Child`, before it is reaped, so the pid cannot have been reused).
//!
//! A daemon that stops with its kernel state kept leaves its device process running
//! (the backend is forgotten, not dropped). The next start finds the live socket and
//! adopts that process instead of starting a second one (which could not open the
//! existing TUN device anyway): same device, same sessions, no handshake lost. The
//! adopted process is checked to be in the target network namespace, watched by pid,
//! replaced by a child of ours if it dies, and on teardown stopped by the pid its
//! socket reports (`SO_PEERCRED`, read on a live connection).
//!
//! `wirespan wireguard`'s stderr (errors only: the child runs with `WIRESPAN_LOG=error`)
//! is forwarded into the node's log, and its last line is kept with the exit status
//! ([`UserspaceBackend::last_exit`]): a device that ended itself (a panicking or
//! stalled thread, `docs/userspace-wireguard.md`) says why in the node's log rather
//! than into /dev/null. wireguard-go's output stays discarded: a Go program whose
//! stderr pipe lost its reader (a device kept running by a node that then exited)
//! dies of SIGPIPE on its next line.
//!
//! The socket directory is shared by every namespace of a mount namespace: interface
//! names must be unique per host unless each daemon has its own mount namespace.

use std::{
    io::{BufRead as _, BufReader, Write},
    os::unix::net::UnixStream,
    path::PathBuf,
    process::{Child, ChildStderr, Stdio},
    sync::{Arc, Condvar, Mutex, PoisonError},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use super::{
    align_order, apply_peer_updates, apply_update, diff, diff_peers,
    uapi::{self, GetError},
    validate_changes, DeviceState, Indexed, KnownState, PeerChange, WgDevice, WgError, WgPeer,
    WgStatus, WgUpdate, WireGuard,
};
use crate::netns::Netns;

/// Where wireguard-go (and `wirespan wireguard` by default) puts its sockets.
pub const DEFAULT_SOCKET_DIR: &str = "/var/run/wireguard";
/// How long to wait for a fresh device process to open its socket. Generous: one that
/// exits is reported at once, and in an emulated VM on a busy machine (the suite's VM
/// tier, QEMU without KVM) a start took longer than 5 s.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long an adopted device process gets to exit on SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// How often the supervisor checks the child.
const POLL: Duration = Duration::from_millis(100);
/// UAPI read/write timeout.
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the supervisor waits, after the device process exited, for the rest of its
/// stderr (the pipe ends at once unless something else holds its write end).
const STDERR_DRAIN: Duration = Duration::from_secs(1);

/// How the device process last ended, as the supervisor saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceExit {
    /// The status as the OS reports it (`exit status: 70`, `signal: 9 (SIGKILL)`).
    pub status: String,
    /// The exit code; `None` when a signal ended it.
    pub code: Option<i32>,
    /// The last line it wrote to stderr (colours removed), if any.
    pub last_line: Option<String>,
}

/// The thread forwarding a child's stderr into the node's log, and its last line.
#[derive(Debug)]
struct StderrTail {
    last: Arc<Mutex<Option<String>>>,
    thread: JoinHandle<()>,
}

impl StderrTail {
    /// Forwards `stderr` line by line (each a `warn`: the child only writes errors).
    fn start(stderr: ChildStderr, link: &str, program: &'static str) -> Option<Self> {
        let last = Arc::new(Mutex::new(None));
        let (keep, link) = (last.clone(), link.to_owned());
        let thread = std::thread::Builder::new()
            .name(format!("wg-{link}-log"))
            .spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    let line = strip_ansi(&line);
                    if line.trim().is_empty() {
                        continue;
                    }
                    tracing::warn!(link = %link, program, output = %line, "userspace WireGuard process");
                    *keep.lock().unwrap_or_else(PoisonError::into_inner) = Some(line);
                }
            })
            .inspect_err(|e| tracing::warn!(error = %e, "cannot forward the device's stderr"))
            .ok()?;
        Some(Self { last, thread })
    }

    /// The last line, once the pipe ended or [`STDERR_DRAIN`] passed.
    fn finish(self) -> Option<String> {
        let deadline = Instant::now() + STDERR_DRAIN;
        while !self.thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.last
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

/// `line` without terminal escape sequences (`ESC [ … letter`): the device's log
/// formatter colours its output even into a pipe.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c != '\u{1b}' {
            out.push(c);
            continue;
        }
        if chars.next() == Some('[') {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        }
    }
    out
}

#[derive(Debug)]
struct SupState {
    child: Option<Child>,
    /// A device process found running at start (not our child).
    adopted: Option<u32>,
    /// What runs the device now: an adopted process is whatever it is, a child of
    /// ours what the options say.
    running: UserspaceImpl,
    stop: bool,
    restarts: u64,
    /// The forwarder of our child's stderr.
    stderr: Option<StderrTail>,
    /// How the last device process ended.
    last_exit: Option<DeviceExit>,
}

#[derive(Debug)]
struct Supervisor {
    shared: Arc<(Mutex<SupState>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

/// Which userspace WireGuard program runs the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UserspaceImpl {
    /// `wirespan wireguard`: wirespan's own device (`BINARY wireguard --foreground
    /// --socket-dir DIR IFNAME`).
    Wirespan,
    /// `wireguard-go -f IFNAME` (its socket directory is compiled in).
    WireguardGo,
}

impl UserspaceImpl {
    /// The name the node reports and `--wireguard` takes: `userspace` or `userspace-go`.
    #[must_use]
    pub fn backend_name(self) -> &'static str {
        match self {
            Self::Wirespan => "userspace",
            Self::WireguardGo => "userspace-go",
        }
    }

    /// The program, as logs and errors name it.
    #[must_use]
    pub fn program(self) -> &'static str {
        match self {
            Self::Wirespan => "wirespan wireguard",
            Self::WireguardGo => "wireguard-go",
        }
    }
}

/// Options of the userspace backend.
#[derive(Debug, Clone)]
pub struct UserspaceOptions {
    /// Which program `binary` is (it decides the command line).
    pub implementation: UserspaceImpl,
    /// The binary: `wireguard-go`, or the `wirespan` executable.
    pub binary: PathBuf,
    /// UAPI socket directory (wireguard-go's compiled-in default).
    pub socket_dir: PathBuf,
}

impl Default for UserspaceOptions {
    /// `wireguard-go` from `PATH`.
    fn default() -> Self {
        Self {
            implementation: UserspaceImpl::WireguardGo,
            binary: PathBuf::from("wireguard-go"),
            socket_dir: PathBuf::from(DEFAULT_SOCKET_DIR),
        }
    }
}

impl UserspaceOptions {
    /// `wirespan wireguard`, run from the `wirespan` executable at `binary`.
    #[must_use]
    pub fn wirespan(binary: PathBuf) -> Self {
        Self {
            implementation: UserspaceImpl::Wirespan,
            binary,
            socket_dir: PathBuf::from(DEFAULT_SOCKET_DIR),
        }
    }
}

/// The userspace backend for one interface.
#[derive(Debug)]
pub struct UserspaceBackend {
    name: String,
    netns: Netns,
    opts: UserspaceOptions,
    sup: Option<Supervisor>,
    writes: u64,
    reads: std::sync::atomic::AtomicU64,
    known: KnownState,
    /// Let go of with [`WireGuard::keep`]: dropping leaves the device process running.
    kept: bool,
    /// Notified by the supervisor after it restarted the device process (an empty device).
    recreated: Arc<tokio::sync::Notify>,
}

impl UserspaceBackend {
    /// A backend for interface `name` in `netns`; nothing starts until [`WireGuard::ensure`]
    /// or [`WireGuard::apply`].
    #[must_use]
    pub fn new(name: &str, netns: Netns) -> Self {
        Self::with_options(name, netns, UserspaceOptions::default())
    }

    /// As [`UserspaceBackend::new`] with explicit options.
    #[must_use]
    pub fn with_options(name: &str, netns: Netns, opts: UserspaceOptions) -> Self {
        Self {
            name: name.to_owned(),
            netns,
            opts,
            sup: None,
            writes: 0,
            reads: std::sync::atomic::AtomicU64::new(0),
            known: KnownState::default(),
            kept: false,
            recreated: Arc::new(tokio::sync::Notify::new()),
        }
    }

    /// pid of the running device process, if any.
    #[must_use]
    pub fn pid(&self) -> Option<u32> {
        let sup = self.sup.as_ref()?;
        let st = sup.shared.0.lock().unwrap_or_else(PoisonError::into_inner);
        st.child.as_ref().map(Child::id).or(st.adopted)
    }

    /// Number of full device reads (`get=1`) so far: a steady-state apply within
    /// [`super::RESYNC_INTERVAL`] of the last read needs none.
    #[must_use]
    pub fn reads(&self) -> u64 {
        self.reads.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How the device process last ended (seen by the supervisor), if it ever did.
    #[must_use]
    pub fn last_exit(&self) -> Option<DeviceExit> {
        let sup = self.sup.as_ref()?;
        let st = sup.shared.0.lock().unwrap_or_else(PoisonError::into_inner);
        st.last_exit.clone()
    }

    /// How many times the supervisor restarted the device process.
    #[must_use]
    pub fn restarts(&self) -> u64 {
        self.sup.as_ref().map_or(0, |s| {
            s.shared
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .restarts
        })
    }

    fn socket_path(&self) -> PathBuf {
        self.opts.socket_dir.join(format!("{}.sock", self.name))
    }

    /// Starts the device process, and the forwarder of its stderr (ours only).
    fn spawn_child(
        netns: &Netns,
        opts: &UserspaceOptions,
        name: &str,
    ) -> std::io::Result<(Child, Option<StderrTail>)> {
        let bin = opts.binary.to_string_lossy().into_owned();
        let mut cmd = netns.command(&bin);
        match opts.implementation {
            UserspaceImpl::Wirespan => cmd
                .arg("wireguard")
                .arg("--foreground")
                .arg("--socket-dir")
                .arg(&opts.socket_dir)
                .arg(name)
                .env("WIRESPAN_LOG", "error")
                .stderr(Stdio::piped()),
            UserspaceImpl::WireguardGo => cmd
                .arg("-f")
                .arg(name)
                .env("LOG_LEVEL", "error")
                .stderr(Stdio::null()),
        };
        let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).spawn()?;
        let tail = child
            .stderr
            .take()
            .and_then(|e| StderrTail::start(e, name, opts.implementation.program()));
        Ok((child, tail))
    }

    fn wait_socket(&self) -> Result<(), WgError> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if UnixStream::connect(self.socket_path()).is_ok() {
                return Ok(());
            }
            if let Some(sup) = &self.sup {
                let mut st = sup.shared.0.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(Ok(Some(status))) = st.child.as_mut().map(Child::try_wait) {
                    return Err(WgError::Daemon {
                        name: self.name.clone(),
                        message: format!(
                            "{} exited at start: {status}",
                            self.opts.implementation.program()
                        ),
                    });
                }
            }
            if Instant::now() > deadline {
                return Err(WgError::Daemon {
                    name: self.name.clone(),
                    message: format!(
                        "no UAPI socket at {} after {START_TIMEOUT:?}",
                        self.socket_path().display()
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn start(&mut self) -> Result<(), WgError> {
        std::fs::create_dir_all(&self.opts.socket_dir).map_err(|source| WgError::Io {
            op: "create socket directory",
            name: self.name.clone(),
            source,
        })?;
        let (child, adopted, running, stderr) = match self.running_elsewhere()? {
            Some(pid) => {
                let found = implementation_of(pid);
                tracing::info!(link = %self.name, pid, netns = ?self.netns.name(), program = found.program(), "adopted the running userspace WireGuard process");
                (None, Some(pid), found, None)
            }
            None => {
                let (child, stderr) = Self::spawn_child(&self.netns, &self.opts, &self.name)
                    .map_err(|e| WgError::Daemon {
                        name: self.name.clone(),
                        message: format!("cannot start {}: {e}", self.opts.binary.display()),
                    })?;
                tracing::info!(link = %self.name, pid = child.id(), netns = ?self.netns.name(), program = self.opts.implementation.program(), "started the userspace WireGuard process");
                (Some(child), None, self.opts.implementation, stderr)
            }
        };
        let shared = Arc::new((
            Mutex::new(SupState {
                child,
                adopted,
                running,
                stop: false,
                restarts: 0,
                stderr,
                last_exit: None,
            }),
            Condvar::new(),
        ));
        let (netns, opts, name, sh, recreated) = (
            self.netns.clone(),
            self.opts.clone(),
            self.name.clone(),
            shared.clone(),
            self.recreated.clone(),
        );
        let thread = std::thread::Builder::new()
            .name(format!("wg-{}", self.name))
            .spawn(move || supervise(&sh, &netns, &opts, &name, &recreated))
            .map_err(|e| WgError::Daemon {
                name: self.name.clone(),
                message: format!("cannot start supervisor: {e}"),
            })?;
        self.sup = Some(Supervisor {
            shared,
            thread: Some(thread),
        });
        self.wait_socket()
    }

    fn stop(&mut self) {
        self.known.forget();
        if let Some(mut sup) = self.sup.take() {
            {
                let (lock, cv) = &*sup.shared;
                let mut st = lock.lock().unwrap_or_else(PoisonError::into_inner);
                st.stop = true;
                if let Some(mut child) = st.child.take() {
                    let pid = child.id();
                    let _ = child.kill();
                    let _ = child.wait();
                    tracing::info!(link = %self.name, pid, "stopped the userspace WireGuard process");
                }
                if st.adopted.take().is_some() {
                    self.stop_adopted();
                }
                cv.notify_all();
            }
            if let Some(t) = sup.thread.take() {
                let _ = t.join();
            }
        }
        // The device process removes its socket on a clean exit only.
        let _ = std::fs::remove_file(self.socket_path());
    }

    /// The pid of a device process already serving this interface's socket, if one
    /// answers; an error if it runs in another network namespace (a socket directory
    /// shared across namespaces: the interface name is taken).
    fn running_elsewhere(&self) -> Result<Option<u32>, WgError> {
        let Some(pid) = socket_owner(&self.socket_path()) else {
            return Ok(None);
        };
        match same_netns(pid, &self.netns) {
            Ok(true) => Ok(Some(pid)),
            Ok(false) => Err(WgError::Daemon {
                name: self.name.clone(),
                message: format!(
                    "{} belongs to pid {pid} in another network namespace",
                    self.socket_path().display()
                ),
            }),
            Err(e) => Err(WgError::Daemon {
                name: self.name.clone(),
                message: format!("cannot tell the network namespace of pid {pid}: {e}"),
            }),
        }
    }

    /// Stops an adopted device process: SIGTERM to the pid its socket reports now (a
    /// clean exit removes the device and the socket), SIGKILL after [`STOP_GRACE`].
    fn stop_adopted(&self) {
        use nix::{sys::signal::Signal, unistd::Pid};
        let path = self.socket_path();
        let term_until = Instant::now() + STOP_GRACE;
        let give_up = term_until + STOP_GRACE;
        let mut last = None;
        // The socket goes first; the process (and with it the device) a moment later.
        while let Some(pid) = socket_owner(&path).or(last.filter(|p| alive(*p))) {
            last = Some(pid);
            let now = Instant::now();
            if now > give_up {
                tracing::warn!(link = %self.name, pid, "the adopted userspace WireGuard process does not exit");
                return;
            }
            let sig = if now < term_until {
                Signal::SIGTERM
            } else {
                Signal::SIGKILL
            };
            if let Ok(raw) = i32::try_from(pid) {
                let _ = nix::sys::signal::kill(Pid::from_raw(raw), sig);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        tracing::info!(link = %self.name, "stopped the adopted userspace WireGuard process");
    }

    fn io_err(&self, op: &'static str) -> impl FnOnce(std::io::Error) -> WgError + '_ {
        move |source| WgError::Io {
            op,
            name: self.name.clone(),
            source,
        }
    }

    /// One UAPI exchange: writes `request`, reads until the blank line.
    fn exchange(&self, request: &str, op: &'static str) -> Result<String, WgError> {
        let mut sock = UnixStream::connect(self.socket_path()).map_err(self.io_err(op))?;
        sock.set_read_timeout(Some(IO_TIMEOUT))
            .map_err(self.io_err(op))?;
        sock.set_write_timeout(Some(IO_TIMEOUT))
            .map_err(self.io_err(op))?;
        sock.write_all(request.as_bytes())
            .map_err(self.io_err(op))?;
        uapi::read_answer(&mut sock).map_err(self.io_err(op))
    }

    fn read(&self) -> Result<DeviceState, WgError> {
        self.reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let text = self.exchange("get=1\n\n", "get")?;
        uapi::parse_get(&text).map_err(|e| match e {
            GetError::Errno(errno) => WgError::Refused {
                name: self.name.clone(),
                errno,
            },
            GetError::Parse(message) => WgError::Protocol {
                name: self.name.clone(),
                message,
            },
        })
    }

    /// Best effort: makes the device equal `previous` again after a refused write.
    fn rollback(&mut self, previous: &DeviceState, desired: &WgDevice) {
        let Some(private_key) = previous.private_key.clone() else {
            return;
        };
        let back = WgDevice {
            name: self.name.clone(),
            private_key,
            listen_port: previous.listen_port,
            fwmark: previous.fwmark,
            peers: previous
                .peers
                .iter()
                .map(|p| WgPeer {
                    public_key: p.public_key.clone(),
                    preshared_key: p.preshared_key.clone(),
                    persistent_keepalive: p.persistent_keepalive,
                    endpoint: p.endpoint,
                    allowed_ips: p.allowed_ips.clone(),
                })
                .collect(),
        };
        let result = self.read().and_then(|now| {
            let up = diff(&now, &back);
            if up.is_empty() {
                return Ok(());
            }
            self.writes += 1;
            let answer = self.exchange(&uapi::format_set(&up), "set")?;
            match uapi::parse_errno(&answer) {
                Ok(0) => Ok(()),
                _ => Err(WgError::Protocol {
                    name: self.name.clone(),
                    message: "rollback refused".into(),
                }),
            }
        });
        match result {
            Ok(()) => {
                tracing::warn!(link = %self.name, wanted_port = desired.listen_port, "WireGuard refused the update; previous state restored");
            }
            Err(e) => {
                tracing::error!(link = %self.name, error = %e, "WireGuard refused the update and the rollback failed");
            }
        }
    }

    fn running(&self) -> bool {
        self.sup.is_some() && UnixStream::connect(self.socket_path()).is_ok()
    }
}

/// The pid of the process serving the UAPI socket at `path`, if it answers.
pub(super) fn socket_owner(path: &std::path::Path) -> Option<u32> {
    let sock = UnixStream::connect(path).ok()?;
    let cred =
        nix::sys::socket::getsockopt(&sock, nix::sys::socket::sockopt::PeerCredentials).ok()?;
    u32::try_from(cred.pid()).ok().filter(|p| *p > 0)
}

/// Which program process `pid` is, from its command line (`/proc/PID/cmdline`).
#[must_use]
pub fn implementation_of(pid: u32) -> UserspaceImpl {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    implementation_from_cmdline(&cmdline)
}

/// `wirespan wireguard …` runs the `wireguard` subcommand of a program that is not
/// wireguard-go (`wireguard-go -f wireguard` is an interface named `wireguard`);
/// anything else speaking the UAPI is taken for wireguard-go.
pub(crate) fn implementation_from_cmdline(cmdline: &[u8]) -> UserspaceImpl {
    let mut args = cmdline.split(|b| *b == 0);
    let program = args.next().unwrap_or_default();
    let base = program.rsplit(|b| *b == b'/').next().unwrap_or_default();
    if base != b"wireguard-go" && args.next() == Some(b"wireguard".as_slice()) {
        UserspaceImpl::Wirespan
    } else {
        UserspaceImpl::WireguardGo
    }
}

/// Whether process `pid` is in `netns`.
pub(super) fn same_netns(pid: u32, netns: &Netns) -> std::io::Result<bool> {
    use std::os::unix::fs::MetadataExt as _;
    let theirs = std::fs::metadata(format!("/proc/{pid}/ns/net"))?;
    let ours = match netns.path() {
        Some(p) => std::fs::metadata(p)?,
        None => std::fs::metadata("/proc/self/ns/net")?,
    };
    Ok(theirs.dev() == ours.dev() && theirs.ino() == ours.ino())
}

/// Whether process `pid` still runs (a zombie does not).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

fn supervise(
    shared: &Arc<(Mutex<SupState>, Condvar)>,
    netns: &Netns,
    opts: &UserspaceOptions,
    name: &str,
    recreated: &tokio::sync::Notify,
) {
    let (lock, cv) = &**shared;
    let mut backoff = Duration::from_millis(100);
    let mut st = lock.lock().unwrap_or_else(PoisonError::into_inner);
    loop {
        if st.stop {
            return;
        }
        let exited = match st.child.as_mut().map(Child::try_wait) {
            Some(Ok(Some(status))) => {
                let last_line = st.stderr.take().and_then(StderrTail::finish);
                st.last_exit = Some(DeviceExit {
                    status: status.to_string(),
                    code: status.code(),
                    last_line,
                });
                Some(status.to_string())
            }
            Some(Err(e)) => Some(e.to_string()),
            Some(Ok(None)) => None,
            None => match st.adopted {
                Some(pid) if alive(pid) => None,
                Some(pid) => Some(format!("adopted pid {pid} gone")),
                None => Some("not running".to_owned()),
            },
        };
        if let Some(why) = exited {
            st.child = None;
            st.adopted = None;
            let last_line = st.last_exit.as_ref().and_then(|e| e.last_line.as_deref());
            tracing::warn!(link = name, status = %why, last_line, backoff = ?backoff, "the userspace WireGuard process died, restarting");
            st = cv
                .wait_timeout(st, backoff)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            if st.stop {
                return;
            }
            match UserspaceBackend::spawn_child(netns, opts, name) {
                Ok((child, stderr)) => {
                    tracing::info!(
                        link = name,
                        pid = child.id(),
                        program = opts.implementation.program(),
                        "restarted the userspace WireGuard process"
                    );
                    st.child = Some(child);
                    st.stderr = stderr;
                    st.running = opts.implementation;
                    st.restarts += 1;
                    // A stored permit: the owner's next wait sees it even if it was
                    // busy now.
                    recreated.notify_one();
                }
                Err(e) => {
                    tracing::error!(link = name, error = %e, "cannot restart the userspace WireGuard process");
                }
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
            continue;
        }
        backoff = Duration::from_millis(100);
        st = cv
            .wait_timeout(st, POLL)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
}

impl UserspaceBackend {
    /// Writes `up`; returns the errno the device answered (0: applied).
    fn set(&mut self, up: &WgUpdate) -> Result<i32, WgError> {
        let answer = self.exchange(&uapi::format_set(up), "set")?;
        self.writes += 1;
        uapi::parse_errno(&answer).map_err(|message| WgError::Protocol {
            name: self.name.clone(),
            message,
        })
    }
}

impl WireGuard for UserspaceBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn recreated(&self) -> Option<Arc<tokio::sync::Notify>> {
        Some(self.recreated.clone())
    }

    fn ensure(&mut self) -> Result<(), WgError> {
        if self.sup.is_none() {
            return self.start();
        }
        if !self.running() {
            // Being restarted by the supervisor: wait for it.
            self.wait_socket()?;
        }
        Ok(())
    }

    fn apply(&mut self, desired: &WgDevice) -> Result<bool, WgError> {
        desired.validate()?;
        if desired.name != self.name {
            return Err(WgError::State(
                self.name.clone(),
                "desired device has another name",
            ));
        }
        self.ensure()?;
        let incarnation = self.restarts();
        let now = Instant::now();
        // Indexed here, in the whole-device apply, so that the next one-peer change
        // (`apply_peers`) does not pay for indexing every peer.
        let known = match self.known.take_fresh_indexed(now, incarnation) {
            Some(known) => known,
            None => Indexed::new(now, self.read()?),
        };
        let up = diff(&known.state, desired);
        if up.is_empty() {
            self.known.remember_indexed(incarnation, known);
            return Ok(false);
        }
        let (read_at, current) = (known.at, known.state);
        let removed = up.peers.iter().filter(|p| p.remove).count();
        tracing::debug!(link = %self.name, peers_changed = up.peers.len() - removed, peers_removed = removed,
            port = ?up.listen_port, key_changed = up.private_key.is_some(), "updating WireGuard device");
        let errno = self.set(&up)?;
        if errno != 0 {
            // wireguard-go stops at the failing line but has already dropped its old
            // socket when a new port is refused: put the previous state back.
            self.rollback(&current, desired);
            return Err(WgError::Refused {
                name: self.name.clone(),
                errno,
            });
        }
        let mut after = current;
        apply_update(&mut after, &up);
        align_order(&mut after, desired);
        self.known
            .remember_indexed(incarnation, Indexed::new(read_at, after));
        Ok(true)
    }

    fn apply_peers(&mut self, changes: &[PeerChange]) -> Result<bool, WgError> {
        if changes.is_empty() {
            return Ok(false);
        }
        self.ensure()?;
        let incarnation = self.restarts();
        let now = Instant::now();
        let mut known = match self.known.take_fresh_indexed(now, incarnation) {
            Some(k) => k,
            None => Indexed::new(now, self.read()?),
        };
        if let Err(e) = validate_changes(known.own.as_ref(), changes) {
            self.known.remember_indexed(incarnation, known);
            return Err(e.into());
        }
        let peers = diff_peers(&known.state, &known.index, changes);
        if peers.is_empty() {
            self.known.remember_indexed(incarnation, known);
            return Ok(false);
        }
        tracing::debug!(link = %self.name, peers_changed = peers.len(), "updating WireGuard peers");
        let up = WgUpdate {
            peers,
            ..WgUpdate::default()
        };
        // A failure leaves the state forgotten: the next apply reads the device.
        let errno = self.set(&up)?;
        if errno != 0 {
            return Err(WgError::Refused {
                name: self.name.clone(),
                errno,
            });
        }
        apply_peer_updates(&mut known.state, &mut known.index, &up.peers);
        self.known.remember_indexed(incarnation, known);
        Ok(true)
    }

    fn observe(&mut self) -> Result<WgStatus, WgError> {
        if self.sup.is_none() && socket_owner(&self.socket_path()).is_some() {
            // The first read after a restart: the device an earlier run kept is read
            // (and its wireguard-go adopted), not reported absent.
            self.start()?;
        }
        if !self.running() {
            return Ok(WgStatus::default());
        }
        let now = Instant::now();
        let st = self.read()?;
        let status = WgStatus::from(&st);
        self.known.remember(now, self.restarts(), st);
        Ok(status)
    }

    fn teardown(&mut self) -> Result<(), WgError> {
        self.stop();
        Ok(())
    }

    fn writes(&self) -> u64 {
        self.writes
    }

    /// Stops supervising and leaves the device process (and its socket) running, for the
    /// next daemon to adopt.
    fn keep(mut self: Box<Self>) {
        if let Some(mut sup) = self.sup.take() {
            {
                let (lock, cv) = &*sup.shared;
                let mut st = lock.lock().unwrap_or_else(PoisonError::into_inner);
                st.stop = true;
                if let Some(pid) = st.child.take().map(|c| c.id()).or(st.adopted.take()) {
                    tracing::info!(link = %self.name, pid, program = st.running.program(), "leaving the userspace WireGuard process running");
                }
                cv.notify_all();
            }
            if let Some(t) = sup.thread.take() {
                let _ = t.join();
            }
        }
        self.kept = true;
    }

    /// What runs the device now (an adopted process is reported as what it is, not
    /// as what was asked for); before the start, what the options name.
    /// Asks `wirespan wireguard` (`stats=1`); wireguard-go has no such request.
    fn drops(&mut self) -> Option<super::DeviceDrops> {
        if self.backend() != UserspaceImpl::Wirespan.backend_name() || !self.running() {
            return None;
        }
        let answer = self.exchange("stats=1\n\n", "stats").ok()?;
        uapi::parse_stats(&answer)
            .inspect_err(
                |e| tracing::debug!(link = %self.name, error = %e, "device stats unreadable"),
            )
            .ok()
    }

    fn backend(&self) -> &'static str {
        self.sup
            .as_ref()
            .map_or(self.opts.implementation, |sup| {
                sup.shared
                    .0
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .running
            })
            .backend_name()
    }
}

impl Drop for UserspaceBackend {
    fn drop(&mut self) {
        if !self.kept {
            self.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::strip_ansi;

    #[test]
    fn the_devices_coloured_log_line_is_forwarded_plain() {
        let coloured = "\u{1b}[2m2026-01-01T00:00:00Z\u{1b}[0m \u{1b}[31mERROR\u{1b}[0m \u{1b}[2mwirespan\u{1b}[0m: panicked thread=\"wg-udp\"";
        assert_eq!(
            strip_ansi(coloured),
            "2026-01-01T00:00:00Z ERROR wirespan: panicked thread=\"wg-udp\""
        );
        assert_eq!(strip_ansi("plain"), "plain");
        // A lone escape at the end is dropped, not a panic.
        assert_eq!(strip_ansi("x\u{1b}"), "x");
    }
}
