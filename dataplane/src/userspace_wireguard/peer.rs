//! One peer's protocol state and what each event does to it, sans-IO: sealing a
//! packet, opening a data message, consuming handshake messages and cookie replies,
//! and carrying out timer actions. The device core finds the peer and holds its lock;
//! everything here runs with that lock held, time passed in.
//!
//! The rules the device keeps against hostile senders live here:
//! - an initiation is taken only with a timestamp greater than every earlier one of
//!   this peer, kept for the peer's lifetime (and by the core across remove and
//!   re-add), and at most one per 20 ms;
//! - the endpoint moves only on an authenticated initiation, response or data
//!   message, never on a cookie reply;
//! - sending uses only the current keypair; a packet on an older one is accepted but
//!   never moves sending back to it; a responder sends on a new keypair only once the
//!   initiator used it.

use std::{
    collections::VecDeque,
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant, SystemTime},
};

use super::{
    allowed_ips::AllowedIps,
    indices::Indices,
    io::Io,
    noise::{
        cookie::CookieJar,
        crypto::{tai64n, Tai64n},
        handshake::{
            consume_initiation, consume_response, create_initiation, create_response, le32,
            InitiationOpened, InitiationSent, LocalIdentity, PeerKeys,
        },
        keypair::{Keypair, Keypairs, Slot, DATA_OVERHEAD},
        random,
    },
    timers::{PeerTimers, TimerAction},
    uapi_request::Key,
};

/// Packets kept while a handshake runs; the oldest goes first when more come.
pub const MAX_STAGED_PACKETS: usize = 128;
/// An initiation is consumed at most this often per peer (50 a second), so replaying
/// a flood of fresh ones cannot make a responder churn keys.
pub const MIN_INITIATION_INTERVAL: Duration = Duration::from_millis(20);
/// The most jitter added to a handshake retry.
const MAX_RETRY_JITTER_MS: u64 = 333;

/// What a peer operation needs besides the peer.
pub struct Ctx<'a> {
    /// The device's static identity.
    pub identity: &'a LocalIdentity,
    /// The device's receiver indices.
    pub indices: &'a Indices,
    /// The peer's id in the device.
    pub id: u32,
    /// The monotonic clock.
    pub now: Instant,
    /// The wall clock (handshake timestamps, `last_handshake`).
    pub wall: SystemTime,
    /// Data messages are padded up to this size at most (the TUN's MTU).
    pub mtu: usize,
}

/// What became of a handshake message or data message addressed to a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Authenticated and handled.
    Accepted,
    /// Authenticated, but the packet inside came from outside the peer's allowed IPs.
    Spoofed,
    /// An authentic initiation older than one already taken, or too soon after it.
    Replayed,
    /// Not authenticated, malformed, or not expected now: dropped, nothing changed.
    Invalid,
}

/// One peer.
pub struct Peer {
    /// Its public key.
    pub public_key: Key,
    /// Its preshared key.
    pub preshared_key: Option<Key>,
    /// Handshake keys derived from the two static keys (none without a private key).
    pub keys: Option<PeerKeys>,
    /// Where its datagrams go.
    pub endpoint: Option<SocketAddr>,
    /// The persistent keepalive interval in seconds (0: off).
    pub persistent_keepalive: u16,
    /// The greatest initiation timestamp taken from it.
    pub latest_timestamp: Option<Tai64n>,
    /// When `last_handshake_time` says the last handshake completed.
    pub last_handshake: Option<SystemTime>,
    /// Bytes received and sent (datagrams, as `wg show` counts them).
    pub rx_bytes: u64,
    /// See `rx_bytes`.
    pub tx_bytes: u64,
    /// The timer state.
    pub timers: PeerTimers,
    handshake: Option<InitiationSent>,
    keypairs: Keypairs,
    last_initiation_consumed: Option<Instant>,
    cookies: CookieJar,
    staged: VecDeque<Vec<u8>>,
}

/// Where the device's decisions about one received data message go.
#[derive(Clone, Copy)]
pub struct Inbound<'a> {
    /// Who sent it.
    pub from: SocketAddr,
    /// The datagram.
    pub datagram: &'a [u8],
    /// The device's routes (the source check).
    pub routes: &'a AllowedIps<u32>,
}

fn jitter() -> Duration {
    Duration::from_millis(u64::from(random::u32()) % (MAX_RETRY_JITTER_MS + 1))
}

/// The source address and length of a decrypted IP packet, the length taken from
/// its header (what follows is padding). `None` when it is not a whole IP packet.
fn inner_packet(p: &[u8]) -> Option<(IpAddr, usize)> {
    match p.first()? >> 4 {
        4 if p.len() >= 20 => {
            let len = usize::from(u16::from_be_bytes([p[2], p[3]]));
            let src: [u8; 4] = p[12..16].try_into().ok()?;
            (20..=p.len())
                .contains(&len)
                .then_some((IpAddr::from(src), len))
        }
        6 if p.len() >= 40 => {
            let len = usize::from(u16::from_be_bytes([p[4], p[5]])) + 40;
            let src: [u8; 16] = p[8..24].try_into().ok()?;
            (len <= p.len()).then_some((IpAddr::from(src), len))
        }
        _ => None,
    }
}

impl Peer {
    /// A new peer; `latest_timestamp` carries what the device remembered of it.
    pub fn new(public_key: Key, keys: Option<PeerKeys>, latest_timestamp: Option<Tai64n>) -> Self {
        Self {
            public_key,
            preshared_key: None,
            keys,
            endpoint: None,
            persistent_keepalive: 0,
            latest_timestamp,
            last_handshake: None,
            rx_bytes: 0,
            tx_bytes: 0,
            timers: PeerTimers::new(0),
            handshake: None,
            keypairs: Keypairs::default(),
            last_initiation_consumed: None,
            cookies: CookieJar::default(),
            staged: VecDeque::new(),
        }
    }

    /// Forgets every session and handshake (new static keys): the replay timestamp
    /// stays. Returns the indices to release.
    pub fn reset_sessions(&mut self, keys: Option<PeerKeys>) -> Vec<u32> {
        self.keys = keys;
        self.timers = PeerTimers::new(self.persistent_keepalive);
        self.cookies = CookieJar::default();
        self.staged.clear();
        let mut freed = self.keypairs.clear();
        freed.extend(self.handshake.take().map(|h| h.local_index));
        freed
    }

    /// Every local index the peer holds (to release when it is removed).
    pub fn indices(&mut self) -> Vec<u32> {
        self.reset_sessions(None)
    }

    /// When the peer's timers or keypairs next need the tick.
    pub fn next_deadline(&self, now: Instant) -> Option<Instant> {
        let timers = self.timers.next_deadline(now);
        let expiry = self.keypairs.next_expiry();
        timers.into_iter().chain(expiry).min()
    }

    fn send(&mut self, to: SocketAddr, datagram: &[u8], io: &mut impl Io) {
        self.tx_bytes += datagram.len() as u64;
        io.send(to, datagram);
    }

    /// Seals a packet from the TUN to the endpoint (the caller checked there is one),
    /// or keeps it until a handshake gives a keypair.
    pub fn seal(&mut self, ctx: &Ctx<'_>, packet: &[u8], buf: &mut [u8], io: &mut impl Io) {
        let action = match self.seal_now(ctx, packet, buf, io) {
            Some(action) => action,
            None => {
                if self.staged.len() == MAX_STAGED_PACKETS {
                    self.staged.pop_front();
                }
                self.staged.push_back(packet.to_vec());
                self.wants_handshake()
            }
        };
        self.act(ctx, action, buf, io);
    }

    fn wants_handshake(&self) -> TimerAction {
        if self.timers.handshake_in_progress() {
            TimerAction::Idle
        } else {
            TimerAction::SendHandshake
        }
    }

    /// Seals with the current keypair and sends; `None` when there is no keypair to
    /// send with (or no endpoint).
    fn seal_now(
        &mut self,
        ctx: &Ctx<'_>,
        packet: &[u8],
        buf: &mut [u8],
        io: &mut impl Io,
    ) -> Option<TimerAction> {
        let endpoint = self.endpoint?;
        let keypair = self.keypairs.sending(ctx.now)?;
        let n = keypair.seal(packet, buf, ctx.mtu, ctx.now).ok()?;
        let rekey = keypair.wants_rekey(ctx.now);
        self.send(endpoint, &buf[..n], io);
        let action = if packet.is_empty() {
            self.timers.on_packet_sent(ctx.now);
            TimerAction::Idle
        } else {
            self.timers.on_data_sent(ctx.now)
        };
        Some(if rekey {
            self.wants_handshake()
        } else {
            action
        })
    }

    /// Sends what waited for a keypair; true when anything went.
    fn send_staged(&mut self, ctx: &Ctx<'_>, buf: &mut [u8], io: &mut impl Io) -> bool {
        let mut sent = false;
        while let Some(packet) = self.staged.pop_front() {
            match self.seal_now(ctx, &packet, buf, io) {
                Some(action) => {
                    sent = true;
                    if action == TimerAction::SendHandshake {
                        self.send_initiation(ctx, io);
                    }
                }
                None => {
                    self.staged.push_front(packet);
                    break;
                }
            }
        }
        sent
    }

    /// Starts (or retries) a handshake: a new initiation with a new index and ephemeral key.
    fn send_initiation(&mut self, ctx: &Ctx<'_>, io: &mut impl Io) {
        // Counted as an attempt even when nothing can go out, so it is retried on the
        // timers' cadence rather than on every packet.
        self.timers.on_handshake_sent(ctx.now, jitter());
        let (Some(keys), Some(endpoint)) = (self.keys.as_ref(), self.endpoint) else {
            return;
        };
        ctx.indices
            .release(self.handshake.take().map(|h| h.local_index));
        let index = ctx.indices.allocate(ctx.id);
        let made = create_initiation(
            ctx.identity,
            keys,
            index,
            random::secret(),
            tai64n(ctx.wall),
        );
        let Some((mut msg, sent)) = made else {
            ctx.indices.release([index]);
            return;
        };
        let mac1_key = keys.mac1_key;
        self.cookies.add_macs(&mac1_key, &mut msg, ctx.now);
        self.handshake = Some(sent);
        self.send(endpoint, &msg, io);
    }

    /// A keepalive on the current keypair, or a handshake when there is none.
    fn send_keepalive(&mut self, ctx: &Ctx<'_>, buf: &mut [u8], io: &mut impl Io) {
        match self.seal_now(ctx, &[], buf, io) {
            Some(_) => {}
            None if !self.timers.handshake_in_progress() => self.send_initiation(ctx, io),
            // Due again after its interval, not at once.
            None => self.timers.on_packet_sent(ctx.now),
        }
    }

    /// Carries out a timer action.
    pub fn act(&mut self, ctx: &Ctx<'_>, action: TimerAction, buf: &mut [u8], io: &mut impl Io) {
        match action {
            TimerAction::Idle => {}
            TimerAction::SendHandshake => self.send_initiation(ctx, io),
            TimerAction::SendKeepalive => self.send_keepalive(ctx, buf, io),
            TimerAction::ExpireKeys => {
                tracing::debug!(peer = ctx.id, "session keys expired");
                ctx.indices.release(self.keypairs.clear());
            }
            TimerAction::GiveUp => {
                tracing::debug!(
                    peer = ctx.id,
                    staged = self.staged.len(),
                    "handshake given up"
                );
                self.staged.clear();
                ctx.indices
                    .release(self.handshake.take().map(|h| h.local_index));
            }
        }
    }

    /// The timer tick: drops expired keypairs, then does what the timers say.
    pub fn tick(&mut self, ctx: &Ctx<'_>, buf: &mut [u8], io: &mut impl Io) {
        ctx.indices.release(self.keypairs.expire(ctx.now));
        let action = self.timers.tick(ctx.now);
        self.act(ctx, action, buf, io);
    }

    /// A data message whose receiver index is one of this peer's: open it, write what
    /// it carried to the TUN when its source is the peer's, follow the peer to `from`.
    pub fn open_data(
        &mut self,
        ctx: &Ctx<'_>,
        rx: Inbound<'_>,
        buf: &mut [u8],
        io: &mut impl Io,
    ) -> Outcome {
        let Some((slot, keypair)) = self.keypairs.find(le32(rx.datagram, 4)) else {
            return Outcome::Invalid;
        };
        let Ok(len) = keypair.open(rx.datagram, buf, ctx.now) else {
            return Outcome::Invalid;
        };
        // Authenticated from here on.
        self.endpoint = Some(rx.from);
        self.rx_bytes += rx.datagram.len() as u64;
        let mut outcome = Outcome::Accepted;
        let mut action = TimerAction::Idle;
        self.timers.on_authenticated_received(ctx.now);
        if len > 0 {
            match inner_packet(&buf[..len]) {
                Some((src, n)) if rx.routes.lookup(src) == Some(ctx.id) => {
                    io.write_tun(&buf[..n]);
                    action = self.timers.on_data_received(ctx.now);
                }
                Some(_) => outcome = Outcome::Spoofed,
                None => outcome = Outcome::Invalid,
            }
        }
        if slot == Slot::Next {
            // The initiator used the keypair we made as responder: the handshake is
            // complete, and we may send on it.
            ctx.indices.release(self.keypairs.confirm_next());
            self.last_handshake = Some(ctx.wall);
            self.send_staged(ctx, buf, io);
        }
        self.act(ctx, action, buf, io);
        outcome
    }

    /// An initiation from this peer whose static key opened: authenticate the rest,
    /// apply the replay and flood rules, answer it.
    pub fn consume_initiation(
        &mut self,
        ctx: &Ctx<'_>,
        opened: &InitiationOpened,
        from: SocketAddr,
        io: &mut impl Io,
    ) -> Outcome {
        let Some(keys) = self.keys.as_ref() else {
            return Outcome::Invalid;
        };
        let Some(consumed) = consume_initiation(opened, keys) else {
            return Outcome::Invalid;
        };
        let stale = self
            .latest_timestamp
            .is_some_and(|t| consumed.timestamp <= t);
        let too_soon = self
            .last_initiation_consumed
            .is_some_and(|t| ctx.now.saturating_duration_since(t) < MIN_INITIATION_INTERVAL);
        if stale || too_soon {
            return Outcome::Replayed;
        }
        let index = ctx.indices.allocate(ctx.id);
        let Some((mut msg, transport)) = create_response(keys, &consumed, index, &random::secret())
        else {
            ctx.indices.release([index]);
            return Outcome::Invalid;
        };
        let mac1_key = keys.mac1_key;
        self.latest_timestamp = Some(consumed.timestamp);
        self.last_initiation_consumed = Some(ctx.now);
        self.cookies.add_macs(&mac1_key, &mut msg, ctx.now);
        let keypair = Keypair::new(&transport, index, consumed.remote_index, false, ctx.now);
        ctx.indices.release(self.keypairs.install(keypair));
        self.endpoint = Some(from);
        self.timers.on_authenticated_received(ctx.now);
        self.send(from, &msg, io);
        self.timers.on_packet_sent(ctx.now);
        self.timers.on_session_established(ctx.now, false);
        Outcome::Accepted
    }

    /// A response to our initiation (its receiver index is this peer's): complete the
    /// handshake, send what waited for it (or a keepalive, which confirms the keys).
    pub fn consume_response(
        &mut self,
        ctx: &Ctx<'_>,
        msg: &[u8],
        from: SocketAddr,
        buf: &mut [u8],
        io: &mut impl Io,
    ) -> Outcome {
        let receiver = le32(msg, 8);
        let (Some(keys), Some(sent)) = (self.keys.as_ref(), self.handshake.as_ref()) else {
            return Outcome::Invalid;
        };
        if sent.local_index != receiver {
            return Outcome::Invalid;
        }
        let Some((remote_index, transport)) = consume_response(ctx.identity, keys, sent, msg)
        else {
            return Outcome::Invalid;
        };
        // The keypair takes over the handshake's index.
        self.handshake = None;
        let keypair = Keypair::new(&transport, receiver, remote_index, true, ctx.now);
        ctx.indices.release(self.keypairs.install(keypair));
        self.endpoint = Some(from);
        self.last_handshake = Some(ctx.wall);
        self.timers.on_authenticated_received(ctx.now);
        self.timers.on_session_established(ctx.now, true);
        if !self.send_staged(ctx, buf, io) {
            self.send_keepalive(ctx, buf, io);
        }
        Outcome::Accepted
    }

    /// A cookie reply to one of our handshake messages: keep the cookie for the next.
    /// It proves nothing about where the peer is: the endpoint stays.
    pub fn consume_cookie_reply(&mut self, ctx: &Ctx<'_>, msg: &[u8]) -> Outcome {
        let receiver = le32(msg, 4);
        let ours = self
            .handshake
            .as_ref()
            .is_some_and(|h| h.local_index == receiver)
            || self.keypairs.find(receiver).is_some();
        let Some(keys) = self.keys.as_ref() else {
            return Outcome::Invalid;
        };
        if ours && self.cookies.consume_reply(&keys.cookie_key, msg, ctx.now) {
            Outcome::Accepted
        } else {
            Outcome::Invalid
        }
    }

    /// True while the peer holds any keypair (tests).
    #[cfg(test)]
    pub fn has_keypairs(&self) -> bool {
        self.keypairs.any()
    }

    /// Packets staged (tests).
    #[cfg(test)]
    pub fn staged(&self) -> usize {
        self.staged.len()
    }
}

/// Room a sealed packet needs beyond its length (padding and overhead).
pub const SEAL_ROOM: usize = 15 + DATA_OVERHEAD;
