//! Paths as real clients spell them, and an error in each surface's own
//! shape for every path or method no surface serves.
//!
//! [`classify`] places every request path: the documented paths, and
//! what real clients send beside them. msal-node (and so Node.js
//! `@azure/identity`) lower-cases the IMDS URL and appends a `/`
//! (`/metadata/identity/oauth2/token/`); aad-pod-identity's NMI, the server
//! `AZURE_POD_IDENTITY_AUTHORITY_HOST` was made for, matches `metadata`
//! case-insensitively. A plain-text 404 on such a path makes an SDK retry
//! for many seconds and then report a network error, so every not-found
//! here answers in the surface's JSON error shape and says what is served.

use axum::http::header::ALLOW;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use super::{
    app_service, aws_container, azure_imds, gce, APP_SERVICE_PATH, AWS_CONTAINER_PATH,
    IMDS_TOKEN_PATH,
};

/// Where IMDSv2 lists the instance's role; a role's credentials are below.
pub(crate) const AWS_ROLES_PATH: &str = "/latest/meta-data/iam/security-credentials/";

/// Where a request path belongs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// Azure IMDS's token endpoint, as documented or spelled another way.
    ImdsToken,
    /// Anything else under `/metadata/`: IMDS paths Lanyard does not serve
    /// (instance metadata, MSAL's newer credential probes).
    ImdsOther,
    /// The App Service endpoint, with or without a trailing slash.
    AppServiceToken,
    /// Anything else under `/msi/`.
    AppServiceOther,
    /// GCE metadata: `/`, `/computeMetadata` and everything below it (the
    /// surface answers its own not-founds).
    Gce,
    /// The AWS container endpoint, with or without a trailing slash.
    AwsContainer,
    /// IMDSv2's session token, `/latest/api/token`.
    AwsImdsSession,
    /// AWS IMDS's role listing, with or without its trailing slash.
    AwsImdsRoles,
    /// One role's credentials: one segment below [`AWS_ROLES_PATH`].
    AwsImdsRole,
    /// `/latest/meta-data/placement/region`.
    AwsImdsRegion,
    /// Anything else under `/latest/`.
    AwsImdsOther,
    /// `/healthz` and `/readyz`: the sidecar's probes, where it has them.
    Probe,
    /// No surface's path.
    Unknown,
}

impl Route {
    /// The methods the route answers, for a `405`'s `Allow`; `None` for a
    /// not-found route, which answers every method alike.
    pub(crate) fn allowed(self) -> Option<&'static str> {
        match self {
            Route::ImdsToken
            | Route::AppServiceToken
            | Route::Gce
            | Route::AwsContainer
            | Route::AwsImdsRoles
            | Route::AwsImdsRole
            | Route::AwsImdsRegion
            | Route::Probe => Some("GET,HEAD"),
            Route::AwsImdsSession => Some("PUT"),
            Route::ImdsOther | Route::AppServiceOther | Route::AwsImdsOther | Route::Unknown => {
                None
            }
        }
    }
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

/// Classifies a request path. Runs on every request: the commonest
/// paths are tried first, each by one comparison.
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
    } else if path == "/" || path == "/computeMetadata" || path.starts_with("/computeMetadata/") {
        Route::Gce
    } else if t == AWS_CONTAINER_PATH {
        Route::AwsContainer
    } else if let Some(below) = path.strip_prefix("/latest/") {
        classify_latest(path, below)
    } else if path == "/healthz" || path == "/readyz" {
        Route::Probe
    } else {
        Route::Unknown
    }
}

/// Classifies a path under `/latest/` (`below` is the rest of it).
fn classify_latest(path: &str, below: &str) -> Route {
    if below == "api/token" {
        Route::AwsImdsSession
    } else if below == "meta-data/placement/region" {
        Route::AwsImdsRegion
    } else if trimmed(path) == trimmed(AWS_ROLES_PATH) {
        Route::AwsImdsRoles
    } else if path
        .strip_prefix(AWS_ROLES_PATH)
        .is_some_and(|role| !role.contains('/'))
    {
        Route::AwsImdsRole
    } else {
        Route::AwsImdsOther
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

/// A method the path's surface does not answer: `405` with `Allow`, in the
/// surface's own shape.
pub(crate) fn method_not_allowed(route: Route) -> Response {
    let allowed = route.allowed().unwrap_or("GET,HEAD");
    let message = format!("Only {allowed} is allowed on this path");
    let mut response = match route {
        Route::ImdsToken => {
            azure_imds::error(StatusCode::METHOD_NOT_ALLOWED, "invalid_request", message)
        }
        Route::AppServiceToken => app_service::error(StatusCode::METHOD_NOT_ALLOWED, message),
        Route::AwsContainer => {
            aws_container::error(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", message)
        }
        Route::Gce => gce::text(StatusCode::METHOD_NOT_ALLOWED, message),
        // EC2's metadata service answers a wrong method with a bare 405,
        // which the SDKs read as "no IMDSv2 here".
        _ => StatusCode::METHOD_NOT_ALLOWED.into_response(),
    };
    response
        .headers_mut()
        .insert(ALLOW, HeaderValue::from_static(allowed));
    response
}

/// The answer to a path no surface serves (a route with nothing to
/// serve, or the probes where there are none), in the shape of the
/// surface the path belongs to.
pub(crate) fn not_found(route: Route, path: &str) -> Response {
    match route {
        // IMDS's newer managed-identity paths (MSAL's `getplatformmetadata`
        // and `issuecredential` probes) answer 404 where the feature is
        // absent, which tells MSAL to use the token endpoint.
        Route::ImdsOther => azure_imds::error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!(
                "{} is not served here; the managed identity token endpoint is {IMDS_TOKEN_PATH}",
                shown(path)
            ),
        ),
        Route::AppServiceOther => app_service::error(
            StatusCode::NOT_FOUND,
            format!(
                "{} is not served here; the managed identity endpoint is {APP_SERVICE_PATH}",
                shown(path)
            ),
        ),
        // EC2's metadata service answers unknown paths with a bare 404.
        Route::AwsImdsOther => (StatusCode::NOT_FOUND, "Not Found").into_response(),
        // A path of no surface: the OAuth-style pair IMDS answers with,
        // which any client can read.
        _ => azure_imds::error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("{} is not served here. {SERVED}", shown(path)),
        ),
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
    fn documented_paths_are_their_surfaces() {
        for (path, route) in [
            (IMDS_TOKEN_PATH, Route::ImdsToken),
            (APP_SERVICE_PATH, Route::AppServiceToken),
            ("/", Route::Gce),
            ("/computeMetadata", Route::Gce),
            ("/computeMetadata/", Route::Gce),
            (
                "/computeMetadata/v1/instance/service-accounts/default/token",
                Route::Gce,
            ),
            (AWS_CONTAINER_PATH, Route::AwsContainer),
            ("/latest/api/token", Route::AwsImdsSession),
            (AWS_ROLES_PATH, Route::AwsImdsRoles),
            (
                "/latest/meta-data/iam/security-credentials/ray-data",
                Route::AwsImdsRole,
            ),
            (
                "/latest/meta-data/iam/security-credentials/a%2Fb",
                Route::AwsImdsRole,
            ),
            ("/latest/meta-data/placement/region", Route::AwsImdsRegion),
            ("/healthz", Route::Probe),
            ("/readyz", Route::Probe),
        ] {
            assert_eq!(classify(path), route, "{path}");
            assert!(route.allowed().is_some(), "{path} answers some method");
        }
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
            ("/latest/api/token/", Route::AwsImdsOther),
            (
                "/latest/meta-data/iam/security-credentials/a/b",
                Route::AwsImdsOther,
            ),
            ("/v1/credentialsx", Route::Unknown),
            ("/V1/credentials", Route::Unknown),
            ("/computeMetadataX", Route::Unknown),
            ("/ComputeMetadata/v1/", Route::Unknown),
            ("/healthz/", Route::Unknown),
            ("", Route::Unknown),
            ("/é/metadata", Route::Unknown),
        ] {
            assert_eq!(classify(path), route, "{path}");
            assert!(route.allowed().is_none(), "{path} is not served");
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
