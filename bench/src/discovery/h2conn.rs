//! A minimal HTTP/2 client for gRPC, without I/O ([`Receiver`], [`Sender`]), and a
//! set of such connections read by one thread from one epoll set ([`Conns`]).
//!
//! The fan-out's watchers and the storm's nodes are thousands of connections on the
//! two cores the server uses too. As tasks with an h2 connection each, the load
//! generator spent about as much CPU per delivered byte as the server (a runtime
//! wake-up, the connection's state machine and a stream lock per frame, and a copy of
//! every DATA frame), so what the benchmark measured was half generator. Here a
//! delivery costs one `read` from a ready socket and the parse of its bytes in place.
//!
//! The protocol subset is what a gRPC client of this server needs: the preface and
//! SETTINGS (our windows), requests as HPACK literals (no dynamic table entries, no
//! Huffman), responses' header blocks decoded (HPACK) for `:status` and
//! `grpc-status`, DATA handed over as it arrives (a frame cut between reads is not
//! buffered) with its window handed back at half the window, SETTINGS and PING
//! acknowledged, RST_STREAM and GOAWAY ending the streams they cover.

use std::{
    io::{self, Read as _, Write as _},
    net::SocketAddr,
    time::Duration,
};

use anyhow::Context as _;
use bytes::Bytes;
use mio::{net::TcpStream, Events, Interest, Poll, Token};
use tonic::{Code, Status};

use super::wire::{frame, Windows};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The protocol's initial window, before SETTINGS and WINDOW_UPDATE change it.
const DEFAULT_WINDOW: u32 = 65_535;
/// Connections opened at once by [`Conns::connect_many`].
const CONNECT_CHUNK: usize = 64;
/// Longest header block (HEADERS and CONTINUATION together) accepted.
const MAX_HEADER_BLOCK: usize = 64 * 1024;

fn frame_header(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    let len = u32::try_from(len).expect("frames here are small");
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
}

/// An HPACK string literal (no Huffman coding; every string here is short).
fn hpack_string(out: &mut Vec<u8>, s: &str) {
    let len = u8::try_from(s.len()).ok().filter(|&l| l < 0x7f);
    out.push(len.expect("header strings here are short"));
    out.extend_from_slice(s.as_bytes());
}

/// A gRPC request encoded once: its header block and its framed message.
#[derive(Debug, Clone)]
pub(super) struct Call {
    block: Vec<u8>,
    body: Bytes,
}

impl Call {
    pub(super) fn new(authority: SocketAddr, path: &str, message: &impl prost::Message) -> Self {
        let mut block = vec![0x83, 0x86]; // :method POST, :scheme http (static table)
        block.push(0x04); // :path, literal without indexing
        hpack_string(&mut block, path);
        block.push(0x01); // :authority
        hpack_string(&mut block, &authority.to_string());
        block.extend_from_slice(&[0x0f, 0x10]); // content-type (static index 31)
        hpack_string(&mut block, "application/grpc");
        block.push(0x00); // te, a name not in the static table
        hpack_string(&mut block, "te");
        hpack_string(&mut block, "trailers");
        Self {
            block,
            body: frame(message),
        }
    }
}

/// What the server sent on one stream.
#[derive(Debug)]
pub(super) enum Event<'a> {
    /// Response headers with status 200 (the call is open; messages follow).
    Headers(u32),
    /// Body bytes, as they arrived (gRPC messages may be cut anywhere).
    Data(u32, &'a [u8]),
    /// The call ended with this status (OK included); nothing more comes on it.
    End(u32, Status),
}

#[derive(Debug)]
struct OpenStream {
    id: u32,
    unreleased: usize,
}

/// The writing half of a connection: requests and control frames not yet written.
#[derive(Debug)]
pub(super) struct Sender {
    out: Vec<u8>,
    next_stream: u32,
    open: Vec<OpenStream>,
    windows: Windows,
    /// The connection should be closed once what is queued was handled.
    pub(super) close: bool,
}

impl Sender {
    /// The preface, our SETTINGS (push off, the stream window) and the connection's
    /// window raised to `windows.connection`.
    fn new(windows: Windows) -> Self {
        let mut out = PREFACE.to_vec();
        frame_header(&mut out, 12, SETTINGS, 0, 0);
        out.extend_from_slice(&[0, 2, 0, 0, 0, 0]); // SETTINGS_ENABLE_PUSH = 0
        out.extend_from_slice(&[0, 4]); // SETTINGS_INITIAL_WINDOW_SIZE
        out.extend_from_slice(&windows.stream.to_be_bytes());
        if let Some(raise) = windows
            .connection
            .checked_sub(DEFAULT_WINDOW)
            .filter(|&r| r > 0)
        {
            frame_header(&mut out, 4, WINDOW_UPDATE, 0, 0);
            out.extend_from_slice(&raise.to_be_bytes());
        }
        Self {
            out,
            next_stream: 1,
            open: Vec::new(),
            windows,
            close: false,
        }
    }

    /// Queues `call` on a new stream (HEADERS, then its message with END_STREAM);
    /// returns the stream's ID.
    pub(super) fn send(&mut self, call: &Call) -> u32 {
        let id = self.next_stream;
        self.next_stream += 2;
        frame_header(&mut self.out, call.block.len(), HEADERS, END_HEADERS, id);
        self.out.extend_from_slice(&call.block);
        frame_header(&mut self.out, call.body.len(), DATA, END_STREAM, id);
        self.out.extend_from_slice(&call.body);
        self.open.push(OpenStream { id, unreleased: 0 });
        id
    }

    fn window_update(&mut self, stream: u32, increment: usize) {
        frame_header(&mut self.out, 4, WINDOW_UPDATE, 0, stream);
        let inc = u32::try_from(increment).unwrap_or(u32::MAX);
        self.out.extend_from_slice(&inc.to_be_bytes());
    }

    /// Counts `n` body bytes received on `stream` and hands the windows back at half.
    fn received(&mut self, stream: u32, n: usize) {
        let half = (self.windows.stream / 2) as usize;
        if let Some(s) = self.open.iter_mut().find(|s| s.id == stream) {
            s.unreleased += n;
            if s.unreleased >= half {
                let inc = std::mem::take(&mut s.unreleased);
                self.window_update(stream, inc);
            }
        }
    }

    fn is_open(&self, stream: u32) -> bool {
        self.open.iter().any(|s| s.id == stream)
    }

    fn closed(&mut self, stream: u32) -> bool {
        let before = self.open.len();
        self.open.retain(|s| s.id != stream);
        self.open.len() < before
    }
}

/// A DATA frame whose payload is still arriving.
#[derive(Debug)]
struct DataLeft {
    stream: u32,
    left: usize,
    end_stream: bool,
}

/// A header block still missing its CONTINUATION frames.
#[derive(Debug)]
struct BlockLeft {
    stream: u32,
    end_stream: bool,
    block: Vec<u8>,
}

/// The reading half of a connection: parses frames as bytes arrive.
pub(super) struct Receiver {
    hpack: loona_hpack::Decoder<'static>,
    /// An incomplete frame (or frame header), other than a DATA frame's payload.
    partial: Vec<u8>,
    data: Option<DataLeft>,
    block: Option<BlockLeft>,
    conn_unreleased: usize,
    /// The server's SETTINGS arrived (it accepted the connection).
    pub(super) settings_seen: bool,
    pub(super) ended: bool,
}

/// `:status`, `grpc-status` and `grpc-message` of a header block.
#[derive(Default)]
struct ResponseHead {
    http: Option<Vec<u8>>,
    grpc: Option<i32>,
    message: String,
}

impl ResponseHead {
    /// The call's status, for a header block that ends the stream.
    fn status(&self) -> Status {
        if let Some(http) = self.http.as_deref().filter(|s| *s != b"200") {
            return Status::unknown(format!("HTTP status {}", String::from_utf8_lossy(http)));
        }
        match self.grpc {
            Some(code) => Status::new(Code::from(code), self.message.clone()),
            None => Status::unknown("call ended without a gRPC status"),
        }
    }
}

impl Default for Receiver {
    fn default() -> Self {
        Self {
            hpack: loona_hpack::Decoder::new(),
            partial: Vec::new(),
            data: None,
            block: None,
            conn_unreleased: 0,
            settings_seen: false,
            ended: false,
        }
    }
}

type OnEvent<'f> = dyn FnMut(&mut Sender, Event<'_>) + 'f;

impl Receiver {
    /// Handles `bytes` (the next ones read from the connection), calling `on` for
    /// what they complete; control responses go into `tx`.
    pub(super) fn receive(&mut self, tx: &mut Sender, mut bytes: &[u8], on: &mut OnEvent<'_>) {
        while !bytes.is_empty() && !self.ended {
            if let Some(d) = &mut self.data {
                let n = d.left.min(bytes.len());
                let (stream, end_stream) = (d.stream, d.end_stream);
                d.left -= n;
                let done = d.left == 0;
                if done {
                    self.data = None;
                }
                self.body(tx, stream, &bytes[..n], on);
                bytes = &bytes[n..];
                if done && end_stream {
                    self.end(
                        tx,
                        stream,
                        Status::unknown("stream ended without trailers"),
                        on,
                    );
                }
                continue;
            }
            if !self.partial.is_empty() || bytes.len() < 9 {
                // Complete the frame header first, then the frame.
                let need = if self.partial.len() < 9 {
                    9 - self.partial.len()
                } else {
                    9 + frame_len(&self.partial) - self.partial.len()
                };
                let n = need.min(bytes.len());
                self.partial.extend_from_slice(&bytes[..n]);
                bytes = &bytes[n..];
                if self.partial.len() < 9 {
                    continue;
                }
                if self.partial.len() == 9 && self.streams_data(&self.partial[..9]) {
                    let head = std::mem::take(&mut self.partial);
                    self.start_data(tx, &head, on);
                    continue;
                }
                if self.partial.len() == 9 + frame_len(&self.partial) {
                    let whole = std::mem::take(&mut self.partial);
                    self.frame(tx, &whole, on);
                }
                continue;
            }
            let len = frame_len(bytes);
            if self.streams_data(&bytes[..9]) {
                self.start_data(tx, &bytes[..9], on);
                bytes = &bytes[9..];
            } else if bytes.len() >= 9 + len {
                self.frame(tx, &bytes[..9 + len], on);
                bytes = &bytes[9 + len..];
            } else {
                self.partial.extend_from_slice(bytes);
                bytes = &[];
            }
        }
    }

    /// A DATA frame without padding: its payload is handed over as it arrives.
    fn streams_data(&self, head: &[u8]) -> bool {
        head[3] == DATA && head[4] & PADDED == 0
    }

    fn start_data(&mut self, tx: &mut Sender, head: &[u8], on: &mut OnEvent<'_>) {
        let (stream, left) = (stream_of(head), frame_len(head));
        let end_stream = head[4] & END_STREAM != 0;
        if left > 0 {
            self.data = Some(DataLeft {
                stream,
                left,
                end_stream,
            });
        } else if end_stream {
            self.end(
                tx,
                stream,
                Status::unknown("stream ended without trailers"),
                on,
            );
        }
    }

    fn body(&mut self, tx: &mut Sender, stream: u32, data: &[u8], on: &mut OnEvent<'_>) {
        self.conn_unreleased += data.len();
        if self.conn_unreleased >= (tx.windows.connection / 2) as usize {
            let inc = std::mem::take(&mut self.conn_unreleased);
            tx.window_update(0, inc);
        }
        if tx.is_open(stream) {
            tx.received(stream, data.len());
            if !data.is_empty() {
                on(tx, Event::Data(stream, data));
            }
        }
    }

    fn end(&mut self, tx: &mut Sender, stream: u32, status: Status, on: &mut OnEvent<'_>) {
        if tx.closed(stream) {
            on(tx, Event::End(stream, status));
        }
    }

    /// Ends every open stream (the connection is gone) with `why`.
    pub(super) fn end_all(&mut self, tx: &mut Sender, why: &str, on: &mut OnEvent<'_>) {
        self.ended = true;
        let open: Vec<u32> = tx.open.iter().map(|s| s.id).collect();
        for stream in open {
            self.end(tx, stream, Status::unavailable(why.to_owned()), on);
        }
    }

    /// One whole frame other than a DATA frame's streamed payload.
    fn frame(&mut self, tx: &mut Sender, f: &[u8], on: &mut OnEvent<'_>) {
        let (kind, flags, stream) = (f[3], f[4], stream_of(f));
        let payload = &f[9..];
        match kind {
            DATA => {
                let pad = payload.first().map_or(0, |&p| usize::from(p));
                let data = payload
                    .get(1..payload.len().saturating_sub(pad))
                    .unwrap_or(&[]);
                self.body(tx, stream, data, on);
                // Padding counts against the windows too.
                self.conn_unreleased += payload.len() - data.len();
                if flags & END_STREAM != 0 {
                    self.end(
                        tx,
                        stream,
                        Status::unknown("stream ended without trailers"),
                        on,
                    );
                }
            }
            HEADERS => {
                let mut fragment = payload;
                if flags & PADDED != 0 {
                    let pad = fragment.first().map_or(0, |&p| usize::from(p));
                    fragment = fragment
                        .get(1..fragment.len().saturating_sub(pad))
                        .unwrap_or(&[]);
                }
                if flags & PRIORITY != 0 {
                    fragment = fragment.get(5..).unwrap_or(&[]);
                }
                let block = BlockLeft {
                    stream,
                    end_stream: flags & END_STREAM != 0,
                    block: fragment.to_vec(),
                };
                if flags & END_HEADERS != 0 {
                    self.header_block(tx, &block, on);
                } else {
                    self.block = Some(block);
                }
            }
            CONTINUATION => {
                if let Some(mut block) = self.block.take() {
                    block.block.extend_from_slice(payload);
                    if block.block.len() > MAX_HEADER_BLOCK {
                        return self.end_all(tx, "header block too long", on);
                    }
                    if flags & END_HEADERS != 0 {
                        self.header_block(tx, &block, on);
                    } else {
                        self.block = Some(block);
                    }
                }
            }
            RST_STREAM => {
                let code = payload
                    .get(..4)
                    .map_or(0, |c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
                self.end(
                    tx,
                    stream,
                    Status::unavailable(format!("RST_STREAM, error code {code}")),
                    on,
                );
            }
            GOAWAY => self.end_all(tx, "GOAWAY", on),
            SETTINGS if flags & ACK == 0 => {
                self.settings_seen = true;
                frame_header(&mut tx.out, 0, SETTINGS, ACK, 0);
            }
            PING if flags & ACK == 0 => {
                frame_header(&mut tx.out, payload.len(), PING, ACK, 0);
                tx.out.extend_from_slice(payload);
            }
            _ => {}
        }
    }

    /// Decodes a whole header block (always, to keep the HPACK table in step).
    fn header_block(&mut self, tx: &mut Sender, block: &BlockLeft, on: &mut OnEvent<'_>) {
        let mut head = ResponseHead::default();
        let decoded = self
            .hpack
            .decode_with_cb(&block.block, |name, value| match &*name {
                b":status" => head.http = Some(value.into_owned()),
                b"grpc-status" => {
                    head.grpc = std::str::from_utf8(&value)
                        .ok()
                        .and_then(|v| v.parse().ok());
                }
                b"grpc-message" => head.message = String::from_utf8_lossy(&value).into_owned(),
                _ => {}
            });
        if let Err(e) = decoded {
            return self.end_all(tx, &format!("HPACK: {e}"), on);
        }
        if block.end_stream {
            self.end(tx, block.stream, head.status(), on);
        } else if head.http.as_deref() == Some(b"200") && tx.is_open(block.stream) {
            on(tx, Event::Headers(block.stream));
        }
    }
}

fn frame_len(head: &[u8]) -> usize {
    u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize
}

fn stream_of(head: &[u8]) -> u32 {
    u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff
}

struct Entry<T> {
    sock: Option<TcpStream>,
    rx: Receiver,
    tx: Sender,
    state: T,
}

/// Connections read by the calling thread from one epoll set, each with its user's
/// state `T`.
pub(super) struct Conns<T> {
    poll: Poll,
    events: Events,
    entries: Vec<Entry<T>>,
    scratch: Box<[u8]>,
    /// The longest pass over the sockets one `epoll_wait` found ready (reading them
    /// and handling what they brought), since this was last reset.
    pub(super) longest_pass: Duration,
}

impl<T> Conns<T> {
    pub(super) fn new() -> anyhow::Result<Self> {
        Ok(Self {
            poll: Poll::new().context("epoll")?,
            events: Events::with_capacity(1024),
            entries: Vec::new(),
            scratch: vec![0; 64 * 1024].into_boxed_slice(),
            longest_pass: Duration::ZERO,
        })
    }

    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Connects (TCP_NODELAY), sends the preface and SETTINGS; returns the index.
    pub(super) fn connect(
        &mut self,
        addr: SocketAddr,
        windows: Windows,
        state: T,
    ) -> anyhow::Result<usize> {
        let i = self.entries.len();
        let sock =
            std::net::TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
        sock.set_nodelay(true)?;
        sock.set_nonblocking(true)?;
        let mut sock = TcpStream::from_std(sock);
        self.poll.registry().register(
            &mut sock,
            Token(i),
            Interest::READABLE | Interest::WRITABLE,
        )?;
        self.entries.push(Entry {
            sock: Some(sock),
            rx: Receiver::default(),
            tx: Sender::new(windows),
            state,
        });
        self.flush(i);
        Ok(i)
    }

    /// Connects `n` more connections (`state` makes each one's state),
    /// [`CONNECT_CHUNK`] at a time, each chunk accepted by the server (its SETTINGS
    /// read) before the next, so the server's accept backlog stays short.
    pub(super) fn connect_many(
        &mut self,
        addr: SocketAddr,
        n: usize,
        windows: Windows,
        what: &str,
        mut state: impl FnMut() -> T,
    ) -> anyhow::Result<()> {
        let pb = crate::bar(n, what);
        let end = self.len() + n;
        while self.len() < end {
            let first = self.len();
            let chunk = (end - first).min(CONNECT_CHUNK);
            for _ in 0..chunk {
                self.connect(addr, windows, state())?;
            }
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while (first..first + chunk).any(|i| !self.accepted(i)) {
                if std::time::Instant::now() > deadline {
                    anyhow::bail!("the server did not accept a connection within 10 s");
                }
                self.pump(Duration::from_millis(100), |_, _, _, _| {})?;
            }
            pb.inc(chunk as u64);
        }
        pb.finish_and_clear();
        Ok(())
    }

    /// Whether connection `i`'s server has sent its SETTINGS.
    fn accepted(&self, i: usize) -> bool {
        self.entries[i].rx.settings_seen
    }

    /// Queues requests on connection `i` through `f` and writes them.
    pub(super) fn send<R>(&mut self, i: usize, f: impl FnOnce(&mut Sender, &mut T) -> R) -> R {
        let e = &mut self.entries[i];
        let r = f(&mut e.tx, &mut e.state);
        self.flush(i);
        r
    }

    /// Writes what is queued on connection `i` as far as its socket takes it (the
    /// rest when it is writable again); closes it if asked to.
    fn flush(&mut self, i: usize) {
        let e = &mut self.entries[i];
        let Some(sock) = e.sock.as_mut() else {
            return;
        };
        let mut failed = None;
        while !e.tx.out.is_empty() {
            match sock.write(&e.tx.out) {
                Ok(0) => {
                    failed = Some(io::Error::from(io::ErrorKind::WriteZero));
                    break;
                }
                Ok(n) => {
                    e.tx.out.drain(..n);
                }
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => break,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => {
                    failed = Some(err);
                    break;
                }
            }
        }
        if let Some(err) = failed {
            // The socket is dead: epoll reports it, and the read that follows fails
            // or sees the end, which ends the streams still open.
            e.tx.out.clear();
            tracing::debug!(conn = i, error = %err, "write failed");
        }
        if e.tx.close {
            if let Some(mut sock) = e.sock.take() {
                let _ = self.poll.registry().deregister(&mut sock);
            }
        }
    }

    /// Waits up to `timeout` for sockets to become ready, reads each, and hands
    /// every event to `on` with its connection's index, its sender and its state.
    pub(super) fn pump(
        &mut self,
        timeout: Duration,
        mut on: impl FnMut(usize, &mut Sender, &mut T, Event<'_>),
    ) -> anyhow::Result<()> {
        match self.poll.poll(&mut self.events, Some(timeout)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(()),
            Err(e) => return Err(e).context("epoll_wait"),
        }
        let pass = std::time::Instant::now();
        let ready: Vec<(usize, bool, bool)> = self
            .events
            .iter()
            .map(|ev| {
                let closed = ev.is_read_closed() || ev.is_error();
                (ev.token().0, ev.is_readable() || closed, closed)
            })
            .collect();
        for (i, readable, closed) in ready {
            let Some(e) = self.entries.get_mut(i) else {
                continue;
            };
            if readable {
                let Entry {
                    sock,
                    rx,
                    tx,
                    state,
                } = e;
                let mut handle = |tx: &mut Sender, ev: Event<'_>| on(i, tx, state, ev);
                while let (Some(s), false) = (sock.as_mut(), rx.ended) {
                    match s.read(&mut self.scratch) {
                        Ok(0) => rx.end_all(tx, "connection closed", &mut handle),
                        Ok(n) => {
                            rx.receive(tx, &self.scratch[..n], &mut handle);
                            // A short read emptied the socket: more data is a new
                            // readiness edge, so the read that would only say
                            // "would block" is skipped (unless the peer closed,
                            // which no later edge would report).
                            if n < self.scratch.len() && !closed {
                                break;
                            }
                        }
                        Err(err) if err.kind() == io::ErrorKind::WouldBlock => break,
                        Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                        Err(err) => rx.end_all(tx, &format!("read: {err}"), &mut handle),
                    }
                }
                if rx.ended {
                    tx.close = true;
                }
            }
            self.flush(i);
        }
        self.longest_pass = self.longest_pass.max(pass.elapsed());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data_frame(payload: &[u8], flags: u8, stream: u32) -> Vec<u8> {
        let mut f = Vec::new();
        frame_header(&mut f, payload.len(), DATA, flags, stream);
        f.extend_from_slice(payload);
        f
    }

    fn headers(fields: &[(&[u8], &[u8])], end_stream: bool, stream: u32) -> Vec<u8> {
        let block = loona_hpack::Encoder::new().encode(fields.iter().copied());
        // Split into HEADERS and a CONTINUATION to exercise both.
        let (a, b) = block.split_at(block.len() / 2);
        let mut f = Vec::new();
        frame_header(
            &mut f,
            a.len(),
            HEADERS,
            if end_stream { END_STREAM } else { 0 },
            stream,
        );
        f.extend_from_slice(a);
        frame_header(&mut f, b.len(), CONTINUATION, END_HEADERS, stream);
        f.extend_from_slice(b);
        f
    }

    fn summary(events: &[(u32, String)]) -> Vec<String> {
        events.iter().map(|(s, e)| format!("{s}: {e}")).collect()
    }

    fn windows() -> Windows {
        Windows {
            stream: 64 * 1024,
            connection: 256 * 1024,
        }
    }

    #[test]
    fn a_response_split_anywhere_gives_the_same_events_and_acks() {
        let mut wire = Vec::new();
        frame_header(&mut wire, 6, SETTINGS, 0, 0);
        wire.extend_from_slice(&[0, 3, 0, 0, 0, 100]);
        wire.extend(headers(
            &[(b":status", b"200"), (b"content-type", b"application/grpc")],
            false,
            1,
        ));
        wire.extend(data_frame(b"hel", 0, 1));
        let mut padded = vec![2];
        padded.extend_from_slice(b"lo");
        padded.extend_from_slice(&[0, 0]);
        wire.extend(data_frame(&padded, PADDED, 1));
        frame_header(&mut wire, 8, PING, 0, 0);
        wire.extend_from_slice(b"12345678");
        // Stream 3: a trailers-only error; stream 1: trailers with OK.
        wire.extend(headers(
            &[
                (b":status", b"200"),
                (b"grpc-status", b"10"),
                (b"grpc-message", b"slow"),
            ],
            true,
            3,
        ));
        wire.extend(headers(&[(b"grpc-status", b"0")], true, 1));
        wire.extend(data_frame(b"after the end", 0, 1));
        for cut in [1, 2, 9, 10, 20, wire.len()] {
            let (mut rx, mut tx) = (Receiver::default(), Sender::new(windows()));
            let call = Call::new(
                "127.0.0.1:1".parse().unwrap(),
                "/a/B",
                &prost_types::Duration::default(),
            );
            assert_eq!((tx.send(&call), tx.send(&call)), (1, 3));
            tx.out.clear();
            let mut events = Vec::new();
            let mut body = Vec::new();
            for chunk in wire.chunks(cut) {
                rx.receive(&mut tx, chunk, &mut |_, ev| match ev {
                    Event::Data(s, d) => {
                        assert_eq!(s, 1);
                        body.extend_from_slice(d);
                    }
                    Event::Headers(s) => events.push((s, "headers".to_owned())),
                    Event::End(s, st) => {
                        events.push((s, format!("{:?} {}", st.code(), st.message())));
                    }
                });
            }
            assert_eq!(body, b"hello", "reads of {cut} bytes");
            let got = summary(&events);
            assert_eq!(
                got,
                ["1: headers", "3: Aborted slow", "1: Ok "],
                "reads of {cut} bytes"
            );
            let mut acks = Vec::new();
            frame_header(&mut acks, 0, SETTINGS, ACK, 0);
            frame_header(&mut acks, 8, PING, ACK, 0);
            acks.extend_from_slice(b"12345678");
            assert_eq!(tx.out, acks, "reads of {cut} bytes");
            assert!(tx.open.is_empty());
        }
    }

    #[test]
    fn windows_are_handed_back_at_half_and_goaway_ends_every_stream() {
        let (mut rx, mut tx) = (Receiver::default(), Sender::new(windows()));
        let call = Call::new(
            "127.0.0.1:1".parse().unwrap(),
            "/a/B",
            &prost_types::Duration::default(),
        );
        let (a, b) = (tx.send(&call), tx.send(&call));
        tx.out.clear();
        let mut ends = Vec::new();
        let half = 32 * 1024;
        for _ in 0..4 {
            rx.receive(
                &mut tx,
                &data_frame(&vec![0; half / 2], 0, a),
                &mut |_, _| {},
            );
        }
        // Stream `a`: 64 KiB read, two updates of 32 KiB; the connection: none yet
        // (its half is 128 KiB).
        let mut updates = Vec::new();
        for _ in 0..2 {
            frame_header(&mut updates, 4, WINDOW_UPDATE, 0, a);
            updates.extend_from_slice(&u32::try_from(half).unwrap().to_be_bytes());
        }
        assert_eq!(tx.out, updates);
        let mut goaway = Vec::new();
        frame_header(&mut goaway, 8, GOAWAY, 0, 0);
        goaway.extend_from_slice(&[0; 8]);
        rx.receive(&mut tx, &goaway, &mut |_, ev| {
            if let Event::End(s, st) = ev {
                ends.push((s, st.code()));
            }
        });
        assert_eq!(ends, [(a, Code::Unavailable), (b, Code::Unavailable)]);
        assert!(rx.ended);
    }

    #[test]
    fn the_opening_is_a_preface_settings_and_the_connection_window() {
        let tx = Sender::new(windows());
        assert!(tx.out.starts_with(PREFACE));
        let o = &tx.out[PREFACE.len()..];
        assert_eq!((o[3], frame_len(o)), (SETTINGS, 12));
        let wu = &o[9 + 12..];
        assert_eq!((wu[3], stream_of(wu)), (WINDOW_UPDATE, 0));
        assert_eq!(
            u32::from_be_bytes(wu[9..13].try_into().unwrap()),
            256 * 1024 - DEFAULT_WINDOW
        );
    }

    /// Responses from the h2 crate's server (hyper's), whose HPACK encoder indexes
    /// and evicts: every status must come out as sent, however the table evolves.
    #[tokio::test]
    async fn statuses_from_an_h2_server_decode_as_sent() {
        const CALLS: usize = 300;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut conn = h2::server::handshake(tcp).await.unwrap();
            let mut k = 0usize;
            while let Some(request) = conn.accept().await {
                let (_, mut respond) = request.unwrap();
                let code = [0, 10, 5, 0, 14][k % 5];
                let response = http::Response::builder()
                    .status(200)
                    .header("content-type", "application/grpc")
                    .body(())
                    .unwrap();
                let mut send = respond.send_response(response, false).unwrap();
                send.send_data(Bytes::from(vec![0, 0, 0, 0, 1, k as u8]), false)
                    .unwrap();
                let mut trailers = http::HeaderMap::new();
                trailers.insert("grpc-status", code.to_string().parse().unwrap());
                trailers.insert(
                    "grpc-message",
                    format!("call {k} of {}", k * 7919 % 1000).parse().unwrap(),
                );
                send.send_trailers(trailers).unwrap();
                k += 1;
            }
        });
        let statuses = tokio::task::spawn_blocking(move || {
            let mut sock = std::net::TcpStream::connect(addr).unwrap();
            let (mut rx, mut tx) = (Receiver::default(), Sender::new(windows()));
            let call = Call::new(addr, "/a/B", &prost_types::Duration::default());
            let mut got = Vec::new();
            let mut buf = vec![0; 4096];
            for _ in 0..CALLS {
                tx.send(&call);
            }
            while got.len() < CALLS {
                sock.write_all(&std::mem::take(&mut tx.out)).unwrap();
                let n = sock.read(&mut buf).unwrap();
                assert!(n > 0, "the server closed the connection");
                rx.receive(&mut tx, &buf[..n], &mut |_, ev| {
                    if let Event::End(s, st) = ev {
                        got.push((s, st.code() as i32, st.message().to_owned()));
                    }
                });
            }
            got
        })
        .await
        .unwrap();
        server.abort();
        for (k, (stream, code, message)) in statuses.iter().enumerate() {
            assert_eq!(*stream, 1 + 2 * k as u32);
            assert_eq!(*code, [0, 10, 5, 0, 14][k % 5], "call {k}");
            assert_eq!(
                *message,
                format!("call {k} of {}", k * 7919 % 1000),
                "call {k}"
            );
        }
    }
}
