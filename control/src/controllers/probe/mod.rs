//! Probes (spec §7): `TCPProbeConfig`/`HTTPProbeConfig` documents become
//! `network-config/ProbeSpec configuration/<probe id>`, merged into
//! `network/ProbeSpec <probe id>`, run by [`ProbeController`] (one task per probe)
//! which publishes `network/ProbeStatus <probe id>`.
//!
//! Runner rules: first probe immediately, then every interval; a success resets the
//! failure count and is published; failures are published once the count reaches the
//! threshold (0 and 1: the first). HTTP: one GET per attempt on a fresh connection,
//! redirects not followed (3xx is success), 200–399 success, body never read;
//! `HTTP_PROXY`/`HTTPS_PROXY`/`NO_PROXY` (or lowercase) re-read on every attempt, with
//! Go's rules: `localhost` and loopback addresses never use a proxy. HTTPS trusts the
//! system roots (`/etc/ssl/certs/ca-certificates.crt`, or `SSL_CERT_FILE`).

use std::{collections::HashMap, net::IpAddr, sync::Arc, time::Duration};

use futures::future::BoxFuture;
use ipnet::IpNet;
use tokio::{
    io::{AsyncBufReadExt as _, AsyncRead, AsyncWrite, AsyncWriteExt as _, BufReader},
    net::TcpStream,
    sync::mpsc,
};
use tokio_util::sync::CancellationToken;

use crate::{
    config::probe::{HttpProbeConfig, TcpProbeConfig, DEFAULT_INTERVAL},
    controllers::network::merge::MergeController,
    resources::{
        config::MachineConfig,
        network::{
            ConfigLayer, HttpProbeSpec, ProbeSpec, ProbeSpecSpec, ProbeStatus, ProbeStatusSpec,
            TcpProbeSpec, NS, NS_CONFIG,
        },
    },
    runtime::{
        Controller, ControllerError, ControllerResult, ControllerRuntime, Input, InputKind, Kind,
        Output, Phase, Pointer, RegistrationError, ResourceKind, Runtime,
    },
};

/// Registers the probe config, merge and runner controllers.
///
/// # Errors
/// Registration conflicts.
pub fn register(runtime: &mut Runtime) -> Result<(), RegistrationError> {
    runtime.register(ProbeConfigController)?;
    runtime.register(MergeController::<ProbeSpec>::new())?;
    runtime.register(ProbeController)?;
    Ok(())
}

/// Probe specs of a config's documents (duplicate targets collapse into one probe).
#[must_use]
pub fn probe_specs(cfg: &crate::config::MachineConfig) -> Vec<ProbeSpecSpec> {
    let mut out: Vec<ProbeSpecSpec> = Vec::new();
    let mut push = |name: &str, spec: ProbeSpecSpec| {
        if out.iter().any(|s| s.key() == spec.key()) {
            tracing::warn!(probe = name, id = %spec.key(),
                "two probe documents have the same target; they are one probe");
            return;
        }
        out.push(spec);
    };
    for t in cfg.documents_of::<TcpProbeConfig>() {
        let (interval, timeout) = t.durations();
        push(
            &t.name,
            ProbeSpecSpec {
                interval,
                failure_threshold: u32::try_from(t.failure_threshold).unwrap_or(0),
                tcp: Some(TcpProbeSpec {
                    endpoint: t.endpoint.clone(),
                    timeout,
                }),
                http: None,
                layer: ConfigLayer::Configuration,
            },
        );
    }
    for h in cfg.documents_of::<HttpProbeConfig>() {
        let (interval, timeout) = h.durations();
        push(
            &h.name,
            ProbeSpecSpec {
                interval,
                failure_threshold: u32::try_from(h.failure_threshold).unwrap_or(0),
                tcp: None,
                http: Some(HttpProbeSpec {
                    url: h.url.clone(),
                    timeout,
                }),
                layer: ConfigLayer::Configuration,
            },
        );
    }
    out
}

/// Writes `network-config/ProbeSpec configuration/<id>` (tracked).
#[derive(Debug, Default)]
pub struct ProbeConfigController;

impl Controller for ProbeConfigController {
    fn name(&self) -> &str {
        "ProbeConfigController"
    }

    fn inputs(&self) -> Vec<Input> {
        vec![MachineConfig::input()]
    }

    fn outputs(&self) -> Vec<Output> {
        vec![Output::shared::<ProbeSpec>()]
    }

    fn run<'a>(&'a mut self, rt: &'a mut ControllerRuntime) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            while rt.next_round().await {
                let cfg = MachineConfig::active(rt)?;
                let specs = cfg.map(|c| probe_specs(&c.spec.config)).unwrap_or_default();
                rt.start_tracking_outputs()?;
                for spec in specs {
                    let id = format!("{}/{}", ConfigLayer::Configuration.prefix(), spec.key());
                    rt.modify::<ProbeSpec>(NS_CONFIG, &id, |r| r.spec = spec.clone())?;
                }
                rt.cleanup_outputs(&[Kind::new(NS_CONFIG, ProbeSpec::TYPE)])?;
            }
            Ok(())
        })
    }
}

/// Failure debouncing of one runner (spec §7.2), pure.
#[derive(Debug, Clone, Default)]
pub struct Debounce {
    threshold: u32,
    failures: u32,
}

impl Debounce {
    /// A counter for `threshold` (0 and 1: the first failure is reported).
    #[must_use]
    pub fn new(threshold: u32) -> Self {
        Self {
            threshold,
            failures: 0,
        }
    }

    /// Records one outcome; returns the status to publish, if any.
    pub fn record(&mut self, outcome: Result<(), String>) -> Option<ProbeStatusSpec> {
        match outcome {
            Ok(()) => {
                self.failures = 0;
                Some(ProbeStatusSpec {
                    success: true,
                    last_error: String::new(),
                })
            }
            Err(e) => {
                self.failures = self.failures.saturating_add(1);
                (self.failures >= self.threshold.max(1)).then_some(ProbeStatusSpec {
                    success: false,
                    last_error: e,
                })
            }
        }
    }
}

/// One TCP probe: connect within `timeout`, then close (SO_LINGER 1 s).
///
/// # Errors
/// The failure, as text.
pub async fn probe_tcp(spec: &TcpProbeSpec) -> Result<(), String> {
    let stream = tokio::time::timeout(spec.timeout, TcpStream::connect(spec.endpoint.as_str()))
        .await
        .map_err(|_| format!("dial tcp {}: i/o timeout", spec.endpoint))?
        .map_err(|e| format!("dial tcp {}: {e}", spec.endpoint))?;
    // Nothing is unsent, so the close does not block; the linger only keeps the
    // socket out of a long TIME-WAIT (spec §7.2).
    #[allow(deprecated)]
    let _ = stream.set_linger(Some(Duration::from_secs(1)));
    drop(stream);
    Ok(())
}

/// A parsed `http(s)://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Url {
    /// `http` or `https`.
    pub https: bool,
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
        let hp = auth.rsplit_once('@').map_or(auth, |(_, h)| h);
        let (host, port) = if let Some(v6) = hp.strip_prefix('[') {
            let (h, rest) = v6.split_once(']').ok_or("bad IPv6 host")?;
            (h.to_owned(), rest.strip_prefix(':'))
        } else {
            match hp.rsplit_once(':') {
                Some((h, p)) => (h.to_owned(), Some(p)),
                None => (hp.to_owned(), None),
            }
        };
        let port = match port {
            Some(p) => p.parse::<u16>().map_err(|_| format!("bad port {p:?}"))?,
            None if https => 443,
            None => 80,
        };
        Ok(Self {
            https,
            host,
            port,
            path,
        })
    }

    fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

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

/// The proxy (`host:port`) for `url` from the environment, read now.
///
/// # Errors
/// A proxy variable that is not an `http://` proxy.
pub fn proxy_for(url: &Url) -> Result<Option<Url>, String> {
    let host = url.host.to_ascii_lowercase();
    if host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback()) {
        return Ok(None);
    }
    let var = if url.https {
        "HTTPS_PROXY"
    } else {
        "HTTP_PROXY"
    };
    let Some(proxy) = env_either(var) else {
        return Ok(None);
    };
    if env_either("NO_PROXY").is_some_and(|np| no_proxy_matches(&np, &url.host, url.port)) {
        return Ok(None);
    }
    let with_scheme = if proxy.contains("://") {
        proxy
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

fn tls_config() -> Result<Arc<rustls::ClientConfig>, String> {
    let path = std::env::var("SSL_CERT_FILE")
        .unwrap_or_else(|_| "/etc/ssl/certs/ca-certificates.crt".to_owned());
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

async fn http_get(url: &Url) -> Result<u16, String> {
    let proxy = proxy_for(url)?;
    let target = proxy
        .as_ref()
        .map_or_else(|| url.authority(), Url::authority);
    let tcp = TcpStream::connect(target.as_str())
        .await
        .map_err(|e| format!("dial tcp {target}: {e}"))?;
    let mut stream: Box<dyn Io> = Box::new(tcp);
    let absolute_form = proxy.is_some() && !url.https;
    if proxy.is_some() && url.https {
        let connect = format!(
            "CONNECT {a} HTTP/1.1\r\nHost: {a}\r\n\r\n",
            a = url.authority()
        );
        stream
            .write_all(connect.as_bytes())
            .await
            .map_err(|e| format!("proxy CONNECT: {e}"))?;
        // Read the proxy's answer up to the blank line, byte by byte so no TLS bytes
        // are consumed.
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            use tokio::io::AsyncReadExt as _;
            let n = stream
                .read(&mut byte)
                .await
                .map_err(|e| format!("proxy CONNECT: {e}"))?;
            if n == 0 || head.len() > 16 * 1024 {
                return Err("proxy CONNECT: connection closed".to_owned());
            }
            head.push(byte[0]);
        }
        let code = read_status(head.as_slice()).await?;
        if code != 200 {
            return Err(format!("proxy CONNECT: status {code}"));
        }
    }
    if url.https {
        let name = rustls::pki_types::ServerName::try_from(url.host.clone())
            .map_err(|e| format!("TLS server name {:?}: {e}", url.host))?;
        let tls = tokio_rustls::TlsConnector::from(tls_config()?)
            .connect(name, stream)
            .await
            .map_err(|e| format!("TLS handshake with {}: {e}", url.authority()))?;
        stream = Box::new(tls);
    }
    let request_target = if absolute_form {
        format!("http://{}{}", url.authority(), url.path)
    } else {
        url.path.clone()
    };
    let req = format!(
        "GET {request_target} HTTP/1.1\r\nHost: {}\r\nUser-Agent: wirespan-probe\r\nAccept: */*\r\nConnection: close\r\n\r\n",
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

/// One HTTP probe attempt.
///
/// # Errors
/// The failure, as text (`received non-success status code: 503`, timeouts, …).
pub async fn probe_http(spec: &HttpProbeSpec) -> Result<(), String> {
    let url = Url::parse(&spec.url)?;
    let code = tokio::time::timeout(spec.timeout, http_get(&url))
        .await
        .map_err(|_| {
            format!(
                "GET {}: timeout after {:?}",
                crate::resources::network::strip_userinfo(&spec.url),
                spec.timeout
            )
        })??;
    if (200..400).contains(&code) {
        Ok(())
    } else {
        Err(format!("received non-success status code: {code}"))
    }
}

async fn probe_once(spec: &ProbeSpecSpec) -> Result<(), String> {
    match (&spec.tcp, &spec.http) {
        (Some(t), _) => probe_tcp(t).await,
        (None, Some(h)) => probe_http(h).await,
        (None, None) => Err("probe has neither tcp nor http".to_owned()),
    }
}

struct Report {
    id: String,
    generation: u64,
    status: ProbeStatusSpec,
}

async fn runner(
    id: String,
    generation: u64,
    spec: ProbeSpecSpec,
    tx: mpsc::UnboundedSender<Report>,
    cancel: CancellationToken,
) {
    let mut debounce = Debounce::new(spec.failure_threshold);
    let interval = if spec.interval.is_zero() {
        DEFAULT_INTERVAL
    } else {
        spec.interval
    };
    loop {
        let outcome = tokio::select! {
            () = cancel.cancelled() => return,
            o = probe_once(&spec) => o,
        };
        if let Err(e) = &outcome {
            tracing::debug!(probe = %id, error = %e, "probe failed");
        }
        if let Some(status) = debounce.record(outcome) {
            if tx
                .send(Report {
                    id: id.clone(),
                    generation,
                    status,
                })
                .is_err()
            {
                return;
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}

struct Running {
    spec: ProbeSpecSpec,
    generation: u64,
    cancel: CancellationToken,
}

/// Runs one task per `network/ProbeSpec` and publishes `network/ProbeStatus`.
#[derive(Debug, Default)]
pub struct ProbeController;

impl Controller for ProbeController {
    fn name(&self) -> &str {
        "ProbeController"
    }

    fn inputs(&self) -> Vec<Input> {
        vec![Input::of::<ProbeSpec>(NS, InputKind::Weak)]
    }

    fn outputs(&self) -> Vec<Output> {
        vec![Output::exclusive::<ProbeStatus>()]
    }

    fn run<'a>(&'a mut self, rt: &'a mut ControllerRuntime) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let (tx, mut rx) = mpsc::unbounded_channel::<Report>();
            let mut running: HashMap<String, Running> = HashMap::new();
            let mut next_generation = 0u64;
            let stop_all = |running: &mut HashMap<String, Running>| {
                for r in running.values() {
                    r.cancel.cancel();
                }
                running.clear();
            };
            let res: ControllerResult = async {
                loop {
                    tokio::select! {
                        () = rt.cancelled() => return Ok(()),
                        () = rt.changed() => {
                            let specs: HashMap<String, ProbeSpecSpec> = rt
                                .list::<ProbeSpec>(NS)?
                                .iter()
                                .filter(|r| r.metadata.phase == Phase::Running)
                                .map(|r| (r.metadata.id.clone(), r.spec.clone()))
                                .collect();
                            let gone: Vec<String> = running
                                .iter()
                                .filter(|(id, r)| specs.get(*id) != Some(&r.spec))
                                .map(|(id, _)| id.clone())
                                .collect();
                            for id in gone {
                                if let Some(r) = running.remove(&id) {
                                    r.cancel.cancel();
                                }
                            }
                            for (id, spec) in specs {
                                if running.contains_key(&id) {
                                    continue;
                                }
                                next_generation += 1;
                                let cancel = rt.cancellation().child_token();
                                tokio::spawn(runner(id.clone(), next_generation, spec.clone(), tx.clone(), cancel.clone()));
                                running.insert(id, Running { spec, generation: next_generation, cancel });
                            }
                            // Statuses of probes that no longer exist.
                            for st in rt.list::<ProbeStatus>(NS)? {
                                if !running.contains_key(&st.metadata.id) && st.metadata.owner == rt.name() {
                                    rt.destroy(&Pointer::new(NS, ProbeStatus::TYPE, &st.metadata.id))?;
                                }
                            }
                            rt.reset_restart_backoff();
                        }
                        Some(rep) = rx.recv() => {
                            // Late results of stopped or restarted runners are ignored.
                            if running.get(&rep.id).is_some_and(|r| r.generation == rep.generation) {
                                rt.modify::<ProbeStatus>(NS, &rep.id, |r| r.spec = rep.status.clone())?;
                            }
                        }
                    }
                }
            }
            .await;
            stop_all(&mut running);
            res.map_err(|e: ControllerError| e)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debounce_reports_failures_at_threshold_and_one_success_resets() {
        let fail = || Err("x".to_owned());
        // (threshold, outcomes, expected reports: None / Some(success))
        type Case = (u32, Vec<Result<(), String>>, Vec<Option<bool>>);
        let cases: Vec<Case> = vec![
            (0, vec![fail(), fail()], vec![Some(false), Some(false)]),
            (1, vec![fail(), Ok(())], vec![Some(false), Some(true)]),
            (
                3,
                vec![fail(), fail(), fail(), fail()],
                vec![None, None, Some(false), Some(false)],
            ),
            (
                3,
                vec![fail(), fail(), Ok(()), fail(), fail(), fail()],
                vec![None, None, Some(true), None, None, Some(false)],
            ),
        ];
        for (threshold, outcomes, want) in cases {
            let mut d = Debounce::new(threshold);
            let got: Vec<Option<bool>> = outcomes
                .into_iter()
                .map(|o| d.record(o).map(|s| s.success))
                .collect();
            assert_eq!(got, want, "threshold {threshold}");
        }
    }

    #[test]
    fn urls_and_no_proxy() {
        let u = Url::parse("https://user:pw@[fd00::1]:8443/health?x=1#frag").unwrap();
        assert_eq!(
            (u.https, u.host.as_str(), u.port, u.path.as_str()),
            (true, "fd00::1", 8443, "/health?x=1")
        );
        let u = Url::parse("http://example.com").unwrap();
        assert_eq!((u.port, u.path.as_str()), (80, "/"));
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
}
