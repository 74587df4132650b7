//! What logs say instead of secrets and bearer credentials. The cluster ID is a
//! bearer credential in the upstream protocol (whoever knows it can publish and
//! delete), so logs carry a short hash that tells clusters apart without giving
//! the ID away.

use sha2::{Digest as _, Sha256};

/// `c:` and the first 8 hex characters of the SHA-256 of `id`.
#[must_use]
pub fn cluster_tag(id: &str) -> String {
    let digest = Sha256::digest(id.as_bytes());
    let mut tag = String::with_capacity(10);
    tag.push_str("c:");
    for b in &digest[..4] {
        tag.push_str(&format!("{b:02x}"));
    }
    tag
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tag_is_a_short_hash() {
        // SHA-256("abc") = ba7816bf…
        assert_eq!(cluster_tag("abc"), "c:ba7816bf");
        assert_eq!(cluster_tag("abc").len(), 10);
        assert_ne!(cluster_tag("abd"), cluster_tag("abc"));
    }
}
