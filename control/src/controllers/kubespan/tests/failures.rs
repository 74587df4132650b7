//! What an operator fears on a live node: a kernel write refused once, kernel state
//! removed behind the manager's back. Each test asserts how the manager noticed (its
//! restart, through the runtime's restart hook that the restart metric counts, or the
//! tick on the fake clock) and that it converged again.

use super::*;
use crate::{controllers::kubespan::manager::NAME, kubespan::rotation::RECONCILE_TICK};

/// `ENOBUFS`: what netlink answers when the kernel is short of memory for a message.
const ENOBUFS: i32 = 105;

fn restarts(m: &Mesh) -> Vec<String> {
    m.restarts.lock().unwrap().clone()
}

async fn one_manager_restart(m: &Mesh) {
    eventually("the refused write restarted the manager", || {
        (!restarts(m).is_empty()).then_some(())
    })
    .await;
}

fn endpoint_of(wg: &FakeWireGuard, n: u8) -> Option<SocketAddr> {
    wg.device()?
        .peers
        .iter()
        .find(|p| p.public_key.to_base64() == key(n))?
        .endpoint
}

#[tokio::test]
async fn a_refused_wireguard_write_is_retried_and_the_new_peer_arrives() {
    let m = start("", tempfile::tempdir().unwrap());
    let store = &m.h.store;
    set_affiliate(store, &affiliate(1, &["192.0.2.1:51820"]));
    eventually("peer 1 on the device", || {
        (device_peers(&m.wg) == 1).then_some(())
    })
    .await;
    assert_eq!(restarts(&m), Vec::<String>::new());

    m.wg.fail_next(ENOBUFS);
    set_affiliate(store, &affiliate(2, &["192.0.2.2:51820"]));
    one_manager_restart(&m).await;
    let endpoint: SocketAddr = "192.0.2.2:51820".parse().unwrap();
    eventually("peer 2 on the device after the retry", || {
        (endpoint_of(&m.wg, 2) == Some(endpoint)).then_some(())
    })
    .await;
    assert_eq!(
        endpoint_of(&m.wg, 1),
        Some("192.0.2.1:51820".parse().unwrap())
    );
    assert_resource::<KubeSpanPeerStatus>(store, NS, &key(2), |r| {
        (r.spec.last_used_endpoint == Some(endpoint))
            .then_some(())
            .ok_or(format!("{:?}", r.spec))
    })
    .await;
    assert_eq!(restarts(&m), [NAME], "one restart, of the manager only");
    m.h.stop().await.unwrap();
}

#[tokio::test]
async fn a_refused_marking_set_write_is_retried_and_the_new_prefix_is_marked() {
    let m = start("", tempfile::tempdir().unwrap());
    let store = &m.h.store;
    set_affiliate(store, &affiliate(1, &["192.0.2.1:51820"]));
    eventually("peer 1 marked", || {
        m.marking
            .spec()
            .filter(|s| routed_v4(s).contains(&"10.244.1.0/24".to_owned()))
    })
    .await;

    m.marking
        .fail_next("Error: Could not process rule: No buffer space available");
    let mut moved = affiliate(1, &["192.0.2.1:51820"]);
    moved.kubespan.as_mut().unwrap().additional_addresses = vec!["10.245.0.0/16".parse().unwrap()];
    set_affiliate(store, &moved);
    one_manager_restart(&m).await;
    let spec = eventually("the new prefix marked after the retry", || {
        m.marking
            .spec()
            .filter(|s| routed_v4(s).contains(&"10.245.0.0/16".to_owned()))
    })
    .await;
    assert_eq!(routed_v4(&spec), ["10.5.0.1/32", "10.245.0.0/16"]);
    assert_eq!(restarts(&m), [NAME], "one restart, of the manager only");
    m.h.stop().await.unwrap();
}

#[tokio::test]
async fn a_mesh_device_deleted_behind_the_managers_back_comes_back_with_its_peers() {
    let m = start("", tempfile::tempdir().unwrap());
    let store = &m.h.store;
    set_affiliate(store, &affiliate(1, &["192.0.2.1:51820"]));
    set_affiliate(store, &affiliate(2, &["192.0.2.2:51820"]));
    eventually("both peers on the device", || {
        (device_peers(&m.wg) == 2).then_some(())
    })
    .await;
    // Past the first-handshake deferral, so keepalives are final before the snapshot.
    m.clock
        .advance(crate::kubespan::rotation::FIRST_HANDSHAKE_DEFERRAL);
    let before = eventually("both peers kept alive", || {
        m.wg.device()
            .filter(|d| d.peers.iter().all(|p| p.persistent_keepalive == 25))
    })
    .await;

    // `ip link del kubespan`, or wireguard-go killed.
    m.wg.vanish();
    // The next device read, on the reconcile tick, finds it gone.
    m.clock.advance(RECONCILE_TICK);
    let after = eventually("the device recreated with both peers", || {
        m.wg.device().filter(|d| d.peers.len() == 2)
    })
    .await;
    assert_eq!(after, before, "recreated as it was");
    assert_length(store, &Kind::new(NS, KubeSpanPeerStatus::TYPE), 2).await;
    assert_eq!(
        restarts(&m),
        Vec::<String>::new(),
        "repaired without an error"
    );
    m.h.stop().await.unwrap();
}

/// A backend refused at creation (`--wireguard kernel` over a kept userspace device)
/// fails once: the manager reports why in its status note and looks again each tick,
/// without restarting in a loop; with a link it can run, it drives the device.
#[tokio::test]
async fn a_refused_backend_is_reported_once_not_restarted_in_a_loop() {
    let m = start(
        &format!("linkName: {REFUSED_LINK}\n"),
        tempfile::tempdir().unwrap(),
    );
    let store = &m.h.store;
    set_affiliate(store, &affiliate(1, &["192.0.2.1:51820"]));
    assert_resource::<KubeSpanManagerStatus>(store, NS, KUBESPAN, |r| {
        (r.spec.note.contains("--wireguard kernel") && r.spec.note.contains(REFUSED_LINK))
            .then_some(())
            .ok_or(format!("{:?}", r.spec))
    })
    .await;
    for _ in 0..3 {
        settled(&m.clock).await;
        m.clock.advance(RECONCILE_TICK);
    }
    settled(&m.clock).await;
    assert_eq!(restarts(&m), Vec::<String>::new(), "the manager restarted");
    assert_eq!(device_peers(&m.wg), 0);

    set_config(store, &config(""));
    eventually("peer 1 on the device of a link the backend runs", || {
        (device_peers(&m.wg) == 1).then_some(())
    })
    .await;
    assert_resource::<KubeSpanManagerStatus>(store, NS, KUBESPAN, |r| {
        r.spec
            .note
            .is_empty()
            .then_some(())
            .ok_or(format!("{:?}", r.spec))
    })
    .await;
    assert_eq!(restarts(&m), Vec::<String>::new());
}
