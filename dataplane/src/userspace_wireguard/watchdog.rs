//! A device thread must never die alone. The device is a handful of long-lived threads
//! sharing one process; if one of them ends, the process, its TUN and its UAPI socket
//! live on and nothing outside can tell that the device went deaf. So the process ends
//! instead, and its supervisor (the node's userspace backend) starts a fresh one and
//! applies its configuration again:
//!
//! - A panic anywhere (a packet loop, the timers, a UAPI connection halfway through a
//!   `set=1`) ends the process at once from the panic hook ([`install_panic_hook`]):
//!   one log line with the thread, the location and the message, exit status
//!   [`PANIC_EXIT_CODE`]. Unwinding a packet loop and carrying on could leave a
//!   peer's state half-changed under a poisoned lock; a restart cannot.
//! - A long-lived thread that returns when no shutdown asked for it is reported to
//!   the main thread ([`Failure::Returned`]), which ends the process.
//! - A packet loop that holds work and makes no progress for [`STALL_LIMIT`] (a
//!   deadlock, a loop that never ends, a send that blocks for good) is reported by the
//!   watchdog thread ([`Failure::Stalled`]).
//!
//! Stalls are judged on heartbeats: each loop marks itself busy from the moment its
//! wait returned with work until that work is flushed ([`Beat::busy`]: one counter,
//! odd while busy). Waiting in `poll`/`recv` is idle by definition, since the kernel
//! wakes a waiting loop as soon as work is queued. The watchdog looks only while some
//! loop is busy: once every loop is idle it parks with no timeout, and the first loop
//! to become busy again unparks it. An idle device therefore costs the watchdog no
//! wake-ups; a busy one, a look every quarter of the limit. The judging is pure
//! ([`StallJudge`], time passed in).

use std::{
    fmt,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc, Arc, OnceLock,
    },
    thread::{self, Thread},
    time::{Duration, Instant},
};

/// The exit status of a process ended by a panic (`EX_SOFTWARE`: an internal error).
pub const PANIC_EXIT_CODE: i32 = 70;

/// How long a packet loop may hold work without finishing any before the process is
/// ended. Generous on purpose: the limit must never end a healthy device, and the
/// timer loop's batch (a thousand peers' handshakes at once) runs far slower in the
/// suite's emulated VM than on hardware; a device that is really stuck stays stuck.
pub const STALL_LIMIT: Duration = Duration::from_secs(30);

/// Installs the panic hook that ends the process (see the module documentation).
/// The device's `run` installs it: the process is the device's alone.
pub fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let current = thread::current();
        let name = current.name().unwrap_or("<unnamed>");
        let location = info.location().map_or_else(
            || "<unknown>".to_owned(),
            |l| format!("{}:{}:{}", l.file(), l.line(), l.column()),
        );
        let message = info
            .payload()
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| info.payload().downcast_ref::<String>().map(String::as_str))
            .unwrap_or("<non-text payload>");
        tracing::error!(
            thread = name,
            location = %location,
            panic = %redact(message),
            "device thread panicked, ending the process so that it is restarted"
        );
        std::process::exit(PANIC_EXIT_CODE);
    }));
}

/// The longest panic message logged (a message that embeds a whole packet is cut).
const MAX_MESSAGE: usize = 512;

/// `message` fit for the log: anything shaped like a key (44 characters of base64
/// ending in `=`, or 64 hex digits) replaced by `<redacted>`, and cut at
/// [`MAX_MESSAGE`]. Panic messages come from our own code and should hold no key;
/// this is the net under a `{:?}` of the wrong value.
#[must_use]
pub fn redact(message: &str) -> String {
    let is_b64 = |c: char| c.is_ascii_alphanumeric() || c == '+' || c == '/' || c == '=';
    let mut out = String::with_capacity(message.len().min(MAX_MESSAGE));
    let mut rest = message;
    while let Some(start) = rest.find(is_b64) {
        out.push_str(&rest[..start]);
        let token = &rest[start..];
        let len = token.find(|c: char| !is_b64(c)).unwrap_or(token.len());
        let word = &token[..len];
        let b64_key = len == 44 && word.ends_with('=') && !word[..43].contains('=');
        let hex_key = len == 64 && word.chars().all(|c| c.is_ascii_hexdigit());
        out.push_str(if b64_key || hex_key {
            "<redacted>"
        } else {
            word
        });
        rest = &token[len..];
    }
    out.push_str(rest);
    if out.len() > MAX_MESSAGE {
        let mut cut = MAX_MESSAGE;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push('…');
    }
    out
}

/// Why the device's threads can no longer serve it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// A long-lived thread returned while no shutdown was asked for.
    Returned {
        /// The thread's name.
        thread: &'static str,
    },
    /// A packet loop held work without finishing it for this long.
    Stalled {
        /// The thread's name.
        thread: &'static str,
        /// How long it made no progress.
        stalled_for: Duration,
    },
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Returned { thread } => write!(f, "device thread {thread} returned unexpectedly"),
            Self::Stalled {
                thread,
                stalled_for,
            } => write!(
                f,
                "device thread {thread} made no progress with work in hand for {:.0} s",
                stalled_for.as_secs_f64()
            ),
        }
    }
}

/// What the watchdog decides after one look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StallVerdict {
    /// No loop holds work: park until one does.
    Idle,
    /// Some loop holds work: look again at this instant.
    LookAt(Instant),
    /// Loop `index` held the same work for `stalled_for` (at least the limit).
    Stalled {
        /// Which loop (index into the counters).
        index: usize,
        /// How long it made no progress.
        stalled_for: Duration,
    },
}

/// Decides from the loops' heartbeat counters (odd: busy) whether one is stuck. Pure:
/// the caller passes the time and the counters.
#[derive(Debug, Clone)]
pub struct StallJudge {
    limit: Duration,
    /// Per loop: the busy counter value last seen, and when it was first seen.
    seen: Vec<Option<(u64, Instant)>>,
}

impl StallJudge {
    /// A judge of `loops` loops that may hold work for at most `limit`.
    #[must_use]
    pub fn new(limit: Duration, loops: usize) -> Self {
        Self {
            limit,
            seen: vec![None; loops],
        }
    }

    /// One look at `counts` at `now`.
    ///
    /// A loop is stalled when the same odd (busy) value has been seen for at least the
    /// limit: it has been inside one batch all that time. A busy value seen for the
    /// first time starts its clock at `now`, so a stall is reported between one and
    /// one and a quarter limits after it began (looks come every quarter limit).
    pub fn observe(&mut self, now: Instant, counts: &[u64]) -> StallVerdict {
        let mut any_busy = false;
        let mut worst: Option<(usize, Duration)> = None;
        for (i, (&count, seen)) in counts.iter().zip(self.seen.iter_mut()).enumerate() {
            if count % 2 == 0 {
                *seen = None;
                continue;
            }
            any_busy = true;
            match *seen {
                Some((value, since)) if value == count => {
                    let held = now.saturating_duration_since(since);
                    if held >= self.limit && worst.is_none_or(|(_, w)| held > w) {
                        worst = Some((i, held));
                    }
                }
                _ => *seen = Some((count, now)),
            }
        }
        match (worst, any_busy) {
            (Some((index, stalled_for)), _) => StallVerdict::Stalled { index, stalled_for },
            (None, true) => StallVerdict::LookAt(now + self.limit / 4),
            (None, false) => StallVerdict::Idle,
        }
    }
}

/// One loop's heartbeat, on a cache line of its own (each is written by one thread
/// per batch).
#[derive(Debug, Default)]
#[repr(align(64))]
struct Heartbeat(AtomicU64);

/// The heartbeats of the watched loops and the watchdog's parking state.
#[derive(Debug)]
pub struct Watch {
    names: Vec<&'static str>,
    beats: Vec<Heartbeat>,
    /// Set by the watchdog before it parks with no timeout.
    parked: AtomicBool,
    watchdog: OnceLock<Thread>,
}

impl Watch {
    /// A watch over the loops `names`; [`Watch::beat`] hands each its heartbeat.
    #[must_use]
    pub fn new(names: &[&'static str]) -> Arc<Self> {
        Arc::new(Self {
            names: names.to_vec(),
            beats: names.iter().map(|_| Heartbeat::default()).collect(),
            parked: AtomicBool::new(false),
            watchdog: OnceLock::new(),
        })
    }

    /// The heartbeat of loop `name`.
    ///
    /// # Panics
    /// `name` was not given to [`Watch::new`] (a programming error at start).
    #[must_use]
    pub fn beat(self: &Arc<Self>, name: &str) -> Beat {
        let index = self
            .names
            .iter()
            .position(|n| *n == name)
            .unwrap_or_else(|| panic!("no heartbeat named {name}"));
        Beat {
            watch: self.clone(),
            index,
        }
    }

    fn counts(&self) -> Vec<u64> {
        self.beats
            .iter()
            .map(|b| b.0.load(Ordering::SeqCst))
            .collect()
    }

    /// Runs the watchdog on the calling thread until a loop stalls; returns the
    /// failure. `limit`: [`STALL_LIMIT`] unless a test asks for less.
    pub fn run_watchdog(&self, limit: Duration) -> Failure {
        let _ = self.watchdog.set(thread::current());
        let mut judge = StallJudge::new(limit, self.beats.len());
        loop {
            let now = Instant::now();
            match judge.observe(now, &self.counts()) {
                StallVerdict::Stalled { index, stalled_for } => {
                    return Failure::Stalled {
                        thread: self.names[index],
                        stalled_for,
                    }
                }
                StallVerdict::LookAt(at) => thread::park_timeout(at.saturating_duration_since(now)),
                StallVerdict::Idle => {
                    // Announce the park, then look once more: a loop that became busy
                    // in between either saw the flag (and unparks us: the token makes
                    // `park` return at once) or is seen busy here.
                    self.parked.store(true, Ordering::SeqCst);
                    if self.counts().iter().all(|c| c % 2 == 0) {
                        thread::park();
                    }
                    self.parked.store(false, Ordering::SeqCst);
                }
            }
        }
    }
}

/// A loop's handle on its heartbeat.
#[derive(Debug, Clone)]
pub struct Beat {
    watch: Arc<Watch>,
    index: usize,
}

impl Beat {
    /// Marks the loop busy until the guard drops: call it once the loop holds work
    /// (its wait returned with something), drop it once that work is flushed.
    #[must_use = "the loop is busy while the guard lives"]
    pub fn busy(&self) -> Busy<'_> {
        self.watch.beats[self.index]
            .0
            .fetch_add(1, Ordering::SeqCst);
        if self.watch.parked.load(Ordering::SeqCst) {
            if let Some(t) = self.watch.watchdog.get() {
                t.unpark();
            }
        }
        Busy(self)
    }
}

/// A loop holding work (see [`Beat::busy`]).
#[derive(Debug)]
pub struct Busy<'a>(&'a Beat);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.watch.beats[self.0.index]
            .0
            .fetch_add(1, Ordering::SeqCst);
    }
}

/// Starts a long-lived device thread running `f`; when `f` returns, `returned`
/// receives [`Failure::Returned`] naming it. A thread whose return is a normal stop
/// (the TUN loop on the interface's deletion) sends its stop reason on the same
/// channel first, so that the receiver sees the reason before the return.
pub fn spawn_long_lived<T: Send + 'static>(
    name: &'static str,
    returned: mpsc::Sender<T>,
    wrap: fn(Failure) -> T,
    f: impl FnOnce() + Send + 'static,
) -> std::io::Result<()> {
    thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            f();
            let _ = returned.send(wrap(Failure::Returned { thread: name }));
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: Duration = Duration::from_secs(8);

    #[test]
    fn an_idle_device_parks_the_watchdog() {
        let t0 = Instant::now();
        let mut j = StallJudge::new(LIMIT, 3);
        assert_eq!(j.observe(t0, &[0, 2, 4]), StallVerdict::Idle);
        assert_eq!(j.observe(t0 + LIMIT * 10, &[0, 2, 4]), StallVerdict::Idle);
    }

    #[test]
    fn a_busy_loop_is_looked_at_every_quarter_limit_while_it_progresses() {
        let t0 = Instant::now();
        let mut j = StallJudge::new(LIMIT, 2);
        assert_eq!(j.observe(t0, &[1, 0]), StallVerdict::LookAt(t0 + LIMIT / 4));
        // Busy again at every look, but a different batch each time: progress.
        let mut t = t0;
        for count in [3u64, 5, 7, 9, 11, 13, 15, 17, 19] {
            t += LIMIT / 4;
            assert_eq!(
                j.observe(t, &[count, 0]),
                StallVerdict::LookAt(t + LIMIT / 4)
            );
        }
    }

    #[test]
    fn a_loop_holding_one_batch_for_the_limit_is_stalled_and_named() {
        let t0 = Instant::now();
        let mut j = StallJudge::new(LIMIT, 3);
        assert_eq!(
            j.observe(t0, &[0, 7, 2]),
            StallVerdict::LookAt(t0 + LIMIT / 4)
        );
        assert_eq!(
            j.observe(t0 + LIMIT / 2, &[2, 7, 2]),
            StallVerdict::LookAt(t0 + LIMIT / 2 + LIMIT / 4)
        );
        assert_eq!(
            j.observe(t0 + LIMIT, &[4, 7, 4]),
            StallVerdict::Stalled {
                index: 1,
                stalled_for: LIMIT
            }
        );
    }

    #[test]
    fn a_stall_clock_restarts_after_progress_or_an_idle_look() {
        let t0 = Instant::now();
        let mut j = StallJudge::new(LIMIT, 1);
        j.observe(t0, &[1]);
        // Idle at one look, busy again with the next batch: a new clock.
        assert_eq!(j.observe(t0 + LIMIT / 2, &[2]), StallVerdict::Idle);
        j.observe(t0 + LIMIT, &[3]);
        assert!(matches!(
            j.observe(t0 + LIMIT + LIMIT / 2, &[3]),
            StallVerdict::LookAt(_)
        ));
        assert!(matches!(
            j.observe(t0 + 2 * LIMIT, &[3]),
            StallVerdict::Stalled { index: 0, .. }
        ));
    }

    #[test]
    fn keys_never_reach_the_log_and_long_messages_are_cut() {
        let b64 = "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=";
        let hex = "c8099ea7d5b6a24b7d0b1b9e5c7c0d40b4e2f1a7a3f0c35d3a0c8c1e8d1b7f59";
        let msg = format!("bad peer {b64} in set; key {hex}: index out of bounds: 3 >= 2");
        let out = redact(&msg);
        assert!(!out.contains(b64) && !out.contains(hex), "{out}");
        assert_eq!(
            out,
            "bad peer <redacted> in set; key <redacted>: index out of bounds: 3 >= 2"
        );
        // Shorter base64-looking words and paths are kept.
        assert_eq!(
            redact("called `Option::unwrap()` on a `None` value at core.rs"),
            "called `Option::unwrap()` on a `None` value at core.rs"
        );
        let long = "é".repeat(1000);
        let cut = redact(&long);
        assert!(cut.len() <= MAX_MESSAGE + '…'.len_utf8() && cut.ends_with('…'));
    }

    #[test]
    fn a_busy_loop_wakes_a_parked_watchdog_and_a_stall_is_reported() {
        let watch = Watch::new(&["a", "b"]);
        let beat = watch.beat("b");
        let w = watch.clone();
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            let _ = tx.send(w.run_watchdog(Duration::from_millis(200)));
        });
        // Wait (against a deadline) until the watchdog found the device idle and parked.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !watch.parked.load(Ordering::SeqCst) {
            assert!(Instant::now() < deadline, "the watchdog never parked");
            thread::yield_now();
        }
        // Progress: busy, done, several times, faster than the limit.
        for _ in 0..5 {
            drop(beat.busy());
        }
        assert!(rx.try_recv().is_err(), "no stall while making progress");
        // One batch held for good: the parked watchdog is woken and reports it.
        let _held = beat.busy();
        let failure = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("the stall was reported");
        assert!(
            matches!(failure, Failure::Stalled { thread: "b", stalled_for } if stalled_for >= Duration::from_millis(200)),
            "{failure:?}"
        );
    }

    #[test]
    fn a_thread_that_returns_is_reported_by_name() {
        let (tx, rx) = mpsc::channel();
        spawn_long_lived("wg-test", tx, |f| f, || {}).unwrap();
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(5)).unwrap(),
            Failure::Returned { thread: "wg-test" }
        );
    }
}
