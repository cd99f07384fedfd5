//! Handling of bearer secrets (tokens, keys): fingerprints for logs and audit,
//! and constant-time comparison for shared header secrets.
//!
//! Secrets themselves are carried as [`secrecy::SecretString`], which zeroizes
//! on drop and never prints its value through `Debug`.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

pub use secrecy::{ExposeSecret, SecretString};

/// A short, stable fingerprint of a secret: the first 12 hex digits of its
/// SHA-256. Safe to log and audit: it identifies a token across records
/// without revealing anything that could be replayed.
pub fn fingerprint(secret: &str) -> String {
    fingerprint_bytes(secret.as_bytes())
}

/// [`fingerprint`] of bytes (a certificate file, say).
pub fn fingerprint_bytes(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    format!("sha256:{}", hex::encode(&digest[..6]))
}

/// Compares two byte strings in time that depends only on their lengths,
/// so that a caller probing a shared header secret learns nothing from
/// response timing.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.ct_eq(b).into()
}

/// Random URL-safe string of `bytes` bytes of entropy, for header secrets,
/// opaque emulator tokens and request ids.
pub fn random_token(bytes: usize) -> String {
    use aws_lc_rs::rand::SecureRandom;
    use base64::Engine;
    let mut buf = vec![0u8; bytes];
    // The system RNG failing is not something a broker can continue after.
    aws_lc_rs::rand::SystemRandom::new()
        .fill(&mut buf)
        .expect("system random number generator failed");
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_is_short_stable_and_not_the_secret() {
        let a = fingerprint("eyJhbGciOiJSUzI1NiJ9.payload.sig");
        assert_eq!(a, fingerprint("eyJhbGciOiJSUzI1NiJ9.payload.sig"));
        assert_ne!(a, fingerprint("eyJhbGciOiJSUzI1NiJ9.payload.sig2"));
        assert_eq!(a.len(), "sha256:".len() + 12);
        assert!(!a.contains("payload"));
    }

    #[test]
    fn constant_time_eq_compares_content_and_length() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"a"));
    }

    #[test]
    fn random_tokens_differ() {
        let a = random_token(32);
        let b = random_token(32);
        assert_ne!(a, b);
        assert_eq!(a.len(), 43);
    }
}
