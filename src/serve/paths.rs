//! Paths as real clients spell them, and a not-found in each surface's own
//! shape for every path no surface serves.
//!
//! The exact routes in [`super::router`] are the documented paths; this
//! fallback takes what real clients send beside them. msal-node (and so
//! Node.js `@azure/identity`) lower-cases the IMDS URL and appends a `/`
//! (`/metadata/identity/oauth2/token/`); aad-pod-identity's NMI, the server
//! `AZURE_POD_IDENTITY_AUTHORITY_HOST` was made for, matches `metadata`
//! case-insensitively. A plain-text 404 on such a path makes an SDK retry
//! for many seconds and then report a network error, so every not-found
//! here answers in the surface's JSON error shape and says what is served.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::{
    app_service, aws_container, aws_imds, azure_imds, Surfaces, APP_SERVICE_PATH,
    AWS_CONTAINER_PATH, IMDS_TOKEN_PATH,
};

/// Where a path that no exact route matched belongs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// Azure IMDS's token endpoint, spelled another way.
    ImdsToken,
    /// Anything else under `/metadata/`: IMDS paths Lanyard does not serve
    /// (instance metadata, MSAL's newer credential probes).
    ImdsOther,
    /// The App Service endpoint with a trailing slash.
    AppServiceToken,
    /// Anything else under `/msi/`.
    AppServiceOther,
    /// The AWS container endpoint with a trailing slash.
    AwsContainer,
    /// AWS IMDS's role listing without its trailing slash.
    AwsImdsRoles,
    /// Anything else under `/latest/`.
    AwsImdsOther,
    /// No surface's path.
    Unknown,
}

/// `path` without one trailing `/` (the root stays `/`).
fn trimmed(path: &str) -> &str {
    match path.strip_suffix('/') {
        Some("") | None => path,
        Some(t) => t,
    }
}

fn starts_with_ignore_case(path: &str, prefix: &str) -> bool {
    path.len() >= prefix.len()
        && path.is_char_boundary(prefix.len())
        && path[..prefix.len()].eq_ignore_ascii_case(prefix)
}

/// Classifies a path no exact route matched.
pub(crate) fn classify(path: &str) -> Route {
    let t = trimmed(path);
    if t.eq_ignore_ascii_case(IMDS_TOKEN_PATH) {
        Route::ImdsToken
    } else if starts_with_ignore_case(path, "/metadata/") {
        Route::ImdsOther
    } else if t.eq_ignore_ascii_case(APP_SERVICE_PATH) {
        Route::AppServiceToken
    } else if starts_with_ignore_case(path, "/msi/") {
        Route::AppServiceOther
    } else if t == AWS_CONTAINER_PATH {
        Route::AwsContainer
    } else if t == "/latest/meta-data/iam/security-credentials" {
        Route::AwsImdsRoles
    } else if path.starts_with("/latest/") {
        Route::AwsImdsOther
    } else {
        Route::Unknown
    }
}

/// What the surfaces serve, for a caller that asked elsewhere.
const SERVED: &str = "Lanyard serves /metadata/identity/oauth2/token (Azure IMDS), /msi/token (App Service), /computeMetadata/v1/ (GCE metadata), /v1/credentials (AWS container credentials) and /latest/ (AWS IMDSv2)";

/// The path as a caller-supplied text: bounded, so an error body never
/// echoes an unbounded request line.
fn shown(path: &str) -> String {
    const MAX: usize = 128;
    if path.len() <= MAX {
        return path.to_string();
    }
    let mut cut = MAX;
    while !path.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &path[..cut])
}

fn method_not_allowed(route: Route) -> Response {
    let message = "Only GET is allowed on this path";
    match route {
        Route::ImdsToken => (
            StatusCode::METHOD_NOT_ALLOWED,
            Json(json!({ "error": "invalid_request", "error_description": message })),
        )
            .into_response(),
        Route::AwsContainer => {
            aws_container::error(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", message)
        }
        _ => app_service_error(StatusCode::METHOD_NOT_ALLOWED, message),
    }
}

fn app_service_error(status: StatusCode, message: &str) -> Response {
    (
        status,
        Json(json!({
            "statusCode": status.as_u16(),
            "message": message,
            "correlationId": uuid::Uuid::new_v4().to_string(),
        })),
    )
        .into_response()
}

/// Answers every request no exact route matched: the token paths as real
/// clients spell them, and a not-found in the shape of the surface the
/// path belongs to.
pub(crate) async fn fallback(State(surfaces): State<Arc<Surfaces>>, request: Request) -> Response {
    let uri = request.uri();
    let route = classify(uri.path());
    let get = request.method() == Method::GET;
    match route {
        Route::ImdsToken | Route::AppServiceToken | Route::AwsContainer if !get => {
            method_not_allowed(route)
        }
        Route::ImdsToken => azure_imds::token(State(surfaces), request).await,
        Route::AppServiceToken => app_service::token(State(surfaces), request).await,
        Route::AwsContainer => aws_container::credentials(State(surfaces), request).await,
        Route::AwsImdsRoles if get => aws_imds::list_roles(State(surfaces), request).await,
        // IMDS's newer managed-identity paths (MSAL's `getplatformmetadata`
        // and `issuecredential` probes) answer 404 where the feature is
        // absent, which tells MSAL to use the token endpoint.
        Route::ImdsOther => (
            StatusCode::NOT_FOUND,
            Json(json!({
                "error": "not_found",
                "error_description": format!(
                    "{} is not served here; the managed identity token endpoint is {IMDS_TOKEN_PATH}",
                    shown(uri.path())
                ),
            })),
        )
            .into_response(),
        Route::AppServiceOther => app_service_error(
            StatusCode::NOT_FOUND,
            &format!(
                "{} is not served here; the managed identity endpoint is {APP_SERVICE_PATH}",
                shown(uri.path())
            ),
        ),
        // EC2's metadata service answers unknown paths with a bare 404.
        Route::AwsImdsRoles | Route::AwsImdsOther => {
            (StatusCode::NOT_FOUND, "Not Found").into_response()
        }
        Route::Unknown => (
            StatusCode::NOT_FOUND,
            Json(json!({
                "error": "not_found",
                "error_description": format!("{} is not served here. {SERVED}", shown(uri.path())),
            })),
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_paths_are_found_however_clients_spell_them() {
        for path in [
            "/metadata/identity/oauth2/token/",
            "/Metadata/identity/oauth2/token",
            "/METADATA/IDENTITY/OAUTH2/TOKEN/",
        ] {
            assert_eq!(classify(path), Route::ImdsToken, "{path}");
        }
        assert_eq!(classify("/msi/token/"), Route::AppServiceToken);
        assert_eq!(classify("/v1/credentials/"), Route::AwsContainer);
        assert_eq!(
            classify("/latest/meta-data/iam/security-credentials"),
            Route::AwsImdsRoles
        );
    }

    #[test]
    fn other_paths_belong_to_their_surface_or_none() {
        for (path, route) in [
            ("/metadata/identity/getplatformmetadata", Route::ImdsOther),
            ("/metadata/identity/issuecredential", Route::ImdsOther),
            ("/metadata/instance", Route::ImdsOther),
            ("/metadata/identity/oauth2/token//", Route::ImdsOther),
            ("/metadata/identity/oauth2/tokens", Route::ImdsOther),
            ("/msi/other", Route::AppServiceOther),
            ("/latest/user-data", Route::AwsImdsOther),
            ("/v1/credentialsx", Route::Unknown),
            ("/V1/credentials", Route::Unknown),
            ("/", Route::Unknown),
            ("/é/metadata", Route::Unknown),
        ] {
            assert_eq!(classify(path), route, "{path}");
        }
    }

    #[test]
    fn shown_paths_are_bounded() {
        let long = format!("/{}", "é".repeat(500));
        let s = shown(&long);
        assert!(s.len() <= 128 + '…'.len_utf8(), "{}", s.len());
        assert!(s.ends_with('…'));
        assert_eq!(shown("/x"), "/x");
    }
}
