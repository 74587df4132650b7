//! Request validation and TTL arithmetic, in the protocol's order (the first rule a
//! request breaks is the error it gets). Pure functions: the service checks cluster
//! IDs with them before touching the state, and the snapshot loader reuses the TTL
//! arithmetic.

use std::time::{Duration, Instant};

use super::{super::error::RequestError, MAX_DATA_LEN, MAX_ENDPOINT_LEN, MAX_ID_LEN, MAX_TTL};
use crate::proto::server as pb;

/// Checks a cluster ID (every RPC).
///
/// # Errors
/// Empty or longer than [`MAX_ID_LEN`].
pub fn validate_cluster_id(id: &str) -> Result<(), RequestError> {
    if id.is_empty() {
        Err(RequestError::ClusterIdEmpty)
    } else if id.len() > MAX_ID_LEN {
        Err(RequestError::ClusterIdTooLong)
    } else {
        Ok(())
    }
}

/// Checks an affiliate ID (Update, Delete).
///
/// # Errors
/// Empty or longer than [`MAX_ID_LEN`].
pub fn validate_affiliate_id(id: &str) -> Result<(), RequestError> {
    if id.is_empty() {
        Err(RequestError::AffiliateIdEmpty)
    } else if id.len() > MAX_ID_LEN {
        Err(RequestError::AffiliateIdTooLong)
    } else {
        Ok(())
    }
}

/// The request's TTL in nanoseconds, saturated to the `i64` range as upstream's
/// `Duration.AsDuration` does. Absent means 0.
#[must_use]
pub fn ttl_nanos(ttl: Option<&prost_types::Duration>) -> i64 {
    ttl.map_or(0, |d| {
        let total = i128::from(d.seconds) * 1_000_000_000 + i128::from(d.nanos);
        i64::try_from(total).unwrap_or(if total < 0 { i64::MIN } else { i64::MAX })
    })
}

/// Validates an AffiliateUpdate in the protocol's order (first failure wins).
///
/// # Errors
/// The first rule the request breaks.
pub fn validate_update(req: &pb::AffiliateUpdateRequest) -> Result<(), RequestError> {
    validate_cluster_id(&req.cluster_id)?;
    validate_affiliate_id(&req.affiliate_id)?;
    if req
        .affiliate_data
        .as_ref()
        .is_some_and(|d| d.len() > MAX_DATA_LEN)
    {
        return Err(RequestError::DataTooBig);
    }
    if req
        .affiliate_endpoints
        .iter()
        .any(|e| e.len() > MAX_ENDPOINT_LEN)
    {
        return Err(RequestError::EndpointTooBig);
    }
    if i128::from(ttl_nanos(req.ttl.as_ref())) > MAX_TTL.as_nanos() as i128 {
        return Err(RequestError::TtlTooLarge);
    }
    Ok(())
}

/// `now + nanos` (negative allowed), saturating where `Instant` cannot go.
#[must_use]
pub fn offset(now: Instant, nanos: i64) -> Instant {
    let magnitude = Duration::from_nanos(nanos.unsigned_abs());
    if nanos >= 0 {
        now.checked_add(magnitude)
            .or_else(|| now.checked_add(Duration::from_secs(u64::from(u32::MAX))))
            .unwrap_or(now)
    } else {
        now.checked_sub(magnitude).unwrap_or(now)
    }
}
