//! wirespan's extension of the affiliate data (`docs/discovery-protocol.md` §4.1): an
//! extra top-level `Affiliate` field that upstream does not use, so a Talos node
//! decodes the affiliate as before and ignores it, while a wirespan node learns that
//! the peer is a wirespan node and how often it sends keepalives.
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WirespanInfo {
    /// Extension format version.
    pub version: u32,
    /// The persistent keepalive the node sets towards wirespan peers, in seconds.
    pub persistent_keepalive_secs: u32,
}

impl WirespanInfo {
    /// This build's extension with the given keepalive.
    #[must_use]
    pub fn new(persistent_keepalive_secs: u32) -> Self {
        Self {
            version: WIRESPAN_EXTENSION_VERSION,
            persistent_keepalive_secs,
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
    fn no_extension_or_a_foreign_use_of_the_number_is_none() {
        let plain = pb::Affiliate::default().encode_to_vec();
        assert_eq!(find(&plain), None);
        // Field 1000 as a varint, and as bytes that are no Wirespan message.
        assert_eq!(find(&[0xc0, 0x3e, 0x05]), None);
        assert_eq!(find(&[0xc2, 0x3e, 0x02, 0xff, 0xff]), None);
    }
}
