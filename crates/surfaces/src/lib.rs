//! Protocol surfaces: the endpoints cloud SDKs already call, each parsing
//! its cloud's request into a broker request and rendering the answer (or
//! the error) in that cloud's exact wire format.

pub mod agent_api;
pub mod app_service;
pub mod aws_container;
pub mod aws_imds;
pub mod azure_imds;
pub mod container_token;
pub mod gce;
mod paths;
mod query;
mod routes;
pub mod sdk_env;
pub mod token_shelf;

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::header::CONTENT_TYPE;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};

use lanyard_core::cloud::{Cloud, Surface};
use lanyard_core::grant::{BrokerError, TokenBroker};
use lanyard_core::secret::SecretString;

pub use query::Query;
pub use routes::SurfaceRouter;

/// Where a request path belongs: one of a surface's endpoints, the
/// sidecar's probes, or nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// Azure IMDS (`/metadata/…`).
    AzureImds(azure_imds::Endpoint),
    /// App Service (`/msi/…`).
    AppService(app_service::Endpoint),
    /// GCE metadata (`/`, `/computeMetadata/…`).
    Gce,
    /// AWS container credentials.
    AwsContainer,
    /// AWS IMDSv2 (`/latest/…`).
    AwsImds(aws_imds::Endpoint),
    /// `/healthz` and `/readyz`.
    Probe,
    /// No one's.
    Unknown,
}

/// What `surface` serves, as the answer to a path of none names it.
const fn serves(surface: Surface) -> &'static str {
    match surface {
        Surface::AzureImds => azure_imds::SERVES,
        Surface::AppService => app_service::SERVES,
        Surface::Gce => gce::SERVES,
        Surface::AwsContainer => aws_container::SERVES,
        Surface::AwsImds => aws_imds::SERVES,
    }
}

/// What every surface serves ([`Surface::ALL`]), for the answer to a path
/// of none.
const SERVED: [&str; Surface::ALL.len()] = {
    let mut out = [""; Surface::ALL.len()];
    let mut i = 0;
    while i < out.len() {
        out[i] = serves(Surface::ALL[i]);
        i += 1;
    }
    out
};

/// Where `path` belongs. Each surface places its own paths; theirs do not
/// overlap, so the order is only the cost of reaching the last.
pub(crate) fn classify(path: &str) -> Route {
    if let Some(endpoint) = azure_imds::classify(path) {
        Route::AzureImds(endpoint)
    } else if let Some(endpoint) = app_service::classify(path) {
        Route::AppService(endpoint)
    } else if gce::classify(path) {
        Route::Gce
    } else if aws_container::classify(path) {
        Route::AwsContainer
    } else if let Some(endpoint) = aws_imds::classify(path) {
        Route::AwsImds(endpoint)
    } else if path == "/healthz" || path == "/readyz" {
        Route::Probe
    } else {
        Route::Unknown
    }
}

#[cfg(test)]
impl Route {
    /// The surface a route belongs to; `None` for probes and unknown paths.
    pub(crate) fn surface(self) -> Option<Surface> {
        match self {
            Route::AzureImds(_) => Some(Surface::AzureImds),
            Route::AppService(_) => Some(Surface::AppService),
            Route::Gce => Some(Surface::Gce),
            Route::AwsContainer => Some(Surface::AwsContainer),
            Route::AwsImds(_) => Some(Surface::AwsImds),
            Route::Probe | Route::Unknown => None,
        }
    }

    /// The methods the route answers; `None` for a path nothing serves.
    pub(crate) fn allowed(self) -> Option<&'static str> {
        match self {
            Route::AzureImds(endpoint) => endpoint.allowed(),
            Route::AppService(endpoint) => endpoint.allowed(),
            Route::Gce | Route::AwsContainer | Route::Probe => Some(paths::READ),
            Route::AwsImds(endpoint) => aws_imds::allowed(endpoint),
            Route::Unknown => None,
        }
    }
}

/// The answer to `request` on `route` (probes answered elsewhere; here a
/// probe path is no one's).
pub(crate) async fn answer(route: Route, surfaces: &Surfaces, request: &Parts) -> Response {
    match route {
        Route::AzureImds(endpoint) => azure_imds::answer(surfaces, endpoint, request).await,
        Route::AppService(endpoint) => app_service::answer(surfaces, endpoint, request).await,
        Route::Gce => gce::answer(surfaces, request).await,
        Route::AwsContainer => aws_container::answer(surfaces, request).await,
        Route::AwsImds(endpoint) => aws_imds::answer(surfaces, endpoint, request).await,
        Route::Probe | Route::Unknown => no_surface(request.uri.path()),
    }
}

/// A path of no surface: the OAuth-style pair IMDS answers with, which any
/// client can read, naming what is served.
fn no_surface(path: &str) -> Response {
    let (last, rest) = SERVED.split_last().unwrap_or((&"", &[]));
    azure_imds::error(
        axum::http::StatusCode::NOT_FOUND,
        "not_found",
        format!(
            "{} is not served here. Lanyard serves {} and {last}",
            paths::shown(path),
            rest.join(", ")
        ),
    )
}

/// Adds `cloud`'s SDK variables for `env` (`base` is the surfaces' URL)
/// to `vars`: from the surface its SDKs call.
pub(crate) fn sdk_vars(
    cloud: Cloud,
    env: &sdk_env::SdkEnv,
    base: &str,
    vars: &mut Vec<(&'static str, String)>,
) {
    match cloud {
        Cloud::Azure => app_service::sdk_vars(env, base, vars),
        Cloud::Gcp => gce::sdk_vars(env, base, vars),
        Cloud::Aws => aws_container::sdk_vars(env, base, vars),
    }
}

/// Variables that make `cloud`'s SDKs take another credential source
/// before they reach the sidecar, each with why.
pub fn conflicts(cloud: Cloud) -> &'static [(&'static str, &'static str)] {
    match cloud {
        Cloud::Azure => app_service::CONFLICTS,
        Cloud::Gcp => gce::CONFLICTS,
        Cloud::Aws => aws_container::CONFLICTS,
    }
}

/// Variables of `cloud`'s SDKs that name one setting twice: a container's
/// own value in the first is given to the second (see
/// `aws_container::LINKED`).
pub fn linked(cloud: Cloud) -> &'static [(&'static str, &'static str)] {
    match cloud {
        Cloud::Azure | Cloud::Gcp => &[],
        Cloud::Aws => aws_container::LINKED,
    }
}

/// Variables holding a secret `cloud`'s surfaces check, each with the
/// endpoint that refuses a container whose own value differs.
pub fn secrets(cloud: Cloud) -> &'static [(&'static str, &'static str)] {
    match cloud {
        Cloud::Azure => app_service::SECRETS,
        Cloud::Gcp | Cloud::Aws => &[],
    }
}

/// Whether `request` reads (`GET` or `HEAD`), what every token path answers.
pub(crate) fn is_read(request: &Parts) -> bool {
    request.method == axum::http::Method::GET || request.method == axum::http::Method::HEAD
}

/// Where the pod's projected tokens come from: files the kubelet rotates
/// (sidecar), or the built-in issuer (dev).
#[async_trait::async_trait]
pub trait SubjectTokens: Send + Sync {
    /// The current projected token for `cloud`'s audience, shared (it is
    /// read on every request).
    async fn token(&self, cloud: Cloud) -> Result<Arc<SecretString>, String>;
}

/// What every surface handler needs.
pub struct Surfaces {
    /// Decides and answers every request: in-process, or the node agent.
    pub broker: Arc<dyn TokenBroker>,
    /// The pod's projected tokens, presented to the broker as the caller's
    /// proof.
    pub subjects: Arc<dyn SubjectTokens>,
    /// Shared secret App Service callers present in `X-IDENTITY-HEADER`.
    pub identity_header: SecretString,
    /// The pod's app-facing token, which AWS container-credential callers
    /// present as `Authorization` (`AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE`),
    /// across its rotations; `None` disables that endpoint.
    pub app_token: Option<container_token::ContainerToken>,
    /// IMDSv2 session tokens.
    pub imds_sessions: aws_imds::SessionTokens,
    /// What the surfaces report of configuration (the IMDS region).
    pub defaults: sdk_env::SdkDefaults,
}

impl Surfaces {
    /// The surfaces of one pod (or `lanyard dev`), each surface's own state
    /// new.
    pub fn new(
        broker: Arc<dyn TokenBroker>,
        subjects: Arc<dyn SubjectTokens>,
        identity_header: SecretString,
        app_token: Option<container_token::ContainerToken>,
        defaults: sdk_env::SdkDefaults,
    ) -> Surfaces {
        Surfaces {
            broker,
            subjects,
            identity_header,
            app_token,
            imds_sessions: aws_imds::SessionTokens::new(),
            defaults,
        }
    }
}

/// All SDK-facing routes on one listener: Azure IMDS
/// ([`azure_imds::TOKEN_PATH`]), App Service ([`app_service::PATH`]), GCE
/// metadata (`/computeMetadata/v1/`), AWS container credentials
/// ([`aws_container::PATH`]) and AWS IMDSv2 (`/latest/`), with other
/// spellings of these paths, and not-found and wrong-method answers in
/// each surface's own shape.
pub fn router(surfaces: Arc<Surfaces>) -> SurfaceRouter {
    SurfaceRouter::new(surfaces)
}

/// Headers that proxies add to what they relay (nginx, Envoy, HAProxy,
/// Squid, CDNs). No SDK sends any of them to a metadata endpoint.
pub const PROXY_HEADERS: [&str; 13] = [
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
    "x-forwarded-port",
    "x-forwarded-server",
    "x-real-ip",
    "x-client-ip",
    "x-cluster-client-ip",
    "x-original-forwarded-for",
    "true-client-ip",
    "cf-connecting-ip",
    "via",
];

/// What a caller is told when its request carries a proxy header.
pub(crate) const FORWARDED_REFUSAL: &str =
    "Requests relayed by a proxy (X-Forwarded-For, Forwarded, X-Real-IP, Via, ...) are not allowed";

/// Requests relayed by a proxy carry one of [`PROXY_HEADERS`]; metadata
/// services refuse them so that an SSRF through a proxy in the pod cannot
/// reach us.
pub(crate) fn is_forwarded(headers: &HeaderMap) -> bool {
    // An SDK request has a handful of headers: walk those (names arrive
    // lower-cased) rather than look up every proxy header.
    headers.keys().any(|k| PROXY_HEADERS.contains(&k.as_str()))
}

/// The pod's current projected token for `cloud`; its absence is a
/// retryable error (the kubelet has not written it yet).
pub(crate) async fn subject(
    surfaces: &Surfaces,
    cloud: Cloud,
) -> Result<Arc<SecretString>, BrokerError> {
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

/// `value` as JSON, for a credential's [`lanyard_core::cloud::RenderedBody`].
/// Serializing plain data into memory cannot fail; should it ever, the SDK
/// gets a retryable error rather than an empty document.
pub(crate) fn to_json(value: &impl serde::Serialize) -> Result<Vec<u8>, BrokerError> {
    serde_json::to_vec(value)
        .map_err(|_| BrokerError::Unavailable("the response body could not be rendered".into()))
}

/// A 200 with a rendered JSON body.
pub(crate) fn json_ok(body: Bytes) -> Response {
    (
        [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    //! Every error class through every surface: the status each SDK
    //! expects, a body in the surface's own shape, and `Retry-After` when
    //! the class says how long to wait.

    use axum::body::to_bytes;

    use super::*;
    use lanyard_core::grant::ErrorClass;

    /// Every surface of the one list is served: the path its answer to an
    /// unknown path names is routed to it.
    #[test]
    fn every_surface_is_routed_where_it_says_it_serves() {
        for surface in Surface::ALL {
            let path = serves(surface).split(' ').next().unwrap_or_default();
            assert_eq!(classify(path).surface(), Some(surface), "{path}");
        }
    }
    use lanyard_core::cloud::CloudError;

    type Render = fn(&BrokerError) -> Response;
    type StatusOf = fn(ErrorClass, &BrokerError) -> u16;
    type Shape = fn(&[u8], &HeaderMap);

    /// Each surface's renderer, the status it gives each class, and a check
    /// of its body's shape.
    fn surfaces() -> Vec<(&'static str, Render, StatusOf, Shape)> {
        fn azure_status(class: ErrorClass, _: &BrokerError) -> u16 {
            match class {
                ErrorClass::NotFound | ErrorClass::BadRequest => 400,
                ErrorClass::Forbidden => 403,
                ErrorClass::Throttled => 429,
                ErrorClass::Unavailable => 503,
            }
        }
        fn plain_status(class: ErrorClass, _: &BrokerError) -> u16 {
            match class {
                ErrorClass::NotFound => 404,
                ErrorClass::BadRequest => 400,
                ErrorClass::Forbidden => 403,
                ErrorClass::Throttled => 429,
                ErrorClass::Unavailable => 503,
            }
        }
        fn imds_status(class: ErrorClass, err: &BrokerError) -> u16 {
            match (class, err) {
                // A failed role assumption is reported in the document.
                (_, BrokerError::Upstream(CloudError::Rejected { .. })) => 200,
                _ => plain_status(class, err),
            }
        }
        fn json_with(body: &[u8], fields: &[&str]) {
            let v: serde_json::Value = serde_json::from_slice(body).expect("a JSON body");
            for f in fields {
                assert!(v.get(f).is_some(), "{f} missing in {v}");
            }
        }
        vec![
            (
                "azure_imds",
                azure_imds::render_error,
                azure_status,
                |b, _| json_with(b, &["error", "error_description"]),
            ),
            (
                "app_service",
                app_service::render_error,
                azure_status,
                |b, _| json_with(b, &["statusCode", "message", "correlationId"]),
            ),
            ("gce", gce::render_error, plain_status, |b, h| {
                assert_eq!(h.get("metadata-flavor").unwrap(), "Google");
                assert!(!b.is_empty());
            }),
            (
                "aws_container",
                aws_container::render_error,
                plain_status,
                |b, _| json_with(b, &["code", "message"]),
            ),
            ("aws_imds", aws_imds::render_error, imds_status, |b, _| {
                assert!(!b.is_empty());
            }),
        ]
    }

    use aws_imds::Endpoint as Ec2;
    use azure_imds::Endpoint as Imds;

    #[test]
    fn token_paths_are_found_however_clients_spell_them() {
        for path in [
            "/metadata/identity/oauth2/token/",
            "/Metadata/identity/oauth2/token",
            "/METADATA/IDENTITY/OAUTH2/TOKEN/",
        ] {
            assert_eq!(classify(path), Route::AzureImds(Imds::Token), "{path}");
        }
        let token = app_service::Endpoint::Token;
        assert_eq!(classify("/msi/token/"), Route::AppService(token));
        assert_eq!(classify("/v1/credentials/"), Route::AwsContainer);
        assert_eq!(
            classify("/latest/meta-data/iam/security-credentials"),
            Route::AwsImds(Ec2::Roles)
        );
    }

    #[test]
    fn documented_paths_are_their_surfaces() {
        for (path, route) in [
            (azure_imds::TOKEN_PATH, Route::AzureImds(Imds::Token)),
            (
                app_service::PATH,
                Route::AppService(app_service::Endpoint::Token),
            ),
            ("/", Route::Gce),
            ("/computeMetadata", Route::Gce),
            ("/computeMetadata/", Route::Gce),
            (
                "/computeMetadata/v1/instance/service-accounts/default/token",
                Route::Gce,
            ),
            (aws_container::PATH, Route::AwsContainer),
            ("/latest/api/token", Route::AwsImds(Ec2::Session)),
            (aws_imds::ROLES_PATH, Route::AwsImds(Ec2::Roles)),
            (
                "/latest/meta-data/iam/security-credentials/ray-data",
                Route::AwsImds(Ec2::Role),
            ),
            (
                "/latest/meta-data/iam/security-credentials/a%2Fb",
                Route::AwsImds(Ec2::Role),
            ),
            (
                "/latest/meta-data/placement/region",
                Route::AwsImds(Ec2::Region),
            ),
            ("/healthz", Route::Probe),
            ("/readyz", Route::Probe),
        ] {
            assert_eq!(classify(path), route, "{path}");
            assert!(route.allowed().is_some(), "{path} answers some method");
        }
    }

    #[test]
    fn other_paths_belong_to_their_surface_or_none() {
        let other = Route::AzureImds(Imds::Other);
        for (path, route) in [
            ("/metadata/identity/getplatformmetadata", other),
            ("/metadata/identity/issuecredential", other),
            ("/metadata/instance", other),
            ("/metadata/identity/oauth2/token//", other),
            ("/metadata/identity/oauth2/tokens", other),
            (
                "/msi/other",
                Route::AppService(app_service::Endpoint::Other),
            ),
            ("/latest/user-data", Route::AwsImds(Ec2::Other)),
            ("/latest/api/token/", Route::AwsImds(Ec2::Other)),
            (
                "/latest/meta-data/iam/security-credentials/a/b",
                Route::AwsImds(Ec2::Other),
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

    #[tokio::test]
    async fn a_path_of_no_surface_names_every_surface() {
        let response = no_surface("/nowhere");
        assert_eq!(response.status(), 404);
        let body = to_bytes(response.into_body(), 1 << 16).await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            v["error_description"],
            "/nowhere is not served here. Lanyard serves /metadata/identity/oauth2/token (Azure IMDS), /msi/token (App Service), /computeMetadata/v1/ (GCE metadata), /v1/credentials (AWS container credentials) and /latest/ (AWS IMDSv2)"
        );
    }

    #[tokio::test]
    async fn every_class_renders_on_every_surface() {
        let mut seen = std::collections::HashSet::new();
        for (name, render, status_of, shape) in surfaces() {
            for err in lanyard_core::grant::samples() {
                let class = err.class();
                seen.insert(class);
                let resp = render(&err);
                let status = resp.status().as_u16();
                assert_eq!(status, status_of(class, &err), "{name}: {err:?}");
                let retry = resp.headers().get("retry-after").cloned();
                let headers = resp.headers().clone();
                let body = to_bytes(resp.into_body(), 1 << 20).await.unwrap();
                shape(&body, &headers);
                if class == ErrorClass::Throttled {
                    let wait = err.retry_after().expect("a throttled sample says how long");
                    assert_eq!(
                        retry.unwrap(),
                        wait.as_secs().to_string().as_str(),
                        "{name}: Retry-After"
                    );
                }
                // Refusals say who refused; nothing says more than it should.
                let text = String::from_utf8_lossy(&body);
                if let BrokerError::Upstream(CloudError::Rejected { code, .. }) = &err {
                    assert!(text.contains(code.as_str()), "{name}: {text}");
                }
                if matches!(err, BrokerError::Denied { .. }) {
                    assert!(text.contains("no-management"), "{name}: {text}");
                }
            }
        }
        assert_eq!(seen.len(), ErrorClass::ALL.len(), "every class walked");
    }
}
