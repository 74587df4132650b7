//! The node's configuration: one multi-document YAML file.
//!
//! Every document has `apiVersion: v1alpha1`, a `kind` and, for kinds that may appear
//! several times, a `name`. [`parse`] reads the whole file and either returns every
//! document, validated, or a [`ConfigError`] listing every problem of every document,
//! each naming the document (position, kind and name) and the field: a config is taken
//! whole or not at all, so a bad file never half-applies.
//!
//! Two documents of one kind with the same merge key (the id the config controllers
//! write their spec under, see [`ConfigDocument::merge_key`]) are rejected: one would
//! silently replace the other.
//!
//! Adding a kind: a type implementing [`ConfigDocument`], `Default` and
//! `schemars::JsonSchema` (with `#[serde(deny_unknown_fields, rename_all =
//! "camelCase")]`, a doc comment on every field and a `Valid:` paragraph for what its
//! `validate` checks) and one line in the `documents!` list below; then regenerate
//! `docs/config-reference.md` ([`reference`](mod@reference)).

use std::fmt;

use serde::{de::DeserializeOwned, Deserialize, Serialize};
use serde_yaml_ng::Value;

pub mod cluster;
pub mod depth;
pub mod duration;
pub mod host;
pub mod kubespan;
pub mod network;
pub mod patch;
pub mod probe;
pub mod reference;
pub mod schema;

/// Name of the last good config's copy in the state dir (kept by the config loader,
/// `crate::config_loader`).
pub const LAST_GOOD_FILE: &str = "last-good-config.yaml";

/// The only `apiVersion` this build reads.
pub const API_VERSION: &str = "v1alpha1";

/// Largest config text the node takes, from a file or through the API (4 MiB, gRPC's
/// customary message size; the API's message limit is derived from it).
pub const MAX_CONFIG_BYTES: usize = 4 << 20;

/// One problem with one field of a document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Dotted path of the field inside the document (`filters.endpoints[1]`); empty
    /// when the problem is the document as a whole.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl FieldError {
    /// A problem with `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.field, self.message)
        }
    }
}

/// Every problem of one document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DocumentError {
    /// Position of the document in the file, from 1.
    pub position: usize,
    /// Its `kind`, when it has a readable one.
    pub kind: Option<String>,
    /// Its `name`, when it has one.
    pub name: Option<String>,
    /// The problems, all of them.
    pub errors: Vec<FieldError>,
}

impl DocumentError {
    /// `document N (Kind "name")`.
    fn header(&self) -> String {
        let p = self.position;
        match (&self.kind, &self.name) {
            (Some(k), Some(n)) => format!("document {p} ({k} {n:?})"),
            (Some(k), None) => format!("document {p} ({k})"),
            _ => format!("document {p}"),
        }
    }
}

impl fmt::Display for DocumentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.header())?;
        for (i, e) in self.errors.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// A config that was rejected, with every problem found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    /// Problems per document, in file order.
    pub documents: Vec<DocumentError>,
}

/// Most problems a [`ConfigError`] lists (in its text, the API's reply, the log and
/// `ConfigStatus`); the rest are counted. Thousands of bad documents would otherwise
/// make an error of megabytes.
pub const MAX_LISTED_PROBLEMS: usize = 50;

/// Longest text of one listed problem (and of a document's header), in bytes; a
/// longer one is cut (a document's name or kind can be as long as the file).
pub const MAX_PROBLEM_BYTES: usize = 256;

/// `s` cut at a character boundary to at most `max` bytes, marked with `…`.
fn cut(s: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if s.len() <= max {
        return s.into();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end]).into()
}

impl ConfigError {
    /// The problems, one line per document, at most [`MAX_LISTED_PROBLEMS`] of them
    /// in all (each cut to [`MAX_PROBLEM_BYTES`]), then `and N more problems`.
    #[must_use]
    pub fn listed(&self) -> Vec<String> {
        let mut budget = MAX_LISTED_PROBLEMS;
        let mut lines = Vec::new();
        let total: usize = self.documents.iter().map(|d| d.errors.len().max(1)).sum();
        for d in &self.documents {
            if budget == 0 {
                break;
            }
            let shown = d.errors.len().min(budget);
            budget -= shown.max(1);
            let problems: Vec<String> = d.errors[..shown]
                .iter()
                .map(|e| cut(&e.to_string(), MAX_PROBLEM_BYTES).into_owned())
                .collect();
            let header = d.header();
            lines.push(format!(
                "{}: {}",
                cut(&header, MAX_PROBLEM_BYTES),
                problems.join("; ")
            ));
        }
        let listed = MAX_LISTED_PROBLEMS - budget;
        if total > listed {
            lines.push(format!("and {} more problems", total - listed));
        }
        lines
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid config: {}", self.listed().join(" | "))
    }
}

/// One kind of config document.
pub trait ConfigDocument:
    Clone + PartialEq + fmt::Debug + Serialize + DeserializeOwned + Send + Sync + 'static
{
    /// The `kind` field.
    const KIND: &'static str;
    /// Singleton kinds appear at most once per config; other kinds may repeat, with
    /// distinct names when they have names.
    const SINGLETON: bool;
    /// The document's name, for kinds that have one.
    fn name(&self) -> Option<&str> {
        None
    }
    /// Every problem of the document (all reported together), fields relative to it.
    fn validate(&self) -> Vec<FieldError>;
    /// For kinds whose documents become specs keyed by content: what the key is made
    /// of (for the error message) and the key of this (valid) document. Two documents
    /// with one key would write the same spec, the later silently replacing the
    /// earlier, so [`parse`] rejects that.
    fn merge_key(&self) -> Option<(&'static str, String)> {
        None
    }
}

/// Access to one variant of [`Document`]; implemented by `documents!`.
pub trait DocumentVariant: ConfigDocument {
    /// The document if it is of this kind.
    fn from_document(doc: &Document) -> Option<&Self>;
}

/// Deserializes one document body (without `apiVersion` and `kind`), naming the field
/// that failed.
fn deserialize<D: ConfigDocument>(value: Value) -> Result<D, FieldError> {
    serde_path_to_error::deserialize::<_, D>(value).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." { String::new() } else { path };
        FieldError::new(field, e.into_inner().to_string())
    })
}

macro_rules! documents {
    ($($variant:ident => $ty:ty),* $(,)?) => {
        /// One config document of any kind.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "kind")]
        pub enum Document {
            $(
                #[doc = concat!("A `", stringify!($variant), "` document.")]
                $variant($ty),
            )*
        }

        impl Document {
            /// Every kind this build reads.
            pub const KINDS: &'static [&'static str] = &[$(<$ty as ConfigDocument>::KIND),*];

            /// The document's kind.
            #[must_use]
            pub fn kind(&self) -> &'static str {
                match self { $(Self::$variant(_) => <$ty as ConfigDocument>::KIND,)* }
            }

            /// The document's name, if its kind has names.
            #[must_use]
            pub fn name(&self) -> Option<&str> {
                match self { $(Self::$variant(d) => d.name(),)* }
            }

            fn singleton(&self) -> bool {
                match self { $(Self::$variant(_) => <$ty as ConfigDocument>::SINGLETON,)* }
            }

            fn validate(&self) -> Vec<FieldError> {
                match self { $(Self::$variant(d) => d.validate(),)* }
            }

            /// What identifies the document among its kind's when it has no name
            /// ([`ConfigDocument::merge_key`]).
            #[must_use]
            pub fn merge_key(&self) -> Option<(&'static str, String)> {
                match self { $(Self::$variant(d) => d.merge_key(),)* }
            }

            /// What the configuration reference says about every kind, in
            /// [`Self::KINDS`] order.
            #[must_use]
            pub fn reference() -> Vec<reference::KindReference> {
                vec![$(reference::KindReference::of::<$ty>()),*]
            }

            fn parse(kind: &str, body: Value) -> Option<Result<Self, FieldError>> {
                $(
                    if kind == <$ty as ConfigDocument>::KIND {
                        return Some(deserialize::<$ty>(body).map(Self::$variant));
                    }
                )*
                None
            }
        }

        $(
            impl DocumentVariant for $ty {
                fn from_document(doc: &Document) -> Option<&Self> {
                    #[allow(unreachable_patterns)]
                    match doc {
                        Document::$variant(d) => Some(d),
                        _ => None,
                    }
                }
            }
        )*
    };
}

documents! {
    ClusterConfig => cluster::ClusterConfig,
    DiscoveryServiceConfig => cluster::DiscoveryServiceConfig,
    KubeSpanConfig => kubespan::KubeSpanConfigDocument,
    KubeSpanEndpointsConfig => kubespan::KubeSpanEndpointsConfig,
    LinkConfig => network::LinkConfig,
    AddressConfig => network::AddressConfig,
    RouteConfig => network::RouteConfig,
    RoutingRuleConfig => network::RoutingRuleConfig,
    HostnameConfig => host::HostnameConfig,
    ResolverConfig => host::ResolverConfig,
    TimeServerConfig => host::TimeServerConfig,
    TcpProbeConfig => probe::TcpProbeConfig,
    HttpProbeConfig => probe::HttpProbeConfig,
}

/// A parsed, validated configuration: its documents in file order.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ConfigDocuments {
    /// The documents.
    pub documents: Vec<Document>,
}

impl ConfigDocuments {
    /// Every document of kind `D`, in file order.
    pub fn documents_of<D: DocumentVariant>(&self) -> impl Iterator<Item = &D> {
        self.documents.iter().filter_map(D::from_document)
    }

    /// The document of singleton kind `D`, if present.
    #[must_use]
    pub fn singleton<D: DocumentVariant>(&self) -> Option<&D> {
        self.documents_of::<D>().next()
    }
}

/// Parses and validates a whole config file.
///
/// # Errors
/// Every problem of every document, each naming the document and the field.
pub fn parse(text: &str) -> Result<ConfigDocuments, ConfigError> {
    if let Err(at) = depth::check(text, depth::MAX_DEPTH) {
        return Err(ConfigError {
            documents: vec![DocumentError {
                position: at.document,
                kind: None,
                name: None,
                errors: vec![FieldError::new(
                    "",
                    format!(
                        "line {}: nested deeper than {} levels (the limit of a config)",
                        at.line,
                        depth::MAX_DEPTH
                    ),
                )],
            }],
        });
    }
    let mut documents = Vec::new();
    let mut errors = Vec::new();
    for (i, de) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let position = i + 1;
        let fail =
            |kind: Option<String>, name: Option<String>, errs: Vec<FieldError>| DocumentError {
                position,
                kind,
                name,
                errors: errs,
            };
        let value = match Value::deserialize(de) {
            Ok(v) => v,
            Err(e) => {
                // A syntax error ends the stream: later documents cannot be found.
                errors.push(fail(
                    None,
                    None,
                    vec![FieldError::new("", format!("not valid YAML: {e}"))],
                ));
                break;
            }
        };
        match parse_document(value) {
            Ok(None) => {}
            Ok(Some(doc)) => documents.push((position, doc)),
            Err((kind, name, errs)) => errors.push(fail(kind, name, errs)),
        }
    }
    check_duplicates(&documents, &mut errors);
    network::check_mesh_reserved(&documents, &mut errors);
    if errors.is_empty() {
        Ok(ConfigDocuments {
            documents: documents.into_iter().map(|(_, d)| d).collect(),
        })
    } else {
        errors.sort_by_key(|e| e.position);
        Err(ConfigError { documents: errors })
    }
}

type Rejected = (Option<String>, Option<String>, Vec<FieldError>);

/// One document: `Ok(None)` for an empty one (a trailing `---`).
fn parse_document(value: Value) -> Result<Option<Document>, Rejected> {
    let mut map = match value {
        Value::Null => return Ok(None),
        Value::Mapping(m) => m,
        _ => {
            return Err((
                None,
                None,
                vec![FieldError::new("", "a document must be a mapping")],
            ))
        }
    };
    let name = map.get("name").and_then(Value::as_str).map(str::to_owned);
    let kind = map.remove("kind");
    let api = map.remove("apiVersion");
    let Some(kind) = kind.as_ref().and_then(Value::as_str).map(str::to_owned) else {
        return Err((
            None,
            name,
            vec![FieldError::new("kind", "is required (a string)")],
        ));
    };
    let mut errs = Vec::new();
    match api.as_ref().and_then(Value::as_str) {
        Some(API_VERSION) => {}
        Some(other) => errs.push(FieldError::new(
            "apiVersion",
            format!("{other:?} is not supported (want {API_VERSION:?})"),
        )),
        None => errs.push(FieldError::new(
            "apiVersion",
            format!("is required ({API_VERSION:?})"),
        )),
    }
    let doc = match Document::parse(&kind, Value::Mapping(map)) {
        None => {
            errs.push(FieldError::new(
                "kind",
                format!(
                    "unknown kind {kind:?} (known: {})",
                    Document::KINDS.join(", ")
                ),
            ));
            None
        }
        Some(Err(e)) => {
            errs.push(e);
            None
        }
        Some(Ok(doc)) => {
            errs.extend(doc.validate());
            Some(doc)
        }
    };
    match doc {
        Some(doc) if errs.is_empty() => Ok(Some(doc)),
        _ => Err((Some(kind), name, errs)),
    }
}

fn check_duplicates(documents: &[(usize, Document)], errors: &mut Vec<DocumentError>) {
    let mut names: Vec<(&'static str, Option<&str>, usize)> = Vec::new();
    let mut keys: Vec<(&'static str, String, usize)> = Vec::new();
    for (position, doc) in documents {
        let mut errs = Vec::new();
        if let Some((what, key)) = doc.merge_key() {
            match keys.iter().find(|(k, n, _)| *k == doc.kind() && *n == key) {
                Some((_, _, first)) => errs.push(FieldError::new(
                    "",
                    format!(
                        "same {what} as document {first} ({key}); one would silently replace the other"
                    ),
                )),
                None => keys.push((doc.kind(), key, *position)),
            }
        }
        let name = if doc.singleton() { None } else { doc.name() };
        if doc.singleton() || name.is_some() {
            match names
                .iter()
                .find(|(k, n, _)| *k == doc.kind() && *n == name)
            {
                Some((_, _, first)) if doc.singleton() => errs.push(FieldError::new(
                    "",
                    format!(
                        "{} may appear only once (also document {first})",
                        doc.kind()
                    ),
                )),
                Some((_, _, first)) => errs.push(FieldError::new(
                    "name",
                    format!("duplicate name (also document {first})"),
                )),
                None => names.push((doc.kind(), name, *position)),
            }
        }
        if !errs.is_empty() {
            errors.push(DocumentError {
                position: *position,
                kind: Some(doc.kind().to_owned()),
                name: doc.name().map(str::to_owned),
                errors: errs,
            });
        }
    }
}

/// Checks that an interface name is one the kernel accepts.
pub fn check_link_name(field: &str, name: &str, errors: &mut Vec<FieldError>) {
    if name.is_empty()
        || name.len() > 15
        || name == "."
        || name == ".."
        || name.contains(['/', ':'])
        || name.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        errors.push(FieldError::new(
            field,
            format!(
                "{name:?} is not a valid interface name (1–15 characters, no '/', ':' or spaces)"
            ),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variant_names_are_the_kinds() {
        // The serde tag of `Document` is the variant name; it must be the kind.
        for doc in [
            Document::KubeSpanConfig(kubespan::KubeSpanConfigDocument::default()),
            Document::ClusterConfig(cluster::ClusterConfig::default()),
            Document::KubeSpanEndpointsConfig(kubespan::KubeSpanEndpointsConfig::default()),
        ] {
            let v = serde_json::to_value(&doc).unwrap();
            assert_eq!(v["kind"], doc.kind());
        }
    }

    #[test]
    fn every_problem_of_every_document_is_reported_with_kind_name_and_field() {
        let text = "\
apiVersion: v1alpha1
kind: KubeSpanConfig
enabled: true
mtu: 1000
linkName: 'a/b'
---
apiVersion: v2
kind: NoSuchConfig
name: x
---
kind: KubeSpanConfig
apiVersion: v1alpha1
bogus: 1
---
- a list
";
        let err = parse(text).unwrap_err();
        let text = err.to_string();
        assert_eq!(err.documents.len(), 4, "{text}");
        let d1 = &err.documents[0];
        assert_eq!(d1.kind.as_deref(), Some("KubeSpanConfig"));
        let fields: Vec<_> = d1.errors.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["mtu", "linkName"], "{text}");
        let d2 = &err.documents[1];
        assert_eq!(d2.name.as_deref(), Some("x"));
        assert_eq!(d2.errors[0].field, "apiVersion");
        assert_eq!(d2.errors[1].field, "kind");
        assert!(d2.errors[1].message.contains("KubeSpanConfig"), "{text}");
        assert!(
            err.documents[2].errors[0].message.contains("bogus"),
            "{text}"
        );
        assert!(err.documents[3].errors[0].message.contains("mapping"));
        assert!(text.contains("document 1 (KubeSpanConfig): mtu:"), "{text}");
    }

    #[test]
    fn singletons_once_and_empty_documents_skipped() {
        let one = "apiVersion: v1alpha1\nkind: KubeSpanConfig\nenabled: true\n";
        let cfg = parse(&format!("---\n{one}---\n")).unwrap();
        assert!(
            cfg.singleton::<kubespan::KubeSpanConfigDocument>()
                .unwrap()
                .enabled
        );
        let err = parse(&format!("{one}---\n{one}")).unwrap_err();
        assert_eq!(err.documents[0].position, 2);
        assert!(err.to_string().contains("only once"), "{err}");
        assert_eq!(parse("").unwrap(), ConfigDocuments::default());
    }

    #[test]
    fn yaml_syntax_errors_name_the_document() {
        let err = parse("apiVersion: v1alpha1\nkind: [\n").unwrap_err();
        assert_eq!(err.documents[0].position, 1);
        assert!(err.to_string().contains("not valid YAML"), "{err}");
    }
}
