//! Discovery server addresses: `host:port` or the URL forms Talos accepts
//! (docs/discovery-protocol.md §1).

use std::fmt;

/// Where the client connects, and how.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ServerAddress {
    /// Host name or IP literal (IPv6 without brackets).
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// TLS (`true`) or plaintext HTTP/2 with prior knowledge.
    pub tls: bool,
}

/// An address that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: invalid discovery endpoint {value:?}: {reason}")]
pub struct AddressError {
    /// Configuration field (or `redirect` for a server-sent address).
    pub field: String,
    /// The offending text (an address, not a secret).
    pub value: String,
    /// What is wrong.
    pub reason: &'static str,
}

impl ServerAddress {
    /// Parses `https://h[:p]` (TLS, 443), `grpc://h[:p]` (TLS, 443),
    /// `http://h[:p]` (plaintext, 80) or a bare `host:port`, which uses TLS unless
    /// `insecure`. IPv6 literals go in brackets; a URL must not have a path.
    ///
    /// # Errors
    /// [`AddressError`] naming `field` and the problem.
    pub fn parse(field: &str, value: &str, insecure: bool) -> Result<Self, AddressError> {
        let err = |reason| AddressError {
            field: field.to_owned(),
            value: value.to_owned(),
            reason,
        };
        let (rest, tls, default_port) = if let Some(r) = value.strip_prefix("https://") {
            (r, true, Some(443))
        } else if let Some(r) = value.strip_prefix("grpc://") {
            (r, true, Some(443))
        } else if let Some(r) = value.strip_prefix("http://") {
            (r, false, Some(80))
        } else if value.contains("://") {
            return Err(err("unsupported scheme (use https, http or grpc)"));
        } else {
            (value, !insecure, None)
        };
        let rest = if default_port.is_some() {
            let rest = rest.strip_suffix('/').unwrap_or(rest);
            if rest.contains(['/', '?', '#']) {
                return Err(err("a URL must not have a path, query or fragment"));
            }
            rest
        } else {
            rest
        };
        let (host, port) = split_host_port(rest).map_err(err)?;
        let port = match (port, default_port) {
            (Some(p), _) => p.parse::<u16>().map_err(|_| err("invalid port"))?,
            (None, Some(d)) => d,
            (None, None) => return Err(err("missing port (expected host:port)")),
        };
        if host.is_empty() {
            return Err(err("empty host"));
        }
        Ok(Self {
            host: host.to_owned(),
            port,
            tls,
        })
    }

    /// The `host:port` of a redirect, keeping this address's TLS mode.
    ///
    /// # Errors
    /// [`AddressError`] with field `redirect`.
    pub fn redirected(&self, endpoint: &str) -> Result<Self, AddressError> {
        let mut next = Self::parse("redirect", endpoint, !self.tls)?;
        next.tls = self.tls;
        Ok(next)
    }

    /// `host:port`, with brackets around IPv6 literals.
    #[must_use]
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// URI for the HTTP/2 channel.
    #[must_use]
    pub fn uri(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.authority())
    }
}

impl fmt::Display for ServerAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.uri())
    }
}

fn split_host_port(s: &str) -> Result<(&str, Option<&str>), &'static str> {
    if let Some(rest) = s.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or("unclosed '[' in IPv6 literal")?;
        if host.parse::<std::net::Ipv6Addr>().is_err() {
            return Err("invalid IPv6 literal");
        }
        match after {
            "" => Ok((host, None)),
            p => p
                .strip_prefix(':')
                .map(|p| (host, Some(p)))
                .ok_or("unexpected text after ']'"),
        }
    } else {
        match s.split_once(':') {
            None => Ok((s, None)),
            Some((_, p)) if p.contains(':') => Err("IPv6 literal must be in brackets"),
            Some((h, p)) => Ok((h, Some(p))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str, insecure: bool) -> (String, u16, bool) {
        let a = ServerAddress::parse("endpoint", s, insecure).unwrap();
        (a.host, a.port, a.tls)
    }

    #[test]
    fn forms_of_spec_section_1() {
        assert_eq!(
            ok("https://d.example", false),
            ("d.example".into(), 443, true)
        );
        assert_eq!(
            ok("https://d.example:8443/", false),
            ("d.example".into(), 8443, true)
        );
        assert_eq!(
            ok("http://d.example", false),
            ("d.example".into(), 80, false)
        );
        assert_eq!(
            ok("grpc://d.example:3000", true),
            ("d.example".into(), 3000, true)
        );
        assert_eq!(
            ok("d.example:3000", false),
            ("d.example".into(), 3000, true)
        );
        assert_eq!(
            ok("127.0.0.1:3000", true),
            ("127.0.0.1".into(), 3000, false)
        );
        assert_eq!(ok("[::1]:3000", true), ("::1".into(), 3000, false));
        assert_eq!(
            ok("https://[2001:db8::1]", false),
            ("2001:db8::1".into(), 443, true)
        );
    }

    #[test]
    fn rejects_with_field_and_reason() {
        let cases = [
            ("d.example", "missing port (expected host:port)"),
            (
                "https://d.example/v1",
                "a URL must not have a path, query or fragment",
            ),
            (
                "ftp://d.example",
                "unsupported scheme (use https, http or grpc)",
            ),
            ("::1:3000", "IPv6 literal must be in brackets"),
            ("[::1:3000", "unclosed '[' in IPv6 literal"),
            ("d.example:99999", "invalid port"),
            (":3000", "empty host"),
        ];
        for (input, reason) in cases {
            let e = ServerAddress::parse("discovery.endpoint", input, false).unwrap_err();
            assert_eq!(e.reason, reason, "{input}");
            assert!(e.to_string().starts_with("discovery.endpoint: "));
        }
    }

    #[test]
    fn uri_and_redirect_keep_mode() {
        let a = ServerAddress::parse("e", "http://[::1]:3000", false).unwrap();
        assert_eq!(a.uri(), "http://[::1]:3000");
        let r = a.redirected("other.example:4000").unwrap();
        assert_eq!(r.uri(), "http://other.example:4000");
        let t = ServerAddress::parse("e", "https://a.example", false).unwrap();
        assert_eq!(
            t.redirected("b.example:443").unwrap().uri(),
            "https://b.example:443"
        );
        assert_eq!(t.redirected("b.example").unwrap_err().field, "redirect");
    }
}
