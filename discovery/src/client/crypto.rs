//! Blob encryption of the discovery protocol (docs/discovery-protocol.md §5).
//!
//! Affiliate data is sealed with AES-256-GCM (`nonce ‖ ciphertext ‖ tag`, no
//! associated data); endpoints with deterministic AES-256-ECB over a length-prefixed,
//! zero-padded protobuf, so equal endpoints give equal bytes and the server can
//! deduplicate them. Both use the raw 32-byte cluster secret, without a KDF, because
//! that is what Talos does.

use std::fmt;

use aes::{
    cipher::{Array, BlockCipherDecrypt, BlockCipherEncrypt, KeyInit},
    Aes256,
};
use aes_gcm::{aead::Aead, Aes256Gcm};
use base64::Engine as _;
use rand::RngCore;
use zeroize::Zeroize;

/// Length of the cluster secret in bytes (AES-256).
pub const KEY_LEN: usize = 32;
/// Length of the random GCM nonce that starts every affiliate blob.
pub const NONCE_LEN: usize = 12;
/// Length of the GCM tag that ends every affiliate blob.
pub const TAG_LEN: usize = 16;
/// Bytes an affiliate blob adds to its plaintext.
pub const GCM_OVERHEAD: usize = NONCE_LEN + TAG_LEN;
/// Largest affiliate blob the server accepts (§7.8).
pub const MAX_AFFILIATE_BLOB: usize = 2048;
/// Largest endpoint blob the server accepts (§7.8).
pub const MAX_ENDPOINT_BLOB: usize = 32;
const BLOCK: usize = 16;

/// The cluster secret: exactly 32 raw bytes, the AES-256 key of every blob.
///
/// `Debug` never shows the bytes, and they are wiped when the value is dropped.
/// No `PartialEq`: comparing secrets is not something callers should need, and a
/// derived comparison would not be constant-time.
#[derive(Clone)]
pub struct ClusterSecret([u8; KEY_LEN]);

impl ClusterSecret {
    /// Wraps raw key bytes.
    #[must_use]
    pub fn from_bytes(bytes: [u8; KEY_LEN]) -> Self {
        Self(bytes)
    }

    /// Parses the standard-base64 text form used in configuration files; `field`
    /// names the configuration field in the error (the value itself is never shown).
    ///
    /// # Errors
    /// [`SecretError`] when the text is not base64 or does not decode to 32 bytes.
    pub fn from_base64(field: &str, text: &str) -> Result<Self, SecretError> {
        let mut raw = base64::engine::general_purpose::STANDARD
            .decode(text.trim())
            .map_err(|_| SecretError::NotBase64 {
                field: field.to_owned(),
            })?;
        let result = <[u8; KEY_LEN]>::try_from(raw.as_slice())
            .map(Self)
            .map_err(|_| SecretError::WrongLength {
                field: field.to_owned(),
                len: raw.len(),
            });
        raw.zeroize();
        result
    }

    /// The raw key bytes (also the KubeSpan WireGuard preshared key).
    #[must_use]
    pub fn as_bytes(&self) -> &[u8; KEY_LEN] {
        &self.0
    }
}

impl Drop for ClusterSecret {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(<redacted>)")
    }
}

/// A cluster secret that could not be parsed. Never contains the secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// The text is not standard base64.
    #[error("{field}: cluster secret is not valid base64")]
    NotBase64 {
        /// Configuration field the value came from.
        field: String,
    },
    /// The decoded key does not have 32 bytes.
    #[error("{field}: cluster secret must decode to {KEY_LEN} bytes, got {len}")]
    WrongLength {
        /// Configuration field the value came from.
        field: String,
        /// Decoded length.
        len: usize,
    },
}

/// Why a blob could not be opened. Carries lengths only, never contents.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// Affiliate blob shorter than nonce + tag.
    #[error("affiliate blob of {len} bytes is shorter than the {GCM_OVERHEAD}-byte minimum")]
    TooShort {
        /// Blob length.
        len: usize,
    },
    /// GCM tag check failed: wrong key or tampered data.
    #[error("affiliate blob failed authentication (wrong cluster secret or corrupted)")]
    Authentication,
    /// Endpoint blob length is zero or not a multiple of the AES block.
    #[error("endpoint blob of {len} bytes is not a non-zero multiple of 16")]
    BadBlockLength {
        /// Blob length.
        len: usize,
    },
    /// The length prefix points past the end of the decrypted endpoint.
    #[error("endpoint length prefix {declared} exceeds the {available} bytes available")]
    BadLengthPrefix {
        /// Length announced by the first plaintext byte.
        declared: usize,
        /// Bytes following the prefix.
        available: usize,
    },
}

/// An endpoint protobuf too long for the one-byte length prefix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("endpoint protobuf of {len} bytes does not fit the one-byte length prefix")]
pub struct EndpointTooLong {
    /// Protobuf length.
    pub len: usize,
}

/// AES-256 keyed with the cluster secret, for both blob kinds.
#[derive(Clone)]
pub struct Cipher {
    gcm: Aes256Gcm,
    ecb: Aes256,
}

impl fmt::Debug for Cipher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Cipher(<redacted>)")
    }
}

impl Cipher {
    /// Keys both ciphers with the secret.
    #[must_use]
    pub fn new(secret: &ClusterSecret) -> Self {
        let key = Array::from(*secret.as_bytes());
        Self {
            gcm: Aes256Gcm::new(&key),
            ecb: Aes256::new(&key),
        }
    }

    /// Seals affiliate plaintext with a fresh random nonce from `rng`.
    pub fn seal_affiliate(&self, plaintext: &[u8], rng: &mut impl RngCore) -> Vec<u8> {
        let mut nonce = [0u8; NONCE_LEN];
        rng.fill_bytes(&mut nonce);
        self.seal_affiliate_with_nonce(plaintext, nonce)
    }

    /// Sealing with a chosen nonce: only for the fixed-nonce test vector; real
    /// encryptions must use [`Cipher::seal_affiliate`].
    pub(crate) fn seal_affiliate_with_nonce(
        &self,
        plaintext: &[u8],
        nonce: [u8; NONCE_LEN],
    ) -> Vec<u8> {
        let sealed = self
            .gcm
            .encrypt(&Array::from(nonce), plaintext)
            .expect("AES-GCM encryption of a plaintext below 64 GiB cannot fail");
        let mut blob = Vec::with_capacity(NONCE_LEN + sealed.len());
        blob.extend_from_slice(&nonce);
        blob.extend_from_slice(&sealed);
        blob
    }

    /// Opens an affiliate blob and returns the plaintext protobuf.
    ///
    /// # Errors
    /// [`OpenError::TooShort`] or [`OpenError::Authentication`].
    pub fn open_affiliate(&self, blob: &[u8]) -> Result<Vec<u8>, OpenError> {
        if blob.len() < GCM_OVERHEAD {
            return Err(OpenError::TooShort { len: blob.len() });
        }
        let (nonce, sealed) = blob.split_at(NONCE_LEN);
        let nonce = <[u8; NONCE_LEN]>::try_from(nonce).expect("split at NONCE_LEN");
        self.gcm
            .decrypt(&Array::from(nonce), sealed)
            .map_err(|_| OpenError::Authentication)
    }

    /// Seals an `Endpoint` protobuf: length byte, protobuf, zero padding to the
    /// block size, each block encrypted on its own.
    ///
    /// # Errors
    /// [`EndpointTooLong`] when the protobuf exceeds 255 bytes.
    pub fn seal_endpoint(&self, protobuf: &[u8]) -> Result<Vec<u8>, EndpointTooLong> {
        let len = u8::try_from(protobuf.len()).map_err(|_| EndpointTooLong {
            len: protobuf.len(),
        })?;
        let mut buf = Vec::with_capacity((protobuf.len() + 1).next_multiple_of(BLOCK));
        buf.push(len);
        buf.extend_from_slice(protobuf);
        buf.resize(buf.len().next_multiple_of(BLOCK), 0);
        for chunk in buf.chunks_exact_mut(BLOCK) {
            let block: &mut Array<u8, _> = chunk.try_into().expect("exact 16-byte chunk");
            self.ecb.encrypt_block(block);
        }
        Ok(buf)
    }

    /// Opens an endpoint blob and returns the protobuf it carries.
    ///
    /// # Errors
    /// [`OpenError::BadBlockLength`] or [`OpenError::BadLengthPrefix`] (the latter
    /// is also what a wrong key usually produces: ECB has no authentication).
    pub fn open_endpoint(&self, blob: &[u8]) -> Result<Vec<u8>, OpenError> {
        if blob.is_empty() || !blob.len().is_multiple_of(BLOCK) {
            return Err(OpenError::BadBlockLength { len: blob.len() });
        }
        let mut buf = blob.to_vec();
        for chunk in buf.chunks_exact_mut(BLOCK) {
            let block: &mut Array<u8, _> = chunk.try_into().expect("exact 16-byte chunk");
            self.ecb.decrypt_block(block);
        }
        let declared = usize::from(buf[0]);
        let available = buf.len() - 1;
        if declared > available {
            return Err(OpenError::BadLengthPrefix {
                declared,
                available,
            });
        }
        buf.truncate(1 + declared);
        buf.remove(0);
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use rand::{rngs::StdRng, SeedableRng};

    use super::*;
    use crate::test_util::hex;

    fn key() -> ClusterSecret {
        let mut k = [0u8; KEY_LEN];
        for (i, b) in k.iter_mut().enumerate() {
            *b = u8::try_from(i).unwrap();
        }
        ClusterSecret::from_bytes(k)
    }

    #[test]
    fn vector_a_ipv4_endpoint() {
        let c = Cipher::new(&key());
        let pb = hex("0a 04 01 02 03 04 10 ae 2c");
        let ct = hex("bc 14 90 92 d7 74 78 ce ce 88 09 c3 e0 15 38 00");
        assert_eq!(c.seal_endpoint(&pb).unwrap(), ct);
        assert_eq!(c.open_endpoint(&ct).unwrap(), pb);
    }

    #[test]
    fn vector_b_ipv6_endpoint() {
        let c = Cipher::new(&key());
        let pb = hex("0a 10 20 01 0d b8 00 00 00 00 00 00 00 00 00 00 00 01 10 ec 94 03");
        let ct = hex("e2 70 26 33 ca 89 23 9d 5e e0 36 a3 16 dd e2 37
             d6 04 c1 9a 74 d2 f4 5c 1e 62 4c 2d 38 c4 cc a0");
        assert_eq!(c.seal_endpoint(&pb).unwrap(), ct);
        assert_eq!(c.open_endpoint(&ct).unwrap(), pb);
    }

    const VECTOR_C_PLAINTEXT: &str =
        "0a066e6f64652d6112040a0000011a01613a1b0a075055424b45593d1210fd000000000000000000000000000001";
    const VECTOR_C_BLOB: &str = "000102030405060708090a0b
        4d04b874a180ef7a9f459d8bb1e8626ce2ec9c3ef72b0a3e7322bcb80f79fdb20110aefcafc1129874a47fed8886
        c46b3a40ac53fd969a0b23d76cc0b514";

    #[test]
    fn vector_c_affiliate_blob() {
        let c = Cipher::new(&key());
        let pt = hex(VECTOR_C_PLAINTEXT);
        let blob = hex(VECTOR_C_BLOB);
        assert_eq!(blob.len(), 74);
        let nonce: [u8; 12] = std::array::from_fn(|i| u8::try_from(i).unwrap());
        assert_eq!(c.seal_affiliate_with_nonce(&pt, nonce), blob);
        assert_eq!(c.open_affiliate(&blob).unwrap(), pt);
    }

    #[test]
    fn affiliate_round_trip_uses_fresh_nonces() {
        let c = Cipher::new(&key());
        let mut rng = StdRng::seed_from_u64(7);
        let a = c.seal_affiliate(b"hello", &mut rng);
        let b = c.seal_affiliate(b"hello", &mut rng);
        assert_ne!(a, b, "two encryptions must not share a nonce");
        assert_eq!(a.len(), 5 + GCM_OVERHEAD);
        assert_eq!(c.open_affiliate(&a).unwrap(), b"hello");
        assert_eq!(c.open_affiliate(&b).unwrap(), b"hello");
        // Empty plaintext is a valid blob of exactly the overhead.
        let e = c.seal_affiliate(b"", &mut rng);
        assert_eq!(c.open_affiliate(&e).unwrap(), b"");
    }

    #[test]
    fn affiliate_open_failures() {
        let c = Cipher::new(&key());
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(
            c.open_affiliate(&[0u8; 27]),
            Err(OpenError::TooShort { len: 27 })
        );
        let mut blob = c.seal_affiliate(b"payload", &mut rng);
        let last = blob.len() - 1;
        blob[last] ^= 1;
        assert_eq!(c.open_affiliate(&blob), Err(OpenError::Authentication));
        let blob = c.seal_affiliate(b"payload", &mut rng);
        let other = Cipher::new(&ClusterSecret::from_bytes([9; KEY_LEN]));
        assert_eq!(other.open_affiliate(&blob), Err(OpenError::Authentication));
    }

    #[test]
    fn endpoint_aligned_plaintext_gets_no_extra_block() {
        let c = Cipher::new(&key());
        let pb = [7u8; 15];
        let blob = c.seal_endpoint(&pb).unwrap();
        assert_eq!(blob.len(), 16);
        assert_eq!(c.open_endpoint(&blob).unwrap(), pb);
        let pb = [7u8; 16];
        assert_eq!(c.seal_endpoint(&pb).unwrap().len(), 32);
        assert_eq!(
            c.seal_endpoint(&[0u8; 256]),
            Err(EndpointTooLong { len: 256 })
        );
        let blob = c.seal_endpoint(&[1u8; 255]).unwrap();
        assert_eq!(c.open_endpoint(&blob).unwrap(), vec![1u8; 255]);
    }

    #[test]
    fn endpoint_open_failures() {
        let c = Cipher::new(&key());
        assert_eq!(
            c.open_endpoint(&[]),
            Err(OpenError::BadBlockLength { len: 0 })
        );
        assert_eq!(
            c.open_endpoint(&[0u8; 17]),
            Err(OpenError::BadBlockLength { len: 17 })
        );
        // A block whose first plaintext byte claims more than the block holds.
        let mut block = Array::from([0u8; 16]);
        block[0] = 16;
        c.ecb.encrypt_block(&mut block);
        assert_eq!(
            c.open_endpoint(&block),
            Err(OpenError::BadLengthPrefix {
                declared: 16,
                available: 15
            })
        );
    }

    #[test]
    fn secret_parsing_names_the_field_and_hides_the_value() {
        use base64::engine::general_purpose::STANDARD;
        let good = STANDARD.encode([5u8; 32]);
        let s = ClusterSecret::from_base64("cluster.secret", &good).unwrap();
        assert_eq!(s.as_bytes(), &[5u8; 32]);
        assert_eq!(format!("{s:?}"), "ClusterSecret(<redacted>)");

        let short = STANDARD.encode([5u8; 16]);
        let err = ClusterSecret::from_base64("cluster.secret", &short).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cluster.secret: cluster secret must decode to 32 bytes, got 16"
        );
        let err = ClusterSecret::from_base64("cluster.secret", "not base64!").unwrap_err();
        assert_eq!(
            err,
            SecretError::NotBase64 {
                field: "cluster.secret".into()
            }
        );
        assert!(!err.to_string().contains("not base64!"));
        assert_eq!(format!("{:?}", Cipher::new(&s)), "Cipher(<redacted>)");
    }
}
