//! Parity of the in-memory fakes (`wirespan_dataplane::fake`) with the real adapters.
//!
//! Controllers are tested against the fakes, so a fake that drifts from the kernel
//! makes those tests prove nothing. Each test here writes one scenario of several
//! steps once, runs every step on the fake and on the real adapter (in a throwaway
//! network namespace), and after each step compares what the call returned and what
//! each side then reports: the adapter's own read functions plus the full state read
//! behind its back (`wg show dump`, `nft -j list`, the fake's handle). A difference
//! fails with a diff naming the step.
//!
//! Only what is legitimately kernel-specific is normalised away; every normalisation
//! is a comment next to the code doing it.
//!
//! One module per adapter; `runner` holds the step runner and its diff.

#[path = "../support/ran.rs"]
mod ran;

mod marking;
mod network;
mod routing;
mod runner;
mod sysctl;
mod wireguard;
