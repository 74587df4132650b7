//! Errors of the WireGuard backends.

use crate::error::Invalid;

/// Errors of the WireGuard backends.
#[derive(Debug, thiserror::Error)]
pub enum WgError {
    /// The desired state is invalid; nothing was written.
    #[error("invalid WireGuard device: {0}")]
    Invalid(#[from] Invalid),
    /// wireguard-go could not be started or did not come up.
    #[error("userspace WireGuard for {name}: {message}")]
    Daemon {
        /// Interface.
        name: String,
        /// What went wrong.
        message: String,
    },
    /// UAPI or netlink I/O failed.
    #[error("WireGuard {op} on {name}: {source}")]
    Io {
        /// What we did.
        op: &'static str,
        /// Interface.
        name: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The device refused the configuration (errno from UAPI or netlink); with the
    /// userspace backend the port is set first, so a refused port changes nothing.
    #[error("WireGuard {name} refused the configuration: errno {errno}")]
    Refused {
        /// Interface.
        name: String,
        /// errno reported.
        errno: i32,
    },
    /// The device answered something we cannot parse.
    #[error("WireGuard {name}: unparsable answer: {message}")]
    Protocol {
        /// Interface.
        name: String,
        /// Which line or field.
        message: String,
    },
    /// The link is held by something the `--wireguard` asked for cannot drive (a
    /// userspace device for `kernel`, a kernel link for a userspace choice): refused
    /// once, at the backend's creation.
    #[error(
        "link {name} is {held_by}, which --wireguard {asked} cannot run: stop it or delete \
         the link, or run the node with --wireguard auto (it adopts a kernel link or a \
         running userspace device)"
    )]
    WrongBackend {
        /// Interface.
        name: String,
        /// The `--wireguard` value asked for.
        asked: &'static str,
        /// What holds the link.
        held_by: String,
    },
    /// The backend was already torn down, or a different device name was asked for.
    #[error("WireGuard backend for {0} is not usable: {1}")]
    State(String, &'static str),
}
