//! The userspace WireGuard device core with a real peer: a completed handshake, then a
//! script of the peer's packets, an attacker's replays, bit flips and junk, and clock
//! jumps. The body, its input format and its properties are
//! `wirespan_dataplane::fuzzing::wg_session`, which the stable suite's
//! `tests/fuzz_replay.rs` also runs on this target's corpus and regressions.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| wirespan_dataplane::fuzzing::wg_session(data));
