//! The nftables marking table (`docs/kubespan.md` §6.6): marks packets bound for the mesh so policy
//! routing sends them into the WireGuard link.
//!
//! [`render()`] turns a [`MarkingSpec`] into a [`Ruleset`] (pure). [`NftMarking`] reads
//! our table with `nft -j list table`, and then either changes only set elements (the
//! steady state: chains are never touched) or, when the structure differs (first
//! apply, MTU or mark change, someone flushed or edited the table), replaces the whole
//! table. Either way it is one atomic transaction touching only our table: small
//! element changes go straight to the kernel as one nf_tables netlink batch (`nft`
//! would fetch every element first), everything else is one `nft -j -f -`. While the
//! ruleset generation shows no transaction but ours, the table is not read at all,
//! and a spec that differs from the previous one in a few prefixes is re-rendered
//! incrementally: a steady-state change costs time in proportion to the change.
//! [`Marking::apply_delta`] goes further: given the change itself ([`PrefixDelta`]),
//! no list is compared at all, and the element changes it renders are committed
//! straight onto the remembered table state.
//!
//! Every rule carries a comment naming what it does and its parameters
//! (`wirespan:mss:v4_hosts:1368`); the comments of the listed rules are compared with
//! the rendered ones to detect edits without comparing nft's normalised expressions.
//!
//! The spec ([`MarkingSpec`], [`PrefixDelta`]) lives in [`crate::markspec`], shared
//! with the eBPF fast path, and is re-exported here. The submodules, in the order an
//! apply uses them:
//! - `ruleset`: the table as plain values, and [`render()`];
//! - `incremental`: re-rendering only what a few changed prefixes touch;
//! - `listing`: the kernel's table read back ([`parse_table`]);
//! - `plan`: what to write to go from one to the other ([`plan()`]);
//! - `batch`: the nft JSON transactions;
//! - `nft`: the adapter, [`NftMarking`];
//! - `error`: [`MarkingError`], the only place this module names [`crate::fastpath`].

mod batch;
mod error;
mod incremental;
mod listing;
mod nft;
mod plan;
mod ruleset;
#[cfg(test)]
mod tests;

pub use batch::{element_batch, full_batch};
pub use error::MarkingError;
pub use listing::{parse_table, TableState};
pub use nft::NftMarking;
pub use plan::{expected_state, plan, Plan, SetDiff};
pub use ruleset::{
    render, ChainDef, Family, RuleDef, Ruleset, SetDef, CHAIN_OUTGOING, CHAIN_PREROUTING,
};

// The spec is shared with the fast path; these keep `marking::MarkingSpec` and the
// rest working.
pub use crate::markspec::{
    AppliedSpec, MarkingSpec, PrefixDelta, PrefixLists, PreroutingMarking, SetLayout, DEFAULT_TABLE,
};

/// Observed state of the marking table.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MarkingStatus {
    /// Whether our table exists.
    pub present: bool,
    /// Elements per set name.
    pub elements: Vec<(String, usize)>,
    /// Rule counters: (rule comment, packets, bytes).
    pub counters: Vec<(String, u64, u64)>,
}

/// The marking adapter interface (implemented by [`NftMarking`] and the fake).
pub trait Marking {
    /// Makes the kernel hold exactly the table rendered from `spec`, with the least
    /// change. Returns whether anything was written.
    ///
    /// # Errors
    /// Invalid spec (nothing written) or nft failure (previous state kept).
    fn apply(&mut self, spec: &MarkingSpec) -> Result<bool, MarkingError>;
    /// Applies `delta` to the spec last applied, writing only what it changes; the
    /// other fields stay as last applied. Returns whether anything was written.
    ///
    /// # Errors
    /// No spec applied yet, an invalid delta (nothing written), or as [`Marking::apply`].
    fn apply_delta(&mut self, delta: &PrefixDelta) -> Result<bool, MarkingError>;
    /// Reads the table's sets and counters.
    ///
    /// # Errors
    /// nft failure.
    fn observe(&mut self) -> Result<MarkingStatus, MarkingError>;
    /// Removes our table (and nothing else). Idempotent.
    ///
    /// # Errors
    /// nft failure.
    fn teardown(&mut self) -> Result<(), MarkingError>;
    /// Number of write transactions so far (for tests and metrics).
    fn transactions(&self) -> u64;
}
