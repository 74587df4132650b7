//! The configuration reference (`wirespan docs config`, committed as
//! `docs/config-reference.md`), rendered from the document types: their kinds and
//! multiplicity from [`ConfigDocument`], their fields, types and defaults from their
//! JSON schemas (`schemars`, which follows the serde attributes), and the prose from
//! their doc comments. A doc-comment paragraph starting with `Valid:` is the field's
//! validation rule; it must say what `validate` checks.

use std::fmt::Write as _;

use serde_json::Value;

use super::{ConfigDocument, API_VERSION, MAX_CONFIG_BYTES};

/// What the reference says about one document kind.
#[derive(Debug, Clone)]
pub struct KindReference {
    /// The `kind`.
    pub kind: &'static str,
    /// At most one per config.
    pub singleton: bool,
    /// The kind has a `name` that must be unique.
    pub named: bool,
    /// What two documents of this kind must not share, if anything.
    pub merge_key: Option<&'static str>,
    /// Field names in declaration order (as serde reads them).
    pub fields: &'static [&'static str],
    /// The JSON schema of the document body.
    pub schema: Value,
}

impl KindReference {
    /// The reference of document type `D`.
    #[must_use]
    pub fn of<D: ConfigDocument + schemars::JsonSchema + Default>() -> Self {
        let sample = D::default();
        Self {
            kind: D::KIND,
            singleton: D::SINGLETON,
            named: sample.name().is_some(),
            merge_key: sample.merge_key().map(|(what, _)| what),
            fields: field_order::<D>(),
            schema: schemars::schema_for!(D).to_value(),
        }
    }
}

/// The field names of a derived `Deserialize` struct, in declaration order: serde's
/// derive passes them to `deserialize_struct`, which this deserializer records and
/// then refuses.
fn field_order<'de, D: serde::Deserialize<'de>>() -> &'static [&'static str] {
    use serde::de::{self, Visitor};

    #[derive(Debug)]
    struct Found(&'static [&'static str]);
    impl std::fmt::Display for Found {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("field list")
        }
    }
    impl std::error::Error for Found {}
    impl de::Error for Found {
        fn custom<T: std::fmt::Display>(_: T) -> Self {
            Self(&[])
        }
    }
    struct Probe;
    impl<'de> de::Deserializer<'de> for Probe {
        type Error = Found;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Found> {
            Err(Found(&[]))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Found> {
            Err(Found(fields))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map
            enum identifier ignored_any
        }
    }
    match D::deserialize(Probe) {
        Ok(_) => &[],
        Err(Found(fields)) => fields,
    }
}

/// One row of a kind's field table.
#[derive(Debug, Default, PartialEq)]
struct Row {
    field: String,
    ty: String,
    default: String,
    description: String,
    valid: String,
}

/// The description of a schema split into prose and `Valid:` rules, each paragraph on
/// one line.
fn prose(schema: &Value) -> (Vec<String>, Vec<String>) {
    let text = schema
        .get("description")
        .and_then(Value::as_str)
        .unwrap_or("");
    let mut plain = Vec::new();
    let mut valid = Vec::new();
    for para in text.split("\n\n") {
        let line = para.split_whitespace().collect::<Vec<_>>().join(" ");
        if line.is_empty() {
            continue;
        }
        match line.strip_prefix("Valid:") {
            Some(rule) => valid.push(rule.trim().to_owned()),
            None => plain.push(line),
        }
    }
    (plain, valid)
}

/// `schema` with a `$ref` to the root's `$defs` followed.
fn resolve<'a>(root: &'a Value, schema: &'a Value) -> &'a Value {
    match schema
        .get("$ref")
        .and_then(Value::as_str)
        .and_then(|r| r.strip_prefix("#/$defs/"))
    {
        Some(name) => root["$defs"].get(name).unwrap_or(schema),
        None => schema,
    }
}

/// `schema` without a `null` alternative (an `Option`).
fn non_null<'a>(root: &'a Value, schema: &'a Value) -> &'a Value {
    let schema = resolve(root, schema);
    for key in ["anyOf", "oneOf"] {
        if let Some(alts) = schema.get(key).and_then(Value::as_array) {
            let rest: Vec<&Value> = alts
                .iter()
                .filter(|a| a.get("type").and_then(Value::as_str) != Some("null"))
                .collect();
            if rest.len() == 1 && rest.len() < alts.len() {
                return resolve(root, rest[0]);
            }
        }
    }
    schema
}

/// The values of a string enum, with their descriptions.
fn enum_values(schema: &Value) -> Option<Vec<(String, String)>> {
    if let Some(values) = schema.get("enum").and_then(Value::as_array) {
        return Some(
            values
                .iter()
                .filter_map(Value::as_str)
                .map(|v| (v.to_owned(), String::new()))
                .collect(),
        );
    }
    let alts = schema.get("oneOf")?.as_array()?;
    alts.iter()
        .map(|a| {
            let value = a.get("const").and_then(Value::as_str)?;
            Some((value.to_owned(), prose(a).0.join(" ")))
        })
        .collect()
}

/// The type of a (non-null) schema in words.
fn type_name(root: &Value, schema: &Value) -> String {
    let schema = non_null(root, schema);
    if let Some(values) = enum_values(schema) {
        let list: Vec<String> = values.iter().map(|(v, _)| format!("`{v}`")).collect();
        return format!("one of {}", list.join(", "));
    }
    let ty = match schema.get("type") {
        Some(Value::String(t)) => t.as_str(),
        // `["string", "null"]`: an `Option` of a simple type.
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .find(|t| *t != "null")
            .unwrap_or("any"),
        _ => "any",
    };
    let format = schema.get("format").and_then(Value::as_str);
    match (ty, format) {
        ("string", Some("cidr")) => "CIDR (`10.0.0.0/8`, `fd00::/64`)".to_owned(),
        ("string", Some("ip")) => "IP address".to_owned(),
        ("string", Some("ip-port")) => "`ip:port` (IPv6 as `[addr]:port`)".to_owned(),
        ("string", Some("duration")) => "duration (`10s`, `1m30s`, `500ms`)".to_owned(),
        ("string", Some("secret")) => "string, secret".to_owned(),
        ("string", _) => "string".to_owned(),
        ("boolean", _) => "bool".to_owned(),
        ("integer", Some(f)) => format!("integer ({})", int_format(f)),
        ("integer", None) => "integer".to_owned(),
        ("array", _) => {
            let items = schema.get("items").unwrap_or(&Value::Null);
            format!("list of {}", type_name(root, items))
        }
        ("object", _) => "mapping".to_owned(),
        (other, _) => other.to_owned(),
    }
}

fn int_format(format: &str) -> &str {
    match format {
        "uint16" => "u16",
        "uint32" => "u32",
        "int64" => "i64",
        "uint64" => "u64",
        other => other,
    }
}

/// A default value as it would be written in YAML.
fn show_default(value: &Value, hex: bool) -> String {
    match value {
        Value::Null => "unset".to_owned(),
        Value::String(s) if s.is_empty() => "unset".to_owned(),
        Value::Number(n) if hex => n
            .as_u64()
            .map_or_else(|| n.to_string(), |v| format!("`{v:#x}`")),
        Value::String(s) => format!("`{s}`"),
        Value::Array(a) if a.is_empty() => "`[]`".to_owned(),
        Value::Object(o) if o.is_empty() => "`{}`".to_owned(),
        other => format!("`{other}`"),
    }
}

/// The rows of an object schema's properties, nested objects flattened with dotted
/// names.
fn rows(
    root: &Value,
    object: &Value,
    order: &[&str],
    prefix: &str,
    parent_default: Option<&Value>,
    out: &mut Vec<Row>,
) {
    let Some(props) = object.get("properties").and_then(Value::as_object) else {
        return;
    };
    let required: Vec<&str> = object
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    // Declaration order where known, then the rest by name.
    let mut names: Vec<&str> = order
        .iter()
        .copied()
        .filter(|n| props.contains_key(*n))
        .collect();
    names.extend(
        props
            .keys()
            .map(String::as_str)
            .filter(|n| !order.contains(n)),
    );
    for name in names {
        let prop = &props[name];
        let field = format!("{prefix}{name}");
        let target = non_null(root, prop);
        let default = prop
            .get("default")
            .or_else(|| parent_default.and_then(|d| d.get(name)));
        let (mut description, valid) = prose(prop);
        if description.is_empty() {
            description = prose(target).0;
        }
        if let Some(values) = enum_values(target) {
            description.extend(
                values
                    .iter()
                    .filter(|(_, d)| !d.is_empty())
                    .map(|(v, d)| format!("`{v}`: {d}")),
            );
        }
        if target.get("properties").is_some() {
            out.push(Row {
                field: field.clone(),
                ty: "mapping".to_owned(),
                default: "see below".to_owned(),
                description: description.join(" "),
                valid: valid.join(" "),
            });
            rows(root, target, &[], &format!("{field}."), default, out);
            continue;
        }
        let hex = prop.get("x-hex").and_then(Value::as_bool) == Some(true);
        // `x-required`: absent reads as a default that validation rejects.
        let must = required.contains(&name)
            || prop.get("x-required").and_then(Value::as_bool) == Some(true);
        let default = if must {
            "required".to_owned()
        } else {
            default.map_or_else(|| "unset".to_owned(), |d| show_default(d, hex))
        };
        out.push(Row {
            field,
            ty: type_name(root, prop),
            default,
            description: description.join(" "),
            valid: valid.join(" "),
        });
    }
}

/// Escapes what would break a table cell.
fn cell(text: &str) -> String {
    if text.is_empty() {
        "—".to_owned()
    } else {
        text.replace('|', "\\|")
    }
}

/// The section of one kind.
fn kind_section(k: &KindReference, out: &mut String) {
    let (about, rules) = prose(&k.schema);
    let _ = writeln!(out, "## {}\n", k.kind);
    for para in &about {
        let _ = writeln!(out, "{para}\n");
    }
    let mut how_many = if k.singleton {
        "At most one per config.".to_owned()
    } else if k.named {
        "Any number per config, each with a `name` of its own.".to_owned()
    } else {
        "Any number per config.".to_owned()
    };
    if let Some(key) = k.merge_key {
        let _ = write!(how_many, " No two may have the same {key}.");
    }
    let _ = writeln!(out, "- **How many:** {how_many}");
    for rule in &rules {
        let _ = writeln!(out, "- **Valid:** {rule}");
    }
    out.push('\n');
    let mut table = Vec::new();
    rows(&k.schema, &k.schema, k.fields, "", None, &mut table);
    let _ = writeln!(out, "| Field | Type | Default | Description | Valid |");
    let _ = writeln!(out, "|---|---|---|---|---|");
    for r in &table {
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} | {} |",
            r.field,
            cell(&r.ty),
            cell(&r.default),
            cell(&r.description),
            cell(&r.valid)
        );
    }
    out.push('\n');
}

/// The whole reference, as markdown.
#[must_use]
pub fn markdown(kinds: &[KindReference]) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "\
# Configuration reference

<!-- Generated by `wirespan docs config` from the config types in
     control/src/config/; do not edit. Regenerate with
     `wirespan docs config --out docs/config-reference.md`. -->

`wirespan node --config FILE` reads one YAML file of several documents separated by
`---`. Every document has `apiVersion: {API_VERSION}` and a `kind`; the other keys
are the fields of that kind below.

- The whole file is validated before anything is applied. A file with any error is
  rejected whole, every error naming the document (position, kind, name) and the
  field, and the config in force stays. An empty file is an error too (turn the mesh
  off with `enabled: false`), and so is a file over {max} bytes ({mib} MiB).
- Limits that keep a hostile file cheap: a file nested deeper than {depth} levels
  (flow `[`/`{{`, block indentation and `- ` markers counted together) is refused
  before it is parsed, naming the document and line; an error lists at most
  {listed} problems, each cut to {problem_bytes} bytes, then `and N more problems`
  (in `wirespan apply`'s reply, the log and `wirespan get configstatus`).
- Unknown fields are errors, field names are case-sensitive, and an empty document
  (a trailing `---`) is skipped.
- Integers may be written in decimal or hex (`0x20`). A field marked *required*
  must be present; *unset* means the field is absent and the description says what
  that means.
- The accepted text is kept in the state dir as `{last_good}` (0600); a node
  started with a bad or missing file starts from it.
- Check a file without applying it: `wirespan doctor --config FILE` (offline), or
  `wirespan apply --dry-run FILE` (on a running node).
- Change a running node's config on trial with `wirespan apply --mode try` (rolled
  back unless `wirespan apply --confirm` comes in time), or part of it with `wirespan
  patch` (documents matched by kind and name) and `wirespan edit`: see
  `docs/operations.md` §2.4.

| Kind | How many |
|---|---|
",
        max = MAX_CONFIG_BYTES,
        mib = MAX_CONFIG_BYTES >> 20,
        depth = super::depth::MAX_DEPTH,
        listed = super::MAX_LISTED_PROBLEMS,
        problem_bytes = super::MAX_PROBLEM_BYTES,
        last_good = super::LAST_GOOD_FILE,
    );
    for k in kinds {
        let how = if k.singleton {
            "at most one"
        } else {
            "any number"
        };
        let _ = writeln!(
            out,
            "| [`{}`](#{}) | {how} |",
            k.kind,
            k.kind.to_ascii_lowercase()
        );
    }
    out.push('\n');
    for k in kinds {
        kind_section(k, &mut out);
    }
    while out.ends_with("\n\n") {
        out.pop();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Document;

    #[test]
    fn every_kind_and_field_is_in_the_reference() {
        let kinds = Document::reference();
        assert_eq!(
            kinds.iter().map(|k| k.kind).collect::<Vec<_>>(),
            Document::KINDS
        );
        let md = markdown(&kinds);
        for k in &kinds {
            assert!(md.contains(&format!("## {}\n", k.kind)), "{}", k.kind);
            assert!(!k.fields.is_empty(), "{}", k.kind);
            for f in k.fields {
                assert!(md.contains(&format!("| `{f}` |")), "{}.{f}", k.kind);
            }
        }
    }

    #[test]
    fn defaults_types_and_rules_come_from_the_types() {
        let md = markdown(&Document::reference());
        for want in [
            "| `listenPort` | integer (u16) | `51820` |",
            "| `deviceMark` | integer (u32) | `0x20` |",
            "| `fastPath` | one of `nftables`, `ebpf` | `nftables` |",
            "| `filters.endpoints` | list of string | unset |",
            "| `secret` | string, secret | required |",
            "| `address` | CIDR (`10.0.0.0/8`, `fd00::/64`) | required |",
            "| `interval` | duration (`10s`, `1m30s`, `500ms`) | `1s` |",
            "| `up` | bool | `true` |",
            "No two may have the same family and priority.",
            "| `endpoint` | string | required |",
            "| `link` | string | unset |",
        ] {
            assert!(md.contains(want), "missing {want:?} in\n{md}");
        }
        // The rule of `mtu` is its `Valid:` paragraph, not part of the description.
        assert!(
            md.contains("TCP MSS is clamped to fit. | 1280–65535. |"),
            "{md}"
        );
    }

    #[test]
    fn field_order_is_declaration_order() {
        let fields = field_order::<crate::config::kubespan::KubeSpanConfigDocument>();
        assert_eq!(fields.first(), Some(&"enabled"));
        assert_eq!(fields.last(), Some(&"peerRelay"));
    }
}
