//! The desired marking state, shared by the two adapters that mark mesh-bound
//! packets: the nftables table ([`crate::marking`]) and the eBPF fast path
//! ([`crate::fastpath`]). Both consume a [`MarkingSpec`] (or a [`PrefixDelta`] of its
//! routed set); neither knows the other through it, so this module depends on
//! neither. [`crate::marking`] re-exports everything here under its old paths.
//!
//! - this file: [`MarkingSpec`] and its options, and their validation;
//! - `delta`: [`PrefixDelta`], a change of the routed set;
//! - `positions`: [`PrefixLists`] and [`AppliedSpec`], the routed set kept so that a
//!   delta costs time in proportion to its size.

use ipnet::IpNet;

use crate::error::Invalid;

mod delta;
mod positions;

pub use delta::PrefixDelta;
pub use positions::{AppliedSpec, PrefixLists};

/// Default table name (ours alone, not shared with the host firewall).
pub const DEFAULT_TABLE: &str = "wirespan";

/// How the routed prefixes are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SetLayout {
    /// Host addresses (/32, /128) in hash sets, true CIDRs in interval sets: a hash
    /// lookup is several times cheaper than the interval (rbtree) lookup (`docs/kubespan.md` §12.1).
    Split,
    /// Everything in one interval set per family, as upstream does.
    Interval,
    /// One hash set per family and prefix length, holding the prefixes' network
    /// addresses, matched by `daddr & mask == @set` (one rule pair per non-empty
    /// length). A commit costs the changed elements only: the kernel's interval set
    /// walks the whole tree on every insert and commit, a hash set does not (issue 18).
    /// The sets of every length exist (empty ones cost no lookup: they get no rule),
    /// so a length appearing or disappearing changes rules, never the set list. The
    /// whole-address sets are the split layout's `v4_hosts` and `v6_hosts`.
    /// The default: `wirespan bench marking` measured it cheaper per forwarded packet
    /// than the split layout (+393 vs +884 ns over no marking at 10,000 prefixes) and
    /// its one-prefix commit flat in the set size.
    #[default]
    PerLength,
}

/// Who marks forwarded traffic (the prerouting chain's job).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PreroutingMarking {
    /// The prerouting chain looks the destination up in the sets and marks.
    #[default]
    Nftables,
    /// The eBPF fast path ([`crate::fastpath`]) marks at tc ingress, before
    /// prerouting: the chain keeps the device-mark accept and clamps the MSS of
    /// forwarded SYNs that already carry the mesh mark, with no set lookup. The output
    /// chain (locally originated traffic) is unchanged.
    FastPath,
}

/// The desired marking table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarkingSpec {
    /// nftables table name (family `inet`).
    pub table: String,
    /// Mark WireGuard puts on its own UDP (`0x20`); such packets are never re-marked.
    pub device_mark: u32,
    /// Mark that sends a packet into the mesh (`0x40`).
    pub mark: u32,
    /// Mask of both marks (`0x60`); other bits are left alone.
    pub mask: u32,
    /// Link MTU; the TCP MSS is clamped to `mtu - 52` (IPv4) and `mtu - 72` (IPv6).
    pub mtu: u32,
    /// IPv4 part of the routed set.
    pub prefixes_v4: Vec<IpNet>,
    /// IPv6 part of the routed set.
    pub prefixes_v6: Vec<IpNet>,
    /// Storage of the prefixes.
    pub layout: SetLayout,
    /// Who marks forwarded traffic.
    pub prerouting: PreroutingMarking,
}

impl Default for MarkingSpec {
    fn default() -> Self {
        Self {
            table: DEFAULT_TABLE.to_owned(),
            device_mark: crate::DEVICE_FWMARK,
            mark: crate::MESH_MARK,
            mask: crate::MARK_MASK,
            mtu: crate::DEFAULT_MTU,
            prefixes_v4: Vec::new(),
            prefixes_v6: Vec::new(),
            layout: SetLayout::PerLength,
            prerouting: PreroutingMarking::Nftables,
        }
    }
}

impl MarkingSpec {
    /// Checks every field; nothing is written when this fails.
    ///
    /// # Errors
    /// The first invalid field.
    pub fn validate(&self) -> Result<(), Invalid> {
        let t = &self.table;
        if t.is_empty()
            || t.len() > 64
            || !t.starts_with(|c: char| c.is_ascii_alphabetic())
            || !t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            return Err(Invalid::new(
                "table",
                format!("{t:?} must be 1 to 64 letters, digits or '_', starting with a letter"),
            ));
        }
        if self.mask == 0 {
            return Err(Invalid::new("mask", "must not be 0"));
        }
        for (field, v) in [("mark", self.mark), ("device_mark", self.device_mark)] {
            if v == 0 || v & !self.mask != 0 {
                return Err(Invalid::new(
                    field,
                    format!("{v:#x} must be non-zero and inside mask {:#x}", self.mask),
                ));
            }
        }
        if self.mark == self.device_mark {
            return Err(Invalid::new("mark", "must differ from device_mark"));
        }
        crate::error::check_mtu("mtu", self.mtu)?;
        for (field, list, v4) in [
            ("prefixes_v4", &self.prefixes_v4, true),
            ("prefixes_v6", &self.prefixes_v6, false),
        ] {
            for (i, p) in list.iter().enumerate() {
                let ok = matches!((p, v4), (IpNet::V4(_), true) | (IpNet::V6(_), false));
                if !ok {
                    let fam = if v4 { "IPv4" } else { "IPv6" };
                    return Err(Invalid::new(
                        format!("{field}[{i}]"),
                        format!("{p} is not an {fam} prefix"),
                    ));
                }
                if p.trunc() != *p {
                    return Err(Invalid::new(
                        format!("{field}[{i}]"),
                        format!("{p} has host bits set (expected {})", p.trunc()),
                    ));
                }
            }
        }
        Ok(())
    }

    /// MSS clamp value for IPv4.
    #[must_use]
    pub fn mss_v4(&self) -> u32 {
        self.mtu.saturating_sub(52)
    }

    /// MSS clamp value for IPv6.
    #[must_use]
    pub fn mss_v6(&self) -> u32 {
        self.mtu.saturating_sub(72)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(v4: &[&str], v6: &[&str]) -> MarkingSpec {
        MarkingSpec {
            prefixes_v4: v4.iter().map(|p| p.parse().unwrap()).collect(),
            prefixes_v6: v6.iter().map(|p| p.parse().unwrap()).collect(),
            ..MarkingSpec::default()
        }
    }

    #[test]
    fn validation_names_the_field() {
        let mut s = spec(&["10.0.0.0/8", "2001:db8::/32"], &[]);
        let e = s.validate().unwrap_err();
        assert_eq!(e.field, "prefixes_v4[1]");
        s = spec(&["10.0.0.1/8"], &[]);
        assert_eq!(s.validate().unwrap_err().field, "prefixes_v4[0]");
        s = spec(&[], &[]);
        s.mtu = 1279;
        assert_eq!(s.validate().unwrap_err().field, "mtu");
        s.mtu = 1420;
        s.mark = 0x80;
        assert_eq!(s.validate().unwrap_err().field, "mark");
        s.mark = 0x40;
        s.table = "bad name".into();
        assert_eq!(s.validate().unwrap_err().field, "table");
    }
}
