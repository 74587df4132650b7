//! `wirespan lab down`: removes everything a lab made, found by its name alone (the
//! state file may be missing or stale after a crash).

use std::time::Duration;

use anyhow::Context as _;

use super::{host, plan::LabName};

/// What `down` removed.
#[derive(Debug, Default)]
pub struct Removed {
    /// Network namespaces deleted.
    pub namespaces: Vec<String>,
    /// Processes stopped.
    pub processes: usize,
    /// The lab directory existed.
    pub dir: bool,
}

/// Removes lab `name`: stops every process in its namespaces (SIGTERM, then SIGKILL),
/// deletes the namespaces (with them the bridge and veths, which never leave them),
/// unmounts its namespace files and deletes its directory. Idempotent.
pub fn down(name: &LabName) -> anyhow::Result<Removed> {
    let mut removed = Removed::default();
    let namespaces: Vec<String> = host::netns_list()
        .into_iter()
        .filter(|n| name.owns_netns(n))
        .collect();
    let mut pids: Vec<i32> = namespaces
        .iter()
        .flat_map(|n| host::netns_pids(n))
        .collect();
    pids.sort_unstable();
    pids.dedup();
    removed.processes = pids.iter().filter(|p| host::alive(**p)).count();
    host::stop(&pids, Duration::from_secs(3));
    for n in &namespaces {
        // Something may have entered it meanwhile (an `exec` shell): stop it too.
        host::stop(&host::netns_pids(n), Duration::from_secs(1));
        host::run("ip", &["netns", "del", n])
            .with_context(|| format!("deleting network namespace {n}"))?;
    }
    removed.namespaces = namespaces;
    let dir = name.dir();
    host::unmount_all_under(&dir)?;
    if dir.exists() {
        removed.dir = true;
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    Ok(removed)
}

/// Runs `down` and reports what it did.
pub fn run(name: &LabName) -> anyhow::Result<()> {
    let r = down(name)?;
    if r.namespaces.is_empty() && !r.dir {
        println!("lab {name}: nothing to remove");
    } else {
        println!(
            "lab {name} removed: {} namespaces, {} processes, directory {}",
            r.namespaces.len(),
            r.processes,
            name.dir().display()
        );
    }
    Ok(())
}
