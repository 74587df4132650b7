//! The loader's side of config trials: arming one, confirming it, rolling it back,
//! finding it again at start, and the task that enforces deadlines and the
//! reachability probe. The decisions are [`ConfigTrial::verdict`]'s.
//!
//! Persistence order, so that a crash at any point comes back on a safe config:
//! the trial file is written before the trial config goes in force and removed before
//! a rollback or a plain apply replaces it; the trial config is written as the last
//! good copy only on confirmation.

use std::{
    path::PathBuf,
    time::{Duration, SystemTime},
};

use tokio_util::sync::CancellationToken;

use super::{
    now_rfc3339, trial, validate, version_of, Accepted, ConfigLoader, ConfigTrial, LoadError,
    LoaderState, ReachabilityProbe, RollbackReason, Save, Verdict, TRIAL_FILE,
};
use crate::{
    files::{create_private_parent, write_atomic},
    resources::config::{ConfigStatus, CURRENT},
    runtime::ResourceKind as _,
};

/// Source name of a config put back by a rollback.
pub const ROLLBACK_SOURCE: &str = "rollback";

/// How long the enforcer waits before retrying a rollback that failed.
const RETRY: Duration = Duration::from_secs(1);

/// A trial request: how long, and the reachability probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrialOptions {
    /// Until the rollback.
    pub timeout: Duration,
    /// `--rollback-unless-reachable`.
    pub probe: Option<ReachabilityProbe>,
}

/// A confirmed trial.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confirmed {
    /// The version now last good.
    pub version: String,
    /// Its text (for the config file).
    pub config: String,
}

impl ConfigLoader {
    /// The trial file, beside the last good copy (none when configs are not
    /// persisted).
    fn trial_path(&self) -> Option<PathBuf> {
        Some(self.last_good.as_ref()?.with_file_name(TRIAL_FILE))
    }

    fn write_trial_file(&self, t: &ConfigTrial) -> Result<(), LoadError> {
        let Some(path) = self.trial_path() else {
            return Ok(());
        };
        let err = |source| LoadError::Persist {
            path: path.clone(),
            source,
        };
        let json = t.to_json().map_err(|e| err(std::io::Error::other(e)))?;
        create_private_parent(&path).map_err(err)?;
        write_atomic(&path, &json).map_err(err)
    }

    pub(super) fn remove_trial_file(&self) {
        let Some(path) = self.trial_path() else {
            return;
        };
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::error!(path = %path.display(), error = %e,
                "removing the config trial file"),
        }
    }

    /// Puts back a trial whose end failed half-way.
    pub(super) fn restore_trial(&self, st: &mut LoaderState, t: ConfigTrial) {
        if let Err(e) = self.write_trial_file(&t) {
            tracing::error!(error = %e, "restoring the config trial file");
        }
        st.trial = Some(t);
        self.trial_changed.notify_one();
    }

    /// The trial in progress.
    #[must_use]
    pub fn trial(&self) -> Option<ConfigTrial> {
        self.locked().trial.clone()
    }

    /// Applies `text` on trial: it is in force at once, and the config in force before
    /// comes back at the deadline unless [`Self::confirm`] is called first (or a plain
    /// apply ends the trial). A trial over a trial keeps the first one's earlier
    /// config. Returns the deadline, or `None` when `text` is already in force and no
    /// trial was needed.
    ///
    /// # Errors
    /// As [`Self::accept_based_on`]; also no config in force, or a bad timeout.
    pub fn accept_trial(
        &self,
        text: &str,
        source: &str,
        opts: TrialOptions,
        base: Option<&str>,
        now: SystemTime,
    ) -> Result<(Accepted, Option<SystemTime>), LoadError> {
        let mut st = self.locked();
        self.try_accept_trial(&mut st, text, source, opts, base, now)
            .inspect_err(|e| self.record_rejection(source, e))
    }

    fn try_accept_trial(
        &self,
        st: &mut LoaderState,
        text: &str,
        source: &str,
        opts: TrialOptions,
        base: Option<&str>,
        now: SystemTime,
    ) -> Result<(Accepted, Option<SystemTime>), LoadError> {
        self.check_base(base)?;
        let timeout = trial::check_timeout(opts.timeout).map_err(LoadError::TrialTimeout)?;
        let cfg = validate(text)?;
        let previous = match (&st.trial, &st.in_force) {
            (Some(t), _) => t.previous.clone(),
            (None, Some(in_force)) => in_force.clone(),
            (None, None) => return Err(LoadError::NothingToRollBackTo),
        };
        if st.trial.is_none() && version_of(&previous) == version_of(text) {
            let a = self.commit(st, text, cfg, source, Save::IfChanged)?;
            return Ok((a, None));
        }
        let t = ConfigTrial::new(previous, text.to_owned(), now, timeout, opts.probe);
        // On disk before in force: a crash right after finds the trial and its deadline.
        self.write_trial_file(&t)?;
        match self.commit(st, text, cfg, source, Save::Never) {
            Ok(a) => {
                tracing::warn!(version = %t.version, previous = %t.previous_version,
                    deadline = %humantime::format_rfc3339_millis(t.deadline),
                    "config on trial; it rolls back unless confirmed");
                self.record_trial(&t);
                let deadline = t.deadline;
                st.trial = Some(t);
                self.trial_changed.notify_one();
                Ok((a, Some(deadline)))
            }
            Err(e) => {
                match st.trial.clone() {
                    Some(old) => self.restore_trial(st, old),
                    None => self.remove_trial_file(),
                }
                Err(e)
            }
        }
    }

    /// Makes the trial config the last good one and ends the trial.
    ///
    /// # Errors
    /// [`LoadError::NoTrial`], or the last good copy could not be written (the trial
    /// goes on).
    pub fn confirm(&self) -> Result<Confirmed, LoadError> {
        let mut st = self.locked();
        let t = st.trial.take().ok_or(LoadError::NoTrial)?;
        if let Err(e) = self.persist(&t.config) {
            st.trial = Some(t);
            return Err(e);
        }
        self.remove_trial_file();
        tracing::info!(version = %t.version, "config trial confirmed");
        self.end_trial(&format!("confirmed version {}", t.version));
        Ok(Confirmed {
            version: t.version,
            config: t.config,
        })
    }

    /// Rolls the trial back if its verdict at `now` says so. `probe` is the
    /// reachability probe's count of failures in a row (and the latest error) for the
    /// trial that began at the given time. Returns why it rolled back.
    ///
    /// # Errors
    /// Putting the earlier config back failed (the trial is kept, to retry).
    pub fn check_trial(
        &self,
        now: SystemTime,
        probe: Option<(SystemTime, u32, &str)>,
    ) -> Result<Option<RollbackReason>, LoadError> {
        let mut st = self.locked();
        let Some(t) = &st.trial else {
            return Ok(None);
        };
        let (failures, error) = match probe {
            Some((started, n, e)) if started == t.started => (n, e),
            _ => (0, ""),
        };
        let Verdict::RollBack(reason) = t.verdict(now, failures, error) else {
            return Ok(None);
        };
        let Some(t) = st.trial.take() else {
            return Ok(None);
        };
        self.roll_back(&mut st, t, &reason.to_string())?;
        Ok(Some(reason))
    }

    /// Puts `t`'s earlier config back in force.
    fn roll_back(&self, st: &mut LoaderState, t: ConfigTrial, why: &str) -> Result<(), LoadError> {
        // Forgotten first: a crash before the earlier config is back in force then
        // starts on the last good copy, which is that config.
        self.remove_trial_file();
        match self.try_accept(st, &t.previous, ROLLBACK_SOURCE, Save::Always) {
            Ok(_) => {
                tracing::warn!(version = %t.version, back_to = %t.previous_version, reason = %why,
                    "config trial rolled back");
                self.end_trial(&format!("rolled back to {}: {why}", t.previous_version));
                Ok(())
            }
            Err(e) => {
                tracing::error!(error = %e, "rolling back the config trial failed; retrying");
                self.restore_trial(st, t);
                Err(e)
            }
        }
    }

    /// At start, after the earlier config is in force: the trial found in the state
    /// dir goes on (its config back in force) while its deadline is ahead, else it is
    /// recorded as rolled back. Returns the trial config's acceptance.
    pub(super) fn resume_trial(&self, st: &mut LoaderState, now: SystemTime) -> Option<Accepted> {
        let path = self.trial_path()?;
        let t = match std::fs::read(&path) {
            Ok(bytes) => ConfigTrial::from_json(&bytes).map_err(|e| e.to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => Err(e.to_string()),
        };
        let t = match t {
            Ok(t) => t,
            Err(e) => {
                self.remove_trial_file();
                let why = RollbackReason::Unreadable(e);
                tracing::error!(path = %path.display(), reason = %why,
                    "config trial dropped at start; the earlier config stays");
                self.record_last_trial(&format!("rolled back at start: {why}"));
                return None;
            }
        };
        let why = match t.verdict(now, 0, "") {
            Verdict::RollBack(why) => {
                format!("rolled back to {} at start: {why}", t.previous_version)
            }
            Verdict::Keep { .. } => {
                match self.try_accept(st, &t.config, "trial (resumed at start)", Save::Never) {
                    Ok(a) => {
                        tracing::warn!(version = %t.version,
                            deadline = %humantime::format_rfc3339_millis(t.deadline),
                            "config trial resumed; it rolls back unless confirmed");
                        self.record_trial(&t);
                        st.trial = Some(t);
                        self.trial_changed.notify_one();
                        return Some(a);
                    }
                    Err(e) => format!("dropped at start: the trial config is not valid: {e}"),
                }
            }
        };
        self.remove_trial_file();
        if st.in_force.is_none() {
            // Nothing else to start on: the trial's earlier config.
            if let Err(e) = self.try_accept(st, &t.previous, ROLLBACK_SOURCE, Save::Always) {
                tracing::error!(error = %e, "the trial's earlier config is not usable");
            }
        }
        tracing::warn!(version = %t.version, outcome = %why, "config trial ended at start");
        self.end_trial(&why);
        None
    }

    /// Shows `t` in the status.
    fn record_trial(&self, t: &ConfigTrial) {
        self.modify_status(|s| {
            s.trial_version.clone_from(&t.version);
            s.trial_deadline = humantime::format_rfc3339_millis(t.deadline).to_string();
            s.trial_previous_version.clone_from(&t.previous_version);
            s.trial_reachability = t
                .probe
                .as_ref()
                .map(|p| p.endpoint.clone())
                .unwrap_or_default();
        });
    }

    /// Clears the trial from the status, with its outcome.
    pub(super) fn end_trial(&self, outcome: &str) {
        self.record_last_trial(outcome);
        self.trial_changed.notify_one();
    }

    fn record_last_trial(&self, outcome: &str) {
        self.modify_status(|s| {
            s.trial_version.clear();
            s.trial_deadline.clear();
            s.trial_previous_version.clear();
            s.trial_reachability.clear();
            s.last_trial = outcome.to_owned();
            s.last_trial_time = now_rfc3339();
        });
    }

    fn modify_status(&self, f: impl Fn(&mut crate::resources::config::ConfigStatusSpec)) {
        let res =
            self.store
                .modify::<ConfigStatus>(ConfigStatus::DEFAULT_NAMESPACE, CURRENT, "", |r| {
                    f(&mut r.spec);
                });
        if let Err(e) = res {
            tracing::error!(error = %e, "recording the config trial in the status");
        }
    }

    /// Enforces trials until `cancel`: rolls a trial back at its deadline, or at
    /// once when its reachability probe fails its threshold.
    pub fn enforce_trials(
        &self,
        cancel: CancellationToken,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let loader = self.clone();
        async move {
            // The probe's failures in a row, for the trial that began at `.0`.
            let mut failures: (Option<SystemTime>, u32, String) = (None, 0, String::new());
            let mut next_probe = tokio::time::Instant::now();
            loop {
                let trial = loader.trial();
                if let Some(t) = &trial {
                    if failures.0 != Some(t.started) {
                        failures = (Some(t.started), 0, String::new());
                        next_probe = tokio::time::Instant::now();
                    }
                    if loader.check_in_blocking(&failures).await.is_err() {
                        tokio::select! {
                            () = cancel.cancelled() => return,
                            () = tokio::time::sleep(RETRY) => continue,
                        }
                    }
                }
                let Some(t) = trial else {
                    tokio::select! {
                        () = cancel.cancelled() => return,
                        () = loader.trial_changed.notified() => continue,
                    }
                };
                let left = t.remaining(SystemTime::now());
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = loader.trial_changed.notified() => {}
                    () = tokio::time::sleep(left) => {}
                    () = tokio::time::sleep_until(next_probe), if t.probe.is_some() => {
                        let Some(p) = &t.probe else { continue };
                        next_probe = tokio::time::Instant::now() + p.interval;
                        match probe_once(p).await {
                            Ok(()) => (failures.1, failures.2) = (0, String::new()),
                            Err(e) => {
                                tracing::warn!(endpoint = %p.endpoint, error = %e,
                                    "config trial reachability probe failed");
                                failures.1 += 1;
                                failures.2 = e;
                            }
                        }
                    }
                }
            }
        }
    }

    /// [`Self::check_trial`] now, off the async workers (a rollback parses a config).
    async fn check_in_blocking(
        &self,
        failures: &(Option<SystemTime>, u32, String),
    ) -> Result<(), ()> {
        let loader = self.clone();
        let failures = failures.clone();
        let res = tokio::task::spawn_blocking(move || {
            let probe = failures.0.map(|s| (s, failures.1, failures.2.as_str()));
            loader.check_trial(SystemTime::now(), probe)
        })
        .await;
        match res {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(_)) => Err(()),
            Err(e) => {
                tracing::error!(error = %e, "config trial check task failed");
                Err(())
            }
        }
    }
}

/// One TCP connect of the reachability probe (the TCP probe's own connect).
async fn probe_once(p: &ReachabilityProbe) -> Result<(), String> {
    crate::controllers::probe::probe_tcp(&crate::resources::network::TcpProbeSpec {
        endpoint: p.endpoint.clone(),
        timeout: p.timeout,
    })
    .await
}
