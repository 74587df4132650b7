//! Compiles the protocol's `.proto` files with `protox` (pure Rust), so no system
//! `protoc` is needed.

const PROTOS: &[&str] = &[
    "proto/sidero/discovery/server/server.proto",
    "proto/sidero/discovery/client/affiliate.proto",
    "proto/sidero/discovery/storage/storage.proto",
    "proto/grpc/health/v1/health.proto",
    "proto/wirespan/relay/v1/relay.proto",
];

include!("src/client/presumed.rs");

/// Adds `KubeSpan.exclude_advertised_addresses` with the presumed number: the number
/// stays one constant, shared with the library, instead of a literal in the `.proto`.
fn add_presumed_fields(fds: &mut prost_types::FileDescriptorSet) -> Result<(), String> {
    use prost_types::field_descriptor_proto::{Label, Type};
    let file = fds
        .file
        .iter_mut()
        .find(|f| f.package() == "sidero.discovery.client")
        .ok_or("no sidero.discovery.client package")?;
    let index = file
        .message_type
        .iter()
        .position(|m| m.name() == "KubeSpan")
        .ok_or("affiliate.proto has no KubeSpan message")?;
    let kubespan = &mut file.message_type[index];
    if let Some(taken) = kubespan
        .field
        .iter()
        .find(|f| f.number() == KUBESPAN_EXCLUDE_ADVERTISED_ADDRESSES_FIELD)
    {
        return Err(format!(
            "KubeSpan field {} is already {}",
            KUBESPAN_EXCLUDE_ADVERTISED_ADDRESSES_FIELD,
            taken.name()
        ));
    }
    kubespan.field.push(prost_types::FieldDescriptorProto {
        name: Some("exclude_advertised_addresses".into()),
        json_name: Some("excludeAdvertisedAddresses".into()),
        number: Some(KUBESPAN_EXCLUDE_ADVERTISED_ADDRESSES_FIELD),
        label: Some(Label::Repeated.into()),
        r#type: Some(Type::Message.into()),
        type_name: Some(".sidero.discovery.client.IPPrefix".into()),
        ..prost_types::FieldDescriptorProto::default()
    });
    // prost-build looks up every field's source location (for its doc comment).
    let field = i32::try_from(kubespan.field.len() - 1).map_err(|e| e.to_string())?;
    let index = i32::try_from(index).map_err(|e| e.to_string())?;
    file.source_code_info
        .get_or_insert_with(Default::default)
        .location
        .push(prost_types::source_code_info::Location {
            path: vec![4, index, 2, field],
            span: vec![0, 0, 0],
            leading_comments: Some(
                " Networks peers must not route to the node; field number presumed\n \
                 (src/client/presumed.rs).\n"
                    .into(),
            ),
            ..Default::default()
        });
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    println!("cargo:rerun-if-changed=src/client/presumed.rs");
    let mut descriptors = protox::compile(PROTOS, ["proto"])?;
    add_presumed_fields(&mut descriptors)?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
