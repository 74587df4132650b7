//! Tests of the server state: validation, expiry, limits, watchers and GC, on a
//! fake clock.

use super::*;

fn req(
    aff: &str,
    data: Option<&[u8]>,
    endpoints: &[&[u8]],
    ttl_secs: i64,
) -> pb::AffiliateUpdateRequest {
    pb::AffiliateUpdateRequest {
        cluster_id: "c".into(),
        affiliate_id: aff.into(),
        affiliate_data: data.map(<[u8]>::to_vec),
        affiliate_endpoints: endpoints.iter().map(|e| e.to_vec()).collect(),
        ttl: Some(prost_types::Duration {
            seconds: ttl_secs,
            nanos: 0,
        }),
    }
}

fn min(n: u64) -> Duration {
    Duration::from_secs(60 * n)
}

fn decode(bytes: &[u8]) -> pb::WatchResponse {
    <pb::WatchResponse as prost::Message>::decode(bytes).unwrap()
}

/// Every message the watcher's stream would send now (catch-ups included).
fn drain_at(s: &mut State, sub: &mut Subscription, now: Instant) -> Vec<pb::WatchResponse> {
    let mut out = Vec::new();
    loop {
        match sub.queue.next(now) {
            Next::Send(ev) => out.push(decode(&ev)),
            Next::CatchUp => {
                assert_ne!(s.catch_up(now, &sub.cluster_id, sub.id), CatchUp::Gone);
            }
            _ => return out,
        }
    }
}

fn drain(sub: &mut Subscription) -> Vec<pb::WatchResponse> {
    let mut out = Vec::new();
    while let Next::Send(ev) = sub.queue.next(Instant::now()) {
        out.push(decode(&ev));
    }
    out
}

#[test]
fn validation_order_and_messages() {
    let long = "x".repeat(257);
    let max = "x".repeat(256);
    let mut r = req("a", Some(b"d"), &[], 60);
    r.cluster_id = String::new();
    assert_eq!(validate_update(&r), Err(RequestError::ClusterIdEmpty));
    r.cluster_id.clone_from(&long);
    r.affiliate_id = String::new();
    // Cluster checks come first.
    assert_eq!(validate_update(&r), Err(RequestError::ClusterIdTooLong));
    r.cluster_id.clone_from(&max);
    assert_eq!(validate_update(&r), Err(RequestError::AffiliateIdEmpty));
    r.affiliate_id.clone_from(&long);
    assert_eq!(validate_update(&r), Err(RequestError::AffiliateIdTooLong));
    r.affiliate_id.clone_from(&max);
    r.affiliate_data = Some(vec![0; 2049]);
    r.affiliate_endpoints = vec![vec![0; 33]];
    assert_eq!(validate_update(&r), Err(RequestError::DataTooBig));
    r.affiliate_data = Some(vec![0; 2048]);
    assert_eq!(validate_update(&r), Err(RequestError::EndpointTooBig));
    r.affiliate_endpoints = vec![vec![0; 32]];
    r.ttl = Some(prost_types::Duration {
        seconds: 1800,
        nanos: 1,
    });
    assert_eq!(validate_update(&r), Err(RequestError::TtlTooLarge));
    r.ttl = Some(prost_types::Duration {
        seconds: 1800,
        nanos: 0,
    });
    assert_eq!(validate_update(&r), Ok(()));
    r.ttl = Some(prost_types::Duration {
        seconds: -5,
        nanos: 0,
    });
    assert_eq!(validate_update(&r), Ok(()));
    // A rejected update touches nothing.
    let mut s = State::new();
    r.ttl = Some(prost_types::Duration {
        seconds: 3600,
        nanos: 0,
    });
    assert!(s.update(Instant::now(), &r).is_err());
    assert_eq!(s.counts(), Counts::default());
}

#[test]
fn endpoint_expires_before_affiliate_and_gc_sends_upsert_then_delete() {
    let t0 = Instant::now();
    let mut s = State::new();
    s.update(t0, &req("a", Some(b"d"), &[], 180)).unwrap();
    s.update(t0, &req("a", None, &[b"e1"], 60)).unwrap();
    let mut w = s.watch(t0, "c", WATCH_QUEUE).unwrap();
    assert_eq!(
        decode(&w.snapshot.to_bytes()[encode::PREFIX..]).affiliates[0].endpoints,
        vec![b"e1".to_vec()]
    );

    assert_eq!(
        s.gc(t0 + min(1) - Duration::from_secs(1)),
        GcStats::default()
    );
    let stats = s.gc(t0 + min(2));
    assert_eq!(stats.endpoints, 1);
    assert_eq!(stats.affiliates, 0);
    // Endpoint-only expiry: an upsert with the current state, not a delete.
    assert_eq!(
        drain(&mut w),
        vec![pb::WatchResponse {
            affiliates: vec![pb::Affiliate {
                id: "a".into(),
                data: b"d".to_vec(),
                endpoints: vec![],
            }],
            deleted: false,
        }]
    );
    let stats = s.gc(t0 + min(4));
    assert_eq!(stats.affiliates, 1);
    assert_eq!(stats.clusters, 0, "the watcher keeps the cluster");
    let events = drain(&mut w);
    assert_eq!(events.len(), 1);
    assert!(events[0].deleted);
    assert_eq!(events[0].affiliates[0].id, "a");
    assert!(events[0].affiliates[0].data.is_empty());
    s.unsubscribe("c", w.id);
    assert_eq!(s.gc(t0 + min(4)).clusters, 1);
    // The snapshot counts as held for watchers until the watcher lets it go: its
    // pointer, and the entry of "a" it alone keeps alive (the affiliate changed, then
    // left); that entry is the whole snapshot's body.
    assert_eq!(s.counts().watch_bytes, w.snapshot.cost() + w.snapshot.len());
    drop(w);
    assert_eq!(s.counts(), Counts::default());
}

#[test]
fn expiration_rules() {
    let t0 = Instant::now();
    let mut s = State::new();
    // Data may shrink the expiration.
    s.update(t0, &req("a", Some(b"d"), &[], 600)).unwrap();
    s.update(t0, &req("a", Some(b"d2"), &[], 60)).unwrap();
    assert_eq!(s.inspect("c", t0).unwrap()[0].expires_in_secs, 60);
    // Endpoint-only updates extend it, and extend an existing endpoint.
    s.update(t0, &req("a", None, &[b"e"], 120)).unwrap();
    assert_eq!(s.inspect("c", t0).unwrap()[0].expires_in_secs, 120);
    s.update(t0, &req("a", None, &[b"e"], 30)).unwrap();
    assert_eq!(s.inspect("c", t0).unwrap()[0].expires_in_secs, 120);
    // Zero TTL: expiration = now, collected once time moves on.
    s.update(t0, &req("z", Some(b"d"), &[], 0)).unwrap();
    assert_eq!(s.gc(t0).affiliates, 0);
    assert_eq!(s.gc(t0 + Duration::from_millis(1)).affiliates, 1);
    // Negative TTL is accepted and already expired.
    s.update(t0, &req("n", Some(b"d"), &[], -10)).unwrap();
    assert_eq!(s.gc(t0).affiliates, 1);
}

#[test]
fn endpoint_only_update_creates_affiliate_with_empty_data() {
    let t0 = Instant::now();
    let mut s = State::new();
    let mut w = s.watch(t0, "c", WATCH_QUEUE).unwrap();
    s.update(t0, &req("x", None, &[b"e"], 60)).unwrap();
    let ev = drain(&mut w);
    assert_eq!(ev.len(), 1);
    assert!(ev[0].affiliates[0].data.is_empty());
    // A repeated endpoint is not a change: no event.
    s.update(t0, &req("x", None, &[b"e"], 60)).unwrap();
    assert!(drain(&mut w).is_empty());
    // A data refresh always is, even with identical bytes.
    s.update(t0, &req("x", Some(b"d"), &[], 60)).unwrap();
    s.update(t0, &req("x", Some(b"d"), &[], 60)).unwrap();
    assert_eq!(drain(&mut w).len(), 2);
}

#[test]
fn limits_affiliates_and_endpoints() {
    let t0 = Instant::now();
    let mut s = State::new();
    for i in 0..MAX_AFFILIATES {
        s.update(t0, &req(&format!("a{i}"), Some(b"d"), &[], 60))
            .unwrap();
    }
    assert_eq!(
        s.update(t0, &req("one-more", Some(b"d"), &[], 60)),
        Err(RequestError::TooManyAffiliates)
    );
    // Existing affiliates can still be updated.
    s.update(t0, &req("a0", Some(b"d2"), &[], 60)).unwrap();
    assert_eq!(s.counts().affiliates, MAX_AFFILIATES);

    let mut w = s.watch(t0, "c", WATCH_QUEUE).unwrap();
    let blobs: Vec<Vec<u8>> = (0..65u32).map(|i| i.to_be_bytes().to_vec()).collect();
    let first: Vec<&[u8]> = blobs[..63].iter().map(Vec::as_slice).collect();
    s.update(t0, &req("a1", None, &first, 60)).unwrap();
    assert_eq!(drain(&mut w).len(), 1);
    // 64th merges, 65th fails: earlier merges stay and are notified.
    let last: Vec<&[u8]> = blobs[63..].iter().map(Vec::as_slice).collect();
    assert_eq!(
        s.update(t0, &req("a1", None, &last, 60)),
        Err(RequestError::TooManyEndpoints)
    );
    let ev = drain(&mut w);
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].affiliates[0].endpoints.len(), MAX_ENDPOINTS);
}

#[test]
fn stalled_watchers_are_dropped_live_ones_see_every_event() {
    let t0 = Instant::now();
    let later = t0 + WATCH_STALL + Duration::from_secs(1);
    let mut s = State::new();
    let mut live: Vec<_> = (0..5).map(|_| s.watch(t0, "c", 16).unwrap()).collect();
    let mut dead: Vec<_> = (0..2).map(|_| s.watch(t0, "c", 1).unwrap()).collect();
    // The first event fills the one-event queues; the next ones come after the dead
    // watchers had it for longer than the stall timeout without taking it.
    s.update(t0, &req("a0", Some(b"d"), &[], 60)).unwrap();
    for i in 1..4 {
        s.update(later, &req(&format!("a{i}"), Some(b"d"), &[], 60))
            .unwrap();
    }
    assert_eq!(s.counts().subscriptions, 5);
    for w in &mut live {
        let ids: Vec<String> = drain(w)
            .into_iter()
            .map(|e| e.affiliates[0].id.clone())
            .collect();
        assert_eq!(ids, ["a0", "a1", "a2", "a3"]);
        assert!(!w.queue.is_lost());
    }
    for w in &mut dead {
        assert!(w.queue.is_lost());
        // The one queued event, then the end with ABORTED.
        assert_eq!(drain(w).len(), 1);
        assert!(matches!(w.queue.next(later), Next::Lost));
    }
}

#[test]
fn stalled_watcher_is_dropped_by_the_periodic_check() {
    let t0 = Instant::now();
    let mut s = State::new();
    let w = s.watch(t0, "c", 1).unwrap();
    s.update(t0, &req("a", Some(b"d"), &[], 60)).unwrap();
    s.check_stalled(t0 + Duration::from_millis(10));
    assert_eq!(s.counts().subscriptions, 1);
    s.check_stalled(t0 + WATCH_STALL + Duration::from_secs(1));
    assert_eq!(s.counts().subscriptions, 0);
    assert!(w.queue.is_lost());
}

/// While the server itself runs late, a watcher it did not get to is not blamed:
/// the stall timeout is extended by the lateness of the server's periodic task.
#[test]
fn a_server_running_late_does_not_drop_its_watchers_for_it() {
    let t0 = Instant::now();
    let every = WATCH_STALL / 4;
    let ms = Duration::from_millis;
    let mut s = State::new();
    s.runtime_tick(t0, Duration::ZERO, every);
    let w = s.watch(t0, "c", 1).unwrap();
    s.update(t0, &req("a", Some(b"d"), &[], 60)).unwrap();
    // The periodic task ran 1.5 s late: a watcher idle for the stall timeout and a
    // bit is kept (the grace is three times the lateness: the runtime queue passes
    // between two takes); once the lateness has decayed it is dropped.
    let late = ms(1500);
    s.runtime_tick(t0 + WATCH_STALL, late, every);
    s.check_stalled(t0 + WATCH_STALL + ms(100));
    assert_eq!(s.counts().subscriptions, 1);
    assert!(!w.queue.is_lost());
    // On time again: the remembered lateness halves every second.
    let mut now = t0 + WATCH_STALL;
    for _ in 0..8 {
        now += every;
        s.runtime_tick(now, Duration::ZERO, every);
    }
    s.check_stalled(now);
    assert_eq!(s.counts().subscriptions, 0);
    assert!(w.queue.is_lost());

    // A task that has not run since counts as late by how overdue it is.
    let w = s.watch(now, "c", 1).unwrap();
    s.update(now, &req("a", Some(b"e"), &[], 60)).unwrap();
    s.check_stalled(now + WATCH_STALL + ms(100));
    assert!(!w.queue.is_lost());
    s.runtime_tick(now + WATCH_STALL + ms(200), Duration::ZERO, every);
    s.check_stalled(now + WATCH_STALL + ms(200));
    assert!(w.queue.is_lost());
}

/// A probe queued into the runtime counts as lateness while it waits, and after it
/// ran for what it waited, halving every second.
#[test]
fn a_probe_waiting_in_the_runtime_spares_watchers_for_as_long_as_it_waited() {
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    let mut s = State::new();
    let lag = s.runtime_lag();
    let w = s.watch(t0, "c", 1).unwrap();
    s.update(t0, &req("a", Some(b"d"), &[], 60)).unwrap();
    assert!(lag.probe_queued(t0 + ms(500)));
    assert!(!lag.probe_queued(t0 + ms(600)), "one probe at a time");
    // Queued 2.1 s ago and still waiting: the watcher, idle 2.6 s, is kept.
    s.check_stalled(t0 + ms(2600));
    assert!(!w.queue.is_lost());
    // It ran 2 s late; 0.4 s later 2 s × 0.5^0.4 ≈ 1.5 s still counts (three times).
    lag.probe_ran(t0 + ms(2500));
    s.check_stalled(t0 + ms(2900));
    assert!(!w.queue.is_lost());
    // 3 s later only 0.25 s does (0.75 s of grace).
    s.check_stalled(t0 + ms(5500));
    assert!(w.queue.is_lost());
    assert_eq!(s.counts().subscriptions, 0);
}

/// Every (deleted, ID, data) a watcher was sent, in order.
fn seen(msgs: &[pb::WatchResponse]) -> Vec<(bool, String, Vec<u8>)> {
    msgs.iter()
        .flat_map(|m| {
            m.affiliates
                .iter()
                .map(move |a| (m.deleted, a.id.clone(), a.data.clone()))
        })
        .collect()
}

/// Cluster "c" with three affiliates, and a watcher of it with a four-event queue.
fn three_affiliates_and_a_watcher(t0: Instant) -> (State, Subscription) {
    let mut s = State::new();
    for i in 0..3 {
        s.update(t0, &req(&format!("old{i}"), Some(b"d"), &[], 60))
            .unwrap();
    }
    let w = s.watch(t0, "c", 4).unwrap();
    (s, w)
}

/// A watcher that falls behind but keeps reading is never dropped: once its queue
/// overflows it reads the cluster's event log, so it sees every event in order, like
/// a watcher that kept up.
#[test]
fn reading_watcher_that_falls_behind_reads_every_event_from_the_log() {
    let t0 = Instant::now();
    let (mut s, mut w) = three_affiliates_and_a_watcher(t0);
    let mut fast = s.watch(t0, "c", 1000).unwrap();
    assert_eq!(
        decode(&w.snapshot.to_bytes()[encode::PREFIX..])
            .affiliates
            .len(),
        3
    );
    // It takes one event, then a burst overflows its queue.
    s.update(t0, &req("a", Some(b"1"), &[], 60)).unwrap();
    assert_eq!(drain_at(&mut s, &mut w, t0).len(), 1);
    for round in 0..5u8 {
        for id in ["b", "a", "c"] {
            s.update(t0, &req(id, Some(&[round]), &[], 60)).unwrap();
        }
    }
    s.delete(t0, "c", "old1").unwrap();
    s.update(t0, &req("old2", Some(b"new"), &[], 60)).unwrap();
    assert_eq!(s.counts().subscriptions, 2, "a reading watcher is kept");
    let lagged = drain_at(&mut s, &mut w, t0);
    let all = drain_at(&mut s, &mut fast, t0);
    assert_eq!(all.len(), 1 + 15 + 2);
    assert_eq!(seen(&lagged), seen(&all[1..]));
    assert_eq!(
        lagged.len(),
        17,
        "one event per message, as upstream sends them"
    );
    let counts = s.counts();
    assert_eq!(counts.watch_lagged, 1);
    assert!(counts.watch_log_bytes > 17 * encode::PREFIX, "{counts:?}");
    // Having read the whole log, it is back on its queue.
    assert!(w.queue.lagging_since().is_none());
    takes_the_next_event(&mut s, &mut w, t0);
}

/// Publishes one more event and checks that the watcher gets it, alone.
fn takes_the_next_event(s: &mut State, w: &mut Subscription, t0: Instant) {
    s.update(t0, &req("a", Some(b"z"), &[], 60)).unwrap();
    let next = drain_at(s, w, t0);
    assert_eq!(seen(&next), [(false, "a".to_owned(), b"z".to_vec())]);
}

/// A lagging watcher that has read the whole log goes back to its queue, under the
/// state lock; an event logged between its last read and its asking is read from the
/// log first.
#[test]
fn a_watcher_that_read_the_whole_log_rejoins_its_queue() {
    let t0 = Instant::now();
    let mut s = State::new();
    let w = s.watch(t0, "c", 1).unwrap();
    let update = |s: &mut State, i: u8| s.update(t0, &req(&format!("a{i}"), Some(&[i]), &[], 60));
    for i in 0..3 {
        update(&mut s, i).unwrap();
    }
    // Its one-event queue overflowed at the second event: it reads the log.
    let mut taken = Vec::new();
    loop {
        match w.queue.next(t0) {
            Next::Send(ev) => taken.push(decode(&ev)),
            Next::CatchUp => break,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(taken.len(), 3);
    update(&mut s, 3).unwrap();
    assert_eq!(s.catch_up(t0, "c", w.id), CatchUp::FromLog);
    let Next::Send(ev) = w.queue.next(t0) else {
        panic!("the event logged meanwhile");
    };
    assert_eq!(decode(&ev).affiliates[0].id, "a3");
    assert!(matches!(w.queue.next(t0), Next::CatchUp));
    assert_eq!(s.catch_up(t0, "c", w.id), CatchUp::Rejoined);
    assert!(matches!(w.queue.next(t0), Next::Wait));
    // Back on its queue: the next event is pushed to it.
    update(&mut s, 4).unwrap();
    let Next::Send(ev) = w.queue.next(t0) else {
        panic!("the next event, from the queue");
    };
    assert_eq!(decode(&ev).affiliates[0].id, "a4");
    assert!(w.queue.lagging_since().is_none());
    assert_eq!(s.counts().watch_lagged, 1);
}

/// Lagging watchers at the same place in the log are handed its sealed segments as
/// the same memory, in body frames of at most one frame's size.
#[test]
fn lagging_watchers_share_the_logs_sealed_segments() {
    let t0 = Instant::now();
    let mut s = State::new();
    let watchers: Vec<_> = (0..2).map(|_| watch_queued(&mut s, "c", 2, t0)).collect();
    let data = vec![7u8; MAX_DATA_LEN];
    for i in 0..20 {
        s.update(t0, &req(&format!("a{i}"), Some(&data), &[], 60))
            .unwrap();
    }
    let per_watcher: Vec<Vec<Bytes>> = watchers.iter().map(|w| frames(w, t0)).collect();
    for frames in &per_watcher {
        assert!(frames.iter().all(|f| f.len() <= encode::FRAME));
        let messages = grpc_messages(&frames.concat());
        assert_eq!(messages.len(), 1 + 20, "the snapshot, then every event");
        let ids: Vec<&str> = messages[1..]
            .iter()
            .map(|m| m.affiliates[0].id.as_str())
            .collect();
        let expected: Vec<String> = (0..20).map(|i| format!("a{i}")).collect();
        assert_eq!(ids, expected);
    }
    // Snapshot frame, two queued events, then the log: its sealed segments (7 events
    // of ~2 KiB each) are shared.
    let shared = (0..per_watcher[0].len())
        .filter(|&i| per_watcher[0][i].as_ptr() == per_watcher[1][i].as_ptr())
        .filter(|&i| per_watcher[0][i].len() > 10_000)
        .count();
    assert!(shared >= 2, "{shared} shared segments");
}

/// A watcher the log no longer reaches back to (it was trimmed to its limit while
/// the watcher lagged) gets a catch-up made from the state: the current state of
/// every affiliate changed since the last event it took and a delete for every
/// affiliate removed since, in event order, several affiliates per message.
#[test]
fn a_watcher_the_log_no_longer_reaches_catches_up_from_the_state() {
    let t0 = Instant::now();
    let (mut s, mut w) = three_affiliates_and_a_watcher(t0);
    s.update(t0, &req("a", Some(b"1"), &[], 60)).unwrap();
    assert_eq!(drain_at(&mut s, &mut w, t0).len(), 1);
    // 120 events of 2 KiB: far over the log's limit for a cluster of six.
    let mut data = vec![0u8; MAX_DATA_LEN];
    for round in 0..40u8 {
        data[0] = round;
        for id in ["b", "a", "c"] {
            s.update(t0, &req(id, Some(&data), &[], 60)).unwrap();
        }
    }
    s.delete(t0, "c", "old1").unwrap();
    s.update(t0, &req("old2", Some(b"new"), &[], 60)).unwrap();
    let msgs = drain_at(&mut s, &mut w, t0);
    data[0] = 39;
    assert_eq!(
        seen(&msgs),
        [
            (false, "b".to_owned(), data.clone()),
            (false, "a".to_owned(), data.clone()),
            (false, "c".to_owned(), data.clone()),
            (true, "old1".to_owned(), vec![]),
            (false, "old2".to_owned(), b"new".to_vec()),
        ]
    );
    assert_eq!(msgs.len(), 3, "upserts batched, the delete alone");
    // Live again afterwards, from its queue.
    takes_the_next_event(&mut s, &mut w, t0);
}

/// A lagging watcher is pending from the moment an event it has not read was
/// logged: one that stopped reading the log is aborted after the stall timeout, one
/// that has read all of it is not, however long ago it last had to.
#[test]
fn stall_of_a_log_reader_counts_from_its_first_unread_event() {
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    let mut s = State::new();
    let mut reading = s.watch(t0, "c", 1).unwrap();
    let stalled = s.watch(t0, "c", 1).unwrap();
    for i in 0..3 {
        s.update(t0, &req(&format!("a{i}"), Some(b"d"), &[], 60))
            .unwrap();
    }
    assert_eq!(drain_at(&mut s, &mut reading, t0).len(), 3);
    let later = t0 + WATCH_STALL + ms(1000);
    s.check_stalled(later);
    assert!(stalled.queue.is_lost());
    assert!(!reading.queue.is_lost());
    // A new event, unread for 100 ms: still reading.
    s.update(later, &req("a0", Some(b"e"), &[], 60)).unwrap();
    s.check_stalled(later + ms(100));
    assert!(!reading.queue.is_lost());
    assert_eq!(s.counts().subscriptions, 1);
    s.check_stalled(later + WATCH_STALL + ms(100));
    assert!(reading.queue.is_lost());
}

#[test]
fn read_only_calls_create_no_cluster_and_watched_ones_are_collected() {
    let t0 = Instant::now();
    let mut s = State::new();
    // Upstream creates a cluster for List and Delete (GC removes it again); here
    // they create nothing, so they cannot spend the cluster cap.
    assert!(s.list("ro").unwrap().is_empty());
    s.delete(t0, "ro2", "x").unwrap();
    assert_eq!(s.counts().clusters, 0);
    assert_eq!(s.stored_bytes(), 0);
    // A watcher that went away without unsubscribing does not pin its cluster.
    let w = s.watch(t0, "w", 1).unwrap();
    drop(w);
    assert_eq!(s.gc(t0).clusters, 1);
}

#[test]
fn watch_snapshot_and_registration_are_atomic() {
    let t0 = Instant::now();
    let mut s = State::new();
    s.update(t0, &req("a", Some(b"d"), &[], 60)).unwrap();
    let mut w = s.watch(t0, "c", WATCH_QUEUE).unwrap();
    assert_eq!(
        decode(&w.snapshot.to_bytes()[encode::PREFIX..])
            .affiliates
            .len(),
        1
    );
    assert!(!decode(&w.snapshot.to_bytes()[encode::PREFIX..]).deleted);
    s.delete(t0, "c", "a").unwrap();
    s.delete(t0, "c", "a").unwrap(); // absent: no event
    let ev = drain(&mut w);
    assert_eq!(ev.len(), 1);
    assert!(ev[0].deleted);
}

#[test]
fn ttl_saturates() {
    assert_eq!(
        ttl_nanos(Some(&prost_types::Duration {
            seconds: i64::MAX,
            nanos: 999_999_999
        })),
        i64::MAX
    );
    assert_eq!(ttl_nanos(None), 0);
    let now = Instant::now();
    assert!(offset(now, i64::MAX) > now);
    assert!(offset(now, -1) < now);
}

#[test]
fn affiliate_cap_is_configurable() {
    let t0 = Instant::now();
    let mut s = State::new();
    s.set_max_affiliates(3);
    for i in 0..3 {
        s.update(t0, &req(&format!("a{i}"), Some(b"d"), &[], 60))
            .unwrap();
    }
    assert_eq!(
        s.update(t0, &req("a3", Some(b"d"), &[], 60)),
        Err(RequestError::TooManyAffiliates)
    );
}

/// A cluster of `n` affiliates with maximal data, so its snapshot spans many frames.
fn big_cluster(s: &mut State, cluster: &str, n: usize, t0: Instant) {
    for i in 0..n {
        let mut r = req(&format!("a{i}"), Some(&[7u8; MAX_DATA_LEN]), &[], 60);
        r.cluster_id = cluster.into();
        s.update(t0, &r).unwrap();
    }
}

/// Registers a watcher and hands its snapshot to its queue, as the stream does.
fn watch_queued(s: &mut State, cluster: &str, queue: usize, t0: Instant) -> Subscription {
    let mut w = s.watch(t0, cluster, queue).unwrap();
    w.queue.send_first(std::mem::take(&mut w.snapshot));
    w
}

fn frames(w: &Subscription, now: Instant) -> Vec<Bytes> {
    let mut out = Vec::new();
    while let Next::Send(frame) = w.queue.next_frame(now) {
        out.push(frame);
    }
    out
}

/// Splits a gRPC body into its messages.
fn grpc_messages(mut body: &[u8]) -> Vec<pb::WatchResponse> {
    let mut out = Vec::new();
    while !body.is_empty() {
        assert_eq!(body[0], 0, "uncompressed");
        let len = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
        out.push(decode(&body[5..5 + len]));
        body = &body[5 + len..];
    }
    out
}

#[test]
fn frames_carry_grpc_framed_messages_in_bounded_pieces() {
    let t0 = Instant::now();
    let mut s = State::new();
    big_cluster(&mut s, "c", 40, t0);
    let w = watch_queued(&mut s, "c", WATCH_QUEUE, t0);
    s.update(t0, &req("a1", Some(b"new"), &[], 60)).unwrap();
    let frames = frames(&w, t0);
    assert!(frames.len() > 3, "{}", frames.len());
    assert!(frames.iter().all(|f| f.len() <= encode::FRAME));
    let body: Vec<u8> = frames.concat();
    let messages = grpc_messages(&body);
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[0].affiliates.len(), 40);
    assert_eq!(messages[1].affiliates[0].data, b"new");
    // Sent in full: nothing is held for the watcher any more.
    assert_eq!(w.queue.holds(), 0);
    assert_eq!(s.watch_bytes(), 0);
}

/// Several watchers on the transport's path: each gets the snapshot, then every event
/// in event order, and an event is handed to every watcher's transport as the one
/// shared buffer rather than a copy per watcher.
#[test]
fn framed_events_reach_every_watcher_in_order_as_one_shared_buffer() {
    let t0 = Instant::now();
    let mut s = State::new();
    s.update(t0, &req("old", Some(b"d"), &[], 60)).unwrap();
    let watchers: Vec<_> = (0..4)
        .map(|_| watch_queued(&mut s, "c", WATCH_QUEUE, t0))
        .collect();
    for i in 0..5u8 {
        s.update(t0, &req(&format!("a{i}"), Some(&[i]), &[], 60))
            .unwrap();
    }
    s.delete(t0, "c", "a1").unwrap();
    s.update(t0, &req("a0", Some(b"again"), &[], 60)).unwrap();
    let per_watcher: Vec<Vec<Bytes>> = watchers.iter().map(|w| frames(w, t0)).collect();
    for frames in &per_watcher {
        let messages = grpc_messages(&frames.concat());
        let seen: Vec<(bool, String, Vec<u8>)> = messages
            .iter()
            .map(|m| {
                let a = &m.affiliates[0];
                (m.deleted, a.id.clone(), a.data.clone())
            })
            .collect();
        let mut expected = vec![(false, "old".to_owned(), b"d".to_vec())];
        expected.extend((0..5u8).map(|i| (false, format!("a{i}"), vec![i])));
        expected.push((true, "a1".to_owned(), vec![]));
        expected.push((false, "a0".to_owned(), b"again".to_vec()));
        assert_eq!(seen, expected);
    }
    // Event frames (all but the snapshot) are the same memory for every watcher.
    for i in 1..per_watcher[0].len() {
        let first = per_watcher[0][i].as_ptr();
        assert!(
            per_watcher.iter().all(|f| f[i].as_ptr() == first),
            "event {i} was copied per watcher"
        );
    }
    assert_eq!(s.counts().subscriptions, 4);
}

/// On the transport's path too, a watcher that took nothing for the stall timeout
/// while its queue was full is aborted (its stream ends with ABORTED after what was
/// already queued) and the watchers that read lose nothing.
#[test]
fn framed_path_still_aborts_a_stalled_watcher() {
    let t0 = Instant::now();
    let later = t0 + WATCH_STALL + Duration::from_secs(1);
    let mut s = State::new();
    let live = watch_queued(&mut s, "c", WATCH_QUEUE, t0);
    let stalled = watch_queued(&mut s, "c", 2, t0);
    // Both take their snapshot; then the stalled one stops reading.
    assert!(matches!(live.queue.next_frame(t0), Next::Send(_)));
    assert!(matches!(stalled.queue.next_frame(t0), Next::Send(_)));
    for i in 0..2 {
        s.update(t0, &req(&format!("a{i}"), Some(b"d"), &[], 60))
            .unwrap();
    }
    s.update(later, &req("a2", Some(b"d"), &[], 60)).unwrap();
    assert!(stalled.queue.is_lost());
    assert_eq!(s.counts().subscriptions, 1);
    assert_eq!(grpc_messages(&frames(&stalled, later).concat()).len(), 2);
    assert!(matches!(stalled.queue.next_frame(later), Next::Lost));
    let seen = grpc_messages(&frames(&live, later).concat());
    assert_eq!(seen.len(), 3);
    assert!(!live.queue.is_lost());
}

/// A joining watcher's snapshot is made of the entries kept for the affiliates, not
/// a copy of them: snapshots taken on either side of an event share every entry but
/// the changed affiliate's, and each shows the state at its registration.
#[test]
fn snapshots_share_the_affiliates_entries_instead_of_copying_them() {
    let t0 = Instant::now();
    let mut s = State::new();
    big_cluster(&mut s, "c", 40, t0);
    let a = watch_queued(&mut s, "c", WATCH_QUEUE, t0);
    s.update(t0, &req("a7", Some(b"new"), &[], 60)).unwrap();
    let b = watch_queued(&mut s, "c", WATCH_QUEUE, t0);
    let snapshot = |w: &Subscription| {
        let body: Vec<u8> = frames(w, t0).concat();
        let mut m = grpc_messages(&body).remove(0);
        m.affiliates.sort_by(|x, y| x.id.cmp(&y.id));
        m
    };
    let (ptrs_a, ptrs_b) = {
        let q = |w: &Subscription| w.queue.first_batch().unwrap().entry_ptrs();
        (q(&a), q(&b))
    };
    let shared = ptrs_b.iter().filter(|p| ptrs_a.contains(p)).count();
    assert_eq!(shared, 39, "all but the changed affiliate are shared");
    let (sa, sb) = (snapshot(&a), snapshot(&b));
    assert_eq!(sa.affiliates.len(), 40);
    assert_eq!(sb.affiliates.len(), 40);
    let data = |m: &pb::WatchResponse| {
        m.affiliates
            .iter()
            .find(|x| x.id == "a7")
            .unwrap()
            .data
            .clone()
    };
    assert_eq!(data(&sa), vec![7u8; MAX_DATA_LEN]);
    assert_eq!(data(&sb), b"new");
}

/// The kept entries never go stale: changes made while nobody watches (new data, a
/// new endpoint) and endpoints dropped by GC show in the next joiner's snapshot.
#[test]
fn snapshot_entries_follow_every_change() {
    let t0 = Instant::now();
    let mut s = State::new();
    let first = s.watch(t0, "c", WATCH_QUEUE).unwrap();
    s.update(t0, &req("a", Some(b"d1"), &[b"e1"], 600)).unwrap();
    s.unsubscribe("c", first.id);
    drop(first);
    // Nobody watches: these changes are not encoded as events.
    s.update(t0, &req("a", Some(b"d2"), &[], 600)).unwrap();
    s.update(t0, &req("a", None, &[b"e2"], 60)).unwrap();
    let snap = |s: &mut State| {
        let w = s.watch(t0, "c", WATCH_QUEUE).unwrap();
        let m = decode(&w.snapshot.to_bytes()[encode::PREFIX..]);
        (
            m.affiliates[0].data.clone(),
            m.affiliates[0].endpoints.clone(),
            w,
        )
    };
    let (data, endpoints, _w) = snap(&mut s);
    assert_eq!(data, b"d2");
    assert_eq!(endpoints, [b"e1".to_vec(), b"e2".to_vec()]);
    // e2 expires first; GC drops it while a watcher is registered.
    s.gc(t0 + Duration::from_secs(120));
    let (_, endpoints, _w2) = snap(&mut s);
    assert_eq!(endpoints, [b"e1".to_vec()]);
}

#[test]
fn watchers_registered_between_two_events_share_one_snapshot() {
    let t0 = Instant::now();
    let mut s = State::new();
    big_cluster(&mut s, "c", 8, t0);
    let a = watch_queued(&mut s, "c", WATCH_QUEUE, t0);
    let one = s.watch_bytes();
    let _b = watch_queued(&mut s, "c", WATCH_QUEUE, t0);
    assert_eq!(s.watch_bytes(), one);
    s.update(t0, &req("a1", Some(b"new"), &[], 60)).unwrap();
    let _c = watch_queued(&mut s, "c", WATCH_QUEUE, t0);
    assert!(s.watch_bytes() > one, "a new event means a new snapshot");
    drop(a);
    assert!(s.watch_bytes() > one, "still held by the second watcher");
}

/// What a batch costs per affiliate while the entries are the affiliates' own.
const POINTER: usize = std::mem::size_of::<usize>();

#[test]
fn a_held_snapshot_counts_a_pointer_per_entry_and_the_entries_only_it_keeps() {
    let t0 = Instant::now();
    let mut s = State::new();
    big_cluster(&mut s, "c", 8, t0);
    let w = watch_queued(&mut s, "c", WATCH_QUEUE, t0);
    let pointers = encode::PREFIX + 8 * POINTER;
    assert_eq!(
        s.watch_bytes(),
        pointers,
        "the entries are the affiliates' own"
    );
    // Two affiliates change while the snapshot still holds their old entries: those
    // are kept for the watcher alone now.
    let old = encode::PREFIX + (w.queue.first_batch().unwrap().len() - encode::PREFIX) / 8;
    s.update(t0, &req("a1", Some(b"new"), &[], 60)).unwrap();
    s.update(t0, &req("a2", Some(b"new"), &[], 60)).unwrap();
    assert_eq!(s.watch_bytes(), pointers + 2 * old);
    // Changing one again costs nothing more: the newer entry was nobody else's.
    s.update(t0, &req("a1", Some(b"newer"), &[], 60)).unwrap();
    assert_eq!(s.watch_bytes(), pointers + 2 * old);
    // The watcher takes its snapshot: nothing is held for it any more.
    let mut now = t0;
    while let Next::Send(_) = w.queue.next_frame(now) {
        now += Duration::from_millis(1);
        if w.queue.holds() == 0 {
            break;
        }
    }
    assert_eq!(w.queue.holds(), 0);
    assert_eq!(s.watch_bytes(), 0);
}

#[test]
fn a_stalled_watcher_frees_its_snapshot_and_is_cut_off() {
    let t0 = Instant::now();
    let later = t0 + WATCH_STALL + Duration::from_secs(1);
    let mut s = State::new();
    big_cluster(&mut s, "c", 40, t0);
    let w = watch_queued(&mut s, "c", 1, t0);
    // The transport took one piece of the snapshot, then the peer stopped reading.
    assert!(matches!(w.queue.next_frame(t0), Next::Send(_)));
    assert_eq!(s.watch_bytes(), encode::PREFIX + 40 * POINTER);
    s.update(t0, &req("x", Some(b"d"), &[], 60)).unwrap();
    s.check_stalled(later);
    assert!(w.queue.is_lost());
    assert_eq!(s.watch_bytes(), 0, "the snapshot is freed");
    // Nothing may follow a message cut off part-way: the stream ends at once.
    assert!(matches!(w.queue.next_frame(later), Next::Lost));
}

#[test]
fn over_the_budget_the_least_recently_active_stalled_watchers_are_aborted() {
    let t0 = Instant::now();
    let stall = WATCH_STALL;
    let mut s = State::new();
    for c in ["c0", "c1", "c2"] {
        big_cluster(&mut s, c, 20, t0);
    }
    let w0 = watch_queued(&mut s, "c0", WATCH_QUEUE, t0);
    let one = s.watch_bytes();
    // Room for two snapshots.
    s.set_watch_budget(2 * one + one / 2);
    let w1 = watch_queued(&mut s, "c1", WATCH_QUEUE, t0);
    let w2 = watch_queued(&mut s, "c2", WATCH_QUEUE, t0);
    // Over the budget, but nobody stalled yet: nobody is aborted.
    s.check_stalled(t0 + stall / 2);
    assert_eq!(s.counts().watch_budget_aborts, 0);
    // w1 made progress later than the others; w0 and w2 took nothing.
    assert!(matches!(w1.queue.next_frame(t0 + stall / 2), Next::Send(_)));
    s.check_stalled(t0 + stall + Duration::from_millis(1));
    // One abort is enough to fit: w0 or w2 (equally idle since t0), never w1.
    let c = s.counts();
    assert_eq!(c.watch_budget_aborts, 1, "{c:?}");
    assert!(c.watch_bytes <= 2 * one + one / 2);
    assert!(!w1.queue.is_lost());
    assert!(w0.queue.is_lost() != w2.queue.is_lost());
    assert_eq!(c.subscriptions, 2);
}

/// Catch-up items come out in event order whether placed (a dense span) or sorted
/// (a sparse one, numbers outside the span, or a clash).
#[test]
fn catch_up_items_come_out_in_event_order() {
    let order = |items: Vec<(u64, char)>, since, seq| {
        super::in_event_order(items, since, seq)
            .into_iter()
            .map(|(s, c)| format!("{s}{c}"))
            .collect::<Vec<_>>()
    };
    // Dense: 4 of the 5 events since 10, shuffled.
    assert_eq!(
        order(vec![(14, 'd'), (11, 'a'), (15, 'e'), (12, 'b')], 10, 15),
        ["11a", "12b", "14d", "15e"]
    );
    // Sparse: 2 of 100.
    assert_eq!(order(vec![(90, 'b'), (3, 'a')], 0, 100), ["3a", "90b"]);
    // A number outside the span, and a clash.
    assert_eq!(order(vec![(7, 'b'), (2, 'a')], 3, 8), ["2a", "7b"]);
    assert_eq!(
        order(vec![(5, 'b'), (4, 'a'), (5, 'c')], 3, 5),
        ["4a", "5b", "5c"]
    );
    assert!(order(Vec::new(), 3, 3).is_empty());
}
