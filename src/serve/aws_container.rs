//! AWS container credentials (the EKS Pod Identity / ECS style endpoint
//! botocore reaches through `AWS_CONTAINER_CREDENTIALS_FULL_URI`):
//! `GET /v1/credentials` with an `Authorization` value that must equal the
//! contents of the file named by `AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE`.
//! The file is re-read on every request, so a rotated token takes effect
//! at once.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::{is_forwarded, Surfaces};
use crate::broker::{AwsGrant, BrokerError};
use crate::cloud::{Cloud, CloudError};
use crate::secret::{constant_time_eq, ExposeSecret};

/// Errors as `{code, message}`, the shape of the EKS Pod Identity agent.
fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({ "code": code, "message": message.into() })),
    )
        .into_response()
}

/// RFC 3339 in UTC with a `Z`, as STS and the SDKs write expirations.
pub(crate) fn rfc3339(unix: u64) -> String {
    time::OffsetDateTime::from_unix_timestamp(unix as i64)
        .ok()
        .and_then(|t| {
            t.format(time::macros::format_description!(
                "[year]-[month]-[day]T[hour]:[minute]:[second]Z"
            ))
            .ok()
        })
        .unwrap_or_default()
}

pub(crate) fn broker_error(err: &BrokerError) -> Response {
    match err {
        BrokerError::IdentityNotFound | BrokerError::NotBound { .. } => error(
            StatusCode::NOT_FOUND,
            "NotFound",
            "No IAM role is bound to this pod's service account (annotation eks.amazonaws.com/role-arn)",
        ),
        BrokerError::CloudDisabled(_) => error(
            StatusCode::NOT_FOUND,
            "NotFound",
            "AWS is not configured on this node",
        ),
        BrokerError::BadRequest(msg) => error(StatusCode::BAD_REQUEST, "InvalidRequest", msg.clone()),
        BrokerError::Unauthenticated(e) if !e.is_transient() => error(
            StatusCode::FORBIDDEN,
            "AccessDenied",
            format!("The pod's service account token was refused: {e}"),
        ),
        BrokerError::Upstream(CloudError::Rejected { code, message, .. }) => error(
            StatusCode::FORBIDDEN,
            code,
            format!("STS refused AssumeRoleWithWebIdentity: {message}"),
        ),
        BrokerError::Upstream(CloudError::Throttled { .. }) => error(
            StatusCode::TOO_MANY_REQUESTS,
            "ThrottlingException",
            "STS is throttling; retry later",
        ),
        other => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            format!("Credential service temporarily unavailable: {other}"),
        ),
    }
}

fn body(grant: &AwsGrant) -> Response {
    let c = &grant.credentials;
    (
        StatusCode::OK,
        Json(json!({
            "AccessKeyId": c.access_key_id,
            "SecretAccessKey": c.secret_access_key.expose_secret(),
            "Token": c.session_token.expose_secret(),
            "AccountId": c.account_id,
            "Expiration": rfc3339(c.expires_at),
        })),
    )
        .into_response()
}

pub async fn credentials(State(surfaces): State<Arc<Surfaces>>, headers: HeaderMap) -> Response {
    if is_forwarded(&headers) {
        return error(
            StatusCode::BAD_REQUEST,
            "InvalidRequest",
            "Requests with an X-Forwarded-For or Forwarded header are not allowed",
        );
    }
    let Some(file) = surfaces.aws_container_token_file.as_ref() else {
        return error(
            StatusCode::NOT_FOUND,
            "NotFound",
            "The container credentials endpoint is not enabled",
        );
    };
    let expected = match tokio::fs::read_to_string(file).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(file = %file.display(), error = %e, "cannot read the container authorization token file");
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                "The authorization token file is not readable yet",
            );
        }
    };
    let expected = expected.trim();
    let presented = headers
        .get("authorization")
        .map(|v| v.as_bytes())
        .unwrap_or_default();
    if expected.is_empty() || !constant_time_eq(presented, expected.as_bytes()) {
        return error(
            StatusCode::UNAUTHORIZED,
            "AccessDenied",
            "The Authorization header is missing or does not match AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
        );
    }
    let subject = match surfaces.subjects.token(Cloud::Aws).await {
        Ok(t) => t,
        Err(e) => return broker_error(&BrokerError::Unavailable(e)),
    };
    match surfaces.broker.aws_credentials(&subject).await {
        Ok(grant) => body(&grant),
        Err(e) => broker_error(&e),
    }
}
