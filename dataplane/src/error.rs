//! Errors shared by the adapters.

use std::fmt;

/// A desired state that cannot be applied: which field, and what is wrong with it.
/// Returned before anything is written to the kernel.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct Invalid {
    /// Path of the offending field, such as `peers[3].allowed_ips[0]`.
    pub field: String,
    /// What is wrong with it.
    pub problem: String,
}

impl Invalid {
    /// An error for `field`.
    pub fn new(field: impl Into<String>, problem: impl fmt::Display) -> Self {
        Self {
            field: field.into(),
            problem: problem.to_string(),
        }
    }
}

/// Checks an MTU against the mesh limits (1280 ..= 65535).
pub(crate) fn check_mtu(field: &str, mtu: u32) -> Result<(), Invalid> {
    if mtu < crate::MIN_MTU {
        return Err(Invalid::new(
            field,
            format!("{mtu} is below the minimum of {}", crate::MIN_MTU),
        ));
    }
    if mtu > 65535 {
        return Err(Invalid::new(field, format!("{mtu} is above 65535")));
    }
    Ok(())
}

/// Checks a Linux interface name (1 to 15 bytes, no `/`, no whitespace).
pub(crate) fn check_ifname(field: &str, name: &str) -> Result<(), Invalid> {
    if name.is_empty() || name.len() > 15 {
        return Err(Invalid::new(
            field,
            format!("{name:?} must be 1 to 15 bytes long"),
        ));
    }
    if name == "."
        || name == ".."
        || name.contains(['/', ':'])
        || name.contains(char::is_whitespace)
    {
        return Err(Invalid::new(
            field,
            format!("{name:?} is not a valid interface name"),
        ));
    }
    Ok(())
}
