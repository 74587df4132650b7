//! Sets of addresses as sorted disjoint ranges per family, with union, difference and
//! the minimal CIDR cover (`docs/kubespan.md` §5.3). Operations cost O(log n) per range touched.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::IpNet;

/// Disjoint, non-adjacent inclusive ranges of one family: start → end.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Ranges(BTreeMap<u128, u128>);

impl Ranges {
    /// Adds `[s, e]`, merging overlapping and adjacent ranges.
    fn insert(&mut self, mut s: u128, mut e: u128) {
        // A range starting before s that reaches s (or s-1) absorbs it.
        if let Some((&ps, &pe)) = self.0.range(..=s).next_back() {
            if pe.saturating_add(1) >= s {
                if pe >= e {
                    return;
                }
                s = ps;
                self.0.remove(&ps);
            }
        }
        // Ranges starting inside [s, e+1] are swallowed.
        let upper = e.saturating_add(1);
        let inside: Vec<(u128, u128)> = self.0.range(s..=upper).map(|(a, b)| (*a, *b)).collect();
        for (a, b) in inside {
            self.0.remove(&a);
            e = e.max(b);
        }
        self.0.insert(s, e);
    }

    /// Removes `[s, e]`.
    fn remove(&mut self, s: u128, e: u128) {
        if let Some((&ps, &pe)) = self.0.range(..s).next_back() {
            if pe >= s {
                self.0.insert(ps, s - 1);
                if pe > e {
                    self.0.insert(e + 1, pe);
                    return;
                }
            }
        }
        let inside: Vec<(u128, u128)> = self.0.range(s..=e).map(|(a, b)| (*a, *b)).collect();
        for (a, b) in inside {
            self.0.remove(&a);
            if b > e {
                self.0.insert(e + 1, b);
            }
        }
    }

    fn overlaps(&self, s: u128, e: u128) -> bool {
        if let Some((_, &pe)) = self.0.range(..=s).next_back() {
            if pe >= s {
                return true;
            }
        }
        self.0.range(s..=e).next().is_some()
    }
}

fn bounds(net: &IpNet) -> (bool, u128, u128) {
    match net {
        IpNet::V4(n) => (
            false,
            u128::from(u32::from(n.network())),
            u128::from(u32::from(n.broadcast())),
        ),
        IpNet::V6(n) => (true, u128::from(n.network()), u128::from(n.broadcast())),
    }
}

/// A set of IPv4 and IPv6 addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixSet {
    v4: Ranges,
    v6: Ranges,
}

impl PrefixSet {
    /// The empty set.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    fn family(&mut self, v6: bool) -> &mut Ranges {
        if v6 {
            &mut self.v6
        } else {
            &mut self.v4
        }
    }

    /// The addresses of one prefix.
    #[must_use]
    pub fn from_prefix(net: &IpNet) -> Self {
        let mut s = Self::new();
        s.insert(net);
        s
    }

    /// Adds every address of `net` (host bits ignored).
    pub fn insert(&mut self, net: &IpNet) {
        let (v6, s, e) = bounds(net);
        self.family(v6).insert(s, e);
    }

    /// Removes every address of `net`.
    pub fn remove(&mut self, net: &IpNet) {
        let (v6, s, e) = bounds(net);
        self.family(v6).remove(s, e);
    }

    /// Adds every address of `other`.
    pub fn union(&mut self, other: &Self) {
        for (s, e) in &other.v4.0 {
            self.v4.insert(*s, *e);
        }
        for (s, e) in &other.v6.0 {
            self.v6.insert(*s, *e);
        }
    }

    /// Removes every address of `other`.
    pub fn subtract(&mut self, other: &Self) {
        for (s, e) in &other.v4.0 {
            self.v4.remove(*s, *e);
        }
        for (s, e) in &other.v6.0 {
            self.v6.remove(*s, *e);
        }
    }

    /// Whether the sets share an address: O(m log n), walking the smaller set's m
    /// ranges and looking each up in the larger one.
    #[must_use]
    pub fn overlaps(&self, other: &Self) -> bool {
        fn any(a: &Ranges, b: &Ranges) -> bool {
            let (small, large) = if a.0.len() <= b.0.len() {
                (a, b)
            } else {
                (b, a)
            };
            small.0.iter().any(|(s, e)| large.overlaps(*s, *e))
        }
        any(&self.v4, &other.v4) || any(&self.v6, &other.v6)
    }

    /// Whether the set is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.v4.0.is_empty() && self.v6.0.is_empty()
    }

    /// The minimal CIDR cover, IPv4 first, each family by address.
    #[must_use]
    pub fn to_prefixes(&self) -> Vec<IpNet> {
        let mut out = Vec::new();
        for (s, e) in &self.v4.0 {
            cover(*s, *e, 32, &mut out);
        }
        for (s, e) in &self.v6.0 {
            cover(*s, *e, 128, &mut out);
        }
        out
    }
}

/// Appends the largest aligned blocks covering `[s, e]` in a family of `width` bits.
fn cover(mut s: u128, e: u128, width: u32, out: &mut Vec<IpNet>) {
    // s aligned to 2^k cannot overflow s + 2^k - 1.
    let block_last = |s: u128, k: u32| {
        if k >= 128 {
            u128::MAX
        } else {
            s + ((1u128 << k) - 1)
        }
    };
    loop {
        let mut k = s.trailing_zeros().min(width);
        while k > 0 && block_last(s, k) > e {
            k -= 1;
        }
        let len = u8::try_from(width - k).unwrap_or(0);
        let net = if width == 32 {
            IpNet::new(
                IpAddr::V4(Ipv4Addr::from(u32::try_from(s).unwrap_or(0))),
                len,
            )
        } else {
            IpNet::new(IpAddr::V6(Ipv6Addr::from(s)), len)
        };
        if let Ok(n) = net {
            out.push(n);
        }
        let last = block_last(s, k);
        if last >= e {
            return;
        }
        s = last + 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(items: &[&str]) -> PrefixSet {
        let mut s = PrefixSet::new();
        for i in items {
            s.insert(&i.parse().unwrap());
        }
        s
    }

    fn text(s: &PrefixSet) -> Vec<String> {
        s.to_prefixes().iter().map(ToString::to_string).collect()
    }

    #[test]
    fn union_merges_adjacent_and_cover_is_minimal() {
        let s = set(&["10.0.0.0/25", "10.0.0.128/25", "10.0.1.0/32", "fd00::/64"]);
        assert_eq!(text(&s), ["10.0.0.0/24", "10.0.1.0/32", "fd00::/64"]);
        assert_eq!(text(&set(&["0.0.0.0/0", "::/0"])), ["0.0.0.0/0", "::/0"]);
    }

    #[test]
    fn subtract_splits_ranges() {
        let mut s = set(&["10.244.3.0/24"]);
        s.subtract(&set(&["10.244.3.128/25"]));
        assert_eq!(text(&s), ["10.244.3.0/25"]);
        let mut s = set(&["10.0.0.0/24"]);
        s.remove(&"10.0.0.5/32".parse().unwrap());
        assert_eq!(
            text(&s),
            [
                "10.0.0.0/30",
                "10.0.0.4/32",
                "10.0.0.6/31",
                "10.0.0.8/29",
                "10.0.0.16/28",
                "10.0.0.32/27",
                "10.0.0.64/26",
                "10.0.0.128/25"
            ]
        );
        assert!(s.overlaps(&set(&["10.0.0.0/29"])));
        assert!(!s.overlaps(&set(&["10.0.0.5/32", "10.0.1.0/24"])));
        let mut all = set(&["::/0"]);
        all.subtract(&set(&["::/0"]));
        assert!(all.is_empty());
    }
}
