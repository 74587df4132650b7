//! `wirespan get` / `wirespan watch`: read and watch resources of a running node.

use std::{fmt::Write as _, path::Path};

use anyhow::Context as _;
use serde_json::{json, Value};
use wirespan_control::api::{client::ApiClient, proto};

use super::fleet::{FleetArgs, Target};
use wirespan_discovery::text::{escape_terminal, is_unsafe_char};

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Aligned columns: NAMESPACE TYPE ID VERSION and the type's print columns.
    Table,
    /// The table plus a column for every other top-level spec field (of the listed
    /// resources; a watch shows the table's columns).
    Wide,
    /// One YAML document per resource.
    Yaml,
    /// One JSON object per resource.
    Json,
}

/// Options of `wirespan get` and `wirespan watch`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Resource type: full name, display name or alias, case-insensitive (e.g. `rd`).
    pub r#type: String,
    /// One resource id (default: all of the kind).
    pub id: Option<String>,
    /// Namespace (default: the type's default namespace). `-n` names nodes (see
    /// `wirespan --help`).
    #[arg(long)]
    pub namespace: Option<String>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Format::Table)]
    pub output: Format,
    /// Keep printing changes (`+` created, ` ` updated, `-` destroyed).
    #[arg(short = 'w', long)]
    pub watch: bool,
    /// Show the spec of sensitive types (secrets); off by default.
    #[arg(long)]
    pub include_sensitive: bool,
}

const REDACTED: &str = "(sensitive: use --include-sensitive to show)";

pub fn run(
    args: &Args,
    fleet: &FleetArgs,
    socket: Option<&Path>,
    force_watch: bool,
) -> anyhow::Result<()> {
    super::block_on(async {
        let targets = super::fleet::targets(fleet, socket).await?;
        let node_column = targets.iter().any(|t| t.node.is_some());
        if args.watch || force_watch {
            return watch(args, &targets, node_column).await;
        }
        let results = super::fleet::each(&targets, |c| fetch(args, c)).await;
        let (ok, failed) = super::fleet::split(results)?;
        if let Some((_, (def, _))) = ok.first() {
            let mut p = Printer::new(def, args.output, false, node_column);
            let rows: Vec<(Option<String>, proto::Resource)> = ok
                .iter()
                .flat_map(|(node, (_, rs))| rs.iter().map(|r| (node.clone(), r.clone())))
                .collect();
            print!("{}", p.render_all(&rows)?);
        }
        failed.into_result()
    })
}

fn spec_format(args: &Args) -> i32 {
    let format = if args.output == Format::Yaml {
        proto::SpecFormat::Yaml
    } else {
        proto::SpecFormat::Json
    };
    format as i32
}

fn status(s: &tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{}", s.message())
}

/// One node's resources (one id, or the kind) and their definition.
async fn fetch(
    args: &Args,
    mut client: ApiClient,
) -> anyhow::Result<(proto::Definition, Vec<proto::Resource>)> {
    let (format, ns) = (
        spec_format(args),
        args.namespace.clone().unwrap_or_default(),
    );
    let (def, resources) = if let Some(id) = &args.id {
        let resp = client
            .get(proto::GetRequest {
                r#type: args.r#type.clone(),
                namespace: ns,
                id: id.clone(),
                format,
                include_sensitive: args.include_sensitive,
            })
            .await
            .map_err(|s| status(&s))?
            .into_inner();
        (resp.definition, resp.resource.into_iter().collect())
    } else {
        let resp = client
            .list(proto::ListRequest {
                r#type: args.r#type.clone(),
                namespace: ns,
                format,
                include_sensitive: args.include_sensitive,
            })
            .await
            .map_err(|s| status(&s))?
            .into_inner();
        (resp.definition, resp.resources)
    };
    Ok((def.context("response without definition")?, resources))
}

type Tagged = (Option<String>, anyhow::Result<proto::WatchResponse>);

/// Forwards one node's watch stream to `tx`, tagged with the node.
async fn forward_watch(
    req: proto::WatchRequest,
    mut client: ApiClient,
    node: Option<String>,
    tx: tokio::sync::mpsc::Sender<Tagged>,
) {
    let mut stream = match client.watch(req).await {
        Ok(s) => s.into_inner(),
        Err(s) => {
            let _ = tx.send((node, Err(status(&s)))).await;
            return;
        }
    };
    loop {
        let item = match stream.message().await {
            Ok(Some(msg)) => Ok(msg),
            Ok(None) => return,
            Err(s) => Err(status(&s)),
        };
        let end = item.is_err();
        if tx.send((node.clone(), item)).await.is_err() || end {
            return;
        }
    }
}

/// Every node's watch stream merged into one printout.
async fn watch(args: &Args, targets: &[Target], node_column: bool) -> anyhow::Result<()> {
    let req = proto::WatchRequest {
        r#type: args.r#type.clone(),
        namespace: args.namespace.clone().unwrap_or_default(),
        id: args.id.clone().unwrap_or_default(),
        format: spec_format(args),
        include_sensitive: args.include_sensitive,
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel(64);
    for t in targets {
        tokio::spawn(forward_watch(
            req.clone(),
            t.client.clone(),
            t.node.clone(),
            tx.clone(),
        ));
    }
    drop(tx);
    let mut printer: Option<Printer> = None;
    let mut failed = 0;
    while let Some((node, item)) = rx.recv().await {
        let msg = match item {
            Ok(m) => m,
            Err(e) if targets.len() == 1 => return Err(e),
            Err(e) => {
                failed += 1;
                eprintln!("{}: {e:#}", node.as_deref().unwrap_or("local"));
                continue;
            }
        };
        if let (Some(def), None) = (&msg.definition, &printer) {
            let p = Printer::new(def, args.output, true, node_column);
            if matches!(args.output, Format::Table | Format::Wide) {
                println!("{}", p.header());
            }
            printer = Some(p);
        }
        let p = printer
            .as_mut()
            .context("watch stream without definition")?;
        let ev = proto::EventType::try_from(msg.event).unwrap_or(proto::EventType::Errored);
        let mark = match ev {
            proto::EventType::Created => "+",
            proto::EventType::Updated => " ",
            proto::EventType::Destroyed => "-",
            proto::EventType::Bootstrapped => continue,
            proto::EventType::Errored if targets.len() == 1 => {
                anyhow::bail!("watch failed: {}", msg.error)
            }
            proto::EventType::Errored => {
                failed += 1;
                eprintln!(
                    "{}: watch failed: {}",
                    node.as_deref().unwrap_or("local"),
                    msg.error
                );
                continue;
            }
        };
        if let Some(r) = &msg.resource {
            // A watch of one missing id starts with a tombstone (version 0).
            if mark == "-" && r.metadata.as_ref().is_some_and(|m| m.version == 0) {
                continue;
            }
            println!("{}", p.render(r, Some(mark), node.as_deref())?);
        }
    }
    anyhow::ensure!(failed == 0, "{failed} of {} node(s) failed", targets.len());
    Ok(())
}

struct Printer {
    def: proto::Definition,
    format: Format,
    watch: bool,
    /// A NODE column first (rows from remote nodes).
    nodes: bool,
    widths: Vec<usize>,
    docs: usize,
}

fn spec_value(r: &proto::Resource, format: Format) -> anyhow::Result<Value> {
    if r.spec_redacted {
        return Ok(Value::String(REDACTED.to_owned()));
    }
    Ok(if format == Format::Yaml {
        serde_yaml_ng::from_str(&r.spec).context("decoding YAML spec")?
    } else {
        serde_json::from_str(&r.spec).context("decoding JSON spec")?
    })
}

fn lookup<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    let path = path.trim_start_matches('{').trim_end_matches('}');
    path.split('.')
        .filter(|s| !s.is_empty())
        .try_fold(v, |v, key| v.get(key))
}

fn cell(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| cell(Some(x)))
            .collect::<Vec<_>>()
            .join(","),
        Some(v) => v.to_string(),
    }
}

/// A YAML or JSON document with the characters its serialiser leaves raw but a
/// terminal obeys (bidi overrides; C1 and DEL in JSON) escaped: as `\uXXXX` in JSON
/// (the same string), as visible text in YAML. Names in specs come from other nodes.
pub(crate) fn escape_document(doc: &str, format: Format) -> String {
    let line = |l: &str| -> String {
        if format != Format::Json {
            return escape_terminal(l).into_owned();
        }
        let mut out = String::with_capacity(l.len());
        for c in l.chars() {
            if is_unsafe_char(c) {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            } else {
                out.push(c);
            }
        }
        out
    };
    doc.split('\n').map(line).collect::<Vec<_>>().join("\n")
}

impl Printer {
    fn new(def: &proto::Definition, format: Format, watch: bool, nodes: bool) -> Self {
        let mut p = Self {
            def: def.clone(),
            format,
            watch,
            nodes,
            widths: Vec::new(),
            docs: 0,
        };
        p.widths = p.header_cells().iter().map(String::len).collect();
        if watch {
            // Rows arrive one by one; pad to a reasonable width instead of measuring
            // (all but the one-character event mark).
            let mark = usize::from(nodes);
            for (i, w) in p.widths.iter_mut().enumerate() {
                if i != mark {
                    *w = (*w).max(12);
                }
            }
        }
        p
    }

    fn header_cells(&self) -> Vec<String> {
        let mut h: Vec<String> = Vec::new();
        if self.nodes {
            h.push("NODE".into());
        }
        if self.watch {
            h.push("*".into());
        }
        h.extend(["NAMESPACE", "TYPE", "ID", "VERSION"].map(String::from));
        h.extend(self.def.print_columns.iter().map(|c| c.name.to_uppercase()));
        h
    }

    fn header(&self) -> String {
        self.line(&self.header_cells())
    }

    fn line(&self, cells: &[String]) -> String {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                let _ = write!(
                    s,
                    "{:w$}   ",
                    c,
                    w = self.widths.get(i).copied().unwrap_or(0)
                );
            }
        }
        s.trim_end().to_owned()
    }

    fn cells(
        &self,
        r: &proto::Resource,
        mark: Option<&str>,
        node: Option<&str>,
    ) -> anyhow::Result<Vec<String>> {
        let md = r.metadata.clone().unwrap_or_default();
        let spec = spec_value(r, Format::Json)?;
        let mut c = Vec::new();
        if self.nodes {
            c.push(node.unwrap_or_default().to_owned());
        }
        if let Some(m) = mark {
            c.push(m.to_owned());
        }
        c.extend([
            md.namespace,
            self.def.display_type.clone(),
            md.id,
            md.version.to_string(),
        ]);
        for col in &self.def.print_columns {
            // `.metadata.annotations.<key>` columns read the metadata (the network
            // spec controllers' per-object error); every other path reads the spec.
            let annotation = col.json_path.strip_prefix(".metadata.annotations.");
            c.push(if let Some(key) = annotation {
                md.annotations.get(key).cloned().unwrap_or_default()
            } else if r.spec_redacted {
                "(sensitive)".into()
            } else {
                cell(lookup(&spec, &col.json_path))
            });
        }
        // Cells show names other nodes chose: an escape sequence is printed as text.
        Ok(c.into_iter()
            .map(|s| escape_terminal(&s).into_owned())
            .collect())
    }

    fn document(
        &self,
        r: &proto::Resource,
        mark: Option<&str>,
        node: Option<&str>,
    ) -> anyhow::Result<Value> {
        let md = r.metadata.clone().unwrap_or_default();
        let mut meta = json!({
            "namespace": md.namespace,
            "type": md.r#type,
            "id": md.id,
            "version": md.version,
            "owner": md.owner,
            "phase": md.phase,
            "created": md.created,
            "updated": md.updated,
        });
        if !md.labels.is_empty() {
            meta["labels"] = json!(md
                .labels
                .into_iter()
                .collect::<std::collections::BTreeMap<_, _>>());
        }
        if !md.finalizers.is_empty() {
            meta["finalizers"] = json!(md.finalizers);
        }
        let mut doc = serde_json::Map::new();
        if let Some(n) = node {
            doc.insert("node".into(), json!(n));
        }
        if let Some(m) = mark {
            let ev = match m {
                "+" => "created",
                "-" => "destroyed",
                _ => "updated",
            };
            doc.insert("event".into(), json!(ev));
        }
        doc.insert("metadata".into(), meta);
        doc.insert("spec".into(), spec_value(r, self.format)?);
        Ok(Value::Object(doc))
    }

    fn render(
        &mut self,
        r: &proto::Resource,
        mark: Option<&str>,
        node: Option<&str>,
    ) -> anyhow::Result<String> {
        match self.format {
            Format::Table | Format::Wide => Ok(self.line(&self.cells(r, mark, node)?)),
            Format::Json => {
                let j = serde_json::to_string_pretty(&self.document(r, mark, node)?)?;
                Ok(escape_document(&j, Format::Json))
            }
            Format::Yaml => {
                let sep = if self.docs > 0 { "---\n" } else { "" };
                self.docs += 1;
                let y = serde_yaml_ng::to_string(&self.document(r, mark, node)?)?;
                Ok(format!(
                    "{sep}{}",
                    escape_document(y.trim_end(), Format::Yaml)
                ))
            }
        }
    }

    /// Adds a column per top-level spec field no print column shows, in name order.
    fn widen(&mut self, resources: &[(Option<String>, proto::Resource)]) -> anyhow::Result<()> {
        let mut extra: Vec<String> = Vec::new();
        for (_, r) in resources.iter().filter(|(_, r)| !r.spec_redacted) {
            if let Value::Object(m) = spec_value(r, Format::Json)? {
                for k in m.keys() {
                    let path = format!(".{k}");
                    let shown = self.def.print_columns.iter().any(|c| c.json_path == path);
                    if !shown && !extra.contains(&path) {
                        extra.push(path);
                    }
                }
            }
        }
        extra.sort();
        for path in extra {
            self.def.print_columns.push(proto::PrintColumn {
                name: path[1..].to_owned(),
                json_path: path,
            });
        }
        self.widths = self.header_cells().iter().map(String::len).collect();
        Ok(())
    }

    fn render_all(
        &mut self,
        resources: &[(Option<String>, proto::Resource)],
    ) -> anyhow::Result<String> {
        let mut out = String::new();
        if self.format == Format::Wide {
            self.widen(resources)?;
        }
        if matches!(self.format, Format::Table | Format::Wide) {
            let rows = resources
                .iter()
                .map(|(node, r)| self.cells(r, None, node.as_deref()))
                .collect::<anyhow::Result<Vec<_>>>()?;
            for row in &rows {
                for (i, c) in row.iter().enumerate() {
                    if let Some(w) = self.widths.get_mut(i) {
                        *w = (*w).max(c.len());
                    }
                }
            }
            out.push_str(&self.header());
            out.push('\n');
            for row in &rows {
                out.push_str(&self.line(row));
                out.push('\n');
            }
            return Ok(out);
        }
        for (node, r) in resources {
            out.push_str(&self.render(r, None, node.as_deref())?);
            out.push('\n');
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A resource as the server sends it: its spec in YAML for `-o yaml`, else JSON.
    fn resource(label: &str, format: Format) -> proto::Resource {
        let spec = json!({ "label": label });
        proto::Resource {
            metadata: Some(proto::Metadata {
                namespace: "kubespan".into(),
                id: "k".into(),
                version: 1,
                ..Default::default()
            }),
            spec: if format == Format::Yaml {
                serde_yaml_ng::to_string(&spec).unwrap()
            } else {
                serde_json::to_string(&spec).unwrap()
            },
            ..Default::default()
        }
    }

    /// A printed name cannot drive the terminal, in any format.
    #[test]
    fn escape_sequences_in_specs_are_printed_as_text() {
        let def = proto::Definition {
            display_type: "KubeSpanPeerStatus".into(),
            print_columns: vec![proto::PrintColumn {
                name: "Label".into(),
                json_path: ".label".into(),
            }],
            ..Default::default()
        };
        for format in [Format::Table, Format::Yaml, Format::Json] {
            let r = resource("evil\u{1b}[2J\u{9b}31m\u{202e}", format);
            let out = Printer::new(&def, format, false, false)
                .render_all(&[(None, r)])
                .unwrap();
            assert!(
                !out.contains(['\u{1b}', '\u{9b}', '\u{202e}']),
                "{format:?}: {out:?}"
            );
            assert!(out.contains("evil"), "{format:?}: {out:?}");
        }
        let out = Printer::new(&def, Format::Json, false, false)
            .render_all(&[(None, resource("a\u{9b}\u{202e}", Format::Json))])
            .unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["spec"]["label"], "a\u{9b}\u{202e}", "the same string");
    }

    /// Rows of several nodes: a NODE column first in tables, a `node` field in JSON.
    #[test]
    fn fanned_out_rows_say_which_node_they_came_from() {
        let def = proto::Definition {
            display_type: "KubeSpanPeerStatus".into(),
            ..Default::default()
        };
        let rows = [
            (Some("node2".to_owned()), resource("a", Format::Json)),
            (Some("node3".to_owned()), resource("b", Format::Json)),
        ];
        let out = Printer::new(&def, Format::Table, false, true)
            .render_all(&rows)
            .unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("NODE    NAMESPACE"), "{out}");
        assert!(lines[1].starts_with("node2   kubespan"), "{out}");
        assert!(lines[2].starts_with("node3   kubespan"), "{out}");
        let out = Printer::new(&def, Format::Json, false, true)
            .render_all(&rows[..1])
            .unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["node"], "node2");
    }

    /// `-o wide`: every spec field no print column shows gets a column, once.
    #[test]
    fn wide_adds_a_column_per_other_spec_field() {
        let def = proto::Definition {
            display_type: "LinkStatus".into(),
            print_columns: vec![proto::PrintColumn {
                name: "Label".into(),
                json_path: ".label".into(),
            }],
            ..Default::default()
        };
        let mut r = resource("x", Format::Json);
        r.spec =
            json!({ "label": "x", "qdisc": "noqueue", "flags": ["UP", "LOWER_UP"] }).to_string();
        let out = Printer::new(&def, Format::Wide, false, false)
            .render_all(&[(None, r.clone()), (None, r)])
            .unwrap();
        let mut lines = out.lines();
        let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        assert_eq!(header[4..], ["LABEL", "FLAGS", "QDISC"], "{out}");
        let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        assert_eq!(row[4..], ["x", "UP,LOWER_UP", "noqueue"], "{out}");
        let table = Printer::new(&def, Format::Table, false, false)
            .render_all(&[(None, resource("x", Format::Json))])
            .unwrap();
        assert!(!table.contains("QDISC"), "{table}");
    }
}
