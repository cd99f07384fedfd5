//! Google STS (`POST /v1/token`): the token exchange that validates the
//! subject token against its workload identity provider and answers a
//! federated access token, with STS's OAuth error shape.

use super::*;

/// An STS error: OAuth shape, HTTP 400.
#[derive(Debug)]
pub(super) struct OAuthError {
    error: &'static str,
    description: String,
}

pub(super) fn oauth(error: &'static str, description: impl Into<String>) -> OAuthError {
    OAuthError {
        error,
        description: description.into(),
    }
}

impl IntoResponse for OAuthError {
    fn into_response(self) -> Response {
        (
            StatusCode::BAD_REQUEST,
            Json(json!({ "error": self.error, "error_description": self.description })),
        )
            .into_response()
    }
}

/// Request parameters: STS takes form-encoded bodies (what the auth
/// libraries send) and JSON bodies with camelCase or snake_case names (what
/// some REST clients send).
pub(super) struct Params(HashMap<String, String>);

impl Params {
    fn parse(headers: &HeaderMap, body: &[u8]) -> Result<Self, OAuthError> {
        let is_json = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.trim_start().starts_with("application/json"));
        if !is_json {
            return Ok(Params(
                url::form_urlencoded::parse(body).into_owned().collect(),
            ));
        }
        let map: Map<String, Value> = serde_json::from_slice(body)
            .map_err(|_| oauth("invalid_request", "Invalid JSON payload received."))?;
        Ok(Params(
            map.into_iter()
                .filter_map(|(k, v)| match v {
                    Value::String(s) => Some((snake_case(&k), s)),
                    _ => None,
                })
                .collect(),
        ))
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .get(name)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }
}

/// `subjectTokenType` → `subject_token_type`.
pub(super) fn snake_case(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 4);
    for c in name.chars() {
        if c.is_ascii_uppercase() {
            out.push('_');
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

#[derive(serde::Deserialize)]
pub(super) struct SubjectClaims {
    iss: Option<String>,
    sub: Option<String>,
    aud: Option<Audience>,
    exp: Option<u64>,
    iat: Option<u64>,
    nbf: Option<u64>,
}

/// Whom STS trusts for one exchange: a provider of a pool of one's own,
/// or a GKE cluster in GKE's pool.
enum Trust<'a> {
    Provider(&'a Provider),
    Gke(&'a GkeCluster),
}

impl Trust<'_> {
    fn issuer(&self) -> &str {
        match self {
            Trust::Provider(p) => p.config.issuer.as_str(),
            Trust::Gke(c) => c.issuer.as_str(),
        }
    }

    /// Audiences a subject token may carry: the provider's (its own name
    /// by default), or the pool's name for GKE.
    fn allowed_audiences(&self) -> Vec<String> {
        match self {
            Trust::Provider(p) if p.config.allowed_audiences.is_empty() => {
                p.name.default_audiences().to_vec()
            }
            Trust::Provider(p) => p.config.allowed_audiences.clone(),
            Trust::Gke(c) => vec![c.pool()],
        }
    }
}

/// `identitynamespace:POOL.svc.id.goog:https://container.googleapis.com/v1/projects/P/locations/L/clusters/C`.
fn is_identity_namespace(audience: &str) -> bool {
    let Some(rest) = audience.strip_prefix("identitynamespace:") else {
        return false;
    };
    let Some((pool, provider)) = rest.split_once(':') else {
        return false;
    };
    let Some(cluster) = provider.strip_prefix("https://container.googleapis.com/v1/") else {
        return false;
    };
    let parts: Vec<&str> = cluster.split('/').collect();
    pool.ends_with(".svc.id.goog")
        && matches!(parts.as_slice(), ["projects", p, "locations", l, "clusters", c]
            if !p.is_empty() && !l.is_empty() && !c.is_empty())
}

pub(super) async fn sts_token(
    State(gcp): State<Arc<Gcp>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    gcp.stats.sts_requests.fetch_add(1, Ordering::Relaxed);
    match exchange(&gcp, &headers, &body).await {
        Ok(resp) => resp,
        Err(e) => e.into_response(),
    }
}

pub(super) async fn exchange(
    gcp: &Gcp,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, OAuthError> {
    let params = Params::parse(headers, body)?;

    match params.get("grant_type") {
        Some(TOKEN_EXCHANGE_GRANT) => {}
        Some(other) => {
            return Err(oauth(
                "unsupported_grant_type",
                format!("Invalid value for \"grant_type\": {other}. The only supported value is {TOKEN_EXCHANGE_GRANT}."),
            ))
        }
        None => {
            return Err(oauth(
                "invalid_request",
                "The \"grant_type\" parameter is required.",
            ))
        }
    }
    let audience = params.get("audience").unwrap_or_default();
    let trust = if audience.starts_with("identitynamespace:") {
        if !is_identity_namespace(audience) {
            return Err(oauth("invalid_request", BAD_AUDIENCE));
        }
        let Some(cluster) = gcp.clusters.iter().find(|c| c.sts_audience() == audience) else {
            return Err(oauth("invalid_target", UNKNOWN_PROVIDER));
        };
        Trust::Gke(cluster)
    } else {
        if ProviderName::names_a_project_id(audience) {
            return Err(oauth("invalid_target", UNKNOWN_PROVIDER));
        }
        if ProviderName::parse(audience).is_none() {
            return Err(oauth("invalid_request", BAD_AUDIENCE));
        }
        let Some(provider) = gcp.providers.iter().find(|p| p.config.name == audience) else {
            return Err(oauth("invalid_target", UNKNOWN_PROVIDER));
        };
        Trust::Provider(provider)
    };
    if params.get("requested_token_type") != Some(ACCESS_TOKEN_TYPE) {
        return Err(oauth(
            "invalid_request",
            format!("Invalid value for \"requested_token_type\". The only supported value is {ACCESS_TOKEN_TYPE}."),
        ));
    }
    match params.get("subject_token_type") {
        Some(JWT_TOKEN_TYPE | ID_TOKEN_TYPE) => {}
        _ => {
            return Err(oauth(
                "invalid_request",
                format!("Invalid value for \"subject_token_type\". An OIDC provider accepts {JWT_TOKEN_TYPE} or {ID_TOKEN_TYPE}."),
            ))
        }
    }
    let Some(subject_token) = params.get("subject_token") else {
        return Err(oauth(
            "invalid_request",
            "The \"subject_token\" parameter is required.",
        ));
    };

    let unparsable = || oauth("invalid_grant", UNPARSABLE_TOKEN);
    let header = jsonwebtoken::decode_header(subject_token).map_err(|_| unparsable())?;
    let claims: SubjectClaims =
        jsonwebtoken::dangerous::insecure_decode_claims(subject_token).map_err(|_| unparsable())?;

    // Issuer first: it decides whose keys to trust, and only the provider's.
    // Google compares it exactly; even a trailing slash makes a mismatch.
    let expected_issuer = trust.issuer();
    if claims.iss.as_deref() != Some(expected_issuer) {
        return Err(oauth(
            "invalid_grant",
            format!(
                "The issuer in ID Token {} does not match the expected one in config: {expected_issuer}.",
                claims.iss.as_deref().unwrap_or("null")
            ),
        ));
    }

    // Signature, against the keys the issuer publishes. Google accepts RSA
    // and EC P-256 keys, as Kubernetes issuers use.
    if !matches!(
        header.alg,
        jsonwebtoken::Algorithm::RS256 | jsonwebtoken::Algorithm::ES256
    ) {
        return Err(oauth("invalid_grant", BAD_SIGNATURE));
    }
    let Some(keys) = gcp.key_sets.get(expected_issuer) else {
        // Unreachable: every provider's issuer has a key set from `new`.
        return Err(oauth("invalid_grant", ISSUER_UNREACHABLE));
    };
    let key = match keys.lookup(header.kid.as_deref()).await {
        Ok(Lookup::Found(key, _)) => key,
        // Measured: an unknown kid gets the same answer as an unreachable issuer.
        Ok(Lookup::Unknown) | Err(_) => return Err(oauth("invalid_grant", ISSUER_UNREACHABLE)),
    };
    let mut validation = jsonwebtoken::Validation::new(header.alg);
    validation.validate_exp = false; // checked below with Google's skew and texts
    validation.validate_aud = false; // checked below against the provider
    validation.required_spec_claims.clear();
    if jsonwebtoken::decode::<Value>(subject_token, &key, &validation).is_err() {
        return Err(oauth("invalid_grant", BAD_SIGNATURE));
    }

    // Validity window. Google words every failure here as a stale token.
    let now = jsonwebtoken::get_current_timestamp();
    let stale = || {
        oauth(
            "invalid_grant",
            format!(
                "ID Token issued at {} is stale to sign-in.",
                claims
                    .iat
                    .map(|i| i.to_string())
                    .unwrap_or_else(|| "null".into())
            ),
        )
    };
    let (Some(iat), Some(exp)) = (claims.iat, claims.exp) else {
        return Err(stale());
    };
    if exp + SKEW_SECS < now
        || iat > now + SKEW_SECS
        || claims.nbf.is_some_and(|nbf| nbf > now + SKEW_SECS)
    {
        return Err(stale());
    }

    let audiences: Vec<&str> = claims
        .aud
        .as_ref()
        .map(|a| a.iter().collect())
        .unwrap_or_default();
    let allowed = trust.allowed_audiences();
    let allowed: Vec<&str> = allowed.iter().map(String::as_str).collect();
    if !audiences.iter().any(|a| allowed.contains(a)) {
        return Err(oauth(
            "invalid_grant",
            format!(
                "The audience in ID Token [{}] does not match the expected audience.",
                audiences.join(", ")
            ),
        ));
    }

    // google.subject = assertion.sub, the default mapping.
    let Some(subject) = claims.sub.filter(|s| !s.is_empty()) else {
        return Err(oauth(
            "invalid_request",
            "The mapped attribute google.subject must not be empty.",
        ));
    };
    if subject.len() > MAX_SUBJECT_BYTES {
        return Err(oauth("invalid_request", SUBJECT_TOO_LONG));
    }

    // Federated tokens live until the subject token expires, at most the
    // configured lifetime (Google: min(exp - now, 3600)).
    let expires_in = exp.saturating_sub(now).clamp(1, gcp.lifetime.as_secs());
    let access_token = format!("ya29.emulated-federated.{}", random_token(48));
    let principal = match trust {
        Trust::Provider(provider) => principal_for(&provider.config.name, &subject),
        // GKE's pool maps a Kubernetes service account's token to
        // ns/NAMESPACE/sa/NAME; it has no principal for any other subject.
        Trust::Gke(cluster) => match subject
            .strip_prefix("system:serviceaccount:")
            .and_then(|rest| rest.split_once(':'))
        {
            Some((namespace, name)) if !namespace.is_empty() && !name.is_empty() => {
                cluster.principal(namespace, name)
            }
            _ => {
                return Err(oauth(
                    "invalid_grant",
                    format!("The subject {subject} is not a Kubernetes service account."),
                ))
            }
        },
    };
    gcp.ledger.record(&access_token, &principal);
    gcp.remember(
        &access_token,
        Federated {
            principal,
            expires_at: now + expires_in,
        },
        now,
    );
    gcp.stats.sts_issued.fetch_add(1, Ordering::Relaxed);
    Ok((
        StatusCode::OK,
        [(header::CACHE_CONTROL, "no-store")],
        Json(json!({
            "access_token": access_token,
            "issued_token_type": ACCESS_TOKEN_TYPE,
            "token_type": "Bearer",
            "expires_in": expires_in,
        })),
    )
        .into_response())
}
