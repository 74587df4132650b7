//! wirespan-control: the node's control plane.
//!
//! * [`runtime`]: a COSI-style resource runtime — resources with metadata, an in-memory
//!   watchable store, controllers with declared inputs and outputs (spec
//!   `docs/runtime.md` §1–§3).
//! * [`resources`]: the resource types of the node and the controllers that need no
//!   data plane (node identity), plus the `meta` definitions and namespaces.
//! * [`kubespan`]: pure logic of the mesh (ULA, AllowedIPs, rotation).
//! * [`controllers`]: controllers by family.
//! * [`config`]: the multi-document YAML config and its validation (a leaf: it uses no
//!   other module of the crate).
//! * [`config_loader`]: takes a config file or API text whole or not at all, into the
//!   store, keeping the last good copy in the state dir.
//! * [`files`]: atomic 0600 writes and private directories of the state dir.
//! * [`secret`]: secret values that never print.
//! * [`api`]: the resource API (tonic over a unix socket) served to the CLI.
//! * `testing` (tests and the `testing` feature only): assert-eventually helpers and small
//!   resource kinds for controller tests. The product never enables it.

pub mod api;
pub mod config;
pub mod config_loader;
pub mod controllers;
pub mod files;
/// The body of the `config_parse` fuzz target (`fuzzing` feature).
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod kubespan;
pub mod resources;
pub mod runtime;
pub mod secret;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
