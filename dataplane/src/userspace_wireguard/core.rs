//! The device's state and packet logic, sans-IO: configuration (applied from parsed
//! UAPI requests), the allowed-IPs table, one Noise tunnel and one timer state per
//! peer. Packets come in as byte slices with `now` passed in; what must go out is
//! handed to an [`Io`]. The device loop owns the TUN and the socket.
//!
//! Every method takes `&self`, so the TUN reader, the socket reader and the timer
//! thread work at once. The locks, always taken in this order and never the other way:
//!
//! 1. the table (`RwLock`): configuration, peers, routes and the key and index maps.
//!    Packets and timers take its read side; only a `set=1` takes the write side.
//! 2. one peer's `Mutex`: its tunnel, timers, endpoint and counters. A packet holds it
//!    while its tunnel seals or opens, so packets of different peers, and of the two
//!    directions of different peers, are encrypted at once; one peer's packets are
//!    handled one at a time (the tunnel needs `&mut`), which also keeps their order.
//!    Never two peers' locks at once.
//! 3. the rate limiter's window (`Mutex`): a leaf, held for an assignment.
//!
//! The device counters and the timer deadline are atomics.

use std::{
    cell::RefCell,
    collections::{BTreeMap, HashMap},
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use boringtun::{
    noise::{handshake::parse_handshake_anon, rate_limiter::RateLimiter, Packet, Tunn, TunnResult},
    x25519::{PublicKey, StaticSecret},
};

use super::{
    allowed_ips::{packet_destination, AllowedIps},
    timers::{PeerTimers, TimerAction},
    uapi_request::{AllowedIpChange, Key, PeerChange, SetRequest},
};

/// Handshake messages per second above which the device answers with cookies. Each
/// message is checked twice (by the device to find the peer, then by the peer's
/// tunnel), so the count is double the protocol's limit.
const HANDSHAKE_RATE_LIMIT: u64 = 2 * 100;

/// How long the handshake rate limiter counts before its count is reset.
const RATE_LIMIT_WINDOW: Duration = Duration::from_secs(1);

/// Room for any packet plus WireGuard's overhead.
const BUFFER_SIZE: usize = 65_536 + 64;

/// `timer_due` when no deadline is pending.
const NO_DEADLINE: u64 = u64::MAX;

thread_local! {
    /// Where a tunnel writes what it seals or opens. One per thread, not per peer
    /// (a thousand idle peers would hold 64 MiB) and not in the core (it would be a
    /// lock every packet thread shares). Allocated zeroed and untouched, so only the
    /// pages a thread's traffic uses become resident.
    static SCRATCH: RefCell<Vec<u8>> = RefCell::new(vec![0; BUFFER_SIZE]);
}

/// Where the device's output goes: the UDP socket and the TUN.
pub trait Io {
    /// Sends a datagram to a peer.
    fn send(&mut self, to: SocketAddr, datagram: &[u8]);
    /// Writes a decrypted IP packet to the TUN.
    fn write_tun(&mut self, packet: &[u8]);
}

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
}

/// [`DeviceCounters`], counted by every thread without a lock.
#[derive(Debug, Default)]
struct AtomicCounters {
    invalid_datagrams: AtomicU64,
    spoofed_packets: AtomicU64,
    unroutable_packets: AtomicU64,
    cookie_replies: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// The local identity: built only when a private key is set.
struct Identity {
    secret: StaticSecret,
    public: PublicKey,
    limiter: Arc<RateLimiter>,
}

impl Identity {
    fn new(key: Key) -> Self {
        let secret = StaticSecret::from(key);
        let public = PublicKey::from(&secret);
        let limiter = Arc::new(RateLimiter::new(&public, HANDSHAKE_RATE_LIMIT));
        Self {
            secret,
            public,
            limiter,
        }
    }
}

/// One peer: its configuration, tunnel, timers and counters.
struct Peer {
    public_key: Key,
    preshared_key: Option<Key>,
    endpoint: Option<SocketAddr>,
    persistent_keepalive: u16,
    /// The Noise state, made when first needed (a packet to send, an initiation
    /// received, a timer) and dropped when the keys expire: an idle peer costs only
    /// its configuration. Boxed: a `Tunn` holds eight sessions inline (kilobytes).
    tunnel: Option<Box<Tunn>>,
    timers: PeerTimers,
    last_handshake: Option<SystemTime>,
    rx_bytes: u64,
    tx_bytes: u64,
}

/// What a `set=1` changes and packets only read: the lock order's first lock.
struct Table {
    identity: Option<Identity>,
    listen_port: u16,
    fwmark: u32,
    peers: BTreeMap<u32, Mutex<Peer>>,
    by_key: HashMap<Key, u32>,
    next_id: u32,
    routes: AllowedIps<u32>,
}

/// A test's view into the seal path: called with the peer's id while its lock is held.
#[cfg(test)]
type SealHook = Box<dyn Fn(u32) + Send + Sync>;

/// The whole device state.
pub struct DeviceCore {
    table: RwLock<Table>,
    counters: AtomicCounters,
    /// When the rate limiter first counted a handshake message since its last reset.
    limiter_counting_since: Mutex<Option<Instant>>,
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
            }),
            counters: AtomicCounters::default(),
            limiter_counting_since: Mutex::new(None),
            epoch: Instant::now(),
            timer_due: AtomicU64::new(NO_DEADLINE),
            wake_timer: AtomicBool::new(false),
            #[cfg(test)]
            seal_hook: None,
        }
    }
}

/// Locks `m`. A panic elsewhere poisons a lock; the state stays consistent between
/// calls, so carry on rather than take the whole device down.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The peer's tunnel (its `tunnel` field), made now if it has none yet.
fn tunnel_of<'a>(identity: &Identity, peer: PeerTunnel<'a>, id: u32) -> &'a mut Tunn {
    let PeerTunnel(slot, public_key, preshared_key) = peer;
    slot.get_or_insert_with(|| Box::new(new_tunnel(identity, public_key, preshared_key, id)))
}

/// A peer's tunnel slot with its public and preshared keys: borrows only that field,
/// so the peer's counters and timers stay usable beside the tunnel.
struct PeerTunnel<'a>(&'a mut Option<Box<Tunn>>, Key, Option<Key>);

fn new_tunnel(identity: &Identity, public_key: Key, preshared_key: Option<Key>, id: u32) -> Tunn {
    Tunn::new(
        identity.secret.clone(),
        PublicKey::from(public_key),
        preshared_key,
        // The persistent keepalive is ours (timers.rs): the tunnel's own timer
        // routine is never called.
        None,
        id,
        Some(identity.limiter.clone()),
    )
}

/// What went out, from the message type in its first byte and its length.
fn note_sent(timers: &mut PeerTimers, datagram: &[u8], now: Instant) -> TimerAction {
    // Type 4 (transport) with an empty payload is 16 bytes of header and a 16-byte tag.
    match datagram.first() {
        Some(1) => {
            timers.on_handshake_sent(now);
            TimerAction::Idle
        }
        Some(4) if datagram.len() > 32 => timers.on_data_sent(now),
        _ => {
            timers.on_packet_sent(now);
            TimerAction::Idle
        }
    }
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

    /// When `tick` next has something to do: the earliest deadline of any peer's
    /// timers or of the rate limiter's reset (`None`: nothing pending). The timer
    /// loop sleeps until then, or until a packet makes a deadline earlier.
    pub fn next_deadline(&self, now: Instant) -> Option<Instant> {
        // While the peers are looked at, a packet may move a deadline of one already
        // looked at. Against "nothing pending" any deadline is earlier, so the packet
        // records it in `timer_due`, and the `fetch_min` below returns it. Wakes from
        // that window are cleared first: the answer already holds their deadlines
        // (waking for them, the loop would go round again under traffic, every time).
        self.timer_due.store(NO_DEADLINE, Ordering::SeqCst);
        let limiter = lock(&self.limiter_counting_since).map(|t| t + RATE_LIMIT_WINDOW);
        let table = self.read();
        let peers = table.identity.as_ref().and_then(|_| {
            table
                .peers
                .values()
                .filter_map(|p| lock(p).timers.next_deadline(now))
                .min()
        });
        let due = limiter.into_iter().chain(peers).min();
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
        // Only a load in the common case (not earlier): the two packet threads would
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
            table.set_private_key(key);
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
                table.remove_peer(id);
            }
        }
        for change in req.peers {
            table.apply_peer(change);
        }
    }
}

impl Table {
    fn set_private_key(&mut self, key: Option<Key>) {
        // Writers such as `wg setconf` resend the same key: that must not cost every
        // peer its session.
        if self.identity.as_ref().map(|i| i.secret.to_bytes()) == key {
            return;
        }
        self.identity = key.map(Identity::new);
        // As the kernel does: a peer with the new identity's public key goes.
        let own = self.identity.as_ref().map(|i| *i.public.as_bytes());
        if let Some(id) = own.and_then(|key| self.by_key.get(&key).copied()) {
            self.remove_peer(id);
        }
        for peer in self.peers.values_mut() {
            let peer = peer.get_mut().unwrap_or_else(PoisonError::into_inner);
            peer.tunnel = None;
            peer.timers = PeerTimers::new(peer.persistent_keepalive);
        }
    }

    fn remove_peer(&mut self, id: u32) {
        if let Some(peer) = self.peers.remove(&id) {
            let peer = peer.into_inner().unwrap_or_else(PoisonError::into_inner);
            self.by_key.remove(&peer.public_key);
            self.routes.remove_peer(id);
        }
    }

    fn apply_peer(&mut self, change: PeerChange) {
        let existing = self.by_key.get(&change.public_key).copied();
        if change.remove {
            if let Some(id) = existing {
                self.remove_peer(id);
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
                .is_some_and(|i| *i.public.as_bytes() == change.public_key) =>
            {
                return
            }
            None => self.add_peer(change.public_key),
        };
        let Some(peer) = self.peers.get_mut(&id) else {
            return;
        };
        // The write lock is held: no other thread can hold the peer's lock.
        let peer = peer.get_mut().unwrap_or_else(PoisonError::into_inner);
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
                peer.tunnel = None;
                peer.timers = PeerTimers::new(peer.persistent_keepalive);
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
        // Ids are the upper 24 bits of the session index the tunnel puts on the wire.
        let id = self.next_id;
        self.next_id = (self.next_id + 1) & 0x00ff_ffff;
        let peer = Peer {
            public_key,
            preshared_key: None,
            endpoint: None,
            persistent_keepalive: 0,
            tunnel: None,
            timers: PeerTimers::new(0),
            last_handshake: None,
            rx_bytes: 0,
            tx_bytes: 0,
        };
        self.peers.insert(id, Mutex::new(peer));
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
            let _ = writeln!(out, "private_key={}", hex::encode(id.secret.to_bytes()));
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
        let mut held = None;
        for packet in packets {
            self.seal(&table, &mut held, packet, now, io);
        }
    }

    fn seal<'t>(
        &self,
        table: &'t Table,
        held: &mut Held<'t>,
        packet: &[u8],
        now: Instant,
        io: &mut impl Io,
    ) {
        let Some(id) = packet_destination(packet).and_then(|dst| table.routes.lookup(dst)) else {
            bump(&self.counters.unroutable_packets);
            return;
        };
        let Some(peer) = hold(table, held, id) else {
            return;
        };
        let (Some(identity), Some(endpoint)) = (table.identity.as_ref(), peer.endpoint) else {
            bump(&self.counters.unroutable_packets);
            return;
        };
        #[cfg(test)]
        if let Some(hook) = &self.seal_hook {
            hook(id);
        }
        SCRATCH.with_borrow_mut(|buf| {
            let tunnel = tunnel_of(
                identity,
                PeerTunnel(&mut peer.tunnel, peer.public_key, peer.preshared_key),
                id,
            );
            let action = match tunnel.encapsulate(packet, buf) {
                TunnResult::WriteToNetwork(out) => {
                    peer.tx_bytes += out.len() as u64;
                    io.send(endpoint, out);
                    note_sent(&mut peer.timers, out, now)
                }
                // Queued until a session exists. A handshake the timers gave up on
                // stays "in progress" inside the tunnel: new traffic restarts it here.
                _ if !peer.timers.handshake_in_progress() => TimerAction::SendHandshake,
                _ => TimerAction::Idle,
            };
            act(identity, id, peer, action, now, buf, io);
        });
        self.note_deadline(peer.timers.next_deadline(now));
    }

    /// An encrypted datagram from the socket: authenticate it, update the peer's
    /// endpoint (roaming) and timers, and write what it carried to the TUN.
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

    /// A batch of datagrams, each handled as by [`Self::handle_datagram`], with a
    /// peer's lock kept over a run of its datagrams (see [`Self::handle_tun_packets`]).
    pub fn handle_datagrams<'d>(
        &self,
        datagrams: impl IntoIterator<Item = (SocketAddr, &'d [u8])>,
        now: Instant,
        wall: SystemTime,
        io: &mut impl Io,
    ) {
        let table = self.read();
        let mut held = None;
        for (from, datagram) in datagrams {
            self.open_datagram(&table, &mut held, (from, datagram), (now, wall), io);
        }
    }

    fn open_datagram<'t>(
        &self,
        table: &'t Table,
        held: &mut Held<'t>,
        (from, datagram): (SocketAddr, &[u8]),
        (now, wall): (Instant, SystemTime),
        io: &mut impl Io,
    ) {
        let Some(identity) = table.identity.as_ref() else {
            bump(&self.counters.invalid_datagrams);
            return;
        };
        let mut cookie = [0u8; 64];
        let id = match identity
            .limiter
            .verify_packet(Some(from.ip()), datagram, &mut cookie)
        {
            Ok(Packet::HandshakeInit(init)) => {
                parse_handshake_anon(&identity.secret, &identity.public, &init)
                    .ok()
                    .and_then(|half| table.by_key.get(&half.peer_static_public).copied())
            }
            Ok(Packet::HandshakeResponse(p)) => Some(p.receiver_idx >> 8),
            Ok(Packet::PacketCookieReply(p)) => Some(p.receiver_idx >> 8),
            Ok(Packet::PacketData(p)) => Some(p.receiver_idx >> 8),
            Err(TunnResult::WriteToNetwork(reply)) => {
                bump(&self.counters.cookie_replies);
                io.send(from, reply);
                return;
            }
            Err(_) => None,
        };
        let Some((id, peer)) = id.and_then(|id| hold(table, held, id).map(|p| (id, p))) else {
            bump(&self.counters.invalid_datagrams);
            return;
        };
        let kind = datagram[0];
        // Only an initiation can start a peer's first session: anything else for a
        // peer without a tunnel is stale or forged.
        if peer.tunnel.is_none() && kind != 1 {
            bump(&self.counters.invalid_datagrams);
            return;
        }
        if kind == 1 || kind == 2 {
            let since = *lock(&self.limiter_counting_since).get_or_insert(now);
            self.note_deadline(Some(since + RATE_LIMIT_WINDOW));
        }
        let opened = SCRATCH
            .with_borrow_mut(|buf| open(table, id, peer, (from, datagram), (now, wall), buf, io));
        if opened == Opened::Invalid {
            bump(&self.counters.invalid_datagrams);
            return;
        }
        if opened == Opened::Spoofed {
            bump(&self.counters.spoofed_packets);
        }
        self.note_deadline(peer.timers.next_deadline(now));
    }

    /// Runs every peer's timers and resets the rate limiter's count once its window
    /// is over; the loop calls it at `next_deadline`.
    pub fn tick(&self, now: Instant, io: &mut impl Io) {
        let table = self.read();
        let Some(identity) = table.identity.as_ref() else {
            return;
        };
        {
            let mut since = lock(&self.limiter_counting_since);
            if since.is_some_and(|t| now >= t + RATE_LIMIT_WINDOW) {
                identity.limiter.reset_count();
                *since = None;
            }
        }
        SCRATCH.with_borrow_mut(|buf| {
            for (id, peer) in &table.peers {
                let mut peer = lock(peer);
                let action = peer.timers.tick(now);
                act(identity, *id, &mut peer, action, now, buf, io);
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

/// What became of a datagram addressed to a known peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Opened {
    /// Authenticated and handled.
    Accepted,
    /// Authenticated, but the packet inside came from outside the peer's allowed IPs.
    Spoofed,
    /// Not authenticated (or not a message the tunnel takes): dropped.
    Invalid,
}

/// Opens one datagram with the peer's tunnel (its lock held): answers handshakes,
/// sends what was queued for the session, writes the packet it carried to the TUN
/// when its source routes back to the peer, and follows the peer to its new address.
fn open(
    table: &Table,
    id: u32,
    peer: &mut Peer,
    (from, datagram): (SocketAddr, &[u8]),
    (now, wall): (Instant, SystemTime),
    buf: &mut [u8],
    io: &mut impl Io,
) -> Opened {
    let Some(identity) = table.identity.as_ref() else {
        return Opened::Invalid;
    };
    let kind = datagram[0];
    let tunnel = tunnel_of(
        identity,
        PeerTunnel(&mut peer.tunnel, peer.public_key, peer.preshared_key),
        id,
    );
    let mut action = TimerAction::Idle;
    let mut opened = Opened::Accepted;
    let inner = match tunnel.decapsulate(Some(from.ip()), datagram, buf) {
        TunnResult::Err(e) => {
            tracing::trace!(peer = id, error = ?e, "datagram dropped");
            return Opened::Invalid;
        }
        TunnResult::WriteToNetwork(out) => {
            peer.tx_bytes += out.len() as u64;
            io.send(from, out);
            // An initiation answered with a response, or a response answered with
            // the confirming keepalive (not a cookie reply under load).
            if (kind == 1 && out[0] == 2) || (kind == 2 && out[0] == 4) {
                peer.timers.on_session_established(now, kind == 2);
                peer.last_handshake = Some(wall);
            }
            note_sent(&mut peer.timers, out, now);
            // Packets queued while the handshake ran go out now.
            while let TunnResult::WriteToNetwork(out) = tunnel.decapsulate(None, &[], buf) {
                peer.tx_bytes += out.len() as u64;
                io.send(from, out);
                if note_sent(&mut peer.timers, out, now) == TimerAction::SendHandshake {
                    action = TimerAction::SendHandshake;
                }
            }
            None
        }
        TunnResult::WriteToTunnelV4(packet, src) => Some((IpAddr::V4(src), &*packet)),
        TunnResult::WriteToTunnelV6(packet, src) => Some((IpAddr::V6(src), &*packet)),
        TunnResult::Done => None,
    };
    if let Some((src, packet)) = inner {
        // A peer may only send from its own allowed IPs.
        if table.routes.lookup(src) == Some(id) {
            io.write_tun(packet);
            action = peer.timers.on_data_received(now);
        } else {
            opened = Opened::Spoofed;
        }
    }
    // Authenticated: count it and follow the peer to its new address.
    peer.rx_bytes += datagram.len() as u64;
    peer.timers.on_authenticated_received();
    peer.endpoint = Some(from);
    act(identity, id, peer, action, now, buf, io);
    opened
}

/// Carries out a timer action for one peer.
fn act(
    identity: &Identity,
    id: u32,
    peer: &mut Peer,
    action: TimerAction,
    now: Instant,
    buf: &mut [u8],
    io: &mut impl Io,
) {
    let result = match action {
        TimerAction::Idle => return,
        TimerAction::ExpireKeys => {
            tracing::debug!(peer = id, "session keys expired");
            // A new tunnel is made when next needed.
            peer.tunnel = None;
            return;
        }
        TimerAction::SendHandshake => tunnel_of(
            identity,
            PeerTunnel(&mut peer.tunnel, peer.public_key, peer.preshared_key),
            id,
        )
        .format_handshake_initiation(buf, true),
        TimerAction::SendKeepalive => tunnel_of(
            identity,
            PeerTunnel(&mut peer.tunnel, peer.public_key, peer.preshared_key),
            id,
        )
        .encapsulate(&[], buf),
    };
    match (result, peer.endpoint) {
        (TunnResult::WriteToNetwork(out), Some(endpoint)) => {
            peer.tx_bytes += out.len() as u64;
            io.send(endpoint, out);
            note_sent(&mut peer.timers, out, now);
        }
        _ if action == TimerAction::SendHandshake => {
            // No endpoint yet: count the attempt so it is retried on the timer's cadence.
            peer.timers.on_handshake_sent(now);
        }
        // Likewise a (persistent) keepalive: due again after its interval, not at once.
        _ if action == TimerAction::SendKeepalive => peer.timers.on_packet_sent(now),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::userspace_wireguard::{timers::REKEY_TIMEOUT, uapi_request::parse_set};

    /// Captures what a core sends and delivers.
    #[derive(Default)]
    struct Captured {
        sent: Vec<(SocketAddr, Vec<u8>)>,
        tun: Vec<Vec<u8>>,
    }

    impl Io for Captured {
        fn send(&mut self, to: SocketAddr, datagram: &[u8]) {
            self.sent.push((to, datagram.to_vec()));
        }
        fn write_tun(&mut self, packet: &[u8]) {
            self.tun.push(packet.to_vec());
        }
    }

    const ADDR_A: &str = "192.0.2.1:51820";
    const ADDR_B: &str = "192.0.2.2:51820";

    fn secret(n: u8) -> Key {
        [n; 32]
    }

    fn public(n: u8) -> String {
        hex::encode(PublicKey::from(&StaticSecret::from(secret(n))).as_bytes())
    }

    /// A core with private key `me`, one peer `peer` owning 10.0.0.`peer`/32.
    fn core(me: u8, peer: u8, endpoint: &str) -> DeviceCore {
        let c = DeviceCore::default();
        let body = format!(
            "private_key={}\npublic_key={}\nendpoint={endpoint}\nallowed_ip=10.0.0.{peer}/32\n",
            hex::encode(secret(me)),
            public(peer)
        );
        c.apply_set(parse_set(&body).unwrap());
        c
    }

    /// A minimal IPv4 packet from 10.0.0.`src` to 10.0.0.`dst` with 8 bytes of payload.
    fn ipv4(src: u8, dst: u8) -> Vec<u8> {
        let mut p = vec![0u8; 28];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&28u16.to_be_bytes());
        p[8] = 64;
        p[9] = 17;
        p[12..16].copy_from_slice(&Ipv4Addr::new(10, 0, 0, src).octets());
        p[16..20].copy_from_slice(&Ipv4Addr::new(10, 0, 0, dst).octets());
        p
    }

    /// Delivers every datagram in `from_io` to `to`, as coming from `from_addr`.
    fn deliver(from_io: &mut Captured, from_addr: &str, to: &DeviceCore, now: Instant) -> Captured {
        let mut out = Captured::default();
        for (_, d) in from_io.sent.drain(..) {
            to.handle_datagram(
                from_addr.parse().unwrap(),
                &d,
                now,
                SystemTime::now(),
                &mut out,
            );
        }
        out
    }

    /// A and B after a handshake started by A's first packet; returns what B delivered.
    fn handshaken(now: Instant) -> (DeviceCore, DeviceCore, Captured) {
        let a = core(1, 2, ADDR_B);
        let b = core(2, 1, ADDR_A);
        let mut io_a = Captured::default();
        a.handle_tun_packet(&ipv4(1, 2), now, &mut io_a);
        assert_eq!(io_a.sent[0].1[0], 1, "a handshake initiation");
        let mut io_b = deliver(&mut io_a, ADDR_A, &b, now);
        assert_eq!(io_b.sent[0].1[0], 2, "a handshake response");
        let mut io_a = deliver(&mut io_b, ADDR_B, &a, now);
        // A's queued packet and a keepalive confirm the session to B.
        let io_b = deliver(&mut io_a, ADDR_A, &b, now);
        (a, b, io_b)
    }

    #[test]
    fn a_queued_packet_crosses_after_the_handshake() {
        let (_, b, io_b) = handshaken(Instant::now());
        assert_eq!(io_b.tun, vec![ipv4(1, 2)]);
        assert!(b.render_get().contains("last_handshake_time_sec="));
        assert!(!b.render_get().contains("last_handshake_time_sec=0\n"));
    }

    #[test]
    fn resending_the_same_private_key_keeps_the_session() {
        let now = Instant::now();
        let (a, _, _) = handshaken(now);
        let same = format!("private_key={}\n", hex::encode(secret(1)));
        a.apply_set(parse_set(&same).unwrap());
        let mut io = Captured::default();
        a.handle_tun_packet(&ipv4(1, 2), now, &mut io);
        assert_eq!(io.sent[0].1[0], 4, "data on the existing session");
        // A new key does start over.
        let other = format!("private_key={}\n", hex::encode(secret(9)));
        a.apply_set(parse_set(&other).unwrap());
        let mut io = Captured::default();
        a.handle_tun_packet(&ipv4(1, 2), now, &mut io);
        assert_eq!(io.sent[0].1[0], 1, "a new handshake");
    }

    #[test]
    fn removed_peers_lose_their_routes_and_update_only_creates_nothing() {
        let now = Instant::now();
        let a = core(1, 2, ADDR_B);
        let set = |c: &DeviceCore, body: String| c.apply_set(parse_set(&body).unwrap());
        set(
            &a,
            format!(
                "public_key={}\nupdate_only=true\nallowed_ip=10.9.0.0/16\n",
                public(3)
            ),
        );
        assert_eq!(a.peer_count(), 1, "update_only never creates");
        set(&a, format!("public_key={}\nremove=true\n", public(2)));
        assert_eq!(a.peer_count(), 0);
        assert!(!a.render_get().contains("allowed_ip="));
        let mut io = Captured::default();
        a.handle_tun_packet(&ipv4(1, 2), now, &mut io);
        assert!(io.sent.is_empty());
        assert_eq!(a.counters().unroutable_packets, 1);
        // replace_peers leaves exactly the peers of the request.
        set(
            &a,
            format!("public_key={}\nallowed_ip=10.0.0.3/32\n", public(3)),
        );
        set(
            &a,
            format!(
                "replace_peers=true\npublic_key={}\nallowed_ip=10.0.0.4/32\n",
                public(4)
            ),
        );
        let get = a.render_get();
        assert!(
            !get.contains(&public(3)) && get.contains(&public(4)),
            "{get}"
        );
    }

    #[test]
    fn the_endpoint_follows_the_peer_to_its_new_address() {
        let now = Instant::now();
        let (a, b, _) = handshaken(now);
        let mut io_a = Captured::default();
        a.handle_tun_packet(&ipv4(1, 2), now, &mut io_a);
        let io_b = deliver(&mut io_a, "198.51.100.7:4000", &b, now);
        assert_eq!(io_b.tun.len(), 1);
        assert!(
            b.render_get().contains("endpoint=198.51.100.7:4000"),
            "{}",
            b.render_get()
        );
        let mut io_b = Captured::default();
        b.handle_tun_packet(&ipv4(2, 1), now, &mut io_b);
        assert_eq!(io_b.sent[0].0, "198.51.100.7:4000".parse().unwrap());
    }

    #[test]
    fn a_packet_from_outside_the_peers_allowed_ips_is_dropped() {
        let now = Instant::now();
        let (a, b, _) = handshaken(now);
        let mut io_a = Captured::default();
        // A's route to B is 10.0.0.2/32; give A a route for the spoofing source too.
        a.apply_set(
            parse_set(&format!(
                "public_key={}\nallowed_ip=10.0.0.0/24\n",
                public(2)
            ))
            .unwrap(),
        );
        a.handle_tun_packet(&ipv4(9, 2), now, &mut io_a);
        let io_b = deliver(&mut io_a, ADDR_A, &b, now);
        assert!(io_b.tun.is_empty());
        assert_eq!(b.counters().spoofed_packets, 1);
    }

    #[test]
    fn garbage_is_counted_not_delivered() {
        let now = Instant::now();
        let (_, b, _) = handshaken(now);
        let mut io = Captured::default();
        for d in [&[1u8][..], &[4u8; 64][..], &[1u8; 148][..], &[7u8; 40][..]] {
            b.handle_datagram(ADDR_A.parse().unwrap(), d, now, SystemTime::now(), &mut io);
        }
        assert!(io.tun.is_empty() && io.sent.is_empty());
        assert_eq!(b.counters().invalid_datagrams, 4);
    }

    #[test]
    fn an_idle_device_has_no_deadline_until_a_packet_brings_one_and_wakes_the_timer() {
        let now = Instant::now();
        let a = core(1, 2, ADDR_B);
        assert_eq!(
            a.next_deadline(now),
            None,
            "configured peers that never talk"
        );
        assert!(
            a.read().peers.values().all(|p| lock(p).tunnel.is_none()),
            "no tunnel made yet"
        );
        let mut io = Captured::default();
        a.handle_tun_packet(&ipv4(1, 2), now, &mut io);
        assert!(
            a.take_timer_wake(),
            "the handshake's retry is the new earliest deadline"
        );
        assert!(!a.take_timer_wake(), "once");
        assert_eq!(a.next_deadline(now), Some(now + REKEY_TIMEOUT));
        // A second packet brings nothing earlier: no wake.
        a.handle_tun_packet(&ipv4(1, 2), now, &mut io);
        assert!(!a.take_timer_wake());
    }

    #[test]
    fn a_flood_of_initiations_gets_cookie_replies() {
        let now = Instant::now();
        let b = core(2, 1, ADDR_A);
        let mut flooder = Tunn::new(
            StaticSecret::from(secret(1)),
            PublicKey::from(&StaticSecret::from(secret(2))),
            None,
            None,
            7,
            None,
        );
        let mut buf = vec![0u8; 256];
        let mut io = Captured::default();
        for _ in 0..150 {
            let TunnResult::WriteToNetwork(init) =
                flooder.format_handshake_initiation(&mut buf, true)
            else {
                panic!("an initiation");
            };
            b.handle_datagram(
                ADDR_A.parse().unwrap(),
                init,
                now,
                SystemTime::now(),
                &mut io,
            );
        }
        let cookies = io.sent.iter().filter(|(_, d)| d[0] == 3).count();
        assert!(cookies > 0, "cookie replies under load");
        assert_eq!(b.counters().cookie_replies, cookies as u64);
        // (The limiter's count is reset on boringtun's own clock, once a second of
        // real time: not something a fake clock can drive.)
    }
    /// Two peers' packets are sealed at once: each thread, inside the seal path with
    /// its peer's lock held, waits (up to a deadline) until the other is inside too.
    /// Under one device-wide lock the second could never enter while the first waits.
    #[test]
    fn two_peers_are_sealed_at_once_by_two_threads() {
        use std::sync::atomic::AtomicUsize;
        let most_at_once = Arc::new(AtomicUsize::new(0));
        let mut a = core(1, 2, ADDR_B);
        a.apply_set(
            parse_set(&format!(
                "public_key={}\nendpoint={ADDR_B}\nallowed_ip=10.0.0.3/32\n",
                public(3)
            ))
            .unwrap(),
        );
        a.seal_hook = Some(Box::new({
            // How many threads are inside now, and have ever come in.
            let (inside, arrived) = (AtomicUsize::new(0), AtomicUsize::new(0));
            let most = most_at_once.clone();
            move |_| {
                most.fetch_max(inside.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
                arrived.fetch_add(1, Ordering::SeqCst);
                // The first one in stays until the second has come in.
                let deadline = Instant::now() + Duration::from_secs(5);
                while arrived.load(Ordering::SeqCst) < 2 && Instant::now() < deadline {
                    std::thread::yield_now();
                }
                inside.fetch_sub(1, Ordering::SeqCst);
            }
        }));
        let now = Instant::now();
        let sent: Vec<Captured> = std::thread::scope(|s| {
            let a = &a;
            let seal = |dst| {
                s.spawn(move || {
                    let mut io = Captured::default();
                    a.handle_tun_packet(&ipv4(1, dst), now, &mut io);
                    io
                })
            };
            let (to_2, to_3) = (seal(2), seal(3));
            vec![to_2.join().unwrap(), to_3.join().unwrap()]
        });
        assert_eq!(most_at_once.load(Ordering::SeqCst), 2);
        // Each thread's output is its own peer's handshake initiation.
        assert!(sent
            .iter()
            .all(|io| io.sent.len() == 1 && io.sent[0].1[0] == 1));
    }

    #[test]
    fn the_peer_table_finds_peers_by_route_key_and_index_after_changes() {
        let now = Instant::now();
        let (a, b, _) = handshaken(now);
        // A third peer on B, then the first peer's route moved to it: data from A
        // still opens (found by index) but its source no longer routes back to A.
        b.apply_set(
            parse_set(&format!(
                "public_key={}\nallowed_ip=10.0.0.0/24\n",
                public(3)
            ))
            .unwrap(),
        );
        b.apply_set(
            parse_set(&format!(
                "public_key={}\nreplace_allowed_ips=true\nallowed_ip=10.0.1.1/32\n",
                public(1)
            ))
            .unwrap(),
        );
        let mut io_a = Captured::default();
        a.handle_tun_packet(&ipv4(1, 2), now, &mut io_a);
        let io_b = deliver(&mut io_a, ADDR_A, &b, now);
        assert!(io_b.tun.is_empty());
        assert_eq!(b.counters().spoofed_packets, 1);
        assert_eq!(b.peer_count(), 2);
        // B's packets to 10.0.0.1 now route to the third peer, which has no endpoint.
        let mut io_b = Captured::default();
        b.handle_tun_packet(&ipv4(2, 1), now, &mut io_b);
        assert!(io_b.sent.is_empty());
        assert_eq!(b.counters().unroutable_packets, 1);
    }
    #[test]
    fn a_batch_switching_between_peers_seals_each_packet_for_its_own_peer_in_order() {
        let now = Instant::now();
        let (a, b, _) = handshaken(now);
        a.apply_set(
            parse_set(&format!(
                "public_key={}\nendpoint=192.0.2.3:51820\nallowed_ip=10.0.0.3/32\n",
                public(3)
            ))
            .unwrap(),
        );
        let mut to_b = ipv4(1, 2);
        to_b[27] = 1;
        let batch = [to_b.clone(), ipv4(1, 3), ipv4(1, 2), to_b];
        let mut io_a = Captured::default();
        a.handle_tun_packets(batch.iter().map(Vec::as_slice), now, &mut io_a);
        let shape: Vec<(String, u8)> = io_a
            .sent
            .iter()
            .map(|(to, d)| (to.to_string(), d[0]))
            .collect();
        let (b_data, c_init) = ((ADDR_B.to_owned(), 4), ("192.0.2.3:51820".to_owned(), 1));
        assert_eq!(shape, vec![b_data.clone(), c_init, b_data.clone(), b_data]);
        io_a.sent.retain(|(to, _)| to.to_string() == ADDR_B);
        let io_b = deliver(&mut io_a, ADDR_A, &b, now);
        assert_eq!(
            io_b.tun,
            vec![batch[0].clone(), batch[2].clone(), batch[3].clone()]
        );
    }
}
