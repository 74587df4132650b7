//! Durations in config documents, written as `10s`, `1m30s`, `500ms` (humantime).

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer};

/// Serializes as humantime text.
///
/// # Errors
/// Those of the serializer.
pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&humantime::format_duration(*d).to_string())
}

/// Deserializes humantime text; a negative duration is an error saying so.
///
/// # Errors
/// Text that is not a duration.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    parse(&text).map_err(serde::de::Error::custom)
}

/// Parses `text`.
///
/// # Errors
/// A message naming the text.
pub fn parse(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    if t.starts_with('-') {
        return Err(format!("cannot be negative: {t}"));
    }
    if t == "0" {
        return Ok(Duration::ZERO);
    }
    humantime::parse_duration(t)
        .map_err(|e| format!("{t:?} is not a duration like 10s, 1m30s or 500ms ({e})"))
}

/// The same for `Option<Duration>` fields (`#[serde(default, with = "…::option")]`).
pub mod option {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Serializes as humantime text or null.
    ///
    /// # Errors
    /// Those of the serializer.
    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => super::serialize(d, s),
            None => s.serialize_none(),
        }
    }

    /// Deserializes humantime text.
    ///
    /// # Errors
    /// Text that is not a duration.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|t| super::parse(&t).map_err(serde::de::Error::custom))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_style_durations_and_rejects_negative() {
        assert_eq!(parse("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse("1m30s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse("0").unwrap(), Duration::ZERO);
        assert!(parse("-1s").unwrap_err().contains("negative"));
        assert!(parse("soon").is_err());
    }
}
