//! `wirespan apply --mode try` through the real binary, a node in a namespace: a
//! `RouteConfig` on trial is in the kernel at once and gone after the deadline, with
//! `configstatus` saying it rolled back; a confirmed one stays across a restart; a node
//! killed with SIGKILL during a trial and started after the deadline comes up on the
//! earlier config, and the start-up sweep removes the kernel route the killed process
//! made.

mod common;

use std::{
    path::PathBuf,
    process::Command,
    time::{Duration, Instant, SystemTime},
};

use common::{bin_in, cli, ChildGuard};
use serde_json::Value;
use wirespan_dataplane::netns::NetnsGuard;

const BASE: &str = "apiVersion: v1alpha1\nkind: AddressConfig\nlink: eth9\naddress: 10.88.0.5/24\n";
const ROUTE: &str = "10.77.0.0/16";

fn with_route() -> String {
    format!(
        "{BASE}---\napiVersion: v1alpha1\nkind: RouteConfig\ndestination: {ROUTE}\ngateway: 10.88.0.1\nlink: eth9\n"
    )
}

fn version(text: &str) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(text.as_bytes())[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

struct Node {
    ns: NetnsGuard,
    _dir: tempfile::TempDir,
    dir: PathBuf,
    socket: PathBuf,
    config: PathBuf,
}

impl Node {
    /// A namespace with a veth `eth9` up, and the base config in the file.
    fn new() -> Self {
        let ns = NetnsGuard::new("wstrial").unwrap();
        ns.run(
            "ip",
            &[
                "link", "add", "eth9", "type", "veth", "peer", "name", "eth9p",
            ],
        )
        .unwrap();
        ns.run("ip", &["link", "set", "eth9p", "up"]).unwrap();
        ns.run("ip", &["link", "set", "eth9", "up"]).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_owned();
        let config = dir.join("config.yaml");
        std::fs::write(&config, BASE).unwrap();
        Self {
            ns,
            _dir: tmp,
            socket: dir.join("node.sock"),
            config,
            dir,
        }
    }

    fn start(&self) -> ChildGuard {
        let _ = std::fs::remove_file(&self.socket);
        let child = bin_in(&self.ns)
            .arg("--socket")
            .arg(&self.socket)
            .arg("node")
            .arg("--state-dir")
            .arg(self.dir.join("state"))
            .arg("--config")
            .arg(&self.config)
            .env_remove("WIRESPAN_SOCKET")
            .spawn()
            .unwrap();
        let g = ChildGuard(child);
        common::wait_for_path(&self.socket);
        g
    }

    fn cli(&self, args: &[&str]) -> std::process::Output {
        cli(&self.socket, args)
    }

    fn has_route(&self) -> bool {
        let out = self
            .ns
            .run_stdout("ip", &["-j", "route", "show", ROUTE])
            .unwrap();
        let v: Value = serde_json::from_str(&out).unwrap_or(Value::Null);
        v.as_array().is_some_and(|a| !a.is_empty())
    }

    fn status(&self) -> Value {
        let o = self.cli(&["get", "configstatus", "current", "-o", "json"]);
        let out = common::stdout(&o);
        serde_json::from_str::<Value>(&out).unwrap()["spec"].clone()
    }

    fn apply_try(&self, text: &str, timeout: &str) -> String {
        let file = self.dir.join("trial.yaml");
        std::fs::write(&file, text).unwrap();
        common::stdout(&self.cli(&[
            "apply",
            "--mode",
            "try",
            "--timeout",
            timeout,
            file.to_str().unwrap(),
        ]))
    }
}

fn until(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < deadline, "timed out: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The trial's deadline from the status.
fn deadline_of(st: &Value) -> SystemTime {
    humantime::parse_rfc3339(st["trialDeadline"].as_str().unwrap()).unwrap()
}

fn sigkill(g: ChildGuard) {
    drop(g);
}

#[test]
fn a_route_on_trial_is_there_at_once_and_gone_after_a_15s_deadline() {
    let node = Node::new();
    let _n = node.start();
    until("the base config", Duration::from_secs(10), || {
        node.status()["acceptedVersion"] == version(BASE)
    });
    let before = Instant::now();
    let out = node.apply_try(&with_route(), "15s");
    assert!(out.starts_with("config on trial: version"), "{out}");
    until("the route on trial", Duration::from_secs(5), || {
        node.has_route()
    });
    let st = node.status();
    assert_eq!(st["trialVersion"], version(&with_route()));
    assert_eq!(st["trialPreviousVersion"], version(BASE));
    let status = common::stdout(&node.cli(&["status"]));
    assert!(status.contains("ON TRIAL until"), "{status}");
    // The config file still holds the earlier config: a restart must find it there.
    assert_eq!(std::fs::read_to_string(&node.config).unwrap(), BASE);

    until("the rollback", Duration::from_secs(15 + 10), || {
        !node.has_route()
    });
    let gone = before.elapsed();
    assert!(gone >= Duration::from_secs(15), "gone after {gone:?}");
    let st = node.status();
    assert_eq!(st["acceptedVersion"], version(BASE));
    let last = st["lastTrial"].as_str().unwrap();
    assert!(
        last.starts_with(&format!(
            "rolled back to {}: not confirmed by its deadline",
            version(BASE)
        )),
        "{last}"
    );
    let status = common::stdout(&node.cli(&["status"]));
    assert!(status.contains("last trial: rolled back"), "{status}");
}

#[test]
fn a_confirmed_trial_stays_past_its_deadline_and_across_a_restart() {
    let node = Node::new();
    let n = node.start();
    until("the base config", Duration::from_secs(10), || {
        node.status()["acceptedVersion"] == version(BASE)
    });
    node.apply_try(&with_route(), "4s");
    until("the route on trial", Duration::from_secs(5), || {
        node.has_route()
    });
    let deadline = deadline_of(&node.status());
    let out = common::stdout(&node.cli(&["apply", "--confirm"]));
    assert!(out.starts_with("config trial confirmed"), "{out}");
    assert_eq!(
        std::fs::read_to_string(&node.config).unwrap(),
        with_route(),
        "confirming writes the config file"
    );
    let o = node.cli(&["apply", "--confirm"]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("no config trial in progress"),
        "{o:?}"
    );

    sigkill(n);
    let _n = node.start();
    until(
        "the restarted node's status",
        Duration::from_secs(10),
        || node.status()["acceptedVersion"] == version(&with_route()),
    );
    until(
        "the route after the restart",
        Duration::from_secs(10),
        || node.has_route(),
    );
    until("the old deadline to pass", Duration::from_secs(10), || {
        SystemTime::now() > deadline + Duration::from_secs(2)
    });
    assert!(node.has_route(), "the confirmed route was rolled back");
    assert_eq!(node.status()["acceptedVersion"], version(&with_route()));
}

#[test]
fn a_node_killed_during_a_trial_and_started_after_the_deadline_comes_up_on_the_earlier_config() {
    let node = Node::new();
    let n = node.start();
    until("the base config", Duration::from_secs(10), || {
        node.status()["acceptedVersion"] == version(BASE)
    });
    node.apply_try(&with_route(), "3s");
    until("the route on trial", Duration::from_secs(5), || {
        node.has_route()
    });
    let deadline = deadline_of(&node.status());
    sigkill(n);
    until("the deadline to pass", Duration::from_secs(10), || {
        SystemTime::now() > deadline
    });
    let _n = node.start();
    until("the earlier config", Duration::from_secs(10), || {
        node.status()["acceptedVersion"] == version(BASE)
    });
    let last = node.status()["lastTrial"].as_str().unwrap().to_owned();
    assert!(
        last.starts_with(&format!("rolled back to {} at start", version(BASE))),
        "{last}"
    );
    // The config in force has no such route.
    let specs = common::stdout(&node.cli(&["get", "routespecs"]));
    assert!(!specs.contains(ROUTE), "{specs}");
    assert!(!node.dir.join("state/config-trial.json").exists());
    // Nor has the kernel, once the start-up sweep's settle time (10 s) has passed:
    // the killed process made the route (protocol 212), and no spec names it now.
    let restarted = Instant::now();
    until(
        "the killed trial's kernel route swept",
        Duration::from_secs(25),
        || !node.has_route(),
    );
    assert!(
        restarted.elapsed() >= Duration::from_secs(8),
        "swept {:?} after the restart, before the settle time",
        restarted.elapsed()
    );
}

#[test]
fn patch_and_edit_validate_whole_show_a_diff_and_apply_in_the_mode_asked() {
    let node = Node::new();
    let _n = node.start();
    until("the base config", Duration::from_secs(10), || {
        node.status()["acceptedVersion"] == version(BASE)
    });
    // Invalid as a whole (a route over a link the patch gives a bad MTU): nothing.
    let o = node.cli(&[
        "patch",
        "--patch",
        "apiVersion: v1alpha1\nkind: LinkConfig\nname: eth9\nmtu: 1\n",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("mtu: 1 is outside"), "{err}");
    assert!(err.contains("nothing applied"), "{err}");
    assert_eq!(node.status()["acceptedVersion"], version(BASE));

    let route = with_route();
    let route_doc = &route[BASE.len() + "---\n".len()..];
    let out = common::stdout(&node.cli(&[
        "patch",
        "--mode",
        "try",
        "--timeout",
        "10m",
        "--patch",
        route_doc,
    ]));
    assert!(
        out.starts_with("added RouteConfig \"inet4/10.88.0.1/10.77.0.0/16/1024\"\n"),
        "{out}"
    );
    assert!(
        out.contains("+kind: RouteConfig\n+destination: 10.77.0.0/16\n"),
        "{out}"
    );
    assert!(out.contains("config on trial: version"), "{out}");
    until("the patched route", Duration::from_secs(5), || {
        node.has_route()
    });
    assert_eq!(node.status()["trialVersion"], version(&route));

    // The editor changes the route; a plain apply, so the trial ends.
    let sed = "sed -i -e s#10.77.0.0/16#10.78.0.0/16#";
    let o = Command::new(common::BIN)
        .arg("--socket")
        .arg(&node.socket)
        .arg("edit")
        .env_remove("WIRESPAN_SOCKET")
        .env_remove("VISUAL")
        .env("EDITOR", sed)
        .output()
        .unwrap();
    let out = common::stdout(&o);
    assert!(
        out.contains("-destination: 10.77.0.0/16\n+destination: 10.78.0.0/16\n"),
        "{out}"
    );
    let edited = route.replace("10.77.0.0/16", "10.78.0.0/16");
    assert_eq!(node.status()["acceptedVersion"], version(&edited));
    let st = node.status();
    assert!(st["trialVersion"].is_null(), "{st}");
    assert_eq!(st["lastTrial"], "ended by a plain apply from api");
    assert_eq!(std::fs::read_to_string(&node.config).unwrap(), edited);
}

#[test]
fn a_trial_rolls_back_at_once_when_the_address_to_keep_is_unreachable() {
    let node = Node::new();
    let _n = node.start();
    until("the base config", Duration::from_secs(10), || {
        node.status()["acceptedVersion"] == version(BASE)
    });
    let file = node.dir.join("trial.yaml");
    std::fs::write(&file, with_route()).unwrap();
    // Loopback is down in the fresh namespace: every connect fails at once.
    let out = common::stdout(&node.cli(&[
        "apply",
        "--mode",
        "try",
        "--timeout",
        "10m",
        "--rollback-unless-reachable",
        "127.0.0.1:9",
        "--failure-threshold",
        "2",
        file.to_str().unwrap(),
    ]));
    assert!(out.starts_with("config on trial"), "{out}");
    until(
        "the rollback on unreachability",
        Duration::from_secs(10),
        || node.status()["acceptedVersion"] == version(BASE),
    );
    let last = node.status()["lastTrial"].as_str().unwrap().to_owned();
    assert!(
        last.contains("127.0.0.1:9 unreachable 2 time(s) in a row"),
        "{last}"
    );
    until("the route removed", Duration::from_secs(10), || {
        !node.has_route()
    });
}
