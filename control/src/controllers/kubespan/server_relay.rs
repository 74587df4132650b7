//! The server relay's allocations (`docs/kubespan.md` §8.8): for every peer the mesh
//! manager can reach by neither a direct path nor a peer relay, ask the configured
//! discovery services, in order, for a relay allocation, keep it refreshed while the
//! peer needs it, and publish it as `kubespan/KubeSpanRelayEndpoint <public key>` for
//! the manager to use.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use futures::future::BoxFuture;
use wirespan_discovery::client::relay::{
    self as relay_client, AllocateCall, AllocateError, RelayEndpoint,
};

use crate::{
    config::cluster::DiscoveryServiceConfig,
    resources::{
        cluster::{self, ClusterIdentity, CLUSTER},
        config::MachineConfig,
        identity::{NodeIdentity, LOCAL},
        kubespan::{
            KubeSpanManagerStatus, KubeSpanRelayEndpoint, KubeSpanRelayEndpointSpec, KUBESPAN, NS,
        },
    },
    runtime::{
        Action, Controller, ControllerError, ControllerResult, ControllerRuntime, Input, InputKind,
        Output, Pointer, ResourceKind as _,
    },
};

/// How long one allocate call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// A peer no service could allocate for is asked for again after this.
const RETRY: Duration = Duration::from_secs(10);
/// A service that offers no relay is not asked again for this long.
const NOT_OFFERED_FOR: Duration = Duration::from_secs(300);
/// With nothing held or to retry, a round this long after the last one anyway.
const IDLE_RECHECK: Duration = Duration::from_secs(3600);

/// One allocate call, owned (the allocator may outlive the round's borrows).
#[derive(Debug, Clone)]
pub struct RelayRequest {
    /// Discovery service endpoint.
    pub endpoint: String,
    /// Cluster id.
    pub cluster_id: String,
    /// Cluster secret.
    pub secret: [u8; 32],
    /// This node.
    pub node_id: String,
    /// The peer.
    pub peer_node_id: String,
}

/// Asks a discovery service for an allocation (a trait so the controller can be
/// tested without a server).
pub trait RelayAllocator: Send + Sync {
    /// One allocate call.
    fn allocate(
        &self,
        req: RelayRequest,
    ) -> BoxFuture<'static, Result<RelayEndpoint, AllocateError>>;
}

/// The allocator that calls the service's `wirespan.relay.v1.Relay`.
#[derive(Debug, Clone, Copy, Default)]
pub struct GrpcRelayAllocator;

impl RelayAllocator for GrpcRelayAllocator {
    fn allocate(
        &self,
        req: RelayRequest,
    ) -> BoxFuture<'static, Result<RelayEndpoint, AllocateError>> {
        Box::pin(async move {
            relay_client::allocate(&AllocateCall {
                endpoint: &req.endpoint,
                insecure: false,
                cluster_id: &req.cluster_id,
                secret: &req.secret,
                node_id: &req.node_id,
                peer_node_id: &req.peer_node_id,
                timeout: CALL_TIMEOUT,
            })
            .await
        })
    }
}

#[derive(Debug, Clone)]
struct Held {
    endpoint: SocketAddr,
    refresh_at: Instant,
}

/// Keeps the server relay allocations the mesh manager asks for.
pub struct ServerRelayController {
    allocator: Arc<dyn RelayAllocator>,
    held: BTreeMap<String, Held>,
    retry_at: BTreeMap<String, Instant>,
    not_offered: BTreeMap<String, Instant>,
}

impl ServerRelayController {
    /// A controller calling through `allocator`.
    #[must_use]
    pub fn new(allocator: Arc<dyn RelayAllocator>) -> Self {
        Self {
            allocator,
            held: BTreeMap::new(),
            retry_at: BTreeMap::new(),
            not_offered: BTreeMap::new(),
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.held
            .values()
            .map(|h| h.refresh_at)
            .chain(self.retry_at.values().copied())
            .min()
    }

    async fn round(&mut self, rt: &mut ControllerRuntime) -> Result<(), ControllerError> {
        let wanted = rt
            .get_opt::<KubeSpanManagerStatus>(NS, KUBESPAN)?
            .map(|r| r.spec.server_relay_wanted.clone())
            .unwrap_or_default();
        let config = MachineConfig::active(rt)?;
        let cluster = rt.get_opt::<ClusterIdentity>(cluster::NS, CLUSTER)?;
        let node = rt.get_opt::<NodeIdentity>(NodeIdentity::DEFAULT_NAMESPACE, LOCAL)?;
        let services: Vec<(String, String)> = config
            .iter()
            .flat_map(|c| c.spec.config.documents_of::<DiscoveryServiceConfig>())
            .map(|d| (d.name.clone(), d.endpoint.clone()))
            .collect();
        // Allocations no longer needed go (the server lets them expire).
        for r in rt.list::<KubeSpanRelayEndpoint>(NS)? {
            let key = &r.metadata.id;
            if !wanted.iter().any(|w| &w.public_key == key) {
                tracing::info!(peer = ?key, "server relay allocation no longer needed");
                rt.destroy(&Pointer::new(NS, KubeSpanRelayEndpoint::TYPE, key))?;
            }
        }
        self.held
            .retain(|k, _| wanted.iter().any(|w| &w.public_key == k));
        self.retry_at
            .retain(|k, _| wanted.iter().any(|w| &w.public_key == k));
        let (Some(cluster), Some(node)) = (cluster, node) else {
            return Ok(());
        };
        let now = Instant::now();
        for want in &wanted {
            let key = &want.public_key;
            if self.held.get(key).is_some_and(|h| h.refresh_at > now)
                || self.retry_at.get(key).is_some_and(|t| *t > now)
            {
                continue;
            }
            let mut granted = None;
            for (name, endpoint) in &services {
                if self.not_offered.get(name).is_some_and(|t| *t > now) {
                    continue;
                }
                let req = RelayRequest {
                    endpoint: endpoint.clone(),
                    cluster_id: cluster.spec.cluster_id.clone(),
                    secret: *cluster.spec.secret.bytes(),
                    node_id: node.spec.node_id.clone(),
                    peer_node_id: want.affiliate_id.clone(),
                };
                match self.allocator.allocate(req).await {
                    Ok(ep) => {
                        granted = Some((name.clone(), ep));
                        break;
                    }
                    Err(AllocateError::NotOffered) => {
                        tracing::info!(service = %name, "discovery service offers no relay");
                        self.not_offered.insert(name.clone(), now + NOT_OFFERED_FOR);
                    }
                    Err(e) => {
                        tracing::warn!(service = %name, peer = ?key, error = %e, "server relay allocation failed");
                    }
                }
            }
            let Some((service, ep)) = granted else {
                // A held allocation stays published until the server would expire it.
                self.retry_at.insert(key.clone(), now + RETRY);
                continue;
            };
            if self.held.get(key).map(|h| h.endpoint) != Some(ep.endpoint) {
                tracing::info!(peer = ?key, service = %service, relay = %ep.endpoint, "server relay allocation granted");
            }
            self.retry_at.remove(key);
            self.held.insert(
                key.clone(),
                Held {
                    endpoint: ep.endpoint,
                    refresh_at: now + (ep.ttl / 3).max(RETRY),
                },
            );
            let spec = KubeSpanRelayEndpointSpec {
                affiliate_id: want.affiliate_id.clone(),
                endpoint: Some(ep.endpoint),
                service,
            };
            rt.modify::<KubeSpanRelayEndpoint>(NS, key, |r| r.spec.clone_from(&spec))?;
        }
        Ok(())
    }
}

impl Controller for ServerRelayController {
    type Event = ();

    fn name(&self) -> &str {
        "KubeSpanServerRelayController"
    }

    fn inputs(&self) -> Vec<Input> {
        vec![
            Input::id_of::<KubeSpanManagerStatus>(NS, KUBESPAN, InputKind::Weak),
            MachineConfig::input(),
            Input::id_of::<ClusterIdentity>(cluster::NS, CLUSTER, InputKind::Weak),
            Input::id_of::<NodeIdentity>(NodeIdentity::DEFAULT_NAMESPACE, LOCAL, InputKind::Weak),
        ]
    }

    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<KubeSpanRelayEndpoint>()]
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            self.round(rt).await?;
            Ok(match self.next_deadline() {
                Some(d) => Action::requeue_at(d.into()),
                None => Action::requeue_after(IDLE_RECHECK),
            })
        })
    }
}
