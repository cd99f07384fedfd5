//! The sidecar's broker: the node agent, over HTTP. Each request carries
//! the pod's projected token for the cloud asked; the agent verifies it,
//! decides, exchanges (or serves from its cache) and answers in the wire
//! format of [`super::wire`]. When the agent is unreachable or slow the
//! error is retryable, so every SDK surface answers with a status its SDK
//! retries on, never a wrong or empty credential.

use std::time::Duration;

use super::wire::{ErrorBody, WireGrant, TOKEN_PATH};
use super::{BrokerError, Grant, TokenBroker};
use crate::cloud::TokenRequest;
use crate::secret::{ExposeSecret, SecretString};

/// A client of the node agent's `/v1/token`.
pub struct RemoteBroker {
    http: reqwest::Client,
    token_url: String,
    health_url: String,
}

impl RemoteBroker {
    /// A client of the agent at `agent_url` (its base URL; a trailing `/` is
    /// ignored). An `http://` agent, the node-local default, is reached without
    /// loading TLS roots. Connections time out after 2 s and requests after
    /// 20 s, and redirects are not followed.
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
            // INVARIANT: shorter than the agent's idle timeout (10 s,
            // `http::Limits::api`), so a pooled connection is dropped here
            // before the agent closes it under a request being sent.
            .pool_idle_timeout(Duration::from_secs(5))
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
}

#[async_trait::async_trait]
impl TokenBroker for RemoteBroker {
    async fn request(
        &self,
        subject: &SecretString,
        request: &TokenRequest,
    ) -> Result<Grant, BrokerError> {
        let resp = self
            .http
            .post(&self.token_url)
            .bearer_auth(subject.expose_secret())
            .json(request)
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
            return serde_json::from_slice::<WireGrant>(&body)
                .map(Grant::from)
                .map_err(|e| {
                    BrokerError::Unavailable(format!(
                        "node agent answered an unreadable grant: {e}"
                    ))
                });
        }
        match serde_json::from_slice::<ErrorBody>(&body) {
            Ok(err) => Err(err.error.into()),
            Err(_) => Err(BrokerError::Unavailable(format!(
                "node agent answered HTTP {status}"
            ))),
        }
    }
}
