//! The device loop: the I/O edge around [`DeviceCore`]. One thread reads the TUN, one
//! the port's data socket, one its handshake socket, one serves the UAPI socket, one
//! runs the timers; the calling thread waits for SIGTERM/SIGINT or the interface's
//! deletion, removes the UAPI socket and returns. The threads share the core, whose
//! own locks let the readers seal and open different peers' packets at once (the lock
//! order is in `core.rs`).
//!
//! Handshakes never hold up data: the kernel steers each datagram to one of the port's
//! two sockets by its type ([`port`]), so the data reader only opens data messages and
//! a flood of handshake messages queues on, and overflows, the handshake socket alone.
//! The handshake reader does all the Diffie-Hellman work, answering with cookie
//! replies while the device is under load.
//!
//! No thread dies alone ([`watchdog`]): a panic ends the process from the panic hook;
//! a long-lived thread that returns, or a packet loop that holds work without progress
//! for the stall limit (judged by the `wg-watchdog` thread on the loops' heartbeats),
//! makes `run` fail. Either way the process exits non-zero and its supervisor starts
//! a fresh device.

use std::{
    fs::File,
    io::{self, BufRead, BufReader, Read, Write},
    net::{SocketAddr, SocketAddrV6, UdpSocket},
    os::{
        fd::AsFd,
        unix::{fs::PermissionsExt, net::UnixListener, net::UnixStream},
    },
    path::{Path, PathBuf},
    sync::{mpsc, Arc, Mutex, RwLock},
    thread,
    time::{Duration, Instant, SystemTime},
};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::{
    signal::{SigSet, Signal},
    signalfd::SignalFd,
};

use super::{
    batch::{
        gro_segments, gso_failure, gso_runs, GsoSwitch, Outbox, GSO_REPROBE, MAX_GSO_BYTES,
        MAX_GSO_SEGMENTS,
    },
    core::DeviceCore,
    fault,
    mmsg::{self, Outgoing, Received},
    noise::limiter::Load,
    offload::{self, VnetHdr, VNET_HDR_LEN},
    port::{self, PortSockets},
    tun,
    uapi_request::{errno, parse_set},
    watchdog::{self, Beat, Failure, Watch},
};

/// Where wireguard-go and `wg` put the UAPI sockets.
pub const DEFAULT_SOCKET_DIR: &str = "/var/run/wireguard";
/// The shortest sleep of the timer loop, its slack: peers whose deadlines fall close
/// together (a thousand handshakes started in one burst) are served by one wake-up,
/// and a deadline that stayed in the past cannot make the loop spin. The fixed tick
/// this replaces ran every 250 ms.
const MIN_TIMER_WAIT: Duration = Duration::from_millis(100);
/// How long the receiver pauses after a socket error that is not a replacement.
const ERROR_PAUSE: Duration = Duration::from_millis(250);
/// A UAPI client that sends nothing for this long is dropped.
const UAPI_IDLE: Duration = Duration::from_secs(10);
/// What the device needs to start.
#[derive(Debug, Clone)]
pub struct DeviceOptions {
    /// The interface name.
    pub name: String,
    /// The UAPI socket directory (`SOCKET_DIR/NAME.sock`).
    pub socket_dir: PathBuf,
    /// The TUN's MTU.
    pub mtu: u32,
    /// How long a packet loop may hold work without progress before the process ends
    /// ([`watchdog::STALL_LIMIT`] by default).
    pub stall_limit: Duration,
}

/// Why the device stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitReason {
    /// SIGTERM or SIGINT.
    Signal,
    /// The interface was deleted.
    InterfaceGone,
}

/// A device that could not start.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// Creating the TUN failed.
    #[error("creating TUN {name}: {source}")]
    Tun {
        /// The interface name.
        name: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Binding the UDP socket failed.
    #[error("binding the UDP socket: {0}")]
    Socket(#[source] io::Error),
    /// The UAPI socket could not be served.
    #[error("UAPI socket {path}: {source}")]
    Uapi {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Another process serves this interface's UAPI socket.
    #[error("{0} is served by a running process")]
    AlreadyRunning(PathBuf),
    /// Signal handling could not be set up.
    #[error("signals: {0}")]
    Signals(#[source] nix::Error),
    /// A device thread returned or stalled: the device can no longer serve.
    #[error("{0}")]
    Failed(Failure),
    /// A device thread could not be started.
    #[error("starting thread {thread}: {source}")]
    Thread {
        /// The thread's name.
        thread: &'static str,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// What ends `run`'s wait: a stop, or a failed thread.
enum Stop {
    Reason(ExitReason),
    Failed(Failure),
}

/// The UAPI socket path of `name` in `dir`.
pub fn socket_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.sock"))
}

/// What the threads share.
struct Shared {
    core: DeviceCore,
    /// Serialises `set=1` requests: the socket's rebinding and the core's update
    /// happen as one. Taken before any lock of the core.
    set_lock: Mutex<()>,
    /// The port's data and handshake sockets (replaced whole by a new port).
    socket: RwLock<Arc<PortSockets>>,
    tun: File,
    /// UDP GSO is used until a send shows the route cannot do it, then again after
    /// a while.
    gso: Mutex<GsoSwitch>,
    /// Wakes the timer loop when a deadline moved earlier.
    wake_timer: mpsc::SyncSender<()>,
}

impl Shared {
    /// Wakes the timer loop (a wake already pending is enough).
    fn wake_timer(&self) {
        let _ = self.wake_timer.try_send(());
    }

    fn socket(&self) -> Arc<PortSockets> {
        self.socket
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// Binds the UAPI socket, refusing to take over one a live process still serves.
fn listen_uapi(dir: &Path, name: &str) -> Result<(UnixListener, PathBuf), DeviceError> {
    let path = socket_path(dir, name);
    let uapi_err = |source| DeviceError::Uapi {
        path: path.clone(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(uapi_err)?;
    if path.exists() {
        if UnixStream::connect(&path).is_ok() {
            return Err(DeviceError::AlreadyRunning(path));
        }
        std::fs::remove_file(&path).map_err(uapi_err)?;
    }
    let listener = UnixListener::bind(&path).map_err(uapi_err)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).map_err(uapi_err)?;
    Ok((listener, path))
}

/// Runs the device until SIGTERM/SIGINT or the interface's deletion. Call it from the
/// process's main thread before any other thread exists: it blocks the two signals
/// for every thread it starts and reads them from a signalfd.
///
/// Installs the panic hook that ends the process on any thread's panic
/// ([`watchdog::install_panic_hook`]).
///
/// # Errors
/// The TUN, the socket, the UAPI socket, the signal setup or a thread failed at start;
/// or later a long-lived thread returned or a packet loop stalled
/// ([`DeviceError::Failed`]): the caller must end the process.
pub fn run(opts: &DeviceOptions) -> Result<ExitReason, DeviceError> {
    watchdog::install_panic_hook();
    fault::init_from_env();
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGTERM);
    signals.add(Signal::SIGINT);
    signals.thread_block().map_err(DeviceError::Signals)?;
    let signal_fd = SignalFd::new(&signals).map_err(DeviceError::Signals)?;

    let tun_file = tun::open(&opts.name).map_err(|source| DeviceError::Tun {
        name: opts.name.clone(),
        source,
    })?;
    match tun::enable_offloads(&tun_file) {
        Ok(uso) => tracing::debug!(interface = %opts.name, uso, "TUN offloads on"),
        Err(e) => tracing::info!(interface = %opts.name, error = %e, "TUN offloads unavailable"),
    }
    if let Err(e) = tun::set_mtu(&opts.name, opts.mtu) {
        tracing::warn!(interface = %opts.name, error = %e, "setting the MTU failed");
    }
    let socket = port::bind(0, 0).map_err(DeviceError::Socket)?;
    let (listener, path) = listen_uapi(&opts.socket_dir, &opts.name)?;
    let core = DeviceCore::default();
    core.set_listen_port(socket.port());
    core.set_mtu(usize::try_from(opts.mtu).unwrap_or(usize::MAX));
    tracing::info!(interface = %opts.name, port = core.listen_port(), "userspace WireGuard device up");
    let (wake_timer, wake_rx) = mpsc::sync_channel(1);
    let shared = Arc::new(Shared {
        core,
        set_lock: Mutex::new(()),
        socket: RwLock::new(Arc::new(socket)),
        tun: tun_file,
        gso: Mutex::new(GsoSwitch::default()),
        wake_timer,
    });

    let (exit_tx, exit_rx) = mpsc::channel();
    // Every long-lived thread reports its return on `exit_tx`: after a stop reason
    // it sent itself, a return is the normal end, otherwise the device's failure.
    let long_lived = |name: &'static str, f: Box<dyn FnOnce() + Send>| {
        watchdog::spawn_long_lived(name, exit_tx.clone(), Stop::Failed, f).map_err(|source| {
            DeviceError::Thread {
                thread: name,
                source,
            }
        })
    };
    let watch = Watch::new(&["wg-tun", "wg-udp", "wg-handshake", "wg-timers"]);
    long_lived(
        "wg-tun",
        Box::new({
            let (shared, exit, beat) = (shared.clone(), exit_tx.clone(), watch.beat("wg-tun"));
            move || tun_loop(&shared, &exit, &beat)
        }),
    )?;
    long_lived(
        "wg-udp",
        Box::new({
            let (shared, beat) = (shared.clone(), watch.beat("wg-udp"));
            move || receive_loop(&shared, &beat, Way::Data)
        }),
    )?;
    long_lived(
        "wg-handshake",
        Box::new({
            let (shared, beat) = (shared.clone(), watch.beat("wg-handshake"));
            move || receive_loop(&shared, &beat, Way::Handshake)
        }),
    )?;
    long_lived(
        "wg-timers",
        Box::new({
            let (shared, beat) = (shared.clone(), watch.beat("wg-timers"));
            move || timer_loop(&shared, &wake_rx, &beat)
        }),
    )?;
    long_lived(
        "wg-watchdog",
        Box::new({
            let (exit, limit) = (exit_tx.clone(), opts.stall_limit);
            move || {
                let failure = watch.run_watchdog(limit);
                let _ = exit.send(Stop::Failed(failure));
                // Parked for good: its return would be reported over the stall.
                loop {
                    thread::park();
                }
            }
        }),
    )?;
    long_lived(
        "wg-uapi",
        Box::new(move || {
            // A thread per connection, as wireguard-go serves them: a client that keeps
            // its connection open must not hold up `wg` or the node.
            for stream in listener.incoming().flatten() {
                let shared = shared.clone();
                spawn("wg-uapi-conn", move || {
                    if let Err(e) = serve_uapi(&shared, stream) {
                        tracing::debug!(error = %e, "UAPI connection ended");
                    }
                });
            }
        }),
    )?;
    long_lived(
        "wg-signals",
        Box::new({
            let exit = exit_tx.clone();
            move || {
                if let Ok(Some(info)) = signal_fd.read_signal() {
                    tracing::info!(signal = info.ssi_signo, "stopping");
                }
                let _ = exit.send(Stop::Reason(ExitReason::Signal));
            }
        }),
    )?;
    drop(exit_tx);

    // Every sender lives in a thread that reports its return: the channel cannot close.
    let stop = exit_rx.recv().unwrap_or(Stop::Reason(ExitReason::Signal));
    let _ = std::fs::remove_file(&path);
    match stop {
        Stop::Reason(reason) => {
            tracing::info!(interface = %opts.name, ?reason, "userspace WireGuard device down");
            Ok(reason)
        }
        Stop::Failed(failure) => {
            let thread = match failure {
                Failure::Returned { thread } | Failure::Stalled { thread, .. } => thread,
            };
            tracing::error!(interface = %opts.name, thread, %failure, "device thread failed, ending the process so that it is restarted");
            Err(DeviceError::Failed(failure))
        }
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) {
    if let Err(e) = thread::Builder::new().name(name.to_owned()).spawn(f) {
        tracing::error!(thread = name, error = %e, "cannot start a device thread");
    }
}

/// Reads up to `BATCH` packets or datagrams before taking the core's lock once for all.
const BATCH: usize = 64;
/// Room for the largest packet (after its `virtio_net_hdr`) or datagram.
const RECV_SIZE: usize = 65_536 + VNET_HDR_LEN;

/// `BATCH` receive buffers. Each is allocated zeroed and untouched, so an idle device
/// holds only the pages its traffic has used.
fn recv_buffers() -> Vec<Vec<u8>> {
    (0..BATCH).map(|_| vec![0u8; RECV_SIZE]).collect()
}

/// Writes what one batch produced, after the peers' locks are released: the TUN
/// packets (one flow's segments coalesced into one write), then the datagrams.
fn flush(shared: &Shared, socket: &UdpSocket, out: &Outbox) {
    tun::write_packets(&shared.tun, out.packets());
    send_datagrams(shared, socket, out);
}

/// Sends the batch's datagrams, [`mmsg::MMSG_MAX`] messages a call: each run of
/// equal-sized datagrams to one peer as one GSO message, other datagrams (other
/// peers, other sizes) as messages of their own beside them.
fn send_datagrams(shared: &Shared, socket: &UdpSocket, out: &Outbox) {
    let now = Instant::now();
    let (gso, reprobe) = lock_gso(shared).enabled(now);
    if reprobe {
        tracing::info!("trying UDP GSO again");
    }
    let mut msgs = Vec::new();
    for run in gso_runs(out.datagrams(), MAX_GSO_SEGMENTS, MAX_GSO_BYTES) {
        let bytes = &out.bytes()[run.bytes.clone()];
        match u16::try_from(run.segment) {
            Ok(segment) if run.count > 1 && gso => msgs.push(Outgoing {
                to: run.to,
                bytes,
                segment: Some(segment),
            }),
            _ => msgs.extend(gro_segments(bytes, run.segment).map(|bytes| Outgoing {
                to: run.to,
                bytes,
                segment: None,
            })),
        }
    }
    let mut rest = &msgs[..];
    while let Some(first) = rest.first() {
        match mmsg::send_batch(socket.as_fd(), rest) {
            Ok(sent) => rest = &rest[sent.max(1)..],
            Err(e) => {
                // A GSO message the kernel would not segment: its datagrams go one by
                // one (and, when the route cannot segment at all, later ones too).
                if let Some((failure, segment)) = gso_failure(e).zip(first.segment) {
                    if lock_gso(shared).failed(failure, now) {
                        tracing::info!(
                            error = %e,
                            off_for = ?GSO_REPROBE,
                            "UDP GSO unavailable on a route, sending datagrams one by one"
                        );
                    }
                    for datagram in gro_segments(first.bytes, usize::from(segment)) {
                        if let Err(e) = socket.send_to(datagram, mapped(first.to)) {
                            tracing::trace!(error = %e, "send failed");
                        }
                    }
                } else {
                    tracing::trace!(error = %e, "send failed");
                }
                rest = &rest[1..];
            }
        }
    }
}

fn lock_gso(shared: &Shared) -> std::sync::MutexGuard<'_, GsoSwitch> {
    shared
        .gso
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The socket is dual-stack IPv6: IPv4 peers are reached as mapped addresses.
fn mapped(to: SocketAddr) -> SocketAddr {
    match to {
        SocketAddr::V4(v4) => {
            SocketAddr::V6(SocketAddrV6::new(v4.ip().to_ipv6_mapped(), v4.port(), 0, 0))
        }
        v6 @ SocketAddr::V6(_) => v6,
    }
}

/// Waits until `fd` is readable (or has an error for the next read to report).
fn wait_readable(fd: std::os::fd::BorrowedFd<'_>) {
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    let _ = poll(&mut fds, PollTimeout::NONE);
}

fn tun_loop(shared: &Shared, exit: &mpsc::Sender<Stop>, beat: &Beat) {
    let mut bufs = recv_buffers();
    let mut lens = Vec::with_capacity(BATCH);
    // The batch's packets, super-packets cut to MTU size, back to back.
    let (mut packets, mut ranges) = (Vec::new(), Vec::new());
    let mut out = Outbox::default();
    loop {
        lens.clear();
        // The TUN is non-blocking: read what is queued, wait only when nothing is.
        while lens.len() < BATCH {
            match (&shared.tun).read(&mut bufs[lens.len()]) {
                Ok(0) => break,
                Ok(n) => lens.push(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if !lens.is_empty() {
                        break;
                    }
                    wait_readable(shared.tun.as_fd());
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::info!(error = %e, "TUN read failed");
                    let _ = exit.send(Stop::Reason(ExitReason::InterfaceGone));
                    return;
                }
            }
        }
        let _busy = beat.busy();
        packets.clear();
        ranges.clear();
        for (buf, n) in bufs.iter().zip(&lens) {
            let Some(hdr) = VnetHdr::parse(&buf[..*n]) else {
                continue;
            };
            if let Err(e) = offload::split(&hdr, &buf[VNET_HDR_LEN..*n], &mut packets, &mut ranges)
            {
                tracing::debug!(error = %e, "TUN packet dropped");
            }
        }
        out.clear();
        let batch = ranges.iter().map(|r| &packets[r.clone()]);
        shared
            .core
            .handle_tun_packets(batch, Instant::now(), &mut out);
        if shared.core.take_timer_wake() {
            shared.wake_timer();
        }
        if !out.is_empty() {
            flush(shared, &shared.socket().data, &out);
        }
    }
}

/// Which of the port's sockets a receive loop reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// Data messages (`wg-udp`).
    Data,
    /// Handshake messages (`wg-handshake`): all the Diffie-Hellman work.
    Handshake,
}

/// Receives from one of the port's sockets: data messages are opened here, with a
/// peer's lock kept over a run of its datagrams; handshake messages (on the data
/// socket only when the steering could not be attached) are handled after them, as
/// under load when this loop's [`Load`] says so.
fn receive_loop(shared: &Shared, beat: &Beat, way: Way) {
    if way == Way::Handshake {
        // A bounded share of busy cores: a flood of handshakes cannot starve the
        // data readers.
        if let Err(e) = port::lower_this_threads_priority(port::HANDSHAKE_NICE) {
            tracing::debug!(error = %e, "cannot lower the handshake reader's priority");
        }
    }
    let mut bufs = recv_buffers();
    let mut got: Vec<Received> = Vec::with_capacity(BATCH);
    let mut out = Outbox::default();
    let mut load = Load::default();
    loop {
        let sockets = shared.socket();
        let socket = match way {
            Way::Data => &sockets.data,
            Way::Handshake => &sockets.handshake,
        };
        // Blocks for the first datagram, then takes what else is queued, in one call.
        match mmsg::recv_batch(socket.as_fd(), &mut bufs, &mut got) {
            Ok(false) | Err(Errno::EAGAIN | Errno::EINTR) => {}
            // Shut down (`apply_set` replaced it) or failed: what came before is
            // handled, and the next round takes the socket that replaced it.
            result => {
                if let Err(e) = result {
                    tracing::trace!(error = %e, "receive failed");
                }
                if Arc::ptr_eq(&sockets, &shared.socket()) {
                    // Not a replacement: avoid spinning on a persistent condition.
                    thread::sleep(ERROR_PAUSE);
                }
            }
        }
        if got.is_empty() {
            continue;
        }
        let _busy = beat.busy();
        if way == Way::Data && fault::on_udp_batch().is_break() {
            return;
        }
        out.clear();
        let (now, wall) = (Instant::now(), SystemTime::now());
        let batch = bufs.iter().zip(&got).flat_map(|(buf, d)| {
            gro_segments(&buf[..d.len], d.segment).map(move |datagram| (d.from, datagram))
        });
        // Allocates only when a batch holds handshake messages.
        let mut handshakes = Vec::new();
        shared
            .core
            .handle_transport(batch, now, wall, &mut out, |from, msg| {
                handshakes.push((from, msg));
            });
        if !handshakes.is_empty() {
            // A full batch: more were waiting behind it.
            let under_load = load.under_load(handshakes.len(), got.len() == BATCH, now);
            shared
                .core
                .handle_handshakes(handshakes, now, wall, under_load, &mut out);
        }
        if shared.core.take_timer_wake() {
            shared.wake_timer();
        }
        if !out.is_empty() {
            flush(shared, &sockets.data, &out);
        }
    }
}

/// Runs the timers when the earliest deadline comes, or sooner when a packet or a
/// `set=1` made a deadline earlier (a message on `wake`). An idle device with no
/// pending timer sleeps until woken.
fn timer_loop(shared: &Shared, wake: &mpsc::Receiver<()>, beat: &Beat) {
    let mut out = Outbox::default();
    loop {
        let busy = beat.busy();
        out.clear();
        let now = Instant::now();
        shared.core.tick(now, &mut out);
        let next = shared.core.next_deadline(now);
        if !out.is_empty() {
            flush(shared, &shared.socket().data, &out);
        }
        drop(busy);
        let woken = match next {
            Some(due) => {
                let wait = due.saturating_duration_since(Instant::now());
                match wake.recv_timeout(wait.max(MIN_TIMER_WAIT)) {
                    Ok(()) | Err(mpsc::RecvTimeoutError::Timeout) => Ok(()),
                    Err(mpsc::RecvTimeoutError::Disconnected) => Err(()),
                }
            }
            None => wake.recv().map_err(|_| ()),
        };
        if woken.is_err() {
            return;
        }
    }
}

/// Serves one UAPI connection: `get=1`, `set=1` and the `stats=1` extension, each
/// ended by a blank line, until the client closes it.
fn serve_uapi(shared: &Shared, stream: UnixStream) -> io::Result<()> {
    stream.set_read_timeout(Some(UAPI_IDLE))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    loop {
        let mut command = String::new();
        if reader.read_line(&mut command)? == 0 {
            return Ok(());
        }
        let mut body = String::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line)? == 0 || line == "\n" {
                break;
            }
            body.push_str(&line);
        }
        let answer = match command.trim_end() {
            "get=1" => format!("{}errno=0\n\n", shared.core.render_get()),
            "set=1" => format!("errno={}\n\n", apply_set(shared, &body)),
            "stats=1" => render_stats(shared),
            _ => {
                writer.write_all(format!("errno={}\n\n", errno::EPROTO).as_bytes())?;
                return Ok(());
            }
        };
        writer.write_all(answer.as_bytes())?;
    }
}

/// The `stats=1` answer: the device's counters.
fn render_stats(shared: &Shared) -> String {
    let c = shared.core.counters();
    format!(
        "invalid_datagrams={}\nspoofed_packets={}\nunroutable_packets={}\ncookie_replies={}\n\
         replayed_initiations={}\nrate_limited_handshakes={}\nerrno=0\n\n",
        c.invalid_datagrams,
        c.spoofed_packets,
        c.unroutable_packets,
        c.cookie_replies,
        c.replayed_initiations,
        c.rate_limited_handshakes,
    )
}

/// Applies a `set=1` body; returns the errno to answer. Nothing changes unless the
/// whole request parses and the socket accepts its port and mark.
fn apply_set(shared: &Shared, body: &str) -> i32 {
    let req = match parse_set(body) {
        Ok(req) => req,
        Err(e) => {
            tracing::info!(error = %e, "UAPI set refused");
            return e.errno();
        }
    };
    let _set = shared
        .set_lock
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let core = &shared.core;
    let (listen_port, fwmark) = (core.listen_port(), core.fwmark());
    let mark = req.fwmark.unwrap_or(fwmark);
    let current = shared.socket();
    let port = match req.listen_port {
        Some(port) if port == 0 || port != listen_port => match port::bind(port, mark) {
            Ok(new) => {
                let port = new.port();
                *shared
                    .socket
                    .write()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(new);
                // Wake the receivers blocked on the old sockets.
                current.shut_down();
                port
            }
            Err(e) => {
                tracing::info!(port, error = %e, "UAPI set refused: cannot bind");
                return if e.kind() == io::ErrorKind::AddrInUse {
                    errno::EADDRINUSE
                } else {
                    errno::EIO
                };
            }
        },
        _ => {
            if mark != fwmark {
                if let Err(e) = current.set_mark(mark) {
                    tracing::info!(error = %e, "UAPI set refused: cannot mark the socket");
                    return errno::EIO;
                }
            }
            listen_port
        }
    };
    // The port actually bound (a request for 0 gets one from the kernel).
    let mut req = req;
    req.listen_port = Some(port);
    core.apply_set(req);
    // New peers or intervals can bring a deadline forward.
    shared.wake_timer();
    0
}
