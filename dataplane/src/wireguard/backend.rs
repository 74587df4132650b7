//! The [`WireGuard`] backend trait and the choice between the kernel and the
//! userspace backends ([`select`]).

use std::path::{Path, PathBuf};

use super::{
    kernel,
    userspace::{self, UserspaceOptions},
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
/// # Errors
/// As [`select`].
pub fn select_with_binary(
    choice: BackendChoice,
    name: &str,
    netns: &Netns,
    wirespan: Option<&Path>,
) -> Result<Box<dyn WireGuard + Send>, WgError> {
    let resolved = match choice {
        BackendChoice::Auto if kernel::supported(netns) => BackendChoice::Kernel,
        BackendChoice::Auto => BackendChoice::Userspace,
        other => other,
    };
    let opts = match resolved {
        BackendChoice::Kernel => {
            tracing::info!(link = name, backend = "kernel", "WireGuard backend");
            return Ok(Box::new(kernel::KernelBackend::new(name, netns)?));
        }
        BackendChoice::UserspaceGo => UserspaceOptions::default(),
        BackendChoice::Userspace | BackendChoice::Auto => {
            UserspaceOptions::wirespan(wirespan_binary(name, wirespan)?)
        }
    };
    tracing::info!(
        link = name,
        backend = opts.implementation.backend_name(),
        binary = %opts.binary.display(),
        "WireGuard backend"
    );
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
