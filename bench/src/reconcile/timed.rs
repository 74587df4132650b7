//! The adapters wrapped to timestamp their applies: each WireGuard or marking apply
//! (whole-state or delta) reports when it finished, how long it took, how many peers
//! or prefixes the kernel then holds, and whether it carried the probed prefix.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tokio::sync::mpsc;
use wirespan_control::{
    config::kubespan::FastPath,
    controllers::kubespan::{
        manager::{MarkingChoice, MarkingFactory, WireGuardFactory},
        KernelMarkingFactory, KernelWireGuard,
    },
};
use wirespan_dataplane::{
    ipnet::IpNet,
    marking::{Marking, MarkingError, MarkingSpec, MarkingStatus, PrefixDelta},
    wireguard::{PeerChange, PublicKey, WgDevice, WgError, WgStatus, WireGuard},
};

/// A prefix to look for in the next applies.
pub(super) type Probe = Arc<Mutex<Option<(PublicKey, IpNet)>>>;

fn probed(p: &Probe) -> Option<(PublicKey, IpNet)> {
    p.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}

/// One apply an adapter reported.
#[derive(Debug, Clone, Copy)]
pub(super) enum Applied {
    WireGuard {
        at: Instant,
        took: Duration,
        peers: usize,
        probe: bool,
    },
    Marking {
        at: Instant,
        took: Duration,
        prefixes: usize,
        probe: bool,
    },
}

struct TimedWg {
    inner: Box<dyn WireGuard + Send>,
    /// The peers the device holds after the applies so far.
    keys: HashSet<PublicKey>,
    tx: mpsc::UnboundedSender<Applied>,
    probe: Probe,
}

impl TimedWg {
    fn probed(&self) -> Option<(PublicKey, IpNet)> {
        probed(&self.probe)
    }
}

impl WireGuard for TimedWg {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn ensure(&mut self) -> Result<(), WgError> {
        self.inner.ensure()
    }
    fn recreated(&self) -> Option<std::sync::Arc<tokio::sync::Notify>> {
        self.inner.recreated()
    }
    fn apply(&mut self, desired: &WgDevice) -> Result<bool, WgError> {
        let t = Instant::now();
        let r = self.inner.apply(desired);
        let took = t.elapsed();
        if r.is_ok() {
            self.keys = desired.peers.iter().map(|p| p.public_key.clone()).collect();
        }
        let probe = self.probed().is_some_and(|(k, net)| {
            desired
                .peers
                .iter()
                .any(|p| p.public_key == k && p.allowed_ips.contains(&net))
        });
        let _ = self.tx.send(Applied::WireGuard {
            at: Instant::now(),
            took,
            peers: self.keys.len(),
            probe,
        });
        r
    }
    fn apply_peers(&mut self, changes: &[PeerChange]) -> Result<bool, WgError> {
        let t = Instant::now();
        let r = self.inner.apply_peers(changes);
        let took = t.elapsed();
        if r.is_ok() {
            for c in changes {
                match c {
                    PeerChange::Upsert(p) => self.keys.insert(p.public_key.clone()),
                    PeerChange::Remove(k) => self.keys.remove(k),
                };
            }
        }
        let probe = self.probed().is_some_and(|(k, net)| {
            changes.iter().any(|c| {
                matches!(c, PeerChange::Upsert(p) if p.public_key == k && p.allowed_ips.contains(&net))
            })
        });
        let _ = self.tx.send(Applied::WireGuard {
            at: Instant::now(),
            took,
            peers: self.keys.len(),
            probe,
        });
        r
    }
    fn observe(&mut self) -> Result<WgStatus, WgError> {
        self.inner.observe()
    }
    fn teardown(&mut self) -> Result<(), WgError> {
        self.inner.teardown()
    }
    fn writes(&self) -> u64 {
        self.inner.writes()
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
}

/// Builds WireGuard backends wrapped in `TimedWg`.
#[derive(Debug)]
pub(super) struct TimedWgFactory {
    pub(super) inner: KernelWireGuard,
    pub(super) tx: mpsc::UnboundedSender<Applied>,
    pub(super) probe: Probe,
}

impl WireGuardFactory for TimedWgFactory {
    fn create(&self, link: &str) -> Result<Box<dyn WireGuard + Send>, WgError> {
        Ok(Box::new(TimedWg {
            inner: self.inner.create(link)?,
            keys: HashSet::new(),
            tx: self.tx.clone(),
            probe: Arc::clone(&self.probe),
        }))
    }
}

struct TimedMarking {
    inner: Box<dyn Marking + Send>,
    /// Prefixes in the routed set after the applies so far.
    prefixes: usize,
    tx: mpsc::UnboundedSender<Applied>,
    probe: Probe,
}

impl Marking for TimedMarking {
    fn apply(&mut self, spec: &MarkingSpec) -> Result<bool, MarkingError> {
        let t = Instant::now();
        let r = self.inner.apply(spec);
        let took = t.elapsed();
        if r.is_ok() {
            self.prefixes = spec.prefixes_v4.len() + spec.prefixes_v6.len();
        }
        let probe = probed(&self.probe).is_some_and(|(_, net)| spec.prefixes_v4.contains(&net));
        let _ = self.tx.send(Applied::Marking {
            at: Instant::now(),
            took,
            prefixes: self.prefixes,
            probe,
        });
        r
    }
    fn apply_delta(&mut self, delta: &PrefixDelta) -> Result<bool, MarkingError> {
        let t = Instant::now();
        let r = self.inner.apply_delta(delta);
        let took = t.elapsed();
        if r.is_ok() {
            self.prefixes = (self.prefixes + delta.add.len()).saturating_sub(delta.remove.len());
        }
        let probe = probed(&self.probe).is_some_and(|(_, net)| delta.add.contains(&net));
        let _ = self.tx.send(Applied::Marking {
            at: Instant::now(),
            took,
            prefixes: self.prefixes,
            probe,
        });
        r
    }
    fn observe(&mut self) -> Result<MarkingStatus, MarkingError> {
        self.inner.observe()
    }
    fn teardown(&mut self) -> Result<(), MarkingError> {
        self.inner.teardown()
    }
    fn transactions(&self) -> u64 {
        self.inner.transactions()
    }
}

/// Builds marking adapters wrapped in `TimedMarking`, and records which it got.
#[derive(Debug)]
pub(super) struct TimedMarkingFactory {
    pub(super) inner: KernelMarkingFactory,
    pub(super) tx: mpsc::UnboundedSender<Applied>,
    pub(super) probe: Probe,
    /// What the manager got: (fast path in use, note).
    pub(super) chosen: Arc<Mutex<Option<(FastPath, String)>>>,
}

impl MarkingFactory for TimedMarkingFactory {
    fn create(&self, fast_path: FastPath, link: &str) -> MarkingChoice {
        let c = self.inner.create(fast_path, link);
        *self
            .chosen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some((c.fast_path, c.note.clone()));
        MarkingChoice {
            marking: Box::new(TimedMarking {
                inner: c.marking,
                prefixes: 0,
                tx: self.tx.clone(),
                probe: Arc::clone(&self.probe),
            }),
            ..c
        }
    }
}
