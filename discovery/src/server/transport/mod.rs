//! The edge of both listeners: connections are counted per client address and in
//! total at accept (refused ones are closed at once); a gRPC connection reaches the
//! HTTP/2 server only once it has finished TLS (if on) and sent the HTTP/2 preface,
//! within the handshake timeout; the metrics port closes connections whose request
//! headers do not arrive in that time; a gRPC call whose handler has not answered
//! within the request timeout is cancelled.

use std::{
    io,
    net::{IpAddr, SocketAddr},
    pin::Pin,
    sync::{Arc, Mutex, PoisonError},
    task::{Context, Poll},
    time::Duration,
};

use bytes::{Buf as _, Bytes};
use futures::future::BoxFuture;
use prometheus_client::{
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};
use tokio::{
    io::{AsyncRead, AsyncReadExt as _, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::mpsc,
};
use tokio_rustls::{server::TlsStream, TlsAcceptor};
use tokio_util::sync::CancellationToken;
use tonic::{
    body::Body,
    transport::server::{Connected, TcpConnectInfo},
};

pub mod limits;

pub use limits::{ConnectionCounts, FdPlan, Refused, TransportLimits};

type Labels = Vec<(&'static str, String)>;

/// The transport's metrics, registered with the server's.
#[derive(Debug, Clone, Default)]
pub struct TransportMetrics {
    open: Family<Labels, Gauge>,
    refused: Family<Labels, Counter>,
    timed_out: Family<Labels, Counter>,
    request_timeouts: Counter,
}

impl TransportMetrics {
    /// Registers every series.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "discovery_connections",
            "Open connections by listener (grpc, web)",
            self.open.clone(),
        );
        registry.register(
            "discovery_connections_refused",
            "Connections closed at accept by listener and cap (per_ip, total)",
            self.refused.clone(),
        );
        registry.register(
            "discovery_connections_timed_out",
            "Connections closed for not finishing TLS and the HTTP/2 preface (grpc) or \
             their request headers (web) within the handshake timeout",
            self.timed_out.clone(),
        );
        registry.register(
            "discovery_grpc_requests_timed_out",
            "gRPC calls cancelled for not completing within the request timeout",
            self.request_timeouts.clone(),
        );
    }

    fn labels(listener: &'static str) -> Labels {
        vec![("listener", listener.to_owned())]
    }

    fn refused(&self, listener: &'static str, why: Refused) {
        let mut labels = Self::labels(listener);
        labels.push(("reason", why.as_str().to_owned()));
        self.refused.get_or_create(&labels).inc();
    }

    fn timed_out(&self, listener: &'static str) {
        self.timed_out.get_or_create(&Self::labels(listener)).inc();
    }
}

/// The connection counts of one listener.
#[derive(Debug, Clone)]
pub(crate) struct Admission {
    listener: &'static str,
    counts: Arc<Mutex<ConnectionCounts>>,
    metrics: TransportMetrics,
}

impl Admission {
    pub(crate) fn new(
        listener: &'static str,
        max_total: usize,
        max_per_ip: usize,
        metrics: TransportMetrics,
    ) -> Self {
        Self {
            listener,
            counts: Arc::new(Mutex::new(ConnectionCounts::new(max_total, max_per_ip))),
            metrics,
        }
    }

    fn admit(&self, ip: IpAddr) -> Result<Admitted, Refused> {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        counts.admit(ip)?;
        self.set_gauge(counts.total());
        Ok(Admitted {
            admission: self.clone(),
            ip,
        })
    }

    fn set_gauge(&self, total: usize) {
        self.metrics
            .open
            .get_or_create(&TransportMetrics::labels(self.listener))
            .set(i64::try_from(total).unwrap_or(i64::MAX));
    }
}

/// One counted connection; uncounted when dropped (with its socket).
#[derive(Debug)]
pub(crate) struct Admitted {
    admission: Admission,
    ip: IpAddr,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut counts = self
            .admission
            .counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        counts.release(self.ip);
        self.admission.set_gauge(counts.total());
    }
}

/// Accepts the next connection within the caps; refused ones are closed at once.
/// `None` once `stop` is cancelled.
async fn accept(
    listener: &TcpListener,
    admission: &Admission,
    stop: &CancellationToken,
) -> Option<(TcpStream, SocketAddr, Admitted)> {
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return None,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(error) => {
                // Out of descriptors, or the peer reset first: a short pause keeps an
                // EMFILE from spinning.
                tracing::debug!(listener = admission.listener, %error, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        match admission.admit(peer.ip()) {
            Ok(admitted) => return Some((stream, peer, admitted)),
            Err(why) => {
                admission.metrics.refused(admission.listener, why);
                tracing::debug!(listener = admission.listener, peer = %peer.ip(), reason = why.as_str(), "connection refused");
            }
        }
    }
}

/// A gRPC connection past its handshake: TLS or plain, with the preface bytes read
/// to check it replayed first.
pub(crate) struct Conn {
    io: Io,
    replay: Bytes,
    info: TcpConnectInfo,
    _admitted: Admitted,
}

enum Io {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.info.clone()
    }
}

macro_rules! io {
    ($self:ident, $s:ident => $e:expr) => {
        match &mut $self.io {
            Io::Plain($s) => {
                let $s = Pin::new($s);
                $e
            }
            Io::Tls($s) => {
                let $s = Pin::new(&mut **$s);
                $e
            }
        }
    };
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.replay.is_empty() {
            let n = self.replay.len().min(buf.remaining());
            buf.put_slice(&self.replay[..n]);
            self.replay.advance(n);
            return Poll::Ready(Ok(()));
        }
        let this = &mut *self;
        io!(this, s => s.poll_read(cx, buf))
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        io!(this, s => s.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        io!(this, s => s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        io!(this, s => s.poll_flush(cx))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        io!(this, s => s.poll_shutdown(cx))
    }
}

/// The HTTP/2 client connection preface: this, then a SETTINGS frame.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const SETTINGS: u8 = 0x4;
const FRAME_HEADER: usize = 9;

/// Runs TLS (if on) and reads the client preface and its SETTINGS frame.
async fn handshake(tcp: TcpStream, tls: Option<TlsAcceptor>) -> io::Result<(Io, Bytes)> {
    let mut io = match tls {
        Some(acceptor) => Io::Tls(Box::new(acceptor.accept(tcp).await?)),
        None => Io::Plain(tcp),
    };
    let mut head = vec![0u8; PREFACE.len() + FRAME_HEADER];
    read_exact(&mut io, &mut head).await?;
    let frame = &head[PREFACE.len()..];
    let len = usize::from(frame[0]) << 16 | usize::from(frame[1]) << 8 | usize::from(frame[2]);
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_owned());
    if &head[..PREFACE.len()] != PREFACE {
        return Err(bad("not the HTTP/2 preface"));
    }
    if frame[3] != SETTINGS || len > limits::MAX_FRAME as usize {
        return Err(bad("the HTTP/2 preface is not followed by SETTINGS"));
    }
    let start = head.len();
    head.resize(start + len, 0);
    read_exact(&mut io, &mut head[start..]).await?;
    Ok((io, Bytes::from(head)))
}

async fn read_exact(io: &mut Io, buf: &mut [u8]) -> io::Result<()> {
    match io {
        Io::Plain(s) => s.read_exact(buf).await.map(drop),
        Io::Tls(s) => s.read_exact(buf).await.map(drop),
    }
}

/// The gRPC port's connections, each once past its handshake, for tonic's
/// `serve_with_incoming_shutdown`. Accepting stops with `stop`.
pub(crate) fn grpc_incoming(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    admission: Admission,
    timeout: Duration,
    stop: CancellationToken,
) -> impl futures::Stream<Item = io::Result<Conn>> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some((tcp, peer, admitted)) = accept(&listener, &admission, &stop).await {
            let (tx, tls, stop, metrics) = (
                tx.clone(),
                tls.clone(),
                stop.clone(),
                admission.metrics.clone(),
            );
            tokio::spawn(async move {
                let _ = tcp.set_nodelay(true);
                let info = TcpConnectInfo {
                    local_addr: tcp.local_addr().ok(),
                    remote_addr: Some(peer),
                };
                let shaken = tokio::select! {
                    () = stop.cancelled() => return,
                    r = tokio::time::timeout(timeout, handshake(tcp, tls)) => r,
                };
                let (io, replay) = match shaken {
                    Ok(Ok(done)) => done,
                    Ok(Err(error)) => {
                        tracing::debug!(peer = %peer.ip(), %error, "handshake failed");
                        return;
                    }
                    Err(_) => {
                        metrics.timed_out("grpc");
                        tracing::debug!(peer = %peer.ip(), "handshake timed out");
                        return;
                    }
                };
                let _ = tx.send(Ok(Conn {
                    io,
                    replay,
                    info,
                    _admitted: admitted,
                }));
            });
        }
    });
    tokio_stream::wrappers::UnboundedReceiverStream::new(rx)
}

/// Serves `router` over HTTP/1 on `listener` until `stop`: each connection within the
/// caps, its request headers due within `header_timeout`.
pub(crate) async fn serve_web(
    listener: TcpListener,
    router: axum::Router,
    admission: Admission,
    header_timeout: Duration,
    stop: CancellationToken,
) -> io::Result<()> {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(header_timeout);
    let connections = tokio_util::task::TaskTracker::new();
    while let Some((tcp, peer, admitted)) = accept(&listener, &admission, &stop).await {
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let conn = http.serve_connection(hyper_util::rt::TokioIo::new(tcp), service);
        let (stop, metrics) = (stop.clone(), admission.metrics.clone());
        connections.spawn(async move {
            let _admitted = admitted;
            let mut conn = std::pin::pin!(conn);
            let served = tokio::select! {
                r = conn.as_mut() => r,
                () = stop.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(error) = served {
                if error.is_timeout() {
                    metrics.timed_out("web");
                }
                tracing::debug!(peer = %peer.ip(), %error, "metrics connection ended");
            }
        });
    }
    drop(listener);
    connections.close();
    connections.wait().await;
    Ok(())
}

/// Cancels gRPC calls whose handler has not answered within the limit, with
/// DEADLINE_EXCEEDED. A Watch handler answers once it has read its request, so only
/// the request is timed, never the stream.
#[derive(Debug, Clone)]
pub(crate) struct RequestTimeoutLayer {
    pub(crate) limit: Duration,
    pub(crate) metrics: TransportMetrics,
}

impl<S> tower::Layer<S> for RequestTimeoutLayer {
    type Service = RequestTimeout<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequestTimeout {
            inner,
            layer: self.clone(),
        }
    }
}

/// See [`RequestTimeoutLayer`].
#[derive(Debug, Clone)]
pub(crate) struct RequestTimeout<S> {
    inner: S,
    layer: RequestTimeoutLayer,
}

impl<S, B> tower::Service<http::Request<B>> for RequestTimeout<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let call = self.inner.call(req);
        let RequestTimeoutLayer { limit, metrics } = self.layer.clone();
        Box::pin(async move {
            if let Ok(answered) = tokio::time::timeout(limit, call).await {
                return answered;
            }
            metrics.request_timeouts.inc();
            Ok(tonic::Status::deadline_exceeded(format!(
                "the request did not complete within {limit:?}"
            ))
            .into_http())
        })
    }
}
