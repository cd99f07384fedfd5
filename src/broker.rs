//! The agent's decision path, independent of any wire format: verify the
//! caller's projected token, resolve its bindings, match the requested
//! identity, exchange upstream, and record the decision.
//!
//! Protocol surfaces talk to a [`TokenBroker`]; in `lanyard dev` that is the
//! in-process [`Broker`], in a cluster the sidecar's client of the node
//! agent. Either way the surface only renders the answer.

use std::sync::Arc;
use std::time::Instant;

use crate::cloud::azure::{resource_to_scope, AzureExchanger, AzureRequest};
use crate::cloud::{AccessToken, Cloud, CloudError};
use crate::directory::{AzureBinding, Directory};
use crate::secret::SecretString;
use crate::token::{Caller, Verifier, VerifyError};

/// How a caller names the Azure identity it wants (IMDS and App Service
/// query parameters).
#[derive(Debug, Clone, PartialEq, Eq)]
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
}

/// Per-cloud settings of the broker.
pub struct AzureSettings {
    pub exchanger: AzureExchanger,
    /// Tenant used when a ServiceAccount names none.
    pub default_tenant: Option<String>,
    /// Audience the caller's projected token must carry.
    pub audience: String,
}

/// The in-process broker: the agent's core.
pub struct Broker {
    verifier: Verifier,
    directory: Arc<dyn Directory>,
    azure: AzureSettings,
}

impl Broker {
    pub fn new(verifier: Verifier, directory: Arc<dyn Directory>, azure: AzureSettings) -> Self {
        Broker {
            verifier,
            directory,
            azure,
        }
    }

    async fn azure_inner(
        &self,
        subject: &SecretString,
        request: &AzureTokenRequest,
        caller_out: &mut Option<Caller>,
    ) -> Result<AzureGrant, BrokerError> {
        use secrecy::ExposeSecret;
        let caller = self
            .verifier
            .verify(subject.expose_secret(), &self.azure.audience)
            .await?;
        *caller_out = Some(caller.clone());
        let bindings = self
            .directory
            .lookup(&caller.namespace, &caller.service_account)
            .await
            .map_err(|e| BrokerError::Unavailable(e.to_string()))?;
        let binding = bindings
            .and_then(|b| b.azure)
            .ok_or_else(|| BrokerError::NotBound {
                cloud: Cloud::Azure,
                namespace: caller.namespace.clone(),
                name: caller.service_account.clone(),
            })?;
        if !selector_matches(&binding, request.selector.as_ref()) {
            return Err(BrokerError::IdentityNotFound);
        }
        let tenant = binding
            .tenant_id
            .as_deref()
            .or(self.azure.default_tenant.as_deref())
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
        let scope = resource_to_scope(resource);
        let token = self
            .azure
            .exchanger
            .exchange(&AzureRequest {
                tenant_id: tenant,
                client_id: &binding.client_id,
                scope: &scope,
                assertion: subject,
            })
            .await?;
        Ok(AzureGrant {
            token,
            client_id: binding.client_id,
            resource: resource.to_string(),
        })
    }
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
