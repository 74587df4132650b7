//! Where the device core's output goes, as a trait: the device loop collects it for
//! the socket and the TUN (`batch::Outbox`), tests and fuzzing capture it.

use std::net::SocketAddr;

/// Where the device's output goes: the UDP socket and the TUN.
pub trait Io {
    /// Sends a datagram to a peer.
    fn send(&mut self, to: SocketAddr, datagram: &[u8]);
    /// Writes a decrypted IP packet to the TUN.
    fn write_tun(&mut self, packet: &[u8]);
}
