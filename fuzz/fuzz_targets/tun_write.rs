//! A batch of decrypted packets from a peer through the TUN writer (coalescer
//! included), its writes collected and cut back into the same packets. The body, its
//! input format and its properties are `wirespan_dataplane::fuzzing::tun_write`, which
//! the stable suite's `tests/fuzz_replay.rs` also runs on this target's corpus and
//! regressions.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| wirespan_dataplane::fuzzing::tun_write(data));
