//! The device state a backend remembers between applies ([`KnownState`]), trusted for
//! [`RESYNC_INTERVAL`] so a steady-state apply needs no read of the device.

use super::{index_of, DeviceState, PeerIndex, PrivateKey, PublicKey};

/// How long a backend trusts the device state it last read or wrote: within this, a
/// steady-state apply costs a diff in memory and one write, not a read of every peer.
/// Every [`WireGuard::observe`](super::WireGuard::observe) refreshes it; any error
/// drops it.
pub const RESYNC_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);

/// The device state a backend last read (when) or wrote, and, once a delta needed
/// it, the index of its peers and the device's public key.
#[derive(Debug, Default)]
pub(crate) struct KnownState {
    known: Option<Known>,
}

#[derive(Debug)]
struct Known {
    at: std::time::Instant,
    incarnation: u64,
    state: DeviceState,
    index: Option<(PeerIndex, Option<PublicKey>)>,
}

/// A remembered state with its peer index, for [`WireGuard::apply_peers`].
pub(crate) struct Indexed {
    pub(crate) at: std::time::Instant,
    pub(crate) state: DeviceState,
    pub(crate) index: PeerIndex,
    pub(crate) own: Option<PublicKey>,
}

impl Indexed {
    /// Indexes a state just read at `at`.
    pub(crate) fn new(at: std::time::Instant, state: DeviceState) -> Self {
        let index = index_of(&state);
        let own = state.private_key.as_ref().map(PrivateKey::public_key);
        Self {
            at,
            state,
            index,
            own,
        }
    }
}

impl KnownState {
    fn take_valid(&mut self, now: std::time::Instant, incarnation: u64) -> Option<Known> {
        self.known.take().filter(|k| {
            k.incarnation == incarnation && now.saturating_duration_since(k.at) < RESYNC_INTERVAL
        })
    }

    /// Takes the remembered state out if it was read within [`RESYNC_INTERVAL`] of
    /// `now` and the device's incarnation (daemon restarts) is unchanged; returns
    /// when it was read. Forgets it otherwise.
    #[cfg(test)]
    pub(crate) fn take_fresh(
        &mut self,
        now: std::time::Instant,
        incarnation: u64,
    ) -> Option<(std::time::Instant, DeviceState)> {
        self.take_valid(now, incarnation).map(|k| (k.at, k.state))
    }

    /// As [`KnownState::take_fresh`], with the peer index (built if missing).
    pub(crate) fn take_fresh_indexed(
        &mut self,
        now: std::time::Instant,
        incarnation: u64,
    ) -> Option<Indexed> {
        self.take_valid(now, incarnation).map(|k| match k.index {
            Some((index, own)) => Indexed {
                at: k.at,
                state: k.state,
                index,
                own,
            },
            None => Indexed::new(k.at, k.state),
        })
    }

    /// Remembers `state`, read (or derived from a read) at `at`.
    pub(crate) fn remember(
        &mut self,
        at: std::time::Instant,
        incarnation: u64,
        state: DeviceState,
    ) {
        self.known = Some(Known {
            at,
            incarnation,
            state,
            index: None,
        });
    }

    /// Remembers an indexed state.
    pub(crate) fn remember_indexed(&mut self, incarnation: u64, k: Indexed) {
        self.known = Some(Known {
            at: k.at,
            incarnation,
            state: k.state,
            index: Some((k.index, k.own)),
        });
    }

    pub(crate) fn forget(&mut self) {
        self.known = None;
    }
}
