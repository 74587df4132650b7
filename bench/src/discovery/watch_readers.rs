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
        readers
            .conns
            .connect_many(addr, n, WINDOWS, what, Watcher::default)?;
        for i in 0..n {
            readers.conns.send(i, |tx, w| w.stream = tx.send(&call));
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut failed = None;
        let (mut snapshot, mut waiting) = (vec![false; n], n);
        while waiting > 0 {
            if Instant::now() > deadline {
                bail!("a watcher got no snapshot within 30 s");
            }
            readers.pump(Duration::from_millis(100), |i, d| match d {
                Delivery::Message(_) => {
                    if !std::mem::replace(&mut snapshot[i], true) {
                        waiting -= 1;
                    }
                }
                Delivery::Ended(status) => failed = Some(status),
            })?;
            if let Some(status) = failed.take() {
                bail!("a watcher's stream ended before its snapshot: {status}");
            }
        }
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
                        Ok(Some(m)) => on(i, Delivery::Message(m)),
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
