//! `TCPProbeConfig` and `HTTPProbeConfig` documents (`docs/runtime.md` §7.1).
//!
//! ```yaml
//! apiVersion: v1alpha1
//! kind: HTTPProbeConfig
//! name: proxy-check
//! url: https://example.com/health   # http or https, absolute, non-empty host;
//!                                   # IPv6 hosts in brackets: http://[fd00::1]:8080/
//! interval: 30s                     # default 1s
//! timeout: 5s                       # default 10s
//! failureThreshold: 3               # default 0 (the first failure is reported)
//! ---
//! apiVersion: v1alpha1
//! kind: TCPProbeConfig
//! name: api
//! endpoint: 10.0.0.1:6443          # IPv6: "[fd00::1]:6443"
//! ```
//!
//! Two probe documents with the same target (`tcp:<endpoint>`, `http:<URL without
//! credentials>`) would be one probe; the config is rejected instead.

use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{ConfigDocument, FieldError};

/// Default probe interval.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);
/// Default probe timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Parses a duration field, with the spec's message for negative values
/// (`<what> cannot be negative: <d>`).
fn duration_field(
    field: &str,
    what: &str,
    text: Option<&str>,
    errs: &mut Vec<FieldError>,
) -> Option<Duration> {
    let t = text?.trim();
    if t.starts_with('-') {
        errs.push(FieldError::new(
            field,
            format!("{what} cannot be negative: {t}"),
        ));
        return None;
    }
    match super::duration::parse(t) {
        Ok(d) => Some(d),
        Err(e) => {
            errs.push(FieldError::new(field, e));
            None
        }
    }
}

/// Interval and timeout of a valid probe document (defaults applied).
fn durations(interval: Option<&str>, timeout: Option<&str>) -> (Duration, Duration) {
    let mut ignored = Vec::new();
    (
        or_default(
            duration_field("", "", interval, &mut ignored),
            DEFAULT_INTERVAL,
        ),
        or_default(
            duration_field("", "", timeout, &mut ignored),
            DEFAULT_TIMEOUT,
        ),
    )
}

fn common(name: &str, failure_threshold: i64, interval: Option<&str>, errs: &mut Vec<FieldError>) {
    duration_field("interval", "probe interval", interval, errs);
    if name.is_empty() {
        errs.push(FieldError::new("name", "probe name is required"));
    }
    if failure_threshold < 0 {
        errs.push(FieldError::new(
            "failureThreshold",
            format!("probe failure threshold cannot be negative: {failure_threshold}"),
        ));
    } else if u32::try_from(failure_threshold).is_err() {
        errs.push(FieldError::new("failureThreshold", "is too large"));
    }
}

/// A TCP connect probe; its result is in `wirespan get probestatuses`. Its target,
/// which two documents must not share, is `tcp:<endpoint>`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TcpProbeConfig {
    /// Name of the probe (not part of its target).
    ///
    /// Valid: non-empty.
    // Absent reads as empty, which validation rejects: required all the same.
    #[serde(default)]
    #[schemars(extend("x-required" = true))]
    pub name: String,
    /// `host:port` to connect to; IPv6 in brackets (`[fd00::1]:6443`).
    ///
    /// Valid: a non-empty host and a port 1–65535; an IPv6 host in brackets.
    // Absent reads as empty, which validation rejects: required all the same.
    #[serde(default)]
    #[schemars(extend("x-required" = true))]
    pub endpoint: String,
    /// Time between probes; `0` means the default.
    ///
    /// Valid: a duration, not negative.
    #[serde(default)]
    #[schemars(with = "Option<super::schema::DurationText>", extend("default" = "1s"))]
    pub interval: Option<String>,
    /// Connect timeout; `0` means the default.
    ///
    /// Valid: a duration, not negative.
    #[serde(default)]
    #[schemars(with = "Option<super::schema::DurationText>", extend("default" = "10s"))]
    pub timeout: Option<String>,
    /// Consecutive failures before the probe reports failure (0 and 1: the first
    /// failure is reported).
    ///
    /// Valid: 0–4294967295.
    #[serde(default)]
    pub failure_threshold: i64,
}

impl TcpProbeConfig {
    /// Interval and timeout with defaults (valid documents only).
    #[must_use]
    pub fn durations(&self) -> (Duration, Duration) {
        durations(self.interval.as_deref(), self.timeout.as_deref())
    }
}

/// An IPv6 address as `host` of `host:port` without brackets (`fd00::1:80`): the
/// error, with the bracketed form to write.
fn unbracketed_v6(endpoint: &str) -> Option<String> {
    let (host, port) = endpoint.rsplit_once(':')?;
    if host.starts_with('[') || !host.contains(':') {
        return None;
    }
    Some(format!(
        "TCP probe endpoint {endpoint:?} has an IPv6 host without brackets; write \"[{host}]:{port}\""
    ))
}

impl ConfigDocument for TcpProbeConfig {
    const KIND: &'static str = "TCPProbeConfig";
    const SINGLETON: bool = false;
    fn name(&self) -> Option<&str> {
        Some(&self.name)
    }
    fn merge_key(&self) -> Option<(&'static str, String)> {
        // The probe id the probe config controller writes the spec under.
        Some(("target", tcp_probe_key(&self.endpoint)))
    }
    fn validate(&self) -> Vec<FieldError> {
        let mut errs = Vec::new();
        common(
            &self.name,
            self.failure_threshold,
            self.interval.as_deref(),
            &mut errs,
        );
        duration_field(
            "timeout",
            "TCP probe timeout",
            self.timeout.as_deref(),
            &mut errs,
        );
        if self.endpoint.is_empty() {
            errs.push(FieldError::new(
                "endpoint",
                "TCP probe endpoint is required",
            ));
        } else if let Some(e) = unbracketed_v6(&self.endpoint) {
            errs.push(FieldError::new("endpoint", e));
        } else if !self
            .endpoint
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p != 0))
        {
            errs.push(FieldError::new(
                "endpoint",
                format!(
                    "TCP probe endpoint must be host:port, got {:?}",
                    self.endpoint
                ),
            ));
        }
        errs
    }
}

/// An HTTP GET probe; its result is in `wirespan get probestatuses`. Its target,
/// which two documents must not share, is `http:<URL without credentials>`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HttpProbeConfig {
    /// Name of the probe (not part of its target).
    ///
    /// Valid: non-empty.
    // Absent reads as empty, which validation rejects: required all the same.
    #[serde(default)]
    #[schemars(extend("x-required" = true))]
    pub name: String,
    /// URL to GET.
    ///
    /// Valid: an absolute `http://` or `https://` URL with a non-empty host (IPv6 in
    /// brackets: `http://[fd00::1]:8080/`) and, if given, a port 1–65535.
    // Absent reads as empty, which validation rejects: required all the same.
    #[serde(default)]
    #[schemars(extend("x-required" = true))]
    pub url: String,
    /// Time between probes; `0` means the default.
    ///
    /// Valid: a duration, not negative.
    #[serde(default)]
    #[schemars(with = "Option<super::schema::DurationText>", extend("default" = "1s"))]
    pub interval: Option<String>,
    /// Request timeout; `0` means the default.
    ///
    /// Valid: a duration, not negative.
    #[serde(default)]
    #[schemars(with = "Option<super::schema::DurationText>", extend("default" = "10s"))]
    pub timeout: Option<String>,
    /// Consecutive failures before the probe reports failure (0 and 1: the first
    /// failure is reported).
    ///
    /// Valid: 0–4294967295.
    #[serde(default)]
    pub failure_threshold: i64,
}

/// Checks an HTTP probe URL; the message is the spec's.
///
/// # Errors
/// The problem.
pub fn check_probe_url(url: &str) -> Result<(), String> {
    if url.is_empty() {
        return Err("HTTP probe URL is required".to_owned());
    }
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(
            "HTTP probe URL must be an absolute http or https URL with a non-empty host".to_owned(),
        );
    };
    let scheme_l = scheme.to_ascii_lowercase();
    if scheme_l != "http" && scheme_l != "https" {
        return Err(format!(
            "HTTP probe URL scheme must be http or https, got {scheme:?}"
        ));
    }
    let auth = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let host_port = auth.rsplit_once('@').map_or(auth, |(_, h)| h);
    let (host, port) = if let Some(v6) = host_port.strip_prefix('[') {
        let Some((host, after)) = v6.split_once(']') else {
            return Err(format!(
                "HTTP probe URL host {host_port:?} has no closing ']'"
            ));
        };
        if host.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(format!(
                "HTTP probe URL host [{host}] is not an IPv6 address"
            ));
        }
        match after.strip_prefix(':') {
            Some(p) => (host, Some(p)),
            None if after.is_empty() => (host, None),
            None => {
                return Err(format!(
                    "HTTP probe URL has {after:?} after the IPv6 host; want [address]:port"
                ))
            }
        }
    } else if host_port.matches(':').count() > 1 {
        // `http://fd00::1/` cannot be told from a host and a port: the URL syntax
        // (RFC 3986) puts IPv6 addresses in brackets.
        return Err(format!(
            "HTTP probe URL host {host_port:?} is an IPv6 address without brackets; write {scheme}://[{host_port}]/ (a port goes after the bracket: [{host_port}]:8080)"
        ));
    } else {
        match host_port.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (host_port, None),
        }
    };
    if host.is_empty() {
        return Err(
            "HTTP probe URL must be an absolute http or https URL with a non-empty host".to_owned(),
        );
    }
    if let Some(p) = port.filter(|p| !p.is_empty()) {
        if !p.parse::<u16>().is_ok_and(|p| p != 0) {
            return Err(format!(
                "HTTP probe URL port {p:?} is not a port number (1–65535)"
            ));
        }
    }
    Ok(())
}

impl HttpProbeConfig {
    /// Interval and timeout with defaults (valid documents only).
    #[must_use]
    pub fn durations(&self) -> (Duration, Duration) {
        durations(self.interval.as_deref(), self.timeout.as_deref())
    }
}

impl ConfigDocument for HttpProbeConfig {
    const KIND: &'static str = "HTTPProbeConfig";
    const SINGLETON: bool = false;
    fn name(&self) -> Option<&str> {
        Some(&self.name)
    }
    fn merge_key(&self) -> Option<(&'static str, String)> {
        Some(("target", http_probe_key(&self.url)))
    }
    fn validate(&self) -> Vec<FieldError> {
        let mut errs = Vec::new();
        common(
            &self.name,
            self.failure_threshold,
            self.interval.as_deref(),
            &mut errs,
        );
        duration_field(
            "timeout",
            "HTTP probe timeout",
            self.timeout.as_deref(),
            &mut errs,
        );
        if let Err(e) = check_probe_url(&self.url) {
            errs.push(FieldError::new("url", e));
        }
        errs
    }
}

/// `d` unless zero or absent, else `default`.
#[must_use]
pub fn or_default(d: Option<Duration>, default: Duration) -> Duration {
    d.filter(|d| !d.is_zero()).unwrap_or(default)
}

/// `scheme://user:pass@host/…` without `user:pass@`.
#[must_use]
pub fn strip_userinfo(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let auth_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..auth_end].rfind('@') {
        Some(at) => format!("{scheme}://{}", &rest[at + 1..]),
        None => url.to_owned(),
    }
}

/// The id a TCP probe's spec is written under: its target.
#[must_use]
pub fn tcp_probe_key(endpoint: &str) -> String {
    format!("tcp:{endpoint}")
}

/// The id an HTTP probe's spec is written under: its URL without credentials.
#[must_use]
pub fn http_probe_key(url: &str) -> String {
    format!("http:{}", strip_userinfo(url))
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_probe_error_is_reported_with_document_and_field() {
        let text = "apiVersion: v1alpha1\nkind: HTTPProbeConfig\nname: \"\"\nurl: gopher://x\ntimeout: -1s\ninterval: -2s\nfailureThreshold: -3\n---\n\
                    apiVersion: v1alpha1\nkind: TCPProbeConfig\nname: t\n---\n\
                    apiVersion: v1alpha1\nkind: HTTPProbeConfig\nname: h\nurl: http:///x\n";
        let err = crate::config::parse(text).unwrap_err().to_string();
        for want in [
            "document 1 (HTTPProbeConfig \"\")",
            "name: probe name is required",
            "url: HTTP probe URL scheme must be http or https, got \"gopher\"",
            "timeout: HTTP probe timeout cannot be negative: -1s",
            "interval: probe interval cannot be negative: -2s",
            "failureThreshold: probe failure threshold cannot be negative: -3",
            "document 2 (TCPProbeConfig \"t\"): endpoint: TCP probe endpoint is required",
            "document 3 (HTTPProbeConfig \"h\"): url: HTTP probe URL must be an absolute http or https URL with a non-empty host",
        ] {
            assert!(err.contains(want), "missing {want:?} in {err}");
        }
    }
}
