//! The desired device ([`WgDevice`]) and its peers ([`WgPeer`]), with validation.

use std::net::SocketAddr;

use ipnet::IpNet;

use super::{PresharedKey, PrivateKey, PublicKey};
use crate::error::{check_ifname, Invalid};

/// One desired peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WgPeer {
    /// The peer's public key (its identity).
    pub public_key: PublicKey,
    /// Preshared key (the cluster secret in KubeSpan).
    pub preshared_key: Option<PresharedKey>,
    /// Persistent keepalive in seconds, 0 = off.
    pub persistent_keepalive: u16,
    /// Endpoint to set; `None` leaves WireGuard's current (possibly roamed) one alone.
    pub endpoint: Option<SocketAddr>,
    /// Allowed IPs (host bits must be zero).
    pub allowed_ips: Vec<IpNet>,
}

/// The desired device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WgDevice {
    /// Interface name (unique per host when the UAPI socket directory is shared).
    pub name: String,
    /// Private key.
    pub private_key: PrivateKey,
    /// UDP listen port, 0 = don't care.
    pub listen_port: u16,
    /// Mark on WireGuard's own packets (0 = none).
    pub fwmark: u32,
    /// Peers.
    pub peers: Vec<WgPeer>,
}

impl WgDevice {
    /// Checks every field; nothing is written when this fails.
    ///
    /// # Errors
    /// The first invalid field.
    pub fn validate(&self) -> Result<(), Invalid> {
        check_ifname("name", &self.name)?;
        if self.private_key.0 == [0; 32] {
            return Err(Invalid::new("private_key", "must not be all zeros"));
        }
        let own = self.private_key.public_key();
        let mut seen = std::collections::HashSet::new();
        for (i, p) in self.peers.iter().enumerate() {
            validate_peer(&format!("peers[{i}]"), p, Some(&own))?;
            if !seen.insert(&p.public_key) {
                return Err(Invalid::new(
                    format!("peers[{i}].public_key"),
                    format!("duplicate peer {}", p.public_key),
                ));
            }
        }
        Ok(())
    }
}

/// The checks of one peer on its own; `at` is its path (`peers[3]`).
pub(super) fn validate_peer(at: &str, p: &WgPeer, own: Option<&PublicKey>) -> Result<(), Invalid> {
    let f = |s: &str| format!("{at}.{s}");
    if p.public_key.0 == [0; 32] {
        return Err(Invalid::new(f("public_key"), "must not be all zeros"));
    }
    if Some(&p.public_key) == own {
        return Err(Invalid::new(
            f("public_key"),
            "is the device's own public key",
        ));
    }
    if let Some(ep) = p.endpoint {
        if ep.port() == 0 || ep.ip().is_unspecified() {
            return Err(Invalid::new(
                f("endpoint"),
                format!("{ep} is not a usable endpoint"),
            ));
        }
    }
    for (j, a) in p.allowed_ips.iter().enumerate() {
        if a.trunc() != *a {
            return Err(Invalid::new(
                f(&format!("allowed_ips[{j}]")),
                format!("{a} has host bits set (expected {})", a.trunc()),
            ));
        }
    }
    Ok(())
}
