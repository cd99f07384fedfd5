//! IAM Credentials (`:generateAccessToken`, `:generateIdToken`) and the
//! ID token keys (`/oauth2/v3/certs`): impersonation allowed only by a
//! `roles/iam.workloadIdentityUser` grant, with Google's API error shape.

use super::*;

/// A Google API error: `{"error": {code, message, status[, details]}}`.
#[derive(Debug)]
pub(super) struct ApiError {
    pub(super) code: StatusCode,
    pub(super) status: &'static str,
    pub(super) message: String,
    /// The IAM permission refused, for the `ErrorInfo` detail of a 403.
    pub(super) permission: Option<&'static str>,
}

pub(super) fn api(code: StatusCode, status: &'static str, message: impl Into<String>) -> ApiError {
    ApiError {
        code,
        status,
        message: message.into(),
        permission: None,
    }
}

pub(super) fn invalid_argument(message: impl Into<String>) -> ApiError {
    api(StatusCode::BAD_REQUEST, "INVALID_ARGUMENT", message)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut error = json!({
            "code": self.code.as_u16(),
            "message": self.message,
            "status": self.status,
        });
        if let Some(permission) = self.permission {
            error["details"] = json!([{
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": "IAM_PERMISSION_DENIED",
                "domain": "iam.googleapis.com",
                "metadata": { "permission": permission },
            }]);
        }
        let body = Json(json!({ "error": error }));
        if self.code == StatusCode::UNAUTHORIZED {
            (
                self.code,
                [(
                    header::WWW_AUTHENTICATE,
                    "Bearer realm=\"https://accounts.google.com/\"",
                )],
                body,
            )
                .into_response()
        } else {
            (self.code, body).into_response()
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Method {
    GenerateAccessToken,
    GenerateIdToken,
}

impl Method {
    fn permission(self) -> &'static str {
        match self {
            Method::GenerateAccessToken => "iam.serviceAccounts.getAccessToken",
            Method::GenerateIdToken => "iam.serviceAccounts.getOpenIdToken",
        }
    }
}

/// Splits the `{name}` path segment, `EMAIL:method`, on its last colon.
pub(super) fn split_resource(name: &str) -> Option<(&str, Method)> {
    let (account, method) = name.rsplit_once(':')?;
    let method = match method {
        "generateAccessToken" => Method::GenerateAccessToken,
        "generateIdToken" => Method::GenerateIdToken,
        _ => return None,
    };
    (!account.is_empty()).then_some((account, method))
}

/// Reads the bearer token from `Authorization`.
pub(super) fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Parses a protobuf JSON `Duration` (`"3600s"`, `"1.5s"`) into whole and
/// fractional seconds.
pub(super) fn parse_duration(text: &str) -> Option<(i64, u32)> {
    let number = text.strip_suffix('s')?;
    let (negative, digits) = match number.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, number),
    };
    let (whole, fraction) = match digits.split_once('.') {
        Some((w, f)) => (w, f),
        None => (digits, ""),
    };
    if whole.is_empty()
        || !whole.bytes().all(|b| b.is_ascii_digit())
        || fraction.len() > 9
        || !fraction.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let secs: i64 = whole.parse().ok()?;
    let nanos: u32 = if fraction.is_empty() {
        0
    } else {
        format!("{fraction:0<9}").parse().ok()?
    };
    Some(if negative {
        (-secs, nanos)
    } else {
        (secs, nanos)
    })
}

/// Checks a requested service-account token lifetime the way IAM does and
/// returns it in whole seconds (a fraction rounds up, so `0.5s` lives 1 s).
pub(super) fn check_lifetime(value: Option<&Value>) -> Result<u64, ApiError> {
    let Some(value) = value else {
        return Ok(MAX_SA_LIFETIME_SECS);
    };
    let (secs, nanos) = value.as_str().and_then(parse_duration).ok_or_else(|| {
        invalid_argument(format!(
            "Invalid value at 'lifetime' (type.googleapis.com/google.protobuf.Duration), {value}"
        ))
    })?;
    if secs < 0 || (secs == 0 && nanos == 0) {
        return Err(invalid_argument(LIFETIME_ZERO));
    }
    let secs = secs.unsigned_abs();
    if secs > MAX_SA_LIFETIME_SECS || (secs == MAX_SA_LIFETIME_SECS && nanos > 0) {
        return Err(invalid_argument(LIFETIME_TOO_LONG));
    }
    Ok(if nanos > 0 { secs + 1 } else { secs })
}

/// Checks requested OAuth scopes. An empty string stands for cloud-platform
/// (as IAM does); anything that is not an OAuth scope URL or one of the
/// OpenID short names is refused.
pub(super) fn check_scopes(value: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let list = match value {
        Some(Value::Array(list)) if !list.is_empty() => list,
        Some(Value::Array(_)) | None => return Err(invalid_argument(INVALID_ARGUMENT)),
        Some(other) => {
            return Err(invalid_argument(format!(
                "Invalid value at 'scope' (type.googleapis.com/google.iam.credentials.v1.GenerateAccessTokenRequest), {other}"
            )))
        }
    };
    let mut scopes = Vec::with_capacity(list.len());
    for scope in list {
        let Some(scope) = scope.as_str() else {
            return Err(invalid_argument(INVALID_ARGUMENT));
        };
        let scope = scope.trim();
        if scope.is_empty() {
            scopes.push(CLOUD_PLATFORM_SCOPE.to_string());
        } else if (scope.starts_with("https://") && !scope.contains(char::is_whitespace))
            || matches!(scope, "openid" | "email" | "profile")
        {
            scopes.push(scope.to_string());
        } else {
            return Err(invalid_argument(INVALID_ARGUMENT));
        }
    }
    Ok(scopes)
}

/// Parses the request body as a JSON object and refuses names the method
/// does not define, as Google's JSON transcoding does.
pub(super) fn request_fields(body: &[u8], method: Method) -> Result<Map<String, Value>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    let map: Map<String, Value> = serde_json::from_slice(body)
        .map_err(|_| invalid_argument("Invalid JSON payload received. Unexpected token."))?;
    let known: &[&str] = match method {
        Method::GenerateAccessToken => &["scope", "lifetime", "delegates"],
        Method::GenerateIdToken => &[
            "audience",
            "includeEmail",
            "include_email",
            "organizationNumberIncluded",
            "organization_number_included",
            "delegates",
        ],
    };
    if let Some(unknown) = map.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(invalid_argument(format!(
            "Invalid JSON payload received. Unknown name \"{unknown}\": Cannot find field."
        )));
    }
    if map
        .get("delegates")
        .is_some_and(|d| d.as_array().is_none_or(|a| !a.is_empty()))
    {
        return Err(invalid_argument(
            "Delegation chains are not supported by the emulator; impersonate the service account directly.",
        ));
    }
    Ok(map)
}

pub(super) fn rfc3339(unix: u64) -> String {
    i64::try_from(unix)
        .ok()
        .and_then(|t| time::OffsetDateTime::from_unix_timestamp(t).ok())
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| unix.to_string())
}

#[derive(serde::Serialize)]
pub(super) struct IdTokenClaims<'a> {
    iss: &'static str,
    aud: &'a str,
    azp: &'a str,
    sub: &'a str,
    iat: u64,
    exp: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    email: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    email_verified: Option<bool>,
    /// `{"organization_number": null}` when the caller asked for it: the
    /// emulator's service accounts belong to no organization, for which
    /// the reference gives `null` (generateIdToken,
    /// `organizationNumberIncluded`).
    #[serde(skip_serializing_if = "Option::is_none")]
    google: Option<Value>,
}

pub(super) async fn iam_credentials(
    State(gcp): State<Arc<Gcp>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    gcp.stats.iam_requests.fetch_add(1, Ordering::Relaxed);
    match impersonate(&gcp, &name, &headers, &body) {
        Ok(resp) => {
            gcp.stats.iam_issued.fetch_add(1, Ordering::Relaxed);
            resp
        }
        Err(e) => e.into_response(),
    }
}

pub(super) fn impersonate(
    gcp: &Gcp,
    name: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let Some((account, method)) = split_resource(name) else {
        return Err(api(StatusCode::NOT_FOUND, "NOT_FOUND", "Method not found."));
    };
    let now = jsonwebtoken::get_current_timestamp();

    let Some(token) = bearer(headers) else {
        return Err(api(
            StatusCode::UNAUTHORIZED,
            "UNAUTHENTICATED",
            UNAUTHENTICATED_MISSING,
        ));
    };
    let Some(principal) = gcp.federated_principal(token) else {
        return Err(api(
            StatusCode::UNAUTHORIZED,
            "UNAUTHENTICATED",
            UNAUTHENTICATED_INVALID,
        ));
    };

    let fields = request_fields(body, method)?;

    let Some(sa) = gcp
        .service_accounts
        .iter()
        .find(|sa| sa.email.eq_ignore_ascii_case(account) || sa.unique_id == account)
    else {
        // Google's 404 for an account that does not exist (seen through the
        // GKE metadata server: "IAM returned 404 Not Found: Not found; …").
        return Err(api(
            StatusCode::NOT_FOUND,
            "NOT_FOUND",
            format!("Not found; Gaia id not found for email {account}"),
        ));
    };

    if !sa.members.iter().any(|m| member_covers(m, &principal)) {
        return Err(ApiError {
            code: StatusCode::FORBIDDEN,
            status: "PERMISSION_DENIED",
            message: format!(
                "Permission '{}' denied on resource (or it may not exist).",
                method.permission()
            ),
            permission: Some(method.permission()),
        });
    }

    let cap = gcp.lifetime.as_secs();
    match method {
        Method::GenerateAccessToken => {
            check_scopes(fields.get("scope"))?;
            let lifetime = check_lifetime(fields.get("lifetime"))?.min(cap);
            let access_token = format!("ya29.emulated-sa.{}", random_token(48));
            gcp.ledger.record(&access_token, &sa.email);
            Ok((
                StatusCode::OK,
                Json(json!({
                    "accessToken": access_token,
                    "expireTime": rfc3339(now + lifetime),
                })),
            )
                .into_response())
        }
        Method::GenerateIdToken => {
            let audience = match fields.get("audience") {
                Some(Value::String(a)) if !a.trim().is_empty() => a.as_str(),
                _ => return Err(invalid_argument(INVALID_ARGUMENT)),
            };
            let include_email = boolean(&fields, "includeEmail", "include_email")?;
            let organization = boolean(
                &fields,
                "organizationNumberIncluded",
                "organization_number_included",
            )?;
            let claims = IdTokenClaims {
                iss: ID_TOKEN_ISSUER,
                aud: audience,
                azp: &sa.unique_id,
                sub: &sa.unique_id,
                iat: now,
                exp: now + MAX_SA_LIFETIME_SECS.min(cap),
                email: include_email.then_some(sa.email.as_str()),
                email_verified: include_email.then_some(true),
                google: organization.then(|| json!({ "organization_number": null })),
            };
            let token = gcp.signing_key.sign(&claims).map_err(|_| {
                api(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "INTERNAL",
                    "Internal error encountered.",
                )
            })?;
            gcp.ledger
                .record(&token, &format!("{} (id token)", sa.email));
            Ok((StatusCode::OK, Json(json!({ "token": token }))).into_response())
        }
    }
}

/// A boolean field under its JSON or proto name, refused as Google's
/// transcoding refuses another type.
fn boolean(fields: &Map<String, Value>, json: &str, proto: &str) -> Result<bool, ApiError> {
    match fields.get(json).or_else(|| fields.get(proto)) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(invalid_argument(format!(
            "Invalid value at '{proto}' (TYPE_BOOL), {other}"
        ))),
    }
}

pub(super) async fn certs(State(gcp): State<Arc<Gcp>>) -> Response {
    (
        [(header::CACHE_CONTROL, "public, max-age=3600")],
        Json(gcp.jwks()),
    )
        .into_response()
}
