//! The `wirespan wireguard` device's untrusted input (UAPI `set=1`, datagrams, TUN
//! packets and reads, decrypted batches). The body, its input format and its properties
//! are `wirespan_dataplane::fuzzing::wg_device_input`, which the stable suite's
//! `tests/fuzz_replay.rs` also runs on this target's corpus and regressions.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| wirespan_dataplane::fuzzing::wg_device_input(data));
