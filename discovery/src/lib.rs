//! wirespan-discovery: the discovery service, wire-compatible with the upstream
//! `sidero.discovery.server.Cluster` gRPC API, and the encrypting client library.
//!
//! - [`proto`]: generated message and service types of the three protobuf packages.
//! - [`server`]: the discovery server.
//! - [`client`]: the client library: blob crypto, typed affiliates, run loop.

pub mod client;
pub mod proto;
pub mod server;
