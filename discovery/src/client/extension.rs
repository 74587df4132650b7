//! wirespan's extension of the affiliate data (`docs/discovery-protocol.md` §4.1): an
//! extra top-level `Affiliate` field that upstream does not use, so a Talos node
//! decodes the affiliate as before and ignores it, while a wirespan node learns that
//! the peer is a wirespan node, how often it sends keepalives, and how it takes part
//! in peer relays.
//!
//! The field is written after the upstream fields and read by a separate pass over
//! the top-level fields, so a sender that used the number for something else costs
//! only the extension, never the affiliate.

use prost::Message as _;

use crate::proto::client as pb;

/// Field number of the extension in `Affiliate` (upstream uses 1–8).
pub const AFFILIATE_WIRESPAN_FIELD: u32 = 1000;

/// Version of the extension this build writes.
pub const WIRESPAN_EXTENSION_VERSION: u32 = 1;

/// What a wirespan node tells others about itself beyond the upstream affiliate.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct WirespanInfo {
    /// Extension format version.
    pub version: u32,
    /// The persistent keepalive the node sets towards wirespan peers, in seconds.
    pub persistent_keepalive_secs: u32,
    /// The node routes traffic for a peer it cannot reach directly through a relay,
    /// and accepts a peer's traffic that way.
    pub relay_user: bool,
    /// The node forwards between two of its peers.
    pub relay_offered: bool,
    /// The peers the node cannot reach directly: the first 8 bytes of each public
    /// key, big-endian.
    pub direct_down: Vec<u64>,
}

impl WirespanInfo {
    /// This build's extension with the given keepalive, taking no part in relays.
    #[must_use]
    pub fn new(persistent_keepalive_secs: u32) -> Self {
        Self {
            version: WIRESPAN_EXTENSION_VERSION,
            persistent_keepalive_secs,
            ..Self::default()
        }
    }
}

/// Appends the extension as field [`AFFILIATE_WIRESPAN_FIELD`] to an encoded
/// `Affiliate` (protobuf fields may come in any order).
pub fn append(info: &WirespanInfo, out: &mut Vec<u8>) {
    use prost::encoding::{encode_key, encode_varint, WireType};
    let body = pb::Wirespan {
        version: info.version,
        persistent_keepalive_seconds: info.persistent_keepalive_secs,
        relay_user: info.relay_user,
        relay_offered: info.relay_offered,
        direct_down: info.direct_down.clone(),
    }
    .encode_to_vec();
    encode_key(AFFILIATE_WIRESPAN_FIELD, WireType::LengthDelimited, out);
    encode_varint(body.len() as u64, out);
    out.extend_from_slice(&body);
}

/// The extension in an encoded `Affiliate`, if any: every occurrence is merged, as
/// protobuf merges a repeated embedded message. `None` without one, or when an
/// occurrence is not a `Wirespan` message (another use of the number).
#[must_use]
pub fn find(mut buf: &[u8]) -> Option<WirespanInfo> {
    use prost::encoding::{decode_key, decode_varint, skip_field, DecodeContext, WireType};
    let mut found: Option<pb::Wirespan> = None;
    while !buf.is_empty() {
        let (tag, wire_type) = decode_key(&mut buf).ok()?;
        if tag == AFFILIATE_WIRESPAN_FIELD {
            if wire_type != WireType::LengthDelimited {
                return None;
            }
            let len = usize::try_from(decode_varint(&mut buf).ok()?).ok()?;
            let body = buf.get(..len)?;
            buf = &buf[len..];
            found
                .get_or_insert_with(Default::default)
                .merge(body)
                .ok()?;
            continue;
        }
        skip_field(wire_type, tag, &mut buf, DecodeContext::default()).ok()?;
    }
    found.map(|w| WirespanInfo {
        version: w.version,
        persistent_keepalive_secs: w.persistent_keepalive_seconds,
        relay_user: w.relay_user,
        relay_offered: w.relay_offered,
        direct_down: w.direct_down,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_extension_follows_the_upstream_fields_and_reads_back() {
        let mut bytes = pb::Affiliate {
            node_id: "n".into(),
            ..pb::Affiliate::default()
        }
        .encode_to_vec();
        let upstream_len = bytes.len();
        append(&WirespanInfo::new(10), &mut bytes);
        // Key 1000/LEN is the varint 8002 = c2 3e; then {version 1, keepalive 10}.
        assert_eq!(
            &bytes[upstream_len..],
            &[0xc2, 0x3e, 0x04, 0x08, 0x01, 0x10, 0x0a]
        );
        assert_eq!(find(&bytes), Some(WirespanInfo::new(10)));
        // The generated (upstream-shaped) message still decodes and skips it.
        assert_eq!(
            pb::Affiliate::decode(bytes.as_slice()).unwrap().node_id,
            "n"
        );
    }

    #[test]
    fn relay_fields_read_back_and_an_upstream_decoder_still_skips_them() {
        let info = WirespanInfo {
            relay_user: true,
            relay_offered: true,
            direct_down: vec![1, u64::MAX, 0x0123_4567_89ab_cdef],
            ..WirespanInfo::new(10)
        };
        let mut bytes = pb::Affiliate {
            node_id: "n".into(),
            hostname: "h".into(),
            ..pb::Affiliate::default()
        }
        .encode_to_vec();
        append(&info, &mut bytes);
        assert_eq!(find(&bytes), Some(info));
        let upstream = pb::Affiliate::decode(bytes.as_slice()).unwrap();
        assert_eq!(
            (upstream.node_id.as_str(), upstream.hostname.as_str()),
            ("n", "h")
        );
        // A version-1 extension without relay fields reads as taking no part.
        let mut old = Vec::new();
        append(&WirespanInfo::new(10), &mut old);
        let read = find(&old).unwrap();
        assert!(!read.relay_user && !read.relay_offered && read.direct_down.is_empty());
    }

    #[test]
    fn no_extension_or_a_foreign_use_of_the_number_is_none() {
        let plain = pb::Affiliate::default().encode_to_vec();
        assert_eq!(find(&plain), None);
        // Field 1000 as a varint, and as bytes that are no Wirespan message.
        assert_eq!(find(&[0xc0, 0x3e, 0x05]), None);
        assert_eq!(find(&[0xc2, 0x3e, 0x02, 0xff, 0xff]), None);
    }
}
