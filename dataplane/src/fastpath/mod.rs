//! The eBPF marking fast path: a tc ingress classifier (tcx where the kernel has it,
//! else a clsact qdisc filter) that marks mesh-bound packets exactly as the nftables
//! prerouting chain would, with maps synced incrementally from the same
//! [`MarkingSpec`].
//!
//! ```no_run
//! # use wirespan_dataplane::{fastpath::*, markspec::MarkingSpec, netns::Netns};
//! # fn main() -> Result<(), FastPathError> {
//! let mut fp = match FastPath::attach(&Netns::current(), FastPathConfig {
//!     interfaces: Interfaces::all_except(["kubespan"]),
//!     ..FastPathConfig::default()
//! }) {
//!     Ok(fp) => fp,
//!     // Fall back to the nftables prerouting rule and say so.
//!     Err(e) if e.is_unsupported() => return Ok(()),
//!     Err(e) => return Err(e),
//! };
//! fp.apply(&MarkingSpec::default())?; // one peer change = that peer's entries only
//! let counters = fp.counters()?;
//! fp.teardown()?;
//! # Ok(()) }
//! ```
//!
//! - [`FastPath::attach`] loads the object from `wirespan-ebpf`, attaches the
//!   classifier to every selected interface of the namespace, and keeps watching the
//!   namespace (netlink) so that interfaces appearing later get it too. Ethernet
//!   interfaces get the Ethernet variant, others (tun, ipip) the layer-3 one.
//! - [`FastPath::apply`] writes only the map entries that changed (see [`sync`]).
//! - [`FastPath::teardown`] (or drop) detaches everything, removes a clsact qdisc it
//!   added, and unloads the object: nothing stays in the kernel.
//!
//! The caller keeps the nftables table for locally originated traffic (output chain)
//! and renders it with [`PreroutingMarking::FastPath`](crate::markspec::PreroutingMarking::FastPath),
//! which omits the prerouting set lookups.
//!
//! When the kernel cannot run the fast path (no bpf syscall, BPF not permitted, an
//! unknown program or map type, no tc/tcx hook), every entry point returns
//! [`FastPathError::Unsupported`]: the daemon then marks with nftables alone and says
//! so. Lookup structures: [`Lookup::PrefixHash`] (default: one hash probe per packet
//! in the common case, a few MiB of bucket arrays) or [`Lookup::Lpm`] (exact-host hash
//! then LPM trie: less memory, slower CIDR hits and misses).
//!
//! This module knows the marking spec ([`crate::markspec`]) but not the nftables
//! adapter (the `marking` module), which depends on it instead: an adapter that
//! marks with both lives with its user (`wirespan-control`) and reports this
//! module's errors through the marking error's `FastPath` variant. Submodules:
//! - `config`: [`FastPathConfig`], [`Interfaces`], [`Lookup`];
//! - `error`: [`FastPathError`], and telling missing kernel support from a failure;
//! - `programs`: [`Programs`], the loaded object: sync, test runs;
//! - `maps`: the map handles, their writes and read-back ([`MapDump`], [`Counters`]);
//! - [`sync`]: the map writes a spec or delta needs (pure); [`keys`]: map keys;
//! - `attach`: attaching to and detaching from interfaces;
//! - `worker`: the thread in the namespace that attaches to interfaces as they appear;
//! - [`testrun`]: `BPF_PROG_TEST_RUN` and crafted frames.

mod attach;
mod config;
mod error;
pub mod keys;
mod maps;
mod programs;
pub mod sync;
pub mod testrun;
mod worker;

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use self::{
    attach::{lock, Shared},
    error::program_load_error,
    sync::Structures,
    worker::{spawn_worker, Worker},
};
pub use self::{
    attach::{AttachMode, AttachedInterface},
    config::{FastPathConfig, Interfaces, Lookup},
    error::FastPathError,
    maps::{Counters, MapDump, SyncStats},
    programs::Programs,
};
use crate::{
    markspec::{MarkingSpec, PrefixDelta},
    netns::Netns,
};

/// Reads the packet counters of a [`FastPath`] without owning it.
#[derive(Clone)]
pub struct CounterReader(std::sync::Weak<Mutex<Shared>>);

impl std::fmt::Debug for CounterReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CounterReader").finish_non_exhaustive()
    }
}

impl CounterReader {
    /// The counters, or `None` once the fast path is gone (torn down or dropped) or
    /// its map cannot be read.
    #[must_use]
    pub fn read(&self) -> Option<Counters> {
        let shared = self.0.upgrade()?;
        let c = lock(&shared).programs.counters().ok();
        c
    }
}

/// The attached fast path of one network namespace. See the module docs.
pub struct FastPath {
    shared: Arc<Mutex<Shared>>,
    worker: Option<Worker>,
}

impl std::fmt::Debug for FastPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastPath")
            .field("interfaces", &self.interfaces())
            .finish_non_exhaustive()
    }
}

impl FastPath {
    /// Loads the classifier and attaches it to the selected interfaces of `netns`,
    /// now and whenever one appears. Until the first [`FastPath::apply`] the maps are
    /// empty (nothing is marked).
    ///
    /// # Errors
    /// [`FastPathError::Unsupported`] when the kernel lacks BPF or tc support; other
    /// variants for other failures. Nothing stays attached after an error.
    pub fn attach(netns: &Netns, config: FastPathConfig) -> Result<Self, FastPathError> {
        let structures = match config.lookup {
            Lookup::PrefixHash => Structures {
                phash: true,
                lpm: false,
            },
            Lookup::Lpm => Structures {
                phash: false,
                lpm: true,
            },
        };
        let mut shared = Shared {
            programs: Programs::load(structures, config.max_prefixes, &[])?,
            config,
            attached: BTreeMap::new(),
            failed: Vec::new(),
        };
        let (eth, l3) = shared.programs_for();
        for name in [eth, l3] {
            let prog = shared.programs.classifier_mut(name)?;
            prog.load().map_err(|e| program_load_error(name, e))?;
        }
        let shared = Arc::new(Mutex::new(shared));
        let worker = spawn_worker(netns.clone(), Arc::clone(&shared))?;
        Ok(Self {
            shared,
            worker: Some(worker),
        })
    }

    /// Syncs the maps to `spec` (see [`Programs::apply`]).
    ///
    /// # Errors
    /// As [`Programs::apply`].
    pub fn apply(&self, spec: &MarkingSpec) -> Result<SyncStats, FastPathError> {
        lock(&self.shared).programs.apply(spec)
    }

    /// Applies a routed-set delta to the maps (see [`Programs::apply_delta`]).
    ///
    /// # Errors
    /// As [`Programs::apply_delta`].
    pub fn apply_delta(&self, delta: &PrefixDelta) -> Result<SyncStats, FastPathError> {
        lock(&self.shared).programs.apply_delta(delta)
    }

    /// The packet counters.
    ///
    /// # Errors
    /// The counter map could not be read.
    pub fn counters(&self) -> Result<Counters, FastPathError> {
        lock(&self.shared).programs.counters()
    }

    /// A handle that reads the packet counters for as long as this fast path lives
    /// (metrics read it at scrape time while the marking owns the fast path).
    #[must_use]
    pub fn counter_reader(&self) -> CounterReader {
        CounterReader(Arc::downgrade(&self.shared))
    }

    /// The interfaces carrying the classifier now.
    #[must_use]
    pub fn interfaces(&self) -> Vec<AttachedInterface> {
        lock(&self.shared)
            .attached
            .values()
            .map(|a| a.info.clone())
            .collect()
    }

    /// Interfaces that appeared later and could not get the classifier: (name, error).
    #[must_use]
    pub fn failures(&self) -> Vec<(String, String)> {
        lock(&self.shared).failed.clone()
    }

    /// Runs a loaded classifier on a crafted packet (see [`Programs::test_run`]).
    ///
    /// # Errors
    /// As [`Programs::test_run`].
    pub fn test_run(
        &self,
        name: &str,
        packet: &[u8],
        mark: u32,
    ) -> Result<testrun::SkbRun, FastPathError> {
        lock(&self.shared).programs.test_run(name, packet, mark, 1)
    }

    /// Stops watching, detaches the classifier from every interface, removes clsact
    /// qdiscs it added, and unloads the object.
    ///
    /// # Errors
    /// A detach failed (the rest is still detached; the object is unloaded anyway).
    pub fn teardown(mut self) -> Result<(), FastPathError> {
        self.stop()
    }

    fn stop(&mut self) -> Result<(), FastPathError> {
        match self.worker.take() {
            Some(w) => w.shut_down(),
            None => Ok(()),
        }
    }
}

impl Drop for FastPath {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::warn!(error = %e, "fast-path teardown on drop");
        }
    }
}
