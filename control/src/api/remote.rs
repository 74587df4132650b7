//! The resource API over TCP with mutual TLS 1.3 (`wirespan node --api-listen`).
//!
//! The node issues itself a server certificate from the cluster API CA in its config
//! (`ClusterConfig.apiCaCert`/`apiCaKey`) and renews it at two thirds of its lifetime,
//! or when its names change (the mesh address appearing). A client must present a
//! certificate signed by that CA, unexpired, with a role in its organisation
//! ([`pki::Role`]); the handshake fails otherwise and the failure is logged.
//!
//! Limits: a handshake must finish within [`HANDSHAKE_TIMEOUT`]; at most
//! [`MAX_PENDING_HANDSHAKES`] handshakes are in progress, and a new connection beyond
//! that evicts the oldest unfinished one, so a flood of connections that never finish
//! cannot lock a real client out for longer than its own handshake takes. Role checks
//! and the proxy to other nodes are in [`gate`](super::gate), the server that joins
//! them in [`remote_server`](super::remote_server).

use std::{
    collections::VecDeque,
    net::{IpAddr, SocketAddr},
    pin::Pin,
    sync::{Arc, Mutex, RwLock},
    task::{Context, Poll},
    time::{Duration, SystemTime},
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::mpsc,
};
use tokio_rustls::{server::TlsStream, TlsAcceptor};
use tokio_util::sync::CancellationToken;

use super::pki::{self, Issued, Role};
use crate::{
    config::cluster::ClusterConfig,
    resources::{
        config::MachineConfig,
        kubespan::KubeSpanIdentity,
        network::{HostnameStatus, HOSTNAME},
    },
    runtime::{ResourceKind as _, Store},
    secret::SecretString,
};

/// How long a client may take to finish the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Handshakes in progress at once; a new connection beyond it evicts the oldest.
pub const MAX_PENDING_HANDSHAKES: usize = 256;

/// Who is calling: read from the client certificate the handshake verified.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The certificate's role.
    pub role: Role,
    /// The certificate's common name, for logs.
    pub name: String,
    /// Where the connection came from.
    pub remote: SocketAddr,
}

/// A verified TLS connection and its caller (the caller reaches each request's
/// extensions through [`tonic::transport::server::Connected`]).
#[derive(Debug)]
pub struct CallerStream {
    inner: TlsStream<TcpStream>,
    caller: Caller,
}

impl tonic::transport::server::Connected for CallerStream {
    type ConnectInfo = Caller;
    fn connect_info(&self) -> Caller {
        self.caller.clone()
    }
}

impl AsyncRead for CallerStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for CallerStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Building the TLS configuration failed.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// Certificate generation.
    #[error(transparent)]
    Pki(#[from] pki::PkiError),
    /// The PEM material did not parse.
    #[error("{0}")]
    Pem(String),
    /// rustls refused the material.
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    /// The CA certificate is unusable as a trust anchor.
    #[error("client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificates of a PEM text.
///
/// # Errors
/// [`TlsError::Pem`] (naming `what`).
pub fn certs(
    pem: &str,
    what: &str,
) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, TlsError> {
    let certs = rustls_pemfile::certs(&mut pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem(format!("{what}: {e}")))?;
    if certs.is_empty() {
        return Err(TlsError::Pem(format!("{what}: no PEM certificate")));
    }
    Ok(certs)
}

/// The private key of a PEM text; errors never contain the key.
///
/// # Errors
/// [`TlsError::Pem`] (naming `what`).
pub fn private_key(
    pem: &SecretString,
    what: &str,
) -> Result<rustls::pki_types::PrivateKeyDer<'static>, TlsError> {
    rustls_pemfile::private_key(&mut pem.expose().as_bytes())
        .ok()
        .flatten()
        .ok_or_else(|| TlsError::Pem(format!("{what}: no PEM private key")))
}

/// The server side: TLS 1.3 only, client certificates signed by `ca_cert_pem`
/// required, HTTP/2.
///
/// # Errors
/// [`TlsError`].
pub fn server_config(
    ca_cert_pem: &str,
    issued: &Issued,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs(ca_cert_pem, "apiCaCert")? {
        roots.add(c)?;
    }
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            certs(&issued.cert_pem, "node certificate")?,
            private_key(&issued.key_pem, "node key")?,
        )?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// The node's current certificate and what it was made from.
#[derive(Debug, Clone)]
pub struct NodeMaterial {
    /// The CA certificate it was issued by (PEM).
    pub ca_cert_pem: String,
    /// The node's certificate and key.
    pub issued: Issued,
    /// The names in it.
    pub sans: Vec<String>,
    server: Arc<rustls::ServerConfig>,
}

/// The node's TLS material, shared by the listener, the renewal loop and the proxy
/// (which presents the node's certificate to other nodes).
pub type SharedMaterial = Arc<RwLock<Option<NodeMaterial>>>;

/// The CA in the active config, if it has one.
#[must_use]
pub fn config_ca(store: &Store) -> Option<(String, SecretString)> {
    let config = store
        .get::<MachineConfig>(
            MachineConfig::DEFAULT_NAMESPACE,
            crate::resources::config::ACTIVE,
        )
        .ok()?;
    let cluster = config.spec.config.singleton::<ClusterConfig>()?;
    Some((cluster.api_ca_cert.clone()?, cluster.api_ca_key.clone()?))
}

/// This host's name (of the UTS namespace the node runs in).
#[must_use]
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default()
}

/// The addresses of this network namespace's interfaces.
#[must_use]
pub fn local_addresses() -> Vec<IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    let mut out: Vec<IpAddr> = addrs
        .filter_map(|a| {
            let a = a.address?;
            a.as_sockaddr_in()
                .map(|s| IpAddr::V4(s.ip()))
                .or_else(|| a.as_sockaddr_in6().map(|s| IpAddr::V6(s.ip())))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The names a node's certificate carries: hostname, `localhost`, every interface
/// address and the mesh address (once the mesh has one), sorted.
#[must_use]
pub fn node_sans(hostname: &str, addresses: &[IpAddr], mesh: Option<IpAddr>) -> Vec<String> {
    let mut sans: Vec<String> = [hostname, "localhost"]
        .into_iter()
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .chain(addresses.iter().chain(mesh.iter()).map(ToString::to_string))
        .collect();
    sans.sort();
    sans.dedup();
    sans
}

/// The node's mesh (ULA) address, once the mesh identity exists.
#[must_use]
pub fn mesh_address(store: &Store) -> Option<IpAddr> {
    store
        .list::<KubeSpanIdentity>(
            KubeSpanIdentity::DEFAULT_NAMESPACE,
            &crate::runtime::Filter::all(),
        )
        .first()
        .and_then(|r| r.spec.address)
        .map(|n| n.addr())
}

/// The cluster's mesh prefix (the /64 every node's mesh address is in): where
/// forwarded requests must come from.
#[must_use]
pub fn mesh_prefix(store: &Store) -> Option<ipnet::IpNet> {
    ipnet::IpNet::new(mesh_address(store)?, 64)
        .ok()
        .map(|n| n.trunc())
}

/// Issues the node a new certificate when there is none, the CA or the names changed,
/// or renewal is due; drops it when the config no longer has a CA.
pub fn refresh(shared: &SharedMaterial, store: &Store, now: SystemTime) {
    let Some((ca_cert, ca_key)) = config_ca(store) else {
        if shared
            .write()
            .map(|mut m| m.take())
            .ok()
            .flatten()
            .is_some()
        {
            tracing::warn!("the config has no API CA (apiCaCert/apiCaKey): the remote API refuses every connection");
        }
        return;
    };
    let host = hostname();
    let mut sans = node_sans(&host, &local_addresses(), mesh_address(store));
    // The FQDN too: other nodes know this node by its affiliate's hostname, which is it.
    if let Ok(h) = store.get::<HostnameStatus>(HostnameStatus::DEFAULT_NAMESPACE, HOSTNAME) {
        let fqdn = h.spec.fqdn();
        if !fqdn.is_empty() && !sans.contains(&fqdn) {
            sans.push(fqdn);
            sans.sort();
        }
    }
    let current = shared.read().ok().and_then(|m| m.clone());
    if let Some(m) = &current {
        if m.ca_cert_pem == ca_cert
            && m.sans == sans
            && !pki::renewal_due(m.issued.not_before, m.issued.not_after, now)
        {
            return;
        }
    }
    let name = if host.is_empty() {
        "wirespan-node"
    } else {
        &host
    };
    let made = pki::issue(&ca_key, Role::Node, name, &sans, now, pki::NODE_LIFETIME)
        .map_err(TlsError::from)
        .and_then(|issued| {
            let server = server_config(&ca_cert, &issued)?;
            Ok(NodeMaterial {
                ca_cert_pem: ca_cert.clone(),
                issued,
                sans: sans.clone(),
                server,
            })
        });
    match made {
        Ok(m) => {
            tracing::info!(names = ?m.sans, not_after = %humantime::format_rfc3339_seconds(m.issued.not_after), "API server certificate issued");
            if let Ok(mut w) = shared.write() {
                *w = Some(m);
            }
        }
        Err(e) => tracing::error!(error = %e, "issuing the API server certificate failed"),
    }
}

/// Unfinished handshakes, oldest first, each with the token that aborts it.
#[derive(Debug, Default)]
struct Pending {
    next: u64,
    order: VecDeque<(u64, CancellationToken)>,
}

impl Pending {
    /// Registers a handshake, evicting the oldest one when at the cap.
    fn admit(&mut self, cap: usize) -> (u64, CancellationToken) {
        while self.order.len() >= cap {
            if let Some((_, old)) = self.order.pop_front() {
                old.cancel();
            }
        }
        self.next += 1;
        let token = CancellationToken::new();
        self.order.push_back((self.next, token.clone()));
        (self.next, token)
    }

    fn done(&mut self, id: u64) {
        self.order.retain(|(i, _)| *i != id);
    }
}

/// Runs one handshake; a verified connection with a role goes to `tx`.
async fn handshake(
    tcp: TcpStream,
    remote: SocketAddr,
    config: Arc<rustls::ServerConfig>,
    abort: CancellationToken,
    tx: mpsc::Sender<Result<CallerStream, std::io::Error>>,
) {
    let accepted = tokio::select! {
        () = abort.cancelled() => {
            tracing::debug!(%remote, "unfinished API handshake evicted (too many in progress)");
            return;
        }
        r = tokio::time::timeout(HANDSHAKE_TIMEOUT, TlsAcceptor::from(config).accept(tcp)) => r,
    };
    let tls = match accepted {
        Err(_) => {
            tracing::debug!(%remote, timeout = ?HANDSHAKE_TIMEOUT, "API handshake timed out");
            return;
        }
        // Closed before saying anything: a port scan or an evicted flood, not a refusal.
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            tracing::debug!(%remote, "API connection closed during the handshake");
            return;
        }
        Ok(Err(e)) => {
            tracing::warn!(%remote, error = %e, "API TLS handshake failed");
            return;
        }
        Ok(Ok(tls)) => tls,
    };
    let der = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec());
    let Some(role) = der.as_deref().and_then(pki::role_of) else {
        tracing::warn!(%remote, "API client certificate carries no wirespan role: connection refused");
        return;
    };
    let name = der.as_deref().and_then(common_name).unwrap_or_default();
    tracing::debug!(%remote, role = role.as_str(), %name, "API client connected");
    let caller = Caller { role, name, remote };
    let _ = tx.send(Ok(CallerStream { inner: tls, caller })).await;
}

/// The subject common name, for logs.
fn common_name(der: &[u8]) -> Option<String> {
    // Same walk as the organisation, other OID: reuse it through a tiny shim.
    pki::subject_attribute(der, &[0x55, 0x04, 0x03])
}

/// Accepts connections until `shutdown`, handing verified ones (with their
/// [`Caller`]) to `tx`.
pub async fn accept_loop(
    listener: TcpListener,
    material: SharedMaterial,
    tx: mpsc::Sender<Result<CallerStream, std::io::Error>>,
    shutdown: CancellationToken,
) {
    let pending = Arc::new(Mutex::new(Pending::default()));
    loop {
        let (tcp, remote) = tokio::select! {
            () = shutdown.cancelled() => return,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors and the like: back off briefly, keep serving.
                    tracing::warn!(error = %e, "API accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let config = material
            .read()
            .ok()
            .and_then(|m| m.as_ref().map(|m| Arc::clone(&m.server)));
        let Some(config) = config else {
            tracing::warn!(%remote, "API connection refused: no API CA in the config yet");
            continue;
        };
        let Ok((id, abort)) = pending.lock().map(|mut p| p.admit(MAX_PENDING_HANDSHAKES)) else {
            continue;
        };
        let (pending, tx) = (Arc::clone(&pending), tx.clone());
        tokio::spawn(async move {
            handshake(tcp, remote, config, abort, tx).await;
            if let Ok(mut p) = pending.lock() {
                p.done(id);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_pending_list_evicts_the_oldest_handshake() {
        let mut p = Pending::default();
        let (a, ta) = p.admit(2);
        let (_b, tb) = p.admit(2);
        let (_c, tc) = p.admit(2);
        assert!(ta.is_cancelled(), "the oldest was evicted");
        assert!(!tb.is_cancelled() && !tc.is_cancelled());
        assert_eq!(p.order.len(), 2);
        p.done(a);
        assert_eq!(p.order.len(), 2, "an evicted id is already gone");
    }

    #[test]
    fn node_names_are_sorted_and_unique() {
        let sans = node_sans(
            "node1",
            &["10.0.0.1".parse().unwrap(), "127.0.0.1".parse().unwrap()],
            Some("fd00::1".parse().unwrap()),
        );
        assert_eq!(
            sans,
            ["10.0.0.1", "127.0.0.1", "fd00::1", "localhost", "node1"]
        );
    }
}
