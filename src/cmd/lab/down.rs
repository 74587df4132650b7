//! `wirespan lab down`: removes everything a lab made, found by its name alone (the
//! state file may be missing or stale after a crash).

use std::{
    os::fd::{FromRawFd as _, OwnedFd},
    time::Duration,
};

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

/// Blocks until process `pid` has exited: a pidfd becomes readable when it does (no
/// polling, no pid-reuse race once the fd is open). A process already gone returns
/// at once.
///
/// # Errors
/// The kernel has no pidfd_open (before 5.3), or poll failed.
#[allow(unsafe_code)] // pidfd_open(2): nix 0.29 has no wrapper for it.
pub fn wait_for_exit(pid: i32) -> anyhow::Result<()> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { nix::libc::syscall(nix::libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(nix::libc::ESRCH) {
            return Ok(());
        }
        return Err(err).with_context(|| format!("pidfd_open({pid})"));
    }
    let fd = i32::try_from(fd).context("pidfd out of range")?;
    // SAFETY: `fd` was just returned by pidfd_open and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    loop {
        let mut fds = [nix::poll::PollFd::new(
            std::os::fd::AsFd::as_fd(&fd),
            nix::poll::PollFlags::POLLIN,
        )];
        match nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE) {
            Ok(_) => return Ok(()),
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e).context("waiting for the process to exit"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_for_exit_returns_when_the_process_ends() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(wait_for_exit(pid).is_ok()).unwrap());
        // Still waiting while the process lives.
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap());
        // A process that no longer exists: at once.
        assert!(wait_for_exit(pid).is_ok());
    }
}
