//! Controllers of the node, one module per family (`docs/runtime.md` §3–§7).

pub mod cluster;
pub mod kubespan;
pub mod network;
pub mod probe;
