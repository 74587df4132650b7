//! wirespan-bench: reproducible benchmarks behind `wirespan bench …`.
//!
//! Each benchmark prints its figures and compares alternatives in the same run.

pub mod dataplane;
pub mod discovery;
pub mod runtime;
