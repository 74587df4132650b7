//! Every reference in README.md and docs/ resolves against the tree: source paths (with
//! a directory, bare file names after a cited directory, globs), directories, Rust module
//! paths (`dataplane::routing::NetworkConfig`), an item named in brackets after a path
//! (`dataplane/src/marking/ruleset.rs` (`render`)), `§N.M` section numbers and `#anchor`
//! links. A renamed or moved file, module or section fails here with the doc that cites
//! it.
//!
//! Pure reading of files: no binary, no network.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

/// Where a path that names a directory may start: the repository, docs/, each workspace
/// member and its `src/`.
const BASES: &[&str] = &[
    "",
    "docs/",
    "src/",
    "control/",
    "control/src/",
    "dataplane/",
    "dataplane/src/",
    "discovery/",
    "discovery/src/",
    "discovery/proto/wirespan/",
    "bench/",
    "bench/src/",
    "ebpf/",
    "ebpf/src/",
];

/// Crate names, as written in docs, and the folder holding the crate root.
const CRATES: &[(&str, &str)] = &[
    ("wirespan", "src"),
    ("control", "control/src"),
    ("wirespan_control", "control/src"),
    ("dataplane", "dataplane/src"),
    ("wirespan_dataplane", "dataplane/src"),
    ("discovery", "discovery/src"),
    ("wirespan_discovery", "discovery/src"),
    ("bench", "bench/src"),
    ("wirespan_bench", "bench/src"),
    ("ebpf", "ebpf/src"),
    ("wirespan_ebpf", "ebpf/src"),
];

/// File kinds whose citations are checked.
const CHECKED_EXTENSIONS: &[&str] = &[
    "rs", "c", "h", "proto", "sh", "toml", "py", "md", "json", "yaml",
];

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The repository's files and folders, relative, `/`-separated (no `target/`, no `.git`).
struct Tree {
    files: BTreeSet<String>,
    dirs: BTreeSet<String>,
}

impl Tree {
    fn load() -> Tree {
        let mut tree = Tree {
            files: BTreeSet::new(),
            dirs: BTreeSet::new(),
        };
        tree.walk("");
        tree
    }

    fn walk(&mut self, rel: &str) {
        for entry in std::fs::read_dir(repo().join(rel)).unwrap() {
            let entry = entry.unwrap();
            let name = entry.file_name().to_string_lossy().into_owned();
            if rel.is_empty() && (name == "target" || name.starts_with('.')) {
                continue;
            }
            let path = format!("{rel}{name}");
            if entry.file_type().unwrap().is_dir() {
                self.dirs.insert(format!("{path}/"));
                self.walk(&format!("{path}/"));
            } else {
                self.files.insert(path);
            }
        }
    }

    fn read(&self, file: &str) -> String {
        std::fs::read_to_string(repo().join(file)).unwrap_or_default()
    }

    /// Files matching `pattern` (`*` matches within one path segment).
    fn matching(&self, pattern: &str) -> impl Iterator<Item = &String> {
        let pattern = pattern.to_owned();
        self.files.iter().filter(move |f| glob_match(&pattern, f))
    }

    /// A relative path (file, folder or glob) under one of `BASES`, or from `doc_dir`.
    fn resolves(&self, doc_dir: &str, path: &str) -> bool {
        let mut bases: Vec<String> = BASES.iter().map(|b| (*b).to_owned()).collect();
        bases.push(doc_dir.to_owned());
        bases.iter().any(|base| {
            let full = normalise(&format!("{base}{path}"));
            if path.ends_with('/') {
                self.dirs.contains(&full)
            } else if path.contains('*') {
                self.matching(&full).next().is_some()
            } else {
                self.files.contains(&full)
            }
        })
    }

    /// The `.rs` files of `module`: its file and everything under its folder.
    fn module_files(&self, module: &Module) -> Vec<String> {
        let mut out = vec![module.file.clone()];
        if let Some(dir) = &module.dir {
            out.extend(
                self.files
                    .iter()
                    .filter(|f| f.starts_with(dir.as_str()) && f.ends_with(".rs"))
                    .cloned(),
            );
        }
        out
    }
}

/// Removes `x/../` pairs.
fn normalise(path: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    for seg in path.split('/') {
        if seg == ".." && out.last().is_some_and(|s| *s != "..") {
            out.pop();
        } else {
            out.push(seg);
        }
    }
    out.join("/")
}

fn glob_match(pattern: &str, text: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == text,
        Some((head, tail)) => {
            let Some(rest) = text.strip_prefix(head) else {
                return false;
            };
            // `*` stays within one segment.
            (0..=rest.len())
                .take_while(|&i| !rest[..i].contains('/'))
                .any(|i| rest.is_char_boundary(i) && glob_match(tail, &rest[i..]))
        }
    }
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

fn contains_word(text: &str, word: &str) -> bool {
    text.match_indices(word).any(|(i, _)| {
        let before = text[..i].chars().next_back();
        let after = text[i + word.len()..].chars().next();
        !before.is_some_and(is_ident_char) && !after.is_some_and(is_ident_char)
    })
}

/// Keywords that declare an item in the file itself.
const ITEM_KEYWORDS: &[&str] = &[
    "fn ",
    "struct ",
    "enum ",
    "union ",
    "trait ",
    "type ",
    "const ",
    "static ",
    "macro_rules! ",
];

/// `name` is declared in `source` (function, type, constant, macro) or is a module
/// declared there.
fn defines(source: &str, name: &str) -> bool {
    declares_item(source, name) || contains_word(source, &format!("mod {name}"))
}

/// `name` is an item whose body is in `source` (not a `mod name;` pointing elsewhere).
fn declares_item(source: &str, name: &str) -> bool {
    ITEM_KEYWORDS
        .iter()
        .any(|kw| contains_word(source, &format!("{kw}{name}")))
}

/// `name` is declared in `source` or re-exported by one of its `use` statements.
fn defines_or_exports(source: &str, name: &str) -> bool {
    defines(source, name)
        || source.split("use ").skip(1).any(|stmt| {
            let stmt = stmt.split(';').next().unwrap_or("");
            contains_word(stmt, name)
        })
}

/// A module: its file (`x.rs` or `x/mod.rs`) and, when it has one, its folder.
struct Module {
    file: String,
    dir: Option<String>,
}

fn module_at(tree: &Tree, path: &str) -> Option<Module> {
    let dir = format!("{path}/");
    let has_dir = tree.dirs.contains(&dir);
    let file = [
        format!("{path}.rs"),
        format!("{path}/mod.rs"),
        format!("{path}/lib.rs"),
        format!("{path}/main.rs"),
    ]
    .into_iter()
    .find(|f| tree.files.contains(f))?;
    Some(Module {
        file,
        dir: has_dir.then_some(dir),
    })
}

/// Resolves `segments` below module path `base` (no extension): each segment a
/// submodule, then an item declared or re-exported in the module reached, then names
/// that occur in that module (methods, fields, variants).
fn resolve_below(tree: &Tree, base: &str, segments: &[&str]) -> bool {
    let Some(module) = module_at(tree, base) else {
        return false;
    };
    let Some((first, rest)) = segments.split_first() else {
        return true;
    };
    let sub = match &module.dir {
        Some(dir) => format!("{dir}{first}"),
        None => format!("{base}/{first}"),
    };
    if module_at(tree, &sub).is_some() {
        return resolve_below(tree, &sub, rest);
    }
    let files = tree.module_files(&module);
    let sources: Vec<String> = files.iter().map(|f| tree.read(f)).collect();
    if !defines_or_exports(&sources[0], first) && !sources.iter().any(|s| defines(s, first)) {
        return false;
    }
    rest.iter()
        .all(|name| sources.iter().any(|s| contains_word(s, name)))
}

/// Resolves a Rust path as written in a doc: from a crate name, from any module of that
/// name in the workspace, or from a type declared somewhere. `None`: not a wirespan path
/// (`std::…`, `tokio::…`).
fn resolve_rust_path(tree: &Tree, path: &str) -> Option<bool> {
    let segments: Vec<&str> = path.split("::").collect();
    if segments
        .iter()
        .any(|s| s.is_empty() || !s.chars().all(is_ident_char))
    {
        return None;
    }
    let (first, rest) = segments.split_first()?;
    let mut bases: Vec<String> = CRATES
        .iter()
        .filter(|(name, _)| name == first)
        .map(|(_, dir)| (*dir).to_owned())
        .collect();
    let from_crate = !bases.is_empty();
    if !from_crate {
        // A module of that name anywhere in a crate's sources.
        for file in &tree.files {
            let Some(stem) = file.strip_suffix(".rs") else {
                continue;
            };
            let stem = stem.strip_suffix("/mod").unwrap_or(stem);
            if stem.rsplit('/').next() == Some(first) && stem.contains("src/") {
                bases.push(stem.to_owned());
            }
        }
    }
    if !bases.is_empty() {
        return Some(bases.iter().any(|b| {
            if from_crate {
                resolve_crate_root(tree, b, rest)
            } else {
                resolve_below(tree, b, rest)
            }
        }));
    }
    if first.starts_with(|c: char| c.is_ascii_uppercase()) {
        // `Type::member`: the type is declared in some file that also names the member.
        let declared_somewhere = tree.files.iter().filter(|f| f.ends_with(".rs")).any(|f| {
            let source = tree.read(f);
            defines(&source, first) && rest.iter().all(|name| contains_word(&source, name))
        });
        return Some(declared_somewhere);
    }
    None
}

/// A crate root is `dir/lib.rs` or `dir/main.rs` with its modules beside it.
fn resolve_crate_root(tree: &Tree, dir: &str, segments: &[&str]) -> bool {
    let Some((first, rest)) = segments.split_first() else {
        return true;
    };
    let sub = format!("{dir}/{first}");
    if module_at(tree, &sub).is_some() {
        return resolve_below(tree, &sub, rest);
    }
    ["lib.rs", "main.rs"].iter().any(|root| {
        let source = tree.read(&format!("{dir}/{root}"));
        defines_or_exports(&source, first)
    })
}

/// The text of a doc with the positions of its inline code spans.
struct Doc {
    name: String,
    dir: String,
    text: String,
    /// `(start, end)` byte ranges of the text inside single backticks.
    spans: Vec<(usize, usize)>,
}

impl Doc {
    fn load(rel: &str) -> Doc {
        let text = std::fs::read_to_string(repo().join(rel)).unwrap();
        let dir = rel.rsplit_once('/').map_or("", |(d, _)| d);
        let dir = if dir.is_empty() {
            String::new()
        } else {
            format!("{dir}/")
        };
        let mut spans = Vec::new();
        let mut open = None;
        for (i, c) in text.char_indices() {
            if c != '`' {
                continue;
            }
            let fence = text[i..].starts_with("```") || text[..i].ends_with('`');
            if fence {
                open = None;
                continue;
            }
            match open.take() {
                None => open = Some(i + 1),
                Some(start) => spans.push((start, i)),
            }
        }
        Doc {
            name: rel.to_owned(),
            dir,
            text,
            spans,
        }
    }

    fn span(&self, i: usize) -> &str {
        &self.text[self.spans[i].0..self.spans[i].1]
    }
}

/// Headings outside code fences: `(section number if any, GitHub anchor)`.
fn headings(text: &str) -> Vec<(Option<String>, String)> {
    let mut out = Vec::new();
    let mut in_fence = false;
    for line in text.lines() {
        if line.starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence || !line.starts_with('#') {
            continue;
        }
        let title = line.trim_start_matches('#').trim();
        let number: String = title
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        let number = number.trim_end_matches('.');
        let number = (!number.is_empty()).then(|| number.to_owned());
        out.push((number, anchor(title)));
    }
    out
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces to `-`.
fn anchor(title: &str) -> String {
    title
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// Tokens that may be paths: runs of path characters, with trailing dots dropped.
fn path_tokens(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || "_./*-".contains(c)))
        .map(|t| t.trim_end_matches('.'))
        .filter(|t| !t.is_empty())
}

fn checked_extension(token: &str) -> bool {
    let name = token.rsplit('/').next().unwrap_or(token);
    name.rsplit_once('.')
        .is_some_and(|(stem, ext)| !stem.is_empty() && CHECKED_EXTENSIONS.contains(&ext))
}

/// A bare name of a file kept in the repository (not a runtime file such as
/// `last-good-config.yaml`).
fn source_file_name(token: &str) -> bool {
    token.rsplit_once('.').is_some_and(|(stem, ext)| {
        !stem.is_empty() && ["rs", "c", "h", "proto", "sh", "toml", "py", "md"].contains(&ext)
    })
}

/// Paths with a folder, anywhere in the text (prose, tables, code blocks).
fn check_paths(tree: &Tree, doc: &Doc, problems: &mut Vec<String>) {
    for token in path_tokens(&doc.text) {
        let first = token.split('/').next().unwrap_or("");
        let placeholder = first.chars().all(|c| c.is_ascii_uppercase() || c == '_');
        if !token.contains('/')
            || token.starts_with('/')
            || token.starts_with("./")
            || placeholder
            || !checked_extension(token)
        {
            continue;
        }
        if !tree.resolves(&doc.dir, token) {
            problems.push(format!("{}: no file {token}", doc.name));
        }
    }
}

/// Inline code: folders, bare file names (under the folder cited last in the same
/// paragraph or table row, else anywhere), and an item named in brackets after a path.
fn check_code_spans(tree: &Tree, doc: &Doc, problems: &mut Vec<String>) {
    let mut last_dir: Option<(usize, String)> = None;
    for i in 0..doc.spans.len() {
        let span = doc.span(i);
        let start = doc.spans[i].0;
        if let Some((at, _)) = &last_dir {
            let between = &doc.text[*at..start];
            if between.contains("\n\n") || between.contains("\n|") {
                last_dir = None;
            }
        }
        let relative = !span.starts_with('/') && !span.contains("://") && !span.contains(' ');
        let one_segment = span.len() > 1 && !span.trim_end_matches('/').contains('/');
        let inside_last = last_dir
            .as_ref()
            .is_some_and(|(_, dir)| tree.resolves(&doc.dir, &format!("{dir}{span}")));
        if relative && span.ends_with('/') && one_segment && inside_last {
            // `state/` beside a cited folder is inside it.
        } else if relative && span.ends_with('/') && span.len() > 1 {
            if !tree.resolves(&doc.dir, span) {
                problems.push(format!("{}: no folder {span}", doc.name));
            }
            last_dir = Some((start, span.to_owned()));
        } else if relative && !span.contains('/') && source_file_name(span) {
            let ok = match &last_dir {
                Some((_, dir)) => tree.resolves(&doc.dir, &format!("{dir}{span}")),
                None => tree
                    .files
                    .iter()
                    .any(|f| f.rsplit('/').next() == Some(span)),
            };
            if !ok {
                let under = last_dir
                    .as_ref()
                    .map_or(String::new(), |(_, d)| format!(" in {d}"));
                problems.push(format!("{}: no file {span}{under}", doc.name));
            }
        }
        if relative && (span.ends_with(".rs") || span.ends_with('/')) && span.contains('/') {
            check_bracketed_item(tree, doc, i, problems);
        }
    }
}

/// `` `path` (`name` ``: `name` is declared in that file, or in a file under that
/// folder.
fn check_bracketed_item(tree: &Tree, doc: &Doc, i: usize, problems: &mut Vec<String>) {
    let path = doc.span(i);
    let Some(next) = doc.spans.get(i + 1) else {
        return;
    };
    if &doc.text[doc.spans[i].1..next.0] != "` (`" {
        return;
    }
    let item = doc.span(i + 1).trim_end_matches("()");
    if item.is_empty() || !item.chars().all(is_ident_char) {
        return;
    }
    let files: Vec<String> = BASES
        .iter()
        .map(|b| normalise(&format!("{b}{path}")))
        .flat_map(|full| {
            if full.ends_with('/') {
                tree.files
                    .iter()
                    .filter(|f| f.starts_with(&full) && f.ends_with(".rs"))
                    .cloned()
                    .collect()
            } else {
                vec![full]
            }
        })
        .filter(|f| tree.files.contains(f))
        .collect();
    if !files.iter().any(|f| declares_item(&tree.read(f), item)) {
        problems.push(format!("{}: {path} declares no {item}", doc.name));
    }
}

/// Rust paths (`a::b::c`) of wirespan's crates, anywhere in the text; `Type::member`
/// only in inline code (code blocks hold pseudo-code such as `K::merge`).
fn check_rust_paths(tree: &Tree, doc: &Doc, problems: &mut Vec<String>) {
    let tokens = doc
        .text
        .split(|c: char| !(is_ident_char(c) || c == ':'))
        .map(|t| t.trim_matches(':'))
        .filter(|t| t.contains("::"));
    let inline: Vec<&str> = (0..doc.spans.len()).map(|i| doc.span(i)).collect();
    for token in tokens {
        let type_path = token.starts_with(|c: char| c.is_ascii_uppercase());
        if type_path && !inline.iter().any(|s| s.contains(token)) {
            continue;
        }
        if resolve_rust_path(tree, token) == Some(false) {
            problems.push(format!("{}: no Rust item {token}", doc.name));
        }
    }
}

/// The doc a `§` at `at` refers to: the last doc named earlier in the same sentence,
/// table cell or paragraph, else `doc` itself.
fn section_target<'a>(doc: &'a Doc, at: usize, docs: &'a [String]) -> &'a str {
    let before = &doc.text[..at];
    let boundary = ["\n\n", "|", ". ", ".\n"]
        .iter()
        .filter_map(|b| before.rfind(b).map(|i| i + b.len()))
        .max()
        .unwrap_or(0);
    let window = &before[boundary..];
    docs.iter()
        .filter_map(|d| {
            let file = d.rsplit('/').next().unwrap();
            window.rfind(file).map(|i| (i, d.as_str()))
        })
        .max()
        .map_or(doc.name.as_str(), |(_, d)| d)
}

/// `§N.M` exists in the doc it refers to; `#anchor` links land on a heading.
fn check_sections(
    doc: &Doc,
    docs: &[String],
    heads: &BTreeMap<String, Vec<(Option<String>, String)>>,
    problems: &mut Vec<String>,
) {
    for (at, _) in doc.text.match_indices('§') {
        let rest = &doc.text[at + '§'.len_utf8()..];
        let number: String = rest
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        let number = number.trim_end_matches('.');
        if number.is_empty() {
            continue;
        }
        let target = section_target(doc, at, docs);
        let sections = &heads[target];
        if sections.iter().all(|(n, _)| n.is_none()) {
            problems.push(format!(
                "{}: §{number} refers to {target}, which has no numbered sections (name the document)",
                doc.name
            ));
        } else if !sections.iter().any(|(n, _)| n.as_deref() == Some(number)) {
            problems.push(format!("{}: {target} has no §{number}", doc.name));
        }
    }
    for (at, _) in doc.text.match_indices("](") {
        let rest = &doc.text[at + 2..];
        let target = &rest[..rest.find(')').unwrap_or(0)];
        let Some((file, fragment)) = target.split_once('#') else {
            continue;
        };
        if target.contains("://") {
            continue;
        }
        let file = if file.is_empty() {
            doc.name.clone()
        } else {
            normalise(&format!("{}{file}", doc.dir))
        };
        let Some(sections) = heads.get(&file) else {
            continue;
        };
        if !sections.iter().any(|(_, a)| a == fragment) {
            problems.push(format!("{}: {file} has no heading #{fragment}", doc.name));
        }
    }
}

fn doc_names(tree: &Tree) -> Vec<String> {
    let mut docs: Vec<String> = tree
        .files
        .iter()
        .filter(|f| f.starts_with("docs/") && f.ends_with(".md") && !f[5..].contains('/'))
        .cloned()
        .collect();
    docs.push("README.md".to_owned());
    docs
}

fn problems_in(tree: &Tree) -> Vec<String> {
    let names = doc_names(tree);
    let docs: Vec<Doc> = names.iter().map(|n| Doc::load(n)).collect();
    let heads: BTreeMap<String, _> = docs
        .iter()
        .map(|d| (d.name.clone(), headings(&d.text)))
        .collect();
    let mut problems = Vec::new();
    for doc in &docs {
        check_paths(tree, doc, &mut problems);
        check_code_spans(tree, doc, &mut problems);
        check_rust_paths(tree, doc, &mut problems);
        check_sections(doc, &names, &heads, &mut problems);
    }
    problems.dedup();
    problems
}

#[test]
fn every_reference_in_the_docs_resolves() {
    let problems = problems_in(&Tree::load());
    assert!(
        problems.is_empty(),
        "{} unresolved references:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn the_checker_catches_what_it_is_for() {
    let tree = Tree::load();
    assert!(tree.resolves("docs/", "control/src/kubespan/ula.rs"));
    assert!(tree.resolves("docs/", "kubespan/ula.rs"));
    assert!(!tree.resolves("docs/", "control/src/kubespan/ula_renamed.rs"));
    assert!(tree.resolves("docs/", "tests/bench_*.rs"));
    assert_eq!(resolve_rust_path(&tree, "dataplane::routing"), Some(true));
    assert_eq!(
        resolve_rust_path(&tree, "dataplane::routing::Nope"),
        Some(false)
    );
    assert_eq!(resolve_rust_path(&tree, "tokio::sync::Notify"), None);
    assert_eq!(
        anchor("8.8 Defending the own affiliate"),
        "88-defending-the-own-affiliate"
    );
    assert!(glob_match("a/*.rs", "a/b.rs") && !glob_match("a/*.rs", "a/b/c.rs"));
}
