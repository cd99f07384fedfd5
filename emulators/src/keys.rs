//! Signing keys for the built-in issuer and emulators: generated at start,
//! never written to disk, published as JWKs.

use aws_lc_rs::encoding::AsDer;
use aws_lc_rs::rsa::{KeyPair as RsaKeyPair, KeySize};
use aws_lc_rs::signature::{EcdsaKeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde::Serialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// A private signing key and its public JWK.
pub struct SigningKey {
    alg: Algorithm,
    kid: String,
    encoding: EncodingKey,
    jwk: Value,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKey")
            .field("alg", &self.alg)
            .field("kid", &self.kid)
            .finish_non_exhaustive()
    }
}

fn pem(label: &str, der: &[u8]) -> String {
    let b64 = STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(chunk).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// Key id as Kubernetes derives it: base64url(SHA-256(SubjectPublicKeyInfo DER)).
fn kid_of(spki_der: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(Sha256::digest(spki_der))
}

impl SigningKey {
    /// A fresh 2048-bit RSA key for RS256, as kube-apiserver uses by default.
    pub fn generate_rs256() -> anyhow::Result<Self> {
        let pair = RsaKeyPair::generate(KeySize::Rsa2048)
            .map_err(|_| anyhow::anyhow!("RSA key generation failed"))?;
        let pkcs8 = pair
            .as_der()
            .map_err(|_| anyhow::anyhow!("RSA key encoding failed"))?;
        let encoding = EncodingKey::from_rsa_pem(pem("PRIVATE KEY", pkcs8.as_ref()).as_bytes())?;
        let public = pair.public_key();
        let spki = public
            .as_der()
            .map_err(|_| anyhow::anyhow!("RSA public key encoding failed"))?;
        let kid = kid_of(spki.as_ref());
        let jwk = json!({
            "use": "sig",
            "kty": "RSA",
            "kid": kid,
            "alg": "RS256",
            "n": URL_SAFE_NO_PAD.encode(public.modulus().big_endian_without_leading_zero()),
            "e": URL_SAFE_NO_PAD.encode(public.exponent().big_endian_without_leading_zero()),
        });
        Ok(SigningKey {
            alg: Algorithm::RS256,
            kid,
            encoding,
            jwk,
        })
    }

    /// A fresh P-256 key for ES256 (Kubernetes issuers may use EC keys).
    pub fn generate_es256() -> anyhow::Result<Self> {
        let rng = aws_lc_rs::rand::SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng)
            .map_err(|_| anyhow::anyhow!("EC key generation failed"))?;
        let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref())
            .map_err(|_| anyhow::anyhow!("EC key parsing failed"))?;
        let public = pair.public_key();
        let point = public.as_ref(); // 0x04 || x || y
        if point.len() != 65 {
            anyhow::bail!("unexpected EC public key length {}", point.len());
        }
        let spki = public
            .as_der()
            .map_err(|_| anyhow::anyhow!("EC public key encoding failed"))?;
        let kid = kid_of(spki.as_ref());
        let jwk = json!({
            "use": "sig",
            "kty": "EC",
            "kid": kid,
            "alg": "ES256",
            "crv": "P-256",
            "x": URL_SAFE_NO_PAD.encode(&point[1..33]),
            "y": URL_SAFE_NO_PAD.encode(&point[33..65]),
        });
        Ok(SigningKey {
            alg: Algorithm::ES256,
            kid,
            encoding: EncodingKey::from_ec_der(pkcs8.as_ref()),
            jwk,
        })
    }

    /// The key id put in the `kid` of every token this key signs.
    pub fn kid(&self) -> &str {
        &self.kid
    }

    /// The public key as a JWK (with `kid` and `alg`), as a JWKS lists it.
    pub fn jwk(&self) -> &Value {
        &self.jwk
    }

    /// Signs `claims` as a JWT with this key's algorithm and `kid`.
    pub fn sign<T: Serialize>(&self, claims: &T) -> anyhow::Result<String> {
        let mut header = Header::new(self.alg);
        header.kid = Some(self.kid.clone());
        Ok(jsonwebtoken::encode(&header, claims, &self.encoding)?)
    }

    /// Signs `claims` claiming another `kid` (for tests of unknown keys).
    pub fn sign_with_kid<T: Serialize>(&self, claims: &T, kid: &str) -> anyhow::Result<String> {
        let mut header = Header::new(self.alg);
        header.kid = Some(kid.to_string());
        Ok(jsonwebtoken::encode(&header, claims, &self.encoding)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rsa_jwk_has_public_parts_only() {
        let key = SigningKey::generate_rs256().unwrap();
        let jwk = key.jwk();
        assert_eq!(jwk["kty"], "RSA");
        assert_eq!(jwk["e"], "AQAB");
        assert!(jwk.get("d").is_none());
        // 2048-bit modulus: 256 bytes → 342 base64url characters.
        assert_eq!(jwk["n"].as_str().unwrap().len(), 342);
    }

    #[test]
    fn ec_jwk_coordinates() {
        let key = SigningKey::generate_es256().unwrap();
        assert_eq!(key.jwk()["crv"], "P-256");
        assert_eq!(key.jwk()["x"].as_str().unwrap().len(), 43);
        assert!(key.jwk().get("d").is_none());
    }
}
