//! Google Security Token Service and IAM Credentials emulator.
//!
//! Validates the way Google does, so that what passes here would pass there:
//!
//! * STS `POST /v1/token` exchanges an OIDC token for a *federated* access
//!   token. The `audience` must name a configured workload identity pool
//!   provider, the subject token's `iss` must be that provider's issuer, its
//!   signature must verify against the keys found by OIDC discovery of that
//!   issuer, its `aud` must contain one of the provider's allowed audiences
//!   and it must be within its validity window (Google allows about a minute
//!   of skew). The federated token is opaque; the emulator remembers which
//!   federated principal (`principal://…/subject/SUB`) it stands for.
//! * GKE's own pool, `PROJECT.svc.id.goog`: STS takes the audience
//!   `identitynamespace:PROJECT.svc.id.goog:https://container.googleapis.com/v1/projects/PROJECT/locations/L/clusters/C`
//!   for a configured cluster, a subject token of that cluster's issuer
//!   carrying the audience `PROJECT.svc.id.goog` and a Kubernetes
//!   service-account subject, and answers for the principal
//!   `principal://…/workloadIdentityPools/PROJECT.svc.id.goog/subject/ns/NS/sa/KSA`.
//! * IAM Credentials `:generateAccessToken` and `:generateIdToken` let a
//!   federated principal impersonate a service account only when it (or a
//!   `principalSet://…/*` covering its pool, or for GKE's pool
//!   `serviceAccount:PROJECT.svc.id.goog[NS/KSA]` and
//!   `principalSet://…/PROJECT.svc.id.goog/namespace/NS`) holds
//!   `roles/iam.workloadIdentityUser` on that account. ID tokens are JWTs
//!   signed by the emulator's own key, published at `GET /oauth2/v3/certs`.
//!
//! Error bodies have Google's shapes: OAuth `{error, error_description}` from
//! STS and `{"error": {code, message, status}}` from IAM, with the texts
//! Google sends where they are known (see the constants below).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use super::keys::SigningKey;
use crate::claims::random_token;
use crate::claims::Audience;
use crate::jwks::{KeySet, KeySource, Lookup};

/// The only grant STS supports for workload identity federation.
pub const TOKEN_EXCHANGE_GRANT: &str = "urn:ietf:params:oauth:grant-type:token-exchange";
/// The only token type STS issues.
pub const ACCESS_TOKEN_TYPE: &str = "urn:ietf:params:oauth:token-type:access_token";
/// Subject token types of OIDC providers (`id_token` is accepted as a synonym).
pub const JWT_TOKEN_TYPE: &str = "urn:ietf:params:oauth:token-type:jwt";
/// The `id_token` synonym of [`JWT_TOKEN_TYPE`] for subject tokens.
pub const ID_TOKEN_TYPE: &str = "urn:ietf:params:oauth:token-type:id_token";
/// The role that lets a federated principal impersonate a service account.
pub const WORKLOAD_IDENTITY_USER: &str = "roles/iam.workloadIdentityUser";
/// The scope Google applies when a caller asks for none.
pub const CLOUD_PLATFORM_SCOPE: &str = "https://www.googleapis.com/auth/cloud-platform";
/// Issuer of Google-signed service-account ID tokens.
pub const ID_TOKEN_ISSUER: &str = "https://accounts.google.com";

/// Full resource names of providers start with this service prefix.
const IAM_SERVICE: &str = "//iam.googleapis.com/";
/// Clock skew Google STS tolerates on `exp` and `iat` (measured: a token 59 s
/// past `exp` is accepted, 61 s past is refused).
const SKEW_SECS: u64 = 60;
/// Google caps the mapped `google.subject` (here: `sub`) at 127 bytes.
const MAX_SUBJECT_BYTES: usize = 127;
/// IAM refuses service-account token lifetimes over one hour unless an org
/// policy extends it; the emulator models the default.
const MAX_SA_LIFETIME_SECS: u64 = 3600;
/// How many live federated tokens the emulator remembers. Thousands of pods
/// each hold one; beyond this the ones closest to expiry are forgotten
/// (their holders get 401 and exchange again), so memory stays bounded.
const FEDERATED_CAPACITY: usize = 65_536;

// Texts Google sends, as observed (sources in each comment).
// google-github-actions/auth#60 and #211 (STS response bodies quoted in full).
const BAD_AUDIENCE: &str = "Invalid value for \"audience\". This value should be the full resource name of the Identity Provider. See https://cloud.google.com/iam/docs/reference/sts/rest/v1/TopLevel/token for the list of possible formats.";
// google-github-actions/auth#161 (gcloud error quoting the STS body).
const UNKNOWN_PROVIDER: &str = "The target service indicated by the \"audience\" parameters is invalid. This might either be because the pool or provider is disabled or deleted or because it doesn't exist.";
// Google Cloud docs, "Troubleshoot Workload Identity Federation".
const ISSUER_UNREACHABLE: &str = "Error connecting to the given credential's issuer.";
const SUBJECT_TOO_LONG: &str = "The size of mapped attribute google.subject exceeds the 127 bytes limit. Either modify your attribute mapping or the incoming assertion to produce a mapped attribute that is less than 127 bytes.";
const UNAUTHENTICATED_INVALID: &str = "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or other valid authentication credential. See https://developers.google.com/identity/sign-in/web/devconsole-project.";
// Measured against real STS (negative checks of a self-held OIDC key) and
// quoted by client libraries' tests (googleauth's STS stubs).
const UNPARSABLE_TOKEN: &str = "Unable to parse the ID Token.";
const BAD_SIGNATURE: &str = "Unable to verify the ID Token signature.";
// Google's text when no credential is presented at all.
const UNAUTHENTICATED_MISSING: &str = "Request is missing required authentication credential. Expected OAuth 2 access token, login cookie or other valid authentication credential. See https://developers.google.com/identity/sign-in/web/devconsole-project.";
// Measured IAM Credentials answers to out-of-range lifetimes (Google's typo kept).
const LIFETIME_ZERO: &str = "Lifetime of access token must be larger then zero.";
const LIFETIME_TOO_LONG: &str = "can not have lifetimes of more than 1 hour. Use the Org Policy Constraint constraints/iam.allowServiceAccountCredentialLifetimeExtension to allow up to 12 hours.";
// Google's generic INVALID_ARGUMENT message.
const INVALID_ARGUMENT: &str = "Request contains an invalid argument.";

/// A workload identity pool provider (OIDC).
#[derive(Debug, Clone)]
pub struct WorkloadIdentityProvider {
    /// Full resource name:
    /// `//iam.googleapis.com/projects/NUMBER/locations/global/workloadIdentityPools/POOL/providers/PROVIDER`.
    pub name: String,
    /// The OIDC issuer whose tokens this provider accepts (`iss`).
    pub issuer: String,
    /// Audiences a subject token may carry. Empty means Google's default: the
    /// provider's full resource name, with `//` or `https://` in front.
    pub allowed_audiences: Vec<String>,
}

/// A service account and who may impersonate it.
#[derive(Debug, Clone)]
pub struct GcpServiceAccount {
    /// The service account's email, `NAME@PROJECT.iam.gserviceaccount.com`.
    pub email: String,
    /// Members holding `roles/iam.workloadIdentityUser` on the account:
    /// `principal://iam.googleapis.com/projects/N/locations/global/workloadIdentityPools/P/subject/SUB`
    /// or `principalSet://iam.googleapis.com/projects/N/locations/global/workloadIdentityPools/P/*`.
    pub members: Vec<String>,
}

/// A GKE cluster whose service-account tokens GKE's pool,
/// `PROJECT.svc.id.goog`, accepts.
#[derive(Debug, Clone)]
pub struct GkeCluster {
    /// The cluster's project id.
    pub project_id: String,
    /// The project's number (naming the pool in principals).
    pub project_number: String,
    /// The cluster's region or zone.
    pub location: String,
    /// The cluster's name.
    pub name: String,
    /// The cluster's service-account token issuer (on GKE
    /// `https://container.googleapis.com/v1/projects/P/locations/L/clusters/C`).
    pub issuer: String,
}

impl GkeCluster {
    /// `PROJECT.svc.id.goog`: the pool, and the one audience its tokens
    /// must carry.
    pub fn pool(&self) -> String {
        format!("{}.svc.id.goog", self.project_id)
    }

    /// The STS audience naming this cluster in its pool.
    pub fn sts_audience(&self) -> String {
        format!(
            "identitynamespace:{}:{}",
            self.pool(),
            self.identity_provider()
        )
    }

    fn identity_provider(&self) -> String {
        format!(
            "https://container.googleapis.com/v1/projects/{}/locations/{}/clusters/{}",
            self.project_id, self.location, self.name
        )
    }

    /// The principal of a Kubernetes service account in the pool.
    pub fn principal(&self, namespace: &str, service_account: &str) -> String {
        format!(
            "principal://iam.googleapis.com/projects/{}/locations/global/workloadIdentityPools/{}/subject/ns/{namespace}/sa/{service_account}",
            self.project_number,
            self.pool()
        )
    }

    /// The legacy member naming the same principal, as GKE Workload
    /// Identity grants are written: `serviceAccount:PROJECT.svc.id.goog[NS/KSA]`.
    pub fn member(&self, namespace: &str, service_account: &str) -> String {
        format!(
            "serviceAccount:{}[{namespace}/{service_account}]",
            self.pool()
        )
    }
}

impl GkeCluster {
    /// The cluster named `projects/PROJECT/locations/LOCATION/clusters/NAME`
    /// in the project numbered `project_number`, its tokens issued by
    /// `issuer`.
    pub fn named(name: &str, project_number: &str, issuer: &str) -> anyhow::Result<GkeCluster> {
        match name.split('/').collect::<Vec<_>>().as_slice() {
            ["projects", project, "locations", location, "clusters", cluster]
                if !project.is_empty() && !location.is_empty() && !cluster.is_empty() =>
            {
                Ok(GkeCluster {
                    project_id: project.to_string(),
                    project_number: project_number.to_string(),
                    location: location.to_string(),
                    name: cluster.to_string(),
                    issuer: issuer.to_string(),
                })
            }
            _ => anyhow::bail!("GKE cluster {name:?} is not projects/P/locations/L/clusters/C"),
        }
    }
}

/// What the emulator trusts and grants.
#[derive(Debug, Clone)]
pub struct GcpEmulatorConfig {
    /// The workload identity pool providers STS accepts subject tokens of.
    pub providers: Vec<WorkloadIdentityProvider>,
    /// GKE clusters whose tokens GKE's pools accept.
    pub clusters: Vec<GkeCluster>,
    /// The service accounts IAM Credentials lets federated principals
    /// impersonate.
    pub service_accounts: Vec<GcpServiceAccount>,
    /// Upper bound on every credential issued (federated tokens, service
    /// account access and ID tokens). Google's is one hour; tests shorten
    /// it to exercise refresh.
    pub lifetime: Duration,
}

/// Counters tests and the dev admin endpoint read.
#[derive(Debug, Default)]
pub struct GcpStats {
    /// Every request that reached STS's token endpoint.
    pub sts_requests: AtomicU64,
    /// Federated access tokens STS handed out.
    pub sts_issued: AtomicU64,
    /// Every request that reached IAM Credentials (`generateAccessToken`,
    /// `generateIdToken`).
    pub iam_requests: AtomicU64,
    /// Service-account access and ID tokens IAM Credentials handed out.
    pub iam_issued: AtomicU64,
}

/// The parts of a provider's full resource name.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ProviderName {
    project_number: String,
    pool: String,
    provider: String,
}

impl ProviderName {
    /// Parses `//iam.googleapis.com/projects/N/locations/global/workloadIdentityPools/P/providers/R`.
    /// Google requires the project *number* and the `//` service prefix.
    fn parse(name: &str) -> Option<Self> {
        let rest = name.strip_prefix(IAM_SERVICE)?;
        let parts: Vec<&str> = rest.split('/').collect();
        match parts.as_slice() {
            ["projects", number, "locations", "global", "workloadIdentityPools", pool, "providers", provider]
                if !number.is_empty()
                    && number.bytes().all(|b| b.is_ascii_digit())
                    && valid_id(pool)
                    && valid_id(provider) =>
            {
                Some(ProviderName {
                    project_number: number.to_string(),
                    pool: pool.to_string(),
                    provider: provider.to_string(),
                })
            }
            _ => None,
        }
    }

    /// Whether `name` has a provider name's shape but a project *ID* where
    /// the number belongs. Google finds no such provider and answers
    /// `invalid_target`, not the malformed-audience `invalid_request`
    /// (google-github-actions/auth#202; unicode-org/unicodetools#622).
    fn names_a_project_id(name: &str) -> bool {
        let Some(rest) = name.strip_prefix(IAM_SERVICE) else {
            return false;
        };
        let parts: Vec<&str> = rest.split('/').collect();
        matches!(
            parts.as_slice(),
            ["projects", project, "locations", "global", "workloadIdentityPools", pool, "providers", provider]
                if is_project_id(project) && valid_id(pool) && valid_id(provider)
        )
    }

    /// `projects/N/locations/global/workloadIdentityPools/P`.
    fn pool_resource(&self) -> String {
        format!(
            "projects/{}/locations/global/workloadIdentityPools/{}",
            self.project_number, self.pool
        )
    }

    /// The audiences Google accepts when the provider lists none.
    fn default_audiences(&self) -> [String; 2] {
        let path = format!("{}/providers/{}", self.pool_resource(), self.provider);
        [
            format!("//iam.googleapis.com/{path}"),
            format!("https://iam.googleapis.com/{path}"),
        ]
    }
}

/// Pool and provider ids: 4–32 lowercase letters, digits and hyphens in
/// Google; the emulator only insists they are non-empty path-safe tokens.
fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// The federated principal STS issues for `subject` through `provider_name`
/// (`principal://iam.googleapis.com/projects/N/locations/global/workloadIdentityPools/P/subject/SUB`):
/// what IAM bindings name to grant a Kubernetes service account access.
pub fn principal_for(provider_name: &str, subject: &str) -> String {
    let path = provider_name.trim_start_matches("//");
    let pool = path.split("/providers/").next().unwrap_or(path);
    format!("principal://{pool}/subject/{subject}")
}

/// Whether the IAM member `member` covers `principal`: the same principal,
/// or `principalSet://…/workloadIdentityPools/P/*` for the principal's
/// pool; in GKE's pool also `serviceAccount:PROJECT.svc.id.goog[NS/KSA]`
/// and `principalSet://…/workloadIdentityPools/PROJECT.svc.id.goog/namespace/NS`.
fn member_covers(member: &str, principal: &str) -> bool {
    if member == principal {
        return true;
    }
    if let Some(gke) = gke_principal(principal) {
        if let Some(rest) = member.strip_prefix("serviceAccount:") {
            return rest == format!("{}[{}/{}]", gke.pool, gke.namespace, gke.service_account);
        }
        if let Some(set) = member.strip_prefix("principalSet://") {
            let namespace_set = format!("{}/namespace/{}", gke.pool_path, gke.namespace);
            if set == namespace_set {
                return true;
            }
        }
    }
    let Some(pool) = member
        .strip_prefix("principalSet://")
        .and_then(|m| m.strip_suffix("/*"))
    else {
        return false;
    };
    principal
        .strip_prefix("principal://")
        .and_then(|p| p.strip_prefix(pool))
        .is_some_and(|rest| rest.starts_with("/subject/"))
}

/// The parts of a principal of GKE's pool:
/// `principal://iam.googleapis.com/projects/N/locations/global/workloadIdentityPools/PROJECT.svc.id.goog/subject/ns/NS/sa/KSA`.
struct GkePrincipal<'a> {
    /// `iam.googleapis.com/projects/N/locations/global/workloadIdentityPools/PROJECT.svc.id.goog`.
    pool_path: &'a str,
    pool: &'a str,
    namespace: &'a str,
    service_account: &'a str,
}

fn gke_principal(principal: &str) -> Option<GkePrincipal<'_>> {
    let rest = principal.strip_prefix("principal://")?;
    let (pool_path, subject) = rest.split_once("/subject/")?;
    let pool = pool_path.rsplit('/').next()?;
    if !pool.ends_with(".svc.id.goog") {
        return None;
    }
    let (namespace, service_account) = subject.strip_prefix("ns/")?.split_once("/sa/")?;
    Some(GkePrincipal {
        pool_path,
        pool,
        namespace,
        service_account,
    })
}

/// A stable numeric unique id for a service account, shaped like Google's
/// 21-digit ids (used as `sub` and `azp` of its ID tokens).
pub fn service_account_unique_id(email: &str) -> String {
    let digest = Sha256::digest(email.to_ascii_lowercase().as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    format!("1{:020}", u64::from_be_bytes(first))
}

/// A federated token's meaning.
#[derive(Debug, Clone)]
struct Federated {
    principal: String,
    expires_at: u64,
}

/// Live federated tokens, keyed by SHA-256 of the token so the map holds
/// nothing that could be replayed.
struct FederatedStore {
    tokens: HashMap<[u8; 32], Federated>,
    capacity: usize,
}

impl FederatedStore {
    fn new(capacity: usize) -> Self {
        FederatedStore {
            tokens: HashMap::new(),
            capacity: capacity.max(1),
        }
    }

    fn key(token: &str) -> [u8; 32] {
        Sha256::digest(token.as_bytes()).into()
    }

    fn insert(&mut self, token: &str, federated: Federated, now: u64) {
        if self.tokens.len() >= self.capacity {
            self.tokens.retain(|_, f| f.expires_at > now);
        }
        while self.tokens.len() >= self.capacity {
            // Still full of live tokens: forget the one closest to expiry.
            let Some(victim) = self
                .tokens
                .iter()
                .min_by_key(|(_, f)| f.expires_at)
                .map(|(k, _)| *k)
            else {
                break;
            };
            self.tokens.remove(&victim);
        }
        self.tokens.insert(Self::key(token), federated);
    }

    fn get(&self, token: &str, now: u64) -> Option<&Federated> {
        self.tokens
            .get(&Self::key(token))
            .filter(|f| f.expires_at > now)
    }
}

struct Provider {
    config: WorkloadIdentityProvider,
    name: ProviderName,
}

/// Every GKE member form names one Kubernetes service account of one pool.
fn is_gke_member(member: &str) -> bool {
    member
        .strip_prefix("serviceAccount:")
        .and_then(|m| m.split_once(".svc.id.goog["))
        .and_then(|(_, rest)| rest.strip_suffix(']'))
        .and_then(|ksa| ksa.split_once('/'))
        .is_some_and(|(ns, sa)| !ns.is_empty() && !sa.is_empty())
}

struct ServiceAccount {
    email: String,
    unique_id: String,
    members: Vec<String>,
}

/// The emulator's state.
pub struct Gcp {
    providers: Vec<Provider>,
    clusters: Vec<GkeCluster>,
    service_accounts: Vec<ServiceAccount>,
    lifetime: Duration,
    /// One key set per issuer that a configured provider names; built up
    /// front so a subject token can never make the emulator fetch keys from
    /// an issuer nobody trusts.
    key_sets: HashMap<String, Arc<KeySet>>,
    federated: Mutex<FederatedStore>,
    signing_key: SigningKey,
    /// What the emulator has been asked and has issued.
    pub stats: GcpStats,
    /// Each token and whom it was issued to: federated tokens to the
    /// federated principal, service-account access tokens to the account's
    /// email, ID tokens to `EMAIL (id token)`.
    pub ledger: super::Ledger,
    /// Misbehaviour to inject (tests, benchmarks).
    pub faults: Arc<super::faults::Faults>,
}

impl Gcp {
    /// Validates the configuration and generates the emulator's ID-token key.
    pub fn new(config: GcpEmulatorConfig, http: reqwest::Client) -> anyhow::Result<Self> {
        if config.lifetime.as_secs() == 0 {
            anyhow::bail!("GCP emulator token lifetime must be at least one second");
        }
        let mut providers = Vec::with_capacity(config.providers.len());
        let mut key_sets = HashMap::new();
        for p in config.providers {
            let name = ProviderName::parse(&p.name).ok_or_else(|| {
                anyhow::anyhow!(
                    "workload identity provider {:?} is not //iam.googleapis.com/projects/NUMBER/locations/global/workloadIdentityPools/POOL/providers/PROVIDER",
                    p.name
                )
            })?;
            if p.issuer.trim().is_empty() {
                anyhow::bail!("workload identity provider {} has no issuer", p.name);
            }
            key_sets.entry(p.issuer.clone()).or_insert_with(|| {
                Arc::new(KeySet::new(
                    KeySource::Discovery {
                        issuer: p.issuer.clone(),
                    },
                    http.clone(),
                ))
            });
            providers.push(Provider { config: p, name });
        }
        for c in &config.clusters {
            if c.issuer.trim().is_empty() || c.project_number.is_empty() {
                anyhow::bail!(
                    "GKE cluster {} needs an issuer and a project number",
                    c.name
                );
            }
            key_sets.entry(c.issuer.clone()).or_insert_with(|| {
                Arc::new(KeySet::new(
                    KeySource::Discovery {
                        issuer: c.issuer.clone(),
                    },
                    http.clone(),
                ))
            });
        }
        let mut service_accounts = Vec::with_capacity(config.service_accounts.len());
        for sa in config.service_accounts {
            if !sa.email.contains('@') || sa.email.contains('/') || sa.email.contains(':') {
                anyhow::bail!("service account email {:?} is not an email", sa.email);
            }
            for m in &sa.members {
                if !(m.starts_with("principal://")
                    || m.starts_with("principalSet://")
                    || is_gke_member(m))
                {
                    anyhow::bail!(
                        "member {m:?} of {} is neither principal://, principalSet:// nor serviceAccount:PROJECT.svc.id.goog[NS/KSA]",
                        sa.email
                    );
                }
            }
            service_accounts.push(ServiceAccount {
                unique_id: service_account_unique_id(&sa.email),
                email: sa.email,
                members: sa.members,
            });
        }
        Ok(Gcp {
            providers,
            clusters: config.clusters,
            service_accounts,
            lifetime: config.lifetime,
            key_sets,
            federated: Mutex::new(FederatedStore::new(FEDERATED_CAPACITY)),
            signing_key: SigningKey::generate_rs256()?,
            stats: GcpStats::default(),
            ledger: super::Ledger::default(),
            faults: Default::default(),
        })
    }

    /// STS, IAM Credentials and the ID-token JWKS on one listener (point both
    /// endpoints of the exchanger at it).
    pub fn router(self: &Arc<Self>) -> Router {
        // One schedule of faults, rendered in the format of the service
        // the request reached.
        let sts = Router::new()
            .route("/v1/token", post(sts_token))
            .with_state(self.clone());
        let iam = Router::new()
            .route(
                "/v1/projects/-/serviceAccounts/{name}",
                post(iam_credentials),
            )
            .route("/oauth2/v3/certs", get(certs))
            .with_state(self.clone());
        self.faults
            .layer(sts, sts_fault_response)
            .merge(self.faults.layer(iam, fault_response))
    }

    /// Fetches the keys of every provider's issuer now, as a service that
    /// has long trusted the issuer holds them.
    pub async fn preload_keys(&self) -> Result<(), crate::jwks::KeysError> {
        for keys in self.key_sets.values() {
            keys.preload().await?;
        }
        Ok(())
    }

    /// See [`principal_for`].
    pub fn principal_for(provider_name: &str, subject: &str) -> String {
        principal_for(provider_name, subject)
    }

    /// The principal a live federated token stands for (for tests and for
    /// emulated APIs that accept federated tokens directly).
    pub fn federated_principal(&self, token: &str) -> Option<String> {
        let now = jsonwebtoken::get_current_timestamp();
        self.federated
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(token, now)
            .map(|f| f.principal.clone())
    }

    /// The JWKS that verifies the emulator's ID tokens.
    pub fn jwks(&self) -> Value {
        json!({ "keys": [self.signing_key.jwk()] })
    }

    fn remember(&self, token: &str, federated: Federated, now: u64) {
        self.federated
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(token, federated, now);
    }
}

/// A project ID as Google allows it: 6 to 30 lowercase letters, digits
/// and hyphens, starting with a letter, not ending with a hyphen.
fn is_project_id(id: &str) -> bool {
    (6..=30).contains(&id.len())
        && id.starts_with(|c: char| c.is_ascii_lowercase())
        && !id.ends_with('-')
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// An injected error status on STS: a 429 is OAuth's `quota_exceeded` as
/// Google documents STS's throttling ("Troubleshoot workload identity
/// federation": "The request was throttled due to rate limit:
/// sts.googleapis.com/requests. Please retry after a few seconds.").
/// Other statuses, for which no STS capture is public, take the API
/// format of [`fault_response`].
fn sts_fault_response(status: StatusCode, retry_after: Option<u64>) -> Response {
    if status == StatusCode::TOO_MANY_REQUESTS {
        let body = json!({
            "error": "quota_exceeded",
            "error_description": "The request was throttled due to rate limit: sts.googleapis.com/requests. Please retry after a few seconds.",
        });
        return (status, Json(body)).into_response();
    }
    fault_response(status, retry_after)
}

/// An injected error status in Google's API error format: 429 is
/// `RESOURCE_EXHAUSTED`, 503 `UNAVAILABLE`, other 5xx `INTERNAL`.
fn fault_response(status: StatusCode, _retry_after: Option<u64>) -> Response {
    let (name, message) = match status.as_u16() {
        429 => (
            "RESOURCE_EXHAUSTED",
            "Quota exceeded for quota metric 'Token requests'.",
        ),
        503 => ("UNAVAILABLE", "The service is currently unavailable."),
        _ => ("INTERNAL", "Internal error encountered."),
    };
    api(status, name, message).into_response()
}

mod iam;
mod sts;

use iam::{api, certs, iam_credentials};
use sts::sts_token;

#[cfg(test)]
mod tests {
    use super::iam::{
        bearer, check_lifetime, check_scopes, parse_duration, request_fields, rfc3339,
        split_resource, Method,
    };
    use super::sts::snake_case;
    use super::*;

    const PROVIDER: &str =
        "//iam.googleapis.com/projects/123456789/locations/global/workloadIdentityPools/lanyard/providers/dev";

    #[test]
    fn provider_names_parse_strictly() {
        let name = ProviderName::parse(PROVIDER).unwrap();
        assert_eq!(name.project_number, "123456789");
        assert_eq!(name.pool, "lanyard");
        assert_eq!(name.provider, "dev");
        assert_eq!(
            name.default_audiences()[1],
            "https://iam.googleapis.com/projects/123456789/locations/global/workloadIdentityPools/lanyard/providers/dev"
        );
        // Google wants the //-prefixed full name and a project number.
        for bad in [
            &PROVIDER[2..],
            "https://iam.googleapis.com/projects/123456789/locations/global/workloadIdentityPools/lanyard/providers/dev",
            "//iam.googleapis.com/projects/my-project/locations/global/workloadIdentityPools/lanyard/providers/dev",
            "//iam.googleapis.com/projects/123456789/locations/global/workloadIdentityPools/lanyard",
            "//iam.googleapis.com/projects/123456789/locations/global/workloadIdentityPools/lanyard/providers/dev/x",
            "//iam.googleapis.com/projects/123456789/locations/global/workloadIdentityPools//providers/dev",
        ] {
            assert!(ProviderName::parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn principal_names_the_pool_and_subject() {
        assert_eq!(
            principal_for(PROVIDER, "system:serviceaccount:ray:head"),
            "principal://iam.googleapis.com/projects/123456789/locations/global/workloadIdentityPools/lanyard/subject/system:serviceaccount:ray:head"
        );
        assert_eq!(
            Gcp::principal_for(PROVIDER, "s"),
            principal_for(PROVIDER, "s")
        );
    }

    #[test]
    fn members_cover_their_principal_or_their_pool_only() {
        let principal = principal_for(PROVIDER, "system:serviceaccount:ray:head");
        assert!(member_covers(&principal, &principal));
        let pool = "principalSet://iam.googleapis.com/projects/123456789/locations/global/workloadIdentityPools/lanyard/*";
        assert!(member_covers(pool, &principal));
        // A pool whose name extends ours is another pool.
        let other_pool = "principalSet://iam.googleapis.com/projects/123456789/locations/global/workloadIdentityPools/lanyard2/*";
        assert!(!member_covers(other_pool, &principal));
        assert!(!member_covers(
            &principal_for(PROVIDER, "system:serviceaccount:ray:worker"),
            &principal
        ));
        // Without the trailing /* it is not a set.
        assert!(!member_covers(pool.trim_end_matches("/*"), &principal));
    }

    #[test]
    fn gke_members_cover_their_kubernetes_service_account_only() {
        let cluster = GkeCluster::named(
            "projects/ray-prod/locations/us-central1/clusters/ray",
            "42",
            "https://issuer",
        )
        .unwrap();
        let head = cluster.principal("ray", "head");
        assert_eq!(
            head,
            "principal://iam.googleapis.com/projects/42/locations/global/workloadIdentityPools/ray-prod.svc.id.goog/subject/ns/ray/sa/head"
        );
        assert!(member_covers(&cluster.member("ray", "head"), &head));
        assert!(member_covers(
            "serviceAccount:ray-prod.svc.id.goog[ray/head]",
            &head
        ));
        assert!(!member_covers(
            "serviceAccount:ray-prod.svc.id.goog[ray/worker]",
            &head
        ));
        assert!(!member_covers(
            "serviceAccount:other.svc.id.goog[ray/head]",
            &head
        ));
        let namespace = "principalSet://iam.googleapis.com/projects/42/locations/global/workloadIdentityPools/ray-prod.svc.id.goog/namespace/ray";
        assert!(member_covers(namespace, &head));
        assert!(!member_covers(
            namespace,
            &cluster.principal("ray2", "head")
        ));
        // A provider's principal is not GKE's, whatever its subject says.
        assert!(!member_covers(
            "serviceAccount:ray-prod.svc.id.goog[ray/head]",
            &principal_for(PROVIDER, "system:serviceaccount:ray:head")
        ));
        assert!(is_gke_member("serviceAccount:p.svc.id.goog[ns/sa]"));
        assert!(!is_gke_member(
            "serviceAccount:sa@p.iam.gserviceaccount.com"
        ));
        assert!(!is_gke_member("serviceAccount:p.svc.id.goog[ns]"));
        assert!(GkeCluster::named("ray", "42", "https://issuer").is_err());
    }

    #[test]
    fn resource_names_split_on_the_last_colon() {
        assert_eq!(
            split_resource("sa@p.iam.gserviceaccount.com:generateAccessToken"),
            Some(("sa@p.iam.gserviceaccount.com", Method::GenerateAccessToken))
        );
        assert_eq!(
            split_resource("a:b@p.iam.gserviceaccount.com:generateIdToken"),
            Some(("a:b@p.iam.gserviceaccount.com", Method::GenerateIdToken))
        );
        assert_eq!(split_resource("sa@p.iam.gserviceaccount.com"), None);
        assert_eq!(split_resource("sa@p.iam.gserviceaccount.com:signJwt"), None);
        assert_eq!(split_resource(":generateIdToken"), None);
    }

    #[test]
    fn durations_parse_like_protobuf_json() {
        assert_eq!(parse_duration("3600s"), Some((3600, 0)));
        assert_eq!(parse_duration("1.5s"), Some((1, 500_000_000)));
        assert_eq!(parse_duration("-2s"), Some((-2, 0)));
        assert_eq!(parse_duration("3600"), None);
        assert_eq!(parse_duration("s"), None);
        assert_eq!(parse_duration("1.0000000001s"), None);
        assert_eq!(parse_duration("1h"), None);
    }

    #[test]
    fn lifetimes_are_bounded_like_iam() {
        assert_eq!(check_lifetime(None).unwrap(), 3600);
        assert_eq!(check_lifetime(Some(&json!("600s"))).unwrap(), 600);
        assert_eq!(check_lifetime(Some(&json!("0.5s"))).unwrap(), 1);
        assert_eq!(
            check_lifetime(Some(&json!("0s"))).unwrap_err().message,
            LIFETIME_ZERO
        );
        assert_eq!(
            check_lifetime(Some(&json!("3601s"))).unwrap_err().message,
            LIFETIME_TOO_LONG
        );
        assert_eq!(
            check_lifetime(Some(&json!(3600))).unwrap_err().status,
            "INVALID_ARGUMENT"
        );
    }

    #[test]
    fn scopes_default_and_reject_like_iam() {
        assert_eq!(
            check_scopes(Some(&json!([""]))).unwrap(),
            vec![CLOUD_PLATFORM_SCOPE]
        );
        assert!(check_scopes(Some(&json!([
            "https://www.googleapis.com/auth/devstorage.read_only"
        ])))
        .is_ok());
        assert!(check_scopes(Some(&json!(["cloud-platform"]))).is_err());
        assert!(check_scopes(Some(&json!([]))).is_err());
        assert!(check_scopes(None).is_err());
        assert!(check_scopes(Some(&json!(
            "https://www.googleapis.com/auth/cloud-platform"
        )))
        .is_err());
    }

    #[test]
    fn unknown_request_fields_are_refused() {
        assert!(request_fields(
            br#"{"scope":[],"lifetime":"1s"}"#,
            Method::GenerateAccessToken
        )
        .is_ok());
        let err = request_fields(br#"{"scopes":[]}"#, Method::GenerateAccessToken).unwrap_err();
        assert!(err.message.contains("Unknown name \"scopes\""));
        assert!(request_fields(
            br#"{"audience":"x","includeEmail":true}"#,
            Method::GenerateIdToken
        )
        .is_ok());
        assert!(request_fields(
            br#"{"delegates":["projects/-/serviceAccounts/x"]}"#,
            Method::GenerateIdToken
        )
        .is_err());
        assert!(request_fields(b"not json", Method::GenerateIdToken).is_err());
        // Documented since 2024: organizationNumberIncluded, a boolean.
        assert!(request_fields(
            br#"{"audience":"x","organizationNumberIncluded":true}"#,
            Method::GenerateIdToken
        )
        .is_ok());
        assert!(request_fields(
            br#"{"scope":["x"],"organizationNumberIncluded":true}"#,
            Method::GenerateAccessToken
        )
        .is_err());
        assert!(request_fields(b"", Method::GenerateIdToken)
            .unwrap()
            .is_empty());
    }

    #[test]
    fn bearer_tokens_are_read_case_insensitively() {
        let mut headers = HeaderMap::new();
        assert_eq!(bearer(&headers), None);
        headers.insert(header::AUTHORIZATION, "bearer abc".parse().unwrap());
        assert_eq!(bearer(&headers), Some("abc"));
        headers.insert(header::AUTHORIZATION, "Basic abc".parse().unwrap());
        assert_eq!(bearer(&headers), None);
        headers.insert(header::AUTHORIZATION, "Bearer ".parse().unwrap());
        assert_eq!(bearer(&headers), None);
    }

    #[test]
    fn json_names_become_form_names() {
        assert_eq!(snake_case("subjectTokenType"), "subject_token_type");
        assert_eq!(snake_case("audience"), "audience");
        assert_eq!(snake_case("grant_type"), "grant_type");
    }

    #[test]
    fn unique_ids_are_stable_21_digit_numbers() {
        let id = service_account_unique_id("a@p.iam.gserviceaccount.com");
        assert_eq!(id.len(), 21);
        assert!(id.bytes().all(|b| b.is_ascii_digit()));
        assert_eq!(id, service_account_unique_id("A@p.iam.gserviceaccount.com"));
        assert_ne!(id, service_account_unique_id("b@p.iam.gserviceaccount.com"));
    }

    #[test]
    fn federated_store_expires_and_stays_bounded() {
        let mut store = FederatedStore::new(2);
        let fed = |p: &str, exp| Federated {
            principal: p.into(),
            expires_at: exp,
        };
        store.insert("t1", fed("p1", 100), 10);
        store.insert("t2", fed("p2", 200), 10);
        assert_eq!(store.get("t1", 50).unwrap().principal, "p1");
        assert!(store.get("t1", 100).is_none(), "expired at its expiry");
        // Full of live tokens: the one closest to expiry goes.
        store.insert("t3", fed("p3", 300), 50);
        assert_eq!(store.tokens.len(), 2);
        assert!(store.get("t1", 50).is_none());
        assert!(store.get("t2", 50).is_some());
        assert!(store.get("t3", 50).is_some());
        // Expired tokens are swept before any live one is evicted.
        store.insert("t4", fed("p4", 400), 250);
        assert!(store.get("t3", 250).is_some());
        assert!(store.get("t4", 250).is_some());
        assert!(store.get("nope", 0).is_none());
    }

    #[test]
    fn timestamps_format_as_rfc3339_utc() {
        assert_eq!(rfc3339(1_796_205_600), "2026-12-02T10:00:00Z");
    }

    #[test]
    fn config_is_validated() {
        let http = reqwest::Client::new();
        let config = |name: &str, member: &str| GcpEmulatorConfig {
            providers: vec![WorkloadIdentityProvider {
                name: name.into(),
                issuer: "http://127.0.0.1:1".into(),
                allowed_audiences: vec![],
            }],
            service_accounts: vec![GcpServiceAccount {
                email: "sa@p.iam.gserviceaccount.com".into(),
                members: vec![member.into()],
            }],
            clusters: vec![],
            lifetime: Duration::from_secs(3600),
        };
        let ok_member = principal_for(PROVIDER, "s");
        assert!(Gcp::new(config(PROVIDER, &ok_member), http.clone()).is_ok());
        assert!(Gcp::new(config("projects/1/x", &ok_member), http.clone()).is_err());
        assert!(Gcp::new(config(PROVIDER, "serviceAccount:x@y"), http.clone()).is_err());
        let mut zero = config(PROVIDER, &ok_member);
        zero.lifetime = Duration::ZERO;
        assert!(Gcp::new(zero, http).is_err());
    }
}
