//! The fan-out's watchers: Watch streams of one cluster, each on its own connection,
//! all read by one thread ([`Conns`]).

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::bail;
use bytes::Bytes;
use tonic::Status;

use super::{
    h2conn::{Call, Conns, Event},
    wire::{Deframer, Windows},
};
use wirespan_discovery::proto::server::WatchRequest;

/// Watchers connected at once while opening, so the server's accept backlog stays
/// short.
const OPEN_CHUNK: usize = 64;

/// The protocol's default windows, as the h2 and tonic clients use them.
const WINDOWS: Windows = Windows {
    stream: 65_535,
    connection: 65_535,
};

/// What a watcher's stream delivered.
pub(super) enum Delivery {
    /// A gRPC message, its 5-byte prefix removed.
    Message(Bytes),
    /// The stream ended (after this, nothing more comes from it).
    Ended(Status),
}

#[derive(Default)]
struct Watcher {
    stream: u32,
    messages: Deframer,
    messages_seen: usize,
}

/// Watchers of one cluster, read by the calling thread.
pub(super) struct WatchReaders {
    conns: Conns<Watcher>,
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
            conns: Conns::new()?,
        };
        let call = Call::new(
            addr,
            "/sidero.discovery.server.Cluster/Watch",
            &WatchRequest {
                cluster_id: cluster.to_owned(),
            },
        );
        let pb = crate::bar(n, what);
        while readers.len() < n {
            let first = readers.len();
            let chunk = (n - first).min(OPEN_CHUNK);
            for _ in 0..chunk {
                let i = readers.conns.connect(addr, WINDOWS, Watcher::default())?;
                readers.conns.send(i, |tx, w| w.stream = tx.send(&call));
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut failed = None;
            while (first..first + chunk).any(|i| readers.conns.state(i).messages_seen == 0) {
                if Instant::now() > deadline {
                    bail!("a watcher got no snapshot within 10 s");
                }
                readers.pump(Duration::from_millis(100), |_, d| {
                    if let Delivery::Ended(status) = d {
                        failed = Some(status);
                    }
                })?;
                if let Some(status) = failed.take() {
                    bail!("a watcher's stream ended before its snapshot: {status}");
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
        self.conns.pump(timeout, |i, tx, w, ev| match ev {
            Event::Data(s, data) if s == w.stream => {
                w.messages.push(data);
                loop {
                    match w.messages.next() {
                        Ok(Some(m)) => {
                            w.messages_seen += 1;
                            on(i, Delivery::Message(m));
                        }
                        Ok(None) => break,
                        Err(status) => {
                            // Nothing after an unreadable message can be read.
                            tx.close = true;
                            w.stream = 0;
                            on(i, Delivery::Ended(status));
                            break;
                        }
                    }
                }
            }
            Event::End(s, status) if s == w.stream => {
                w.stream = 0;
                on(i, Delivery::Ended(status));
            }
            _ => {}
        })
    }
}
