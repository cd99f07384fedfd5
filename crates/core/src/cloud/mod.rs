//! The cloud model: which clouds exist ([`Cloud`], one table of their
//! properties), the SDK-facing surfaces ([`Surface`]), the uniform request
//! a surface makes ([`TokenRequest`]), the credentials an exchange yields
//! ([`Credential`]) with the body last rendered from them
//! ([`RenderedBody`]), and the typed errors of an upstream
//! ([`CloudError`]). Each cloud's model (its annotations, the audiences
//! it accepts, AWS's session credentials) is in its module here; its
//! exchanger, settings and bindings are in the product crate's `cloud`.
//!
//! Nothing here does I/O: the sidecar, the agent and the tools share it.

pub mod aws;
pub mod azure;
pub mod gcp;
mod rendered;
mod request;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::secret::SecretString;

pub use aws::AwsCredentials;
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

/// Most identities of one cloud that one ServiceAccount may list (its
/// single-value annotation and its list annotation together); entries past
/// it are dropped with a warning. Bounded because a request selecting none
/// of them is compared against each, and a listing decides each.
pub const MAX_IDENTITIES: usize = 8;

/// An annotation's value, trimmed; empty counts as absent, as the clouds'
/// own webhooks treat it.
pub(crate) fn annotation(annotations: &Annotations, key: &str) -> Option<String> {
    annotations
        .get(key)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

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
    /// (the product's `CloudSettings::node_identities`).
    pub fn known_refusals(&self, cloud: Cloud, node_identities: &[String]) -> Vec<String> {
        match cloud {
            Cloud::Azure => azure::known_refusals(&self.azure, node_identities),
            Cloud::Gcp | Cloud::Aws => Vec::new(),
        }
    }

    /// The ids of `cloud`'s identities bound here: client ids, Google
    /// service accounts, role ARNs.
    pub fn identity_ids(&self, cloud: Cloud) -> Vec<&str> {
        match cloud {
            Cloud::Azure => self.azure.iter().map(|b| b.client_id.as_str()).collect(),
            Cloud::Gcp => self.gcp.iter().map(String::as_str).collect(),
            Cloud::Aws => self.aws.iter().map(|b| b.role_arn.as_str()).collect(),
        }
    }

    /// Every ServiceAccount annotation any cloud's bindings are read from.
    pub fn annotation_keys() -> impl Iterator<Item = &'static str> {
        azure::annotations::ALL
            .iter()
            .chain(gcp::annotations::ALL)
            .chain(aws::annotations::ALL)
            .copied()
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
    /// The defaults of the configuration's `azure.tenant_id`,
    /// `gcp.universe_domain` and `aws.region`, as typed sections give them.
    pub fn of(azure_tenant_id: Option<&str>, gcp_universe_domain: &str, aws_region: &str) -> Self {
        SdkDefaults {
            azure_tenant_id: azure_tenant_id.map(str::to_string),
            aws_region: Some(aws_region.to_string()),
            gcp_universe_domain: (gcp_universe_domain != gcp::DEFAULT_UNIVERSE_DOMAIN)
                .then(|| gcp_universe_domain.to_string()),
        }
    }

    /// What the sections' defaults give (no key set).
    pub fn unconfigured() -> Self {
        SdkDefaults::of(None, gcp::DEFAULT_UNIVERSE_DOMAIN, aws::DEFAULT_REGION)
    }

    /// The same keys read from the clouds' sections as loaded, untyped
    /// (`section(cloud)`: the section named after the cloud, if any), and
    /// checked as the full configuration checks them; an absent key takes
    /// its default. The slim sidecar reads its configuration this way, so
    /// that it names no cloud of its own.
    pub fn from_sections<'a>(
        section: impl Fn(Cloud) -> Option<&'a serde_json::Value>,
    ) -> Result<Self, Invalid> {
        let key = |cloud: Cloud, key: &str| -> Result<Option<String>, serde_json::Value> {
            match section(cloud).and_then(|s| s.get(key)) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::String(v)) => Ok(Some(v.clone())),
                Some(other) => Err(other.clone()),
            }
        };
        let refuse =
            |key: &'static str, expected: &'static str, got: String| Invalid { key, expected, got };
        const TENANT: &str = "a tenant GUID or domain name";
        const UNIVERSE: &str = "a DNS domain (googleapis.com)";
        const REGION: &str = "an AWS region such as us-east-1";
        let tenant = key(Cloud::Azure, "tenant_id")
            .map_err(|v| refuse("azure.tenant_id", TENANT, v.to_string()))?;
        if let Some(t) = tenant.as_deref().filter(|t| !azure::is_tenant(t)) {
            return Err(refuse("azure.tenant_id", TENANT, t.to_string()));
        }
        let universe = key(Cloud::Gcp, "universe_domain")
            .map_err(|v| refuse("gcp.universe_domain", UNIVERSE, v.to_string()))?
            .unwrap_or_else(|| gcp::DEFAULT_UNIVERSE_DOMAIN.to_string());
        if !gcp::is_universe_domain(&universe) {
            return Err(refuse("gcp.universe_domain", UNIVERSE, universe));
        }
        let region = key(Cloud::Aws, "region")
            .map_err(|v| refuse("aws.region", REGION, v.to_string()))?
            .unwrap_or_else(|| aws::DEFAULT_REGION.to_string());
        if aws::Region::parse(region.as_str()).is_err() {
            return Err(refuse("aws.region", REGION, region));
        }
        Ok(SdkDefaults::of(tenant.as_deref(), &universe, &region))
    }

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
        text.truncate(text.floor_char_boundary(MAX_MESSAGE_BYTES));
        text.push('…');
    }
    text
}

/// The wall clock in Unix seconds (0 before 1970).
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A configuration value a section refuses (a cloud's, the sidecar's).
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

#[cfg(test)]
mod tests {
    use super::*;

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
