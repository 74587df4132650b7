//! The handshake messages of WireGuard (section 5.4 of the paper): building and
//! consuming the initiation and the response, sans-IO. Randomness (the ephemeral key)
//! and time (the timestamp) come in as arguments; the caller decides what a consumed
//! message may change (replay, flood and roaming rules live in the device core).

use x25519_dalek::{PublicKey, StaticSecret};

use super::crypto::{hash, kdf, mac, open, seal, Tai64n, TAG_LEN};

/// Message types, the first byte of every message (the next three are zero).
pub const MSG_INITIATION: u8 = 1;
/// A handshake response.
pub const MSG_RESPONSE: u8 = 2;
/// A cookie reply.
pub const MSG_COOKIE_REPLY: u8 = 3;
/// A transport data message.
pub const MSG_DATA: u8 = 4;

/// The initiation's length.
pub const INITIATION_LEN: usize = 148;
/// The response's length.
pub const RESPONSE_LEN: usize = 92;
/// The cookie reply's length.
pub const COOKIE_REPLY_LEN: usize = 64;

const CONSTRUCTION: &[u8] = b"Noise_IKpsk2_25519_ChaChaPoly_BLAKE2s";
const IDENTIFIER: &[u8] = b"WireGuard v1 zx2c4 Jason@zx2c4.com";
const LABEL_MAC1: &[u8] = b"mac1----";
const LABEL_COOKIE: &[u8] = b"cookie--";

/// Where MAC1 starts in a message of `len` bytes (MAC2 follows it; both 16 bytes).
pub const fn mac1_offset(len: usize) -> usize {
    len - 32
}

/// The message type of `datagram` when its first four bytes are a type WireGuard
/// knows with the three reserved bytes zero.
pub fn message_type(datagram: &[u8]) -> Option<u8> {
    match datagram.get(..4)? {
        [t @ 1..=4, 0, 0, 0] => Some(*t),
        _ => None,
    }
}

/// True when `datagram` has the exact length its handshake type requires.
pub fn handshake_length_ok(kind: u8, datagram: &[u8]) -> bool {
    match kind {
        MSG_INITIATION => datagram.len() == INITIATION_LEN,
        MSG_RESPONSE => datagram.len() == RESPONSE_LEN,
        MSG_COOKIE_REPLY => datagram.len() == COOKIE_REPLY_LEN,
        _ => false,
    }
}

/// A little-endian u32 at `at` (the caller checked the length).
pub fn le32(datagram: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(datagram[at..at + 4].try_into().expect("4 bytes"))
}

/// The key of MAC1 on messages to the holder of `public`.
pub fn mac1_key(public: &[u8; 32]) -> [u8; 32] {
    hash(&[LABEL_MAC1, public])
}

fn initial_chaining_key() -> [u8; 32] {
    hash(&[CONSTRUCTION])
}

/// `hash(hash(C0 || identifier) || responder's public key)`: the handshake hash both
/// sides start from.
fn initial_hash(responder: &[u8; 32]) -> [u8; 32] {
    hash(&[&hash(&[&initial_chaining_key(), IDENTIFIER]), responder])
}

/// X25519, refusing a result of all zeros (a low-order point from the other side).
fn dh(secret: &StaticSecret, public: &[u8; 32]) -> Option<[u8; 32]> {
    let shared = secret.diffie_hellman(&PublicKey::from(*public));
    shared.was_contributory().then(|| shared.to_bytes())
}

/// The device's own static key with what every handshake derives from it.
pub struct LocalIdentity {
    secret: StaticSecret,
    public: [u8; 32],
    /// The handshake hash an initiation to us starts from.
    initial_hash: [u8; 32],
    /// Keys MAC1 of messages to us.
    pub mac1_key: [u8; 32],
    /// Encrypts the cookie replies we send.
    pub cookie_key: [u8; 32],
}

impl LocalIdentity {
    /// The identity of a private key.
    pub fn new(private: [u8; 32]) -> Self {
        let secret = StaticSecret::from(private);
        let public = PublicKey::from(&secret).to_bytes();
        Self {
            initial_hash: initial_hash(&public),
            mac1_key: mac1_key(&public),
            cookie_key: hash(&[LABEL_COOKIE, &public]),
            secret,
            public,
        }
    }

    /// The private key (for `get=1`, which prints it as wireguard-go does).
    pub fn private_key(&self) -> [u8; 32] {
        self.secret.to_bytes()
    }

    /// The public key.
    pub fn public_key(&self) -> [u8; 32] {
        self.public
    }

    /// True when MAC1 of a message to us is right.
    pub fn mac1_ok(&self, msg: &[u8]) -> bool {
        let at = mac1_offset(msg.len());
        constant_time_eq(&mac(&self.mac1_key, &msg[..at]), &msg[at..at + 16])
    }
}

/// A peer's keys with what handshakes with it derive from them (computed once per
/// configuration change, so a handshake costs no DH of the two static keys).
#[derive(Clone)]
pub struct PeerKeys {
    public: [u8; 32],
    preshared: [u8; 32],
    /// DH of our static key and theirs; `None` for a low-order key (no handshake).
    static_static: Option<[u8; 32]>,
    initial_hash: [u8; 32],
    /// Keys MAC1 of messages to the peer.
    pub mac1_key: [u8; 32],
    /// Decrypts the cookie replies the peer sends us.
    pub cookie_key: [u8; 32],
}

impl PeerKeys {
    /// The keys for handshakes between `local` and the peer `public`.
    pub fn new(local: &LocalIdentity, public: [u8; 32], preshared: Option<[u8; 32]>) -> Self {
        Self {
            public,
            preshared: preshared.unwrap_or_default(),
            static_static: dh(&local.secret, &public),
            initial_hash: initial_hash(&public),
            mac1_key: mac1_key(&public),
            cookie_key: hash(&[LABEL_COOKIE, &public]),
        }
    }
}

/// The two transport keys of a completed handshake.
pub struct TransportKeys {
    /// Encrypts what we send.
    pub send: [u8; 32],
    /// Decrypts what we receive.
    pub recv: [u8; 32],
}

/// An initiation we sent and wait for the response to.
pub struct InitiationSent {
    /// Our index in it (the response's receiver index).
    pub local_index: u32,
    ephemeral: StaticSecret,
    chaining_key: [u8; 32],
    hash: [u8; 32],
}

/// Builds an initiation from us (`local`) to the peer of `keys`, without its MACs
/// (the caller adds them: MAC2 needs the peer's cookie). `None` when the peer's key
/// is of low order.
pub fn create_initiation(
    local: &LocalIdentity,
    keys: &PeerKeys,
    local_index: u32,
    ephemeral: StaticSecret,
    timestamp: Tai64n,
) -> Option<([u8; INITIATION_LEN], InitiationSent)> {
    let mut msg = [0u8; INITIATION_LEN];
    msg[0] = MSG_INITIATION;
    msg[4..8].copy_from_slice(&local_index.to_le_bytes());
    let e_pub = PublicKey::from(&ephemeral).to_bytes();
    msg[8..40].copy_from_slice(&e_pub);
    let mut h = hash(&[&keys.initial_hash, &e_pub]);
    let [mut ck] = kdf::<1>(&initial_chaining_key(), &e_pub);
    let [ck1, k] = kdf::<2>(&ck, &dh(&ephemeral, &keys.public)?);
    ck = ck1;
    seal(&k, &h, &local.public, &mut msg[40..88]);
    h = hash(&[&h, &msg[40..88]]);
    let [ck2, k] = kdf::<2>(&ck, &keys.static_static?);
    ck = ck2;
    seal(&k, &h, &timestamp, &mut msg[88..116]);
    h = hash(&[&h, &msg[88..116]]);
    Some((
        msg,
        InitiationSent {
            local_index,
            ephemeral,
            chaining_key: ck,
            hash: h,
        },
    ))
}

/// An initiation to us whose sender's static key we decrypted, before the timestamp
/// (which needs that peer's keys).
pub struct InitiationOpened {
    /// The sender's static public key.
    pub peer_public: [u8; 32],
    sender_index: u32,
    remote_ephemeral: [u8; 32],
    chaining_key: [u8; 32],
    hash: [u8; 32],
    sealed_timestamp: [u8; 12 + TAG_LEN],
}

/// Decrypts the sender's static key of an initiation (`msg`, 148 bytes, MAC1 already
/// checked). `None` when it does not authenticate.
pub fn open_initiation(local: &LocalIdentity, msg: &[u8]) -> Option<InitiationOpened> {
    let msg: &[u8; INITIATION_LEN] = msg.try_into().ok()?;
    let remote_ephemeral: [u8; 32] = msg[8..40].try_into().ok()?;
    let mut h = hash(&[&local.initial_hash, &remote_ephemeral]);
    let [ck] = kdf::<1>(&initial_chaining_key(), &remote_ephemeral);
    let [ck, k] = kdf::<2>(&ck, &dh(&local.secret, &remote_ephemeral)?);
    let peer_public = open::<32>(&k, &h, &msg[40..88])?;
    h = hash(&[&h, &msg[40..88]]);
    Some(InitiationOpened {
        peer_public,
        sender_index: le32(msg, 4),
        remote_ephemeral,
        chaining_key: ck,
        hash: h,
        sealed_timestamp: msg[88..116].try_into().ok()?,
    })
}

/// An authenticated initiation from a configured peer.
pub struct InitiationConsumed {
    /// The sender's index (our response's receiver index).
    pub remote_index: u32,
    /// When the sender says it sent it: a responder only takes a timestamp greater
    /// than every earlier one of that peer (the replay rule).
    pub timestamp: Tai64n,
    remote_ephemeral: [u8; 32],
    chaining_key: [u8; 32],
    hash: [u8; 32],
}

/// Authenticates the rest of an opened initiation with the sender's keys.
pub fn consume_initiation(
    opened: &InitiationOpened,
    keys: &PeerKeys,
) -> Option<InitiationConsumed> {
    if opened.peer_public != keys.public {
        return None;
    }
    let [ck, k] = kdf::<2>(&opened.chaining_key, &keys.static_static?);
    let timestamp = open::<12>(&k, &opened.hash, &opened.sealed_timestamp)?;
    Some(InitiationConsumed {
        remote_index: opened.sender_index,
        timestamp,
        remote_ephemeral: opened.remote_ephemeral,
        chaining_key: ck,
        hash: hash(&[&opened.hash, &opened.sealed_timestamp]),
    })
}

/// Builds the response to a consumed initiation (without MACs) and the responder's
/// transport keys.
pub fn create_response(
    keys: &PeerKeys,
    consumed: &InitiationConsumed,
    local_index: u32,
    ephemeral: &StaticSecret,
) -> Option<([u8; RESPONSE_LEN], TransportKeys)> {
    let mut msg = [0u8; RESPONSE_LEN];
    msg[0] = MSG_RESPONSE;
    msg[4..8].copy_from_slice(&local_index.to_le_bytes());
    msg[8..12].copy_from_slice(&consumed.remote_index.to_le_bytes());
    let e_pub = PublicKey::from(ephemeral).to_bytes();
    msg[12..44].copy_from_slice(&e_pub);
    let mut h = hash(&[&consumed.hash, &e_pub]);
    let [ck] = kdf::<1>(&consumed.chaining_key, &e_pub);
    let [ck] = kdf::<1>(&ck, &dh(ephemeral, &consumed.remote_ephemeral)?);
    let [ck] = kdf::<1>(&ck, &dh(ephemeral, &keys.public)?);
    let [ck, tau, k] = kdf::<3>(&ck, &keys.preshared);
    h = hash(&[&h, &tau]);
    seal(&k, &h, &[], &mut msg[44..60]);
    let [recv, send] = kdf::<2>(&ck, &[]);
    Some((msg, TransportKeys { send, recv }))
}

/// Consumes the response to our initiation (`msg`, 92 bytes, MAC1 checked, its
/// receiver index ours): the initiator's transport keys, or `None` when it does not
/// authenticate.
pub fn consume_response(
    local: &LocalIdentity,
    keys: &PeerKeys,
    sent: &InitiationSent,
    msg: &[u8],
) -> Option<(u32, TransportKeys)> {
    let msg: &[u8; RESPONSE_LEN] = msg.try_into().ok()?;
    let e_r: [u8; 32] = msg[12..44].try_into().ok()?;
    let h = hash(&[&sent.hash, &e_r]);
    let [ck] = kdf::<1>(&sent.chaining_key, &e_r);
    let [ck] = kdf::<1>(&ck, &dh(&sent.ephemeral, &e_r)?);
    let [ck] = kdf::<1>(&ck, &dh(&local.secret, &e_r)?);
    let [ck, tau, k] = kdf::<3>(&ck, &keys.preshared);
    let h = hash(&[&h, &tau]);
    open::<0>(&k, &h, &msg[44..60])?;
    let [send, recv] = kdf::<2>(&ck, &[]);
    Some((le32(msg, 4), TransportKeys { send, recv }))
}

/// Compares two MACs without an early exit.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(n: u8) -> LocalIdentity {
        LocalIdentity::new([n; 32])
    }

    #[test]
    fn both_sides_derive_the_same_transport_keys() {
        let (a, b) = (identity(1), identity(2));
        let (a_to_b, b_to_a) = (
            PeerKeys::new(&a, b.public_key(), Some([9; 32])),
            PeerKeys::new(&b, a.public_key(), Some([9; 32])),
        );
        let ts = [1u8; 12];
        let (init, sent) =
            create_initiation(&a, &a_to_b, 77, StaticSecret::from([3; 32]), ts).unwrap();
        let opened = open_initiation(&b, &init).unwrap();
        assert_eq!(opened.peer_public, a.public_key());
        let consumed = consume_initiation(&opened, &b_to_a).unwrap();
        assert_eq!((consumed.remote_index, consumed.timestamp), (77, ts));
        let (resp, b_keys) =
            create_response(&b_to_a, &consumed, 88, &StaticSecret::from([4; 32])).unwrap();
        let (remote, a_keys) = consume_response(&a, &a_to_b, &sent, &resp).unwrap();
        assert_eq!(remote, 88);
        assert_eq!((a_keys.send, a_keys.recv), (b_keys.recv, b_keys.send));
        assert_ne!(a_keys.send, a_keys.recv);
    }

    #[test]
    fn a_wrong_preshared_key_or_a_flipped_bit_fails() {
        let (a, b) = (identity(1), identity(2));
        let a_to_b = PeerKeys::new(&a, b.public_key(), Some([9; 32]));
        let b_to_a = PeerKeys::new(&b, a.public_key(), Some([8; 32]));
        let (init, sent) =
            create_initiation(&a, &a_to_b, 1, StaticSecret::from([3; 32]), [1; 12]).unwrap();
        for i in [8, 40, 100] {
            let mut bad = init;
            bad[i] ^= 1;
            let ok = open_initiation(&b, &bad)
                .and_then(|o| consume_initiation(&o, &b_to_a))
                .is_some();
            assert!(!ok, "byte {i} flipped");
        }
        let consumed = consume_initiation(&open_initiation(&b, &init).unwrap(), &b_to_a).unwrap();
        let (resp, _) =
            create_response(&b_to_a, &consumed, 2, &StaticSecret::from([4; 32])).unwrap();
        assert!(
            consume_response(&a, &a_to_b, &sent, &resp).is_none(),
            "the preshared keys differ"
        );
    }

    #[test]
    fn a_low_order_ephemeral_key_is_refused() {
        let b = identity(2);
        let mut init = [0u8; INITIATION_LEN];
        init[0] = MSG_INITIATION;
        // The all-zero point gives an all-zero DH.
        assert!(open_initiation(&b, &init).is_none());
    }

    #[test]
    fn message_types_need_their_reserved_bytes_zero() {
        assert_eq!(message_type(&[4, 0, 0, 0, 9]), Some(4));
        assert_eq!(message_type(&[4, 0, 0, 1]), None);
        assert_eq!(message_type(&[5, 0, 0, 0]), None);
        assert_eq!(message_type(&[1, 0, 0]), None);
    }
}
