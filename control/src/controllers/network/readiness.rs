//! `NetworkReadinessController`: `NetworkStatus status` from resources other
//! controllers publish (Talos's `network.StatusController`, plus the mesh).
//!
//! * address: the `current` node address list is not empty;
//! * connectivity: every probe succeeds; with no probe, a default route exists in the
//!   main table (Talos looks at any table, which here would count the mesh's own
//!   default route in its table);
//! * hostname: `HostnameStatus hostname` exists;
//! * mesh: enabled, its link programmed (`KubeSpanManagerStatus`), and every peer spec
//!   has a peer status that is `up` (no peers: ready once programmed).

use futures::future::BoxFuture;

use crate::{
    resources::{
        kubespan::{
            self, KubeSpanConfig, KubeSpanManagerStatus, KubeSpanPeerSpec, KubeSpanPeerStatus,
            PeerState, KUBESPAN,
        },
        network::{
            node_address, HostnameStatus, NetworkStatus, NetworkStatusSpec, NodeAddress,
            ProbeStatus, RouteStatus, RouteType, HOSTNAME, NETWORK_STATUS, NS, TABLE_MAIN,
        },
    },
    runtime::{Action, Controller, ControllerResult, ControllerRuntime, Input, InputKind, Output},
};

/// What the mesh part is computed from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MeshInputs {
    /// The config enables the mesh.
    pub enabled: bool,
    /// The manager has programmed the link (its status exists).
    pub programmed: bool,
    /// One state per peer spec (`Unknown` when it has no status yet).
    pub peers: Vec<PeerState>,
}

/// Everything the status is computed from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inputs {
    /// Number of `current` node addresses (`None`: not computed yet).
    pub current_addresses: Option<usize>,
    /// Success of each probe.
    pub probes: Vec<bool>,
    /// A unicast default route exists in the main table.
    pub default_route: bool,
    /// The hostname status exists.
    pub hostname: bool,
    /// The mesh.
    pub mesh: MeshInputs,
}

/// The status (pure).
#[must_use]
pub fn compute(i: &Inputs) -> NetworkStatusSpec {
    let connectivity_ready = if i.probes.is_empty() {
        i.default_route
    } else {
        i.probes.iter().all(|ok| *ok)
    };
    let peers_up = i.mesh.peers.iter().filter(|s| **s == PeerState::Up).count();
    NetworkStatusSpec {
        address_ready: i.current_addresses.is_some_and(|n| n > 0),
        connectivity_ready,
        hostname_ready: i.hostname,
        mesh_enabled: i.mesh.enabled,
        mesh_ready: i.mesh.enabled && i.mesh.programmed && peers_up == i.mesh.peers.len(),
        peers: i.mesh.peers.len(),
        peers_up,
    }
}

/// Writes `network/NetworkStatus status`.
#[derive(Debug, Default)]
pub struct NetworkReadinessController;

impl NetworkReadinessController {
    fn inputs_now(rt: &ControllerRuntime) -> Result<Inputs, crate::runtime::ControllerError> {
        let enabled = rt
            .get_opt::<KubeSpanConfig>(kubespan::NS, KUBESPAN)?
            .is_some_and(|c| c.spec.config.enabled);
        let statuses = rt.list::<KubeSpanPeerStatus>(kubespan::NS)?;
        let peers = rt
            .list::<KubeSpanPeerSpec>(kubespan::NS)?
            .iter()
            .map(|spec| {
                statuses
                    .iter()
                    .find(|s| s.metadata.id == spec.metadata.id)
                    .map_or(PeerState::Unknown, |s| s.spec.state)
            })
            .collect();
        Ok(Inputs {
            current_addresses: rt
                .get_opt::<NodeAddress>(NS, node_address::CURRENT)?
                .map(|r| r.spec.addresses.len()),
            probes: rt
                .list::<ProbeStatus>(NS)?
                .iter()
                .map(|r| r.spec.success)
                .collect(),
            default_route: rt.list::<RouteStatus>(NS)?.iter().any(|r| {
                r.spec.destination.is_none()
                    && r.spec.table == TABLE_MAIN
                    && r.spec.r#type == RouteType::Unicast
            }),
            hostname: rt.get_opt::<HostnameStatus>(NS, HOSTNAME)?.is_some(),
            mesh: MeshInputs {
                enabled,
                programmed: rt
                    .get_opt::<KubeSpanManagerStatus>(kubespan::NS, KUBESPAN)?
                    .is_some(),
                peers,
            },
        })
    }
}

impl Controller for NetworkReadinessController {
    type Event = ();

    fn name(&self) -> &str {
        "NetworkReadinessController"
    }

    fn inputs(&self) -> Vec<Input> {
        vec![
            Input::id_of::<NodeAddress>(NS, node_address::CURRENT, InputKind::Weak),
            Input::of::<ProbeStatus>(NS, InputKind::Weak),
            Input::of::<RouteStatus>(NS, InputKind::Weak),
            Input::id_of::<HostnameStatus>(NS, HOSTNAME, InputKind::Weak),
            Input::id_of::<KubeSpanConfig>(kubespan::NS, KUBESPAN, InputKind::Weak),
            Input::id_of::<KubeSpanManagerStatus>(kubespan::NS, KUBESPAN, InputKind::Weak),
            Input::of::<KubeSpanPeerSpec>(kubespan::NS, InputKind::Weak),
            Input::of::<KubeSpanPeerStatus>(kubespan::NS, InputKind::Weak),
        ]
    }

    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<NetworkStatus>()]
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let spec = compute(&Self::inputs_now(rt)?);
            let current = rt.get_opt::<NetworkStatus>(NS, NETWORK_STATUS)?;
            if current.as_ref().is_none_or(|r| r.spec != spec) {
                rt.modify::<NetworkStatus>(NS, NETWORK_STATUS, |r| r.spec = spec.clone())?;
            }
            Ok(Action::await_change())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        resources::{
            kubespan::{KubeSpanManagerStatusSpec, KubeSpanPeerStatusSpec},
            network::{HostnameStatusSpec, ProbeStatusSpec, RouteStatusSpec},
        },
        runtime::{Pointer, Resource, ResourceKind as _, Runtime, Store, StoreOptions},
        testing::{assert_resource, Harness},
    };

    /// Waits until the status matches `want` on the named fields.
    async fn expect(store: &Store, what: &str, check: impl Fn(&NetworkStatusSpec) -> bool) {
        assert_resource::<NetworkStatus>(
            store,
            NS,
            NETWORK_STATUS,
            |r: &Resource<NetworkStatus>| {
                check(&r.spec)
                    .then_some(())
                    .ok_or(format!("{what}: {:?}", r.spec))
            },
        )
        .await;
    }

    #[tokio::test]
    async fn every_readiness_follows_its_inputs_both_ways() {
        let store = Store::new(StoreOptions::default());
        let mut runtime = Runtime::new(store.clone());
        runtime.register(NetworkReadinessController).unwrap();
        let h = Harness::start(runtime);
        let s = &h.store;
        expect(s, "nothing ready at first", |n| {
            *n == NetworkStatusSpec::default()
        })
        .await;

        // Address.
        s.modify::<NodeAddress>(NS, node_address::CURRENT, "", |r| {
            r.spec.addresses = vec!["10.5.0.1/24".parse().unwrap()];
        })
        .unwrap();
        expect(s, "address ready", |n| n.address_ready).await;
        s.modify::<NodeAddress>(NS, node_address::CURRENT, "", |r| {
            r.spec.addresses.clear();
        })
        .unwrap();
        expect(s, "address gone", |n| !n.address_ready).await;

        // Connectivity: a default route in the main table, then probes override it.
        s.modify::<RouteStatus>(NS, "mesh-default", "", |r| {
            r.spec = RouteStatusSpec {
                table: 180,
                ..RouteStatusSpec::default()
            };
        })
        .unwrap();
        s.modify::<RouteStatus>(NS, "main-default", "", |r| {
            r.spec = RouteStatusSpec {
                table: TABLE_MAIN,
                ..RouteStatusSpec::default()
            };
        })
        .unwrap();
        expect(s, "default route", |n| n.connectivity_ready).await;
        s.destroy(&Pointer::new(NS, RouteStatus::TYPE, "main-default"), "")
            .unwrap();
        expect(s, "only the mesh table's default route", |n| {
            !n.connectivity_ready
        })
        .await;
        s.modify::<ProbeStatus>(NS, "tcp:a", "", |r| {
            r.spec = ProbeStatusSpec {
                success: true,
                last_error: String::new(),
            };
        })
        .unwrap();
        expect(s, "probe succeeds", |n| n.connectivity_ready).await;
        s.modify::<ProbeStatus>(NS, "tcp:a", "", |r| {
            r.spec = ProbeStatusSpec {
                success: false,
                last_error: "refused".into(),
            };
        })
        .unwrap();
        expect(s, "probe fails", |n| !n.connectivity_ready).await;

        // Hostname.
        s.modify::<HostnameStatus>(NS, HOSTNAME, "", |r| {
            r.spec = HostnameStatusSpec {
                hostname: "node1".into(),
                domainname: String::new(),
            };
        })
        .unwrap();
        expect(s, "hostname", |n| n.hostname_ready).await;
        s.destroy(&Pointer::new(NS, HostnameStatus::TYPE, HOSTNAME), "")
            .unwrap();
        expect(s, "hostname gone", |n| !n.hostname_ready).await;

        // Mesh: enabled, programmed, then each peer's state.
        s.modify::<KubeSpanConfig>(kubespan::NS, KUBESPAN, "", |r| {
            r.spec.config.enabled = true;
        })
        .unwrap();
        expect(s, "enabled, not programmed", |n| {
            n.mesh_enabled && !n.mesh_ready
        })
        .await;
        s.modify::<KubeSpanManagerStatus>(kubespan::NS, KUBESPAN, "", |r| {
            r.spec = KubeSpanManagerStatusSpec::default();
        })
        .unwrap();
        expect(s, "programmed, no peers", |n| n.mesh_ready).await;
        s.modify::<KubeSpanPeerSpec>(kubespan::NS, "peer1", "", |_| {})
            .unwrap();
        expect(s, "a peer without status", |n| {
            !n.mesh_ready && n.peers == 1 && n.peers_up == 0
        })
        .await;
        let set_state = |state| {
            s.modify::<KubeSpanPeerStatus>(kubespan::NS, "peer1", "", |r| {
                r.spec = KubeSpanPeerStatusSpec {
                    state,
                    ..KubeSpanPeerStatusSpec::default()
                };
            })
            .unwrap();
        };
        set_state(PeerState::Up);
        expect(s, "the peer is up", |n| n.mesh_ready && n.peers_up == 1).await;
        set_state(PeerState::Down);
        expect(s, "the peer is down", |n| !n.mesh_ready).await;
        set_state(PeerState::Up);
        expect(s, "up again", |n| n.mesh_ready).await;
        s.modify::<KubeSpanConfig>(kubespan::NS, KUBESPAN, "", |r| {
            r.spec.config.enabled = false;
        })
        .unwrap();
        expect(s, "disabled", |n| !n.mesh_enabled && !n.mesh_ready).await;
        h.stop().await.unwrap();
    }

    #[test]
    fn connectivity_uses_probes_when_there_are_any() {
        let mut i = Inputs {
            default_route: true,
            ..Inputs::default()
        };
        assert!(
            compute(&i).connectivity_ready,
            "no probe: the default route"
        );
        i.probes = vec![true, false];
        assert!(!compute(&i).connectivity_ready, "a failing probe wins");
        i.probes = vec![true, true];
        i.default_route = false;
        assert!(compute(&i).connectivity_ready, "probes only");
    }

    #[test]
    fn mesh_needs_enabled_programmed_and_every_peer_up() {
        let mut i = Inputs::default();
        assert!(!compute(&i).mesh_ready);
        i.mesh.enabled = true;
        assert!(!compute(&i).mesh_ready, "link not programmed");
        i.mesh.programmed = true;
        assert!(compute(&i).mesh_ready, "no peers");
        i.mesh.peers = vec![PeerState::Up, PeerState::Unknown];
        let s = compute(&i);
        assert!(!s.mesh_ready);
        assert_eq!((s.peers, s.peers_up), (2, 1));
        i.mesh.peers[1] = PeerState::Up;
        assert!(compute(&i).mesh_ready);
        i.mesh.enabled = false;
        assert!(!compute(&i).mesh_ready, "disabled");
    }

    #[test]
    fn address_needs_one_current_address() {
        let mut i = Inputs::default();
        assert!(!compute(&i).address_ready);
        i.current_addresses = Some(0);
        assert!(!compute(&i).address_ready);
        i.current_addresses = Some(1);
        assert!(compute(&i).address_ready);
    }
}
