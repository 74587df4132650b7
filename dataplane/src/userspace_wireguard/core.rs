//! The device's state and packet logic, sans-IO: configuration (applied from parsed
//! UAPI requests), the allowed-IPs table, the receiver indices and one [`Peer`] per
//! peer (its keys, keypairs, handshake and timers). Packets come in as byte slices
//! with `now` passed in; what must go out is handed to an [`Io`]. The device loop
//! owns the TUN and the socket.
//!
//! Data and handshakes take separate ways in: [`DeviceCore::handle_transport`] opens
//! data messages at once and hands every handshake message to the caller (the kernel
//! already steers them to the device's handshake socket, see `port.rs`; this catches
//! the rest), [`DeviceCore::handle_handshakes`] takes them from there, answering with
//! cookie replies while the device is under load.
//!
//! Every method takes `&self`, so the TUN reader, the two socket readers (data and
//! handshakes) and the timer thread work at once. The locks, always taken in this order:
//!
//! 1. the table (`RwLock`): configuration, peers, routes and the key map. Packets and
//!    timers take its read side; only a `set=1` takes the write side.
//! 2. one peer's `Mutex`: its keys, keypairs, timers, endpoint and counters. A packet
//!    holds it while it seals or opens, so different peers' packets are encrypted at
//!    once; one peer's packets are handled one at a time, which keeps their order.
//!    Never two peers' locks at once.
//! 3. leaves, each held for a lookup or an update: the receiver indices, the
//!    responder's cookie secret and per-source limiter.
//!
//! The device counters and the timer deadline are atomics.

use std::{
    cell::RefCell,
    collections::{BTreeMap, HashMap, VecDeque},
    fmt::Write as _,
    net::SocketAddr,
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use super::{
    allowed_ips::{packet_destination, AllowedIps},
    indices::Indices,
    noise::{
        cookie::{reply_receiver, CookieChecker},
        crypto::Tai64n,
        handshake::{
            handshake_length_ok, le32, message_type, open_initiation, LocalIdentity, PeerKeys,
            MSG_COOKIE_REPLY, MSG_DATA, MSG_INITIATION, MSG_RESPONSE,
        },
        keypair::DATA_OVERHEAD,
        limiter::SourceLimiter,
        random,
    },
    peer::{Ctx, Inbound, Outcome, Peer, SEAL_ROOM},
    uapi_request::{AllowedIpChange, Key, PeerChange, SetRequest},
};

/// Room for any packet plus WireGuard's overhead.
const BUFFER_SIZE: usize = 65_536 + SEAL_ROOM;

/// `timer_due` when no deadline is pending.
const NO_DEADLINE: u64 = u64::MAX;

/// The TUN's MTU until the device says otherwise (the node's default).
const DEFAULT_MTU: usize = 1420;

/// Removed peers whose greatest initiation timestamp is remembered, so removing and
/// re-adding a peer does not reopen it to replays of its old initiations.
const REMEMBERED_TIMESTAMPS: usize = 4096;

thread_local! {
    /// Where a peer writes what it seals or opens. One per thread, not per peer
    /// (a thousand idle peers would hold 64 MiB) and not in the core (it would be a
    /// lock every packet thread shares). Allocated zeroed and untouched, so only the
    /// pages a thread's traffic uses become resident.
    static SCRATCH: RefCell<Vec<u8>> = RefCell::new(vec![0; BUFFER_SIZE]);
}

use super::io::Io;

/// Counters of the device as a whole.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCounters {
    /// Datagrams dropped as malformed or unauthenticated (bad length, type, MAC, tag
    /// or counter, unknown receiver).
    pub invalid_datagrams: u64,
    /// Decrypted packets dropped because their source is not among the sending
    /// peer's allowed IPs.
    pub spoofed_packets: u64,
    /// Packets from the TUN dropped for want of a route, a key or an endpoint.
    pub unroutable_packets: u64,
    /// Cookie replies sent because the device was under load.
    pub cookie_replies: u64,
    /// Authentic initiations refused as replays: a timestamp not newer than one
    /// already taken from that peer, or one too soon after the last.
    pub replayed_initiations: u64,
    /// Handshake messages with a valid cookie dropped by the per-source limit.
    pub rate_limited_handshakes: u64,
}

/// [`DeviceCounters`], counted by every thread without a lock.
#[derive(Debug, Default)]
struct AtomicCounters {
    invalid_datagrams: AtomicU64,
    spoofed_packets: AtomicU64,
    unroutable_packets: AtomicU64,
    cookie_replies: AtomicU64,
    replayed_initiations: AtomicU64,
    rate_limited_handshakes: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// The responder's defences: cookies and the per-source limits (a leaf lock).
#[derive(Default)]
struct Responder {
    cookies: CookieChecker,
    /// Handshakes whose cookie proved their source, per source.
    sources: SourceLimiter,
    /// Cookie replies, per source: a flood from a few addresses gets a few replies a
    /// second each, not one per message.
    cookie_sources: SourceLimiter,
}

/// Greatest initiation timestamps of removed peers, oldest removal first out.
#[derive(Default)]
struct Remembered {
    timestamps: HashMap<Key, Tai64n>,
    order: VecDeque<Key>,
}

impl Remembered {
    fn keep(&mut self, key: Key, timestamp: Tai64n) {
        if self.timestamps.insert(key, timestamp).is_none() {
            self.order.push_back(key);
        }
        while self.order.len() > REMEMBERED_TIMESTAMPS {
            if let Some(old) = self.order.pop_front() {
                self.timestamps.remove(&old);
            }
        }
    }

    fn take(&mut self, key: &Key) -> Option<Tai64n> {
        let t = self.timestamps.remove(key)?;
        self.order.retain(|k| k != key);
        Some(t)
    }
}

/// What a `set=1` changes and packets only read: the lock order's first lock.
struct Table {
    identity: Option<LocalIdentity>,
    listen_port: u16,
    fwmark: u32,
    peers: BTreeMap<u32, Mutex<Peer>>,
    by_key: HashMap<Key, u32>,
    next_id: u32,
    routes: AllowedIps<u32>,
    remembered: Remembered,
}

/// A test's view into the seal path: called with the peer's id while its lock is held.
#[cfg(test)]
type SealHook = Box<dyn Fn(u32) + Send + Sync>;

/// The whole device state.
pub struct DeviceCore {
    table: RwLock<Table>,
    indices: Indices,
    responder: Mutex<Responder>,
    counters: AtomicCounters,
    mtu: AtomicUsize,
    /// The instant `timer_due` counts from.
    epoch: Instant,
    /// Nanoseconds after `epoch` at which the timer loop will next run `tick`
    /// (`NO_DEADLINE`: not until woken).
    timer_due: AtomicU64,
    /// A packet made a deadline earlier than `timer_due`: the timer loop must wake.
    wake_timer: AtomicBool,
    #[cfg(test)]
    seal_hook: Option<SealHook>,
}

impl Default for DeviceCore {
    fn default() -> Self {
        Self {
            table: RwLock::new(Table {
                identity: None,
                listen_port: 0,
                fwmark: 0,
                peers: BTreeMap::new(),
                by_key: HashMap::new(),
                next_id: 1,
                routes: AllowedIps::default(),
                remembered: Remembered::default(),
            }),
            indices: Indices::default(),
            responder: Mutex::new(Responder::default()),
            counters: AtomicCounters::default(),
            mtu: AtomicUsize::new(DEFAULT_MTU),
            epoch: Instant::now(),
            timer_due: AtomicU64::new(NO_DEADLINE),
            wake_timer: AtomicBool::new(false),
            #[cfg(test)]
            seal_hook: None,
        }
    }
}

/// Locks `m`. A panic ends the process (the device installs a hook for it), so a
/// poisoned lock is only seen while it unwinds: carry on.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl DeviceCore {
    fn read(&self) -> RwLockReadGuard<'_, Table> {
        self.table.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> RwLockWriteGuard<'_, Table> {
        self.table.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// The device's counters.
    pub fn counters(&self) -> DeviceCounters {
        let c = &self.counters;
        DeviceCounters {
            invalid_datagrams: c.invalid_datagrams.load(Ordering::Relaxed),
            spoofed_packets: c.spoofed_packets.load(Ordering::Relaxed),
            unroutable_packets: c.unroutable_packets.load(Ordering::Relaxed),
            cookie_replies: c.cookie_replies.load(Ordering::Relaxed),
            replayed_initiations: c.replayed_initiations.load(Ordering::Relaxed),
            rate_limited_handshakes: c.rate_limited_handshakes.load(Ordering::Relaxed),
        }
    }

    /// The number of peers.
    pub fn peer_count(&self) -> usize {
        self.read().peers.len()
    }

    /// The port the socket is bound to.
    pub fn listen_port(&self) -> u16 {
        self.read().listen_port
    }

    /// Records the port the socket is bound to (the loop keeps it current).
    pub fn set_listen_port(&self, port: u16) {
        self.write().listen_port = port;
    }

    /// The socket mark (0: none).
    pub fn fwmark(&self) -> u32 {
        self.read().fwmark
    }

    /// The TUN's MTU: data messages are padded to a multiple of 16 bytes up to it.
    pub fn set_mtu(&self, mtu: usize) {
        self.mtu.store(mtu, Ordering::Relaxed);
    }

    /// When `tick` next has something to do: the earliest deadline of any peer's
    /// timers or keypairs (`None`: nothing pending). The timer loop sleeps until
    /// then, or until a packet makes a deadline earlier.
    pub fn next_deadline(&self, now: Instant) -> Option<Instant> {
        // While the peers are looked at, a packet may move a deadline of one already
        // looked at. Against "nothing pending" any deadline is earlier, so the packet
        // records it in `timer_due`, and the `fetch_min` below returns it. Wakes from
        // that window are cleared first: the answer already holds their deadlines
        // (waking for them, the loop would go round again under traffic, every time).
        self.timer_due.store(NO_DEADLINE, Ordering::SeqCst);
        let table = self.read();
        let due = table.identity.as_ref().and_then(|_| {
            table
                .peers
                .values()
                .filter_map(|p| lock(p).next_deadline(now))
                .min()
        });
        let due = self.nanos(due);
        self.wake_timer.store(false, Ordering::SeqCst);
        let earliest = self.timer_due.fetch_min(due, Ordering::SeqCst).min(due);
        (earliest != NO_DEADLINE).then(|| self.epoch + Duration::from_nanos(earliest))
    }

    fn nanos(&self, due: Option<Instant>) -> u64 {
        due.map_or(NO_DEADLINE, |t| {
            u64::try_from(t.saturating_duration_since(self.epoch).as_nanos())
                .unwrap_or(NO_DEADLINE - 1)
        })
    }

    /// True (once) when a packet made a deadline earlier than the one the timer loop
    /// sleeps until.
    pub fn take_timer_wake(&self) -> bool {
        self.wake_timer.load(Ordering::Relaxed) && self.wake_timer.swap(false, Ordering::SeqCst)
    }

    fn note_deadline(&self, due: Option<Instant>) {
        let due = self.nanos(due);
        // Only a load in the common case (not earlier): the packet threads would
        // otherwise bounce the line between cores on every packet.
        if due < self.timer_due.load(Ordering::SeqCst)
            && due < self.timer_due.fetch_min(due, Ordering::SeqCst)
        {
            self.wake_timer.store(true, Ordering::SeqCst);
        }
    }

    /// Applies a parsed `set=1` request (the listen port and mark are the loop's: it
    /// binds and marks the socket before calling this, so nothing here can fail).
    pub fn apply_set(&self, req: SetRequest) {
        let mut table = self.write();
        let table = &mut *table;
        if let Some(key) = req.private_key {
            table.set_private_key(key, &self.indices);
        }
        if let Some(port) = req.listen_port {
            table.listen_port = port;
        }
        if let Some(mark) = req.fwmark {
            table.fwmark = mark;
        }
        if req.replace_peers {
            let ids: Vec<u32> = table.peers.keys().copied().collect();
            for id in ids {
                table.remove_peer(id, &self.indices);
            }
        }
        for change in req.peers {
            table.apply_peer(change, &self.indices);
        }
    }
}

/// A peer's lock taken while the table's write lock is held: nobody else holds it.
fn owned(peer: &mut Mutex<Peer>) -> &mut Peer {
    peer.get_mut().unwrap_or_else(PoisonError::into_inner)
}

impl Table {
    fn set_private_key(&mut self, key: Option<Key>, indices: &Indices) {
        // Writers such as `wg setconf` resend the same key: that must not cost every
        // peer its session.
        if self.identity.as_ref().map(LocalIdentity::private_key) == key {
            return;
        }
        self.identity = key.map(LocalIdentity::new);
        // As the kernel does: a peer with the new identity's public key goes.
        let own = self.identity.as_ref().map(LocalIdentity::public_key);
        if let Some(id) = own.and_then(|key| self.by_key.get(&key).copied()) {
            self.remove_peer(id, indices);
        }
        for peer in self.peers.values_mut() {
            let peer = owned(peer);
            let keys = self
                .identity
                .as_ref()
                .map(|i| PeerKeys::new(i, peer.public_key, peer.preshared_key));
            indices.release(peer.reset_sessions(keys));
        }
    }

    fn remove_peer(&mut self, id: u32, indices: &Indices) {
        if let Some(peer) = self.peers.remove(&id) {
            let mut peer = peer.into_inner().unwrap_or_else(PoisonError::into_inner);
            indices.release(peer.indices());
            self.by_key.remove(&peer.public_key);
            self.routes.remove_peer(id);
            if let Some(t) = peer.latest_timestamp {
                self.remembered.keep(peer.public_key, t);
            }
        }
    }

    fn apply_peer(&mut self, change: PeerChange, indices: &Indices) {
        let existing = self.by_key.get(&change.public_key).copied();
        if change.remove {
            if let Some(id) = existing {
                self.remove_peer(id, indices);
            }
            return;
        }
        let id = match existing {
            Some(id) => id,
            None if change.update_only => return,
            // The device's own key is silently no peer (the kernel's rule), so one
            // request can configure every node of a mesh.
            None if self
                .identity
                .as_ref()
                .is_some_and(|i| i.public_key() == change.public_key) =>
            {
                return
            }
            None => self.add_peer(change.public_key),
        };
        let identity = self.identity.as_ref();
        let Some(peer) = self.peers.get_mut(&id) else {
            return;
        };
        let peer = owned(peer);
        if let Some(endpoint) = change.endpoint {
            peer.endpoint = Some(endpoint);
        }
        if let Some(secs) = change.persistent_keepalive {
            peer.persistent_keepalive = secs;
            peer.timers.set_persistent_keepalive(secs);
        }
        if let Some(psk) = change.preshared_key {
            if psk != peer.preshared_key {
                peer.preshared_key = psk;
                let keys = identity.map(|i| PeerKeys::new(i, peer.public_key, psk));
                indices.release(peer.reset_sessions(keys));
            }
        }
        if change.replace_allowed_ips {
            self.routes.remove_peer(id);
        }
        for ip in change.allowed_ips {
            match ip {
                AllowedIpChange::Add(net) => self.routes.insert(net.trunc(), id),
                AllowedIpChange::Remove(net) => self.routes.remove(net.trunc(), id),
            }
        }
    }

    fn add_peer(&mut self, public_key: Key) -> u32 {
        // Ids are internal (the wire carries random indices); skip any still in use
        // so a wrap can never hand a live peer's id to another.
        let mut id = self.next_id;
        while self.peers.contains_key(&id) {
            id = id.wrapping_add(1);
        }
        self.next_id = id.wrapping_add(1);
        let keys = self
            .identity
            .as_ref()
            .map(|i| PeerKeys::new(i, public_key, None));
        let remembered = self.remembered.take(&public_key);
        self.peers
            .insert(id, Mutex::new(Peer::new(public_key, keys, remembered)));
        self.by_key.insert(public_key, id);
        id
    }
}

impl DeviceCore {
    /// The `get=1` answer, without the final `errno=0` line.
    pub fn render_get(&self) -> String {
        let table = self.read();
        let mut out = String::new();
        if let Some(id) = &table.identity {
            let _ = writeln!(out, "private_key={}", hex::encode(id.private_key()));
        }
        let _ = writeln!(out, "listen_port={}", table.listen_port);
        if table.fwmark != 0 {
            let _ = writeln!(out, "fwmark={}", table.fwmark);
        }
        for (id, peer) in &table.peers {
            let peer = lock(peer);
            let _ = writeln!(out, "public_key={}", hex::encode(peer.public_key));
            let psk = peer.preshared_key.unwrap_or_default();
            let _ = writeln!(out, "preshared_key={}", hex::encode(psk));
            let _ = writeln!(out, "protocol_version=1");
            if let Some(ep) = peer.endpoint {
                let _ = writeln!(out, "endpoint={ep}");
            }
            let since = peer
                .last_handshake
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .unwrap_or_default();
            let _ = writeln!(out, "last_handshake_time_sec={}", since.as_secs());
            let _ = writeln!(out, "last_handshake_time_nsec={}", since.subsec_nanos());
            let _ = writeln!(out, "tx_bytes={}", peer.tx_bytes);
            let _ = writeln!(out, "rx_bytes={}", peer.rx_bytes);
            let _ = writeln!(
                out,
                "persistent_keepalive_interval={}",
                peer.persistent_keepalive
            );
            for net in table.routes.prefixes_of(*id) {
                let _ = writeln!(out, "allowed_ip={net}");
            }
        }
        out
    }

    fn ctx<'t>(
        &'t self,
        identity: &'t LocalIdentity,
        id: u32,
        now: Instant,
        wall: SystemTime,
    ) -> Ctx<'t> {
        Ctx {
            identity,
            indices: &self.indices,
            id,
            now,
            wall,
            mtu: self.mtu.load(Ordering::Relaxed),
        }
    }

    /// The wall clock at `now`, for the threads that are given only the monotonic
    /// clock (TUN, timers): initiation timestamps follow the real clock, as the
    /// kernel's do, so a clock set right after start is what peers see.
    fn wall_at(now: Instant) -> SystemTime {
        let real = Instant::now();
        match now.checked_duration_since(real) {
            Some(ahead) => SystemTime::now() + ahead,
            None => SystemTime::now() - real.saturating_duration_since(now),
        }
    }

    /// An IP packet read from the TUN: encrypt it for the peer its destination routes to.
    pub fn handle_tun_packet(&self, packet: &[u8], now: Instant, io: &mut impl Io) {
        self.handle_tun_packets([packet], now, io);
    }

    /// A batch of IP packets read from the TUN, each encrypted for the peer its
    /// destination routes to. A peer's lock is kept while consecutive packets go to
    /// it: the reader that seals and the one that opens the same peer's packets
    /// then take turns a run at a time, not a packet at a time.
    pub fn handle_tun_packets<'p>(
        &self,
        packets: impl IntoIterator<Item = &'p [u8]>,
        now: Instant,
        io: &mut impl Io,
    ) {
        let table = self.read();
        let Some(identity) = table.identity.as_ref() else {
            for _ in packets {
                bump(&self.counters.unroutable_packets);
            }
            return;
        };
        let wall = Self::wall_at(now);
        let mut held = None;
        SCRATCH.with_borrow_mut(|buf| {
            for packet in packets {
                let Some(id) = packet_destination(packet).and_then(|dst| table.routes.lookup(dst))
                else {
                    bump(&self.counters.unroutable_packets);
                    continue;
                };
                let Some(peer) = hold(&table, &mut held, id) else {
                    continue;
                };
                if peer.endpoint.is_none() {
                    bump(&self.counters.unroutable_packets);
                    continue;
                }
                #[cfg(test)]
                if let Some(hook) = &self.seal_hook {
                    hook(id);
                }
                peer.seal(&self.ctx(identity, id, now, wall), packet, buf, io);
                self.note_deadline(peer.next_deadline(now));
            }
        });
    }

    /// A datagram from the socket, handled whole: data opened, handshake messages
    /// answered at once (never under load). For tests and fuzzing; the device splits
    /// the two ways with [`Self::handle_transport`] and [`Self::handle_handshakes`].
    pub fn handle_datagram(
        &self,
        from: SocketAddr,
        datagram: &[u8],
        now: Instant,
        wall: SystemTime,
        io: &mut impl Io,
    ) {
        self.handle_datagrams([(from, datagram)], now, wall, io);
    }

    /// A batch of datagrams, each handled as by [`Self::handle_datagram`].
    pub fn handle_datagrams<'d>(
        &self,
        datagrams: impl IntoIterator<Item = (SocketAddr, &'d [u8])>,
        now: Instant,
        wall: SystemTime,
        io: &mut impl Io,
    ) {
        let mut handshakes = Vec::new();
        self.handle_transport(datagrams, now, wall, io, |from, msg| {
            handshakes.push((from, msg.to_vec()));
        });
        let batch = handshakes.iter().map(|(from, m)| (*from, m.as_slice()));
        self.handle_handshakes(batch, now, wall, false, io);
    }

    /// A batch of datagrams from the socket: data messages are authenticated and
    /// opened (the endpoint follows the peer, the packet inside goes to the TUN when
    /// its source is the peer's), with a peer's lock kept over a run of its
    /// datagrams; handshake messages of the right length go to `handshake`
    /// untouched, for [`Self::handle_handshakes`]; anything else is counted invalid.
    pub fn handle_transport<'d>(
        &self,
        datagrams: impl IntoIterator<Item = (SocketAddr, &'d [u8])>,
        now: Instant,
        wall: SystemTime,
        io: &mut impl Io,
        mut handshake: impl FnMut(SocketAddr, &'d [u8]),
    ) {
        let table = self.read();
        let mut held = None;
        SCRATCH.with_borrow_mut(|buf| {
            for (from, datagram) in datagrams {
                match message_type(datagram) {
                    Some(MSG_DATA) if datagram.len() >= DATA_OVERHEAD => {
                        self.open_data(&table, &mut held, (from, datagram), (now, wall), buf, io);
                    }
                    Some(kind) if handshake_length_ok(kind, datagram) => handshake(from, datagram),
                    _ => bump(&self.counters.invalid_datagrams),
                }
            }
        });
    }

    fn open_data<'t>(
        &self,
        table: &'t Table,
        held: &mut Held<'t>,
        (from, datagram): (SocketAddr, &[u8]),
        (now, wall): (Instant, SystemTime),
        buf: &mut [u8],
        io: &mut impl Io,
    ) {
        let found = table.identity.as_ref().and_then(|identity| {
            let id = self.indices.lookup(le32(datagram, 4))?;
            Some((identity, id, hold(table, held, id)?))
        });
        let Some((identity, id, peer)) = found else {
            bump(&self.counters.invalid_datagrams);
            return;
        };
        let rx = Inbound {
            from,
            datagram,
            routes: &table.routes,
        };
        let outcome = peer.open_data(&self.ctx(identity, id, now, wall), rx, buf, io);
        self.count(outcome);
        self.note_deadline(peer.next_deadline(now));
    }

    fn count(&self, outcome: Outcome) {
        match outcome {
            Outcome::Accepted => {}
            Outcome::Spoofed => bump(&self.counters.spoofed_packets),
            Outcome::Replayed => bump(&self.counters.replayed_initiations),
            Outcome::Invalid => bump(&self.counters.invalid_datagrams),
        }
    }

    /// Handshake messages (initiations, responses, cookie replies) that
    /// [`Self::handle_transport`] set aside. MAC1 must be ours; `under_load`, a
    /// message also needs the MAC2 of its source's cookie (else it is answered with
    /// a cookie reply and nothing else), and its source must be within its rate (for
    /// the cookie reply too).
    pub fn handle_handshakes<'d>(
        &self,
        messages: impl IntoIterator<Item = (SocketAddr, &'d [u8])>,
        now: Instant,
        wall: SystemTime,
        under_load: bool,
        io: &mut impl Io,
    ) {
        let table = self.read();
        let Some(identity) = table.identity.as_ref() else {
            for _ in messages {
                bump(&self.counters.invalid_datagrams);
            }
            return;
        };
        SCRATCH.with_borrow_mut(|buf| {
            for (from, msg) in messages {
                let outcome = match message_type(msg) {
                    Some(kind @ (MSG_INITIATION | MSG_RESPONSE))
                        if handshake_length_ok(kind, msg) =>
                    {
                        self.authenticated_handshake(
                            &table,
                            identity,
                            (from, msg),
                            (now, wall),
                            under_load,
                            buf,
                            io,
                        )
                    }
                    Some(MSG_COOKIE_REPLY) if handshake_length_ok(MSG_COOKIE_REPLY, msg) => self
                        .with_peer(
                            &table,
                            (self.indices.lookup(reply_receiver(msg)), now),
                            |peer, id| {
                                peer.consume_cookie_reply(&self.ctx(identity, id, now, wall), msg)
                            },
                        ),
                    _ => Some(Outcome::Invalid),
                };
                // `None`: answered with a cookie reply or limited, already counted.
                if let Some(outcome) = outcome {
                    self.count(outcome);
                }
            }
        });
    }

    /// Runs `f` on peer `id` with its lock held, then notes its next deadline.
    fn with_peer(
        &self,
        table: &Table,
        (id, now): (Option<u32>, Instant),
        f: impl FnOnce(&mut Peer, u32) -> Outcome,
    ) -> Option<Outcome> {
        let Some((id, peer)) = id.and_then(|id| Some((id, table.peers.get(&id)?))) else {
            return Some(Outcome::Invalid);
        };
        let mut peer = lock(peer);
        let outcome = f(&mut peer, id);
        self.note_deadline(peer.next_deadline(now));
        Some(outcome)
    }

    #[allow(clippy::too_many_arguments)]
    fn authenticated_handshake(
        &self,
        table: &Table,
        identity: &LocalIdentity,
        (from, msg): (SocketAddr, &[u8]),
        (now, wall): (Instant, SystemTime),
        under_load: bool,
        buf: &mut [u8],
        io: &mut impl Io,
    ) -> Option<Outcome> {
        if under_load {
            if let Some(stop) = self.admit_under_load(identity, msg, from, now, io) {
                return stop;
            }
        } else if !identity.mac1_ok(msg) {
            return Some(Outcome::Invalid);
        }
        if msg[0] == MSG_INITIATION {
            let Some(opened) = open_initiation(identity, msg) else {
                return Some(Outcome::Invalid);
            };
            let id = table.by_key.get(&opened.peer_public).copied();
            self.with_peer(table, (id, now), |peer, id| {
                peer.consume_initiation(&self.ctx(identity, id, now, wall), &opened, from, io)
            })
        } else {
            let id = self.indices.lookup(le32(msg, 8));
            self.with_peer(table, (id, now), |peer, id| {
                peer.consume_response(&self.ctx(identity, id, now, wall), msg, from, buf, io)
            })
        }
    }

    /// Under load: a message without its source's cookie gets a cookie reply while
    /// its source is within its rate; one with it passes if its source is within its
    /// rate. MAC2 is checked first: a message over its source's rate costs no MAC1.
    /// `Some(outcome)` when the message stops here (`None` in it: answered or limited,
    /// already counted).
    fn admit_under_load(
        &self,
        identity: &LocalIdentity,
        msg: &[u8],
        from: SocketAddr,
        now: Instant,
        io: &mut impl Io,
    ) -> Option<Option<Outcome>> {
        let mut responder = lock(&self.responder);
        let secret = || random::bytes::<32>();
        let limited = || {
            bump(&self.counters.rate_limited_handshakes);
            Some(None)
        };
        if responder.cookies.mac2_ok(msg, from, now, secret) {
            if !responder.sources.allow(from.ip(), now) {
                return limited();
            }
            return (!identity.mac1_ok(msg)).then_some(Some(Outcome::Invalid));
        }
        if !responder.cookie_sources.allow_untracked(from.ip(), now) {
            return limited();
        }
        if !identity.mac1_ok(msg) {
            return Some(Some(Outcome::Invalid));
        }
        let reply = responder
            .cookies
            .reply(identity, msg, from, now, secret, random::bytes());
        drop(responder);
        bump(&self.counters.cookie_replies);
        io.send(from, &reply);
        Some(None)
    }

    /// Runs every peer's timers and drops expired keypairs; the loop calls it at
    /// `next_deadline`.
    pub fn tick(&self, now: Instant, io: &mut impl Io) {
        let table = self.read();
        let Some(identity) = table.identity.as_ref() else {
            return;
        };
        let wall = Self::wall_at(now);
        SCRATCH.with_borrow_mut(|buf| {
            for (id, peer) in &table.peers {
                lock(peer).tick(&self.ctx(identity, *id, now, wall), buf, io);
            }
        });
    }
}

/// The peer whose lock a batch holds, with its id.
type Held<'t> = Option<(u32, MutexGuard<'t, Peer>)>;

/// Peer `id`, locked: the lock `held` already has when it is that peer's, else that
/// one released first (never two peers' locks at once) and this one taken.
fn hold<'h, 't>(table: &'t Table, held: &'h mut Held<'t>, id: u32) -> Option<&'h mut Peer> {
    if held.as_ref().is_none_or(|(h, _)| *h != id) {
        *held = None;
        *held = Some((id, lock(table.peers.get(&id)?)));
    }
    held.as_mut().map(|(_, peer)| &mut **peer)
}

#[cfg(test)]
#[path = "core_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "hostile_tests.rs"]
mod hostile_tests;
