//! The userspace WireGuard device's untrusted input (`wirespan wireguard`): UAPI `set=1`
//! bodies (`uapi_request::parse_set`, then applied), and datagrams and TUN packets fed
//! to a configured `core::DeviceCore`, and TUN reads (a `virtio_net_hdr` and a packet)
//! cut by `offload::split`, and a batch of decrypted packets coalesced for the TUN
//! (`coalesce::Coalescer`). Nothing may panic; a refused request must leave `get=1`
//! unchanged; split packets are whole and no longer than the read; the coalesced
//! writes, split again, are as many packets of the same lengths as the batch.
#![no_main]

use std::{
    net::SocketAddr,
    time::{Duration, Instant, SystemTime},
};

use libfuzzer_sys::fuzz_target;
use wirespan_dataplane::userspace_wireguard::{
    coalesce::Coalescer,
    core::{DeviceCore, Io},
    offload::{self, VnetHdr, VNET_HDR_LEN},
    uapi_request::parse_set,
};

struct Discard;

impl Io for Discard {
    fn send(&mut self, _: SocketAddr, _: &[u8]) {}
    fn write_tun(&mut self, _: &[u8]) {}
}

const BASE: &str = "private_key=0101010101010101010101010101010101010101010101010101010101010101\n\
public_key=8f40c5adb68f25624ae5b214ea767a6ec94d829d3d7b5e1ad1ba6f3e2138285f\n\
endpoint=192.0.2.2:51820\nallowed_ip=10.0.0.0/8\nallowed_ip=fd00::/8\n";

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let core = DeviceCore::default();
    core.apply_set(parse_set(BASE).expect("the base config parses"));
    let now = Instant::now();
    match selector % 5 {
        0 => {
            let before = core.render_get();
            match parse_set(&String::from_utf8_lossy(rest)) {
                Ok(req) => core.apply_set(req),
                Err(_) => assert_eq!(core.render_get(), before),
            }
        }
        1 => {
            let from: SocketAddr = "192.0.2.2:51820".parse().unwrap();
            for chunk in rest.split(|b| *b == 0xff) {
                core.handle_datagram(from, chunk, now, SystemTime::now(), &mut Discard);
            }
        }
        3 => {
            let Some(hdr) = VnetHdr::parse(rest) else {
                return;
            };
            let packet = &rest[VNET_HDR_LEN..];
            let (mut out, mut ranges) = (Vec::new(), Vec::new());
            if offload::split(&hdr, packet, &mut out, &mut ranges).is_ok() {
                for r in &ranges {
                    assert!(r.end <= out.len() && r.len() <= packet.len().max(1));
                }
            } else {
                assert!(
                    out.is_empty() && ranges.is_empty(),
                    "a refused read adds nothing"
                );
            }
        }
        4 => {
            let packets: Vec<&[u8]> = rest.split(|b| *b == 0xff).collect();
            let mut coalescer = Coalescer::default();
            coalescer.coalesce(&packets, selector & 0x80 != 0);
            let (mut out, mut ranges) = (Vec::new(), Vec::new());
            for write in coalescer.writes() {
                let hdr = VnetHdr::parse(write).expect("a write starts with its header");
                offload::split(&hdr, &write[VNET_HDR_LEN..], &mut out, &mut ranges)
                    .expect("a write splits");
            }
            let mut lens: Vec<usize> = ranges.iter().map(|r| r.len()).collect();
            let mut want: Vec<usize> = packets.iter().map(|p| p.len()).collect();
            lens.sort_unstable();
            want.sort_unstable();
            assert_eq!(lens, want, "the batch's packets, one for one");
        }
        _ => {
            for (i, chunk) in rest.split(|b| *b == 0xff).enumerate() {
                let t = now + Duration::from_secs(i as u64 * 7);
                core.handle_tun_packet(chunk, t, &mut Discard);
                core.tick(t, &mut Discard);
            }
        }
    }
});
