//! EC2 instance metadata, IMDSv2 only, the part the AWS SDKs use for
//! credentials: `PUT /latest/api/token` for a session token bound to its
//! TTL, then `GET /latest/meta-data/iam/security-credentials/[ROLE]` with
//! it. Requests without a session token get 401, as on instances that
//! require IMDSv2.
//!
//! Session tokens are stateless: the expiry and an HMAC of it under a key
//! that lives only in this process, so nothing is stored per token and a
//! token cannot be stretched past its TTL.

use aws_lc_rs::hmac;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use serde_json::json;

use super::aws_container::{aws_credentials, rfc3339_seconds};
use super::paths;
use super::{is_forwarded, json_ok, subject, to_json, with_retry_after, Surfaces};
use lanyard_core::cloud::{
    now_unix, BodyKey, Cloud, CloudError, Kind, Selector, Surface, TokenRequest,
};
use lanyard_core::grant::{BrokerError, ErrorClass, Grant};
use lanyard_core::secret::ExposeSecret;

const TTL_HEADER: &str = "x-aws-ec2-metadata-token-ttl-seconds";
const TOKEN_HEADER: &str = "x-aws-ec2-metadata-token";
const MAX_TTL: u64 = 21_600;

/// Issues and checks IMDSv2 session tokens.
pub struct SessionTokens {
    key: hmac::Key,
}

impl Default for SessionTokens {
    fn default() -> Self {
        Self::new()
    }
}

impl SessionTokens {
    /// Tokens signed with a fresh random key: tokens of another process (or a
    /// restarted one) are not valid here.
    pub fn new() -> Self {
        let secret = lanyard_core::secret::random_token(32);
        SessionTokens {
            key: hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes()),
        }
    }

    /// A session token valid for `ttl` seconds from now: the expiry and its
    /// HMAC-SHA256, base64url.
    pub fn issue(&self, ttl: u64) -> String {
        let expires = (now_unix() + ttl).to_be_bytes();
        let tag = hmac::sign(&self.key, &expires);
        let mut raw = expires.to_vec();
        raw.extend_from_slice(tag.as_ref());
        URL_SAFE_NO_PAD.encode(raw)
    }

    /// Whether `token` was issued by this instance and has not expired.
    pub fn is_valid(&self, token: &[u8]) -> bool {
        let Ok(raw) = URL_SAFE_NO_PAD.decode(token) else {
            return false;
        };
        if raw.len() != 8 + 32 {
            return false;
        }
        let (expires, tag) = raw.split_at(8);
        if hmac::verify(&self.key, expires, tag).is_err() {
            return false;
        }
        let mut buf = [0u8; 8];
        buf.copy_from_slice(expires);
        u64::from_be_bytes(buf) > now_unix()
    }
}

fn plain(status: StatusCode, body: impl Into<String>) -> Response {
    (status, [("content-type", "text/plain")], body.into()).into_response()
}

fn unauthorized() -> Response {
    plain(StatusCode::UNAUTHORIZED, "")
}

/// `PUT /latest/api/token`: a session token for the TTL the
/// `X-aws-ec2-metadata-token-ttl-seconds` header asks (1–21600 seconds;
/// 400 otherwise).
pub async fn put_token(surfaces: &Surfaces, request: &Parts) -> Response {
    let headers = &request.headers;
    if is_forwarded(headers) {
        return plain(StatusCode::FORBIDDEN, "Forbidden");
    }
    let ttl = headers
        .get(TTL_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let Some(ttl) = ttl.filter(|t| (1..=MAX_TTL).contains(t)) else {
        return plain(StatusCode::BAD_REQUEST, "Bad Request");
    };
    let token = surfaces.imds_sessions.issue(ttl);
    let mut resp = plain(StatusCode::OK, token);
    if let Ok(v) = HeaderValue::from_str(&ttl.to_string()) {
        resp.headers_mut().insert(TTL_HEADER, v);
    }
    resp
}

/// Common checks for metadata GETs: no forwarding, a valid session token.
fn check(surfaces: &Surfaces, headers: &HeaderMap) -> Option<Response> {
    if is_forwarded(headers) {
        return Some(plain(StatusCode::FORBIDDEN, "Forbidden"));
    }
    match headers.get(TOKEN_HEADER) {
        Some(t) if surfaces.imds_sessions.is_valid(t.as_bytes()) => None,
        _ => Some(unauthorized()),
    }
}

/// The role's credentials document, borrowed from the cached credential
/// and serialized without a JSON tree.
#[derive(serde::Serialize)]
#[serde(rename_all = "PascalCase")]
struct CredentialsBody<'a> {
    code: &'static str,
    last_updated: String,
    r#type: &'static str,
    access_key_id: &'a str,
    secret_access_key: &'a str,
    token: &'a str,
    expiration: String,
}

/// Renders an error class as instance metadata does: plain bodies, and a
/// failed role assumption in the credentials document itself.
pub(crate) fn render_error(err: &BrokerError) -> Response {
    match err.class() {
        ErrorClass::NotFound => plain(StatusCode::NOT_FOUND, "Not Found"),
        ErrorClass::BadRequest => plain(StatusCode::BAD_REQUEST, err.describe()),
        ErrorClass::Forbidden => match err {
            BrokerError::Upstream(CloudError::Rejected { code, message, .. }) => (
                StatusCode::OK,
                Json(json!({
                    "Code": code,
                    "Message": message,
                    "LastUpdated": rfc3339_seconds(now_unix()),
                })),
            )
                .into_response(),
            other => plain(StatusCode::FORBIDDEN, other.describe()),
        },
        ErrorClass::Throttled => with_retry_after(
            plain(StatusCode::TOO_MANY_REQUESTS, "Too Many Requests"),
            err,
        ),
        ErrorClass::Unavailable => plain(StatusCode::SERVICE_UNAVAILABLE, "Service Unavailable"),
    }
}

/// Asks the broker for `kind` naming `role` (when given).
async fn ask(surfaces: &Surfaces, kind: Kind, role: Option<String>) -> Result<Grant, BrokerError> {
    let subject = subject(surfaces, Cloud::Aws).await?;
    let request = TokenRequest::new(Cloud::Aws, kind, Surface::AwsImds)
        .with_selector(role.map(Selector::RoleName));
    surfaces.broker.request(&subject, &request).await
}

/// `GET /latest/meta-data/iam/security-credentials/`: one role's name, as
/// IMDS lists an instance profile's one role: the one a request selecting
/// none gets (of several the ServiceAccount lists, the first the policy
/// allows the caller). One line, never several: botocore takes the whole
/// body as the role's name.
pub async fn list_roles(surfaces: &Surfaces, request: &Parts) -> Response {
    if let Some(refused) = check(surfaces, &request.headers) {
        return refused;
    }
    match ask(surfaces, Kind::Identity, None).await {
        Ok(grant) => plain(StatusCode::OK, grant.identity.short_name().to_string()),
        Err(e) => render_error(&e),
    }
}

/// `GET /latest/meta-data/iam/security-credentials/ROLE`: session
/// credentials for `ROLE`, which must be the caller's bound role (404
/// otherwise), in IMDS's JSON shape.
pub async fn role_credentials(surfaces: &Surfaces, role: String, request: &Parts) -> Response {
    if let Some(refused) = check(surfaces, &request.headers) {
        return refused;
    }
    let result = async {
        let grant = ask(surfaces, Kind::AwsCredentials, Some(role)).await?;
        let c = aws_credentials(&grant)?;
        // Rendered once per credential: nothing in it changes.
        let key = BodyKey::fixed(Surface::AwsImds, 0);
        let body = c.rendered.get_or_render(key, || {
            to_json(&CredentialsBody {
                code: "Success",
                last_updated: rfc3339_seconds(c.issued_at),
                r#type: "AWS-HMAC",
                access_key_id: &c.access_key_id,
                secret_access_key: c.secret_access_key.expose_secret(),
                token: c.session_token.expose_secret(),
                expiration: rfc3339_seconds(c.expires_at),
            })
        })?;
        Ok::<_, BrokerError>(json_ok(body))
    }
    .await;
    result.unwrap_or_else(|e| render_error(&e))
}

/// `placement/region`, which the SDKs read for a default region.
pub async fn region(surfaces: &Surfaces, request: &Parts) -> Response {
    if let Some(refused) = check(surfaces, &request.headers) {
        return refused;
    }
    match &surfaces.defaults.aws_region {
        Some(r) => plain(StatusCode::OK, r.clone()),
        None => plain(StatusCode::NOT_FOUND, "Not Found"),
    }
}

/// Where IMDSv2 lists the instance's role; a role's credentials are below.
pub(crate) const ROLES_PATH: &str = "/latest/meta-data/iam/security-credentials/";
/// What this surface serves, for the answer to a path of no surface.
pub(crate) const SERVES: &str = "/latest/ (AWS IMDSv2)";

/// This surface's paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    /// `PUT /latest/api/token`.
    Session,
    /// The role listing.
    Roles,
    /// One role's credentials.
    Role,
    /// `meta-data/placement/region`.
    Region,
    /// Anything else under `/latest/`.
    Other,
}

/// The endpoint `path` is, if it is this surface's.
pub(crate) fn classify(path: &str) -> Option<Endpoint> {
    let below = path.strip_prefix("/latest/")?;
    Some(if below == "api/token" {
        Endpoint::Session
    } else if below == "meta-data/placement/region" {
        Endpoint::Region
    } else if paths::trimmed(path) == paths::trimmed(ROLES_PATH) {
        Endpoint::Roles
    } else if path
        .strip_prefix(ROLES_PATH)
        .is_some_and(|role| !role.contains('/'))
    {
        Endpoint::Role
    } else {
        Endpoint::Other
    })
}

/// The methods `endpoint` answers.
pub(crate) fn allowed(endpoint: Endpoint) -> Option<&'static str> {
    match endpoint {
        Endpoint::Session => Some("PUT"),
        Endpoint::Roles | Endpoint::Role | Endpoint::Region => Some(paths::READ),
        Endpoint::Other => None,
    }
}

/// The answer to a request for `endpoint`. EC2's metadata service answers
/// unknown paths with a bare 404 and a wrong method with a bare 405.
pub(crate) async fn answer(surfaces: &Surfaces, endpoint: Endpoint, request: &Parts) -> Response {
    let read = super::is_read(request);
    match endpoint {
        Endpoint::Session if request.method == axum::http::Method::PUT => {
            put_token(surfaces, request).await
        }
        Endpoint::Roles if read => list_roles(surfaces, request).await,
        Endpoint::Role if read => match role(request.uri.path()) {
            Some(role) => role_credentials(surfaces, role, request).await,
            None => paths::bare_not_found(),
        },
        Endpoint::Region if read => region(surfaces, request).await,
        Endpoint::Other => paths::bare_not_found(),
        wrong => paths::bare_method_not_allowed(allowed(wrong).unwrap_or(paths::READ)),
    }
}

/// The role named in a role-credentials path, percent-decoded; `None` when
/// it is not UTF-8 (no role is named so).
fn role(path: &str) -> Option<String> {
    let raw = path.strip_prefix(ROLES_PATH)?;
    percent_encoding::percent_decode_str(raw)
        .decode_utf8()
        .ok()
        .map(|role| role.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_tokens_are_bound_to_key_and_ttl() {
        let tokens = SessionTokens::new();
        let t = tokens.issue(60);
        assert!(tokens.is_valid(t.as_bytes()));
        assert!(
            !SessionTokens::new().is_valid(t.as_bytes()),
            "another process's key"
        );
        let mut tampered = URL_SAFE_NO_PAD.decode(&t).unwrap();
        tampered[7] ^= 0xff; // extend the expiry
        assert!(!tokens.is_valid(URL_SAFE_NO_PAD.encode(tampered).as_bytes()));
        assert!(!tokens.is_valid(b"garbage"));
        assert!(!tokens.is_valid(b""));
    }
}
