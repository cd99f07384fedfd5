//! Verification of Kubernetes service-account tokens.
//!
//! A [`Verifier`] trusts one issuer (its key set found by discovery or a
//! fixed JWKS URL) and checks, in order: shape and algorithm, signature,
//! `iss`, `aud`, `exp`/`nbf` with a small leeway, and the `sub` format. Each
//! failure is a distinct [`VerifyError`] so that callers, logs and audit
//! records can say exactly which check failed.

mod claims;
mod jwks;
mod memo;
mod review;

pub use review::TokenReviewer;

pub use lanyard_core::token::{KeysError, VerifyError, LEEWAY_SECS};

use std::collections::HashSet;
use std::sync::Arc;

pub use claims::{
    parse_subject, Audience, Caller, KubernetesClaim, ObjectRef, ServiceAccountClaims,
};
pub use jwks::{kube_get, Discovery, KeySet, KeySource, Lookup};

use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, Validation};

use crate::secret::fingerprint;

/// Algorithms a service-account issuer may use. Kubernetes signs with RS256
/// or ES256; anything else (notably `none` and HMAC) is refused.
const ALLOWED_ALGS: [Algorithm; 2] = [Algorithm::RS256, Algorithm::ES256];

/// Verifies tokens of one issuer.
///
/// Successful verifications are remembered (keyed by a SHA-256 of token
/// and audience, for at most five minutes and never past the token's
/// expiry), so a pod asking again with the same projected token costs a
/// comparison (or a hash) instead of a signature check; requests with one token that arrive
/// together wait for one verification of it.
pub struct Verifier {
    issuer: String,
    /// `None` for a standalone sidecar reading its own pod's token files:
    /// there is no trust boundary to defend there (the cloud verifies the
    /// signature), and no issuer keys to reach.
    keys: Option<KeySet>,
    review: Option<TokenReviewer>,
    memo: memo::Memo,
}

impl Verifier {
    /// A verifier of tokens whose `iss` is `issuer`, signed by a key of `keys`.
    pub fn new(issuer: impl Into<String>, keys: KeySet) -> Self {
        Verifier {
            issuer: issuer.into(),
            keys: Some(keys),
            memo: memo::Memo::default(),
            review: None,
        }
    }

    /// A verifier for tokens read from the pod's own projected volume by a
    /// standalone sidecar: claims, audience, expiry and subject are checked,
    /// the signature is left to the cloud that receives the token.
    pub fn local_files() -> Self {
        Verifier {
            issuer: String::new(),
            keys: None,
            memo: memo::Memo::default(),
            review: None,
        }
    }

    /// Also asks the API server (TokenReview) on first sight of a token.
    pub fn with_token_review(mut self, reviewer: TokenReviewer) -> Self {
        self.review = Some(reviewer);
        self
    }

    /// The issuer tokens must name; empty for [`Verifier::local_files`].
    pub fn issuer(&self) -> &str {
        &self.issuer
    }

    /// Verifies `token` for `audience` and returns the claims.
    pub async fn verify_claims(
        &self,
        token: &str,
        audience: &str,
    ) -> Result<ServiceAccountClaims, VerifyError> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| VerifyError::Malformed)?;
        if !ALLOWED_ALGS.contains(&header.alg) {
            return Err(VerifyError::Algorithm(format!("{:?}", header.alg)));
        }
        let Some(keys) = &self.keys else {
            return self.check_local(token, audience);
        };
        let (key, jwk) = match keys.lookup(header.kid.as_deref()).await? {
            Lookup::Found(key, jwk) => (key, jwk),
            Lookup::Unknown => return Err(VerifyError::UnknownKey),
        };
        // A JWK that declares its algorithm binds the key to it: an RSA key
        // published for RS256 must not verify an RS512 token, and so on.
        if let Some(key_alg) = jwk.common.key_algorithm {
            if format!("{key_alg:?}") != format!("{:?}", header.alg) {
                return Err(VerifyError::Algorithm(format!("{:?}", header.alg)));
            }
        }

        let mut validation = Validation::new(header.alg);
        validation.leeway = LEEWAY_SECS;
        validation.validate_nbf = true;
        validation.set_issuer(&[self.issuer.as_str()]);
        validation.set_audience(&[audience]);
        validation.set_required_spec_claims(&["exp", "iat", "iss", "aud", "sub"]);

        let data = jsonwebtoken::decode::<ServiceAccountClaims>(token, &key, &validation)
            .map_err(|e| self.map_error(e.into_kind(), audience))?;
        let claims = data.claims;

        let now = jsonwebtoken::get_current_timestamp();
        if claims.iat > now + LEEWAY_SECS {
            return Err(VerifyError::NotYetValid);
        }
        match parse_subject(&claims.sub) {
            Some((ns, sa))
                if ns == claims.kubernetes.namespace
                    && sa == claims.kubernetes.serviceaccount.name => {}
            _ => return Err(VerifyError::Subject),
        }
        Ok(claims)
    }

    /// Verifies `token` for `audience` and returns who is calling, shared:
    /// a token seen recently is answered from memory without copying.
    pub async fn verify(&self, token: &str, audience: &str) -> Result<Arc<Caller>, VerifyError> {
        let key = self.memo.key(token, audience);
        let now = jsonwebtoken::get_current_timestamp();
        if let Some(caller) = self.memo.remembered(&key, now) {
            return Ok(caller);
        }
        loop {
            match self.memo.turn(key, now) {
                memo::Turn::Remembered(caller) => return Ok(caller),
                memo::Turn::Lead(leader) => {
                    // Boxed: the first sight of a token (a key fetch, a
                    // TokenReview) is the rare path, and inline its state
                    // would make every remembered request's future larger.
                    let answer = Box::pin(self.verify_afresh(token, audience)).await;
                    leader.land(&answer);
                    return answer;
                }
                memo::Turn::Follow(follower) => {
                    if let Some(answer) = follower.wait().await {
                        return answer;
                    }
                    // The leader was cancelled: take another turn.
                }
            }
        }
    }

    /// The signature and claim checks, then the API server's review if
    /// enabled.
    async fn verify_afresh(&self, token: &str, audience: &str) -> Result<Arc<Caller>, VerifyError> {
        let caller = Arc::new(self.verify_uncached(token, audience).await?);
        if let Some(reviewer) = &self.review {
            reviewer.review(token, audience).await?;
        }
        Ok(caller)
    }

    async fn verify_uncached(&self, token: &str, audience: &str) -> Result<Caller, VerifyError> {
        let claims = self.verify_claims(token, audience).await?;
        Ok(Caller {
            namespace: claims.kubernetes.namespace,
            service_account: claims.kubernetes.serviceaccount.name,
            service_account_uid: claims.kubernetes.serviceaccount.uid,
            pod: claims.kubernetes.pod,
            node: claims.kubernetes.node,
            token_expires_at: claims.exp,
            token_fingerprint: fingerprint(token),
        })
    }

    /// Claim checks without a signature check (see [`Verifier::local_files`]).
    fn check_local(
        &self,
        token: &str,
        audience: &str,
    ) -> Result<ServiceAccountClaims, VerifyError> {
        let claims: ServiceAccountClaims = jsonwebtoken::dangerous::insecure_decode_claims(token)
            .map_err(|e| VerifyError::Claims(e.to_string()))?;
        let now = jsonwebtoken::get_current_timestamp();
        if claims.exp.saturating_add(LEEWAY_SECS) <= now {
            return Err(VerifyError::Expired);
        }
        if claims.nbf.unwrap_or(0) > now + LEEWAY_SECS || claims.iat > now + LEEWAY_SECS {
            return Err(VerifyError::NotYetValid);
        }
        if !claims.aud.contains(audience) {
            return Err(VerifyError::Audience {
                expected: audience.to_string(),
            });
        }
        match parse_subject(&claims.sub) {
            Some((ns, sa))
                if ns == claims.kubernetes.namespace
                    && sa == claims.kubernetes.serviceaccount.name => {}
            _ => return Err(VerifyError::Subject),
        }
        Ok(claims)
    }

    fn map_error(&self, kind: ErrorKind, audience: &str) -> VerifyError {
        match kind {
            ErrorKind::InvalidSignature => VerifyError::Signature,
            ErrorKind::ExpiredSignature => VerifyError::Expired,
            ErrorKind::ImmatureSignature => VerifyError::NotYetValid,
            ErrorKind::InvalidIssuer => VerifyError::Issuer {
                expected: self.issuer.clone(),
            },
            ErrorKind::InvalidAudience => VerifyError::Audience {
                expected: audience.to_string(),
            },
            ErrorKind::InvalidAlgorithm => VerifyError::Algorithm("mismatched".into()),
            ErrorKind::MissingRequiredClaim(c) => VerifyError::Claims(c),
            ErrorKind::InvalidClaimFormat(c) => VerifyError::Claims(c),
            ErrorKind::Json(e) => VerifyError::Claims(e.to_string()),
            ErrorKind::InvalidEcdsaKey | ErrorKind::InvalidRsaKey(_) => VerifyError::Signature,
            _ => VerifyError::Malformed,
        }
    }
}

/// Reads the unverified `iss` of a token, to decide which issuer's keys to
/// check it against. Nothing read here is trusted until verified.
pub fn unverified_issuer(token: &str) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Iss {
        iss: String,
    }
    jsonwebtoken::dangerous::insecure_decode_claims::<Iss>(token)
        .ok()
        .map(|c| c.iss)
}

/// The distinct audiences in a token (unverified), for error messages.
pub fn unverified_audiences(token: &str) -> HashSet<String> {
    #[derive(serde::Deserialize)]
    struct Aud {
        aud: Audience,
    }
    jsonwebtoken::dangerous::insecure_decode_claims::<Aud>(token)
        .map(|c| c.aud.iter().map(str::to_string).collect())
        .unwrap_or_default()
}

// The verifier's tests sign with the built-in issuer (the `dev` feature).
#[cfg(test)]
mod tests;
