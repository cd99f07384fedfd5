//! GCE metadata server, the part Google's SDKs and gcloud use:
//! `/computeMetadata/v1/...` with `Metadata-Flavor: Google` required and
//! echoed, text or JSON bodies as the real server sends them, directory
//! listings with `?recursive=true`, trailing-slash redirects, service
//! account email/scopes/token/identity, and project ids.

use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::{is_forwarded, seconds_until, Query, Surfaces};
use crate::broker::{BrokerError, GcpIdTokenRequest, GcpIdentity, GcpTokenRequest};
use crate::cloud::{Cloud, CloudError};
use crate::secret::ExposeSecret;

const FLAVOR: &str = "metadata-flavor";
/// Scopes the metadata server reports for a workload identity, as GKE does.
const DEFAULT_SCOPES: [&str; 2] = [
    "https://www.googleapis.com/auth/cloud-platform",
    "https://www.googleapis.com/auth/userinfo.email",
];
const UNIVERSE_DOMAIN: &str = "googleapis.com";

fn with_flavor(mut resp: Response) -> Response {
    resp.headers_mut()
        .insert(FLAVOR, HeaderValue::from_static("Google"));
    resp
}

fn text(status: StatusCode, body: impl Into<String>) -> Response {
    with_flavor((status, [("content-type", "application/text")], body.into()).into_response())
}

fn json_body(value: Value) -> Response {
    with_flavor(
        (
            StatusCode::OK,
            [("content-type", "application/json")],
            value.to_string(),
        )
            .into_response(),
    )
}

fn not_found() -> Response {
    with_flavor(
        (
            StatusCode::NOT_FOUND,
            [("content-type", "text/html; charset=UTF-8")],
            "<!DOCTYPE html>\n<html lang=en>\n  <title>Error 404 (Not Found)!!1</title>\n  <p><b>404.</b> <ins>That’s an error.</ins>\n  <p>The requested URL was not found on this server.  <ins>That’s all we know.</ins>\n",
        )
            .into_response(),
    )
}

fn redirect(uri: &Uri) -> Response {
    let mut location = format!("{}/", uri.path());
    if let Some(q) = uri.query() {
        location.push('?');
        location.push_str(q);
    }
    let mut resp = text(StatusCode::MOVED_PERMANENTLY, "");
    if let Ok(v) = HeaderValue::from_str(&location) {
        resp.headers_mut().insert("location", v);
    }
    resp
}

fn broker_error(err: &BrokerError) -> Response {
    match err {
        BrokerError::IdentityNotFound | BrokerError::NotBound { .. } => not_found(),
        BrokerError::BadRequest(msg) => text(StatusCode::BAD_REQUEST, msg.clone()),
        BrokerError::CloudDisabled(_) => text(
            StatusCode::NOT_FOUND,
            "Google workload identity is not configured on this node",
        ),
        BrokerError::Unauthenticated(e) if !e.is_transient() => text(
            StatusCode::FORBIDDEN,
            format!("The pod's service account token was refused: {e}"),
        ),
        BrokerError::Upstream(CloudError::Rejected { code, message, .. }) => text(
            StatusCode::FORBIDDEN,
            format!("Google refused the token exchange: {code}: {message}"),
        ),
        BrokerError::Upstream(CloudError::Throttled { retry_after, .. }) => {
            let mut resp = text(
                StatusCode::TOO_MANY_REQUESTS,
                "Google is throttling token requests; retry later",
            );
            if let Some(after) = retry_after {
                if let Ok(v) = HeaderValue::from_str(&after.as_secs().to_string()) {
                    resp.headers_mut().insert("retry-after", v);
                }
            }
            resp
        }
        other => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("Token service temporarily unavailable: {other}"),
        ),
    }
}

fn account_info(identity: &GcpIdentity) -> Value {
    json!({
        "aliases": ["default"],
        "email": identity.email,
        "scopes": DEFAULT_SCOPES,
    })
}

/// Newline-terminated listing, as the metadata server prints directories.
fn listing(entries: &[&str]) -> Response {
    let mut body = String::new();
    for e in entries {
        body.push_str(e);
        body.push('\n');
    }
    text(StatusCode::OK, body)
}

/// Entry point for `/`, `/computeMetadata` and everything below it.
pub async fn handle(
    State(surfaces): State<Arc<Surfaces>>,
    uri: Uri,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> Response {
    if is_forwarded(&headers) {
        return text(
            StatusCode::FORBIDDEN,
            "Requests with an X-Forwarded-For or Forwarded header are not allowed",
        );
    }
    let flavored = headers
        .get(FLAVOR)
        .is_some_and(|v| v.as_bytes() == b"Google");
    if !flavored {
        return text(
            StatusCode::FORBIDDEN,
            "Missing required header \"Metadata-Flavor\": \"Google\"",
        );
    }
    let query = Query::parse(raw.as_deref());
    if let Some(dup) = query.duplicated() {
        return text(
            StatusCode::BAD_REQUEST,
            format!("Query parameter '{dup}' is specified more than once"),
        );
    }
    let recursive = query
        .get("recursive")
        .is_some_and(|v| v.eq_ignore_ascii_case("true"));
    let path = uri.path();

    // Root and version directories.
    match path {
        "/" => return listing(&["computeMetadata/"]),
        "/computeMetadata" | "/computeMetadata/v1" => return redirect(&uri),
        "/computeMetadata/" => return listing(&["v1/"]),
        _ => {}
    }
    let Some(rest) = path.strip_prefix("/computeMetadata/v1/") else {
        return not_found();
    };
    let segments: Vec<&str> = rest.split('/').collect();
    let is_dir = rest.is_empty() || rest.ends_with('/');
    let segments: Vec<&str> = if is_dir {
        segments[..segments.len().saturating_sub(1)].to_vec()
    } else {
        segments
    };

    match (segments.as_slice(), is_dir) {
        ([], true) => {
            if recursive {
                return match identity_for_account(&surfaces, "default").await {
                    Ok((_, id)) => json_body(json!({
                        "instance": { "serviceAccounts": accounts_json(&id) },
                        "project": { "numericProjectId": number(&id.project_number), "projectId": id.project_id },
                        "universe": { "universeDomain": UNIVERSE_DOMAIN },
                    })),
                    Err(e) => broker_error(&e),
                };
            }
            listing(&["instance/", "project/", "universe/"])
        }
        (["universe"], true) => {
            if recursive {
                json_body(json!({ "universeDomain": UNIVERSE_DOMAIN }))
            } else {
                listing(&["universe-domain"])
            }
        }
        (["universe", "universe-domain"], false) => text(StatusCode::OK, UNIVERSE_DOMAIN),
        (["project"], true) => match identity_for_account(&surfaces, "default").await {
            Ok((_, id)) if recursive => json_body(json!({
                "numericProjectId": number(&id.project_number),
                "projectId": id.project_id,
            })),
            Ok(_) => listing(&["numeric-project-id", "project-id"]),
            Err(e) => broker_error(&e),
        },
        (["project", "project-id"], false) => {
            match identity_for_account(&surfaces, "default").await {
                Ok((_, id)) => text(StatusCode::OK, id.project_id),
                Err(e) => broker_error(&e),
            }
        }
        (["project", "numeric-project-id"], false) => {
            match identity_for_account(&surfaces, "default").await {
                Ok((_, id)) => text(StatusCode::OK, id.project_number),
                Err(e) => broker_error(&e),
            }
        }
        (["instance"], true) => match identity_for_account(&surfaces, "default").await {
            Ok((_, id)) if recursive => json_body(json!({ "serviceAccounts": accounts_json(&id) })),
            Ok(_) => listing(&["service-accounts/"]),
            Err(e) => broker_error(&e),
        },
        (["instance", "service-accounts"], true) => {
            match identity_for_account(&surfaces, "default").await {
                Ok((_, id)) if recursive => json_body(accounts_json(&id)),
                Ok((_, id)) => {
                    let email_dir = format!("{}/", id.email);
                    listing(&["default/", &email_dir])
                }
                Err(e) => broker_error(&e),
            }
        }
        (["instance", "service-accounts", account, rest @ ..], _) => {
            service_account(surfaces, account, rest, is_dir, recursive, &query, &uri).await
        }
        // Known directories asked for without their trailing slash.
        (
            [] | ["project"] | ["instance"] | ["universe"] | ["instance", "service-accounts"],
            false,
        ) => redirect(&uri),
        _ => not_found(),
    }
}

/// Resolves the caller's identity and checks `account` names it.
async fn identity_for_account(
    surfaces: &Surfaces,
    account: &str,
) -> Result<(crate::secret::SecretString, GcpIdentity), BrokerError> {
    let subject = surfaces
        .subjects
        .token(Cloud::Gcp)
        .await
        .map_err(BrokerError::Unavailable)?;
    let identity = surfaces.broker.gcp_identity(&subject).await?;
    if account != "default" && !account.eq_ignore_ascii_case(&identity.email) {
        return Err(BrokerError::IdentityNotFound);
    }
    Ok((subject, identity))
}

#[allow(clippy::too_many_arguments)]
async fn service_account(
    surfaces: Arc<Surfaces>,
    account: &str,
    rest: &[&str],
    is_dir: bool,
    recursive: bool,
    query: &Query,
    uri: &Uri,
) -> Response {
    let (subject, id) = match identity_for_account(&surfaces, account).await {
        Ok(v) => v,
        Err(e) => return broker_error(&e),
    };
    match (rest, is_dir) {
        ([], true) => {
            if recursive {
                json_body(account_info(&id))
            } else {
                listing(&["aliases", "email", "identity", "scopes", "token"])
            }
        }
        ([], false) => redirect(uri),
        (["aliases"], false) => listing(&["default"]),
        (["email"], false) => text(StatusCode::OK, id.email),
        (["scopes"], false) => listing(&DEFAULT_SCOPES),
        (["token"], false) => {
            let scopes: Vec<String> = query
                .get("scopes")
                .map(|s| {
                    s.split(',')
                        .map(str::trim)
                        .filter(|s| !s.is_empty())
                        .map(str::to_string)
                        .collect()
                })
                .unwrap_or_default();
            let request = GcpTokenRequest {
                account: account.to_string(),
                scopes,
            };
            match surfaces.broker.gcp_token(&subject, &request).await {
                Ok(grant) => json_body(json!({
                    "access_token": grant.token.token.expose_secret(),
                    "expires_in": seconds_until(grant.token.expires_at),
                    "token_type": "Bearer",
                })),
                Err(e) => broker_error(&e),
            }
        }
        (["identity"], false) => {
            let Some(audience) = query.get("audience") else {
                return text(
                    StatusCode::BAD_REQUEST,
                    "non-empty audience parameter required",
                );
            };
            let include_email = match query.get("format").unwrap_or("standard") {
                "standard" => false,
                "full" => true,
                other => {
                    return text(
                        StatusCode::BAD_REQUEST,
                        format!("invalid format {other:?}: expected standard or full"),
                    )
                }
            };
            let request = GcpIdTokenRequest {
                account: account.to_string(),
                audience: audience.to_string(),
                include_email,
            };
            match surfaces.broker.gcp_id_token(&subject, &request).await {
                Ok(token) => text(StatusCode::OK, token.token.expose_secret().to_string()),
                Err(e) => broker_error(&e),
            }
        }
        _ => not_found(),
    }
}

/// `{"default": {...}, "EMAIL": {...}}`, as `service-accounts/?recursive=true` answers.
fn accounts_json(id: &GcpIdentity) -> Value {
    let info = account_info(id);
    json!({ "default": info.clone(), id.email.clone(): info })
}

/// The numeric project id as a JSON number when it is one.
fn number(n: &str) -> Value {
    n.parse::<u64>()
        .map(Value::from)
        .unwrap_or_else(|_| Value::from(n))
}
