//! The body of this crate's cargo-fuzz target (`fuzz/fuzz_targets/config_parse.rs`),
//! taking the fuzzer's raw input and panicking on a broken property. The target only
//! calls it, and the stable suite's `tests/fuzz_replay.rs` (root package) runs every
//! committed corpus and regression input through it. Compiled only with the
//! `fuzzing` feature.

/// `config_parse`: the machine config loader's parser (`config::parse`) on arbitrary
/// YAML text, any number of documents. It returns a config or errors, never panics;
/// errors render.
pub fn config_parse(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match crate::config::parse(text) {
        Ok(config) => {
            let _ = format!("{config:?}");
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
}
