//! `wirespan wireguard`: a userspace WireGuard device with wireguard-go's contract (a
//! TUN, a UDP socket and the cross-platform UAPI socket), for hosts without the kernel
//! module.
//!
//! The Noise protocol is our own ([`noise`]: handshake, transport keypairs, replay
//! window, cookies, load control). Decision logic is sans-IO with time passed in:
//! [`noise`], [`timers`] (the protocol's timer rules), [`peer`] (one peer's protocol
//! state and the rules against hostile senders), [`allowed_ips`] (routing and the
//! source check), [`uapi_request`] (parsing `set=1` completely before anything
//! changes) and [`core`] (the device state and packet handling). The device
//! loop ([`device`]) owns the TUN, the socket, the UAPI listener and the signals;
//! [`watchdog`] ends the process when one of its threads panics, returns or stalls, so
//! that its supervisor restarts it ([`fault`] injects such faults, for tests only).
//! `docs/userspace-wireguard.md` has the library evaluation and the design.

pub mod allowed_ips;
pub mod batch;
pub mod coalesce;
pub mod core;
pub mod device;
pub mod fault;
pub mod indices;
pub mod io;
pub mod mmsg;
pub mod noise;
pub mod offload;
pub mod peer;
pub mod port;
#[cfg(any(test, feature = "fuzzing"))]
pub mod session_fuzz;
pub mod timers;
pub mod tun;
pub mod uapi_request;
pub mod watchdog;
