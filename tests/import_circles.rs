//! No import circles between the modules of any workspace crate.
//!
//! A file's `use crate::…`, `use super::…` and inline `crate::…`/`super::…` paths
//! each point at the deepest module they name. A reference between two modules that
//! are not ancestor and descendant is an edge between the two sibling modules under
//! their closest common ancestor (`config/network.rs` → `controllers/network/config.rs`
//! is `config` → `controllers`). A circle among siblings fails the test. Code after a
//! file's first `#[cfg(test)]` does not count: tests may use anything.
//!
//! The only accepted circles are those in [`ACCEPTED`], each justified in
//! `docs/architecture.md`.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

/// Workspace crates and their source folders.
const CRATES: &[(&str, &str)] = &[
    ("wirespan", "src"),
    ("wirespan-control", "control/src"),
    ("wirespan-dataplane", "dataplane/src"),
    ("wirespan-discovery", "discovery/src"),
    ("wirespan-bench", "bench/src"),
    ("wirespan-ebpf", "ebpf/src"),
];

/// Circles allowed to stay: `(crate, the modules of the circle, sorted, joined with
/// " ")`. Each must be explained in `docs/architecture.md` under the same words.
const ACCEPTED: &[(&str, &str)] = &[];

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A module path, `["server", "relay"]` for `server/relay/mod.rs`.
type ModPath = Vec<String>;

/// The module a source file defines, from its path relative to the crate's `src/`.
fn module_of(rel: &str) -> ModPath {
    let stem = rel.strip_suffix(".rs").unwrap_or(rel);
    let mut segs: ModPath = stem.split('/').map(str::to_owned).collect();
    let last = segs.last().map(String::as_str);
    if last == Some("mod") || (segs.len() == 1 && matches!(last, Some("lib" | "main"))) {
        segs.pop();
    }
    segs
}

/// The source without comments, string and character literals, cut at the first
/// `#[cfg(test)]` line.
fn code_of(source: &str) -> String {
    let source = source
        .find("\n#[cfg(test)]")
        .map_or(source, |i| &source[..i]);
    let b = source.as_bytes();
    let mut out = String::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let rest = &source[i..];
        if rest.starts_with("//") {
            i += rest.find('\n').unwrap_or(rest.len());
        } else if rest.starts_with("/*") {
            i += rest.find("*/").map_or(rest.len(), |e| e + 2);
        } else if let Some(len) = raw_string_len(rest) {
            i += len;
            out.push_str("\"\"");
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if let Some(len) = char_literal_len(rest) {
            i += len;
            out.push_str("' '");
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// Length of a raw string literal (`r"…"`, `r#"…"#`, `br"…"`) starting `text`.
fn raw_string_len(text: &str) -> Option<usize> {
    let after_b = text.strip_prefix('b').unwrap_or(text);
    let after_r = after_b.strip_prefix('r')?;
    let hashes = after_r.len() - after_r.trim_start_matches('#').len();
    let body = after_r[hashes..].strip_prefix('"')?;
    let close = format!("\"{}", "#".repeat(hashes));
    let end = body.find(&close)?;
    Some(text.len() - body.len() + end + close.len())
}

/// Length of a character literal (`'a'`, `'\n'`, `'\''`) starting `text`; `None` for a
/// lifetime.
fn char_literal_len(text: &str) -> Option<usize> {
    let rest = text.strip_prefix('\'')?;
    let len = if let Some(esc) = rest.strip_prefix('\\') {
        1 + esc.find('\'')?
    } else {
        rest.chars().next()?.len_utf8()
    };
    (rest[len..].starts_with('\'')).then_some(len + 2)
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The paths of a `use` tree (`a::{b, c::{d as e, self}}` → `a::b`, `a::c::d`, `a::c`).
fn expand_use_tree(tree: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    expand_into(&[], tree, &mut out);
    out
}

fn expand_into(prefix: &[String], tree: &str, out: &mut Vec<Vec<String>>) {
    let mut depth = 0;
    let mut start = 0;
    let mut parts = Vec::new();
    for (i, c) in tree.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&tree[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&tree[start..]);
    for part in parts {
        let part = part.trim();
        if part.is_empty() {
            continue;
        }
        if let Some(open) = part.find('{') {
            let close = part.rfind('}').unwrap_or(part.len());
            let head = split_path(&part[..open]);
            let mut p = prefix.to_vec();
            p.extend(head);
            expand_into(&p, &part[open + 1..close], out);
        } else {
            let part = part.split(" as ").next().unwrap_or(part);
            let mut p = prefix.to_vec();
            p.extend(split_path(part).into_iter().filter(|s| s != "self"));
            out.push(p);
        }
    }
}

fn split_path(path: &str) -> Vec<String> {
    path.split("::")
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

/// Every path a file's code starts with `crate`, `super` or `self`.
fn referenced_paths(code: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let mut rest_of_code = String::with_capacity(code.len());
    let mut text = code;
    // `use` statements (their trees may span lines and braces).
    while let Some(i) = find_word(text, "use") {
        rest_of_code.push_str(&text[..i]);
        let after = &text[i + 3..];
        let end = after.find(';').unwrap_or(after.len());
        paths.extend(expand_use_tree(&after[..end]));
        text = &after[(end + 1).min(after.len())..];
    }
    rest_of_code.push_str(text);
    // Inline paths (`crate::x::f()`).
    for root in ["crate::", "super::"] {
        for (i, _) in rest_of_code.match_indices(root) {
            if rest_of_code[..i]
                .chars()
                .next_back()
                .is_some_and(is_ident_char)
            {
                continue;
            }
            let path: String = rest_of_code[i..]
                .chars()
                .take_while(|c| is_ident_char(*c) || *c == ':')
                .collect();
            paths.push(split_path(&path));
        }
    }
    paths
        .into_iter()
        .filter(|p| {
            p.first()
                .is_some_and(|s| s == "crate" || s == "super" || s == "self")
        })
        .collect()
}

fn find_word(text: &str, word: &str) -> Option<usize> {
    text.match_indices(word).map(|(i, _)| i).find(|&i| {
        let before = text[..i].chars().next_back();
        let after = text[i + word.len()..].chars().next();
        !before.is_some_and(is_ident_char) && after.is_some_and(char::is_whitespace)
    })
}

/// Sibling edges `(from, to)` with, for each, one file and path that makes it.
type Edges = BTreeMap<(ModPath, ModPath), String>;

/// The sibling-module edges of a crate given as `(path under src/, source)`.
fn edges(files: &[(String, String)]) -> Edges {
    let modules: BTreeSet<ModPath> = files.iter().map(|(rel, _)| module_of(rel)).collect();
    let mut out = Edges::new();
    for (rel, source) in files {
        let me = module_of(rel);
        for path in referenced_paths(&code_of(source)) {
            let mut target: ModPath = Vec::new();
            let mut segs = path.iter().peekable();
            match segs.next().map(String::as_str) {
                Some("crate") => {}
                Some("self") => target.clone_from(&me),
                _ => {
                    target = me[..me.len().saturating_sub(1)].to_vec();
                    while segs.peek().is_some_and(|s| *s == "super") {
                        segs.next();
                        target.pop();
                    }
                }
            }
            for seg in segs {
                let mut deeper = target.clone();
                deeper.push(seg.clone());
                if !modules.contains(&deeper) {
                    break;
                }
                target = deeper;
            }
            let common = me.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if common == me.len() || common == target.len() {
                continue; // ancestor or descendant
            }
            out.entry((me[..=common].to_vec(), target[..=common].to_vec()))
                .or_insert_with(|| format!("{rel}: {}", path.join("::")));
        }
    }
    out
}

/// Strongly connected groups of more than one module.
fn circles(edges: &Edges) -> Vec<Vec<ModPath>> {
    let mut graph: BTreeMap<&ModPath, Vec<&ModPath>> = BTreeMap::new();
    for (from, to) in edges.keys() {
        graph.entry(from).or_default().push(to);
        graph.entry(to).or_default();
    }
    // Two nodes are in one circle when each reaches the other.
    let reach = |start: &ModPath| -> BTreeSet<ModPath> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![start];
        while let Some(n) = stack.pop() {
            for next in &graph[n] {
                if seen.insert((*next).clone()) {
                    stack.push(next);
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&ModPath, BTreeSet<ModPath>> =
        graph.keys().map(|n| (*n, reach(n))).collect();
    let mut out: Vec<Vec<ModPath>> = Vec::new();
    for (n, r) in &reaches {
        if !r.contains(*n) || out.iter().any(|c| c.contains(n)) {
            continue;
        }
        let group: Vec<ModPath> = r
            .iter()
            .filter(|m| reaches[m].contains(*n))
            .cloned()
            .collect();
        out.push(group);
    }
    out
}

fn crate_files(dir: &str) -> Vec<(String, String)> {
    fn walk(root: &Path, rel: &str, out: &mut Vec<(String, String)>) {
        for entry in std::fs::read_dir(root.join(rel)).unwrap() {
            let entry = entry.unwrap();
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = if rel.is_empty() {
                name.clone()
            } else {
                format!("{rel}/{name}")
            };
            if entry.file_type().unwrap().is_dir() {
                walk(root, &path, out);
            } else if name.ends_with(".rs") {
                out.push((path, std::fs::read_to_string(entry.path()).unwrap()));
            }
        }
    }
    let mut out = Vec::new();
    walk(&repo().join(dir), "", &mut out);
    out
}

fn describe(krate: &str, circle: &[ModPath], edges: &Edges) -> String {
    let name = |m: &ModPath| m.join("::");
    let mut text = format!(
        "{krate}: {}",
        circle.iter().map(name).collect::<Vec<_>>().join(" ")
    );
    for ((from, to), example) in edges {
        if circle.contains(from) && circle.contains(to) {
            text.push_str(&format!("\n    {} -> {} ({example})", name(from), name(to)));
        }
    }
    text
}

#[test]
fn no_module_circles_in_any_crate() {
    let architecture = std::fs::read_to_string(repo().join("docs/architecture.md")).unwrap();
    let mut problems = Vec::new();
    for (krate, dir) in CRATES {
        let edges = edges(&crate_files(dir));
        for circle in circles(&edges) {
            let key = circle
                .iter()
                .map(|m| m.join("::"))
                .collect::<Vec<_>>()
                .join(" ");
            let accepted = ACCEPTED.iter().any(|(k, c)| k == krate && *c == key);
            if !accepted {
                problems.push(describe(krate, &circle, &edges));
            }
        }
    }
    for (krate, circle) in ACCEPTED {
        assert!(
            architecture.contains(circle),
            "accepted circle {krate}: {circle} is not justified in docs/architecture.md"
        );
    }
    assert!(
        problems.is_empty(),
        "import circles between modules:\n{}",
        problems.join("\n")
    );
}

/// The checker itself: a circle made by hand is found, with the file that makes it;
/// parents and children referring to each other are not circles.
#[test]
fn a_hand_made_circle_is_found() {
    let file = |p: &str, s: &str| (p.to_owned(), s.to_owned());
    let files = vec![
        file("lib.rs", "pub mod a;\npub mod b;\nuse crate::a::X;"),
        file("a/mod.rs", "mod inner;\nuse self::inner::Y; pub struct X;"),
        file(
            "a/inner.rs",
            "use super::X;\nuse crate::b::{c::{Z as W}, self};",
        ),
        file(
            "b/mod.rs",
            "pub mod c;\n// use crate::a::X;\nlet s = \"crate::a\";",
        ),
        file("b/c.rs", "pub struct Z;\n#[cfg(test)]\nuse crate::a::X;"),
    ];
    let e = edges(&files);
    assert!(circles(&e).is_empty(), "{e:?}");
    let mut with_circle = files;
    with_circle.push(file("b/d.rs", "fn f() { crate::a::inner::g(); }"));
    let found = circles(&edges(&with_circle));
    assert_eq!(
        found,
        vec![vec![vec!["a".to_owned()], vec!["b".to_owned()]]]
    );
    assert!(describe("k", &found[0], &edges(&with_circle)).contains("b/d.rs: crate::a::inner::g"));
}
