//! A cheap, linear nesting-depth check run before the YAML parser: the parser's cost
//! grows faster than linearly with nesting (100,000 levels of `[` took seconds), and no
//! config needs more than a handful of levels.
//!
//! The scan is an over-approximation that reads no values: per line it counts the
//! block indentation levels open, the `- ` sequence markers that start the line and the
//! flow collections (`[`, `{`) open, skipping quoted strings, comments and block
//! scalars (`|`, `>`). Anything it does not understand is simply counted, never
//! parsed.

/// Deepest nesting a config may have ([`check`]).
pub const MAX_DEPTH: usize = 64;

/// Where the text first nests deeper than the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooDeep {
    /// Position of the document in the file, from 1.
    pub document: usize,
    /// Line in the file, from 1.
    pub line: usize,
}

/// State carried from one line to the next.
#[derive(Default)]
struct Scan {
    document: usize,
    /// Indentation of the open block levels, innermost last.
    indents: Vec<usize>,
    /// Open `[` and `{`.
    flow: usize,
    /// Inside a quoted string that continues on the next line: its quote.
    quote: Option<char>,
    /// Inside a block scalar whose header line had this indentation.
    block_scalar: Option<usize>,
}

/// Checks that no document of `text` nests deeper than `limit`.
///
/// # Errors
/// The first place where it does.
pub fn check(text: &str, limit: usize) -> Result<(), TooDeep> {
    check_raw_flow(text)?;
    let mut s = Scan {
        document: 1,
        ..Scan::default()
    };
    // Whether the current document has content, or was opened by `---`: either way
    // the next marker starts another one (as the parser numbers them).
    let (mut seen_content, mut opened) = (false, false);
    for (i, line) in text.lines().enumerate() {
        let mut line = line;
        if s.quote.is_none() && is_document_marker(line) {
            let start = line.starts_with("---");
            s.document += usize::from(seen_content || (opened && start));
            (seen_content, opened) = (false, start);
            s.indents.clear();
            s.flow = 0;
            s.block_scalar = None;
            // `--- [[[` has content on the marker's line.
            line = line[3..].trim_start_matches([' ', '\t']);
        }
        let depth = s.line(line);
        seen_content |= !line.trim().is_empty() && !line.trim_start().starts_with('#');
        if depth > limit {
            return Err(TooDeep {
                document: s.document,
                line: i + 1,
            });
        }
    }
    Ok(())
}

/// Open `[`/`{` counted with no regard to quotes or comments that
/// [`check_raw_flow`] allows: a backstop, should the scan above ever take a bracket
/// for text that the parser reads as nesting. No config comes near it, and a parse
/// this deep is still cheap.
const RAW_FLOW_LIMIT: usize = 1024;

fn check_raw_flow(text: &str) -> Result<(), TooDeep> {
    let (mut open, mut document, mut content) = (0usize, 1, false);
    for (i, line) in text.lines().enumerate() {
        if is_document_marker(line) && line.starts_with("---") && content {
            (document, content) = (document + 1, false);
        }
        content |= !line.trim().is_empty();
        for b in line.bytes() {
            match b {
                b'[' | b'{' => open += 1,
                b']' | b'}' => open = open.saturating_sub(1),
                _ => {}
            }
            if open > RAW_FLOW_LIMIT {
                return Err(TooDeep {
                    document,
                    line: i + 1,
                });
            }
        }
    }
    Ok(())
}

/// `---` or `...` at the start of a line, alone or followed by a space.
fn is_document_marker(line: &str) -> bool {
    ["---", "..."].iter().any(|m| {
        line.strip_prefix(m)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t']))
    })
}

impl Scan {
    /// Takes one line; returns the deepest nesting seen on it.
    fn line(&mut self, line: &str) -> usize {
        let indent = line.len() - line.trim_start_matches(' ').len();
        let body = &line[indent..];
        if let Some(header) = self.block_scalar {
            if body.is_empty() || indent > header {
                return 0;
            }
            self.block_scalar = None;
        }
        let mut depth = 0;
        let mut rest = body;
        if self.flow == 0 && self.quote.is_none() {
            if body.is_empty() || body.starts_with('#') {
                return 0;
            }
            while self.indents.last().is_some_and(|&top| top > indent) {
                self.indents.pop();
            }
            if self.indents.last().is_none_or(|&top| top < indent) {
                self.indents.push(indent);
            }
            // `- - - x` opens one sequence per marker on a single line.
            while let Some(r) = rest.strip_prefix("- ").or(rest.strip_prefix("? ")) {
                depth += 1;
                rest = r.trim_start_matches(' ');
            }
        }
        let base = self.indents.len() + depth;
        let deepest = self.characters(rest, base);
        if self.flow == 0 && self.quote.is_none() && opens_block_scalar(rest) {
            self.block_scalar = Some(indent);
        }
        deepest.max(base + self.flow)
    }

    /// Follows quotes, comments and flow brackets through `rest`; returns the deepest
    /// nesting reached (`base` plus the open flow collections).
    fn characters(&mut self, rest: &str, base: usize) -> usize {
        let mut deepest = base + self.flow;
        // The last character and the last one that is not a blank: a quote opens a
        // quoted scalar only where a value starts (`key: 'x'`, `- "x"`, `[a, 'b']`),
        // not inside a plain one (`rock 'n roll`).
        let (mut prev, mut prev_token) = (' ', ':');
        let mut chars = rest.chars().peekable();
        while let Some(c) = chars.next() {
            match (self.quote, c) {
                (Some('"'), '\\') => {
                    chars.next();
                }
                (Some('\''), '\'') if chars.peek() == Some(&'\'') => {
                    chars.next();
                }
                (Some(q), c) if c == q => self.quote = None,
                (Some(_), _) => {}
                (None, '"' | '\'') if starts_value(prev_token) => self.quote = Some(c),
                (None, '#') if prev == ' ' || prev == '\t' => break,
                (None, '[' | '{') => {
                    self.flow += 1;
                    deepest = deepest.max(base + self.flow);
                }
                (None, ']' | '}') => self.flow = self.flow.saturating_sub(1),
                _ => {}
            }
            prev = c;
            if !matches!(c, ' ' | '\t') {
                prev_token = c;
            }
        }
        deepest
    }
}

/// Whether a quote after the non-blank `prev` opens a quoted scalar (rather than
/// being part of a plain one, as in `it's` or `rock 'n roll`).
fn starts_value(prev: char) -> bool {
    matches!(prev, '[' | '{' | ',' | ':' | '-' | '?')
}

/// Whether a line ends with a block scalar header (`key: |`, `- >-`, `|2+`).
fn opens_block_scalar(rest: &str) -> bool {
    let code = match rest.find(" #") {
        Some(i) => &rest[..i],
        None => rest,
    };
    let last = code.trim_end().rsplit(' ').next().unwrap_or("");
    let mut chars = last.chars();
    matches!(chars.next(), Some('|' | '>'))
        && chars.all(|c| c == '+' || c == '-' || c.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinary_configs_pass() {
        let text = "apiVersion: v1alpha1\nkind: KubeSpanConfig\nfilters:\n  endpoints:\n    - 0.0.0.0/0\n    - '!10.0.0.0/8'\n---\nkind: X\nlist: [a, {b: [c]}]\nscript: |\n  [[[[[[[[[[\n  \"\n";
        assert_eq!(check(text, 8), Ok(()));
    }

    #[test]
    fn deep_flow_nesting_is_refused_with_document_and_line() {
        let text = format!("kind: A\n---\nkind: B\nx:\n  {}\n", "[".repeat(100_000));
        assert_eq!(
            check(&text, MAX_DEPTH),
            Err(TooDeep {
                document: 2,
                line: 5
            })
        );
        assert_eq!(check(&"{a: ".repeat(65), MAX_DEPTH).unwrap_err().line, 1);
    }

    #[test]
    fn flow_nesting_across_lines_counts() {
        let text = "x: [\n".repeat(10);
        assert!(check(&text, 9).is_err());
        assert!(check(&text, 11).is_ok());
    }

    #[test]
    fn deep_block_nesting_is_refused() {
        let mut text = String::new();
        for i in 0..70 {
            text.push_str(&format!("{}k{i}:\n", " ".repeat(i)));
        }
        assert_eq!(check(&text, MAX_DEPTH).unwrap_err().line, 65);
        assert!(check(&format!("x: {}1\n", "- ".repeat(70)), MAX_DEPTH).is_ok());
        assert_eq!(
            check(&format!("{}1\n", "- ".repeat(70)), MAX_DEPTH)
                .unwrap_err()
                .line,
            1
        );
    }

    #[test]
    fn brackets_in_quotes_and_comments_do_not_count() {
        let deep = "[".repeat(100);
        for text in [
            format!("a: \"{deep}\"\n"),
            format!("a: '{deep}'\n"),
            format!("a: 'it''s {deep}'\n"),
            format!("a: 1 # {deep}\n"),
            format!("# {deep}\n"),
            format!("a: \"multi\n  line {deep}\"\n"),
        ] {
            assert_eq!(check(&text, 4), Ok(()), "{text}");
        }
    }

    #[test]
    fn an_apostrophe_in_a_plain_value_hides_nothing() {
        let text = format!("a: rock 'n roll\nb: {}\n", "[".repeat(100));
        assert_eq!(check(&text, 8).unwrap_err().line, 2);
        let text = format!("a: \"x\"\nb: '{}\n", "[".repeat(2000));
        assert_eq!(check(&text, 8).unwrap_err().line, 2, "the raw backstop");
    }

    #[test]
    fn documents_are_counted_from_one() {
        let deep = "[".repeat(10);
        assert_eq!(
            check(&format!("---\nx: {deep}\n"), 4).unwrap_err().document,
            1
        );
        assert_eq!(
            check(&format!("a: 1\n---\nx: {deep}\n"), 4)
                .unwrap_err()
                .document,
            2
        );
        assert_eq!(
            check(&format!("a: 1\n...\n---\nx: {deep}\n"), 4)
                .unwrap_err()
                .document,
            2
        );
        assert_eq!(
            check(&format!("---\n---\nx: {deep}\n"), 4)
                .unwrap_err()
                .document,
            2
        );
        assert_eq!(
            check(&format!("a: 1\n--- {deep}\n"), 4)
                .unwrap_err()
                .document,
            2
        );
    }
}
