//! The lab's edge to the host: commands (`ip`, `unshare`, `nsenter`, `mount`), process
//! signals and the mount table.

use std::{
    fs::File,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use nix::{sys::signal::Signal, unistd::Pid};

/// Runs `program args…`; a failure is an error with its stderr.
pub fn run(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("starting {program} (is it installed? see scripts/setup.sh)"))?;
    if !out.status.success() {
        anyhow::bail!(
            "{program} {}: {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `ip -n NETNS args…`.
pub fn ip_in(netns: &str, args: &[&str]) -> anyhow::Result<String> {
    let mut all = vec!["-n", netns];
    all.extend_from_slice(args);
    run("ip", &all)
}

/// Every named network namespace (`/run/netns`).
pub fn netns_list() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/run/netns") else {
        return Vec::new();
    };
    let mut v: Vec<String> = dir
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    v.sort();
    v
}

/// Pids of the processes in network namespace `netns`.
pub fn netns_pids(netns: &str) -> Vec<i32> {
    run("ip", &["netns", "pids", netns])
        .map(|o| {
            o.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// True while `pid` exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name in parentheses.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Sends SIGTERM to `pids`, waits up to `grace` for them to end, then SIGKILLs what is
/// left and waits again.
pub fn stop(pids: &[i32], grace: Duration) {
    for sig in [Signal::SIGTERM, Signal::SIGKILL] {
        let left: Vec<i32> = pids.iter().copied().filter(|p| alive(*p)).collect();
        if left.is_empty() {
            return;
        }
        for p in &left {
            let _ = nix::sys::signal::kill(Pid::from_raw(*p), sig);
        }
        let deadline = Instant::now() + grace;
        while left.iter().any(|p| alive(*p)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Mount points at or below `dir`, deepest first, parsed from a mountinfo text.
#[must_use]
pub fn mounts_under(mountinfo: &str, dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(p.replace("\\040", " ")))
        .filter(|p| p.starts_with(dir))
        .collect();
    v.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    v.dedup();
    v
}

/// True when `dir` is itself a mount point.
pub fn is_mount_point(dir: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    mounts_under(&info, dir).iter().any(|p| p == dir)
}

/// Makes `dir` a private bind mount of itself (once), so namespace files can be bound
/// inside it, as `ip netns` does for `/run/netns`.
pub fn ensure_private_mount(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let d = dir.to_str().context("non-UTF-8 lab root")?;
    // Labs created at the same time must not both bind it.
    let lock_path = dir.with_extension("lock");
    let lock =
        File::create(&lock_path).with_context(|| format!("creating {}", lock_path.display()))?;
    lock.lock()
        .with_context(|| format!("locking {}", lock_path.display()))?;
    if !is_mount_point(dir) {
        run("mount", &["--bind", d, d])?;
    }
    run("mount", &["--make-private", d])?;
    Ok(())
}

/// Unmounts every mount at or below `dir` (lazily: nothing can keep it busy).
pub fn unmount_all_under(dir: &Path) -> anyhow::Result<()> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").context("reading mountinfo")?;
    for m in mounts_under(&info, dir) {
        let p = m.to_str().context("non-UTF-8 mount point")?;
        run("umount", &["-l", p])?;
    }
    Ok(())
}

/// Starts `args` detached (new session, no terminal, output to `log`) inside the given
/// namespaces; `nsenter` and `setsid` exec, so the pid is the program's own.
pub fn spawn_detached(
    netns: &str,
    mount_uts: Option<(&Path, &Path)>,
    args: &[&str],
    log: &Path,
) -> anyhow::Result<Child> {
    let out = File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let err = out.try_clone()?;
    let mut cmd = Command::new("setsid");
    cmd.arg("nsenter").arg(format!("--net=/run/netns/{netns}"));
    if let Some((mnt, uts)) = mount_uts {
        cmd.arg(format!("--mount={}", mnt.display()))
            .arg(format!("--uts={}", uts.display()));
    }
    cmd.arg("--")
        .args(args)
        // Logs go to a file: no colour codes.
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .with_context(|| format!("starting {} in {netns}", args.join(" ")))
}

/// The last `n` lines of a log file, for error messages.
#[must_use]
pub fn log_tail(log: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mounts_under_a_dir_deepest_first() {
        let info = "\
43 27 254:0 /run/wirespan-lab /run/wirespan-lab rw - ext4 /dev/vda rw
67 43 0:4 uts:[4026532178] /run/wirespan-lab/a/ns/node1.uts rw - nsfs nsfs rw
68 43 0:4 mnt:[4026532177] /run/wirespan-lab/a/ns/node1.mnt rw - nsfs nsfs rw
69 43 0:4 mnt:[4026532179] /run/wirespan-lab/ab/ns/node1.mnt rw - nsfs nsfs rw
70 27 0:5 / /run/netns rw - tmpfs tmpfs rw";
        let m = mounts_under(info, Path::new("/run/wirespan-lab/a"));
        assert_eq!(
            m,
            [
                PathBuf::from("/run/wirespan-lab/a/ns/node1.uts"),
                PathBuf::from("/run/wirespan-lab/a/ns/node1.mnt")
            ]
        );
        let root = mounts_under(info, Path::new("/run/wirespan-lab"));
        assert_eq!(root.last().unwrap(), Path::new("/run/wirespan-lab"));
        assert_eq!(root.len(), 4);
    }
}
