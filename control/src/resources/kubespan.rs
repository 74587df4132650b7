//! Mesh resources shared between controllers: identity, effective mesh config and
//! harvested endpoints (spec `kubespan-dataplane.md`).

use std::net::SocketAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::{
    config::kubespan::KubeSpanConfig as KubeSpanConfigDocument,
    runtime::{Definition, ResourceKind},
    secret::Key32,
};

/// Namespace of the mesh resources.
pub const NS: &str = "kubespan";
/// Id of the singletons (identity, config).
pub const KUBESPAN: &str = "kubespan";

/// This node's mesh identity (`kubespan/KubeSpanIdentity kubespan`).
#[derive(Debug)]
pub struct KubeSpanIdentity;

impl ResourceKind for KubeSpanIdentity {
    const TYPE: &'static str = "KubeSpanIdentities.kubespan.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = NS;
    type Spec = KubeSpanIdentitySpec;
    fn definition() -> Definition {
        Definition::new(Self::TYPE, "KubeSpanIdentity", Self::DEFAULT_NAMESPACE)
            .column("Address", ".address")
            .column("Public Key", ".publicKey")
    }
}

/// Spec of [`KubeSpanIdentity`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeSpanIdentitySpec {
    /// The node's ULA as a /128.
    pub address: Option<IpNet>,
    /// The cluster's /64.
    pub subnet: Option<IpNet>,
    /// WireGuard public key (base64).
    pub public_key: String,
    /// Link whose MAC derived the address.
    pub mac_source_link: String,
    /// WireGuard private key; never serialized (the API and CLI never show it).
    #[serde(skip)]
    pub private_key: Key32,
}

/// The mesh settings in force (`kubespan/KubeSpanConfig kubespan`): the config
/// document with defaults applied, plus every document's extra endpoints.
#[derive(Debug)]
pub struct KubeSpanConfig;

impl ResourceKind for KubeSpanConfig {
    const TYPE: &'static str = "KubeSpanConfigs.kubespan.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = NS;
    type Spec = KubeSpanConfigSpec;
    fn definition() -> Definition {
        Definition::new(Self::TYPE, "KubeSpanConfig", Self::DEFAULT_NAMESPACE)
            .column("Enabled", ".config.enabled")
            .column("Link", ".config.linkName")
            .column("Fast Path", ".config.fastPath")
    }
}

/// Spec of [`KubeSpanConfig`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeSpanConfigSpec {
    /// The document.
    pub config: KubeSpanConfigDocument,
    /// Union of all `KubeSpanEndpointsConfig` documents.
    pub extra_announced_endpoints: Vec<SocketAddr>,
}

/// An endpoint observed for another peer, to publish for it (`harvestExtraEndpoints`;
/// id = the peer's public key).
#[derive(Debug)]
pub struct KubeSpanEndpoint;

impl ResourceKind for KubeSpanEndpoint {
    const TYPE: &'static str = "KubeSpanEndpoints.kubespan.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = NS;
    type Spec = KubeSpanEndpointSpec;
    fn definition() -> Definition {
        Definition::new(Self::TYPE, "KubeSpanEndpoint", Self::DEFAULT_NAMESPACE)
            .column("Endpoint", ".endpoint")
            .column("Affiliate ID", ".affiliateId")
    }
}

/// Spec of [`KubeSpanEndpoint`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeSpanEndpointSpec {
    /// Node ID of the peer.
    pub affiliate_id: String,
    /// The endpoint WireGuard uses for it.
    pub endpoint: Option<SocketAddr>,
}
