//! The sidecar's broker: the node agent, over HTTP. Each request carries
//! the pod's projected token for the cloud asked; the agent verifies it,
//! decides, exchanges (or serves from its cache) and answers in the wire
//! format of [`super::wire`]. When the agent is unreachable or slow the
//! error is retryable, so every SDK surface answers with a status its SDK
//! retries on, never a wrong or empty credential.

use std::time::Duration;

use super::wire::{AgentRequest, AgentResponse, ErrorBody, TOKEN_PATH};
use super::{
    AwsGrant, AzureGrant, AzureTokenRequest, BrokerError, GcpGrant, GcpIdTokenRequest, GcpIdentity,
    GcpTokenRequest, TokenBroker,
};
use crate::cloud::aws::AwsCredentials;
use crate::cloud::gcp::IdToken;
use crate::cloud::AccessToken;
use crate::secret::{ExposeSecret, SecretString};

/// A client of the node agent's `/v1/token`.
pub struct RemoteBroker {
    http: reqwest::Client,
    token_url: String,
    health_url: String,
}

impl RemoteBroker {
    pub fn new(agent_url: &str) -> Self {
        let base = agent_url.trim_end_matches('/');
        // A plain-http agent (the node-local default) needs no TLS roots;
        // not loading them keeps the sidecar's footprint small.
        let plain = base.starts_with("http://");
        let mut builder = reqwest::Client::builder();
        if plain {
            builder = builder.tls_certs_only(Vec::new());
        }
        let http = builder
            .connect_timeout(Duration::from_secs(2))
            // Longer than the agent's own upstream timeout would be pointless:
            // the SDKs retry a 503 sooner than they would wait.
            .timeout(Duration::from_secs(20))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap_or_default();
        RemoteBroker {
            http,
            token_url: format!("{base}{TOKEN_PATH}"),
            health_url: format!("{base}/healthz"),
        }
    }

    /// Whether the agent answers its health check (for the sidecar's readiness).
    pub async fn agent_healthy(&self) -> bool {
        match self
            .http
            .get(&self.health_url)
            .timeout(Duration::from_secs(1))
            .send()
            .await
        {
            Ok(r) => r.status().is_success(),
            Err(_) => false,
        }
    }

    async fn call(
        &self,
        subject: &SecretString,
        request: AgentRequest,
    ) -> Result<AgentResponse, BrokerError> {
        let cloud = request.cloud();
        let resp = self
            .http
            .post(&self.token_url)
            .bearer_auth(subject.expose_secret())
            .json(&request)
            .send()
            .await
            .map_err(|e| {
                BrokerError::Unavailable(format!("node agent unreachable: {}", e.without_url()))
            })?;
        let status = resp.status();
        let body = resp.bytes().await.map_err(|e| {
            BrokerError::Unavailable(format!("node agent response: {}", e.without_url()))
        })?;
        if status.is_success() {
            return serde_json::from_slice(&body).map_err(|e| {
                BrokerError::Unavailable(format!("node agent answered an unreadable grant: {e}"))
            });
        }
        match serde_json::from_slice::<ErrorBody>(&body) {
            Ok(err) => Err(err.error.into_broker(cloud)),
            Err(_) => Err(BrokerError::Unavailable(format!(
                "node agent answered HTTP {status}"
            ))),
        }
    }
}

fn unexpected() -> BrokerError {
    BrokerError::Unavailable("node agent answered a grant of another kind".into())
}

#[async_trait::async_trait]
impl TokenBroker for RemoteBroker {
    async fn azure_token(
        &self,
        subject: &SecretString,
        request: &AzureTokenRequest,
    ) -> Result<AzureGrant, BrokerError> {
        let req = AgentRequest::AzureToken {
            resource: request.resource.clone(),
            selector: request.selector.clone(),
        };
        match self.call(subject, req).await? {
            AgentResponse::AzureToken {
                access_token,
                issued_at,
                expires_at,
                client_id,
                resource,
            } => Ok(AzureGrant {
                token: AccessToken {
                    token: SecretString::from(access_token),
                    issued_at,
                    expires_at,
                },
                client_id,
                resource,
            }),
            _ => Err(unexpected()),
        }
    }

    async fn gcp_identity(&self, subject: &SecretString) -> Result<GcpIdentity, BrokerError> {
        match self.call(subject, AgentRequest::GcpIdentity).await? {
            AgentResponse::GcpIdentity(identity) => Ok(identity),
            _ => Err(unexpected()),
        }
    }

    async fn gcp_token(
        &self,
        subject: &SecretString,
        request: &GcpTokenRequest,
    ) -> Result<GcpGrant, BrokerError> {
        let req = AgentRequest::GcpToken {
            account: request.account.clone(),
            scopes: request.scopes.clone(),
        };
        match self.call(subject, req).await? {
            AgentResponse::GcpToken {
                access_token,
                issued_at,
                expires_at,
                identity,
            } => Ok(GcpGrant {
                token: AccessToken {
                    token: SecretString::from(access_token),
                    issued_at,
                    expires_at,
                },
                identity,
            }),
            _ => Err(unexpected()),
        }
    }

    async fn gcp_id_token(
        &self,
        subject: &SecretString,
        request: &GcpIdTokenRequest,
    ) -> Result<IdToken, BrokerError> {
        let req = AgentRequest::GcpIdToken {
            account: request.account.clone(),
            audience: request.audience.clone(),
            include_email: request.include_email,
        };
        match self.call(subject, req).await? {
            AgentResponse::GcpIdToken { token, expires_at } => Ok(IdToken {
                token: SecretString::from(token),
                expires_at,
            }),
            _ => Err(unexpected()),
        }
    }

    async fn aws_role(&self, subject: &SecretString) -> Result<String, BrokerError> {
        match self.call(subject, AgentRequest::AwsRole).await? {
            AgentResponse::AwsRole { role_arn } => Ok(role_arn),
            _ => Err(unexpected()),
        }
    }

    async fn aws_credentials(&self, subject: &SecretString) -> Result<AwsGrant, BrokerError> {
        match self.call(subject, AgentRequest::AwsCredentials).await? {
            AgentResponse::AwsCredentials {
                access_key_id,
                secret_access_key,
                session_token,
                issued_at,
                expires_at,
                account_id,
                assumed_role_arn,
                role_arn,
            } => Ok(AwsGrant {
                credentials: AwsCredentials {
                    access_key_id,
                    secret_access_key: SecretString::from(secret_access_key),
                    session_token: SecretString::from(session_token),
                    expires_at,
                    issued_at,
                    account_id,
                    assumed_role_arn,
                },
                role_arn,
            }),
            _ => Err(unexpected()),
        }
    }
}
