//! Map keys and values of the BPF object, laid out exactly as in
//! `ebpf/src/bpf/marking.bpf.c`, and the pure functions that place a prefix in the
//! prefix-hash structure (which key, which length bit, which bucket). The BPF side
//! computes the same from a packet's destination; the unit tests pin both views to
//! each other.

#![allow(unsafe_code)] // `aya::Pod` impls: plain `repr(C)` data without padding.

use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// IPv4 lengths from this one up are recorded per bucket, shorter ones globally.
pub const V4_BUCKET_MIN_LEN: u8 = 24;
/// IPv6 lengths from this one up are recorded per bucket, shorter ones globally.
pub const V6_BUCKET_MIN_LEN: u8 = 64;

/// `struct config`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Config {
    /// Packets whose `mark & mask` equals this are left alone.
    pub device_mark: u32,
    /// Mask of the mesh marks.
    pub mask: u32,
    /// IPv4 lengths below [`V4_BUCKET_MIN_LEN`]: bit `32 - len`.
    pub v4_global: u64,
    /// IPv6 lengths 1..63: bit `128 - len - 64`.
    pub v6_global_hi: u64,
    /// Route mark of `::/0` (0 = absent).
    pub v6_all_mark: u32,
    /// Padding.
    pub pad: u32,
}
// SAFETY: repr(C), integer fields only, explicit padding field: no uninitialised bytes.
unsafe impl aya::Pod for Config {}

/// `struct key4`: network-order masked address, host-order mask.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key4 {
    /// Masked address as its network-order bytes.
    pub addr: u32,
    /// Mask (host order).
    pub mask: u32,
}
// SAFETY: repr(C), two u32, no padding.
unsafe impl aya::Pod for Key4 {}

/// `struct key6`: host-order masked halves and a per-length id.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key6 {
    /// Top 64 bits, masked.
    pub hi: u64,
    /// Bottom 64 bits, masked.
    pub lo: u64,
    /// `mask_lo ^ !mask_hi`, unique per length.
    pub id: u64,
}
// SAFETY: repr(C), three u64, no padding.
unsafe impl aya::Pod for Key6 {}

/// `struct bits6`: length bitmap of an IPv6 bucket.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Bits6 {
    /// Lengths 65..=128: bit `128 - len`.
    pub lo: u64,
    /// Length 64: bit 0.
    pub hi: u64,
}
// SAFETY: repr(C), two u64, no padding.
unsafe impl aya::Pod for Bits6 {}

/// Bucket of an IPv4 address (from its top 24 bits).
#[must_use]
pub fn bucket4(addr: Ipv4Addr) -> u32 {
    ((u32::from(addr) >> 8).wrapping_mul(wirespan_ebpf::BUCKET_HASH4) >> 16)
        & (wirespan_ebpf::BUCKETS - 1)
}

/// Bucket of an IPv6 address (from its top 64 bits).
#[must_use]
pub fn bucket6(addr: Ipv6Addr) -> u32 {
    let hi = (u128::from(addr) >> 64) as u64;
    // The shift leaves 16 bits.
    u32::try_from(hi.wrapping_mul(wirespan_ebpf::BUCKET_HASH6) >> 48).unwrap_or(0)
        & (wirespan_ebpf::BUCKETS - 1)
}

/// Where a prefix lives in the prefix-hash structure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Slot {
    /// IPv4: key, bit `32 - len`, and the bucket (`None`: global bitmap).
    V4(Key4, u32, Option<u32>),
    /// IPv6: key, bit `128 - len` (`128` for `::/0`, which is a flag, not a key),
    /// and the bucket (`None`: global bitmap).
    V6(Key6, u32, Option<u32>),
}

/// The mask of an IPv4 prefix length (host order).
#[must_use]
pub fn mask4(len: u8) -> u32 {
    u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0)
}

/// The slot of a (truncated) prefix.
#[must_use]
pub fn slot(p: &IpNet) -> Slot {
    match p {
        IpNet::V4(n) => slot4(n),
        IpNet::V6(n) => slot6(n),
    }
}

fn slot4(n: &Ipv4Net) -> Slot {
    let len = n.prefix_len();
    let mask = mask4(len);
    let key = Key4 {
        addr: u32::from_ne_bytes((u32::from(n.network()) & mask).to_be_bytes()),
        mask,
    };
    let bucket = (len >= V4_BUCKET_MIN_LEN).then(|| bucket4(n.network()));
    Slot::V4(key, 32 - u32::from(len), bucket)
}

fn slot6(n: &Ipv6Net) -> Slot {
    let len = n.prefix_len();
    let j = 128 - u32::from(len);
    let addr = u128::from(n.network());
    let (hi, lo) = ((addr >> 64) as u64, addr as u64);
    let (mhi, mlo) = if j < 64 {
        (u64::MAX, 0u64.wrapping_sub(1 << j))
    } else if j < 128 {
        (0u64.wrapping_sub(1 << (j - 64)), 0)
    } else {
        (0, 0)
    };
    let key = Key6 {
        hi: hi & mhi,
        lo: lo & mlo,
        id: mlo ^ !mhi,
    };
    let bucket = (len >= V6_BUCKET_MIN_LEN).then(|| bucket6(n.network()));
    Slot::V6(key, j, bucket)
}

/// The exact-host key of an IPv4 address (network-order bytes).
#[must_use]
pub fn host4(a: Ipv4Addr) -> u32 {
    u32::from_ne_bytes(a.octets())
}

/// The LPM trie key of an IPv4 prefix.
#[must_use]
pub fn lpm4(n: &Ipv4Net) -> aya::maps::lpm_trie::Key<u32> {
    aya::maps::lpm_trie::Key::new(u32::from(n.prefix_len()), host4(n.network()))
}

/// The LPM trie key of an IPv6 prefix.
#[must_use]
pub fn lpm6(n: &Ipv6Net) -> aya::maps::lpm_trie::Key<[u8; 16]> {
    aya::maps::lpm_trie::Key::new(u32::from(n.prefix_len()), n.network().octets())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The C bucket hash the BPF programs use (`hash.h`, with the constants `build.rs`
    /// passes) compiled for the host gives the buckets this module computes. Fails on
    /// a hash or a constant changed on one side only.
    #[test]
    fn the_c_bucket_hash_agrees_with_the_rust_one() {
        let v4: Vec<Ipv4Addr> = [
            "0.0.0.0",
            "10.0.0.1",
            "192.168.77.5",
            "255.255.255.255",
            "100.64.3.9",
        ]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
        let v6: Vec<Ipv6Addr> = [
            "::",
            "fd00::1",
            "2001:db8:1234:5678::1",
            "ffff:ffff:ffff:ffff::",
        ]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
        let mut main = String::from(
            "#include <stdio.h>\n#include <linux/types.h>\n#include \"hash.h\"\nint main(void) {\n",
        );
        for a in &v4 {
            main.push_str(&format!(
                "printf(\"%u\\n\", wirespan_bucket4({}u));\n",
                u32::from(*a)
            ));
        }
        for a in &v6 {
            let hi = (u128::from(*a) >> 64) as u64;
            main.push_str(&format!("printf(\"%u\\n\", wirespan_bucket6({hi}ull));\n"));
        }
        main.push_str("return 0;\n}\n");
        let dir = TempDir::new();
        std::fs::write(dir.0.join("hash.h"), wirespan_ebpf::BUCKET_HASH_C).unwrap();
        std::fs::write(dir.0.join("main.c"), main).unwrap();
        let clang = std::env::var_os("CLANG").unwrap_or_else(|| "clang".into());
        let bin = dir.0.join("hash");
        let status = std::process::Command::new(clang)
            .args([
                format!("-DBUCKETS={}", wirespan_ebpf::BUCKETS),
                format!("-DBUCKET_HASH4={:#x}u", wirespan_ebpf::BUCKET_HASH4),
                format!("-DBUCKET_HASH6={:#x}ull", wirespan_ebpf::BUCKET_HASH6),
                "-Wall".into(),
                "-Werror".into(),
                "-o".into(),
            ])
            .arg(&bin)
            .arg(dir.0.join("main.c"))
            .status()
            .expect("clang (needed to build wirespan-ebpf) runs");
        assert!(status.success());
        let out = std::process::Command::new(&bin).output().unwrap();
        let c: Vec<u32> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        let rust: Vec<u32> = v4
            .iter()
            .map(|a| bucket4(*a))
            .chain(v6.iter().map(|a| bucket6(*a)))
            .collect();
        assert_eq!(c, rust);
        assert!(rust.iter().any(|b| *b != 0), "{rust:?}");
    }

    /// A directory removed when the test ends, pass or fail.
    struct TempDir(std::path::PathBuf);

    impl TempDir {
        fn new() -> Self {
            let dir = std::env::temp_dir().join(format!(
                "wirespan-hash-{}-{:016x}",
                std::process::id(),
                rand::random::<u64>()
            ));
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// What the BPF program computes for a destination and a length bit (mirrors the
    /// C loop body).
    fn probe4(dst: Ipv4Addr, j: u32) -> Key4 {
        let iso = 1u64 << j;
        let mask = 0u64.wrapping_sub(iso) as u32;
        let addr = u32::from_ne_bytes(dst.octets());
        Key4 {
            addr: addr & mask.to_be(),
            mask,
        }
    }

    fn probe6(dst: Ipv6Addr, j: u32) -> Key6 {
        let a = u128::from(dst);
        let (hi, lo) = ((a >> 64) as u64, a as u64);
        let (mhi, mlo) = if j < 64 {
            (u64::MAX, 0u64.wrapping_sub(1 << j))
        } else {
            (0u64.wrapping_sub(1 << (j - 64)), 0)
        };
        Key6 {
            hi: hi & mhi,
            lo: lo & mlo,
            id: mlo ^ !mhi,
        }
    }

    #[test]
    fn v4_prefix_key_equals_the_probe_of_any_address_inside() {
        for (p, inside) in [
            ("10.1.2.3/32", "10.1.2.3"),
            ("10.244.7.0/24", "10.244.7.200"),
            ("10.0.0.0/8", "10.9.8.7"),
            ("0.0.0.0/0", "203.0.113.9"),
            ("192.168.0.64/26", "192.168.0.127"),
        ] {
            let p: IpNet = p.parse().unwrap();
            let Slot::V4(key, j, bucket) = slot(&p) else {
                panic!()
            };
            let dst: Ipv4Addr = inside.parse().unwrap();
            assert_eq!(probe4(dst, j), key, "{p}");
            assert_eq!(bucket.is_some(), p.prefix_len() >= 24);
            if let Some(b) = bucket {
                assert_eq!(b, bucket4(dst), "{p}");
            }
        }
    }

    #[test]
    fn v6_prefix_key_equals_the_probe_of_any_address_inside() {
        for (p, inside) in [
            ("fd00::1/128", "fd00::1"),
            ("fd00:1:2:3::/64", "fd00:1:2:3:ffff::9"),
            ("2001:db8::/32", "2001:db8:ffff::1"),
            ("fd00:0:0:1::/65", "fd00:0:0:1:7fff::1"),
            ("fd00::/63", "fd00:0:0:1::1"),
        ] {
            let p: IpNet = p.parse().unwrap();
            let Slot::V6(key, j, bucket) = slot(&p) else {
                panic!()
            };
            let dst: Ipv6Addr = inside.parse().unwrap();
            assert_eq!(probe6(dst, j), key, "{p}");
            assert_eq!(bucket.is_some(), p.prefix_len() >= 64);
            if let Some(b) = bucket {
                assert_eq!(b, bucket6(dst), "{p}");
            }
        }
    }

    #[test]
    fn keys_of_different_lengths_differ() {
        let k = |s: &str| slot(&s.parse().unwrap());
        assert_ne!(k("10.0.0.0/8"), k("10.0.0.0/16"));
        assert_ne!(k("fd00::/64"), k("fd00::/65"));
        assert_ne!(k("fd00::/63"), k("fd00::/64"));
        assert_ne!(k("::/64"), k("::/128"));
        let ids: std::collections::HashSet<u64> = (1..=128u8)
            .map(
                |l| match slot(&IpNet::new("::".parse().unwrap(), l).unwrap()) {
                    Slot::V6(k, _, _) => k.id,
                    Slot::V4(..) => unreachable!(),
                },
            )
            .collect();
        assert_eq!(ids.len(), 128);
    }
}
