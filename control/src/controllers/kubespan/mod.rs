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
    kernel_marking::{Composed, KernelMarking},
    marking::{NftMarking, PreroutingMarking},
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
/// else `wirespan wireguard`; wireguard-go when chosen).
#[derive(Debug, Clone)]
pub struct KernelWireGuard {
    /// The namespace.
    pub netns: Netns,
    /// Backend choice.
    pub choice: BackendChoice,
    /// The `wirespan` executable run as `wirespan wireguard` (`None`: this process's
    /// own executable).
    pub wirespan_binary: Option<PathBuf>,
}

impl WireGuardFactory for KernelWireGuard {
    /// `wireguard::select` looks at what holds the link first: it adopts a running
    /// userspace device or a kernel link, and removes a TUN nobody serves.
    fn create(&self, link: &str) -> Result<Box<dyn WireGuard + Send>, WgError> {
        wireguard::select_with_binary(
            self.choice,
            link,
            &self.netns,
            self.wirespan_binary.as_deref(),
        )
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

/// The daemon's marking factory: the kernel's marking
/// ([`wirespan_dataplane::kernel_marking`]: nftables, or the eBPF classifier on every
/// interface but `lo` plus nftables) with the classifier's packet counters exported.
#[derive(Debug, Clone)]
pub struct KernelMarkingFactory {
    /// Builds the adapters.
    pub marking: KernelMarking,
    /// Where the classifier's packet counters are exported, if anywhere.
    pub metrics: Option<Arc<metrics::MeshMetrics>>,
}

impl MarkingFactory for KernelMarkingFactory {
    fn create(&self, fast_path: FastPath, _link: &str) -> MarkingChoice {
        let composed = self.marking.create(prerouting_of(fast_path));
        if let (Some(m), Some(reader)) = (&self.metrics, composed.counters.clone()) {
            m.set_fast_path_counters(Some(Box::new(move || reader.read())));
        }
        choice_of(composed)
    }
}

/// Who marks forwarded traffic for a configured fast path.
#[must_use]
pub fn prerouting_of(fast_path: FastPath) -> PreroutingMarking {
    match fast_path {
        FastPath::Nftables => PreroutingMarking::Nftables,
        FastPath::Ebpf => PreroutingMarking::FastPath,
    }
}

/// The manager's view of a composed marking: the fast path in use, and a note saying
/// why when it is not the configured one.
#[must_use]
pub fn choice_of(composed: Composed) -> MarkingChoice {
    let note = composed.fallback.map_or_else(String::new, |e| {
        let why = if e.is_unsupported() {
            "unsupported by this kernel"
        } else {
            "could not be attached"
        };
        format!("eBPF fast path {why} ({e}); marking with nftables")
    });
    MarkingChoice {
        marking: composed.marking,
        fast_path: match composed.prerouting {
            PreroutingMarking::Nftables => FastPath::Nftables,
            PreroutingMarking::FastPath => FastPath::Ebpf,
        },
        note,
    }
}

#[cfg(test)]
mod tests;
