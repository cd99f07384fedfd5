//! Azure Instance Metadata Service token endpoint:
//! `GET /metadata/identity/oauth2/token?api-version=&resource=[&client_id|object_id|msi_res_id]`
//! with `Metadata: true`. Success bodies carry every field as a string, as
//! IMDS does; errors are `{error, error_description}`.

use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::{is_forwarded, seconds_until, Query, Surfaces};
use crate::broker::{AzureGrant, AzureSelector, AzureTokenRequest, BrokerError};
use crate::cloud::Cloud;
use crate::secret::ExposeSecret;

fn error(status: StatusCode, error: &str, description: impl Into<String>) -> Response {
    (
        status,
        Json(json!({ "error": error, "error_description": description.into() })),
    )
        .into_response()
}

fn bad_request(description: impl Into<String>) -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_request", description)
}

/// Reads the identity selector; at most one may be given. Names accepted
/// are those of IMDS (`client_id`, `object_id`, `msi_res_id`) and App
/// Service (`principal_id`, `mi_res_id`), since SDKs mix them.
pub(crate) fn selector(query: &Query) -> Result<Option<AzureSelector>, String> {
    let candidates = [
        (
            "client_id",
            query
                .get("client_id")
                .map(|v| AzureSelector::ClientId(v.into())),
        ),
        (
            "object_id",
            query
                .get("object_id")
                .map(|v| AzureSelector::ObjectId(v.into())),
        ),
        (
            "principal_id",
            query
                .get("principal_id")
                .map(|v| AzureSelector::ObjectId(v.into())),
        ),
        (
            "msi_res_id",
            query
                .get("msi_res_id")
                .map(|v| AzureSelector::ResourceId(v.into())),
        ),
        (
            "mi_res_id",
            query
                .get("mi_res_id")
                .map(|v| AzureSelector::ResourceId(v.into())),
        ),
    ];
    let mut given = candidates
        .into_iter()
        .filter_map(|(n, s)| s.map(|s| (n, s)));
    let first = given.next();
    if let Some((second, _)) = given.next() {
        return Err(format!(
            "Only one of client_id, object_id or msi_res_id may be specified (also got {second})"
        ));
    }
    Ok(first.map(|(_, s)| s))
}

/// Renders a grant as IMDS does: all values strings.
pub(crate) fn grant_body(grant: &AzureGrant) -> serde_json::Value {
    let expires_in = seconds_until(grant.token.expires_at).to_string();
    json!({
        "access_token": grant.token.token.expose_secret(),
        "client_id": grant.client_id,
        "expires_in": expires_in,
        "expires_on": grant.token.expires_at.to_string(),
        "ext_expires_in": expires_in,
        "not_before": grant.token.issued_at.to_string(),
        "resource": grant.resource,
        "token_type": "Bearer",
    })
}

/// Maps a broker error to IMDS's status and error body.
fn broker_error(err: &BrokerError) -> Response {
    match err {
        BrokerError::IdentityNotFound | BrokerError::NotBound { .. } => {
            bad_request("Identity not found")
        }
        BrokerError::BadRequest(msg) => bad_request(msg.clone()),
        BrokerError::Unauthenticated(e) if !e.is_transient() => error(
            StatusCode::FORBIDDEN,
            "unauthorized_client",
            format!("The pod's service account token was refused: {e}"),
        ),
        BrokerError::Upstream(crate::cloud::CloudError::Rejected { code, message, .. }) => error(
            StatusCode::FORBIDDEN,
            "unauthorized_client",
            format!("Entra ID refused the token exchange: {code}: {message}"),
        ),
        BrokerError::Upstream(crate::cloud::CloudError::Throttled { retry_after, .. }) => {
            let mut resp = error(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_requests",
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
            "temporarily_unavailable",
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
        return bad_request("Requests with an X-Forwarded-For or Forwarded header are not allowed");
    }
    let metadata = headers
        .get("metadata")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("true"));
    if !metadata {
        return bad_request("Required metadata header not specified");
    }
    let query = Query::parse(raw.as_deref());
    if let Some(dup) = query.duplicated() {
        return bad_request(format!(
            "Query parameter '{dup}' is specified more than once"
        ));
    }
    if query.get("api-version").is_none() {
        return bad_request("Required query variable 'api-version' is missing");
    }
    let Some(resource) = query.get("resource") else {
        return bad_request("Required audience parameter not specified");
    };
    let selector = match selector(&query) {
        Ok(s) => s,
        Err(msg) => return bad_request(msg),
    };
    let subject = match surfaces.subjects.token(Cloud::Azure).await {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!(error = %e, "no projected token for Azure");
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "temporarily_unavailable",
                "The pod's projected service account token is not available yet",
            );
        }
    };
    let request = AzureTokenRequest {
        resource: resource.to_string(),
        selector,
    };
    match surfaces.broker.azure_token(&subject, &request).await {
        Ok(grant) => (StatusCode::OK, Json(grant_body(&grant))).into_response(),
        Err(err) => broker_error(&err),
    }
}
