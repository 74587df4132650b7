//! The thread that lives in the namespace for as long as the fast path is attached:
//! it attaches the classifier to the interfaces there at start, then to every
//! selected interface that appears (netlink link events), and detaches everything
//! when told to stop.

use std::{
    io,
    sync::{Arc, Mutex},
    thread::JoinHandle,
};

use futures::StreamExt;

use super::{
    attach::{list_links, lock, Shared},
    FastPathError,
};
use crate::{
    netns::Netns,
    watch::{Change, NetEvent, Watcher},
};

/// The running thread, as [`FastPath`](super::FastPath) holds it.
pub(super) struct Worker {
    stop: Option<futures::channel::oneshot::Sender<()>>,
    done: std::sync::mpsc::Receiver<Result<(), FastPathError>>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Stops watching and waits for the thread to detach everything: its result.
    pub(super) fn shut_down(mut self) -> Result<(), FastPathError> {
        self.stop.take();
        let r = self.done.recv().unwrap_or_else(|_| {
            Err(FastPathError::Netns(io::Error::other(
                "fast-path worker died",
            )))
        });
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        r
    }
}

pub(super) fn spawn_worker(
    netns: Netns,
    shared: Arc<Mutex<Shared>>,
) -> Result<Worker, FastPathError> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), FastPathError>>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<Result<(), FastPathError>>();
    let (stop_tx, stop_rx) = futures::channel::oneshot::channel::<()>();
    let file = netns
        .path()
        .map(std::fs::File::open)
        .transpose()
        .map_err(FastPathError::Netns)?;
    let thread = std::thread::Builder::new()
        .name("fastpath-watch".into())
        .spawn(move || {
            if let Some(f) = &file {
                if let Err(e) = nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET) {
                    let _ = ready_tx.send(Err(FastPathError::Netns(e.into())));
                    return;
                }
            }
            // Subscribe before listing, so no interface slips between the two.
            let mut watcher = match Watcher::start(&netns, false) {
                Ok(w) => w,
                Err(e) => {
                    let _ = ready_tx.send(Err(FastPathError::Netns(e)));
                    return;
                }
            };
            let initial = (|| {
                let links = list_links(&netns, None).map_err(FastPathError::Netns)?;
                let mut s = lock(&shared);
                for l in &links {
                    s.consider(&netns, l)?;
                }
                Ok(())
            })();
            if let Err(e) = initial {
                let _ = lock(&shared).detach_all(&netns);
                let _ = ready_tx.send(Err(e));
                return;
            }
            let _ = ready_tx.send(Ok(()));
            futures::executor::block_on(async {
                let mut stop = stop_rx;
                loop {
                    let ev = futures::future::select(watcher.next(), &mut stop).await;
                    match ev {
                        futures::future::Either::Left((Some(ev), _)) => on_event(&netns, &shared, &ev),
                        futures::future::Either::Left((None, _)) => {
                            tracing::warn!("netlink watcher ended; interfaces appearing later will not get the fast-path classifier");
                            let _ = (&mut stop).await;
                            break;
                        }
                        futures::future::Either::Right(_) => break,
                    }
                }
            });
            drop(watcher);
            let r = lock(&shared).detach_all(&netns);
            let _ = done_tx.send(r);
        })
        .map_err(FastPathError::Netns)?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(Worker {
            stop: Some(stop_tx),
            done: done_rx,
            thread: Some(thread),
        }),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => {
            let _ = thread.join();
            Err(FastPathError::Netns(io::Error::other(
                "fast-path worker died during setup",
            )))
        }
    }
}

fn on_event(netns: &Netns, shared: &Mutex<Shared>, ev: &NetEvent) {
    let NetEvent::Link {
        change,
        index,
        name,
        ..
    } = ev
    else {
        return;
    };
    let mut s = lock(shared);
    match change {
        Change::Removed => {
            let _ = s.detach(netns, *index, true);
        }
        Change::Updated => {
            if s.attached.contains_key(index) || !s.config.interfaces.selects(name) {
                return;
            }
            let link = match list_links(netns, Some(name)) {
                Ok(mut l) if !l.is_empty() => l.remove(0),
                Ok(_) => return,
                Err(e) => {
                    tracing::debug!(interface = %name, error = %e, "interface gone before attach");
                    return;
                }
            };
            if let Err(e) = s.consider(netns, &link) {
                tracing::warn!(interface = %name, error = %e, "cannot attach the fast-path classifier");
                s.failed.push((name.clone(), e.to_string()));
            }
        }
    }
}
