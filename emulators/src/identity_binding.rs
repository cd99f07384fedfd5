//! AKS's identity-binding proxy: a pod's projected token (audience
//! `api://AKSIdentityBinding`) exchanged for a managed identity's Entra
//! token when Kubernetes RBAC lets the pod's ServiceAccount use the
//! identity, through one federated credential the identity holds for
//! every cluster bound to it.
//!
//! What it does, each with its source (docs/emulators.md has the table):
//! - TLS with the cluster CA, told apart from the API server on the same
//!   address by the server name `<label>.ests.aks`
//!   (`AZURE_KUBERNETES_SNI_NAME`; cloud-provider-azure pull request #9907
//!   dials the API server with that name and the cluster CA). A handshake
//!   naming anything else finds no certificate here: at AKS it reaches the
//!   API server, which is no token endpoint.
//! - `POST` on any path (the credential provider posts to `/`, the SDKs
//!   to `/{tenant}/oauth2/v2.0/token`), Entra's client-credentials form in
//!   the body or the query string (the azure-workload-identity sample
//!   `identitybinding-msal-go` sends it as a query), exactly one `scope`
//!   (#9907 checks it), no tenant needed ("IB proxy does not need tenant ID
//!   to work", the review of cloud-provider-azure #9687).
//! - The assertion is the pod's token: the cluster's issuer, audience
//!   `api://AKSIdentityBinding`, signed by a key the issuer publishes, not
//!   expired (what a TokenReview of that audience checks).
//! - The ServiceAccount may use the identity: Microsoft Learn's "Identity
//!   bindings" ClusterRole grants verb `use-managed-identity` in API group
//!   `cid.wi.aks.azure.com` on the identity's client id. The proxy asks
//!   [`Grants`]: the fake API server's answers from the RBAC objects it
//!   holds (the pod harness), or, by default, the binding's
//!   `service_accounts`, standing for the subjects such a role is bound to
//!   (`lanyard dev`).
//! - Upstream, the proxy presents an assertion of its own, issued by
//!   `https://ib.oic.prod-aks.azure.com/TENANT/CLIENT_ID` with keys of
//!   that issuer, to Entra under the identity's federated credential
//!   `aks-identity-binding` (Learn: one credential per identity, created by
//!   AKS, shared by every binding of it; the private preview's concepts
//!   page: "a client assertion signed by the internal token provider using
//!   this issuer's dedicated signing keys … exchanged for an Azure Entra
//!   token via the federated identity flow"), and relays Entra's answer.
//!   The assertion's subject and audience are not published (a portal
//!   capture shows the subject begins `/subscriptions/`): the emulator uses
//!   the identity's ARM resource id and `api://AzureADTokenExchange`.
//!
//! The proxy's own refusals (bad request, bad token, no RBAC grant) are
//! not published either: they are Entra-shaped JSON with texts of the
//! emulator's (`error` `invalid_request`, `invalid_client`,
//! `unauthorized_client`). The MSAL metadata requests SDKs send through
//! the proxy are not served: Lanyard's agent sends none.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::entra::FederatedCredential;
use crate::jwks::{KeySet, KeySource, Lookup};
use crate::SigningKey;

/// The audience of the pods' tokens the proxy takes.
pub const AUDIENCE: &str = "api://AKSIdentityBinding";
/// Where AKS's identity-binding issuers live (public cloud).
pub const ISSUER_ORIGIN: &str = "https://ib.oic.prod-aks.azure.com";
/// The name AKS gives the federated credential it creates.
pub const CREDENTIAL_NAME: &str = "aks-identity-binding";
const JWT_BEARER: &str = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer";
/// The audience of the proxy's own assertion (not published; Entra's
/// usual federated-credential audience).
const UPSTREAM_AUDIENCE: &str = "api://AzureADTokenExchange";

/// A managed identity bound to the cluster, and who may use it.
#[derive(Debug, Clone)]
pub struct IdentityBinding {
    /// The identity's tenant.
    pub tenant_id: String,
    /// Its client id.
    pub client_id: String,
    /// Its ARM resource id
    /// (`/subscriptions/…/providers/Microsoft.ManagedIdentity/userAssignedIdentities/NAME`).
    pub resource_id: String,
    /// The ServiceAccounts (`NAMESPACE:NAME`) RBAC lets use it.
    pub service_accounts: Vec<String>,
}

impl IdentityBinding {
    /// The issuer AKS gives the identity's bindings.
    pub fn issuer(&self) -> String {
        format!("{ISSUER_ORIGIN}/{}/{}", self.tenant_id, self.client_id)
    }

    /// The federated credential AKS creates on the identity
    /// ([`CREDENTIAL_NAME`]), shared by every cluster bound to it.
    pub fn federated_credential(&self) -> FederatedCredential {
        FederatedCredential {
            issuer: self.issuer(),
            subject: self.resource_id.clone(),
            audience: UPSTREAM_AUDIENCE.to_string(),
        }
    }
}

/// The proxy's configuration.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// The TLS server name it answers to (`<label>.ests.aks`).
    pub sni_name: String,
    /// The cluster's service-account issuer (keys by OIDC discovery).
    pub cluster_issuer: String,
    /// Entra's authority host (the Entra emulator's base URL).
    pub entra: String,
    /// The identities bound to the cluster.
    pub bindings: Vec<IdentityBinding>,
}

/// Who may use which identity: Kubernetes RBAC's answer to "may
/// `system:serviceaccount:NAMESPACE:NAME` `use-managed-identity` the
/// resource CLIENT_ID in API group `cid.wi.aks.azure.com`?".
pub trait Grants: Send + Sync {
    /// Whether the ServiceAccount `namespace`/`name` may use the managed
    /// identity `client_id`.
    fn may_use(&self, namespace: &str, name: &str, client_id: &str) -> bool;
}

/// The verb Learn's identity-binding ClusterRole grants.
pub const VERB: &str = "use-managed-identity";
/// The API group it grants the verb in.
pub const API_GROUP: &str = "cid.wi.aks.azure.com";

/// Counters tests read.
#[derive(Debug, Default)]
pub struct ProxyStats {
    /// Requests that reached the proxy.
    pub requests: AtomicU64,
    /// Exchanges it sent Entra.
    pub exchanged: AtomicU64,
}

/// The proxy.
pub struct Proxy {
    config: ProxyConfig,
    cluster_keys: KeySet,
    /// One signing key per identity's issuer.
    issuer_keys: HashMap<String, SigningKey>,
    http: reqwest::Client,
    /// RBAC's grants, when something other than the bindings' own lists
    /// answers.
    grants: Option<Arc<dyn Grants>>,
    /// What it has been asked and has sent on.
    pub stats: ProxyStats,
}

#[derive(Deserialize)]
struct PodClaims {
    iss: Option<String>,
    sub: Option<String>,
    aud: Option<crate::claims::Audience>,
    exp: Option<u64>,
    nbf: Option<u64>,
}

#[derive(Serialize)]
struct Assertion<'a> {
    iss: String,
    sub: &'a str,
    aud: &'static str,
    iat: u64,
    nbf: u64,
    exp: u64,
    jti: String,
}

fn refuse(status: StatusCode, error: &'static str, description: impl Into<String>) -> Response {
    (
        status,
        Json(json!({"error": error, "error_description": description.into()})),
    )
        .into_response()
}

impl Proxy {
    /// The proxy `config` describes; fetches the cluster issuer's keys and
    /// asks Entra with `http`.
    pub fn new(config: ProxyConfig, http: reqwest::Client) -> anyhow::Result<Self> {
        let mut issuer_keys = HashMap::new();
        for b in &config.bindings {
            issuer_keys.insert(
                b.client_id.to_ascii_lowercase(),
                SigningKey::generate_rs256()?,
            );
        }
        Ok(Proxy {
            cluster_keys: KeySet::new(
                KeySource::Discovery {
                    issuer: config.cluster_issuer.clone(),
                },
                http.clone(),
            ),
            config,
            issuer_keys,
            http,
            grants: None,
            stats: ProxyStats::default(),
        })
    }

    /// The proxy, asking `grants` who may use an identity instead of the
    /// bindings' `service_accounts`.
    pub fn with_grants(mut self, grants: Arc<dyn Grants>) -> Self {
        self.grants = Some(grants);
        self
    }

    /// Whether the ServiceAccount `ksa` (`NAMESPACE:NAME`) may use
    /// `binding`'s identity.
    fn may_use(&self, binding: &IdentityBinding, ksa: &str) -> bool {
        match (&self.grants, ksa.split_once(':')) {
            (Some(grants), Some((namespace, name))) => {
                grants.may_use(namespace, name, &binding.client_id)
            }
            (Some(_), None) => false,
            (None, _) => binding.service_accounts.iter().any(|s| s == ksa),
        }
    }

    /// The TLS server name it answers to.
    pub fn sni_name(&self) -> &str {
        &self.config.sni_name
    }

    /// The token endpoint: `POST` on any path. Serve it over TLS with
    /// [`Proxy::tls`].
    pub fn router(self: &Arc<Self>) -> Router {
        Router::new().fallback(post(token)).with_state(self.clone())
    }

    /// The identities' issuers, as `ib.oic.prod-aks.azure.com` serves them:
    /// `GET /{tenant}/{client_id}/.well-known/openid-configuration` and the
    /// keys it names. Serve it where Entra's emulator is told that origin
    /// is (`Entra::stand_in`).
    pub fn issuer_router(self: &Arc<Self>) -> Router {
        Router::new()
            .route(
                "/{tenant}/{client}/.well-known/openid-configuration",
                get(discovery),
            )
            .route("/{tenant}/{client}/keys", get(keys))
            .with_state(self.clone())
    }

    /// A TLS configuration presenting a certificate for the proxy's server
    /// name, signed by `pki`'s CA (the cluster's), to clients that ask for
    /// that name and to no other.
    pub fn tls(&self, pki: &crate::pki::Pki) -> anyhow::Result<Arc<rustls::ServerConfig>> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certs = CertificateDer::pem_slice_iter(pki.cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()?;
        let key = PrivateKeyDer::from_pem_slice(pki.key_pem.as_bytes())?;
        let provider = rustls::crypto::aws_lc_rs::default_provider();
        let signing = provider.key_provider.load_private_key(key)?;
        let mut by_name = rustls::server::ResolvesServerCertUsingSni::new();
        by_name.add(
            &self.config.sni_name,
            rustls::sign::CertifiedKey::new(certs, signing),
        )?;
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(provider))
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(by_name));
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    fn binding(&self, client_id: &str) -> Option<&IdentityBinding> {
        self.config
            .bindings
            .iter()
            .find(|b| b.client_id.eq_ignore_ascii_case(client_id))
    }

    /// The pod's ServiceAccount (`NAMESPACE:NAME`) when `token` is a valid
    /// token of the cluster for [`AUDIENCE`].
    async fn authenticate(&self, token: &str) -> Result<String, String> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| "not a JWT".to_string())?;
        let claims: PodClaims = jsonwebtoken::dangerous::insecure_decode_claims(token)
            .map_err(|_| "not a JWT".to_string())?;
        if claims.iss.as_deref() != Some(self.config.cluster_issuer.as_str()) {
            return Err("not issued by this cluster".into());
        }
        if !claims
            .aud
            .as_ref()
            .is_some_and(|aud| aud.iter().any(|a| a == AUDIENCE))
        {
            return Err(format!("its audience is not {AUDIENCE}"));
        }
        let key = match self.cluster_keys.lookup(header.kid.as_deref()).await {
            Ok(Lookup::Found(key, _)) => key,
            Ok(Lookup::Unknown) => {
                return Err("signed by a key the cluster does not publish".into())
            }
            Err(e) => {
                tracing::warn!(error = %e, "the identity-binding emulator cannot fetch the cluster's keys");
                return Err("the cluster's keys cannot be fetched".into());
            }
        };
        let mut validation = jsonwebtoken::Validation::new(header.alg);
        validation.validate_aud = false; // checked above
        validation.leeway = 0;
        validation.required_spec_claims = ["exp".to_string()].into();
        jsonwebtoken::decode::<serde_json::Value>(token, &key, &validation).map_err(|e| match e
            .kind()
        {
            jsonwebtoken::errors::ErrorKind::ExpiredSignature => "expired".to_string(),
            _ => "its signature does not verify".to_string(),
        })?;
        let now = jsonwebtoken::get_current_timestamp();
        if claims.exp.is_none() || claims.nbf.is_some_and(|nbf| nbf > now) {
            return Err("not valid now".into());
        }
        claims
            .sub
            .as_deref()
            .and_then(|s| s.strip_prefix("system:serviceaccount:"))
            .filter(|ksa| ksa.split(':').count() == 2)
            .map(str::to_string)
            .ok_or_else(|| "not a service account's token".into())
    }

    /// The proxy's own assertion for `binding`.
    fn assertion(&self, binding: &IdentityBinding) -> anyhow::Result<String> {
        let key = self
            .issuer_keys
            .get(&binding.client_id.to_ascii_lowercase())
            .ok_or_else(|| anyhow::anyhow!("no issuer key"))?;
        let now = jsonwebtoken::get_current_timestamp();
        key.sign(&Assertion {
            iss: binding.issuer(),
            sub: &binding.resource_id,
            aud: UPSTREAM_AUDIENCE,
            iat: now,
            nbf: now,
            exp: now + 300,
            jti: uuid::Uuid::new_v4().to_string(),
        })
    }
}

/// The form's fields, from the body or the query string.
fn fields(query: Option<&str>, body: &[u8]) -> HashMap<String, String> {
    let mut out: HashMap<String, String> = HashMap::new();
    // The body first: Go's `Request.FormValue` gives body parameters
    // precedence over the query's.
    for (k, v) in url::form_urlencoded::parse(body)
        .chain(url::form_urlencoded::parse(query.unwrap_or("").as_bytes()))
    {
        out.entry(k.into_owned()).or_insert_with(|| v.into_owned());
    }
    out
}

async fn token(
    State(proxy): State<Arc<Proxy>>,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Response {
    proxy.stats.requests.fetch_add(1, Ordering::Relaxed);
    let fields = fields(query.as_deref(), &body);
    let field = |name: &str| {
        fields
            .get(name)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    };
    let bad = |what: &str| refuse(StatusCode::BAD_REQUEST, "invalid_request", what.to_string());
    if field("grant_type") != Some("client_credentials") {
        return bad("grant_type must be client_credentials");
    }
    if field("client_assertion_type") != Some(JWT_BEARER) {
        return bad(
            "client_assertion_type must be urn:ietf:params:oauth:client-assertion-type:jwt-bearer",
        );
    }
    let (Some(client_id), Some(scope), Some(assertion)) = (
        field("client_id"),
        field("scope"),
        field("client_assertion"),
    ) else {
        return bad("client_id, scope and client_assertion are required");
    };
    if scope.split_whitespace().count() != 1 {
        return bad("exactly one scope may be requested");
    }
    let ksa = match proxy.authenticate(assertion).await {
        Ok(ksa) => ksa,
        Err(why) => {
            return refuse(
                StatusCode::UNAUTHORIZED,
                "invalid_client",
                format!(
                "the client assertion is not a valid service account token for {AUDIENCE}: {why}"
            ),
            )
        }
    };
    let Some(binding) = proxy.binding(client_id) else {
        return refuse(
            StatusCode::FORBIDDEN,
            "unauthorized_client",
            format!("managed identity {client_id} has no identity binding in this cluster"),
        );
    };
    if !proxy.may_use(binding, &ksa) {
        let (namespace, name) = ksa.split_once(':').unwrap_or((&ksa, ""));
        return refuse(
            StatusCode::FORBIDDEN,
            "unauthorized_client",
            format!("service account {namespace}/{name} cannot {VERB} {client_id} in API group {API_GROUP}"),
        );
    }
    let own = match proxy.assertion(binding) {
        Ok(own) => own,
        Err(_) => {
            return refuse(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "the proxy cannot sign its assertion",
            )
        }
    };
    proxy.stats.exchanged.fetch_add(1, Ordering::Relaxed);
    let url = format!(
        "{}/{}/oauth2/v2.0/token",
        proxy.config.entra.trim_end_matches('/'),
        binding.tenant_id
    );
    let form = [
        ("grant_type", "client_credentials"),
        ("client_id", binding.client_id.as_str()),
        ("scope", scope),
        ("client_assertion_type", JWT_BEARER),
        ("client_assertion", own.as_str()),
    ];
    let upstream = match proxy.http.post(&url).form(&form).send().await {
        Ok(resp) => resp,
        Err(_) => {
            return refuse(
                StatusCode::BAD_GATEWAY,
                "temporarily_unavailable",
                "Entra cannot be reached",
            )
        }
    };
    // Entra's answer, relayed: its status, type and body.
    let status = upstream.status();
    let mut headers = HeaderMap::new();
    for name in [header::CONTENT_TYPE, header::RETRY_AFTER] {
        if let Some(value) = upstream.headers().get(&name) {
            headers.insert(name, value.clone());
        }
    }
    match upstream.bytes().await {
        Ok(body) => (status, headers, body).into_response(),
        Err(_) => refuse(
            StatusCode::BAD_GATEWAY,
            "temporarily_unavailable",
            "Entra's answer was cut off",
        ),
    }
}

async fn discovery(
    State(proxy): State<Arc<Proxy>>,
    Path((tenant, client)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let Some(binding) = proxy.binding(&client).filter(|b| b.tenant_id == tenant) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    // The keys' address as this request reached the stand-in.
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("localhost");
    Json(json!({
        "issuer": binding.issuer(),
        "jwks_uri": format!("http://{host}/{tenant}/{client}/keys"),
        "response_types_supported": ["id_token"],
        "subject_types_supported": ["public"],
        "id_token_signing_alg_values_supported": ["RS256"],
    }))
    .into_response()
}

async fn keys(
    State(proxy): State<Arc<Proxy>>,
    Path((tenant, client)): Path<(String, String)>,
) -> Response {
    let key = proxy
        .binding(&client)
        .filter(|b| b.tenant_id == tenant)
        .and_then(|b| proxy.issuer_keys.get(&b.client_id.to_ascii_lowercase()));
    match key {
        Some(key) => Json(json!({ "keys": [key.jwk()] })).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_form_is_read_from_the_body_or_the_query() {
        let f = fields(
            Some("grant_type=client_credentials&scope=a"),
            b"client_id=c&scope=b",
        );
        assert_eq!(f["grant_type"], "client_credentials");
        assert_eq!(f["client_id"], "c");
        // The body's comes first, as Go's FormValue takes it.
        assert_eq!(f["scope"], "b");
    }

    #[test]
    fn the_credential_aks_creates_names_the_identitys_issuer() {
        let b = IdentityBinding {
            tenant_id: "t".into(),
            client_id: "c".into(),
            resource_id: "/subscriptions/s/resourceGroups/g/providers/Microsoft.ManagedIdentity/userAssignedIdentities/i".into(),
            service_accounts: vec![],
        };
        let fic = b.federated_credential();
        assert_eq!(fic.issuer, "https://ib.oic.prod-aks.azure.com/t/c");
        assert_eq!(fic.subject, b.resource_id);
        assert_eq!(fic.audience, "api://AzureADTokenExchange");
    }
}
