//! The [`WireGuard`] backend trait and the choice between the kernel and the
//! userspace backend ([`select`]).

use super::{kernel, userspace, PeerChange, WgDevice, WgError, WgStatus};
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
    /// supervisor restarted a dead wireguard-go): the caller should apply the whole
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
    /// Which implementation runs the device: `kernel` or `userspace` (reported in the
    /// manager's status, so an operator sees what `auto` chose).
    fn backend(&self) -> &'static str;
}

/// Which backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// Kernel if the kernel supports WireGuard, else userspace.
    #[default]
    Auto,
    /// Kernel (netlink).
    Kernel,
    /// Userspace (`wireguard-go`).
    Userspace,
}

/// Builds the backend for device `name` in `netns`.
///
/// # Errors
/// The kernel backend was forced but is unavailable, or the probe failed.
pub fn select(
    choice: BackendChoice,
    name: &str,
    netns: &Netns,
) -> Result<Box<dyn WireGuard + Send>, WgError> {
    let kernel = match choice {
        BackendChoice::Userspace => false,
        BackendChoice::Kernel => true,
        BackendChoice::Auto => kernel::supported(netns),
    };
    tracing::info!(
        link = name,
        backend = if kernel { "kernel" } else { "userspace" },
        "WireGuard backend"
    );
    if kernel {
        Ok(Box::new(kernel::KernelBackend::new(name, netns)?))
    } else {
        Ok(Box::new(userspace::UserspaceBackend::new(
            name,
            netns.clone(),
        )))
    }
}
