//! AWS container credentials (the EKS Pod Identity / ECS style endpoint
//! botocore reaches through `AWS_CONTAINER_CREDENTIALS_FULL_URI`):
//! `GET /v1/credentials` with an `Authorization` value that must equal the
//! contents of the file named by `AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE`.
//! The file is re-read on every request, so a rotated token takes effect
//! at once (and the one it replaced is honoured for a short grace).

use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::paths;
use super::sdk_env::SdkEnv;
use super::{
    is_forwarded, json_ok, subject, to_json, with_retry_after, wrong_credential, Surfaces,
    FORWARDED_REFUSAL,
};
use lanyard_core::cloud::aws::AwsCredentials;
use lanyard_core::cloud::{BodyKey, Cloud, CloudError, Credential, Kind, Surface, TokenRequest};
use lanyard_core::grant::{BrokerError, ErrorClass, Grant};
use lanyard_core::secret::ExposeSecret;

/// Errors as `{code, message}`, the shape of the EKS Pod Identity agent.
pub(crate) fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({ "code": code, "message": message.into() })),
    )
        .into_response()
}

/// RFC 3339 in UTC with a `Z`, as STS and the SDKs write expirations.
pub(crate) fn rfc3339_seconds(unix: u64) -> String {
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

/// Renders an error class as the EKS Pod Identity agent does.
pub(crate) fn render_error(err: &BrokerError) -> Response {
    let resp = match err.class() {
        ErrorClass::NotFound => {
            let message = match err {
                BrokerError::NotBound { .. } | BrokerError::IdentityNotFound => {
                    "No IAM role is bound to this pod's service account (annotation eks.amazonaws.com/role-arn)".to_string()
                }
                other => other.describe(),
            };
            error(StatusCode::NOT_FOUND, "NotFound", message)
        }
        ErrorClass::BadRequest => error(StatusCode::BAD_REQUEST, "InvalidRequest", err.describe()),
        ErrorClass::Forbidden => match err {
            BrokerError::Upstream(CloudError::Rejected { code, message, .. }) => error(
                StatusCode::FORBIDDEN,
                code,
                // STS's message names the action it refused; a chained
                // hop's names the role it chained into.
                format!("STS refused the exchange: {message}"),
            ),
            other => error(StatusCode::FORBIDDEN, "AccessDenied", other.describe()),
        },
        ErrorClass::Throttled => error(
            StatusCode::TOO_MANY_REQUESTS,
            "ThrottlingException",
            err.describe(),
        ),
        ErrorClass::Unavailable => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            err.describe(),
        ),
    };
    with_retry_after(resp, err)
}

/// The AWS session credentials of a grant.
pub(crate) fn aws_credentials(grant: &Grant) -> Result<&AwsCredentials, BrokerError> {
    grant
        .credential
        .as_deref()
        .and_then(Credential::aws)
        .ok_or_else(wrong_credential)
}

/// The container credentials document, borrowed from the cached
/// credential and serialized without a JSON tree.
#[derive(serde::Serialize)]
#[serde(rename_all = "PascalCase")]
struct CredentialsBody<'a> {
    access_key_id: &'a str,
    secret_access_key: &'a str,
    token: &'a str,
    account_id: &'a str,
    expiration: String,
}

/// The document, rendered once per credential: nothing in it changes.
fn body(c: &AwsCredentials) -> Result<Response, BrokerError> {
    let key = BodyKey::fixed(Surface::AwsContainer, 0);
    let body = c.rendered.get_or_render(key, || {
        to_json(&CredentialsBody {
            access_key_id: &c.access_key_id,
            secret_access_key: c.secret_access_key.expose_secret(),
            token: c.session_token.expose_secret(),
            account_id: &c.account_id,
            expiration: rfc3339_seconds(c.expires_at),
        })
    })?;
    Ok(json_ok(body))
}

/// `GET /v1/credentials`: the ECS/EKS container credentials protocol. The
/// caller's `Authorization` must equal the token file's contents (compared
/// in constant time, the file re-read on every request, the token a
/// rotation replaced accepted briefly: see [`super::container_token`]);
/// 404 when no token file is configured.
pub async fn credentials(surfaces: &Surfaces, request: &Parts) -> Response {
    let headers = &request.headers;
    if is_forwarded(headers) {
        return error(StatusCode::BAD_REQUEST, "InvalidRequest", FORWARDED_REFUSAL);
    }
    let Some(token) = surfaces.app_token.as_ref() else {
        return error(
            StatusCode::NOT_FOUND,
            "NotFound",
            "The container credentials endpoint is not enabled",
        );
    };
    let presented = headers
        .get("authorization")
        .map(|v| v.as_bytes())
        .unwrap_or_default();
    match token.accepts(presented).await {
        Ok(true) => {}
        Ok(false) => {
            return error(
                StatusCode::UNAUTHORIZED,
                "AccessDenied",
                "The Authorization header is missing or does not match AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
            )
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the container authorization token file");
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                "The authorization token file is not readable yet",
            );
        }
    }
    let request = TokenRequest::new(Cloud::Aws, Kind::AwsCredentials, Surface::AwsContainer);
    let result = async {
        let subject = subject(surfaces, Cloud::Aws).await?;
        let grant = surfaces.broker.request(&subject, &request).await?;
        body(aws_credentials(&grant)?)
    }
    .await;
    result.unwrap_or_else(|e| render_error(&e))
}
/// Path of the AWS container credentials endpoint.
pub const PATH: &str = "/v1/credentials";
/// What this surface serves, for the answer to a path of no surface.
pub(crate) const SERVES: &str = "/v1/credentials (AWS container credentials)";

/// Whether `path` is this surface's.
pub(crate) fn classify(path: &str) -> bool {
    paths::trimmed(path) == PATH
}

/// The answer to a request for this surface's path.
pub(crate) async fn answer(surfaces: &Surfaces, request: &Parts) -> Response {
    if super::is_read(request) {
        credentials(surfaces, request).await
    } else {
        let message = paths::wrong_method(paths::READ);
        let refusal = error(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", message);
        paths::with_allow(refusal, paths::READ)
    }
}
/// The AWS SDKs' variables (`serve::sdk_env`).
pub(crate) fn sdk_vars(env: &SdkEnv, base: &str, vars: &mut Vec<(&'static str, String)>) {
    vars.push((
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        format!("{base}{PATH}"),
    ));
    vars.push((
        "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
        env.app_token_file.to_string(),
    ));
    // IMDS goes to the sidecar too, so an SDK that falls back to instance
    // metadata never reaches the node's own role.
    vars.push(("AWS_EC2_METADATA_SERVICE_ENDPOINT", format!("{base}/")));
    // The JS, Go and Java SDKs read AWS_REGION; botocore (boto3, the aws
    // CLI) reads only AWS_DEFAULT_REGION. Both, as the EKS pod identity
    // webhook sets them.
    if let Some(region) = &env.defaults.aws_region {
        vars.push(("AWS_REGION", region.clone()));
        vars.push(("AWS_DEFAULT_REGION", region.clone()));
    }
}

/// Variables that name the same setting for different SDKs: a container
/// that chose its value in one gets that choice in the other too (the
/// region: `AWS_REGION`, read by most SDKs, and `AWS_DEFAULT_REGION`,
/// botocore's), so its SDKs never disagree.
pub(crate) const LINKED: &[(&str, &str)] = &[
    ("AWS_REGION", "AWS_DEFAULT_REGION"),
    ("AWS_DEFAULT_REGION", "AWS_REGION"),
];

/// Variables that make this cloud's SDKs take another credential source
/// before they reach the sidecar: left alone (the user may mean them) and
/// reported by the webhook.
pub(crate) const CONFLICTS: &[(&str, &str)] = &[
    ("AWS_WEB_IDENTITY_TOKEN_FILE", "the AWS SDKs use web identity before container credentials"),
    ("AWS_ROLE_ARN", "the AWS SDKs assume this role by web identity (with AWS_WEB_IDENTITY_TOKEN_FILE) before container credentials"),
    ("AWS_ACCESS_KEY_ID", "the AWS SDKs use static keys before container credentials"),
];
