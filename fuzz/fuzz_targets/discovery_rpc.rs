//! The discovery server's RPC handlers with sequences of requests against one server
//! state. The body, its input format and its properties are
//! `wirespan_discovery::fuzzing::discovery_rpc`, which the stable suite's
//! `tests/fuzz_replay.rs` also runs on this target's corpus and regressions.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| wirespan_discovery::fuzzing::discovery_rpc(data));
