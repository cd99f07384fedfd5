//! App Service managed-identity endpoint (`IDENTITY_ENDPOINT` +
//! `IDENTITY_HEADER`), which both the Python and the Rust azure-identity
//! honour from the environment:
//! `GET {IDENTITY_ENDPOINT}?api-version=2019-08-01&resource=` with
//! `X-IDENTITY-HEADER`. Errors use App Service's
//! `{statusCode, message, correlationId}` shape.
//!
//! The same path serves the older protocol (`MSI_ENDPOINT` + `MSI_SECRET`):
//! `api-version=2017-09-01`, the secret in a `secret` header, and only
//! `clientid` to select an identity. Older SDKs (azure-identity for Python
//! up to 1.8, `@azure/identity` up to 4.3, .NET's legacy mode) speak it as
//! App Service; current MSAL and azure-identity call the same request
//! "Azure Machine Learning" and use it only when `IDENTITY_ENDPOINT` is
//! unset. App Service 2017 answered `expires_on` as a date string, Azure
//! Machine Learning as Unix seconds; every SDK that speaks it tries a
//! number first, and MSAL accepts nothing else, so it is Unix seconds here.

use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::azure_imds::{issue, token_request, Fields};
use super::paths;
use super::sdk_env::SdkEnv;
use super::{is_forwarded, with_retry_after, Query, Surfaces, FORWARDED_REFUSAL};
use lanyard_core::cloud::{Cloud, Kind, Selector, Surface, TokenRequest};
use lanyard_core::grant::{BrokerError, ErrorClass};

use lanyard_core::secret::{constant_time_eq, ExposeSecret};

/// An error in this surface's own body shape.
pub(crate) fn error(status: StatusCode, message: impl Into<String>) -> Response {
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
const FIELDS: Fields = Fields {
    ext_expires_in: false,
    not_before: true,
};

/// The older protocol's version.
const API_2017: &str = "2017-09-01";

/// The token as the 2017 protocol renders it: no `not_before`, `expires_on`
/// in Unix seconds (see the module docs).
const FIELDS_2017: Fields = Fields {
    ext_expires_in: false,
    not_before: false,
};

/// The request of a 2017 query: `resource`, and the identity only by
/// `clientid`.
fn token_request_2017(query: &Query) -> Result<TokenRequest, String> {
    for other in [
        "client_id",
        "object_id",
        "principal_id",
        "msi_res_id",
        "mi_res_id",
    ] {
        if query.get(other).is_some() {
            return Err(format!(
                "api-version {API_2017} selects a user-assigned identity by its client ID only (clientid), not {other}"
            ));
        }
    }
    let resource = query
        .get("resource")
        .ok_or("The resource parameter is required")?;
    Ok(
        TokenRequest::new(Cloud::Azure, Kind::AccessToken, Surface::AppService)
            .with_selector(query.get("clientid").map(|c| Selector::ClientId(c.into())))
            .with_scopes(vec![resource.trim().to_string()]),
    )
}

/// `GET /msi/token`: the App Service managed-identity protocol. The caller
/// must present the shared secret (compared in constant time) in
/// `X-IDENTITY-HEADER`, or in `secret` with `api-version=2017-09-01`, and
/// give `api-version` and `resource`; the token is rendered as App Service
/// does.
pub async fn token(surfaces: &Surfaces, request: &Parts) -> Response {
    let (headers, query) = (&request.headers, request.uri.query());
    if is_forwarded(headers) {
        return error(StatusCode::BAD_REQUEST, FORWARDED_REFUSAL);
    }
    let query = Query::parse(query);
    let legacy = query.get("api-version") == Some(API_2017);
    let (header, shown, variable) = match legacy {
        true => ("secret", "secret", "MSI_SECRET"),
        false => ("x-identity-header", "X-IDENTITY-HEADER", "IDENTITY_HEADER"),
    };
    let presented = headers
        .get(header)
        .map(|v| v.as_bytes())
        .unwrap_or_default();
    if !constant_time_eq(
        presented,
        surfaces.identity_header.expose_secret().as_bytes(),
    ) {
        return error(
            StatusCode::UNAUTHORIZED,
            format!("The {shown} header is missing or does not match {variable}"),
        );
    }
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
    let (request, fields) = match legacy {
        true => (token_request_2017(&query), FIELDS_2017),
        false => (token_request(&query, Surface::AppService), FIELDS),
    };
    match request {
        Ok(request) => issue(surfaces, request, fields, render_error).await,
        Err(msg) => error(StatusCode::BAD_REQUEST, msg),
    }
}

/// Path of the App Service managed-identity endpoint (`IDENTITY_ENDPOINT`).
pub const PATH: &str = "/msi/token";
/// What this surface serves, for the answer to a path of no surface.
pub(crate) const SERVES: &str = "/msi/token (App Service)";

/// This surface's paths: the token path, and anything else under `/msi/`.
pub(crate) type Endpoint = paths::TokenPath;

/// The endpoint `path` is, if it is this surface's.
pub(crate) fn classify(path: &str) -> Option<Endpoint> {
    Endpoint::of(path, PATH, "/msi/")
}

/// The answer to a request for `endpoint`.
pub(crate) async fn answer(surfaces: &Surfaces, endpoint: Endpoint, request: &Parts) -> Response {
    match endpoint {
        Endpoint::Token if super::is_read(request) => token(surfaces, request).await,
        Endpoint::Token => paths::with_allow(
            error(
                StatusCode::METHOD_NOT_ALLOWED,
                paths::wrong_method(paths::READ),
            ),
            paths::READ,
        ),
        Endpoint::Other => error(
            StatusCode::NOT_FOUND,
            format!(
                "{} is not served here; the managed identity endpoint is {PATH}",
                paths::shown(request.uri.path())
            ),
        ),
    }
}
/// The Azure SDKs' variables (`serve::sdk_env`): App Service for current
/// SDKs (they take `IDENTITY_ENDPOINT` first), IMDS for those that speak
/// only IMDS, the older App Service protocol (2017-09-01) for SDKs from
/// before 2019-08-01, which take it first (docs/compatibility.md).
pub(crate) fn sdk_vars(env: &SdkEnv, base: &str, vars: &mut Vec<(&'static str, String)>) {
    vars.push(("AZURE_POD_IDENTITY_AUTHORITY_HOST", base.to_string()));
    vars.push(("IDENTITY_ENDPOINT", format!("{base}{PATH}")));
    vars.push(("IDENTITY_HEADER", env.identity_header.to_string()));
    vars.push(("MSI_ENDPOINT", format!("{base}{PATH}")));
    vars.push(("MSI_SECRET", env.identity_header.to_string()));
    // The default identity: an SDK that selects none gets it.
    if let Some(az) = env.bindings.azure.first() {
        vars.push(("AZURE_CLIENT_ID", az.client_id.clone()));
        let default = env.defaults.azure_tenant_id.as_ref();
        if let Some(tenant) = az.tenant_id.as_ref().or(default) {
            vars.push(("AZURE_TENANT_ID", tenant.clone()));
        }
    }
}

/// Variables holding the secret the surface checks, with the endpoint that
/// refuses a container whose own value differs from the sidecar's.
pub(crate) const SECRETS: &[(&str, &str)] = &[
    ("IDENTITY_HEADER", "App Service"),
    ("MSI_SECRET", "App Service"),
];

/// Variables that make this cloud's SDKs take another credential source
/// before they reach the sidecar: left alone (the user may mean them) and
/// reported by the webhook.
pub(crate) const CONFLICTS: &[(&str, &str)] = &[
    (
        "AZURE_FEDERATED_TOKEN_FILE",
        "azure-identity uses workload identity federation before managed identity",
    ),
    (
        "AZURE_CLIENT_SECRET",
        "azure-identity uses the client secret before managed identity",
    ),
    (
        "AZURE_CLIENT_CERTIFICATE_PATH",
        "azure-identity uses the client certificate before managed identity",
    ),
];
