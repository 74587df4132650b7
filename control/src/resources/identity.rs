//! The node identity: a random node ID generated once and persisted in the state dir.

use std::{
    fs,
    path::{Path, PathBuf},
};

use futures::future::BoxFuture;
use rand::RngCore as _;
use serde::{Deserialize, Serialize};

use crate::files::{ensure_private_dir, write_atomic};
use crate::runtime::{
    Action, Controller, ControllerError, ControllerResult, ControllerRuntime, Definition, Input,
    Output, ResourceKind,
};

/// The node's identity (`cluster/local`).
#[derive(Debug)]
pub struct NodeIdentity;

/// Id of the single identity resource.
pub const LOCAL: &str = "local";

impl ResourceKind for NodeIdentity {
    const TYPE: &'static str = "NodeIdentities.cluster.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = "cluster";
    type Spec = NodeIdentitySpec;
    fn definition() -> Definition {
        // `identities` (as in Talos) means this node's identity; the cluster's is
        // `clusteridentities`, the mesh key `kubespanidentities`.
        Definition::new(Self::TYPE, "NodeIdentity", Self::DEFAULT_NAMESPACE)
            .alias("identities")
            .alias("identity")
            .column("ID", ".nodeId")
    }
}

/// Spec of [`NodeIdentity`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeIdentitySpec {
    /// Opaque node ID (base62 of 32 random bytes), stable across restarts.
    pub node_id: String,
}

const ALPHABET: &[u8; 62] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";

/// Bit-packing base62: 6 bits per character, except that a 6-bit group of 60–63
/// (high five bits `11110`/`11111`) consumes only its high 5 bits and encodes as
/// character 60 or 61; characters below 60 are 6-bit groups, so the text stays
/// decodable and uses `A–Z a–z 0–9` only.
#[must_use]
pub fn base62(data: &[u8]) -> String {
    let total = data.len() * 8;
    let bit = |i: usize| (data[i / 8] >> (7 - i % 8)) & 1;
    let mut out = String::with_capacity(total / 5 + 1);
    let mut pos = 0;
    while pos < total {
        let take = 6.min(total - pos);
        let mut v = 0u8;
        for i in 0..take {
            v = (v << 1) | bit(pos + i);
        }
        v <<= 6 - take;
        if v >= 60 {
            out.push(char::from(ALPHABET[usize::from(30 + (v >> 1))]));
            pos += 5;
        } else {
            out.push(char::from(ALPHABET[usize::from(v)]));
            pos += take;
        }
    }
    out
}

/// Errors of the identity file.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// Reading or writing the file failed.
    #[error("node identity file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The file holds something that is not a node ID.
    #[error("node identity file {path}: invalid node ID (want 1–256 characters of [A-Za-z0-9])")]
    Invalid {
        /// The file.
        path: PathBuf,
    },
}

/// A fresh node ID: 32 random bytes in [`base62`].
#[must_use]
pub fn generate_node_id() -> String {
    let mut raw = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut raw);
    base62(&raw)
}

/// Loads the node ID from `dir/node-id`, generating and persisting it when missing.
///
/// # Errors
/// I/O errors and an invalid file.
pub fn load_or_generate(dir: &Path) -> Result<String, IdentityError> {
    let path = dir.join("node-id");
    let io = |source| IdentityError::Io {
        path: path.clone(),
        source,
    };
    match fs::read_to_string(&path) {
        Ok(s) => {
            let id = s.trim();
            if id.is_empty() || id.len() > 256 || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
                return Err(IdentityError::Invalid { path });
            }
            Ok(id.to_owned())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            ensure_private_dir(dir).map_err(io)?;
            let id = generate_node_id();
            write_atomic(&path, format!("{id}\n").as_bytes()).map_err(io)?;
            tracing::info!(path = %path.display(), "generated node identity");
            Ok(id)
        }
        Err(e) => Err(io(e)),
    }
}

/// Publishes `cluster/NodeIdentity local` from the persisted node ID.
#[derive(Debug)]
pub struct NodeIdentityController {
    state_dir: PathBuf,
}

impl NodeIdentityController {
    /// A controller persisting the ID under `state_dir`.
    #[must_use]
    pub fn new(state_dir: PathBuf) -> Self {
        Self { state_dir }
    }
}

impl Controller for NodeIdentityController {
    type Event = ();

    fn name(&self) -> &str {
        "NodeIdentityController"
    }

    fn inputs(&self) -> Vec<Input> {
        Vec::new()
    }

    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<NodeIdentity>()]
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let dir = self.state_dir.clone();
            let id = tokio::task::spawn_blocking(move || load_or_generate(&dir))
                .await
                .map_err(ControllerError::other)?
                .map_err(ControllerError::other)?;
            rt.modify::<NodeIdentity>(NodeIdentity::DEFAULT_NAMESPACE, LOCAL, |r| {
                r.spec.node_id.clone_from(&id);
            })?;
            Ok(Action::await_change())
        })
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    #[test]
    fn base62_of_32_bytes_is_alphanumeric_and_43_to_52_chars() {
        for seed in 0..200u8 {
            let raw: Vec<u8> = (0..32u8)
                .map(|i| i.wrapping_mul(seed).wrapping_add(seed))
                .collect();
            let s = base62(&raw);
            assert!(s.bytes().all(|b| b.is_ascii_alphanumeric()), "{s}");
            assert!((43..=52).contains(&s.len()), "{} {s}", s.len());
        }
        assert_eq!(base62(&[0xff; 32]).len(), 52);
        assert_eq!(base62(&[0; 32]).len(), 43);
    }

    #[test]
    fn identity_is_persisted_0600_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let a = load_or_generate(dir.path()).unwrap();
        let b = load_or_generate(dir.path()).unwrap();
        assert_eq!(a, b);
        let mode = fs::metadata(dir.path().join("node-id"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        fs::write(dir.path().join("node-id"), "not valid!").unwrap();
        assert!(matches!(
            load_or_generate(dir.path()),
            Err(IdentityError::Invalid { .. })
        ));
    }
}
