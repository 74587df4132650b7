//! The discovery client library.

pub mod address;
pub mod backoff;
pub mod crypto;
pub mod machine;
pub mod model;
