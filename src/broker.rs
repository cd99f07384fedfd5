//! The agent's decision path, independent of any wire format: verify the
//! caller's projected token, resolve its bindings, match the requested
//! identity, exchange upstream, and record the decision.
//!
//! Protocol surfaces talk to a [`TokenBroker`]; in `lanyard dev` that is the
//! in-process [`Broker`], in a cluster the sidecar's client of the node
//! agent. Either way the surface only renders the answer.

use std::sync::Arc;
use std::time::Instant;

use crate::cache::{Cache, CacheConfig, CacheKey, CacheScope, Credential, Fetcher};
use crate::cloud::aws::{AwsCredentials, AwsExchanger};
use crate::cloud::azure::{resource_to_scope, AzureExchanger, AzureRequest};
use crate::cloud::gcp::{GcpExchanger, IdToken};
use crate::cloud::{AccessToken, Cloud, CloudError};
use crate::directory::{AzureBinding, Bindings, Directory};
use crate::secret::SecretString;
use crate::telemetry::metrics::Metrics;
use crate::token::{Caller, Verifier, VerifyError};

pub mod remote;
pub mod wire;

/// How a caller names the Azure identity it wants (IMDS and App Service
/// query parameters).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AzureSelector {
    ClientId(String),
    ObjectId(String),
    ResourceId(String),
}

/// An Azure token request, as parsed from IMDS or App Service.
#[derive(Debug, Clone)]
pub struct AzureTokenRequest {
    /// AAD v1 resource (`https://storage.azure.com/`) or v2 scope.
    pub resource: String,
    pub selector: Option<AzureSelector>,
}

/// An Azure access token and the identity it was issued for.
#[derive(Debug, Clone)]
pub struct AzureGrant {
    pub token: AccessToken,
    pub client_id: String,
    pub resource: String,
}

/// The Google identity a caller acts as on the metadata server.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GcpIdentity {
    /// The impersonated service account, or `PROJECT.svc.id.goog` when the
    /// caller uses its federated principal directly (as GKE reports it).
    pub email: String,
    /// Whether `email` is a real service account being impersonated.
    pub impersonated: bool,
    pub project_id: String,
    pub project_number: String,
}

/// A Google access-token request from the GCE metadata surface.
#[derive(Debug, Clone)]
pub struct GcpTokenRequest {
    /// `default` or the service account's email, from the request path.
    pub account: String,
    /// Requested OAuth scopes; empty means cloud-platform.
    pub scopes: Vec<String>,
}

/// A Google ID-token request (`.../identity?audience=&format=`).
#[derive(Debug, Clone)]
pub struct GcpIdTokenRequest {
    pub account: String,
    pub audience: String,
    /// `format=full`: include the email claims.
    pub include_email: bool,
}

/// A Google access token and whom it belongs to.
#[derive(Debug, Clone)]
pub struct GcpGrant {
    pub token: AccessToken,
    pub identity: GcpIdentity,
}

/// AWS session credentials and the role they are for.
#[derive(Debug, Clone)]
pub struct AwsGrant {
    pub credentials: AwsCredentials,
    pub role_arn: String,
}

impl AwsGrant {
    /// The role name, the last path segment of the ARN (IMDS lists it).
    pub fn role_name(&self) -> &str {
        role_name(&self.role_arn)
    }
}

/// The name of a role from its ARN (`arn:aws:iam::1:role/path/NAME` → `NAME`).
pub fn role_name(arn: &str) -> &str {
    arn.rsplit('/').next().unwrap_or(arn)
}

/// Why a request was not granted.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("caller token refused: {0}")]
    Unauthenticated(#[from] VerifyError),
    #[error("service account {namespace}/{name} has no {cloud} binding")]
    NotBound {
        cloud: Cloud,
        namespace: String,
        name: String,
    },
    #[error("the requested identity is not bound to this service account")]
    IdentityNotFound,
    #[error("{0} is not configured on this broker")]
    CloudDisabled(Cloud),
    #[error("{0}")]
    BadRequest(String),
    #[error(transparent)]
    Upstream(#[from] CloudError),
    #[error("{0}")]
    Unavailable(String),
}

impl BrokerError {
    /// Short reason for audit and metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            BrokerError::Unauthenticated(e) => e.reason(),
            BrokerError::NotBound { .. } => "not_bound",
            BrokerError::IdentityNotFound => "identity_not_found",
            BrokerError::CloudDisabled(_) => "cloud_disabled",
            BrokerError::BadRequest(_) => "bad_request",
            BrokerError::Upstream(CloudError::Rejected { .. }) => "upstream_rejected",
            BrokerError::Upstream(CloudError::Throttled { .. }) => "upstream_throttled",
            BrokerError::Upstream(_) => "upstream_unavailable",
            BrokerError::Unavailable(_) => "unavailable",
        }
    }

    /// Whether the client should retry (the SDKs retry 429 and 5xx).
    pub fn is_retryable(&self) -> bool {
        match self {
            BrokerError::Unauthenticated(e) => e.is_transient(),
            BrokerError::Upstream(e) => e.is_retryable(),
            BrokerError::Unavailable(_) => true,
            _ => false,
        }
    }
}

/// What a protocol surface needs from the broker.
#[async_trait::async_trait]
pub trait TokenBroker: Send + Sync {
    async fn azure_token(
        &self,
        subject: &SecretString,
        request: &AzureTokenRequest,
    ) -> Result<AzureGrant, BrokerError>;

    /// Who the caller is on Google (for the metadata server's listings).
    async fn gcp_identity(&self, subject: &SecretString) -> Result<GcpIdentity, BrokerError>;

    async fn gcp_token(
        &self,
        subject: &SecretString,
        request: &GcpTokenRequest,
    ) -> Result<GcpGrant, BrokerError>;

    async fn gcp_id_token(
        &self,
        subject: &SecretString,
        request: &GcpIdTokenRequest,
    ) -> Result<IdToken, BrokerError>;

    /// The role ARN bound to the caller, without exchanging (IMDS listing).
    async fn aws_role(&self, subject: &SecretString) -> Result<String, BrokerError>;

    async fn aws_credentials(&self, subject: &SecretString) -> Result<AwsGrant, BrokerError>;
}

/// Per-cloud settings of the broker.
pub struct AzureSettings {
    pub exchanger: AzureExchanger,
    /// Tenant used when a ServiceAccount names none.
    pub default_tenant: Option<String>,
    /// Audience the caller's projected token must carry.
    pub audience: String,
}

/// Google settings of the broker.
pub struct GcpSettings {
    pub exchanger: GcpExchanger,
    /// The workload identity pool provider, `//iam.googleapis.com/projects/N/locations/global/workloadIdentityPools/P/providers/R`:
    /// the STS `audience`.
    pub provider: String,
    /// Audience callers' projected tokens must carry for Google.
    pub audience: String,
    pub project_id: String,
    pub project_number: String,
    /// Lifetime asked of `generateAccessToken`.
    pub token_lifetime: std::time::Duration,
}

/// AWS settings of the broker.
pub struct AwsSettings {
    pub exchanger: AwsExchanger,
    /// Audience callers' projected tokens must carry for AWS.
    pub audience: String,
    /// `DurationSeconds` asked of STS.
    pub session_duration: std::time::Duration,
}

/// The in-process broker: the agent's core.
pub struct Broker {
    verifier: Verifier,
    directory: Arc<dyn Directory>,
    cache: Cache,
    metrics: Arc<Metrics>,
    /// When set, tokens that name another node are refused.
    node_name: Option<String>,
    azure: Option<AzureSettings>,
    gcp: Option<GcpSettings>,
    aws: Option<AwsSettings>,
}

impl Broker {
    /// A broker with no cloud enabled and a default cache; add clouds with
    /// the `with_*` methods.
    pub fn new(verifier: Verifier, directory: Arc<dyn Directory>) -> Self {
        let metrics = Arc::new(Metrics::new());
        Broker {
            verifier,
            directory,
            cache: Cache::new(CacheConfig::default(), metrics.clone()),
            metrics,
            node_name: None,
            azure: None,
            gcp: None,
            aws: None,
        }
    }

    /// Uses `cache` (and the metrics it reports to).
    pub fn with_cache(mut self, cache: Cache, metrics: Arc<Metrics>) -> Self {
        self.cache = cache;
        self.metrics = metrics;
        self
    }

    /// Refuses tokens whose node claim names another node.
    pub fn with_node_name(mut self, node: impl Into<String>) -> Self {
        self.node_name = Some(node.into());
        self
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn cache(&self) -> &Cache {
        &self.cache
    }

    /// The cache key for `caller` asking `identity` for `scope`.
    fn cache_key(&self, cloud: Cloud, identity: &str, scope: &str, caller: &Caller) -> CacheKey {
        CacheKey {
            cloud,
            identity: identity.to_string(),
            scope: scope.to_string(),
            namespace: caller.namespace.clone(),
            service_account: caller.service_account.clone(),
            pod_uid: match self.cache.scope() {
                CacheScope::Pod => caller.pod.as_ref().map(|p| p.uid.clone()),
                CacheScope::ServiceAccount => None,
            },
        }
    }

    /// Gets the credential for `key` from the cache, exchanging with
    /// `fetcher` when needed.
    async fn cached(
        &self,
        key: CacheKey,
        subject: &SecretString,
        caller: &Caller,
        fetcher: impl FnOnce() -> Fetcher,
    ) -> Result<Credential, BrokerError> {
        Ok(self
            .cache
            .get(key, subject, caller.token_expires_at, fetcher)
            .await?)
    }

    pub fn with_azure(mut self, azure: AzureSettings) -> Self {
        self.azure = Some(azure);
        self
    }

    pub fn with_gcp(mut self, gcp: GcpSettings) -> Self {
        self.gcp = Some(gcp);
        self
    }

    pub fn with_aws(mut self, aws: AwsSettings) -> Self {
        self.aws = Some(aws);
        self
    }

    /// Verifies the caller's token for `audience` and looks up its bindings.
    async fn authenticate(
        &self,
        subject: &SecretString,
        audience: &str,
        caller_out: &mut Option<Caller>,
    ) -> Result<(Caller, Bindings), BrokerError> {
        use secrecy::ExposeSecret;
        let caller = self
            .verifier
            .verify(subject.expose_secret(), audience)
            .await?;
        *caller_out = Some(caller.clone());
        // Only projected, pod-bound tokens: a legacy secret token outlives
        // its pod forever and proves nothing about where it is used.
        if caller.pod.is_none() {
            return Err(VerifyError::NotPodBound.into());
        }
        if let (Some(this), Some(node)) = (&self.node_name, &caller.node) {
            if &node.name != this {
                return Err(VerifyError::OtherNode {
                    token_node: node.name.clone(),
                    this_node: this.clone(),
                }
                .into());
            }
        }
        if let Some(pod) = &caller.pod {
            let exists = self
                .directory
                .pod_exists(&caller.namespace, &pod.name, &pod.uid)
                .await
                .map_err(|e| BrokerError::Unavailable(e.to_string()))?;
            if exists == Some(false) {
                return Err(VerifyError::PodGone.into());
            }
        }
        let bindings = self
            .directory
            .lookup(&caller.namespace, &caller.service_account)
            .await
            .map_err(|e| BrokerError::Unavailable(e.to_string()))?
            .unwrap_or_default();
        Ok((caller, bindings))
    }

    fn not_bound(cloud: Cloud, caller: &Caller) -> BrokerError {
        BrokerError::NotBound {
            cloud,
            namespace: caller.namespace.clone(),
            name: caller.service_account.clone(),
        }
    }

    fn gcp_settings(&self) -> Result<&GcpSettings, BrokerError> {
        self.gcp
            .as_ref()
            .ok_or(BrokerError::CloudDisabled(Cloud::Gcp))
    }

    fn aws_settings(&self) -> Result<&AwsSettings, BrokerError> {
        self.aws
            .as_ref()
            .ok_or(BrokerError::CloudDisabled(Cloud::Aws))
    }

    async fn gcp_identity_inner(
        &self,
        subject: &SecretString,
        caller_out: &mut Option<Caller>,
    ) -> Result<GcpIdentity, BrokerError> {
        let gcp = self.gcp_settings()?;
        let (_, bindings) = self
            .authenticate(subject, &gcp.audience, caller_out)
            .await?;
        Ok(match bindings.gcp_service_account {
            Some(email) => GcpIdentity {
                email,
                impersonated: true,
                project_id: gcp.project_id.clone(),
                project_number: gcp.project_number.clone(),
            },
            None => GcpIdentity {
                email: format!("{}.svc.id.goog", gcp.project_id),
                impersonated: false,
                project_id: gcp.project_id.clone(),
                project_number: gcp.project_number.clone(),
            },
        })
    }

    /// `default` or the identity's own email select it; anything else is
    /// another identity and is refused.
    fn check_account(identity: &GcpIdentity, account: &str) -> Result<(), BrokerError> {
        if account == "default" || account.eq_ignore_ascii_case(&identity.email) {
            Ok(())
        } else {
            Err(BrokerError::IdentityNotFound)
        }
    }

    async fn gcp_token_inner(
        &self,
        subject: &SecretString,
        request: &GcpTokenRequest,
        caller_out: &mut Option<Caller>,
    ) -> Result<GcpGrant, BrokerError> {
        let gcp = self.gcp_settings()?;
        let identity = self.gcp_identity_inner(subject, caller_out).await?;
        Self::check_account(&identity, &request.account)?;
        let caller = caller_out
            .clone()
            .ok_or_else(|| BrokerError::Unavailable("caller unknown".into()))?;
        if request.scopes.len() > MAX_SCOPES {
            return Err(BrokerError::BadRequest(format!(
                "at most {MAX_SCOPES} scopes may be requested"
            )));
        }
        for scope in &request.scopes {
            check_len("scope", scope)?;
        }
        let mut scopes = request.scopes.clone();
        scopes.sort();
        scopes.dedup();
        let key = self.cache_key(Cloud::Gcp, &identity.email, &scopes.join(" "), &caller);
        let fetcher = || {
            let params = (
                gcp.exchanger.clone(),
                gcp.provider.clone(),
                identity.impersonated.then(|| identity.email.clone()),
                scopes.clone(),
                gcp.token_lifetime,
            );
            make_fetcher(params, |p, subject| async move {
                let (exchanger, provider, email, scopes, lifetime) = &*p;
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
        };
        let token = self
            .cached(key, subject, &caller, fetcher)
            .await?
            .into_token()
            .ok_or_else(kind_mismatch)?;
        Ok(GcpGrant { token, identity })
    }

    async fn gcp_id_token_inner(
        &self,
        subject: &SecretString,
        request: &GcpIdTokenRequest,
        caller_out: &mut Option<Caller>,
    ) -> Result<IdToken, BrokerError> {
        let gcp = self.gcp_settings()?;
        let identity = self.gcp_identity_inner(subject, caller_out).await?;
        Self::check_account(&identity, &request.account)?;
        if !identity.impersonated {
            // A federated principal has no email to sign ID tokens for; GKE
            // refuses the same way.
            return Err(BrokerError::BadRequest(
                "ID tokens need a Google service account: annotate the Kubernetes service account with iam.gke.io/gcp-service-account".into(),
            ));
        }
        if request.audience.trim().is_empty() {
            return Err(BrokerError::BadRequest("audience is required".into()));
        }
        let caller = caller_out
            .clone()
            .ok_or_else(|| BrokerError::Unavailable("caller unknown".into()))?;
        check_len("audience", &request.audience)?;
        let format = if request.include_email {
            "full"
        } else {
            "standard"
        };
        let key = self.cache_key(
            Cloud::Gcp,
            &identity.email,
            &format!("id_token {format} {}", request.audience),
            &caller,
        );
        let fetcher = || {
            let params = (
                gcp.exchanger.clone(),
                gcp.provider.clone(),
                identity.email.clone(),
                request.audience.clone(),
                request.include_email,
            );
            make_fetcher(params, |p, subject| async move {
                let (exchanger, provider, email, audience, include_email) = &*p;
                let federated = federate(exchanger, &subject, provider).await?;
                let id = exchanger
                    .generate_id_token(&federated.token, email, audience, *include_email)
                    .await?;
                Ok(Credential::IdToken(id))
            })
        };
        self.cached(key, subject, &caller, fetcher)
            .await?
            .into_id_token()
            .ok_or_else(kind_mismatch)
    }

    async fn aws_role_inner(
        &self,
        subject: &SecretString,
        caller_out: &mut Option<Caller>,
    ) -> Result<(Caller, String), BrokerError> {
        let aws = self.aws_settings()?;
        let (caller, bindings) = self
            .authenticate(subject, &aws.audience, caller_out)
            .await?;
        let arn = bindings
            .aws_role_arn
            .ok_or_else(|| Self::not_bound(Cloud::Aws, &caller))?;
        Ok((caller, arn))
    }

    async fn aws_credentials_inner(
        &self,
        subject: &SecretString,
        caller_out: &mut Option<Caller>,
    ) -> Result<AwsGrant, BrokerError> {
        let aws = self.aws_settings()?;
        let (caller, role_arn) = self.aws_role_inner(subject, caller_out).await?;
        let key = self.cache_key(
            Cloud::Aws,
            &role_arn,
            &format!(
                "sts:AssumeRoleWithWebIdentity {}",
                aws.session_duration.as_secs()
            ),
            &caller,
        );
        let fetcher = || {
            let params = (
                aws.exchanger.clone(),
                AwsExchanger::session_name(&caller.namespace, &caller.service_account),
                role_arn.clone(),
                aws.session_duration,
            );
            make_fetcher(params, |p, subject| async move {
                let (exchanger, session, role_arn, duration) = &*p;
                let credentials = exchanger
                    .assume_role_with_web_identity(role_arn, session, &subject, *duration)
                    .await?;
                Ok(Credential::Aws(credentials))
            })
        };
        let credentials = self
            .cached(key, subject, &caller, fetcher)
            .await?
            .into_aws()
            .ok_or_else(kind_mismatch)?;
        Ok(AwsGrant {
            credentials,
            role_arn,
        })
    }

    async fn azure_inner(
        &self,
        subject: &SecretString,
        request: &AzureTokenRequest,
        caller_out: &mut Option<Caller>,
    ) -> Result<AzureGrant, BrokerError> {
        let azure = self
            .azure
            .as_ref()
            .ok_or(BrokerError::CloudDisabled(Cloud::Azure))?;
        let (caller, bindings) = self
            .authenticate(subject, &azure.audience, caller_out)
            .await?;
        let binding = bindings
            .azure
            .ok_or_else(|| Self::not_bound(Cloud::Azure, &caller))?;
        if !selector_matches(&binding, request.selector.as_ref()) {
            return Err(BrokerError::IdentityNotFound);
        }
        let tenant = binding
            .tenant_id
            .as_deref()
            .or(azure.default_tenant.as_deref())
            .ok_or_else(|| {
                BrokerError::BadRequest(format!(
                    "service account {}/{} names no Azure tenant and no default tenant is configured",
                    caller.namespace, caller.service_account
                ))
            })?;
        let resource = request.resource.trim();
        if resource.is_empty() {
            return Err(BrokerError::BadRequest("resource is empty".into()));
        }
        check_len("resource", resource)?;
        let scope = resource_to_scope(resource);
        let key = self.cache_key(
            Cloud::Azure,
            &format!("{tenant}/{}", binding.client_id),
            &scope,
            &caller,
        );
        let fetcher = || {
            let params = (
                azure.exchanger.clone(),
                tenant.to_string(),
                binding.client_id.clone(),
                scope.clone(),
            );
            make_fetcher(params, |p, subject| async move {
                let (exchanger, tenant_id, client_id, scope) = &*p;
                let request = AzureRequest {
                    tenant_id,
                    client_id,
                    scope,
                    assertion: &subject,
                };
                Ok(Credential::Token(exchanger.exchange(&request).await?))
            })
        };
        let token = self
            .cached(key, subject, &caller, fetcher)
            .await?
            .into_token()
            .ok_or_else(kind_mismatch)?;
        Ok(AzureGrant {
            token,
            client_id: binding.client_id,
            resource: resource.to_string(),
        })
    }
}

/// The federated (STS) token that impersonation starts from.
async fn federate(
    exchanger: &GcpExchanger,
    subject: &SecretString,
    provider: &str,
) -> Result<AccessToken, CloudError> {
    let scopes = [crate::cloud::gcp::CLOUD_PLATFORM_SCOPE.to_string()];
    exchanger.exchange(subject, provider, &scopes).await
}

/// A cache fetcher from an async exchange over shared `params` (captured
/// once; each exchange clones only the `Arc`).
fn make_fetcher<P, F, Fut>(params: P, exchange: F) -> Fetcher
where
    P: Send + Sync + 'static,
    F: Fn(Arc<P>, SecretString) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Credential, CloudError>> + Send + 'static,
{
    let params = Arc::new(params);
    Arc::new(move |subject| Box::pin(exchange(params.clone(), subject)))
}

/// The cache stores one credential enum; a key always maps to one kind, so
/// a mismatch is a bug, reported as a retryable failure rather than a panic.
fn kind_mismatch() -> BrokerError {
    BrokerError::Unavailable("cache returned another credential kind".into())
}

/// Longest resource, scope or audience accepted: bounded keys keep the
/// cache's memory bounded whatever callers send.
const MAX_PARAM_LEN: usize = 1024;
const MAX_SCOPES: usize = 32;

fn check_len(what: &str, value: &str) -> Result<(), BrokerError> {
    if value.len() > MAX_PARAM_LEN {
        return Err(BrokerError::BadRequest(format!(
            "{what} is longer than {MAX_PARAM_LEN} characters"
        )));
    }
    Ok(())
}

/// A selector matches only the identity bound to the caller, never another.
fn selector_matches(binding: &AzureBinding, selector: Option<&AzureSelector>) -> bool {
    let eq = |a: &str, b: &str| a.eq_ignore_ascii_case(b);
    match selector {
        None => true,
        Some(AzureSelector::ClientId(id)) => eq(id, &binding.client_id),
        Some(AzureSelector::ObjectId(id)) => {
            binding.object_id.as_deref().is_some_and(|o| eq(o, id))
        }
        Some(AzureSelector::ResourceId(id)) => {
            binding.resource_id.as_deref().is_some_and(|r| eq(r, id))
        }
    }
}

#[async_trait::async_trait]
impl TokenBroker for Broker {
    async fn azure_token(
        &self,
        subject: &SecretString,
        request: &AzureTokenRequest,
    ) -> Result<AzureGrant, BrokerError> {
        let started = Instant::now();
        let mut caller = None;
        let result = self.azure_inner(subject, request, &mut caller).await;
        crate::telemetry::audit_decision(
            Cloud::Azure,
            caller.as_ref(),
            subject,
            &request.resource,
            result.as_ref().map(|g| g.client_id.as_str()),
            started.elapsed(),
        );
        result
    }

    async fn gcp_identity(&self, subject: &SecretString) -> Result<GcpIdentity, BrokerError> {
        // A lookup, not a grant: no audit record.
        self.gcp_identity_inner(subject, &mut None).await
    }

    async fn gcp_token(
        &self,
        subject: &SecretString,
        request: &GcpTokenRequest,
    ) -> Result<GcpGrant, BrokerError> {
        let started = Instant::now();
        let mut caller = None;
        let result = self.gcp_token_inner(subject, request, &mut caller).await;
        let scopes = request.scopes.join(" ");
        crate::telemetry::audit_decision(
            Cloud::Gcp,
            caller.as_ref(),
            subject,
            &scopes,
            result.as_ref().map(|g| g.identity.email.as_str()),
            started.elapsed(),
        );
        result
    }

    async fn gcp_id_token(
        &self,
        subject: &SecretString,
        request: &GcpIdTokenRequest,
    ) -> Result<IdToken, BrokerError> {
        let started = Instant::now();
        let mut caller = None;
        let result = self.gcp_id_token_inner(subject, request, &mut caller).await;
        crate::telemetry::audit_decision(
            Cloud::Gcp,
            caller.as_ref(),
            subject,
            &format!("id_token:{}", request.audience),
            result.as_ref().map(|_| request.account.as_str()),
            started.elapsed(),
        );
        result
    }

    async fn aws_role(&self, subject: &SecretString) -> Result<String, BrokerError> {
        self.aws_role_inner(subject, &mut None)
            .await
            .map(|(_, arn)| arn)
    }

    async fn aws_credentials(&self, subject: &SecretString) -> Result<AwsGrant, BrokerError> {
        let started = Instant::now();
        let mut caller = None;
        let result = self.aws_credentials_inner(subject, &mut caller).await;
        crate::telemetry::audit_decision(
            Cloud::Aws,
            caller.as_ref(),
            subject,
            "sts:AssumeRoleWithWebIdentity",
            result.as_ref().map(|g| g.role_arn.as_str()),
            started.elapsed(),
        );
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn broker(scope: CacheScope) -> Broker {
        let verifier = Verifier::new(
            "http://127.0.0.1:9",
            crate::token::KeySet::new(
                crate::token::KeySource::Jwks {
                    url: "http://127.0.0.1:9/jwks".into(),
                },
                crate::http::client(),
            ),
        );
        let directory = Arc::new(crate::directory::file::StaticDirectory::new(&[]));
        let metrics = Arc::new(Metrics::new());
        let cache = Cache::new(
            CacheConfig {
                scope,
                ..Default::default()
            },
            metrics.clone(),
        );
        Broker::new(verifier, directory).with_cache(cache, metrics)
    }

    fn caller() -> Caller {
        Caller {
            namespace: "ml".into(),
            service_account: "ray-worker".into(),
            service_account_uid: "sa-uid".into(),
            pod: Some(crate::token::ObjectRef {
                name: "ray-worker-7".into(),
                uid: "pod-uid-7".into(),
            }),
            node: None,
            token_expires_at: 0,
            token_fingerprint: "sha256:x".into(),
        }
    }

    #[tokio::test]
    async fn cache_keys_follow_the_configured_scope() {
        let key = broker(CacheScope::ServiceAccount).cache_key(Cloud::Aws, "arn", "s", &caller());
        assert_eq!(key.pod_uid, None);
        assert_eq!(
            (key.namespace.as_str(), key.service_account.as_str()),
            ("ml", "ray-worker")
        );
        let key = broker(CacheScope::Pod).cache_key(Cloud::Aws, "arn", "s", &caller());
        assert_eq!(key.pod_uid.as_deref(), Some("pod-uid-7"));
    }

    fn binding() -> AzureBinding {
        AzureBinding {
            client_id: "11111111-2222-3333-4444-555555555555".into(),
            tenant_id: None,
            object_id: Some("oid-1".into()),
            resource_id: None,
        }
    }

    #[test]
    fn selectors_match_only_the_bound_identity() {
        let b = binding();
        assert!(selector_matches(&b, None));
        assert!(selector_matches(
            &b,
            Some(&AzureSelector::ClientId(
                "11111111-2222-3333-4444-555555555555".to_uppercase()
            ))
        ));
        assert!(!selector_matches(
            &b,
            Some(&AzureSelector::ClientId("other".into()))
        ));
        assert!(selector_matches(
            &b,
            Some(&AzureSelector::ObjectId("oid-1".into()))
        ));
        assert!(!selector_matches(
            &b,
            Some(&AzureSelector::ObjectId("oid-2".into()))
        ));
        // No resource id is known, so no resource id can select it.
        assert!(!selector_matches(
            &b,
            Some(&AzureSelector::ResourceId("/subscriptions/x".into()))
        ));
    }
}
