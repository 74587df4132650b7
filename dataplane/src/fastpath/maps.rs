//! The classifier's maps: typed handles, the writes of a sync [`Plan`], and reading
//! them back ([`MapDump`], [`Counters`]).

use std::collections::BTreeMap;

use aya::{
    maps::{Array, HashMap as BpfHashMap, LpmTrie, MapData, MapError, PerCpuArray},
    Ebpf,
};
use ipnet::IpNet;

use super::{
    keys::{self, Bits6, Config, Key4, Key6, Slot},
    sync::{self, Plan, Structures},
    FastPathError,
};

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

/// What one [`Programs::apply`](super::Programs::apply) wrote.
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

/// The lookup maps as the kernel holds them (see [`Programs::dump`](super::Programs::dump)): keys as plain
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
pub(super) struct Maps {
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

impl Maps {
    /// Takes every map out of the loaded object.
    pub(super) fn take_from(ebpf: &mut Ebpf) -> Result<Self, FastPathError> {
        Ok(Self {
            config: take(ebpf, wirespan_ebpf::MAP_CONFIG)?,
            counters: take(ebpf, wirespan_ebpf::MAP_COUNTERS)?,
            phash_v4: take(ebpf, wirespan_ebpf::MAP_PHASH_V4)?,
            phash_v6: take(ebpf, wirespan_ebpf::MAP_PHASH_V6)?,
            buckets_v4: take(ebpf, wirespan_ebpf::MAP_BUCKETS_V4)?,
            buckets_v6: take(ebpf, wirespan_ebpf::MAP_BUCKETS_V6)?,
            hosts_v4: take(ebpf, wirespan_ebpf::MAP_HOSTS_V4)?,
            hosts_v6: take(ebpf, wirespan_ebpf::MAP_HOSTS_V6)?,
            lpm_v4: take(ebpf, wirespan_ebpf::MAP_LPM_V4)?,
            lpm_v6: take(ebpf, wirespan_ebpf::MAP_LPM_V6)?,
        })
    }

    /// Writes `plan` in its field order (see [`Plan`]) to the maps of `structures`.
    pub(super) fn write(
        &mut self,
        structures: Structures,
        plan: &Plan,
    ) -> Result<SyncStats, FastPathError> {
        let m = self;
        let map_err = |map: &'static str| move |source| FastPathError::Map { map, source };
        let mark = plan.route_mark;
        for p in &plan.insert {
            if structures.phash {
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
            if structures.lpm {
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
            if structures.phash {
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
            if structures.lpm {
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
    pub(super) fn dump(&self) -> Result<MapDump, FastPathError> {
        let m = self;
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
    pub(super) fn counters(&self) -> Result<Counters, FastPathError> {
        let read = |i: u32| -> Result<u64, FastPathError> {
            let v = self
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
