//! What the lab's daemons report through their resource APIs: KubeSpan identity and
//! peer statuses.

use std::{net::IpAddr, path::Path};

use serde::Serialize;
use serde_json::Value;
use tonic::transport::Channel;
use wirespan_control::api::{
    client::connect,
    proto::{self, resource_service_client::ResourceServiceClient},
};

/// Type of the peer statuses (defined by the mesh controllers).
pub const PEER_STATUSES: &str = "KubeSpanPeerStatuses.kubespan.wirespan.dev";
/// Type of the mesh manager's status (WireGuard implementation, fast path).
pub const MANAGER_STATUSES: &str = "KubeSpanManagerStatuses.kubespan.wirespan.dev";
/// Type of the discovery clients' statuses (the observed public IP).
pub const DISCOVERY_STATUSES: &str = "DiscoveryServiceStatuses.cluster.wirespan.dev";
/// Type of the KubeSpan identity.
pub const KUBESPAN_IDENTITIES: &str = "KubeSpanIdentities.kubespan.wirespan.dev";

/// One peer as a node sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PeerView {
    /// Peer public key (the resource id).
    pub public_key: String,
    /// Peer label (its hostname as published).
    pub label: String,
    /// Endpoint in use.
    pub endpoint: String,
    /// `up`, `down` or `unknown` (the direct path).
    pub state: String,
    /// How traffic reaches it: `direct`, `relay` or `none`.
    pub path: String,
    /// The relay's label, for `relay`.
    pub via: String,
}

/// One node's report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeView {
    /// The API answered.
    pub api: bool,
    /// WireGuard public key (empty until the identity exists).
    pub public_key: String,
    /// KubeSpan address (the ULA), once known.
    pub kubespan_address: Option<IpAddr>,
    /// WireGuard implementation the node's mesh link runs on (`kernel`, `userspace`,
    /// `userspace-go`),
    /// as its mesh manager reports it; empty until the device is programmed.
    pub wireguard: String,
    /// The node's address as the discovery server observed it (its client's public
    /// IP), once reported.
    pub observed_address: Option<IpAddr>,
    /// Peer statuses.
    pub peers: Vec<PeerView>,
    /// Why something could not be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

fn text(v: &Value, key: &str) -> String {
    match v.get(key) {
        Some(Value::String(s)) => s.clone(),
        None | Some(Value::Null) => String::new(),
        Some(other) => other.to_string(),
    }
}

async fn list(
    client: &mut ResourceServiceClient<Channel>,
    ty: &str,
) -> Result<Vec<(String, Value)>, String> {
    let req = proto::ListRequest {
        r#type: ty.to_owned(),
        namespace: String::new(),
        format: proto::SpecFormat::Json as i32,
        include_sensitive: false,
    };
    let resp = client.list(req).await.map_err(|s| s.message().to_owned())?;
    resp.into_inner()
        .resources
        .into_iter()
        .map(|r| {
            let id = r.metadata.map(|m| m.id).unwrap_or_default();
            serde_json::from_str::<Value>(&r.spec)
                .map(|v| (id, v))
                .map_err(|e| format!("decoding {ty} spec: {e}"))
        })
        .collect()
}

/// Asks the node at `socket` for its identity and peers; never fails: problems are
/// recorded in the view.
pub async fn observe(socket: &Path) -> NodeView {
    let mut view = NodeView::default();
    let mut client = match connect(socket).await {
        Ok(c) => c,
        Err(e) => {
            view.error = Some(e.to_string());
            return view;
        }
    };
    view.api = true;
    let mut errors = Vec::new();
    match list(&mut client, KUBESPAN_IDENTITIES).await {
        Ok(ids) => {
            if let Some((_, spec)) = ids.first() {
                view.public_key = text(spec, "publicKey");
                view.kubespan_address = spec
                    .get("address")
                    .and_then(Value::as_str)
                    .and_then(|a| a.split('/').next()?.parse().ok());
            }
        }
        Err(e) => errors.push(format!("identity: {e}")),
    }
    match list(&mut client, MANAGER_STATUSES).await {
        Ok(st) => {
            if let Some((_, spec)) = st.first() {
                view.wireguard = text(spec, "wireguard");
            }
        }
        Err(e) => errors.push(format!("manager status: {e}")),
    }
    match list(&mut client, DISCOVERY_STATUSES).await {
        Ok(st) => {
            view.observed_address = st
                .iter()
                .find_map(|(_, spec)| spec.get("publicIp")?.as_str()?.parse().ok());
        }
        Err(e) => errors.push(format!("discovery status: {e}")),
    }
    match list(&mut client, PEER_STATUSES).await {
        Ok(peers) => {
            view.peers = peers
                .into_iter()
                .map(|(id, spec)| PeerView {
                    public_key: id,
                    label: text(&spec, "label"),
                    endpoint: text(&spec, "endpoint"),
                    state: text(&spec, "state"),
                    path: text(&spec, "path"),
                    via: text(&spec, "via"),
                })
                .collect();
        }
        Err(e) => errors.push(format!("peers: {e}")),
    }
    if !errors.is_empty() {
        view.error = Some(errors.join("; "));
    }
    view
}

/// Peers of one node that are not up yet, given the public keys of the other nodes
/// (`others`: name and key; an empty key means that node has no identity yet).
#[must_use]
pub fn not_up(view: &NodeView, others: &[(String, String)]) -> Vec<String> {
    missing(view, others, Want::Up)
}

/// Of `others`, those this node does not reach through a peer relay, each as
/// `name: why`.
#[must_use]
pub fn not_relayed(view: &NodeView, others: &[(String, String)]) -> Vec<String> {
    missing(view, others, Want::Relayed)
}

/// Of `others`, those this node does not reach, up, through the server relay, each as
/// `name: why`.
#[must_use]
pub fn not_server_relayed(view: &NodeView, others: &[(String, String)]) -> Vec<String> {
    missing(view, others, Want::ServerRelayed)
}

/// What [`missing`] asks of each peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    Up,
    Relayed,
    ServerRelayed,
}

fn missing(view: &NodeView, others: &[(String, String)], want: Want) -> Vec<String> {
    let mut missing = Vec::new();
    for (name, key) in others {
        if key.is_empty() {
            missing.push(format!("{name}: no KubeSpan identity yet"));
            continue;
        }
        match view.peers.iter().find(|p| &p.public_key == key) {
            None => missing.push(format!("{name}: not a peer yet")),
            Some(p)
                if (want == Want::Relayed && p.path != "relay")
                    || (want == Want::ServerRelayed && (p.path != "server" || p.state != "up")) =>
            {
                missing.push(format!(
                    "{name}: path {} (state {})",
                    if p.path.is_empty() { "?" } else { &p.path },
                    if p.state.is_empty() { "?" } else { &p.state },
                ));
            }
            Some(p) if want == Want::Up && p.state != "up" => missing.push(format!(
                "{name}: state {} (endpoint {})",
                if p.state.is_empty() { "?" } else { &p.state },
                if p.endpoint.is_empty() {
                    "none"
                } else {
                    &p.endpoint
                }
            )),
            Some(_) => {}
        }
    }
    missing
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(key: &str, state: &str) -> PeerView {
        PeerView {
            public_key: key.into(),
            label: String::new(),
            endpoint: "10.99.1.12:51820".into(),
            state: state.into(),
            path: if state == "up" { "direct" } else { "none" }.into(),
            via: String::new(),
        }
    }

    #[test]
    fn not_up_names_each_missing_or_down_peer() {
        let view = NodeView {
            api: true,
            peers: vec![peer("k2", "up"), peer("k3", "down")],
            ..NodeView::default()
        };
        let others = [
            ("node2".to_owned(), "k2".to_owned()),
            ("node3".to_owned(), "k3".to_owned()),
            ("node4".to_owned(), "k4".to_owned()),
            ("node5".to_owned(), String::new()),
        ];
        assert_eq!(
            not_up(&view, &others),
            [
                "node3: state down (endpoint 10.99.1.12:51820)",
                "node4: not a peer yet",
                "node5: no KubeSpan identity yet"
            ]
        );
        assert!(not_up(&view, &others[..1]).is_empty());
        // Through the server relay: that path, and up.
        assert_eq!(
            not_server_relayed(&view, &others[..2]),
            [
                "node2: path direct (state up)",
                "node3: path none (state down)"
            ]
        );
        // Where a relay could, the path must be one.
        assert_eq!(
            not_relayed(&view, &others[..2]),
            [
                "node2: path direct (state up)",
                "node3: path none (state down)"
            ]
        );
        let mut relayed = view;
        relayed.peers[1].path = "relay".into();
        assert_eq!(not_relayed(&relayed, &others[1..2]), Vec::<String>::new());
        relayed.peers[1].path = "server".into();
        assert_eq!(
            not_server_relayed(&relayed, &others[1..2]),
            ["node3: path server (state down)"]
        );
        relayed.peers[1].state = "up".into();
        assert_eq!(
            not_server_relayed(&relayed, &others[1..2]),
            Vec::<String>::new()
        );
    }
}
