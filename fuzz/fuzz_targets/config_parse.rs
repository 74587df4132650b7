//! The machine config loader's parser (`control::config::parse`): arbitrary YAML text,
//! any number of documents. It must return a config or errors, never panic; errors
//! must render.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match wirespan_control::config::parse(text) {
        Ok(config) => {
            let _ = format!("{config:?}");
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
