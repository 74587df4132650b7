//! Controllers, one module per family (spec `resource-runtime.md` §4–§7).

pub mod network;
pub mod probe;
