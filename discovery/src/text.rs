//! Untrusted text: names and descriptions that other cluster members (or anyone who
//! knows the cluster ID) publish through discovery.
//!
//! Two layers, because a value can reach an output by more than one path:
//! - [`sanitize`] runs when an affiliate is decoded: control characters (C0, DEL, C1,
//!   which include the ANSI escape introducers ESC and CSI), bidi overrides and line
//!   separators become U+FFFD, and the value is cut to a byte bound;
//! - every output escapes again in its own syntax: [`escape_label_value`] for the
//!   Prometheus text exposition, [`escape_terminal`] for tables and plain text.
//!   Logs print untrusted strings with `?` (Debug), which escapes them.

use std::{borrow::Cow, fmt::Write as _};

/// What a removed character is replaced with.
pub const REPLACEMENT: char = '\u{fffd}';

/// Longest kept host name or node name, in bytes (a DNS name and a Kubernetes node
/// name are at most 253).
pub const MAX_NAME_BYTES: usize = 253;

/// Longest kept free-text value (the OS description), in bytes.
pub const MAX_TEXT_BYTES: usize = 256;

/// Whether `c` must not reach a terminal or a line-oriented output: control
/// characters (C0, DEL, C1), bidi embeddings, overrides, isolates and marks, and the
/// Unicode line and paragraph separators.
#[must_use]
pub fn is_unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
                | '\u{2028}'
                | '\u{2029}'
        )
}

/// `value` with every [unsafe character](is_unsafe_char) replaced by [`REPLACEMENT`],
/// cut at a character boundary to at most `max_bytes` bytes.
#[must_use]
pub fn sanitize(value: &str, max_bytes: usize) -> String {
    let mut out = String::with_capacity(value.len().min(max_bytes));
    for c in value.chars() {
        let c = if is_unsafe_char(c) { REPLACEMENT } else { c };
        if out.len() + c.len_utf8() > max_bytes {
            break;
        }
        out.push(c);
    }
    out
}

/// `value` as a Prometheus label value (text exposition 0.0.4): backslash, double
/// quote and line feed escaped, so a value can neither end the label set nor start a
/// line of its own.
#[must_use]
pub fn escape_label_value(value: &str) -> Cow<'_, str> {
    if !value.contains(['\\', '"', '\n']) {
        return Cow::Borrowed(value);
    }
    let mut out = String::with_capacity(value.len() + 8);
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// `value` for a terminal: every [unsafe character](is_unsafe_char) written as
/// visible text (`\x1b`, `\u{202e}`), so an escape sequence is shown, not obeyed.
#[must_use]
pub fn escape_terminal(value: &str) -> Cow<'_, str> {
    if !value.chars().any(is_unsafe_char) {
        return Cow::Borrowed(value);
    }
    let mut out = String::with_capacity(value.len() + 8);
    for c in value.chars() {
        if !is_unsafe_char(c) {
            out.push(c);
        } else if u32::from(c) < 0x100 {
            let _ = write!(out, "\\x{:02x}", u32::from(c));
        } else {
            let _ = write!(out, "\\u{{{:04x}}}", u32::from(c));
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sanitize_replaces_controls_escapes_and_bidi() {
        assert_eq!(sanitize("node-1.example", 253), "node-1.example");
        assert_eq!(sanitize("a\u{1b}[2Jb", 253), "a\u{fffd}[2Jb");
        assert_eq!(sanitize("a\u{9b}2Jb", 253), "a\u{fffd}2Jb", "C1 CSI");
        assert_eq!(sanitize("a\"}\nx 1\n", 253), "a\"}\u{fffd}x 1\u{fffd}");
        assert_eq!(sanitize("\u{7f}\t\r\0", 253), "\u{fffd}".repeat(4));
        assert_eq!(
            sanitize("ab\u{202e}cd\u{2066}", 253),
            "ab\u{fffd}cd\u{fffd}"
        );
        assert_eq!(sanitize("x\u{2028}y", 253), "x\u{fffd}y");
        // Non-ASCII letters are names too.
        assert_eq!(sanitize("nœud-été", 253), "nœud-été");
    }

    #[test]
    fn sanitize_cuts_at_a_character_boundary() {
        assert_eq!(sanitize(&"a".repeat(1000), 253).len(), 253);
        // 'é' is two bytes: 3 bytes allow one of them, not one and a half.
        assert_eq!(sanitize("ééé", 3), "é");
        assert_eq!(sanitize("a\u{1b}", 3), "a", "U+FFFD is 3 bytes");
        assert_eq!(sanitize("", 0), "");
    }

    #[test]
    fn label_values_cannot_close_the_label_set_or_break_the_line() {
        assert!(matches!(
            escape_label_value("plain"),
            Cow::Borrowed("plain")
        ));
        assert_eq!(
            escape_label_value("n\"}\nforged_series 1\n"),
            "n\\\"}\\nforged_series 1\\n"
        );
        assert_eq!(escape_label_value("a\\b"), "a\\\\b");
        assert!(!escape_label_value("x\"\n\n").contains('\n'));
    }

    #[test]
    fn terminal_escape_shows_escape_sequences_as_text() {
        assert!(matches!(escape_terminal("node-1"), Cow::Borrowed("node-1")));
        assert_eq!(escape_terminal("a\u{1b}[2Jb"), "a\\x1b[2Jb");
        assert_eq!(escape_terminal("\u{9b}\u{7f}\n"), "\\x9b\\x7f\\x0a");
        assert_eq!(escape_terminal("l\u{202e}r"), "l\\u{202e}r");
        assert!(!escape_terminal("\u{1b}\u{1b}").contains('\u{1b}'));
    }
}
