//! The byte budget for what watchers hold (snapshots, catch-up batches): watchers
//! that stopped reading are aborted to bring it back under the budget, watchers that
//! read are untouched, and the server keeps serving.

mod server_common;

use std::time::{Duration, Instant};

use server_common::*;
use tonic::{
    transport::{Channel, Endpoint},
    Code,
};
use wirespan_discovery::{
    proto::server::{cluster_client::ClusterClient, *},
    server::{
        state::{MAX_DATA_LEN, MAX_ENDPOINTS, MAX_ENDPOINT_LEN},
        RunningServer, ServerConfig,
    },
};

const AFFILIATES: usize = 64;
/// Room for about 16 held snapshots of `AFFILIATES` (a pointer per entry each).
const BUDGET: usize = 8 << 10;

/// Maximal data whose first 8 bytes carry `n`, so a watcher can tell updates apart.
fn marked(n: u64) -> Vec<u8> {
    let mut data = vec![0xdd; MAX_DATA_LEN];
    data[..8].copy_from_slice(&n.to_be_bytes());
    data
}

fn big_update(i: usize, n: u64) -> AffiliateUpdateRequest {
    big_update_in("big", i, n)
}

fn big_update_in(cluster: &str, i: usize, n: u64) -> AffiliateUpdateRequest {
    AffiliateUpdateRequest {
        cluster_id: cluster.into(),
        affiliate_id: format!("a{i}"),
        affiliate_data: Some(marked(n)),
        affiliate_endpoints: (0..MAX_ENDPOINTS)
            .map(|k| {
                let mut e = vec![0xee; MAX_ENDPOINT_LEN];
                e[..8].copy_from_slice(&((i * MAX_ENDPOINTS + k) as u64).to_be_bytes());
                e
            })
            .collect(),
        ttl: ttl(600),
    }
}

/// A watcher on its own connection with the smallest HTTP/2 window, that never
/// reads: the server can hand its transport 64 KiB and no more.
async fn stuck_watcher(
    server: &RunningServer,
    cluster: &str,
) -> (ClusterClient<Channel>, tonic::Streaming<WatchResponse>) {
    let channel = Endpoint::from_shared(format!("http://{}", server.local_addr()))
        .unwrap()
        .initial_stream_window_size(65_535)
        .initial_connection_window_size(65_535)
        .connect()
        .await
        .unwrap();
    let mut client = ClusterClient::new(channel);
    let stream = open_watch(&mut client, cluster).await;
    (client, stream)
}

async fn wait_for(what: &str, deadline: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + deadline;
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn non_reading_watchers_are_aborted_to_stay_within_the_byte_budget() {
    let server = start(ServerConfig {
        rate_limit: false,
        watch_stall: Duration::from_millis(300),
        watch_budget: BUDGET,
        // Deep enough that the reading watcher never needs a catch-up, so it sees
        // every single event.
        watch_queue: 4096,
        ..ServerConfig::default()
    })
    .await;
    let mut c = client(&server).await;
    let mut n = 0u64;
    for i in 0..AFFILIATES {
        c.affiliate_update(big_update(i, n)).await.unwrap();
        n += 1;
    }

    // A watcher that reads everything, from before the hostile ones.
    let mut reader_client = client(&server).await;
    let mut reader = open_watch(&mut reader_client, "big").await;
    let snapshot = next(&mut reader).await;
    assert_eq!(snapshot.affiliates.len(), AFFILIATES);
    let first_event = n;
    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel();
    let reading = tokio::spawn(async move {
        while let Ok(Some(msg)) = reader.message().await {
            for a in msg.affiliates {
                let mark = u64::from_be_bytes(a.data[..8].try_into().unwrap());
                if seen_tx.send(mark).is_err() {
                    return;
                }
            }
        }
    });

    // Stuck watchers, each of its own large cluster that then stays quiet: no
    // event waits for them, so the stall check leaves them alone, and together
    // their snapshots hold far more than the budget.
    // What a held snapshot counts while its entries are the affiliates' own: the
    // gRPC prefix and a pointer per entry.
    let snapshot_len = 5 + AFFILIATES * std::mem::size_of::<usize>();
    let stuck_count = 3 * BUDGET / snapshot_len + 1;
    assert!(stuck_count * snapshot_len > 2 * BUDGET);
    for k in 0..stuck_count {
        for i in 0..AFFILIATES {
            c.affiliate_update(big_update_in(&format!("quiet{k}"), i, 0))
                .await
                .unwrap();
        }
    }
    let mut stuck = Vec::new();
    for k in 0..stuck_count {
        // Events keep flowing to the reader meanwhile.
        c.affiliate_update(big_update(k % AFFILIATES, n))
            .await
            .unwrap();
        n += 1;
        stuck.push(stuck_watcher(&server, &format!("quiet{k}")).await);
    }

    // Once they took nothing for the stall timeout, they are aborted until the held
    // bytes fit again (the periodic check runs without new events), oldest first.
    wait_for(
        "the held bytes to fit the budget",
        Duration::from_secs(20),
        || server.counts().watch_bytes <= BUDGET,
    )
    .await;
    let counts = server.counts();
    assert!(counts.watch_budget_aborts >= 1, "{counts:?}");
    // Only as many as needed to fit: the newest stuck watchers stay.
    let fit = (BUDGET / snapshot_len) as u64;
    assert!(
        counts.watch_budget_aborts <= stuck_count as u64 - fit,
        "{counts:?}"
    );
    assert!(
        counts.subscriptions >= 1,
        "the reading watcher stays subscribed: {counts:?}"
    );
    let text = server.metrics_text();
    assert!(
        text.contains("discovery_watch_budget_aborts_total "),
        "{text}"
    );

    // The server keeps serving: more updates reach the reader, a new watcher gets
    // a snapshot, Hello answers.
    for k in 0..AFFILIATES {
        c.affiliate_update(big_update(k, n)).await.unwrap();
        n += 1;
    }
    let mut fresh = open_watch(&mut c, "big").await;
    assert_eq!(next(&mut fresh).await.affiliates.len(), AFFILIATES);
    c.hello(HelloRequest {
        cluster_id: "big".into(),
        client_version: "v1.8.0".into(),
    })
    .await
    .unwrap();

    // The reader saw every event, in order.
    let mut seen = Vec::new();
    while seen.len() < (n - first_event) as usize {
        let mark = tokio::time::timeout(Duration::from_secs(20), seen_rx.recv())
            .await
            .expect("the reader waited 20 s for an event")
            .expect("the reader's stream ended");
        seen.push(mark);
    }
    assert_eq!(seen, (first_event..n).collect::<Vec<_>>());

    // An aborted watcher that reads at last finds its stream ended with an error:
    // ABORTED, or a cut-off message where its snapshot was freed part-way.
    let (_client, mut aborted) = stuck.swap_remove(0);
    let end = loop {
        match tokio::time::timeout(Duration::from_secs(20), aborted.message())
            .await
            .expect("an aborted watcher's stream did not end")
        {
            Ok(Some(_)) => {}
            Ok(None) => panic!("an aborted watcher's stream ended with OK"),
            Err(status) => break status,
        }
    };
    assert_ne!(end.code(), Code::Ok, "{end:?}");

    drop(stuck);
    reading.abort();
    server.shutdown().await.unwrap();
}

/// With a budget far below what they hold at first, watchers that read their
/// snapshots and events as they come are never aborted.
#[tokio::test]
async fn reading_watchers_are_never_aborted_for_the_budget() {
    let server = start(ServerConfig {
        rate_limit: false,
        watch_budget: 1,
        ..ServerConfig::default()
    })
    .await;
    let mut c = client(&server).await;
    let mut n = 0u64;
    for i in 0..AFFILIATES {
        c.affiliate_update(big_update(i, n)).await.unwrap();
        n += 1;
    }
    let mut readers = Vec::new();
    for k in 0..8 {
        c.affiliate_update(big_update(k, n)).await.unwrap();
        n += 1;
        let mut rc = client(&server).await;
        let mut w = open_watch(&mut rc, "big").await;
        assert_eq!(next(&mut w).await.affiliates.len(), AFFILIATES);
        readers.push((rc, w));
    }
    for k in 0..16 {
        c.affiliate_update(big_update(k, n)).await.unwrap();
        n += 1;
    }
    for (_, w) in &mut readers {
        for _ in 0..16 {
            next(w).await;
        }
    }
    let counts = server.counts();
    assert_eq!(counts.watch_budget_aborts, 0, "{counts:?}");
    assert_eq!(counts.subscriptions, 8, "{counts:?}");
    assert_eq!(counts.watch_bytes, 0, "{counts:?}");
    server.shutdown().await.unwrap();
}
