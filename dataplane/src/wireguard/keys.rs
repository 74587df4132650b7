//! WireGuard keys: public, private and preshared, 32 bytes each, base64 on the wire
//! and in configs; the secret ones are redacted in `Debug`.

use std::fmt;

use wireguard_control::Key;

use crate::error::Invalid;

macro_rules! key_type {
    ($name:ident, $what:literal, secret = $secret:literal) => {
        #[doc = concat!("A WireGuard ", $what, " (32 bytes).")]
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub(super) [u8; 32]);

        impl $name {
            /// From raw bytes.
            #[must_use]
            pub fn from_bytes(bytes: [u8; 32]) -> Self {
                Self(bytes)
            }

            /// The raw bytes.
            #[must_use]
            pub fn as_bytes(&self) -> &[u8; 32] {
                &self.0
            }

            /// Parses standard base64 (44 characters); the error names `field` and
            /// never echoes the input.
            ///
            /// # Errors
            /// Not a base64 32-byte key.
            pub fn from_base64(field: &str, text: &str) -> Result<Self, Invalid> {
                Key::from_base64(text.trim())
                    .map(|k| Self(k.0))
                    .map_err(|_| Invalid::new(field, concat!("not a base64 ", $what)))
            }

            /// Standard base64 text.
            #[must_use]
            pub fn to_base64(&self) -> String {
                Key(self.0).to_base64()
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                if $secret {
                    f.write_str(concat!(stringify!($name), "(<redacted>)"))
                } else {
                    write!(f, "{}({})", stringify!($name), self.to_base64())
                }
            }
        }
    };
}

key_type!(PublicKey, "public key", secret = false);
key_type!(PrivateKey, "private key", secret = true);
key_type!(PresharedKey, "preshared key", secret = true);

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_base64())
    }
}

impl PrivateKey {
    /// A fresh random private key.
    #[must_use]
    pub fn generate() -> Self {
        Self(Key::generate_private().0)
    }

    /// The matching public key.
    #[must_use]
    pub fn public_key(&self) -> PublicKey {
        PublicKey(Key(self.0).get_public().0)
    }
}

impl PresharedKey {
    /// A fresh random preshared key.
    #[must_use]
    pub fn generate() -> Self {
        Self(Key::generate_preshared().0)
    }
}
