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

#[test]
fn a_stranger_with_the_cluster_id_deleting_every_second_does_not_cut_the_mesh() {
    let lab = Lab::new();
    lab.ok(&["up", "--nodes", "2", "--timeout", "45s", "--no-hints"]);
    let st = lab.status();
    let (cluster_id, _) = cluster_identity(&st);
    let server: SocketAddr = st["discovery"]["address"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    // The attacker runs beside the server: it needs nothing but a route and the ID.
    let attacker = Netns::named(st["discovery"]["namespace"].as_str().unwrap());
    let id = cluster_id.clone();
    let before = attacker
        .block_on(move || async move { listed(server, &id).await })
        .unwrap();
    assert_eq!(
        before.len(),
        2,
        "both nodes listed before the attack: {before:?}"
    );
    let ula2 = node(&st, "node2")["addresses"]["kubespan"]
        .as_str()
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_owned();
    let ns1 = node(&st, "node1")["namespace"].as_str().unwrap().to_owned();

    // Pings for the attack and the time allowed to recover after it.
    let ping = TimedPing::start(&ns1, &ula2, (ATTACK + RELIST).as_secs());
    let (id, ids) = (cluster_id.clone(), before.clone());
    let (accepted, calls) = attacker
        .block_on(move || async move { delete_storm(server, id, ids, ATTACK).await })
        .unwrap();
    eprintln!("attack: {accepted} of {calls} deletes accepted");
    assert!(
        accepted > 0,
        "the server refused every delete: nothing was tested"
    );
    let stopped = Instant::now();
    let relisted = loop {
        let id = cluster_id.clone();
        let now = attacker
            .block_on(move || async move { listed(server, &id).await })
            .unwrap();
        if now == before {
            break stopped.elapsed();
        }
        assert!(
            stopped.elapsed() < RELIST,
            "after {RELIST:?} the server lists {now:?}, not {before:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    eprintln!("both affiliates listed again {relisted:?} after the attack");
    let (sent, answered) = ping.finish();
    #[allow(clippy::cast_precision_loss)]
    let share = answered as f64 / sent as f64;
    eprintln!("pings node1 → node2 ({ula2}): {answered} of {sent} answered");
    assert!(
        share >= MIN_ANSWERED,
        "only {answered} of {sent} pings answered during and after the attack"
    );

    // The nodes saw themselves deleted and said so, without the cluster ID.
    for name in ["node1", "node2"] {
        assert!(republishes(&lab, name) > 0, "{name} never re-published");
        let log = std::fs::read_to_string(node(&st, name)["log"].as_str().unwrap()).unwrap();
        assert!(
            log.contains("re-publishing"),
            "{name}'s log has no re-publish line"
        );
        assert!(
            !log.contains(&cluster_id),
            "{name}'s log contains the cluster ID"
        );
    }
}
