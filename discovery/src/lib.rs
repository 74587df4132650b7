//! wirespan-discovery: the discovery service, wire-compatible with the upstream
//! `sidero.discovery.server.Cluster` gRPC API, and the encrypting client library.
//!
//! - [`proto`]: generated message and service types of the three protobuf packages.
//! - [`server`]: the discovery server.
//! - [`relay`]: the pair token both sides of the server relay compute or check (the
//!   relay itself is [`server::relay`], a node's allocation call [`client::relay`]).
//! - [`client`]: the client library: blob crypto, typed affiliates, run loop.
//! - [`redact`]: what logs print instead of cluster IDs.
//! - [`text`]: sanitising and escaping untrusted names from affiliates.

pub mod client;
/// The bodies of the cargo-fuzz targets of this crate's code (`fuzzing` feature).
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod proto;
pub mod redact;
pub mod relay;
pub mod server;
pub mod text;

/// Helpers of the unit tests.
#[cfg(test)]
mod test_util {
    /// Bytes from hex text; whitespace is ignored (vectors are wrapped for reading).
    pub(crate) fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }
}
