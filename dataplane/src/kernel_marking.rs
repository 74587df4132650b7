//! The daemon's marking (`docs/kubespan.md` §6.6): the nftables table alone, or the
//! eBPF fast path's tc classifier for forwarded traffic plus the table without its
//! prerouting set lookups.
//!
//! [`KernelMarking`] builds either in a namespace. [`compose`] is the choice itself,
//! with the classifier's attach passed in so that tests run it against fakes, and
//! [`FastPathMarking`] is the composed adapter. The mesh never runs without marking:
//! when the classifier cannot be attached, the table alone marks, and the caller is
//! told why ([`Composed::fallback`]).
//!
//! This module is the one place that knows both [`crate::marking`] and
//! [`crate::fastpath`]; neither of those knows it.

use crate::{
    fastpath::{self, CounterReader, FastPath, FastPathConfig, FastPathError, Interfaces},
    marking::{
        AppliedSpec, Marking, MarkingError, MarkingSpec, MarkingStatus, NftMarking, PrefixDelta,
        PreroutingMarking,
    },
    netns::Netns,
};

/// Marking in a namespace: nftables, with the tc classifier when asked for.
#[derive(Debug, Clone)]
pub struct KernelMarking {
    /// The namespace.
    pub netns: Netns,
}

impl KernelMarking {
    /// The marking for `wanted`: [`PreroutingMarking::Nftables`] is the table alone;
    /// [`PreroutingMarking::FastPath`] attaches the classifier on every interface but
    /// `lo`, the mesh link included (a peer relay forwards what arrives there, and it
    /// needs the mark, as nftables' prerouting chain gives it on every interface), and
    /// falls back to the table alone if that fails.
    #[must_use]
    pub fn create(&self, wanted: PreroutingMarking) -> Composed {
        let nft = NftMarking::new(self.netns.clone());
        let mut counters = None;
        let composed = compose(nft, wanted, || {
            let fp = FastPath::attach(
                &self.netns,
                FastPathConfig {
                    interfaces: Interfaces::all_except(Vec::<String>::new()),
                    ..FastPathConfig::default()
                },
            )?;
            counters = Some(fp.counter_reader());
            Ok(fp)
        });
        Composed {
            counters,
            ..composed
        }
    }
}

/// What [`compose`] or [`KernelMarking::create`] came to.
pub struct Composed {
    /// The adapter.
    pub marking: Box<dyn Marking + Send>,
    /// Who marks forwarded traffic with it.
    pub prerouting: PreroutingMarking,
    /// Why the classifier is not in use although it was asked for.
    pub fallback: Option<FastPathError>,
    /// The attached classifier's packet counters ([`KernelMarking::create`] only).
    pub counters: Option<CounterReader>,
}

impl std::fmt::Debug for Composed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Composed")
            .field("prerouting", &self.prerouting)
            .field("fallback", &self.fallback)
            .finish_non_exhaustive()
    }
}

/// The marking for `wanted`: `nft` alone for [`PreroutingMarking::Nftables`]; for
/// [`PreroutingMarking::FastPath`], `attach` the classifier and combine it with `nft`
/// in a [`FastPathMarking`], or, if attaching fails, `nft` alone (prerouting lookups
/// kept) with the error.
pub fn compose<N, C>(
    nft: N,
    wanted: PreroutingMarking,
    attach: impl FnOnce() -> Result<C, FastPathError>,
) -> Composed
where
    N: Marking + Send + 'static,
    C: Classifier + Send + 'static,
{
    let nftables_alone = |nft: N, fallback| Composed {
        marking: Box::new(nft),
        prerouting: PreroutingMarking::Nftables,
        fallback,
        counters: None,
    };
    if wanted == PreroutingMarking::Nftables {
        return nftables_alone(nft, None);
    }
    match attach() {
        Ok(classifier) => Composed {
            marking: Box::new(FastPathMarking::new(nft, classifier)),
            prerouting: PreroutingMarking::FastPath,
            fallback: None,
            counters: None,
        },
        Err(e) => nftables_alone(nft, Some(e)),
    }
}

/// The marking classifier as [`FastPathMarking`] needs it (implemented by
/// [`fastpath::FastPath`]).
pub trait Classifier {
    /// Syncs the classifier's maps to `spec`; returns whether anything was written.
    ///
    /// # Errors
    /// Invalid spec, capacity, or a map write failed.
    fn apply(&mut self, spec: &MarkingSpec) -> Result<bool, FastPathError>;
    /// Applies a routed-set delta to the maps (marks as last applied); returns whether
    /// anything was written.
    ///
    /// # Errors
    /// Nothing applied yet, invalid delta, capacity, or a map write failed.
    fn apply_delta(&mut self, delta: &PrefixDelta) -> Result<bool, FastPathError>;
    /// Detaches and unloads.
    ///
    /// # Errors
    /// A detach failed.
    fn teardown(self) -> Result<(), FastPathError>;
}

impl Classifier for FastPath {
    fn apply(&mut self, spec: &MarkingSpec) -> Result<bool, FastPathError> {
        fastpath::FastPath::apply(self, spec).map(|s| s.writes() > 0)
    }

    fn apply_delta(&mut self, delta: &PrefixDelta) -> Result<bool, FastPathError> {
        fastpath::FastPath::apply_delta(self, delta).map(|s| s.writes() > 0)
    }

    fn teardown(self) -> Result<(), FastPathError> {
        fastpath::FastPath::teardown(self)
    }
}

/// nftables for locally originated traffic plus the classifier for forwarded
/// traffic; once the classifier is torn down, nftables marks both again. Dropped
/// without teardown (a fast-path switch, or the daemon stopping with its kernel state
/// kept), it first restores the prerouting lookups, then detaches the classifier.
#[derive(Debug)]
pub struct FastPathMarking<N: Marking, C: Classifier> {
    nft: N,
    classifier: Option<C>,
    /// The last spec applied, with the deltas since (restored with nftables
    /// prerouting on drop). Kept as [`AppliedSpec`] so a delta updates it in time
    /// proportional to the delta.
    applied: Option<AppliedSpec>,
}

impl<N: Marking, C: Classifier> FastPathMarking<N, C> {
    /// `nft` and an attached `classifier`, nothing applied yet.
    pub fn new(nft: N, classifier: C) -> Self {
        Self {
            nft,
            classifier: Some(classifier),
            applied: None,
        }
    }
}

impl<N: Marking, C: Classifier> Drop for FastPathMarking<N, C> {
    fn drop(&mut self) {
        let Some(classifier) = self.classifier.take() else {
            return;
        };
        if let Some(applied) = self.applied.take() {
            let spec = MarkingSpec {
                prerouting: PreroutingMarking::Nftables,
                ..applied.to_spec()
            };
            if let Err(e) = self.nft.apply(&spec) {
                tracing::warn!(error = %e, "restoring the nftables prerouting marking failed");
            }
        }
        if let Err(e) = classifier.teardown() {
            tracing::warn!(error = %e, "detaching the eBPF fast path failed");
        }
    }
}

impl<N: Marking, C: Classifier> Marking for FastPathMarking<N, C> {
    fn apply(&mut self, spec: &MarkingSpec) -> Result<bool, MarkingError> {
        let Some(classifier) = self.classifier.as_mut() else {
            let spec = MarkingSpec {
                prerouting: PreroutingMarking::Nftables,
                ..spec.clone()
            };
            return self.nft.apply(&spec);
        };
        // Maps first, so forwarded traffic is marked before the prerouting lookups go.
        let maps = classifier.apply(spec).map_err(MarkingError::FastPath)?;
        let spec = MarkingSpec {
            prerouting: PreroutingMarking::FastPath,
            ..spec.clone()
        };
        let nft = self.nft.apply(&spec);
        // The maps hold `spec` now; nftables remembers it even when its write failed
        // (the next apply or delta writes it), so it is what a delta applies to.
        if !matches!(nft, Err(MarkingError::Invalid(_))) {
            // Updated in place: a new one would drop the index the next delta needs.
            match self.applied.as_mut() {
                Some(applied) => applied.assign(spec),
                None => self.applied = Some(AppliedSpec::new(spec)),
            }
        }
        Ok(nft? || maps)
    }

    /// The classifier's delta first (forwarded traffic is marked before anything
    /// else changes), then nftables'; both in time proportional to the delta. An
    /// invalid delta writes nothing.
    fn apply_delta(&mut self, delta: &PrefixDelta) -> Result<bool, MarkingError> {
        let Some(classifier) = self.classifier.as_mut() else {
            return self.nft.apply_delta(delta);
        };
        let applied = self.applied.as_mut().ok_or(MarkingError::NotApplied)?;
        if delta.is_empty() {
            return Ok(false);
        }
        applied.check_delta(delta)?;
        let maps = classifier
            .apply_delta(delta)
            .map_err(MarkingError::FastPath)?;
        let nft = self.nft.apply_delta(delta);
        if !matches!(
            nft,
            Err(MarkingError::Invalid(_) | MarkingError::NotApplied)
        ) {
            applied.apply_delta(delta)?;
        }
        Ok(nft? || maps)
    }

    fn observe(&mut self) -> Result<MarkingStatus, MarkingError> {
        self.nft.observe()
    }

    fn teardown(&mut self) -> Result<(), MarkingError> {
        let nft = self.nft.teardown();
        if let Some(c) = self.classifier.take() {
            c.teardown().map_err(MarkingError::FastPath)?;
        }
        nft
    }

    fn transactions(&self) -> u64 {
        self.nft.transactions()
    }
}

#[cfg(test)]
mod tests;
