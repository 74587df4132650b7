//! The WireGuard UAPI answer parsers (`parse_get`, `parse_errno`, `parse_stats`) on
//! arbitrary text.
#![no_main]

use libfuzzer_sys::fuzz_target;
use wirespan_dataplane::wireguard::uapi;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = uapi::parse_get(&text);
    let _ = uapi::parse_errno(&text);
    let _ = uapi::parse_stats(&text);
});
