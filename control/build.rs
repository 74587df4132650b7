//! Compiles the resource API `.proto` with `protox` (pure Rust, no system `protoc`).

const PROTOS: &[&str] = &["proto/wirespan/resource/v1/resource.proto"];

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
