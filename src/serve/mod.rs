//! Protocol surfaces: the endpoints cloud SDKs already call, each parsing
//! its cloud's request into a broker request and rendering the answer (or
//! the error) in that cloud's exact wire format.

pub mod agent_api;
pub mod app_service;
pub mod aws_container;
pub mod aws_imds;
pub mod azure_imds;
pub mod gce;
mod query;

use std::path::PathBuf;
use std::sync::Arc;

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;

use crate::broker::{BrokerError, TokenBroker};
use crate::cloud::Cloud;
use crate::secret::SecretString;

pub use query::Query;

/// Path of the Azure IMDS token endpoint.
pub const IMDS_TOKEN_PATH: &str = "/metadata/identity/oauth2/token";
/// Path of the App Service managed-identity endpoint (`IDENTITY_ENDPOINT`).
pub const APP_SERVICE_PATH: &str = "/msi/token";
/// Path of the AWS container credentials endpoint.
pub const AWS_CONTAINER_PATH: &str = "/v1/credentials";

/// Where the pod's projected tokens come from: files the kubelet rotates
/// (sidecar), or the built-in issuer (dev).
#[async_trait::async_trait]
pub trait SubjectTokens: Send + Sync {
    /// The current projected token for `cloud`'s audience.
    async fn token(&self, cloud: Cloud) -> Result<SecretString, String>;
}

/// What every surface handler needs.
pub struct Surfaces {
    pub broker: Arc<dyn TokenBroker>,
    pub subjects: Arc<dyn SubjectTokens>,
    /// Shared secret App Service callers present in `X-IDENTITY-HEADER`.
    pub identity_header: SecretString,
    /// File whose contents AWS container-credential callers must present
    /// as `Authorization` (`AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE`);
    /// `None` disables the endpoint.
    pub aws_container_token_file: Option<PathBuf>,
    /// IMDSv2 session tokens.
    pub imds_sessions: aws_imds::SessionTokens,
    /// Region reported at `placement/region`.
    pub aws_region: Option<String>,
}

/// All SDK-facing routes on one listener.
pub fn router(surfaces: Arc<Surfaces>) -> Router {
    Router::new()
        .route(IMDS_TOKEN_PATH, axum::routing::get(azure_imds::token))
        .route(APP_SERVICE_PATH, axum::routing::get(app_service::token))
        .route("/", axum::routing::get(gce::handle))
        .route("/computeMetadata", axum::routing::get(gce::handle))
        .route("/computeMetadata/", axum::routing::get(gce::handle))
        .route("/computeMetadata/{*rest}", axum::routing::get(gce::handle))
        .route(
            AWS_CONTAINER_PATH,
            axum::routing::get(aws_container::credentials),
        )
        .route("/latest/api/token", axum::routing::put(aws_imds::put_token))
        .route(
            "/latest/meta-data/iam/security-credentials/",
            axum::routing::get(aws_imds::list_roles),
        )
        .route(
            "/latest/meta-data/iam/security-credentials/{role}",
            axum::routing::get(aws_imds::role_credentials),
        )
        .route(
            "/latest/meta-data/placement/region",
            axum::routing::get(aws_imds::region),
        )
        .fallback(not_found)
        .with_state(surfaces)
}

async fn not_found() -> impl IntoResponse {
    (StatusCode::NOT_FOUND, "Not Found")
}

/// Requests relayed by a proxy carry `X-Forwarded-For`; metadata services
/// refuse them so that an SSRF through a proxy in the pod cannot reach us.
pub(crate) fn is_forwarded(headers: &HeaderMap) -> bool {
    headers.contains_key("x-forwarded-for") || headers.contains_key("forwarded")
}

/// The pod's current projected token for `cloud`; its absence is a
/// retryable error (the kubelet has not written it yet).
pub(crate) async fn subject(
    surfaces: &Surfaces,
    cloud: Cloud,
) -> Result<SecretString, BrokerError> {
    surfaces.subjects.token(cloud).await.map_err(|e| {
        tracing::warn!(%cloud, error = %e, "no projected token");
        BrokerError::Unavailable(
            "the pod's projected service account token is not available yet".into(),
        )
    })
}

/// Adds `Retry-After` (seconds) when the error says how long to wait.
pub(crate) fn with_retry_after(mut resp: Response, err: &BrokerError) -> Response {
    if let Some(after) = err.retry_after() {
        if let Ok(v) = axum::http::HeaderValue::from_str(&after.as_secs().to_string()) {
            resp.headers_mut().insert("retry-after", v);
        }
    }
    resp
}

/// A grant whose credential is not of the kind asked for: a broker bug,
/// answered as retryable rather than a panic or a wrong body.
pub(crate) fn wrong_credential() -> BrokerError {
    BrokerError::Unavailable("the broker answered another kind of credential".into())
}

/// Seconds from now until `at` (Unix seconds), never negative.
pub(crate) fn seconds_until(at: u64) -> u64 {
    at.saturating_sub(crate::cloud::now_unix())
}
