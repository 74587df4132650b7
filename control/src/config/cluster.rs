//! `ClusterConfig` and `DiscoveryServiceConfig` documents.
//!
//! ```yaml
//! apiVersion: v1alpha1
//! kind: ClusterConfig
//! id: <base64 of 32 random bytes>       # opaque; used raw for the ULA and discovery
//! secret: <base64 of 32 random bytes>   # discovery AES key and WireGuard PSK
//! ---
//! apiVersion: v1alpha1
//! kind: DiscoveryServiceConfig
//! name: lab
//! endpoint: http://10.99.0.1:3000       # http (h2c) or https
//! ```
//!
//! No discovery service is contacted unless a `DiscoveryServiceConfig` names it.

use base64::Engine as _;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{ConfigDocument, FieldError};
use crate::secret::{Key32, SecretString};

/// The cluster this node joins: nodes with the same ID and secret form one mesh.
/// `wirespan gen cluster` writes this document (and a `DiscoveryServiceConfig`) with
/// a fresh ID and secret.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ClusterConfig {
    /// Cluster ID: an opaque string, used as raw bytes for the mesh's IPv6 ULA prefix
    /// and as the cluster ID on the discovery service (`wirespan gen cluster` and Talos
    /// write base64 of 32 random bytes).
    ///
    /// Valid: 1 to 256 bytes.
    pub id: String,
    /// Cluster secret: the discovery service encryption key (AES-256-GCM) and the
    /// WireGuard preshared key of every peer. Shown as `<redacted>` everywhere.
    ///
    /// Valid: standard base64 decoding to exactly 32 bytes.
    #[schemars(with = "super::schema::Secret")]
    pub secret: SecretString,
    /// The cluster API CA's certificate (PEM). A node started with `--api-listen`
    /// issues itself a server certificate from it and accepts clients whose
    /// certificates it signed. `wirespan gen cluster` writes it.
    ///
    /// Valid: absent, or a PEM certificate given together with `apiCaKey`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_ca_cert: Option<String>,
    /// The cluster API CA's private key (PEM). Shown as `<redacted>` everywhere.
    ///
    /// Valid: absent, or a PEM private key given together with `apiCaCert`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<super::schema::Secret>")]
    pub api_ca_key: Option<SecretString>,
}

impl ClusterConfig {
    /// The decoded secret (valid documents always decode).
    #[must_use]
    pub fn secret_key(&self) -> Option<Key32> {
        decode_secret(self.secret.expose()).ok()
    }
}

/// Decodes a base64 cluster secret of exactly 32 bytes. Errors never contain the text.
///
/// # Errors
/// Not base64, or not 32 bytes.
pub fn decode_secret(text: &str) -> Result<Key32, String> {
    let raw = base64::engine::general_purpose::STANDARD
        .decode(text.trim())
        .map_err(|_| "is not valid base64".to_owned())?;
    <[u8; 32]>::try_from(raw.as_slice())
        .map(Key32)
        .map_err(|_| format!("must decode to exactly 32 bytes, got {}", raw.len()))
}

impl ConfigDocument for ClusterConfig {
    const KIND: &'static str = "ClusterConfig";
    const SINGLETON: bool = true;

    fn validate(&self) -> Vec<FieldError> {
        let mut errs = Vec::new();
        if self.id.is_empty() {
            errs.push(FieldError::new("id", "is required"));
        } else if self.id.len() > 256 {
            errs.push(FieldError::new("id", "is longer than 256 bytes"));
        }
        if let Err(e) = decode_secret(self.secret.expose()) {
            errs.push(FieldError::new("secret", e));
        }
        match (&self.api_ca_cert, &self.api_ca_key) {
            (None, None) => {}
            (Some(cert), Some(key)) => {
                if rustls_pemfile::certs(&mut cert.as_bytes())
                    .next()
                    .is_none_or(|c| c.is_err())
                {
                    errs.push(FieldError::new("apiCaCert", "is not a PEM certificate"));
                }
                if !key.expose().contains("PRIVATE KEY-----") {
                    errs.push(FieldError::new("apiCaKey", "is not a PEM private key"));
                }
            }
            (Some(_), None) => errs.push(FieldError::new("apiCaKey", "is required with apiCaCert")),
            (None, Some(_)) => errs.push(FieldError::new("apiCaCert", "is required with apiCaKey")),
        }
        errs
    }
}

/// A discovery service this node publishes its affiliate to and learns peers from.
/// One client per document; with several, the node publishes to each and merges what
/// they return. Without any, no discovery service is contacted and no peers are
/// learnt.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DiscoveryServiceConfig {
    /// Name of this service; also the key under which its affiliates are kept
    /// (`wirespan get affiliates`).
    ///
    /// Valid: non-empty; letters, digits, `-`, `_` and `.` only.
    pub name: String,
    /// `http://host[:port]` (gRPC over cleartext HTTP/2, default port 80) or
    /// `https://host[:port]` (TLS, default port 443).
    ///
    /// Valid: an `http://` or `https://` URL with a non-empty host (IPv6 in brackets),
    /// an optional port and no path, query or fragment (a trailing `/` is allowed).
    pub endpoint: String,
}

impl ConfigDocument for DiscoveryServiceConfig {
    const KIND: &'static str = "DiscoveryServiceConfig";
    const SINGLETON: bool = false;

    fn name(&self) -> Option<&str> {
        Some(&self.name)
    }

    fn validate(&self) -> Vec<FieldError> {
        let mut errs = Vec::new();
        if self.name.is_empty() {
            errs.push(FieldError::new("name", "is required"));
        } else if !self
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        {
            errs.push(FieldError::new(
                "name",
                format!(
                    "{:?} may only contain letters, digits, '-', '_' and '.'",
                    self.name
                ),
            ));
        }
        if !(self.endpoint.starts_with("http://") || self.endpoint.starts_with("https://")) {
            errs.push(FieldError::new(
                "endpoint",
                format!("{:?} must be an http:// or https:// URL", self.endpoint),
            ));
        } else if let Err(e) = wirespan_discovery::client::address::ServerAddress::parse(
            "endpoint",
            &self.endpoint,
            false,
        ) {
            errs.push(FieldError::new(
                "endpoint",
                format!("{:?}: {}", self.endpoint, e.reason),
            ));
        }
        errs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse;

    const ID: &str = "8XuV9TZHW08DOk3bVxQjH9ih_TBKjnh-j44tsCLSBzo=";
    const SECRET: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

    #[test]
    fn cluster_and_discovery_documents_parse_and_secret_never_prints() {
        let cfg = parse(&format!(
            "apiVersion: v1alpha1\nkind: ClusterConfig\nid: {ID}\nsecret: {SECRET}\n---\n\
             apiVersion: v1alpha1\nkind: DiscoveryServiceConfig\nname: lab\nendpoint: http://10.99.0.1:3000\n"
        ))
        .unwrap();
        let c = cfg.singleton::<ClusterConfig>().unwrap();
        assert_eq!(c.secret_key().unwrap().bytes()[31], 31);
        assert!(!format!("{cfg:?}").contains(SECRET));
        assert!(!serde_json::to_string(&cfg).unwrap().contains(SECRET));
        assert_eq!(cfg.documents_of::<DiscoveryServiceConfig>().count(), 1);
    }

    #[test]
    fn bad_secret_and_endpoint_are_named_without_echoing_the_secret() {
        let err = parse(
            "apiVersion: v1alpha1\nkind: ClusterConfig\nid: x\nsecret: c2hvcnQ=\n---\n\
             apiVersion: v1alpha1\nkind: DiscoveryServiceConfig\nname: a\nendpoint: ftp://x\n---\n\
             apiVersion: v1alpha1\nkind: DiscoveryServiceConfig\nname: a\nendpoint: https://x/path\n",
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("secret: must decode to exactly 32 bytes, got 5"),
            "{text}"
        );
        assert!(!text.contains("c2hvcnQ="), "{text}");
        assert!(
            text.contains("(DiscoveryServiceConfig \"a\"): endpoint:"),
            "{text}"
        );
        assert!(text.contains("path"), "{text}");
        let err =
            parse("apiVersion: v1alpha1\nkind: ClusterConfig\nid: x\nsecret: '!!'\n").unwrap_err();
        assert!(
            err.to_string().contains("secret: is not valid base64"),
            "{err}"
        );
    }
}
