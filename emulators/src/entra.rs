//! Entra ID token endpoint emulator.
//!
//! Validates a client-assertion (workload identity federation) request the
//! way Entra does: the assertion's issuer must appear in a federated
//! credential of the app, its signature must verify against the keys found
//! by OIDC discovery of that issuer, its subject and audience must match the
//! record, and it must be within its validity window. Errors carry Entra's
//! JSON shape and AADSTS codes, so clients see what they would see in Azure.
//!
//! A managed identity's token presented as an app's assertion (Entra's own
//! v2 token, "managed identity as a federated identity credential") must
//! be one the identity got without a federated credential: from the IMDS of
//! the compute it is assigned to ([`Entra::imds_token`], `imds.rs`). One
//! obtained through the identity's own federated credential is refused with
//! `AADSTS700231: Token obtained using another federated identity credential
//! may not be used as federated identity credential` (the text
//! azure-workload-identity issue #1363 reports for this very flow under AKS
//! workload identity, which works under aad-pod-identity, where the token
//! came from the node's IMDS; azure-sdk-for-net issue #49212, "FIC chaining
//! which is not allowed"). The emulator knows which of its tokens were
//! obtained how by their `uti`, as Entra knows its own tokens.
//!
//! The access tokens it issues are JWTs shaped as Entra's v1 app-only tokens
//! for Azure resources are (`iss` `https://sts.windows.net/TENANT/`, `aud`
//! the resource, `tid`, `oid`, `appid`, `exp`), signed RS256 with a key of
//! the emulator's own that `/{tenant}/discovery/v2.0/keys` publishes, so a
//! resource emulator that checks Entra tokens (Azurite in OAuth mode) takes
//! them and refuses another audience.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::claims::random_token;
use crate::jwks::{KeySet, KeysError, Lookup};

use super::SigningKey;

/// The audience Entra requires in federated assertions (the product's
/// constant: the emulator checks what the exchanger is configured with).
/// The audience Entra ID expects of a federated credential's assertion in
/// the public cloud.
pub const FEDERATION_AUDIENCE: &str = "api://AzureADTokenExchange";
const JWT_BEARER: &str = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer";

/// A federated identity credential on an app registration.
#[derive(Debug, Clone)]
pub struct FederatedCredential {
    /// The issuer the assertion's `iss` must equal exactly.
    pub issuer: String,
    /// The subject the assertion's `sub` must equal exactly
    /// (`system:serviceaccount:NAMESPACE:NAME` for a Kubernetes token).
    pub subject: String,
    /// The audience the assertion's `aud` must contain
    /// ([`FEDERATION_AUDIENCE`] in practice).
    pub audience: String,
}

/// An app registration (or user-assigned managed identity) in a tenant.
#[derive(Debug, Clone, Default)]
pub struct App {
    /// The tenant the app lives in (its home tenant): a `{tenant}` of the
    /// token URL it answers in.
    pub tenant_id: String,
    /// The app's client (application) id, the request's `client_id`.
    pub client_id: String,
    /// The federated credentials that let outside tokens act as the app; one
    /// must match the assertion.
    pub federated: Vec<FederatedCredential>,
    /// Other tenants the (multi-tenant) app is provisioned in: it answers
    /// there too, and its tokens there name that tenant.
    pub provisioned_in: Vec<String>,
    /// A user-assigned managed identity, not an app registration: only its
    /// tokens may be an app's assertion under Entra's own issuer.
    pub managed_identity: bool,
    /// The managed identity is assigned to the compute (a node pool's VM
    /// scale set) whose IMDS the emulator's `imds` stands in for.
    pub on_node: bool,
}

impl App {
    fn answers_in(&self, tenant: &str) -> bool {
        self.tenant_id == tenant || self.provisioned_in.iter().any(|t| t == tenant)
    }

    /// The object (principal) id of the app's service principal in its
    /// home tenant: the `sub` of its tokens, and what a federated
    /// credential trusting a managed identity names as its subject.
    pub fn object_id(&self) -> String {
        object_id(self)
    }
}

/// The issuer of Entra's v2 tokens in `tenant` (public cloud): what a
/// federated credential trusting a managed identity of `tenant` names.
pub fn v2_issuer(tenant: &str) -> String {
    format!("https://login.microsoftonline.com/{tenant}/v2.0")
}

/// Whether `scope` asks for a token to present as another app's assertion
/// (`api://AzureADTokenExchange…/.default`, any cloud's).
fn is_exchange_scope(scope: &str) -> bool {
    scope
        .strip_suffix("/.default")
        .is_some_and(|r| r.starts_with(FEDERATION_AUDIENCE))
}

/// Counters tests and the dev admin endpoint read.
#[derive(Debug, Default)]
pub struct EntraStats {
    /// Every request that reached the token endpoint.
    pub requests: AtomicU64,
    /// Access tokens handed out.
    pub issued: AtomicU64,
}

/// The emulator's state.
pub struct Entra {
    apps: Vec<App>,
    lifetime: Duration,
    /// Signs the access tokens; its public half is the tenant's JWKS.
    signing: SigningKey,
    /// That public half, to verify tokens of its own presented back as
    /// assertions.
    own_key: jsonwebtoken::DecodingKey,
    key_sets: super::IssuerKeys,
    /// What the emulator has been asked and has issued.
    pub stats: EntraStats,
    /// Each access token and the app (`TENANT/CLIENT_ID`) it was issued to.
    pub ledger: super::Ledger,
    /// Misbehaviour to inject (tests, benchmarks).
    pub faults: Arc<super::faults::Faults>,
    /// The `uti` of every token obtained through a federated credential
    /// (bounded, oldest forgotten first).
    federation_obtained: std::sync::Mutex<Utis>,
    /// Federated credentials added while running
    /// ([`Entra::add_federated_credential`]).
    added: std::sync::Mutex<Vec<Added>>,
}

/// A federated credential added while running, honoured from `visible_at`.
struct Added {
    client_id: String,
    credential: FederatedCredential,
    visible_at: std::time::Instant,
}

/// A bounded set of token ids.
#[derive(Default)]
struct Utis {
    set: std::collections::HashSet<String>,
    order: std::collections::VecDeque<String>,
}

impl Utis {
    const CAPACITY: usize = 100_000;

    fn insert(&mut self, uti: String) {
        if self.order.len() >= Self::CAPACITY {
            if let Some(oldest) = self.order.pop_front() {
                self.set.remove(&oldest);
            }
        }
        self.order.push_back(uti.clone());
        self.set.insert(uti);
    }
}

/// How a token was obtained, which decides whether it may be another
/// app's assertion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Obtained {
    /// Through a federated credential (`client_assertion`).
    Federation,
    /// From the IMDS of the compute the managed identity is assigned to.
    Imds,
}

/// A token the emulator issued: the JWT, its lifetime in seconds.
pub struct Issued {
    /// The access token.
    pub access_token: String,
    /// Seconds it is valid for.
    pub expires_in: u64,
}

impl Entra {
    /// An emulator of `apps`, issuing access tokens valid for `lifetime` and
    /// discovering assertion issuers' keys with `http`.
    pub fn new(apps: Vec<App>, lifetime: Duration, http: reqwest::Client) -> anyhow::Result<Self> {
        let signing = SigningKey::generate_rs256()?;
        Ok(Entra {
            apps,
            lifetime,
            own_key: {
                let jwk: jsonwebtoken::jwk::Jwk = serde_json::from_value(signing.jwk().clone())?;
                jsonwebtoken::DecodingKey::from_jwk(&jwk)?
            },
            signing,
            key_sets: super::IssuerKeys::new(http),
            stats: EntraStats::default(),
            ledger: super::Ledger::default(),
            faults: Default::default(),
            federation_obtained: Default::default(),
            added: Default::default(),
        })
    }

    /// Adds a federated credential to the app `client_id`, as an
    /// administrator creates one, which Entra honours only `propagation`
    /// later: until then an assertion it would match is refused as one
    /// matching no record. Microsoft Learn, "Workload identity federation
    /// considerations" ("Time for federated credential changes to
    /// propagate": a token request several minutes after configuring the
    /// credential "may fail because the cache is populated in the directory
    /// with old data"); azure-workload-identity's FAQ ("a couple of
    /// minutes"); Azure/azure-workload-identity#1200 (intermittent
    /// `AADSTS700211`/`700213` that clear by waiting). Learn quotes the
    /// refusal as `AADSTS70021`, the code these refusals had before Entra
    /// split it; the emulator answers today's split codes. `false` if no
    /// such app exists.
    pub fn add_federated_credential(
        &self,
        client_id: &str,
        credential: FederatedCredential,
        propagation: Duration,
    ) -> bool {
        if !self.apps.iter().any(|a| a.client_id == client_id) {
            return false;
        }
        self.added
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Added {
                client_id: client_id.to_string(),
                credential,
                visible_at: std::time::Instant::now() + propagation,
            });
        true
    }

    /// `app`'s federated credentials for `issuer` that Entra honours now.
    fn credentials_of(&self, app: &App, issuer: &str) -> Vec<FederatedCredential> {
        let now = std::time::Instant::now();
        let added = self.added.lock().unwrap_or_else(|p| p.into_inner());
        app.federated
            .iter()
            .chain(
                added
                    .iter()
                    .filter(|a| a.client_id == app.client_id && a.visible_at <= now)
                    .map(|a| &a.credential),
            )
            .filter(|f| f.issuer == issuer)
            .cloned()
            .collect()
    }

    /// The managed identities assigned to the node (`App::on_node`), in
    /// the order configured.
    pub fn node_identities(&self) -> impl Iterator<Item = &App> {
        self.apps.iter().filter(|a| a.managed_identity && a.on_node)
    }

    /// A token for `resource` as the node's IMDS hands one to a managed
    /// identity assigned to it (`client_id`): no assertion, and one that
    /// may be an app's assertion. `None` when no such identity is on the
    /// node.
    pub fn imds_token(&self, client_id: &str, resource: &str) -> Option<Issued> {
        let app = self
            .node_identities()
            .find(|a| a.client_id.eq_ignore_ascii_case(client_id))?;
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        let scope = format!("{}/.default", resource.trim_end_matches('/'));
        self.mint(app, &app.tenant_id, &scope, Obtained::Imds).ok()
    }

    /// The token endpoint, `POST /{tenant}/oauth2/v2.0/token`, and the keys
    /// its access tokens are signed with, `GET /{tenant}/discovery/v2.0/keys`
    /// (and `/common/discovery/keys`): serve it at an authority host's root.
    pub fn router(self: &Arc<Self>) -> Router {
        let router = Router::new()
            .route("/{tenant}/oauth2/v2.0/token", post(token))
            .route("/{tenant}/discovery/v2.0/keys", get(jwks))
            .route("/{tenant}/discovery/keys", get(jwks))
            .with_state(self.clone());
        self.faults.layer(router, fault_response)
    }

    /// Fetches the keys of issuers under `origin` from `stand_in`, which
    /// serves that origin's paths on loopback (AKS's identity-binding
    /// issuers, `identity_binding`).
    pub fn stand_in(&self, origin: &str, stand_in: &str) {
        self.key_sets.stand_in(origin, stand_in);
    }

    fn key_set(&self, issuer: &str) -> Arc<KeySet> {
        self.key_sets.get(issuer)
    }

    /// The tenant whose v2 issuer `iss` is, when it is Entra's own and the
    /// tenant is one the emulator holds.
    fn own_issuer_tenant<'a>(&self, iss: &'a str) -> Option<&'a str> {
        let tenant = iss
            .strip_prefix("https://login.microsoftonline.com/")?
            .strip_suffix("/v2.0")?;
        self.apps
            .iter()
            .any(|a| a.tenant_id == tenant)
            .then_some(tenant)
    }

    /// Fetches the keys of every issuer a federated credential names now,
    /// as a service that has long trusted the issuer holds them.
    pub async fn preload_keys(&self) -> Result<(), KeysError> {
        let issuers = self
            .apps
            .iter()
            .flat_map(|a| &a.federated)
            .map(|f| f.issuer.as_str())
            .filter(|issuer| self.own_issuer_tenant(issuer).is_none());
        self.key_sets.preload(issuers).await
    }
}

/// An Entra error response.
struct AadError {
    status: StatusCode,
    error: &'static str,
    code: u32,
    message: String,
}

fn aad(status: StatusCode, error: &'static str, code: u32, message: impl Into<String>) -> AadError {
    AadError {
        status,
        error,
        code,
        message: message.into(),
    }
}

impl IntoResponse for AadError {
    fn into_response(self) -> Response {
        let trace_id = uuid::Uuid::new_v4().to_string();
        let correlation_id = uuid::Uuid::new_v4().to_string();
        let now = time::OffsetDateTime::now_utc();
        let timestamp = now
            .format(time::macros::format_description!(
                "[year]-[month]-[day] [hour]:[minute]:[second]Z"
            ))
            .unwrap_or_default();
        let description = format!(
            "AADSTS{}: {} Trace ID: {} Correlation ID: {} Timestamp: {}",
            self.code, self.message, trace_id, correlation_id, timestamp
        );
        let body = json!({
            "error": self.error,
            "error_description": description,
            "error_codes": [self.code],
            "timestamp": timestamp,
            "trace_id": trace_id,
            "correlation_id": correlation_id,
            "error_uri": format!("https://login.microsoftonline.com/error?code={}", self.code),
        });
        // Entra names every answer by its trace id in `x-ms-request-id`.
        (self.status, [("x-ms-request-id", trace_id)], Json(body)).into_response()
    }
}

fn missing(param: &str) -> AadError {
    aad(
        StatusCode::BAD_REQUEST,
        "invalid_request",
        900144,
        format!("The request body must contain the following parameter: '{param}'."),
    )
}

#[derive(serde::Deserialize)]
struct AssertionClaims {
    iss: Option<String>,
    sub: Option<String>,
    aud: Option<crate::claims::Audience>,
    exp: Option<u64>,
    nbf: Option<u64>,
}

async fn jwks(State(entra): State<Arc<Entra>>) -> Json<serde_json::Value> {
    Json(json!({ "keys": [entra.signing.jwk()] }))
}

/// The claims of an Entra access token issued to an app (client
/// credentials): v1 as Azure resources take them (`iss`
/// `https://sts.windows.net/TENANT/`, `appid`, `appidacr`, `idp`), or v2
/// as the token-exchange resource takes them (`iss` the v2 issuer, `azp`,
/// `azpacr`), for a managed identity to present as an app's assertion.
#[derive(serde::Serialize)]
struct AccessClaims<'a> {
    aud: &'a str,
    iss: String,
    iat: u64,
    nbf: u64,
    exp: u64,
    aio: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    appid: Option<&'a str>,
    /// 2: the client authenticated with a certificate or an assertion.
    #[serde(skip_serializing_if = "Option::is_none")]
    appidacr: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    azp: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    azpacr: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    idp: Option<String>,
    idtyp: &'static str,
    oid: String,
    rh: String,
    sub: String,
    tid: &'a str,
    uti: String,
    ver: &'static str,
}

/// What the emulator reads of an assertion it issued itself.
#[derive(serde::Deserialize)]
struct OwnClaims {
    azp: Option<String>,
    uti: Option<String>,
}

/// The app's service principal object id in its tenant: stable for an app,
/// as Entra's is.
fn object_id(app: &App) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(format!("{}/{}", app.tenant_id, app.client_id));
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_random_bytes(bytes)
        .into_uuid()
        .to_string()
}

async fn token(
    State(entra): State<Arc<Entra>>,
    Path(tenant): Path<String>,
    body: Bytes,
) -> Response {
    entra.stats.requests.fetch_add(1, Ordering::Relaxed);
    match issue(&entra, &tenant, &body).await {
        Ok(resp) => resp,
        Err(e) => e.into_response(),
    }
}

async fn issue(entra: &Entra, tenant: &str, body: &[u8]) -> Result<Response, AadError> {
    let form: HashMap<String, String> = url::form_urlencoded::parse(body).into_owned().collect();
    let field = |name: &str| form.get(name).map(String::as_str).filter(|v| !v.is_empty());

    if !entra.apps.iter().any(|a| a.answers_in(tenant)) {
        return Err(aad(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            90002,
            format!("Tenant '{tenant}' not found. Check to make sure you have the correct tenant ID and are signing into the correct cloud. Check with your subscription administrator, this may happen if there are no active subscriptions for the tenant."),
        ));
    }
    let grant_type = field("grant_type").ok_or_else(|| missing("grant_type"))?;
    if grant_type != "client_credentials" {
        return Err(aad(
            StatusCode::BAD_REQUEST,
            "unsupported_grant_type",
            70003,
            format!("The app requested an unsupported grant type '{grant_type}'."),
        ));
    }
    let client_id = field("client_id").ok_or_else(|| missing("client_id"))?;
    let scope = field("scope").ok_or_else(|| {
        aad(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            90014,
            "The required field 'scope' is missing from the credential. Ensure that you have all the necessary parameters for the login request.",
        )
    })?;
    if scope.contains(' ') {
        return Err(aad(
            StatusCode::BAD_REQUEST,
            "invalid_scope",
            70011,
            format!("The provided request must include a 'scope' input parameter. The provided value for the input parameter 'scope' is not valid. The scope {scope} is not valid."),
        ));
    }
    if !scope.ends_with("/.default") {
        return Err(aad(
            StatusCode::BAD_REQUEST,
            "invalid_scope",
            1002012,
            format!("The provided value for scope {scope} is not valid. Client credential flows must have a scope value with /.default suffixed to the resource identifier (application ID URI)."),
        ));
    }
    let assertion = match (field("client_assertion_type"), field("client_assertion")) {
        (Some(JWT_BEARER), Some(assertion)) => assertion,
        _ => {
            return Err(aad(
                StatusCode::UNAUTHORIZED,
                "invalid_client",
                7000216,
                "'client_assertion', 'client_secret' or 'request' is required for the 'client_credentials' grant type.",
            ))
        }
    };
    let Some(app) = entra
        .apps
        .iter()
        .find(|a| a.answers_in(tenant) && a.client_id == client_id)
    else {
        return Err(aad(
            StatusCode::BAD_REQUEST,
            "unauthorized_client",
            700016,
            format!("Application with identifier '{client_id}' was not found in the directory '{tenant}'. This can happen if the application has not been installed by the administrator of the tenant or consented to by any user in the tenant. You may have sent your authentication request to the wrong tenant."),
        ));
    };

    let malformed = || {
        aad(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            50027,
            "JWT token is invalid or malformed.",
        )
    };
    let header = jsonwebtoken::decode_header(assertion).map_err(|_| malformed())?;
    let claims: AssertionClaims =
        jsonwebtoken::dangerous::insecure_decode_claims(assertion).map_err(|_| malformed())?;
    let (Some(iss), Some(sub), Some(aud), Some(exp)) =
        (claims.iss, claims.sub, claims.aud, claims.exp)
    else {
        return Err(malformed());
    };

    let now = jsonwebtoken::get_current_timestamp();
    let skew = 300; // Entra tolerates five minutes of clock skew.
    if exp + skew < now || claims.nbf.is_some_and(|nbf| nbf > now + skew) {
        return Err(aad(
            StatusCode::UNAUTHORIZED,
            "invalid_client",
            700024,
            format!("Client assertion is not within its valid time range. Current time: {}, assertion valid from {}, expiry time of assertion {}. Review the documentation at https://docs.microsoft.com/azure/active-directory/develop/active-directory-certificate-credentials .",
                entra_time(now), entra_time(claims.nbf.unwrap_or(0)), entra_time(exp)),
        ));
    }

    let audiences: Vec<&str> = aud.iter().collect();
    // The credentials of this issuer Entra sees now: the configured ones
    // and those added since whose propagation is over.
    let records = entra.credentials_of(app, &iss);
    if records.is_empty() {
        return Err(aad(
            StatusCode::UNAUTHORIZED,
            "invalid_client",
            700211,
            format!("No matching federated identity record found for presented assertion issuer '{iss}'. Please check your federated identity credential Subject, Audience and Issuer against the presented assertion. https://docs.microsoft.com/en-us/azure/active-directory/develop/workload-identity-federation"),
        ));
    }

    // Entra's own v2 token as the assertion: a managed identity acting as
    // an app's federated credential. Only a managed identity's will do.
    let entra_issued = entra.own_issuer_tenant(&iss);
    if let Some(issuing_tenant) = entra_issued {
        let claims: OwnClaims =
            jsonwebtoken::dangerous::insecure_decode_claims(assertion).map_err(|_| malformed())?;
        let is_identity = entra.apps.iter().any(|a| {
            a.managed_identity
                && a.tenant_id == issuing_tenant
                && Some(&a.client_id) == claims.azp.as_ref()
        });
        if !is_identity {
            return Err(aad(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                700226,
                "Only MSI tokens may be used as Federated Identity Credentials for AAD issuer.",
            ));
        }
    }

    // Signature, against the keys the issuer publishes (Entra's own for
    // its tokens).
    let key = match entra_issued {
        Some(_) => Box::new(entra.own_key.clone()),
        None => match entra.key_set(&iss).lookup(header.kid.as_deref()).await {
            Ok(Lookup::Found(key, _)) => key,
            Ok(Lookup::Unknown) => {
                return Err(aad(
                    StatusCode::UNAUTHORIZED,
                    "invalid_client",
                    7000272,
                    format!("The certificate with identifier {} used to sign the federated credential could not be found in the metadata of identity provider {iss}. Please validate that your Identity Provider's metadata exposes the key used to sign the incoming token.", header.kid.as_deref().unwrap_or("")),
                ))
            }
            Err(e) => {
                tracing::warn!(issuer = %iss, error = %e, "the Entra emulator cannot fetch the issuer's keys");
                return Err(aad(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    50166,
                    "Request to External OIDC endpoint failed.",
                ));
            }
        },
    };
    let mut validation = jsonwebtoken::Validation::new(header.alg);
    validation.validate_exp = false; // checked above with Entra's skew
    validation.validate_aud = false; // checked against the record below
    validation.required_spec_claims.clear();
    if jsonwebtoken::decode::<serde_json::Value>(assertion, &key, &validation).is_err() {
        return Err(aad(
            StatusCode::UNAUTHORIZED,
            "invalid_client",
            50013,
            "Assertion failed signature validation. [Reason - Key was found, but use of the key to verify the signature failed.]",
        ));
    }

    if entra_issued.is_some() {
        let claims: OwnClaims =
            jsonwebtoken::dangerous::insecure_decode_claims(assertion).map_err(|_| malformed())?;
        let chained = claims.uti.as_ref().is_some_and(|uti| {
            let obtained = entra
                .federation_obtained
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            obtained.set.contains(uti)
        });
        if chained {
            return Err(aad(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                700231,
                "Token obtained using another federated identity credential may not be used as federated identity credential.",
            ));
        }
    }

    // The credentials of this issuer: the subject must match one exactly
    // (case-sensitively since September 2024), then its audience.
    let subject: Vec<&FederatedCredential> = records.iter().filter(|f| f.subject == sub).collect();
    if subject.is_empty() {
        if records.iter().any(|f| f.subject.eq_ignore_ascii_case(&sub)) {
            return Err(aad(
                StatusCode::UNAUTHORIZED,
                "invalid_client",
                7002138,
                format!("No matching federated identity record found for presented assertion subject '{sub}'. The subject matches with case-insensitive comparison, but not with case-sensitive comparison. Check your federated identity credential Subject, Audience and Issuer against the presented assertion. See documentation at: https://learn.microsoft.com/entra/workload-id/workload-identity-federation. See breaking change notification and remediation at: https://learn.microsoft.com/en-us/entra/identity-platform/reference-breaking-changes#august-2024."),
            ));
        }
        return Err(aad(
            StatusCode::UNAUTHORIZED,
            "invalid_client",
            700213,
            format!("No matching federated identity record found for presented assertion subject '{sub}'. Check your federated identity credential Subject, Audience and Issuer against the presented assertion. https://learn.microsoft.com/entra/workload-id/workload-identity-federation"),
        ));
    }
    if !subject
        .iter()
        .any(|f| audiences.iter().any(|a| *a == f.audience))
    {
        return Err(aad(
            StatusCode::UNAUTHORIZED,
            "invalid_client",
            700212,
            format!("No matching federated identity record found for presented assertion audience '{}'. Please check your federated identity credential Subject, Audience and Issuer against the presented assertion. https://docs.microsoft.com/en-us/azure/active-directory/develop/workload-identity-federation", audiences.join(",")),
        ));
    }

    let issued = entra.mint(app, tenant, scope, Obtained::Federation)?;
    Ok((
        StatusCode::OK,
        [
            ("cache-control", "no-store, no-cache".to_string()),
            ("x-ms-request-id", uuid::Uuid::new_v4().to_string()),
        ],
        Json(json!({
            "token_type": "Bearer",
            "expires_in": issued.expires_in,
            "ext_expires_in": issued.expires_in,
            "access_token": issued.access_token,
        })),
    )
        .into_response())
}

impl Entra {
    /// Signs `app`'s access token for `scope` in `tenant` and records it.
    fn mint(
        &self,
        app: &App,
        tenant: &str,
        scope: &str,
        obtained: Obtained,
    ) -> Result<Issued, AadError> {
        let now = jsonwebtoken::get_current_timestamp();
        let lifetime = self.lifetime.as_secs();
        // The resource is the scope without `/.default`: what `aud` names.
        let resource = scope.strip_suffix("/.default").unwrap_or(scope);
        let oid = object_id(app);
        // A token to present as an assertion is v2, as the token-exchange
        // resource takes them; any other is v1, as Azure resources take them.
        let v2 = is_exchange_scope(scope);
        let issuer = match v2 {
            true => v2_issuer(tenant),
            false => format!("https://sts.windows.net/{tenant}/"),
        };
        let client = Some(app.client_id.as_str());
        let uti = random_token(16);
        let signed = self.signing.sign(&AccessClaims {
            aud: resource,
            iat: now,
            nbf: now,
            exp: now + lifetime,
            aio: random_token(24),
            appid: client.filter(|_| !v2),
            appidacr: Some("2").filter(|_| !v2),
            azp: client.filter(|_| v2),
            azpacr: Some("2").filter(|_| v2),
            idp: (!v2).then(|| issuer.clone()),
            iss: issuer,
            idtyp: "app",
            sub: oid.clone(),
            oid,
            rh: random_token(16),
            tid: tenant,
            uti: uti.clone(),
            ver: if v2 { "2.0" } else { "1.0" },
        });
        let access_token = signed.map_err(|_| {
            aad(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                50000,
                "There was an error issuing a token or an issue with our sign-in service.",
            )
        })?;
        if obtained == Obtained::Federation {
            self.federation_obtained
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(uti);
        }
        self.stats.issued.fetch_add(1, Ordering::Relaxed);
        self.ledger
            .record(&access_token, &format!("{tenant}/{}", app.client_id));
        Ok(Issued {
            access_token,
            expires_in: lifetime,
        })
    }
}

/// A time as Entra writes it in its messages: seven fractional digits,
/// `Z` (`2024-06-04T11:40:28.3451933Z`).
fn entra_time(unix: u64) -> String {
    time::OffsetDateTime::from_unix_timestamp(unix as i64)
        .ok()
        .and_then(|t| {
            t.format(time::macros::format_description!(
                "[year]-[month]-[day]T[hour]:[minute]:[second].0000000Z"
            ))
            .ok()
        })
        .unwrap_or_else(|| unix.to_string())
}

/// An injected error status as Entra answers a transient failure (429 or
/// 5xx, `temporarily_unavailable`, AADSTS90033); MSAL and azure-identity
/// retry on the status and honour `Retry-After`.
fn fault_response(status: StatusCode, _retry_after: Option<u64>) -> Response {
    aad(
        status,
        "temporarily_unavailable",
        90033,
        "A transient error has occurred. Please try again.",
    )
    .into_response()
}
