//! Unit tests of the pure parts: diffing, peer changes, validation, the remembered
//! state and key redaction.

use super::*;

fn key(b: u8) -> PublicKey {
    PublicKey([b; 32])
}

fn peer(b: u8, ips: &[&str]) -> WgPeer {
    WgPeer {
        public_key: key(b),
        preshared_key: Some(PresharedKey([9; 32])),
        persistent_keepalive: 25,
        endpoint: None,
        allowed_ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
    }
}

fn state_of(d: &WgDevice) -> DeviceState {
    DeviceState {
        private_key: Some(d.private_key.clone()),
        listen_port: d.listen_port,
        fwmark: d.fwmark,
        peers: d
            .peers
            .iter()
            .map(|p| DevicePeer {
                public_key: p.public_key.clone(),
                preshared_key: p.preshared_key.clone(),
                endpoint: p.endpoint,
                persistent_keepalive: p.persistent_keepalive,
                allowed_ips: p.allowed_ips.clone(),
                last_handshake: None,
                rx_bytes: 0,
                tx_bytes: 0,
            })
            .collect(),
    }
}

fn device(peers: Vec<WgPeer>) -> WgDevice {
    WgDevice {
        name: "ws0".into(),
        private_key: PrivateKey([7; 32]),
        listen_port: 51820,
        fwmark: 0x20,
        peers,
    }
}

#[test]
fn applying_the_diff_to_the_state_leaves_nothing_to_do() {
    let from = device(vec![
        peer(1, &["10.0.0.1/32"]),
        peer(2, &["10.0.0.2/32", "10.2.0.0/16"]),
        peer(3, &["10.0.0.3/32"]),
    ]);
    let mut to = device(vec![
        // Peer 1 gone, peer 2 changed everywhere, peer 3 same, peer 4 new.
        WgPeer {
            preshared_key: None,
            persistent_keepalive: 0,
            endpoint: Some("192.0.2.2:51820".parse().unwrap()),
            ..peer(2, &["10.0.0.2/32", "10.3.0.0/16"])
        },
        peer(3, &["10.0.0.3/32"]),
        peer(4, &["10.0.0.4/32"]),
    ]);
    to.listen_port = 51821;
    to.private_key = PrivateKey([8; 32]);
    let mut st = state_of(&from);
    let up = diff(&st, &to);
    apply_update(&mut st, &up);
    assert!(diff(&st, &to).is_empty(), "{:?}", diff(&st, &to));
    assert_eq!(st.peers.len(), 3);
    let p2 = st.peers.iter().find(|p| p.public_key == key(2)).unwrap();
    assert_eq!(p2.preshared_key, None);
    assert_eq!(p2.endpoint, to.peers[0].endpoint);
}

#[test]
fn pairwise_and_keyed_diffs_agree_and_align_order_enables_pairwise() {
    let from = device(vec![
        peer(1, &["10.0.0.1/32"]),
        peer(2, &["10.0.0.2/32"]),
        peer(3, &["10.0.0.3/32"]),
    ]);
    let mut to = device(from.peers.clone());
    to.peers[1].allowed_ips = vec![
        "10.0.0.2/32".parse().unwrap(),
        "10.9.0.0/16".parse().unwrap(),
    ];
    to.peers[2].endpoint = Some("192.0.2.3:51820".parse().unwrap());
    let in_order = state_of(&from);
    let mut shuffled = state_of(&from);
    shuffled.peers.rotate_left(1);
    let pairwise = diff(&in_order, &to);
    assert_eq!(pairwise, diff(&shuffled, &to));
    assert_eq!(pairwise.peers.len(), 2);
    align_order(&mut shuffled, &to);
    assert_eq!(shuffled, in_order);
    // Peers the caller does not name go last.
    let mut extra = state_of(&device(vec![peer(9, &["10.0.0.9/32"])]));
    extra.peers.extend(state_of(&from).peers);
    align_order(&mut extra, &from);
    assert_eq!(extra.peers.last().unwrap().public_key, key(9));
}

#[test]
fn known_state_expires_and_follows_incarnation() {
    let t0 = std::time::Instant::now();
    let mut k = KnownState::default();
    k.remember(t0, 0, DeviceState::default());
    assert!(k.take_fresh(t0 + RESYNC_INTERVAL / 2, 0).is_some());
    // Taken out: gone until remembered again.
    assert!(k.take_fresh(t0, 0).is_none());
    k.remember(t0, 0, DeviceState::default());
    assert!(k.take_fresh(t0 + RESYNC_INTERVAL, 0).is_none());
    k.remember(t0, 0, DeviceState::default());
    assert!(k.take_fresh(t0, 1).is_none(), "daemon restarted");
}

#[test]
fn same_state_is_empty_update_regardless_of_order() {
    let d = device(vec![
        peer(1, &["10.0.0.1/32", "10.1.0.0/16"]),
        peer(2, &["10.0.0.2/32"]),
    ]);
    let mut st = state_of(&d);
    st.peers.reverse();
    st.peers[1].allowed_ips.reverse();
    assert!(diff(&st, &d).is_empty());
}

#[test]
fn empty_desired_endpoint_keeps_roamed_one() {
    let d = device(vec![peer(1, &["10.0.0.1/32"])]);
    let mut st = state_of(&d);
    st.peers[0].endpoint = Some("192.0.2.7:40000".parse().unwrap());
    assert!(diff(&st, &d).is_empty());
    let mut d2 = d;
    d2.peers[0].endpoint = Some("192.0.2.8:51820".parse().unwrap());
    let up = diff(&st, &d2);
    assert_eq!(up.peers.len(), 1);
    assert_eq!(up.peers[0].endpoint, d2.peers[0].endpoint);
    assert!(up.peers[0].allowed_ips.is_none() && up.peers[0].preshared_key.is_none());
}

#[test]
fn peer_changes_end_where_a_full_apply_of_the_result_would() {
    let d = device(
        (1..=6)
            .map(|b| peer(b, &[&format!("10.0.0.{b}/32")]))
            .collect(),
    );
    let mut st = state_of(&d);
    let mut index = index_of(&st);
    let mut changed = peer(2, &["10.0.0.2/32", "10.2.0.0/16"]);
    changed.endpoint = Some("192.0.2.2:51820".parse().unwrap());
    let changes = vec![
        PeerChange::Upsert(changed.clone()),
        PeerChange::Remove(key(1)),
        PeerChange::Upsert(peer(9, &["10.0.0.9/32"])),
        PeerChange::Upsert(peer(4, &["10.0.0.4/32"])), // unchanged: no update
        PeerChange::Remove(key(42)),                   // absent: no update
    ];
    validate_changes(Some(&d.private_key.public_key()), &changes).unwrap();
    let ups = diff_peers(&st, &index, &changes);
    assert_eq!(
        ups.iter().map(|u| u.public_key.clone()).collect::<Vec<_>>(),
        vec![key(2), key(1), key(9)]
    );
    apply_peer_updates(&mut st, &mut index, &ups);
    assert_eq!(index, index_of(&st), "index follows the state");
    let mut want = d;
    want.peers.retain(|p| p.public_key != key(1));
    want.peers[0] = changed;
    want.peers.push(peer(9, &["10.0.0.9/32"]));
    assert!(diff(&st, &want).is_empty(), "{:?}", diff(&st, &want));
}

#[test]
fn peer_changes_are_checked_on_their_own() {
    let own = PrivateKey([7; 32]).public_key();
    let mut bad = peer(3, &["10.0.0.1/24"]);
    let e = validate_changes(Some(&own), &[PeerChange::Upsert(bad.clone())]).unwrap_err();
    assert_eq!(e.field, "changes[0].allowed_ips[0]");
    bad.allowed_ips.clear();
    let e = validate_changes(
        Some(&own),
        &[PeerChange::Remove(key(3)), PeerChange::Upsert(bad)],
    )
    .unwrap_err();
    assert_eq!(e.field, "changes[1].public_key");
    let mine = WgPeer {
        public_key: own.clone(),
        ..peer(1, &[])
    };
    let e = validate_changes(Some(&own), &[PeerChange::Upsert(mine)]).unwrap_err();
    assert!(e.problem.contains("own public key"), "{e}");
}

#[test]
fn changed_allowed_ips_touch_only_that_peer() {
    let d = device(vec![peer(1, &["10.0.0.1/32"]), peer(2, &["10.0.0.2/32"])]);
    let st = state_of(&d);
    let mut d2 = d;
    d2.peers[1].allowed_ips.push("10.2.0.0/16".parse().unwrap());
    let up = diff(&st, &d2);
    assert_eq!(up.peers.len(), 1);
    assert_eq!(up.peers[0].public_key, key(2));
    assert_eq!(up.peers[0].allowed_ips.as_ref().unwrap().len(), 2);
    assert!(up.listen_port.is_none() && up.private_key.is_none() && up.fwmark.is_none());
}

#[test]
fn add_remove_psk_keepalive_and_port() {
    let d = device(vec![peer(1, &["10.0.0.1/32"]), peer(2, &["10.0.0.2/32"])]);
    let st = state_of(&d);
    let mut d2 = device(vec![peer(2, &["10.0.0.2/32"]), peer(3, &["10.0.0.3/32"])]);
    d2.peers[0].preshared_key = None;
    d2.peers[0].persistent_keepalive = 0;
    d2.listen_port = 51821;
    let up = diff(&st, &d2);
    assert_eq!(up.listen_port, Some(51821));
    let by = |b: u8| up.peers.iter().find(|p| p.public_key == key(b)).unwrap();
    assert!(by(1).remove);
    assert_eq!(by(2).preshared_key, Some(None));
    assert_eq!(by(2).persistent_keepalive, Some(0));
    assert!(by(2).allowed_ips.is_none());
    assert!(!by(3).remove && by(3).allowed_ips.is_some());
    // Port 0: don't care.
    d2.listen_port = 0;
    assert!(diff(&st, &d2).listen_port.is_none());
}

#[test]
fn secrets_are_redacted_in_debug() {
    let d = device(vec![peer(1, &[])]);
    let text = format!("{d:?}");
    assert!(!text.contains(&PrivateKey([7; 32]).to_base64()));
    assert!(!text.contains(&PresharedKey([9; 32]).to_base64()));
    assert!(text.contains("<redacted>"));
    assert!(text.contains(&key(1).to_base64()));
}

#[test]
fn validation_names_fields() {
    let mut d = device(vec![peer(1, &["10.0.0.1/8"])]);
    assert_eq!(d.validate().unwrap_err().field, "peers[0].allowed_ips[0]");
    d.peers = vec![peer(1, &[]), peer(1, &[])];
    assert_eq!(d.validate().unwrap_err().field, "peers[1].public_key");
    d.peers = vec![];
    d.name = "way-too-long-interface".into();
    assert_eq!(d.validate().unwrap_err().field, "name");
    let e = PublicKey::from_base64("peers[0].public_key", "not-a-key").unwrap_err();
    assert_eq!(e.field, "peers[0].public_key");
    assert!(!e.to_string().contains("not-a-key"));
}
