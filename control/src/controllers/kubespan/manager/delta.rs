//! The delta round: the plan for the peers whose specs changed
//! (`MeshState::plan_delta`), applied as WireGuard peer changes and a routed-set
//! delta, and their outputs written, so its work is proportional to the change, not
//! to the mesh.

use std::time::SystemTime;

use wirespan_dataplane::wireguard::PresharedKey;

use super::{blocking, wg_error, KubeSpanManagerController, ManagerError};
use crate::{
    config::kubespan::KubeSpanConfigDocument as Settings,
    kubespan::{
        planner::{MarkingPlan, Plan, WireGuardPlan},
        rotation::RECONCILE_TICK,
    },
    resources::cluster::ClusterIdentity,
    runtime::{ControllerError, ControllerRuntime, Resource},
};

impl KubeSpanManagerController {
    /// A delta round over the peers `keys` (see [`Self::reconcile`]).
    pub(super) async fn delta_round(
        &mut self,
        rt: &mut ControllerRuntime,
        s: &Settings,
        cluster: &Resource<ClusterIdentity>,
        keys: &[String],
        now: SystemTime,
    ) -> Result<Option<SystemTime>, ControllerError> {
        let psk = PresharedKey::from_bytes(*cluster.spec.secret.bytes());
        let plan = self.mesh.plan_delta(keys, s, &psk, now);
        self.note_plan(&plan);
        let Plan {
            wireguard: WireGuardPlan::Peers(changes),
            marking: MarkingPlan::Delta(delta),
            statuses,
            wake,
            ..
        } = plan
        else {
            unreachable!("a delta plan is a delta");
        };
        let wg = self
            .kernel
            .wg
            .take()
            .unwrap_or_else(|| unreachable!("checked by the caller"));
        let (wg, res) = blocking(wg, move |w| w.apply_peers(&changes)).await?;
        self.kernel.wg = Some(wg);
        res.map_err(|source| wg_error(&s.link_name, source))?;
        if !delta.is_empty() {
            let m = self
                .kernel
                .marking
                .take()
                .unwrap_or_else(|| unreachable!("set by a complete round"));
            let (m, res) = blocking(m, move |m| m.marking.apply_delta(&delta)).await?;
            self.kernel.marking = Some(m);
            res.map_err(|e| ControllerError::other(ManagerError::Marking(e)))?;
        }
        for key in &statuses {
            self.write_status(rt, key)?;
            self.write_harvested(rt, s, key)?;
        }
        self.write_manager_status(rt, s)?;
        let tick = self.kernel.last_read.map(|t| t + RECONCILE_TICK);
        Ok(match (wake, tick) {
            (Some(w), Some(t)) => Some(w.min(t)),
            (w, t) => w.or(t),
        })
    }
}
