//! Generated protobuf types. Decoders ignore unknown fields (prost does), as the
//! protocol requires.

/// `sidero.discovery.server`: the gRPC service and its transport messages.
#[allow(clippy::all, clippy::pedantic, missing_docs, rust_2018_idioms)]
pub mod server {
    tonic::include_proto!("sidero.discovery.server");
}

/// `sidero.discovery.client`: plaintext of the encrypted blobs.
#[allow(clippy::all, clippy::pedantic, missing_docs, rust_2018_idioms)]
pub mod client {
    tonic::include_proto!("sidero.discovery.client");
}

/// `sidero.discovery.storage`: the snapshot file format.
#[allow(clippy::all, clippy::pedantic, missing_docs, rust_2018_idioms)]
pub mod storage {
    tonic::include_proto!("sidero.discovery.storage");
}

/// `grpc.health.v1`: the standard health checking service.
#[allow(clippy::all, clippy::pedantic, missing_docs, rust_2018_idioms)]
pub mod health {
    tonic::include_proto!("grpc.health.v1");
}

/// `wirespan.relay.v1`: the server relay's allocation service (wirespan's own).
#[allow(clippy::all, clippy::pedantic, missing_docs, rust_2018_idioms)]
pub mod relay {
    tonic::include_proto!("wirespan.relay.v1");
}

#[cfg(test)]
mod tests {
    //! The protocol's test vectors (d): deterministic encodings of transport messages.

    use prost::Message;

    use super::server::*;
    use crate::test_util::hex;

    const BLOB_C: &str = "000102030405060708090a0b\
        4d04b874a180ef7a9f459d8bb1e8626ce2ec9c3ef72b0a3e7322bcb80f79fdb20110aefcafc1129874a47fed8886\
        c46b3a40ac53fd969a0b23d76cc0b514";
    const CT_A: &str = "bc149092d77478cece8809c3e0153800";

    #[test]
    fn vector_d_transport_messages() {
        let ttl = prost_types::Duration {
            seconds: 1800,
            nanos: 0,
        };
        assert_eq!(ttl.encode_to_vec(), hex("08 88 0e"));
        let hello = HelloRequest {
            cluster_id: "c1".into(),
            client_version: "v1.8.3".into(),
        };
        assert_eq!(
            hello.encode_to_vec(),
            hex("0a 02 63 31 12 06 76 31 2e 38 2e 33")
        );
        let resp = HelloResponse {
            redirect: None,
            client_ip: vec![127, 0, 0, 1],
        };
        assert_eq!(resp.encode_to_vec(), hex("12 04 7f 00 00 01"));
        let resp = HelloResponse {
            redirect: Some(RedirectMessage {
                endpoint: "example.com:443".into(),
            }),
            client_ip: vec![1, 2, 3, 4],
        };
        assert_eq!(
            resp.encode_to_vec(),
            hex("0a 11 0a 0f 65 78 61 6d 70 6c 65 2e 63 6f 6d 3a 34 34 33 12 04 01 02 03 04")
        );
        let deleted = WatchResponse {
            affiliates: vec![Affiliate {
                id: "node-a".into(),
                ..Affiliate::default()
            }],
            deleted: true,
        };
        assert_eq!(
            deleted.encode_to_vec(),
            hex("0a 08 0a 06 6e 6f 64 65 2d 61 10 01")
        );
        assert!(WatchResponse::default().encode_to_vec().is_empty());
        let update = AffiliateUpdateRequest {
            cluster_id: "c1".into(),
            affiliate_id: "node-a".into(),
            affiliate_data: Some(hex(BLOB_C)),
            affiliate_endpoints: vec![hex(CT_A)],
            ttl: Some(ttl),
        };
        let expected = [
            hex("0a 02 6331 12 06 6e6f64652d61 1a 4a"),
            hex(BLOB_C),
            hex("22 10"),
            hex(CT_A),
            hex("2a 03 08880e"),
        ]
        .concat();
        assert_eq!(update.encode_to_vec(), expected);
        // And decoding gives the message back, with unknown fields ignored.
        let mut with_unknown = expected;
        with_unknown.extend(hex("f8 07 01")); // field 127, varint
        assert_eq!(
            AffiliateUpdateRequest::decode(with_unknown.as_slice()).unwrap(),
            update
        );
    }

    #[test]
    fn optional_empty_data_is_present_on_the_wire() {
        let update = AffiliateUpdateRequest {
            affiliate_data: Some(Vec::new()),
            ..AffiliateUpdateRequest::default()
        };
        assert_eq!(update.encode_to_vec(), hex("1a 00"));
    }
}
