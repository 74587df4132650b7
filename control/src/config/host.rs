//! Host documents: `HostnameConfig`, `ResolverConfig`, `TimeServerConfig`. Each is
//! opt-in: without it the node only observes (`HostnameStatus`, `ResolverStatus`,
//! `TimeServerStatus`); with it the network config controller writes
//! `network-config/{Hostname,Resolver,TimeServer}Spec configuration/<id>` and the host
//! spec controllers apply them (`docs/runtime.md` §4.8).
//!
//! ```yaml
//! apiVersion: v1alpha1
//! kind: HostnameConfig
//! hostname: node1.example.com   # short name, or a name with its domain
//! writeEtcHostname: false       # also write /etc/hostname (the node manages the host)
//! ---
//! apiVersion: v1alpha1
//! kind: ResolverConfig
//! nameservers: [10.0.0.2, fd00::53]
//! searchDomains: [example.com]
//! ---
//! apiVersion: v1alpha1
//! kind: TimeServerConfig
//! servers: [ntp1.example.com, 10.0.0.123]
//! ```

use std::net::IpAddr;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{ConfigDocument, FieldError};

/// Longest host name label the kernel takes (`__NEW_UTS_LEN`).
pub const MAX_UTS_NAME: usize = 64;
/// Most name servers a `ResolverConfig` lists (glibc reads three from resolv.conf;
/// systemd-resolved more, but a list the fallback file cannot hold would behave
/// differently on the two backends).
pub const MAX_NAMESERVERS: usize = 3;
/// Most search domains (the limit of older glibc versions, still the safe one).
pub const MAX_SEARCH_DOMAINS: usize = 6;
/// Most time servers a `TimeServerConfig` lists.
pub const MAX_TIME_SERVERS: usize = 16;

/// Why `name` is not a DNS name (RFC 1123 labels: letters, digits and `-`, 1–63
/// bytes each, not starting or ending with `-`; at most 253 bytes in all), if it is not.
#[must_use]
pub fn dns_name_problem(name: &str) -> Option<String> {
    if name.is_empty() {
        return Some("is empty".into());
    }
    if name.len() > 253 {
        return Some(format!("{name:?} is longer than 253 bytes"));
    }
    for label in name.split('.') {
        if label.is_empty() || label.len() > 63 {
            return Some(format!(
                "{name:?} has a label that is empty or longer than 63 bytes"
            ));
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Some(format!("{name:?} has a label starting or ending with '-'"));
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return Some(format!(
                "{name:?} may contain only letters, digits, '-' and '.'"
            ));
        }
    }
    None
}

/// The node's host name. How it is applied, and what comes back when the document is
/// removed: `docs/runtime.md` §4.8.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HostnameConfig {
    /// Host name: a short name (`node1`) or one with its domain
    /// (`node1.example.com`); the first label becomes the kernel's host name, the rest
    /// its domain name.
    ///
    /// Valid: a DNS name (labels of letters, digits and `-`, 1–63 bytes each, not
    /// starting or ending with `-`); the first label and the domain each at most 64
    /// bytes.
    pub hostname: String,
    /// Also write `/etc/hostname`, so the name survives a reboot. Set it only when the
    /// node manages the host; the original file is kept and put back when the
    /// document goes away.
    #[serde(default)]
    pub write_etc_hostname: bool,
}

impl HostnameConfig {
    /// The short host name and the domain name (empty without one).
    #[must_use]
    pub fn split(&self) -> (String, String) {
        match self.hostname.split_once('.') {
            Some((h, d)) => (h.to_owned(), d.to_owned()),
            None => (self.hostname.clone(), String::new()),
        }
    }
}

impl ConfigDocument for HostnameConfig {
    const KIND: &'static str = "HostnameConfig";
    const SINGLETON: bool = true;
    fn validate(&self) -> Vec<FieldError> {
        let mut errs = Vec::new();
        if let Some(p) = dns_name_problem(&self.hostname) {
            errs.push(FieldError::new("hostname", p));
        } else {
            let (h, d) = self.split();
            if h.len() > MAX_UTS_NAME || d.len() > MAX_UTS_NAME {
                errs.push(FieldError::new(
                    "hostname",
                    format!(
                        "{:?}: the host name and the domain may each be at most {MAX_UTS_NAME} bytes",
                        self.hostname
                    ),
                ));
            }
        }
        errs
    }
}

/// The DNS resolvers the node uses: through systemd-resolved when it runs, else in an
/// `/etc/resolv.conf` wirespan owns (`docs/runtime.md` §4.8).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ResolverConfig {
    /// Name servers, in the order they are tried.
    ///
    /// Valid: 1–3 unicast addresses, no duplicates.
    pub nameservers: Vec<IpAddr>,
    /// Search domains, in order.
    ///
    /// Valid: at most 6 DNS names.
    #[serde(default)]
    pub search_domains: Vec<String>,
}

impl ConfigDocument for ResolverConfig {
    const KIND: &'static str = "ResolverConfig";
    const SINGLETON: bool = true;
    fn validate(&self) -> Vec<FieldError> {
        let mut errs = Vec::new();
        if self.nameservers.is_empty() {
            errs.push(FieldError::new("nameservers", "at least one is required"));
        }
        if self.nameservers.len() > MAX_NAMESERVERS {
            errs.push(FieldError::new(
                "nameservers",
                format!(
                    "{} listed; at most {MAX_NAMESERVERS}",
                    self.nameservers.len()
                ),
            ));
        }
        for (i, ip) in self.nameservers.iter().enumerate() {
            let field = format!("nameservers[{i}]");
            if ip.is_unspecified() || ip.is_multicast() {
                errs.push(FieldError::new(
                    field,
                    format!("{ip} is not a unicast address"),
                ));
            } else if self.nameservers[..i].contains(ip) {
                errs.push(FieldError::new(field, format!("{ip} is listed twice")));
            }
        }
        if self.search_domains.len() > MAX_SEARCH_DOMAINS {
            errs.push(FieldError::new(
                "searchDomains",
                format!(
                    "{} listed; at most {MAX_SEARCH_DOMAINS}",
                    self.search_domains.len()
                ),
            ));
        }
        for (i, d) in self.search_domains.iter().enumerate() {
            if let Some(p) = dns_name_problem(d) {
                errs.push(FieldError::new(format!("searchDomains[{i}]"), p));
            }
        }
        errs
    }
}

/// The NTP servers of the host's time service: a drop-in for chrony or
/// systemd-timesyncd, whichever is installed (`docs/runtime.md` §4.8).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TimeServerConfig {
    /// Servers: host names or addresses, in order.
    ///
    /// Valid: 1–16 entries, each a DNS name or an IP address, no duplicates.
    pub servers: Vec<String>,
}

impl ConfigDocument for TimeServerConfig {
    const KIND: &'static str = "TimeServerConfig";
    const SINGLETON: bool = true;
    fn validate(&self) -> Vec<FieldError> {
        let mut errs = Vec::new();
        if self.servers.is_empty() {
            errs.push(FieldError::new("servers", "at least one is required"));
        }
        if self.servers.len() > MAX_TIME_SERVERS {
            errs.push(FieldError::new(
                "servers",
                format!("{} listed; at most {MAX_TIME_SERVERS}", self.servers.len()),
            ));
        }
        for (i, s) in self.servers.iter().enumerate() {
            let field = format!("servers[{i}]");
            if s.parse::<IpAddr>().is_err() {
                if let Some(p) = dns_name_problem(s) {
                    errs.push(FieldError::new(field, p));
                    continue;
                }
            }
            if self.servers[..i].contains(s) {
                errs.push(FieldError::new(field, format!("{s:?} is listed twice")));
            }
        }
        errs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse;

    fn errors(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    #[test]
    fn valid_documents_parse_and_split_the_domain() {
        let cfg = parse(
            "apiVersion: v1alpha1\nkind: HostnameConfig\nhostname: node1.example.com\n---\n\
             apiVersion: v1alpha1\nkind: ResolverConfig\nnameservers: [10.0.0.2, 'fd00::53']\nsearchDomains: [example.com]\n---\n\
             apiVersion: v1alpha1\nkind: TimeServerConfig\nservers: [ntp.example.com, 10.0.0.123]\n",
        )
        .unwrap();
        let h = cfg.singleton::<HostnameConfig>().unwrap();
        assert_eq!(h.split(), ("node1".into(), "example.com".into()));
        assert!(!h.write_etc_hostname);
        assert_eq!(
            cfg.singleton::<ResolverConfig>().unwrap().nameservers.len(),
            2
        );
        assert_eq!(
            cfg.singleton::<TimeServerConfig>().unwrap().servers.len(),
            2
        );
    }

    #[test]
    fn errors_name_the_field() {
        let e = errors("apiVersion: v1alpha1\nkind: HostnameConfig\nhostname: -bad_name\n");
        assert!(
            e.contains("(HostnameConfig): hostname: \"-bad_name\""),
            "{e}"
        );
        let long = "a".repeat(65);
        let e = errors(&format!(
            "apiVersion: v1alpha1\nkind: HostnameConfig\nhostname: {long}.example\n"
        ));
        assert!(e.contains("hostname: ") && e.contains("label"), "{e}");
        let e = errors(
            "apiVersion: v1alpha1\nkind: ResolverConfig\nnameservers: [0.0.0.0, 10.0.0.1, 10.0.0.1]\nsearchDomains: ['a..b']\n",
        );
        assert!(
            e.contains("nameservers[0]: 0.0.0.0 is not a unicast address"),
            "{e}"
        );
        assert!(
            e.contains("nameservers[2]: 10.0.0.1 is listed twice"),
            "{e}"
        );
        assert!(e.contains("searchDomains[0]: \"a..b\" has a label"), "{e}");
        let e = errors("apiVersion: v1alpha1\nkind: ResolverConfig\nnameservers: []\n");
        assert!(e.contains("nameservers: at least one is required"), "{e}");
        let e = errors(
            "apiVersion: v1alpha1\nkind: ResolverConfig\nnameservers: [1.1.1.1, 1.0.0.1, 8.8.8.8, 8.8.4.4]\n",
        );
        assert!(e.contains("nameservers: 4 listed; at most 3"), "{e}");
        let e = errors(
            "apiVersion: v1alpha1\nkind: TimeServerConfig\nservers: ['ntp example', ntp1, ntp1]\n",
        );
        assert!(
            e.contains("servers[0]: \"ntp example\" may contain only"),
            "{e}"
        );
        assert!(e.contains("servers[2]: \"ntp1\" is listed twice"), "{e}");
        let e = errors(
            "apiVersion: v1alpha1\nkind: TimeServerConfig\nservers: [a]\n---\napiVersion: v1alpha1\nkind: TimeServerConfig\nservers: [b]\n",
        );
        assert!(e.contains("TimeServerConfig"), "{e}");
    }
}
