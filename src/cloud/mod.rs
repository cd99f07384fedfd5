//! The cloud model and the exchangers.
//!
//! This module is the vocabulary every layer shares: which clouds exist
//! ([`Cloud`], one table of their properties), the uniform request a
//! surface makes ([`TokenRequest`], in `request`), the credentials an
//! exchange yields ([`Credential`]), and the typed errors of an upstream
//! ([`CloudError`]). Each cloud then has one module (`azure`, `gcp`, `aws`)
//! with its upstream client and its [`CloudExchanger`]: how a
//! ServiceAccount's bindings name its identity, how a selector matches it,
//! how a request is keyed in the cache, and the exchange itself. Endpoints
//! are overridable (sovereign clouds, private endpoints, emulators).
//!
//! Nothing here knows about the broker's pipeline, the cache or the wire
//! formats: data flows from the surfaces through the broker to here.

pub mod aws;
pub mod azure;
mod exchanger;
pub mod gcp;
mod rendered;
mod request;
pub(crate) mod send;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::secret::SecretString;

pub use aws::AwsCredentials;
pub use exchanger::CloudExchanger;
pub use rendered::{BodyKey, Form, RenderedBody};
pub use request::{Identity, Kind, RequestError, Selector, Source, TokenRequest, Via};

/// The clouds Lanyard brokers for.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Cloud {
    /// Microsoft Entra ID (Azure).
    Azure,
    /// Google Cloud.
    Gcp,
    /// Amazon Web Services.
    Aws,
}

/// The SDK-facing endpoint a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Surface {
    /// Azure IMDS, `/metadata/identity/oauth2/token`.
    AzureImds,
    /// The App Service managed-identity endpoint (`IDENTITY_ENDPOINT`,
    /// `/msi/token`).
    AppService,
    /// The GCE metadata server, `/computeMetadata/v1/…`.
    Gce,
    /// The ECS/EKS container credentials endpoint, `/v1/credentials`.
    AwsContainer,
    /// EC2 IMDSv2, `/latest/meta-data/iam/security-credentials/…`.
    AwsImds,
}

impl Surface {
    /// Every surface, in a fixed order: the one list of them (the serving
    /// layer's answer to an unknown path names each from here).
    pub const ALL: [Surface; 5] = [
        Surface::AzureImds,
        Surface::AppService,
        Surface::Gce,
        Surface::AwsContainer,
        Surface::AwsImds,
    ];

    /// The name used in audit records, metrics and policy context.
    pub fn name(self) -> &'static str {
        match self {
            Surface::AzureImds => "azure_imds",
            Surface::AppService => "app_service",
            Surface::Gce => "gce",
            Surface::AwsContainer => "aws_container",
            Surface::AwsImds => "aws_imds",
        }
    }
}

/// What differs between clouds in how their credentials are cached and
/// rate-limited: one row per cloud, in [`Cloud::ALL`] order.
struct Row {
    cloud: Cloud,
    name: &'static str,
    /// The upstream token service as users know it, for error messages.
    upstream: &'static str,
    /// Least remaining lifetime with which a cached credential is served:
    /// what keeps the cloud's SDKs from refreshing on every call (botocore
    /// refreshes under 15 min; MSAL treats under 5 min as expired).
    min_remaining: Duration,
    /// Refresh a cached credential no later than this before its expiry.
    refresh_window: Duration,
    /// Default upstream exchanges per second.
    default_rate: f64,
    /// Its upstream rate's configuration key.
    rate_key: &'static str,
    /// The ServiceAccount annotation that names its identity.
    binding_annotation: &'static str,
    /// Whether a ServiceAccount without that annotation still has an
    /// identity of this cloud (Google's federated principal).
    implicit_identity: bool,
    /// The surface a request is assumed to come from when only the cloud
    /// is known (policy test cases).
    surface: Surface,
    /// Whether its SDKs present the pod's app-facing token (the AWS
    /// container protocol's authorization token).
    app_token: bool,
}

const TABLE: [Row; Cloud::COUNT] = [
    Row {
        cloud: Cloud::Azure,
        name: "azure",
        upstream: "Entra ID",
        min_remaining: Duration::from_secs(5 * 60),
        refresh_window: Duration::from_secs(10 * 60),
        default_rate: 50.0,
        rate_key: "cache.rate_azure",
        binding_annotation: azure::annotations::CLIENT_ID,
        implicit_identity: false,
        surface: Surface::AzureImds,
        app_token: false,
    },
    Row {
        cloud: Cloud::Gcp,
        name: "gcp",
        upstream: "Google",
        min_remaining: Duration::from_secs(5 * 60),
        refresh_window: Duration::from_secs(10 * 60),
        // Google STS: 6,000 a minute per project.
        default_rate: 100.0,
        rate_key: "cache.rate_gcp",
        binding_annotation: gcp::annotations::SERVICE_ACCOUNT,
        implicit_identity: true,
        surface: Surface::Gce,
        app_token: false,
    },
    Row {
        cloud: Cloud::Aws,
        name: "aws",
        upstream: "AWS STS",
        min_remaining: Duration::from_secs(15 * 60),
        refresh_window: Duration::from_secs(20 * 60),
        default_rate: 50.0,
        rate_key: "cache.rate_aws",
        binding_annotation: aws::annotations::ROLE_ARN,
        implicit_identity: false,
        surface: Surface::AwsContainer,
        app_token: true,
    },
];

impl Cloud {
    /// How many clouds there are.
    pub const COUNT: usize = 3;
    /// Every cloud, in a fixed order.
    pub const ALL: [Cloud; Cloud::COUNT] = [Cloud::Azure, Cloud::Gcp, Cloud::Aws];

    fn row(self) -> &'static Row {
        let row = &TABLE[self as usize];
        // INVARIANT: TABLE is in declaration order (checked by a test).
        debug_assert_eq!(row.cloud, self);
        row
    }

    /// The cloud's name in configuration, metrics, audit and file names.
    pub fn name(self) -> &'static str {
        self.row().name
    }

    /// The upstream token service's name as users know it ("Entra ID").
    pub fn upstream(self) -> &'static str {
        self.row().upstream
    }

    /// The cloud named `name`, if any.
    pub fn from_name(name: &str) -> Option<Cloud> {
        Cloud::ALL.into_iter().find(|c| c.name() == name)
    }

    /// Least remaining lifetime with which a credential is served from cache.
    pub fn min_remaining(self) -> Duration {
        self.row().min_remaining
    }

    /// Refresh no later than this before expiry.
    pub fn refresh_window(self) -> Duration {
        self.row().refresh_window
    }

    /// Default upstream exchanges per second.
    pub fn default_rate(self) -> f64 {
        self.row().default_rate
    }

    /// The configuration key of its upstream rate (`cache.rate_NAME`).
    pub fn rate_key(self) -> &'static str {
        self.row().rate_key
    }

    /// The ServiceAccount annotation that names this cloud's identity.
    pub fn binding_annotation(self) -> &'static str {
        self.row().binding_annotation
    }

    /// Every cloud's binding annotation, each followed by `suffix`, as one
    /// phrase for messages: `a, b or c`.
    pub fn binding_annotations(suffix: &str) -> String {
        let names = Cloud::ALL.map(|c| format!("{}{suffix}", c.binding_annotation()));
        match names.split_last() {
            Some((last, [])) => last.clone(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
            None => String::new(),
        }
    }

    /// Whether a ServiceAccount has an identity of this cloud without
    /// naming one (Google's federated principal).
    pub fn implicit_identity(self) -> bool {
        self.row().implicit_identity
    }

    /// The surface assumed when only the cloud is known.
    pub fn surface(self) -> Surface {
        self.row().surface
    }

    /// Whether this cloud's SDKs present the pod's app-facing token.
    pub fn app_token(self) -> bool {
        self.row().app_token
    }

    /// Every audience under which this cloud accepts a token the cluster
    /// issues, given the one Lanyard is configured with: what a pod's own
    /// containers must not be given (the webhook's guard).
    pub fn accepted_audiences(self, configured: &str) -> Vec<String> {
        match self {
            Cloud::Azure => azure::accepted_audiences(configured),
            Cloud::Gcp => gcp::accepted_audiences(configured),
            Cloud::Aws => vec![configured.to_string()],
        }
    }
}

impl fmt::Display for Cloud {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One value per cloud, indexed by [`Cloud`] (a table keyed by cloud, not a
/// positional array whose order callers must remember).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PerCloud<T>([T; Cloud::COUNT]);

impl<T> PerCloud<T> {
    /// The table with `f(cloud)` for every cloud.
    pub fn from_fn(mut f: impl FnMut(Cloud) -> T) -> Self {
        PerCloud(Cloud::ALL.map(&mut f))
    }

    /// Each cloud with its value.
    pub fn iter(&self) -> impl Iterator<Item = (Cloud, &T)> {
        Cloud::ALL.into_iter().zip(self.0.iter())
    }

    /// The table with `f` applied to every value.
    pub fn map<U>(self, f: impl FnMut(T) -> U) -> PerCloud<U> {
        PerCloud(self.0.map(f))
    }
}

impl<T> std::ops::Index<Cloud> for PerCloud<T> {
    type Output = T;
    fn index(&self, cloud: Cloud) -> &T {
        &self.0[cloud as usize]
    }
}

impl<T> std::ops::IndexMut<Cloud> for PerCloud<T> {
    fn index_mut(&mut self, cloud: Cloud) -> &mut T {
        &mut self.0[cloud as usize]
    }
}

/// ServiceAccount annotations, as the directory reads them.
pub type Annotations = std::collections::BTreeMap<String, String>;

/// An annotation's value, trimmed; empty counts as absent, as the clouds'
/// own webhooks treat it.
pub(crate) fn annotation(annotations: &Annotations, key: &str) -> Option<String> {
    annotations
        .get(key)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// Most identities of one cloud that one ServiceAccount may list (its
/// single-value annotation and its list annotation together); entries past
/// it are dropped with a warning. Bounded because a request selecting none
/// of them is compared against each, and a listing decides each.
pub const MAX_IDENTITIES: usize = 8;

/// A list annotation's entries: separated by commas or whitespace, empty
/// ones dropped. Order is kept: the first listed is the default.
pub(crate) fn listed(annotations: &Annotations, key: &str) -> Vec<String> {
    annotations
        .get(key)
        .map(|v| {
            v.split(|c: char| c == ',' || c.is_whitespace())
                .filter(|e| !e.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// `entries` without those `same` finds earlier in it, and at most
/// [`MAX_IDENTITIES`] (the rest dropped, with a warning naming `key`).
pub(crate) fn distinct<T>(
    entries: impl IntoIterator<Item = T>,
    same: impl Fn(&T, &T) -> bool,
    key: &str,
) -> Vec<T> {
    let mut kept: Vec<T> = Vec::new();
    let mut dropped = 0usize;
    for entry in entries {
        if kept.iter().any(|k| same(k, &entry)) {
            continue;
        }
        if kept.len() == MAX_IDENTITIES {
            dropped += 1;
            continue;
        }
        kept.push(entry);
    }
    if dropped > 0 {
        tracing::warn!(
            annotation = key,
            dropped,
            "a ServiceAccount lists more than {MAX_IDENTITIES} identities of one cloud; the rest are ignored"
        );
    }
    kept
}

/// Every cloud identity bound to one ServiceAccount, each read by its
/// cloud's module from the annotations the clouds' own webhooks use
/// (`azure::annotations`, `gcp::annotations`, `aws::annotations`) and
/// Lanyard's list annotations. Per cloud, the first is the default (what a
/// request that selects none gets); the others only a request selecting
/// them by the SDK's own selector.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bindings {
    /// The Azure identities; empty when the ServiceAccount names no client id.
    pub azure: Vec<azure::Binding>,
    /// The Google service accounts to impersonate; empty: the federated
    /// principal is used directly.
    pub gcp: Vec<gcp::Binding>,
    /// The IAM roles to assume; empty: no AWS binding.
    pub aws: Vec<aws::Binding>,
}

impl Bindings {
    /// Reads every cloud's binding from ServiceAccount annotations.
    pub fn from_annotations(annotations: &Annotations) -> Bindings {
        Bindings {
            azure: azure::bindings(annotations),
            gcp: gcp::bindings(annotations),
            aws: aws::bindings(annotations),
        }
    }

    /// Whether the ServiceAccount names an identity of `cloud` (Google's
    /// federated principal, which needs no annotation, does not count).
    pub fn names(&self, cloud: Cloud) -> bool {
        match cloud {
            Cloud::Azure => !self.azure.is_empty(),
            Cloud::Gcp => !self.gcp.is_empty(),
            Cloud::Aws => !self.aws.is_empty(),
        }
    }

    /// What the agent will refuse of `cloud`'s bindings before it asks
    /// anything, whatever the pod: each a sentence saying why and what to
    /// do. `node_identities` are the identities assigned to the node
    /// ([`CloudSettings::node_identities`]).
    pub fn known_refusals(&self, cloud: Cloud, node_identities: &[String]) -> Vec<String> {
        match cloud {
            Cloud::Azure => azure::known_refusals(&self.azure, node_identities),
            Cloud::Gcp | Cloud::Aws => Vec::new(),
        }
    }

    /// Whether no cloud is bound at all.
    pub fn is_empty(&self) -> bool {
        !Cloud::ALL.into_iter().any(|c| self.names(c))
    }

    /// No bindings, shared: what an unknown ServiceAccount has.
    pub fn none() -> Arc<Bindings> {
        static NONE: std::sync::LazyLock<Arc<Bindings>> =
            std::sync::LazyLock::new(|| Arc::new(Bindings::default()));
        NONE.clone()
    }
}

/// A configuration value a cloud's section refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration: {key}: {expected} (got {got:?})")]
pub struct Invalid {
    /// The key, as `section.key`.
    pub key: &'static str,
    /// What the key takes.
    pub expected: &'static str,
    /// The value that was given.
    pub got: String,
}

pub(crate) fn invalid(key: &'static str, expected: &'static str, got: &str) -> Invalid {
    Invalid {
        key,
        expected,
        got: got.to_string(),
    }
}

/// An https URL, or http to a loopback host (emulators, local proxies).
pub fn check_endpoint(value: &str) -> Result<(), &'static str> {
    const EXPECTED: &str =
        "an https:// URL (http:// only for loopback hosts) without query or fragment";
    let url = url::Url::parse(value).map_err(|_| EXPECTED)?;
    let loopback = match url.host() {
        Some(url::Host::Domain(d)) => d == "localhost",
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        None => false,
    };
    let scheme_ok = url.scheme() == "https" || (url.scheme() == "http" && loopback);
    if !scheme_ok || url.query().is_some() || url.fragment().is_some() || url.host().is_none() {
        return Err(EXPECTED);
    }
    Ok(())
}

/// Every cloud's section of the configuration, together
/// (`Config::clouds`).
#[derive(Debug, Clone, Copy)]
pub struct CloudSettings<'a> {
    /// `azure`.
    pub azure: &'a azure::Settings,
    /// `gcp`.
    pub gcp: &'a gcp::Settings,
    /// `aws`.
    pub aws: &'a aws::Settings,
}

/// Where [`CloudSettings::register`] puts each configured cloud's
/// exchanger (the broker).
pub trait Registry {
    /// Serves `exchanger`'s cloud with it.
    fn register<E: CloudExchanger>(&mut self, exchanger: E);
}

impl CloudSettings<'_> {
    /// Each section's checks, in [`Cloud::ALL`] order.
    pub fn check(&self) -> Result<(), Invalid> {
        self.azure.check()?;
        self.gcp.check()?;
        self.aws.check()
    }

    /// The identities assigned to the node, which the node's metadata
    /// service serves (Azure's `node_identities`).
    pub fn node_identities(&self) -> Vec<String> {
        self.azure.node_identities.clone()
    }

    /// The audience of the projected token each cloud's exchange takes;
    /// `None` where the cloud is not configured (Google without a
    /// workload identity provider).
    pub fn audiences(&self) -> PerCloud<Option<String>> {
        PerCloud::from_fn(|cloud| match cloud {
            Cloud::Azure => Some(self.azure.audience.clone()),
            Cloud::Gcp => self.gcp.token_audience(),
            Cloud::Aws => Some(self.aws.audience.clone()),
        })
    }

    /// What the SDK environment takes from these sections.
    pub fn sdk_defaults(&self) -> SdkDefaults {
        SdkDefaults {
            azure_tenant_id: self.azure.tenant_id.clone(),
            aws_region: Some(self.aws.region.clone()),
            gcp_universe_domain: (self.gcp.universe_domain != gcp::DEFAULT_UNIVERSE_DOMAIN)
                .then(|| self.gcp.universe_domain.clone()),
        }
    }

    /// Registers the exchanger of every configured cloud.
    pub fn register(
        &self,
        http: &reqwest::Client,
        registry: &mut impl Registry,
    ) -> Result<(), Invalid> {
        registry.register(self.azure.exchanger(http.clone())?);
        if let Some(google) = self.gcp.exchanger(http.clone())? {
            registry.register(google);
        }
        registry.register(self.aws.exchanger(http.clone()));
        Ok(())
    }
}

/// Settings the SDK environment takes from configuration when a binding
/// does not name them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SdkDefaults {
    /// Tenant for Azure bindings that name none (`AZURE_TENANT_ID`).
    pub azure_tenant_id: Option<String>,
    /// The AWS region (`AWS_REGION`, `AWS_DEFAULT_REGION`, and the
    /// sidecar's `LANYARD_AWS_REGION`); `None` sets none.
    pub aws_region: Option<String>,
    /// Google's universe domain, as the GCE surface reports it; `None`:
    /// `googleapis.com`.
    pub gcp_universe_domain: Option<String>,
}

impl SdkDefaults {
    /// What the sidecar of a pod that presents its app-facing token is
    /// told of these defaults (the region its IMDS surface reports).
    pub fn sidecar_vars(&self) -> Vec<(&'static str, String)> {
        let region = self.aws_region.iter();
        let region = region.map(|r| ("LANYARD_AWS_REGION", r.clone()));
        let universe = self.gcp_universe_domain.iter();
        let universe = universe.map(|u| ("LANYARD_GCP_UNIVERSE_DOMAIN", u.clone()));
        region.chain(universe).collect()
    }
}

/// A bearer token (OAuth access token or OIDC ID token) with its validity
/// window.
#[derive(Debug, Clone)]
pub struct AccessToken {
    /// The bearer token itself.
    pub token: SecretString,
    /// Unix seconds.
    pub issued_at: u64,
    /// Unix seconds.
    pub expires_at: u64,
    /// The last response body this token was rendered into.
    pub rendered: RenderedBody,
}

/// A credential of any cloud, as the cache stores it and a grant carries it.
#[derive(Clone, Debug)]
pub enum Credential {
    /// An OAuth access token (Entra, Google).
    Token(AccessToken),
    /// An OIDC ID token (Google `generateIdToken`).
    IdToken(AccessToken),
    /// AWS session credentials.
    Aws(aws::AwsCredentials),
}

impl Credential {
    /// Wall-clock expiry, Unix seconds.
    pub fn expires_at(&self) -> u64 {
        match self {
            Credential::Token(t) | Credential::IdToken(t) => t.expires_at,
            Credential::Aws(c) => c.expires_at,
        }
    }

    /// The last response body this credential was rendered into.
    pub fn rendered(&self) -> &RenderedBody {
        match self {
            Credential::Token(t) | Credential::IdToken(t) => &t.rendered,
            Credential::Aws(c) => &c.rendered,
        }
    }

    /// The bearer token, for the access- and ID-token kinds.
    pub fn bearer(&self) -> Option<&AccessToken> {
        match self {
            Credential::Token(t) | Credential::IdToken(t) => Some(t),
            Credential::Aws(_) => None,
        }
    }

    /// The AWS session credentials.
    pub fn aws(&self) -> Option<&aws::AwsCredentials> {
        match self {
            Credential::Aws(c) => Some(c),
            _ => None,
        }
    }

    /// A short fingerprint of the secret part, for audit (never the secret).
    pub fn fingerprint(&self) -> String {
        use crate::secret::ExposeSecret;
        match self {
            Credential::Token(t) | Credential::IdToken(t) => {
                crate::secret::fingerprint(t.token.expose_secret())
            }
            Credential::Aws(c) => crate::secret::fingerprint(c.session_token.expose_secret()),
        }
    }
}

/// The upstream call for a cache key, given the newest subject token.
pub type FetchFuture = Pin<Box<dyn Future<Output = Result<Credential, CloudError>> + Send>>;
/// A reusable upstream call (the cache keeps it to refresh ahead).
pub type Fetcher = Arc<dyn Fn(SecretString) -> FetchFuture + Send + Sync>;

/// A [`Fetcher`] from an async exchange over shared `params`, captured once;
/// each exchange clones only the `Arc`.
pub fn fetcher<P, F, Fut>(params: P, exchange: F) -> Fetcher
where
    P: Send + Sync + 'static,
    F: Fn(Arc<P>, SecretString) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Credential, CloudError>> + Send + 'static,
{
    let params = Arc::new(params);
    Arc::new(move |subject| Box::pin(exchange(params.clone(), subject)))
}

/// Which of its fairness bounds (`cache::fairness`) a caller met: part
/// of [`CloudError::CallerLimited`], so it lives with the error vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallerLimit {
    /// Too many exchanges in flight.
    Inflight,
    /// New cache keys too fast.
    NewKeys,
    /// Its entries are at the bound and every one is in use.
    Entries,
}

impl CallerLimit {
    /// As in audit records, metrics and answers.
    pub fn name(self) -> &'static str {
        match self {
            CallerLimit::Inflight => "inflight",
            CallerLimit::NewKeys => "new_keys",
            CallerLimit::Entries => "entries",
        }
    }

    /// What was too many, for the caller's answer.
    pub fn describe(self) -> &'static str {
        match self {
            CallerLimit::Inflight => "token exchanges in progress",
            CallerLimit::NewKeys => "new scopes a second",
            CallerLimit::Entries => "cached credentials in use",
        }
    }
}

/// One upstream call as the audit record names it: how long it took and
/// the cloud's own id for it (Entra's `x-ms-request-id`, STS's
/// `x-amzn-RequestId`), which the cloud's support asks for. Google's token
/// endpoints send none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamCall {
    /// From sending the exchange to its result (rate-limit wait excluded).
    pub latency: Duration,
    /// The upstream's request id, when it sent a usable one.
    pub request_id: Option<String>,
}

tokio::task_local! {
    /// The request id an exchanger noted for the exchange running in this
    /// task (see [`note_request_id`]).
    static REQUEST_ID: std::cell::RefCell<Option<String>>;
}

/// Longest request id kept; real ones are UUIDs or shorter.
const MAX_REQUEST_ID: usize = 128;
/// Most request ids kept for one exchange (its calls, in order).
pub const MAX_REQUEST_IDS: usize = 4;

/// Notes the upstream's request id from `headers[name]` for the exchange in
/// progress, so that its audit record names it. Each exchanger calls it on
/// every answer; the ids of a multi-step exchange (STS then IAM
/// Credentials, a web identity then a chained role) are kept in order,
/// comma-separated, at most [`MAX_REQUEST_IDS`]. An id that is long or not
/// plain printable text is dropped: it is upstream-supplied. Outside
/// [`with_request_id`] it does nothing.
pub fn note_request_id(headers: &reqwest::header::HeaderMap, name: &str) {
    let id = headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| {
            !v.is_empty()
                && v.len() <= MAX_REQUEST_ID
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
        });
    if let Some(id) = id {
        let _ = REQUEST_ID.try_with(|slot| {
            let mut slot = slot.borrow_mut();
            match slot.as_mut() {
                None => *slot = Some(id.to_string()),
                Some(ids) if ids.split(',').count() < MAX_REQUEST_IDS => {
                    ids.push(',');
                    ids.push_str(id);
                }
                Some(_) => {}
            }
        });
    }
}

/// Runs one exchange and returns its result with the request id its
/// exchanger noted.
// INVARIANT: the exchange runs inside this scope, in this task: an
// exchanger that spawned its upstream call elsewhere would note nothing.
pub async fn with_request_id<F: Future>(exchange: F) -> (F::Output, Option<String>) {
    REQUEST_ID
        .scope(std::cell::RefCell::new(None), async move {
            let output = exchange.await;
            let id = REQUEST_ID.with(|slot| slot.borrow_mut().take());
            (output, id)
        })
        .await
}

/// Why an exchange failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CloudError {
    /// The cloud refused this request and will refuse it again until
    /// something is reconfigured (no federated credential, role not trusted).
    #[error("{cloud} rejected the exchange: {code}: {message}")]
    Rejected {
        /// The cloud that refused.
        cloud: Cloud,
        /// The upstream's error code (`AADSTS70021`, `PERMISSION_DENIED`,
        /// `AccessDenied`).
        code: String,
        /// The upstream's explanation, scrubbed of anything secret.
        message: String,
    },
    /// The cloud asked us to slow down.
    #[error("{cloud} is throttling token requests ({code}); retry after {retry_after:?}")]
    Throttled {
        /// The cloud that is throttling.
        cloud: Cloud,
        /// The upstream's error code (`Throttling`, `RESOURCE_EXHAUSTED`),
        /// or `HTTP429` when it gave none.
        code: String,
        /// How long to wait, from the upstream's `Retry-After` (Entra's
        /// exchanger assumes 5 s without one); `None` when unknown.
        retry_after: Option<Duration>,
    },
    /// The cloud could not be reached or failed on its side.
    #[error("{cloud} token service unavailable: {reason}")]
    Unavailable {
        /// The cloud that could not be reached.
        cloud: Cloud,
        /// What failed (connection, timeout, a 5xx status).
        reason: String,
    },
    /// Lanyard itself refused: the caller's ServiceAccount met one of its
    /// fairness bounds (`cache.caller_*`); the cloud was not asked.
    #[error("too many {} from this service account for {cloud}; retry after {retry_after:?}", limit.describe())]
    CallerLimited {
        /// The cloud the request was for.
        cloud: Cloud,
        /// Which bound.
        limit: CallerLimit,
        /// How long to wait.
        retry_after: Duration,
    },
    /// The cloud answered something we cannot interpret.
    #[error("{cloud} token service answered unexpectedly: {reason}")]
    Protocol {
        /// The cloud whose answer could not be read.
        cloud: Cloud,
        /// What was wrong with the answer.
        reason: String,
    },
}

impl CloudError {
    /// Whether the same request may succeed later without reconfiguration.
    pub fn is_retryable(&self) -> bool {
        !matches!(self, CloudError::Rejected { .. })
    }

    /// The upstream error code, when the cloud gave one (AADSTS…, AWS codes).
    pub fn code(&self) -> Option<&str> {
        match self {
            CloudError::Rejected { code, .. } | CloudError::Throttled { code, .. } => Some(code),
            _ => None,
        }
    }
}

/// Parses a `Retry-After` header given in seconds (the form token services use).
pub fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}

/// Longest upstream message kept, in bytes (before the `…` marking a cut).
/// Upstream text is for humans; bounding it keeps a misbehaving endpoint
/// from flooding logs, audit records and error answers.
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// Secrets shorter than this are not searched for: replacing a short
/// string would mangle ordinary words, and real credentials are far longer.
const MIN_SECRET_LEN: usize = 8;

/// Makes an upstream error message safe to log and return: every
/// occurrence of `secret` (the credential the request carried, which an
/// endpoint may echo) becomes `[redacted]`, and the result is cut to
/// [`MAX_MESSAGE_BYTES`] on a character boundary, ending in `…` when cut.
/// One function for every exchanger, so the rule cannot drift apart.
pub fn scrub_message(message: &str, secret: &str) -> String {
    let mut text = if secret.len() >= MIN_SECRET_LEN && message.contains(secret) {
        message.replace(secret, "[redacted]")
    } else {
        message.to_string()
    };
    if text.len() > MAX_MESSAGE_BYTES {
        let mut cut = MAX_MESSAGE_BYTES;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push('…');
    }
    text
}

/// What stays readable in one URL path segment: RFC 3986's unreserved
/// characters and `@` (a `pchar`, and what Google's clients leave in
/// service-account emails). Everything else, `/`, `?`, `#`, `:`, `%` and
/// non-ASCII included, is percent-encoded.
const PATH_SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~')
    .remove(b'@');

/// Percent-encodes a caller- or configuration-derived value (a tenant, a
/// service-account email) for one path segment, so that nothing in it can
/// change the path, add a query or pick another method after a `:`.
pub(crate) fn encode_path_segment(segment: &str) -> String {
    percent_encoding::utf8_percent_encode(segment, PATH_SEGMENT).to_string()
}

/// Parses an RFC 3339 timestamp (what Google's `expireTime` and STS's
/// `Expiration` are) with the `time` crate's parser. The date and time
/// must be separated by `T`, `t` or a space, as RFC 3339 allows: `time`
/// alone would take any byte there.
pub(crate) fn parse_rfc3339(text: &str) -> Option<time::OffsetDateTime> {
    use time::format_description::well_known::Rfc3339;
    if !matches!(text.as_bytes().get(10), Some(b'T' | b't' | b' ')) {
        return None;
    }
    time::OffsetDateTime::parse(text, &Rfc3339).ok()
}

/// Unix seconds of a time, `None` before 1970.
pub(crate) fn unix_seconds(at: time::OffsetDateTime) -> Option<u64> {
    u64::try_from(at.unix_timestamp()).ok()
}

pub(crate) fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sidecars_learn_a_universe_other_than_googles_and_the_region() {
        let mut gcp = gcp::Settings::default();
        let (azure, aws) = (azure::Settings::default(), aws::Settings::default());
        let defaults = |gcp: &gcp::Settings| {
            CloudSettings {
                azure: &azure,
                gcp,
                aws: &aws,
            }
            .sdk_defaults()
        };
        let vars = defaults(&gcp).sidecar_vars();
        assert_eq!(vars, vec![("LANYARD_AWS_REGION", aws.region.clone())]);
        gcp.universe_domain = "apis-tpczero.goog".into();
        let vars = defaults(&gcp).sidecar_vars();
        assert!(vars.contains(&("LANYARD_GCP_UNIVERSE_DOMAIN", "apis-tpczero.goog".into())));
    }

    #[test]
    fn annotations_map_to_bindings() {
        let mut a = Annotations::new();
        assert!(Bindings::from_annotations(&a).is_empty());
        a.insert(azure::annotations::CLIENT_ID.into(), " abc ".into());
        a.insert(azure::annotations::TENANT_ID.into(), "".into());
        let b = Bindings::from_annotations(&a);
        assert!(b.names(Cloud::Azure) && !b.names(Cloud::Gcp) && !b.names(Cloud::Aws));
        let az = &b.azure[0];
        assert_eq!(az.client_id, "abc");
        assert_eq!(az.tenant_id, None);
        a.insert(
            aws::annotations::ROLE_ARN.into(),
            "arn:aws:iam::111122223333:role/r".into(),
        );
        a.insert(
            gcp::annotations::SERVICE_ACCOUNT.into(),
            "sa@p.iam.gserviceaccount.com".into(),
        );
        let b = Bindings::from_annotations(&a);
        assert_eq!(b.aws, vec!["arn:aws:iam::111122223333:role/r".into()]);
        assert_eq!(b.gcp, vec!["sa@p.iam.gserviceaccount.com".to_string()]);
        assert!(Cloud::ALL.into_iter().all(|c| b.names(c)));
    }

    #[test]
    fn list_annotations_follow_the_single_value_ones_in_order_once_each() {
        let mut a = Annotations::new();
        a.insert(azure::annotations::CLIENT_ID.into(), "A".into());
        a.insert(azure::annotations::TENANT_ID.into(), "t".into());
        a.insert(azure::annotations::CLIENT_IDS.into(), "b, a\nc,,".into());
        a.insert(
            gcp::annotations::SERVICE_ACCOUNTS.into(),
            "x@p.iam.gserviceaccount.com y@p.iam.gserviceaccount.com".into(),
        );
        a.insert(
            aws::annotations::ROLE_ARN.into(),
            "arn:aws:iam::111122223333:role/r".into(),
        );
        a.insert(
            aws::annotations::ROLE_ARNS.into(),
            "arn:aws:iam::111122223333:role/s, arn:aws:iam::444455556666:role/r".into(),
        );
        let b = Bindings::from_annotations(&a);
        let azure: Vec<_> = b.azure.iter().map(|b| b.client_id.as_str()).collect();
        assert_eq!(azure, ["A", "b", "c"], "a is A, case aside");
        assert!(b.azure.iter().all(|b| b.tenant_id.as_deref() == Some("t")));
        // No single-value annotation: the list's first is the default.
        assert_eq!(
            b.gcp,
            ["x@p.iam.gserviceaccount.com", "y@p.iam.gserviceaccount.com"]
        );
        // IMDS selects by name: a second role named r could never be chosen.
        let aws: Vec<_> = b.aws.iter().map(|b| b.role_arn.as_str()).collect();
        assert_eq!(
            aws,
            [
                "arn:aws:iam::111122223333:role/r",
                "arn:aws:iam::111122223333:role/s"
            ]
        );
        let many: Vec<String> = (0..20).map(|i| format!("c{i}")).collect();
        a.insert(azure::annotations::CLIENT_IDS.into(), many.join(","));
        assert_eq!(Bindings::from_annotations(&a).azure.len(), MAX_IDENTITIES);
    }

    #[test]
    fn the_binding_annotations_read_as_one_phrase() {
        assert_eq!(
            Cloud::binding_annotations("=..."),
            "azure.workload.identity/client-id=..., iam.gke.io/gcp-service-account=... or eks.amazonaws.com/role-arn=..."
        );
    }

    #[test]
    fn each_clouds_rate_key_is_named_after_it() {
        for cloud in Cloud::ALL {
            assert_eq!(cloud.rate_key(), format!("cache.rate_{}", cloud.name()));
        }
    }

    #[test]
    fn every_cloud_accepts_its_configured_audience_and_entra_all_its_clouds() {
        for cloud in Cloud::ALL {
            assert!(cloud.accepted_audiences("x").contains(&"x".to_string()));
        }
        let entra = Cloud::Azure.accepted_audiences("api://AzureADTokenExchange");
        assert_eq!(entra.len(), 6, "{entra:?}");
        assert!(entra.contains(&"api://AKSIdentityBinding".to_string()));
        let google = Cloud::Gcp.accepted_audiences("//iam.googleapis.com/p");
        assert_eq!(
            google,
            ["//iam.googleapis.com/p", "https://iam.googleapis.com/p"]
        );
    }

    fn headers(value: &str) -> reqwest::header::HeaderMap {
        let mut h = reqwest::header::HeaderMap::new();
        h.insert("x-ms-request-id", value.parse().unwrap());
        h
    }

    #[tokio::test]
    async fn an_exchange_names_the_request_id_it_noted_and_only_a_plain_one() {
        let (out, id) = with_request_id(async {
            note_request_id(&headers("first"), "x-ms-request-id");
            tokio::task::yield_now().await;
            note_request_id(
                &headers(" 0b6e2e0a-8f1c-4c1e-9a0e-1f2d3c4b5a69 "),
                "x-ms-request-id",
            );
            7
        })
        .await;
        assert_eq!(out, 7);
        // Every call's id, in order, trimmed.
        assert_eq!(
            id.as_deref(),
            Some("first,0b6e2e0a-8f1c-4c1e-9a0e-1f2d3c4b5a69")
        );
        // At most MAX_REQUEST_IDS of them.
        let ((), id) = with_request_id(async {
            for i in 0..10 {
                note_request_id(&headers(&format!("id{i}")), "x-ms-request-id");
            }
        })
        .await;
        assert_eq!(id.as_deref(), Some("id0,id1,id2,id3"));
        for bad in ["a b", "x;y", &"a".repeat(129), "<script>"] {
            let ((), id) = with_request_id(async {
                note_request_id(&headers(bad), "x-ms-request-id");
            })
            .await;
            assert_eq!(id, None, "{bad}");
        }
        // Another header, or none: nothing.
        let ((), id) = with_request_id(async {
            note_request_id(&headers("abc"), "x-amzn-requestid");
        })
        .await;
        assert_eq!(id, None);
        // Outside an exchange: no effect, no panic.
        note_request_id(&headers("abc"), "x-ms-request-id");
    }

    #[test]
    fn the_table_has_one_row_per_cloud_in_order() {
        for (i, cloud) in Cloud::ALL.into_iter().enumerate() {
            assert_eq!(TABLE[i].cloud, cloud);
            assert_eq!(Cloud::from_name(cloud.name()), Some(cloud));
            assert_eq!(cloud.to_string(), cloud.name());
            // The serde name is the table's name too.
            assert_eq!(
                serde_json::to_value(cloud).unwrap(),
                serde_json::Value::from(cloud.name())
            );
        }
        assert_eq!(Cloud::from_name("oracle"), None);
    }

    #[test]
    fn per_cloud_tables_index_by_cloud() {
        let mut t = PerCloud::from_fn(|c| c.name().len());
        assert_eq!(t[Cloud::Azure], 5);
        t[Cloud::Aws] = 9;
        assert_eq!(t.iter().map(|(_, v)| *v).collect::<Vec<_>>(), [5, 3, 9]);
    }

    const SECRET: &str = "eyJhbGciOiJSUzI1NiJ9.c2VjcmV0.c2ln";

    #[test]
    fn path_segments_cannot_escape() {
        assert_eq!(
            encode_path_segment("sa@p.iam.gserviceaccount.com"),
            "sa@p.iam.gserviceaccount.com"
        );
        assert_eq!(encode_path_segment("../x?y"), "..%2Fx%3Fy");
        assert_eq!(
            encode_path_segment("a/../b:signJwt?x#f%2F é"),
            "a%2F..%2Fb%3AsignJwt%3Fx%23f%252F%20%C3%A9"
        );
        assert_eq!(encode_path_segment("A-z_0.9~"), "A-z_0.9~");
    }

    #[test]
    fn secrets_are_redacted() {
        let m = scrub_message(&format!("bad token {SECRET}; again: {SECRET}"), SECRET);
        assert_eq!(m, "bad token [redacted]; again: [redacted]");
        // Short or empty "secrets" are not searched for.
        assert_eq!(scrub_message("a token", ""), "a token");
        assert_eq!(scrub_message("a token", "a"), "a token");
    }

    #[test]
    fn huge_messages_are_bounded() {
        let huge = format!("{}{SECRET}", "x".repeat(100 * 1024));
        let m = scrub_message(&huge, SECRET);
        assert!(m.len() <= MAX_MESSAGE_BYTES + '…'.len_utf8(), "{}", m.len());
        assert!(m.ends_with('…'));
        assert!(!m.contains(SECRET));
        let short = "x".repeat(MAX_MESSAGE_BYTES);
        assert_eq!(scrub_message(&short, ""), short, "at the bound: not cut");
    }

    #[test]
    fn multibyte_text_is_cut_on_a_boundary() {
        // 'é' is two bytes and '€' three: neither divides 1024 evenly
        // once offset by one ASCII byte.
        for text in [format!("a{}", "é".repeat(2000)), "€".repeat(1000)] {
            let m = scrub_message(&text, "");
            assert!(m.ends_with('…'));
            let body = m.trim_end_matches('…');
            assert!(body.len() <= MAX_MESSAGE_BYTES && body.len() > MAX_MESSAGE_BYTES - 4);
            assert!(text.starts_with(body));
        }
    }

    #[test]
    fn a_secret_split_by_the_cut_is_still_redacted() {
        // Redaction happens before the cut, so no prefix of the secret
        // survives at the end.
        let text = format!("{}{SECRET}", "x".repeat(MAX_MESSAGE_BYTES - 5));
        let m = scrub_message(&text, SECRET);
        assert!(!m.contains("eyJhb"), "{m}");
    }
}
