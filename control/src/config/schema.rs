//! JSON-schema stand-ins for config field types that have no schema of their own
//! (`#[schemars(with = "…")]`). Each is a string with a `format` that
//! [`super::reference`] turns into words; none is ever instantiated.

use std::borrow::Cow;

use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};

macro_rules! string_format {
    ($(#[$doc:meta])* $name:ident => $format:literal) => {
        $(#[$doc])*
        pub enum $name {}

        impl JsonSchema for $name {
            fn inline_schema() -> bool {
                true
            }

            fn schema_name() -> Cow<'static, str> {
                $format.into()
            }

            fn json_schema(_: &mut SchemaGenerator) -> Schema {
                json_schema!({ "type": "string", "format": $format })
            }
        }
    };
}

string_format! {
    /// An address with prefix length (`ipnet::IpNet`).
    Cidr => "cidr"
}

string_format! {
    /// `ip:port`, IPv6 in brackets (`std::net::SocketAddr`).
    IpPort => "ip-port"
}

string_format! {
    /// A duration written like `10s`, `1m30s` or `500ms`.
    DurationText => "duration"
}

string_format! {
    /// A secret: read from the file, never printed.
    Secret => "secret"
}
