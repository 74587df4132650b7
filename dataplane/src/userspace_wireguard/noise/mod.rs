//! WireGuard's Noise protocol, our own and sans-IO: the primitives ([`crypto`]), the
//! handshake messages ([`handshake`]), cookies ([`cookie`]), transport keypairs with
//! their replay window and limits ([`keypair`]) and handshake load control
//! ([`limiter`]). Time and randomness come in as arguments, so every rule is tested on
//! a fake clock. The device core ([`super::core`]) decides what an authenticated
//! message may change: the replay rule on initiation timestamps, roaming, which
//! keypair sends.

pub mod cookie;
pub mod crypto;
pub mod handshake;
pub mod keypair;
pub mod limiter;

/// Randomness from the operating system. Small draws (indices, nonces, jitter) come
/// from a per-thread pool refilled 4 KiB at a time, so a flood answered with cookie
/// replies does not cost a system call per reply.
pub mod random {
    use std::cell::RefCell;

    use rand_core::{OsRng, RngCore};
    use x25519_dalek::StaticSecret;

    const POOL: usize = 4096;

    thread_local! {
        static BYTES: RefCell<(Vec<u8>, usize)> = const { RefCell::new((Vec::new(), POOL)) };
    }

    /// `N` random bytes.
    pub fn bytes<const N: usize>() -> [u8; N] {
        let mut out = [0u8; N];
        BYTES.with_borrow_mut(|(pool, used)| {
            if pool.len() != POOL {
                pool.resize(POOL, 0);
            }
            if *used + N > POOL {
                OsRng.fill_bytes(pool);
                *used = 0;
            }
            out.copy_from_slice(&pool[*used..*used + N]);
            // Each byte is handed out once.
            pool[*used..*used + N].fill(0);
            *used += N;
        });
        out
    }

    /// A random u32.
    pub fn u32() -> u32 {
        u32::from_le_bytes(bytes())
    }

    /// A fresh ephemeral (or cookie) secret, straight from the operating system.
    pub fn secret() -> StaticSecret {
        StaticSecret::random_from_rng(OsRng)
    }
}
