//! The controller–resource dependency graph (`docs/runtime.md` §3.9) and its DOT rendering.

use std::fmt::Write as _;

/// Kind of an edge between a controller and a resource type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EdgeKind {
    /// Exclusive output.
    OutputExclusive,
    /// Shared output.
    OutputShared,
    /// Strong input.
    InputStrong,
    /// Weak input.
    InputWeak,
    /// DestroyReady input.
    InputDestroyReady,
}

impl EdgeKind {
    /// True for output edges.
    #[must_use]
    pub fn is_output(self) -> bool {
        matches!(self, Self::OutputExclusive | Self::OutputShared)
    }
}

/// One edge; output edges have an empty namespace.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Edge {
    /// Controller name.
    pub controller: String,
    /// Namespace (empty for outputs: outputs are per type, any namespace).
    pub namespace: String,
    /// Resource type.
    pub r#type: String,
    /// Id for id-specific inputs.
    pub id: Option<String>,
    /// Edge kind.
    pub kind: EdgeKind,
}

/// Sorts edges: outputs first, then by controller, namespace, type, id.
pub fn sort_edges(edges: &mut [Edge]) {
    edges.sort_by(|a, b| {
        (
            !a.kind.is_output(),
            &a.controller,
            &a.namespace,
            &a.r#type,
            &a.id,
            a.kind,
        )
            .cmp(&(
                !b.kind.is_output(),
                &b.controller,
                &b.namespace,
                &b.r#type,
                &b.id,
                b.kind,
            ))
    });
}

fn quote(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// Renders Graphviz DOT: controllers as boxes, types as notes; exclusive outputs bold,
/// shared solid, strong inputs solid, weak dotted, DestroyReady left out unless asked.
#[must_use]
pub fn to_dot(edges: &[Edge], with_destroy_ready: bool) -> String {
    let mut out = String::from("digraph dependencies {\n  rankdir=LR;\n");
    let mut controllers: Vec<&str> = edges.iter().map(|e| e.controller.as_str()).collect();
    controllers.sort_unstable();
    controllers.dedup();
    // Types are the nodes (outputs are per type, any namespace); an input's namespace
    // and id go on its edge label, so producers and consumers of a type connect.
    let node = |e: &Edge| e.r#type.clone();
    let mut types: Vec<String> = edges
        .iter()
        .filter(|e| with_destroy_ready || e.kind != EdgeKind::InputDestroyReady)
        .map(node)
        .collect();
    types.sort_unstable();
    types.dedup();
    for c in &controllers {
        let _ = writeln!(out, "  {} [shape=box];", quote(c));
    }
    for t in &types {
        let _ = writeln!(out, "  {} [shape=note];", quote(t));
    }
    for e in edges {
        let (from, to, style) = match e.kind {
            EdgeKind::OutputExclusive => (e.controller.clone(), node(e), "bold"),
            EdgeKind::OutputShared => (e.controller.clone(), node(e), "solid"),
            EdgeKind::InputStrong => (node(e), e.controller.clone(), "solid"),
            EdgeKind::InputWeak => (node(e), e.controller.clone(), "dotted"),
            EdgeKind::InputDestroyReady if with_destroy_ready => {
                (node(e), e.controller.clone(), "dashed")
            }
            EdgeKind::InputDestroyReady => continue,
        };
        let label = match (&e.id, e.namespace.is_empty()) {
            (_, true) => String::new(),
            (None, false) => format!(", label={}", quote(&e.namespace)),
            (Some(id), false) => format!(", label={}", quote(&format!("{}/{id}", e.namespace))),
        };
        let _ = writeln!(
            out,
            "  {} -> {} [style={style}{label}];",
            quote(&from),
            quote(&to)
        );
    }
    out.push_str("}\n");
    out
}

/// [`to_dot`] plus one node per resource, `(type, namespace, id)`, linked from its
/// type's node (`inspect dependencies --with-resources`). Types without an edge are
/// not drawn, so neither are their resources.
#[must_use]
pub fn to_dot_with_resources(
    edges: &[Edge],
    with_destroy_ready: bool,
    resources: &[(String, String, String)],
) -> String {
    let mut out = to_dot(edges, with_destroy_ready);
    out.truncate(out.len() - "}\n".len());
    for (ty, ns, id) in resources {
        if !edges.iter().any(|e| &e.r#type == ty) {
            continue;
        }
        let name = format!("{ty}:{ns}/{id}");
        let _ = writeln!(
            out,
            "  {} [shape=ellipse, label={}];",
            quote(&name),
            quote(&format!("{ns}/{id}"))
        );
        let _ = writeln!(
            out,
            "  {} -> {} [style=dotted, arrowhead=none];",
            quote(ty),
            quote(&name)
        );
    }
    out.push_str("}\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_styles_and_order() {
        let mut edges = vec![
            Edge {
                controller: "B".into(),
                namespace: "ns".into(),
                r#type: "T".into(),
                id: None,
                kind: EdgeKind::InputWeak,
            },
            Edge {
                controller: "A".into(),
                namespace: String::new(),
                r#type: "T".into(),
                id: None,
                kind: EdgeKind::OutputExclusive,
            },
            Edge {
                controller: "B".into(),
                namespace: "ns".into(),
                r#type: "U".into(),
                id: None,
                kind: EdgeKind::InputDestroyReady,
            },
        ];
        sort_edges(&mut edges);
        assert_eq!(edges[0].kind, EdgeKind::OutputExclusive);
        let dot = to_dot(&edges, false);
        assert!(dot.contains("\"A\" -> \"T\" [style=bold];"), "{dot}");
        assert!(
            dot.contains("\"T\" -> \"B\" [style=dotted, label=\"ns\"];"),
            "{dot}"
        );
        assert!(!dot.contains("\"U\""), "{dot}");
    }

    #[test]
    fn resources_hang_off_their_type() {
        let edges = vec![Edge {
            controller: "C".into(),
            namespace: String::new(),
            r#type: "T".into(),
            id: None,
            kind: EdgeKind::OutputExclusive,
        }];
        let dot = to_dot_with_resources(
            &edges,
            false,
            &[
                ("T".into(), "ns".into(), "a".into()),
                ("Other".into(), "ns".into(), "b".into()),
            ],
        );
        assert!(
            dot.contains("\"T:ns/a\" [shape=ellipse, label=\"ns/a\"];"),
            "{dot}"
        );
        assert!(dot.contains("\"T\" -> \"T:ns/a\" [style=dotted"), "{dot}");
        assert!(!dot.contains("ns/b"), "{dot}");
        assert!(dot.ends_with("}\n"));
    }
}
