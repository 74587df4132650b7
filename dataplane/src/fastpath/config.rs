//! How the fast path is set up: where the classifier goes and which lookup
//! structure it uses.

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
/// [`MarkingSpec`](crate::markspec::MarkingSpec).
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
