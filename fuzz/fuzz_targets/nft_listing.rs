//! The `nft -j list table` parser on arbitrary text. The body, its input format and its
//! properties are `wirespan_dataplane::fuzzing::nft_listing`, which the stable suite's
//! `tests/fuzz_replay.rs` also runs on this target's corpus and regressions.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| wirespan_dataplane::fuzzing::nft_listing(data));
