//! Labs the benchmarks run on: `wirespan lab up` with the given binary, removed on
//! drop, and by a watchdog (`lab down --after-exit`) if this process is killed.

use std::{
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
};

use anyhow::{bail, Context as _};
use serde_json::Value;

/// Runs `cmd`, failing with its stderr when it fails.
pub(crate) fn run_ok(cmd: &mut Command, what: &str) -> anyhow::Result<Output> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!(
            "{what}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out)
}

/// A running lab.
pub(crate) struct Lab {
    pub(crate) exe: PathBuf,
    pub(crate) name: String,
    /// `lab status -o json` as of the last [`Lab::refresh`].
    pub(crate) status: Value,
}

impl Lab {
    /// `lab up` with `up_args` (it waits for the mesh as the topology expects).
    pub(crate) fn up(exe: &Path, name: &str, up_args: &[&str]) -> anyhow::Result<Self> {
        // Its own process group, never waited for: it outlives this process by design.
        #[allow(clippy::zombie_processes)]
        Command::new(exe)
            .args(["lab", "down", "--name", name, "--after-exit"])
            .arg(std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .context("starting the lab's watchdog")?;
        let mut lab = Self {
            exe: exe.to_owned(),
            name: name.to_owned(),
            status: Value::Null,
        };
        run_ok(
            lab.cmd(&["up", "--timeout", "90s", "--no-hints"])
                .args(up_args),
            "wirespan lab up",
        )?;
        lab.refresh()?;
        Ok(lab)
    }

    /// Reads `lab status -o json` again.
    pub(crate) fn refresh(&mut self) -> anyhow::Result<&Value> {
        let out = run_ok(
            &mut self.cmd(&["status", "-o", "json"]),
            "wirespan lab status",
        )?;
        self.status = serde_json::from_slice(&out.stdout).context("lab status JSON")?;
        Ok(&self.status)
    }

    /// `wirespan lab ARGS[0] --name NAME ARGS[1..]`.
    pub(crate) fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.exe);
        c.args(["--log", "warn", "lab"])
            .arg(args[0])
            .args(["--name", &self.name])
            .args(&args[1..]);
        c
    }

    /// A node's entry in the status.
    pub(crate) fn node(&self, name: &str) -> anyhow::Result<&Value> {
        self.status["nodes"]
            .as_array()
            .and_then(|n| n.iter().find(|n| n["name"] == name))
            .with_context(|| format!("lab {} has no {name}", self.name))
    }

    /// A node's network namespace.
    pub(crate) fn namespace(&self, node: &str) -> anyhow::Result<String> {
        Ok(self.node(node)?["namespace"]
            .as_str()
            .context("node without namespace")?
            .to_owned())
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let _ = self
            .cmd(&["down"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}
