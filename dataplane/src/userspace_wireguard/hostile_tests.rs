//! The hostile-peer harness, in memory: a scripted peer (a second core, or a
//! stranger with hand-made datagrams) sends replays, forged responses, cookie
//! replies, stale keys, floods; each test asserts what the device did and, as
//! important, what it did not change (endpoint, last handshake, sessions). The same
//! rules are driven through the real device over UDP in `tests/userspace_wireguard.rs`.

use std::time::{Duration, Instant, SystemTime};

use super::{
    tests::{
        addr, core, deliver, handshaken, ipv4, kinds, public, under_load, Captured, ADDR_A, ADDR_B,
    },
    *,
};
use crate::userspace_wireguard::{
    noise::{
        crypto::mac,
        handshake::{LocalIdentity, RESPONSE_LEN},
        keypair::REJECT_AFTER_TIME,
    },
    timers::{REKEY_ATTEMPT_TIME, REKEY_TIMEOUT},
    uapi_request::parse_set,
};

const ELSEWHERE: &str = "198.51.100.9:4444";

fn get(c: &DeviceCore, key: &str) -> Option<String> {
    c.render_get()
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")).map(str::to_owned))
}

fn set(c: &DeviceCore, body: &str) {
    c.apply_set(parse_set(body).unwrap());
}

/// A's first initiation to B, and B's answer to it, at `now`.
fn first_initiation(a: &DeviceCore, now: Instant) -> Vec<u8> {
    let mut io = Captured::default();
    a.handle_tun_packet(&ipv4(1, 2), now, &mut io);
    assert_eq!(kinds(&io), vec![1]);
    io.sent.remove(0).1
}

/// A and B after a complete handshake from `init`, A's packet delivered to B.
fn complete(a: &DeviceCore, b: &DeviceCore, init: &[u8], now: Instant) {
    let mut io_b = Captured::default();
    b.handle_datagram(addr(ADDR_A), init, now, SystemTime::now(), &mut io_b);
    assert_eq!(kinds(&io_b), vec![2]);
    let mut io_a = deliver(&mut io_b, ADDR_B, a, now);
    let io_b = deliver(&mut io_a, ADDR_A, b, now);
    assert_eq!(io_b.tun.len(), 1, "A's staged packet arrived");
}

/// Sends `datagram` to `c` from `from`; what came out.
fn send(c: &DeviceCore, from: &str, datagram: &[u8], now: Instant) -> Captured {
    let mut io = Captured::default();
    c.handle_datagram(addr(from), datagram, now, SystemTime::now(), &mut io);
    io
}

#[test]
fn an_initiation_replayed_after_the_sessions_expired_is_refused_and_moves_nothing() {
    let t0 = Instant::now();
    let (a, b) = (core(1, 2, ADDR_B), core(2, 1, ADDR_A));
    let init = first_initiation(&a, t0);
    complete(&a, &b, &init, t0);
    let handshake = get(&b, "last_handshake_time_sec");
    // 185 s idle: every key of the session is gone on both sides.
    let later = t0 + Duration::from_secs(185);
    b.tick(later, &mut Captured::default());
    let io = send(&b, ELSEWHERE, &init, later);
    assert!(io.sent.is_empty(), "no response to a replay");
    assert_eq!(b.counters().replayed_initiations, 1);
    assert_eq!(
        get(&b, "endpoint").as_deref(),
        Some(ADDR_A),
        "endpoint unchanged"
    );
    assert_eq!(get(&b, "last_handshake_time_sec"), handshake);
    // The peer's own next initiation is newer and still taken.
    a.tick(later, &mut Captured::default());
    let fresh = first_initiation(&a, later);
    assert_eq!(kinds(&send(&b, ADDR_A, &fresh, later)), vec![2]);
}

#[test]
fn replays_stay_refused_across_a_preshared_key_change_and_a_remove_and_readd() {
    let t0 = Instant::now();
    let (a, b) = (core(1, 2, ADDR_B), core(2, 1, ADDR_A));
    let init = first_initiation(&a, t0);
    complete(&a, &b, &init, t0);
    // A preshared key set and cleared again: the sessions go, the timestamp stays.
    set(
        &b,
        &format!(
            "public_key={}\npreshared_key={}\n",
            public(1),
            hex::encode([5u8; 32])
        ),
    );
    set(
        &b,
        &format!(
            "public_key={}\npreshared_key={}\n",
            public(1),
            hex::encode([0u8; 32])
        ),
    );
    let t1 = t0 + Duration::from_secs(1);
    assert!(send(&b, ELSEWHERE, &init, t1).sent.is_empty());
    // Removed and added back.
    set(&b, &format!("public_key={}\nremove=true\n", public(1)));
    set(
        &b,
        &format!(
            "public_key={}\nendpoint={ADDR_A}\nallowed_ip=10.0.0.1/32\n",
            public(1)
        ),
    );
    let t2 = t0 + Duration::from_secs(2);
    assert!(send(&b, ELSEWHERE, &init, t2).sent.is_empty());
    assert_eq!(b.counters().replayed_initiations, 2);
    assert_eq!(get(&b, "endpoint").as_deref(), Some(ADDR_A));
}

#[test]
fn initiations_closer_than_20_ms_are_not_consumed() {
    let t0 = Instant::now();
    let (a, b) = (core(1, 2, ADDR_B), core(2, 1, ADDR_A));
    let first = first_initiation(&a, t0);
    assert_eq!(kinds(&send(&b, ADDR_A, &first, t0)), vec![2]);
    // A newer initiation (as a retry makes), 10 ms later: refused as a flood.
    a.tick(
        t0 + REKEY_TIMEOUT + Duration::from_millis(400),
        &mut Captured::default(),
    );
    let mut io = Captured::default();
    a.tick(t0 + Duration::from_secs(20), &mut io);
    let newer = io
        .sent
        .iter()
        .find(|(_, d)| d[0] == 1)
        .expect("a retry")
        .1
        .clone();
    assert!(send(&b, ADDR_A, &newer, t0 + Duration::from_millis(10))
        .sent
        .is_empty());
    assert_eq!(
        kinds(&send(&b, ADDR_A, &newer, t0 + Duration::from_millis(30))),
        vec![2]
    );
}

#[test]
fn cookie_replies_and_forged_responses_never_move_the_endpoint() {
    let now = Instant::now();
    let (a, b) = (core(1, 2, ADDR_B), core(2, 1, ADDR_A));
    let init = first_initiation(&a, now);
    let index = &init[4..8];
    // A forged response to A's initiation, with a valid MAC1 (anyone can make one:
    // the key is A's public key), from a stranger: refused, endpoint unchanged.
    let mut forged = [7u8; RESPONSE_LEN];
    forged[..4].copy_from_slice(&[2, 0, 0, 0]);
    forged[8..12].copy_from_slice(index);
    let a_public: [u8; 32] = hex::decode(public(1)).unwrap().try_into().unwrap();
    let m1 = mac(
        &crate::userspace_wireguard::noise::crypto::hash(&[b"mac1----", &a_public]),
        &forged[..60],
    );
    forged[60..76].copy_from_slice(&m1);
    assert!(send(&a, ELSEWHERE, &forged, now).sent.is_empty());
    // A genuine cookie reply from B's checker, delivered from elsewhere: A keeps the
    // cookie (it is B's) but not the address.
    let mut io_b = under_load(&b, [(addr(ADDR_A), &init[..])], now);
    let cookie_reply = io_b.sent.remove(0).1;
    assert!(send(&a, ELSEWHERE, &cookie_reply, now).sent.is_empty());
    let mut forged_cookie = cookie_reply;
    forged_cookie[40] ^= 1;
    assert!(send(&a, ELSEWHERE, &forged_cookie, now).sent.is_empty());
    assert_eq!(get(&a, "endpoint").as_deref(), Some(ADDR_B));
    assert_eq!(
        a.counters().invalid_datagrams,
        2,
        "the forged response and the forged cookie"
    );
}

#[test]
fn keypairs_expire_on_their_own_and_a_packet_on_an_older_one_never_takes_sending_back() {
    let t0 = Instant::now();
    let (a, b, _) = handshaken(t0);
    // A packet A sealed at 179 s is refused by B at 181 s: its keypair is past 180 s.
    let mut io_a = Captured::default();
    a.handle_tun_packet(&ipv4(1, 2), t0 + Duration::from_secs(119), &mut io_a);
    let on_first = io_a.sent.remove(0).1;
    // At 121 s A's data asks for a new handshake (initiator, REKEY_AFTER_TIME).
    let t1 = t0 + Duration::from_secs(121);
    let mut io_a = Captured::default();
    a.handle_tun_packet(&ipv4(1, 2), t1, &mut io_a);
    assert_eq!(
        kinds(&io_a),
        vec![4, 1],
        "data on the old keypair, then an initiation"
    );
    let new_index = io_a.sent[1].1[4..8].to_vec();
    io_a.sent.remove(0);
    let mut io_b = deliver(&mut io_a, ADDR_A, &b, t1);
    let mut io_a = deliver(&mut io_b, ADDR_B, &a, t1);
    deliver(&mut io_a, ADDR_A, &b, t1);
    // A packet on the first keypair arrives late: accepted, but B keeps sending on
    // the new one (its receiver index is A's new one).
    let io = send(&b, ADDR_A, &on_first, t1);
    assert_eq!(io.tun.len(), 1);
    let mut io_b = Captured::default();
    b.handle_tun_packet(&ipv4(2, 1), t1, &mut io_b);
    assert_eq!(&io_b.sent[0].1[4..8], &new_index[..]);
    // The first keypair ends at 180 s even though a newer one lives on.
    let mut io_a = Captured::default();
    a.handle_tun_packet(&ipv4(1, 2), t1, &mut io_a);
    let replayed_late = send(&b, ADDR_A, &on_first, t0 + REJECT_AFTER_TIME);
    assert!(replayed_late.tun.is_empty());
}

#[test]
fn a_flood_from_many_sources_gets_only_cookie_replies_and_a_proven_source_only_its_rate() {
    let now = Instant::now();
    let (a, b) = (core(1, 2, ADDR_B), core(2, 1, ADDR_A));
    let init = first_initiation(&a, now);
    let sources: Vec<SocketAddr> = (0..500u32)
        .map(|i| {
            addr(&format!(
                "10.{}.{}.{}:{}",
                i >> 16,
                (i >> 8) & 255,
                i & 255,
                1000 + i
            ))
        })
        .collect();
    let io = under_load(&b, sources.iter().map(|s| (*s, &init[..])), now);
    assert_eq!(
        kinds(&io),
        vec![3; 500],
        "a cookie reply each, never a response"
    );
    assert_eq!(get(&b, "endpoint").as_deref(), Some(ADDR_A));
    // A source that proved its address gets 5 at once, then 20 a second.
    let mut io_b = under_load(&b, [(addr(ADDR_A), &init[..])], now);
    let mut io_a = deliver(&mut io_b, ADDR_B, &a, now);
    let mut t = now;
    let mut retries = Vec::new();
    for _ in 0..8 {
        t += REKEY_TIMEOUT + Duration::from_millis(400);
        a.tick(t, &mut io_a);
        retries.push(io_a.sent.pop().expect("a retry").1);
    }
    let batch = retries.iter().map(|r| (addr(ADDR_A), &r[..]));
    under_load(&b, batch, t);
    assert_eq!(
        b.counters().rate_limited_handshakes,
        3,
        "8 sent, a burst of 5 admitted"
    );
}

#[test]
fn staged_packets_are_dropped_when_the_handshake_is_given_up() {
    let t0 = Instant::now();
    let a = core(1, 2, ADDR_B);
    let mut io = Captured::default();
    for _ in 0..3 {
        a.handle_tun_packet(&ipv4(1, 2), t0, &mut io);
    }
    let staged = |c: &DeviceCore| {
        c.read()
            .peers
            .values()
            .map(|p| lock(p).staged())
            .sum::<usize>()
    };
    assert_eq!(staged(&a), 3);
    let mut t = t0;
    while t < t0 + REKEY_ATTEMPT_TIME + Duration::from_secs(1) {
        t += Duration::from_secs(1);
        a.tick(t, &mut io);
    }
    assert_eq!(staged(&a), 0);
    assert!(
        kinds(&io).iter().filter(|k| **k == 1).count() >= 15,
        "retried meanwhile"
    );
}

#[test]
fn peer_ids_skip_live_ones_when_the_counter_comes_round() {
    let a = core(1, 2, ADDR_B);
    a.write().next_id = 1;
    set(
        &a,
        &format!("public_key={}\nallowed_ip=10.0.0.3/32\n", public(3)),
    );
    assert_eq!(a.peer_count(), 2);
    let get = a.render_get();
    assert!(
        get.contains(&public(2)) && get.contains(&public(3)),
        "{get}"
    );
    assert!(get.contains("allowed_ip=10.0.0.2/32") && get.contains("allowed_ip=10.0.0.3/32"));
}

#[test]
fn a_stranger_without_our_key_gets_nothing_back() {
    let now = Instant::now();
    let b = core(2, 1, ADDR_A);
    // An initiation from an unconfigured key (MAC1 right: it knows our public key).
    let stranger = core(9, 2, ADDR_B);
    let init = first_initiation_to(&stranger, 2, now);
    assert!(send(&b, ELSEWHERE, &init, now).sent.is_empty());
    assert_eq!(b.counters().invalid_datagrams, 1);
    // Data for an index nobody holds, truncated and oversized junk.
    let mut data = vec![4u8, 0, 0, 0];
    data.extend_from_slice(&[0x55; 60]);
    for d in [
        &data[..],
        &data[..20],
        &[1u8, 0, 0, 0][..],
        &vec![4u8; 70_000][..],
    ] {
        assert!(send(&b, ELSEWHERE, d, now).sent.is_empty());
    }
    assert_eq!(b.counters().invalid_datagrams, 5);
    assert_eq!(get(&b, "endpoint").as_deref(), Some(ADDR_A));
}

/// An initiation from `c` to its peer that owns 10.0.0.`dst`.
fn first_initiation_to(c: &DeviceCore, dst: u8, now: Instant) -> Vec<u8> {
    let mut io = Captured::default();
    c.handle_tun_packet(&ipv4(9, dst), now, &mut io);
    io.sent.remove(0).1
}

#[test]
fn our_core_and_boringtun_complete_handshakes_both_ways_and_carry_data() {
    use boringtun::noise::{Tunn, TunnResult};
    let now = Instant::now();
    let ours = core(2, 1, ADDR_A);
    let theirs_secret = boringtun::x25519::StaticSecret::from(tests::secret(1));
    let ours_public =
        boringtun::x25519::PublicKey::from(LocalIdentity::new(tests::secret(2)).public_key());
    let mut theirs = Tunn::new(theirs_secret, ours_public, None, None, 1, None);
    let mut buf = vec![0u8; 2048];
    // boringtun initiates.
    let TunnResult::WriteToNetwork(init) = theirs.encapsulate(&ipv4(1, 2), &mut buf) else {
        panic!("an initiation");
    };
    let io = send(&ours, ADDR_A, init, now);
    assert_eq!(kinds(&io), vec![2]);
    let mut out = vec![0u8; 2048];
    let TunnResult::WriteToNetwork(keepalive) = theirs.decapsulate(None, &io.sent[0].1, &mut out)
    else {
        panic!("the response is taken");
    };
    // Its keepalive confirms the keys, then its queued packet follows.
    assert!(send(&ours, ADDR_A, keepalive, now).tun.is_empty());
    let TunnResult::WriteToNetwork(data) = theirs.decapsulate(None, &[], &mut out) else {
        panic!("the queued packet");
    };
    let io = send(&ours, ADDR_A, data, now);
    assert_eq!(io.tun, vec![ipv4(1, 2)], "boringtun's queued packet opened");
    // We answer on the confirmed keypair; boringtun opens it.
    let mut io = Captured::default();
    ours.handle_tun_packet(&ipv4(2, 1), now, &mut io);
    let opened = theirs.decapsulate(None, &io.sent[0].1, &mut out);
    assert!(matches!(opened, TunnResult::WriteToTunnelV4(p, _) if *p == ipv4(2, 1)[..]));
    // We initiate (a fresh core), boringtun responds.
    let fresh = core(2, 1, ADDR_A);
    let mut theirs = Tunn::new(
        boringtun::x25519::StaticSecret::from(tests::secret(1)),
        ours_public,
        None,
        None,
        2,
        None,
    );
    let mut io = Captured::default();
    fresh.handle_tun_packet(&ipv4(2, 1), now, &mut io);
    let TunnResult::WriteToNetwork(resp) = theirs.decapsulate(None, &io.sent[0].1, &mut out) else {
        panic!("boringtun takes our initiation");
    };
    let io = send(&fresh, ADDR_A, resp, now);
    assert_eq!(kinds(&io), vec![4], "our staged packet on the new keypair");
    let opened = theirs.decapsulate(None, &io.sent[0].1, &mut out);
    assert!(matches!(opened, TunnResult::WriteToTunnelV4(p, _) if *p == ipv4(2, 1)[..]));
}

#[test]
fn a_flood_from_one_source_gets_its_burst_of_cookie_replies_then_its_rate() {
    let now = Instant::now();
    let (a, b) = (core(1, 2, ADDR_B), core(2, 1, ADDR_A));
    let init = first_initiation(&a, now);
    let flood = std::iter::repeat_n((addr(ELSEWHERE), &init[..]), 1000);
    let io = under_load(&b, flood, now);
    assert_eq!(kinds(&io), vec![3; 5], "a burst of 5 replies, not 1,000");
    assert_eq!(b.counters().rate_limited_handshakes, 995);
    // A second later the bucket is full again, and holds no more than a burst.
    let later = now + Duration::from_secs(1);
    let flood = std::iter::repeat_n((addr(ELSEWHERE), &init[..]), 1000);
    let io = under_load(&b, flood, later);
    assert_eq!(io.sent.len(), 5, "the bucket holds at most a burst");
    // Another source is not held back by it.
    let io = under_load(&b, [(addr(ADDR_A), &init[..])], later);
    assert_eq!(kinds(&io), vec![3]);
}
