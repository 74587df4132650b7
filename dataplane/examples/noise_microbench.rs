//! The userspace WireGuard Noise core's figures (docs/userspace-wireguard.md): our own
//! core (`userspace_wireguard::noise`) and boringtun's sealing and opening 1,400-byte
//! packets and completing handshakes, side by side, beside the floor (one `ring`
//! ChaCha20-Poly1305 seal, one X25519 operation), and what a flood costs a responder
//! (a MAC1 check, a cookie reply).
//!
//! `cargo run -p wirespan-dataplane --example noise_microbench` (the crypto crates are
//! optimised in dev builds too, see the workspace `Cargo.toml`).

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use boringtun::{
    noise::{rate_limiter::RateLimiter, Tunn, TunnResult},
    x25519::{PublicKey, StaticSecret},
};
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305};

const PACKET: usize = 1400;

fn pair() -> (Tunn, Tunn) {
    let (ka, kb) = (StaticSecret::from([1u8; 32]), StaticSecret::from([2u8; 32]));
    let (pa, pb) = (PublicKey::from(&ka), PublicKey::from(&kb));
    // Unlimited handshakes: the benchmark is the load a limiter would refuse.
    let limit_a = Arc::new(RateLimiter::new(&pa, u64::MAX));
    let limit_b = Arc::new(RateLimiter::new(&pb, u64::MAX));
    (
        Tunn::new(ka, pb, None, None, 1, Some(limit_a)),
        Tunn::new(kb, pa, None, None, 2, Some(limit_b)),
    )
}

/// One complete handshake between `a` (initiator) and `b`; returns B's first data.
fn handshake(a: &mut Tunn, b: &mut Tunn, buf: &mut [u8], out: &mut [u8]) {
    let TunnResult::WriteToNetwork(init) = a.format_handshake_initiation(buf, true) else {
        panic!("initiation");
    };
    let TunnResult::WriteToNetwork(resp) = b.decapsulate(None, init, out) else {
        panic!("response");
    };
    let TunnResult::WriteToNetwork(_keepalive) = a.decapsulate(None, resp, buf) else {
        panic!("keepalive");
    };
}

fn report(what: &str, n: u32, elapsed: Duration, bytes: Option<usize>) {
    let per = elapsed / n;
    match bytes {
        Some(b) => {
            let gbits = (b as f64 * 8.0 * f64::from(n)) / elapsed.as_secs_f64() / 1e9;
            println!(
                "{what:<48} {:>9.2} µs/op {gbits:>7.2} Gbit/s",
                per.as_secs_f64() * 1e6
            );
        }
        None => println!("{what:<48} {:>9.2} µs/op", per.as_secs_f64() * 1e6),
    }
}

/// Our core: the same operations through `noise::{handshake, keypair, cookie}`.
fn ours(packet: &[u8], n: u32, hn: u32) {
    use std::net::SocketAddr;
    use wirespan_dataplane::userspace_wireguard::noise::{
        cookie::{CookieChecker, CookieJar},
        handshake::{
            consume_initiation, consume_response, create_initiation, create_response,
            open_initiation, LocalIdentity, PeerKeys,
        },
        keypair::Keypair,
    };
    let (a, b) = (LocalIdentity::new([1; 32]), LocalIdentity::new([2; 32]));
    let (a_to_b, b_to_a) = (
        PeerKeys::new(&a, b.public_key(), None),
        PeerKeys::new(&b, a.public_key(), None),
    );
    let now = Instant::now();
    let handshake = |i: u32| {
        let e = x25519_dalek::StaticSecret::from([9; 32]);
        let (init, sent) = create_initiation(&a, &a_to_b, i, e, [0; 12]).unwrap();
        let opened = open_initiation(&b, &init).unwrap();
        let consumed = consume_initiation(&opened, &b_to_a).unwrap();
        let e = x25519_dalek::StaticSecret::from([8; 32]);
        let (resp, b_keys) = create_response(&b_to_a, &consumed, i + 1, &e).unwrap();
        let (_, a_keys) = consume_response(&a, &a_to_b, &sent, &resp).unwrap();
        (
            Keypair::new(&a_keys, i, i + 1, true, now),
            Keypair::new(&b_keys, i + 1, i, false, now),
        )
    };
    let (mut ka, mut kb) = handshake(1);
    let (mut buf, mut out) = (vec![0u8; 2048], vec![0u8; 2048]);
    let t = Instant::now();
    for _ in 0..n {
        let len = ka.seal(packet, &mut buf, 1420, now).unwrap();
        let _ = std::hint::black_box(&buf[..len]);
    }
    report("ours seal 1400 B", n, t.elapsed(), Some(PACKET));
    let t = Instant::now();
    for _ in 0..n {
        let len = ka.seal(packet, &mut buf, 1420, now).unwrap();
        let opened = kb.open(&buf[..len], &mut out, now).unwrap();
        let _ = std::hint::black_box(opened);
    }
    report("ours seal+open 1400 B", n, t.elapsed(), Some(PACKET));
    let t = Instant::now();
    for i in 0..hn {
        let _ = std::hint::black_box(handshake(i * 2));
    }
    report(
        "ours handshake (init, response, keys)",
        hn,
        t.elapsed(),
        None,
    );
    // What a flood costs a responder under load: MAC1, then a cookie reply.
    let mut init = [0u8; 148];
    init[0] = 1;
    CookieJar::default().add_macs(&a_to_b.mac1_key, &mut init, now);
    let from: SocketAddr = "192.0.2.1:1".parse().unwrap();
    let mut checker = CookieChecker::default();
    let t = Instant::now();
    for _ in 0..n {
        assert!(b.mac1_ok(&init));
        let ok = checker.mac2_ok(&init, from, now, || [5; 32]);
        let reply = checker.reply(&b, &init, from, now, || [5; 32], [1; 24]);
        let _ = std::hint::black_box((ok, reply));
    }
    report(
        "ours MAC1 + MAC2 check + cookie reply",
        n,
        t.elapsed(),
        None,
    );
}

fn main() {
    let mut buf = vec![0u8; 2048];
    let mut out = vec![0u8; 2048];
    let mut packet = vec![0u8; PACKET];
    packet[0] = 0x45;
    packet[2..4].copy_from_slice(&u16::try_from(PACKET).unwrap().to_be_bytes());

    let (mut a, mut b) = pair();
    handshake(&mut a, &mut b, &mut buf, &mut out);

    let n = 50_000;
    let hn = 500;
    ours(&packet, n, hn);
    let t = Instant::now();
    for _ in 0..n {
        let TunnResult::WriteToNetwork(sealed) = a.encapsulate(&packet, &mut buf) else {
            panic!("seal");
        };
        let _ = std::hint::black_box(sealed);
    }
    report(
        "boringtun seal 1400 B (encapsulate)",
        n,
        t.elapsed(),
        Some(PACKET),
    );

    let t = Instant::now();
    for _ in 0..n {
        let TunnResult::WriteToNetwork(sealed) = a.encapsulate(&packet, &mut buf) else {
            panic!("seal");
        };
        let TunnResult::WriteToTunnelV4(opened, _) = b.decapsulate(None, sealed, &mut out) else {
            panic!("open");
        };
        let _ = std::hint::black_box(opened);
    }
    report("boringtun seal+open 1400 B", n, t.elapsed(), Some(PACKET));

    let t = Instant::now();
    for _ in 0..hn {
        handshake(&mut a, &mut b, &mut buf, &mut out);
    }
    report(
        "boringtun handshake (init, response, confirm)",
        hn,
        t.elapsed(),
        None,
    );

    let key = LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, &[7u8; 32]).unwrap());
    let mut data = vec![0u8; PACKET];
    let t = Instant::now();
    for i in 0..n {
        let mut nonce = [0u8; 12];
        nonce[4..].copy_from_slice(&u64::from(i).to_le_bytes());
        let tag = key
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::empty(),
                &mut data,
            )
            .unwrap();
        let _ = std::hint::black_box(tag);
    }
    report(
        "ring ChaCha20-Poly1305 seal 1400 B (floor)",
        n,
        t.elapsed(),
        Some(PACKET),
    );

    let secret = x25519_dalek::StaticSecret::from([3u8; 32]);
    let public = x25519_dalek::PublicKey::from(&x25519_dalek::StaticSecret::from([4u8; 32]));
    let t = Instant::now();
    for _ in 0..hn {
        let _ = std::hint::black_box(secret.diffie_hellman(&public));
    }
    report(
        "x25519-dalek one DH (a handshake needs ~8)",
        hn,
        t.elapsed(),
        None,
    );
}
