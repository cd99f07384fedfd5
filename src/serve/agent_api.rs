//! The node agent's API: `POST /v1/token` with the pod's projected token
//! in `Authorization: Bearer` and an [`AgentRequest`] body; answers an
//! [`AgentResponse`] or an [`ErrorBody`]. `GET /healthz` for sidecars'
//! readiness checks.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use crate::broker::wire::{AgentError, AgentRequest, AgentResponse, ErrorBody, TOKEN_PATH};
use crate::broker::{
    AzureTokenRequest, BrokerError, GcpIdTokenRequest, GcpTokenRequest, TokenBroker,
};
use crate::secret::{ExposeSecret, SecretString};

/// Largest request body accepted: requests are a few hundred bytes.
const MAX_BODY: usize = 16 * 1024;

pub fn router(broker: Arc<dyn TokenBroker>) -> Router {
    Router::new()
        .route(TOKEN_PATH, post(token))
        .route("/healthz", get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(broker)
}

fn error(err: AgentError) -> Response {
    let status = StatusCode::from_u16(err.status()).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    (status, Json(ErrorBody { error: err })).into_response()
}

fn bad_request(message: impl Into<String>) -> Response {
    error(AgentError::from_broker(&BrokerError::BadRequest(
        message.into(),
    )))
}

async fn token(
    State(broker): State<Arc<dyn TokenBroker>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(subject) = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
    else {
        return error(AgentError {
            kind: "unauthenticated".into(),
            message: "Authorization: Bearer <projected service account token> is required".into(),
            cloud: None,
            code: Some("missing".into()),
            retry_after_secs: None,
            namespace: None,
            service_account: None,
        });
    };
    let subject = SecretString::from(subject.to_string());
    let request: AgentRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(format!("invalid request body: {e}")),
    };
    let result = match request {
        AgentRequest::AzureToken { resource, selector } => broker
            .azure_token(&subject, &AzureTokenRequest { resource, selector })
            .await
            .map(|g| AgentResponse::AzureToken {
                access_token: g.token.token.expose_secret().to_string(),
                issued_at: g.token.issued_at,
                expires_at: g.token.expires_at,
                client_id: g.client_id,
                resource: g.resource,
            }),
        AgentRequest::GcpIdentity => broker
            .gcp_identity(&subject)
            .await
            .map(AgentResponse::GcpIdentity),
        AgentRequest::GcpToken { account, scopes } => broker
            .gcp_token(&subject, &GcpTokenRequest { account, scopes })
            .await
            .map(|g| AgentResponse::GcpToken {
                access_token: g.token.token.expose_secret().to_string(),
                issued_at: g.token.issued_at,
                expires_at: g.token.expires_at,
                identity: g.identity,
            }),
        AgentRequest::GcpIdToken {
            account,
            audience,
            include_email,
        } => broker
            .gcp_id_token(
                &subject,
                &GcpIdTokenRequest {
                    account,
                    audience,
                    include_email,
                },
            )
            .await
            .map(|t| AgentResponse::GcpIdToken {
                token: t.token.expose_secret().to_string(),
                expires_at: t.expires_at,
            }),
        AgentRequest::AwsRole => broker
            .aws_role(&subject)
            .await
            .map(|role_arn| AgentResponse::AwsRole { role_arn }),
        AgentRequest::AwsCredentials => {
            broker
                .aws_credentials(&subject)
                .await
                .map(|g| AgentResponse::AwsCredentials {
                    access_key_id: g.credentials.access_key_id.clone(),
                    secret_access_key: g.credentials.secret_access_key.expose_secret().to_string(),
                    session_token: g.credentials.session_token.expose_secret().to_string(),
                    issued_at: g.credentials.issued_at,
                    expires_at: g.credentials.expires_at,
                    account_id: g.credentials.account_id.clone(),
                    assumed_role_arn: g.credentials.assumed_role_arn.clone(),
                    role_arn: g.role_arn,
                })
        }
    };
    match result {
        Ok(grant) => (StatusCode::OK, Json(grant)).into_response(),
        Err(e) => error(AgentError::from_broker(&e)),
    }
}
