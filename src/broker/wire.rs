//! The agent API's wire format (`POST /v1/token`), shared by the agent's
//! server and the sidecar's client. Versioned by path; fields are only
//! ever added.
//!
//! The caller's projected token travels in `Authorization: Bearer`, never
//! in the body, so that it is not captured by body logging anywhere.

use serde::{Deserialize, Serialize};

use super::{AzureSelector, BrokerError, GcpIdentity};
use crate::cloud::{Cloud, CloudError};
use crate::token::VerifyError;

/// Path of the agent API.
pub const TOKEN_PATH: &str = "/v1/token";

/// What a sidecar asks the agent for. Unknown fields are ignored, so a
/// newer sidecar can talk to an older agent; unknown request kinds are not.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "request", rename_all = "snake_case")]
pub enum AgentRequest {
    AzureToken {
        resource: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        selector: Option<AzureSelector>,
    },
    GcpIdentity,
    GcpToken {
        account: String,
        #[serde(default)]
        scopes: Vec<String>,
    },
    GcpIdToken {
        account: String,
        audience: String,
        #[serde(default)]
        include_email: bool,
    },
    AwsRole,
    AwsCredentials,
}

impl AgentRequest {
    /// The cloud whose projected token must authenticate this request.
    pub fn cloud(&self) -> Cloud {
        match self {
            AgentRequest::AzureToken { .. } => Cloud::Azure,
            AgentRequest::GcpIdentity
            | AgentRequest::GcpToken { .. }
            | AgentRequest::GcpIdToken { .. } => Cloud::Gcp,
            AgentRequest::AwsRole | AgentRequest::AwsCredentials => Cloud::Aws,
        }
    }
}

/// What the agent answers. Secrets appear only here, in the response body
/// on the node-local connection.
#[derive(Clone, Serialize, Deserialize)]
#[serde(tag = "grant", rename_all = "snake_case")]
pub enum AgentResponse {
    AzureToken {
        access_token: String,
        issued_at: u64,
        expires_at: u64,
        client_id: String,
        resource: String,
    },
    GcpIdentity(GcpIdentity),
    GcpToken {
        access_token: String,
        issued_at: u64,
        expires_at: u64,
        identity: GcpIdentity,
    },
    GcpIdToken {
        token: String,
        expires_at: u64,
    },
    AwsRole {
        role_arn: String,
    },
    AwsCredentials {
        access_key_id: String,
        secret_access_key: String,
        session_token: String,
        issued_at: u64,
        expires_at: u64,
        account_id: String,
        assumed_role_arn: String,
        role_arn: String,
    },
}

impl std::fmt::Debug for AgentResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secrets a response carries.
        let kind = match self {
            AgentResponse::AzureToken { .. } => "azure_token",
            AgentResponse::GcpIdentity(_) => "gcp_identity",
            AgentResponse::GcpToken { .. } => "gcp_token",
            AgentResponse::GcpIdToken { .. } => "gcp_id_token",
            AgentResponse::AwsRole { .. } => "aws_role",
            AgentResponse::AwsCredentials { .. } => "aws_credentials",
        };
        f.debug_struct("AgentResponse")
            .field("grant", &kind)
            .finish_non_exhaustive()
    }
}

/// A refusal or failure, with enough structure for the sidecar to rebuild
/// the broker error and render it in each SDK's format.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AgentError {
    /// `unauthenticated`, `not_bound`, `identity_not_found`, `cloud_disabled`,
    /// `bad_request`, `upstream_rejected`, `upstream_throttled`,
    /// `upstream_unavailable`, `upstream_protocol`, `unavailable`.
    pub kind: String,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud: Option<Cloud>,
    /// Upstream code (AADSTS…, PERMISSION_DENIED, AccessDenied) or, for
    /// `unauthenticated`, which token check failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_secs: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: AgentError,
}

impl AgentError {
    /// The HTTP status the agent answers with.
    pub fn status(&self) -> u16 {
        match self.kind.as_str() {
            "unauthenticated" => 401,
            "not_bound" | "identity_not_found" | "cloud_disabled" => 404,
            "bad_request" => 400,
            "upstream_rejected" => 403,
            "upstream_throttled" => 429,
            _ => 503,
        }
    }

    pub fn from_broker(err: &BrokerError) -> AgentError {
        let mut e = AgentError {
            kind: String::new(),
            message: err.to_string(),
            cloud: None,
            code: None,
            retry_after_secs: None,
            namespace: None,
            service_account: None,
        };
        match err {
            BrokerError::Unauthenticated(v) if v.is_transient() => {
                e.kind = "unavailable".into();
            }
            BrokerError::Unauthenticated(v) => {
                e.kind = "unauthenticated".into();
                e.code = Some(v.reason().into());
            }
            BrokerError::NotBound {
                cloud,
                namespace,
                name,
            } => {
                e.kind = "not_bound".into();
                e.cloud = Some(*cloud);
                e.namespace = Some(namespace.clone());
                e.service_account = Some(name.clone());
            }
            BrokerError::IdentityNotFound => e.kind = "identity_not_found".into(),
            BrokerError::CloudDisabled(cloud) => {
                e.kind = "cloud_disabled".into();
                e.cloud = Some(*cloud);
            }
            BrokerError::BadRequest(_) => e.kind = "bad_request".into(),
            BrokerError::Upstream(up) => match up {
                CloudError::Rejected {
                    cloud,
                    code,
                    message,
                } => {
                    e.kind = "upstream_rejected".into();
                    e.cloud = Some(*cloud);
                    e.code = Some(code.clone());
                    e.message = message.clone();
                }
                CloudError::Throttled {
                    cloud,
                    code,
                    retry_after,
                } => {
                    e.kind = "upstream_throttled".into();
                    e.cloud = Some(*cloud);
                    e.code = Some(code.clone());
                    e.retry_after_secs = retry_after.map(|d| d.as_secs());
                }
                CloudError::Unavailable { cloud, reason } => {
                    e.kind = "upstream_unavailable".into();
                    e.cloud = Some(*cloud);
                    e.message = reason.clone();
                }
                CloudError::Protocol { cloud, reason } => {
                    e.kind = "upstream_protocol".into();
                    e.cloud = Some(*cloud);
                    e.message = reason.clone();
                }
            },
            BrokerError::Unavailable(_) => e.kind = "unavailable".into(),
        }
        e
    }

    /// Rebuilds the broker error on the sidecar's side. `cloud` is the
    /// cloud of the request, used where the agent named none.
    pub fn into_broker(self, cloud: Cloud) -> BrokerError {
        let c = self.cloud.unwrap_or(cloud);
        match self.kind.as_str() {
            "unauthenticated" => BrokerError::Unauthenticated(VerifyError::Refused {
                reason: self.code.unwrap_or_else(|| "refused".into()),
                message: self.message,
            }),
            "not_bound" => BrokerError::NotBound {
                cloud: c,
                namespace: self.namespace.unwrap_or_default(),
                name: self.service_account.unwrap_or_default(),
            },
            "identity_not_found" => BrokerError::IdentityNotFound,
            "cloud_disabled" => BrokerError::CloudDisabled(c),
            "bad_request" => BrokerError::BadRequest(self.message),
            "upstream_rejected" => BrokerError::Upstream(CloudError::Rejected {
                cloud: c,
                code: self.code.unwrap_or_default(),
                message: self.message,
            }),
            "upstream_throttled" => BrokerError::Upstream(CloudError::Throttled {
                cloud: c,
                code: self.code.unwrap_or_default(),
                retry_after: self.retry_after_secs.map(std::time::Duration::from_secs),
            }),
            "upstream_unavailable" => BrokerError::Upstream(CloudError::Unavailable {
                cloud: c,
                reason: self.message,
            }),
            "upstream_protocol" => BrokerError::Upstream(CloudError::Protocol {
                cloud: c,
                reason: self.message,
            }),
            _ => BrokerError::Unavailable(self.message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_unknown_kinds_are_refused() {
        let r: AgentRequest = serde_json::from_str(
            r#"{"request":"azure_token","resource":"https://storage.azure.com/","selector":{"client_id":"abc"}}"#,
        )
        .unwrap();
        assert!(matches!(
            r,
            AgentRequest::AzureToken { selector: Some(AzureSelector::ClientId(ref c)), .. } if c == "abc"
        ));
        assert_eq!(r.cloud(), Cloud::Azure);
        assert!(matches!(
            serde_json::from_str::<AgentRequest>(r#"{"request":"aws_role","added_later":1}"#),
            Ok(AgentRequest::AwsRole)
        ));
        assert!(
            serde_json::from_str::<AgentRequest>(r#"{"request":"gcp_token"}"#).is_err(),
            "account is required"
        );
        assert!(serde_json::from_str::<AgentRequest>(r#"{"request":"steal"}"#).is_err());
    }

    #[test]
    fn errors_survive_the_trip() {
        let original = BrokerError::Upstream(CloudError::Rejected {
            cloud: Cloud::Azure,
            code: "AADSTS70021".into(),
            message: "no match".into(),
        });
        let wire = AgentError::from_broker(&original);
        assert_eq!(wire.status(), 403);
        let back = wire.into_broker(Cloud::Azure);
        assert!(
            matches!(back, BrokerError::Upstream(CloudError::Rejected { ref code, .. }) if code == "AADSTS70021")
        );

        let wire = AgentError::from_broker(&BrokerError::Unauthenticated(VerifyError::Expired));
        assert_eq!(wire.status(), 401);
        assert_eq!(wire.code.as_deref(), Some("expired"));
        assert!(!wire.into_broker(Cloud::Gcp).is_retryable());

        let response = AgentResponse::AwsRole {
            role_arn: "arn".into(),
        };
        assert!(!format!("{response:?}").contains("arn"));
    }
}
