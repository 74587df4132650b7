//! The fuzz body that drives the device core with a real peer (`wg_session`): two
//! cores with a completed handshake, then a script read from the fuzz input: the peer
//! sends packets, an attacker replays, bit-flips or makes up datagrams from its own
//! address, the clock jumps, and the other side answers. Nothing may panic, and the
//! device never writes to its TUN a packet the peer did not send.

use std::{
    collections::HashSet,
    net::SocketAddr,
    time::{Duration, Instant, SystemTime},
};

use super::{core::DeviceCore, io::Io, uapi_request::parse_set};

const PEER: &str = "192.0.2.1:51820";
const DEVICE: &str = "192.0.2.2:51820";
const ATTACKER: &str = "203.0.113.66:4000";

#[derive(Default)]
struct Captured {
    sent: Vec<Vec<u8>>,
    tun: Vec<Vec<u8>>,
}

impl Io for Captured {
    fn send(&mut self, _: SocketAddr, datagram: &[u8]) {
        self.sent.push(datagram.to_vec());
    }
    fn write_tun(&mut self, packet: &[u8]) {
        self.tun.push(packet.to_vec());
    }
}

fn side(me: u8, peer: u8, endpoint: &str) -> DeviceCore {
    let core = DeviceCore::default();
    let public = super::noise::handshake::LocalIdentity::new([peer; 32]).public_key();
    let body = format!(
        "private_key={}\npublic_key={}\nendpoint={endpoint}\nallowed_ip=10.0.0.{peer}/32\n",
        hex::encode([me; 32]),
        hex::encode(public)
    );
    core.apply_set(parse_set(&body).expect("a valid request"));
    core
}

/// An IPv4 UDP packet from 10.0.0.`src` to 10.0.0.`dst` carrying `payload`.
fn ipv4(src: u8, dst: u8, payload: &[u8]) -> Vec<u8> {
    let len = 28 + payload.len();
    let mut p = vec![0u8; 28];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_be_bytes());
    p[8] = 64;
    p[9] = 17;
    p[12..16].copy_from_slice(&[10, 0, 0, src]);
    p[16..20].copy_from_slice(&[10, 0, 0, dst]);
    p.extend_from_slice(payload);
    p
}

struct Session {
    peer: DeviceCore,
    device: DeviceCore,
    now: Instant,
    /// Every datagram the peer sent, in order.
    recorded: Vec<Vec<u8>>,
    /// Every packet the peer sealed.
    sealed: HashSet<Vec<u8>>,
}

impl Session {
    /// Delivers datagrams both ways until neither side has anything to send.
    fn settle(&mut self, mut from_peer: Vec<Vec<u8>>) {
        for _ in 0..8 {
            if from_peer.is_empty() {
                return;
            }
            let mut to_peer = Captured::default();
            for d in from_peer.drain(..) {
                self.recorded.push(d.clone());
                self.to_device(PEER, &d, &mut to_peer);
            }
            from_peer = self.to_peer(&to_peer.sent);
        }
    }

    /// Hands the device's datagrams to the peer; returns what the peer answered.
    fn to_peer(&self, datagrams: &[Vec<u8>]) -> Vec<Vec<u8>> {
        let mut back = Captured::default();
        for d in datagrams {
            let from = DEVICE.parse().unwrap();
            self.peer
                .handle_datagram(from, d, self.now, SystemTime::now(), &mut back);
        }
        back.sent
    }

    fn to_device(&self, from: &str, datagram: &[u8], io: &mut Captured) {
        self.device.handle_datagram(
            from.parse().unwrap(),
            datagram,
            self.now,
            SystemTime::now(),
            io,
        );
        for p in io.tun.drain(..) {
            assert!(
                self.sealed.contains(&p),
                "the device delivered a packet the peer never sent"
            );
        }
    }

    fn peer_sends(&mut self, payload: &[u8]) {
        let packet = ipv4(1, 2, payload);
        self.sealed.insert(packet.clone());
        let mut io = Captured::default();
        self.peer.handle_tun_packet(&packet, self.now, &mut io);
        self.settle(io.sent);
    }

    fn attack(&mut self, datagram: &[u8]) {
        let mut io = Captured::default();
        self.to_device(ATTACKER, datagram, &mut io);
        // Whatever the device answers goes to the attacker, never to the peer.
    }
}

/// One fuzz input: a script of operations, each a byte and its arguments.
pub fn wg_session(data: &[u8]) {
    let mut s = Session {
        peer: side(1, 2, DEVICE),
        device: side(2, 1, PEER),
        now: Instant::now(),
        recorded: Vec::new(),
        sealed: HashSet::new(),
    };
    s.peer_sends(b"hello");
    let mut input = data.iter().copied();
    while let Some(op) = input.next() {
        let arg = input.next().unwrap_or(0);
        match op % 6 {
            0 => {
                let payload: Vec<u8> = input.by_ref().take(usize::from(arg % 64)).collect();
                s.peer_sends(&payload);
            }
            1 | 2 if !s.recorded.is_empty() => {
                let mut d = s.recorded[usize::from(arg) % s.recorded.len()].clone();
                if op % 6 == 1 {
                    // Flip a byte the input names, to a value it names.
                    let (at, to) = (input.next().unwrap_or(0), input.next().unwrap_or(0));
                    let i = usize::from(at) % d.len().max(1);
                    if let Some(b) = d.get_mut(i) {
                        *b ^= to.max(1);
                    }
                }
                s.attack(&d);
            }
            3 => {
                let raw: Vec<u8> = input.by_ref().take(usize::from(arg)).collect();
                s.attack(&raw);
            }
            4 => {
                s.now += Duration::from_secs(u64::from(arg));
                let mut io = Captured::default();
                s.device.tick(s.now, &mut io);
                let mut from_peer = Captured::default();
                s.peer.tick(s.now, &mut from_peer);
                let mut answers = s.to_peer(&io.sent);
                answers.extend(from_peer.sent);
                s.settle(answers);
            }
            _ => {
                let mut io = Captured::default();
                s.device
                    .handle_tun_packet(&ipv4(2, 1, &[arg]), s.now, &mut io);
                let answers = s.to_peer(&io.sent);
                s.settle(answers);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scripted_session_with_replays_flips_and_time_runs_clean() {
        // Send, replay, flip, junk, an hour later, answer, send again.
        wg_session(&[
            0, 5, 1, 2, 3, 0, 7, 2, 0, 3, 40, 9, 9, 9, 4, 200, 4, 200, 5, 1, 0, 3, 1, 2, 0,
        ]);
    }
}
