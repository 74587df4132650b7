//! The lab harness of the end-to-end tests: a uniquely named `wirespan lab` driven
//! through the real binary, removed with `lab down` on drop even when a test fails.

use std::{
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use serde_json::Value;

use super::BIN;

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A lab name unique on this host; `lab down` runs on drop.
pub struct Lab {
    pub name: String,
}

impl Lab {
    /// A new lab name. A watchdog (`lab down --after-exit`) removes the lab if this
    /// process dies without dropping the guard (the runner's SIGKILL on a timeout);
    /// the first lab of a process also removes the labs of dead test processes.
    pub fn new() -> Self {
        static SWEEP: std::sync::Once = std::sync::Once::new();
        SWEEP.call_once(sweep_labs_of_dead_tests);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let lab = Self {
            name: format!("t{}x{n}", std::process::id()),
        };
        // Its own process group: the runner kills the test's group on a timeout. Never
        // waited for: it outlives this process by design (and init reaps it).
        #[allow(clippy::zombie_processes)]
        Command::new(BIN)
            .args(["lab", "down", "--name", &lab.name, "--after-exit"])
            .arg(std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("starting the lab's watchdog");
        lab
    }

    /// `wirespan lab ARGS --name NAME`. An `up` that does not say which WireGuard runs
    /// gets the one `WIRESPAN_TEST_WIREGUARD` names (`auto`, `kernel`, `userspace`,
    /// `userspace-go`, or per node as `lab up` takes it; the suite's VM tier sets
    /// `kernel`; unset, the lab's own default `auto`), so the same scenarios run on
    /// `wirespan wireguard` on the host and on kernel WireGuard in the VM.
    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        c.arg("lab").args(args);
        if args.first() == Some(&"up") && !args.contains(&"--wireguard") {
            if let Ok(w) = std::env::var("WIRESPAN_TEST_WIREGUARD") {
                c.args(["--wireguard", &w]);
            }
        }
        c.arg("--name")
            .arg(&self.name)
            .env_remove("WIRESPAN_LAB")
            .env_remove("WIRESPAN_SOCKET")
            .stdin(Stdio::null());
        c
    }

    pub fn run(&self, args: &[&str]) -> Output {
        self.cmd(args).output().unwrap()
    }

    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        assert!(
            o.status.success(),
            "lab {args:?} failed: {}\nstdout:\n{}\nstderr:\n{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        if args.first() == Some(&"up") {
            // The test output says which WireGuard ran: the suite passes on kernels
            // with and without it, and a failure should say which one it met.
            let backends = self.backends();
            eprintln!("lab {}: WireGuard {}", self.name, backends.join(", "));
            for b in &backends {
                if let Some((_, w)) = b.split_once('=').filter(|(_, w)| *w != "?") {
                    super::ran::record("wireguard", w);
                }
            }
        }
        String::from_utf8(o.stdout).unwrap()
    }

    /// Each node's WireGuard implementation as `lab status` reports it
    /// (`node1=userspace`, `node2=userspace-go`, …; `?` while the node has not
    /// programmed its link).
    pub fn backends(&self) -> Vec<String> {
        let st = self.status();
        st["nodes"]
            .as_array()
            .map(|ns| {
                ns.iter()
                    .map(|n| {
                        format!(
                            "{}={}",
                            n["name"].as_str().unwrap_or("?"),
                            n["wireguard"].as_str().unwrap_or("?")
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The WireGuard implementation `node` runs (`kernel`, `userspace`,
    /// `userspace-go`), once known.
    pub fn backend(&self, node: &str) -> String {
        let mut found = String::new();
        wait_until(&format!("{node} to report its WireGuard"), || {
            let st = self.status();
            found = st["nodes"]
                .as_array()
                .and_then(|ns| ns.iter().find(|n| n["name"] == node))
                .and_then(|n| n["wireguard"].as_str())
                .unwrap_or_default()
                .to_owned();
            !found.is_empty()
        });
        found
    }

    /// `lab exec NODE -- args…` (exec takes `--name` before the node).
    pub fn exec(&self, node: &str, args: &[&str]) -> Output {
        Command::new(BIN)
            .args(["lab", "exec", "--name", &self.name, node, "--"])
            .args(args)
            .env_remove("WIRESPAN_SOCKET")
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    pub fn exec_ok(&self, node: &str, args: &[&str]) -> String {
        let o = self.exec(node, args);
        assert!(
            o.status.success(),
            "exec {node} {args:?}: {}\n{}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8(o.stdout).unwrap()
    }

    pub fn status(&self) -> Value {
        serde_json::from_str(&self.ok(&["status", "-o", "json"])).unwrap()
    }

    pub fn prefix(&self) -> String {
        format!("wsl-{}-", self.name)
    }

    pub fn dir(&self) -> PathBuf {
        Path::new("/run/wirespan-lab").join(&self.name)
    }

    pub fn namespaces(&self) -> Vec<String> {
        let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|n| n.starts_with(&self.prefix()))
            .map(str::to_owned)
            .collect()
    }

    /// Every process in the lab's namespaces.
    pub fn pids(&self) -> Vec<i32> {
        self.namespaces()
            .iter()
            .flat_map(|n| {
                let out = Command::new("ip")
                    .args(["netns", "pids", n])
                    .output()
                    .unwrap();
                String::from_utf8_lossy(&out.stdout)
                    .split_whitespace()
                    .filter_map(|p| p.parse().ok())
                    .collect::<Vec<i32>>()
            })
            .collect()
    }

    /// Asserts that nothing of the lab is left: namespaces, host links, processes,
    /// mounts, directory.
    pub fn assert_gone(&self, pids: &[i32]) {
        assert!(self.namespaces().is_empty(), "{:?}", self.namespaces());
        let links: Value = serde_json::from_slice(
            &Command::new("ip")
                .args(["-j", "link", "show"])
                .output()
                .unwrap()
                .stdout,
        )
        .unwrap();
        // Only this lab's objects: other labs may run beside it.
        let ours = self.prefix();
        for l in links.as_array().unwrap() {
            let name = l["ifname"].as_str().unwrap();
            assert!(!name.starts_with(&ours), "lab link {name} in the host");
        }
        for p in pids {
            assert!(!alive(*p), "process {p} of the lab still runs");
        }
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let dir = self.dir();
        assert!(
            !mounts
                .lines()
                .filter_map(|l| l.split(' ').nth(4))
                .any(|m| Path::new(m).starts_with(&dir)),
            "mounts left under {}",
            dir.display()
        );
        assert!(!dir.exists(), "{} left", dir.display());
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let _ = self.run(&["down"]);
    }
}

/// `lab down` for every test lab (`tPIDxN`) whose process is gone. Labs of live
/// processes, and labs not named like a test's, are left alone.
fn sweep_labs_of_dead_tests() {
    let Ok(dir) = std::fs::read_dir("/run/wirespan-lab") else {
        return;
    };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix('t')
            .and_then(|r| r.split_once('x'))
            .filter(|(p, n)| {
                n.bytes().all(|b| b.is_ascii_digit()) && !n.is_empty() && !p.is_empty()
            })
            .and_then(|(p, _)| p.parse::<i32>().ok())
        else {
            continue;
        };
        if !alive(pid) {
            let _ = Command::new(BIN)
                .args(["lab", "down", "--name", &name])
                .stdin(Stdio::null())
                .output();
        }
    }
}

/// Alive and not a zombie (orphans may wait for a reaper that never comes).
pub fn alive(pid: i32) -> bool {
    // Any thread not yet exited: after SIGKILL the leader shows `Z` while the other
    // threads are still exiting, and with them the process's open files (its API
    // socket still accepts connections until the last one is gone).
    let running = |stat: &str| {
        std::fs::read_to_string(stat).is_ok_and(|s| {
            s.rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().next())
                .is_some_and(|st| st != "Z" && st != "X")
        })
    };
    std::fs::read_dir(format!("/proc/{pid}/task")).is_ok_and(|tasks| {
        tasks
            .flatten()
            .any(|t| running(&format!("{}/stat", t.path().display())))
    })
}

pub fn pid_of(v: &Value) -> i32 {
    i32::try_from(v["pid"].as_u64().unwrap()).unwrap()
}

pub fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
