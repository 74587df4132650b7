//! The nf_tables netlink reply parsers on arbitrary datagrams. The body, its input
//! format and its properties are `wirespan_dataplane::fuzzing::nfnl_reply`, which the
//! stable suite's `tests/fuzz_replay.rs` also runs on this target's corpus and
//! regressions.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| wirespan_dataplane::fuzzing::nfnl_reply(data));
