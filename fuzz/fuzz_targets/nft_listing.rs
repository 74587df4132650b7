//! The `nft -j list table` parser (`marking::parse_table`) on arbitrary text.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = wirespan_dataplane::marking::parse_table(text);
});
