//! One discovery client per `DiscoveryServiceConfig` document, run as sub-tasks of one
//! controller (`docs/runtime.md` §3.8, `docs/discovery-protocol.md` §8.7).
//!
//! Every round the controller diffs the wanted clients against the running ones
//! (stopping changed or removed ones, starting new ones), hands each client the local
//! affiliate and the harvested endpoints (the client itself ignores unchanged data, so
//! nothing is re-encrypted), and mirrors each client's discovered set into
//! `cluster-raw/Affiliate <service>/<node id>` plus a `DiscoveryServiceStatus`. A
//! sub-task per client wakes the controller whenever that client's state changes.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::{Duration, Instant},
};

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;
use wirespan_discovery::client::{
    self as dclient, AffiliateInfo, Client, ClientConfig, ClusterSecret, ConnectionState,
    ControlPlaneInfo, DiscoveryState, KubeSpanInfo, MachineType, WirespanInfo,
};

use super::{merge::raw_id, put, retire_stale};
use crate::{
    config::cluster::DiscoveryServiceConfig,
    resources::{
        cluster::{
            Affiliate, AffiliateSpec, ClusterIdentity, ControlPlaneSpec, DiscoveryServiceStatus,
            DiscoveryServiceStatusSpec, KubeSpanAffiliateSpec, WirespanAffiliateSpec, CLUSTER, NS,
            NS_RAW,
        },
        config::MachineConfig,
        identity::{NodeIdentity, LOCAL},
        kubespan::KubeSpanEndpoint,
    },
    runtime::{
        Action, Controller, ControllerError, ControllerResult, ControllerRuntime, Input, InputKind,
        Output, ResourceKind, Triggers, Waker,
    },
};

/// Tunables of the discovery clients.
#[derive(Debug, Clone)]
pub struct DiscoveryOptions {
    /// TTL of published data (refreshed every TTL/2); at most 30 min.
    pub ttl: Duration,
}

impl Default for DiscoveryOptions {
    fn default() -> Self {
        Self {
            ttl: dclient::DEFAULT_TTL,
        }
    }
}

/// What a client is started from; a change of any field restarts it.
#[derive(Clone, PartialEq, Eq)]
struct ClientSpec {
    endpoint: String,
    cluster_id: String,
    secret: [u8; 32],
    node_id: String,
}

struct RunningClient {
    spec: ClientSpec,
    client: Option<Client>,
    start_error: Option<String>,
    cancel: CancellationToken,
    /// Raw records this service stopped listing, and since when (see
    /// [`VANISHED_GRACE`]).
    missing_since: BTreeMap<String, Instant>,
}

/// How long a record that a service stopped listing is kept. A restarted, empty server
/// answers the reconnecting clients' Watch with a snapshot that lists nobody until the
/// nodes have republished, a few seconds later: without a grace period every node
/// would tear down all its peers and rebuild them.
pub const VANISHED_GRACE: Duration = Duration::from_secs(60);

impl Drop for RunningClient {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

fn start_client(
    name: &str,
    spec: ClientSpec,
    options: &DiscoveryOptions,
    parent: &CancellationToken,
    waker: Waker,
) -> RunningClient {
    let cancel = parent.child_token();
    let config = ClientConfig {
        endpoint: spec.endpoint.clone(),
        insecure: false,
        ca_pem: None,
        cluster_id: spec.cluster_id.clone(),
        secret: ClusterSecret::from_bytes(spec.secret),
        affiliate_id: spec.node_id.clone(),
        ttl: options.ttl,
        client_version: format!("v{}", env!("CARGO_PKG_VERSION")),
    };
    match Client::new(config) {
        Ok(client) => {
            // The cluster ID is a credential: a tag identifies the cluster in logs.
            tracing::info!(
                service = name,
                endpoint = %spec.endpoint,
                cluster = %wirespan_discovery::redact::cluster_tag(&spec.cluster_id),
                "starting discovery client"
            );
            drop(client.spawn(cancel.clone()));
            let mut state = client.subscribe();
            let stop = cancel.clone();
            // A dynamic event source, so a sub-task with the controller's waker.
            let watch = async move {
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        changed = state.changed() => {
                            if changed.is_err() {
                                return;
                            }
                            waker.wake();
                        }
                    }
                }
            };
            tokio::spawn(watch.in_current_span());
            RunningClient {
                spec,
                client: Some(client),
                start_error: None,
                cancel,
                missing_since: BTreeMap::new(),
            }
        }
        Err(e) => {
            tracing::warn!(service = name, error = %e, "cannot start discovery client");
            RunningClient {
                spec,
                client: None,
                start_error: Some(e.to_string()),
                cancel,
                missing_since: BTreeMap::new(),
            }
        }
    }
}

/// Converts a merged/raw affiliate spec to the client's plaintext model plus its own
/// endpoints (sent only with a KubeSpan public key, `docs/discovery-protocol.md` §8.7).
#[must_use]
pub fn to_wire(spec: &AffiliateSpec) -> (AffiliateInfo, Vec<dclient::Endpoint>) {
    let kubespan = spec.kubespan.as_ref().filter(|k| !k.public_key.is_empty());
    let info = AffiliateInfo {
        node_id: spec.node_id.clone(),
        addresses: spec.addresses.clone(),
        hostname: spec.hostname.clone(),
        nodename: spec.nodename.clone(),
        machine_type: MachineType::from_wire(&spec.machine_type),
        operating_system: spec.operating_system.clone(),
        kubespan: kubespan.map(|k| KubeSpanInfo {
            public_key: k.public_key.clone(),
            address: match k.address {
                Some(IpAddr::V6(a)) => a,
                _ => std::net::Ipv6Addr::UNSPECIFIED,
            },
            additional_addresses: k.additional_addresses.clone(),
            exclude_advertised_networks: k.exclude_advertised_networks.clone(),
        }),
        control_plane: spec.control_plane.as_ref().map(|c| ControlPlaneInfo {
            api_server_port: c.api_server_port,
        }),
        wirespan: spec.wirespan.as_ref().map(|w| WirespanInfo {
            version: w.version,
            persistent_keepalive_secs: w.persistent_keepalive_secs,
            relay_user: w.relay_user,
            relay_offered: w.relay_offered,
            direct_down: w.direct_down.clone(),
        }),
    };
    let endpoints = kubespan.map(|k| k.endpoints.clone()).unwrap_or_default();
    (info, endpoints)
}

/// Converts a decoded affiliate to the resource spec; endpoints are kept only with a
/// KubeSpan part (they are WireGuard endpoints).
#[must_use]
pub fn from_wire(affiliate: &dclient::Affiliate) -> AffiliateSpec {
    let info = &affiliate.info;
    AffiliateSpec {
        node_id: info.node_id.clone(),
        hostname: info.hostname.clone(),
        nodename: info.nodename.clone(),
        machine_type: info.machine_type.as_str().to_owned(),
        operating_system: info.operating_system.clone(),
        addresses: info.addresses.clone(),
        kubespan: info.kubespan.as_ref().map(|k| KubeSpanAffiliateSpec {
            public_key: k.public_key.clone(),
            address: (!k.address.is_unspecified()).then_some(IpAddr::V6(k.address)),
            additional_addresses: k.additional_addresses.clone(),
            exclude_advertised_networks: k.exclude_advertised_networks.clone(),
            endpoints: affiliate.endpoints.clone(),
        }),
        control_plane: info.control_plane.map(|c| ControlPlaneSpec {
            api_server_port: c.api_server_port,
        }),
        wirespan: info.wirespan.as_ref().map(|w| WirespanAffiliateSpec {
            version: w.version,
            persistent_keepalive_secs: w.persistent_keepalive_secs,
            relay_user: w.relay_user,
            relay_offered: w.relay_offered,
            direct_down: w.direct_down.clone(),
        }),
    }
}

fn status_of(endpoint: &str, state: &DiscoveryState) -> DiscoveryServiceStatusSpec {
    DiscoveryServiceStatusSpec {
        endpoint: endpoint.to_owned(),
        current_endpoint: state.endpoint.to_string(),
        connected: state.connection == ConnectionState::Connected,
        connection: match state.connection {
            ConnectionState::Backoff => "backoff",
            ConnectionState::Connecting => "connecting",
            ConnectionState::Connected => "connected",
        }
        .to_owned(),
        last_error: state.last_error.clone(),
        public_ip: state.public_ip,
        affiliate_count: state.affiliates.len(),
        republishes: state.republishes,
    }
}

/// Runs the discovery clients and mirrors what they discover.
#[derive(Default)]
pub struct DiscoveryController {
    options: DiscoveryOptions,
    /// The clients, by service name; dropping one stops it.
    running: BTreeMap<String, RunningClient>,
}

impl std::fmt::Debug for DiscoveryController {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiscoveryController")
            .field("options", &self.options)
            .field("running", &self.running.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl DiscoveryController {
    /// A controller whose clients use `options`.
    #[must_use]
    pub fn new(options: DiscoveryOptions) -> Self {
        Self {
            options,
            running: BTreeMap::new(),
        }
    }
}

impl Controller for DiscoveryController {
    type Event = ();

    fn name(&self) -> &str {
        "cluster.DiscoveryController"
    }

    fn inputs(&self) -> Vec<Input> {
        vec![
            MachineConfig::input(),
            Input::id_of::<ClusterIdentity>(NS, CLUSTER, InputKind::Weak),
            Input::id_of::<NodeIdentity>(NodeIdentity::DEFAULT_NAMESPACE, LOCAL, InputKind::Weak),
            // The local affiliate, and DestroyReady of the own raw records.
            Input::of::<Affiliate>(NS_RAW, InputKind::Weak),
            Input::of::<KubeSpanEndpoint>(KubeSpanEndpoint::DEFAULT_NAMESPACE, InputKind::Weak),
            Input::of::<DiscoveryServiceStatus>(NS, InputKind::DestroyReady),
        ]
    }

    fn outputs(&self) -> Vec<Output> {
        vec![
            Output::shared::<Affiliate>(),
            Output::exclusive::<DiscoveryServiceStatus>(),
        ]
    }

    fn start(&mut self, _rt: &mut ControllerRuntime) -> Result<Triggers<()>, ControllerError> {
        // A restart starts every client afresh.
        self.running.clear();
        Ok(Triggers::inputs_only())
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let wanted = wanted_clients(rt)?;
            self.running.retain(|name, r| {
                let keep = wanted.get(name) == Some(&r.spec);
                if !keep {
                    tracing::info!(service = name.as_str(), "stopping discovery client");
                }
                keep
            });
            let parent = rt.cancellation();
            for (name, spec) in wanted {
                if let std::collections::btree_map::Entry::Vacant(slot) = self.running.entry(name) {
                    let r = start_client(slot.key(), spec, &self.options, &parent, rt.waker());
                    slot.insert(r);
                }
            }
            publish_local(rt, &self.running)?;
            mirror(rt, &mut self.running)?;
            // A round when the next grace of a vanished record ends, so that it goes.
            let grace_ends = next_grace_end(
                self.running.values().flat_map(|r| r.missing_since.values()),
                Instant::now(),
            );
            Ok(grace_ends.map_or_else(Action::await_change, |t| Action::requeue_at(t.into())))
        })
    }
}

fn wanted_clients(rt: &ControllerRuntime) -> Result<BTreeMap<String, ClientSpec>, ControllerError> {
    let mut wanted = BTreeMap::new();
    let config = MachineConfig::active(rt)?;
    let cluster = rt.get_opt::<ClusterIdentity>(NS, CLUSTER)?;
    let node = rt.get_opt::<NodeIdentity>(NodeIdentity::DEFAULT_NAMESPACE, LOCAL)?;
    let (Some(config), Some(cluster), Some(node)) = (config, cluster, node) else {
        return Ok(wanted);
    };
    for doc in config.spec.config.documents_of::<DiscoveryServiceConfig>() {
        wanted.insert(
            doc.name.clone(),
            ClientSpec {
                endpoint: doc.endpoint.clone(),
                cluster_id: cluster.spec.cluster_id.clone(),
                secret: *cluster.spec.secret.bytes(),
                node_id: node.spec.node_id.clone(),
            },
        );
    }
    Ok(wanted)
}

/// Hands the local affiliate and the harvested endpoints to every client; each client
/// ignores data equal to what it already has (`docs/discovery-protocol.md` §8.7).
fn publish_local(
    rt: &ControllerRuntime,
    running: &BTreeMap<String, RunningClient>,
) -> Result<(), ControllerError> {
    let Some(node) = rt.get_opt::<NodeIdentity>(NodeIdentity::DEFAULT_NAMESPACE, LOCAL)? else {
        return Ok(());
    };
    let local = rt.get_opt::<Affiliate>(NS_RAW, &node.spec.node_id)?;
    let mut others: BTreeMap<String, Vec<dclient::Endpoint>> = BTreeMap::new();
    for e in rt.list::<KubeSpanEndpoint>(KubeSpanEndpoint::DEFAULT_NAMESPACE)? {
        if let Some(ep) = e.spec.endpoint {
            let list = others.entry(e.spec.affiliate_id.clone()).or_default();
            if !list.contains(&ep) {
                list.push(ep);
            }
        }
    }
    let wire = local.as_ref().map(|l| to_wire(&l.spec));
    for (name, r) in running {
        let Some(client) = &r.client else { continue };
        if let Some((info, endpoints)) = &wire {
            match client.set_local_data(info.clone(), endpoints.clone()) {
                Ok(true) => tracing::debug!(
                    service = name.as_str(),
                    "local affiliate changed, publishing"
                ),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(service = name.as_str(), error = %e, "cannot publish the local affiliate");
                }
            }
        }
        client.set_other_endpoints(others.clone());
    }
    Ok(())
}

/// Writes each client's discovered affiliates and its status; removes records of
/// stopped clients at once and of vanished affiliates after [`VANISHED_GRACE`].
fn mirror(
    rt: &mut ControllerRuntime,
    running: &mut BTreeMap<String, RunningClient>,
) -> Result<(), ControllerError> {
    let mut keep_raw = BTreeSet::new();
    let mut keep_status = BTreeSet::new();
    let existing: Vec<String> = rt
        .list::<Affiliate>(NS_RAW)?
        .iter()
        .filter(|a| a.metadata.owner == rt.name())
        .map(|a| a.metadata.id.clone())
        .collect();
    let now = Instant::now();
    for (name, r) in running.iter_mut() {
        let status = match &r.client {
            Some(client) => {
                let state = client.state();
                for (id, affiliate) in state.affiliates.iter() {
                    // A record claiming another node's ID is not trusted (`docs/discovery-protocol.md` §5.1 MAY).
                    if affiliate.info.node_id != *id {
                        continue;
                    }
                    let rid = raw_id(name, id);
                    put::<Affiliate>(rt, NS_RAW, &rid, &from_wire(affiliate))?;
                    keep_raw.insert(rid);
                }
                let listed = keep_raw.clone();
                keep_vanished(name, r, &existing, &listed, now, &mut keep_raw);
                status_of(&r.spec.endpoint, &state)
            }
            None => DiscoveryServiceStatusSpec {
                endpoint: r.spec.endpoint.clone(),
                connection: "stopped".to_owned(),
                last_error: r.start_error.clone(),
                ..DiscoveryServiceStatusSpec::default()
            },
        };
        put::<DiscoveryServiceStatus>(rt, NS, name, &status)?;
        keep_status.insert(name.clone());
    }
    retire_stale::<Affiliate>(rt, NS_RAW, &keep_raw)?;
    retire_stale::<DiscoveryServiceStatus>(rt, NS, &keep_status)?;
    Ok(())
}

/// When the first grace still running at `now` ends, of records missed since
/// `missing_since` (graces already over had their round).
fn next_grace_end<'a>(
    missing_since: impl Iterator<Item = &'a Instant>,
    now: Instant,
) -> Option<Instant> {
    missing_since
        .map(|since| *since + VANISHED_GRACE + Duration::from_millis(50))
        .filter(|end| *end > now)
        .min()
}

/// Keeps `name`'s records that the service no longer lists for [`VANISHED_GRACE`] after
/// they were first missed (the round asks for a wake-up when the grace ends).
fn keep_vanished(
    name: &str,
    r: &mut RunningClient,
    existing: &[String],
    listed: &BTreeSet<String>,
    now: Instant,
    keep: &mut BTreeSet<String>,
) {
    let prefix = raw_id(name, "");
    r.missing_since.retain(|rid, _| !listed.contains(rid));
    for rid in existing
        .iter()
        .filter(|id| id.starts_with(&prefix) && !listed.contains(*id))
    {
        let since = *r.missing_since.entry(rid.clone()).or_insert(now);
        if now.duration_since(since) < VANISHED_GRACE {
            keep.insert(rid.clone());
        }
    }
    r.missing_since.retain(|rid, _| existing.contains(rid));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_grace_end_is_the_earliest_still_running() {
        // Ahead of the clock, so the instants below never underflow.
        let now = Instant::now() + Duration::from_secs(120);
        let end = |since: Instant| since + VANISHED_GRACE + Duration::from_millis(50);
        let over = now - VANISHED_GRACE - Duration::from_secs(1);
        let early = now - Duration::from_secs(20);
        let late = now - Duration::from_secs(5);
        assert_eq!(next_grace_end([late, early].iter(), now), Some(end(early)));
        // A grace that is over asks for no round (it would come back at once while
        // its record waits for finalizers).
        assert_eq!(next_grace_end([over].iter(), now), None);
        assert_eq!(next_grace_end([over, late].iter(), now), Some(end(late)));
        assert_eq!(next_grace_end(std::iter::empty(), now), None);
    }

    #[test]
    fn exclusions_survive_the_wire_both_ways() {
        let spec = AffiliateSpec {
            node_id: "n1".into(),
            machine_type: "worker".into(),
            addresses: vec!["10.5.0.1".parse().unwrap()],
            kubespan: Some(KubeSpanAffiliateSpec {
                public_key: "K".into(),
                address: Some("fd00::1".parse().unwrap()),
                additional_addresses: vec!["10.244.1.0/24".parse().unwrap()],
                exclude_advertised_networks: vec!["10.244.1.128/25".parse().unwrap()],
                endpoints: vec!["10.5.0.1:51820".parse().unwrap()],
            }),
            ..AffiliateSpec::default()
        };
        let (info, endpoints) = to_wire(&spec);
        let decoded = AffiliateInfo::decode(&info.encode()).unwrap();
        let back = from_wire(&dclient::Affiliate {
            id: "n1".into(),
            info: decoded,
            endpoints,
        });
        assert_eq!(back, spec);
    }
}
