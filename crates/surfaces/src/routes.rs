//! Which surface answers a request.
//!
//! The SDK surfaces serve a handful of fixed paths, and a cached credential
//! is answered in a few microseconds, so routing is a noticeable part of
//! each request. An axum router costs a route-table walk, a map of path
//! parameters and a boxed future per request (about a tenth of a cached
//! hit's instructions under callgrind). Here [`super::classify`] places
//! the path by a few string comparisons (each surface's own), the handler
//! is called directly, and its future lives in the connection's task.
//!
//! Measured against the same surfaces behind an axum router (a route per
//! surface, each handler calling the same `answer`): 1.16 times the
//! cached-hit requests/s at 0.85 times the CPU per request, in each of two
//! A B B A runs (`bench/compare`, release, 2 cores).

use std::future::Future;
use std::sync::Arc;

use axum::body::{Bytes, HttpBody};
use axum::http::Request;
use axum::response::Response;
use hyper::body::Incoming;
use tower::ServiceExt;

use super::{classify, Route, Surfaces};
use lanyard_http::Respond;

/// Every SDK-facing route on one listener (see [`super::router`]).
#[derive(Clone)]
pub struct SurfaceRouter {
    surfaces: Arc<Surfaces>,
    probes: Option<axum::Router>,
}

impl SurfaceRouter {
    pub(super) fn new(surfaces: Arc<Surfaces>) -> Self {
        SurfaceRouter {
            surfaces,
            probes: None,
        }
    }

    /// Hands `/healthz` and `/readyz` to `probes` (the sidecar's, served on
    /// the SDK port for the kubelet).
    pub fn with_probes(mut self, probes: axum::Router) -> Self {
        self.probes = Some(probes);
        self
    }

    /// The answer to `request`, from any body type (the listeners hand
    /// over hyper's; tests and the fuzzer build their own).
    pub async fn answer<B>(self, request: Request<B>) -> Response
    where
        B: HttpBody<Data = Bytes> + Send + 'static,
        B::Error: Into<axum::BoxError>,
    {
        let route = classify(request.uri().path());
        if let (Route::Probe, Some(probes)) = (route, self.probes) {
            return match probes.oneshot(request).await {
                Ok(response) => response,
                Err(never) => match never {},
            };
        }
        // No surface reads a body.
        let (parts, _body) = request.into_parts();
        // A probe path without its probes (`lanyard dev`) is no one's.
        super::answer(route, &self.surfaces, &parts).await
    }
}

impl Respond for SurfaceRouter {
    fn respond(
        self,
        request: hyper::Request<Incoming>,
    ) -> impl Future<Output = Response> + Send + 'static {
        self.answer(request)
    }
}

#[cfg(test)]
mod tests {
    //! Each method and path reaches the surface it belongs to (seen by the
    //! request that surface makes of the broker), and nothing else does.

    use std::sync::Mutex;

    use axum::body::{to_bytes, Body};

    use super::*;
    use crate::aws_imds::SessionTokens;
    use crate::SubjectTokens;
    use axum::http::Method;
    use lanyard_core::cloud::{Cloud, Kind, Selector, Surface, TokenRequest};
    use lanyard_core::grant::{BrokerError, Grant, TokenBroker};
    use lanyard_core::secret::SecretString;

    /// Records what it was asked and refuses it (as an unbound identity).
    #[derive(Default)]
    struct Recording(Mutex<Vec<TokenRequest>>);

    #[async_trait::async_trait]
    impl TokenBroker for Recording {
        async fn request(
            &self,
            _subject: &SecretString,
            request: &TokenRequest,
        ) -> Result<Grant, BrokerError> {
            self.0.lock().unwrap().push(request.clone());
            Err(BrokerError::IdentityNotFound)
        }
    }

    struct Subject;

    #[async_trait::async_trait]
    impl SubjectTokens for Subject {
        async fn token(&self, _cloud: Cloud) -> Result<Arc<SecretString>, String> {
            Ok(Arc::new(SecretString::from("projected-token")))
        }
    }

    const IDENTITY_HEADER: &str = "identity-header-secret";

    fn router() -> (SurfaceRouter, Arc<Recording>, String) {
        let broker = Arc::new(Recording::default());
        let imds_sessions = SessionTokens::new();
        let session = imds_sessions.issue(60);
        let surfaces = Surfaces {
            broker: broker.clone(),
            subjects: Arc::new(Subject),
            identity_header: SecretString::from(IDENTITY_HEADER),
            app_token: None,
            imds_sessions,
            defaults: super::super::sdk_env::SdkDefaults {
                azure_tenant_id: None,
                aws_region: Some("eu-west-1".into()),
                gcp_universe_domain: None,
            },
        };
        (super::super::router(Arc::new(surfaces)), broker, session)
    }

    /// The status, `Allow`, body, and the request the broker saw.
    async fn send(
        router: &SurfaceRouter,
        broker: &Recording,
        method: Method,
        uri: &str,
        headers: &[(&str, &str)],
    ) -> (u16, Option<String>, String, Option<TokenRequest>) {
        let mut request = Request::builder().method(method).uri(uri);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = router
            .clone()
            .answer(request.body(Body::empty()).unwrap())
            .await;
        let status = response.status().as_u16();
        let allow = response
            .headers()
            .get("allow")
            .map(|v| v.to_str().unwrap().to_string());
        let body = to_bytes(response.into_body(), 1 << 16).await.unwrap();
        let asked = broker.0.lock().unwrap().pop();
        (status, allow, String::from_utf8_lossy(&body).into(), asked)
    }

    /// A request (method, target, headers) and the broker request its
    /// surface makes of it.
    type Case<'a> = (
        Method,
        &'a str,
        &'a [(&'a str, &'a str)],
        Surface,
        Kind,
        Option<Selector>,
    );

    #[tokio::test]
    async fn each_path_reaches_its_surface() {
        let (router, broker, session) = router();
        let imds = "/metadata/identity/oauth2/token?api-version=2018-02-01&resource=https%3A%2F%2Fvault.azure.net";
        let app = "/msi/token?api-version=2019-08-01&resource=https%3A%2F%2Fvault.azure.net";
        let gce =
            "/computeMetadata/v1/instance/service-accounts/ray@p.iam.gserviceaccount.com/token";
        let role = "/latest/meta-data/iam/security-credentials/ray%20data";
        let imds_v2 = [("x-aws-ec2-metadata-token", session.as_str())];
        let cases: [Case; 6] = [
            (
                Method::GET,
                imds,
                &[("metadata", "true")],
                Surface::AzureImds,
                Kind::AccessToken,
                None,
            ),
            // HEAD is answered as GET is (hyper leaves out the body).
            (
                Method::HEAD,
                imds,
                &[("metadata", "true")],
                Surface::AzureImds,
                Kind::AccessToken,
                None,
            ),
            (
                Method::GET,
                app,
                &[("x-identity-header", IDENTITY_HEADER)],
                Surface::AppService,
                Kind::AccessToken,
                None,
            ),
            (
                Method::GET,
                gce,
                &[("metadata-flavor", "Google")],
                Surface::Gce,
                Kind::AccessToken,
                Some(Selector::Email("ray@p.iam.gserviceaccount.com".into())),
            ),
            (
                Method::GET,
                crate::aws_imds::ROLES_PATH,
                &imds_v2,
                Surface::AwsImds,
                Kind::Identity,
                None,
            ),
            (
                Method::GET,
                role,
                &imds_v2,
                Surface::AwsImds,
                Kind::AwsCredentials,
                Some(Selector::RoleName("ray data".into())),
            ),
        ];
        for (method, uri, headers, surface, kind, selector) in cases {
            let (status, _, body, asked) =
                send(&router, &broker, method.clone(), uri, headers).await;
            let asked =
                asked.unwrap_or_else(|| panic!("{method} {uri}: no request ({status} {body})"));
            assert_eq!(
                (asked.surface, asked.kind),
                (surface, kind),
                "{method} {uri}"
            );
            assert_eq!(asked.selector, selector, "{method} {uri}");
            // The broker's refusal, rendered by the surface.
            assert!(
                matches!(status, 400 | 404),
                "{method} {uri}: {status} {body}"
            );
        }

        // Paths the surfaces answer without the broker.
        let (status, _, body, asked) = send(
            &router,
            &broker,
            Method::PUT,
            "/latest/api/token",
            &[("x-aws-ec2-metadata-token-ttl-seconds", "60")],
        )
        .await;
        assert_eq!((status, asked), (200, None));
        assert!(!body.is_empty());
        let (status, _, body, _) = send(
            &router,
            &broker,
            Method::GET,
            "/latest/meta-data/placement/region",
            &imds_v2,
        )
        .await;
        assert_eq!((status, body.as_str()), (200, "eu-west-1"));
        let (status, _, body, _) = send(
            &router,
            &broker,
            Method::GET,
            "/",
            &[("metadata-flavor", "Google")],
        )
        .await;
        assert_eq!((status, body.as_str()), (200, "computeMetadata/\n"));
        // No container token file: the endpoint says it is off.
        let (status, _, body, asked) =
            send(&router, &broker, Method::GET, AWS_CONTAINER_PATH, &[]).await;
        assert_eq!((status, asked), (404, None), "{body}");
        assert!(body.contains("not enabled"), "{body}");
    }

    #[tokio::test]
    async fn a_wrong_method_is_405_with_allow_in_the_surfaces_shape() {
        let (router, broker, _) = router();
        for (method, path, allow, shape) in [
            (
                Method::POST,
                IMDS_TOKEN,
                "GET,HEAD",
                "\"error\":\"invalid_request\"",
            ),
            (
                Method::DELETE,
                "/msi/token",
                "GET,HEAD",
                "\"statusCode\":405",
            ),
            (
                Method::POST,
                "/v1/credentials",
                "GET,HEAD",
                "\"code\":\"MethodNotAllowed\"",
            ),
            (
                Method::PUT,
                "/computeMetadata/v1/",
                "GET,HEAD",
                "GET,HEAD is allowed",
            ),
            (Method::GET, "/latest/api/token", "PUT", ""),
            (Method::PUT, crate::aws_imds::ROLES_PATH, "GET,HEAD", ""),
            (
                Method::POST,
                "/latest/meta-data/iam/security-credentials/r",
                "GET,HEAD",
                "",
            ),
        ] {
            let (status, allowed, body, asked) =
                send(&router, &broker, method.clone(), path, &[]).await;
            assert_eq!(status, 405, "{method} {path}: {body}");
            assert_eq!(allowed.as_deref(), Some(allow), "{method} {path}");
            assert!(body.contains(shape), "{method} {path}: {body}");
            assert!(asked.is_none(), "{method} {path} reached the broker");
        }
    }

    #[tokio::test]
    async fn probes_are_served_only_where_given() {
        let (router, broker, _) = router();
        let (status, _, _, _) = send(&router, &broker, Method::GET, "/healthz", &[]).await;
        assert_eq!(status, 404);
        let probes = axum::Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
        let router = router.with_probes(probes);
        let (status, _, body, _) = send(&router, &broker, Method::GET, "/healthz", &[]).await;
        assert_eq!((status, body.as_str()), (200, "ok"));
        // The surfaces are still served beside them.
        let (status, _, _, asked) = send(
            &router,
            &broker,
            Method::GET,
            "/computeMetadata/v1/instance/service-accounts/default/email",
            &[("metadata-flavor", "Google")],
        )
        .await;
        assert_eq!(status, 404);
        assert_eq!(asked.map(|r| r.kind), Some(Kind::Identity));
    }

    #[tokio::test]
    async fn a_role_that_is_not_utf8_is_not_found_without_asking() {
        let (router, broker, session) = router();
        let (status, _, body, asked) = send(
            &router,
            &broker,
            Method::GET,
            "/latest/meta-data/iam/security-credentials/%ff%fe",
            &[("x-aws-ec2-metadata-token", session.as_str())],
        )
        .await;
        assert_eq!((status, body.as_str(), asked), (404, "Not Found", None));
    }

    const IMDS_TOKEN: &str = crate::azure_imds::TOKEN_PATH;
    const AWS_CONTAINER_PATH: &str = crate::aws_container::PATH;
}
