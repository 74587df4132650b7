//! The load generator's gRPC client, at the HTTP/2 level: each request is encoded
//! once and sent as the same bytes every call, responses are checked for their gRPC
//! status without being decoded, and each connection is driven by the one task that
//! uses it.
//!
//! The benchmark's clients share the machine's cores with the server, so whatever a
//! client spends per call or per delivery is taken from the server and shows up as
//! the server's latency or lost throughput. tonic's client spends more per call than
//! the server does (the request encoded per call, a buffer task between the caller
//! and the connection, the connection in a task of its own, each woken per frame).
//! This client speaks the same protocol to the same server; only the load
//! generator's share of the cores shrinks. Every RPC the throughput section compares
//! goes through it, so its ratios still compare the server's handling of them. (The
//! fan-out's watchers and the storm's nodes, thousands of connections, use the
//! leaner [`super::h2conn`].)

use std::{
    future::Future,
    net::SocketAddr,
    pin::Pin,
    task::{Context, Poll},
};

use anyhow::Context as _;
use bytes::{BufMut as _, Bytes, BytesMut};
use h2::{
    client::{Connection, ResponseFuture, SendRequest},
    RecvStream,
};
use tokio::net::TcpStream;
use tonic::{Code, Status};

/// HTTP/2 windows of a connection: (stream, connection) in bytes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Windows {
    pub(super) stream: u32,
    pub(super) connection: u32,
}

/// One HTTP/2 connection to the server. Its frames are read and written only while
/// one of its calls is awaited, which is all the benchmark's clients need.
pub(super) struct WireClient {
    send: SendRequest<Bytes>,
    conn: Connection<TcpStream, Bytes>,
    base: String,
}

/// A gRPC message with its 5-byte prefix (uncompressed), as it goes on the wire.
pub(super) fn frame(message: &impl prost::Message) -> Bytes {
    let len = message.encoded_len();
    let mut buf = BytesMut::with_capacity(5 + len);
    buf.put_u8(0);
    buf.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    message
        .encode(&mut buf)
        .expect("the buffer has room for the message");
    buf.freeze()
}

fn unavailable(e: &h2::Error) -> Status {
    Status::unavailable(format!("HTTP/2: {e}"))
}

/// A prepared call: the request's path on this client's server and its body.
#[derive(Debug, Clone)]
pub(super) struct Call {
    uri: http::Uri,
    body: Bytes,
}

impl WireClient {
    /// Connects (TCP_NODELAY, as tonic's endpoints here) with the library's default
    /// windows or `windows`.
    pub(super) async fn connect(
        addr: SocketAddr,
        windows: Option<Windows>,
    ) -> anyhow::Result<Self> {
        let tcp = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        tcp.set_nodelay(true)?;
        let mut builder = h2::client::Builder::new();
        if let Some(w) = windows {
            builder
                .initial_window_size(w.stream)
                .initial_connection_window_size(w.connection);
        }
        let (send, conn) = builder
            .handshake(tcp)
            .await
            .with_context(|| format!("HTTP/2 handshake with {addr}"))?;
        Ok(Self {
            send,
            conn,
            base: format!("http://{addr}"),
        })
    }

    /// A call of `path` with `request`, encoded now once for all its uses.
    pub(super) fn call(&self, path: &str, request: &impl prost::Message) -> Call {
        Call {
            uri: format!("{}{path}", self.base)
                .parse()
                .expect("an address and a method path form a URI"),
            body: frame(request),
        }
    }

    /// A unary call: its response message read to the end (its bytes only, not
    /// decoded), and its status.
    pub(super) async fn unary(&mut self, call: &Call) -> Result<(), Status> {
        drive(&mut self.conn, exchange(&mut self.send, call)).await?
    }
}

/// Awaits `fut` while reading and writing the connection's frames. The connection
/// goes first in each poll, so what it reads is ready for `fut` in the same poll.
async fn drive<F: Future>(
    conn: &mut Connection<TcpStream, Bytes>,
    fut: F,
) -> Result<F::Output, Status> {
    let mut fut = std::pin::pin!(fut);
    std::future::poll_fn(|cx: &mut Context<'_>| {
        if let Poll::Ready(r) = Pin::new(&mut *conn).poll(cx) {
            return Poll::Ready(Err(match r {
                Ok(()) => Status::unavailable("connection closed"),
                Err(e) => unavailable(&e),
            }));
        }
        fut.as_mut().poll(cx).map(Ok)
    })
    .await
}

/// Sends the request (headers, then the body with END_STREAM); the response follows.
async fn start(send: &mut SendRequest<Bytes>, call: &Call) -> Result<ResponseFuture, Status> {
    futures::future::poll_fn(|cx| send.poll_ready(cx))
        .await
        .map_err(|e| unavailable(&e))?;
    let request = http::Request::post(call.uri.clone())
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .header(http::header::TE, "trailers")
        .body(())
        .map_err(|e| Status::internal(e.to_string()))?;
    let (response, mut stream) = send
        .send_request(request, false)
        .map_err(|e| unavailable(&e))?;
    stream
        .send_data(call.body.clone(), true)
        .map_err(|e| unavailable(&e))?;
    Ok(response)
}

/// Sends `call`; its response body once the headers came, the connection driven by
/// the caller.
async fn response(send: &mut SendRequest<Bytes>, call: &Call) -> Result<RecvStream, Status> {
    response_body(start(send, call).await?.await)
}

/// The body of a response, or its status if it ended at once (trailers only).
fn response_body(
    response: Result<http::Response<RecvStream>, h2::Error>,
) -> Result<RecvStream, Status> {
    let response = response.map_err(|e| unavailable(&e))?;
    if response.status() != http::StatusCode::OK {
        return Err(Status::unknown(format!(
            "HTTP status {}",
            response.status()
        )));
    }
    if let Some(status) = Status::from_header_map(response.headers()) {
        return Err(status);
    }
    Ok(response.into_body())
}

/// A received DATA frame, its window handed back to the server.
fn released(body: &mut RecvStream, data: Result<Bytes, h2::Error>) -> Result<Bytes, Status> {
    let data = data.map_err(|e| unavailable(&e))?;
    // Fails only on a stream already reset, which its next read reports.
    let _ = body.flow_control().release_capacity(data.len());
    Ok(data)
}

/// The call's status from the trailers of a body read to its end: OK, or the error.
async fn status_of(body: &mut RecvStream) -> Result<(), Status> {
    let trailers = body.trailers().await.map_err(|e| unavailable(&e))?;
    match trailers.as_ref().and_then(Status::from_header_map) {
        Some(status) if status.code() == Code::Ok => Ok(()),
        Some(status) => Err(status),
        None => Err(Status::unknown("call ended without a gRPC status")),
    }
}

/// A whole unary exchange, the connection driven by the caller.
async fn exchange(send: &mut SendRequest<Bytes>, call: &Call) -> Result<(), Status> {
    let mut body = response(send, call).await?;
    while let Some(data) = body.data().await {
        released(&mut body, data)?;
    }
    status_of(&mut body).await
}

/// `n` clients, one connection each, with a progress bar.
pub(super) async fn connect_many(
    addr: SocketAddr,
    n: usize,
    windows: Option<Windows>,
    what: &str,
) -> anyhow::Result<Vec<WireClient>> {
    let pb = crate::bar(n, what);
    let mut out = Vec::with_capacity(n);
    // Chunks keep the accept backlog small.
    while out.len() < n {
        let chunk = (n - out.len()).min(64);
        for c in
            futures::future::join_all((0..chunk).map(|_| WireClient::connect(addr, windows))).await
        {
            out.push(c?);
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    Ok(out)
}

/// Splits a response body into its gRPC messages (prefix removed) as frames arrive.
#[derive(Debug, Default)]
pub(super) struct Deframer {
    buf: BytesMut,
}

impl Deframer {
    pub(super) fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next whole message, if the bytes pushed so far hold one.
    pub(super) fn next(&mut self) -> Result<Option<Bytes>, Status> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        if self.buf[0] != 0 {
            return Err(Status::internal("compressed message"));
        }
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        let mut message = self.buf.split_to(5 + len);
        let _ = message.split_to(5);
        Ok(Some(message.freeze()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deframer_yields_whole_messages_split_anywhere() {
        let messages: Vec<Vec<u8>> = vec![vec![], vec![1, 2, 3], vec![7; 300]];
        let wire: Vec<u8> = messages
            .iter()
            .flat_map(|m| {
                let mut f = vec![0];
                f.extend_from_slice(&u32::try_from(m.len()).unwrap().to_be_bytes());
                f.extend_from_slice(m);
                f
            })
            .collect();
        for step in [1, 2, 5, 6, 100, wire.len()] {
            let mut d = Deframer::default();
            let mut out = Vec::new();
            for chunk in wire.chunks(step) {
                d.push(chunk);
                while let Some(m) = d.next().unwrap() {
                    out.push(m.to_vec());
                }
            }
            assert_eq!(out, messages, "chunks of {step}");
        }
        let mut d = Deframer::default();
        d.push(&[1, 0, 0, 0, 0]);
        assert!(d.next().is_err());
    }
}
