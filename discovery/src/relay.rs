//! What both sides of the server relay (`docs/discovery-protocol.md` §7.14) agree on:
//! the pair token. The server part (sockets, allocation table, gRPC service) is
//! [`crate::server::relay`]; a node's part (one `Allocate` call) is
//! [`crate::client::relay`].

/// Length of a pair token.
pub const TOKEN_LEN: usize = 32;

/// The pair token both nodes of a pair present to the server relay: only holders of
/// the cluster secret can compute it, and it is the same whichever node asks.
#[must_use]
pub fn pair_token(secret: &[u8; 32], cluster_id: &str, a: &str, b: &str) -> [u8; TOKEN_LEN] {
    use sha2::{Digest as _, Sha256};
    let (lo, hi) = if a < b { (a, b) } else { (b, a) };
    let mut h = Sha256::new();
    h.update(b"wirespan relay pair v1\0");
    h.update(secret);
    h.update(cluster_id.as_bytes());
    h.update([0]);
    h.update(lo.as_bytes());
    h.update([0]);
    h.update(hi.as_bytes());
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::pair_token;

    #[test]
    fn the_pair_token_is_symmetric_and_keyed_by_the_secret() {
        let t = pair_token(&[1; 32], "c", "node-a", "node-b");
        assert_eq!(t, pair_token(&[1; 32], "c", "node-b", "node-a"));
        assert_ne!(t, pair_token(&[2; 32], "c", "node-a", "node-b"));
        assert_ne!(t, pair_token(&[1; 32], "c", "node-a", "node-c"));
        // Ids cannot slide into each other.
        assert_ne!(
            pair_token(&[1; 32], "c", "ab", "c"),
            pair_token(&[1; 32], "c", "a", "bc")
        );
    }
}
