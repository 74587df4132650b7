//! WireGuard: desired device state in, per-peer observations out (`docs/kubespan.md` §6.2).
//!
//! [`diff`] (pure) compares what the device holds with what is desired and yields the
//! smallest [`WgUpdate`]: key, port and fwmark only when changed; missing peers added,
//! extra peers removed, a changed peer updated in place (allowed IPs replaced, PSK,
//! keepalive) and its endpoint written only when the desired endpoint is set and
//! differs, so a roamed endpoint survives. Peers are never replaced wholesale.
//!
//! Backends: [`userspace::UserspaceBackend`] supervises a userspace device process
//! (`wirespan wireguard` or `wireguard-go`) and speaks the UAPI text protocol on its
//! socket; [`kernel::KernelBackend`] uses
//! `wireguard-control` over netlink where the kernel has WireGuard. [`select`] picks one.
//!
//! Layout: `keys` (key types), `config` (the desired device and its validation),
//! `state` (observed state), `diff` (whole-device diff), `peers` (per-peer changes),
//! `known` (the state a backend remembers between applies), `backend` (the
//! [`WireGuard`] trait and [`select`]), `choose` (what holds the link decides first), `error`; the backends in `kernel`,
//! `userspace` (with the UAPI protocol in `uapi`). Unit tests in `tests.rs`.

pub mod choose;
pub mod kernel;
pub mod uapi;
pub mod userspace;

mod backend;
mod config;
mod diff;
mod error;
mod keys;
mod known;
mod peers;
mod state;
#[cfg(test)]
mod tests;

pub use backend::{select, select_with_binary, BackendChoice, WireGuard};
pub use config::{WgDevice, WgPeer};
pub use diff::{apply_update, diff, PeerUpdate, WgUpdate};
pub use error::WgError;
pub use keys::{PresharedKey, PrivateKey, PublicKey};
pub use known::RESYNC_INTERVAL;
pub use peers::{validate_changes, PeerChange};
pub use state::{DeviceDrops, DevicePeer, DeviceState, PeerStatus, WgStatus};

pub(crate) use diff::align_order;
pub(crate) use known::{Indexed, KnownState};
pub(crate) use peers::{apply_peer_updates, diff_peers, index_of, PeerIndex};
