//! Controllers of the node, one module per family (spec `resource-runtime.md` §3–§7).

pub mod cluster;
pub mod kubespan;
pub mod network;
pub mod probe;
