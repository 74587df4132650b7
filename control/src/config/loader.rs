//! The config loader: file (or API text) → [`super::parse`] → `config/MachineConfig
//! active`, written unowned and only when the whole text validated, so a bad config
//! keeps the previous one in force. [`watch_file`] re-reads the file when it changes.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use tokio_util::sync::CancellationToken;

use super::ConfigError;
use crate::{
    resources::config::{MachineConfig, MachineConfigSpec, ACTIVE},
    runtime::{ResourceKind, StateError, Store},
};

/// Why a config was not applied.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("reading config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The text is invalid (every problem, naming document and field).
    #[error(transparent)]
    Invalid(#[from] ConfigError),
    /// The store refused the write.
    #[error("storing config: {0}")]
    Store(#[from] StateError),
}

/// Validates `text` and, only if all of it is valid, makes it the active config.
/// Returns whether the active config changed.
///
/// # Errors
/// Every problem of the text; nothing is written then.
pub fn apply_text(store: &Store, text: &str, source: &str) -> Result<bool, LoadError> {
    let cfg = super::parse(text)?;
    let spec = MachineConfigSpec {
        source: source.to_owned(),
        document_count: cfg.documents.len(),
        config: cfg,
    };
    let before = store
        .get::<MachineConfig>(MachineConfig::DEFAULT_NAMESPACE, ACTIVE)
        .ok();
    let after =
        store.modify::<MachineConfig>(MachineConfig::DEFAULT_NAMESPACE, ACTIVE, "", |r| {
            r.spec = spec.clone();
        })?;
    let changed = before.is_none_or(|b| b.metadata.version != after.metadata.version);
    if changed {
        tracing::info!(source, documents = spec.document_count, "config applied");
    }
    Ok(changed)
}

/// Reads and applies `path`.
///
/// # Errors
/// Unreadable or invalid file; nothing is written then.
pub fn apply_file(store: &Store, path: &Path) -> Result<bool, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
        path: path.to_owned(),
        source,
    })?;
    apply_text(store, &text, &path.display().to_string())
}

/// Polls `path` every `period` and re-applies it when its content changes; an invalid
/// new content is logged with every error and the previous config stays. Returns
/// when `cancel` fires. Each outcome (changed?, or the error text) is also sent to
/// `reports` when given. The file is first read when this is called (not when the
/// future is first polled), so a change right after the call is seen.
pub fn watch_file(
    store: Store,
    path: PathBuf,
    period: Duration,
    cancel: CancellationToken,
    reports: Option<tokio::sync::mpsc::UnboundedSender<Result<bool, String>>>,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let mut last = std::fs::read(&path).ok();
    async move {
        let mut tick = tokio::time::interval(period);
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            let now = std::fs::read(&path).ok();
            if now.is_none() || now == last {
                continue;
            }
            last.clone_from(&now);
            let res = apply_file(&store, &path).map_err(|e| e.to_string());
            if let Err(e) = &res {
                tracing::error!(path = %path.display(), error = %e,
                "config rejected; the previous config stays in force");
            }
            if let Some(r) = &reports {
                let _ = r.send(res);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::StoreOptions;

    const GOOD: &str =
        "apiVersion: v1alpha1\nkind: AddressConfig\nlink: eth0\naddress: 10.0.0.1/24\n";
    const BAD: &str = "apiVersion: v1alpha1\nkind: AddressConfig\nlink: eth0\naddress: 10.0.0.1/24\n---\napiVersion: v1alpha1\nkind: HTTPProbeConfig\nname: web\nurl: ftp://x/\nfailureThreshold: -1\n";

    #[test]
    fn invalid_config_keeps_the_previous_one_and_names_document_and_field() {
        let store = Store::new(StoreOptions::default());
        assert!(apply_text(&store, GOOD, "test").unwrap());
        assert!(
            !apply_text(&store, GOOD, "test").unwrap(),
            "same text is a no-op"
        );
        let err = apply_text(&store, BAD, "test").unwrap_err().to_string();
        assert!(err.contains("HTTPProbeConfig \"web\""), "{err}");
        assert!(
            err.contains("url: HTTP probe URL scheme must be http or https, got \"ftp\""),
            "{err}"
        );
        assert!(
            err.contains("failureThreshold: probe failure threshold cannot be negative: -1"),
            "{err}"
        );
        let active = store.get::<MachineConfig>("config", ACTIVE).unwrap();
        assert_eq!(active.spec.document_count, 1);
        assert_eq!(active.metadata.version, 1);
        assert_eq!(active.metadata.owner, "");
    }

    #[tokio::test]
    async fn watched_file_reloads_valid_changes_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.yaml");
        std::fs::write(&path, GOOD).unwrap();
        let store = Store::new(StoreOptions::default());
        apply_file(&store, &path).unwrap();
        let cancel = CancellationToken::new();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let task = tokio::spawn(watch_file(
            store.clone(),
            path.clone(),
            Duration::from_millis(20),
            cancel.clone(),
            Some(tx),
        ));
        std::fs::write(&path, BAD).unwrap();
        let report = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert!(report.unwrap_err().contains("HTTPProbeConfig"));
        let two =
            format!("{GOOD}---\napiVersion: v1alpha1\nkind: LinkConfig\nname: eth0\nmtu: 1400\n");
        assert_eq!(
            store
                .get::<MachineConfig>("config", ACTIVE)
                .unwrap()
                .spec
                .document_count,
            1
        );
        std::fs::write(&path, &two).unwrap();
        crate::testing::assert_resource::<MachineConfig>(&store, "config", ACTIVE, |r| {
            if r.spec.document_count == 2 {
                Ok(())
            } else {
                Err(format!("{} documents", r.spec.document_count))
            }
        })
        .await;
        cancel.cancel();
        task.await.unwrap();
    }
}
