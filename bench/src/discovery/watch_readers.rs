//! Watch streams read by one thread: the fan-out's watchers as a minimal HTTP/2 client
//! on one epoll loop.
//!
//! With 10,000 watchers, every update means 10,000 deliveries, and the load generator
//! reads them on the same two cores the server writes them on. Each watcher as a task
//! with an h2 connection cost the generator ~8.5 µs per delivery (a runtime wake-up,
//! the connection's state machine, a stream lock) against the server's ~12 µs, so the
//! fan-out latency measured the generator almost as much as the server. Here a
//! delivery costs the generator one `read` from a ready socket and the frame parse.
//!
//! The protocol subset is what a Watch needs: the connection preface and SETTINGS,
//! one request (HPACK literals, no dynamic table, no Huffman), DATA frames split into
//! gRPC messages with their window handed back, SETTINGS and PING acknowledged. The
//! response's header blocks are not decoded: the stream ending for any reason (its
//! trailers, RST_STREAM, GOAWAY, the connection closing) before the watcher got every
//! update is what the benchmark counts as an abort.

use std::{
    io::{self, Read as _, Write as _},
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _};
use bytes::Bytes;
use mio::{net::TcpStream, Events, Interest, Poll, Token};

use super::wire::{frame, Deframer};
use wirespan_discovery::proto::server::WatchRequest;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
/// The Watch call's stream, the connection's only one.
const STREAM: u32 = 1;
/// Received DATA bytes are handed back (WINDOW_UPDATE for the stream and the
/// connection) once this many are unreleased: a quarter of the default window.
const RELEASE_AT: usize = 16 * 1024;
/// Watchers connected at once while opening, so the server's accept backlog stays
/// short.
const OPEN_CHUNK: usize = 64;

/// What a watcher's stream delivered.
pub(super) enum Delivery {
    /// A gRPC message, its 5-byte prefix removed.
    Message(Bytes),
    /// The stream ended (after this, nothing more comes from it).
    Ended(String),
}

/// Watchers of one cluster, each on its own connection, read by the calling thread.
pub(super) struct WatchReaders {
    poll: Poll,
    events: Events,
    conns: Vec<Conn>,
    scratch: Box<[u8]>,
}

struct Conn {
    sock: TcpStream,
    /// The start of a frame not yet wholly read.
    partial: Vec<u8>,
    /// Frames not yet written (the socket was full).
    out: Vec<u8>,
    messages: Deframer,
    unreleased: usize,
    ended: bool,
}

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

/// What a watcher sends first: the preface, its SETTINGS (the defaults, push off),
/// and the Watch request (HEADERS, then the request message with END_STREAM).
fn opening(addr: SocketAddr, cluster: &str) -> Vec<u8> {
    let mut out = PREFACE.to_vec();
    frame_header(&mut out, 6, SETTINGS, 0, 0);
    out.extend_from_slice(&[0, 2, 0, 0, 0, 0]); // SETTINGS_ENABLE_PUSH = 0
    let mut block = vec![0x83, 0x86]; // :method POST, :scheme http (static table)
    block.push(0x04); // :path, literal without indexing
    hpack_string(&mut block, "/sidero.discovery.server.Cluster/Watch");
    block.push(0x01); // :authority
    hpack_string(&mut block, &addr.to_string());
    block.extend_from_slice(&[0x0f, 0x10]); // content-type (static index 31)
    hpack_string(&mut block, "application/grpc");
    block.push(0x00); // te, a name not in the static table
    hpack_string(&mut block, "te");
    hpack_string(&mut block, "trailers");
    frame_header(&mut out, block.len(), HEADERS, END_HEADERS, STREAM);
    out.extend_from_slice(&block);
    let body = frame(&WatchRequest {
        cluster_id: cluster.to_owned(),
    });
    frame_header(&mut out, body.len(), DATA, END_STREAM, STREAM);
    out.extend_from_slice(&body);
    out
}

impl Conn {
    /// Handles the whole frames at the start of `buf`; returns how many bytes they
    /// took. Stops at the stream's end.
    fn frames(&mut self, buf: &[u8], on: &mut impl FnMut(Delivery)) -> usize {
        let mut at = 0;
        while !self.ended && buf.len() - at >= 9 {
            let h = &buf[at..at + 9];
            let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
            if buf.len() - at - 9 < len {
                break;
            }
            let (kind, flags) = (h[3], h[4]);
            let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
            let payload = &buf[at + 9..at + 9 + len];
            at += 9 + len;
            match (kind, stream) {
                (DATA, STREAM) => self.data(flags, payload, on),
                (HEADERS, STREAM) if flags & END_STREAM != 0 => {
                    self.end("the server ended the stream (trailers)", on);
                }
                (RST_STREAM, STREAM) => self.end("RST_STREAM", on),
                (GOAWAY, 0) => self.end("GOAWAY", on),
                (SETTINGS, 0) if flags & ACK == 0 => {
                    frame_header(&mut self.out, 0, SETTINGS, ACK, 0);
                }
                (PING, 0) if flags & ACK == 0 => {
                    frame_header(&mut self.out, payload.len(), PING, ACK, 0);
                    self.out.extend_from_slice(payload);
                }
                _ => {}
            }
        }
        at
    }

    fn data(&mut self, flags: u8, payload: &[u8], on: &mut impl FnMut(Delivery)) {
        let data = if flags & PADDED != 0 {
            let pad = payload.first().map_or(0, |&p| usize::from(p));
            payload
                .get(1..payload.len().saturating_sub(pad))
                .unwrap_or(&[])
        } else {
            payload
        };
        self.messages.push(data);
        loop {
            match self.messages.next() {
                Ok(Some(m)) => on(Delivery::Message(m)),
                Ok(None) => break,
                Err(status) => return self.end(status.message(), on),
            }
        }
        self.unreleased += payload.len();
        if self.unreleased >= RELEASE_AT {
            let inc = u32::try_from(self.unreleased).unwrap_or(u32::MAX);
            for stream in [0, STREAM] {
                frame_header(&mut self.out, 4, WINDOW_UPDATE, 0, stream);
                self.out.extend_from_slice(&inc.to_be_bytes());
            }
            self.unreleased = 0;
        }
        if flags & END_STREAM != 0 {
            self.end("the server ended the stream without trailers", on);
        }
    }

    fn end(&mut self, why: &str, on: &mut impl FnMut(Delivery)) {
        if !self.ended {
            self.ended = true;
            on(Delivery::Ended(why.to_owned()));
        }
    }

    /// Writes what is queued, as far as the socket takes it.
    fn flush(&mut self) -> io::Result<()> {
        while !self.out.is_empty() {
            match self.sock.write(&self.out) {
                Ok(n) => {
                    self.out.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads everything the socket has, handing over what it completes. A read that
    /// does not fill `scratch` emptied the socket: data that comes after it is a new
    /// readiness edge, so the extra read that would only say "would block" (one
    /// syscall per delivery) is skipped, unless the peer also closed (no new edge
    /// would report that).
    fn read(&mut self, scratch: &mut [u8], closed: bool, on: &mut impl FnMut(Delivery)) {
        while !self.ended {
            match self.sock.read(scratch) {
                Ok(0) => self.end("connection closed", on),
                Ok(n) => {
                    let mut partial = std::mem::take(&mut self.partial);
                    if partial.is_empty() {
                        let used = self.frames(&scratch[..n], on);
                        partial.extend_from_slice(&scratch[used..n]);
                    } else {
                        partial.extend_from_slice(&scratch[..n]);
                        let used = self.frames(&partial, on);
                        partial.drain(..used);
                    }
                    self.partial = partial;
                    if n < scratch.len() && !closed {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => self.end(&format!("read: {e}"), on),
            }
        }
    }
}

impl WatchReaders {
    /// `n` watchers of `cluster`, each with its snapshot read. A watcher whose
    /// stream ends before its snapshot fails the whole set.
    pub(super) fn open(
        addr: SocketAddr,
        cluster: &str,
        n: usize,
        what: &str,
    ) -> anyhow::Result<Self> {
        let mut readers = Self {
            poll: Poll::new().context("epoll")?,
            events: Events::with_capacity(1024),
            conns: Vec::with_capacity(n),
            scratch: vec![0; 64 * 1024].into_boxed_slice(),
        };
        let opening = opening(addr, cluster);
        let pb = crate::bar(n, what);
        while readers.conns.len() < n {
            let first = readers.conns.len();
            let chunk = (n - first).min(OPEN_CHUNK);
            for i in first..first + chunk {
                let mut sock = std::net::TcpStream::connect(addr)
                    .with_context(|| format!("connecting to {addr}"))?;
                sock.set_nodelay(true)?;
                sock.write_all(&opening)
                    .context("sending the Watch request")?;
                sock.set_nonblocking(true)?;
                let mut sock = TcpStream::from_std(sock);
                readers.poll.registry().register(
                    &mut sock,
                    Token(i),
                    Interest::READABLE | Interest::WRITABLE,
                )?;
                readers.conns.push(Conn {
                    sock,
                    partial: Vec::new(),
                    out: Vec::new(),
                    messages: Deframer::default(),
                    unreleased: 0,
                    ended: false,
                });
            }
            let mut snapshots = vec![false; chunk];
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut failed = None;
            while snapshots.iter().any(|s| !s) {
                if Instant::now() > deadline {
                    bail!("a watcher got no snapshot within 10 s");
                }
                readers.pump(Duration::from_millis(100), |i, d| match d {
                    Delivery::Message(_) => {
                        if let Some(s) = i.checked_sub(first).and_then(|k| snapshots.get_mut(k)) {
                            *s = true;
                        }
                    }
                    Delivery::Ended(why) => failed = Some(why),
                })?;
                if let Some(why) = failed.take() {
                    bail!("a watcher's stream ended before its snapshot: {why}");
                }
            }
            pb.inc(chunk as u64);
        }
        pb.finish_and_clear();
        Ok(readers)
    }

    pub(super) fn len(&self) -> usize {
        self.conns.len()
    }

    /// Waits up to `timeout` for sockets to become ready, then hands every delivery
    /// they complete to `on` with its watcher's index.
    pub(super) fn pump(
        &mut self,
        timeout: Duration,
        mut on: impl FnMut(usize, Delivery),
    ) -> anyhow::Result<()> {
        match self.poll.poll(&mut self.events, Some(timeout)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(()),
            Err(e) => return Err(e).context("epoll_wait"),
        }
        for event in &self.events {
            let i = event.token().0;
            let Some(conn) = self.conns.get_mut(i) else {
                continue;
            };
            if conn.ended {
                continue;
            }
            let mut on = |d| on(i, d);
            let closed = event.is_read_closed() || event.is_error();
            if event.is_readable() || closed {
                conn.read(&mut self.scratch, closed, &mut on);
            }
            if let Err(e) = conn.flush() {
                conn.end(&format!("write: {e}"), &mut on);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data_frame(payload: &[u8], flags: u8) -> Vec<u8> {
        let mut f = Vec::new();
        frame_header(&mut f, payload.len(), DATA, flags, STREAM);
        f.extend_from_slice(payload);
        f
    }

    fn grpc(message: &[u8]) -> Vec<u8> {
        let mut m = vec![0];
        m.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
        m.extend_from_slice(message);
        m
    }

    /// A connection's frame handling alone (the socket is a throwaway loopback pair).
    fn conn() -> (Conn, std::net::TcpListener) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        s.set_nonblocking(true).unwrap();
        let c = Conn {
            sock: TcpStream::from_std(s),
            partial: Vec::new(),
            out: Vec::new(),
            messages: Deframer::default(),
            unreleased: 0,
            ended: false,
        };
        (c, l)
    }

    #[test]
    fn frames_yield_messages_acks_and_the_end_of_the_stream() {
        let (mut c, _l) = conn();
        let mut wire = Vec::new();
        frame_header(&mut wire, 6, SETTINGS, 0, 0);
        wire.extend_from_slice(&[0, 3, 0, 0, 0, 100]);
        // One message split over a plain and a padded DATA frame.
        let m = grpc(b"hello");
        wire.extend(data_frame(&m[..3], 0));
        let mut padded = vec![2];
        padded.extend_from_slice(&m[3..]);
        padded.extend_from_slice(&[0, 0]);
        wire.extend(data_frame(&padded, PADDED));
        frame_header(&mut wire, 8, PING, 0, 0);
        wire.extend_from_slice(b"12345678");
        frame_header(&mut wire, 1, HEADERS, END_STREAM | END_HEADERS, STREAM);
        wire.push(0x88);
        wire.extend(data_frame(&grpc(b"after the end"), 0));
        let mut got = Vec::new();
        // Every split of the bytes between reads gives the same result.
        for cut in [1, 9, 10, 20, wire.len()] {
            let (mut c2, _l2) = conn();
            got.clear();
            let mut partial: Vec<u8> = Vec::new();
            for chunk in wire.chunks(cut) {
                partial.extend_from_slice(chunk);
                let used = c2.frames(&partial, &mut |d| got.push(d));
                partial.drain(..used);
            }
            let summary: Vec<String> = got
                .iter()
                .map(|d| match d {
                    Delivery::Message(m) => String::from_utf8_lossy(m).into_owned(),
                    Delivery::Ended(why) => format!("ended: {why}"),
                })
                .collect();
            assert_eq!(
                summary,
                ["hello", "ended: the server ended the stream (trailers)"],
                "reads of {cut} bytes"
            );
            let mut acks = Vec::new();
            frame_header(&mut acks, 0, SETTINGS, ACK, 0);
            frame_header(&mut acks, 8, PING, ACK, 0);
            acks.extend_from_slice(b"12345678");
            assert_eq!(c2.out, acks, "reads of {cut} bytes");
        }
        // Windows are handed back once a quarter of the default is read.
        let big = grpc(&[7; RELEASE_AT]);
        let used = c.frames(&data_frame(&big, 0), &mut |_| {});
        assert_eq!(used, 9 + big.len());
        let mut updates = Vec::new();
        for stream in [0, STREAM] {
            frame_header(&mut updates, 4, WINDOW_UPDATE, 0, stream);
            updates.extend_from_slice(&u32::try_from(big.len()).unwrap().to_be_bytes());
        }
        assert_eq!(c.out, updates);
    }

    #[test]
    fn the_opening_is_a_preface_settings_and_one_request() {
        let addr: SocketAddr = "127.0.0.1:3000".parse().unwrap();
        let o = opening(addr, "c1");
        assert!(o.starts_with(PREFACE));
        let mut kinds = Vec::new();
        let mut at = PREFACE.len();
        while at < o.len() {
            let len = u32::from_be_bytes([0, o[at], o[at + 1], o[at + 2]]) as usize;
            kinds.push((o[at + 3], o[at + 4]));
            at += 9 + len;
        }
        assert_eq!(at, o.len());
        assert_eq!(
            kinds,
            [(SETTINGS, 0), (HEADERS, END_HEADERS), (DATA, END_STREAM)]
        );
    }
}
