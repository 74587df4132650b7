//! The discovery client library.

pub mod crypto;
pub mod model;
