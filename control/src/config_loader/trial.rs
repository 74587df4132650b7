//! A config on trial (`wirespan apply --mode try`): the config in force until it is
//! confirmed or its deadline passes, with the config to go back to. Pure: every
//! decision takes the time (and the reachability probe's failure count) as input; the
//! loader does the I/O (persisting the trial beside the last good copy, applying,
//! probing).

use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

/// The file, in the state dir beside [`crate::config::LAST_GOOD_FILE`], that holds the
/// trial in progress (JSON, 0600: both configs may hold the cluster secret).
pub const TRIAL_FILE: &str = "config-trial.json";

/// Default time a trial config stays in force unconfirmed.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The reachability probe's period (`--rollback-unless-reachable`).
pub const PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// The reachability probe's connect timeout.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Failed connects in a row that roll a trial back, unless asked otherwise.
pub const DEFAULT_FAILURE_THRESHOLD: u32 = 3;

/// Longest trial: a forgotten trial should not outlive a working day.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// `--rollback-unless-reachable`: a TCP connect to `endpoint` every `interval`; after
/// `failure_threshold` failures in a row the trial rolls back at once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReachabilityProbe {
    /// `host:port`.
    pub endpoint: String,
    /// Between two connects.
    #[serde(with = "crate::config::duration")]
    pub interval: Duration,
    /// Connect timeout.
    #[serde(with = "crate::config::duration")]
    pub timeout: Duration,
    /// Failures in a row that roll the trial back.
    pub failure_threshold: u32,
}

/// A trial in progress.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConfigTrial {
    /// The text of the config before the trial (what a rollback goes back to).
    pub previous: String,
    /// Its version (`version_of`).
    pub previous_version: String,
    /// The text of the config on trial.
    pub config: String,
    /// Its version.
    pub version: String,
    /// When the trial began.
    #[serde(with = "unix_millis")]
    pub started: SystemTime,
    /// When it rolls back unless confirmed.
    #[serde(with = "unix_millis")]
    pub deadline: SystemTime,
    /// The reachability probe, if asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe: Option<ReachabilityProbe>,
}

/// What to do with a trial now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Keep the trial config in force; look again by `until` at the latest.
    Keep {
        /// The deadline.
        until: SystemTime,
    },
    /// Go back to the previous config.
    RollBack(RollbackReason),
}

/// Why a trial was rolled back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RollbackReason {
    /// The deadline passed without a confirmation.
    Expired {
        /// The deadline.
        deadline: SystemTime,
    },
    /// The reachability probe failed its threshold.
    Unreachable {
        /// The probed endpoint.
        endpoint: String,
        /// Failures in a row.
        failures: u32,
        /// The latest failure.
        error: String,
    },
    /// The trial file could not be read at start: the earlier config is the safe one.
    Unreadable(String),
}

impl std::fmt::Display for RollbackReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Expired { deadline } => write!(
                f,
                "not confirmed by its deadline {}",
                humantime::format_rfc3339_millis(*deadline)
            ),
            Self::Unreachable {
                endpoint,
                failures,
                error,
            } => write!(
                f,
                "{endpoint} unreachable {failures} time(s) in a row (last: {error})"
            ),
            Self::Unreadable(e) => write!(f, "the trial file is unusable: {e}"),
        }
    }
}

impl ConfigTrial {
    /// A trial of `config` over `previous`, from `now` for `timeout`.
    #[must_use]
    pub fn new(
        previous: String,
        config: String,
        now: SystemTime,
        timeout: Duration,
        probe: Option<ReachabilityProbe>,
    ) -> Self {
        // Whole milliseconds, as in the trial file: the trial read back at a restart is
        // the same trial.
        let since = now
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        let now = SystemTime::UNIX_EPOCH
            + Duration::from_millis(u64::try_from(since.as_millis()).unwrap_or(u64::MAX));
        Self {
            previous_version: super::version_of(&previous),
            version: super::version_of(&config),
            previous,
            config,
            started: now,
            deadline: now + timeout,
            probe,
        }
    }

    /// The decision at `now`, given the reachability probe's failures in a row (and
    /// the latest failure's text): roll back when the deadline passed or the probe
    /// reached its threshold, else keep.
    #[must_use]
    pub fn verdict(&self, now: SystemTime, probe_failures: u32, last_error: &str) -> Verdict {
        if now >= self.deadline {
            return Verdict::RollBack(RollbackReason::Expired {
                deadline: self.deadline,
            });
        }
        if let Some(p) = &self.probe {
            if probe_failures >= p.failure_threshold.max(1) {
                return Verdict::RollBack(RollbackReason::Unreachable {
                    endpoint: p.endpoint.clone(),
                    failures: probe_failures,
                    error: last_error.to_owned(),
                });
            }
        }
        Verdict::Keep {
            until: self.deadline,
        }
    }

    /// The time left at `now` (zero when past the deadline).
    #[must_use]
    pub fn remaining(&self, now: SystemTime) -> Duration {
        self.deadline.duration_since(now).unwrap_or_default()
    }

    /// The JSON of the trial file.
    ///
    /// # Errors
    /// Never in practice (plain strings and numbers).
    pub fn to_json(&self) -> serde_json::Result<Vec<u8>> {
        serde_json::to_vec_pretty(self)
    }

    /// Parses the trial file.
    ///
    /// # Errors
    /// Not a trial.
    pub fn from_json(bytes: &[u8]) -> serde_json::Result<Self> {
        serde_json::from_slice(bytes)
    }
}

/// A checked trial timeout: more than zero, at most [`MAX_TIMEOUT`].
///
/// # Errors
/// The reason, for the operator.
pub fn check_timeout(timeout: Duration) -> Result<Duration, String> {
    if timeout.is_zero() {
        return Err("the trial timeout must be more than 0".to_owned());
    }
    if timeout > MAX_TIMEOUT {
        return Err(format!(
            "the trial timeout {} is over the {} limit",
            humantime::format_duration(timeout),
            humantime::format_duration(MAX_TIMEOUT)
        ));
    }
    Ok(timeout)
}

/// Milliseconds since the Unix epoch, the format of the trial file's times.
mod unix_millis {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use serde::{Deserialize as _, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        let ms = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis();
        s.serialize_u64(u64::try_from(ms).unwrap_or(u64::MAX))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SystemTime, D::Error> {
        Ok(UNIX_EPOCH + Duration::from_millis(u64::deserialize(d)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_800_000_000;

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(T0 + secs)
    }

    fn probe(threshold: u32) -> ReachabilityProbe {
        ReachabilityProbe {
            endpoint: "192.0.2.1:22".into(),
            interval: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            failure_threshold: threshold,
        }
    }

    #[test]
    fn a_trial_is_kept_until_its_deadline_then_rolls_back() {
        let t = ConfigTrial::new("a".into(), "b".into(), at(0), Duration::from_secs(15), None);
        assert_eq!(t.deadline, at(15));
        assert_eq!(t.verdict(at(0), 0, ""), Verdict::Keep { until: at(15) });
        assert_eq!(t.verdict(at(14), 99, ""), Verdict::Keep { until: at(15) });
        assert_eq!(t.remaining(at(10)), Duration::from_secs(5));
        let v = t.verdict(at(15), 0, "");
        assert_eq!(
            v,
            Verdict::RollBack(RollbackReason::Expired { deadline: at(15) })
        );
        assert_eq!(t.remaining(at(20)), Duration::ZERO);
        let Verdict::RollBack(r) = v else { panic!() };
        assert_eq!(
            r.to_string(),
            "not confirmed by its deadline 2027-01-15T08:00:15.000Z"
        );
    }

    #[test]
    fn an_unreachable_probe_rolls_back_at_its_threshold_before_the_deadline() {
        let t = ConfigTrial::new(
            "a".into(),
            "b".into(),
            at(0),
            Duration::from_secs(60),
            Some(probe(3)),
        );
        assert!(matches!(
            t.verdict(at(5), 2, "refused"),
            Verdict::Keep { .. }
        ));
        let Verdict::RollBack(r) = t.verdict(at(5), 3, "connection refused") else {
            panic!("threshold reached but kept");
        };
        assert_eq!(
            r.to_string(),
            "192.0.2.1:22 unreachable 3 time(s) in a row (last: connection refused)"
        );
        // A threshold of 0 still needs one failure.
        let t0 = ConfigTrial {
            probe: Some(probe(0)),
            ..t
        };
        assert!(matches!(t0.verdict(at(5), 0, ""), Verdict::Keep { .. }));
        assert!(matches!(t0.verdict(at(5), 1, ""), Verdict::RollBack(_)));
    }

    #[test]
    fn the_trial_file_round_trips() {
        let t = ConfigTrial::new(
            "a: 1\n".into(),
            "b: 2\n".into(),
            at(0) + Duration::from_millis(250),
            Duration::from_secs(60),
            Some(probe(3)),
        );
        let back = ConfigTrial::from_json(&t.to_json().unwrap()).unwrap();
        assert_eq!(back, t);
        assert!(ConfigTrial::from_json(b"{\"config\": 1}").is_err());
    }

    #[test]
    fn timeouts_are_bounded() {
        assert!(check_timeout(Duration::ZERO).is_err());
        assert_eq!(
            check_timeout(Duration::from_secs(15)),
            Ok(Duration::from_secs(15))
        );
        assert_eq!(
            check_timeout(MAX_TIMEOUT + Duration::from_secs(1)).unwrap_err(),
            "the trial timeout 1day 1s is over the 1day limit"
        );
    }
}
