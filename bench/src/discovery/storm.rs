//! The join storm: `n` nodes join one cluster at once and each waits until its Watch
//! holds all `n`.
//!
//! One process plays every node, so what a node keeps must not grow with what it
//! receives: each of the `n` streams carries about `n` affiliates (≈ 3.4 MB per
//! stream, 34 GB in all at 10,240 nodes). Every node is a connection of one
//! [`Conns`] set, read by one thread; its Watch body is parsed as the bytes arrive,
//! keeping only a bit per node (which affiliates it holds) and at most one affiliate
//! entry of unparsed bytes; a tonic stream would buffer each whole message (a
//! snapshot of the cluster) per node first. Each connection also gets a small HTTP/2
//! window, so data a node has not read yet waits on the server, as it does for a real
//! slow client.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::bail;
use bytes::{Buf as _, BufMut as _, BytesMut};
use tonic::Code;
use wirespan_discovery::proto::server::*;

use super::{
    affiliate_id,
    h2conn::{Call, Conns, Event, Sender},
    ttl,
    wire::Windows,
    DATA_LEN,
};
use crate::bar;

/// How long the join storm may take before it is reported as not converged.
const STORM_LIMIT: Duration = Duration::from_secs(120);

/// HTTP/2 window of each node's Watch stream: unread Watch data beyond it stays on the
/// server (the client library's default of 2 MiB times 10,240 nodes would let the
/// load generator buffer 20 GiB; 64 KiB bounds it at 640 MiB). Each half window's
/// worth costs a WINDOW_UPDATE, which the server must read and act on.
const NODE_WINDOW: u32 = 64 * 1024;

/// The connection's window exceeds the stream's, so Watch data a node has not read
/// yet never holds back the responses to its other calls on the same connection.
const NODE_CONNECTION_WINDOW: u32 = 4 * NODE_WINDOW;

/// Longest affiliate entry (or other field) a reader holds while it is incomplete.
/// The server's largest is ~4.5 KiB (2 KiB data, 64 endpoints).
const MAX_FIELD: usize = 1 << 20;

pub(super) struct Storm {
    pub(super) nodes: usize,
    pub(super) converged: usize,
    pub(super) elapsed: Duration,
    pub(super) aborted: usize,
    /// The load generator's longest pass over its ready sockets: a node's data waited
    /// at most about this long to be read once it arrived.
    pub(super) longest_pass: Duration,
    /// Watch body bytes the nodes read in all.
    pub(super) bytes: u64,
}

/// Why a Watch body could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(super) enum ReadError {
    #[error("compressed Watch message (flag {0})")]
    Compressed(u8),
    #[error("malformed varint in a Watch message")]
    Varint,
    #[error("Watch message field of {0} bytes (limit {MAX_FIELD})")]
    FieldTooLong(u64),
    #[error("Watch message field crosses the message end")]
    Overrun,
    #[error("unsupported wire type {0} in a Watch message")]
    WireType(u64),
}

/// Reads a varint from the front of `buf`: `Ok(None)` if it is incomplete.
fn varint(buf: &[u8]) -> Result<Option<(u64, usize)>, ReadError> {
    let mut value = 0u64;
    for (i, b) in buf.iter().enumerate().take(10) {
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Ok(Some((value, i + 1)));
        }
    }
    if buf.len() >= 10 {
        Err(ReadError::Varint)
    } else {
        Ok(None)
    }
}

/// The `id` (field 1) of an encoded `Affiliate`.
fn affiliate_id_of(mut entry: &[u8]) -> Result<Option<&[u8]>, ReadError> {
    while !entry.is_empty() {
        let (key, n) = varint(entry)?.ok_or(ReadError::Overrun)?;
        entry = &entry[n..];
        match key & 7 {
            0 => {
                let (_, n) = varint(entry)?.ok_or(ReadError::Overrun)?;
                entry = &entry[n..];
            }
            2 => {
                let (len, n) = varint(entry)?.ok_or(ReadError::Overrun)?;
                let end = usize::try_from(len)
                    .ok()
                    .and_then(|l| l.checked_add(n))
                    .filter(|&e| e <= entry.len())
                    .ok_or(ReadError::Overrun)?;
                if key >> 3 == 1 {
                    return Ok(Some(&entry[n..end]));
                }
                entry = &entry[end..];
            }
            t => return Err(ReadError::WireType(t)),
        }
    }
    Ok(None)
}

/// Parses a Watch response body (gRPC-framed `WatchResponse`s) as it arrives, keeping
/// only the current message's affiliate indices and the bytes of one incomplete
/// item.
#[derive(Debug, Default)]
pub(super) struct WatchReader {
    buf: BytesMut,
    /// Bytes of the current message not parsed yet; `None` between messages.
    left: Option<usize>,
    /// Indices of the current message's affiliates (IDs that `index` knows).
    indices: Vec<usize>,
    deleted: bool,
    /// What the item kept in `buf` needs.
    need: Need,
}

/// How many bytes the next item (message prefix or field) needs, from its start.
#[derive(Debug, Clone, Copy, Default)]
enum Need {
    Total(usize),
    /// Its length is in a varint not yet complete.
    #[default]
    Unknown,
}

impl WatchReader {
    /// Feeds the next body bytes; calls `message(indices, deleted)` for each message
    /// they complete. `index` maps an affiliate ID to a node index. Bytes are parsed
    /// where they lie; only an item cut off at the end of `chunk` is kept, and
    /// completed from the next chunk with just the bytes it needs.
    pub(super) fn feed(
        &mut self,
        mut chunk: &[u8],
        index: impl Fn(&[u8]) -> Option<usize>,
        mut message: impl FnMut(&[usize], bool),
    ) -> Result<(), ReadError> {
        while !self.buf.is_empty() {
            if chunk.is_empty() {
                return Ok(());
            }
            let take = match self.need {
                Need::Total(total) => total.saturating_sub(self.buf.len()).max(1),
                // Enough for any varint.
                Need::Unknown => 16,
            }
            .min(chunk.len());
            self.buf.put_slice(&chunk[..take]);
            chunk = &chunk[take..];
            let kept = std::mem::take(&mut self.buf);
            let parsed = self.parse(&kept, &index, &mut message);
            self.buf = kept;
            let (used, need) = parsed?;
            self.buf.advance(used);
            self.need = need;
        }
        let (used, need) = self.parse(chunk, &index, &mut message)?;
        self.buf.put_slice(&chunk[used..]);
        self.need = need;
        Ok(())
    }

    /// Parses the whole items at the start of `src`: how many bytes they took, and
    /// what the next one needs.
    fn parse(
        &mut self,
        src: &[u8],
        index: &impl Fn(&[u8]) -> Option<usize>,
        message: &mut impl FnMut(&[usize], bool),
    ) -> Result<(usize, Need), ReadError> {
        let mut at = 0;
        loop {
            let rest = &src[at..];
            let Some(left) = self.left else {
                if rest.len() < 5 {
                    return Ok((at, Need::Total(5)));
                }
                if rest[0] != 0 {
                    return Err(ReadError::Compressed(rest[0]));
                }
                let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]);
                at += 5;
                self.left = Some(len as usize);
                self.indices.clear();
                self.deleted = false;
                continue;
            };
            if left == 0 {
                message(&self.indices, self.deleted);
                self.left = None;
                continue;
            }
            // One whole field of the message, or what it needs.
            let avail = &rest[..rest.len().min(left)];
            // A varint cut off by the message's end cannot be completed.
            let incomplete = || {
                if avail.len() < rest.len() {
                    Err(ReadError::Overrun)
                } else {
                    Ok((at, Need::Unknown))
                }
            };
            let Some((key, k)) = varint(avail)? else {
                return incomplete();
            };
            let used = match key & 7 {
                0 => {
                    let Some((value, n)) = varint(&avail[k..])? else {
                        return incomplete();
                    };
                    if key >> 3 == 2 {
                        self.deleted = value != 0;
                    }
                    k + n
                }
                2 => {
                    let Some((len, n)) = varint(&avail[k..])? else {
                        return incomplete();
                    };
                    let len_usize = usize::try_from(len)
                        .ok()
                        .filter(|&l| l <= MAX_FIELD)
                        .ok_or(ReadError::FieldTooLong(len))?;
                    let used = k + n + len_usize;
                    if used > left {
                        return Err(ReadError::Overrun);
                    }
                    if avail.len() < used {
                        return Ok((at, Need::Total(used)));
                    }
                    if key >> 3 == 1 {
                        if let Some(i) = affiliate_id_of(&avail[k + n..used])?.and_then(index) {
                            self.indices.push(i);
                        }
                    }
                    used
                }
                t => return Err(ReadError::WireType(t)),
            };
            at += used;
            self.left = Some(left - used);
        }
    }
}

/// Which nodes one node holds, a bit each.
struct Held {
    bits: Vec<u64>,
    count: usize,
}

impl Held {
    fn new(n: usize) -> Self {
        Self {
            bits: vec![0; n.div_ceil(64)],
            count: 0,
        }
    }

    fn apply(&mut self, indices: &[usize], deleted: bool) {
        for &k in indices {
            let (word, bit) = (k / 64, 1u64 << (k % 64));
            let held = self.bits[word] & bit != 0;
            if held == deleted {
                self.bits[word] ^= bit;
                if deleted {
                    self.count -= 1;
                } else {
                    self.count += 1;
                }
            }
        }
    }
}

/// The storm's node index from its affiliate ID (`node` + 40 digits). Runs for every
/// affiliate every node receives (10⁸ times at 10,240 nodes), hence no `str::parse`.
fn node_index(id: &[u8]) -> Option<usize> {
    let digits = id.strip_prefix(b"node").filter(|d| !d.is_empty())?;
    // The storm's own IDs: 40 digits, all but the last few zeros; the zeros are
    // compared as one slice and only the rest is parsed.
    const TAIL: usize = 8;
    if digits.len() == 40 && digits[..40 - TAIL] == [b'0'; 40 - TAIL] {
        return parse_digits(&digits[40 - TAIL..]);
    }
    parse_digits(digits)
}

fn parse_digits(digits: &[u8]) -> Option<usize> {
    digits.iter().try_fold(0usize, |v, &b| {
        let digit = b.checked_sub(b'0').filter(|d| *d < 10)?;
        v.checked_mul(10)?.checked_add(usize::from(digit))
    })
}

/// What one node knows: the affiliates its current Watch has shown it.
struct NodeView {
    n: usize,
    reader: WatchReader,
    held: Held,
    /// Body bytes read (for error reports).
    bytes: u64,
}

impl NodeView {
    fn new(n: usize) -> Self {
        Self {
            n,
            reader: WatchReader::default(),
            held: Held::new(n),
            bytes: 0,
        }
    }

    fn feed(&mut self, data: &[u8]) -> Result<(), ReadError> {
        self.bytes += data.len() as u64;
        let (n, held) = (self.n, &mut self.held);
        self.reader.feed(
            data,
            |id| node_index(id).filter(|&k| k < n),
            |indices, deleted| held.apply(indices, deleted),
        )
    }

    fn converged(&self) -> bool {
        self.held.count == self.n
    }
}

/// Where a node is in joining.
enum Phase {
    /// Connected, nothing sent yet.
    Idle,
    /// Hello sent on this stream.
    Hello(u32),
    /// Watch sent on this stream; `view` is what it has shown so far.
    Watch { stream: u32, view: NodeView },
    /// It held all `n`; its connection is closed.
    Converged,
}

/// One node: Hello, Watch, and (once) AffiliateUpdate as soon as its Watch is open,
/// reading the Watch all the while as a real client reads its stream in a task of its
/// own; then it reads until it holds all `n`. A watch aborted as slow is
/// re-established (Hello + Watch, fresh snapshot) as a real client does.
struct Node {
    phase: Phase,
    /// AffiliateUpdate's stream, once sent.
    update: Option<u32>,
}

/// The requests every node sends alike.
struct Calls {
    addr: SocketAddr,
    hello: Call,
    watch: Call,
}

/// What the storm counts while it runs.
#[derive(Default)]
struct Tally {
    converged: usize,
    aborted: usize,
    /// Watch body bytes the nodes read.
    bytes: u64,
}

impl Node {
    /// Advances node `i` by one event of its connection.
    fn step(
        &mut self,
        i: usize,
        n: usize,
        tx: &mut Sender,
        ev: Event<'_>,
        calls: &Calls,
        tally: &mut Tally,
    ) -> anyhow::Result<()> {
        match (&mut self.phase, ev) {
            (Phase::Hello(s), Event::End(e, status)) if *s == e => {
                if status.code() != Code::Ok {
                    bail!("node {i}: Hello failed: {status}");
                }
                self.phase = Phase::Watch {
                    stream: tx.send(&calls.watch),
                    view: NodeView::new(n),
                };
            }
            (Phase::Watch { stream, .. }, Event::Headers(s))
                if *stream == s && self.update.is_none() =>
            {
                self.update = Some(tx.send(&update_call(calls.addr, i)));
            }
            (Phase::Watch { stream, view }, Event::Data(s, data)) if *stream == s => {
                view.feed(data)?;
                tally.bytes += data.len() as u64;
                if view.converged() {
                    self.phase = Phase::Converged;
                    tx.close = true;
                    tally.converged += 1;
                }
            }
            (Phase::Watch { stream, view }, Event::End(s, status)) if *stream == s => {
                if status.code() != Code::Aborted {
                    bail!(
                        "node {i}: its Watch ended ({:?}: {:?}) after {} bytes, holding {} of {n} \
                         affiliates{}",
                        status.code(),
                        status.message(),
                        view.bytes,
                        view.held.count,
                        if view.reader.left.is_some() {
                            ", in the middle of a message"
                        } else {
                            ""
                        },
                    );
                }
                tally.aborted += 1;
                self.phase = Phase::Hello(tx.send(&calls.hello));
            }
            (_, Event::End(s, status)) if self.update == Some(s) && status.code() != Code::Ok => {
                bail!("node {i}: AffiliateUpdate failed: {status}");
            }
            _ => {}
        }
        Ok(())
    }
}

fn update_call(addr: SocketAddr, i: usize) -> Call {
    Call::new(
        addr,
        "/sidero.discovery.server.Cluster/AffiliateUpdate",
        &AffiliateUpdateRequest {
            cluster_id: CLUSTER.into(),
            affiliate_id: affiliate_id(i),
            affiliate_data: Some(vec![0x42; DATA_LEN]),
            affiliate_endpoints: vec![vec![i as u8; 16]],
            ttl: ttl(),
        },
    )
}

const CLUSTER: &str = "storm";

/// `n` nodes join one cluster at once; each waits until its watch holds all `n`.
/// Every node is a connection read by one thread (see [`Conns`]).
pub(super) async fn storm(addr: SocketAddr, n: usize) -> anyhow::Result<Storm> {
    tokio::task::spawn_blocking(move || run(addr, n)).await?
}

fn run(addr: SocketAddr, n: usize) -> anyhow::Result<Storm> {
    let windows = Windows {
        stream: NODE_WINDOW,
        connection: NODE_CONNECTION_WINDOW,
    };
    let mut conns = Conns::new()?;
    conns.connect_many(addr, n, windows, "connecting nodes", || Node {
        phase: Phase::Idle,
        update: None,
    })?;
    let calls = Calls {
        addr,
        hello: Call::new(
            addr,
            "/sidero.discovery.server.Cluster/Hello",
            &HelloRequest {
                cluster_id: CLUSTER.into(),
                client_version: "v1.8.3".into(),
            },
        ),
        watch: Call::new(
            addr,
            "/sidero.discovery.server.Cluster/Watch",
            &WatchRequest {
                cluster_id: CLUSTER.into(),
            },
        ),
    };
    let pb = bar(n, "join storm: converged");
    conns.longest_pass = Duration::ZERO;
    let start = Instant::now();
    for i in 0..n {
        conns.send(i, |tx, node| {
            node.phase = Phase::Hello(tx.send(&calls.hello));
        });
    }
    let mut tally = Tally::default();
    let mut failure = None;
    while tally.converged < n && start.elapsed() < STORM_LIMIT {
        conns.pump(Duration::from_millis(50), |i, tx, node, ev| {
            if failure.is_none() {
                failure = node.step(i, n, tx, ev, &calls, &mut tally).err();
            }
        })?;
        if let Some(e) = failure.take() {
            return Err(e);
        }
        pb.set_position(tally.converged as u64);
    }
    let elapsed = start.elapsed();
    pb.finish_and_clear();
    Ok(Storm {
        nodes: n,
        converged: tally.converged,
        elapsed,
        aborted: tally.aborted,
        longest_pass: conns.longest_pass,
        bytes: tally.bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(m: &WatchResponse) -> Vec<u8> {
        crate::discovery::wire::frame(m).to_vec()
    }

    fn affiliate(i: usize) -> Affiliate {
        Affiliate {
            id: affiliate_id(i),
            data: vec![0x42; 300],
            endpoints: vec![vec![1; 16], vec![2; 32]],
        }
    }

    /// Every split of a body into chunks (down to one byte at a time) yields the same
    /// messages, and the reader never holds more than one field's bytes.
    #[test]
    fn reader_parses_messages_split_anywhere() {
        let snapshot = WatchResponse {
            affiliates: (0..5).map(affiliate).collect(),
            deleted: false,
        };
        let delete = WatchResponse {
            affiliates: vec![Affiliate {
                id: affiliate_id(3),
                ..Affiliate::default()
            }],
            deleted: true,
        };
        let foreign = WatchResponse {
            affiliates: vec![Affiliate {
                id: "someone-else".into(),
                ..Affiliate::default()
            }],
            deleted: false,
        };
        let empty = WatchResponse::default();
        let body = [
            framed(&empty),
            framed(&snapshot),
            framed(&delete),
            framed(&foreign),
        ]
        .concat();
        for step in [1, 2, 3, 7, 64, 333, body.len()] {
            let mut reader = WatchReader::default();
            let mut seen = Vec::new();
            let mut most = 0;
            for chunk in body.chunks(step) {
                reader
                    .feed(chunk, node_index, |ids, deleted| {
                        seen.push((ids.to_vec(), deleted));
                    })
                    .unwrap();
                most = most.max(reader.buf.len());
            }
            assert_eq!(
                seen,
                [
                    (vec![], false),
                    (vec![0, 1, 2, 3, 4], false),
                    (vec![3], true),
                    (vec![], false),
                ],
                "chunks of {step}"
            );
            // One affiliate entry is ~410 bytes.
            assert!(most < 420 + step, "held {most} bytes with chunks of {step}");
        }
    }

    #[test]
    fn reader_rejects_what_it_cannot_read() {
        let mut reader = WatchReader::default();
        assert_eq!(
            reader.feed(&[1, 0, 0, 0, 1, 0], node_index, |_, _| {}),
            Err(ReadError::Compressed(1))
        );
        // A field longer than the message.
        let mut reader = WatchReader::default();
        assert_eq!(
            reader.feed(&[0, 0, 0, 0, 3, 0x0a, 0x05, 0], node_index, |_, _| {}),
            Err(ReadError::Overrun)
        );
    }

    #[test]
    fn node_index_reads_storm_ids_only() {
        assert_eq!(node_index(affiliate_id(10_239).as_bytes()), Some(10_239));
        assert_eq!(
            node_index(affiliate_id(123_456_789).as_bytes()),
            Some(123_456_789)
        );
        assert_eq!(node_index(format!("node{:0>40}", "1x").as_bytes()), None);
        assert_eq!(
            node_index(format!("node{:1>40}", "").as_bytes()),
            None,
            "overflows"
        );
        assert_eq!(node_index(b"node0"), Some(0));
        assert_eq!(node_index(b"node12x"), None);
        assert_eq!(node_index(b"node"), None);
        assert_eq!(node_index(b"other"), None);
        assert_eq!(node_index(b"node99999999999999999999999999"), None);
    }

    #[test]
    fn held_counts_each_node_once() {
        let mut held = Held::new(130);
        held.apply(&[0, 129, 0, 64], false);
        assert_eq!(held.count, 3);
        held.apply(&[129, 5], true);
        assert_eq!(held.count, 2);
        held.apply(&[129], false);
        assert_eq!(held.count, 3);
    }
}
