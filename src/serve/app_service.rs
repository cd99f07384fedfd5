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

use super::azure_imds::{issue, token_request};
use super::{is_forwarded, seconds_until, with_retry_after, Query, Surfaces};
use crate::broker::{BrokerError, ErrorClass};
use crate::cloud::{AccessToken, Surface};
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

/// Renders an error class as App Service does.
pub(crate) fn render_error(err: &BrokerError) -> Response {
    let resp = match err.class() {
        ErrorClass::NotFound => error(
            StatusCode::BAD_REQUEST,
            "Unable to load the proper Managed Identity. Identity not found.",
        ),
        ErrorClass::BadRequest => error(StatusCode::BAD_REQUEST, err.describe()),
        ErrorClass::Forbidden => error(StatusCode::FORBIDDEN, err.describe()),
        ErrorClass::Throttled => error(StatusCode::TOO_MANY_REQUESTS, err.describe()),
        ErrorClass::Unavailable => error(StatusCode::SERVICE_UNAVAILABLE, err.describe()),
    };
    with_retry_after(resp, err)
}

/// The token as App Service renders it: IMDS's fields but `ext_expires_in`.
fn grant_body(token: &AccessToken, client_id: &str, resource: &str) -> serde_json::Value {
    json!({
        "access_token": token.token.expose_secret(),
        "client_id": client_id,
        "expires_in": seconds_until(token.expires_at).to_string(),
        "expires_on": token.expires_at.to_string(),
        "not_before": token.issued_at.to_string(),
        "resource": resource,
        "token_type": "Bearer",
    })
}

/// `GET /msi/token`: the App Service managed-identity protocol. The caller
/// must present the shared `X-IDENTITY-HEADER` (compared in constant time)
/// and give `api-version` and `resource`; the token is rendered as App
/// Service does.
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
    if query.get("resource").is_none() {
        return error(
            StatusCode::BAD_REQUEST,
            "The resource parameter is required",
        );
    }
    match token_request(&query, Surface::AppService) {
        Ok(request) => issue(&surfaces, request, grant_body, render_error).await,
        Err(msg) => error(StatusCode::BAD_REQUEST, msg),
    }
}
