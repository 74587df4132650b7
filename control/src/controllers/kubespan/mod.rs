//! KubeSpan controllers (spec `kubespan-dataplane.md`): the effective config, the
//! identity, peer specs from affiliates, and the manager that programs the kernel and
//! keeps peer statuses.

pub mod config;
pub mod identity;
pub mod manager;
pub mod metrics;
pub mod peer_spec;

use std::{path::PathBuf, sync::Arc};

use wirespan_dataplane::{
    marking::NftMarking,
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

/// Registers the four KubeSpan controllers.
///
/// # Errors
/// Output conflicts with other controllers.
pub fn register(runtime: &mut Runtime, deps: Deps) -> Result<(), RegistrationError> {
    runtime.register(KubeSpanConfigController)?;
    runtime.register(KubeSpanIdentityController::new(deps.state_dir, deps.links))?;
    runtime.register(KubeSpanPeerSpecController::new())?;
    runtime.register(KubeSpanManagerController::new(deps.manager))?;
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
        if userspace {
            remove_stale_link(&self.netns, link);
        }
        Ok(backend)
    }
}

/// A link left by a crashed daemon (its wireguard-go may still hold it) would keep a
/// new wireguard-go from creating the device: remove it; wireguard-go exits with it.
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
    fn create(&self, fast_path: FastPath) -> MarkingChoice {
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

#[cfg(test)]
mod tests;
