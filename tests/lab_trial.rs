//! Issue 33's acceptance in a two-node lab, through the fleet API from node1:
//! `wirespan -n node2 apply --mode try --timeout 15s` with a `RouteConfig` adding a
//! route on node2 puts the route in node2's kernel at once and takes it out within
//! 10 s after the deadline, and node2's `configstatus` says it rolled back; the same
//! confirmed with `apply --confirm` stays past its deadline and across a restart of
//! node2's daemon (`kill -9`, then `wirespan node` again inside the node with the
//! arguments `lab up` gave it).

mod common;

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant, SystemTime},
};

use common::{lab::Lab, BIN};
use serde_json::Value;

/// TEST-NET-2: a route no lab traffic uses.
const ROUTE: &str = "198.51.100.0/24";

fn version(text: &str) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(text.as_bytes())[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn until(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < deadline, "timed out: {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn node<'a>(st: &'a Value, name: &str) -> &'a Value {
    st["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == name)
        .unwrap()
}

fn node2_has_route(lab: &Lab) -> bool {
    let out = lab.exec_ok("node2", &["ip", "-j", "route", "show", ROUTE]);
    serde_json::from_str::<Value>(&out)
        .ok()
        .and_then(|v| v.as_array().map(|a| !a.is_empty()))
        .unwrap_or(false)
}

/// node2's `configstatus` read from node1 through the fleet API (`None` while node2
/// does not answer, as during its restart).
fn node2_status(lab: &Lab) -> Option<Value> {
    let o = lab.exec(
        "node1",
        &[
            "wirespan",
            "-n",
            "node2",
            "get",
            "configstatus",
            "current",
            "-o",
            "json",
        ],
    );
    let v: Value = serde_json::from_slice(&o.stdout).ok()?;
    let v = v.as_array().and_then(|a| a.first().cloned()).unwrap_or(v);
    o.status.success().then(|| v["spec"].clone())
}

/// `wirespan -n node2 apply ARGS` from node1.
fn apply_on_node2(lab: &Lab, args: &[&str]) -> String {
    let mut all = vec!["wirespan", "-n", "node2", "apply"];
    all.extend_from_slice(args);
    lab.exec_ok("node1", &all)
}

fn deadline_of(st: &Value) -> SystemTime {
    humantime::parse_rfc3339(st["trialDeadline"].as_str().unwrap()).unwrap()
}

/// node2's daemon started again inside the node with the arguments `lab up` gives it;
/// killed on drop (and by `lab down` anyway).
struct Restarted(Child);

impl Restarted {
    fn start(lab: &Lab, n: &Value) -> Self {
        let dir = lab.dir().join("node2");
        let log = std::fs::File::create(dir.join("node-restart.log")).unwrap();
        let api = format!("[::]:{}", wirespan_control::api::client::DEFAULT_PORT);
        let host_root = dir.join("host");
        let child = Command::new(BIN)
            .args([
                "lab", "exec", "--name", &lab.name, "node2", "--", "wirespan",
            ])
            .args(["--socket", n["socket"].as_str().unwrap(), "node"])
            .args(["--state-dir", n["stateDir"].as_str().unwrap()])
            .args(["--config", n["config"].as_str().unwrap()])
            .args(["--wireguard", n["wireguard"].as_str().unwrap_or("auto")])
            .args(["--api-listen", &api])
            .args(["--host-root", host_root.to_str().unwrap()])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        Self(child)
    }
}

impl Drop for Restarted {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_route_tried_on_node2_rolls_back_after_15s_and_a_confirmed_one_stays_across_a_restart() {
    let lab = Lab::new();
    lab.ok(&["up", "--nodes", "2"]);
    let st = lab.status();
    let n2 = node(&st, "node2").clone();
    let gateway = node(&st, "node1")["addresses"]["underlay"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .find(|a| !a.contains(':'))
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_owned();
    let base = std::fs::read_to_string(n2["config"].as_str().unwrap()).unwrap();
    let sep = if base.ends_with('\n') { "" } else { "\n" };
    let trial = format!(
        "{base}{sep}---\napiVersion: v1alpha1\nkind: RouteConfig\ndestination: {ROUTE}\ngateway: {gateway}\n"
    );
    let file = lab.dir().join("trial.yaml");
    std::fs::write(&file, &trial).unwrap();
    let file = file.to_str().unwrap();
    until("node2's status", Duration::from_secs(20), || {
        node2_status(&lab).is_some_and(|s| s["acceptedVersion"] == version(&base))
    });

    // Tried and not confirmed: in at once, out within 10 s after the deadline.
    apply_on_node2(&lab, &["--mode", "try", "--timeout", "15s", file]);
    until("the route on trial", Duration::from_secs(5), || {
        node2_has_route(&lab)
    });
    let st = node2_status(&lab).unwrap();
    assert_eq!(st["trialVersion"], version(&trial), "{st}");
    let deadline = deadline_of(&st);
    until("the rollback", Duration::from_secs(30), || {
        !node2_has_route(&lab)
    });
    let late = SystemTime::now().duration_since(deadline);
    assert!(
        late.as_ref().is_ok_and(|d| *d <= Duration::from_secs(10)),
        "route gone {late:?} after the deadline"
    );
    let st = node2_status(&lab).unwrap();
    let last = st["lastTrial"].as_str().unwrap_or_default();
    assert!(
        last.starts_with(&format!("rolled back to {}", version(&base))),
        "{st}"
    );
    assert_eq!(st["acceptedVersion"], version(&base));

    // Tried and confirmed: stays past the deadline.
    apply_on_node2(&lab, &["--mode", "try", "--timeout", "15s", file]);
    until("the route on trial again", Duration::from_secs(5), || {
        node2_has_route(&lab)
    });
    let deadline = deadline_of(&node2_status(&lab).unwrap());
    apply_on_node2(&lab, &["--confirm"]);
    let st = node2_status(&lab).unwrap();
    assert!(
        st["lastTrial"]
            .as_str()
            .is_some_and(|l| l.starts_with("confirmed")),
        "{st}"
    );
    until(
        "the confirmed trial's deadline",
        Duration::from_secs(20),
        || SystemTime::now() > deadline + Duration::from_secs(2),
    );
    assert!(node2_has_route(&lab), "the confirmed route was rolled back");
    assert_eq!(
        node2_status(&lab).unwrap()["acceptedVersion"],
        version(&trial)
    );

    // Across a restart: kill -9, take the route out by hand, start again; the
    // restarted daemon puts it back from the confirmed config.
    let pid = n2["pid"].as_u64().unwrap().to_string();
    assert!(Command::new("kill")
        .args(["-9", &pid])
        .status()
        .unwrap()
        .success());
    until("node2's daemon to die", Duration::from_secs(10), || {
        !common::lab::alive(pid.parse().unwrap())
    });
    lab.exec_ok("node2", &["ip", "route", "del", ROUTE]);
    let _daemon = Restarted::start(&lab, &n2);
    until(
        "the route after the restart",
        Duration::from_secs(20),
        || node2_has_route(&lab),
    );
    until(
        "node2's status after the restart",
        Duration::from_secs(30),
        || node2_status(&lab).is_some_and(|s| s["acceptedVersion"] == version(&trial)),
    );
}
