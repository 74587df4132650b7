//! `wirespan get` / `watch` against a resource API served in-process.

mod common;

use common::{expect_line, spawn_lines, stdout, Server};
use serde::{Deserialize, Serialize};
use wirespan_control::{
    resources::{self, meta},
    runtime::{Definition, Pointer, Resource, ResourceKind, Store},
    testing::{int, IntResource},
};

#[derive(Debug)]
struct Secret;

#[derive(Clone, Default, PartialEq, Serialize, Deserialize)]
struct SecretSpec {
    key: String,
}

impl std::fmt::Debug for SecretSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretSpec(<redacted>)")
    }
}

impl ResourceKind for Secret {
    const TYPE: &'static str = "Secrets.test.wirespan.dev";
    const DEFAULT_NAMESPACE: &'static str = "default";
    type Spec = SecretSpec;
    fn definition() -> Definition {
        Definition::new(Self::TYPE, "Secret", "default")
            .column("Key", ".key")
            .sensitive()
    }
}

const SECRET: &str = "c2VjcmV0LWtleS1tYXRlcmlhbA";

fn store() -> Store {
    let s = Store::default();
    let mut defs = resources::definitions();
    defs.push(IntResource::definition());
    defs.push(Secret::definition());
    meta::register(&s, &defs).unwrap();
    for (id, v) in [("b", 2), ("a", 1), ("c", 3)] {
        s.create(int("default", id, v), "").unwrap();
    }
    s.create(int("other", "z", 26), "").unwrap();
    s.create(
        Resource::<Secret>::new("default", "wg", SecretSpec { key: SECRET.into() }),
        "",
    )
    .unwrap();
    s
}

#[test]
fn table_lists_sorted_with_print_columns_and_case_insensitive_alias() {
    let srv = Server::start(store());
    let out = stdout(&srv.cli(&["get", "IRs"]));
    let lines: Vec<&str> = out.lines().collect();
    let cols: Vec<Vec<&str>> = lines
        .iter()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        cols[0],
        ["NAMESPACE", "TYPE", "ID", "VERSION", "VALUE"],
        "{out}"
    );
    assert_eq!(cols[1], ["default", "IntResource", "a", "1", "1"], "{out}");
    assert_eq!(cols[2][2], "b");
    assert_eq!(cols[3][2], "c");
    assert_eq!(lines.len(), 4, "{out}");
    // Namespace flag and single id.
    let out = stdout(&srv.cli(&["get", "intresource", "z", "--namespace", "other"]));
    assert!(
        out.lines()
            .nth(1)
            .unwrap()
            .split_whitespace()
            .eq(["other", "IntResource", "z", "1", "26"]),
        "{out}"
    );
    // Definitions are resources too.
    let out = stdout(&srv.cli(&["get", "rd"]));
    assert!(out.contains("IntResources.test.wirespan.dev"), "{out}");
    assert!(out.contains("intresource,intresources,ir,irs"), "{out}");
}

#[test]
fn yaml_and_json_output() {
    let srv = Server::start(store());
    let out = stdout(&srv.cli(&["get", "intresources", "b", "-o", "yaml"]));
    let doc: serde_json::Value = serde_yaml_ng::from_str(&out).unwrap();
    assert_eq!(doc["metadata"]["id"], "b");
    assert_eq!(doc["metadata"]["version"], 1);
    assert_eq!(doc["metadata"]["phase"], "running");
    assert_eq!(doc["spec"]["value"], 2);
    let out = stdout(&srv.cli(&["get", "ir", "-o", "yaml"]));
    assert_eq!(out.matches("\n---\n").count(), 2, "{out}");

    let out = stdout(&srv.cli(&["get", "ir", "-o", "json"]));
    let docs: Vec<serde_json::Value> = serde_json::Deserializer::from_str(&out)
        .into_iter()
        .collect::<Result<_, _>>()
        .unwrap();
    let ids: Vec<&str> = docs
        .iter()
        .map(|d| d["metadata"]["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["a", "b", "c"]);
    assert_eq!(docs[2]["spec"]["value"], 3);
    assert_eq!(docs[0]["metadata"]["type"], IntResource::TYPE);
}

#[test]
fn sensitive_specs_are_not_printed_unless_asked() {
    let srv = Server::start(store());
    for args in [
        &["get", "secrets"][..],
        &["get", "secret", "wg", "-o", "yaml"],
        &["get", "secret", "-o", "json"],
    ] {
        let out = stdout(&srv.cli(args));
        assert!(!out.contains(SECRET), "{args:?} leaked: {out}");
        assert!(out.contains("sensitive"), "{out}");
    }
    let out = stdout(&srv.cli(&["get", "secret", "wg", "-o", "json", "--include-sensitive"]));
    assert!(out.contains(SECRET), "{out}");
}

/// The ID column of a watch line (the mark column is blank for updates).
fn watch_id(l: &str) -> Option<&str> {
    let t: Vec<&str> = l.split_whitespace().collect();
    match t.first() {
        Some(&"+" | &"-") => t.get(3).copied(),
        _ => t.get(2).copied(),
    }
}

#[test]
fn watch_marks_created_updated_destroyed() {
    let s = store();
    let srv = Server::start(s.clone());
    let (_child, rx) = spawn_lines(&srv.socket, &["watch", "ir"]);
    let header = expect_line(&rx, "header", |l| l.starts_with('*'));
    assert!(
        header
            .split_whitespace()
            .eq(["*", "NAMESPACE", "TYPE", "ID", "VERSION", "VALUE"]),
        "{header}"
    );
    // Bootstrap contents come as creations.
    expect_line(&rx, "bootstrap c", |l| {
        l.starts_with('+') && watch_id(l) == Some("c")
    });
    s.create(int("default", "d", 4), "").unwrap();
    let l = expect_line(&rx, "created d", |l| watch_id(l) == Some("d"));
    assert!(l.starts_with("+ "), "{l}");
    s.modify::<IntResource>("default", "d", "", |r| r.spec.value = 40)
        .unwrap();
    let l = expect_line(&rx, "updated d", |l| watch_id(l) == Some("d"));
    assert!(l.starts_with("  "), "{l}");
    assert!(
        l.split_whitespace()
            .eq(["default", "IntResource", "d", "2", "40"]),
        "{l}"
    );
    s.destroy(&Pointer::new("default", IntResource::TYPE, "d"), "")
        .unwrap();
    let l = expect_line(&rx, "destroyed d", |l| watch_id(l) == Some("d"));
    assert!(l.starts_with("- "), "{l}");

    // `get --watch` with -o yaml marks events too.
    let (_child2, rx2) = spawn_lines(&srv.socket, &["get", "ir", "a", "--watch", "-o", "yaml"]);
    expect_line(&rx2, "event", |l| l == "event: created");
}

#[test]
fn unknown_type_lists_closest_names() {
    let srv = Server::start(store());
    let o = srv.cli(&["get", "intresorces"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("unknown resource type \"intresorces\""),
        "{err}"
    );
    assert!(err.contains("closest known names: intresources"), "{err}");
}

#[test]
fn missing_socket_says_node_is_not_running() {
    let dir = tempfile::tempdir().unwrap();
    let o = common::cli(&dir.path().join("nope.sock"), &["get", "rd"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("node is not running"), "{err}");
    assert!(err.contains("start it with `wirespan node`"), "{err}");
}
