//! The eBPF marking fast path: a tc ingress classifier (tcx where the kernel has it,
//! else a clsact qdisc filter) that marks mesh-bound packets exactly as the nftables
//! prerouting chain would, with maps synced incrementally from the same
//! [`MarkingSpec`].
//!
//! ```no_run
//! # use wirespan_dataplane::{fastpath::*, marking::MarkingSpec, netns::Netns};
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
//! and renders it with [`crate::marking::PreroutingMarking::FastPath`], which omits
//! the prerouting set lookups.
//!
//! When the kernel cannot run the fast path (no bpf syscall, BPF not permitted, an
//! unknown program or map type, no tc/tcx hook), every entry point returns
//! [`FastPathError::Unsupported`]: the daemon then marks with nftables alone and says
//! so. Lookup structures: [`Lookup::PrefixHash`] (default: one hash probe per packet
//! in the common case, a few MiB of bucket arrays) or [`Lookup::Lpm`] (exact-host hash
//! then LPM trie: less memory, slower CIDR hits and misses).

pub mod keys;
pub mod sync;
pub mod testrun;

use std::{
    collections::BTreeMap,
    error::Error as StdError,
    io,
    os::fd::{AsFd, BorrowedFd},
    sync::{Arc, Mutex, PoisonError},
    thread::JoinHandle,
};

use aya::{
    maps::{Array, HashMap as BpfHashMap, LpmTrie, MapData, MapError, PerCpuArray},
    programs::{
        tc::{SchedClassifierLinkId, TcAttachOptions},
        LinkOrder, ProgramError, SchedClassifier, TcAttachType, Xdp,
    },
    Ebpf, EbpfError, EbpfLoader,
};
use futures::StreamExt;
use ipnet::IpNet;
use serde::Deserialize;

use self::{
    keys::{Bits6, Config, Key4, Key6, Slot},
    sync::{MapState, Occupancy, Plan, Structures},
};
use crate::{
    error::Invalid,
    markspec::{MarkingSpec, PrefixDelta},
    netns::Netns,
    watch::{Change, NetEvent, Watcher},
};

/// Which lookup structure the classifier uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Lookup {
    /// Hash maps keyed by (masked address, length), probing only the lengths present
    /// in the destination's bucket: about one hash lookup per packet.
    #[default]
    PrefixHash,
    /// Exact-host hash, then an LPM trie: less memory, a trie walk for CIDR hits and
    /// misses.
    Lpm,
}

/// The interfaces whose ingress gets the classifier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Interfaces {
    /// Every interface except `lo` and these (the mesh link), including interfaces
    /// that appear later.
    AllExcept(Vec<String>),
    /// Only these, whenever they exist.
    Only(Vec<String>),
}

impl Interfaces {
    /// Every interface except `lo` and `names`.
    pub fn all_except<S: Into<String>>(names: impl IntoIterator<Item = S>) -> Self {
        Self::AllExcept(names.into_iter().map(Into::into).collect())
    }

    /// Whether interface `name` is selected.
    #[must_use]
    pub fn selects(&self, name: &str) -> bool {
        match self {
            Self::AllExcept(ex) => name != "lo" && !ex.iter().any(|e| e == name),
            Self::Only(only) => only.iter().any(|o| o == name),
        }
    }
}

impl Default for Interfaces {
    fn default() -> Self {
        Self::AllExcept(Vec::new())
    }
}

/// How the fast path is set up. The marks themselves come with each
/// [`MarkingSpec`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FastPathConfig {
    /// Where the classifier goes.
    pub interfaces: Interfaces,
    /// Lookup structure.
    pub lookup: Lookup,
    /// Capacity of each prefix map (per family); a spec needing more is refused
    /// before anything is written.
    pub max_prefixes: u32,
}

impl Default for FastPathConfig {
    fn default() -> Self {
        Self {
            interfaces: Interfaces::default(),
            lookup: Lookup::default(),
            max_prefixes: wirespan_ebpf::DEFAULT_ENTRIES,
        }
    }
}

/// Errors of the fast path.
#[derive(Debug, thiserror::Error)]
pub enum FastPathError {
    /// The desired state is invalid; nothing was written.
    #[error("invalid marking spec: {0}")]
    Invalid(#[from] Invalid),
    /// The kernel cannot run the fast path (no bpf syscall, BPF not permitted, program
    /// or map type unknown, verifier refused, no tc/tcx hook). Mark with nftables
    /// instead.
    #[error("the kernel cannot run the eBPF fast path: {what}: {source}")]
    Unsupported {
        /// What failed.
        what: String,
        /// Why.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
    /// More prefixes than a map holds; nothing was written.
    #[error("{map}: {needed} entries needed, capacity {capacity} (raise max_prefixes)")]
    Capacity {
        /// The map.
        map: &'static str,
        /// Entries the spec needs.
        needed: usize,
        /// Its capacity.
        capacity: u32,
    },
    /// Attaching to an interface failed for a reason other than missing support.
    #[error("attaching the classifier to {interface}: {source}")]
    Attach {
        /// The interface.
        interface: String,
        /// Why.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
    /// A map operation failed; the next apply retries from the last good state.
    #[error("map {map}: {source}")]
    Map {
        /// The map.
        map: &'static str,
        /// Why.
        #[source]
        source: MapError,
    },
    /// The object lacks something the loader expects (a build mismatch).
    #[error("BPF object: {0}")]
    Object(String),
    /// `BPF_PROG_TEST_RUN` refused a run (for example an IP frame shorter than its
    /// header: the kernel checks that before running the program).
    #[error("BPF_PROG_TEST_RUN of {program}: {source}")]
    TestRun {
        /// The program.
        program: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The namespace could not be entered or watched.
    #[error("network namespace: {0}")]
    Netns(#[source] io::Error),
    /// A delta was given before any spec was applied.
    #[error("a routed-set delta needs a spec applied first")]
    NotApplied,
}

impl FastPathError {
    /// Whether the kernel lacks BPF or tc support (fall back to nftables marking).
    #[must_use]
    pub fn is_unsupported(&self) -> bool {
        matches!(self, Self::Unsupported { .. })
    }
}

/// Errnos that mean "this kernel cannot do it" rather than "something went wrong".
fn unsupported_errno(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::ENOSYS
                | libc::EPERM
                | libc::EOPNOTSUPP
                | libc::EINVAL
                | libc::E2BIG
                | libc::EACCES
        )
    )
}

/// The first `io::Error` in an error's source chain.
fn find_io<'a>(e: &'a (dyn StdError + 'static)) -> Option<&'a io::Error> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<io::Error>() {
            return Some(io);
        }
        cur = err.source();
    }
    None
}

fn load_error(what: impl Into<String>, e: impl StdError + Send + Sync + 'static) -> FastPathError {
    FastPathError::Unsupported {
        what: what.into(),
        source: Box::new(e),
    }
}

fn program_load_error(name: &str, e: ProgramError) -> FastPathError {
    if let ProgramError::LoadError {
        io_error,
        verifier_log,
    } = &e
    {
        let log = verifier_log.to_string();
        let tail: Vec<&str> = log.lines().rev().take(6).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        return FastPathError::Unsupported {
            what: format!("loading program {name}"),
            source: format!("{io_error}; verifier: {}", tail.join(" | ")).into(),
        };
    }
    load_error(format!("loading program {name}"), e)
}

/// Packet counters of the classifier, summed over CPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    /// Destination in the routed set: marked.
    pub hit: u64,
    /// Parsed, destination not in the set.
    pub miss: u64,
    /// Carried the device mark: left alone.
    pub skipped: u64,
    /// Not parsable as IPv4/IPv6 (or VLAN-tagged on the parent): left alone.
    pub unparsed: u64,
}

/// What one [`Programs::apply`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SyncStats {
    /// Prefixes inserted (or rewritten after a mark change).
    pub inserted: usize,
    /// Prefixes removed.
    pub removed: usize,
    /// Bucket bitmaps written.
    pub buckets: usize,
    /// Whether the config entry was written.
    pub config: bool,
}

impl SyncStats {
    /// Total map writes.
    #[must_use]
    pub fn writes(&self) -> usize {
        self.inserted + self.removed + self.buckets + usize::from(self.config)
    }
}

/// The lookup maps as the kernel holds them (see [`Programs::dump`]): keys as plain
/// tuples, values the route marks; buckets and their bitmaps only where non-zero.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MapDump {
    /// Prefix hash, IPv4: (address, mask).
    pub phash_v4: BTreeMap<(u32, u32), u32>,
    /// Prefix hash, IPv6: (hi, lo, id).
    pub phash_v6: BTreeMap<(u64, u64, u64), u32>,
    /// Exact hosts, IPv4.
    pub hosts_v4: BTreeMap<u32, u32>,
    /// Exact hosts, IPv6.
    pub hosts_v6: BTreeMap<[u8; 16], u32>,
    /// LPM trie, IPv4: (length, address).
    pub lpm_v4: BTreeMap<(u32, u32), u32>,
    /// LPM trie, IPv6: (length, address).
    pub lpm_v6: BTreeMap<(u32, [u8; 16]), u32>,
    /// IPv4 bucket bitmaps.
    pub buckets_v4: BTreeMap<u32, u64>,
    /// IPv6 bucket bitmaps: (lo, hi).
    pub buckets_v6: BTreeMap<u32, (u64, u64)>,
    /// The config entry.
    pub config: Config,
}

/// Typed handles of the maps.
struct Maps {
    config: Array<MapData, Config>,
    counters: PerCpuArray<MapData, u64>,
    phash_v4: BpfHashMap<MapData, Key4, u32>,
    phash_v6: BpfHashMap<MapData, Key6, u32>,
    buckets_v4: Array<MapData, u64>,
    buckets_v6: Array<MapData, Bits6>,
    hosts_v4: BpfHashMap<MapData, u32, u32>,
    hosts_v6: BpfHashMap<MapData, [u8; 16], u32>,
    lpm_v4: LpmTrie<MapData, u32, u32>,
    lpm_v6: LpmTrie<MapData, [u8; 16], u32>,
}

fn take<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, FastPathError>
where
    T: TryFrom<aya::maps::Map, Error = MapError>,
{
    let map = ebpf
        .take_map(name)
        .ok_or_else(|| FastPathError::Object(format!("map {name} missing")))?;
    T::try_from(map).map_err(|source| FastPathError::Map { map: name, source })
}

fn absent_ok(r: Result<(), MapError>, map: &'static str) -> Result<(), FastPathError> {
    match r {
        Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        r => r.map_err(|source| FastPathError::Map { map, source }),
    }
}

/// The loaded BPF object and its maps, not attached anywhere: what [`FastPath`]
/// attaches, and what tests and benchmarks run with `BPF_PROG_TEST_RUN`.
pub struct Programs {
    ebpf: Ebpf,
    maps: Maps,
    structures: Structures,
    max_prefixes: u32,
    state: MapState,
}

impl std::fmt::Debug for Programs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Programs")
            .field("structures", &self.structures)
            .field("max_prefixes", &self.max_prefixes)
            .field("occupancy", &self.state.occupancy())
            .finish_non_exhaustive()
    }
}

impl Programs {
    /// Loads the object with the maps of `structures` (the others shrink to one
    /// entry) and loads `programs` (names from `wirespan_ebpf::PROG_*`).
    ///
    /// # Errors
    /// [`FastPathError::Unsupported`] when the kernel refuses the maps or programs.
    pub fn load(
        structures: Structures,
        max_prefixes: u32,
        programs: &[&str],
    ) -> Result<Self, FastPathError> {
        if max_prefixes == 0 {
            return Err(Invalid::new("max_prefixes", "must be at least 1").into());
        }
        let small = |on: bool, n: u32| if on { n } else { 1 };
        let mut loader = EbpfLoader::new();
        for (name, on) in [
            (wirespan_ebpf::MAP_PHASH_V4, structures.phash),
            (wirespan_ebpf::MAP_PHASH_V6, structures.phash),
            (wirespan_ebpf::MAP_HOSTS_V4, structures.lpm),
            (wirespan_ebpf::MAP_HOSTS_V6, structures.lpm),
            (wirespan_ebpf::MAP_LPM_V4, structures.lpm),
            (wirespan_ebpf::MAP_LPM_V6, structures.lpm),
        ] {
            loader.map_max_entries(name, small(on, max_prefixes));
        }
        for name in [wirespan_ebpf::MAP_BUCKETS_V4, wirespan_ebpf::MAP_BUCKETS_V6] {
            loader.map_max_entries(name, small(structures.phash, wirespan_ebpf::BUCKETS));
        }
        let mut ebpf = loader
            .load(wirespan_ebpf::marking_object())
            .map_err(|e| match e {
                EbpfError::MapError(m) => load_error("creating maps", m),
                e => load_error("loading the BPF object", e),
            })?;
        for name in programs {
            let prog = ebpf
                .program_mut(name)
                .ok_or_else(|| FastPathError::Object(format!("program {name} missing")))?;
            let loaded = match prog {
                aya::programs::Program::SchedClassifier(p) => p.load(),
                aya::programs::Program::Xdp(p) => p.load(),
                _ => return Err(FastPathError::Object(format!("{name}: unexpected type"))),
            };
            loaded.map_err(|e| program_load_error(name, e))?;
        }
        let maps = Maps {
            config: take(&mut ebpf, wirespan_ebpf::MAP_CONFIG)?,
            counters: take(&mut ebpf, wirespan_ebpf::MAP_COUNTERS)?,
            phash_v4: take(&mut ebpf, wirespan_ebpf::MAP_PHASH_V4)?,
            phash_v6: take(&mut ebpf, wirespan_ebpf::MAP_PHASH_V6)?,
            buckets_v4: take(&mut ebpf, wirespan_ebpf::MAP_BUCKETS_V4)?,
            buckets_v6: take(&mut ebpf, wirespan_ebpf::MAP_BUCKETS_V6)?,
            hosts_v4: take(&mut ebpf, wirespan_ebpf::MAP_HOSTS_V4)?,
            hosts_v6: take(&mut ebpf, wirespan_ebpf::MAP_HOSTS_V6)?,
            lpm_v4: take(&mut ebpf, wirespan_ebpf::MAP_LPM_V4)?,
            lpm_v6: take(&mut ebpf, wirespan_ebpf::MAP_LPM_V6)?,
        };
        Ok(Self {
            ebpf,
            maps,
            structures,
            max_prefixes,
            state: MapState::new(structures),
        })
    }

    /// The fd of loaded program `name`, for `BPF_PROG_TEST_RUN`.
    ///
    /// # Errors
    /// Unknown or not loaded program.
    pub fn program_fd(&self, name: &str) -> Result<BorrowedFd<'_>, FastPathError> {
        let prog = self
            .ebpf
            .program(name)
            .ok_or_else(|| FastPathError::Object(format!("program {name} missing")))?;
        let fd = match prog {
            aya::programs::Program::SchedClassifier(p) => p.fd(),
            aya::programs::Program::Xdp(p) => p.fd(),
            _ => return Err(FastPathError::Object(format!("{name}: unexpected type"))),
        }
        .map_err(|e| FastPathError::Object(format!("{name}: {e}")))?;
        Ok(fd.as_fd())
    }

    /// Runs tc program `name` on `packet` entering with `mark`
    /// (see [`testrun::run_skb`]).
    ///
    /// # Errors
    /// Unknown program, or the kernel refused the run.
    pub fn test_run(
        &self,
        name: &str,
        packet: &[u8],
        mark: u32,
        repeat: u32,
    ) -> Result<testrun::SkbRun, FastPathError> {
        testrun::run_skb(self.program_fd(name)?, packet, mark, repeat).map_err(|source| {
            FastPathError::TestRun {
                program: name.to_owned(),
                source,
            }
        })
    }

    /// Attaches XDP program `name` to `interface` (of the calling thread's namespace).
    ///
    /// # Errors
    /// Unknown program or interface, or the kernel refused.
    pub fn attach_xdp(&mut self, name: &str, interface: &str) -> Result<(), FastPathError> {
        let prog: &mut Xdp = self
            .ebpf
            .program_mut(name)
            .ok_or_else(|| FastPathError::Object(format!("program {name} missing")))?
            .try_into()
            .map_err(|e: ProgramError| FastPathError::Object(format!("{name}: {e}")))?;
        prog.attach(interface, aya::programs::XdpMode::default())
            .map_err(|e| FastPathError::Attach {
                interface: interface.to_owned(),
                source: Box::new(e),
            })?;
        Ok(())
    }

    /// Entry counts of the maps.
    #[must_use]
    pub fn occupancy(&self) -> Occupancy {
        self.state.occupancy()
    }

    /// Makes the maps hold `spec`'s routed set and marks, writing only what changed.
    ///
    /// # Errors
    /// Invalid spec or capacity exceeded (nothing written), or a map write failed (the
    /// next apply retries from the last good state).
    pub fn apply(&mut self, spec: &MarkingSpec) -> Result<SyncStats, FastPathError> {
        spec.validate()?;
        let (plan, next) = self.state.plan(spec);
        self.check_capacity(next.occupancy())?;
        let stats = self.write(&plan)?;
        let old = std::mem::replace(&mut self.state, next);
        self.state.adopt_index(old);
        Ok(stats)
    }

    /// Applies `delta` to the routed set last applied (marks unchanged), writing only
    /// what it changes, in time proportional to the delta: only its prefixes are
    /// planned against the remembered state, and the capacity check uses the entry
    /// counts updated by the delta.
    ///
    /// # Errors
    /// [`FastPathError::NotApplied`] before the first [`Programs::apply`]; an invalid
    /// delta or capacity exceeded (nothing written); a map write failed (the state
    /// stays as before the delta, to retry from).
    pub fn apply_delta(&mut self, delta: &PrefixDelta) -> Result<SyncStats, FastPathError> {
        if !self.state.is_applied() {
            return Err(FastPathError::NotApplied);
        }
        let (plan, changes) = self.state.plan_delta(delta)?;
        self.check_capacity(changes.occupancy)?;
        let stats = self.write(&plan)?;
        self.state.commit_delta(delta, &plan, changes);
        Ok(stats)
    }

    fn check_capacity(&self, occ: Occupancy) -> Result<(), FastPathError> {
        let cap = self.max_prefixes as usize;
        for (map, needed) in [
            (wirespan_ebpf::MAP_PHASH_V4, occ.phash.0),
            (wirespan_ebpf::MAP_PHASH_V6, occ.phash.1),
            (wirespan_ebpf::MAP_HOSTS_V4, occ.hosts.0),
            (wirespan_ebpf::MAP_HOSTS_V6, occ.hosts.1),
            (wirespan_ebpf::MAP_LPM_V4, occ.lpm.0),
            (wirespan_ebpf::MAP_LPM_V6, occ.lpm.1),
        ] {
            if needed > cap {
                return Err(FastPathError::Capacity {
                    map,
                    needed,
                    capacity: self.max_prefixes,
                });
            }
        }
        Ok(())
    }

    fn write(&mut self, plan: &Plan) -> Result<SyncStats, FastPathError> {
        let m = &mut self.maps;
        let map_err = |map: &'static str| move |source| FastPathError::Map { map, source };
        let mark = plan.route_mark;
        for p in &plan.insert {
            if self.structures.phash {
                match keys::slot(p) {
                    Slot::V4(k, _, _) => m
                        .phash_v4
                        .insert(k, mark, 0)
                        .map_err(map_err(wirespan_ebpf::MAP_PHASH_V4))?,
                    Slot::V6(_, 128, _) => {} // ::/0 is a config flag
                    Slot::V6(k, _, _) => m
                        .phash_v6
                        .insert(k, mark, 0)
                        .map_err(map_err(wirespan_ebpf::MAP_PHASH_V6))?,
                }
            }
            if self.structures.lpm {
                match p {
                    IpNet::V4(n) if sync::is_host_prefix(p) => m
                        .hosts_v4
                        .insert(keys::host4(n.addr()), mark, 0)
                        .map_err(map_err(wirespan_ebpf::MAP_HOSTS_V4))?,
                    IpNet::V6(n) if sync::is_host_prefix(p) => m
                        .hosts_v6
                        .insert(n.addr().octets(), mark, 0)
                        .map_err(map_err(wirespan_ebpf::MAP_HOSTS_V6))?,
                    IpNet::V4(n) => m
                        .lpm_v4
                        .insert(&keys::lpm4(n), mark, 0)
                        .map_err(map_err(wirespan_ebpf::MAP_LPM_V4))?,
                    IpNet::V6(n) => m
                        .lpm_v6
                        .insert(&keys::lpm6(n), mark, 0)
                        .map_err(map_err(wirespan_ebpf::MAP_LPM_V6))?,
                }
            }
        }
        for (b, bits) in &plan.buckets_v4 {
            m.buckets_v4
                .set(*b, bits, 0)
                .map_err(map_err(wirespan_ebpf::MAP_BUCKETS_V4))?;
        }
        for (b, bits) in &plan.buckets_v6 {
            m.buckets_v6
                .set(*b, bits, 0)
                .map_err(map_err(wirespan_ebpf::MAP_BUCKETS_V6))?;
        }
        if let Some(cfg) = &plan.config {
            m.config
                .set(0, cfg, 0)
                .map_err(map_err(wirespan_ebpf::MAP_CONFIG))?;
        }
        for p in &plan.remove {
            if self.structures.phash {
                match keys::slot(p) {
                    Slot::V4(k, _, _) => {
                        absent_ok(m.phash_v4.remove(&k), wirespan_ebpf::MAP_PHASH_V4)?;
                    }
                    Slot::V6(_, 128, _) => {}
                    Slot::V6(k, _, _) => {
                        absent_ok(m.phash_v6.remove(&k), wirespan_ebpf::MAP_PHASH_V6)?;
                    }
                }
            }
            if self.structures.lpm {
                match p {
                    IpNet::V4(n) if sync::is_host_prefix(p) => absent_ok(
                        m.hosts_v4.remove(&keys::host4(n.addr())),
                        wirespan_ebpf::MAP_HOSTS_V4,
                    )?,
                    IpNet::V6(n) if sync::is_host_prefix(p) => absent_ok(
                        m.hosts_v6.remove(&n.addr().octets()),
                        wirespan_ebpf::MAP_HOSTS_V6,
                    )?,
                    IpNet::V4(n) => {
                        absent_ok(m.lpm_v4.remove(&keys::lpm4(n)), wirespan_ebpf::MAP_LPM_V4)?;
                    }
                    IpNet::V6(n) => {
                        absent_ok(m.lpm_v6.remove(&keys::lpm6(n)), wirespan_ebpf::MAP_LPM_V6)?;
                    }
                }
            }
        }
        Ok(SyncStats {
            inserted: plan.insert.len(),
            removed: plan.remove.len(),
            buckets: plan.buckets_v4.len() + plan.buckets_v6.len(),
            config: plan.config.is_some(),
        })
    }

    /// Reads every lookup map back from the kernel (for tests: one syscall per
    /// entry and per bucket).
    ///
    /// # Errors
    /// A map could not be read.
    pub fn dump(&self) -> Result<MapDump, FastPathError> {
        let m = &self.maps;
        let err = |map: &'static str| move |source| FastPathError::Map { map, source };
        let mut d = MapDump::default();
        for kv in m.phash_v4.iter() {
            let (k, v) = kv.map_err(err(wirespan_ebpf::MAP_PHASH_V4))?;
            d.phash_v4.insert((k.addr, k.mask), v);
        }
        for kv in m.phash_v6.iter() {
            let (k, v) = kv.map_err(err(wirespan_ebpf::MAP_PHASH_V6))?;
            d.phash_v6.insert((k.hi, k.lo, k.id), v);
        }
        for kv in m.hosts_v4.iter() {
            let (k, v) = kv.map_err(err(wirespan_ebpf::MAP_HOSTS_V4))?;
            d.hosts_v4.insert(k, v);
        }
        for kv in m.hosts_v6.iter() {
            let (k, v) = kv.map_err(err(wirespan_ebpf::MAP_HOSTS_V6))?;
            d.hosts_v6.insert(k, v);
        }
        for kv in m.lpm_v4.iter() {
            let (k, v) = kv.map_err(err(wirespan_ebpf::MAP_LPM_V4))?;
            d.lpm_v4.insert((k.prefix_len(), k.data()), v);
        }
        for kv in m.lpm_v6.iter() {
            let (k, v) = kv.map_err(err(wirespan_ebpf::MAP_LPM_V6))?;
            d.lpm_v6.insert((k.prefix_len(), k.data()), v);
        }
        for (b, bits) in m.buckets_v4.iter().enumerate() {
            let bits = bits.map_err(err(wirespan_ebpf::MAP_BUCKETS_V4))?;
            if bits != 0 {
                d.buckets_v4
                    .insert(u32::try_from(b).unwrap_or(u32::MAX), bits);
            }
        }
        for (b, bits) in m.buckets_v6.iter().enumerate() {
            let bits = bits.map_err(err(wirespan_ebpf::MAP_BUCKETS_V6))?;
            if bits != Bits6::default() {
                d.buckets_v6
                    .insert(u32::try_from(b).unwrap_or(u32::MAX), (bits.lo, bits.hi));
            }
        }
        d.config = m
            .config
            .get(&0, 0)
            .map_err(err(wirespan_ebpf::MAP_CONFIG))?;
        Ok(d)
    }

    /// The packet counters, summed over CPUs.
    ///
    /// # Errors
    /// The map could not be read.
    pub fn counters(&self) -> Result<Counters, FastPathError> {
        let read = |i: u32| -> Result<u64, FastPathError> {
            let v = self
                .maps
                .counters
                .get(&i, 0)
                .map_err(|source| FastPathError::Map {
                    map: wirespan_ebpf::MAP_COUNTERS,
                    source,
                })?;
            Ok(v.iter().sum())
        };
        use wirespan_ebpf::counter;
        Ok(Counters {
            hit: read(counter::HIT)?,
            miss: read(counter::MISS)?,
            skipped: read(counter::SKIPPED)?,
            unparsed: read(counter::UNPARSED)?,
        })
    }
}

/// How the classifier is attached to one interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachMode {
    /// tcx link (kernel ≥ 6.6).
    Tcx,
    /// Filter on a clsact qdisc (older kernels).
    Clsact,
}

/// One interface carrying the classifier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachedInterface {
    /// Interface name when attached.
    pub name: String,
    /// ifindex.
    pub index: u32,
    /// The program variant (Ethernet or layer 3).
    pub program: &'static str,
    /// tcx or clsact.
    pub mode: AttachMode,
}

struct Attachment {
    info: AttachedInterface,
    link: SchedClassifierLinkId,
    added_clsact: bool,
}

struct Shared {
    programs: Programs,
    config: FastPathConfig,
    attached: BTreeMap<u32, Attachment>,
    /// Interfaces the classifier could not be attached to: (name, error).
    failed: Vec<(String, String)>,
}

/// `ip -j link` entry.
#[derive(Debug, Deserialize)]
struct IpLink {
    ifindex: u32,
    ifname: String,
    #[serde(default)]
    link_type: String,
}

fn list_links(netns: &Netns, dev: Option<&str>) -> io::Result<Vec<IpLink>> {
    let mut args = vec!["-j", "link", "show"];
    if let Some(d) = dev {
        args.extend(["dev", d]);
    }
    let out = netns.run_stdout("ip", &args)?;
    serde_json::from_str(&out).map_err(io::Error::other)
}

fn lock(shared: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    fn programs_for(&self) -> (&'static str, &'static str) {
        match self.config.lookup {
            Lookup::PrefixHash => (wirespan_ebpf::PROG_PHASH, wirespan_ebpf::PROG_PHASH_L3),
            Lookup::Lpm => (wirespan_ebpf::PROG_LPM, wirespan_ebpf::PROG_LPM_L3),
        }
    }

    /// Attaches to `link` if it is selected and not yet attached. Runs on a thread
    /// inside the namespace.
    fn consider(&mut self, netns: &Netns, link: &IpLink) -> Result<(), FastPathError> {
        if self.attached.contains_key(&link.ifindex)
            || !self.config.interfaces.selects(&link.ifname)
        {
            return Ok(());
        }
        let (eth, l3) = self.programs_for();
        let program = if link.link_type == "ether" { eth } else { l3 };
        let prog: &mut SchedClassifier = self
            .programs
            .ebpf
            .program_mut(program)
            .ok_or_else(|| FastPathError::Object(format!("program {program} missing")))?
            .try_into()
            .map_err(|e: ProgramError| FastPathError::Object(e.to_string()))?;
        let tcx = prog.attach_with_options(
            &link.ifname,
            TcAttachType::Ingress,
            TcAttachOptions::TcxOrder(LinkOrder::default()),
        );
        let (link_id, mode, added_clsact) = match tcx {
            Ok(id) => (id, AttachMode::Tcx, false),
            Err(tcx_err) => {
                tracing::debug!(interface = %link.ifname, error = %tcx_err, "tcx attach failed, trying a clsact qdisc");
                let added = match aya::programs::tc::qdisc_add_clsact(&link.ifname) {
                    Ok(()) => true,
                    Err(e)
                        if find_io(&e).and_then(io::Error::raw_os_error) == Some(libc::EEXIST) =>
                    {
                        false
                    }
                    Err(e) => return Err(attach_error(&link.ifname, e)),
                };
                match prog.attach_with_options(
                    &link.ifname,
                    TcAttachType::Ingress,
                    TcAttachOptions::Netlink(aya::programs::tc::NlOptions::default()),
                ) {
                    Ok(id) => (id, AttachMode::Clsact, added),
                    Err(e) => {
                        if added {
                            let _ =
                                netns.run("tc", &["qdisc", "del", "dev", &link.ifname, "clsact"]);
                        }
                        return Err(attach_error(&link.ifname, e));
                    }
                }
            }
        };
        tracing::info!(interface = %link.ifname, ifindex = link.ifindex, program, mode = ?mode, "fast-path classifier attached");
        self.attached.insert(
            link.ifindex,
            Attachment {
                info: AttachedInterface {
                    name: link.ifname.clone(),
                    index: link.ifindex,
                    program,
                    mode,
                },
                link: link_id,
                added_clsact,
            },
        );
        Ok(())
    }

    fn detach(&mut self, netns: &Netns, index: u32, gone: bool) -> Result<(), FastPathError> {
        let Some(a) = self.attached.remove(&index) else {
            return Ok(());
        };
        let prog: Result<&mut SchedClassifier, _> = self
            .programs
            .ebpf
            .program_mut(a.info.program)
            .ok_or_else(|| FastPathError::Object(format!("program {} missing", a.info.program)))?
            .try_into();
        let prog = prog.map_err(|e: ProgramError| FastPathError::Object(e.to_string()))?;
        let r = prog.detach(a.link);
        if gone {
            return Ok(());
        }
        r.map_err(|e| attach_error(&a.info.name, e))?;
        if a.added_clsact {
            netns
                .run("tc", &["qdisc", "del", "dev", &a.info.name, "clsact"])
                .map_err(|e| attach_error(&a.info.name, e))?;
        }
        tracing::info!(interface = %a.info.name, "fast-path classifier detached");
        Ok(())
    }

    fn detach_all(&mut self, netns: &Netns) -> Result<(), FastPathError> {
        let mut first = Ok(());
        let present: Vec<u32> = list_links(netns, None)
            .map(|l| l.into_iter().map(|l| l.ifindex).collect())
            .unwrap_or_default();
        for index in self.attached.keys().copied().collect::<Vec<_>>() {
            let r = self.detach(netns, index, !present.contains(&index));
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

fn attach_error(interface: &str, e: impl StdError + Send + Sync + 'static) -> FastPathError {
    if find_io(&e).is_some_and(unsupported_errno) {
        FastPathError::Unsupported {
            what: format!("attaching the tc classifier to {interface}"),
            source: Box::new(e),
        }
    } else {
        FastPathError::Attach {
            interface: interface.to_owned(),
            source: Box::new(e),
        }
    }
}

struct Worker {
    stop: Option<futures::channel::oneshot::Sender<()>>,
    done: std::sync::mpsc::Receiver<Result<(), FastPathError>>,
    thread: Option<JoinHandle<()>>,
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
            let prog: &mut SchedClassifier = shared
                .programs
                .ebpf
                .program_mut(name)
                .ok_or_else(|| FastPathError::Object(format!("program {name} missing")))?
                .try_into()
                .map_err(|e: ProgramError| FastPathError::Object(e.to_string()))?;
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
        let Some(mut w) = self.worker.take() else {
            return Ok(());
        };
        w.stop.take();
        let r = w.done.recv().unwrap_or_else(|_| {
            Err(FastPathError::Netns(io::Error::other(
                "fast-path worker died",
            )))
        });
        if let Some(t) = w.thread.take() {
            let _ = t.join();
        }
        r
    }
}

impl Drop for FastPath {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::warn!(error = %e, "fast-path teardown on drop");
        }
    }
}

fn spawn_worker(netns: Netns, shared: Arc<Mutex<Shared>>) -> Result<Worker, FastPathError> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), FastPathError>>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<Result<(), FastPathError>>();
    let (stop_tx, stop_rx) = futures::channel::oneshot::channel::<()>();
    let file = netns
        .path()
        .map(std::fs::File::open)
        .transpose()
        .map_err(FastPathError::Netns)?;
    let thread = std::thread::Builder::new()
        .name("fastpath-watch".into())
        .spawn(move || {
            if let Some(f) = &file {
                if let Err(e) = nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET) {
                    let _ = ready_tx.send(Err(FastPathError::Netns(e.into())));
                    return;
                }
            }
            // Subscribe before listing, so no interface slips between the two.
            let mut watcher = match Watcher::start(&netns, false) {
                Ok(w) => w,
                Err(e) => {
                    let _ = ready_tx.send(Err(FastPathError::Netns(e)));
                    return;
                }
            };
            let initial = (|| {
                let links = list_links(&netns, None).map_err(FastPathError::Netns)?;
                let mut s = lock(&shared);
                for l in &links {
                    s.consider(&netns, l)?;
                }
                Ok(())
            })();
            if let Err(e) = initial {
                let _ = lock(&shared).detach_all(&netns);
                let _ = ready_tx.send(Err(e));
                return;
            }
            let _ = ready_tx.send(Ok(()));
            futures::executor::block_on(async {
                let mut stop = stop_rx;
                loop {
                    let ev = futures::future::select(watcher.next(), &mut stop).await;
                    match ev {
                        futures::future::Either::Left((Some(ev), _)) => on_event(&netns, &shared, &ev),
                        futures::future::Either::Left((None, _)) => {
                            tracing::warn!("netlink watcher ended; interfaces appearing later will not get the fast-path classifier");
                            let _ = (&mut stop).await;
                            break;
                        }
                        futures::future::Either::Right(_) => break,
                    }
                }
            });
            drop(watcher);
            let r = lock(&shared).detach_all(&netns);
            let _ = done_tx.send(r);
        })
        .map_err(FastPathError::Netns)?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(Worker {
            stop: Some(stop_tx),
            done: done_rx,
            thread: Some(thread),
        }),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => {
            let _ = thread.join();
            Err(FastPathError::Netns(io::Error::other(
                "fast-path worker died during setup",
            )))
        }
    }
}

fn on_event(netns: &Netns, shared: &Mutex<Shared>, ev: &NetEvent) {
    let NetEvent::Link {
        change,
        index,
        name,
        ..
    } = ev
    else {
        return;
    };
    let mut s = lock(shared);
    match change {
        Change::Removed => {
            let _ = s.detach(netns, *index, true);
        }
        Change::Updated => {
            if s.attached.contains_key(index) || !s.config.interfaces.selects(name) {
                return;
            }
            let link = match list_links(netns, Some(name)) {
                Ok(mut l) if !l.is_empty() => l.remove(0),
                Ok(_) => return,
                Err(e) => {
                    tracing::debug!(interface = %name, error = %e, "interface gone before attach");
                    return;
                }
            };
            if let Err(e) = s.consider(netns, &link) {
                tracing::warn!(interface = %name, error = %e, "cannot attach the fast-path classifier");
                s.failed.push((name.clone(), e.to_string()));
            }
        }
    }
}
