//! Compiles the protocol's `.proto` files with `protox` (pure Rust), so no system
//! `protoc` is needed.

const PROTOS: &[&str] = &[
    "proto/sidero/discovery/server/server.proto",
    "proto/sidero/discovery/client/affiliate.proto",
    "proto/sidero/discovery/storage/storage.proto",
    "proto/grpc/health/v1/health.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(PROTOS, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
