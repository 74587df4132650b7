//! Affiliate and endpoint blobs: decrypt, decode, seal and encode round trips. The
//! body, its input format and its properties are
//! `wirespan_discovery::fuzzing::discovery_crypto`, which the stable suite's
//! `tests/fuzz_replay.rs` also runs on this target's corpus and regressions.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| wirespan_discovery::fuzzing::discovery_crypto(data));
