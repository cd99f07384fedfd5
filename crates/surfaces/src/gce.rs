//! GCE metadata server, the part Google's SDKs and gcloud use:
//! `/computeMetadata/v1/...` with `Metadata-Flavor: Google` required and
//! echoed, text or JSON bodies as the real server sends them, directory
//! listings with `?recursive=true`, trailing-slash redirects, service
//! account email/scopes/token/identity, and project ids.

use axum::body::Body;
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::paths;
use super::sdk_env::SdkEnv;
use super::{
    is_forwarded, json_ok, subject, to_json, with_retry_after, wrong_credential, Query, Surfaces,
    FORWARDED_REFUSAL,
};
use lanyard_core::cloud::gcp::DEFAULT_UNIVERSE_DOMAIN;
use lanyard_core::cloud::{
    now_unix, AccessToken, BodyKey, Cloud, Credential, Form, Identity, Kind, Selector, Surface,
    TokenRequest,
};
use lanyard_core::grant::{BrokerError, ErrorClass, Grant};
use lanyard_core::secret::ExposeSecret;

const FLAVOR: &str = "metadata-flavor";
/// Scopes the metadata server reports for a workload identity, as GKE does.
const DEFAULT_SCOPES: [&str; 2] = [
    "https://www.googleapis.com/auth/cloud-platform",
    "https://www.googleapis.com/auth/userinfo.email",
];

fn with_flavor(mut resp: Response) -> Response {
    resp.headers_mut()
        .insert(FLAVOR, HeaderValue::from_static("Google"));
    resp
}

pub(crate) fn text(status: StatusCode, body: impl Into<Body>) -> Response {
    with_flavor((status, [("content-type", "application/text")], body.into()).into_response())
}

/// [`BodyKey`] variants of the bodies rendered from a token.
const TOKEN_BODY: u8 = 0;
const ID_TOKEN_BODY: u8 = 1;

fn json_body(value: impl serde::Serialize) -> Response {
    // Serializing plain data into memory cannot fail; should it ever, the
    // SDK gets a 500 rather than an empty document.
    let Ok(body) = serde_json::to_vec(&value) else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    with_flavor(json_ok(body.into()))
}

/// An access token as the metadata server renders it, borrowed from the
/// cached credential and serialized without a JSON tree.
#[derive(serde::Serialize)]
struct TokenBody<'a> {
    access_token: &'a str,
    expires_in: u64,
    token_type: &'static str,
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

/// Renders an error class as the metadata server does (text bodies).
pub(crate) fn render_error(err: &BrokerError) -> Response {
    let resp = match err.class() {
        ErrorClass::NotFound => return not_found(),
        ErrorClass::BadRequest => text(StatusCode::BAD_REQUEST, err.describe()),
        ErrorClass::Forbidden => text(StatusCode::FORBIDDEN, err.describe()),
        ErrorClass::Throttled => text(StatusCode::TOO_MANY_REQUESTS, err.describe()),
        ErrorClass::Unavailable => text(StatusCode::SERVICE_UNAVAILABLE, err.describe()),
    };
    with_retry_after(resp, err)
}

fn account_info(identity: &Identity) -> Value {
    json!({
        "aliases": ["default"],
        "email": identity.id,
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
pub async fn handle(surfaces: &Surfaces, request: &Parts) -> Response {
    let (uri, headers) = (&request.uri, &request.headers);
    if is_forwarded(headers) {
        return text(StatusCode::FORBIDDEN, FORWARDED_REFUSAL);
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
    let query = Query::parse(uri.query());
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
    let universe = surfaces
        .defaults
        .gcp_universe_domain
        .as_deref()
        .unwrap_or(DEFAULT_UNIVERSE_DOMAIN);

    // Root and version directories.
    match path {
        "/" => return listing(&["computeMetadata/"]),
        "/computeMetadata" | "/computeMetadata/v1" => return redirect(uri),
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
                return match listed_accounts(surfaces).await {
                    Ok(grant) => json_body(json!({
                        "instance": { "serviceAccounts": accounts_json(&grant) },
                        "project": { "numericProjectId": number(grant.identity.account_number.as_deref().unwrap_or_default()), "projectId": grant.identity.account },
                        "universe": { "universeDomain": universe },
                    })),
                    Err(e) => render_error(&e),
                };
            }
            listing(&["instance/", "project/", "universe/"])
        }
        (["universe"], true) => {
            if recursive {
                json_body(json!({ "universeDomain": universe }))
            } else {
                listing(&["universe-domain"])
            }
        }
        // Older golang.org/x/oauth2 clients ask for `universe_domain`.
        (["universe", "universe-domain" | "universe_domain"], false) => {
            text(StatusCode::OK, universe.to_string())
        }
        (["project"], true) => match identity_for_account(surfaces, "default").await {
            Ok(id) if recursive => json_body(json!({
                "numericProjectId": number(id.account_number.as_deref().unwrap_or_default()),
                "projectId": id.account,
            })),
            Ok(_) => listing(&["numeric-project-id", "project-id"]),
            Err(e) => render_error(&e),
        },
        (["project", "project-id"], false) => {
            match identity_for_account(surfaces, "default").await {
                Ok(id) => text(StatusCode::OK, id.account),
                Err(e) => render_error(&e),
            }
        }
        (["project", "numeric-project-id"], false) => {
            match identity_for_account(surfaces, "default").await {
                Ok(id) => text(StatusCode::OK, id.account_number.unwrap_or_default()),
                Err(e) => render_error(&e),
            }
        }
        (["instance"], true) => match listed_accounts(surfaces).await {
            Ok(grant) if recursive => {
                json_body(json!({ "serviceAccounts": accounts_json(&grant) }))
            }
            Ok(_) => listing(&["service-accounts/"]),
            Err(e) => render_error(&e),
        },
        (["instance", "service-accounts"], true) => match listed_accounts(surfaces).await {
            Ok(grant) if recursive => json_body(accounts_json(&grant)),
            Ok(grant) => {
                let dirs: Vec<String> = std::iter::once("default/".to_string())
                    .chain(grant.listed().iter().map(|id| format!("{}/", id.id)))
                    .collect();
                let dirs: Vec<&str> = dirs.iter().map(String::as_str).collect();
                listing(&dirs)
            }
            Err(e) => render_error(&e),
        },
        (["instance", "service-accounts", account, rest @ ..], _) => {
            service_account(surfaces, account, rest, is_dir, recursive, &query, uri).await
        }
        // Known directories asked for without their trailing slash.
        (
            [] | ["project"] | ["instance"] | ["universe"] | ["instance", "service-accounts"],
            false,
        ) => redirect(uri),
        _ => not_found(),
    }
}

/// The selector a metadata path's account segment makes: `default` names
/// whatever identity is bound, anything else must be its email.
fn account_selector(account: &str) -> Option<Selector> {
    (account != "default").then(|| Selector::Email(account.to_string()))
}

/// Asks the broker for `request` with the pod's Google token.
async fn ask(surfaces: &Surfaces, request: TokenRequest) -> Result<Grant, BrokerError> {
    let subject = subject(surfaces, Cloud::Gcp).await?;
    surfaces.broker.request(&subject, &request).await
}

/// The caller's Google identity, checked against `account`.
async fn identity_for_account(surfaces: &Surfaces, account: &str) -> Result<Identity, BrokerError> {
    let request = TokenRequest::new(Cloud::Gcp, Kind::Identity, Surface::Gce)
        .with_selector(account_selector(account));
    Ok(ask(surfaces, request).await?.identity)
}

/// The caller's Google identities as a listing shows them: the default
/// (`default/`), and every one its ServiceAccount lists that the policy
/// allows it, by email.
async fn listed_accounts(surfaces: &Surfaces) -> Result<Grant, BrokerError> {
    ask(
        surfaces,
        TokenRequest::new(Cloud::Gcp, Kind::Identity, Surface::Gce),
    )
    .await
}

/// `render` applied to the bearer token `request` is granted.
async fn with_bearer(
    surfaces: &Surfaces,
    request: TokenRequest,
    render: impl FnOnce(&AccessToken) -> Result<Response, BrokerError>,
) -> Result<Response, BrokerError> {
    let grant = ask(surfaces, request).await?;
    let token = grant
        .credential
        .as_deref()
        .and_then(Credential::bearer)
        .ok_or_else(wrong_credential)?;
    render(token)
}

#[allow(clippy::too_many_arguments)]
async fn service_account(
    surfaces: &Surfaces,
    account: &str,
    rest: &[&str],
    is_dir: bool,
    recursive: bool,
    query: &Query<'_>,
    uri: &Uri,
) -> Response {
    let request = |kind| {
        TokenRequest::new(Cloud::Gcp, kind, Surface::Gce).with_selector(account_selector(account))
    };
    match (rest, is_dir) {
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
            let request = request(Kind::AccessToken).with_scopes(scopes);
            let rendered = with_bearer(surfaces, request, |token| {
                let now = now_unix();
                let key = BodyKey {
                    form: Form::Surface(Surface::Gce),
                    variant: TOKEN_BODY,
                    second: now,
                    echo: &[],
                };
                let body = token.rendered.get_or_render(key, || {
                    to_json(&TokenBody {
                        access_token: token.token.expose_secret(),
                        expires_in: token.expires_at.saturating_sub(now),
                        token_type: "Bearer",
                    })
                })?;
                Ok(with_flavor(json_ok(body)))
            });
            rendered.await.unwrap_or_else(|e| render_error(&e))
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
                        format!(
                            "invalid format {:?}: expected standard or full",
                            lanyard_core::text::bounded(other)
                        ),
                    )
                }
            };
            let mut req = request(Kind::IdToken);
            req.audience = Some(audience.to_string());
            req.include_email = include_email;
            with_bearer(surfaces, req, |token| {
                // The ID token is the whole body, so it never changes.
                let key = BodyKey::fixed(Surface::Gce, ID_TOKEN_BODY);
                let body = token.rendered.get_or_render(key, || {
                    Ok::<_, BrokerError>(token.token.expose_secret().as_bytes().to_vec())
                })?;
                Ok(text(StatusCode::OK, body))
            })
            .await
            .unwrap_or_else(|e| render_error(&e))
        }
        _ => {
            let id = match identity_for_account(surfaces, account).await {
                Ok(id) => id,
                Err(e) => return render_error(&e),
            };
            match (rest, is_dir) {
                ([], true) if recursive => json_body(account_info(&id)),
                ([], true) => listing(&["aliases", "email", "identity", "scopes", "token"]),
                ([], false) => redirect(uri),
                (["aliases"], false) => listing(&["default"]),
                (["email"], false) => text(StatusCode::OK, id.id),
                (["scopes"], false) => listing(&DEFAULT_SCOPES),
                _ => not_found(),
            }
        }
    }
}

/// `{"default": {...}, "EMAIL": {...}, ...}`, as
/// `service-accounts/?recursive=true` answers: `default` is the
/// ServiceAccount's default, then each listed account by its email.
fn accounts_json(grant: &Grant) -> Value {
    let mut accounts = serde_json::Map::new();
    accounts.insert("default".into(), account_info(&grant.identity));
    for id in grant.listed() {
        accounts.insert(id.id.clone(), account_info(id));
    }
    Value::Object(accounts)
}

/// The numeric project id as a JSON number when it is one.
fn number(n: &str) -> Value {
    n.parse::<u64>()
        .map(Value::from)
        .unwrap_or_else(|_| Value::from(n))
}
/// What this surface serves, for the answer to a path of no surface.
pub(crate) const SERVES: &str = "/computeMetadata/v1/ (GCE metadata)";

/// Whether `path` is this surface's: `/`, `/computeMetadata` and
/// everything below it.
pub(crate) fn classify(path: &str) -> bool {
    path == "/" || path == "/computeMetadata" || path.starts_with("/computeMetadata/")
}

/// The answer to a request for one of this surface's paths.
pub(crate) async fn answer(surfaces: &Surfaces, request: &Parts) -> Response {
    if super::is_read(request) {
        handle(surfaces, request).await
    } else {
        let message = paths::wrong_method(paths::READ);
        paths::with_allow(text(StatusCode::METHOD_NOT_ALLOWED, message), paths::READ)
    }
}
/// The Google SDKs' variables (`serve::sdk_env`): google-auth reads the
/// first two, gcloud the third.
pub(crate) fn sdk_vars(env: &SdkEnv, _base: &str, vars: &mut Vec<(&'static str, String)>) {
    for name in ["GCE_METADATA_HOST", "GCE_METADATA_IP", "GCE_METADATA_ROOT"] {
        vars.push((name, env.host_port.to_string()));
    }
}

/// Variables that make this cloud's SDKs take another credential source
/// before they reach the sidecar: left alone (the user may mean them) and
/// reported by the webhook.
pub(crate) const CONFLICTS: &[(&str, &str)] = &[(
    "GOOGLE_APPLICATION_CREDENTIALS",
    "google-auth uses that file before the metadata server",
)];
