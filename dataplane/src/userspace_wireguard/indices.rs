//! The device's receiver indices: which peer a random 32-bit index on the wire
//! belongs to. Every handshake and keypair takes a fresh random index, so an index
//! says nothing about the peer or how many came before (the peer's own id never goes
//! on the wire). A leaf lock: taken inside a peer's lock, never the other way round.

use std::{
    collections::{hash_map::Entry, HashMap},
    sync::{PoisonError, RwLock},
};

use super::noise::random;

/// Local index → peer id.
#[derive(Debug, Default)]
pub struct Indices(RwLock<HashMap<u32, u32>>);

impl Indices {
    /// A new random index for `peer`, unused by any other.
    pub fn allocate(&self, peer: u32) -> u32 {
        let mut map = self.0.write().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Entry::Vacant(e) = map.entry(random::u32()) {
                return *e.insert_entry(peer).key();
            }
        }
    }

    /// Frees indices no longer in use.
    pub fn release(&self, indices: impl IntoIterator<Item = u32>) {
        let mut indices = indices.into_iter().peekable();
        if indices.peek().is_none() {
            return;
        }
        let mut map = self.0.write().unwrap_or_else(PoisonError::into_inner);
        for i in indices {
            map.remove(&i);
        }
    }

    /// The peer `index` belongs to.
    pub fn lookup(&self, index: u32) -> Option<u32> {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&index)
            .copied()
    }

    /// Indices in use (tests).
    pub fn len(&self) -> usize {
        self.0.read().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// True when none is in use.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_are_random_distinct_and_released() {
        let ix = Indices::default();
        let a: Vec<u32> = (0..1000).map(|_| ix.allocate(7)).collect();
        assert_eq!(ix.len(), 1000);
        assert!(a.iter().all(|i| ix.lookup(*i) == Some(7)));
        // Not a counter: consecutive indices are not consecutive numbers.
        let steps = a
            .windows(2)
            .filter(|w| w[1].wrapping_sub(w[0]) < 256)
            .count();
        assert!(steps < 5, "{steps} near-consecutive indices");
        ix.release(a.iter().copied());
        assert!(ix.is_empty());
    }
}
