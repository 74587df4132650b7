//! The machine config loader's parser on arbitrary (multi-document) YAML. The body, its
//! input format and its properties are `wirespan_control::fuzzing::config_parse`, which
//! the stable suite's `tests/fuzz_replay.rs` also runs on this target's corpus and
//! regressions.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| wirespan_control::fuzzing::config_parse(data));
