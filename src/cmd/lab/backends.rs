//! `lab up --wireguard`: one WireGuard implementation for every node (`auto`, `kernel`,
//! `userspace` for `wirespan wireguard`, `userspace-go` for wireguard-go), or one per
//! node (`node1=kernel,node2=userspace-go`), so a lab can mix kernel WireGuard and both
//! userspace devices. Nodes not named run the bare value given in the list, else
//! `auto`.

use std::{collections::BTreeMap, fmt, str::FromStr};

use super::super::node::WireGuardArg;

/// Which WireGuard implementation each node of a lab runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireGuardPlan {
    /// For nodes not named.
    default: WireGuardArg,
    /// By node name.
    per_node: BTreeMap<String, WireGuardArg>,
}

impl Default for WireGuardPlan {
    fn default() -> Self {
        Self {
            default: WireGuardArg::Auto,
            per_node: BTreeMap::new(),
        }
    }
}

/// The value of the daemon's `--wireguard` as typed on a command line.
#[must_use]
pub fn wireguard_name(w: WireGuardArg) -> &'static str {
    match w {
        WireGuardArg::Auto => "auto",
        WireGuardArg::Kernel => "kernel",
        WireGuardArg::Userspace => "userspace",
        WireGuardArg::UserspaceGo => "userspace-go",
    }
}

fn parse_one(s: &str) -> Result<WireGuardArg, String> {
    match s {
        "auto" => Ok(WireGuardArg::Auto),
        "kernel" => Ok(WireGuardArg::Kernel),
        "userspace" => Ok(WireGuardArg::Userspace),
        "userspace-go" => Ok(WireGuardArg::UserspaceGo),
        other => Err(format!(
            "{other:?} is not a WireGuard implementation (auto, kernel, userspace, userspace-go)"
        )),
    }
}

impl FromStr for WireGuardPlan {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut plan = Self::default();
        let mut default_given = false;
        for item in s.split(',') {
            match item.split_once('=') {
                None => {
                    if std::mem::replace(&mut default_given, true) {
                        return Err(format!("{s:?} gives more than one value for every node"));
                    }
                    plan.default = parse_one(item)?;
                }
                Some((node, value)) => {
                    if node.is_empty() {
                        return Err(format!("{item:?} names no node"));
                    }
                    if plan
                        .per_node
                        .insert(node.to_owned(), parse_one(value)?)
                        .is_some()
                    {
                        return Err(format!("node {node:?} is named twice"));
                    }
                }
            }
        }
        Ok(plan)
    }
}

impl fmt::Display for WireGuardPlan {
    /// The form `FromStr` reads back: `kernel`, or `node1=kernel,node2=userspace`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut items = Vec::new();
        if self.per_node.is_empty() || !matches!(self.default, WireGuardArg::Auto) {
            items.push(wireguard_name(self.default).to_owned());
        }
        items.extend(
            self.per_node
                .iter()
                .map(|(n, w)| format!("{n}={}", wireguard_name(*w))),
        );
        f.write_str(&items.join(","))
    }
}

impl WireGuardPlan {
    /// The implementation `node` runs.
    #[must_use]
    pub fn for_node(&self, node: &str) -> WireGuardArg {
        self.per_node.get(node).copied().unwrap_or(self.default)
    }

    /// Whether any node is forced onto kernel WireGuard.
    #[must_use]
    pub fn any_kernel(&self) -> bool {
        matches!(self.default, WireGuardArg::Kernel)
            || self
                .per_node
                .values()
                .any(|w| matches!(w, WireGuardArg::Kernel))
    }

    /// Checks that every node named is one of `nodes`.
    ///
    /// # Errors
    /// The first unknown node, with the lab's nodes.
    pub fn check_nodes(&self, nodes: &[String]) -> Result<(), String> {
        match self.per_node.keys().find(|n| !nodes.contains(n)) {
            Some(unknown) => Err(format!(
                "--wireguard names {unknown:?}, which is not a node of this lab ({})",
                nodes.join(", ")
            )),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(plan: &WireGuardPlan, nodes: &[&str]) -> Vec<&'static str> {
        nodes
            .iter()
            .map(|n| wireguard_name(plan.for_node(n)))
            .collect()
    }

    #[test]
    fn one_value_for_every_node_or_one_per_node() {
        let all: WireGuardPlan = "kernel".parse().unwrap();
        assert_eq!(names(&all, &["node1", "node2"]), ["kernel", "kernel"]);
        assert!(all.any_kernel());
        assert_eq!(all.to_string(), "kernel");

        let mixed: WireGuardPlan = "node1=kernel,node3=userspace-go".parse().unwrap();
        assert_eq!(
            names(&mixed, &["node1", "node2", "node3"]),
            ["kernel", "auto", "userspace-go"]
        );
        assert_eq!(mixed.to_string(), "node1=kernel,node3=userspace-go");
        assert_eq!(mixed.to_string().parse::<WireGuardPlan>().unwrap(), mixed);

        let with_default: WireGuardPlan = "userspace,node2=kernel".parse().unwrap();
        assert_eq!(
            names(&with_default, &["node1", "node2"]),
            ["userspace", "kernel"]
        );
        assert_eq!(
            with_default.to_string().parse::<WireGuardPlan>().unwrap(),
            with_default
        );
        assert!(!"node1=userspace"
            .parse::<WireGuardPlan>()
            .unwrap()
            .any_kernel());
    }

    #[test]
    fn bad_values_and_unknown_nodes_are_refused_by_name() {
        for (bad, says) in [
            ("kernal", "\"kernal\" is not a WireGuard implementation"),
            ("node1=go", "\"go\" is not"),
            (
                "node1=kernel,node1=userspace",
                "node \"node1\" is named twice",
            ),
            ("kernel,userspace", "more than one value"),
            ("=kernel", "names no node"),
            ("", "\"\" is not"),
        ] {
            let err = bad.parse::<WireGuardPlan>().unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
        let plan: WireGuardPlan = "node4=kernel".parse().unwrap();
        let err = plan
            .check_nodes(&["node1".into(), "node2".into()])
            .unwrap_err();
        assert!(
            err.contains("\"node4\"") && err.contains("node1, node2"),
            "{err}"
        );
        assert!(plan.check_nodes(&["node4".into()]).is_ok());
    }
}
