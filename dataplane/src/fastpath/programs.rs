//! [`Programs`]: the loaded BPF object and its maps, not attached anywhere. It syncs
//! the maps to a spec or a delta (planned by [`super::sync`], written by `maps`) and
//! runs a program on a crafted packet (`BPF_PROG_TEST_RUN`).

use std::os::fd::{AsFd, BorrowedFd};

use aya::{
    programs::{ProgramError, SchedClassifier, Xdp},
    Ebpf, EbpfError, EbpfLoader,
};

use super::{
    error::{load_error, program_load_error},
    maps::Maps,
    sync::{MapState, Occupancy, Plan, Structures},
    testrun, Counters, FastPathError, MapDump, SyncStats,
};
use crate::{
    error::Invalid,
    markspec::{MarkingSpec, PrefixDelta},
};

/// The loaded BPF object and its maps, not attached anywhere: what
/// [`FastPath`](super::FastPath) attaches, and what tests and benchmarks run with `BPF_PROG_TEST_RUN`.
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
        let maps = Maps::take_from(&mut ebpf)?;
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
        self.maps.write(self.structures, plan)
    }

    /// Reads every lookup map back from the kernel (for tests: one syscall per
    /// entry and per bucket).
    ///
    /// # Errors
    /// A map could not be read.
    pub fn dump(&self) -> Result<MapDump, FastPathError> {
        self.maps.dump()
    }

    /// The packet counters, summed over CPUs.
    ///
    /// # Errors
    /// The map could not be read.
    pub fn counters(&self) -> Result<Counters, FastPathError> {
        self.maps.counters()
    }

    /// Loaded classifier `name`, to attach or detach.
    pub(super) fn classifier_mut(
        &mut self,
        name: &str,
    ) -> Result<&mut SchedClassifier, FastPathError> {
        self.ebpf
            .program_mut(name)
            .ok_or_else(|| FastPathError::Object(format!("program {name} missing")))?
            .try_into()
            .map_err(|e: ProgramError| FastPathError::Object(e.to_string()))
    }
}
