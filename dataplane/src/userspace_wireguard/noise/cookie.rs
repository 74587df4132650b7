//! Cookies (section 5.4.7 of the paper), sans-IO with time and randomness passed in.
//! Under load a responder answers a handshake message without a valid MAC2 with a
//! cookie reply instead of doing any Diffie-Hellman; the cookie binds the sender's
//! address, so a flood from forged addresses never gets past it.

use std::{
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use super::{
    crypto::{mac, xopen_cookie, xseal_cookie},
    handshake::{
        constant_time_eq, le32, mac1_offset, LocalIdentity, COOKIE_REPLY_LEN, MSG_COOKIE_REPLY,
    },
};

/// A responder's cookie secret changes this often, so a cookie is good this long.
pub const COOKIE_SECRET_MAX_AGE: Duration = Duration::from_secs(120);
/// An initiator stops using a cookie this long before the responder would change its
/// secret (the reply's travel time).
const COOKIE_SECRET_LATENCY: Duration = Duration::from_secs(5);

/// The bytes of a sender's address a cookie binds: the IP address and the port.
fn address_bytes(from: SocketAddr) -> Vec<u8> {
    let mut out = match from.ip() {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.octets().to_vec(),
            None => v6.octets().to_vec(),
        },
    };
    out.extend_from_slice(&from.port().to_be_bytes());
    out
}

/// The responder's side: checks MAC2 and makes cookie replies.
#[derive(Default)]
pub struct CookieChecker {
    secret: [u8; 32],
    born: Option<Instant>,
}

impl CookieChecker {
    /// The cookie of `from` now, with a fresh secret when the last one is too old.
    fn cookie(
        &mut self,
        from: SocketAddr,
        now: Instant,
        random: impl FnOnce() -> [u8; 32],
    ) -> [u8; 16] {
        if self
            .born
            .is_none_or(|b| now.saturating_duration_since(b) >= COOKIE_SECRET_MAX_AGE)
        {
            self.secret = random();
            self.born = Some(now);
        }
        mac(&self.secret, &address_bytes(from))
    }

    /// True when `msg` (an initiation or a response) carries the MAC2 of `from`'s
    /// current cookie.
    pub fn mac2_ok(
        &mut self,
        msg: &[u8],
        from: SocketAddr,
        now: Instant,
        random: impl FnOnce() -> [u8; 32],
    ) -> bool {
        let cookie = self.cookie(from, now, random);
        let at = mac1_offset(msg.len()) + 16;
        constant_time_eq(&mac(&cookie, &msg[..at]), &msg[at..at + 16])
    }

    /// The cookie reply to `msg` from `from`: `from`'s cookie, encrypted to the key
    /// only the holder of our public key's peer relationship can derive, bound to the
    /// message by its MAC1.
    pub fn reply(
        &mut self,
        local: &LocalIdentity,
        msg: &[u8],
        from: SocketAddr,
        now: Instant,
        random_secret: impl FnOnce() -> [u8; 32],
        nonce: [u8; 24],
    ) -> [u8; COOKIE_REPLY_LEN] {
        let cookie = self.cookie(from, now, random_secret);
        let at = mac1_offset(msg.len());
        let mut out = [0u8; COOKIE_REPLY_LEN];
        out[0] = MSG_COOKIE_REPLY;
        // The receiver is the sender index of the message (its bytes 4..8).
        out[4..8].copy_from_slice(&msg[4..8]);
        out[8..32].copy_from_slice(&nonce);
        out[32..].copy_from_slice(&xseal_cookie(
            &local.cookie_key,
            &nonce,
            &msg[at..at + 16],
            &cookie,
        ));
        out
    }
}

/// The initiator's side, one per peer: the MAC1 of the last handshake message we sent
/// (a reply must be bound to it) and the cookie a reply gave us.
#[derive(Default, Clone)]
pub struct CookieJar {
    last_mac1: Option<[u8; 16]>,
    cookie: Option<([u8; 16], Instant)>,
}

impl CookieJar {
    /// Adds MAC1 and MAC2 to a handshake message of ours to a peer whose MAC1 key is
    /// `mac1_key`; MAC2 only while we hold a fresh cookie from it.
    pub fn add_macs(&mut self, mac1_key: &[u8; 32], msg: &mut [u8], now: Instant) {
        let at = mac1_offset(msg.len());
        let m1 = mac(mac1_key, &msg[..at]);
        msg[at..at + 16].copy_from_slice(&m1);
        self.last_mac1 = Some(m1);
        let fresh = self.cookie.filter(|(_, got)| {
            now.saturating_duration_since(*got) < COOKIE_SECRET_MAX_AGE - COOKIE_SECRET_LATENCY
        });
        let m2 = fresh.map_or([0u8; 16], |(c, _)| mac(&c, &msg[..at + 16]));
        msg[at + 16..at + 32].copy_from_slice(&m2);
    }

    /// Takes a cookie reply (64 bytes) from the peer whose cookie key is `cookie_key`.
    /// False when it is not the answer to our last message; it changes nothing then.
    pub fn consume_reply(&mut self, cookie_key: &[u8; 32], reply: &[u8], now: Instant) -> bool {
        let Some(last) = self.last_mac1 else {
            return false;
        };
        let Ok(nonce) = <[u8; 24]>::try_from(&reply[8..32]) else {
            return false;
        };
        match xopen_cookie(cookie_key, &nonce, &last, &reply[32..]) {
            Some(cookie) => {
                self.cookie = Some((cookie, now));
                // One reply per message: a second copy is not needed.
                self.last_mac1 = None;
                true
            }
            None => false,
        }
    }
}

/// The receiver index of a cookie reply.
pub fn reply_receiver(reply: &[u8]) -> u32 {
    le32(reply, 4)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::userspace_wireguard::noise::handshake::{PeerKeys, INITIATION_LEN};

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_cookie_reply_lets_the_next_message_pass_mac2_from_that_address_only() {
        let (a, b) = (LocalIdentity::new([1; 32]), LocalIdentity::new([2; 32]));
        let a_to_b = PeerKeys::new(&a, b.public_key(), None);
        let now = Instant::now();
        let mut jar = CookieJar::default();
        let mut checker = CookieChecker::default();
        let mut msg = [0u8; INITIATION_LEN];
        msg[0] = 1;
        msg[4] = 42;
        jar.add_macs(&a_to_b.mac1_key, &mut msg, now);
        assert!(b.mac1_ok(&msg));
        let from = addr("192.0.2.1:5000");
        assert!(!checker.mac2_ok(&msg, from, now, || [7; 32]));
        let reply = checker.reply(&b, &msg, from, now, || unreachable!(), [3; 24]);
        assert_eq!(reply_receiver(&reply), 42);
        assert!(jar.consume_reply(&a_to_b.cookie_key, &reply, now));
        assert!(
            !jar.consume_reply(&a_to_b.cookie_key, &reply, now),
            "once per message"
        );
        jar.add_macs(&a_to_b.mac1_key, &mut msg, now);
        assert!(checker.mac2_ok(&msg, from, now, || unreachable!()));
        assert!(!checker.mac2_ok(&msg, addr("192.0.2.1:5001"), now, || unreachable!()));
        // After the secret changes the old cookie is worthless.
        let later = now + COOKIE_SECRET_MAX_AGE;
        assert!(!checker.mac2_ok(&msg, from, later, || [8; 32]));
    }

    #[test]
    fn a_reply_not_bound_to_our_last_message_is_ignored() {
        let (a, b) = (LocalIdentity::new([1; 32]), LocalIdentity::new([2; 32]));
        let a_to_b = PeerKeys::new(&a, b.public_key(), None);
        let now = Instant::now();
        let mut jar = CookieJar::default();
        let mut checker = CookieChecker::default();
        let mut forged_for = [0u8; INITIATION_LEN];
        forged_for[0] = 1;
        let reply = checker.reply(
            &b,
            &forged_for,
            addr("192.0.2.1:1"),
            now,
            || [7; 32],
            [0; 24],
        );
        assert!(
            !jar.consume_reply(&a_to_b.cookie_key, &reply, now),
            "nothing sent yet"
        );
        let mut msg = [0u8; INITIATION_LEN];
        msg[0] = 1;
        jar.add_macs(&a_to_b.mac1_key, &mut msg, now);
        assert!(
            !jar.consume_reply(&a_to_b.cookie_key, &reply, now),
            "another MAC1"
        );
        assert_eq!(&msg[132..], &[0u8; 16], "no cookie: MAC2 stays zero");
    }
}
