//! The node agent's API: `POST /v1/token` with the pod's projected token
//! in `Authorization: Bearer` and a [`TokenRequest`] body; answers a
//! [`WireGrant`] or an [`ErrorBody`]. `GET /healthz` for sidecars'
//! readiness checks.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use super::{json_ok, to_json};
use lanyard_agent_api::wire::{self, ErrorBody, WireError, WireGrant, TOKEN_PATH};
use lanyard_core::cloud::{BodyKey, TokenRequest};
use lanyard_core::grant::{BrokerError, Grant, TokenBroker};
use lanyard_core::secret::SecretString;
use lanyard_core::token::VerifyError;

/// Largest request body accepted: requests are a few hundred bytes.
const MAX_BODY: usize = 16 * 1024;

/// The agent API's routes, deciding through `broker`: `POST /v1/token`
/// (bodies over 16 KiB are refused) and `GET /healthz`.
pub fn router(broker: Arc<dyn TokenBroker>) -> Router {
    Router::new()
        .route(TOKEN_PATH, post(token))
        .route("/healthz", get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(broker)
}

fn error(err: &BrokerError) -> Response {
    let status = StatusCode::from_u16(wire::status(err)).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    (
        status,
        Json(ErrorBody {
            error: WireError::from(err),
        }),
    )
        .into_response()
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
        return error(&BrokerError::Unauthenticated(VerifyError::Missing));
    };
    let subject = SecretString::from(subject.to_string());
    let request: TokenRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return error(&BrokerError::BadRequest(format!(
                "invalid request body: {e}"
            )))
        }
    };
    match broker.request(&subject, &request).await {
        Ok(grant) => match grant_body(&grant) {
            Ok(body) => json_ok(body),
            Err(e) => error(&e),
        },
        Err(e) => error(&e),
    }
}

/// `grant` as the agent API sends it, rendered once per credential: it
/// carries absolute times only, so it never changes, and it is the same
/// whichever surface the sidecar was asked on.
fn grant_body(grant: &Grant) -> Result<Bytes, BrokerError> {
    let render = || to_json(&WireGrant::from(grant));
    match grant.credential.as_deref() {
        Some(credential) => {
            let echo = [grant.identity.id.as_str(), grant.identity.account.as_str()];
            credential
                .rendered()
                .get_or_render(BodyKey::wire(&echo), render)
        }
        None => render().map(Bytes::from),
    }
}
