// Shared by `build.rs` (through `include!`) and the library, so the number lives in
// one place. Keep this file free of `use` items and attributes.

/// Field number of `KubeSpan.exclude_advertised_addresses` (`repeated IPPrefix`),
/// which Talos sends since discovery-api v0.1.8. No stored copy of that proto gives
/// the number; 4 is the next free number of `KubeSpan` and is a presumption
/// (`docs/discovery-protocol.md` §4). `build.rs` adds the field to the generated
/// `KubeSpan` message with this number.
pub const KUBESPAN_EXCLUDE_ADVERTISED_ADDRESSES_FIELD: i32 = 4;
