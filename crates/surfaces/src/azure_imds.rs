//! Azure Instance Metadata Service token endpoint:
//! `GET /metadata/identity/oauth2/token?api-version=&resource=[&client_id|object_id|msi_res_id]`
//! with `Metadata: true`. Success bodies carry every field as a string, as
//! IMDS does; errors are `{error, error_description}`.

use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::paths;
use super::{
    is_forwarded, json_ok, subject, to_json, with_retry_after, wrong_credential, Query, Surfaces,
    FORWARDED_REFUSAL,
};
use lanyard_core::cloud::{
    now_unix, AccessToken, BodyKey, Cloud, Credential, Form, Kind, Selector, Surface, TokenRequest,
};
use lanyard_core::grant::{BrokerError, ErrorClass};
use lanyard_core::secret::ExposeSecret;

/// An error in this surface's own body shape.
pub(crate) fn error(status: StatusCode, error: &str, description: impl Into<String>) -> Response {
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
pub(crate) fn selector(query: &Query) -> Result<Option<Selector>, String> {
    let candidates = [
        (
            "client_id",
            query.get("client_id").map(|v| Selector::ClientId(v.into())),
        ),
        (
            "object_id",
            query.get("object_id").map(|v| Selector::ObjectId(v.into())),
        ),
        (
            "principal_id",
            query
                .get("principal_id")
                .map(|v| Selector::ObjectId(v.into())),
        ),
        (
            "msi_res_id",
            query
                .get("msi_res_id")
                .map(|v| Selector::ResourceId(v.into())),
        ),
        (
            "mi_res_id",
            query
                .get("mi_res_id")
                .map(|v| Selector::ResourceId(v.into())),
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

/// A token as the Azure surfaces render it, every value a string as IMDS
/// sends them. Its fields borrow from the cached credential and are
/// serialized straight into the response: a cache hit builds no JSON tree.
#[derive(serde::Serialize)]
pub(crate) struct TokenBody<'a> {
    access_token: &'a str,
    client_id: &'a str,
    expires_in: Decimal,
    expires_on: Decimal,
    #[serde(skip_serializing_if = "Option::is_none")]
    ext_expires_in: Option<Decimal>,
    #[serde(skip_serializing_if = "Option::is_none")]
    not_before: Option<Decimal>,
    resource: &'a str,
    token_type: &'static str,
}

/// A number written as a JSON string (`"3599"`), formatted in place.
#[derive(Clone, Copy)]
pub(crate) struct Decimal(u64);

impl serde::Serialize for Decimal {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(itoa::Buffer::new().format(self.0))
    }
}

/// Which of the optional fields a surface sends.
#[derive(Clone, Copy)]
pub(crate) struct Fields {
    /// `ext_expires_in` (IMDS only).
    pub ext_expires_in: bool,
    /// `not_before` (all but App Service's 2017 protocol).
    pub not_before: bool,
}

impl Fields {
    /// Which fields, as a [`BodyKey`]'s variant.
    fn variant(self) -> u8 {
        u8::from(self.ext_expires_in) | u8::from(self.not_before) << 1
    }
}

impl<'a> TokenBody<'a> {
    /// `token` for the identity `client_id` and `resource`, with `fields`,
    /// at `now` (Unix seconds).
    pub(crate) fn new(
        token: &'a AccessToken,
        client_id: &'a str,
        resource: &'a str,
        fields: Fields,
        now: u64,
    ) -> Self {
        let expires_in = Decimal(token.expires_at.saturating_sub(now));
        TokenBody {
            access_token: token.token.expose_secret(),
            client_id,
            expires_in,
            expires_on: Decimal(token.expires_at),
            ext_expires_in: fields.ext_expires_in.then_some(expires_in),
            not_before: fields.not_before.then_some(Decimal(token.issued_at)),
            resource,
            token_type: "Bearer",
        }
    }
}

/// The fields IMDS sends.
pub(crate) const IMDS_FIELDS: Fields = Fields {
    ext_expires_in: true,
    not_before: true,
};

/// Renders an error class as IMDS does.
pub(crate) fn render_error(err: &BrokerError) -> Response {
    let resp = match err.class() {
        ErrorClass::NotFound => bad_request("Identity not found"),
        ErrorClass::BadRequest => bad_request(err.describe()),
        ErrorClass::Forbidden => {
            error(StatusCode::FORBIDDEN, "unauthorized_client", err.describe())
        }
        ErrorClass::Throttled => error(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_requests",
            err.describe(),
        ),
        ErrorClass::Unavailable => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "temporarily_unavailable",
            err.describe(),
        ),
    };
    with_retry_after(resp, err)
}

/// The request an IMDS or App Service query makes, or the reason it is
/// malformed.
pub(crate) fn token_request(query: &Query<'_>, surface: Surface) -> Result<TokenRequest, String> {
    let resource = query
        .get("resource")
        .ok_or("Required audience parameter not specified")?;
    Ok(TokenRequest::new(Cloud::Azure, Kind::AccessToken, surface)
        .with_selector(selector(query)?)
        .with_scopes(vec![resource.trim().to_string()]))
}

/// Asks the broker and renders the token with `render`, or the error with
/// `render_error`.
pub(crate) async fn issue(
    surfaces: &Surfaces,
    request: TokenRequest,
    fields: Fields,
    render_error: fn(&BrokerError) -> Response,
) -> Response {
    let result = async {
        let subject = subject(surfaces, Cloud::Azure).await?;
        let grant = surfaces.broker.request(&subject, &request).await?;
        let token = grant
            .credential
            .as_deref()
            .and_then(Credential::bearer)
            .ok_or_else(wrong_credential)?;
        let resource = request.scopes.first().map_or("", String::as_str);
        let client_id = grant.identity.id.as_str();
        let now = now_unix();
        let key = BodyKey {
            form: Form::Surface(request.surface),
            variant: fields.variant(),
            second: now,
            echo: &[resource, client_id],
        };
        let body = token.rendered.get_or_render(key, || {
            to_json(&TokenBody::new(token, client_id, resource, fields, now))
        })?;
        Ok::<_, BrokerError>(json_ok(body))
    }
    .await;
    match result {
        Ok(response) => response,
        Err(err) => render_error(&err),
    }
}

/// `GET /metadata/identity/oauth2/token`: Azure IMDS's managed-identity
/// protocol. The caller must send `Metadata: true` and `api-version`, and
/// may select the identity by one of `client_id`, `object_id` (or
/// `principal_id`) and `msi_res_id` (or `mi_res_id`).
pub async fn token(surfaces: &Surfaces, request: &Parts) -> Response {
    let (headers, query) = (&request.headers, request.uri.query());
    if is_forwarded(headers) {
        return bad_request(FORWARDED_REFUSAL);
    }
    let metadata = headers
        .get("metadata")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("true"));
    if !metadata {
        return bad_request("Required metadata header not specified");
    }
    let query = Query::parse(query);
    if let Some(dup) = query.duplicated() {
        return bad_request(format!(
            "Query parameter '{dup}' is specified more than once"
        ));
    }
    if query.get("api-version").is_none() {
        return bad_request("Required query variable 'api-version' is missing");
    }
    match token_request(&query, Surface::AzureImds) {
        Ok(request) => issue(surfaces, request, IMDS_FIELDS, render_error).await,
        Err(msg) => bad_request(msg),
    }
}

/// Path of the Azure IMDS token endpoint.
pub const TOKEN_PATH: &str = "/metadata/identity/oauth2/token";
/// What this surface serves, for the answer to a path of no surface.
pub(crate) const SERVES: &str = "/metadata/identity/oauth2/token (Azure IMDS)";

/// This surface's paths: the token path, and anything else under
/// `/metadata/` (IMDS paths Lanyard does not serve, such as MSAL's
/// `getplatformmetadata` and `issuecredential` probes).
pub(crate) type Endpoint = paths::TokenPath;

/// The endpoint `path` is, if it is this surface's.
pub(crate) fn classify(path: &str) -> Option<Endpoint> {
    Endpoint::of(path, TOKEN_PATH, "/metadata/")
}

/// The answer to a request for `endpoint`.
pub(crate) async fn answer(surfaces: &Surfaces, endpoint: Endpoint, request: &Parts) -> Response {
    match endpoint {
        Endpoint::Token if super::is_read(request) => token(surfaces, request).await,
        Endpoint::Token => paths::with_allow(
            error(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request",
                paths::wrong_method(paths::READ),
            ),
            paths::READ,
        ),
        // IMDS's newer managed-identity paths answer 404 where the feature
        // is absent, which tells MSAL to use the token endpoint.
        Endpoint::Other => error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!(
                "{} is not served here; the managed identity token endpoint is {TOKEN_PATH}",
                paths::shown(request.uri.path())
            ),
        ),
    }
}
