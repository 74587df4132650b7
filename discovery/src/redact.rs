//! What logs say instead of a cluster ID. The ID is a bearer credential of the
//! upstream protocol (anyone who knows it can delete a cluster's affiliates), so it is
//! never logged; a short tag still lets an operator match log lines of one cluster.

use sha2::{Digest as _, Sha256};

/// `c:` and the first 8 hex digits of the SHA-256 of `cluster_id`.
#[must_use]
pub fn cluster_tag(cluster_id: &str) -> String {
    let digest = Sha256::digest(cluster_id.as_bytes());
    let hex: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
    format!("c:{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tag_is_a_short_hash_prefix() {
        // SHA-256("abc") = ba7816bf…
        assert_eq!(cluster_tag("abc"), "c:ba7816bf");
        assert_eq!(cluster_tag("abc").len(), 10);
        assert_ne!(cluster_tag("abd"), cluster_tag("abc"));
    }
}
