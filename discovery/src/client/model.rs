//! Typed plaintext of the encrypted blobs (docs/discovery-protocol.md §4) and the conversion
//! to and from the `sidero.discovery.client` protobufs.
//!
//! Encoders write 4 bytes for IPv4 (never IPv4-mapped IPv6) and 16 for IPv6.
//! Decoders ignore unknown fields (prost does) and skip only the single list item
//! whose IP has a length other than 4 or 16 bytes.

use std::{
    fmt,
    net::{IpAddr, Ipv6Addr, SocketAddr},
};

use ipnet::IpNet;
use prost::Message as _;

use crate::{proto::client as pb, text};

/// Role of a node, as carried in `machine_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub enum MachineType {
    /// `controlplane`.
    ControlPlane,
    /// `worker`.
    Worker,
    /// `init` (legacy Talos bootstrap node).
    Init,
    /// `unknown`, and any string this version does not know.
    #[default]
    Unknown,
}

impl MachineType {
    /// The wire string.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ControlPlane => "controlplane",
            Self::Worker => "worker",
            Self::Init => "init",
            Self::Unknown => "unknown",
        }
    }

    /// Parses the wire string; anything unrecognised is [`MachineType::Unknown`].
    #[must_use]
    pub fn from_wire(s: &str) -> Self {
        match s {
            "controlplane" => Self::ControlPlane,
            "worker" => Self::Worker,
            "init" => Self::Init,
            _ => Self::Unknown,
        }
    }
}

impl fmt::Display for MachineType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The KubeSpan part of an affiliate.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KubeSpanInfo {
    /// WireGuard public key, standard base64 text.
    pub public_key: String,
    /// The node's KubeSpan ULA.
    pub address: Ipv6Addr,
    /// Extra networks routed to the node (pod CIDRs), as advertised (not masked).
    pub additional_addresses: Vec<IpNet>,
    /// Networks peers must not route to the node, as advertised (not masked).
    /// Field [`KUBESPAN_EXCLUDE_ADVERTISED_ADDRESSES_FIELD`](super::presumed::KUBESPAN_EXCLUDE_ADVERTISED_ADDRESSES_FIELD)
    /// (a presumed number).
    pub exclude_advertised_networks: Vec<IpNet>,
}

/// Control-plane details of an affiliate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ControlPlaneInfo {
    /// Kubernetes API server port.
    pub api_server_port: u16,
}

/// Decrypted affiliate data: what one node tells the others about itself.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct AffiliateInfo {
    /// Node ID; equals the affiliate ID on the server.
    pub node_id: String,
    /// Node addresses.
    pub addresses: Vec<IpAddr>,
    /// Host name (FQDN).
    pub hostname: String,
    /// Kubernetes node name.
    pub nodename: String,
    /// Node role.
    pub machine_type: MachineType,
    /// Free-text OS description.
    pub operating_system: String,
    /// Present when the node runs KubeSpan.
    pub kubespan: Option<KubeSpanInfo>,
    /// Present on control-plane nodes.
    pub control_plane: Option<ControlPlaneInfo>,
    /// wirespan's extension ([`super::extension`]); absent: a Talos node.
    pub wirespan: Option<super::extension::WirespanInfo>,
}

/// A WireGuard endpoint; the scope ID of an IPv6 address is never sent.
pub type Endpoint = SocketAddr;

/// Why a decrypted payload could not be used. Never carries the payload.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not a valid protobuf of the expected message.
    #[error("invalid {message} protobuf: {reason}")]
    Protobuf {
        /// Message name.
        message: &'static str,
        /// prost's description.
        reason: String,
    },
    /// An IP field has a length other than 4 or 16.
    #[error("{field}: IP of {len} bytes (want 4 or 16)")]
    IpLength {
        /// Field name.
        field: &'static str,
        /// Actual length.
        len: usize,
    },
    /// Endpoint port above 65535.
    #[error("endpoint port {port} is above 65535")]
    Port {
        /// The decoded value.
        port: u32,
    },
}

fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip.to_canonical() {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

fn parse_ip(field: &'static str, bytes: &[u8]) -> Result<IpAddr, DecodeError> {
    match bytes.len() {
        4 => Ok(IpAddr::from(<[u8; 4]>::try_from(bytes).expect("len 4"))),
        16 => Ok(IpAddr::from(<[u8; 16]>::try_from(bytes).expect("len 16"))),
        len => Err(DecodeError::IpLength { field, len }),
    }
}

fn ip_prefix(net: &IpNet) -> pb::IpPrefix {
    pb::IpPrefix {
        ip: ip_bytes(net.addr()),
        bits: u32::from(net.prefix_len()),
    }
}

/// One received exclusion as Talos reads it: an IP of 4 or 16 bytes with its bits;
/// `Ok(None)` for an IP of another non-zero length (Talos skips that item);
/// `Err(())` for an empty IP or bits beyond the family, which make Talos's set builder
/// fail, so Talos configures no peer for the node at all.
fn exclusion(p: &pb::IpPrefix) -> Result<Option<IpNet>, ()> {
    let ip = match parse_ip("kubespan.exclude_advertised_addresses", &p.ip) {
        Ok(ip) => ip,
        Err(_) if p.ip.is_empty() => return Err(()),
        Err(_) => return Ok(None),
    };
    let bits = u8::try_from(p.bits).map_err(|_| ())?;
    IpNet::new(ip, bits).map(Some).map_err(|_| ())
}

/// `bytes` (an `Affiliate`) without the presumed field inside its `KubeSpan`
/// occurrences; `None` when the framing itself is broken.
fn without_presumed_field(bytes: &[u8]) -> Option<Vec<u8>> {
    use prost::encoding::{
        decode_key, decode_varint, encode_key, encode_varint, skip_field, DecodeContext, WireType,
    };
    const KUBESPAN: u32 = 7;
    let presumed =
        u32::try_from(super::presumed::KUBESPAN_EXCLUDE_ADVERTISED_ADDRESSES_FIELD).ok()?;
    // Copies every field of `buf` but `drop`; a `KUBESPAN` field is rewritten by `inner`.
    fn copy(
        mut buf: &[u8],
        drop: Option<u32>,
        inner: &dyn Fn(&[u8]) -> Option<Vec<u8>>,
    ) -> Option<Vec<u8>> {
        let mut out = Vec::with_capacity(buf.len());
        while !buf.is_empty() {
            let start = buf;
            let (tag, wire_type) = decode_key(&mut buf).ok()?;
            if drop.is_none() && tag == KUBESPAN && wire_type == WireType::LengthDelimited {
                let len = usize::try_from(decode_varint(&mut buf).ok()?).ok()?;
                let body = buf.get(..len)?;
                buf = &buf[len..];
                let body = inner(body)?;
                encode_key(tag, wire_type, &mut out);
                encode_varint(body.len() as u64, &mut out);
                out.extend_from_slice(&body);
                continue;
            }
            skip_field(wire_type, tag, &mut buf, DecodeContext::default()).ok()?;
            if drop != Some(tag) {
                out.extend_from_slice(&start[..start.len() - buf.len()]);
            }
        }
        Some(out)
    }
    copy(bytes, None, &|body| copy(body, Some(presumed), &|_| None))
}

fn protobuf_error(message: &'static str, e: &prost::DecodeError) -> DecodeError {
    DecodeError::Protobuf {
        message,
        reason: e.to_string(),
    }
}

/// Encodes an `Endpoint` protobuf (the plaintext of an endpoint blob).
#[must_use]
pub fn encode_endpoint(endpoint: &Endpoint) -> Vec<u8> {
    pb::Endpoint {
        ip: ip_bytes(endpoint.ip()),
        port: u32::from(endpoint.port()),
    }
    .encode_to_vec()
}

/// Decodes an `Endpoint` protobuf.
///
/// # Errors
/// [`DecodeError`] for a malformed protobuf, an IP that is not 4 or 16 bytes, or a
/// port above 65535.
pub fn decode_endpoint(bytes: &[u8]) -> Result<Endpoint, DecodeError> {
    let msg = pb::Endpoint::decode(bytes).map_err(|e| protobuf_error("Endpoint", &e))?;
    let ip = parse_ip("endpoint.ip", &msg.ip)?;
    let port = u16::try_from(msg.port).map_err(|_| DecodeError::Port { port: msg.port })?;
    Ok(SocketAddr::new(ip, port))
}

impl AffiliateInfo {
    /// Encodes the `Affiliate` protobuf (the plaintext of an affiliate blob).
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = pb::Affiliate {
            node_id: self.node_id.clone(),
            addresses: self.addresses.iter().map(|ip| ip_bytes(*ip)).collect(),
            hostname: self.hostname.clone(),
            nodename: self.nodename.clone(),
            machine_type: self.machine_type.as_str().to_owned(),
            operating_system: self.operating_system.clone(),
            kubespan: self.kubespan.as_ref().map(|k| pb::KubeSpan {
                public_key: k.public_key.clone(),
                address: k.address.octets().to_vec(),
                additional_addresses: k.additional_addresses.iter().map(ip_prefix).collect(),
                exclude_advertised_addresses: k
                    .exclude_advertised_networks
                    .iter()
                    .map(ip_prefix)
                    .collect(),
            }),
            control_plane: self.control_plane.map(|c| pb::ControlPlane {
                api_server_port: u32::from(c.api_server_port),
            }),
        }
        .encode_to_vec();
        if let Some(w) = &self.wirespan {
            super::extension::append(w, &mut bytes);
        }
        bytes
    }

    /// Decodes an `Affiliate` protobuf. The node ID, names and OS description are
    /// [sanitised](text::sanitize) (untrusted text). Items with a malformed IP (and prefixes
    /// longer than their family allows) are skipped one by one; a KubeSpan part
    /// whose address is not 16 bytes is dropped as a whole, since a peer cannot
    /// be configured without its ULA; a control-plane port above 65535 drops the
    /// control-plane part. Exclusions follow Talos exactly: an item whose IP has a
    /// length other than 0, 4 or 16 is skipped, but an empty IP or a prefix longer
    /// than its family drops the KubeSpan part (Talos then makes no peer of the node
    /// rather than route networks it asked to keep).
    ///
    /// # Errors
    /// [`DecodeError::Protobuf`] when the bytes are not an `Affiliate` message.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let msg = match pb::Affiliate::decode(bytes) {
            Ok(msg) => msg,
            // The exclusions' field number is a presumption: if a sender used it for
            // something else, the node must still decode, without exclusions.
            Err(e) => without_presumed_field(bytes)
                .and_then(|b| pb::Affiliate::decode(b.as_slice()).ok())
                .ok_or_else(|| protobuf_error("Affiliate", &e))?,
        };
        let kubespan = msg.kubespan.and_then(|k| {
            let address = <[u8; 16]>::try_from(k.address.as_slice())
                .ok()
                .map(Ipv6Addr::from)?;
            let exclude_advertised_networks = k
                .exclude_advertised_addresses
                .iter()
                .map(exclusion)
                .collect::<Result<Vec<_>, ()>>()
                .ok()?
                .into_iter()
                .flatten()
                .collect();
            Some(KubeSpanInfo {
                public_key: k.public_key,
                address,
                additional_addresses: k
                    .additional_addresses
                    .iter()
                    .filter_map(|p| {
                        let ip = parse_ip("kubespan.additional_addresses", &p.ip).ok()?;
                        IpNet::new(ip, u8::try_from(p.bits).ok()?).ok()
                    })
                    .collect(),
                exclude_advertised_networks,
            })
        });
        // Names are untrusted text: sanitised here, once, for every later use.
        // A node ID changed by this no longer equals its affiliate ID, so the record
        // is dropped where IDs are compared.
        Ok(Self {
            node_id: text::sanitize(&msg.node_id, text::MAX_TEXT_BYTES),
            addresses: msg
                .addresses
                .iter()
                .filter_map(|a| parse_ip("addresses", a).ok())
                .collect(),
            hostname: text::sanitize(&msg.hostname, text::MAX_NAME_BYTES),
            nodename: text::sanitize(&msg.nodename, text::MAX_NAME_BYTES),
            machine_type: MachineType::from_wire(&msg.machine_type),
            operating_system: text::sanitize(&msg.operating_system, text::MAX_TEXT_BYTES),
            kubespan,
            control_plane: msg.control_plane.and_then(|c| {
                Some(ControlPlaneInfo {
                    api_server_port: u16::try_from(c.api_server_port).ok()?,
                })
            }),
            wirespan: super::extension::find(bytes),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, SocketAddrV6};

    use super::*;

    fn sample() -> AffiliateInfo {
        AffiliateInfo {
            node_id: "node-a".into(),
            addresses: vec!["10.0.0.1".parse().unwrap(), "2001:db8::5".parse().unwrap()],
            hostname: "a.example".into(),
            nodename: "a".into(),
            machine_type: MachineType::ControlPlane,
            operating_system: "wirespan (v0.1.0)".into(),
            kubespan: Some(KubeSpanInfo {
                public_key: "PUBKEY=".into(),
                address: "fd00::1".parse().unwrap(),
                additional_addresses: vec![
                    "10.244.1.0/24".parse().unwrap(),
                    "fd40::/64".parse().unwrap(),
                ],
                // Host bits set on purpose: sent and kept as given, masked only when used.
                exclude_advertised_networks: vec![
                    "10.244.1.129/25".parse().unwrap(),
                    "fd40::1/80".parse().unwrap(),
                ],
            }),
            control_plane: Some(ControlPlaneInfo {
                api_server_port: 6443,
            }),
            wirespan: Some(super::super::extension::WirespanInfo::new(10)),
        }
    }

    #[test]
    fn spec_vector_c_plaintext_is_what_we_encode() {
        let info = AffiliateInfo {
            node_id: "node-a".into(),
            addresses: vec![IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))],
            hostname: "a".into(),
            machine_type: MachineType::Unknown,
            kubespan: Some(KubeSpanInfo {
                public_key: "PUBKEY=".into(),
                address: "fd00::1".parse().unwrap(),
                additional_addresses: vec![],
                exclude_advertised_networks: vec![],
            }),
            ..AffiliateInfo::default()
        };
        let decoded = AffiliateInfo::decode(&hex(VECTOR_C_PLAINTEXT)).unwrap();
        assert_eq!(decoded, info);
    }

    /// Spec §6 (c) plaintext.
    const VECTOR_C_PLAINTEXT: &str =
        "0a066e6f64652d6112040a0000011a01613a1b0a075055424b45593d1210fd000000000000000000000000000001";

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn affiliate_round_trip() {
        let info = sample();
        assert_eq!(AffiliateInfo::decode(&info.encode()).unwrap(), info);
        let empty = AffiliateInfo::default();
        assert_eq!(AffiliateInfo::decode(&empty.encode()).unwrap(), empty);
    }

    #[test]
    fn ipv4_is_written_as_four_bytes_even_when_mapped() {
        let info = AffiliateInfo {
            addresses: vec!["::ffff:10.1.2.3".parse().unwrap()],
            ..AffiliateInfo::default()
        };
        let msg = pb::Affiliate::decode(info.encode().as_slice()).unwrap();
        assert_eq!(msg.addresses, vec![vec![10, 1, 2, 3]]);
        let ep: Endpoint = "[::ffff:1.2.3.4]:5678".parse().unwrap();
        assert_eq!(
            encode_endpoint(&ep),
            vec![0x0a, 4, 1, 2, 3, 4, 0x10, 0xae, 0x2c]
        );
    }

    #[test]
    fn endpoint_round_trip_and_scope_dropped() {
        for ep in ["1.2.3.4:5678", "[2001:db8::1]:51820", "9.9.9.9:0"] {
            let ep: Endpoint = ep.parse().unwrap();
            assert_eq!(decode_endpoint(&encode_endpoint(&ep)).unwrap(), ep);
        }
        let scoped = SocketAddr::V6(SocketAddrV6::new("fe80::1".parse().unwrap(), 1, 0, 7));
        assert_eq!(
            decode_endpoint(&encode_endpoint(&scoped)).unwrap(),
            "[fe80::1]:1".parse::<SocketAddr>().unwrap()
        );
    }

    #[test]
    fn endpoint_decode_failures() {
        let bad_ip = pb::Endpoint {
            ip: vec![1, 2, 3],
            port: 1,
        }
        .encode_to_vec();
        assert_eq!(
            decode_endpoint(&bad_ip),
            Err(DecodeError::IpLength {
                field: "endpoint.ip",
                len: 3
            })
        );
        let no_ip = pb::Endpoint {
            ip: vec![],
            port: 1,
        }
        .encode_to_vec();
        assert!(matches!(
            decode_endpoint(&no_ip),
            Err(DecodeError::IpLength { len: 0, .. })
        ));
        let big_port = pb::Endpoint {
            ip: vec![1, 2, 3, 4],
            port: 65536,
        }
        .encode_to_vec();
        assert_eq!(
            decode_endpoint(&big_port),
            Err(DecodeError::Port { port: 65536 })
        );
        assert!(matches!(
            decode_endpoint(&[0x0a, 0x10, 1]),
            Err(DecodeError::Protobuf { .. })
        ));
    }

    #[test]
    fn unknown_fields_are_ignored() {
        let mut bytes = encode_endpoint(&"1.2.3.4:5".parse().unwrap());
        // field 9, varint 1; field 15, length-delimited "xy".
        bytes.extend_from_slice(&[0x48, 0x01, 0x7a, 0x02, b'x', b'y']);
        assert_eq!(
            decode_endpoint(&bytes).unwrap(),
            "1.2.3.4:5".parse::<SocketAddr>().unwrap()
        );

        let info = sample();
        let mut bytes = info.encode();
        // Affiliate field 20 (varint) and a KubeSpan field 5 a newer version may send.
        bytes.extend_from_slice(&[0xa0, 0x01, 0x05]);
        bytes.extend_from_slice(&[0x3a, 0x06, 0x2a, 0x04]);
        bytes.extend_from_slice(&[0x0a, 0x02, 10, 0]);
        let decoded = AffiliateInfo::decode(&bytes).unwrap();
        assert_eq!(decoded.node_id, info.node_id);
        assert_eq!(decoded.addresses, info.addresses);
        // The second kubespan occurrence is merged by protobuf rules and adds nothing.
        assert_eq!(decoded.kubespan, info.kubespan);
    }

    #[test]
    fn malformed_items_skip_only_themselves() {
        let msg = pb::Affiliate {
            node_id: "n".into(),
            addresses: vec![vec![1, 2, 3, 4], vec![1, 2], vec![0; 16]],
            machine_type: "space-station".into(),
            kubespan: Some(pb::KubeSpan {
                public_key: "K".into(),
                address: vec![0xfd; 16],
                additional_addresses: vec![
                    pb::IpPrefix {
                        ip: vec![10, 0, 0, 0],
                        bits: 8,
                    },
                    pb::IpPrefix {
                        ip: vec![10, 0, 0, 0],
                        bits: 33,
                    },
                    pb::IpPrefix {
                        ip: vec![10, 0, 0],
                        bits: 8,
                    },
                ],
                exclude_advertised_addresses: vec![],
            }),
            control_plane: Some(pb::ControlPlane {
                api_server_port: 70000,
            }),
            ..pb::Affiliate::default()
        };
        let info = AffiliateInfo::decode(&msg.encode_to_vec()).unwrap();
        assert_eq!(
            info.addresses,
            vec![
                IpAddr::from([1, 2, 3, 4]),
                IpAddr::V6(Ipv6Addr::UNSPECIFIED)
            ]
        );
        assert_eq!(info.machine_type, MachineType::Unknown);
        let ks = info.kubespan.unwrap();
        assert_eq!(
            ks.additional_addresses,
            vec!["10.0.0.0/8".parse::<IpNet>().unwrap()]
        );
        assert_eq!(info.control_plane, None);

        let bad_ula = pb::Affiliate {
            kubespan: Some(pb::KubeSpan {
                public_key: "K".into(),
                address: vec![10, 0, 0, 1],
                additional_addresses: vec![],
                exclude_advertised_addresses: vec![],
            }),
            ..pb::Affiliate::default()
        };
        assert_eq!(
            AffiliateInfo::decode(&bad_ula.encode_to_vec())
                .unwrap()
                .kubespan,
            None
        );
    }

    #[test]
    fn exclusions_travel_in_the_presumed_field() {
        use super::super::presumed::KUBESPAN_EXCLUDE_ADVERTISED_ADDRESSES_FIELD as FIELD;
        let info = AffiliateInfo {
            kubespan: Some(KubeSpanInfo {
                public_key: "K".into(),
                address: "fd00::1".parse().unwrap(),
                additional_addresses: vec![],
                exclude_advertised_networks: vec!["10.1.2.0/24".parse().unwrap()],
            }),
            ..AffiliateInfo::default()
        };
        let bytes = info.encode();
        // machine_type "unknown", then field 7 (KubeSpan, 31 bytes): key "K", address,
        // and the exclusion under the presumed number as IPPrefix {10.1.2.0, 24}.
        let key = u8::try_from((FIELD << 3) | 2).unwrap();
        let mut want = vec![0x2a, 0x07];
        want.extend_from_slice(b"unknown");
        want.extend_from_slice(&[0x3a, 0x1f, 0x0a, 0x01, b'K', 0x12, 0x10]);
        want.extend_from_slice(&"fd00::1".parse::<Ipv6Addr>().unwrap().octets());
        want.extend_from_slice(&[key, 0x08, 0x0a, 0x04, 10, 1, 2, 0, 0x10, 24]);
        assert_eq!(bytes, want);
        assert_eq!(AffiliateInfo::decode(&bytes).unwrap(), info);
    }

    fn with_exclusions(items: Vec<pb::IpPrefix>) -> Option<KubeSpanInfo> {
        let msg = pb::Affiliate {
            kubespan: Some(pb::KubeSpan {
                public_key: "K".into(),
                address: vec![0xfd; 16],
                additional_addresses: vec![],
                exclude_advertised_addresses: items,
            }),
            ..pb::Affiliate::default()
        };
        AffiliateInfo::decode(&msg.encode_to_vec())
            .unwrap()
            .kubespan
    }

    #[test]
    fn received_exclusions_are_read_as_talos_reads_them() {
        let p = |ip: Vec<u8>, bits| pb::IpPrefix { ip, bits };
        // A 3-byte IP is skipped alone; host bits are kept; IPv6 stays IPv6.
        let ks = with_exclusions(vec![
            p(vec![10, 0, 0, 1], 8),
            p(vec![10, 0, 0], 8),
            p(vec![0; 16], 0),
        ])
        .expect("still a KubeSpan peer");
        assert_eq!(
            ks.exclude_advertised_networks,
            vec![
                "10.0.0.1/8".parse::<IpNet>().unwrap(),
                "::/0".parse().unwrap()
            ]
        );
        // An empty IP or bits beyond the family: Talos builds no peer for the node.
        assert_eq!(with_exclusions(vec![p(vec![], 8)]), None);
        assert_eq!(with_exclusions(vec![p(vec![10, 0, 0, 0], 33)]), None);
        assert_eq!(with_exclusions(vec![p(vec![0; 16], 129)]), None);
    }

    #[test]
    fn a_different_use_of_the_presumed_field_costs_only_the_exclusions() {
        use super::super::presumed::KUBESPAN_EXCLUDE_ADVERTISED_ADDRESSES_FIELD as FIELD;
        let info = sample();
        let plain = AffiliateInfo {
            kubespan: info.kubespan.clone().map(|k| KubeSpanInfo {
                exclude_advertised_networks: vec![],
                ..k
            }),
            ..info
        };
        let mut bytes = plain.encode();
        // One more KubeSpan occurrence (merged by protobuf rules) whose presumed field
        // is a string, as a sender with another numbering would write it.
        let key = u8::try_from((FIELD << 3) | 2).unwrap();
        let text = b"10.0.0.0/8";
        bytes.extend_from_slice(&[0x3a, u8::try_from(text.len() + 2).unwrap(), key]);
        bytes.push(u8::try_from(text.len()).unwrap());
        bytes.extend_from_slice(text);
        assert!(
            pb::Affiliate::decode(bytes.as_slice()).is_err(),
            "not an IPPrefix"
        );
        assert_eq!(AffiliateInfo::decode(&bytes).unwrap(), plain);
        // Broken framing elsewhere is still an error.
        bytes.push(0x0a);
        assert!(AffiliateInfo::decode(&bytes).is_err());
    }

    #[test]
    fn invalid_utf8_string_is_a_protobuf_error() {
        // field 1 (node_id), length 1, byte 0xff.
        assert!(matches!(
            AffiliateInfo::decode(&[0x0a, 0x01, 0xff]),
            Err(DecodeError::Protobuf {
                message: "Affiliate",
                ..
            })
        ));
    }

    #[test]
    fn machine_type_strings() {
        for t in [
            MachineType::ControlPlane,
            MachineType::Worker,
            MachineType::Init,
            MachineType::Unknown,
        ] {
            assert_eq!(MachineType::from_wire(t.as_str()), t);
        }
        assert_eq!(MachineType::from_wire(""), MachineType::Unknown);
    }

    #[test]
    fn decoded_names_are_sanitised_and_bounded() {
        let sent = AffiliateInfo {
            node_id: "id\u{1b}".into(),
            hostname: format!("h\u{1b}[2J{}", "x".repeat(1000)),
            nodename: "n\"}\nforged_series 1\n\u{202e}".into(),
            operating_system: "os\u{9b}".into(),
            ..sample()
        };
        let got = AffiliateInfo::decode(&sent.encode()).unwrap();
        assert_eq!(got.node_id, "id\u{fffd}");
        assert!(
            got.hostname.starts_with("h\u{fffd}[2Jxx"),
            "{}",
            got.hostname
        );
        assert!(got.hostname.len() <= crate::text::MAX_NAME_BYTES);
        assert_eq!(got.nodename, "n\"}\u{fffd}forged_series 1\u{fffd}\u{fffd}");
        assert_eq!(got.operating_system, "os\u{fffd}");
        // Everything else is decoded as sent.
        assert_eq!(got.kubespan, sent.kubespan);
        assert_eq!(got.addresses, sent.addresses);
    }
}
