//! The device core's tests: configuration, the two packet ways, timers and locks.
//! The rules against hostile senders are tested in `hostile_tests.rs`.

use std::{net::Ipv4Addr, sync::Arc};

use x25519_dalek::{PublicKey, StaticSecret};

use super::*;
use crate::userspace_wireguard::{timers::REKEY_TIMEOUT, uapi_request::parse_set};

/// Captures what a core sends and delivers.
#[derive(Default)]
pub(super) struct Captured {
    pub(super) sent: Vec<(SocketAddr, Vec<u8>)>,
    pub(super) tun: Vec<Vec<u8>>,
}

impl Io for Captured {
    fn send(&mut self, to: SocketAddr, datagram: &[u8]) {
        self.sent.push((to, datagram.to_vec()));
    }
    fn write_tun(&mut self, packet: &[u8]) {
        self.tun.push(packet.to_vec());
    }
}

pub(super) const ADDR_A: &str = "192.0.2.1:51820";
pub(super) const ADDR_B: &str = "192.0.2.2:51820";

pub(super) fn secret(n: u8) -> Key {
    [n; 32]
}

pub(super) fn public(n: u8) -> String {
    hex::encode(PublicKey::from(&StaticSecret::from(secret(n))).as_bytes())
}

/// A core with private key `me`, one peer `peer` owning 10.0.0.`peer`/32.
pub(super) fn core(me: u8, peer: u8, endpoint: &str) -> DeviceCore {
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
pub(super) fn ipv4(src: u8, dst: u8) -> Vec<u8> {
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
pub(super) fn deliver(
    from_io: &mut Captured,
    from_addr: &str,
    to: &DeviceCore,
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
pub(super) fn handshaken(now: Instant) -> (DeviceCore, DeviceCore, Captured) {
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
        a.read().peers.values().all(|p| !lock(p).has_keypairs()),
        "no keypair made yet"
    );
    let mut io = Captured::default();
    a.handle_tun_packet(&ipv4(1, 2), now, &mut io);
    assert!(
        a.take_timer_wake(),
        "the handshake's retry is the new earliest deadline"
    );
    assert!(!a.take_timer_wake(), "once");
    let due = a.next_deadline(now).expect("a retry");
    let jitter = due - (now + REKEY_TIMEOUT);
    assert!(jitter <= Duration::from_millis(333), "{jitter:?}");
    // A second packet brings nothing earlier: no wake.
    a.handle_tun_packet(&ipv4(1, 2), now, &mut io);
    assert!(!a.take_timer_wake());
}

#[test]
fn under_load_an_initiation_gets_a_cookie_reply_and_its_retry_with_the_cookie_a_response() {
    let now = Instant::now();
    let (a, b) = (core(1, 2, ADDR_B), core(2, 1, ADDR_A));
    let mut io_a = Captured::default();
    a.handle_tun_packet(&ipv4(1, 2), now, &mut io_a);
    let init = io_a.sent.remove(0).1;
    let mut io_b = under_load(&b, [(addr(ADDR_A), &init[..])], now);
    assert_eq!(kinds(&io_b), vec![3], "a cookie reply, no response");
    assert_eq!(b.counters().cookie_replies, 1);
    let mut io_a = deliver(&mut io_b, ADDR_B, &a, now);
    assert!(io_a.sent.is_empty(), "a cookie reply sends nothing back");
    // The retry carries MAC2 and passes while B is still under load.
    a.tick(now + REKEY_TIMEOUT + Duration::from_millis(400), &mut io_a);
    let retry = io_a.sent.remove(0).1;
    assert_ne!(&retry[132..], &[0u8; 16], "MAC2 set");
    let t = now + Duration::from_secs(6);
    let io_b = under_load(&b, [(addr(ADDR_A), &retry[..])], t);
    assert_eq!(kinds(&io_b), vec![2], "a response");
    // From another address the cookie is worthless.
    let io_c = under_load(&b, [(addr("192.0.2.9:1"), &retry[..])], t);
    assert_eq!(kinds(&io_c), vec![3]);
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

pub(super) fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// The message types of what `io` sent.
pub(super) fn kinds(io: &Captured) -> Vec<u8> {
    io.sent.iter().map(|(_, d)| d[0]).collect()
}

/// What `c` sends back for `messages` taken as under load (the handshake reader's way).
pub(super) fn under_load<'d>(
    c: &DeviceCore,
    messages: impl IntoIterator<Item = (SocketAddr, &'d [u8])>,
    now: Instant,
) -> Captured {
    let mut io = Captured::default();
    c.handle_handshakes(messages, now, SystemTime::now(), true, &mut io);
    io
}
