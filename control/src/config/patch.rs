//! A strategic merge of config documents (`wirespan patch`): each document of a patch
//! is matched with the config's document of the same identity, then merged into it,
//! replaces it or deletes it; a patch document that matches none is added.
//!
//! Identity: the `kind`, and then the `name` for kinds with names, nothing more for
//! singleton kinds (`ClusterConfig`, `KubeSpanConfig`), and for kinds keyed by content
//! (`AddressConfig`, `RouteConfig`, `RoutingRuleConfig`) their merge key, which is
//! made of the fields that identify them, so such a patch document must be whole.
//!
//! A patch document's `$patch` says what to do: `merge` (the default: fields are
//! merged into the matching document, mappings recursively, a `null` value removes the
//! field, a list replaces the list), `replace` (the whole document), `delete` (the
//! document goes; it must exist).
//!
//! The config's documents that do not change keep their text byte for byte, comments
//! included; changed and new documents are written out anew (without comments).

use std::collections::BTreeMap;

use serde_yaml_ng::{Mapping, Value};

use super::{reference::KindReference, Document, API_VERSION};

/// The key of a patch document that says what to do with it.
pub const MARKER: &str = "$patch";

/// What a patch did to one document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A new document.
    Added(String),
    /// Fields merged into a document.
    Merged(String),
    /// A document replaced whole.
    Replaced(String),
    /// A document removed.
    Deleted(String),
}

impl std::fmt::Display for Change {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Added(d) => write!(f, "added {d}"),
            Self::Merged(d) => write!(f, "merged into {d}"),
            Self::Replaced(d) => write!(f, "replaced {d}"),
            Self::Deleted(d) => write!(f, "deleted {d}"),
        }
    }
}

/// A patch that cannot be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatchError {
    /// The config is not YAML (it cannot be, when it is the one in force).
    #[error("the config is not valid YAML: {0}")]
    Config(String),
    /// The patch is not YAML.
    #[error("the patch is not valid YAML: {0}")]
    Yaml(String),
    /// One patch document is unusable.
    #[error("patch document {position}: {message}")]
    Document {
        /// From 1.
        position: usize,
        /// What is wrong.
        message: String,
    },
}

/// The patched config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Patched {
    /// Its text (to validate whole before it is applied).
    pub text: String,
    /// What changed, in patch order.
    pub changes: Vec<Change>,
}

/// A document's identity: kind, and name or merge key.
type Id = (String, Option<String>);

fn describe((kind, key): &Id) -> String {
    match key {
        Some(k) => format!("{kind} {k:?}"),
        None => kind.clone(),
    }
}

/// One document of the config, with the text it came from.
#[derive(Debug)]
struct Chunk {
    /// Its `---` line, if any.
    separator: Option<String>,
    /// The text after it.
    text: String,
    /// The document (`None`: no document, only comments or blank lines).
    value: Option<Value>,
    /// Written out anew.
    changed: bool,
}

/// Applies `patch` to `config`.
///
/// # Errors
/// Either text is not YAML; a patch document has no identity, or deletes a document
/// that does not exist.
pub fn merge(config: &str, patch: &str) -> Result<Patched, PatchError> {
    let kinds: BTreeMap<&str, KindReference> = Document::reference()
        .into_iter()
        .map(|r| (r.kind, r))
        .collect();
    let mut chunks = split(config)?;
    let mut changes = Vec::new();
    for (i, doc) in stream(patch)
        .map_err(PatchError::Yaml)?
        .into_iter()
        .enumerate()
    {
        let fail = |message: String| PatchError::Document {
            position: i + 1,
            message,
        };
        let Value::Mapping(mut map) = doc else {
            return Err(fail("a document must be a mapping".to_owned()));
        };
        let action = match map.remove(MARKER) {
            None => "merge".to_owned(),
            Some(Value::String(s)) => s,
            Some(other) => return Err(fail(format!("{MARKER} must be a string, got {other:?}"))),
        };
        let id = identity(&map, &kinds).map_err(fail)?;
        let matching: Vec<usize> = chunks
            .iter()
            .enumerate()
            .filter(|(_, c)| {
                c.value
                    .as_ref()
                    .and_then(Value::as_mapping)
                    .and_then(|m| identity(m, &kinds).ok())
                    .as_ref()
                    == Some(&id)
            })
            .map(|(i, _)| i)
            .collect();
        let at = match matching.as_slice() {
            [] => None,
            [at] => Some(*at),
            _ => {
                return Err(fail(format!(
                    "{} matches {} documents of the config",
                    describe(&id),
                    matching.len()
                )))
            }
        };
        let change = match (action.as_str(), at) {
            ("delete", Some(at)) => {
                chunks.remove(at);
                Change::Deleted(describe(&id))
            }
            ("delete", None) => {
                return Err(fail(format!("{} is not in the config", describe(&id))));
            }
            ("merge" | "replace", None) => {
                chunks.push(Chunk {
                    separator: Some("---\n".to_owned()),
                    text: String::new(),
                    value: Some(Value::Mapping(map)),
                    changed: true,
                });
                Change::Added(describe(&id))
            }
            ("merge" | "replace", Some(at)) => {
                let chunk = &mut chunks[at];
                chunk.changed = true;
                if action == "replace" {
                    chunk.value = Some(Value::Mapping(map));
                    Change::Replaced(describe(&id))
                } else {
                    merge_value(chunk.value.get_or_insert(Value::Null), Value::Mapping(map));
                    Change::Merged(describe(&id))
                }
            }
            (other, _) => {
                return Err(fail(format!(
                    "{MARKER}: {other:?} is not merge, replace or delete"
                )))
            }
        };
        changes.push(change);
    }
    Ok(Patched {
        text: render(&chunks),
        changes,
    })
}

/// Merges `patch` into `target`: mappings key by key (recursively; `null` removes a
/// key), anything else replaced.
fn merge_value(target: &mut Value, patch: Value) {
    match (target, patch) {
        (Value::Mapping(t), Value::Mapping(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(&k);
                } else if let Some(existing) = t.get_mut(&k) {
                    merge_value(existing, v);
                } else {
                    t.insert(k, v);
                }
            }
        }
        (t, p) => *t = p,
    }
}

/// The identity of a document (see the module's doc).
fn identity(map: &Mapping, kinds: &BTreeMap<&str, KindReference>) -> Result<Id, String> {
    let kind = map
        .get("kind")
        .and_then(Value::as_str)
        .ok_or("kind is required (a string)")?;
    let Some(r) = kinds.get(kind) else {
        return Err(format!("unknown kind {kind:?}"));
    };
    if r.named {
        let name = map
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("a {kind} is identified by its name, which is missing"))?;
        return Ok((kind.to_owned(), Some(name.to_owned())));
    }
    if r.singleton || r.merge_key.is_none() {
        return Ok((kind.to_owned(), None));
    }
    // Keyed by content: the document, whole, says which one it is.
    let mut whole = map.clone();
    whole
        .entry(Value::from("apiVersion"))
        .or_insert_with(|| Value::from(API_VERSION));
    let text = serde_yaml_ng::to_string(&whole).map_err(|e| e.to_string())?;
    let what = r.merge_key.unwrap_or_default();
    let parsed = super::parse(&text).map_err(|e| {
        format!(
            "a {kind} is identified by its {what}, so its patch must be a whole document: {}",
            e.listed().join("; ")
        )
    })?;
    let key = parsed
        .documents
        .first()
        .and_then(Document::merge_key)
        .map(|(_, k)| k);
    Ok((kind.to_owned(), key))
}

/// The documents of a YAML stream (empty ones left out).
fn stream(text: &str) -> Result<Vec<Value>, String> {
    use serde::Deserialize as _;
    let mut docs = Vec::new();
    for de in serde_yaml_ng::Deserializer::from_str(text) {
        let v = Value::deserialize(de).map_err(|e| e.to_string())?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

fn is_separator(line: &str) -> bool {
    let bare = line.trim_end_matches(['\n', '\r']);
    bare == "---" || bare.starts_with("--- ") || bare.starts_with("---\t")
}

/// The config cut at its `---` lines, each piece with its document. When the pieces
/// do not read as the same documents as the whole (YAML this simple cut does not
/// handle), every document is written out anew instead.
fn split(config: &str) -> Result<Vec<Chunk>, PatchError> {
    let whole = stream(config).map_err(PatchError::Config)?;
    let mut pieces: Vec<(Option<String>, String)> = vec![(None, String::new())];
    for line in config.split_inclusive('\n') {
        if is_separator(line) {
            pieces.push((Some(line.to_owned()), String::new()));
        } else if let Some(last) = pieces.last_mut() {
            last.1.push_str(line);
        }
    }
    let mut chunks = Vec::new();
    for (separator, text) in pieces {
        let full = format!("{}{text}", separator.as_deref().unwrap_or(""));
        let value = stream(&full).ok().and_then(|mut v| match v.len() {
            1 => v.pop(),
            _ => None,
        });
        chunks.push(Chunk {
            separator,
            text,
            value,
            changed: false,
        });
    }
    let read: Vec<&Value> = chunks.iter().filter_map(|c| c.value.as_ref()).collect();
    if read.len() == whole.len() && read.iter().zip(&whole).all(|(a, b)| *a == b) {
        return Ok(chunks);
    }
    Ok(whole
        .into_iter()
        .map(|v| Chunk {
            separator: Some("---\n".to_owned()),
            text: String::new(),
            value: Some(v),
            changed: true,
        })
        .collect())
}

fn render(chunks: &[Chunk]) -> String {
    let mut out = String::new();
    for c in chunks {
        if !out.is_empty() && !out.ends_with('\n') {
            out.push('\n');
        }
        match (&c.value, c.changed) {
            (Some(v), true) => {
                if !out.is_empty() || c.separator.is_some() {
                    out.push_str("---\n");
                }
                out.push_str(&serde_yaml_ng::to_string(v).unwrap_or_default());
            }
            _ => {
                out.push_str(c.separator.as_deref().unwrap_or(""));
                out.push_str(&c.text);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = "# the mesh of rack 4\n\
apiVersion: v1alpha1\n\
kind: LinkConfig\n\
name: eth0\n\
mtu: 1400 # jumbo frames later\n\
---\n\
apiVersion: v1alpha1\n\
kind: AddressConfig\n\
link: eth0\n\
address: 10.0.0.1/24\n\
---\n\
apiVersion: v1alpha1\n\
kind: RouteConfig\n\
destination: 10.77.0.0/16\n\
gateway: 10.0.0.254\n\
link: eth0\n";

    fn changes(p: &Patched) -> Vec<String> {
        p.changes.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn a_named_document_is_merged_and_the_others_keep_their_text() {
        let p = merge(CONFIG, "kind: LinkConfig\nname: eth0\nmtu: 9000\n").unwrap();
        assert_eq!(changes(&p), ["merged into LinkConfig \"eth0\""]);
        assert!(
            p.text.starts_with(
                // Rewritten: its comments go.
                "apiVersion: v1alpha1\nkind: LinkConfig\nname: eth0\nmtu: 9000\n---\napiVersion: v1alpha1\nkind: AddressConfig\n"
            ),
            "{}",
            p.text
        );
        assert!(p.text.ends_with(
            &CONFIG[CONFIG
                .find("---\napiVersion: v1alpha1\nkind: AddressConfig")
                .unwrap()..]
        ));
        crate::config::parse(&p.text).unwrap();
    }

    #[test]
    fn documents_are_added_replaced_and_deleted() {
        let patch = "apiVersion: v1alpha1\nkind: LinkConfig\nname: eth1\nmtu: 1300\n\
---\n$patch: delete\nkind: RouteConfig\ndestination: 10.77.0.0/16\ngateway: 10.0.0.254\nlink: eth0\n\
---\n$patch: replace\napiVersion: v1alpha1\nkind: LinkConfig\nname: eth0\n";
        let p = merge(CONFIG, patch).unwrap();
        assert_eq!(
            changes(&p),
            [
                "added LinkConfig \"eth1\"",
                "deleted RouteConfig \"inet4/10.0.0.254/10.77.0.0/16/1024\"",
                "replaced LinkConfig \"eth0\""
            ]
        );
        let cfg = crate::config::parse(&p.text).unwrap();
        let kinds: Vec<_> = cfg
            .documents
            .iter()
            .map(|d| (d.kind(), d.name().map(str::to_owned)))
            .collect();
        assert_eq!(
            kinds,
            [
                ("LinkConfig", Some("eth0".to_owned())),
                ("AddressConfig", None),
                ("LinkConfig", Some("eth1".to_owned()))
            ]
        );
        assert!(!p.text.contains("mtu: 1400"), "replaced whole: {}", p.text);
        assert!(!p.text.contains(MARKER));
    }

    #[test]
    fn null_removes_a_field_and_mappings_merge_recursively() {
        let mut t: Value = serde_yaml_ng::from_str("a: 1\nb: {c: 2, d: 3}\nl: [1, 2]\n").unwrap();
        let p: Value = serde_yaml_ng::from_str("a: null\nb: {d: 4, e: 5}\nl: [3]\n").unwrap();
        merge_value(&mut t, p);
        let want: Value = serde_yaml_ng::from_str("b: {c: 2, d: 4, e: 5}\nl: [3]\n").unwrap();
        assert_eq!(t, want);
        let p = merge(CONFIG, "kind: LinkConfig\nname: eth0\nmtu: null\n").unwrap();
        assert!(!p.text.contains("mtu"), "{}", p.text);
    }

    #[test]
    fn a_singleton_is_matched_by_kind_alone() {
        let cfg = "apiVersion: v1alpha1\nkind: ClusterConfig\nid: a\nsecret: s\n";
        let p = merge(cfg, "kind: ClusterConfig\nid: b\n").unwrap();
        assert_eq!(changes(&p), ["merged into ClusterConfig"]);
        assert_eq!(
            p.text,
            "apiVersion: v1alpha1\nkind: ClusterConfig\nid: b\nsecret: s\n"
        );
    }

    #[test]
    fn unusable_patches_say_which_document_and_why() {
        let e = |patch: &str| merge(CONFIG, patch).unwrap_err().to_string();
        assert_eq!(
            e("name: eth0\nmtu: 1\n"),
            "patch document 1: kind is required (a string)"
        );
        assert_eq!(
            e("kind: LinkConfig\nmtu: 1\n"),
            "patch document 1: a LinkConfig is identified by its name, which is missing"
        );
        assert_eq!(
            e("kind: LinkConfig\nname: eth0\n---\n$patch: delete\nkind: LinkConfig\nname: eth5\n"),
            "patch document 2: LinkConfig \"eth5\" is not in the config"
        );
        assert!(e("kind: RouteConfig\ndestination: nowhere\n")
            .starts_with("patch document 1: a RouteConfig is identified by its table, family"));
        assert_eq!(
            e("$patch: remove\nkind: LinkConfig\nname: eth0\n"),
            "patch document 1: $patch: \"remove\" is not merge, replace or delete"
        );
        assert!(e("kind: [").starts_with("the patch is not valid YAML"));
    }

    #[test]
    fn a_config_the_cut_cannot_read_is_written_out_whole() {
        // A document in the `---` line itself.
        let cfg = "--- {apiVersion: v1alpha1, kind: LinkConfig, name: eth0}\n";
        let p = merge(cfg, "kind: LinkConfig\nname: eth1\napiVersion: v1alpha1\n").unwrap();
        let parsed = crate::config::parse(&p.text).unwrap();
        assert_eq!(parsed.documents.len(), 2, "{}", p.text);
    }
}
