//! The connection cycle: backoff, Hello (following redirects within a cap), Watch,
//! and back to backoff when a call fails (docs/discovery-protocol.md §8.3).

use std::{net::IpAddr, time::Instant};

use rand::RngCore;

use super::{Action, Machine, Phase, MAX_REDIRECTS};
use crate::proto::server as wire;

impl<R: RngCore> Machine<R> {
    /// Starts a new connection cycle (the driver was restarted): any call in
    /// flight is forgotten, the channel is rebuilt after one backoff delay.
    pub fn reset_connection(&mut self, now: Instant) {
        self.connected = false;
        self.refresh_in_flight = false;
        self.refresh_due = true;
        // A delay also precedes the first Hello of a run started long after the
        // machine was created (the initial delay has expired by then).
        match self.phase {
            Phase::Backoff { until } if until > now => {}
            _ => self.enter_backoff(now),
        }
        self.actions.clear();
    }

    /// Hello answered.
    pub fn hello_succeeded(&mut self, now: Instant, response: &wire::HelloResponse) {
        if self.phase != Phase::Hello {
            return;
        }
        // Like upstream, the latest Hello wins: a server that stopped reporting
        // the address clears it rather than leaving a stale candidate.
        self.public_ip = parse_client_ip(&response.client_ip);
        if let Some(redirect) = response
            .redirect
            .as_ref()
            .filter(|r| !r.endpoint.is_empty())
        {
            if self.redirects >= MAX_REDIRECTS {
                if self.endpoint != self.config.endpoint {
                    tracing::warn!(
                        redirects = self.redirects,
                        endpoint = %self.config.endpoint,
                        "too many consecutive redirects, falling back to the configured endpoint"
                    );
                    self.endpoint = self.config.endpoint.clone();
                    self.connected = false;
                    self.enter_backoff(now);
                    return;
                }
                // The redirecting instance keeps serving every RPC (§7.5), so
                // stay on it for this session instead of cycling forever.
                tracing::warn!(
                    redirects = self.redirects,
                    "ignoring redirect after too many consecutive redirects"
                );
            } else {
                match self.endpoint.redirected(&redirect.endpoint) {
                    Ok(next) => {
                        tracing::info!(from = %self.endpoint, to = %next, "discovery server redirected");
                        self.redirects += 1;
                        self.endpoint = next;
                        self.connected = false;
                        self.enter_backoff(now);
                        return;
                    }
                    // Same reasoning: the current server still works.
                    Err(e) => tracing::warn!(error = %e, "ignoring invalid redirect"),
                }
            }
        }
        self.redirects = 0;
        self.actions.push_back(Action::Watch(wire::WatchRequest {
            cluster_id: self.config.cluster_id.clone(),
        }));
        self.phase = Phase::Watching {
            snapshot_seen: false,
        };
        self.maybe_refresh();
    }

    /// Hello failed (error status, deadline, transport error). The channel is
    /// dropped, which also re-reads TLS roots; after a redirect the configured
    /// endpoint is tried next (it will redirect again if it still wants to).
    pub fn hello_failed(&mut self, now: Instant) {
        if self.phase != Phase::Hello {
            return;
        }
        self.connected = false;
        if self.endpoint != self.config.endpoint {
            self.endpoint = self.config.endpoint.clone();
        }
        self.enter_backoff(now);
    }

    /// The Watch stream failed or ended: back to backoff and Hello on the same
    /// channel, then a refresh.
    pub fn watch_ended(&mut self, now: Instant) {
        if !matches!(self.phase, Phase::Watching { .. }) {
            return;
        }
        if self.refresh_in_flight {
            self.actions.push_back(Action::CancelWatch);
            self.refresh_in_flight = false;
        }
        self.refresh_due = true;
        self.enter_backoff(now);
    }

    pub(super) fn enter_backoff(&mut self, now: Instant) {
        let delay = self.backoff.next(&mut self.rng);
        tracing::debug!(delay_ms = delay.as_millis(), endpoint = %self.endpoint, "discovery reconnect backoff");
        self.phase = Phase::Backoff { until: now + delay };
    }
}

/// Hello's `client_ip`: 4 or 16 bytes, an IPv4-mapped IPv6 address reported as IPv4.
pub(super) fn parse_client_ip(bytes: &[u8]) -> Option<IpAddr> {
    match bytes.len() {
        4 => Some(IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?)),
        16 => Some(IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?).to_canonical()),
        _ => None,
    }
}
