//! Google: workload identity federation through STS, then (optionally)
//! service-account impersonation through IAM Credentials.
//!
//! 1. STS `POST {sts}/v1/token` exchanges the pod's projected token for a
//!    federated access token of the principal
//!    `principal://…/workloadIdentityPools/P/subject/system:serviceaccount:NS:SA`
//!    (a pool of one's own, `gcp.workload_identity_provider`), or
//!    `principal://…/workloadIdentityPools/PROJECT.svc.id.goog/subject/ns/NS/sa/SA`
//!    (GKE's pool, `gcp.gke_cluster`: the audience is
//!    `identitynamespace:PROJECT.svc.id.goog:https://container.googleapis.com/v1/…/clusters/C`,
//!    as GKE's metadata server sends it, so grants made for GKE Workload
//!    Identity apply unchanged). That token is used directly when the
//!    ServiceAccount names no Google service account.
//! 2. With `iam.gke.io/gcp-service-account`, IAM Credentials
//!    `:generateAccessToken` / `:generateIdToken` turn the federated token
//!    into the service account's access or ID token.
//!
//! The endpoints are `sts.` and `iamcredentials.` in the configured
//! universe domain (`googleapis.com` unless a Trusted Partner Cloud's).
//!
//! Written on reqwest rather than a Google auth crate: we need the raw
//! OAuth `error` / Google `status` to classify failures for caching, and
//! plain-HTTP endpoints for the emulators.
//!
//! The model (annotations, `Binding`, the accepted audiences, the default
//! universe) is `lanyard_core::cloud::gcp`, re-exported here; this module
//! is the exchanger and its settings.

use std::time::Duration;

use reqwest::StatusCode;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{check_endpoint, invalid, Bindings, Invalid};
use super::{
    encode_path_segment, fetcher, now_unix, scrub_message, AccessToken, Cloud, CloudError,
    CloudExchanger, Credential, Fetcher, Identity, Kind, RequestError, Selector, TokenRequest,
};
use crate::secret::{ExposeSecret, SecretString};
use crate::token::Caller;

pub use lanyard_core::cloud::gcp::{
    accepted_audiences, annotations, bindings, is_universe_domain, Binding, DEFAULT_UNIVERSE_DOMAIN,
};

pub mod trust;

/// The scope asked for when the caller names none (what the GCE metadata
/// server hands out by default).
pub const CLOUD_PLATFORM_SCOPE: &str = "https://www.googleapis.com/auth/cloud-platform";

const TOKEN_EXCHANGE_GRANT: &str = "urn:ietf:params:oauth:grant-type:token-exchange";
const ACCESS_TOKEN_TYPE: &str = "urn:ietf:params:oauth:token-type:access_token";
const JWT_TOKEN_TYPE: &str = "urn:ietf:params:oauth:token-type:jwt";
/// Federated tokens never outlive an hour.
const MAX_FEDERATED_SECS: u64 = 3600;

/// The Google exchanger.
#[derive(Clone)]
pub struct GcpExchanger {
    http: reqwest::Client,
    sts_endpoint: String,
    iamcredentials_endpoint: String,
}

#[derive(Deserialize)]
struct StsSuccess {
    access_token: String,
    #[serde(default)]
    expires_in: Option<Value>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct AccessTokenSuccess {
    access_token: String,
    expire_time: String,
}

#[derive(Deserialize)]
struct IdTokenSuccess {
    token: String,
}

impl GcpExchanger {
    /// An exchanger calling STS at `sts_endpoint` and IAM Credentials at
    /// `iamcredentials_endpoint` (base URLs; trailing `/`s are dropped).
    pub fn new(
        http: reqwest::Client,
        sts_endpoint: impl Into<String>,
        iamcredentials_endpoint: impl Into<String>,
    ) -> Self {
        GcpExchanger {
            http,
            sts_endpoint: sts_endpoint.into().trim_end_matches('/').to_string(),
            iamcredentials_endpoint: iamcredentials_endpoint
                .into()
                .trim_end_matches('/')
                .to_string(),
        }
    }

    /// The STS base URL, without a trailing `/`.
    pub fn sts_endpoint(&self) -> &str {
        &self.sts_endpoint
    }

    /// The IAM Credentials base URL, without a trailing `/`.
    pub fn iamcredentials_endpoint(&self) -> &str {
        &self.iamcredentials_endpoint
    }

    /// Exchanges `subject` (a projected token whose `aud` the provider
    /// accepts) for a federated access token. `provider_audience` is the
    /// provider's full resource name,
    /// `//iam.googleapis.com/projects/N/locations/global/workloadIdentityPools/P/providers/R`.
    pub async fn exchange(
        &self,
        subject: &SecretString,
        provider_audience: &str,
        scopes: &[String],
    ) -> Result<AccessToken, CloudError> {
        let scope = join_scopes(scopes);
        let form = [
            ("grant_type", TOKEN_EXCHANGE_GRANT),
            ("audience", provider_audience),
            ("scope", scope.as_str()),
            ("requested_token_type", ACCESS_TOKEN_TYPE),
            ("subject_token", subject.expose_secret()),
            ("subject_token_type", JWT_TOKEN_TYPE),
        ];
        let issued_at = now_unix();
        let request = self
            .http
            .post(format!("{}/v1/token", self.sts_endpoint))
            .form(&form);
        let body = send(request, subject.expose_secret()).await?;
        let ok: StsSuccess = serde_json::from_slice(&body).map_err(|e| CloudError::Protocol {
            cloud: Cloud::Gcp,
            reason: format!("STS token response: {e}"),
        })?;
        let expires_in = match &ok.expires_in {
            Some(v) => Some(positive_seconds(v).ok_or_else(|| CloudError::Protocol {
                cloud: Cloud::Gcp,
                reason: "STS token response has an invalid expires_in".into(),
            })?),
            None => None,
        };
        // STS leaves out expires_in when the subject token has only seconds
        // left; the federated token then lives as long as the subject token.
        let expires_at = match expires_in {
            Some(secs) => issued_at + secs,
            None => jwt_exp(subject.expose_secret())
                .map(|exp| exp.min(issued_at + MAX_FEDERATED_SECS))
                .ok_or_else(|| CloudError::Protocol {
                    cloud: Cloud::Gcp,
                    reason: "STS token response has no expires_in and the subject token no exp"
                        .into(),
                })?,
        };
        Ok(AccessToken {
            rendered: Default::default(),
            token: SecretString::from(ok.access_token),
            issued_at,
            expires_at,
        })
    }

    /// Impersonates `email` with a federated token: an OAuth access token of
    /// the service account for `scopes` (cloud-platform when empty), living
    /// `lifetime` (IAM allows at most one hour by default).
    pub async fn generate_access_token(
        &self,
        federated: &SecretString,
        email: &str,
        scopes: &[String],
        lifetime: Duration,
    ) -> Result<AccessToken, CloudError> {
        let scope: Vec<&str> = if scopes.is_empty() {
            vec![CLOUD_PLATFORM_SCOPE]
        } else {
            scopes.iter().map(String::as_str).collect()
        };
        let payload = json!({
            "scope": scope,
            "lifetime": format!("{}s", lifetime.as_secs()),
        });
        let issued_at = now_unix();
        let body = send(
            self.iam_request(federated, email, "generateAccessToken")
                .json(&payload),
            federated.expose_secret(),
        )
        .await?;
        let ok: AccessTokenSuccess =
            serde_json::from_slice(&body).map_err(|e| CloudError::Protocol {
                cloud: Cloud::Gcp,
                reason: format!("generateAccessToken response: {e}"),
            })?;
        let expires_at = parse_rfc3339(&ok.expire_time).ok_or_else(|| CloudError::Protocol {
            cloud: Cloud::Gcp,
            reason: format!(
                "generateAccessToken expireTime {:?} is not an RFC 3339 time",
                scrub_message(&ok.expire_time, "")
            ),
        })?;
        Ok(AccessToken {
            rendered: Default::default(),
            token: SecretString::from(ok.access_token),
            issued_at,
            expires_at,
        })
    }

    /// Impersonates `email` with a federated token: a Google-signed ID token
    /// for `audience`, carrying `email`/`email_verified` when `include_email`.
    pub async fn generate_id_token(
        &self,
        federated: &SecretString,
        email: &str,
        audience: &str,
        include_email: bool,
    ) -> Result<AccessToken, CloudError> {
        let issued_at = now_unix();
        let payload = json!({ "audience": audience, "includeEmail": include_email });
        let body = send(
            self.iam_request(federated, email, "generateIdToken")
                .json(&payload),
            federated.expose_secret(),
        )
        .await?;
        let ok: IdTokenSuccess =
            serde_json::from_slice(&body).map_err(|e| CloudError::Protocol {
                cloud: Cloud::Gcp,
                reason: format!("generateIdToken response: {e}"),
            })?;
        // Not verified: it came over TLS from Google and we only need to
        // know how long to cache it. Whoever consumes it verifies it.
        let expires_at = jwt_exp(&ok.token).ok_or_else(|| CloudError::Protocol {
            cloud: Cloud::Gcp,
            reason: "generateIdToken returned a token that is not a JWT with an exp claim".into(),
        })?;
        Ok(AccessToken {
            rendered: Default::default(),
            token: SecretString::from(ok.token),
            issued_at,
            expires_at,
        })
    }

    fn iam_request(
        &self,
        federated: &SecretString,
        email: &str,
        method: &str,
    ) -> reqwest::RequestBuilder {
        self.http
            .post(format!(
                "{}/v1/projects/-/serviceAccounts/{}:{method}",
                self.iamcredentials_endpoint,
                encode_path_segment(email)
            ))
            .bearer_auth(federated.expose_secret())
    }
}

/// The Google side of the broker: the exchanger, the workload identity
/// provider callers federate through, and the project they act in.
#[derive(Clone)]
pub struct GcpCloud {
    /// The STS and IAM Credentials client.
    pub exchanger: GcpExchanger,
    /// The STS `audience`: the workload identity pool provider,
    /// `//iam.googleapis.com/projects/N/locations/global/workloadIdentityPools/P/providers/R`,
    /// or GKE's pool and cluster, `identitynamespace:PROJECT.svc.id.goog:https://container.googleapis.com/v1/projects/…/clusters/C`.
    pub provider: String,
    /// Audience callers' projected tokens must carry for Google.
    pub audience: String,
    /// The project id callers act in: reported by the metadata server and
    /// naming the federated principal `PROJECT.svc.id.goog`.
    pub project_id: String,
    /// The numeric project number, as the metadata server's
    /// `numeric-project-id` reports it.
    pub project_number: String,
    /// Lifetime asked of `generateAccessToken` (and the most a caller may ask).
    pub token_lifetime: Duration,
}

/// The Google identity of a ServiceAccount.
#[derive(Debug, Clone)]
pub struct GcpBound {
    /// The impersonated service account, or `PROJECT.svc.id.goog` when the
    /// caller uses its federated principal directly (as GKE reports it).
    pub email: String,
    /// Whether `email` is a real service account being impersonated.
    pub impersonated: bool,
}

/// Shortest access-token lifetime a caller may ask for (IAM's minimum).
const MIN_LIFETIME: Duration = Duration::from_secs(300);

impl GcpCloud {
    fn lifetime(&self, request: &TokenRequest) -> Duration {
        request.lifetime.map_or(self.token_lifetime, |l| {
            l.clamp(MIN_LIFETIME, self.token_lifetime.max(MIN_LIFETIME))
        })
    }

    /// Requested scopes, trimmed, sorted and deduplicated.
    fn scopes(request: &TokenRequest) -> Vec<String> {
        let mut scopes: Vec<String> = request
            .scopes
            .iter()
            .map(|s| s.trim())
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        scopes.sort();
        scopes.dedup();
        scopes
    }
}

impl CloudExchanger for GcpCloud {
    type Binding = GcpBound;

    fn cloud(&self) -> Cloud {
        Cloud::Gcp
    }

    fn audience(&self) -> &str {
        &self.audience
    }

    fn kinds(&self) -> &'static [Kind] {
        &[Kind::AccessToken, Kind::IdToken]
    }

    /// Every ServiceAccount has a Google identity: the impersonated service
    /// account it names, or else its federated principal.
    fn bind(&self, bindings: &Bindings, _: &Caller) -> Result<Vec<GcpBound>, RequestError> {
        if bindings.gcp.is_empty() {
            return Ok(vec![GcpBound {
                email: format!("{}.svc.id.goog", self.project_id),
                impersonated: false,
            }]);
        }
        Ok(bindings
            .gcp
            .iter()
            .map(|email| GcpBound {
                email: email.clone(),
                impersonated: true,
            })
            .collect())
    }

    fn identity(&self, bound: &GcpBound) -> Identity {
        Identity {
            cloud: Cloud::Gcp,
            id: bound.email.clone(),
            account: self.project_id.clone(),
            account_number: Some(self.project_number.clone()),
            source: crate::cloud::Source::Federation,
            via: None,
        }
    }

    fn lifetime(&self, bound: &GcpBound, request: &TokenRequest) -> Option<Duration> {
        // Google's ID tokens live an hour, whatever is asked; the federated
        // principal's access token lives as long as STS decides.
        (request.kind == Kind::AccessToken && bound.impersonated)
            .then(|| GcpCloud::lifetime(self, request))
    }

    fn selects(&self, bound: &GcpBound, selector: &Selector) -> bool {
        matches!(selector, Selector::Email(e) if e.eq_ignore_ascii_case(&bound.email))
    }

    fn scope(&self, bound: &GcpBound, request: &TokenRequest) -> Result<String, RequestError> {
        match request.kind {
            Kind::IdToken => {
                if !bound.impersonated {
                    // A federated principal has no email to sign ID tokens
                    // for; GKE refuses the same way.
                    return Err(RequestError::BadRequest(
                        "ID tokens need a Google service account: annotate the Kubernetes service account with iam.gke.io/gcp-service-account".into(),
                    ));
                }
                let audience = request.audience.as_deref().map(str::trim).unwrap_or("");
                if audience.is_empty() {
                    return Err(RequestError::BadRequest("audience is required".into()));
                }
                let format = if request.include_email {
                    "full"
                } else {
                    "standard"
                };
                Ok(format!("id_token {format} {audience}"))
            }
            _ => {
                let scopes = Self::scopes(request).join(" ");
                match request.lifetime {
                    None => Ok(scopes),
                    Some(_) => Ok(format!(
                        "{scopes} lifetime={}",
                        self.lifetime(request).as_secs()
                    )),
                }
            }
        }
    }

    fn fetcher(&self, bound: &GcpBound, request: &TokenRequest, _: &Caller) -> Fetcher {
        let base = (self.exchanger.clone(), self.provider.clone());
        if request.kind == Kind::IdToken {
            let params = (
                base,
                bound.email.clone(),
                request.audience.as_deref().unwrap_or("").trim().to_string(),
                request.include_email,
            );
            return fetcher(params, |p, subject| async move {
                let ((exchanger, provider), email, audience, include_email) = &*p;
                let federated = federate(exchanger, &subject, provider).await?;
                let id = exchanger
                    .generate_id_token(&federated.token, email, audience, *include_email)
                    .await?;
                Ok(Credential::IdToken(id))
            });
        }
        let params = (
            base,
            bound.impersonated.then(|| bound.email.clone()),
            Self::scopes(request),
            self.lifetime(request),
        );
        fetcher(params, |p, subject| async move {
            let ((exchanger, provider), email, scopes, lifetime) = &*p;
            let token = match email {
                Some(email) => {
                    let federated = federate(exchanger, &subject, provider).await?;
                    exchanger
                        .generate_access_token(&federated.token, email, scopes, *lifetime)
                        .await?
                }
                None => exchanger.exchange(&subject, provider, scopes).await?,
            };
            Ok(Credential::Token(token))
        })
    }
}

/// The federated (STS) token that impersonation starts from.
async fn federate(
    exchanger: &GcpExchanger,
    subject: &SecretString,
    provider: &str,
) -> Result<AccessToken, CloudError> {
    let scopes = [CLOUD_PLATFORM_SCOPE.to_string()];
    exchanger.exchange(subject, provider, &scopes).await
}

/// Sends `request` and returns the body of a 2xx answer, or the classified
/// error. `secret` is the credential the request carried, scrubbed from any
/// upstream message that might echo it.
async fn send(request: reqwest::RequestBuilder, secret: &str) -> Result<Vec<u8>, CloudError> {
    let answer = super::send::send(Cloud::Gcp, request, None).await?;
    if answer.status.is_success() {
        return Ok(answer.body.to_vec());
    }
    Err(classify(
        answer.status,
        answer.retry_after,
        &answer.body,
        secret,
    ))
}

/// Google's two error shapes: OAuth `{error, error_description}` (STS) and
/// `{"error": {code, message, status}}` (every other Google API).
fn parse_failure(body: &[u8]) -> Option<(String, String)> {
    let value: Value = serde_json::from_slice(body).ok()?;
    match value.get("error")? {
        Value::String(code) if !code.is_empty() => {
            let message = value
                .get("error_description")
                .and_then(Value::as_str)
                .unwrap_or(code);
            Some((code.clone(), message.to_string()))
        }
        Value::Object(error) => {
            let status = error.get("status").and_then(Value::as_str);
            let code = error.get("code").and_then(Value::as_u64);
            let code = match (status, code) {
                (Some(s), _) if !s.is_empty() => s.to_string(),
                (_, Some(c)) => format!("HTTP{c}"),
                _ => return None,
            };
            let message = error
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or(&code)
                .to_string();
            Some((code, message))
        }
        _ => None,
    }
}

/// Codes that mean "slow down" rather than "no".
fn is_throttle(code: &str) -> bool {
    matches!(
        code,
        "RESOURCE_EXHAUSTED" | "quota_exceeded" | "rate_limit_exceeded"
    )
}

/// Codes that mean Google failed on its side, whatever the HTTP status.
fn is_transient(code: &str) -> bool {
    matches!(
        code,
        "UNAVAILABLE"
            | "INTERNAL"
            | "DEADLINE_EXCEEDED"
            | "temporarily_unavailable"
            | "server_error"
    )
}

/// Maps a non-2xx answer to a [`CloudError`].
fn classify(status: StatusCode, retry: Option<Duration>, body: &[u8], secret: &str) -> CloudError {
    let failure = parse_failure(body).map(|(code, message)| {
        (
            scrub_message(&code, secret),
            scrub_message(&message, secret),
        )
    });
    if status == StatusCode::TOO_MANY_REQUESTS
        || failure.as_ref().is_some_and(|(code, _)| is_throttle(code))
    {
        return CloudError::Throttled {
            cloud: Cloud::Gcp,
            code: failure
                .map(|(code, _)| code)
                .unwrap_or_else(|| "HTTP429".into()),
            retry_after: retry.or(Some(Duration::from_secs(5))),
        };
    }
    if status.is_server_error() || failure.as_ref().is_some_and(|(code, _)| is_transient(code)) {
        let detail = failure
            .map(|(code, message)| format!("{code}: {message}"))
            .unwrap_or_else(|| "no error body".into());
        return CloudError::Unavailable {
            cloud: Cloud::Gcp,
            reason: format!("HTTP {}: {detail}", status.as_u16()),
        };
    }
    match failure {
        // invalid_grant, invalid_target, UNAUTHENTICATED, PERMISSION_DENIED,
        // NOT_FOUND, INVALID_ARGUMENT…: the same request will fail again.
        Some((code, message)) => CloudError::Rejected {
            cloud: Cloud::Gcp,
            code,
            message,
        },
        None => CloudError::Protocol {
            cloud: Cloud::Gcp,
            reason: format!("HTTP {} without a Google error body", status.as_u16()),
        },
    }
}

/// STS sends an integer; tolerate a numeric string as some proxies do.
fn positive_seconds(value: &Value) -> Option<u64> {
    match value {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// Space-separated scopes for STS, cloud-platform when none are given.
fn join_scopes(scopes: &[String]) -> String {
    let scopes: Vec<&str> = scopes
        .iter()
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .collect();
    if scopes.is_empty() {
        CLOUD_PLATFORM_SCOPE.to_string()
    } else {
        scopes.join(" ")
    }
}

/// The unverified `exp` of a JWT.
fn jwt_exp(token: &str) -> Option<u64> {
    #[derive(Deserialize)]
    struct Exp {
        exp: u64,
    }
    jsonwebtoken::dangerous::insecure_decode_claims::<Exp>(token)
        .ok()
        .map(|c| c.exp)
}

/// Parses the RFC 3339 times Google sends (`2026-12-02T10:00:00Z`, with an
/// optional fraction and a `Z` or `±HH:MM` offset) into Unix seconds.
fn parse_rfc3339(text: &str) -> Option<u64> {
    super::parse_rfc3339(text).and_then(super::unix_seconds)
}

/// The `gcp` section of the configuration: Google workload identity
/// federation, through a pool of one's own or GKE's.
#[derive(Debug, Clone, PartialEq, serde::Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// `//iam.googleapis.com/projects/N/locations/global/workloadIdentityPools/P/providers/R`.
    pub workload_identity_provider: Option<String>,
    /// GKE's own pool instead of a provider: the cluster,
    /// `projects/PROJECT/locations/LOCATION/clusters/CLUSTER`.
    pub gke_cluster: Option<String>,
    /// The Google project id callers act in (6–30 lowercase letters, digits and
    /// `-`); required with a workload identity provider, and the cluster's
    /// project with GKE's pool.
    pub project_id: Option<String>,
    /// The numeric project number; default: the one in the provider's name
    /// (required with GKE's pool).
    pub project_number: Option<String>,
    /// Audience callers' projected tokens must carry; default: the provider
    /// (`PROJECT.svc.id.goog` with GKE's pool, which accepts no other).
    pub audience: Option<String>,
    /// The universe the endpoints are in (`googleapis.com`; a Trusted
    /// Partner Cloud's domain), reported by the metadata server.
    pub universe_domain: String,
    /// Overrides Google's STS endpoint (private endpoints, emulators).
    pub sts_endpoint: Option<String>,
    /// Overrides Google's IAM Credentials endpoint (private endpoints,
    /// emulators).
    pub iamcredentials_endpoint: Option<String>,
    /// Lifetime, in seconds, asked of generateAccessToken (300–3600).
    pub token_lifetime: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            workload_identity_provider: None,
            gke_cluster: None,
            project_id: None,
            project_number: None,
            audience: None,
            universe_domain: DEFAULT_UNIVERSE_DOMAIN.to_string(),
            sts_endpoint: None,
            iamcredentials_endpoint: None,
            token_lifetime: 3600,
        }
    }
}

/// A GKE cluster whose Workload Identity pool, `PROJECT.svc.id.goog`, the
/// exchange goes through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GkeCluster {
    /// The cluster's project id (the pool's name is `PROJECT.svc.id.goog`).
    pub project: String,
    /// Its region or zone.
    pub location: String,
    /// Its name.
    pub name: String,
}

impl GkeCluster {
    /// Parses `projects/PROJECT/locations/LOCATION/clusters/CLUSTER`.
    pub fn parse(text: &str) -> Option<GkeCluster> {
        let parts: Vec<&str> = text.split('/').collect();
        match parts.as_slice() {
            ["projects", project, "locations", location, "clusters", name]
                if is_project_id(project) && is_gke_name(location) && is_gke_name(name) =>
            {
                Some(GkeCluster {
                    project: project.to_string(),
                    location: location.to_string(),
                    name: name.to_string(),
                })
            }
            _ => None,
        }
    }

    /// The pool, `PROJECT.svc.id.goog`: also the audience of the tokens
    /// GKE's pool accepts.
    pub fn pool(&self) -> String {
        format!("{}.svc.id.goog", self.project)
    }

    /// The STS `audience` of an exchange through the cluster's pool, as
    /// GKE's metadata server sends it:
    /// `identitynamespace:PROJECT.svc.id.goog:https://container.googleapis.com/v1/projects/PROJECT/locations/LOCATION/clusters/CLUSTER`.
    pub fn sts_audience(&self) -> String {
        format!(
            "identitynamespace:{}:https://container.googleapis.com/v1/projects/{}/locations/{}/clusters/{}",
            self.pool(),
            self.project,
            self.location,
            self.name
        )
    }
}

/// GKE locations and cluster names: lowercase letters, digits and `-`
/// (cluster names up to 40 characters, locations shorter).
fn is_gke_name(s: &str) -> bool {
    (1..=40).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && s.starts_with(|c: char| c.is_ascii_lowercase())
}

impl Settings {
    /// Checks the section: provider or cluster, project, endpoints and
    /// token lifetime.
    pub fn check(&self) -> Result<(), Invalid> {
        let g = self;
        if let Some(p) = &g.workload_identity_provider {
            if !is_provider_name(p) {
                return Err(invalid(
                    "gcp.workload_identity_provider",
                    "//iam.googleapis.com/projects/NUMBER/locations/global/workloadIdentityPools/POOL/providers/PROVIDER",
                    p,
                ));
            }
        }
        if let Some(c) = &g.gke_cluster {
            let Some(cluster) = GkeCluster::parse(c) else {
                return Err(invalid(
                    "gcp.gke_cluster",
                    "projects/PROJECT_ID/locations/LOCATION/clusters/CLUSTER",
                    c,
                ));
            };
            if g.workload_identity_provider.is_some() {
                return Err(invalid(
                    "gcp.gke_cluster",
                    "unset when gcp.workload_identity_provider is set (one pool: GKE's or a provider's)",
                    c,
                ));
            }
            if let Some(id) = g.project_id.as_ref().filter(|id| **id != cluster.project) {
                return Err(invalid(
                    "gcp.project_id",
                    "the GKE cluster's project (gcp.gke_cluster), or unset",
                    id,
                ));
            }
            if let Some(aud) = g.audience.as_ref().filter(|a| **a != cluster.pool()) {
                return Err(invalid(
                    "gcp.audience",
                    "PROJECT_ID.svc.id.goog (the only audience GKE's pool accepts), or unset",
                    aud,
                ));
            }
            if g.project_number.is_none() {
                return Err(Invalid {
                    key: "gcp.project_number",
                    expected: "the cluster project's number (LANYARD_GCP_PROJECT_NUMBER), required with gcp.gke_cluster",
                    got: String::new(),
                });
            }
        }
        if let Some(n) = &g.project_number {
            if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                return Err(invalid(
                    "gcp.project_number",
                    "the numeric project number",
                    n,
                ));
            }
        }
        if let Some(id) = &g.project_id {
            if !is_project_id(id) {
                return Err(invalid(
                    "gcp.project_id",
                    "a project id (6-30 lowercase letters, digits, '-')",
                    id,
                ));
            }
        }
        if !is_universe_domain(&g.universe_domain) {
            return Err(invalid(
                "gcp.universe_domain",
                "a DNS domain (googleapis.com)",
                &g.universe_domain,
            ));
        }
        for (key, value) in [
            ("gcp.sts_endpoint", &g.sts_endpoint),
            ("gcp.iamcredentials_endpoint", &g.iamcredentials_endpoint),
        ] {
            if let Some(v) = value {
                check_endpoint(v).map_err(|expected| invalid(key, expected, v))?;
            }
        }
        if !(300..=3600).contains(&g.token_lifetime) {
            return Err(invalid(
                "gcp.token_lifetime",
                "seconds between 300 and 3600",
                &g.token_lifetime.to_string(),
            ));
        }
        Ok(())
    }

    /// The GKE cluster whose pool the exchange goes through, if any.
    pub fn gke(&self) -> Option<GkeCluster> {
        self.gke_cluster.as_deref().and_then(GkeCluster::parse)
    }

    /// The audience callers' tokens carry for Google: the configured one,
    /// else the provider's name (`PROJECT.svc.id.goog` with GKE's pool);
    /// `None` when Google is off.
    pub fn token_audience(&self) -> Option<String> {
        self.audience
            .clone()
            .or_else(|| self.workload_identity_provider.clone())
            .or_else(|| self.gke().map(|c| c.pool()))
    }

    /// The Google side of the broker these settings describe; `None`
    /// without a workload identity provider or a GKE cluster (Google is
    /// then off).
    pub fn exchanger(&self, http: reqwest::Client) -> Result<Option<GcpCloud>, Invalid> {
        let (sts_audience, project_id, derived_number) = match (
            &self.workload_identity_provider,
            self.gke(),
        ) {
            (Some(provider), _) => {
                let project_id = self.project_id.clone().ok_or(Invalid {
                    key: "gcp.project_id",
                    expected: "the project id (LANYARD_GCP_PROJECT_ID), required with a workload identity provider",
                    got: String::new(),
                })?;
                let number = provider
                    .strip_prefix("//iam.googleapis.com/projects/")
                    .and_then(|r| r.split('/').next())
                    .unwrap_or_default()
                    .to_string();
                (provider.clone(), project_id, number)
            }
            (None, Some(cluster)) => (cluster.sts_audience(), cluster.project, String::new()),
            (None, None) => return Ok(None),
        };
        let project_number = self.project_number.clone().unwrap_or(derived_number);
        let endpoint = |configured: &Option<String>, service: &str| {
            configured
                .clone()
                .unwrap_or_else(|| format!("https://{service}.{}", self.universe_domain))
        };
        Ok(Some(GcpCloud {
            exchanger: GcpExchanger::new(
                http,
                endpoint(&self.sts_endpoint, "sts"),
                endpoint(&self.iamcredentials_endpoint, "iamcredentials"),
            ),
            audience: self
                .token_audience()
                .unwrap_or_else(|| sts_audience.clone()),
            provider: sts_audience,
            project_id,
            project_number,
            token_lifetime: Duration::from_secs(self.token_lifetime),
        }))
    }
}

fn is_provider_name(s: &str) -> bool {
    let Some(rest) = s.strip_prefix("//iam.googleapis.com/projects/") else {
        return false;
    };
    let parts: Vec<&str> = rest.split('/').collect();
    matches!(
        parts.as_slice(),
        [number, "locations", "global", "workloadIdentityPools", pool, "providers", provider]
            if !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit())
                && !pool.is_empty() && !provider.is_empty()
    )
}

fn is_project_id(s: &str) -> bool {
    (6..=30).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && s.starts_with(|c: char| c.is_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_times_parse() {
        assert_eq!(parse_rfc3339("2026-12-02T10:00:00Z"), Some(1_796_205_600));
        assert_eq!(
            parse_rfc3339("2026-12-02T10:00:00.123456789Z"),
            Some(1_796_205_600)
        );
        assert_eq!(
            parse_rfc3339("2026-12-02T11:30:00+01:30"),
            Some(1_796_205_600)
        );
        assert_eq!(
            parse_rfc3339("2026-12-02T08:00:00-02:00"),
            Some(1_796_205_600)
        );
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_rfc3339("2026-12-02 10:00:00z"), Some(1_796_205_600));
        // RFC 3339 allows leap seconds; `time` reads :60 as the last
        // instant of :59.
        assert_eq!(parse_rfc3339("2026-12-31T23:59:60Z"), Some(1_798_761_599));
        for bad in [
            "2026-12-02X10:00:00Z",
            "2026-12-02T10:00:00+24:00",
            "",
            "2026-12-02",
            "2026-12-02T10:00:00",
            "2026-13-02T10:00:00Z",
            "2026-02-30T10:00:00Z",
            "2026-12-02T24:00:00Z",
            "2026-12-02T10:00:00.Z",
            "2026-12-02T10:00:00+0100",
            "2026-12-02T10:00:00ZZ",
            "20x6-12-02T10:00:00Z",
            "1969-12-31T23:59:59Z",
        ] {
            assert_eq!(parse_rfc3339(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn failures_of_both_shapes_parse() {
        assert_eq!(
            parse_failure(br#"{"error":"invalid_grant","error_description":"Unable to verify the ID Token signature."}"#),
            Some(("invalid_grant".into(), "Unable to verify the ID Token signature.".into()))
        );
        assert_eq!(
            parse_failure(br#"{"error":"invalid_target"}"#),
            Some(("invalid_target".into(), "invalid_target".into()))
        );
        assert_eq!(
            parse_failure(
                br#"{"error":{"code":403,"message":"denied","status":"PERMISSION_DENIED"}}"#
            ),
            Some(("PERMISSION_DENIED".into(), "denied".into()))
        );
        assert_eq!(
            parse_failure(br#"{"error":{"code":404,"message":"gone"}}"#),
            Some(("HTTP404".into(), "gone".into()))
        );
        assert_eq!(parse_failure(b"<html>502</html>"), None);
        assert_eq!(parse_failure(br#"{"error":{}}"#), None);
        assert_eq!(parse_failure(br#"{"message":"x"}"#), None);
    }

    fn rejected_code(e: &CloudError) -> Option<&str> {
        match e {
            CloudError::Rejected { code, .. } => Some(code),
            _ => None,
        }
    }

    #[test]
    fn errors_are_classified() {
        let e = classify(
            StatusCode::BAD_REQUEST,
            None,
            br#"{"error":"invalid_grant","error_description":"ID Token issued at 1 is stale to sign-in."}"#,
            "",
        );
        assert_eq!(rejected_code(&e), Some("invalid_grant"));
        assert!(!e.is_retryable());

        let e = classify(
            StatusCode::FORBIDDEN,
            None,
            br#"{"error":{"code":403,"message":"Permission 'iam.serviceAccounts.getAccessToken' denied on resource (or it may not exist).","status":"PERMISSION_DENIED"}}"#,
            "",
        );
        assert_eq!(rejected_code(&e), Some("PERMISSION_DENIED"));

        let e = classify(
            StatusCode::TOO_MANY_REQUESTS,
            Some(Duration::from_secs(30)),
            br#"{"error":"quota_exceeded","error_description":"The request was throttled due to rate limit: sts.googleapis.com/requests. Please retry after a few seconds."}"#,
            "",
        );
        match e {
            CloudError::Throttled {
                code, retry_after, ..
            } => {
                assert_eq!(code, "quota_exceeded");
                assert_eq!(retry_after, Some(Duration::from_secs(30)));
            }
            other => panic!("{other:?}"),
        }

        // RESOURCE_EXHAUSTED is throttling even if a proxy changed the status.
        let e = classify(
            StatusCode::FORBIDDEN,
            None,
            br#"{"error":{"code":429,"message":"Quota exceeded","status":"RESOURCE_EXHAUSTED"}}"#,
            "",
        );
        assert!(
            matches!(e, CloudError::Throttled { ref code, retry_after: Some(_), .. } if code == "RESOURCE_EXHAUSTED")
        );

        let e = classify(StatusCode::TOO_MANY_REQUESTS, None, b"", "");
        assert_eq!(e.code(), Some("HTTP429"));

        let e = classify(
            StatusCode::INTERNAL_SERVER_ERROR,
            None,
            br#"{"error":{"code":500,"message":"Internal error encountered.","status":"INTERNAL"}}"#,
            "",
        );
        assert!(matches!(e, CloudError::Unavailable { .. }));
        assert!(e.is_retryable());
        assert!(matches!(
            classify(StatusCode::BAD_GATEWAY, None, b"<html/>", ""),
            CloudError::Unavailable { .. }
        ));
        assert!(matches!(
            classify(StatusCode::NOT_FOUND, None, b"<html>Not Found</html>", ""),
            CloudError::Protocol { .. }
        ));
    }

    #[test]
    fn tokens_never_reach_error_messages() {
        let secret = "eyJhbGciOiJSUzI1NiJ9.c2VjcmV0.c2ln";
        let body =
            format!(r#"{{"error":"invalid_grant","error_description":"bad token {secret}"}}"#);
        let e = classify(StatusCode::BAD_REQUEST, None, body.as_bytes(), secret);
        assert!(!e.to_string().contains(secret));
        assert!(e.to_string().contains("[redacted]"));
    }

    #[test]
    fn long_messages_are_truncated() {
        let body = format!(
            r#"{{"error":"invalid_grant","error_description":"{}"}}"#,
            "x".repeat(100_000)
        );
        match classify(StatusCode::BAD_REQUEST, None, body.as_bytes(), "") {
            CloudError::Rejected { message, .. } => {
                assert!(message.len() <= crate::cloud::MAX_MESSAGE_BYTES + 3)
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn scopes_default_to_cloud_platform() {
        assert_eq!(join_scopes(&[]), CLOUD_PLATFORM_SCOPE);
        assert_eq!(join_scopes(&[" ".into()]), CLOUD_PLATFORM_SCOPE);
        assert_eq!(join_scopes(&["a".into(), "b".into()]), "a b");
    }

    #[test]
    fn emails_cannot_escape_their_path_segment() {
        assert_eq!(
            encode_path_segment("sa@p.iam.gserviceaccount.com"),
            "sa@p.iam.gserviceaccount.com"
        );
        assert_eq!(
            encode_path_segment("a/../b:signJwt?x"),
            "a%2F..%2Fb%3AsignJwt%3Fx"
        );
    }

    #[test]
    fn expires_in_may_be_number_or_string() {
        assert_eq!(positive_seconds(&json!(3599)), Some(3599));
        assert_eq!(positive_seconds(&json!("3599")), Some(3599));
        assert_eq!(positive_seconds(&json!(-1)), None);
        assert_eq!(positive_seconds(&json!(null)), None);
    }

    #[test]
    fn jwt_exp_reads_the_payload() {
        use base64::Engine;
        let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let token = format!(
            "{}.{}.sig",
            b64(r#"{"alg":"RS256"}"#),
            b64(r#"{"exp":1796205600}"#)
        );
        assert_eq!(jwt_exp(&token), Some(1_796_205_600));
        assert_eq!(jwt_exp("not-a-jwt"), None);
        let no_exp = format!("{}.{}.sig", b64(r#"{"alg":"RS256"}"#), b64(r#"{"iat":1}"#));
        assert_eq!(jwt_exp(&no_exp), None);
    }

    const CLUSTER: &str = "projects/ray-prod-4821/locations/us-central1/clusters/ray";

    fn gke_settings() -> Settings {
        Settings {
            gke_cluster: Some(CLUSTER.into()),
            project_number: Some("310987654321".into()),
            ..Settings::default()
        }
    }

    fn refused_key(settings: &Settings) -> &'static str {
        settings.check().expect_err("refused").key
    }

    #[test]
    fn gke_clusters_parse_strictly() {
        let c = GkeCluster::parse(CLUSTER).unwrap();
        assert_eq!(c.pool(), "ray-prod-4821.svc.id.goog");
        assert_eq!(
            c.sts_audience(),
            "identitynamespace:ray-prod-4821.svc.id.goog:https://container.googleapis.com/v1/projects/ray-prod-4821/locations/us-central1/clusters/ray"
        );
        for bad in [
            "",
            "projects/ray-prod-4821/locations/us-central1/clusters/",
            "projects/Ray/locations/us-central1/clusters/ray",
            "projects/ray-prod-4821/zones/us-central1-a/clusters/ray",
            "projects/ray-prod-4821/locations/us-central1/clusters/ray/x",
            "https://container.googleapis.com/v1/projects/ray-prod-4821/locations/us-central1/clusters/ray",
        ] {
            assert!(GkeCluster::parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn gke_mode_derives_audience_project_and_sts_audience() {
        let s = gke_settings();
        s.check().unwrap();
        assert_eq!(
            s.token_audience().as_deref(),
            Some("ray-prod-4821.svc.id.goog")
        );
        let google = s.exchanger(reqwest::Client::new()).unwrap().unwrap();
        assert_eq!(google.project_id, "ray-prod-4821");
        assert_eq!(google.project_number, "310987654321");
        assert_eq!(google.audience, "ray-prod-4821.svc.id.goog");
        assert!(google
            .provider
            .starts_with("identitynamespace:ray-prod-4821.svc.id.goog:"));
        assert_eq!(
            google.exchanger.sts_endpoint(),
            "https://sts.googleapis.com"
        );
    }

    #[test]
    fn gke_mode_refuses_what_gkes_pool_would_not_take() {
        let mut s = gke_settings();
        s.workload_identity_provider = Some(
            "//iam.googleapis.com/projects/1/locations/global/workloadIdentityPools/p/providers/r"
                .into(),
        );
        assert_eq!(refused_key(&s), "gcp.gke_cluster");
        let mut s = gke_settings();
        s.project_id = Some("another-project".into());
        assert_eq!(refused_key(&s), "gcp.project_id");
        // The cluster's own project is fine.
        s.project_id = Some("ray-prod-4821".into());
        assert!(s.check().is_ok());
        let mut s = gke_settings();
        s.audience = Some("sts.googleapis.com".into());
        assert_eq!(refused_key(&s), "gcp.audience");
        let mut s = gke_settings();
        s.project_number = None;
        assert_eq!(refused_key(&s), "gcp.project_number");
        let mut s = gke_settings();
        s.gke_cluster = Some("ray".into());
        assert_eq!(refused_key(&s), "gcp.gke_cluster");
    }

    #[test]
    fn the_universe_domain_names_the_endpoints() {
        let mut s = gke_settings();
        s.universe_domain = "apis-tpczero.goog".into();
        s.check().unwrap();
        let google = s.exchanger(reqwest::Client::new()).unwrap().unwrap();
        assert_eq!(
            google.exchanger.sts_endpoint(),
            "https://sts.apis-tpczero.goog"
        );
        assert_eq!(
            google.exchanger.iamcredentials_endpoint(),
            "https://iamcredentials.apis-tpczero.goog"
        );
        // An explicit endpoint still wins.
        s.sts_endpoint = Some("https://sts.example.internal".into());
        let google = s.exchanger(reqwest::Client::new()).unwrap().unwrap();
        assert_eq!(
            google.exchanger.sts_endpoint(),
            "https://sts.example.internal"
        );
        for bad in [
            "",
            "googleapis",
            "Googleapis.com",
            "a..com",
            "-a.com",
            "a.com/x",
        ] {
            s.universe_domain = bad.into();
            assert_eq!(refused_key(&s), "gcp.universe_domain", "{bad}");
        }
    }

    #[test]
    fn endpoints_lose_trailing_slashes() {
        let x = GcpExchanger::new(reqwest::Client::new(), "http://a/", "http://b//");
        assert_eq!(x.sts_endpoint(), "http://a");
        assert_eq!(x.iamcredentials_endpoint(), "http://b");
    }
}
