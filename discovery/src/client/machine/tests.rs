//! Tests of the client state machine, on a fake clock and a seeded RNG.

use rand::{rngs::StdRng, SeedableRng};

use super::{connection::parse_client_ip, *};
use crate::client::{
    crypto::ClusterSecret,
    model::{decode_endpoint, encode_endpoint, KubeSpanInfo, MachineType},
};

const TTL: Duration = Duration::from_secs(1800);

fn secret() -> ClusterSecret {
    ClusterSecret::from_bytes([3; 32])
}

fn config() -> MachineSettings {
    MachineSettings {
        endpoint: ServerAddress::parse("endpoint", "http://disco.example:3000", false).unwrap(),
        cluster_id: "c1".into(),
        affiliate_id: "self".into(),
        ttl: TTL,
        client_version: "v0.1.0".into(),
    }
}

fn machine(now: Instant) -> Machine<StdRng> {
    Machine::new(
        config(),
        Cipher::new(&secret()),
        StdRng::seed_from_u64(1),
        now,
    )
}

fn info(id: &str) -> AffiliateInfo {
    AffiliateInfo {
        node_id: id.into(),
        addresses: vec!["10.0.0.1".parse().unwrap()],
        hostname: format!("{id}.example"),
        nodename: id.into(),
        machine_type: MachineType::Worker,
        operating_system: "test".into(),
        kubespan: Some(KubeSpanInfo {
            public_key: "PUB".into(),
            address: "fd00::1".parse().unwrap(),
            additional_addresses: vec![],
            exclude_advertised_networks: vec![],
        }),
        control_plane: None,
        wirespan: None,
    }
}

fn ep(s: &str) -> Endpoint {
    s.parse().unwrap()
}

fn drain<R: RngCore>(m: &mut Machine<R>) -> Vec<Action> {
    std::iter::from_fn(|| m.poll_action()).collect()
}

/// Runs the backoff and a successful Hello; returns the time after it.
fn connect<R: RngCore>(m: &mut Machine<R>, now: Instant, client_ip: &[u8]) -> Instant {
    let now = m.poll_timeout().max(now);
    m.handle_timeout(now);
    let actions = drain(m);
    assert!(
        matches!(actions.last(), Some(Action::Hello(_))),
        "expected Hello, got {actions:?}"
    );
    m.hello_succeeded(
        now,
        &wire::HelloResponse {
            redirect: None,
            client_ip: client_ip.to_vec(),
        },
    );
    now
}

fn own_update(actions: &[Action]) -> wire::AffiliateUpdateRequest {
    for a in actions {
        if let Action::Refresh(batch) = a {
            if let RefreshCall::Update(u) = &batch[0] {
                return u.clone();
            }
        }
    }
    panic!("no refresh in {actions:?}");
}

fn sealed(id: &str, key: &ClusterSecret, eps: &[&str]) -> wire::Affiliate {
    let c = Cipher::new(key);
    let mut rng = StdRng::seed_from_u64(9);
    wire::Affiliate {
        id: id.into(),
        data: c.seal_affiliate(&info(id).encode(), &mut rng),
        endpoints: eps
            .iter()
            .map(|e| c.seal_endpoint(&encode_endpoint(&ep(e))).unwrap())
            .collect(),
    }
}

#[test]
fn first_hello_waits_one_backoff_and_connects() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    assert_eq!(m.connection_state(), ConnectionState::Backoff);
    let first = m.poll_timeout() - t0;
    assert!(first >= Duration::from_millis(250) && first <= Duration::from_millis(750));
    m.handle_timeout(t0 + first - Duration::from_millis(1));
    assert!(drain(&mut m).is_empty(), "nothing before the backoff ends");
    m.handle_timeout(t0 + first);
    let actions = drain(&mut m);
    assert_eq!(
        actions,
        vec![
            Action::Connect(config().endpoint),
            Action::Hello(wire::HelloRequest {
                cluster_id: "c1".into(),
                client_version: "v0.1.0".into()
            })
        ]
    );
    assert_eq!(m.connection_state(), ConnectionState::Connecting);
    m.hello_succeeded(
        t0 + first,
        &wire::HelloResponse {
            redirect: None,
            client_ip: vec![192, 0, 2, 7],
        },
    );
    assert_eq!(m.public_ip(), Some("192.0.2.7".parse().unwrap()));
    assert_eq!(
        drain(&mut m),
        vec![Action::Watch(wire::WatchRequest {
            cluster_id: "c1".into()
        })],
        "no local data yet: no refresh"
    );
    assert!(!m.watch_message(t0, &wire::WatchResponse::default()));
    assert_eq!(m.connection_state(), ConnectionState::Connected);
}

#[test]
fn publishes_own_data_and_endpoints_then_refreshes_at_half_ttl() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    assert!(m
        .set_local_data(
            info("self"),
            vec![ep("1.2.3.4:51820"), ep("[2001:db8::1]:51820")]
        )
        .unwrap());
    assert!(drain(&mut m).is_empty(), "not connected: nothing sent yet");
    let now = connect(&mut m, t0, &[127, 0, 0, 1]);
    let actions = drain(&mut m);
    let update = own_update(&actions);
    assert_eq!(update.affiliate_id, "self");
    assert_eq!(
        update.ttl,
        Some(prost_types::Duration {
            seconds: 1800,
            nanos: 0
        })
    );
    let cipher = Cipher::new(&secret());
    let data = update.affiliate_data.clone().unwrap();
    assert_eq!(
        AffiliateInfo::decode(&cipher.open_affiliate(&data).unwrap()).unwrap(),
        info("self")
    );
    assert_eq!(update.affiliate_endpoints.len(), 2);
    assert_eq!(update.affiliate_endpoints[0].len(), 16);
    assert_eq!(update.affiliate_endpoints[1].len(), 32);
    m.refresh_done(now, true);
    assert!(drain(&mut m).is_empty());

    // The ticker fires TTL/2 after start: the same blob goes out again.
    assert_eq!(m.poll_timeout(), t0 + TTL / 2);
    m.handle_timeout(t0 + TTL / 2 - Duration::from_secs(1));
    assert!(drain(&mut m).is_empty());
    m.handle_timeout(t0 + TTL / 2);
    let again = own_update(&drain(&mut m));
    assert_eq!(again, update, "refresh resends identical bytes");
    m.refresh_done(t0 + TTL / 2, true);
    assert_eq!(m.poll_timeout(), t0 + TTL);
}

#[test]
fn unchanged_local_data_is_not_reencrypted_or_resent() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    let now = connect(&mut m, t0, &[]);
    assert!(m
        .set_local_data(info("self"), vec![ep("1.2.3.4:1")])
        .unwrap());
    let first = own_update(&drain(&mut m));
    m.refresh_done(now, true);
    assert!(!m
        .set_local_data(info("self"), vec![ep("1.2.3.4:1")])
        .unwrap());
    assert!(drain(&mut m).is_empty(), "equal data: no RPC");
    assert!(m
        .set_local_data(info("self"), vec![ep("1.2.3.4:2")])
        .unwrap());
    let second = own_update(&drain(&mut m));
    assert_ne!(first.affiliate_data, second.affiliate_data, "fresh nonce");
    assert_ne!(first.affiliate_endpoints, second.affiliate_endpoints);
}

#[test]
fn change_during_refresh_triggers_one_more_refresh() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    let now = connect(&mut m, t0, &[]);
    m.set_local_data(info("self"), vec![]).unwrap();
    assert!(matches!(
        drain(&mut m)[..],
        [Action::Watch(_), Action::Refresh(_)]
    ));
    m.set_local_data(info("self"), vec![ep("1.1.1.1:1")])
        .unwrap();
    assert!(drain(&mut m).is_empty(), "one batch at a time");
    m.refresh_done(now, true);
    let update = own_update(&drain(&mut m));
    assert_eq!(update.affiliate_endpoints.len(), 1);
}

#[test]
fn refused_local_data_keeps_the_previous() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    let now = connect(&mut m, t0, &[]);
    m.set_local_data(info("self"), vec![]).unwrap();
    let before = own_update(&drain(&mut m));
    m.refresh_done(now, true);

    let mut big = info("self");
    big.addresses = (0..200u32)
        .map(|i| {
            IpAddr::V6(std::net::Ipv6Addr::from(
                (0x2001_0db8_u128 << 96) | u128::from(i),
            ))
        })
        .collect();
    let err = m.set_local_data(big, vec![]).unwrap_err();
    assert!(matches!(err, LocalDataError::TooLarge { .. }), "{err}");
    assert!(err.to_string().contains("above the server limit of 2048"));
    let err = m
        .set_local_data(info("self"), vec![ep("1.1.1.1:1"); 65])
        .unwrap_err();
    assert_eq!(err, LocalDataError::TooManyEndpoints { count: 65 });
    let err = m.set_local_data(info("other"), vec![]).unwrap_err();
    assert!(matches!(err, LocalDataError::NodeIdMismatch { .. }));
    assert!(drain(&mut m).is_empty());

    m.handle_timeout(t0 + TTL / 2);
    assert_eq!(own_update(&drain(&mut m)), before);
}

#[test]
fn other_endpoints_are_endpoint_only_updates() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    let now = connect(&mut m, t0, &[]);
    m.set_local_data(info("self"), vec![ep("1.2.3.4:1")])
        .unwrap();
    drain(&mut m);
    m.refresh_done(now, true);
    let others = BTreeMap::from([
        ("peer-b".to_string(), vec![ep("5.6.7.8:51820")]),
        ("self".to_string(), vec![ep("9.9.9.9:1")]),
        ("peer-c".to_string(), vec![]),
    ]);
    assert!(m.set_other_endpoints(others.clone()));
    let actions = drain(&mut m);
    let Some(Action::Refresh(batch)) = actions.first() else {
        panic!("{actions:?}")
    };
    assert_eq!(
        batch.len(),
        2,
        "own + peer-b; own ID and empty lists dropped"
    );
    let RefreshCall::Update(peer) = &batch[1] else {
        panic!()
    };
    assert_eq!(peer.affiliate_id, "peer-b");
    assert_eq!(peer.affiliate_data, None);
    let cipher = Cipher::new(&secret());
    assert_eq!(
        decode_endpoint(&cipher.open_endpoint(&peer.affiliate_endpoints[0]).unwrap()).unwrap(),
        ep("5.6.7.8:51820")
    );
    m.refresh_done(now, true);
    assert!(!m.set_other_endpoints(others), "unchanged: no refresh");
    assert!(drain(&mut m).is_empty());
}

#[test]
fn delete_is_sent_on_every_refresh_until_new_data() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    let now = connect(&mut m, t0, &[]);
    m.set_local_data(info("self"), vec![]).unwrap();
    drain(&mut m);
    m.refresh_done(now, true);
    m.delete_own_affiliate();
    let delete = Action::Refresh(vec![RefreshCall::Delete(wire::AffiliateDeleteRequest {
        cluster_id: "c1".into(),
        affiliate_id: "self".into(),
    })]);
    assert_eq!(drain(&mut m), vec![delete.clone()]);
    m.refresh_done(now, true);
    m.handle_timeout(t0 + TTL / 2);
    assert_eq!(drain(&mut m), vec![delete]);
    m.refresh_done(t0 + TTL / 2, true);
    assert!(
        m.set_local_data(info("self"), vec![]).unwrap(),
        "same data after delete is sent"
    );
    own_update(&drain(&mut m));
}

#[test]
fn failures_back_off_growing_and_reset_after_refresh() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    m.set_local_data(info("self"), vec![]).unwrap();
    let mut now = m.poll_timeout();
    m.handle_timeout(now);
    assert!(matches!(
        drain(&mut m)[..],
        [Action::Connect(_), Action::Hello(_)]
    ));
    // Hello fails 4 times: each delay is within ±50 % of a growing interval,
    // and each retry reconnects (new channel).
    let mut interval = Duration::from_millis(750);
    for _ in 0..4 {
        m.hello_failed(now);
        assert_eq!(m.connection_state(), ConnectionState::Backoff);
        let delay = m.poll_timeout() - now;
        assert!(
            delay >= interval / 2 && delay <= interval * 3 / 2,
            "{delay:?} vs {interval:?}"
        );
        now += delay;
        m.handle_timeout(now);
        assert!(matches!(
            drain(&mut m)[..],
            [Action::Connect(_), Action::Hello(_)]
        ));
        interval = interval.mul_f64(1.5);
    }
    m.hello_succeeded(now, &wire::HelloResponse::default());
    let actions = drain(&mut m);
    assert!(matches!(
        actions[..],
        [Action::Watch(_), Action::Refresh(_)]
    ));
    // Refresh fails: watch cancelled, backoff, Hello on the same channel.
    m.refresh_done(now, false);
    assert_eq!(drain(&mut m), vec![Action::CancelWatch]);
    let delay = m.poll_timeout() - now;
    assert!(delay >= interval / 2, "still growing: {delay:?}");
    now += delay;
    m.handle_timeout(now);
    assert!(
        matches!(drain(&mut m)[..], [Action::Hello(_)]),
        "no reconnect"
    );
    m.hello_succeeded(now, &wire::HelloResponse::default());
    assert!(matches!(
        drain(&mut m)[..],
        [Action::Watch(_), Action::Refresh(_)]
    ));
    m.refresh_done(now, true);
    // After success the backoff restarts from 0.5 s.
    m.watch_ended(now);
    let delay = m.poll_timeout() - now;
    assert!(delay <= Duration::from_millis(750), "{delay:?}");
    // And a refresh follows the next Hello even without new data.
    now += delay;
    m.handle_timeout(now);
    m.hello_succeeded(now, &wire::HelloResponse::default());
    assert!(matches!(
        drain(&mut m)[..],
        [Action::Hello(_), Action::Watch(_), Action::Refresh(_)]
    ));
}

#[test]
fn redirect_is_followed_and_capped() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    let mut now = m.poll_timeout();
    m.handle_timeout(now);
    drain(&mut m);
    let redirect = wire::HelloResponse {
        redirect: Some(wire::RedirectMessage {
            endpoint: "other.example:4000".into(),
        }),
        client_ip: vec![1, 2, 3, 4],
    };
    m.hello_succeeded(now, &redirect);
    assert_eq!(m.public_ip(), Some("1.2.3.4".parse().unwrap()));
    // An IPv4-mapped 16-byte address is reported as IPv4.
    let mut mapped = vec![0u8; 10];
    mapped.extend_from_slice(&[0xff, 0xff, 1, 2, 3, 4]);
    assert_eq!(parse_client_ip(&mapped), Some("1.2.3.4".parse().unwrap()));
    assert_eq!(parse_client_ip(&[1, 2, 3]), None);
    assert_eq!(m.connection_state(), ConnectionState::Backoff);
    now = m.poll_timeout();
    m.handle_timeout(now);
    let target = ServerAddress::parse("e", "http://other.example:4000", false).unwrap();
    assert!(matches!(&drain(&mut m)[..], [Action::Connect(a), Action::Hello(_)] if *a == target));
    assert_eq!(m.current_endpoint(), &target);
    // The target keeps redirecting (to itself): after MAX_REDIRECTS the
    // configured endpoint is used, and its redirect is then ignored.
    for _ in 1..MAX_REDIRECTS {
        m.hello_succeeded(now, &redirect);
        now = m.poll_timeout();
        m.handle_timeout(now);
        drain(&mut m);
        assert_eq!(m.current_endpoint(), &target);
    }
    m.hello_succeeded(now, &redirect);
    now = m.poll_timeout();
    m.handle_timeout(now);
    assert!(
        matches!(&drain(&mut m)[..], [Action::Connect(a), Action::Hello(_)] if *a == config().endpoint)
    );
    m.hello_succeeded(now, &redirect);
    assert!(
        matches!(drain(&mut m)[..], [Action::Watch(_)]),
        "stays on the configured server"
    );
    assert_eq!(m.current_endpoint(), &config().endpoint);

    // Next session: redirects are followed again; a plain answer at the target
    // is where the client stays.
    m.watch_ended(now);
    now = m.poll_timeout();
    m.handle_timeout(now);
    drain(&mut m);
    m.hello_succeeded(now, &redirect);
    now = m.poll_timeout();
    m.handle_timeout(now);
    drain(&mut m);
    assert_eq!(m.current_endpoint(), &target);
    m.hello_succeeded(now, &wire::HelloResponse::default());
    assert!(matches!(drain(&mut m)[..], [Action::Watch(_)]));
    assert_eq!(m.current_endpoint(), &target);
    assert_eq!(m.public_ip(), None, "a Hello without client_ip clears it");
}

#[test]
fn invalid_redirect_is_ignored() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    let now = m.poll_timeout();
    m.handle_timeout(now);
    drain(&mut m);
    m.hello_succeeded(
        now,
        &wire::HelloResponse {
            redirect: Some(wire::RedirectMessage {
                endpoint: "no-port".into(),
            }),
            client_ip: vec![],
        },
    );
    assert!(matches!(drain(&mut m)[..], [Action::Watch(_)]));
    assert_eq!(m.current_endpoint(), &config().endpoint);
}

#[test]
fn watch_messages_apply_as_spec_section_8_5() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    connect(&mut m, t0, &[]);
    let key = secret();
    let wrong = ClusterSecret::from_bytes([4; 32]);
    let mut partial = sealed("b", &key, &["1.1.1.1:1", "[2001:db8::2]:2"]);
    partial.endpoints.push(vec![0; 15]);
    partial.endpoints.push(vec![0; 16]);
    let snapshot = wire::WatchResponse {
        affiliates: vec![
            sealed("a", &key, &["10.0.0.1:51820"]),
            partial,
            sealed("self", &key, &[]),
            sealed("stranger", &wrong, &[]),
            wire::Affiliate {
                id: "empty".into(),
                ..Default::default()
            },
            wire::Affiliate {
                id: "liar".into(),
                ..sealed("a", &key, &[])
            },
        ],
        deleted: false,
    };
    assert!(m.watch_message(t0, &snapshot));
    let ids: Vec<&String> = m.affiliates().keys().collect();
    assert_eq!(ids, ["a", "b"]);
    assert_eq!(m.affiliates()["a"].info, info("a"));
    assert_eq!(m.affiliates()["a"].endpoints, vec![ep("10.0.0.1:51820")]);
    assert_eq!(
        m.affiliates()["b"].endpoints,
        vec![ep("1.1.1.1:1"), ep("[2001:db8::2]:2")],
        "undecodable endpoint blobs are dropped one by one"
    );

    // A corrupt update keeps the previous copy; an identical one changes nothing.
    let mut corrupt = sealed("a", &key, &[]);
    corrupt.data[20] ^= 1;
    assert!(!m.watch_message(
        t0,
        &wire::WatchResponse {
            affiliates: vec![corrupt],
            deleted: false
        }
    ));
    assert_eq!(m.affiliates()["a"].endpoints.len(), 1);
    assert!(!m.watch_message(
        t0,
        &wire::WatchResponse {
            affiliates: vec![sealed("a", &key, &["10.0.0.1:51820"])],
            deleted: false
        }
    ));
    // Upsert replaces the entry (endpoints included).
    assert!(m.watch_message(
        t0,
        &wire::WatchResponse {
            affiliates: vec![sealed("a", &key, &[])],
            deleted: false
        }
    ));
    assert!(m.affiliates()["a"].endpoints.is_empty());
    // Delete removes.
    assert!(m.watch_message(
        t0,
        &wire::WatchResponse {
            affiliates: vec![wire::Affiliate {
                id: "a".into(),
                ..Default::default()
            }],
            deleted: true
        }
    ));
    assert!(!m.affiliates().contains_key("a"));

    // A new stream's snapshot replaces everything.
    m.watch_ended(t0);
    connect(&mut m, t0, &[]);
    assert!(m.watch_message(
        t0,
        &wire::WatchResponse {
            affiliates: vec![sealed("c", &key, &[])],
            deleted: false
        }
    ));
    let ids: Vec<&String> = m.affiliates().keys().collect();
    assert_eq!(ids, ["c"]);
}

#[test]
fn restart_waits_a_backoff_and_reconnects() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    let now = connect(&mut m, t0, &[]);
    m.set_local_data(info("self"), vec![]).unwrap();
    drain(&mut m);
    // The driver stopped and starts again much later: calls in flight are gone.
    let later = now + Duration::from_secs(600);
    m.reset_connection(later);
    assert_eq!(m.connection_state(), ConnectionState::Backoff);
    assert!(m.poll_timeout() > later, "a delay before the first Hello");
    let at = m.poll_timeout();
    m.handle_timeout(at);
    assert!(matches!(
        drain(&mut m)[..],
        [Action::Connect(_), Action::Hello(_)]
    ));
    m.refresh_done(at, true);
    m.hello_succeeded(at, &wire::HelloResponse::default());
    assert!(
        matches!(drain(&mut m)[..], [Action::Watch(_), Action::Refresh(_)]),
        "the earlier refresh result was ignored and the data is republished"
    );
}

#[test]
fn stale_results_are_ignored() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    m.hello_succeeded(t0, &wire::HelloResponse::default());
    m.refresh_done(t0, false);
    assert!(!m.watch_message(
        t0,
        &wire::WatchResponse {
            affiliates: vec![sealed("a", &secret(), &[])],
            deleted: false
        }
    ));
    assert!(drain(&mut m).is_empty());
    assert!(m.affiliates().is_empty());
    assert_eq!(m.connection_state(), ConnectionState::Backoff);
}

/// Connected, own data published and its echo seen on the stream; returns the
/// published data blob and the time.
fn published_and_confirmed(t0: Instant) -> (Machine<StdRng>, Vec<u8>, Instant) {
    let mut m = machine(t0);
    let now = connect(&mut m, t0, &[]);
    m.set_local_data(info("self"), vec![ep("1.2.3.4:51820")])
        .unwrap();
    let update = own_update(&drain(&mut m));
    let blob = update.affiliate_data.clone().unwrap();
    // The snapshot predates the update: the own record is absent, which is no delete.
    assert!(!m.watch_message(now, &wire::WatchResponse::default()));
    m.refresh_done(now, true);
    assert!(drain(&mut m).is_empty());
    m.watch_message(now, &own_record(&blob, &update.affiliate_endpoints));
    assert!(drain(&mut m).is_empty(), "its own echo is not a change");
    (m, blob, now)
}

fn own_record(data: &[u8], endpoints: &[Vec<u8>]) -> wire::WatchResponse {
    wire::WatchResponse {
        affiliates: vec![wire::Affiliate {
            id: "self".into(),
            data: data.to_vec(),
            endpoints: endpoints.to_vec(),
        }],
        deleted: false,
    }
}

fn own_deleted() -> wire::WatchResponse {
    wire::WatchResponse {
        affiliates: vec![wire::Affiliate {
            id: "self".into(),
            ..Default::default()
        }],
        deleted: true,
    }
}

/// The one own-data update of a re-publish, or a panic.
fn republish(actions: &[Action]) -> wire::AffiliateUpdateRequest {
    match actions {
        [Action::Refresh(batch)] => match &batch[..] {
            [RefreshCall::Update(u)] => u.clone(),
            other => panic!("not an own-data-only batch: {other:?}"),
        },
        other => panic!("expected one refresh, got {other:?}"),
    }
}

#[test]
fn own_affiliate_deleted_by_someone_else_is_republished_at_once() {
    let (mut m, blob, now) = published_and_confirmed(Instant::now());
    // A peer's harvested endpoints get published for everyone: nothing to do.
    m.set_other_endpoints(BTreeMap::from([(
        "peer".to_string(),
        vec![ep("9.9.9.9:1")],
    )]));
    drain(&mut m);
    m.refresh_done(now, true);
    m.watch_message(now, &own_deleted());
    let update = republish(&drain(&mut m));
    assert_eq!(update.affiliate_id, "self");
    assert_eq!(
        update.affiliate_data.as_deref(),
        Some(&blob[..]),
        "same bytes"
    );
    assert_eq!(update.ttl.unwrap().seconds, 1800);
    assert_eq!(m.republishes(), 1);
    // A second delete event before the re-publish's echo changes nothing.
    m.watch_message(now, &own_deleted());
    assert!(drain(&mut m).is_empty());
    m.refresh_done(now, true);
    assert!(drain(&mut m).is_empty());
    assert_eq!(m.republishes(), 1);
}

#[test]
fn own_data_altered_is_republished_but_harvested_endpoints_are_not() {
    let (mut m, blob, now) = published_and_confirmed(Instant::now());
    let cipher = Cipher::new(&secret());
    let harvested = cipher
        .seal_endpoint(&encode_endpoint(&ep("5.6.7.8:1")))
        .unwrap();
    m.watch_message(now, &own_record(&blob, &[harvested]));
    assert!(
        drain(&mut m).is_empty(),
        "another node's endpoint is harvesting"
    );
    assert_eq!(m.republishes(), 0);
    let forged = sealed("self", &secret(), &[]).data;
    assert_ne!(forged, blob);
    m.watch_message(now, &own_record(&forged, &[]));
    assert_eq!(
        republish(&drain(&mut m)).affiliate_data.as_deref(),
        Some(&blob[..])
    );
    assert_eq!(m.republishes(), 1);
    // An endpoints-only update on a deleted record leaves it without data: altered.
    m.refresh_done(now, true);
    m.watch_message(now, &own_record(&blob, &[]));
    let later = now + REPUBLISH_INTERVAL;
    m.watch_message(later, &own_record(&[], &[vec![1; 16]]));
    republish(&drain(&mut m));
    assert_eq!(m.republishes(), 2);
}

#[test]
fn a_delete_loop_gets_at_most_one_republish_per_interval() {
    let (mut m, blob, t0) = published_and_confirmed(Instant::now());
    let echo = |m: &mut Machine<StdRng>, at: Instant| {
        m.refresh_done(at, true);
        m.watch_message(at, &own_record(&blob, &[]));
    };
    m.watch_message(t0, &own_deleted());
    republish(&drain(&mut m));
    echo(&mut m, t0 + Duration::from_millis(10));
    // Deleted again 100 ms later, and again: one re-publish, held back to t0 + 1 s.
    let t1 = t0 + Duration::from_millis(100);
    m.watch_message(t1, &own_deleted());
    assert!(drain(&mut m).is_empty(), "within the interval: held back");
    assert_eq!(m.poll_timeout(), t0 + REPUBLISH_INTERVAL);
    m.handle_timeout(t0 + REPUBLISH_INTERVAL - Duration::from_millis(1));
    assert!(drain(&mut m).is_empty());
    m.handle_timeout(t0 + REPUBLISH_INTERVAL);
    republish(&drain(&mut m));
    assert_eq!(m.republishes(), 2);
    echo(&mut m, t0 + REPUBLISH_INTERVAL);
    // An attacker deleting 100 times a second for 10 s: at most 11 re-publishes.
    let mut now = t0 + REPUBLISH_INTERVAL;
    let mut sent = 0;
    for _ in 0..1000 {
        now += Duration::from_millis(10);
        if m.poll_timeout() <= now {
            m.handle_timeout(now);
        }
        let actions = drain(&mut m);
        if !actions.is_empty() {
            republish(&actions);
            sent += 1;
            echo(&mut m, now);
        }
        m.watch_message(now, &own_deleted());
        let actions = drain(&mut m);
        if !actions.is_empty() {
            republish(&actions);
            sent += 1;
            echo(&mut m, now);
        }
    }
    assert!((9..=11).contains(&sent), "{sent} re-publishes in 10 s");
    assert_eq!(m.republishes(), 2 + sent);
}

#[test]
fn no_republish_without_published_data_or_after_an_own_delete() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    connect(&mut m, t0, &[]);
    drain(&mut m);
    // No local data: a record under this ID is not ours to defend.
    m.watch_message(t0, &own_deleted());
    assert!(drain(&mut m).is_empty());

    let (mut m, _, now) = published_and_confirmed(t0);
    m.delete_own_affiliate();
    drain(&mut m);
    m.refresh_done(now, true);
    m.watch_message(now, &own_deleted());
    assert!(drain(&mut m).is_empty(), "this node deleted it");
    assert_eq!(m.republishes(), 0);

    // A new stream: its snapshot's stale record (from before a reconnect's refresh)
    // is not a change by someone else.
    let (mut m, blob, now) = published_and_confirmed(t0);
    m.watch_ended(now);
    let now = connect(&mut m, now, &[]);
    drain(&mut m);
    m.watch_message(now, &own_record(&[1, 2, 3], &[]));
    assert!(drain(&mut m).is_empty());
    m.refresh_done(now, true);
    m.watch_message(now, &own_record(&blob, &[]));
    m.watch_message(now, &own_deleted());
    republish(&drain(&mut m));
}
