//! The spec controllers' start-up sweep (`docs/runtime.md` §4.5): kernel objects that
//! carry the network documents' marker (protocol 212, `IFA_PROTO` 212, the link alias)
//! but that no spec names any more are left over from an earlier run: a process killed
//! during a trial, or a document removed while the node was down. Their specs are
//! gone, so no finalizer will ever remove them.
//!
//! [`Sweep`] is the pure rule, with the time passed in. Nothing is swept before the
//! config in force has been loaded (an empty spec set during start-up says nothing), and
//! an object is removed only after it stayed unmatched for [`SWEEP_SETTLE`] since it
//! was first seen so with a config loaded, which covers the specs of a kept-state
//! restart arriving a moment after the controller started. The sweep ends with the
//! first round past the settle time that finds nothing left to remove; from then on
//! the finalizers remove what a spec made.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::Duration,
};

use tokio::time::Instant;

/// How long a marked object must stay unmatched by any spec, with a config loaded,
/// before the sweep removes it.
pub const SWEEP_SETTLE: Duration = Duration::from_secs(10);

/// What one sweep round decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SweepPlan<K> {
    /// Objects to remove now.
    pub remove: Vec<K>,
    /// When to look again (the earliest settle deadline still pending); `None` when
    /// nothing is pending.
    pub recheck_at: Option<Instant>,
}

impl<K> Default for SweepPlan<K> {
    fn default() -> Self {
        Self {
            remove: Vec::new(),
            recheck_at: None,
        }
    }
}

/// The sweep's memory across rounds: since when each marked object has been unmatched.
#[derive(Debug, Clone)]
pub struct Sweep<K> {
    settle: Duration,
    /// When a config was first seen loaded.
    loaded_at: Option<Instant>,
    unmatched_since: BTreeMap<K, Instant>,
    done: bool,
}

impl<K: Ord + Clone> Sweep<K> {
    /// A sweep that removes objects unmatched for `settle`.
    #[must_use]
    pub fn new(settle: Duration) -> Self {
        Self {
            settle,
            loaded_at: None,
            unmatched_since: BTreeMap::new(),
            done: false,
        }
    }

    /// Whether the sweep still runs (the controller lists the kernel only then).
    #[must_use]
    pub fn active(&self) -> bool {
        !self.done
    }

    /// One round: `marked` are the keys of the kernel objects carrying the documents'
    /// marker, `wanted` the keys every spec names (any phase), `config_loaded` whether
    /// the config loader has put a config in force.
    pub fn plan(
        &mut self,
        config_loaded: bool,
        marked: &BTreeSet<K>,
        wanted: &BTreeSet<K>,
        now: Instant,
    ) -> SweepPlan<K> {
        if self.done {
            return SweepPlan::default();
        }
        if !config_loaded {
            // Woken again when the config arrives; nothing counts before it.
            self.unmatched_since.clear();
            return SweepPlan::default();
        }
        let loaded_at = *self.loaded_at.get_or_insert(now);
        let unmatched: BTreeSet<&K> = marked.difference(wanted).collect();
        // A spec that arrived (or an object that went) ends its wait.
        self.unmatched_since.retain(|k, _| unmatched.contains(k));
        for k in &unmatched {
            self.unmatched_since.entry((*k).clone()).or_insert(now);
        }
        let mut plan = SweepPlan::default();
        for (k, since) in &self.unmatched_since {
            let due = *since + self.settle;
            if now >= due {
                plan.remove.push(k.clone());
            } else {
                plan.recheck_at = Some(plan.recheck_at.map_or(due, |t: Instant| t.min(due)));
            }
        }
        if unmatched.is_empty() && now >= loaded_at + self.settle {
            self.done = true;
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(keys: &[&'static str]) -> BTreeSet<&'static str> {
        keys.iter().copied().collect()
    }

    const S: Duration = Duration::from_secs(10);

    #[test]
    fn within_settle_kept_after_settle_removed() {
        let t0 = Instant::now();
        let mut sw = Sweep::new(S);
        let p = sw.plan(true, &set(&["old", "kept"]), &set(&["kept"]), t0);
        assert!(p.remove.is_empty());
        assert_eq!(p.recheck_at, Some(t0 + S));
        let p = sw.plan(true, &set(&["old", "kept"]), &set(&["kept"]), t0 + S / 2);
        assert!(p.remove.is_empty());
        assert_eq!(p.recheck_at, Some(t0 + S));
        let p = sw.plan(true, &set(&["old", "kept"]), &set(&["kept"]), t0 + S);
        assert_eq!(p.remove, vec!["old"]);
        assert_eq!(p.recheck_at, None);
        assert!(sw.active(), "still one to confirm gone");
        let p = sw.plan(true, &set(&["kept"]), &set(&["kept"]), t0 + S);
        assert!(p.remove.is_empty());
        assert!(
            !sw.active(),
            "nothing left past the settle time: the sweep ends"
        );
    }

    #[test]
    fn a_spec_arriving_within_settle_keeps_the_object() {
        let t0 = Instant::now();
        let mut sw = Sweep::new(S);
        assert!(sw.plan(true, &set(&["r"]), &set(&[]), t0).remove.is_empty());
        let p = sw.plan(
            true,
            &set(&["r"]),
            &set(&["r"]),
            t0 + S - Duration::from_millis(1),
        );
        assert_eq!(p, SweepPlan::default());
        let p = sw.plan(true, &set(&["r"]), &set(&["r"]), t0 + 2 * S);
        assert!(p.remove.is_empty());
        assert!(!sw.active());
    }

    #[test]
    fn an_object_unmatched_again_waits_a_full_settle_time() {
        let t0 = Instant::now();
        let mut sw = Sweep::new(S);
        sw.plan(true, &set(&["r"]), &set(&[]), t0);
        sw.plan(true, &set(&["r"]), &set(&["r"]), t0 + S / 2);
        let p = sw.plan(true, &set(&["r"]), &set(&[]), t0 + S);
        assert!(p.remove.is_empty());
        assert_eq!(p.recheck_at, Some(t0 + 2 * S));
        assert_eq!(
            sw.plan(true, &set(&["r"]), &set(&[]), t0 + 2 * S).remove,
            vec!["r"]
        );
    }

    #[test]
    fn nothing_is_swept_before_the_config_is_loaded() {
        let t0 = Instant::now();
        let mut sw = Sweep::new(S);
        for i in 0..5 {
            let p = sw.plan(false, &set(&["r"]), &set(&[]), t0 + i * S);
            assert_eq!(p, SweepPlan::default());
            assert!(sw.active());
        }
        // The settle time counts from the config's arrival, not the start.
        let t1 = t0 + 5 * S;
        let p = sw.plan(true, &set(&["r"]), &set(&[]), t1);
        assert!(p.remove.is_empty());
        assert_eq!(p.recheck_at, Some(t1 + S));
        assert_eq!(
            sw.plan(true, &set(&["r"]), &set(&[]), t1 + S).remove,
            vec!["r"]
        );
    }

    #[test]
    fn unmarked_objects_are_never_candidates() {
        // The caller passes only marked objects: an object absent from `marked` (the
        // operator's own route, the mesh's) is never planned, however long it stays.
        let t0 = Instant::now();
        let mut sw = Sweep::new(S);
        for i in 0..3 {
            let p = sw.plan(true, &set(&[]), &set(&["spec"]), t0 + i * S);
            assert_eq!(p, SweepPlan::default());
        }
        assert!(!sw.active());
    }

    #[test]
    fn an_ended_sweep_removes_nothing() {
        let t0 = Instant::now();
        let mut sw = Sweep::new(S);
        sw.plan(true, &set(&[]), &set(&[]), t0);
        sw.plan(true, &set(&[]), &set(&[]), t0 + S);
        assert!(!sw.active());
        let p = sw.plan(true, &set(&["late"]), &set(&[]), t0 + 5 * S);
        assert_eq!(p, SweepPlan::default());
    }
}
