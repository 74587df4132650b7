//! The server side of the cross-platform UAPI's `set=1` request, parsed completely
//! before anything is applied: a request with one bad line changes nothing. The text
//! carries keys, so errors name the key of the bad line, never its value.

use std::net::SocketAddr;

use ipnet::IpNet;

/// `errno` values the UAPI answers with: Linux numbers, negated as wireguard-go
/// writes them (wg(8) negates the answer again into its `errno`, so a positive one
/// prints as "Unknown error -22").
pub mod errno {
    /// A bad key or value.
    pub const EINVAL: i32 = -22;
    /// The listen port is taken.
    pub const EADDRINUSE: i32 = -98;
    /// A line that is not `key=value`, or an unknown command.
    pub const EPROTO: i32 = -71;
    /// An I/O failure inside the device (binding the socket, setting the mark).
    pub const EIO: i32 = -5;
}

/// Why a `set=1` request was refused. The value of the bad line is left out: it may be a key.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UapiError {
    /// A line is not `key=value`.
    #[error("line {line} is not key=value")]
    Malformed {
        /// 1-based line number within the request body.
        line: usize,
    },
    /// A key that does not belong where it is, or a value that does not parse.
    #[error("invalid value for {key}")]
    Invalid {
        /// The key of the bad line.
        key: String,
    },
}

impl UapiError {
    /// The `errno` the UAPI answers with.
    pub fn errno(&self) -> i32 {
        match self {
            Self::Malformed { .. } => errno::EPROTO,
            Self::Invalid { .. } => errno::EINVAL,
        }
    }
}

/// A 32-byte key as sent on the UAPI (lower-case hex).
pub type Key = [u8; 32];

/// One parsed `set=1` request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SetRequest {
    /// `Some(None)` removes the private key (an all-zero key).
    pub private_key: Option<Option<Key>>,
    /// A new listen port (0: any free port).
    pub listen_port: Option<u16>,
    /// A new socket mark (0: none).
    pub fwmark: Option<u32>,
    /// Remove every peer before applying `peers`.
    pub replace_peers: bool,
    /// The peer sections, in order.
    pub peers: Vec<PeerChange>,
}

/// One `public_key=` section of a `set=1` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerChange {
    /// The peer's public key.
    pub public_key: Key,
    /// Remove the peer.
    pub remove: bool,
    /// Change the peer only if it exists; never create it.
    pub update_only: bool,
    /// `Some(None)` removes the preshared key (an all-zero key).
    pub preshared_key: Option<Option<Key>>,
    /// A new endpoint.
    pub endpoint: Option<SocketAddr>,
    /// A new persistent keepalive interval in seconds (0: off).
    pub persistent_keepalive: Option<u16>,
    /// Remove the peer's allowed IPs before applying `allowed_ips`.
    pub replace_allowed_ips: bool,
    /// Allowed IPs to add or remove, in order.
    pub allowed_ips: Vec<AllowedIpChange>,
}

/// One `allowed_ip=` line: `PREFIX` adds it, `-PREFIX` takes it from the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllowedIpChange {
    /// Route the prefix to the peer.
    Add(IpNet),
    /// Remove the prefix if it is the peer's (as the kernel and wireguard-go do).
    Remove(IpNet),
}

impl PeerChange {
    fn new(public_key: Key) -> Self {
        Self {
            public_key,
            remove: false,
            update_only: false,
            preshared_key: None,
            endpoint: None,
            persistent_keepalive: None,
            replace_allowed_ips: false,
            allowed_ips: Vec::new(),
        }
    }
}

fn parse_key(key: &str, value: &str) -> Result<Key, UapiError> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(value, &mut out).map_err(|_| invalid(key))?;
    Ok(out)
}

/// A key where all zeroes means "none".
fn parse_optional_key(key: &str, value: &str) -> Result<Option<Key>, UapiError> {
    let k = parse_key(key, value)?;
    Ok((k != [0u8; 32]).then_some(k))
}

fn invalid(key: &str) -> UapiError {
    UapiError::Invalid {
        key: key.to_owned(),
    }
}

/// A flag: only `true` is valid, as in wireguard-go (`false` is refused, not ignored).
fn parse_true(key: &str, value: &str) -> Result<bool, UapiError> {
    match value {
        "true" => Ok(true),
        _ => Err(invalid(key)),
    }
}

fn parse_num<T: std::str::FromStr>(key: &str, value: &str) -> Result<T, UapiError> {
    value.parse().map_err(|_| invalid(key))
}

/// Parses the body of a `set=1` request (the lines after `set=1`, without the blank
/// line that ends it).
pub fn parse_set(body: &str) -> Result<SetRequest, UapiError> {
    let mut req = SetRequest::default();
    for (n, line) in body.lines().enumerate() {
        if line.is_empty() {
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .ok_or(UapiError::Malformed { line: n + 1 })?;
        if key == "public_key" {
            req.peers.push(PeerChange::new(parse_key(key, value)?));
            continue;
        }
        match req.peers.last_mut() {
            None => apply_device_line(&mut req, key, value)?,
            Some(peer) => apply_peer_line(peer, key, value)?,
        }
    }
    Ok(req)
}

fn apply_device_line(req: &mut SetRequest, key: &str, value: &str) -> Result<(), UapiError> {
    match key {
        "private_key" => req.private_key = Some(parse_optional_key(key, value)?),
        "listen_port" => req.listen_port = Some(parse_num(key, value)?),
        // `wg set IF fwmark off` sends an empty value.
        "fwmark" if value.is_empty() => req.fwmark = Some(0),
        "fwmark" => req.fwmark = Some(parse_num(key, value)?),
        "replace_peers" => req.replace_peers = parse_true(key, value)?,
        _ => return Err(invalid(key)),
    }
    Ok(())
}

fn apply_peer_line(peer: &mut PeerChange, key: &str, value: &str) -> Result<(), UapiError> {
    match key {
        "remove" => peer.remove = parse_true(key, value)?,
        "update_only" => peer.update_only = parse_true(key, value)?,
        "preshared_key" => peer.preshared_key = Some(parse_optional_key(key, value)?),
        "endpoint" => peer.endpoint = Some(parse_num(key, value)?),
        "persistent_keepalive_interval" => {
            peer.persistent_keepalive = Some(parse_num(key, value)?);
        }
        "replace_allowed_ips" => peer.replace_allowed_ips = parse_true(key, value)?,
        "allowed_ip" => peer.allowed_ips.push(match value.strip_prefix('-') {
            Some(net) => AllowedIpChange::Remove(parse_num(key, net)?),
            None => AllowedIpChange::Add(parse_num(key, value)?),
        }),
        "protocol_version" if value == "1" => {}
        _ => return Err(invalid(key)),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "0101010101010101010101010101010101010101010101010101010101010101";
    const B: &str = "0202020202020202020202020202020202020202020202020202020202020202";
    const ZERO: &str = "0000000000000000000000000000000000000000000000000000000000000000";

    #[test]
    fn a_full_request_parses_in_order() {
        let body = format!(
            "private_key={A}\nlisten_port=51820\nfwmark=32\nreplace_peers=true\n\
             public_key={B}\npreshared_key={ZERO}\nendpoint=[fd00::1]:51821\n\
             persistent_keepalive_interval=25\nreplace_allowed_ips=true\n\
             allowed_ip=10.0.0.2/32\nallowed_ip=fd00::2/128\nprotocol_version=1\n\
             public_key={A}\nremove=true\n"
        );
        let req = parse_set(&body).unwrap();
        assert_eq!(req.private_key, Some(Some([1; 32])));
        assert_eq!(req.listen_port, Some(51820));
        assert_eq!(req.fwmark, Some(32));
        assert!(req.replace_peers);
        assert_eq!(req.peers.len(), 2);
        let p = &req.peers[0];
        assert_eq!(p.public_key, [2; 32]);
        assert_eq!(p.preshared_key, Some(None));
        assert_eq!(p.endpoint, Some("[fd00::1]:51821".parse().unwrap()));
        assert_eq!(p.persistent_keepalive, Some(25));
        assert!(p.replace_allowed_ips);
        assert_eq!(p.allowed_ips.len(), 2);
        assert!(req.peers[1].remove);
    }

    #[test]
    fn bad_lines_are_refused_with_their_errno_and_without_their_value() {
        let cases = [
            (format!("private_key={}", &A[1..]), errno::EINVAL),
            ("listen_port=65536".to_owned(), errno::EINVAL),
            ("bogus=1".to_owned(), errno::EINVAL),
            ("no equals sign".to_owned(), errno::EPROTO),
            (format!("public_key={B}\nendpoint=nowhere"), errno::EINVAL),
            (
                format!("public_key={B}\nallowed_ip=10.0.0.0/33"),
                errno::EINVAL,
            ),
            (format!("public_key={B}\nlisten_port=1"), errno::EINVAL),
            (format!("public_key={B}\nprotocol_version=2"), errno::EINVAL),
            (format!("public_key={B}\nremove=yes"), errno::EINVAL),
        ];
        for (body, want) in cases {
            let err = parse_set(&body).unwrap_err();
            assert_eq!(err.errno(), want, "{body}");
            assert!(!err.to_string().contains(&A[1..]), "the error shows no key");
        }
    }

    /// wg(8) negates the number it reads into `errno` (`errno = -ret`), so the
    /// answer carries it negated, as wireguard-go writes it; a positive one prints
    /// "Unknown error -22" instead of "Invalid argument".
    #[test]
    fn errors_answer_with_the_negated_errno_as_wireguard_go_does() {
        let invalid = parse_set("bogus=1").unwrap_err();
        assert_eq!(invalid.errno(), -22);
        let malformed = parse_set("no equals sign").unwrap_err();
        assert_eq!(malformed.errno(), -71);
        assert_eq!((errno::EADDRINUSE, errno::EIO), (-98, -5));
    }

    /// As in wireguard-go: `true` is the only value of a flag; `false` (or anything
    /// else) is refused, so the request changes nothing.
    #[test]
    fn flags_take_only_true() {
        for key in ["remove", "update_only", "replace_allowed_ips"] {
            for value in ["false", "1", ""] {
                let body = format!("public_key={B}\n{key}={value}\n");
                let err = parse_set(&body).unwrap_err();
                assert_eq!(err.errno(), errno::EINVAL, "{key}={value}");
            }
        }
        for value in ["false", "TRUE"] {
            assert!(parse_set(&format!("replace_peers={value}\n")).is_err());
        }
    }

    mod applied {
        use boringtun::x25519::{PublicKey, StaticSecret};

        use super::*;
        use crate::userspace_wireguard::core::DeviceCore;

        fn public(secret: u8) -> String {
            hex::encode(PublicKey::from(&StaticSecret::from([secret; 32])).as_bytes())
        }

        fn device(body: &str) -> DeviceCore {
            let core = DeviceCore::default();
            core.apply_set(parse_set(body).unwrap());
            core
        }

        fn set(core: &DeviceCore, body: &str) {
            core.apply_set(parse_set(body).unwrap());
        }

        fn allowed_ips(core: &DeviceCore) -> Vec<String> {
            let get = core.render_get();
            get.lines()
                .filter_map(|l| l.strip_prefix("allowed_ip="))
                .map(str::to_owned)
                .collect()
        }

        /// `allowed_ip=-PREFIX` (wg(8) `allowed-ips -10.0.0.0/24`, newer kernels and
        /// wireguard-go) takes that one prefix from the peer, and only if the peer
        /// has it; lines apply in order.
        #[test]
        fn a_minus_prefix_removes_one_allowed_ip_of_that_peer() {
            let core = device(&format!(
                "public_key={B}\nallowed_ip=10.0.0.0/24\nallowed_ip=10.0.1.0/24\n\
                 allowed_ip=fd00::/64\npublic_key={A}\nallowed_ip=10.9.0.0/16\n"
            ));
            set(
                &core,
                &format!(
                    "public_key={B}\nallowed_ip=-10.0.0.7/24\nallowed_ip=-fd00::/64\n\
                     allowed_ip=-10.9.0.0/16\nallowed_ip=10.0.2.0/24\nallowed_ip=-10.0.2.0/24\n"
                ),
            );
            let mut ips = allowed_ips(&core);
            ips.sort();
            // A's prefix is not B's to remove.
            assert_eq!(ips, vec!["10.0.1.0/24", "10.9.0.0/16"]);
            assert!(parse_set(&format!("public_key={B}\nallowed_ip=-10.0.0.0/33\n")).is_err());
            assert!(parse_set(&format!("public_key={B}\nallowed_ip=--10.0.0.0/8\n")).is_err());
        }

        /// As the kernel does: a peer with the device's own public key is ignored
        /// without an error, and a new private key whose public key is a peer's
        /// removes that peer.
        #[test]
        fn the_devices_own_public_key_is_never_a_peer() {
            let me = "01".repeat(32);
            let core = device(&format!(
                "private_key={me}\npublic_key={}\nallowed_ip=10.0.0.1/32\n\
                 public_key={}\nallowed_ip=10.0.0.3/32\n",
                public(1),
                public(3)
            ));
            let get = core.render_get();
            assert!(!get.contains(&public(1)), "{get}");
            assert_eq!(allowed_ips(&core), vec!["10.0.0.3/32"]);
            set(&core, &format!("private_key={}\n", "03".repeat(32)));
            assert_eq!(core.peer_count(), 0, "{}", core.render_get());
            assert!(allowed_ips(&core).is_empty());
        }
    }
}
