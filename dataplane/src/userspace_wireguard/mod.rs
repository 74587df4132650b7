//! `wirespan wireguard`: a userspace WireGuard device with wireguard-go's contract (a
//! TUN, a UDP socket and the cross-platform UAPI socket), for hosts without the kernel
//! module.
//!
//! The Noise protocol (handshake, transport keys, replay window, cookies) is
//! `boringtun`'s `noise` core; everything around it is here. Decision logic is sans-IO
//! with time passed in: [`timers`] (the protocol's timer rules), [`allowed_ips`]
//! (routing and the source check), [`uapi_request`] (parsing `set=1` completely before
//! anything changes) and [`core`] (the device state and packet handling). The device
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
pub mod mmsg;
pub mod offload;
pub mod timers;
pub mod tun;
pub mod uapi_request;
pub mod watchdog;
