//! The [`WireGuard`] backend trait and the choice between the kernel and the
//! userspace backends ([`select`]).

use std::path::{Path, PathBuf};

use super::{
    choose::{choose, link_facts, serving_device, LinkFacts, Run},
    kernel,
    userspace::{self, UserspaceImpl, UserspaceOptions},
    PeerChange, WgDevice, WgError, WgStatus,
};
use crate::netns::Netns;

/// A WireGuard backend: one device.
pub trait WireGuard {
    /// Interface name.
    fn name(&self) -> &str;
    /// Creates the device if missing (link exists afterwards).
    ///
    /// # Errors
    /// Creation failed.
    fn ensure(&mut self) -> Result<(), WgError>;
    /// Creates the device if needed and applies the minimal diff to `desired`.
    /// Returns whether anything was written.
    ///
    /// # Errors
    /// Invalid state (nothing written) or a failed write.
    fn apply(&mut self, desired: &WgDevice) -> Result<bool, WgError>;
    /// Changes only the peers named (device settings and other peers untouched), with
    /// work proportional to the change. Meant after a successful [`WireGuard::apply`];
    /// returns whether anything was written.
    ///
    /// # Errors
    /// An invalid change (nothing written) or a failed write.
    fn apply_peers(&mut self, changes: &[PeerChange]) -> Result<bool, WgError>;
    /// Reads per-peer endpoint, handshake and counters (`present: false` if no device).
    ///
    /// # Errors
    /// The device could not be read.
    fn observe(&mut self) -> Result<WgStatus, WgError>;
    /// Removes the device (and stops its process). Idempotent.
    ///
    /// # Errors
    /// Removal failed.
    fn teardown(&mut self) -> Result<(), WgError>;
    /// Number of configuration writes so far.
    fn writes(&self) -> u64;
    /// Notified each time the device was recreated empty behind the caller's back (the
    /// supervisor restarted a dead userspace device process): the caller should apply the whole
    /// device again rather than wait for its next round. `None`: this backend never
    /// does that (a deleted kernel link is recreated by the next apply).
    fn recreated(&self) -> Option<std::sync::Arc<tokio::sync::Notify>> {
        None
    }
    /// Lets go of the device and leaves it running as it is (a daemon stopping with
    /// its kernel state kept); a later backend for the same name adopts it.
    fn keep(self: Box<Self>) {
        // Dropping could stop what the device needs (a userspace backend's process).
        std::mem::forget(self);
    }
    /// Which implementation runs the device: `kernel`, `userspace` (`wirespan
    /// wireguard`) or `userspace-go` (`wireguard-go`), reported in the manager's status
    /// so an operator sees what `auto` chose.
    fn backend(&self) -> &'static str;
    /// What the device dropped as hostile or broken input, where it counts that
    /// (`wirespan wireguard`); `None` for the kernel and wireguard-go, or when the
    /// device cannot be asked now.
    fn drops(&mut self) -> Option<super::DeviceDrops> {
        None
    }
}

/// Which backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// Kernel if the kernel supports WireGuard, else `wirespan wireguard`.
    #[default]
    Auto,
    /// Kernel (netlink).
    Kernel,
    /// Userspace: `wirespan wireguard`, wirespan's own device.
    Userspace,
    /// Userspace: `wireguard-go`.
    UserspaceGo,
}

impl BackendChoice {
    /// The value `--wireguard` takes for this choice.
    #[must_use]
    pub fn flag(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Kernel => "kernel",
            Self::Userspace => "userspace",
            Self::UserspaceGo => "userspace-go",
        }
    }
}

/// Builds the backend for device `name` in `netns`; `wirespan wireguard` runs from
/// this process's own executable.
///
/// # Errors
/// The kernel backend was forced but is unavailable, the probe failed, or this
/// executable cannot be found.
pub fn select(
    choice: BackendChoice,
    name: &str,
    netns: &Netns,
) -> Result<Box<dyn WireGuard + Send>, WgError> {
    select_with_binary(choice, name, netns, None)
}

/// As [`select`], with `wirespan wireguard` run from `wirespan` (`None`: this
/// process's own executable, the node's case).
///
/// What holds the link decides first ([`choose`]): a kernel WireGuard link is
/// driven by the kernel backend, a userspace device serving the link's socket is
/// adopted (and reported as what it is), and a TUN nobody serves is removed before
/// choosing as on a clean start.
///
/// # Errors
/// As [`select`], and [`WgError::WrongBackend`] when the link is held by something
/// the explicit `choice` cannot drive.
pub fn select_with_binary(
    choice: BackendChoice,
    name: &str,
    netns: &Netns,
    wirespan: Option<&Path>,
) -> Result<Box<dyn WireGuard + Send>, WgError> {
    let link = link_facts(netns, name).map_err(|source| WgError::Io {
        op: "inspect link",
        name: name.to_owned(),
        source,
    })?;
    let device = serving_device(netns, name);
    let kernel_has_wg = link == LinkFacts::WireGuard
        || (choice == BackendChoice::Auto && device.is_none() && kernel::supported(netns));
    let decision =
        choose(&link, device, choice, kernel_has_wg).map_err(|m| WgError::WrongBackend {
            name: name.to_owned(),
            asked: m.asked.flag(),
            held_by: m.held_by,
        })?;
    if decision.remove_stale_link {
        tracing::warn!(
            link = name,
            "removing a stale mesh link nobody serves (left by an earlier run)"
        );
        netns
            .run("ip", &["link", "del", "dev", name])
            .map_err(|source| WgError::Io {
                op: "remove stale link",
                name: name.to_owned(),
                source,
            })?;
    }
    // What to start when nothing runs (and after an adopted process dies): what was
    // asked for, `wirespan wireguard` for `auto`.
    let opts = match (decision.run, choice) {
        (Run::Kernel, _) => {
            tracing::info!(
                link = name,
                backend = "kernel",
                adopted = link == LinkFacts::WireGuard,
                "WireGuard backend"
            );
            return Ok(Box::new(kernel::KernelBackend::new(name, netns)?));
        }
        (Run::Start(UserspaceImpl::WireguardGo), _)
        | (Run::Adopt(_), BackendChoice::UserspaceGo) => UserspaceOptions::default(),
        (Run::Start(UserspaceImpl::Wirespan) | Run::Adopt(_), _) => {
            UserspaceOptions::wirespan(wirespan_binary(name, wirespan)?)
        }
    };
    if let Run::Adopt(found) = decision.run {
        tracing::info!(
            link = name,
            backend = found.implementation.backend_name(),
            pid = found.pid,
            asked = choice.flag(),
            "WireGuard backend: adopting the running userspace device"
        );
    } else {
        tracing::info!(
            link = name,
            backend = opts.implementation.backend_name(),
            binary = %opts.binary.display(),
            "WireGuard backend"
        );
    }
    Ok(Box::new(userspace::UserspaceBackend::with_options(
        name,
        netns.clone(),
        opts,
    )))
}

fn wirespan_binary(name: &str, given: Option<&Path>) -> Result<PathBuf, WgError> {
    if let Some(p) = given {
        return Ok(p.to_owned());
    }
    let exe = std::env::current_exe().map_err(|e| WgError::Daemon {
        name: name.to_owned(),
        message: format!("cannot find this executable to run `wirespan wireguard`: {e}"),
    })?;
    Ok(undeleted(exe))
}

/// The path an executable replaced on disk since it started had (an upgrade installs
/// a new file, and Linux then names the running one `PATH (deleted)`): the supervisor
/// starts the device from the file now there.
fn undeleted(exe: PathBuf) -> PathBuf {
    match exe.to_str().and_then(|s| s.strip_suffix(" (deleted)")) {
        Some(path) => PathBuf::from(path),
        None => exe,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replaced_executable_is_started_from_its_path() {
        assert_eq!(
            undeleted("/usr/local/bin/wirespan (deleted)".into()),
            PathBuf::from("/usr/local/bin/wirespan")
        );
        assert_eq!(
            undeleted("/usr/local/bin/wirespan".into()),
            PathBuf::from("/usr/local/bin/wirespan")
        );
    }
}
