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
