//! Per-peer changes ([`PeerChange`], for [`super::WireGuard::apply_peers`]): their
//! validation, and diffing and applying them against a remembered state through a
//! peer index, so the work is proportional to the change, not to the peer count.

use super::{
    config::validate_peer,
    diff::{apply_fields, normalise, peer_update},
    DevicePeer, DeviceState, PeerUpdate, PublicKey, WgPeer,
};
use crate::error::Invalid;

/// One peer's change, for [`WireGuard::apply_peers`](super::WireGuard::apply_peers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerChange {
    /// Make the peer exactly this (added if missing).
    Upsert(WgPeer),
    /// Remove the peer (nothing if missing).
    Remove(PublicKey),
}

impl PeerChange {
    /// The peer changed.
    #[must_use]
    pub fn public_key(&self) -> &PublicKey {
        match self {
            Self::Upsert(p) => &p.public_key,
            Self::Remove(k) => k,
        }
    }
}

/// Checks changes on their own (fields named `changes[i]…`); `own` is the device's
/// public key when known. The peers not named are not looked at.
///
/// # Errors
/// The first invalid field, or a peer named twice.
pub fn validate_changes(own: Option<&PublicKey>, changes: &[PeerChange]) -> Result<(), Invalid> {
    let mut seen = std::collections::HashSet::with_capacity(changes.len());
    for (i, c) in changes.iter().enumerate() {
        if let PeerChange::Upsert(p) = c {
            validate_peer(&format!("changes[{i}]"), p, own)?;
        }
        if !seen.insert(c.public_key()) {
            return Err(Invalid::new(
                format!("changes[{i}].public_key"),
                format!("peer {} is changed twice", c.public_key()),
            ));
        }
    }
    Ok(())
}

/// Positions of the peers of `state`, by key.
pub(crate) type PeerIndex = std::collections::HashMap<PublicKey, usize>;

pub(crate) fn index_of(state: &DeviceState) -> PeerIndex {
    state
        .peers
        .iter()
        .enumerate()
        .map(|(i, p)| (p.public_key.clone(), i))
        .collect()
}

/// The updates `changes` make to `current` (pure; `index` locates its peers): a
/// changed peer as [`diff`] would update it, a removal only of a present peer.
pub(crate) fn diff_peers(
    current: &DeviceState,
    index: &PeerIndex,
    changes: &[PeerChange],
) -> Vec<PeerUpdate> {
    changes
        .iter()
        .filter_map(|c| {
            let cur = index.get(c.public_key()).map(|i| &current.peers[*i]);
            match c {
                PeerChange::Upsert(p) => peer_update(cur, p),
                PeerChange::Remove(_) => cur.map(|_| full_update(c)),
            }
        })
        .collect()
}

/// The update that sets every field of a changed peer, without knowing its state.
pub(crate) fn full_update(c: &PeerChange) -> PeerUpdate {
    match c {
        PeerChange::Upsert(p) => PeerUpdate {
            public_key: p.public_key.clone(),
            remove: false,
            preshared_key: Some(p.preshared_key.clone()),
            persistent_keepalive: Some(p.persistent_keepalive),
            endpoint: p.endpoint,
            allowed_ips: Some(normalise(&p.allowed_ips)),
        },
        PeerChange::Remove(k) => PeerUpdate {
            public_key: k.clone(),
            remove: true,
            preshared_key: None,
            persistent_keepalive: None,
            endpoint: None,
            allowed_ips: None,
        },
    }
}

/// Updates `state` and its `index` after `updates` were written (the peer order is
/// not kept: a removed peer's place goes to the last one).
pub(crate) fn apply_peer_updates(
    state: &mut DeviceState,
    index: &mut PeerIndex,
    updates: &[PeerUpdate],
) {
    for u in updates {
        if u.remove {
            if let Some(i) = index.remove(&u.public_key) {
                state.peers.swap_remove(i);
                if let Some(moved) = state.peers.get(i) {
                    index.insert(moved.public_key.clone(), i);
                }
            }
            continue;
        }
        let i = *index.entry(u.public_key.clone()).or_insert_with(|| {
            state.peers.push(DevicePeer::new(u.public_key.clone()));
            state.peers.len() - 1
        });
        apply_fields(&mut state.peers[i], u);
    }
}
