//! The HTTP probe's client: URL parsing, proxy choice, one GET per attempt.
//!
//! One GET on a fresh connection, redirects not followed (3xx is success), 200–399
//! success, body never read. The proxy settings come as a [`ProbeEnv`] value that the
//! runner reads from the process environment on every attempt
//! ([`ProbeEnv::from_process`]), so a proxy set after start is used, and tests inject
//! their own without touching the (process-wide) environment. Go's rules: `localhost`
//! and loopback addresses never use a proxy; `user:pass@` in the proxy URL becomes
//! `Proxy-Authorization: Basic`, in the target URL `Authorization: Basic`. HTTPS trusts
//! the system roots (`/etc/ssl/certs/ca-certificates.crt`, or `SSL_CERT_FILE`).

use std::{net::IpAddr, path::PathBuf, sync::Arc};

use base64::Engine as _;
use ipnet::IpNet;
use tokio::{
    io::{AsyncBufReadExt as _, AsyncRead, AsyncWrite, AsyncWriteExt as _, BufReader},
    net::TcpStream,
};

/// Proxy and trust settings of one probe attempt (the process environment's, or a
/// test's).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProbeEnv {
    /// `HTTP_PROXY` (or `http_proxy`).
    pub http_proxy: Option<String>,
    /// `HTTPS_PROXY` (or `https_proxy`).
    pub https_proxy: Option<String>,
    /// `NO_PROXY` (or `no_proxy`).
    pub no_proxy: Option<String>,
    /// `SSL_CERT_FILE`: the trusted roots (default the system bundle).
    pub ssl_cert_file: Option<PathBuf>,
}

/// Where a runner gets its [`ProbeEnv`] from, asked on every attempt.
pub type EnvSource = Arc<dyn Fn() -> ProbeEnv + Send + Sync>;

fn env_either(upper: &str) -> Option<String> {
    std::env::var(upper)
        .ok()
        .filter(|v| !v.is_empty())
        .or_else(|| {
            std::env::var(upper.to_lowercase())
                .ok()
                .filter(|v| !v.is_empty())
        })
}

impl ProbeEnv {
    /// The process environment, read now (upper case wins over lower case).
    #[must_use]
    pub fn from_process() -> Self {
        Self {
            http_proxy: env_either("HTTP_PROXY"),
            https_proxy: env_either("HTTPS_PROXY"),
            no_proxy: env_either("NO_PROXY"),
            ssl_cert_file: std::env::var_os("SSL_CERT_FILE").map(PathBuf::from),
        }
    }

    /// A source that reads the process environment on every attempt.
    #[must_use]
    pub fn process_source() -> EnvSource {
        Arc::new(Self::from_process)
    }
}

/// A parsed `http(s)://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Url {
    /// `http` or `https`.
    pub https: bool,
    /// `user:pass` (still percent-encoded), if given.
    pub userinfo: Option<String>,
    /// Host (IPv6 without brackets).
    pub host: String,
    /// Port.
    pub port: u16,
    /// Path and query (`/` when empty).
    pub path: String,
}

impl Url {
    /// Parses an absolute http/https URL.
    ///
    /// # Errors
    /// What is wrong.
    pub fn parse(url: &str) -> Result<Self, String> {
        crate::config::probe::check_probe_url(url)?;
        let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
        let https = scheme.eq_ignore_ascii_case("https");
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let auth = &rest[..end];
        let mut path = rest[end..].split('#').next().unwrap_or("").to_owned();
        if !path.starts_with('/') {
            path.insert(0, '/');
        }
        let (userinfo, hp) = match auth.rsplit_once('@') {
            Some((u, h)) => (Some(u.to_owned()), h),
            None => (None, auth),
        };
        let (host, port) = if let Some(v6) = hp.strip_prefix('[') {
            let (h, rest) = v6.split_once(']').ok_or("bad IPv6 host")?;
            (h.to_owned(), rest.strip_prefix(':'))
        } else {
            match hp.rsplit_once(':') {
                Some((h, p)) => (h.to_owned(), Some(p)),
                None => (hp.to_owned(), None),
            }
        };
        let port = match port.filter(|p| !p.is_empty()) {
            Some(p) => p.parse::<u16>().map_err(|_| format!("bad port {p:?}"))?,
            None if https => 443,
            None => 80,
        };
        Ok(Self {
            https,
            userinfo,
            host,
            port,
            path,
        })
    }

    /// `host:port`, IPv6 hosts in brackets.
    #[must_use]
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// `Basic …` credentials of the userinfo (percent-decoded), if any.
    #[must_use]
    pub fn basic_auth(&self) -> Option<String> {
        let info = self.userinfo.as_deref()?;
        let (user, pass) = info.split_once(':').unwrap_or((info, ""));
        let plain = format!("{}:{}", percent_decode(user), percent_decode(pass));
        Some(format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(plain)
        ))
    }
}

/// `%XX` escapes decoded (invalid escapes kept as they are).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| char::from(c).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                // Two hex digits: at most 0xff.
                out.push(u8::try_from(h * 16 + l).unwrap_or(b'?'));
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `NO_PROXY` (comma-separated hosts, domain suffixes, IPs, CIDRs, `*`)
/// exempts `host:port`.
#[must_use]
pub fn no_proxy_matches(no_proxy: &str, host: &str, port: u16) -> bool {
    let host = host.to_ascii_lowercase();
    let ip: Option<IpAddr> = host.parse().ok();
    no_proxy
        .split([',', ' '])
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .any(|entry| {
            if entry == "*" {
                return true;
            }
            if let (Some(ip), Ok(net)) = (ip, entry.parse::<IpNet>()) {
                return net.contains(&ip);
            }
            if let (Some(ip), Ok(e)) = (ip, entry.parse::<IpAddr>()) {
                return ip == e;
            }
            let (name, eport) = match entry.rsplit_once(':') {
                Some((n, p)) if !n.contains(':') => (n, p.parse::<u16>().ok()),
                _ => (entry, None),
            };
            if eport.is_some_and(|p| p != port) {
                return false;
            }
            let name = name.to_ascii_lowercase();
            let bare = name.trim_start_matches('.');
            if name.starts_with('.') {
                host.ends_with(&name) || host == bare
            } else {
                host == bare || host.ends_with(&format!(".{bare}"))
            }
        })
}

/// The proxy for `url` under `env`.
///
/// # Errors
/// A proxy setting that is not an `http://` proxy.
pub fn proxy_for(url: &Url, env: &ProbeEnv) -> Result<Option<Url>, String> {
    let host = url.host.to_ascii_lowercase();
    if host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback()) {
        return Ok(None);
    }
    let (var, proxy) = if url.https {
        ("HTTPS_PROXY", &env.https_proxy)
    } else {
        ("HTTP_PROXY", &env.http_proxy)
    };
    let Some(proxy) = proxy.as_deref().filter(|p| !p.is_empty()) else {
        return Ok(None);
    };
    if env
        .no_proxy
        .as_deref()
        .is_some_and(|np| no_proxy_matches(np, &url.host, url.port))
    {
        return Ok(None);
    }
    let with_scheme = if proxy.contains("://") {
        proxy.to_owned()
    } else {
        format!("http://{proxy}")
    };
    let p = Url::parse(&with_scheme).map_err(|e| format!("proxy {var}: {e}"))?;
    if p.https {
        return Err(format!("proxy {var}: only http:// proxies are supported"));
    }
    Ok(Some(p))
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

async fn read_status<S: AsyncRead + Unpin>(stream: S) -> Result<u16, String> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader
        .read_line(&mut line)
        .await
        .map_err(|e| format!("reading response: {e}"))?;
    let mut parts = line.split_whitespace();
    match (
        parts.next(),
        parts.next().and_then(|c| c.parse::<u16>().ok()),
    ) {
        (Some(v), Some(code)) if v.starts_with("HTTP/") => Ok(code),
        _ => Err(format!(
            "malformed response status line {:?}",
            line.trim_end()
        )),
    }
}

fn tls_config(env: &ProbeEnv) -> Result<Arc<rustls::ClientConfig>, String> {
    let path = env
        .ssl_cert_file
        .clone()
        .unwrap_or_else(|| PathBuf::from("/etc/ssl/certs/ca-certificates.crt"));
    let mut roots = rustls::RootCertStore::empty();
    if let Ok(pem) = std::fs::read(&path) {
        for cert in rustls_pemfile::certs(&mut pem.as_slice()).flatten() {
            let _ = roots.add(cert);
        }
    }
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| format!("TLS setup: {e}"))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Arc::new(cfg))
}

/// Sends `CONNECT` for `url` on `stream` and reads the proxy's answer up to the blank
/// line, byte by byte so that no TLS bytes are consumed.
async fn connect_tunnel(stream: &mut dyn Io, url: &Url, proxy: &Url) -> Result<(), String> {
    use tokio::io::AsyncReadExt as _;
    let auth = proxy
        .basic_auth()
        .map(|a| format!("Proxy-Authorization: {a}\r\n"))
        .unwrap_or_default();
    let connect = format!(
        "CONNECT {a} HTTP/1.1\r\nHost: {a}\r\n{auth}\r\n",
        a = url.authority()
    );
    stream
        .write_all(connect.as_bytes())
        .await
        .map_err(|e| format!("proxy CONNECT: {e}"))?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = stream
            .read(&mut byte)
            .await
            .map_err(|e| format!("proxy CONNECT: {e}"))?;
        if n == 0 || head.len() > 16 * 1024 {
            return Err("proxy CONNECT: connection closed".to_owned());
        }
        head.push(byte[0]);
    }
    match read_status(head.as_slice()).await? {
        200 => Ok(()),
        code => Err(format!("proxy CONNECT: status {code}")),
    }
}

/// One GET of `url` (through the proxy `env` names, if any); the status code.
///
/// # Errors
/// Connection, TLS or protocol failures, as text (never with URL credentials).
pub async fn get(url: &Url, env: &ProbeEnv) -> Result<u16, String> {
    let proxy = proxy_for(url, env)?;
    let target = proxy
        .as_ref()
        .map_or_else(|| url.authority(), Url::authority);
    let tcp = TcpStream::connect(target.as_str())
        .await
        .map_err(|e| format!("dial tcp {target}: {e}"))?;
    let mut stream: Box<dyn Io> = Box::new(tcp);
    let mut headers = String::new();
    if let Some(p) = &proxy {
        if url.https {
            connect_tunnel(&mut *stream, url, p).await?;
        } else if let Some(a) = p.basic_auth() {
            headers.push_str(&format!("Proxy-Authorization: {a}\r\n"));
        }
    }
    if let Some(a) = url.basic_auth() {
        headers.push_str(&format!("Authorization: {a}\r\n"));
    }
    if url.https {
        let name = rustls::pki_types::ServerName::try_from(url.host.clone())
            .map_err(|e| format!("TLS server name {:?}: {e}", url.host))?;
        let tls = tokio_rustls::TlsConnector::from(tls_config(env)?)
            .connect(name, stream)
            .await
            .map_err(|e| format!("TLS handshake with {}: {e}", url.authority()))?;
        stream = Box::new(tls);
    }
    // A plain-HTTP request through a proxy names the whole URL (absolute form).
    let request_target = if proxy.is_some() && !url.https {
        format!("http://{}{}", url.authority(), url.path)
    } else {
        url.path.clone()
    };
    let req = format!(
        "GET {request_target} HTTP/1.1\r\nHost: {}\r\nUser-Agent: wirespan-probe\r\nAccept: */*\r\n{headers}Connection: close\r\n\r\n",
        url.authority()
    );
    stream
        .write_all(req.as_bytes())
        .await
        .map_err(|e| format!("sending request: {e}"))?;
    let code = read_status(&mut stream).await?;
    // Body never read; the connection closes on drop.
    drop(stream);
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_no_proxy() {
        let u = Url::parse("https://user:pw@[fd00::1]:8443/health?x=1#frag").unwrap();
        assert_eq!(
            (u.https, u.host.as_str(), u.port, u.path.as_str()),
            (true, "fd00::1", 8443, "/health?x=1")
        );
        assert_eq!(u.userinfo.as_deref(), Some("user:pw"));
        let u = Url::parse("http://example.com").unwrap();
        assert_eq!((u.port, u.path.as_str(), u.userinfo), (80, "/", None));
        assert_eq!(Url::parse("http://example.com:/x").unwrap().port, 80);
        assert!(Url::parse("ftp://x/").is_err());
        assert!(Url::parse("http:///path").is_err());
        for (np, host, port, want) in [
            ("*", "a.example", 80, true),
            ("example.com", "api.example.com", 80, true),
            ("example.com", "example.com", 80, true),
            (".example.com", "example.com", 80, true),
            ("example.com", "badexample.com", 80, false),
            ("10.0.0.0/8", "10.1.2.3", 80, true),
            ("10.0.0.1", "10.0.0.2", 80, false),
            ("example.com:443", "example.com", 80, false),
            ("foo, example.com:443", "example.com", 443, true),
        ] {
            assert_eq!(no_proxy_matches(np, host, port), want, "{np} {host}:{port}");
        }
    }

    #[test]
    fn basic_auth_decodes_percent_escapes() {
        let u = Url::parse("http://us%65r:p%40ss@proxy:3128").unwrap();
        // base64("user:p@ss")
        assert_eq!(u.basic_auth().unwrap(), "Basic dXNlcjpwQHNz");
        let u = Url::parse("http://token@proxy:3128").unwrap();
        assert_eq!(u.basic_auth().unwrap(), "Basic dG9rZW46");
        assert_eq!(percent_decode("a%2"), "a%2");
        assert_eq!(percent_decode("%zz%41"), "%zzA");
    }

    #[test]
    fn proxy_choice_comes_from_the_given_environment() {
        let env = ProbeEnv {
            http_proxy: Some("127.0.0.9:3128".into()),
            https_proxy: Some("http://u:p@proxy.example:8080".into()),
            no_proxy: Some(".internal".into()),
            ssl_cert_file: None,
        };
        let plain = Url::parse("http://example.com/").unwrap();
        assert_eq!(
            proxy_for(&plain, &env).unwrap().unwrap().authority(),
            "127.0.0.9:3128"
        );
        let tls = Url::parse("https://example.com/").unwrap();
        let p = proxy_for(&tls, &env).unwrap().unwrap();
        assert_eq!(
            (p.authority().as_str(), p.userinfo.as_deref()),
            ("proxy.example:8080", Some("u:p"))
        );
        let exempt = Url::parse("http://api.internal/").unwrap();
        assert_eq!(proxy_for(&exempt, &env).unwrap(), None);
        let local = Url::parse("http://127.0.0.1:8080/").unwrap();
        assert_eq!(proxy_for(&local, &env).unwrap(), None);
        assert_eq!(proxy_for(&plain, &ProbeEnv::default()).unwrap(), None);
        let bad = ProbeEnv {
            http_proxy: Some("https://proxy:3128".into()),
            ..ProbeEnv::default()
        };
        assert!(proxy_for(&plain, &bad)
            .unwrap_err()
            .contains("only http:// proxies"));
    }
}
