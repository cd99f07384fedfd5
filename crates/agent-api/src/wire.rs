//! The agent API's wire format (`POST /v1/token`), shared by the agent's
//! server and the sidecar's client. Versioned by path; from here on fields
//! are only ever added.
//!
//! The body is the uniform [`lanyard_core::cloud::TokenRequest`]; the answer a
//! [`WireGrant`] or an [`ErrorBody`] whose [`WireError`] mirrors
//! [`BrokerError`] variant for variant, so a refusal renders in the sidecar
//! exactly as it would have in the agent. The caller's projected token travels in `Authorization:
//! Bearer`, never in the body, so that it is not captured by body logging
//! anywhere.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use lanyard_core::cloud::{AccessToken, Cloud, CloudError, Credential, Identity};
use lanyard_core::grant::{BrokerError, ErrorClass, Grant};
use lanyard_core::secret::{ExposeSecret, SecretString};
use lanyard_core::token::VerifyError;

/// Path of the agent API.
pub const TOKEN_PATH: &str = "/v1/token";

/// A grant on the wire. Secrets appear only here, in the response body on
/// the node-local connection.
#[derive(Clone, Serialize, Deserialize)]
pub struct WireGrant {
    /// The identity the request was decided for.
    pub identity: Identity,
    /// The credential; absent for [`lanyard_core::cloud::Kind::Identity`] lookups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential: Option<WireCredential>,
    /// [`Grant::listed`]; absent from agents before it (the sidecar then
    /// lists `identity` alone, as they did).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listed: Option<Vec<Identity>>,
}

/// A credential on the wire.
#[derive(Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum WireCredential {
    /// An OAuth access token ([`Credential::Token`]).
    Token {
        /// The bearer token itself.
        access_token: String,
        /// When it was obtained, Unix seconds.
        issued_at: u64,
        /// When it expires, Unix seconds.
        expires_at: u64,
    },
    /// An OIDC ID token ([`Credential::IdToken`]).
    IdToken {
        /// The signed JWT itself.
        token: String,
        /// When it was obtained, Unix seconds.
        issued_at: u64,
        /// When it expires, Unix seconds.
        expires_at: u64,
    },
    /// AWS session credentials ([`Credential::Aws`]).
    Aws {
        /// The session's access key id (`ASIA…`).
        access_key_id: String,
        /// The session's secret access key.
        secret_access_key: String,
        /// The session token SDKs send as `X-Amz-Security-Token`.
        session_token: String,
        /// When STS was asked, Unix seconds.
        issued_at: u64,
        /// STS's `Expiration`, Unix seconds.
        expires_at: u64,
        /// The role's 12-digit account.
        account_id: String,
        /// `arn:aws:sts::ACCOUNT:assumed-role/ROLE/SESSION`.
        assumed_role_arn: String,
    },
}

impl std::fmt::Debug for WireGrant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secrets a grant carries.
        f.debug_struct("WireGrant")
            .field("identity", &self.identity.id)
            .finish_non_exhaustive()
    }
}

impl From<&Grant> for WireGrant {
    fn from(grant: &Grant) -> Self {
        let token = |t: &AccessToken| {
            (
                t.token.expose_secret().to_string(),
                t.issued_at,
                t.expires_at,
            )
        };
        WireGrant {
            identity: grant.identity.clone(),
            credential: grant.credential.as_deref().map(|c| match c {
                Credential::Token(t) => {
                    let (access_token, issued_at, expires_at) = token(t);
                    WireCredential::Token {
                        access_token,
                        issued_at,
                        expires_at,
                    }
                }
                Credential::IdToken(t) => {
                    let (token, issued_at, expires_at) = token(t);
                    WireCredential::IdToken {
                        token,
                        issued_at,
                        expires_at,
                    }
                }
                Credential::Aws(c) => WireCredential::Aws {
                    access_key_id: c.access_key_id.clone(),
                    secret_access_key: c.secret_access_key.expose_secret().to_string(),
                    session_token: c.session_token.expose_secret().to_string(),
                    issued_at: c.issued_at,
                    expires_at: c.expires_at,
                    account_id: c.account_id.clone(),
                    assumed_role_arn: c.assumed_role_arn.clone(),
                },
            }),
            listed: grant.listed.clone(),
        }
    }
}

impl From<WireGrant> for Grant {
    fn from(wire: WireGrant) -> Self {
        let token = |t: String, issued_at, expires_at| AccessToken {
            rendered: Default::default(),
            token: SecretString::from(t),
            issued_at,
            expires_at,
        };
        Grant {
            identity: wire.identity,
            credential: wire
                .credential
                .map(|c| match c {
                    WireCredential::Token {
                        access_token,
                        issued_at,
                        expires_at,
                    } => Credential::Token(token(access_token, issued_at, expires_at)),
                    WireCredential::IdToken {
                        token: t,
                        issued_at,
                        expires_at,
                    } => Credential::IdToken(token(t, issued_at, expires_at)),
                    WireCredential::Aws {
                        access_key_id,
                        secret_access_key,
                        session_token,
                        issued_at,
                        expires_at,
                        account_id,
                        assumed_role_arn,
                    } => Credential::Aws(lanyard_core::cloud::AwsCredentials {
                        rendered: Default::default(),
                        access_key_id,
                        secret_access_key: SecretString::from(secret_access_key),
                        session_token: SecretString::from(session_token),
                        expires_at,
                        issued_at,
                        account_id,
                        assumed_role_arn,
                    }),
                })
                .map(Arc::new),
            listed: wire.listed,
        }
    }
}

/// A refusal or failure: [`BrokerError`], variant for variant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WireError {
    /// The caller's token was refused; `code` says which check failed.
    Unauthenticated {
        /// [`VerifyError::reason`] of the failed check (`expired`, `audience`, …).
        code: String,
        /// The refusal as the agent words it.
        message: String,
    },
    /// [`BrokerError::NotBound`]: no binding for this cloud.
    NotBound {
        /// The cloud asked for.
        cloud: Cloud,
        /// The ServiceAccount's namespace.
        namespace: String,
        /// The ServiceAccount's name.
        service_account: String,
    },
    /// [`BrokerError::IdentityNotFound`]: the selector names another identity.
    IdentityNotFound,
    /// [`BrokerError::CloudDisabled`]: the agent does not serve this cloud.
    CloudDisabled {
        /// The cloud asked for.
        cloud: Cloud,
    },
    /// [`BrokerError::BadRequest`]: the request is malformed or out of bounds.
    BadRequest {
        /// What is wrong with it.
        message: String,
    },
    /// [`BrokerError::Denied`]: a policy refused the request.
    PolicyDenied {
        /// The policy's reason, as users are told it.
        message: String,
        /// Ids of the policies that decided (absent from older agents: none).
        #[serde(default)]
        policies: Vec<String>,
    },
    /// [`CloudError::Rejected`]: the cloud refused the exchange.
    UpstreamRejected {
        /// The cloud that refused.
        cloud: Cloud,
        /// The upstream's error code.
        code: String,
        /// The upstream's explanation, scrubbed of secrets.
        message: String,
    },
    /// [`CloudError::Throttled`]: the cloud asked us to slow down.
    UpstreamThrottled {
        /// The cloud that is throttling.
        cloud: Cloud,
        /// The upstream's error code.
        code: String,
        /// How long to wait, in whole seconds; absent when unknown.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        retry_after_secs: Option<u64>,
    },
    /// [`CloudError::CallerLimited`]: the caller's ServiceAccount met one
    /// of its fairness bounds on the agent.
    CallerLimited {
        /// The cloud the request was for.
        cloud: Cloud,
        /// Which bound.
        limit: lanyard_core::cloud::CallerLimit,
        /// How long to wait, in whole seconds.
        retry_after_secs: u64,
    },
    /// [`CloudError::Unavailable`]: the cloud could not be reached or failed.
    UpstreamUnavailable {
        /// The cloud that failed.
        cloud: Cloud,
        /// What failed.
        message: String,
    },
    /// [`CloudError::Protocol`]: the cloud answered something unreadable.
    UpstreamProtocol {
        /// The cloud whose answer could not be read.
        cloud: Cloud,
        /// What was wrong with the answer.
        message: String,
    },
    /// [`BrokerError::Unavailable`], and transient token-check failures: the
    /// agent cannot answer for now.
    Unavailable {
        /// What failed.
        message: String,
    },
    /// A kind this side does not know (a newer agent): retryable.
    #[serde(other)]
    Unknown,
}

/// The error body: `{"error": {...}}`.
#[derive(Debug, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The refusal or failure, tagged by `kind`.
    pub error: WireError,
}

/// The agent API's HTTP status for `err`, from its one classification
/// ([`BrokerError::class`]), as the surfaces render theirs. Within
/// Forbidden, a refused caller token is 401: the agent API authenticates
/// its callers by bearer token, and HTTP names that failure 401.
pub fn status(err: &BrokerError) -> u16 {
    match err.class() {
        ErrorClass::NotFound => 404,
        ErrorClass::BadRequest => 400,
        ErrorClass::Forbidden if matches!(err, BrokerError::Unauthenticated(_)) => 401,
        ErrorClass::Forbidden => 403,
        ErrorClass::Throttled => 429,
        ErrorClass::Unavailable => 503,
    }
}

impl From<&BrokerError> for WireError {
    fn from(err: &BrokerError) -> Self {
        match err {
            // A transient verification failure (issuer keys unreachable)
            // is the agent's trouble, not the caller's: retryable.
            BrokerError::Unauthenticated(v) if v.is_transient() => WireError::Unavailable {
                message: err.to_string(),
            },
            BrokerError::Unauthenticated(v) => WireError::Unauthenticated {
                code: v.reason().to_string(),
                message: v.to_string(),
            },
            BrokerError::NotBound {
                cloud,
                namespace,
                name,
            } => WireError::NotBound {
                cloud: *cloud,
                namespace: namespace.clone(),
                service_account: name.clone(),
            },
            BrokerError::IdentityNotFound => WireError::IdentityNotFound,
            BrokerError::CloudDisabled(cloud) => WireError::CloudDisabled { cloud: *cloud },
            BrokerError::BadRequest(message) => WireError::BadRequest {
                message: message.clone(),
            },
            BrokerError::Denied { reason, policies } => WireError::PolicyDenied {
                message: reason.clone(),
                policies: policies.clone(),
            },
            BrokerError::Upstream(CloudError::Rejected {
                cloud,
                code,
                message,
            }) => WireError::UpstreamRejected {
                cloud: *cloud,
                code: code.clone(),
                message: message.clone(),
            },
            BrokerError::Upstream(CloudError::CallerLimited {
                cloud,
                limit,
                retry_after,
            }) => WireError::CallerLimited {
                cloud: *cloud,
                limit: *limit,
                retry_after_secs: retry_after.as_secs().max(1),
            },
            BrokerError::Upstream(CloudError::Throttled {
                cloud,
                code,
                retry_after,
            }) => WireError::UpstreamThrottled {
                cloud: *cloud,
                code: code.clone(),
                retry_after_secs: retry_after.map(|d| d.as_secs()),
            },
            BrokerError::Upstream(CloudError::Unavailable { cloud, reason }) => {
                WireError::UpstreamUnavailable {
                    cloud: *cloud,
                    message: reason.clone(),
                }
            }
            BrokerError::Upstream(CloudError::Protocol { cloud, reason }) => {
                WireError::UpstreamProtocol {
                    cloud: *cloud,
                    message: reason.clone(),
                }
            }
            BrokerError::Unavailable(message) => WireError::Unavailable {
                message: message.clone(),
            },
        }
    }
}

impl From<WireError> for BrokerError {
    fn from(wire: WireError) -> Self {
        match wire {
            WireError::Unauthenticated { code, message } => {
                BrokerError::Unauthenticated(VerifyError::Refused {
                    reason: code,
                    message,
                })
            }
            WireError::NotBound {
                cloud,
                namespace,
                service_account,
            } => BrokerError::NotBound {
                cloud,
                namespace,
                name: service_account,
            },
            WireError::IdentityNotFound => BrokerError::IdentityNotFound,
            WireError::CloudDisabled { cloud } => BrokerError::CloudDisabled(cloud),
            WireError::BadRequest { message } => BrokerError::BadRequest(message),
            WireError::PolicyDenied { message, policies } => BrokerError::Denied {
                reason: message,
                policies,
            },
            WireError::UpstreamRejected {
                cloud,
                code,
                message,
            } => BrokerError::Upstream(CloudError::Rejected {
                cloud,
                code,
                message,
            }),
            WireError::CallerLimited {
                cloud,
                limit,
                retry_after_secs,
            } => BrokerError::Upstream(CloudError::CallerLimited {
                cloud,
                limit,
                retry_after: Duration::from_secs(retry_after_secs.max(1)),
            }),
            WireError::UpstreamThrottled {
                cloud,
                code,
                retry_after_secs,
            } => BrokerError::Upstream(CloudError::Throttled {
                cloud,
                code,
                retry_after: retry_after_secs.map(Duration::from_secs),
            }),
            WireError::UpstreamUnavailable { cloud, message } => {
                BrokerError::Upstream(CloudError::Unavailable {
                    cloud,
                    reason: message,
                })
            }
            WireError::UpstreamProtocol { cloud, message } => {
                BrokerError::Upstream(CloudError::Protocol {
                    cloud,
                    reason: message,
                })
            }
            WireError::Unavailable { message } => BrokerError::Unavailable(message),
            WireError::Unknown => BrokerError::Unavailable(
                "the node agent answered an error of an unknown kind".into(),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_survives_the_trip() {
        for original in lanyard_core::grant::samples() {
            let wire = WireError::from(&original);
            let json = serde_json::to_string(&ErrorBody {
                error: wire.clone(),
            })
            .unwrap();
            let body: ErrorBody = serde_json::from_str(&json).unwrap();
            assert_eq!(body.error, wire, "{json}");
            let back = BrokerError::from(body.error);
            assert_eq!(back.class(), original.class(), "{original:?} → {json}");
            if !matches!(original, BrokerError::Unauthenticated(_)) {
                assert_eq!(back.reason(), original.reason(), "{original:?}");
                assert_eq!(back.describe(), original.describe(), "{original:?}");
            }
            if original.class() == ErrorClass::Forbidden {
                assert_eq!(back.code(), original.code(), "{original:?}");
            }
            assert_eq!(back.retry_after(), original.retry_after());
            // The sidecar's reading of the answer has the agent's status.
            assert_eq!(status(&back), status(&original), "{original:?}");
            let want = match original.class() {
                ErrorClass::NotFound => 404,
                ErrorClass::BadRequest => 400,
                ErrorClass::Forbidden if matches!(original, BrokerError::Unauthenticated(_)) => 401,
                ErrorClass::Forbidden => 403,
                ErrorClass::Throttled => 429,
                ErrorClass::Unavailable => 503,
            };
            assert_eq!(status(&original), want, "{original:?}");
        }
    }

    #[test]
    fn unknown_kinds_are_retryable_and_grants_hide_secrets() {
        let body: ErrorBody =
            serde_json::from_str(r#"{"error":{"kind":"added_later","message":"x"}}"#).unwrap();
        assert_eq!(body.error, WireError::Unknown);
        assert!(BrokerError::from(body.error).is_retryable());
        let grant = WireGrant {
            identity: Identity {
                cloud: Cloud::Aws,
                id: "arn:aws:iam::111122223333:role/r".into(),
                account: "111122223333".into(),
                account_number: None,
                source: lanyard_core::cloud::Source::Federation,
                via: None,
            },
            credential: Some(WireCredential::Token {
                access_token: "secret-token".into(),
                issued_at: 1,
                expires_at: 2,
            }),
            listed: None,
        };
        assert!(!format!("{grant:?}").contains("secret-token"));
    }
}
