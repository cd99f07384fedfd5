//! What a request to the broker yields: a [`Grant`], or why not
//! ([`BrokerError`]), with the one classification every surface renders
//! from ([`ErrorClass`]); and what a surface needs of a broker
//! ([`TokenBroker`]), whether the pipeline itself (the agent) or the
//! agent reached over the agent API (the sidecar).
//!
//! The pipeline decides *what* went wrong ([`BrokerError`]); what that
//! means for a caller — not found, bad request, forbidden, throttled (with
//! a retry-after), retryable unavailable — is decided here, once
//! ([`BrokerError::class`]), so the five surfaces cannot disagree. Each
//! surface only chooses its SDK's status code and body shape per class.

use std::sync::Arc;
use std::time::Duration;

use secrecy::SecretString;

use crate::cloud::{Cloud, CloudError, Credential, Identity, TokenRequest};
use crate::token::VerifyError;

/// What a granted request yields: the identity, and the credential (none
/// for [`Kind::Identity`](crate::cloud::Kind::Identity) lookups).
#[derive(Debug, Clone)]
pub struct Grant {
    /// The cloud identity the request was decided for.
    pub identity: Identity,
    /// The credential, shared with the cache; `None` only for
    /// [`Kind::Identity`](crate::cloud::Kind::Identity) lookups.
    pub credential: Option<Arc<Credential>>,
    /// For a lookup that selects nothing, where the ServiceAccount lists
    /// several identities of the cloud: those the policy allows the caller,
    /// in their order (what GCE's `service-accounts/` lists; `identity` is
    /// the first of them, or the default where it allows none). `None`:
    /// only `identity`, undecided.
    pub listed: Option<Vec<Identity>>,
}

impl Grant {
    /// The identities a listing shows: [`Grant::listed`], or else the one
    /// identity (a single one is listed even where the policy denies it, so
    /// that asking for it meets the denial, naming the policies).
    pub fn listed(&self) -> &[Identity] {
        self.listed
            .as_deref()
            .unwrap_or(std::slice::from_ref(&self.identity))
    }
}

/// What a protocol surface needs from the broker.
#[async_trait::async_trait]
pub trait TokenBroker: Send + Sync {
    /// Decides `request` for the caller whose projected token is `subject`.
    async fn request(
        &self,
        subject: &SecretString,
        request: &TokenRequest,
    ) -> Result<Grant, BrokerError>;
}

/// A shared broker decides as the broker it shares.
#[async_trait::async_trait]
impl<T: TokenBroker + ?Sized> TokenBroker for Arc<T> {
    async fn request(
        &self,
        subject: &SecretString,
        request: &TokenRequest,
    ) -> Result<Grant, BrokerError> {
        (**self).request(subject, request).await
    }
}

/// Why a request was not granted.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// The caller's projected token failed a check (or, when
    /// [`VerifyError::is_transient`], could not be checked for now).
    #[error("caller token refused: {0}")]
    Unauthenticated(#[from] VerifyError),
    /// The caller's ServiceAccount has no binding for the cloud asked (no
    /// annotation naming an identity there).
    #[error("service account {namespace}/{name} has no {cloud} binding")]
    NotBound {
        /// The cloud asked for.
        cloud: Cloud,
        /// The ServiceAccount's namespace.
        namespace: String,
        /// The ServiceAccount's name.
        name: String,
    },
    /// The request named an identity (a client id, an email, a role name)
    /// that the caller's ServiceAccount does not list. Among the listed ones,
    /// the policy decides ("forbidden"); one not listed is "not found".
    #[error("the requested identity is not bound to this service account")]
    IdentityNotFound,
    /// The cloud asked for is not enabled on this broker.
    #[error("{0} is not configured on this broker")]
    CloudDisabled(Cloud),
    /// The request is malformed or out of bounds (a missing audience, too many
    /// scopes, a kind the cloud does not issue); the text says what is wrong.
    #[error("{0}")]
    BadRequest(String),
    /// The authorization policy refused the request.
    #[error("denied by policy: {reason}")]
    Denied {
        /// What the caller is told.
        reason: String,
        /// Ids of the policies that decided.
        policies: Vec<String>,
    },
    /// The cloud's token service refused, throttled or failed the exchange.
    #[error(transparent)]
    Upstream(#[from] CloudError),
    /// Lanyard itself cannot answer for now (the node agent, the binding
    /// directory or the audit sink is unreachable, or the projected token is not
    /// written yet); retryable. The text says what failed.
    #[error("{0}")]
    Unavailable(String),
}

/// What an error means for the caller; each surface renders each class in
/// its SDK's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// No such identity for this caller (unbound, unselected, cloud off).
    NotFound,
    /// The request itself is wrong; retrying it unchanged cannot help.
    BadRequest,
    /// Refused: the caller's token, the policy, or the cloud said no.
    Forbidden,
    /// Slow down; retry after the error's [`BrokerError::retry_after`].
    Throttled,
    /// Failed for now; retrying can succeed.
    Unavailable,
}

impl ErrorClass {
    /// Every class, for tests that walk them through every surface.
    pub const ALL: [ErrorClass; 5] = [
        ErrorClass::NotFound,
        ErrorClass::BadRequest,
        ErrorClass::Forbidden,
        ErrorClass::Throttled,
        ErrorClass::Unavailable,
    ];

    /// Whether an SDK should retry (they retry 429 and 5xx).
    pub fn is_retryable(self) -> bool {
        matches!(self, ErrorClass::Throttled | ErrorClass::Unavailable)
    }
}

impl BrokerError {
    /// The one classification of this error.
    pub fn class(&self) -> ErrorClass {
        match self {
            BrokerError::Unauthenticated(e) if e.is_transient() => ErrorClass::Unavailable,
            BrokerError::Unauthenticated(_) => ErrorClass::Forbidden,
            BrokerError::NotBound { .. }
            | BrokerError::IdentityNotFound
            | BrokerError::CloudDisabled(_) => ErrorClass::NotFound,
            BrokerError::BadRequest(_) => ErrorClass::BadRequest,
            BrokerError::Denied { .. } => ErrorClass::Forbidden,
            BrokerError::Upstream(CloudError::Rejected { .. }) => ErrorClass::Forbidden,
            BrokerError::Upstream(
                CloudError::Throttled { .. } | CloudError::CallerLimited { .. },
            ) => ErrorClass::Throttled,
            BrokerError::Upstream(_) | BrokerError::Unavailable(_) => ErrorClass::Unavailable,
        }
    }

    /// Whether the client should retry.
    pub fn is_retryable(&self) -> bool {
        self.class().is_retryable()
    }

    /// How long a throttled caller should wait, when known.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            BrokerError::Upstream(CloudError::Throttled { retry_after, .. }) => *retry_after,
            BrokerError::Upstream(CloudError::CallerLimited { retry_after, .. }) => {
                Some(*retry_after)
            }
            _ => None,
        }
    }

    /// The code that decided: the upstream's (AADSTS…, PERMISSION_DENIED,
    /// AccessDenied) or, for a refused token, which check failed.
    pub fn code(&self) -> Option<&str> {
        match self {
            BrokerError::Upstream(e) => e.code(),
            // As relayed by the agent, the check's name travels as text.
            BrokerError::Unauthenticated(VerifyError::Refused { reason, .. }) => Some(reason),
            BrokerError::Unauthenticated(e) => Some(e.reason()),
            _ => None,
        }
    }

    /// Short reason for audit and metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            BrokerError::Unauthenticated(e) => e.reason(),
            BrokerError::NotBound { .. } => "not_bound",
            BrokerError::IdentityNotFound => "identity_not_found",
            BrokerError::CloudDisabled(_) => "cloud_disabled",
            BrokerError::BadRequest(_) => "bad_request",
            BrokerError::Denied { .. } => "policy_denied",
            BrokerError::Upstream(CloudError::Rejected { .. }) => "upstream_rejected",
            BrokerError::Upstream(CloudError::Throttled { .. }) => "upstream_throttled",
            BrokerError::Upstream(CloudError::CallerLimited { .. }) => "caller_limited",
            BrokerError::Upstream(_) => "upstream_unavailable",
            BrokerError::Unavailable(_) => "unavailable",
        }
    }

    /// What the caller is told: who refused and why, never a secret.
    pub fn describe(&self) -> String {
        match self {
            BrokerError::Unauthenticated(e) if !e.is_transient() => {
                format!("The pod's service account token was refused: {e}")
            }
            BrokerError::Denied { reason, policies } if policies.is_empty() => {
                format!("Denied by Lanyard policy: {reason}")
            }
            BrokerError::Denied { reason, policies } => {
                format!(
                    "Denied by Lanyard policy: {reason} (policies: {})",
                    policies.join(", ")
                )
            }
            BrokerError::Upstream(CloudError::Rejected {
                cloud,
                code,
                message,
            }) => format!(
                "{} refused the token exchange: {code}: {message}",
                cloud.upstream()
            ),
            BrokerError::Upstream(CloudError::Throttled { cloud, .. }) => format!(
                "{} is throttling token requests; retry later",
                cloud.upstream()
            ),
            BrokerError::Upstream(CloudError::CallerLimited {
                limit, retry_after, ..
            }) => format!(
                "Lanyard limits each service account: too many {}; retry in {} s",
                limit.describe(),
                retry_after.as_secs().max(1)
            ),
            other if other.class() == ErrorClass::Unavailable => {
                format!("Token service temporarily unavailable: {other}")
            }
            other => other.to_string(),
        }
    }
}

/// One error of every variant (and so of every class), for the tests that
/// walk them through the wire format and every surface.
#[cfg(any(test, feature = "samples"))]
#[doc(hidden)]
pub fn samples() -> Vec<BrokerError> {
    vec![
        BrokerError::NotBound {
            cloud: Cloud::Aws,
            namespace: "ml".into(),
            name: "ray".into(),
        },
        BrokerError::IdentityNotFound,
        BrokerError::CloudDisabled(Cloud::Gcp),
        BrokerError::BadRequest("resource is empty".into()),
        BrokerError::Unauthenticated(VerifyError::Expired),
        BrokerError::Unauthenticated(VerifyError::Keys(crate::token::KeysError::Fetch {
            url: "http://issuer/jwks".into(),
            reason: "down".into(),
        })),
        BrokerError::Denied {
            reason: "no control-plane scopes".into(),
            policies: vec!["no-management".into()],
        },
        BrokerError::Upstream(CloudError::Rejected {
            cloud: Cloud::Azure,
            code: "AADSTS70021".into(),
            message: "No matching federated identity record found".into(),
        }),
        BrokerError::Upstream(CloudError::CallerLimited {
            cloud: Cloud::Azure,
            limit: crate::cloud::CallerLimit::NewKeys,
            retry_after: Duration::from_secs(2),
        }),
        BrokerError::Upstream(CloudError::Throttled {
            cloud: Cloud::Aws,
            code: "Throttling".into(),
            retry_after: Some(Duration::from_secs(7)),
        }),
        BrokerError::Upstream(CloudError::Unavailable {
            cloud: Cloud::Gcp,
            reason: "connection reset".into(),
        }),
        BrokerError::Upstream(CloudError::Protocol {
            cloud: Cloud::Azure,
            reason: "not JSON".into(),
        }),
        BrokerError::Unavailable("node agent unreachable".into()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_agree_with_retryability() {
        let disabled = BrokerError::CloudDisabled(Cloud::Azure);
        assert_eq!(disabled.class(), ErrorClass::NotFound);
        assert!(!disabled.is_retryable());
        let keys =
            BrokerError::Unauthenticated(VerifyError::Keys(crate::token::KeysError::Fetch {
                url: "http://issuer/jwks".into(),
                reason: "down".into(),
            }));
        assert_eq!(keys.class(), ErrorClass::Unavailable);
        assert!(keys.is_retryable());
        let expired = BrokerError::Unauthenticated(VerifyError::Expired);
        assert_eq!(expired.class(), ErrorClass::Forbidden);
        assert_eq!(expired.code(), Some("expired"));
        let throttled = BrokerError::Upstream(CloudError::Throttled {
            cloud: Cloud::Aws,
            code: "Throttling".into(),
            retry_after: Some(Duration::from_secs(7)),
        });
        assert_eq!(throttled.class(), ErrorClass::Throttled);
        assert_eq!(throttled.retry_after(), Some(Duration::from_secs(7)));
        let denied = BrokerError::Denied {
            reason: "forbidden scope".into(),
            policies: vec!["p1".into(), "p2".into()],
        };
        assert_eq!(denied.class(), ErrorClass::Forbidden);
        assert!(denied.describe().contains("p1, p2"));
    }
}
