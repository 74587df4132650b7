//! [`PrefixDelta`]: a change of the routed set, given instead of the next whole spec.

use ipnet::IpNet;

use super::MarkingSpec;
use crate::error::Invalid;

/// A change of the routed set relative to the spec last applied. Like the spec's
/// prefix lists, the routed set is a multiset: each entry of `remove` takes away one
/// occurrence, each entry of `add` adds one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixDelta {
    /// Occurrences to remove (each must be present).
    pub remove: Vec<IpNet>,
    /// Occurrences to add (host bits must be zero).
    pub add: Vec<IpNet>,
}

impl PrefixDelta {
    /// Whether nothing changes.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.remove.is_empty() && self.add.is_empty()
    }

    /// Checks the added prefixes; nothing is written when this fails.
    ///
    /// # Errors
    /// The first prefix with host bits set.
    pub fn validate(&self) -> Result<(), Invalid> {
        for (i, p) in self.add.iter().enumerate() {
            if p.trunc() != *p {
                return Err(Invalid::new(
                    format!("add[{i}]"),
                    format!("{p} has host bits set (expected {})", p.trunc()),
                ));
            }
        }
        Ok(())
    }

    /// `spec` with this change. An added prefix takes the position of a removed one of
    /// its family where it can (so a spec compared position by position afterwards
    /// differs in few places); other additions are appended.
    ///
    /// # Errors
    /// An added prefix is invalid, or a removed one is not in `spec`.
    pub fn applied_to(&self, spec: &MarkingSpec) -> Result<MarkingSpec, Invalid> {
        self.validate()?;
        let mut out = spec.clone();
        let mut free: (Vec<usize>, Vec<usize>) = (Vec::new(), Vec::new());
        for (i, p) in self.remove.iter().enumerate() {
            let (list, free) = match p {
                IpNet::V4(_) => (&out.prefixes_v4, &mut free.0),
                IpNet::V6(_) => (&out.prefixes_v6, &mut free.1),
            };
            let at = list
                .iter()
                .enumerate()
                .position(|(k, q)| q == p && !free.contains(&k))
                .ok_or_else(|| {
                    Invalid::new(
                        format!("remove[{i}]"),
                        format!("{p} is not in the routed set"),
                    )
                })?;
            free.push(at);
        }
        for p in &self.add {
            let (list, free) = match p {
                IpNet::V4(_) => (&mut out.prefixes_v4, &mut free.0),
                IpNet::V6(_) => (&mut out.prefixes_v6, &mut free.1),
            };
            match free.pop() {
                Some(at) => list[at] = *p,
                None => list.push(*p),
            }
        }
        for (list, free) in [
            (&mut out.prefixes_v4, &mut free.0),
            (&mut out.prefixes_v6, &mut free.1),
        ] {
            // Highest position first, so every index stays valid.
            free.sort_unstable();
            for at in free.iter().rev() {
                list.swap_remove(*at);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delta_reuses_removed_positions_and_names_what_is_missing() {
        let p = |s: &str| s.parse::<IpNet>().unwrap();
        let spec = MarkingSpec {
            prefixes_v4: vec![p("10.0.0.1/32"), p("10.1.0.0/24"), p("10.0.0.1/32")],
            prefixes_v6: vec![p("fd00::1/128")],
            ..MarkingSpec::default()
        };
        let delta = PrefixDelta {
            remove: vec![p("10.1.0.0/24"), p("10.0.0.1/32"), p("fd00::1/128")],
            add: vec![p("10.9.0.0/16")],
        };
        let out = delta.applied_to(&spec).unwrap();
        // One occurrence of the duplicate stays; the /16 takes a freed position.
        let mut v4 = out.prefixes_v4.clone();
        v4.sort();
        assert_eq!(v4, vec![p("10.0.0.1/32"), p("10.9.0.0/16")]);
        assert!(out.prefixes_v6.is_empty());
        let missing = PrefixDelta {
            remove: vec![p("10.1.0.0/24"), p("10.1.0.0/24")],
            add: vec![],
        };
        assert_eq!(missing.applied_to(&spec).unwrap_err().field, "remove[1]");
        let host_bits = PrefixDelta {
            remove: vec![],
            add: vec![p("10.1.0.1/24")],
        };
        assert_eq!(host_bits.applied_to(&spec).unwrap_err().field, "add[0]");
    }
}
