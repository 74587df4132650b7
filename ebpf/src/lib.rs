//! wirespan-ebpf: BPF programs of the marking fast path.
//!
//! The programs are C (`src/bpf/marking.bpf.c`), compiled with clang by `build.rs` and
//! embedded here as object bytes for the loader in `wirespan-dataplane`
//! (`fastpath`). A missing clang stops the build with a message saying how to
//! install it.
//!
//! What the object holds (names are the contract with the loader):
//!
//! - tc classifiers (section `classifier`), all returning `TC_ACT_UNSPEC`
//!   (= `TCX_NEXT`): [`PROG_PHASH`] / [`PROG_PHASH_L3`] (per-length hash maps with
//!   bucketed length bitmaps, the default), [`PROG_LPM`] / [`PROG_LPM_L3`] (exact-host
//!   hash, then LPM trie; the memory-tight fallback), and the benchmark reference
//!   points [`PROG_FLOOR`] (parse + one hash lookup) and [`PROG_EMPTY`]. The `_l3`
//!   variants are for interfaces without an Ethernet header (tun, WireGuard, ipip).
//! - XDP programs for the benchmark: [`PROG_XDP_PASS`] (traffic source with
//!   `BPF_F_TEST_XDP_LIVE_FRAMES`) and [`PROG_XDP_SINK`] (counts and drops).
//! - maps: see the `MAP_*` constants; key and value layouts are mirrored by the
//!   loader. Sizes, the bucket hash's multipliers and the counter indices are defined
//!   once, in Rust ([`BUCKETS`], [`DEFAULT_ENTRIES`], [`BUCKET_HASH4`],
//!   [`BUCKET_HASH6`], [`counter`]), and passed to clang by `build.rs`.

/// Bytes with the alignment the ELF parser wants.
#[repr(C, align(32))]
struct Aligned<T: ?Sized>(T);

static MARKING: &Aligned<[u8]> =
    &Aligned(*include_bytes!(concat!(env!("OUT_DIR"), "/marking.bpf.o")));

/// The compiled marking object (ELF, BTF included).
#[must_use]
pub fn marking_object() -> &'static [u8] {
    &MARKING.0
}

/// Prefix-hash classifier, Ethernet interfaces.
pub const PROG_PHASH: &str = "wirespan_phash";
/// Prefix-hash classifier, interfaces without a link-layer header.
pub const PROG_PHASH_L3: &str = "wirespan_phash_l3";
/// Host hash + LPM trie classifier, Ethernet interfaces.
pub const PROG_LPM: &str = "wirespan_lpm";
/// Host hash + LPM trie classifier, interfaces without a link-layer header.
pub const PROG_LPM_L3: &str = "wirespan_lpm_l3";
/// Benchmark floor: parse and one exact-host hash lookup.
pub const PROG_FLOOR: &str = "wirespan_floor";
/// Benchmark reference: returns at once.
pub const PROG_EMPTY: &str = "wirespan_empty";
/// XDP program passing every frame to the stack.
pub const PROG_XDP_PASS: &str = "wirespan_xdp_pass";
/// XDP program counting (hit counter) and dropping every frame.
pub const PROG_XDP_SINK: &str = "wirespan_xdp_sink";

/// `ARRAY[1]` of the configuration struct.
pub const MAP_CONFIG: &str = "wirespan_config";
/// `PERCPU_ARRAY[4]` of `u64`: hit, miss, skipped (device mark), unparsed.
pub const MAP_COUNTERS: &str = "wirespan_counters";
/// Prefix hash, IPv4: `{addr: u32 (network order, masked), mask: u32}` -> route mark.
pub const MAP_PHASH_V4: &str = "wirespan_phash_v4";
/// Prefix hash, IPv6: `{hi: u64, lo: u64 (host order, masked), id: u64}` -> route mark.
pub const MAP_PHASH_V6: &str = "wirespan_phash_v6";
/// Length bitmaps of IPv4 buckets (`u64`).
pub const MAP_BUCKETS_V4: &str = "wirespan_buckets_v4";
/// Length bitmaps of IPv6 buckets (`{lo: u64, hi: u64}`).
pub const MAP_BUCKETS_V6: &str = "wirespan_buckets_v6";
/// Exact hosts, IPv4 (`u32` network order) -> route mark.
pub const MAP_HOSTS_V4: &str = "wirespan_hosts_v4";
/// Exact hosts, IPv6 (16 bytes) -> route mark.
pub const MAP_HOSTS_V6: &str = "wirespan_hosts_v6";
/// LPM trie, IPv4.
pub const MAP_LPM_V4: &str = "wirespan_lpm_v4";
/// LPM trie, IPv6.
pub const MAP_LPM_V6: &str = "wirespan_lpm_v6";

mod constants;
/// Counter indices in [`MAP_COUNTERS`], passed to clang by `build.rs` like the sizes.
pub use constants::counter;
pub use constants::{BUCKETS, BUCKET_HASH4, BUCKET_HASH6, DEFAULT_ENTRIES};

/// The bucket hash in C (`src/bpf/hash.h`, included by the programs), for tests that
/// compile it for the host and compare it with the loader's Rust copy.
pub const BUCKET_HASH_C: &str = include_str!("bpf/hash.h");
#[cfg(test)]
mod tests {
    #[test]
    fn object_is_an_elf_for_bpf() {
        let o = super::marking_object();
        assert_eq!(&o[..4], b"\x7fELF");
        // e_machine EM_BPF (247), little endian.
        assert_eq!(u16::from_le_bytes([o[18], o[19]]), 247);
        assert_eq!(o.as_ptr() as usize % 32, 0);
    }
}
