//! The config loader: file (or API text) → [`crate::config::parse`] → `config/MachineConfig
//! active`, written unowned and only when the whole text validated, so a bad config
//! keeps the previous one in force.
//!
//! Safety rules (the node must never lose its mesh to a bad write of its config):
//! - an accepted config's text is persisted in the state dir ([`LAST_GOOD_FILE`],
//!   atomically, 0600: it may hold the cluster secret); at start, a config file that
//!   is unreadable, empty, too large or invalid falls back to that copy;
//! - an empty config is an error ([`EMPTY`]): turning the mesh off is an explicit
//!   `enabled: false`, never the side effect of a truncated file;
//! - a config over [`MAX_CONFIG_BYTES`] (the API's limit too) is rejected;
//! - every rejection is logged and recorded in `config/ConfigStatus current`, next to
//!   the version in force (a content hash, [`version_of`]);
//! - [`ConfigLoader::watch_file`] re-reads the file only after a complete write
//!   (inotify close-write, a rename onto it, or, for a symlinked file such as a
//!   Kubernetes Secret volume's, a rename in its directory), not on a timer.

use std::{
    io::Read as _,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, SystemTime},
};

use sha2::Digest as _;
use tokio_util::sync::CancellationToken;

use crate::{
    config::{ConfigError, MAX_CONFIG_BYTES},
    files::{create_private_parent, write_atomic},
    resources::config::{
        attempt, ConfigStatus, ConfigStatusSpec, MachineConfig, MachineConfigSpec, ACTIVE, CURRENT,
    },
    runtime::{ResourceKind, StateError, Store},
};

pub use crate::config::LAST_GOOD_FILE;
pub use trial::{ConfigTrial, ReachabilityProbe, RollbackReason, Verdict, TRIAL_FILE};

pub mod trial;
mod trial_run;
pub use trial_run::{Confirmed, TrialOptions, ROLLBACK_SOURCE};
/// The error of a config without documents.
pub const EMPTY: &str = "config file is empty; to turn the mesh off set enabled: false";
/// Poll period of the file when inotify cannot be used.
pub const FALLBACK_POLL: Duration = Duration::from_secs(30);

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
    /// Over [`MAX_CONFIG_BYTES`].
    #[error("config is {size} bytes, over the {cap}-byte ({} MiB) limit", .cap >> 20)]
    TooLarge {
        /// Its size (of the file: at least this much).
        size: u64,
        /// The cap.
        cap: usize,
    },
    /// No documents.
    #[error("{EMPTY}")]
    Empty,
    /// The text is invalid (every problem, naming document and field).
    #[error(transparent)]
    Invalid(#[from] ConfigError),
    /// The last good copy could not be written; nothing was applied.
    #[error("saving the accepted config to {path}: {source}")]
    Persist {
        /// The state file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The store refused the write.
    #[error("storing config: {0}")]
    Store(#[from] StateError),
    /// `apply --confirm` without a trial in progress.
    #[error("no config trial in progress (nothing to confirm)")]
    NoTrial,
    /// A trial needs a config in force to roll back to.
    #[error("a trial needs a config in force to roll back to; apply this one plainly")]
    NothingToRollBackTo,
    /// The trial's timeout is out of range.
    #[error("{0}")]
    TrialTimeout(String),
    /// The config in force is not the one the change was made against (a patch or
    /// edit raced another change).
    #[error("the config in force is version {in_force}, not {expected} that the change was made against; fetch it again")]
    Stale {
        /// The version the caller expected.
        expected: String,
        /// The version in force.
        in_force: String,
    },
}

impl LoadError {
    /// The problems, one line each (one per document of an invalid config, at most
    /// [`crate::config::MAX_LISTED_PROBLEMS`] problems, then a count of the rest).
    #[must_use]
    pub fn problems(&self) -> Vec<String> {
        match self {
            Self::Invalid(e) => e.listed(),
            other => vec![other.to_string()],
        }
    }
}

/// A config the node accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    /// Whether the config in force changed (false: the same text was in force).
    pub changed: bool,
    /// Its version ([`version_of`]).
    pub version: String,
    /// Its number of documents.
    pub documents: usize,
}

/// The version of a config text: the first 16 hex digits of its SHA-256
/// (`sha256sum FILE | cut -c1-16`). A hash rather than a counter so that the same
/// text has the same version across restarts and nodes.
#[must_use]
pub fn version_of(text: &str) -> String {
    let digest = sha2::Sha256::digest(text.as_bytes());
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

fn check_size(size: u64) -> Result<(), LoadError> {
    if size > MAX_CONFIG_BYTES as u64 {
        return Err(LoadError::TooLarge {
            size,
            cap: MAX_CONFIG_BYTES,
        });
    }
    Ok(())
}

/// Reads a config file, refusing one over [`MAX_CONFIG_BYTES`] without reading it all.
///
/// # Errors
/// Unreadable or too large.
pub fn read_file(path: &Path) -> Result<String, LoadError> {
    let read_err = |source| LoadError::Read {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read_err)?;
    check_size(file.metadata().map_err(read_err)?.len())?;
    // The file may grow between the stat and the read.
    let mut text = String::new();
    file.take(MAX_CONFIG_BYTES as u64 + 1)
        .read_to_string(&mut text)
        .map_err(read_err)?;
    check_size(text.len() as u64)?;
    Ok(text)
}

/// Validates a whole config text: size, at least one document, every document.
///
/// # Errors
/// Every problem.
pub fn validate(text: &str) -> Result<crate::config::ConfigDocuments, LoadError> {
    check_size(text.len() as u64)?;
    let cfg = crate::config::parse(text)?;
    if cfg.documents.is_empty() {
        return Err(LoadError::Empty);
    }
    Ok(cfg)
}

fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

/// Takes configs from the file, the API and the state dir into the store, keeps the
/// last good copy and `config/ConfigStatus current`, and runs config trials
/// (`apply --mode try`, see [`trial`]). Clones share one lock, so a file reload, an
/// API apply and a rollback never interleave.
#[derive(Debug, Clone)]
pub struct ConfigLoader {
    store: Store,
    last_good: Option<PathBuf>,
    state: Arc<Mutex<LoaderState>>,
    /// Woken whenever a trial begins or ends (the trial enforcer waits on it).
    trial_changed: Arc<tokio::sync::Notify>,
}

/// What the loader holds under its lock.
#[derive(Debug, Default)]
struct LoaderState {
    /// The text of the config in force (what a trial rolls back to).
    in_force: Option<String>,
    /// The trial in progress.
    trial: Option<ConfigTrial>,
}

/// Whether an accepted text becomes the last good copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Save {
    /// When it differs from the config in force (a plain apply, no trial running).
    IfChanged,
    /// Always (a plain apply ending a trial, a rollback).
    Always,
    /// Never (a config on trial).
    Never,
}

impl ConfigLoader {
    /// A loader that keeps the last good config at `last_good` (none: not persisted).
    #[must_use]
    pub fn new(store: Store, last_good: Option<PathBuf>) -> Self {
        Self {
            store,
            last_good,
            state: Arc::default(),
            trial_changed: Arc::default(),
        }
    }

    /// A loader that keeps the last good config in `state_dir`.
    #[must_use]
    pub fn in_state_dir(store: Store, state_dir: &Path) -> Self {
        Self::new(store, Some(state_dir.join(LAST_GOOD_FILE)))
    }

    fn locked(&self) -> MutexGuard<'_, LoaderState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Where the last good config is kept.
    #[must_use]
    pub fn last_good_path(&self) -> Option<&Path> {
        self.last_good.as_deref()
    }

    /// The current status, if any config was offered yet.
    #[must_use]
    pub fn status(&self) -> Option<ConfigStatusSpec> {
        self.store
            .get::<ConfigStatus>(ConfigStatus::DEFAULT_NAMESPACE, CURRENT)
            .ok()
            .map(|r| r.spec.clone())
    }

    /// The text of the config in force, if any.
    #[must_use]
    pub fn in_force_text(&self) -> Option<String> {
        self.locked().in_force.clone()
    }

    /// The version in force (empty when none).
    #[must_use]
    pub fn accepted_version(&self) -> String {
        self.status()
            .map(|s| s.accepted_version)
            .unwrap_or_default()
    }

    /// Validates `text` and, only if all of it is valid, persists it and makes it the
    /// active config. A rejection is logged and recorded in the status.
    ///
    /// # Errors
    /// Every problem of the text; nothing changes then (but the status).
    /// A trial in progress ends: the accepted text becomes the last good copy.
    pub fn accept(&self, text: &str, source: &str) -> Result<Accepted, LoadError> {
        self.accept_based_on(text, source, None)
    }

    /// [`Self::accept`], only if the config in force is version `base` (when given):
    /// a change computed from the config in force (patch, edit) must not undo another
    /// change made meanwhile.
    ///
    /// # Errors
    /// As [`Self::accept`], and [`LoadError::Stale`].
    pub fn accept_based_on(
        &self,
        text: &str,
        source: &str,
        base: Option<&str>,
    ) -> Result<Accepted, LoadError> {
        let mut st = self.locked();
        self.check_base(base)
            .and_then(|()| self.accept_plain(&mut st, text, source))
            .inspect_err(|e| self.record_rejection(source, e))
    }

    fn check_base(&self, base: Option<&str>) -> Result<(), LoadError> {
        let in_force = self.accepted_version();
        match base {
            Some(b) if b != in_force => Err(LoadError::Stale {
                expected: b.to_owned(),
                in_force,
            }),
            _ => Ok(()),
        }
    }

    /// A plain apply, the lock held: ends a trial in progress.
    fn accept_plain(
        &self,
        st: &mut LoaderState,
        text: &str,
        source: &str,
    ) -> Result<Accepted, LoadError> {
        let cfg = validate(text)?;
        let Some(trial) = st.trial.take() else {
            return self.commit(st, text, cfg, source, Save::IfChanged);
        };
        // The trial file goes first: a crash before the new last good copy is written
        // then comes back on the earlier config, never on the trial's.
        self.remove_trial_file();
        match self.commit(st, text, cfg, source, Save::Always) {
            Ok(a) => {
                self.end_trial(&format!("ended by a plain apply from {source}"));
                Ok(a)
            }
            Err(e) => {
                self.restore_trial(st, trial);
                Err(e)
            }
        }
    }

    /// Reads `path` and [`Self::accept`]s it; read errors are recorded too.
    ///
    /// # Errors
    /// Unreadable, too large or invalid file; nothing changes then.
    pub fn accept_file(&self, path: &Path) -> Result<Accepted, LoadError> {
        let source = path.display().to_string();
        match read_file(path) {
            Ok(text) => self.accept(&text, &source),
            Err(e) => {
                let _g = self.locked();
                self.record_rejection(&source, &e);
                Err(e)
            }
        }
    }

    /// The config at start: `file` if it is good, else the last good copy (and the
    /// file's error recorded); without `file`, the last good copy if there is one.
    ///
    /// # Errors
    /// The file's error when there is no usable last good copy to fall back to.
    ///
    /// A trial found in the state dir then resumes on top of it, or, past its deadline
    /// (or unreadable), is recorded as rolled back: the earlier config stays.
    pub fn start(&self, file: Option<&Path>) -> Result<Option<Accepted>, LoadError> {
        let mut st = self.locked();
        let earlier = self.start_earlier(&mut st, file)?;
        Ok(self.resume_trial(&mut st, SystemTime::now()).or(earlier))
    }

    /// The config in force before any trial: the file, else the last good copy.
    fn start_earlier(
        &self,
        st: &mut LoaderState,
        file: Option<&Path>,
    ) -> Result<Option<Accepted>, LoadError> {
        let Some(path) = file else {
            let Some((text, source)) = self.read_last_good() else {
                return Ok(None);
            };
            return self
                .try_accept(st, &text, &source, Save::IfChanged)
                .map(Some);
        };
        let file_source = path.display().to_string();
        let err = match read_file(path)
            .and_then(|t| self.try_accept(st, &t, &file_source, Save::IfChanged))
        {
            Ok(a) => return Ok(Some(a)),
            Err(e) => e,
        };
        let Some((text, source)) = self.read_last_good() else {
            return Err(err);
        };
        match self.try_accept(st, &text, &source, Save::IfChanged) {
            Ok(a) => {
                tracing::error!(path = %path.display(), error = %err, last_good = %source,
                    version = %a.version,
                    "config file rejected; starting with the last good config");
                self.record_rejection(&file_source, &err);
                Ok(Some(a))
            }
            Err(e) => {
                tracing::error!(last_good = %source, error = %e,
                    "the last good config copy is not usable either");
                Err(err)
            }
        }
    }

    fn read_last_good(&self) -> Option<(String, String)> {
        let path = self.last_good.as_ref()?;
        match read_file(path) {
            Ok(text) => Some((text, path.display().to_string())),
            Err(LoadError::Read { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                None
            }
            Err(e) => {
                tracing::error!(error = %e, "ignoring the last good config copy");
                None
            }
        }
    }

    /// The work of [`Self::accept`], the lock held, without recording a rejection.
    fn try_accept(
        &self,
        st: &mut LoaderState,
        text: &str,
        source: &str,
        save: Save,
    ) -> Result<Accepted, LoadError> {
        let cfg = validate(text)?;
        self.commit(st, text, cfg, source, save)
    }

    /// Puts a validated config in force.
    fn commit(
        &self,
        st: &mut LoaderState,
        text: &str,
        cfg: crate::config::ConfigDocuments,
        source: &str,
        save: Save,
    ) -> Result<Accepted, LoadError> {
        let version = version_of(text);
        let documents = cfg.documents.len();
        let in_force = self
            .store
            .get::<MachineConfig>(MachineConfig::DEFAULT_NAMESPACE, ACTIVE)
            .is_ok();
        let status = self.status().unwrap_or_default();
        let changed = !(in_force && status.accepted_version == version);
        if save == Save::Always || (save == Save::IfChanged && changed) {
            self.persist(text)?;
        }
        st.in_force = Some(text.to_owned());
        if changed {
            let spec = MachineConfigSpec {
                source: source.to_owned(),
                document_count: documents,
                config: cfg,
            };
            self.store.modify::<MachineConfig>(
                MachineConfig::DEFAULT_NAMESPACE,
                ACTIVE,
                "",
                |r| {
                    r.spec = spec.clone();
                },
            )?;
            tracing::info!(source, version, documents, "config applied");
        }
        self.store
            .modify::<ConfigStatus>(ConfigStatus::DEFAULT_NAMESPACE, CURRENT, "", |r| {
                if changed {
                    r.spec.source = source.to_owned();
                    r.spec.accepted_version.clone_from(&version);
                    r.spec.accepted_time = now_rfc3339();
                    r.spec.documents = documents;
                }
                r.spec.last_attempt = attempt::ACCEPTED.to_owned();
            })?;
        Ok(Accepted {
            changed,
            version,
            documents,
        })
    }

    fn persist(&self, text: &str) -> Result<(), LoadError> {
        let Some(path) = &self.last_good else {
            return Ok(());
        };
        let err = |source| LoadError::Persist {
            path: path.clone(),
            source,
        };
        create_private_parent(path).map_err(err)?;
        write_atomic(path, text.as_bytes()).map_err(err)
    }

    fn record_rejection(&self, source: &str, e: &LoadError) {
        let in_force = self.accepted_version();
        tracing::error!(source, error = %e, in_force = %in_force,
            "config rejected; the config in force stays");
        let res =
            self.store
                .modify::<ConfigStatus>(ConfigStatus::DEFAULT_NAMESPACE, CURRENT, "", |r| {
                    r.spec.last_attempt = attempt::REJECTED.to_owned();
                    r.spec.last_error = e.to_string();
                    r.spec.last_error_source = source.to_owned();
                    r.spec.last_error_time = now_rfc3339();
                });
        if let Err(e) = res {
            tracing::error!(error = %e, "recording the config status");
        }
    }

    /// Re-reads `path` after every complete write of it (inotify close-write, or a
    /// rename onto it: the directory is watched, so editors' and `write_atomic`'s
    /// renames are seen) and accepts a changed content; a rejected one is logged and
    /// recorded and the config in force stays. Polls every [`FALLBACK_POLL`] instead
    /// when inotify cannot be used. Returns when `cancel` fires. Each outcome is also
    /// sent to `reports` when given. The file's content and the watch are taken when
    /// this is called (not when the future is first polled), so a change right after
    /// the call is seen.
    pub fn watch_file(
        &self,
        path: PathBuf,
        cancel: CancellationToken,
        reports: Option<tokio::sync::mpsc::UnboundedSender<Result<Accepted, String>>>,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let loader = self.clone();
        let watch = watch(&path);
        let mut last = read_file(&path).ok();
        async move {
            let (watcher, mut events) = match watch {
                Ok((w, rx)) => (Some(w), Some(rx)),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, poll = ?FALLBACK_POLL,
                        "cannot watch the config file with inotify; polling it instead");
                    (None, None)
                }
            };
            let mut poll = tokio::time::interval(FALLBACK_POLL);
            poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = cancel.cancelled() => break,
                    ev = async { events.as_mut()?.recv().await }, if events.is_some() => {
                        if ev.is_none() {
                            break;
                        }
                    }
                    _ = poll.tick(), if events.is_none() => {}
                }
                if let Some(rx) = events.as_mut() {
                    // Several events of one write: one read.
                    while rx.try_recv().is_ok() {}
                }
                // Reading and parsing are blocking work: off the async workers.
                let (now, res) = {
                    let (loader, path, last) = (loader.clone(), path.clone(), last.clone());
                    match tokio::task::spawn_blocking(move || {
                        reload(&loader, &path, last.as_deref())
                    })
                    .await
                    {
                        Ok(Some(r)) => r,
                        Ok(None) => continue,
                        Err(e) => {
                            tracing::error!(error = %e, "config reload task failed");
                            continue;
                        }
                    }
                };
                last = now;
                if let Some(r) = &reports {
                    let _ = r.send(res.map_err(|e| e.to_string()));
                }
            }
            drop(watcher);
        }
    }
}

/// One reload of the watched file: `None` when its content is `last`, else the new
/// content (`None` when unreadable) and the outcome of accepting it.
fn reload(
    loader: &ConfigLoader,
    path: &Path,
    last: Option<&str>,
) -> Option<(Option<String>, Result<Accepted, LoadError>)> {
    let now = read_file(path);
    if matches!((&now, last), (Ok(a), Some(b)) if a == b) {
        return None;
    }
    Some(match now {
        Ok(text) => {
            let res = loader.accept(&text, &path.display().to_string());
            (Some(text), res)
        }
        // A read failure is a rejection too (recorded by accept_file).
        Err(_) => (None, loader.accept_file(path)),
    })
}

/// Whether `ev` ends a write of the file named `name` in the watched directory: the
/// writer closed it, or a file was renamed onto it. Plain modifications (a write in
/// progress) are not. When the file is a symlink (`symlink`), a rename of any entry
/// may have changed what it points to: Kubernetes updates a mounted Secret or
/// ConfigMap by renaming a `..data` symlink that `config.yaml -> ..data/config.yaml`
/// goes through.
fn completes_write(ev: &notify::Event, name: &std::ffi::OsStr, symlink: bool) -> bool {
    use notify::event::{AccessKind, AccessMode, EventKind, ModifyKind, RenameMode};
    let ours = ev.paths.iter().any(|p| p.file_name() == Some(name));
    match ev.kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => ours,
        EventKind::Modify(ModifyKind::Name(RenameMode::To)) => ours || symlink,
        // Events were lost: the file may have changed.
        _ => ev.need_rescan(),
    }
}

type Watch = (
    notify::RecommendedWatcher,
    tokio::sync::mpsc::UnboundedReceiver<()>,
);

/// An inotify watch of `path`'s directory, sending `()` on each complete write of it.
fn watch(path: &Path) -> notify::Result<Watch> {
    use notify::Watcher as _;
    let name = path
        .file_name()
        .ok_or_else(|| notify::Error::generic("the config path has no file name"))?
        .to_owned();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    let symlink = path.symlink_metadata().is_ok_and(|m| m.is_symlink());
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let mut watcher =
        notify::recommended_watcher(move |res: notify::Result<notify::Event>| match res {
            Ok(ev) if !completes_write(&ev, &name, symlink) => {}
            Ok(_) => {
                let _ = tx.send(());
            }
            Err(e) => {
                // Re-read: whatever was missed, the content comparison sorts it out.
                tracing::warn!(error = %e, "config file watch");
                let _ = tx.send(());
            }
        })?;
    watcher.watch(&dir, notify::RecursiveMode::NonRecursive)?;
    Ok((watcher, rx))
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod trial_tests;
