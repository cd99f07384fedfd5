//! Every SDK surface (Azure IMDS, App Service, GCE metadata, AWS container
//! credentials, IMDSv2) and the node agent's API, from the bytes of one
//! HTTP request.
//!
//! The input reads like a request on the wire, so that seeds are real
//! request lines and the fuzzer mutates those:
//!
//! ```text
//! GET /metadata/identity/oauth2/token?api-version=2018-02-01&resource=... HTTP/1.1
//! Metadata: true
//!
//! (body, for the agent's POST /v1/token)
//! ```
//!
//! The request goes through [`lanyard::serve::router`] and
//! [`lanyard::serve::agent_api::router`] exactly as the listeners hand it
//! over, with the real [`Broker`] behind them: the caller's token checked
//! (claims, not signature, as a standalone sidecar does), bindings,
//! selectors, policy, cache and audit as in production. Only the upstream
//! exchange is replaced ([`Offline`]): it answers canned credentials
//! without a network. A fresh broker and runtime per input keep inputs
//! independent, so a crash replays from its file alone.
//!
//! A request that HTTP/1 framing would refuse (a bad method, target or
//! header name) is skipped, as hyper would refuse it before any handler.
//! Two values no fuzzer can guess are spelled as placeholders in header
//! values: `{subject}` (the pod's projected token, which the sidecar sends
//! the agent) and `{imds-token}` (a valid IMDSv2 session token).
//!
//! Beside "never panics", three properties are checked:
//! - no answer ever carries the pod's projected token;
//! - a credential is only ever handed out to a request that passed one of
//!   the surfaces' SSRF guards (`Metadata: true`, `Metadata-Flavor:
//!   Google`, the App Service identity header, the container authorization
//!   token, a valid IMDSv2 session, or the agent's bearer token), through
//!   no proxy, by GET (POST on the agent);
//! - no answer is a 5xx other than 503 (a retryable "unavailable"): a 500
//!   would be a handler failing on input it should have refused.
//!
//! Every request the surfaces make of the broker must also survive the
//! sidecar-to-agent wire (JSON) unchanged.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Uri};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use tower::ServiceExt;

use lanyard::broker::{BrokerError, Grant, TokenBroker};
use lanyard::cloud::aws::{AwsCloud, AwsCredentials, AwsExchanger};
use lanyard::cloud::azure::{AzureCloud, AzureExchanger, FEDERATION_AUDIENCE, PUBLIC_CLOUD};
use lanyard::cloud::gcp::{GcpCloud, GcpExchanger};
use lanyard::cloud::{azure, Bindings};
use lanyard::cloud::{
    AccessToken, Cloud, CloudExchanger, Credential, Fetcher, Identity, Kind, RequestError,
    Selector, TokenRequest,
};
use lanyard::directory::file::FixedDirectory;
use lanyard::secret::SecretString;
use lanyard::serve::aws_imds::SessionTokens;
use lanyard::serve::container_token::ContainerToken;
use lanyard::serve::{SubjectTokens, Surfaces, PROXY_HEADERS};
use lanyard::token::{Caller, Verifier};

/// The App Service endpoint's shared secret (`X-IDENTITY-HEADER`).
const IDENTITY_HEADER: &str = "fuzz-identity-header-5f0c2d9a";
/// The contents of `AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE`.
const CONTAINER_TOKEN: &str = "fuzz-container-authorization-7b1e4c3f";
/// The canned credentials' secret parts: they appear in an answer only when
/// a credential was handed out.
const ACCESS_TOKEN: &str = "fuzz-canned-access-token-2b8d";
const ID_TOKEN: &str = "fuzz-canned-id-token-9e4a";
const AWS_SECRET_KEY: &str = "fuzz-canned-aws-secret-key-61c0";
const AWS_SESSION_TOKEN: &str = "fuzz-canned-aws-session-token-d37f";
const CANNED_SECRETS: [&str; 4] = [ACCESS_TOKEN, ID_TOKEN, AWS_SECRET_KEY, AWS_SESSION_TOKEN];

/// The bound identities (shapes from the repository's tests).
const AZURE_CLIENT: &str = "11111111-2222-3333-4444-555555555555";
const AZURE_TENANT: &str = "72f988bf-86f1-41af-91ab-2d7cd011db47";
const GCP_EMAIL: &str = "ray@team-a.iam.gserviceaccount.com";
const GCP_PROVIDER: &str = "//iam.googleapis.com/projects/123456789012/locations/global/workloadIdentityPools/lanyard-dev/providers/dev-cluster";
const AWS_ROLE: &str = "arn:aws:iam::123456789012:role/ray-data";

/// Longest body read back from an answer.
const MAX_ANSWER: usize = 1 << 20;

/// Runs one input.
pub fn run(data: &[u8]) {
    let Some(raw) = RawRequest::parse(data) else {
        return;
    };
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    let Ok(token_file) = tempfile::NamedTempFile::new() else {
        return;
    };
    if std::fs::write(token_file.path(), CONTAINER_TOKEN).is_err() {
        return;
    }
    runtime.block_on(async {
        let broker: Arc<dyn TokenBroker> = Arc::new(WireChecked(broker()));
        let imds_sessions = SessionTokens::new();
        let imds_token = imds_sessions.issue(60);
        let surfaces = Arc::new(Surfaces {
            broker: broker.clone(),
            subjects: Arc::new(Subjects),
            identity_header: SecretString::from(IDENTITY_HEADER),
            app_token: Some(ContainerToken::new(token_file.path())),
            imds_sessions,
            defaults: lanyard::serve::sdk_env::SdkDefaults {
                azure_tenant_id: None,
                aws_region: Some("us-east-1".into()),
                gcp_universe_domain: None,
            },
        });

        if let Some(request) = raw.build(&imds_token) {
            let guarded = sdk_guard_passed(request.headers(), &surfaces.imds_sessions)
                && !forwarded(request.headers())
                && matches!(*request.method(), Method::GET | Method::HEAD);
            let answer = lanyard::serve::router(surfaces.clone())
                .answer(request)
                .await;
            check(Ok(answer), guarded, "SDK surfaces").await;
        }
        if let Some(request) = raw.build(&imds_token) {
            let guarded = request
                .headers()
                .get("authorization")
                .is_some_and(|v| v.as_bytes() == format!("Bearer {}", subject()).as_bytes())
                && request.method() == Method::POST;
            let answer = lanyard::serve::agent_api::router(broker)
                .oneshot(request)
                .await;
            check(answer, guarded, "agent API").await;
        }
    });
}

/// Checks one answer's status, headers and body.
async fn check(
    answer: Result<axum::response::Response, std::convert::Infallible>,
    guarded: bool,
    listener: &str,
) {
    let Ok(answer) = answer;
    let status = answer.status();
    assert!(
        !status.is_server_error() || status.as_u16() == 503,
        "{listener} answered {status}"
    );
    let headers = answer.headers().clone();
    let Ok(body) = axum::body::to_bytes(answer.into_body(), MAX_ANSWER).await else {
        return;
    };
    let text = String::from_utf8_lossy(&body);
    let subject = subject();
    assert!(
        !text.contains(subject.as_str()),
        "{listener} echoed the pod's projected token in its body"
    );
    for (name, value) in &headers {
        assert!(
            !String::from_utf8_lossy(value.as_bytes()).contains(subject.as_str()),
            "{listener} echoed the pod's projected token in header {name}"
        );
    }
    if let Some(secret) = CANNED_SECRETS.iter().find(|s| text.contains(**s)) {
        assert!(
            guarded,
            "{listener} handed out a credential ({secret}) to a request that passed no guard"
        );
    }
}

/// Whether the request carries one of the SDK surfaces' guards, right.
fn sdk_guard_passed(headers: &HeaderMap, sessions: &SessionTokens) -> bool {
    let is = |name: &str, want: &str| {
        headers
            .get(name)
            .is_some_and(|v| v.as_bytes() == want.as_bytes())
    };
    headers
        .get("metadata")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"))
        || is("metadata-flavor", "Google")
        || is("x-identity-header", IDENTITY_HEADER)
        || is("authorization", CONTAINER_TOKEN)
        || headers
            .get("x-aws-ec2-metadata-token")
            .is_some_and(|v| sessions.is_valid(v.as_bytes()))
}

fn forwarded(headers: &HeaderMap) -> bool {
    headers.keys().any(|k| PROXY_HEADERS.contains(&k.as_str()))
}

/// The input, split as HTTP/1 frames a request.
struct RawRequest<'a> {
    method: &'a [u8],
    target: &'a [u8],
    headers: Vec<(&'a [u8], &'a [u8])>,
    body: &'a [u8],
}

impl<'a> RawRequest<'a> {
    /// Most header lines read (hyper's default limit is 100).
    const MAX_HEADERS: usize = 100;

    fn parse(data: &'a [u8]) -> Option<Self> {
        let (head, body) = match find(data, b"\r\n\r\n") {
            Some(i) => (&data[..i], &data[i + 4..]),
            None => match find(data, b"\n\n") {
                Some(i) => (&data[..i], &data[i + 2..]),
                None => (data, &[][..]),
            },
        };
        let mut lines = head
            .split(|b| *b == b'\n')
            .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
        let mut first = lines.next()?.splitn(3, |b| *b == b' ');
        let method = first.next()?;
        let target = first.next()?;
        let headers = lines
            .take(Self::MAX_HEADERS)
            .filter_map(|line| {
                let colon = line.iter().position(|b| *b == b':')?;
                let value = &line[colon + 1..];
                let start = value.iter().position(|b| *b != b' ' && *b != b'\t');
                let value = start.map_or(&[][..], |s| &value[s..]);
                Some((&line[..colon], value))
            })
            .collect();
        Some(RawRequest {
            method,
            target,
            headers,
            body,
        })
    }

    /// The request, placeholders filled in; `None` where hyper would
    /// refuse it.
    fn build(&self, imds_token: &str) -> Option<Request<Body>> {
        let method = Method::from_bytes(self.method).ok()?;
        let uri = Uri::try_from(self.target).ok()?;
        let mut builder = Request::builder().method(method).uri(uri);
        for (name, value) in &self.headers {
            let name = HeaderName::from_bytes(name).ok()?;
            let value = replace(value, b"{subject}", subject().as_bytes());
            let value = replace(&value, b"{imds-token}", imds_token.as_bytes());
            let value = HeaderValue::from_bytes(&value).ok()?;
            builder = builder.header(name, value);
        }
        builder.body(Body::from(self.body.to_vec())).ok()
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn replace(text: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = find(rest, from) {
        out.extend_from_slice(&rest[..i]);
        out.extend_from_slice(to);
        rest = &rest[i + from.len()..];
    }
    out.extend_from_slice(rest);
    out
}

/// The pod's projected token: unsigned (a standalone sidecar's verifier
/// checks claims, not signatures), for every cloud's audience, valid for
/// an hour from the process's first use.
fn subject() -> &'static String {
    static TOKEN: OnceLock<String> = OnceLock::new();
    TOKEN.get_or_init(|| {
        let now = super::now();
        let header = r#"{"alg":"RS256","kid":"fuzz"}"#;
        let claims = serde_json::json!({
            "iss": "https://kubernetes.default.svc.cluster.local",
            "sub": "system:serviceaccount:ml:ray",
            "aud": [FEDERATION_AUDIENCE, GCP_PROVIDER, "sts.amazonaws.com"],
            "exp": now + 3600,
            "iat": now,
            "nbf": now,
            "kubernetes.io": {
                "namespace": "ml",
                "serviceaccount": {"name": "ray", "uid": "0d4c5c6b-1f7e-4a55-9d3e-3b7d2c1a0f99"},
                "pod": {"name": "raycluster-worker-0", "uid": "8a1b2c3d-4e5f-4a7b-8c9d-0e1f2a3b4c5d"},
                "node": {"name": "node-a", "uid": "5e6f7a8b-9c0d-4e1f-8a2b-3c4d5e6f7a8b"}
            }
        });
        format!(
            "{}.{}.c2lnbmF0dXJl",
            URL_SAFE_NO_PAD.encode(header),
            URL_SAFE_NO_PAD.encode(claims.to_string())
        )
    })
}

struct Subjects;

#[async_trait::async_trait]
impl SubjectTokens for Subjects {
    async fn token(&self, _: Cloud) -> Result<Arc<SecretString>, String> {
        Ok(Arc::new(SecretString::from(subject().clone())))
    }
}

/// The production pipeline over the three clouds as `lanyard agent`
/// configures them, with offline exchanges.
fn broker() -> lanyard::broker::Broker {
    static HTTP: OnceLock<reqwest::Client> = OnceLock::new();
    let http = HTTP.get_or_init(lanyard::http::client);
    let bindings = Bindings {
        azure: vec![azure::Binding {
            client_id: AZURE_CLIENT.into(),
            tenant_id: None,
            object_id: Some("22222222-3333-4444-5555-666666666666".into()),
            resource_id: Some("/subscriptions/x/resourceGroups/y/providers/Microsoft.ManagedIdentity/userAssignedIdentities/ray".into()),
            app: None,
        }],
        gcp: vec![GCP_EMAIL.into()],
        aws: vec![AWS_ROLE.into()],
    };
    lanyard::broker::Broker::new(
        Verifier::local_files(),
        Arc::new(FixedDirectory(Arc::new(bindings))),
    )
    .with_cloud(Offline(AzureCloud {
        exchanger: AzureExchanger::new(http.clone(), PUBLIC_CLOUD),
        default_tenant: Some(AZURE_TENANT.into()),
        audience: FEDERATION_AUDIENCE.into(),
        exchange_audience: FEDERATION_AUDIENCE.into(),
        first_hops: Default::default(),
        node_identities: Default::default(),
        node_imds: lanyard::cloud::azure::NodeImds::new(
            http.clone(),
            lanyard::cloud::azure::DEFAULT_IMDS_ENDPOINT,
        ),
        identity_binding: None,
    }))
    .with_cloud(Offline(GcpCloud {
        exchanger: GcpExchanger::new(
            http.clone(),
            "https://sts.googleapis.com",
            "https://iamcredentials.googleapis.com",
        ),
        provider: GCP_PROVIDER.into(),
        audience: GCP_PROVIDER.into(),
        project_id: "team-a".into(),
        project_number: "123456789012".into(),
        token_lifetime: Duration::from_secs(3600),
    }))
    .with_cloud(Offline(AwsCloud {
        exchanger: AwsExchanger::new(http.clone(), "https://sts.us-east-1.amazonaws.com"),
        audience: "sts.amazonaws.com".into(),
        session_duration: Duration::from_secs(3600),
        region: "us-east-1".into(),
        cluster_arn: None,
    }))
}

/// Checks that each request the surfaces make survives the JSON wire
/// between a sidecar and the node agent, then decides it.
struct WireChecked(lanyard::broker::Broker);

#[async_trait::async_trait]
impl TokenBroker for WireChecked {
    async fn request(
        &self,
        subject: &SecretString,
        request: &TokenRequest,
    ) -> Result<Grant, BrokerError> {
        let wire = serde_json::to_string(request).expect("a TokenRequest serializes");
        let back: TokenRequest =
            serde_json::from_str(&wire).expect("a serialized TokenRequest deserializes");
        assert_eq!(&back, request, "the request changed on the wire: {wire}");
        self.0.request(subject, request).await
    }
}

/// A cloud whose every decision is the real one's, and whose exchange
/// answers a canned credential of the kind asked, valid for an hour.
struct Offline<E>(E);

impl<E: CloudExchanger> CloudExchanger for Offline<E> {
    type Binding = E::Binding;

    fn cloud(&self) -> Cloud {
        self.0.cloud()
    }

    fn audience(&self) -> &str {
        self.0.audience()
    }

    fn kinds(&self) -> &'static [Kind] {
        self.0.kinds()
    }

    fn bind(&self, bindings: &Bindings, caller: &Caller) -> Result<Vec<E::Binding>, RequestError> {
        self.0.bind(bindings, caller)
    }

    fn identity(&self, binding: &E::Binding) -> Identity {
        self.0.identity(binding)
    }

    fn selects(&self, binding: &E::Binding, selector: &Selector) -> bool {
        self.0.selects(binding, selector)
    }

    fn scope(&self, binding: &E::Binding, request: &TokenRequest) -> Result<String, RequestError> {
        self.0.scope(binding, request)
    }

    fn lifetime(&self, binding: &E::Binding, request: &TokenRequest) -> Option<Duration> {
        self.0.lifetime(binding, request)
    }

    fn fetcher(&self, _: &E::Binding, request: &TokenRequest, _: &Caller) -> Fetcher {
        lanyard::cloud::fetcher(request.kind, |kind, _subject| async move {
            let now = super::now();
            let bearer = |token: &str| AccessToken {
                rendered: Default::default(),
                token: SecretString::from(token),
                issued_at: now,
                expires_at: now + 3600,
            };
            Ok(match *kind {
                Kind::AwsCredentials => Credential::Aws(AwsCredentials {
                    rendered: Default::default(),
                    access_key_id: "ASIAQX5EXAMPLE7KEYID".into(),
                    secret_access_key: SecretString::from(AWS_SECRET_KEY),
                    session_token: SecretString::from(AWS_SESSION_TOKEN),
                    expires_at: now + 3600,
                    issued_at: now,
                    account_id: "123456789012".into(),
                    assumed_role_arn: "arn:aws:sts::123456789012:assumed-role/ray-data/ml_ray"
                        .into(),
                }),
                Kind::IdToken => Credential::IdToken(bearer(ID_TOKEN)),
                Kind::AccessToken | Kind::Identity => Credential::Token(bearer(ACCESS_TOKEN)),
            })
        })
    }
}
