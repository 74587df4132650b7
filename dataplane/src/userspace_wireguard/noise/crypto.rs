//! The primitives of WireGuard's Noise_IKpsk2_25519_ChaChaPoly_BLAKE2s, as the paper
//! (section 5.4) names them: `hash`, `mac`, `hmac`, `kdf`, the handshake AEAD and the
//! TAI64N timestamp. Plain functions over byte arrays; no state, no I/O.

use std::time::{SystemTime, UNIX_EPOCH};

use blake2::{
    digest::{consts::U16, FixedOutput, KeyInit, Mac as _, Update},
    Blake2s256, Blake2sMac, Digest,
};
use chacha20poly1305::{aead::AeadInPlace, ChaCha20Poly1305, XChaCha20Poly1305};
use hmac::SimpleHmac;

/// The AEAD tag's length.
pub const TAG_LEN: usize = 16;

/// BLAKE2s-256 of the concatenation of `parts`.
pub fn hash(parts: &[&[u8]]) -> [u8; 32] {
    let mut h = Blake2s256::new();
    for p in parts {
        Digest::update(&mut h, p);
    }
    h.finalize().into()
}

/// Keyed BLAKE2s with a 16-byte output (MAC1, MAC2 and the cookie).
pub fn mac(key: &[u8], data: &[u8]) -> [u8; 16] {
    // Keys are 16 or 32 bytes here, always within BLAKE2s's limit.
    let mut m = <Blake2sMac<U16> as KeyInit>::new_from_slice(key).expect("key of at most 32 bytes");
    Update::update(&mut m, data);
    m.finalize_fixed().into()
}

/// HMAC-BLAKE2s over the concatenation of `parts`.
fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut m = <SimpleHmac<Blake2s256> as KeyInit>::new_from_slice(key)
        .expect("HMAC takes any key length");
    for p in parts {
        Update::update(&mut m, p);
    }
    m.finalize().into_bytes().into()
}

/// The HKDF of the paper with `N` outputs (1 to 3), keyed by the chaining key.
pub fn kdf<const N: usize>(chaining_key: &[u8; 32], input: &[u8]) -> [[u8; 32]; N] {
    let prk = hmac(chaining_key, &[input]);
    let mut out = [[0u8; 32]; N];
    let mut prev: Option<[u8; 32]> = None;
    for (i, slot) in out.iter_mut().enumerate() {
        let counter = [u8::try_from(i + 1).expect("at most 3 outputs")];
        let next = match &prev {
            None => hmac(&prk, &[&counter]),
            Some(p) => hmac(&prk, &[p, &counter]),
        };
        *slot = next;
        prev = Some(next);
    }
    out
}

/// The handshake's AEAD: ChaCha20-Poly1305 with a 64-bit counter nonce (always 0 in
/// a handshake, each key being used once) over `plain`, with `ad`; writes the
/// ciphertext and tag to `out` (`plain.len() + TAG_LEN` bytes).
pub fn seal(key: &[u8; 32], ad: &[u8], plain: &[u8], out: &mut [u8]) {
    let (body, tag) = out.split_at_mut(plain.len());
    body.copy_from_slice(plain);
    let cipher = <ChaCha20Poly1305 as KeyInit>::new(key.into());
    let t = cipher
        .encrypt_in_place_detached(&[0u8; 12].into(), ad, body)
        .expect("a handshake field is far below the AEAD's limit");
    tag.copy_from_slice(&t);
}

/// Opens what [`seal`] made; `None` when the tag does not verify.
pub fn open<const N: usize>(key: &[u8; 32], ad: &[u8], sealed: &[u8]) -> Option<[u8; N]> {
    if sealed.len() != N + TAG_LEN {
        return None;
    }
    let (body, tag) = sealed.split_at(N);
    let mut plain = [0u8; N];
    plain.copy_from_slice(body);
    let cipher = <ChaCha20Poly1305 as KeyInit>::new(key.into());
    cipher
        .decrypt_in_place_detached(&[0u8; 12].into(), ad, &mut plain, tag.into())
        .ok()?;
    Some(plain)
}

/// XChaCha20-Poly1305 of a 16-byte cookie (the cookie reply's payload).
pub fn xseal_cookie(key: &[u8; 32], nonce: &[u8; 24], ad: &[u8], cookie: &[u8; 16]) -> [u8; 32] {
    let mut out = [0u8; 32];
    out[..16].copy_from_slice(cookie);
    let cipher = <XChaCha20Poly1305 as KeyInit>::new(key.into());
    let tag = cipher
        .encrypt_in_place_detached(nonce.into(), ad, &mut out[..16])
        .expect("16 bytes are within the AEAD's limit");
    out[16..].copy_from_slice(&tag);
    out
}

/// Opens what [`xseal_cookie`] made; `None` when the tag does not verify.
pub fn xopen_cookie(
    key: &[u8; 32],
    nonce: &[u8; 24],
    ad: &[u8],
    sealed: &[u8],
) -> Option<[u8; 16]> {
    let sealed: &[u8; 32] = sealed.try_into().ok()?;
    let mut cookie = [0u8; 16];
    cookie.copy_from_slice(&sealed[..16]);
    let cipher = <XChaCha20Poly1305 as KeyInit>::new(key.into());
    cipher
        .decrypt_in_place_detached(nonce.into(), ad, &mut cookie, sealed[16..].into())
        .ok()?;
    Some(cookie)
}

/// A TAI64N timestamp: seconds since 1970 plus 2^62, then nanoseconds, both big-endian.
pub type Tai64n = [u8; 12];

/// The timestamp of `wall`, its nanoseconds rounded down to 2^24 ns (about 17 ms), as
/// the kernel does: a responder learns no finer clock than that, and no peer needs
/// more, since initiations come at most 50 a second.
pub fn tai64n(wall: SystemTime) -> Tai64n {
    let since = wall.duration_since(UNIX_EPOCH).unwrap_or_default();
    let mut out = [0u8; 12];
    out[..8].copy_from_slice(&((1u64 << 62) + since.as_secs()).to_be_bytes());
    out[8..].copy_from_slice(&(since.subsec_nanos() & !((1 << 24) - 1)).to_be_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kdf_outputs_chain_and_differ() {
        let ck = [7u8; 32];
        let [a] = kdf::<1>(&ck, b"x");
        let [b, c] = kdf::<2>(&ck, b"x");
        let [d, e, f] = kdf::<3>(&ck, b"x");
        assert_eq!(a, b, "the first output does not depend on how many follow");
        assert_eq!((b, c), (d, e));
        assert!(a != c && c != f && a != f);
    }

    #[test]
    fn the_aead_opens_what_it_sealed_and_nothing_else() {
        let key = [3u8; 32];
        let mut out = [0u8; 4 + TAG_LEN];
        seal(&key, b"ad", b"abcd", &mut out);
        assert_eq!(open::<4>(&key, b"ad", &out), Some(*b"abcd"));
        assert_eq!(open::<4>(&key, b"other ad", &out), None);
        out[0] ^= 1;
        assert_eq!(open::<4>(&key, b"ad", &out), None);
        let sealed = xseal_cookie(&key, &[9; 24], b"mac1", &[5; 16]);
        assert_eq!(
            xopen_cookie(&key, &[9; 24], b"mac1", &sealed),
            Some([5; 16])
        );
        assert_eq!(xopen_cookie(&key, &[8; 24], b"mac1", &sealed), None);
    }

    #[test]
    fn timestamps_grow_with_time_and_hide_the_low_nanoseconds() {
        let t = UNIX_EPOCH + std::time::Duration::new(1_700_000_000, 5_000_000);
        let later = t + std::time::Duration::from_millis(40);
        assert!(tai64n(later) > tai64n(t));
        assert_eq!(tai64n(t), tai64n(t + std::time::Duration::from_millis(1)));
        assert_eq!(
            &tai64n(t)[..8],
            &((1u64 << 62) + 1_700_000_000).to_be_bytes()
        );
    }
}
