//! The device's state and packet logic, sans-IO: configuration (applied from parsed
//! UAPI requests), the allowed-IPs table, one Noise tunnel and one timer state per
//! peer. Packets come in as byte slices with `now` passed in; what must go out is
//! handed to an [`Io`]. The device loop owns the TUN and the socket.

use std::{
    collections::{BTreeMap, HashMap},
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use boringtun::{
    noise::{handshake::parse_handshake_anon, rate_limiter::RateLimiter, Packet, Tunn, TunnResult},
    x25519::{PublicKey, StaticSecret},
};

use super::{
    allowed_ips::{packet_destination, AllowedIps},
    timers::{PeerTimers, TimerAction},
    uapi_request::{Key, PeerChange, SetRequest},
};

/// Handshake messages per second above which the device answers with cookies. Each
/// message is checked twice (by the device to find the peer, then by the peer's
/// tunnel), so the count is double the protocol's limit.
const HANDSHAKE_RATE_LIMIT: u64 = 2 * 100;

/// How long the handshake rate limiter counts before its count is reset.
const RATE_LIMIT_WINDOW: Duration = Duration::from_secs(1);

/// Room for any packet plus WireGuard's overhead.
const BUFFER_SIZE: usize = 65_536 + 64;

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

/// The whole device state.
pub struct DeviceCore {
    identity: Option<Identity>,
    /// The port the socket is bound to (the loop keeps it current).
    pub listen_port: u16,
    /// The socket mark (0: none).
    pub fwmark: u32,
    peers: BTreeMap<u32, Peer>,
    by_key: HashMap<Key, u32>,
    next_id: u32,
    routes: AllowedIps<u32>,
    counters: DeviceCounters,
    buf: Vec<u8>,
    /// When the rate limiter first counted a handshake message since its last reset.
    limiter_counting_since: Option<Instant>,
    /// When the timer loop will next run `tick` (`None`: not until woken).
    timer_due: Option<Instant>,
    /// A packet made a deadline earlier than `timer_due`: the timer loop must wake.
    wake_timer: bool,
}

impl Default for DeviceCore {
    fn default() -> Self {
        Self {
            identity: None,
            listen_port: 0,
            fwmark: 0,
            peers: BTreeMap::new(),
            by_key: HashMap::new(),
            next_id: 1,
            routes: AllowedIps::default(),
            counters: DeviceCounters::default(),
            buf: vec![0; BUFFER_SIZE],
            limiter_counting_since: None,
            timer_due: None,
            wake_timer: false,
        }
    }
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
    /// The device's counters.
    pub fn counters(&self) -> DeviceCounters {
        self.counters
    }

    /// The number of peers.
    pub fn peer_count(&self) -> usize {
        self.peers.len()
    }

    /// When `tick` next has something to do: the earliest deadline of any peer's
    /// timers or of the rate limiter's reset (`None`: nothing pending). The timer
    /// loop sleeps until then, or until a packet makes a deadline earlier.
    pub fn next_deadline(&mut self, now: Instant) -> Option<Instant> {
        let limiter = self.limiter_counting_since.map(|t| t + RATE_LIMIT_WINDOW);
        let peers = self.identity.as_ref().and_then(|_| {
            self.peers
                .values()
                .filter_map(|p| p.timers.next_deadline(now))
                .min()
        });
        let due = limiter.into_iter().chain(peers).min();
        self.timer_due = due;
        self.wake_timer = false;
        due
    }

    /// True (once) when a packet made a deadline earlier than the one the timer loop
    /// sleeps until.
    pub fn take_timer_wake(&mut self) -> bool {
        std::mem::take(&mut self.wake_timer)
    }

    fn note_deadline(&mut self, due: Option<Instant>) {
        if let Some(due) = due {
            if self.timer_due.is_none_or(|t| due < t) {
                self.timer_due = Some(due);
                self.wake_timer = true;
            }
        }
    }

    /// Applies a parsed `set=1` request (the listen port and mark are the loop's: it
    /// binds and marks the socket before calling this, so nothing here can fail).
    pub fn apply_set(&mut self, req: SetRequest) {
        if let Some(key) = req.private_key {
            self.set_private_key(key);
        }
        if let Some(port) = req.listen_port {
            self.listen_port = port;
        }
        if let Some(mark) = req.fwmark {
            self.fwmark = mark;
        }
        if req.replace_peers {
            let ids: Vec<u32> = self.peers.keys().copied().collect();
            for id in ids {
                self.remove_peer(id);
            }
        }
        for change in req.peers {
            self.apply_peer(change);
        }
    }

    fn set_private_key(&mut self, key: Option<Key>) {
        // Writers such as `wg setconf` resend the same key: that must not cost every
        // peer its session.
        if self.identity.as_ref().map(|i| i.secret.to_bytes()) == key {
            return;
        }
        self.identity = key.map(Identity::new);
        for peer in self.peers.values_mut() {
            peer.tunnel = None;
            peer.timers = PeerTimers::new(peer.persistent_keepalive);
        }
    }

    fn remove_peer(&mut self, id: u32) {
        if let Some(peer) = self.peers.remove(&id) {
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
            None => self.add_peer(change.public_key),
        };
        let Some(peer) = self.peers.get_mut(&id) else {
            return;
        };
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
        for net in change.allowed_ips {
            self.routes.insert(net.trunc(), id);
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
        self.peers.insert(id, peer);
        self.by_key.insert(public_key, id);
        id
    }

    /// The `get=1` answer, without the final `errno=0` line.
    pub fn render_get(&self) -> String {
        let mut out = String::new();
        if let Some(id) = &self.identity {
            let _ = writeln!(out, "private_key={}", hex::encode(id.secret.to_bytes()));
        }
        let _ = writeln!(out, "listen_port={}", self.listen_port);
        if self.fwmark != 0 {
            let _ = writeln!(out, "fwmark={}", self.fwmark);
        }
        for (id, peer) in &self.peers {
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
            for net in self.routes.prefixes_of(*id) {
                let _ = writeln!(out, "allowed_ip={net}");
            }
        }
        out
    }

    /// An IP packet read from the TUN: encrypt it for the peer its destination routes to.
    pub fn handle_tun_packet(&mut self, packet: &[u8], now: Instant, io: &mut impl Io) {
        let Some(id) = packet_destination(packet).and_then(|dst| self.routes.lookup(dst)) else {
            self.counters.unroutable_packets += 1;
            return;
        };
        let Some(peer) = self.peers.get_mut(&id) else {
            return;
        };
        let (Some(identity), Some(endpoint)) = (self.identity.as_ref(), peer.endpoint) else {
            self.counters.unroutable_packets += 1;
            return;
        };
        let tunnel = tunnel_of(
            identity,
            PeerTunnel(&mut peer.tunnel, peer.public_key, peer.preshared_key),
            id,
        );
        let action = match tunnel.encapsulate(packet, &mut self.buf) {
            TunnResult::WriteToNetwork(out) => {
                peer.tx_bytes += out.len() as u64;
                io.send(endpoint, out);
                note_sent(&mut peer.timers, out, now)
            }
            // Queued until a session exists. A handshake the timers gave up on stays
            // "in progress" inside the tunnel: new traffic restarts it here.
            _ if !peer.timers.handshake_in_progress() => TimerAction::SendHandshake,
            _ => TimerAction::Idle,
        };
        act(identity, id, peer, action, now, &mut self.buf, io);
        let due = peer.timers.next_deadline(now);
        self.note_deadline(due);
    }

    /// An encrypted datagram from the socket: authenticate it, update the peer's
    /// endpoint (roaming) and timers, and write what it carried to the TUN.
    pub fn handle_datagram(
        &mut self,
        from: SocketAddr,
        datagram: &[u8],
        now: Instant,
        wall: SystemTime,
        io: &mut impl Io,
    ) {
        let Some(identity) = self.identity.as_ref() else {
            self.counters.invalid_datagrams += 1;
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
                    .and_then(|half| self.by_key.get(&half.peer_static_public).copied())
            }
            Ok(Packet::HandshakeResponse(p)) => Some(p.receiver_idx >> 8),
            Ok(Packet::PacketCookieReply(p)) => Some(p.receiver_idx >> 8),
            Ok(Packet::PacketData(p)) => Some(p.receiver_idx >> 8),
            Err(TunnResult::WriteToNetwork(reply)) => {
                self.counters.cookie_replies += 1;
                io.send(from, reply);
                return;
            }
            Err(_) => None,
        };
        let Some((id, peer)) = id.and_then(|id| self.peers.get_mut(&id).map(|p| (id, p))) else {
            self.counters.invalid_datagrams += 1;
            return;
        };
        let kind = datagram[0];
        // Only an initiation can start a peer's first session: anything else for a
        // peer without a tunnel is stale or forged.
        if peer.tunnel.is_none() && kind != 1 {
            self.counters.invalid_datagrams += 1;
            return;
        }
        if kind == 1 || kind == 2 {
            self.limiter_counting_since.get_or_insert(now);
        }
        let tunnel = tunnel_of(
            identity,
            PeerTunnel(&mut peer.tunnel, peer.public_key, peer.preshared_key),
            id,
        );
        let mut action = TimerAction::Idle;
        let inner = match tunnel.decapsulate(Some(from.ip()), datagram, &mut self.buf) {
            TunnResult::Err(e) => {
                tracing::trace!(peer = id, error = ?e, "datagram dropped");
                self.counters.invalid_datagrams += 1;
                return;
            }
            TunnResult::WriteToNetwork(out) => {
                peer.tx_bytes += out.len() as u64;
                io.send(from, out);
                // An initiation answered with a response, or a response answered
                // with the confirming keepalive (not a cookie reply under load).
                if (kind == 1 && out[0] == 2) || (kind == 2 && out[0] == 4) {
                    peer.timers.on_session_established(now, kind == 2);
                    peer.last_handshake = Some(wall);
                }
                note_sent(&mut peer.timers, out, now);
                // Packets queued while the handshake ran go out now.
                while let TunnResult::WriteToNetwork(out) =
                    tunnel.decapsulate(None, &[], &mut self.buf)
                {
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
            if self.routes.lookup(src) == Some(id) {
                io.write_tun(packet);
                action = peer.timers.on_data_received(now);
            } else {
                self.counters.spoofed_packets += 1;
            }
        }
        // Authenticated: count it and follow the peer to its new address.
        peer.rx_bytes += datagram.len() as u64;
        peer.timers.on_authenticated_received();
        peer.endpoint = Some(from);
        act(identity, id, peer, action, now, &mut self.buf, io);
        let due = peer.timers.next_deadline(now);
        self.note_deadline(due);
        if let Some(since) = self.limiter_counting_since {
            self.note_deadline(Some(since + RATE_LIMIT_WINDOW));
        }
    }

    /// Runs every peer's timers and resets the rate limiter's count once its window
    /// is over; the loop calls it at `next_deadline`.
    pub fn tick(&mut self, now: Instant, io: &mut impl Io) {
        let Some(identity) = self.identity.as_ref() else {
            return;
        };
        if self
            .limiter_counting_since
            .is_some_and(|t| now >= t + RATE_LIMIT_WINDOW)
        {
            identity.limiter.reset_count();
            self.limiter_counting_since = None;
        }
        for (id, peer) in &mut self.peers {
            let action = peer.timers.tick(now);
            act(identity, *id, peer, action, now, &mut self.buf, io);
        }
    }
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
        let mut c = DeviceCore::default();
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
    fn deliver(
        from_io: &mut Captured,
        from_addr: &str,
        to: &mut DeviceCore,
        now: Instant,
    ) -> Captured {
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
        let mut a = core(1, 2, ADDR_B);
        let mut b = core(2, 1, ADDR_A);
        let mut io_a = Captured::default();
        a.handle_tun_packet(&ipv4(1, 2), now, &mut io_a);
        assert_eq!(io_a.sent[0].1[0], 1, "a handshake initiation");
        let mut io_b = deliver(&mut io_a, ADDR_A, &mut b, now);
        assert_eq!(io_b.sent[0].1[0], 2, "a handshake response");
        let mut io_a = deliver(&mut io_b, ADDR_B, &mut a, now);
        // A's queued packet and a keepalive confirm the session to B.
        let io_b = deliver(&mut io_a, ADDR_A, &mut b, now);
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
        let (mut a, _, _) = handshaken(now);
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
        let mut a = core(1, 2, ADDR_B);
        let set = |c: &mut DeviceCore, body: String| c.apply_set(parse_set(&body).unwrap());
        set(
            &mut a,
            format!(
                "public_key={}\nupdate_only=true\nallowed_ip=10.9.0.0/16\n",
                public(3)
            ),
        );
        assert_eq!(a.peer_count(), 1, "update_only never creates");
        set(&mut a, format!("public_key={}\nremove=true\n", public(2)));
        assert_eq!(a.peer_count(), 0);
        assert!(!a.render_get().contains("allowed_ip="));
        let mut io = Captured::default();
        a.handle_tun_packet(&ipv4(1, 2), now, &mut io);
        assert!(io.sent.is_empty());
        assert_eq!(a.counters().unroutable_packets, 1);
        // replace_peers leaves exactly the peers of the request.
        set(
            &mut a,
            format!("public_key={}\nallowed_ip=10.0.0.3/32\n", public(3)),
        );
        set(
            &mut a,
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
        let (mut a, mut b, _) = handshaken(now);
        let mut io_a = Captured::default();
        a.handle_tun_packet(&ipv4(1, 2), now, &mut io_a);
        let io_b = deliver(&mut io_a, "198.51.100.7:4000", &mut b, now);
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
        let (mut a, mut b, _) = handshaken(now);
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
        let io_b = deliver(&mut io_a, ADDR_A, &mut b, now);
        assert!(io_b.tun.is_empty());
        assert_eq!(b.counters().spoofed_packets, 1);
    }

    #[test]
    fn garbage_is_counted_not_delivered() {
        let now = Instant::now();
        let (_, mut b, _) = handshaken(now);
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
        let mut a = core(1, 2, ADDR_B);
        assert_eq!(
            a.next_deadline(now),
            None,
            "configured peers that never talk"
        );
        assert!(
            a.peers.values().all(|p| p.tunnel.is_none()),
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
        let mut b = core(2, 1, ADDR_A);
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
}
