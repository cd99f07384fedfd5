//! Why a caller's projected token was refused ([`VerifyError`]), and why
//! the issuer's keys could not be had ([`KeysError`]): what the verifier
//! decides, what the agent API carries back to a sidecar, and what every
//! surface renders. The verifier itself is in the product crate.

/// Clock skew tolerated on `exp`, `nbf` and `iat`, in seconds.
pub const LEEWAY_SECS: u64 = 30;

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

/// Why keys could not be obtained.
#[derive(Debug, Clone, thiserror::Error)]
pub enum KeysError {
    /// The document could not be fetched: unreachable, or not a 2xx.
    #[error("fetching {url} failed: {reason}")]
    Fetch {
        /// The document's URL (or `kubernetes API PATH`).
        url: String,
        /// What failed: the transport error, or `HTTP STATUS`.
        reason: String,
    },
    /// The document was fetched but is not what it should be.
    #[error("{url} is not a valid {what} document: {reason}")]
    Parse {
        /// The document's URL (or `kubernetes API PATH`).
        url: String,
        /// Which document was expected (`JWKS`, `OIDC discovery`).
        what: &'static str,
        /// The JSON error.
        reason: String,
    },
    /// The token names a key the keys fetched last do not have, and the
    /// last attempt to fetch them again failed too recently to try again
    /// (an attacker inventing `kid`s must not cause a fetch per request);
    /// it may be a key the issuer has rotated to since, so this is no
    /// verdict on it.
    #[error("the token's key is not among the issuer's keys fetched last, and the last attempt to refetch them failed (retried at most every {interval_seconds} s)")]
    NotRefetched {
        /// The minimum interval between fetches.
        interval_seconds: u64,
    },
    /// The discovery document names another issuer than the one asked,
    /// so its keys cannot be trusted for this issuer's tokens.
    #[error("discovery document of {issuer} names issuer {found}")]
    IssuerMismatch {
        /// The issuer whose document was fetched.
        issuer: String,
        /// The issuer the document names.
        found: String,
    },
}
