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

use std::collections::HashSet;
use std::sync::Arc;

pub use claims::{
    parse_subject, Audience, Caller, KubernetesClaim, ObjectRef, ServiceAccountClaims,
};
pub use jwks::{kube_get, Discovery, KeySet, KeySource, KeysError, Lookup};

use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, Validation};

use crate::secret::fingerprint;

/// Clock skew tolerated on `exp`, `nbf` and `iat`, in seconds.
pub const LEEWAY_SECS: u64 = 30;

/// Algorithms a service-account issuer may use. Kubernetes signs with RS256
/// or ES256; anything else (notably `none` and HMAC) is refused.
const ALLOWED_ALGS: [Algorithm; 2] = [Algorithm::RS256, Algorithm::ES256];

/// Which check a token failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum VerifyError {
    /// Not a JWT: its header does not decode, or the token is otherwise
    /// unreadable.
    #[error("token is not a well-formed JWT")]
    Malformed,
    /// Signed with an algorithm other than RS256 or ES256, or one the key's
    /// JWK does not allow; carries the algorithm.
    #[error(
        "token algorithm {0} is not allowed (RS256 or ES256, as the signing key's JWK names it)"
    )]
    Algorithm(String),
    /// The `kid` names no key of the issuer's set, even after a refetch.
    #[error("token is signed by a key the issuer does not publish")]
    UnknownKey,
    /// The signature does not verify with the issuer's key.
    #[error("token signature is invalid")]
    Signature,
    /// The token's `iss` is not the verifier's issuer.
    #[error("token issuer is not {expected}")]
    Issuer {
        /// The issuer the verifier trusts.
        expected: String,
    },
    /// The token's `aud` does not include the cloud's audience.
    #[error("token audience does not include {expected}")]
    Audience {
        /// The audience the request needed.
        expected: String,
    },
    /// `exp` has passed (beyond [`LEEWAY_SECS`]).
    #[error("token has expired")]
    Expired,
    /// `nbf` or `iat` is in the future (beyond [`LEEWAY_SECS`]).
    #[error("token is not valid yet (nbf in the future)")]
    NotYetValid,
    /// A required claim is missing or malformed; carries which, or the decode
    /// error.
    #[error("token claim {0} is missing or malformed")]
    Claims(String),
    /// `sub` is not `system:serviceaccount:NAMESPACE:NAME`, or disagrees with
    /// the `kubernetes.io` claim.
    #[error("token subject is not system:serviceaccount:NAMESPACE:NAME or disagrees with its kubernetes.io claim")]
    Subject,
    /// The issuer's keys could not be obtained: transient, the token itself may
    /// be fine.
    #[error("issuer keys unavailable: {0}")]
    Keys(#[from] KeysError),
    /// A valid token, but not bound to a pod (a legacy Secret token, or one
    /// from `kubectl create token` without `--bound-object-kind Pod`).
    #[error("token is not bound to a pod (legacy or non-projected token)")]
    NotPodBound,
    /// The pod the token is bound to no longer exists (or has another uid).
    #[error("token belongs to a pod that no longer exists")]
    PodGone,
    /// The token's ServiceAccount was deleted and created again under the
    /// same name: the token names the old one's uid.
    #[error(
        "token belongs to a ServiceAccount that was deleted (one of the same name exists now)"
    )]
    ServiceAccountReplaced,
    /// The token's pod runs on another node than this agent's.
    #[error("token was issued for node {token_node}, not this node ({this_node})")]
    OtherNode {
        /// The node the token names.
        token_node: String,
        /// This agent's node.
        this_node: String,
    },
    /// No token at all: the agent API's request carried no `Authorization:
    /// Bearer`.
    #[error("Authorization: Bearer <projected service account token> is required")]
    Missing,
    /// Refused by the node agent (as seen from a sidecar).
    #[error("{message}")]
    Refused {
        /// The check that failed, as [`VerifyError::reason`] named it on
        /// the agent (or `token_review`).
        reason: String,
        /// The refusal as the agent worded it.
        message: String,
    },
}

impl VerifyError {
    /// Short machine-readable reason, for metrics labels and audit.
    pub fn reason(&self) -> &'static str {
        match self {
            VerifyError::Malformed => "malformed",
            VerifyError::Algorithm(_) => "algorithm",
            VerifyError::UnknownKey => "unknown_key",
            VerifyError::Signature => "signature",
            VerifyError::Issuer { .. } => "issuer",
            VerifyError::Audience { .. } => "audience",
            VerifyError::Expired => "expired",
            VerifyError::NotYetValid => "not_yet_valid",
            VerifyError::Claims(_) => "claims",
            VerifyError::Subject => "subject",
            VerifyError::Keys(_) => "keys_unavailable",
            VerifyError::NotPodBound => "not_pod_bound",
            VerifyError::PodGone => "pod_gone",
            VerifyError::ServiceAccountReplaced => "service_account_replaced",
            VerifyError::OtherNode { .. } => "other_node",
            VerifyError::Missing => "missing",
            VerifyError::Refused { reason, .. } if reason == "token_review" => "token_review",
            VerifyError::Refused { .. } => "refused",
        }
    }

    /// Whether retrying later could succeed (issuer keys unreachable) as
    /// opposed to the token itself being unacceptable.
    pub fn is_transient(&self) -> bool {
        matches!(self, VerifyError::Keys(_))
    }
}

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
