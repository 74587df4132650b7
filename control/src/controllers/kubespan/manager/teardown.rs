//! Tearing mesh kernel state down: when the mesh is disabled, when the link is
//! renamed, and on stop with `OnStop::Teardown`.

use super::{blocking, KubeSpanManagerController};
use crate::{
    config::kubespan::FastPath,
    runtime::{ControllerError, ControllerRuntime},
};

impl KubeSpanManagerController {
    /// Removes kernel state (device, marking table, the mesh's rules and routes; rules
    /// and routes from network documents carry another marker and stay).
    pub(super) async fn teardown_kernel(&mut self) {
        // The link's own setting back first (the link may outlive the device).
        if let (Some(rp), Some(sysctl)) = (self.kernel.rp_filter.take(), self.deps.sysctl.clone()) {
            if let Ok(((), Err(e))) = blocking((), move |()| rp.restore(&*sysctl)).await {
                tracing::warn!(link = %self.kernel.link, error = %e, "restoring rp_filter on the mesh link failed");
            }
        }
        if let Some(wg) = self.kernel.wg.take() {
            if let Ok((_, Err(e))) = blocking(wg, |w| w.teardown()).await {
                tracing::warn!(link = %self.kernel.link, error = %e, "removing the WireGuard device failed");
            }
        }
        let marking = match self.kernel.marking.take() {
            Some(m) => Some(m.marking),
            None if self.kernel.first_round => Some(
                self.deps
                    .marking
                    .create(FastPath::Nftables, &self.kernel.link)
                    .marking,
            ),
            None => None,
        };
        if let Some(m) = marking {
            if let Ok((_, Err(e))) = blocking(m, |m| m.teardown()).await {
                tracing::warn!(error = %e, "removing the marking table failed");
            }
        }
        if let Some(r) = self.deps.routing_cleanup.take() {
            match blocking(r, |r| r.teardown()).await {
                Ok((r, res)) => {
                    if let Err(e) = res {
                        tracing::warn!(error = %e, "removing mesh rules and routes failed");
                    }
                    self.deps.routing_cleanup = Some(r);
                }
                Err(e) => tracing::warn!(error = %e, "routing cleanup task failed"),
            }
        }
        self.mesh.forget_device();
    }

    /// Disabled: remove kernel state and every output.
    pub(super) async fn disable(
        &mut self,
        rt: &mut ControllerRuntime,
    ) -> Result<(), ControllerError> {
        let active =
            self.kernel.wg.is_some() || self.kernel.marking.is_some() || self.kernel.first_round;
        if active {
            tracing::info!("mesh disabled: tearing down");
            self.teardown_kernel().await;
        }
        self.mesh.disable();
        self.destroy_outputs(rt)?;
        Ok(())
    }
}
