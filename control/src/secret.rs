//! Secret values held in resources and config documents.
//!
//! They never leave the process through the resource API, logs or errors: `Debug` and
//! `Display` print `<redacted>`, and resources skip them when serializing (the field is
//! `#[serde(skip)]` on resource specs; config documents serialize `<redacted>`).

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Text printed in place of a secret.
pub const REDACTED: &str = "<redacted>";

/// 32 secret bytes: a WireGuard private key or the cluster secret.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Key32(pub [u8; 32]);

impl Key32 {
    /// The bytes.
    #[must_use]
    pub fn bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// True when all zero (unset).
    #[must_use]
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 32]
    }
}

impl fmt::Debug for Key32 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

/// A secret string from a config document (e.g. the base64 cluster secret). Parsed from
/// its text; serialized and printed as `<redacted>`.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct SecretString(String);

impl SecretString {
    /// Wraps a secret.
    #[must_use]
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }

    /// The secret text; callers must not log it.
    #[must_use]
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SecretString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

impl Serialize for SecretString {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(REDACTED)
    }
}

impl<'de> Deserialize<'de> for SecretString {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_print_or_serialize() {
        let s = SecretString::new("c2VjcmV0");
        assert_eq!(format!("{s:?}"), REDACTED);
        assert_eq!(serde_json::to_string(&s).unwrap(), "\"<redacted>\"");
        let parsed: SecretString = serde_json::from_str("\"abc\"").unwrap();
        assert_eq!(parsed.expose(), "abc");
        assert_eq!(format!("{:?}", Key32([7; 32])), REDACTED);
    }
}
