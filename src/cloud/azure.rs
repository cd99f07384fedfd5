//! Entra ID: workload identity federation by client assertion.
//!
//! `POST {authority}/{tenant}/oauth2/v2.0/token` with the pod's projected
//! token (audience `api://AzureADTokenExchange`) as `client_assertion`.
//! Written on reqwest rather than azure_identity's ClientAssertionCredential:
//! we need the raw AADSTS code to classify errors for caching, a per-request
//! tenant and client, and plain-HTTP authority hosts for the emulators.
//!
//! The model (annotations, `Binding`, `AppHop`, the app hop refused
//! up front, the accepted audiences) is `lanyard_core::cloud::azure`,
//! re-exported here; this module is the exchanger and its settings.

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use super::{check_endpoint, invalid, Bindings, Invalid};
use super::{
    encode_path_segment, fetcher, scrub_message, AccessToken, Cloud, CloudError, CloudExchanger,
    Credential, Fetcher, Identity, Kind, RequestError, Selector, TokenRequest,
};
use crate::secret::{ExposeSecret, SecretString};
use crate::token::Caller;

pub use lanyard_core::cloud::azure::{
    accepted_audiences, annotations, bindings, chained_federation, is_tenant, known_refusals,
    AppHop, Binding, EXCHANGE_AUDIENCES, FEDERATION_AUDIENCE,
};

mod app_hop;
pub mod identity_binding;
mod node_imds;
pub mod trust;
pub use app_hop::{FirstHops, Hop};
pub use identity_binding::IdentityBindingProxy;
pub use node_imds::{NodeImds, DEFAULT_ENDPOINT as DEFAULT_IMDS_ENDPOINT};

/// Well-known Entra authority hosts.
pub const PUBLIC_CLOUD: &str = "https://login.microsoftonline.com";
/// Azure US Government (`usgovernment`).
pub const US_GOVERNMENT: &str = "https://login.microsoftonline.us";
/// Azure operated by 21Vianet (`china`): the host Microsoft's national
/// cloud endpoints page names for Entra there; the older
/// `https://login.chinacloudapi.cn` still answers and can be set with
/// `azure.authority_host`.
pub const CHINA: &str = "https://login.partner.microsoftonline.cn";

/// The token-exchange audience for `configured` (`azure.audience`) in the
/// named cloud `cloud`: `configured` itself when it is one of
/// [`EXCHANGE_AUDIENCES`], else the cloud's own (Microsoft Learn, "Configure
/// an application to trust a managed identity": `api://AzureADTokenExchange`
/// in the public cloud, `…USGov` in Azure US Government, `…China` in Azure
/// operated by 21Vianet).
pub fn exchange_audience(cloud: &str, configured: &str) -> &'static str {
    if let Some(known) = EXCHANGE_AUDIENCES.iter().find(|a| **a == configured) {
        return known;
    }
    match authority_for_cloud(cloud) {
        Some(US_GOVERNMENT) => "api://AzureADTokenExchangeUSGov",
        Some(CHINA) => "api://AzureADTokenExchangeChina",
        _ => FEDERATION_AUDIENCE,
    }
}

/// The authority host for a named Azure cloud.
pub fn authority_for_cloud(name: &str) -> Option<&'static str> {
    match name.to_ascii_lowercase().as_str() {
        "public" | "azurepubliccloud" => Some(PUBLIC_CLOUD),
        "usgovernment" | "azureusgovernment" | "azureusgovernmentcloud" => Some(US_GOVERNMENT),
        "china" | "azurechinacloud" => Some(CHINA),
        _ => None,
    }
}

/// Converts an AAD v1 resource (what IMDS callers send) to a v2 scope.
/// A trailing slash on the resource is not doubled.
pub fn resource_to_scope(resource: &str) -> String {
    // Every cached hit asks this: concatenation, not `format!` (whose
    // machinery cost about 700 instructions here).
    let suffix = if resource.ends_with("/.default") {
        ""
    } else if resource.ends_with('/') {
        ".default"
    } else {
        "/.default"
    };
    let mut scope = String::with_capacity(resource.len() + suffix.len());
    scope.push_str(resource);
    scope.push_str(suffix);
    scope
}

/// One exchange.
pub struct AzureRequest<'a> {
    /// The tenant to ask: a GUID or a verified domain name. Percent-encoded
    /// into the token URL's path, so it cannot change the path.
    pub tenant_id: &'a str,
    /// The client (application) id of the managed identity or app registration
    /// whose federated credential trusts the assertion.
    pub client_id: &'a str,
    /// The v2 scope asked for, `RESOURCE/.default` (see [`resource_to_scope`]).
    pub scope: &'a str,
    /// The pod's projected token, audience [`FEDERATION_AUDIENCE`], sent as
    /// `client_assertion`.
    pub assertion: &'a SecretString,
}

/// The Entra exchanger.
#[derive(Clone)]
pub struct AzureExchanger {
    http: reqwest::Client,
    authority_host: String,
}

#[derive(Deserialize)]
struct Success {
    access_token: String,
    expires_in: serde_json::Value,
}

#[derive(Deserialize)]
struct Failure {
    error: Option<String>,
    error_description: Option<String>,
    #[serde(default)]
    error_codes: Vec<u64>,
}

/// AADSTS codes that mean "the service is overloaded or failing", not "no".
const TRANSIENT_CODES: [u64; 4] = [
    50196, // client loop / request throttled
    90033, // temporary service error
    50000, // server error
    90055, // too many requests
];

impl AzureExchanger {
    /// An exchanger asking Entra at `authority_host` (such as [`PUBLIC_CLOUD`];
    /// a trailing `/` is dropped).
    pub fn new(http: reqwest::Client, authority_host: impl Into<String>) -> Self {
        AzureExchanger {
            http,
            authority_host: authority_host.into().trim_end_matches('/').to_string(),
        }
    }

    /// The authority host this exchanger asks, without a trailing `/`.
    pub fn authority_host(&self) -> &str {
        &self.authority_host
    }

    /// Exchanges the assertion for an access token with the client-credentials
    /// grant. A 429 or one of Entra's transient AADSTS codes is
    /// [`CloudError::Throttled`], a 5xx or an unreachable host
    /// [`CloudError::Unavailable`], any other refusal carrying an AADSTS code
    /// [`CloudError::Rejected`], and an unreadable answer
    /// [`CloudError::Protocol`]; messages never contain the assertion.
    pub async fn exchange(&self, req: &AzureRequest<'_>) -> Result<AccessToken, CloudError> {
        post_token(&self.http, &self.authority_host, req).await
    }
}

/// Seconds as Entra and IMDS write them: a JSON number, or the same
/// number as a string (IMDS, older endpoints and some proxies).
fn seconds(value: Option<&serde_json::Value>) -> Option<u64> {
    match value? {
        serde_json::Value::String(s) => s.trim().parse().ok(),
        serde_json::Value::Number(n) => n.as_u64(),
        _ => None,
    }
}

/// `POST {base}/{tenant}/oauth2/v2.0/token` with the client-credentials
/// grant and `req`'s assertion, as Entra (or a proxy speaking its protocol)
/// takes it; the answer classified as [`AzureExchanger::exchange`] says.
async fn post_token(
    http: &reqwest::Client,
    base: &str,
    req: &AzureRequest<'_>,
) -> Result<AccessToken, CloudError> {
    // Tenant ids are GUIDs or domain names; anything else is
    // percent-encoded so that it cannot change the path.
    let url = format!(
        "{base}/{}/oauth2/v2.0/token",
        encode_path_segment(req.tenant_id)
    );
    let form = [
        ("grant_type", "client_credentials"),
        ("client_id", req.client_id),
        ("scope", req.scope),
        (
            "client_assertion_type",
            "urn:ietf:params:oauth:client-assertion-type:jwt-bearer",
        ),
        ("client_assertion", req.assertion.expose_secret()),
    ];
    let super::send::Answer {
        status,
        retry_after: retry,
        body,
        sent_at: issued_at,
    } = super::send::send(
        Cloud::Azure,
        http.post(&url).form(&form),
        Some("x-ms-request-id"),
    )
    .await?;

    if status.is_success() {
        let ok: Success = serde_json::from_slice(&body).map_err(|e| CloudError::Protocol {
            cloud: Cloud::Azure,
            reason: format!("token response: {e}"),
        })?;
        // Entra sends an integer; some proxies and older endpoints a string.
        let expires_in = seconds(Some(&ok.expires_in)).ok_or_else(|| CloudError::Protocol {
            cloud: Cloud::Azure,
            reason: "token response has no valid expires_in".into(),
        })?;
        return Ok(AccessToken {
            rendered: Default::default(),
            token: SecretString::from(ok.access_token),
            issued_at,
            expires_at: issued_at + expires_in,
        });
    }

    Err(classify(
        status,
        retry,
        &body,
        req.assertion.expose_secret(),
    ))
}

/// The Entra ID side of the broker: the exchanger, the audience callers'
/// tokens carry, and the tenant of ServiceAccounts that name none.
#[derive(Clone)]
pub struct AzureCloud {
    /// The Entra client.
    pub exchanger: AzureExchanger,
    /// Tenant used when a ServiceAccount names none.
    pub default_tenant: Option<String>,
    /// Audience the caller's projected token must carry: the cloud's
    /// token-exchange audience, which is also what a managed identity's
    /// token for an app's assertion is asked for.
    pub audience: String,
    /// The cloud's token-exchange audience (`api://AzureADTokenExchange`
    /// and its twins): the resource of a managed identity's token that is
    /// an app's assertion. `azure.audience` when it is one of them, else
    /// `azure.cloud`'s, since a custom audience for the pods' tokens is no
    /// resource Entra knows ([`exchange_audience`]).
    pub exchange_audience: String,
    /// The managed-identity-to-app hop's first tokens.
    pub first_hops: Arc<FirstHops>,
    /// The client ids of the managed identities assigned to the node pool
    /// (`azure.node_identities`), lowercased: their tokens come from the
    /// node's IMDS, not from a federated credential.
    pub node_identities: Arc<[String]>,
    /// The node's IMDS.
    pub node_imds: NodeImds,
    /// The AKS identity-binding proxy every federated exchange goes
    /// through (`azure.identity_binding_sni`); `None`: Entra directly.
    pub identity_binding: Option<IdentityBindingProxy>,
}

/// The Azure identity bound to a ServiceAccount, tenant resolved.
#[derive(Debug, Clone)]
pub struct AzureBound {
    /// The binding as the ServiceAccount's annotations give it.
    pub binding: Binding,
    /// The tenant to ask: the binding's, else the broker's default.
    pub tenant: String,
}

impl CloudExchanger for AzureCloud {
    type Binding = AzureBound;

    fn cloud(&self) -> Cloud {
        Cloud::Azure
    }

    fn audience(&self) -> &str {
        &self.audience
    }

    fn kinds(&self) -> &'static [Kind] {
        &[Kind::AccessToken]
    }

    fn bind(&self, bindings: &Bindings, caller: &Caller) -> Result<Vec<AzureBound>, RequestError> {
        let Some(first) = bindings.azure.first() else {
            return Err(RequestError::NotBound);
        };
        // One tenant annotation serves every listed identity.
        let tenant = first
            .tenant_id
            .clone()
            .or_else(|| self.default_tenant.clone())
            .ok_or_else(|| {
                RequestError::BadRequest(format!(
                    "service account {}/{} names no Azure tenant and no default tenant is configured",
                    caller.namespace, caller.service_account
                ))
            })?;
        Ok(bindings
            .azure
            .iter()
            .map(|binding| AzureBound {
                binding: binding.clone(),
                tenant: tenant.clone(),
            })
            .collect())
    }

    /// The app, when the identity reaches one (reached via the identity),
    /// else the identity.
    fn identity(&self, bound: &AzureBound) -> Identity {
        let b = &bound.binding;
        let source = match (self.on_node(&b.client_id), &self.identity_binding) {
            (true, _) => super::Source::Node,
            (false, Some(_)) => super::Source::IdentityBinding,
            (false, None) => super::Source::Federation,
        };
        match &b.app {
            None => Identity {
                cloud: Cloud::Azure,
                id: b.client_id.clone(),
                account: bound.tenant.clone(),
                account_number: None,
                source,
                via: None,
            },
            Some(app) => Identity {
                cloud: Cloud::Azure,
                id: app.client_id.clone(),
                account: app
                    .tenant_id
                    .clone()
                    .unwrap_or_else(|| bound.tenant.clone()),
                account_number: None,
                source,
                via: Some(super::Via {
                    id: b.client_id.clone(),
                    account: bound.tenant.clone(),
                    session_tags: false,
                    session_policy: false,
                }),
            },
        }
    }

    fn selects(&self, bound: &AzureBound, selector: &Selector) -> bool {
        let b = &bound.binding;
        let eq = |a: &str, b: &str| a.eq_ignore_ascii_case(b);
        match selector {
            // The identity's client id (what the webhook's AZURE_CLIENT_ID
            // says), or the app's it reaches.
            Selector::ClientId(id) => {
                eq(id, &b.client_id) || b.app.as_ref().is_some_and(|a| eq(id, &a.client_id))
            }
            Selector::ObjectId(id) => b.object_id.as_deref().is_some_and(|o| eq(o, id)),
            Selector::ResourceId(id) => b.resource_id.as_deref().is_some_and(|r| eq(r, id)),
            Selector::Email(_) | Selector::RoleName(_) => false,
        }
    }

    fn scope(&self, bound: &AzureBound, request: &TokenRequest) -> Result<String, RequestError> {
        let mut scope = resource_scope(request)?;
        // Through an app, the identity is part of what was asked for.
        if let Some(app) = &bound.binding.app {
            // INVARIANT: the app hop's first token comes from the node's
            // IMDS; Entra refuses one obtained through the identity's own
            // federated credential, so that is never asked for.
            if !self.on_node(&bound.binding.client_id) {
                return Err(RequestError::BadRequest(chained_federation(
                    &bound.binding.client_id,
                    &app.client_id,
                )));
            }
            scope.push_str(" via ");
            scope.push_str(&bound.binding.client_id);
        }
        Ok(scope)
    }

    fn fetcher(&self, bound: &AzureBound, request: &TokenRequest, _caller: &Caller) -> Fetcher {
        // The pipeline asked `scope` first, so it holds for this request.
        let scope = resource_scope(request).unwrap_or_default();
        if let Some(app) = &bound.binding.app {
            return self.app_fetcher(bound, app, scope);
        }
        if self.on_node(&bound.binding.client_id) {
            // The node's identity, for this pod: IMDS asks nothing of the
            // pod, whose token the agent has already verified.
            let params = (
                self.node_imds.clone(),
                bound.binding.client_id.clone(),
                scope,
            );
            return fetcher(params, |p, _subject| async move {
                let (imds, client_id, scope) = &*p;
                let resource = scope.strip_suffix("/.default").unwrap_or(scope);
                Ok(Credential::Token(imds.token(client_id, resource).await?))
            });
        }
        let params = (
            self.exchanger.clone(),
            self.identity_binding.clone(),
            bound.tenant.clone(),
            bound.binding.client_id.clone(),
            scope,
        );
        fetcher(params, |p, subject| async move {
            let (exchanger, identity_binding, tenant_id, client_id, scope) = &*p;
            let request = AzureRequest {
                tenant_id,
                client_id,
                scope,
                assertion: &subject,
            };
            let token = match identity_binding {
                Some(proxy) => proxy.exchange(&request).await?,
                None => exchanger.exchange(&request).await?,
            };
            Ok(Credential::Token(token))
        })
    }
}

/// The v2 scope of the one resource `request` names.
fn resource_scope(request: &TokenRequest) -> Result<String, RequestError> {
    match request.scopes.as_slice() {
        [resource] if !resource.trim().is_empty() => Ok(resource_to_scope(resource.trim())),
        [] | [_] => Err(RequestError::BadRequest("resource is empty".into())),
        _ => Err(RequestError::BadRequest(
            "exactly one resource may be requested".into(),
        )),
    }
}

impl AzureCloud {
    /// Whether `client_id` is a managed identity assigned to the node pool.
    pub fn on_node(&self, client_id: &str) -> bool {
        self.node_identities
            .iter()
            .any(|id| id.eq_ignore_ascii_case(client_id))
    }

    /// The two hops: the node's IMDS gives the managed identity a token for
    /// the token-exchange audience (kept in [`FirstHops`], one per identity
    /// on the node, shared by every ServiceAccount, app and resource it
    /// reaches), which gives the app its token for the resource in the
    /// app's tenant. [`CloudExchanger::scope`] has refused an identity not
    /// on the node.
    fn app_fetcher(&self, bound: &AzureBound, app: &AppHop, scope: String) -> Fetcher {
        let identity_tenant = bound.tenant.clone();
        let exchange = self.exchange_audience.clone();
        let params = (
            self.exchanger.clone(),
            self.node_imds.clone(),
            self.first_hops.clone(),
            format!(
                "node/{}/{exchange}",
                bound.binding.client_id.to_ascii_lowercase()
            ),
            identity_tenant.clone(),
            bound.binding.client_id.clone(),
            exchange,
            app.tenant_id.clone().unwrap_or(identity_tenant),
            app.client_id.clone(),
            scope,
        );
        fetcher(params, |p, _subject| async move {
            let (
                exchanger,
                imds,
                first_hops,
                key,
                identity_tenant,
                identity,
                exchange,
                app_tenant,
                app,
                scope,
            ) = &*p;
            let first = first_hops
                .get(key.clone(), || imds.token(identity, exchange))
                .await
                .map_err(|e| {
                    Hop::Identity {
                        client_id: identity,
                        tenant: identity_tenant,
                    }
                    .named(e)
                })?;
            let request = AzureRequest {
                tenant_id: app_tenant,
                client_id: app,
                scope,
                assertion: &first,
            };
            let token = exchanger.exchange(&request).await.map_err(|e| {
                Hop::App {
                    client_id: app,
                    tenant: app_tenant,
                }
                .named(e)
            })?;
            Ok(Credential::Token(token))
        })
    }
}

/// Maps a non-success answer to a [`CloudError`]: throttling and transient
/// AADSTS codes are retryable, other AADSTS refusals are not. `secret` (the
/// client assertion) is scrubbed from the description in case it is echoed.
fn classify(
    status: reqwest::StatusCode,
    retry: Option<Duration>,
    body: &[u8],
    secret: &str,
) -> CloudError {
    let failure: Option<Failure> = serde_json::from_slice(body).ok();
    // Entra's AADSTS code; else the OAuth `error` (a proxy speaking Entra's
    // protocol, such as AKS's identity-binding proxy, may send no code).
    let code = failure.as_ref().and_then(|f| {
        f.error_codes
            .first()
            .map(|c| format!("AADSTS{c}"))
            .or_else(|| f.error.as_deref().map(|e| e.chars().take(64).collect()))
    });
    // Entra's descriptions are long (trace and correlation ids, a
    // timestamp) and an endpoint may echo the assertion: scrub and bound.
    let message = failure
        .as_ref()
        .and_then(|f| f.error_description.as_deref().or(f.error.as_deref()))
        .map(|m| scrub_message(m, secret))
        .unwrap_or_else(|| format!("HTTP {status}"));
    let numeric = failure
        .as_ref()
        .and_then(|f| f.error_codes.first().copied());

    if status.as_u16() == 429 || numeric.is_some_and(|c| TRANSIENT_CODES.contains(&c)) {
        return CloudError::Throttled {
            cloud: Cloud::Azure,
            code: code.unwrap_or_else(|| "HTTP429".into()),
            retry_after: retry.or(Some(Duration::from_secs(5))),
        };
    }
    if status.is_server_error() {
        return CloudError::Unavailable {
            cloud: Cloud::Azure,
            reason: format!("HTTP {status}: {message}"),
        };
    }
    match code {
        Some(code) => CloudError::Rejected {
            cloud: Cloud::Azure,
            code,
            message,
        },
        None => CloudError::Protocol {
            cloud: Cloud::Azure,
            reason: format!("HTTP {status} without an Entra error body"),
        },
    }
}

/// The `azure` section of the configuration: talking to Entra ID.
#[derive(Debug, Clone, PartialEq, serde::Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// Named cloud: `public`, `usgovernment` or `china`.
    pub cloud: String,
    /// Overrides the cloud's authority host (private endpoints, emulators).
    pub authority_host: Option<String>,
    /// Tenant for ServiceAccounts that do not name one.
    pub tenant_id: Option<String>,
    /// Audience callers' projected tokens must carry for Azure.
    pub audience: String,
    /// Client ids of the user-assigned managed identities assigned to the
    /// node pool (its VM scale set): a ServiceAccount bound to one is
    /// served that identity's tokens from the node's IMDS, and may reach an
    /// app that trusts it (`lanyard.dev/azure-app-client-id`).
    pub node_identities: Vec<String>,
    /// The node's IMDS (`http://169.254.169.254`); an emulator's in
    /// `lanyard dev`.
    pub imds_endpoint: String,
    /// The AKS identity-binding proxy's TLS server name (`<label>.ests.aks`,
    /// the `AZURE_KUBERNETES_SNI_NAME` AKS gives pods); set, every
    /// federated identity's token is exchanged through the proxy, and
    /// `audience` must be `api://AKSIdentityBinding`.
    pub identity_binding_sni: Option<String>,
    /// Where the proxy listens: the API server, `https://HOST[:PORT]`;
    /// unset, the in-cluster `KUBERNETES_SERVICE_HOST` and `_PORT`.
    pub identity_binding_proxy: Option<String>,
    /// The cluster CA the proxy's certificate is checked against.
    pub identity_binding_ca_file: std::path::PathBuf,
}

/// Most node identities listed (a VM scale set holds at most 100
/// user-assigned identities; a node pool used for brokering, a handful).
const MAX_NODE_IDENTITIES: usize = 64;

impl Default for Settings {
    fn default() -> Self {
        Settings {
            cloud: "public".into(),
            authority_host: None,
            tenant_id: None,
            audience: FEDERATION_AUDIENCE.into(),
            node_identities: Vec::new(),
            imds_endpoint: node_imds::DEFAULT_ENDPOINT.into(),
            identity_binding_sni: None,
            identity_binding_proxy: None,
            identity_binding_ca_file: identity_binding::DEFAULT_CA_FILE.into(),
        }
    }
}

impl Settings {
    /// Checks the section: the cloud, authority, tenant and audience.
    pub fn check(&self) -> Result<(), Invalid> {
        if authority_for_cloud(&self.cloud).is_none() {
            return Err(invalid(
                "azure.cloud",
                "one of public, usgovernment, china",
                &self.cloud,
            ));
        }
        if let Some(host) = &self.authority_host {
            check_endpoint(host)
                .map_err(|expected| invalid("azure.authority_host", expected, host))?;
        }
        if let Some(t) = &self.tenant_id {
            if !is_tenant(t) {
                return Err(invalid(
                    "azure.tenant_id",
                    "a tenant GUID or domain name",
                    t,
                ));
            }
        }
        if self.audience.trim().is_empty() {
            return Err(invalid(
                "azure.audience",
                "a non-empty audience",
                &self.audience,
            ));
        }
        if self.node_identities.len() > MAX_NODE_IDENTITIES {
            return Err(invalid(
                "azure.node_identities",
                "at most 64 client ids",
                &self.node_identities.len().to_string(),
            ));
        }
        for id in &self.node_identities {
            let valid = !id.is_empty()
                && id.len() <= 64
                && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
            if !valid {
                return Err(invalid("azure.node_identities", "client ids (GUIDs)", id));
            }
        }
        node_imds::check_endpoint(&self.imds_endpoint)
            .map_err(|expected| invalid("azure.imds_endpoint", expected, &self.imds_endpoint))?;
        self.check_identity_binding()?;
        Ok(())
    }

    /// The identity-binding settings: the server name a DNS name, the proxy
    /// an `https://` address, and the pods' tokens for the proxy's
    /// audience (and only then).
    fn check_identity_binding(&self) -> Result<(), Invalid> {
        let Some(sni) = &self.identity_binding_sni else {
            if self.audience == identity_binding::AUDIENCE {
                return Err(invalid(
                    "azure.identity_binding_sni",
                    "the identity-binding proxy's server name (<label>.ests.aks) when azure.audience is api://AKSIdentityBinding: only the proxy takes such a token",
                    "unset",
                ));
            }
            return Ok(());
        };
        identity_binding::check_sni_name(sni).map_err(|_| {
            invalid(
                "azure.identity_binding_sni",
                "a lower-case DNS name, <label>.ests.aks (AZURE_KUBERNETES_SNI_NAME in an identity-binding pod)",
                sni,
            )
        })?;
        if self.audience != identity_binding::AUDIENCE {
            return Err(invalid(
                "azure.audience",
                "api://AKSIdentityBinding when azure.identity_binding_sni is set: the proxy takes tokens for that audience only",
                &self.audience,
            ));
        }
        if let Some(proxy) = &self.identity_binding_proxy {
            identity_binding::api_server(Some(proxy), (None, None)).map_err(|_| {
                invalid(
                    "azure.identity_binding_proxy",
                    "an https:// URL of the API server's address, without path, query or fragment",
                    proxy,
                )
            })?;
        }
        Ok(())
    }

    /// The identity-binding proxy these settings name, if any; the API
    /// server's address from the environment when not configured.
    pub fn identity_binding(
        &self,
    ) -> Result<Option<IdentityBindingProxy>, identity_binding::ProxySettingsError> {
        let Some(sni) = &self.identity_binding_sni else {
            return Ok(None);
        };
        let service = (
            std::env::var("KUBERNETES_SERVICE_HOST").ok(),
            std::env::var("KUBERNETES_SERVICE_PORT").ok(),
        );
        let api_server =
            identity_binding::api_server(self.identity_binding_proxy.as_deref(), service)?;
        Ok(Some(IdentityBindingProxy::new(
            sni.clone(),
            api_server,
            self.identity_binding_ca_file.clone(),
        )))
    }

    /// The Azure side of the broker these settings describe.
    ///
    /// Refused when the identity-binding proxy is configured and the API
    /// server's address is neither configured nor in the environment.
    pub fn exchanger(&self, http: reqwest::Client) -> Result<AzureCloud, Invalid> {
        let identity_binding = self.identity_binding().map_err(|e| Invalid {
            key: "azure.identity_binding_proxy",
            expected: "the API server's address, https://HOST[:PORT] (unset: from KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT, which are not in the environment)",
            got: e.to_string(),
        })?;
        let authority = match &self.authority_host {
            Some(host) => host.clone(),
            None => authority_for_cloud(&self.cloud)
                .unwrap_or(PUBLIC_CLOUD)
                .to_string(),
        };
        Ok(AzureCloud {
            exchanger: AzureExchanger::new(http.clone(), authority),
            default_tenant: self.tenant_id.clone(),
            audience: self.audience.clone(),
            exchange_audience: exchange_audience(&self.cloud, &self.audience).to_string(),
            first_hops: Arc::default(),
            node_identities: self
                .node_identities
                .iter()
                .map(|id| id.to_ascii_lowercase())
                .collect(),
            node_imds: NodeImds::new(http, &self.imds_endpoint),
            identity_binding,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_bindings_take_the_proxys_audience_and_only_then() {
        let key = |s: &Settings| s.check().err().map(|e| e.key);
        let bound = Settings {
            identity_binding_sni: Some("a1b2.ests.aks".into()),
            audience: identity_binding::AUDIENCE.into(),
            identity_binding_proxy: Some("https://10.0.0.1:443".into()),
            ..Settings::default()
        };
        assert_eq!(key(&bound), None);
        // The pods' tokens would be for Entra's audience: the proxy
        // refuses them.
        let other_audience = Settings {
            audience: FEDERATION_AUDIENCE.into(),
            ..bound.clone()
        };
        assert_eq!(key(&other_audience), Some("azure.audience"));
        // The proxy's audience with no proxy: Entra refuses such tokens.
        let no_proxy = Settings {
            identity_binding_sni: None,
            ..bound.clone()
        };
        assert_eq!(key(&no_proxy), Some("azure.identity_binding_sni"));
        let bad_name = Settings {
            identity_binding_sni: Some("10.0.0.1".into()),
            ..bound.clone()
        };
        assert_eq!(key(&bad_name), Some("azure.identity_binding_sni"));
        let bad_proxy = Settings {
            identity_binding_proxy: Some("http://10.0.0.1".into()),
            ..bound.clone()
        };
        assert_eq!(key(&bad_proxy), Some("azure.identity_binding_proxy"));
        // Configured, the exchanger goes through the proxy; its identities
        // are said to come from it.
        let cloud = bound.exchanger(reqwest::Client::new()).unwrap();
        assert_eq!(
            cloud.identity_binding.as_ref().map(|p| p.sni_name()),
            Some("a1b2.ests.aks")
        );
        let bound_sa = AzureBound {
            binding: Binding {
                client_id: "c".into(),
                tenant_id: None,
                object_id: None,
                resource_id: None,
                app: None,
            },
            tenant: "t".into(),
        };
        assert_eq!(
            cloud.identity(&bound_sa).source,
            super::super::Source::IdentityBinding
        );
        let plain = Settings::default()
            .exchanger(reqwest::Client::new())
            .unwrap();
        assert_eq!(
            plain.identity(&bound_sa).source,
            super::super::Source::Federation
        );
    }

    #[test]
    fn resource_scope_conversion() {
        assert_eq!(
            resource_to_scope("https://storage.azure.com"),
            "https://storage.azure.com/.default"
        );
        assert_eq!(
            resource_to_scope("https://management.azure.com/"),
            "https://management.azure.com/.default"
        );
        assert_eq!(
            resource_to_scope("https://vault.azure.net/.default"),
            "https://vault.azure.net/.default"
        );
    }

    #[test]
    fn the_exchange_audience_is_the_clouds_when_the_pods_is_custom() {
        assert_eq!(
            exchange_audience("public", "api://lanyard-prod"),
            FEDERATION_AUDIENCE
        );
        assert_eq!(
            exchange_audience("usgovernment", "api://lanyard-prod"),
            "api://AzureADTokenExchangeUSGov"
        );
        assert_eq!(
            exchange_audience("china", "custom"),
            "api://AzureADTokenExchangeChina"
        );
        assert_eq!(
            exchange_audience("public", "api://AzureADTokenExchangeUSGov"),
            "api://AzureADTokenExchangeUSGov"
        );
    }

    #[test]
    fn named_clouds() {
        assert_eq!(authority_for_cloud("AzurePublicCloud"), Some(PUBLIC_CLOUD));
        assert_eq!(authority_for_cloud("usgovernment"), Some(US_GOVERNMENT));
        assert_eq!(authority_for_cloud("china"), Some(CHINA));
        assert_eq!(authority_for_cloud("mars"), None);
    }

    fn bound() -> AzureBound {
        AzureBound {
            binding: Binding {
                client_id: "11111111-2222-3333-4444-555555555555".into(),
                tenant_id: None,
                object_id: Some("oid-1".into()),
                resource_id: None,
                app: None,
            },
            tenant: "t".into(),
        }
    }

    const ASSERTION: &str = "eyJhbGciOiJSUzI1NiJ9.YXNzZXJ0aW9u.c2ln";

    fn rejected_message(body: &str) -> String {
        match classify(
            reqwest::StatusCode::BAD_REQUEST,
            None,
            body.as_bytes(),
            ASSERTION,
        ) {
            CloudError::Rejected { code, message, .. } => {
                assert_eq!(code, "AADSTS70021");
                message
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn selectors_match_only_the_bound_identity() {
        let cloud = AzureCloud {
            exchanger: AzureExchanger::new(reqwest::Client::new(), PUBLIC_CLOUD),
            default_tenant: None,
            audience: "api://AzureADTokenExchange".into(),
            exchange_audience: FEDERATION_AUDIENCE.into(),
            first_hops: Default::default(),
            node_identities: Default::default(),
            node_imds: NodeImds::new(reqwest::Client::new(), DEFAULT_IMDS_ENDPOINT),
            identity_binding: None,
        };
        let b = bound();
        let upper = "11111111-2222-3333-4444-555555555555".to_uppercase();
        assert!(cloud.selects(&b, &Selector::ClientId(upper)));
        assert!(!cloud.selects(&b, &Selector::ClientId("other".into())));
        assert!(cloud.selects(&b, &Selector::ObjectId("oid-1".into())));
        assert!(!cloud.selects(&b, &Selector::ObjectId("oid-2".into())));
        // No resource id is known, so no resource id can select it.
        assert!(!cloud.selects(&b, &Selector::ResourceId("/subscriptions/x".into())));
        // Another cloud's selector never matches.
        assert!(!cloud.selects(
            &b,
            &Selector::Email("11111111-2222-3333-4444-555555555555".into())
        ));
    }

    #[test]
    fn one_resource_is_required() {
        let cloud = AzureCloud {
            exchanger: AzureExchanger::new(reqwest::Client::new(), PUBLIC_CLOUD),
            default_tenant: None,
            audience: "a".into(),
            exchange_audience: FEDERATION_AUDIENCE.into(),
            first_hops: Default::default(),
            node_identities: Default::default(),
            node_imds: NodeImds::new(reqwest::Client::new(), DEFAULT_IMDS_ENDPOINT),
            identity_binding: None,
        };
        let req = |scopes: &[&str]| {
            TokenRequest::new(
                Cloud::Azure,
                Kind::AccessToken,
                crate::cloud::Surface::AzureImds,
            )
            .with_scopes(scopes.iter().map(|s| s.to_string()).collect())
        };
        assert_eq!(
            cloud.scope(&bound(), &req(&["https://storage.azure.com"])),
            Ok("https://storage.azure.com/.default".to_string())
        );
        assert!(cloud.scope(&bound(), &req(&[])).is_err());
        assert!(cloud.scope(&bound(), &req(&[" "])).is_err());
        assert!(cloud.scope(&bound(), &req(&["a", "b"])).is_err());
    }

    #[test]
    fn descriptions_never_carry_the_assertion() {
        let body = format!(
            r#"{{"error":"invalid_client","error_description":"AADSTS70021: No matching federated identity record found for presented assertion {ASSERTION}.","error_codes":[70021]}}"#
        );
        let message = rejected_message(&body);
        assert!(!message.contains(ASSERTION), "{message}");
        assert!(message.contains("[redacted]"), "{message}");
    }

    #[test]
    fn long_descriptions_are_bounded() {
        let body = format!(
            r#"{{"error":"invalid_client","error_description":"{}","error_codes":[70021]}}"#,
            "x".repeat(100_000)
        );
        let message = rejected_message(&body);
        assert!(message.len() <= crate::cloud::MAX_MESSAGE_BYTES + 3);
        assert!(message.ends_with('…'));
    }

    #[test]
    fn errors_are_classified() {
        let status = reqwest::StatusCode::from_u16;
        let e = classify(status(429).unwrap(), Some(Duration::from_secs(60)), b"", "");
        assert!(
            matches!(e, CloudError::Throttled { ref code, retry_after: Some(d), .. }
            if code == "HTTP429" && d == Duration::from_secs(60))
        );
        let e = classify(
            status(400).unwrap(),
            None,
            br#"{"error":"temporarily_unavailable","error_codes":[90033]}"#,
            "",
        );
        assert_eq!(e.code(), Some("AADSTS90033"));
        assert!(e.is_retryable());
        let e = classify(status(503).unwrap(), None, b"<html/>", "");
        assert!(matches!(e, CloudError::Unavailable { .. }), "{e:?}");
        let e = classify(status(400).unwrap(), None, b"<html/>", "");
        assert!(matches!(e, CloudError::Protocol { .. }), "{e:?}");
    }

    #[test]
    fn tenant_segment_cannot_escape_the_path() {
        assert_eq!(encode_path_segment("../x?y"), "..%2Fx%3Fy");
        assert_eq!(encode_path_segment("a b"), "a%20b");
    }
}
