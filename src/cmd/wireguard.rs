//! `wirespan wireguard [--foreground] INTERFACE`: the userspace WireGuard device, a
//! drop-in for `wireguard-go` (same UAPI socket, so `wg` and the node's userspace
//! backend drive it unchanged).
//!
//! Without `--foreground` it daemonises the way wireguard-go does: it starts itself
//! again in the foreground in a new process group with no terminal, waits until that
//! child serves its UAPI socket, and exits 0 (or 1 with the child's exit status if the
//! child failed to start).
//!
//! The device ends its own process when one of its threads panics (exit status 70),
//! returns or stalls (status 1): a partly dead device must not look alive to its
//! supervisor, which restarts it (`docs/userspace-wireguard.md`, "Supervision").

use std::{
    os::unix::{net::UnixStream, process::CommandExt as _},
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use wirespan_dataplane::userspace_wireguard::{
    device::{self, DeviceOptions, DEFAULT_SOCKET_DIR},
    watchdog::STALL_LIMIT,
};

/// How long a daemonising parent waits for its child's UAPI socket.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// Options of `wirespan wireguard`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Stay in the foreground (default: daemonise once the device serves its socket).
    #[arg(short = 'f', long)]
    foreground: bool,
    /// Directory of the UAPI socket `INTERFACE.sock`.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_SOCKET_DIR)]
    socket_dir: PathBuf,
    /// MTU of the TUN interface.
    #[arg(long, default_value_t = wirespan_dataplane::DEFAULT_MTU)]
    mtu: u32,
    /// Seconds a packet loop may hold work without progress before the device ends
    /// its process (for its supervisor to restart it).
    #[arg(long, value_name = "SECONDS", default_value_t = STALL_LIMIT.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..))]
    stall_limit: u64,
    /// The interface to create.
    interface: String,
}

/// Runs the device (foreground) or starts it in the background.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let opts = DeviceOptions {
        name: args.interface.clone(),
        socket_dir: args.socket_dir.clone(),
        mtu: args.mtu,
        stall_limit: Duration::from_secs(args.stall_limit),
    };
    if !args.foreground {
        return daemonise(args, &opts);
    }
    let reason = device::run(&opts).with_context(|| format!("device {}", opts.name))?;
    tracing::debug!(?reason, "device stopped");
    Ok(())
}

fn daemonise(args: &Args, opts: &DeviceOptions) -> anyhow::Result<()> {
    let path = device::socket_path(&opts.socket_dir, &opts.name);
    if UnixStream::connect(&path).is_ok() {
        anyhow::bail!("{} is served by a running process", path.display());
    }
    let exe = std::env::current_exe().context("finding this executable")?;
    let mut child = Command::new(exe)
        .arg("wireguard")
        .arg("--foreground")
        .arg("--socket-dir")
        .arg(&args.socket_dir)
        .arg("--mtu")
        .arg(args.mtu.to_string())
        .arg("--stall-limit")
        .arg(args.stall_limit.to_string())
        .arg(&args.interface)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .context("starting the device process")?;
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if UnixStream::connect(&path).is_ok() {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            anyhow::bail!(
                "the device exited at start ({status}); run with --foreground to see why"
            );
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!(
                "the device did not serve {} within {START_TIMEOUT:?}",
                path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
