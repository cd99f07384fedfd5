//! App Service managed-identity endpoint (`IDENTITY_ENDPOINT` +
//! `IDENTITY_HEADER`), which both the Python and the Rust azure-identity
//! honour from the environment:
//! `GET {IDENTITY_ENDPOINT}?api-version=2019-08-01&resource=` with
//! `X-IDENTITY-HEADER`. Errors use App Service's
//! `{statusCode, message, correlationId}` shape.

use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::azure_imds::selector;
use super::{is_forwarded, seconds_until, Query, Surfaces};
use crate::broker::{AzureTokenRequest, BrokerError};
use crate::cloud::{Cloud, CloudError};
use crate::secret::{constant_time_eq, ExposeSecret};

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({
            "statusCode": status.as_u16(),
            "message": message.into(),
            "correlationId": uuid::Uuid::new_v4().to_string(),
        })),
    )
        .into_response()
}

fn broker_error(err: &BrokerError) -> Response {
    match err {
        BrokerError::IdentityNotFound | BrokerError::NotBound { .. } => error(
            StatusCode::BAD_REQUEST,
            "Unable to load the proper Managed Identity. Identity not found.",
        ),
        BrokerError::BadRequest(msg) => error(StatusCode::BAD_REQUEST, msg.clone()),
        BrokerError::Unauthenticated(e) if !e.is_transient() => error(
            StatusCode::FORBIDDEN,
            format!("The pod's service account token was refused: {e}"),
        ),
        BrokerError::Upstream(CloudError::Rejected { code, message, .. }) => error(
            StatusCode::FORBIDDEN,
            format!("Entra ID refused the token exchange: {code}: {message}"),
        ),
        BrokerError::Upstream(CloudError::Throttled { retry_after, .. }) => {
            let mut resp = error(
                StatusCode::TOO_MANY_REQUESTS,
                "Entra ID is throttling token requests; retry later",
            );
            if let Some(after) = retry_after {
                if let Ok(v) = after.as_secs().to_string().parse() {
                    resp.headers_mut().insert("retry-after", v);
                }
            }
            resp
        }
        other => error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("Token service temporarily unavailable: {other}"),
        ),
    }
}

pub async fn token(
    State(surfaces): State<Arc<Surfaces>>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> Response {
    if is_forwarded(&headers) {
        return error(
            StatusCode::BAD_REQUEST,
            "Requests with an X-Forwarded-For or Forwarded header are not allowed",
        );
    }
    let presented = headers
        .get("x-identity-header")
        .map(|v| v.as_bytes())
        .unwrap_or_default();
    if !constant_time_eq(
        presented,
        surfaces.identity_header.expose_secret().as_bytes(),
    ) {
        return error(
            StatusCode::UNAUTHORIZED,
            "The X-IDENTITY-HEADER header is missing or does not match IDENTITY_HEADER",
        );
    }
    let query = Query::parse(raw.as_deref());
    if let Some(dup) = query.duplicated() {
        return error(
            StatusCode::BAD_REQUEST,
            format!("Query parameter '{dup}' is specified more than once"),
        );
    }
    if query.get("api-version").is_none() {
        return error(
            StatusCode::BAD_REQUEST,
            "The api-version parameter is required",
        );
    }
    let Some(resource) = query.get("resource") else {
        return error(
            StatusCode::BAD_REQUEST,
            "The resource parameter is required",
        );
    };
    let selector = match selector(&query) {
        Ok(s) => s,
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
    };
    let subject = match surfaces.subjects.token(Cloud::Azure).await {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!(error = %e, "no projected token for Azure");
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "The pod's projected service account token is not available yet",
            );
        }
    };
    let request = AzureTokenRequest {
        resource: resource.to_string(),
        selector,
    };
    match surfaces.broker.azure_token(&subject, &request).await {
        Ok(grant) => (
            StatusCode::OK,
            Json(json!({
                "access_token": grant.token.token.expose_secret(),
                "client_id": grant.client_id,
                "expires_in": seconds_until(grant.token.expires_at).to_string(),
                "expires_on": grant.token.expires_at.to_string(),
                "not_before": grant.token.issued_at.to_string(),
                "resource": grant.resource,
                "token_type": "Bearer",
            })),
        )
            .into_response(),
        Err(err) => broker_error(&err),
    }
}
