//! Affiliate and endpoint blobs: decrypt + decode with arbitrary bytes and keys, and
//! decode of arbitrary plaintext (random ciphertext almost never authenticates, so
//! the decoders get their own share of the input). Round trips must hold: what we
//! seal opens to the same bytes, and what we decode re-encodes to a stable form.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use rand::{rngs::StdRng, SeedableRng};
use wirespan_discovery::client::{
    crypto::{Cipher, ClusterSecret},
    model::{decode_endpoint, encode_endpoint, AffiliateInfo},
};

#[derive(Arbitrary, Debug)]
struct Input {
    key: [u8; 32],
    /// Seed of the RNG that picks the seal nonce.
    seed: [u8; 32],
    /// Opened as an affiliate blob, an endpoint blob, and decoded as plaintext.
    blob: Vec<u8>,
}

fn check_affiliate(plain: &[u8]) {
    if let Ok(info) = AffiliateInfo::decode(plain) {
        let once = info.encode();
        let again = AffiliateInfo::decode(&once).expect("our own encoding decodes");
        assert_eq!(again.encode(), once, "affiliate encoding not stable");
    }
}

fn check_endpoint(plain: &[u8]) {
    if let Ok(ep) = decode_endpoint(plain) {
        let once = encode_endpoint(&ep);
        let again = decode_endpoint(&once).expect("our own encoding decodes");
        assert_eq!(
            encode_endpoint(&again),
            once,
            "endpoint encoding not stable"
        );
    }
}

fuzz_target!(|input: Input| {
    let cipher = Cipher::new(&ClusterSecret::from_bytes(input.key));
    let blob = input.blob.as_slice();

    if let Ok(plain) = cipher.open_affiliate(blob) {
        check_affiliate(&plain);
    }
    if let Ok(plain) = cipher.open_endpoint(blob) {
        check_endpoint(&plain);
    }
    check_affiliate(blob);
    check_endpoint(blob);

    // Sealing then opening gives the plaintext back.
    let mut rng = StdRng::from_seed(input.seed);
    let sealed = cipher.seal_affiliate(blob, &mut rng);
    assert_eq!(cipher.open_affiliate(&sealed).expect("opens"), blob);
    match cipher.seal_endpoint(blob) {
        Ok(sealed) => assert_eq!(cipher.open_endpoint(&sealed).expect("opens"), blob),
        Err(_) => assert!(blob.len() > 255),
    }
});
