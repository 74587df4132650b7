//! The WireGuard cross-platform UAPI text protocol (`get=1` / `set=1`), pure
//! formatting and parsing. The text carries keys: it is never logged.
//!
//! We speak it directly instead of through `wireguard-control`'s userspace module
//! because that module hard-codes the socket directory and, when the socket is
//! missing, starts a *daemonized* wireguard-go on its own, which would escape
//! supervision (a dead supervised process must be restarted by us, not replaced by an
//! orphan). Its update model (per-peer builders with replace-allowed-IPs) would allow
//! the same minimal diff.

use std::{
    fmt::Write as _,
    net::SocketAddr,
    time::{Duration, SystemTime},
};

use ipnet::IpNet;

use super::{DeviceDrops, DevicePeer, DeviceState, PresharedKey, PrivateKey, PublicKey, WgUpdate};

fn hex32(field: &str, v: &str) -> Result<[u8; 32], String> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(v, &mut out).map_err(|_| format!("bad {field}"))?;
    Ok(out)
}

fn endpoint_text(e: SocketAddr) -> String {
    // SocketAddr's Display already brackets IPv6: [addr]:port.
    e.to_string()
}

/// The `set=1` request for `up`, ending with the blank line. The listen port comes
/// first: it is the one setting the device may refuse (port in use), and the device
/// stops at the first error, so a refused port leaves everything else unchanged.
#[must_use]
pub fn format_set(up: &WgUpdate) -> String {
    let mut s = String::from("set=1\n");
    if let Some(p) = up.listen_port {
        let _ = writeln!(s, "listen_port={p}");
    }
    if let Some(m) = up.fwmark {
        let _ = writeln!(s, "fwmark={m}");
    }
    if let Some(k) = &up.private_key {
        let _ = writeln!(s, "private_key={}", hex::encode(k.as_bytes()));
    }
    for p in &up.peers {
        let _ = writeln!(s, "public_key={}", hex::encode(p.public_key.as_bytes()));
        if p.remove {
            s.push_str("remove=true\n");
            continue;
        }
        if let Some(psk) = &p.preshared_key {
            let bytes = psk.as_ref().map_or([0; 32], |k| *k.as_bytes());
            let _ = writeln!(s, "preshared_key={}", hex::encode(bytes));
        }
        if let Some(e) = p.endpoint {
            let _ = writeln!(s, "endpoint={}", endpoint_text(e));
        }
        if let Some(k) = p.persistent_keepalive {
            let _ = writeln!(s, "persistent_keepalive_interval={k}");
        }
        if let Some(ips) = &p.allowed_ips {
            s.push_str("replace_allowed_ips=true\n");
            for ip in ips {
                let _ = writeln!(s, "allowed_ip={ip}");
            }
        }
    }
    s.push('\n');
    s
}

/// Parses the answer to `get=1` (up to and including `errno=`).
///
/// # Errors
/// A line that does not parse (message names the key, never a value), or a non-zero
/// errno (as `Err` with the number).
pub fn parse_get(text: &str) -> Result<DeviceState, GetError> {
    let mut d = DeviceState::default();
    let mut peer: Option<DevicePeer> = None;
    let mut hs_sec: u64 = 0;
    let mut hs_nsec: u32 = 0;
    let finish = |peer: Option<DevicePeer>, sec: u64, nsec: u32, d: &mut DeviceState| {
        if let Some(mut p) = peer {
            if sec != 0 || nsec != 0 {
                // Checked: a bogus time in the answer is a parse error, not a panic.
                let t = SystemTime::UNIX_EPOCH
                    .checked_add(Duration::from_secs(sec))
                    .and_then(|t| t.checked_add(Duration::from_nanos(u64::from(nsec))))
                    .ok_or_else(|| GetError::Parse("bad last_handshake_time_sec".into()))?;
                p.last_handshake = Some(t);
            }
            d.peers.push(p);
        }
        Ok(())
    };
    for line in text.lines() {
        if line.is_empty() {
            break;
        }
        let (k, v) = line
            .split_once('=')
            .ok_or_else(|| GetError::Parse("line without '='".into()))?;
        let bad = |what: &str| GetError::Parse(format!("bad {what}"));
        let cur = |peer: &mut Option<DevicePeer>| -> Result<(), GetError> {
            if peer.is_none() {
                return Err(GetError::Parse(format!("{k} before public_key")));
            }
            Ok(())
        };
        match k {
            "private_key" => {
                let b = hex32(k, v).map_err(GetError::Parse)?;
                d.private_key = (b != [0; 32]).then(|| PrivateKey::from_bytes(b));
            }
            "listen_port" => d.listen_port = v.parse().map_err(|_| bad(k))?,
            "fwmark" => d.fwmark = v.parse().map_err(|_| bad(k))?,
            "public_key" => {
                finish(peer.take(), hs_sec, hs_nsec, &mut d)?;
                hs_sec = 0;
                hs_nsec = 0;
                peer = Some(DevicePeer::new(PublicKey::from_bytes(
                    hex32(k, v).map_err(GetError::Parse)?,
                )));
            }
            "preshared_key" => {
                cur(&mut peer)?;
                let b = hex32(k, v).map_err(GetError::Parse)?;
                if let Some(p) = peer.as_mut() {
                    p.preshared_key = (b != [0; 32]).then(|| PresharedKey::from_bytes(b));
                }
            }
            "endpoint" => {
                cur(&mut peer)?;
                let e: SocketAddr = v.parse().map_err(|_| bad(k))?;
                if let Some(p) = peer.as_mut() {
                    p.endpoint = Some(e);
                }
            }
            "persistent_keepalive_interval" => {
                cur(&mut peer)?;
                let n = v.parse().map_err(|_| bad(k))?;
                if let Some(p) = peer.as_mut() {
                    p.persistent_keepalive = n;
                }
            }
            "allowed_ip" => {
                cur(&mut peer)?;
                let a: IpNet = v.parse().map_err(|_| bad(k))?;
                if let Some(p) = peer.as_mut() {
                    p.allowed_ips.push(a);
                }
            }
            "rx_bytes" | "tx_bytes" => {
                cur(&mut peer)?;
                let n = v.parse().map_err(|_| bad(k))?;
                if let Some(p) = peer.as_mut() {
                    if k == "rx_bytes" {
                        p.rx_bytes = n;
                    } else {
                        p.tx_bytes = n;
                    }
                }
            }
            "last_handshake_time_sec" => hs_sec = v.parse().map_err(|_| bad(k))?,
            "last_handshake_time_nsec" => hs_nsec = v.parse().map_err(|_| bad(k))?,
            "errno" => {
                let n: i32 = v.parse().map_err(|_| bad(k))?;
                if n != 0 {
                    return Err(GetError::Errno(n));
                }
            }
            // protocol_version and anything newer: not needed.
            _ => {}
        }
    }
    finish(peer, hs_sec, hs_nsec, &mut d)?;
    Ok(d)
}

/// How much of an answer is read at a time.
const READ_CHUNK: usize = 64 * 1024;

/// Reads one answer from `r`: everything before the blank line that ends it, or up
/// to the end of the stream. Read in large chunks into one buffer rather than line by
/// line: a `get` of 10,000 peers is about 100,000 lines and several megabytes, read
/// while the manager's round waits.
///
/// # Errors
/// A read error, or an answer that is not UTF-8.
pub fn read_answer(r: &mut impl std::io::Read) -> std::io::Result<String> {
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let len = buf.len();
        buf.resize(len + READ_CHUNK, 0);
        let n = loop {
            match r.read(&mut buf[len..]) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                other => break other,
            }
        }?;
        buf.truncate(len + n);
        if n == 0 {
            // The end of the stream: what came is the answer.
            break;
        }
        // Only the end needs looking at: no blank line comes before the last one. An
        // empty answer is the blank line alone.
        if buf.ends_with(b"\n\n") || buf == b"\n" {
            buf.pop();
            break;
        }
    }
    String::from_utf8(buf).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Why a `get` answer was not usable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GetError {
    /// Non-zero errno from the device.
    Errno(i32),
    /// Malformed line (names the key only).
    Parse(String),
}

/// Parses the `errno=N` answer to a `set`.
///
/// # Errors
/// No errno line.
pub fn parse_errno(text: &str) -> Result<i32, String> {
    text.lines()
        .find_map(|l| l.strip_prefix("errno="))
        .ok_or_else(|| "no errno in answer".to_owned())?
        .trim()
        .parse()
        .map_err(|_| "bad errno".to_owned())
}

/// Parses the answer to `wirespan wireguard`'s `stats=1` extension (its drop
/// counters). Unknown keys are skipped, so a later device may add counters.
///
/// # Errors
/// A non-zero errno (wireguard-go answers `stats=1` with one), no errno line, or a
/// counter that is not a number.
pub fn parse_stats(text: &str) -> Result<DeviceDrops, String> {
    match parse_errno(text)? {
        0 => {}
        errno => return Err(format!("stats refused: errno {errno}")),
    }
    let mut drops = DeviceDrops::default();
    for (key, value) in text.lines().filter_map(|l| l.split_once('=')) {
        let field = match key {
            "invalid_datagrams" => &mut drops.invalid_datagrams,
            "spoofed_packets" => &mut drops.spoofed_packets,
            "unroutable_packets" => &mut drops.unroutable_packets,
            "replayed_initiations" => &mut drops.replayed_initiations,
            "rate_limited_handshakes" => &mut drops.rate_limited_handshakes,
            _ => continue,
        };
        *field = value.parse().map_err(|_| format!("bad {key}"))?;
    }
    Ok(drops)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_stats_answer_and_refuses_an_errno() {
        let answer =
            "invalid_datagrams=4\nspoofed_packets=1\nunroutable_packets=7\ncookie_replies=2\n\
                      replayed_initiations=3\nrate_limited_handshakes=5\nerrno=0\n";
        assert_eq!(
            parse_stats(answer).unwrap(),
            DeviceDrops {
                invalid_datagrams: 4,
                spoofed_packets: 1,
                unroutable_packets: 7,
                replayed_initiations: 3,
                rate_limited_handshakes: 5,
            }
        );
        // An older device without the handshake counters reads as zeros.
        let old = "invalid_datagrams=1\nspoofed_packets=0\nunroutable_packets=0\nerrno=0\n";
        assert_eq!(parse_stats(old).unwrap().replayed_initiations, 0);
        assert!(parse_stats("errno=22\n").is_err());
        assert!(parse_stats("invalid_datagrams=x\nerrno=0\n").is_err());
        assert!(parse_stats("invalid_datagrams=1\n").is_err());
    }
    use crate::wireguard::PeerUpdate;

    #[test]
    fn set_puts_port_first_and_replaces_allowed_ips() {
        let up = WgUpdate {
            listen_port: Some(51820),
            fwmark: Some(32),
            private_key: Some(PrivateKey::from_bytes([1; 32])),
            peers: vec![
                PeerUpdate {
                    public_key: PublicKey::from_bytes([2; 32]),
                    remove: true,
                    preshared_key: None,
                    persistent_keepalive: None,
                    endpoint: None,
                    allowed_ips: None,
                },
                PeerUpdate {
                    public_key: PublicKey::from_bytes([3; 32]),
                    remove: false,
                    preshared_key: Some(None),
                    persistent_keepalive: Some(25),
                    endpoint: Some("[fd00::1]:51820".parse().unwrap()),
                    allowed_ips: Some(vec!["10.0.0.0/24".parse().unwrap()]),
                },
            ],
        };
        let s = format_set(&up);
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "set=1");
        assert_eq!(lines[1], "listen_port=51820");
        assert_eq!(lines[2], "fwmark=32");
        assert!(lines[3].starts_with("private_key=0101"));
        assert_eq!(lines[5], "remove=true");
        assert_eq!(lines[7], format!("preshared_key={}", "00".repeat(32)));
        assert_eq!(lines[8], "endpoint=[fd00::1]:51820");
        assert_eq!(lines[9], "persistent_keepalive_interval=25");
        assert_eq!(lines[10], "replace_allowed_ips=true");
        assert_eq!(lines[11], "allowed_ip=10.0.0.0/24");
        assert!(s.ends_with("\n\n"));
    }

    #[test]
    fn parses_get_answer() {
        let text = format!(
            "private_key={}\nlisten_port=51820\nfwmark=32\npublic_key={}\npreshared_key={}\nprotocol_version=1\nendpoint=192.0.2.1:51820\nlast_handshake_time_sec=1700000000\nlast_handshake_time_nsec=5\ntx_bytes=10\nrx_bytes=20\npersistent_keepalive_interval=25\nallowed_ip=10.0.0.1/32\nallowed_ip=fd00::/64\npublic_key={}\npreshared_key={}\nlast_handshake_time_sec=0\nlast_handshake_time_nsec=0\nerrno=0\n\n",
            "11".repeat(32),
            "22".repeat(32),
            "33".repeat(32),
            "44".repeat(32),
            "00".repeat(32),
        );
        let d = parse_get(&text).unwrap();
        assert_eq!(d.listen_port, 51820);
        assert_eq!(d.fwmark, 32);
        assert_eq!(d.peers.len(), 2);
        let p = &d.peers[0];
        assert_eq!(p.endpoint, Some("192.0.2.1:51820".parse().unwrap()));
        assert_eq!(
            (p.rx_bytes, p.tx_bytes, p.persistent_keepalive),
            (20, 10, 25)
        );
        assert_eq!(p.allowed_ips.len(), 2);
        assert_eq!(
            p.last_handshake,
            Some(SystemTime::UNIX_EPOCH + Duration::new(1_700_000_000, 5))
        );
        assert!(d.peers[1].preshared_key.is_none() && d.peers[1].last_handshake.is_none());
        assert_eq!(parse_get("errno=2\n\n"), Err(GetError::Errno(2)));
        assert!(matches!(
            parse_get("allowed_ip=10.0.0.0/8\n\n"),
            Err(GetError::Parse(_))
        ));
    }

    /// Fuzzing (`uapi_parse`): a handshake time beyond what `SystemTime` holds, or
    /// nanoseconds that carry it over, panicked in `Duration::new` / `SystemTime + _`.
    #[test]
    fn handshake_time_out_of_range_is_a_parse_error_not_a_panic() {
        let key = "11".repeat(32);
        for (sec, nsec) in [
            (u64::MAX, 0u32),
            (u64::MAX, u32::MAX),
            (u64::MAX / 2, 5),
            (1, u32::MAX),
        ] {
            let text = format!(
                "public_key={key}\nlast_handshake_time_sec={sec}\nlast_handshake_time_nsec={nsec}\nerrno=0\n\n"
            );
            let r = parse_get(&text);
            assert!(
                matches!(r, Err(GetError::Parse(_))) || r.is_ok(),
                "{sec} {nsec}: {r:?}"
            );
        }
        assert_eq!(
            parse_get(&format!(
                "public_key={key}\nlast_handshake_time_sec={}\nerrno=0\n\n",
                u64::MAX
            )),
            Err(GetError::Parse("bad last_handshake_time_sec".into()))
        );
    }

    /// A reader that hands out at most `step` bytes a read, as a socket may.
    struct Trickle<'a> {
        data: &'a [u8],
        step: usize,
    }

    impl std::io::Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.step.min(buf.len()).min(self.data.len());
            buf[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }

    #[test]
    fn an_answer_ends_at_its_blank_line_however_it_is_split() {
        let answer = "listen_port=51820\npublic_key=ab\nerrno=0\n";
        let sent = format!("{answer}\n");
        for step in [1, 2, 7, 1 << 20] {
            let mut r = Trickle {
                data: sent.as_bytes(),
                step,
            };
            assert_eq!(read_answer(&mut r).unwrap(), answer, "step {step}");
        }
        // The end of the stream without the blank line, and the empty answer.
        let mut r = Trickle {
            data: b"errno=0\n",
            step: 3,
        };
        assert_eq!(read_answer(&mut r).unwrap(), "errno=0\n");
        let mut r = Trickle {
            data: b"\n",
            step: 1,
        };
        assert_eq!(read_answer(&mut r).unwrap(), "");
        let mut r = Trickle {
            data: b"\xff\n\n",
            step: 8,
        };
        assert!(read_answer(&mut r).is_err(), "not UTF-8");
    }
}
