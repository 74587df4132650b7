//! A stranger who knows only the cluster ID (a bearer credential of the upstream
//! protocol) attacks a 2-node lab through its discovery server: the real binary, a
//! real server and real WireGuard. The nodes defend their mesh: each re-publishes its
//! affiliate when it sees it deleted, and a peer with a fresh session is not dropped
//! because discovery stopped listing it.
//!
//! The lab has a unique name and its guard runs `lab down` even when the test fails;
//! the ping child is killed on drop.

mod common;

use std::{
    net::SocketAddr,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use common::{lab::Lab, talos::cluster_identity};
use nix::sys::signal::Signal;
use serde_json::Value;
use wirespan_dataplane::netns::Netns;
use wirespan_discovery::proto::server::{
    cluster_client::ClusterClient, AffiliateDeleteRequest, ListRequest,
};

/// How long the attacker deletes, once a second.
const ATTACK: Duration = Duration::from_secs(60);
/// How soon after the attack both affiliates must be listed again.
const RELIST: Duration = Duration::from_secs(30);
/// The share of pings that must be answered, during the attack and after it.
const MIN_ANSWERED: f64 = 0.95;

/// `ping` from a node's namespace for a fixed time; killed on drop.
struct TimedPing {
    child: Option<Child>,
}

impl TimedPing {
    /// One echo request every 0.2 s to `to` for `secs` seconds, 1 s to answer each.
    fn start(netns: &str, to: &str, secs: u64) -> Self {
        let child = Command::new("ip")
            .args([
                "netns", "exec", netns, "ping", "-n", "-q", "-i", "0.2", "-W", "1",
            ])
            .args(["-w", &secs.to_string(), to])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        Self { child: Some(child) }
    }

    /// Ends it now (ping prints its summary on SIGINT); returns (sent, answered).
    fn stop(self) -> (u64, u64) {
        if let Some(c) = &self.child {
            signal(c.id(), Signal::SIGINT);
        }
        self.finish()
    }

    /// Waits for the end; returns (sent, answered) from ping's summary.
    fn finish(mut self) -> (u64, u64) {
        let out = self.child.take().unwrap().wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let summary = text
            .lines()
            .find(|l| l.contains("packets transmitted"))
            .unwrap_or_else(|| panic!("no ping summary in {text:?}"));
        let number = |after: &str| -> u64 {
            summary
                .split(',')
                .find(|p| p.contains(after))
                .and_then(|p| p.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("no {after:?} in {summary:?}"))
        };
        (number("transmitted"), number("received"))
    }
}

impl Drop for TimedPing {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn signal(pid: u32, signal: Signal) {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap());
    nix::sys::signal::kill(pid, signal).unwrap();
}

/// A node daemon stopped with SIGSTOP (its discovery client frozen, its WireGuard
/// device working on: wireguard-go or the kernel); SIGCONT on drop, also when the test
/// fails.
struct Frozen(u32);

impl Frozen {
    fn new(pid: u32) -> Self {
        signal(pid, Signal::SIGSTOP);
        Self(pid)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(self.0).unwrap()),
            Signal::SIGCONT,
        );
    }
}

async fn client(server: SocketAddr) -> ClusterClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{server}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connecting to the lab's discovery server {server}: {e}"));
    ClusterClient::new(channel)
}

/// The IDs of the affiliates the server lists with data.
async fn listed(server: SocketAddr, cluster_id: &str) -> Vec<String> {
    let reply = client(server)
        .await
        .list(ListRequest {
            cluster_id: cluster_id.to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut ids: Vec<String> = reply
        .affiliates
        .into_iter()
        .filter(|a| !a.data.is_empty())
        .map(|a| a.id)
        .collect();
    ids.sort();
    ids
}

/// Deletes every affiliate in `ids` once a second for `how_long`; returns how many
/// deletes the server accepted and how many calls were made.
async fn delete_storm(
    server: SocketAddr,
    cluster_id: String,
    ids: Vec<String>,
    how_long: Duration,
) -> (u32, u32) {
    let mut c = client(server).await;
    let (mut accepted, mut calls) = (0, 0);
    let end = tokio::time::Instant::now() + how_long;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while tokio::time::Instant::now() < end {
        tick.tick().await;
        for id in &ids {
            calls += 1;
            let r = c
                .affiliate_delete(AffiliateDeleteRequest {
                    cluster_id: cluster_id.clone(),
                    affiliate_id: id.clone(),
                })
                .await;
            if r.is_ok() {
                accepted += 1;
            }
        }
    }
    (accepted, calls)
}

fn node<'a>(st: &'a Value, name: &str) -> &'a Value {
    st["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == name)
        .unwrap()
}

/// Re-publishes node `name` counted (its discovery service status).
fn republishes(lab: &Lab, name: &str) -> u64 {
    let out = lab.exec_ok(
        name,
        &["wirespan", "get", "discoveryservices", "-o", "json"],
    );
    serde_json::Deserializer::from_str(&out)
        .into_iter::<Value>()
        .map(|v| v.unwrap()["spec"]["republishes"].as_u64().unwrap_or(0))
        .sum()
}

/// The peer statuses of node `name`.
fn peers(lab: &Lab, name: &str) -> Vec<Value> {
    let out = lab.exec_ok(name, &["wirespan", "get", "peers", "-o", "json"]);
    serde_json::Deserializer::from_str(&out)
        .into_iter::<Value>()
        .map(Result::unwrap)
        .collect()
}

/// Polls `f` every 0.5 s until it returns `Some` or `limit` passes.
fn within<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "not within {limit:?}: {what}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// A 2-node mesh, and what the attacker and the checks need of it.
struct Scene {
    lab: Lab,
    st: Value,
    cluster_id: String,
    server: SocketAddr,
    /// The attacker runs beside the server: it needs nothing but a route and the ID.
    attacker: Netns,
    /// The affiliates listed before the attack.
    before: Vec<String>,
    /// node2's KubeSpan address.
    ula2: String,
    /// node1's network namespace.
    ns1: String,
}

impl Scene {
    fn up() -> Self {
        let lab = Lab::new();
        lab.ok(&["up", "--nodes", "2", "--timeout", "45s", "--no-hints"]);
        let st = lab.status();
        let (cluster_id, _) = cluster_identity(&st);
        let server = st["discovery"]["address"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        let attacker = Netns::named(st["discovery"]["namespace"].as_str().unwrap());
        let ula2 = node(&st, "node2")["addresses"]["kubespan"]
            .as_str()
            .unwrap();
        let ula2 = ula2.split('/').next().unwrap().to_owned();
        let ns1 = node(&st, "node1")["namespace"].as_str().unwrap().to_owned();
        let mut scene = Self {
            lab,
            st,
            cluster_id,
            server,
            attacker,
            before: Vec::new(),
            ula2,
            ns1,
        };
        scene.before = scene.listed();
        assert_eq!(
            scene.before.len(),
            2,
            "both nodes listed: {:?}",
            scene.before
        );
        scene
    }

    /// Deletes every affiliate listed before, once a second for `how_long`; returns
    /// (accepted, calls).
    fn delete_storm(&self, how_long: Duration) -> (u32, u32) {
        let (server, id, ids) = (self.server, self.cluster_id.clone(), self.before.clone());
        self.attacker
            .block_on(move || async move { delete_storm(server, id, ids, how_long).await })
            .unwrap()
    }

    /// The affiliates the server lists with data.
    fn listed(&self) -> Vec<String> {
        let (server, id) = (self.server, self.cluster_id.clone());
        self.attacker
            .block_on(move || async move { listed(server, &id).await })
            .unwrap()
    }

    fn ping(&self, secs: u64) -> TimedPing {
        TimedPing::start(&self.ns1, &self.ula2, secs)
    }
}

fn assert_answered((sent, answered): (u64, u64), to: &str) {
    #[allow(clippy::cast_precision_loss)]
    let share = answered as f64 / sent as f64;
    eprintln!("pings node1 → node2 ({to}): {answered} of {sent} answered");
    assert!(
        share >= MIN_ANSWERED,
        "only {answered} of {sent} pings node1 → node2 answered"
    );
}

/// The acceptance test of issue 35: both affiliates deleted every second for 60 s by a
/// client that knows only the cluster ID. The nodes re-publish at once (at most once a
/// second), so the mesh stays up and both are listed again right after.
#[test]
fn a_stranger_with_the_cluster_id_deleting_every_second_does_not_cut_the_mesh() {
    let scene = Scene::up();
    // Pings for the attack and the time allowed to recover after it.
    let ping = scene.ping((ATTACK + RELIST).as_secs());
    let (accepted, calls) = scene.delete_storm(ATTACK);
    eprintln!("attack: {accepted} of {calls} deletes accepted");
    assert!(
        accepted > 0,
        "the server refused every delete: nothing was tested"
    );
    let stopped = Instant::now();
    within(RELIST, "both affiliates listed again", || {
        (scene.listed() == scene.before).then_some(())
    });
    eprintln!(
        "both affiliates listed again {:?} after the attack",
        stopped.elapsed()
    );
    assert_answered(ping.finish(), &scene.ula2);

    // The nodes saw themselves deleted and said so, without the cluster ID.
    for name in ["node1", "node2"] {
        assert!(
            republishes(&scene.lab, name) > 0,
            "{name} never re-published"
        );
        let log = node(&scene.st, name)["log"].as_str().unwrap();
        let log = std::fs::read_to_string(log).unwrap();
        assert!(
            log.contains("re-publishing"),
            "{name}'s log has no re-publish line"
        );
        assert!(
            !log.contains(&scene.cluster_id),
            "{name}'s log contains the cluster ID"
        );
    }
}

/// The second defence: a node that cannot re-publish (its daemon frozen here) is
/// deleted and stays unlisted, yet its peer keeps it while their WireGuard session is
/// fresh, says why in `get peers`, and takes it back as listed once it re-publishes.
#[test]
fn a_peer_deleted_from_discovery_is_kept_while_its_session_is_fresh() {
    let scene = Scene::up();
    let ping = scene.ping(300);
    let frozen =
        Frozen::new(u32::try_from(node(&scene.st, "node2")["pid"].as_u64().unwrap()).unwrap());
    let (accepted, _) = scene.delete_storm(Duration::from_millis(1));
    assert_eq!(
        accepted, 2,
        "the server refused the deletes: nothing was tested"
    );
    // node1 re-publishes itself; node2 cannot and stays unlisted.
    within(Duration::from_secs(10), "only node1 listed", || {
        (scene.listed().len() == 1).then_some(())
    });
    // Discovery forgets node2 on node1 after its grace; the peer stays, with a reason.
    let reason = within(
        Duration::from_secs(100),
        "node1 keeps node2 unlisted",
        || {
            let p = peers(&scene.lab, "node1");
            assert_eq!(p.len(), 1, "node1 dropped its peer: {p:?}");
            p[0]["spec"]["retainedReason"].as_str().map(str::to_owned)
        },
    );
    assert_eq!(
        reason,
        "not listed by discovery; kept while its session is fresh"
    );
    let table = scene.lab.exec_ok("node1", &["wirespan", "get", "peers"]);
    assert!(
        table.contains("RETAINED") && table.contains(&reason),
        "{table}"
    );
    // Unlisted and kept for a while: traffic goes on.
    let kept = Instant::now();
    within(Duration::from_secs(30), "10 s kept", || {
        let p = peers(&scene.lab, "node1");
        assert_eq!(
            p[0]["spec"]["retainedReason"].as_str(),
            Some(reason.as_str())
        );
        (kept.elapsed() >= Duration::from_secs(10)).then_some(())
    });

    // node2 comes back and re-publishes: listed again, the reason goes.
    drop(frozen);
    within(Duration::from_secs(30), "node2 listed again", || {
        (scene.listed() == scene.before).then_some(())
    });
    within(Duration::from_secs(30), "node1 lists node2 again", || {
        let p = peers(&scene.lab, "node1");
        assert_eq!(p.len(), 1, "{p:?}");
        p[0]["spec"].get("retainedReason").is_none().then_some(())
    });
    assert_answered(ping.stop(), &scene.ula2);
}
