//! AWS STS emulator: `AssumeRoleWithWebIdentity`, `AssumeRole` and
//! `GetCallerIdentity`, validating like AWS.
//!
//! `AssumeRoleWithWebIdentity` is the unsigned query-protocol form `Action`,
//! `Version`, `RoleArn`, `RoleSessionName`, `WebIdentityToken`,
//! `DurationSeconds` (an `Authorization` header on it is ignored: the token
//! is the credential). Checks run in the order STS applies them as far as
//! its answers show:
//! operation and version, the request's field constraints (AWS's
//! "N validation errors detected" text), the token's issuer against the
//! registered IAM OIDC providers (the issuer URL without scheme is the
//! provider id, as in IAM), the token's signature against the keys found by
//! OIDC discovery of that issuer, its expiry, its audience against the
//! provider's client ids, the role's trust in the token's subject, and the
//! role's `MaxSessionDuration`. Answers carry STS's XML shapes and error
//! codes, so the exchanger and the SDKs see what they would see from AWS.
//!
//! `AssumeRole` and `GetCallerIdentity` must be signed (SigV4, verified by
//! the `sigv4` module from the specification) with credentials this
//! emulator issued: it remembers each issued credential (bounded, in the
//! `sessions` module) and answers `InvalidClientTokenId`, `ExpiredToken`,
//! `SignatureDoesNotMatch` and their kin as STS does. `AssumeRole` then applies the target role's
//! trust policy as modelled by [`AwsRole`] (trusted source roles, an
//! `sts:ExternalId` condition, `sts:TagSession`), session tags with their
//! chaining rules, the one-hour limit of role chaining and a deterministic
//! model of the packed policy size (documented in the `assume_role`
//! module and at [`AwsEmulatorConfig::packed_policy_limit`]). Every
//! issuance is recorded for tests ([`AwsSts::sessions`]).
//!
//! Simplification: the emulator has one IAM namespace. Every registered
//! provider is trusted by every role (as if each role's trust policy named
//! each provider as its `Federated` principal); roles differ in which
//! subjects they accept (`StringLike` patterns on `sub`), and in which
//! roles' sessions may chain into them.

mod assume_role;
#[cfg(test)]
mod router_tests;
mod sessions;
mod sigv4;
mod validation;

pub use sessions::{SessionAction, SessionRecord, SESSION_RECORD_CAPACITY};

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use quick_xml::escape::escape;
use sha2::{Digest, Sha256};

use crate::arn::RoleArn;
use crate::claims::Audience;
use crate::jwks::{KeySet, KeysError, Lookup};
use sessions::{Credential, CredentialStore, Principal, SessionLog};
use sigv4::{KeyMaterial, SigV4Error, SignedRequest};
use validation::{Shown, Violations};

/// The XML namespace of every STS answer.
pub const STS_NAMESPACE: &str = "https://sts.amazonaws.com/doc/2011-06-15/";
/// The only STS API version there is.
pub const STS_VERSION: &str = "2011-06-15";
/// The client id EKS registers for IRSA tokens; what projected tokens for
/// AWS carry as `aud`.
pub const DEFAULT_AUDIENCE: &str = "sts.amazonaws.com";

const WEB_IDENTITY_ACTION: &str = "AssumeRoleWithWebIdentity";
const ASSUME_ROLE_ACTION: &str = "AssumeRole";
const CALLER_IDENTITY_ACTION: &str = "GetCallerIdentity";
/// The packed-size budget [`AwsEmulatorConfig::packed_policy_limit`]
/// defaults to, in bytes of tag keys, tag values and policy text: the six
/// EKS session tags with realistic values (keys 114 bytes, values
/// 100–250) fill 11–18% of it; 50 tags of 256-character values (over
/// 12,800 bytes) overflow it six times.
pub const DEFAULT_PACKED_POLICY_LIMIT: usize = 2048;
/// STS's bounds on `DurationSeconds`, independent of the role.
const MIN_DURATION: u64 = 900;
const MAX_DURATION: u64 = 43200;
/// STS's default when `DurationSeconds` is absent.
const DEFAULT_DURATION: u64 = 3600;
/// STS's message when the JWKS of the issuer cannot be fetched (observed
/// from AWS, including its double space). Clients recognise it as
/// transient, so the exact text matters.
pub const KEY_RETRIEVAL_FAILED: &str = "Couldn't retrieve verification key from your identity provider,  please reference AssumeRoleWithWebIdentity documentation for requirements";

/// An IAM OIDC identity provider.
#[derive(Debug, Clone)]
pub struct OidcProvider {
    /// The issuer URL (`https://oidc.eks.…/id/…`; `http://127.0.0.1:…` for
    /// the built-in issuer). Without its scheme it is the provider id.
    pub issuer: String,
    /// Allowed client ids: the token's `aud` must contain one.
    pub audiences: Vec<String>,
}

/// An IAM role that web identities may assume.
#[derive(Debug, Clone)]
pub struct AwsRole {
    /// `arn:aws:iam::123456789012:role/NAME` (a path before NAME is allowed).
    pub arn: String,
    /// Subjects the trust policy accepts, as `StringLike` patterns: `*`
    /// matches any run of characters, `?` one character.
    pub trusted_subjects: Vec<String>,
    /// The role's `MaxSessionDuration`, in seconds (IAM allows 3600–43200).
    pub max_session_duration: u64,
    /// Principals whose sessions may `AssumeRole` into this role (trust
    /// policy `"Principal": {"AWS": …}` with `sts:AssumeRole`): role ARNs,
    /// whose sessions are trusted, or an account (`arn:aws:iam::ACCOUNT:root`
    /// or the bare id), all of whose sessions are. Empty: no chaining in.
    pub trusted_roles: Vec<String>,
    /// The trust policy's `StringEquals {"sts:ExternalId": …}` condition:
    /// `AssumeRole` must present exactly this `ExternalId`. `None`: no
    /// condition (a presented id is ignored, as by AWS).
    pub external_id: Option<String>,
    /// Whether the trust policy also grants `sts:TagSession`, which
    /// `AssumeRole` needs to pass session tags or transitive keys, or to
    /// inherit transitive tags from the caller.
    pub allow_tag_session: bool,
}

/// What the emulated account contains.
#[derive(Debug, Clone)]
pub struct AwsEmulatorConfig {
    /// The IAM OIDC identity providers: which issuers' tokens STS accepts.
    pub providers: Vec<OidcProvider>,
    /// The roles, with the subjects their trust policies accept.
    pub roles: Vec<AwsRole>,
    /// The packed-size budget of an `AssumeRole` session, in bytes.
    ///
    /// AWS packs session tags and policies into a binary form of
    /// undocumented size; the emulator models it deterministically:
    /// `PackedPolicySize = ceil((UTF-8 bytes of every tag key and value the
    /// session carries, passed or inherited, + bytes of the session policy)
    /// × 100 / packed_policy_limit)`. Over 100 is `PackedPolicyTooLarge`.
    /// [`DEFAULT_PACKED_POLICY_LIMIT`] unless a test shrinks it.
    pub packed_policy_limit: usize,
}

impl Default for AwsEmulatorConfig {
    fn default() -> Self {
        AwsEmulatorConfig {
            providers: Vec::new(),
            roles: Vec::new(),
            packed_policy_limit: DEFAULT_PACKED_POLICY_LIMIT,
        }
    }
}

/// Counters tests and the dev admin endpoint read.
#[derive(Debug, Default)]
pub struct AwsStsStats {
    /// Every request that reached the endpoint, throttled or not.
    pub requests: AtomicU64,
    /// Credentials handed out.
    pub issued: AtomicU64,
    /// Requests refused by the throttle knob.
    pub throttled: AtomicU64,
    /// `AssumeRole` requests (signed or not) past the throttle.
    pub assume_role_requests: AtomicU64,
    /// Credentials handed out by `AssumeRole` (also counted in `issued`).
    pub assume_role_issued: AtomicU64,
    /// `GetCallerIdentity` requests past the throttle.
    pub caller_identity_requests: AtomicU64,
    /// Signed actions refused before they ran: missing, malformed or wrong
    /// signatures, unknown or expired credentials.
    pub auth_failures: AtomicU64,
}

/// The emulator's state.
pub struct AwsSts {
    config: AwsEmulatorConfig,
    key_sets: super::IssuerKeys,
    throttle: AtomicU32,
    /// What the emulator has been asked and has issued.
    pub stats: AwsStsStats,
    /// Each access key id and the role ARN it was issued for.
    pub ledger: super::Ledger,
    /// Misbehaviour to inject (tests, benchmarks).
    pub faults: Arc<super::faults::Faults>,
    /// Every credential issued, to verify signed calls with.
    credentials: Mutex<CredentialStore>,
    /// Every issuance, for tests.
    session_log: Mutex<SessionLog>,
}

/// A session about to be issued, with what its record shows.
struct Grant {
    action: SessionAction,
    role_arn: String,
    session_name: String,
    duration: u64,
    subject: Option<String>,
    /// The caller, for `AssumeRole`.
    source: Option<Principal>,
    tags: Vec<(String, String)>,
    transitive_tag_keys: Vec<String>,
    inherited_tags: Vec<(String, String)>,
    /// The new session's transitive tags.
    transitive_tags: Vec<(String, String)>,
    external_id: Option<String>,
    session_policy: bool,
    packed_policy_size: Option<u32>,
}

/// Credentials issued for a [`Grant`], and how the answer names them.
struct Minted {
    credentials: Issued,
    expiration: String,
    assumed_role_arn: String,
    assumed_role_id: String,
    request_id: String,
}

impl AwsSts {
    /// An emulator of the account `config` describes, discovering issuers'
    /// keys with `http`; no request is throttled until
    /// [`AwsSts::set_throttle`].
    pub fn new(config: AwsEmulatorConfig, http: reqwest::Client) -> Self {
        AwsSts {
            config,
            key_sets: super::IssuerKeys::new(http),
            throttle: AtomicU32::new(0),
            stats: AwsStsStats::default(),
            ledger: super::Ledger::default(),
            faults: Default::default(),
            credentials: Mutex::new(CredentialStore::new(sessions::CREDENTIAL_CAPACITY)),
            session_log: Mutex::new(SessionLog::default()),
        }
    }

    /// Every issuance still in the record (the newest
    /// [`SESSION_RECORD_CAPACITY`]), oldest first: which operation, role,
    /// session name, source, tags, external id, policy and duration, as
    /// CloudTrail would show them.
    pub fn sessions(&self) -> Vec<SessionRecord> {
        self.session_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .snapshot()
    }

    /// Generates credentials for `grant` on `role`, remembers them for
    /// signature checks, and records the issuance (ledger, stats, log).
    fn issue(&self, grant: Grant, role: &RoleArn, now: u64) -> Result<Minted, StsError> {
        let credentials = Issued::generate().ok_or_else(|| {
            sts_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalFailure",
                "An internal error occurred.",
            )
        })?;
        let expires_at = now + grant.duration;
        let assumed_role_arn = role.assumed_role_arn(&grant.session_name);
        let assumed_role_id = format!("{}:{}", role_unique_id(&grant.role_arn), grant.session_name);
        let request_id = uuid::Uuid::new_v4().to_string();
        let principal = Principal {
            role_arn: grant.role_arn.clone(),
            assumed_role_arn: assumed_role_arn.clone(),
            user_id: assumed_role_id.clone(),
            account: role.account().to_string(),
            transitive_tags: grant.transitive_tags,
        };
        self.credentials
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                &credentials.access_key_id,
                Credential::new(
                    &credentials.secret_access_key,
                    &credentials.session_token,
                    expires_at,
                    principal,
                ),
                now,
            );
        let record = SessionRecord {
            action: grant.action,
            request_id: request_id.clone(),
            access_key_id: credentials.access_key_id.clone(),
            role_arn: grant.role_arn.clone(),
            assumed_role_arn: assumed_role_arn.clone(),
            session_name: grant.session_name,
            subject: grant.subject,
            source_role_arn: grant.source.as_ref().map(|s| s.role_arn.clone()),
            source_assumed_role_arn: grant.source.map(|s| s.assumed_role_arn),
            tags: grant.tags,
            transitive_tag_keys: grant.transitive_tag_keys,
            inherited_tags: grant.inherited_tags,
            external_id: grant.external_id,
            session_policy: grant.session_policy,
            packed_policy_size: grant.packed_policy_size,
            duration_seconds: grant.duration,
            expires_at,
        };
        self.session_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(record);
        self.stats.issued.fetch_add(1, Ordering::Relaxed);
        self.ledger
            .record(&credentials.access_key_id, &grant.role_arn);
        Ok(Minted {
            credentials,
            expiration: iso8601(expires_at),
            assumed_role_arn,
            assumed_role_id,
            request_id,
        })
    }

    /// Verifies `request`'s signature against the credentials issued here
    /// and returns whom they stand for.
    fn authenticate(&self, request: &SignedRequest<'_>, now: u64) -> Result<Principal, StsError> {
        let now_secs = i64::try_from(now).unwrap_or(i64::MAX);
        let verified = sigv4::verify(request, now_secs, |access_key_id, token| {
            let store = self.credentials.lock().unwrap_or_else(|p| p.into_inner());
            let credential = store.get(access_key_id).ok_or(SigV4Error::InvalidToken)?;
            // Issued credentials are all temporary: the token is required.
            if !token.is_some_and(|t| credential.token_matches(t)) {
                return Err(SigV4Error::InvalidToken);
            }
            if credential.expires_at() <= now {
                return Err(SigV4Error::ExpiredToken);
            }
            Ok(KeyMaterial {
                secret: credential.secret().to_string(),
                principal: credential.principal().clone(),
            })
        });
        verified.map_err(|e| {
            self.stats.auth_failures.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(code = e.code(), "STS emulator refused a signed request");
            StsError::from(e)
        })
    }

    /// STS answers every action on `POST /`.
    pub fn router(self: &Arc<Self>) -> Router {
        let router = Router::new()
            .route("/", post(handle))
            .with_state(self.clone());
        self.faults.layer(router, fault_response)
    }

    /// Makes the next `n` requests fail with `Throttling` ("Rate exceeded",
    /// HTTP 400), as STS does when an account exceeds its request rate, so
    /// that tests can show what the cache does while upstream pushes back.
    pub fn set_throttle(&self, n: u32) {
        self.throttle.store(n, Ordering::SeqCst);
    }

    /// Takes one request from the throttle budget, if any is left.
    fn take_throttle(&self) -> bool {
        self.throttle
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    fn key_set(&self, issuer: &str) -> Arc<KeySet> {
        self.key_sets.get(issuer)
    }

    /// Fetches the keys of every OIDC provider's issuer now, as a service
    /// that has long trusted the issuer holds them.
    pub async fn preload_keys(&self) -> Result<(), KeysError> {
        let issuers = self.config.providers.iter().map(|p| p.issuer.as_str());
        self.key_sets.preload(issuers).await
    }

    fn provider(&self, iss: &str) -> Option<&OidcProvider> {
        let id = provider_id(iss);
        self.config
            .providers
            .iter()
            .find(|p| provider_id(&p.issuer) == id)
    }
}

/// The IAM provider id of an issuer URL: the URL without its scheme and
/// trailing slash (`oidc.eks.us-west-2.amazonaws.com/id/ABC`).
pub fn provider_id(issuer: &str) -> &str {
    let rest = issuer
        .strip_prefix("https://")
        .or_else(|| issuer.strip_prefix("http://"))
        .unwrap_or(issuer);
    rest.trim_end_matches('/')
}

/// An STS error answer.
#[derive(Debug)]
struct StsError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

fn sts_error(status: StatusCode, code: &'static str, message: impl Into<String>) -> StsError {
    StsError {
        status,
        code,
        message: message.into(),
    }
}

fn invalid_token(message: impl Into<String>) -> StsError {
    sts_error(StatusCode::BAD_REQUEST, "InvalidIdentityToken", message)
}

fn validation(message: impl Into<String>) -> StsError {
    sts_error(StatusCode::BAD_REQUEST, "ValidationError", message)
}

/// STS's answer when the role does not exist or does not trust the caller:
/// the same for both, so that callers cannot probe for role names.
fn access_denied() -> StsError {
    sts_error(
        StatusCode::FORBIDDEN,
        "AccessDenied",
        "Not authorized to perform sts:AssumeRoleWithWebIdentity",
    )
}

impl From<SigV4Error> for StsError {
    fn from(e: SigV4Error) -> Self {
        let status = match e {
            SigV4Error::Incomplete(_) => StatusCode::BAD_REQUEST,
            _ => StatusCode::FORBIDDEN,
        };
        sts_error(status, e.code(), e.message())
    }
}

/// A successful STS answer: XML, with its request id in a header too.
fn xml_response(body: String, request_id: String) -> Response {
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE.as_str(), "text/xml".to_string()),
            ("x-amzn-requestid", request_id),
        ],
        body,
    )
        .into_response()
}

impl IntoResponse for StsError {
    fn into_response(self) -> Response {
        let request_id = uuid::Uuid::new_v4().to_string();
        let body = format!(
            "<ErrorResponse xmlns=\"{STS_NAMESPACE}\">\n  <Error>\n    <Type>Sender</Type>\n    <Code>{}</Code>\n    <Message>{}</Message>\n  </Error>\n  <RequestId>{request_id}</RequestId>\n</ErrorResponse>\n",
            self.code,
            escape(self.message.as_str()),
        );
        (
            self.status,
            [
                (header::CONTENT_TYPE.as_str(), "text/xml".to_string()),
                ("x-amzn-requestid", request_id),
            ],
            body,
        )
            .into_response()
    }
}

async fn handle(
    State(sts): State<Arc<AwsSts>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    sts.stats.requests.fetch_add(1, Ordering::Relaxed);
    if sts.take_throttle() {
        sts.stats.throttled.fetch_add(1, Ordering::Relaxed);
        return sts_error(StatusCode::BAD_REQUEST, "Throttling", "Rate exceeded").into_response();
    }
    let request = SignedRequest {
        method: method.as_str(),
        path: uri.path(),
        query: uri.query().unwrap_or(""),
        headers: &headers,
        body: &body,
    };
    match dispatch(&sts, &request).await {
        Ok(resp) => resp,
        Err(e) => e.into_response(),
    }
}

/// Routes on `Action`: a web identity needs no signature, the others do.
async fn dispatch(sts: &AwsSts, request: &SignedRequest<'_>) -> Result<Response, StsError> {
    let form: HashMap<String, String> = url::form_urlencoded::parse(request.body)
        .into_owned()
        .collect();
    let field = |name: &str| form.get(name).map(String::as_str);

    let Some(action) = field("Action").filter(|a| !a.is_empty()) else {
        return Err(sts_error(
            StatusCode::BAD_REQUEST,
            "MissingAction",
            "Missing Action",
        ));
    };
    let version = field("Version").unwrap_or("NO_VERSION_SPECIFIED");
    let known = matches!(
        action,
        WEB_IDENTITY_ACTION | ASSUME_ROLE_ACTION | CALLER_IDENTITY_ACTION
    );
    if !known || version != STS_VERSION {
        return Err(sts_error(
            StatusCode::BAD_REQUEST,
            "InvalidAction",
            format!("Could not find operation {action} for version {version}"),
        ));
    }
    let now = jsonwebtoken::get_current_timestamp();
    match action {
        ASSUME_ROLE_ACTION => {
            sts.stats
                .assume_role_requests
                .fetch_add(1, Ordering::Relaxed);
            let caller = sts.authenticate(request, now)?;
            assume_role::assume_role(sts, &caller, &form, now)
        }
        CALLER_IDENTITY_ACTION => {
            sts.stats
                .caller_identity_requests
                .fetch_add(1, Ordering::Relaxed);
            let caller = sts.authenticate(request, now)?;
            Ok(assume_role::caller_identity(&caller))
        }
        _ => assume_with_web_identity(sts, &form, now).await,
    }
}

#[derive(serde::Deserialize)]
struct WebIdentityClaims {
    iss: Option<String>,
    sub: Option<String>,
    aud: Option<Audience>,
    exp: Option<u64>,
    nbf: Option<u64>,
}

async fn assume_with_web_identity(
    sts: &AwsSts,
    form: &HashMap<String, String>,
    now: u64,
) -> Result<Response, StsError> {
    let field = |name: &str| form.get(name).map(String::as_str);

    let params = validate_params(
        field("RoleArn"),
        field("RoleSessionName"),
        field("WebIdentityToken"),
        field("DurationSeconds"),
    )?;
    let token = params.token;

    // The token, unverified, only to learn which provider to verify it with.
    let header = jsonwebtoken::decode_header(token)
        .map_err(|_| invalid_token("The ID token is not a valid JWT."))?;
    let claims: WebIdentityClaims = jsonwebtoken::dangerous::insecure_decode_claims(token)
        .map_err(|_| invalid_token("The ID token is not a valid JWT."))?;
    let Some(iss) = claims.iss.as_deref() else {
        return Err(invalid_token("The ID token has no issuer (iss) claim."));
    };
    // Keys are fetched only for registered providers: an unregistered issuer
    // must not make STS call out to an arbitrary URL.
    let Some(provider) = sts.provider(iss) else {
        return Err(invalid_token(format!(
            "No OpenIDConnect provider found in your account for {iss}"
        )));
    };

    // Signature, against the keys the provider's issuer publishes.
    let alg_family_ok = matches!(
        header.alg,
        jsonwebtoken::Algorithm::RS256
            | jsonwebtoken::Algorithm::RS384
            | jsonwebtoken::Algorithm::RS512
            | jsonwebtoken::Algorithm::PS256
            | jsonwebtoken::Algorithm::PS384
            | jsonwebtoken::Algorithm::PS512
            | jsonwebtoken::Algorithm::ES256
            | jsonwebtoken::Algorithm::ES384
    );
    if !alg_family_ok {
        return Err(invalid_token(format!(
            "The ID token is signed with an unsupported algorithm ({:?}).",
            header.alg
        )));
    }
    let keys = sts.key_set(provider.issuer.trim_end_matches('/'));
    let key = match keys.lookup(header.kid.as_deref()).await {
        Ok(Lookup::Found(key, _)) => key,
        Ok(Lookup::Unknown) => {
            return Err(invalid_token(
                "The ID token's signing key (kid) is not published by the identity provider.",
            ))
        }
        Err(e) => {
            tracing::debug!(error = %e, "STS emulator could not fetch issuer keys");
            return Err(invalid_token(KEY_RETRIEVAL_FAILED));
        }
    };
    let mut v = jsonwebtoken::Validation::new(header.alg);
    v.validate_exp = false; // checked below, with STS's own error
    v.validate_aud = false; // checked below against the provider's client ids
    v.required_spec_claims.clear();
    if jsonwebtoken::decode::<serde_json::Value>(token, &key, &v).is_err() {
        return Err(invalid_token(
            "The ID token's signature could not be verified.",
        ));
    }

    let Some(exp) = claims.exp else {
        return Err(invalid_token("The ID token has no expiration (exp) claim."));
    };
    if exp <= now {
        return Err(sts_error(
            StatusCode::BAD_REQUEST,
            "ExpiredTokenException",
            format!("Token expired: current date/time {now} must be before the expiration date/time {exp}"),
        ));
    }
    if claims.nbf.is_some_and(|nbf| nbf > now + 60) {
        return Err(invalid_token("The ID token is not valid yet (nbf)."));
    }
    // A token without `aud` is refused for it by name
    // (aws/aws-sdk-ruby#2698); one for another audience is not.
    let Some(aud) = claims.aud.as_ref() else {
        return Err(invalid_token("Missing a required claim: aud"));
    };
    let audience = aud
        .iter()
        .find(|a| provider.audiences.iter().any(|p| p == a))
        .ok_or_else(|| invalid_token("Incorrect token audience"))?
        .to_string();
    let Some(sub) = claims.sub.as_deref().filter(|s| !s.is_empty()) else {
        return Err(invalid_token("The ID token has no subject (sub) claim."));
    };

    let role = sts
        .config
        .roles
        .iter()
        .find(|r| r.arn == params.role_arn)
        .ok_or_else(access_denied)?;
    let role_arn = RoleArn::parse(role.arn.as_str()).map_err(|_| access_denied())?;
    if !role.trusted_subjects.iter().any(|p| string_like(p, sub)) {
        return Err(access_denied());
    }
    if params.duration > role.max_session_duration {
        return Err(validation(
            "The requested DurationSeconds exceeds the MaxSessionDuration set for this role.",
        ));
    }

    let provider_arn = format!(
        "arn:{}:iam::{}:oidc-provider/{}",
        role_arn.partition(),
        role_arn.account(),
        provider_id(&provider.issuer)
    );
    let minted = sts.issue(
        Grant {
            action: SessionAction::AssumeRoleWithWebIdentity,
            role_arn: role.arn.clone(),
            session_name: params.session_name.to_string(),
            duration: params.duration,
            subject: Some(sub.to_string()),
            source: None,
            tags: Vec::new(),
            transitive_tag_keys: Vec::new(),
            inherited_tags: Vec::new(),
            transitive_tags: Vec::new(),
            external_id: None,
            session_policy: false,
            packed_policy_size: None,
        },
        &role_arn,
        now,
    )?;
    let body = format!(
        "<AssumeRoleWithWebIdentityResponse xmlns=\"{STS_NAMESPACE}\">\n  <AssumeRoleWithWebIdentityResult>\n    <Audience>{}</Audience>\n    <AssumedRoleUser>\n      <AssumedRoleId>{}</AssumedRoleId>\n      <Arn>{}</Arn>\n    </AssumedRoleUser>\n    <Provider>{}</Provider>\n    <Credentials>\n      <AccessKeyId>{}</AccessKeyId>\n      <SecretAccessKey>{}</SecretAccessKey>\n      <SessionToken>{}</SessionToken>\n      <Expiration>{}</Expiration>\n    </Credentials>\n    <SubjectFromWebIdentityToken>{}</SubjectFromWebIdentityToken>\n  </AssumeRoleWithWebIdentityResult>\n  <ResponseMetadata>\n    <RequestId>{}</RequestId>\n  </ResponseMetadata>\n</AssumeRoleWithWebIdentityResponse>\n",
        escape(audience.as_str()),
        escape(minted.assumed_role_id.as_str()),
        escape(minted.assumed_role_arn.as_str()),
        escape(provider_arn.as_str()),
        minted.credentials.access_key_id,
        escape(minted.credentials.secret_access_key.as_str()),
        escape(minted.credentials.session_token.as_str()),
        minted.expiration,
        escape(sub),
        minted.request_id,
    );
    Ok(xml_response(body, minted.request_id))
}

/// The request's fields after STS's declarative constraints.
struct Params<'a> {
    role_arn: &'a str,
    session_name: &'a str,
    token: &'a str,
    duration: u64,
}

/// Applies the constraints of the STS API model, collecting every
/// violation into one message as AWS does: "2 validation errors detected:
/// Value '…' at 'roleSessionName' failed to satisfy constraint: …; …".
/// The token is never echoed (AWS redacts sensitive members).
fn validate_params<'a>(
    role_arn: Option<&'a str>,
    session_name: Option<&'a str>,
    token: Option<&'a str>,
    duration: Option<&'a str>,
) -> Result<Params<'a>, StsError> {
    let mut v = Violations::default();
    v.role_and_session(role_arn, session_name);
    match token {
        None => v.fail(Shown::Null, "webIdentityToken", "Member must not be null"),
        // Bytes, not characters: tokens are ASCII. Never echoed.
        Some(t) if t.len() < 4 => v.fail(
            Shown::Redacted,
            "webIdentityToken",
            "Member must have length greater than or equal to 4",
        ),
        Some(t) if t.len() > 20000 => v.fail(
            Shown::Redacted,
            "webIdentityToken",
            "Member must have length less than or equal to 20000",
        ),
        Some(_) => {}
    }
    let seconds = validation::duration(
        &mut v,
        duration,
        MIN_DURATION,
        MAX_DURATION,
        DEFAULT_DURATION,
    );
    match (role_arn, session_name, token) {
        (Some(role_arn), Some(session_name), Some(token)) if v.is_empty() => Ok(Params {
            role_arn,
            session_name,
            token,
            duration: seconds,
        }),
        _ => {
            v.finish()?;
            // Unreachable: a missing member is a violation.
            Err(validation("1 validation error detected"))
        }
    }
}

/// IAM's `StringLike`: `*` matches any run of characters (including none),
/// `?` exactly one; everything else literally and case-sensitively.
pub fn string_like(pattern: &str, value: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let v: Vec<char> = value.chars().collect();
    // Iterative glob with single-star backtracking: linear in practice and
    // never exponential, whatever the pattern.
    let (mut pi, mut vi) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while vi < v.len() {
        match p.get(pi) {
            Some('*') => {
                star = Some((pi, vi));
                pi += 1;
            }
            Some(&c) if c == '?' || c == v[vi] => {
                pi += 1;
                vi += 1;
            }
            _ => match star {
                Some((sp, sv)) => {
                    pi = sp + 1;
                    vi = sv + 1;
                    star = Some((sp, sv + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// A role's unique id (`AROA` + 17 characters), stable for its ARN as IAM's
/// is for the role's lifetime.
fn role_unique_id(arn: &str) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let digest = Sha256::digest(arn.as_bytes());
    let mut id = String::from("AROA");
    id.extend(
        digest
            .iter()
            .take(17)
            .map(|b| char::from(ALPHABET[usize::from(b % 32)])),
    );
    id
}

/// Freshly minted session credentials in STS's formats.
struct Issued {
    /// `ASIA` + 16 uppercase alphanumerics: the prefix marks temporary keys.
    access_key_id: String,
    /// 40 characters of base64.
    secret_access_key: String,
    /// Opaque and long, as real session tokens are (hundreds of bytes).
    session_token: String,
}

impl Issued {
    fn generate() -> Option<Issued> {
        use aws_lc_rs::rand::SecureRandom;
        use base64::engine::general_purpose::STANDARD;
        use base64::Engine;
        const UPPER_ALNUM: &[u8; 36] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
        let rng = aws_lc_rs::rand::SystemRandom::new();
        let mut id = [0u8; 16];
        let mut secret = [0u8; 30];
        let mut token = vec![0u8; 420];
        rng.fill(&mut id).ok()?;
        rng.fill(&mut secret).ok()?;
        rng.fill(&mut token).ok()?;
        let mut access_key_id = String::from("ASIA");
        access_key_id.extend(
            id.iter()
                .map(|b| char::from(UPPER_ALNUM[usize::from(b % 36)])),
        );
        Some(Issued {
            access_key_id,
            secret_access_key: STANDARD.encode(secret),
            // Real tokens are standard base64 (with `+`, `/`, `=`) and start
            // with this protobuf-ish prefix; clients must carry them verbatim.
            session_token: format!("IQoJb3JpZ2luX2VjE{}", STANDARD.encode(token)),
        })
    }
}

/// `2026-12-02T11:00:00Z`, the form of STS's `Expiration`.
fn iso8601(unix: u64) -> String {
    i64::try_from(unix)
        .ok()
        .and_then(|u| time::OffsetDateTime::from_unix_timestamp(u).ok())
        .and_then(|t| {
            t.format(time::macros::format_description!(
                "[year]-[month]-[day]T[hour]:[minute]:[second]Z"
            ))
            .ok()
        })
        .unwrap_or_else(|| "1970-01-01T00:00:00Z".to_string())
}

/// An injected error status as STS answers it: 429 becomes STS's own
/// throttling answer (HTTP 400 `Throttling`), 503 `ServiceUnavailable`,
/// other 5xx `InternalFailure`.
fn fault_response(status: StatusCode, _retry_after: Option<u64>) -> Response {
    match status.as_u16() {
        429 => sts_error(StatusCode::BAD_REQUEST, "Throttling", "Rate exceeded"),
        503 => sts_error(
            status,
            "ServiceUnavailable",
            "Service is unable to handle request.",
        ),
        _ => sts_error(status, "InternalFailure", "An internal error occurred."),
    }
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aws_string_like_globs() {
        assert!(string_like(
            "system:serviceaccount:ml:*",
            "system:serviceaccount:ml:ray"
        ));
        assert!(string_like(
            "system:serviceaccount:ml:*",
            "system:serviceaccount:ml:"
        ));
        assert!(!string_like(
            "system:serviceaccount:ml:*",
            "system:serviceaccount:mlx:ray"
        ));
        assert!(string_like(
            "system:serviceaccount:ml:ray",
            "system:serviceaccount:ml:ray"
        ));
        assert!(!string_like(
            "system:serviceaccount:ml:ray",
            "system:serviceaccount:ml:ray2"
        ));
        assert!(string_like("a*c*e", "abcdcxe"));
        assert!(!string_like("a*c*e", "abcdcx"));
        assert!(string_like("ray-?", "ray-1"));
        assert!(!string_like("ray-?", "ray-12"));
        assert!(string_like("*", ""));
        assert!(!string_like("", "x"));
    }

    #[test]
    fn aws_provider_ids_drop_scheme_and_slash() {
        assert_eq!(
            provider_id("https://oidc.eks.eu-west-1.amazonaws.com/id/ABC/"),
            "oidc.eks.eu-west-1.amazonaws.com/id/ABC"
        );
        assert_eq!(provider_id("http://127.0.0.1:8080"), "127.0.0.1:8080");
    }

    #[test]
    fn aws_validation_messages_have_aws_shape() {
        let e = validate_params(
            Some("arn:aws:iam::123456789012:role/r"),
            Some("bad name"),
            Some("tok.en.x"),
            Some("3600"),
        )
        .err()
        .unwrap();
        assert_eq!(e.code, "ValidationError");
        assert_eq!(
            e.message,
            r"1 validation error detected: Value 'bad name' at 'roleSessionName' failed to satisfy constraint: Member must satisfy regular expression pattern: [\w+=,.@-]*"
        );

        let e = validate_params(
            Some("arn:aws:iam::123456789012:role/r"),
            Some("x"),
            Some("secret-token"),
            Some("50000"),
        )
        .err()
        .unwrap();
        assert!(
            e.message.starts_with("2 validation errors detected: "),
            "{}",
            e.message
        );
        assert!(e.message.contains("Member must have length greater than or equal to 2; Value '50000' at 'durationSeconds' failed to satisfy constraint: Member must have value less than or equal to 43200"));

        let e = validate_params(
            Some("arn:aws:iam::123456789012:role/r"),
            Some("ok"),
            Some("abc"),
            None,
        )
        .err()
        .unwrap();
        assert!(!e.message.contains("abc"), "the token must not be echoed");

        let ok = validate_params(
            Some("arn:aws:iam::123456789012:role/r"),
            Some("ok"),
            Some("a.b.c"),
            None,
        );
        assert_eq!(ok.ok().map(|p| p.duration), Some(3600));
    }

    #[test]
    fn aws_credentials_have_sts_formats() {
        let c = Issued::generate().unwrap();
        assert_eq!(c.access_key_id.len(), 20);
        assert!(c.access_key_id.starts_with("ASIA"));
        assert!(c.access_key_id[4..]
            .chars()
            .all(|ch| ch.is_ascii_uppercase() || ch.is_ascii_digit()));
        assert_eq!(c.secret_access_key.len(), 40);
        assert!(c.session_token.len() > 500);
        let other = Issued::generate().unwrap();
        assert_ne!(c.access_key_id, other.access_key_id);
        assert_ne!(c.secret_access_key, other.secret_access_key);
    }

    #[test]
    fn aws_role_ids_are_stable_and_shaped() {
        let a = role_unique_id("arn:aws:iam::123456789012:role/a");
        assert_eq!(a, role_unique_id("arn:aws:iam::123456789012:role/a"));
        assert_ne!(a, role_unique_id("arn:aws:iam::123456789012:role/b"));
        assert_eq!(a.len(), 21);
        assert!(a.starts_with("AROA"));
    }

    #[test]
    fn aws_expiration_format() {
        assert_eq!(iso8601(1_796_209_200), "2026-12-02T11:00:00Z");
    }

    #[test]
    fn aws_throttle_budget_counts_down() {
        let sts = AwsSts::new(AwsEmulatorConfig::default(), reqwest::Client::new());
        assert!(!sts.take_throttle());
        sts.set_throttle(2);
        assert!(sts.take_throttle());
        assert!(sts.take_throttle());
        assert!(!sts.take_throttle());
    }
}
