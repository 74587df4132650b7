// The constants the BPF programs and their loader share. One definition: `lib.rs`
// exports them to Rust and `build.rs` passes them to clang as `-D` macros (this file
// is `include!`d there, so it holds only items with outer comments).

/// Number of buckets of each bucket map (a power of two: bucket hashes are masked with
/// `BUCKETS - 1`).
pub const BUCKETS: u32 = 65_536;
/// Default capacity of each prefix map (the loader may change it).
pub const DEFAULT_ENTRIES: u32 = 262_144;
/// Multiplier of the IPv4 bucket hash (Fibonacci hashing: 2^32 / golden ratio).
pub const BUCKET_HASH4: u32 = 0x9E37_79B1;
/// Multiplier of the IPv6 bucket hash (2^64 / golden ratio).
pub const BUCKET_HASH6: u64 = 0x9E37_79B9_7F4A_7C15;

/// Counter indices in the `PERCPU_ARRAY` of packet counters (`MAP_COUNTERS`); clang
/// gets them as `CNT_HIT`, `CNT_MISS`, `CNT_SKIPPED`, `CNT_UNPARSED` and `CNT_MAX`.
pub mod counter {
    /// Destination in the set: marked.
    pub const HIT: u32 = 0;
    /// Parsed, not in the set.
    pub const MISS: u32 = 1;
    /// Carried the device mark: left alone.
    pub const SKIPPED: u32 = 2;
    /// Not IPv4/IPv6 (or truncated, or VLAN-tagged on the parent device): left alone.
    pub const UNPARSED: u32 = 3;
    /// Number of counters (the map's size).
    pub const COUNT: u32 = 4;
}
