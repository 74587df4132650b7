//! Transport keypairs (section 5.4.6 of the paper): sealing and opening data messages
//! with a nonce counter and a replay window, the age and message-count limits, and a
//! peer's three slots (previous, current, next) with the rules that move keypairs
//! between them. Time is passed in.

use std::time::{Duration, Instant};

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305};

use super::handshake::{TransportKeys, MSG_DATA};

/// The data message's header: type, receiver index, counter.
pub const DATA_HEADER_LEN: usize = 16;
/// Header plus the AEAD tag: a keepalive's length.
pub const DATA_OVERHEAD: usize = DATA_HEADER_LEN + 16;

/// A keypair is renewed by its initiator after this many messages.
pub const REKEY_AFTER_MESSAGES: u64 = 1 << 60;
/// No message is sent or accepted with a counter this high (leaving room for the
/// replay window below 2^64, so counter arithmetic cannot overflow).
pub const REJECT_AFTER_MESSAGES: u64 = u64::MAX - (1 << 13) - 1;
/// No packet is sent or accepted on a keypair this old.
pub const REJECT_AFTER_TIME: Duration = Duration::from_secs(180);
/// A keypair's initiator renews it when sending on it this late.
pub const REKEY_AFTER_TIME: Duration = Duration::from_secs(120);

const WINDOW_WORDS: usize = 128;
/// How far behind the greatest counter seen a counter is still accepted once.
pub const REPLAY_WINDOW: u64 = (WINDOW_WORDS as u64 - 1) * 64;

/// The counters received on one keypair: the greatest, and which of the ones before
/// it within [`REPLAY_WINDOW`] were seen.
#[derive(Clone)]
pub struct ReplayWindow {
    /// The greatest counter accepted plus one (0: none yet).
    next: u64,
    bits: [u64; WINDOW_WORDS],
}

impl Default for ReplayWindow {
    fn default() -> Self {
        Self {
            next: 0,
            bits: [0; WINDOW_WORDS],
        }
    }
}

impl ReplayWindow {
    /// Records `counter` (of an authenticated message); false when it was seen
    /// before, is too old for the window, or is beyond [`REJECT_AFTER_MESSAGES`].
    pub fn accept(&mut self, counter: u64) -> bool {
        if counter >= REJECT_AFTER_MESSAGES {
            return false;
        }
        // No overflow: counter < REJECT_AFTER_MESSAGES leaves room above it.
        let word = counter / 64;
        if counter + 1 > self.next {
            // Words between the old greatest's and the new one's are cleared.
            let top = (self.next > 0).then(|| (self.next - 1) / 64);
            match top.map(|t| word - t) {
                Some(gap) if gap < WINDOW_WORDS as u64 => {
                    for w in word - gap + 1..=word {
                        self.bits[(w % WINDOW_WORDS as u64) as usize] = 0;
                    }
                }
                _ => self.bits = [0; WINDOW_WORDS],
            }
            self.next = counter + 1;
        } else if self.next - 1 - counter > REPLAY_WINDOW {
            return false;
        }
        let (slot, bit) = (
            (word % WINDOW_WORDS as u64) as usize,
            1u64 << (counter % 64),
        );
        if self.bits[slot] & bit != 0 {
            return false;
        }
        self.bits[slot] |= bit;
        true
    }
}

/// Why a keypair could not seal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SealRefused {
    /// Older than [`REJECT_AFTER_TIME`] or out of counters: a new handshake is needed.
    Exhausted,
}

/// Why a data message did not open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenRefused {
    /// Shorter than a keepalive.
    Truncated,
    /// The keypair is too old or the counter too high.
    Expired,
    /// The tag did not verify.
    Forged,
    /// Authentic, but a counter seen before or outside the window.
    Replayed,
}

/// One direction pair of transport keys from one handshake.
pub struct Keypair {
    /// Our index: the receiver index of what the peer sends on this keypair.
    pub local_index: u32,
    /// The peer's index: the receiver index of what we send.
    pub remote_index: u32,
    /// When the handshake that made it completed.
    pub created: Instant,
    /// True when we sent the initiation.
    pub initiator: bool,
    send: LessSafeKey,
    recv: LessSafeKey,
    send_counter: u64,
    replay: ReplayWindow,
}

fn aead_key(key: &[u8; 32]) -> LessSafeKey {
    LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, key).expect("a 32-byte key"))
}

fn nonce(counter: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

impl Keypair {
    /// A keypair from a completed handshake.
    pub fn new(
        keys: &TransportKeys,
        local_index: u32,
        remote_index: u32,
        initiator: bool,
        created: Instant,
    ) -> Self {
        Self {
            local_index,
            remote_index,
            created,
            initiator,
            send: aead_key(&keys.send),
            recv: aead_key(&keys.recv),
            send_counter: 0,
            replay: ReplayWindow::default(),
        }
    }

    /// True while it may still send: younger than [`REJECT_AFTER_TIME`] and below
    /// [`REJECT_AFTER_MESSAGES`].
    pub fn can_send(&self, now: Instant) -> bool {
        self.fresh(now) && self.send_counter < REJECT_AFTER_MESSAGES
    }

    fn fresh(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.created) < REJECT_AFTER_TIME
    }

    /// True when this keypair's use calls for a new handshake: its initiator sending
    /// on it after [`REKEY_AFTER_TIME`], or anyone after [`REKEY_AFTER_MESSAGES`].
    pub fn wants_rekey(&self, now: Instant) -> bool {
        self.send_counter >= REKEY_AFTER_MESSAGES
            || (self.initiator && now.saturating_duration_since(self.created) >= REKEY_AFTER_TIME)
    }

    /// Seals `packet` into `out` as a data message, padded to a multiple of 16 bytes
    /// but not past `max_padded` (the link's MTU); returns its length. `out` must hold
    /// `packet.len() + 15 + DATA_OVERHEAD` bytes.
    pub fn seal(
        &mut self,
        packet: &[u8],
        out: &mut [u8],
        max_padded: usize,
        now: Instant,
    ) -> Result<usize, SealRefused> {
        if !self.can_send(now) {
            return Err(SealRefused::Exhausted);
        }
        let counter = self.send_counter;
        self.send_counter += 1;
        let padded = packet
            .len()
            .next_multiple_of(16)
            .min(max_padded.max(packet.len()));
        out[..4].copy_from_slice(&u32::from(MSG_DATA).to_le_bytes());
        out[4..8].copy_from_slice(&self.remote_index.to_le_bytes());
        out[8..16].copy_from_slice(&counter.to_le_bytes());
        let body = &mut out[DATA_HEADER_LEN..DATA_HEADER_LEN + padded];
        body[..packet.len()].copy_from_slice(packet);
        body[packet.len()..].fill(0);
        let tag = self
            .send
            .seal_in_place_separate_tag(nonce(counter), Aad::empty(), body)
            .map_err(|_| SealRefused::Exhausted)?;
        let end = DATA_HEADER_LEN + padded;
        out[end..end + 16].copy_from_slice(tag.as_ref());
        Ok(end + 16)
    }

    /// Opens a data message (its receiver index already matched) into `out`, which
    /// must hold the datagram; returns the plaintext's length (0: a keepalive).
    pub fn open(
        &mut self,
        datagram: &[u8],
        out: &mut [u8],
        now: Instant,
    ) -> Result<usize, OpenRefused> {
        if datagram.len() < DATA_OVERHEAD {
            return Err(OpenRefused::Truncated);
        }
        let counter = u64::from_le_bytes(datagram[8..16].try_into().expect("8 bytes"));
        if !self.fresh(now) || counter >= REJECT_AFTER_MESSAGES {
            return Err(OpenRefused::Expired);
        }
        let sealed = &datagram[DATA_HEADER_LEN..];
        let buf = &mut out[..sealed.len()];
        buf.copy_from_slice(sealed);
        let plain = self
            .recv
            .open_in_place(nonce(counter), Aad::empty(), buf)
            .map_err(|_| OpenRefused::Forged)?
            .len();
        // Only an authentic counter may move the window.
        if !self.replay.accept(counter) {
            return Err(OpenRefused::Replayed);
        }
        Ok(plain)
    }
}

/// Which of a peer's slots a keypair is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// The one we send with.
    Current,
    /// The one before it, still accepted for packets in flight.
    Previous,
    /// A responder's new keypair, not sent with until the initiator's first data on
    /// it confirms the initiator has it too.
    Next,
}

/// A peer's keypairs. Sending uses only `current`; receiving accepts all three while
/// they are fresh; a packet on `previous` never moves sending back to it.
#[derive(Default)]
pub struct Keypairs {
    current: Option<Box<Keypair>>,
    previous: Option<Box<Keypair>>,
    next: Option<Box<Keypair>>,
}

impl Keypairs {
    /// Adds the keypair of a completed handshake; returns the local indices of the
    /// keypairs it pushed out (to be released by the caller).
    pub fn install(&mut self, keypair: Keypair) -> Vec<u32> {
        let mut freed = Vec::new();
        let mut free = |k: Option<Box<Keypair>>| freed.extend(k.map(|k| k.local_index));
        if keypair.initiator {
            // The peer has these keys already (its response proved it): send with them.
            if let Some(next) = self.next.take() {
                // An unconfirmed responder keypair becomes the previous one.
                free(self.current.take());
                free(self.previous.replace(next));
            } else {
                free(self.previous.take());
                self.previous = self.current.take();
            }
            self.current = Some(Box::new(keypair));
        } else {
            free(self.next.replace(Box::new(keypair)));
            free(self.previous.take());
        }
        freed
    }

    /// The keypair whose local index is `index`, with its slot.
    pub fn find(&mut self, index: u32) -> Option<(Slot, &mut Keypair)> {
        [
            (Slot::Current, &mut self.current),
            (Slot::Previous, &mut self.previous),
            (Slot::Next, &mut self.next),
        ]
        .into_iter()
        .find_map(|(slot, k)| {
            k.as_deref_mut()
                .filter(|k| k.local_index == index)
                .map(|k| (slot, k))
        })
    }

    /// The initiator used `next`: it becomes current. Returns the freed index.
    pub fn confirm_next(&mut self) -> Vec<u32> {
        let Some(next) = self.next.take() else {
            return Vec::new();
        };
        let freed = self.previous.take().map(|k| k.local_index);
        self.previous = self.current.replace(next);
        freed.into_iter().collect()
    }

    /// The keypair to send with, when it still may.
    pub fn sending(&mut self, now: Instant) -> Option<&mut Keypair> {
        self.current.as_deref_mut().filter(|k| k.can_send(now))
    }

    /// Drops every keypair older than [`REJECT_AFTER_TIME`]; returns their indices.
    pub fn expire(&mut self, now: Instant) -> Vec<u32> {
        let mut freed = Vec::new();
        for slot in [&mut self.current, &mut self.previous, &mut self.next] {
            if slot.as_ref().is_some_and(|k| !k.fresh(now)) {
                freed.extend(slot.take().map(|k| k.local_index));
            }
        }
        freed
    }

    /// Drops all keypairs; returns their indices.
    pub fn clear(&mut self) -> Vec<u32> {
        [self.current.take(), self.previous.take(), self.next.take()]
            .into_iter()
            .flatten()
            .map(|k| k.local_index)
            .collect()
    }

    /// When the oldest keypair expires (the tick drops it then).
    pub fn next_expiry(&self) -> Option<Instant> {
        [&self.current, &self.previous, &self.next]
            .into_iter()
            .flatten()
            .map(|k| k.created + REJECT_AFTER_TIME)
            .min()
    }

    /// True when any keypair is held.
    pub fn any(&self) -> bool {
        self.current.is_some() || self.previous.is_some() || self.next.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(now: Instant) -> (Keypair, Keypair) {
        let a = TransportKeys {
            send: [1; 32],
            recv: [2; 32],
        };
        let b = TransportKeys {
            send: [2; 32],
            recv: [1; 32],
        };
        (
            Keypair::new(&a, 10, 20, true, now),
            Keypair::new(&b, 20, 10, false, now),
        )
    }

    #[test]
    fn the_window_takes_each_counter_once_and_nothing_older_than_it_holds() {
        let mut w = ReplayWindow::default();
        assert!(w.accept(0));
        assert!(!w.accept(0));
        assert!(w.accept(5) && w.accept(3) && !w.accept(3));
        assert!(w.accept(10_000));
        assert!(
            w.accept(10_000 - REPLAY_WINDOW),
            "the oldest the window holds"
        );
        assert!(!w.accept(10_000 - REPLAY_WINDOW - 1), "just past it");
        assert!(!w.accept(5), "long gone");
        // A jump far ahead clears every word: old bits must not read as seen.
        assert!(w.accept(1_000_000));
        assert!(w.accept(1_000_000 - 64 * 3));
        assert!(!w.accept(REJECT_AFTER_MESSAGES));
        assert!(!w.accept(u64::MAX));
        assert!(
            w.accept(REJECT_AFTER_MESSAGES - 1),
            "the last counter there is"
        );
        assert!(!w.accept(REJECT_AFTER_MESSAGES - 1));
    }

    #[test]
    fn a_sealed_packet_opens_once_and_its_forgery_never() {
        let now = Instant::now();
        let (mut a, mut b) = pair(now);
        let mut out = vec![0u8; 128];
        let n = a.seal(b"hello", &mut out, 1420, now).unwrap();
        assert_eq!(n, DATA_OVERHEAD + 16, "padded to 16 bytes");
        let mut plain = vec![0u8; 128];
        assert_eq!(b.open(&out[..n], &mut plain, now), Ok(16));
        assert_eq!(&plain[..5], b"hello");
        assert_eq!(
            b.open(&out[..n], &mut plain, now),
            Err(OpenRefused::Replayed)
        );
        let m = a.seal(b"again", &mut out, 1420, now).unwrap();
        out[20] ^= 1;
        assert_eq!(b.open(&out[..m], &mut plain, now), Err(OpenRefused::Forged));
        out[20] ^= 1;
        assert_eq!(
            b.open(&out[..m], &mut plain, now),
            Ok(16),
            "a forgery moved nothing"
        );
        assert_eq!(
            b.open(&out[..20], &mut plain, now),
            Err(OpenRefused::Truncated)
        );
    }

    #[test]
    fn padding_stops_at_the_mtu() {
        let now = Instant::now();
        let (mut a, _) = pair(now);
        let mut out = vec![0u8; 2048];
        assert_eq!(
            a.seal(&[0; 1419], &mut out, 1420, now),
            Ok(1420 + DATA_OVERHEAD)
        );
        assert_eq!(
            a.seal(&[0; 1417], &mut out, 1418, now),
            Ok(1418 + DATA_OVERHEAD)
        );
        // Larger than the MTU (a GSO super-packet would be): not padded at all.
        assert_eq!(
            a.seal(&[0; 1500], &mut out, 1420, now),
            Ok(1500 + DATA_OVERHEAD)
        );
    }

    #[test]
    fn keys_past_their_age_or_counter_limit_neither_send_nor_open() {
        let now = Instant::now();
        let (mut a, mut b) = pair(now);
        let mut out = vec![0u8; 128];
        let n = a.seal(b"x", &mut out, 1420, now).unwrap();
        let late = now + REJECT_AFTER_TIME;
        let mut plain = vec![0u8; 128];
        assert_eq!(
            b.open(&out[..n], &mut plain, late),
            Err(OpenRefused::Expired)
        );
        assert_eq!(
            a.seal(b"x", &mut out, 1420, late),
            Err(SealRefused::Exhausted)
        );
        // A counter near 2^64 is refused before any arithmetic on it.
        out[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(
            b.open(&out[..n], &mut plain, now),
            Err(OpenRefused::Expired)
        );
        a.send_counter = REJECT_AFTER_MESSAGES - 1;
        assert!(a.seal(b"x", &mut out, 1420, now).is_ok(), "the last one");
        assert_eq!(
            a.seal(b"x", &mut out, 1420, now),
            Err(SealRefused::Exhausted)
        );
        assert!(a.wants_rekey(now));
    }

    #[test]
    fn a_responders_keypair_waits_in_next_until_confirmed_and_old_ones_never_take_over() {
        let now = Instant::now();
        let keys = TransportKeys {
            send: [1; 32],
            recv: [2; 32],
        };
        let mut k = Keypairs::default();
        assert!(k.install(Keypair::new(&keys, 1, 9, false, now)).is_empty());
        assert!(k.sending(now).is_none(), "unconfirmed");
        assert_eq!(k.find(1).map(|(s, _)| s), Some(Slot::Next));
        assert!(k.confirm_next().is_empty());
        assert_eq!(k.sending(now).map(|k| k.local_index), Some(1));
        // Our own handshake: the new one sends, the old stays as previous.
        assert!(k.install(Keypair::new(&keys, 2, 9, true, now)).is_empty());
        assert_eq!(k.find(1).map(|(s, _)| s), Some(Slot::Previous));
        assert_eq!(k.sending(now).map(|k| k.local_index), Some(2));
        // A third drops the oldest.
        assert_eq!(k.install(Keypair::new(&keys, 3, 9, true, now)), vec![1]);
        assert!(k.find(1).is_none());
        let later = now + REJECT_AFTER_TIME;
        assert_eq!(k.expire(later).len(), 2);
        assert!(!k.any());
    }
}
