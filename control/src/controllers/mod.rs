//! Controllers of the node, one module per family.

pub mod cluster;
