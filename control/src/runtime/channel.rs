//! The per-kind channel between the store and its watches: the kind's resources, a
//! bounded ring of its events with absolute positions, and one `Notify`. The store
//! writes through it; each watch keeps its own position and reads the ring.

use std::{
    collections::{BTreeMap, VecDeque},
    sync::{Arc, Mutex, PoisonError},
};

use tokio::sync::Notify;

use super::{
    error::StateError,
    event::RingEvent,
    metadata::{Kind, Metadata, Pointer},
    resource::AnyResource,
};

pub(crate) struct KindState {
    pub(crate) resources: BTreeMap<String, Arc<dyn AnyResource>>,
    pub(crate) ring: VecDeque<RingEvent>,
    /// Absolute position of `ring[0]`.
    pub(crate) start: u64,
}

impl KindState {
    pub(crate) fn head(&self) -> u64 {
        self.start + self.ring.len() as u64
    }

    /// The metadata of `ptr`'s resource, if it exists and `owner` owns it.
    pub(crate) fn owned(&self, ptr: &Pointer, owner: &str) -> Result<&Metadata, StateError> {
        let Some(cur) = self.resources.get(&ptr.id) else {
            return Err(StateError::NotFound {
                pointer: ptr.clone(),
            });
        };
        let md = cur.metadata();
        if md.owner != owner {
            return Err(StateError::OwnerConflict {
                pointer: ptr.clone(),
                owner: md.owner.clone(),
            });
        }
        Ok(md)
    }
}

pub(crate) struct KindShared {
    pub(crate) kind: Kind,
    pub(crate) capacity: usize,
    pub(crate) state: Mutex<KindState>,
    pub(crate) notify: Notify,
}

impl KindShared {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, KindState> {
        // A panic while holding the lock cannot leave the map half-written (each critical
        // section does one insert/remove and one push), so poisoning is ignored.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn push(&self, st: &mut KindState, ev: RingEvent) {
        if st.ring.len() == self.capacity {
            st.ring.pop_front();
            st.start += 1;
        }
        st.ring.push_back(ev);
    }
}
