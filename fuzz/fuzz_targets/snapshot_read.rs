//! Snapshot loading of arbitrary bytes, and the save and load round trip. The body, its
//! input format and its properties are `wirespan_discovery::fuzzing::snapshot_read`,
//! which the stable suite's `tests/fuzz_replay.rs` also runs on this target's corpus
//! and regressions.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| wirespan_discovery::fuzzing::snapshot_read(data));
