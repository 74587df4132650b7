//! KubeSpan controllers (`docs/kubespan.md`): the effective config, the
//! identity, peer specs from affiliates, and the manager that programs the kernel and
//! keeps peer statuses.

pub mod config;
pub mod identity;
pub mod manager;
pub mod metrics;
pub mod peer_spec;
pub mod server_relay;

use std::{path::PathBuf, sync::Arc};

use wirespan_dataplane::{
    fastpath::{self, FastPathConfig, FastPathError, Interfaces},
    marking::{
        AppliedSpec, Marking, MarkingError, MarkingSpec, MarkingStatus, NftMarking, PrefixDelta,
        PreroutingMarking,
    },
    netns::Netns,
    wireguard::{self, BackendChoice, WgError, WireGuard},
};

use self::{
    config::KubeSpanConfigController,
    identity::{KubeSpanIdentityController, LinkSource},
    manager::{
        KubeSpanManagerController, ManagerDeps, MarkingChoice, MarkingFactory, WireGuardFactory,
    },
    peer_spec::KubeSpanPeerSpecController,
};
use crate::{
    config::kubespan::FastPath,
    runtime::{RegistrationError, Runtime},
};

/// What the KubeSpan controllers need.
#[derive(Debug)]
pub struct Deps {
    /// Where the WireGuard key lives.
    pub state_dir: PathBuf,
    /// Links of the node (for the MAC of the KubeSpan address).
    pub links: Arc<dyn LinkSource>,
    /// The manager's adapters, clock, metrics and shutdown mode.
    pub manager: ManagerDeps,
}

/// Registers the five KubeSpan controllers.
///
/// # Errors
/// Output conflicts with other controllers.
pub fn register(runtime: &mut Runtime, deps: Deps) -> Result<(), RegistrationError> {
    runtime.register(KubeSpanConfigController)?;
    runtime.register(KubeSpanIdentityController::new(deps.state_dir, deps.links))?;
    runtime.register(KubeSpanPeerSpecController::new())?;
    runtime.register(KubeSpanManagerController::new(deps.manager))?;
    runtime.register(server_relay::ServerRelayController::new(Arc::new(
        server_relay::GrpcRelayAllocator,
    )))?;
    Ok(())
}

/// Real WireGuard backends in a namespace (`wireguard::select`: kernel if available,
/// else wireguard-go).
#[derive(Debug, Clone)]
pub struct KernelWireGuard {
    /// The namespace.
    pub netns: Netns,
    /// Backend choice.
    pub choice: BackendChoice,
}

impl WireGuardFactory for KernelWireGuard {
    fn create(&self, link: &str) -> Result<Box<dyn WireGuard + Send>, WgError> {
        let backend = wireguard::select(self.choice, link, &self.netns)?;
        let userspace = matches!(self.choice, BackendChoice::Userspace)
            || (matches!(self.choice, BackendChoice::Auto)
                && !wireguard::kernel::supported(&self.netns));
        // A running wireguard-go kept by an earlier run is adopted by the backend;
        // only a link nobody serves is stale.
        if userspace && !wireguard::userspace::adoptable(link, &self.netns) {
            remove_stale_link(&self.netns, link);
        }
        Ok(backend)
    }
}

/// A link of this name that no wireguard-go serves (a kernel WireGuard link, a leftover
/// of something else) would keep a new wireguard-go from creating the device: remove
/// it.
fn remove_stale_link(netns: &Netns, link: &str) {
    let exists = netns
        .run("ip", &["link", "show", "dev", link])
        .is_ok_and(|o| o.status.success());
    if exists {
        tracing::warn!(link, "removing a stale mesh link left by an earlier run");
        if let Err(e) = netns.run("ip", &["link", "del", "dev", link]) {
            tracing::warn!(link, error = %e, "could not remove the stale mesh link");
        }
    }
}

/// nftables marking in a namespace; the eBPF fast path is not built into this
/// factory, so `ebpf` falls back to nftables with a note.
#[derive(Debug, Clone)]
pub struct NftablesMarking {
    /// The namespace.
    pub netns: Netns,
}

impl MarkingFactory for NftablesMarking {
    fn create(&self, fast_path: FastPath, _link: &str) -> MarkingChoice {
        let note = match fast_path {
            FastPath::Nftables => String::new(),
            FastPath::Ebpf => {
                "eBPF fast path unavailable in this build; marking with nftables".to_owned()
            }
        };
        MarkingChoice {
            marking: Box::new(NftMarking::new(self.netns.clone())),
            fast_path: FastPath::Nftables,
            note,
        }
    }
}

/// The daemon's marking: nftables for `nftables`; for `ebpf` the tc classifier
/// ([`fastpath::FastPath`]) on every interface but `lo`, the mesh link included (a
/// peer relay forwards what arrives there and it needs the mark), plus the nftables
/// table without prerouting set lookups. If the classifier cannot be
/// attached, plain nftables marking with a note.
#[derive(Debug, Clone)]
pub struct KernelMarking {
    /// The namespace.
    pub netns: Netns,
    /// Where the classifier's packet counters are exported, if anywhere.
    pub metrics: Option<Arc<metrics::MeshMetrics>>,
}

impl MarkingFactory for KernelMarking {
    fn create(&self, fast_path: FastPath, _link: &str) -> MarkingChoice {
        let nft = NftMarking::new(self.netns.clone());
        fast_path_choice(fast_path, nft, || {
            let fp = fastpath::FastPath::attach(
                &self.netns,
                FastPathConfig {
                    // The mesh link too: a relay (§8.7) forwards what arrives on it to
                    // another peer, which takes the mark, as nftables' prerouting
                    // chain gives it on every interface.
                    interfaces: Interfaces::all_except(Vec::<String>::new()),
                    ..FastPathConfig::default()
                },
            )?;
            if let Some(m) = &self.metrics {
                let reader = fp.counter_reader();
                m.set_fast_path_counters(Some(Box::new(move || reader.read())));
            }
            Ok(fp)
        })
    }
}

/// Chooses the marking for `configured`: for `ebpf`, `attach` the classifier and
/// combine it with `nft`; if attaching fails, `nft` alone (prerouting lookups kept)
/// with a note saying why. The mesh never runs without marking.
pub fn fast_path_choice<F>(
    configured: FastPath,
    nft: impl Marking + Send + 'static,
    attach: impl FnOnce() -> Result<F, FastPathError>,
) -> MarkingChoice
where
    F: Classifier + Send + 'static,
{
    if configured == FastPath::Nftables {
        return MarkingChoice {
            marking: Box::new(nft),
            fast_path: FastPath::Nftables,
            note: String::new(),
        };
    }
    match attach() {
        Ok(classifier) => MarkingChoice {
            marking: Box::new(FastPathMarking {
                nft,
                classifier: Some(classifier),
                applied: None,
            }),
            fast_path: FastPath::Ebpf,
            note: String::new(),
        },
        Err(e) => {
            let why = if e.is_unsupported() {
                "unsupported by this kernel"
            } else {
                "could not be attached"
            };
            MarkingChoice {
                marking: Box::new(nft),
                fast_path: FastPath::Nftables,
                note: format!("eBPF fast path {why} ({e}); marking with nftables"),
            }
        }
    }
}

/// The marking classifier as the fast-path marking needs it (implemented by
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

impl Classifier for fastpath::FastPath {
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
struct FastPathMarking<N: Marking, C: Classifier> {
    nft: N,
    classifier: Option<C>,
    /// The last spec applied, with the deltas since (restored with nftables
    /// prerouting on drop). Kept as [`AppliedSpec`] so a delta updates it in time
    /// proportional to the delta.
    applied: Option<AppliedSpec>,
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
