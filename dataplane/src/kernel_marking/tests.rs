//! The composed marking against the fake nftables adapter and a counting classifier.

use std::sync::{Arc, Mutex};

use ipnet::IpNet;

use super::{compose, Classifier, FastPathMarking};
use crate::{
    fake::FakeMarking,
    fastpath::FastPathError,
    marking::{Marking as _, MarkingError, MarkingSpec, PrefixDelta, PreroutingMarking},
};

/// Counts applies; shares the count with the test.
#[derive(Clone, Default)]
struct CountingClassifier(Arc<Mutex<(usize, bool)>>);

impl Classifier for CountingClassifier {
    fn apply(&mut self, _spec: &MarkingSpec) -> Result<bool, FastPathError> {
        self.0.lock().unwrap().0 += 1;
        Ok(true)
    }

    fn apply_delta(&mut self, _delta: &PrefixDelta) -> Result<bool, FastPathError> {
        self.0.lock().unwrap().0 += 1;
        Ok(true)
    }

    fn teardown(self) -> Result<(), FastPathError> {
        self.0.lock().unwrap().1 = true;
        Ok(())
    }
}

#[test]
fn fast_path_marking_omits_prerouting_lookups_and_restores_them_when_dropped() {
    let nft = FakeMarking::new();
    let classifier = CountingClassifier::default();
    let mut m = FastPathMarking::new(nft.clone(), classifier.clone());
    let spec = MarkingSpec {
        prefixes_v4: vec!["10.5.0.1/32".parse().unwrap()],
        ..MarkingSpec::default()
    };
    assert!(m.apply(&spec).unwrap());
    assert_eq!(nft.spec().unwrap().prerouting, PreroutingMarking::FastPath);
    assert_eq!(*classifier.0.lock().unwrap(), (1, false));
    // Dropped without teardown (fast-path switch, or stop keeping kernel state):
    // nftables marks forwarded traffic again before the classifier goes.
    drop(m);
    let restored = nft.spec().unwrap();
    assert_eq!(restored.prerouting, PreroutingMarking::Nftables);
    assert_eq!(restored.prefixes_v4, spec.prefixes_v4);
    assert_eq!(*classifier.0.lock().unwrap(), (1, true));
}

#[test]
fn fast_path_marking_applies_deltas_to_both_and_restores_the_result_when_dropped() {
    let p = |s: &str| s.parse::<IpNet>().unwrap();
    let nft = FakeMarking::new();
    let classifier = CountingClassifier::default();
    let mut m = FastPathMarking::new(nft.clone(), classifier.clone());
    let delta = PrefixDelta {
        remove: vec![p("10.5.0.1/32")],
        add: vec![p("10.6.0.0/24"), p("fd00::1/128")],
    };
    assert!(matches!(
        m.apply_delta(&delta),
        Err(MarkingError::NotApplied)
    ));
    let spec = MarkingSpec {
        prefixes_v4: vec![p("10.5.0.1/32"), p("10.5.0.2/32")],
        ..MarkingSpec::default()
    };
    assert!(m.apply(&spec).unwrap());
    assert!(m.apply_delta(&delta).unwrap());
    assert_eq!(*classifier.0.lock().unwrap(), (2, false));
    let after = nft.spec().unwrap();
    assert_eq!(after.prerouting, PreroutingMarking::FastPath);
    let mut v4 = after.prefixes_v4.clone();
    v4.sort();
    assert_eq!(v4, vec![p("10.5.0.2/32"), p("10.6.0.0/24")]);
    assert_eq!(after.prefixes_v6, vec![p("fd00::1/128")]);
    // An invalid delta names the entry and reaches neither the maps nor nftables.
    let writes = nft.transactions();
    let bad = PrefixDelta {
        remove: vec![p("10.5.0.1/32")],
        add: vec![],
    };
    match m.apply_delta(&bad) {
        Err(MarkingError::Invalid(e)) => assert_eq!(e.field, "remove[0]"),
        other => panic!("{other:?}"),
    }
    assert_eq!(*classifier.0.lock().unwrap(), (2, false));
    assert_eq!(nft.transactions(), writes);
    // Dropped: nftables marks the routed set as the deltas left it.
    drop(m);
    let restored = nft.spec().unwrap();
    assert_eq!(restored.prerouting, PreroutingMarking::Nftables);
    let mut v4 = restored.prefixes_v4.clone();
    v4.sort();
    assert_eq!(v4, vec![p("10.5.0.2/32"), p("10.6.0.0/24")]);
    assert_eq!(restored.prefixes_v6, vec![p("fd00::1/128")]);
    assert_eq!(*classifier.0.lock().unwrap(), (2, true));
}

fn unsupported() -> FastPathError {
    FastPathError::Unsupported {
        what: "bpf syscall".into(),
        source: "not in tests".into(),
    }
}

#[test]
fn nftables_is_chosen_without_attaching_and_a_failed_attach_falls_back_with_its_error() {
    let mut attached = false;
    let c = compose(FakeMarking::new(), PreroutingMarking::Nftables, || {
        attached = true;
        Ok(CountingClassifier::default())
    });
    assert!(!attached, "nftables alone attaches nothing");
    assert_eq!(c.prerouting, PreroutingMarking::Nftables);
    assert!(c.fallback.is_none());

    let c = compose(FakeMarking::new(), PreroutingMarking::FastPath, || {
        Err::<CountingClassifier, _>(unsupported())
    });
    assert_eq!(c.prerouting, PreroutingMarking::Nftables);
    assert!(c.fallback.is_some_and(|e| e.is_unsupported()));

    let nft = FakeMarking::new();
    let classifier = CountingClassifier::default();
    let mut c = compose(nft.clone(), PreroutingMarking::FastPath, || {
        Ok(classifier.clone())
    });
    assert_eq!(c.prerouting, PreroutingMarking::FastPath);
    assert!(c.fallback.is_none());
    c.marking.apply(&MarkingSpec::default()).unwrap();
    assert_eq!(nft.spec().unwrap().prerouting, PreroutingMarking::FastPath);
    assert_eq!(*classifier.0.lock().unwrap(), (1, false));
}
