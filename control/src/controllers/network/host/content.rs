//! What the host files say: the bodies wirespan writes and the parsers that read the
//! settings in force back (pure functions).

use std::{net::IpAddr, path::PathBuf};

use crate::resources::network::{ResolverSpecSpec, ResolverStatusSpec};

/// `/etc/hostname`: the short host name.
#[must_use]
pub fn etc_hostname(hostname: &str) -> String {
    format!("{hostname}\n")
}

/// A resolv.conf wirespan owns (no systemd-resolved).
#[must_use]
pub fn resolv_conf(spec: &ResolverSpecSpec) -> String {
    let mut s = String::new();
    for ip in &spec.dns_servers {
        s.push_str(&format!("nameserver {ip}\n"));
    }
    if !spec.search_domains.is_empty() {
        s.push_str(&format!("search {}\n", spec.search_domains.join(" ")));
    }
    s
}

/// The systemd-resolved drop-in: the global servers and domains. The empty
/// assignments first reset what resolved.conf lists (list settings accumulate).
#[must_use]
pub fn resolved_dropin(spec: &ResolverSpecSpec) -> String {
    let servers: Vec<String> = spec.dns_servers.iter().map(ToString::to_string).collect();
    format!(
        "[Resolve]\nDNS=\nDNS={}\nDomains=\nDomains={}\n",
        servers.join(" "),
        spec.search_domains.join(" ")
    )
}

/// The systemd-timesyncd drop-in (reset, then the servers).
#[must_use]
pub fn timesyncd_dropin(servers: &[String]) -> String {
    format!("[Time]\nNTP=\nNTP={}\n", servers.join(" "))
}

/// The chrony sources file.
#[must_use]
pub fn chrony_sources(servers: &[String]) -> String {
    servers
        .iter()
        .map(|s| format!("server {s} iburst\n"))
        .collect()
}

/// Parses `resolv.conf` text: `nameserver` and `search`/`domain` lines.
#[must_use]
pub fn parse_resolv_conf(text: &str) -> ResolverStatusSpec {
    let mut out = ResolverStatusSpec::default();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("nameserver") => {
                if let Some(ip) = words.next().and_then(|w| w.parse::<IpAddr>().ok()) {
                    out.dns_servers.push(ip);
                }
            }
            Some("search" | "domain") => {
                out.search_domains = words.map(str::to_owned).collect();
            }
            _ => {}
        }
    }
    out
}

/// The value of a systemd list setting (`key=`) over a config file and its drop-ins,
/// in the order systemd reads them: assignments accumulate, an empty one resets.
#[must_use]
pub fn systemd_list(files: &[String], section: &str, key: &str) -> Vec<String> {
    let mut out = Vec::new();
    for text in files {
        let mut in_section = false;
        for line in text.lines().map(str::trim) {
            if line.starts_with('[') {
                in_section = line == format!("[{section}]");
                continue;
            }
            if !in_section || line.starts_with('#') || line.starts_with(';') {
                continue;
            }
            if let Some((k, v)) = line.split_once('=') {
                if k.trim() == key {
                    let v = v.trim();
                    if v.is_empty() {
                        out.clear();
                    } else {
                        out.extend(v.split_whitespace().map(str::to_owned));
                    }
                }
            }
        }
    }
    out
}

/// The `server`/`pool` hosts of a chrony config text, and its `sourcedir` dirs.
#[must_use]
pub fn chrony_servers(text: &str) -> (Vec<String>, Vec<PathBuf>) {
    let mut servers = Vec::new();
    let mut dirs = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        match (words.next(), words.next()) {
            (Some("server" | "pool"), Some(host)) => servers.push(host.to_owned()),
            (Some("sourcedir"), Some(dir)) => dirs.push(PathBuf::from(dir)),
            _ => {}
        }
    }
    (servers, dirs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_parses_servers_and_search() {
        let r = parse_resolv_conf(
            "# comment\nnameserver 10.0.0.2\nnameserver fd00::53\nnameserver bogus\nsearch a.example b.example\noptions ndots:5\n",
        );
        assert_eq!(
            r.dns_servers,
            vec![
                "10.0.0.2".parse::<IpAddr>().unwrap(),
                "fd00::53".parse().unwrap()
            ]
        );
        assert_eq!(r.search_domains, vec!["a.example", "b.example"]);
    }

    #[test]
    fn written_resolver_files_read_back_as_the_spec() {
        let spec = ResolverSpecSpec {
            dns_servers: vec!["10.0.0.2".parse().unwrap(), "fd00::53".parse().unwrap()],
            search_domains: vec!["example.com".into()],
            ..ResolverSpecSpec::default()
        };
        let back = parse_resolv_conf(&resolv_conf(&spec));
        assert_eq!(back.dns_servers, spec.dns_servers);
        assert_eq!(back.search_domains, spec.search_domains);
        let main = "[Resolve]\nDNS=1.1.1.1\n#DNS=9.9.9.9\n".to_owned();
        assert_eq!(
            systemd_list(&[main.clone(), resolved_dropin(&spec)], "Resolve", "DNS"),
            ["10.0.0.2", "fd00::53"]
        );
        assert_eq!(systemd_list(&[main], "Resolve", "DNS"), ["1.1.1.1"]);
    }

    #[test]
    fn systemd_lists_accumulate_and_reset_and_chrony_reads_sourcedirs() {
        let files = [
            "[Time]\nNTP=a b\nFallbackNTP=z\n".to_owned(),
            "[Other]\nNTP=x\n[Time]\nNTP=c\n".to_owned(),
        ];
        assert_eq!(systemd_list(&files, "Time", "NTP"), ["a", "b", "c"]);
        let servers = vec!["ntp1".to_owned(), "10.0.0.123".to_owned()];
        let with_ours = [files[0].clone(), timesyncd_dropin(&servers)];
        assert_eq!(systemd_list(&with_ours, "Time", "NTP"), servers);
        let (s, d) = chrony_servers(
            "pool 2.debian.pool.ntp.org iburst\nsourcedir /etc/chrony/sources.d\n# server x\n",
        );
        assert_eq!(s, ["2.debian.pool.ntp.org"]);
        assert_eq!(d, [PathBuf::from("/etc/chrony/sources.d")]);
        assert_eq!(chrony_servers(&chrony_sources(&servers)).0, servers);
    }
}
