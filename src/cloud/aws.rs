//! AWS: `sts:AssumeRoleWithWebIdentity` with the pod's projected token.
//!
//! An unsigned `POST /` of the query-protocol form to the (regional) STS
//! endpoint; the answer is XML. Written on reqwest rather than the AWS SDK:
//! we need the raw STS error code to classify failures for caching, a
//! per-request role and session name, and plain-HTTP endpoints for the
//! emulator, and the SDK's credential chain would go looking for
//! credentials this call does not need.

use std::fmt;
use std::time::Duration;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::{
    fetcher, now_unix, retry_after, Cloud, CloudError, CloudExchanger, Credential, Fetcher,
    Identity, Kind, RequestError, Selector, TokenRequest,
};
use crate::directory::Bindings;
use crate::secret::{ExposeSecret, SecretString};
use crate::token::Caller;

const STS_VERSION: &str = "2011-06-15";

/// Longest error message kept from STS; longer ones are cut so that a
/// misbehaving endpoint cannot flood logs and audit records.
const MAX_MESSAGE: usize = 1024;

/// STS codes that mean "slow down".
const THROTTLE_CODES: [&str; 5] = [
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestLimitExceeded",
    "TooManyRequestsException",
];

/// STS codes that mean the service (or the identity provider it consults)
/// failed, not that the request is wrong.
const UNAVAILABLE_CODES: [&str; 5] = [
    "IDPCommunicationError",
    "InternalFailure",
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
];

/// The message STS gives, under `InvalidIdentityToken`, when it could not
/// fetch the issuer's JWKS. That is a transient failure between STS and the
/// issuer (the AWS SDKs retry it), not a verdict on the token.
const KEY_RETRIEVAL_PREFIX: &str = "Couldn't retrieve verification key";

/// Session credentials from STS.
#[derive(Clone)]
pub struct AwsCredentials {
    pub access_key_id: String,
    pub secret_access_key: SecretString,
    pub session_token: SecretString,
    /// Unix seconds, from STS's `Expiration`.
    pub expires_at: u64,
    /// Unix seconds, when the request was sent (for refresh-ahead).
    pub issued_at: u64,
    /// The account of the role, from the role ARN.
    pub account_id: String,
    /// `arn:aws:sts::ACCOUNT:assumed-role/ROLE/SESSION`.
    pub assumed_role_arn: String,
}

/// Written by hand so that neither the secret key nor the session token can
/// reach a log through `{:?}`, whatever `SecretString` prints.
impl fmt::Debug for AwsCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AwsCredentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"[redacted]")
            .field("session_token", &"[redacted]")
            .field("expires_at", &self.expires_at)
            .field("issued_at", &self.issued_at)
            .field("account_id", &self.account_id)
            .field("assumed_role_arn", &self.assumed_role_arn)
            .finish()
    }
}

/// The STS exchanger.
#[derive(Clone)]
pub struct AwsExchanger {
    http: reqwest::Client,
    endpoint: String,
}

impl AwsExchanger {
    pub fn new(http: reqwest::Client, endpoint: impl Into<String>) -> Self {
        AwsExchanger {
            http,
            endpoint: endpoint.into().trim_end_matches('/').to_string(),
        }
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The regional STS endpoint, `https://sts.{region}.amazonaws.com`
    /// (`.amazonaws.com.cn` in the China regions). Regional rather than the
    /// global `sts.amazonaws.com`: it stays up when us-east-1 does not, keeps
    /// latency local, and is what the SDKs now default to. The region is
    /// assumed to have been validated by configuration.
    pub fn regional_endpoint(region: &str) -> String {
        let region = region.trim().to_ascii_lowercase();
        let suffix = if region.starts_with("cn-") {
            "amazonaws.com.cn"
        } else {
            "amazonaws.com"
        };
        format!("https://sts.{region}.{suffix}")
    }

    /// The `RoleSessionName` for a service account. It shows in CloudTrail
    /// and in the assumed-role ARN, so it says who asked:
    /// `lanyard-{namespace}_{service_account}`.
    ///
    /// The `_` separator cannot occur in a namespace (a DNS label), so for
    /// valid Kubernetes names the mapping is one-to-one (`-` would make
    /// `a-b`/`c` and `a`/`b-c` collide). When the inputs are not valid
    /// Kubernetes names, or the result would exceed STS's 64 characters, the
    /// name is sanitised to `[\w+=,.@-]`, cut, and ends in `+` and 12 hex
    /// digits of a SHA-256 of both inputs: `+` never occurs in the plain
    /// form, so the two forms cannot collide, and the hash keeps distinct
    /// inputs distinct.
    pub fn session_name(namespace: &str, service_account: &str) -> String {
        const MAX: usize = 64;
        const HASH_HEX: usize = 12;
        let label = |s: &str| {
            !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        };
        let subdomain = |s: &str| {
            !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        };
        let plain = format!("lanyard-{namespace}_{service_account}");
        if label(namespace) && subdomain(service_account) && plain.len() <= MAX {
            return plain;
        }
        let mut hasher = Sha256::new();
        hasher.update(namespace.as_bytes());
        hasher.update([0u8]); // unambiguous boundary between the two inputs
        hasher.update(service_account.as_bytes());
        let digest = hasher.finalize();
        let hash: String = digest
            .iter()
            .take(HASH_HEX / 2)
            .map(|b| format!("{b:02x}"))
            .collect();
        let mut name: String = plain
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '_' | '=' | ',' | '.' | '@' | '-') {
                    c
                } else {
                    '-'
                }
            })
            .take(MAX - HASH_HEX - 1)
            .collect();
        name.push('+');
        name.push_str(&hash);
        name
    }

    /// Exchanges `token` for session credentials of `role_arn`.
    ///
    /// `duration` is sent as is: STS enforces 900–43200 s and the role's
    /// `MaxSessionDuration`, and its `ValidationError` says which bound was
    /// crossed better than a local check could.
    pub async fn assume_role_with_web_identity(
        &self,
        role_arn: &str,
        session_name: &str,
        token: &SecretString,
        duration: Duration,
    ) -> Result<AwsCredentials, CloudError> {
        let Some(account_id) = account_of(role_arn) else {
            return Err(CloudError::Rejected {
                cloud: Cloud::Aws,
                code: "InvalidRoleArn".into(),
                message: format!(
                    "{role_arn} is not an IAM role ARN (arn:PARTITION:iam::ACCOUNT:role/NAME)"
                ),
            });
        };
        let seconds = duration.as_secs().to_string();
        let form = [
            ("Action", "AssumeRoleWithWebIdentity"),
            ("Version", STS_VERSION),
            ("RoleArn", role_arn),
            ("RoleSessionName", session_name),
            ("WebIdentityToken", token.expose_secret()),
            ("DurationSeconds", seconds.as_str()),
        ];
        let issued_at = now_unix();
        let url = format!("{}/", self.endpoint);
        let resp = self
            .http
            .post(&url)
            .header("accept", "text/xml")
            .form(&form)
            .send()
            .await
            .map_err(|e| CloudError::Unavailable {
                cloud: Cloud::Aws,
                reason: e.without_url().to_string(),
            })?;
        let status = resp.status();
        let retry = retry_after(resp.headers());
        let body = resp.bytes().await.map_err(|e| CloudError::Unavailable {
            cloud: Cloud::Aws,
            reason: e.without_url().to_string(),
        })?;

        if status.is_success() {
            let ok = parse_success(&body).map_err(|reason| CloudError::Protocol {
                cloud: Cloud::Aws,
                reason,
            })?;
            if ok.expires_at <= issued_at {
                return Err(CloudError::Protocol {
                    cloud: Cloud::Aws,
                    reason: "STS returned credentials that have already expired".into(),
                });
            }
            let assumed_role_arn = ok
                .assumed_role_arn
                .unwrap_or_else(|| assumed_role_arn(role_arn, session_name));
            return Ok(AwsCredentials {
                access_key_id: ok.access_key_id,
                secret_access_key: ok.secret_access_key,
                session_token: ok.session_token,
                expires_at: ok.expires_at,
                issued_at,
                account_id: account_id.to_string(),
                assumed_role_arn,
            });
        }
        Err(classify(
            status.as_u16(),
            retry,
            &body,
            token.expose_secret(),
        ))
    }
}

/// The AWS side of the broker: the STS exchanger, the audience callers'
/// tokens carry, and the session duration asked of STS.
#[derive(Clone)]
pub struct AwsCloud {
    pub exchanger: AwsExchanger,
    /// Audience callers' projected tokens must carry for AWS.
    pub audience: String,
    /// `DurationSeconds` asked of STS (and the most a caller may ask).
    pub session_duration: Duration,
}

/// STS's shortest session.
const MIN_SESSION: Duration = Duration::from_secs(900);

impl AwsCloud {
    fn duration(&self, request: &TokenRequest) -> Duration {
        request.lifetime.map_or(self.session_duration, |l| {
            l.clamp(MIN_SESSION, self.session_duration.max(MIN_SESSION))
        })
    }
}

impl CloudExchanger for AwsCloud {
    /// The role ARN.
    type Binding = String;

    fn cloud(&self) -> Cloud {
        Cloud::Aws
    }

    fn audience(&self) -> &str {
        &self.audience
    }

    fn kinds(&self) -> &'static [Kind] {
        &[Kind::AwsCredentials]
    }

    fn bind(&self, bindings: &Bindings, _: &Caller) -> Result<String, RequestError> {
        bindings.aws_role_arn.clone().ok_or(RequestError::NotBound)
    }

    fn identity(&self, role_arn: &String) -> Identity {
        Identity {
            cloud: Cloud::Aws,
            id: role_arn.clone(),
            account: account_of(role_arn).unwrap_or_default().to_string(),
            account_number: None,
        }
    }

    fn selects(&self, role_arn: &String, selector: &Selector) -> bool {
        matches!(selector, Selector::RoleName(name) if role_arn.rsplit('/').next() == Some(name.as_str()))
    }

    fn scope(&self, _: &String, request: &TokenRequest) -> Result<String, RequestError> {
        Ok(format!(
            "sts:AssumeRoleWithWebIdentity {}",
            self.duration(request).as_secs()
        ))
    }

    fn fetcher(&self, role_arn: &String, request: &TokenRequest, caller: &Caller) -> Fetcher {
        let params = (
            self.exchanger.clone(),
            AwsExchanger::session_name(&caller.namespace, &caller.service_account),
            role_arn.clone(),
            self.duration(request),
        );
        fetcher(params, |p, subject| async move {
            let (exchanger, session, role_arn, duration) = &*p;
            let credentials = exchanger
                .assume_role_with_web_identity(role_arn, session, &subject, *duration)
                .await?;
            Ok(Credential::Aws(credentials))
        })
    }
}

/// The account id of `arn:PARTITION:iam::ACCOUNT:role/NAME`.
fn account_of(role_arn: &str) -> Option<&str> {
    let mut parts = role_arn.splitn(6, ':');
    match (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) {
        (Some("arn"), Some(partition), Some("iam"), Some(""), Some(account), Some(resource))
            if partition.starts_with("aws")
                && account.len() == 12
                && account.bytes().all(|b| b.is_ascii_digit())
                && resource
                    .strip_prefix("role/")
                    .is_some_and(|r| !r.is_empty() && !r.ends_with('/')) =>
        {
            Some(account)
        }
        _ => None,
    }
}

/// The assumed-role ARN STS would report, for answers that omit it.
fn assumed_role_arn(role_arn: &str, session_name: &str) -> String {
    let mut parts = role_arn.splitn(6, ':');
    let partition = parts.nth(1).unwrap_or("aws");
    let account = account_of(role_arn).unwrap_or_default();
    let name = role_arn.rsplit('/').next().unwrap_or_default();
    format!("arn:{partition}:sts::{account}:assumed-role/{name}/{session_name}")
}

#[derive(Deserialize)]
struct SuccessXml {
    #[serde(rename = "AssumeRoleWithWebIdentityResult")]
    result: Option<ResultXml>,
}

#[derive(Deserialize)]
struct ResultXml {
    #[serde(rename = "Credentials")]
    credentials: Option<CredentialsXml>,
    #[serde(rename = "AssumedRoleUser")]
    assumed_role_user: Option<AssumedRoleUserXml>,
}

#[derive(Deserialize)]
struct CredentialsXml {
    #[serde(rename = "AccessKeyId")]
    access_key_id: Option<String>,
    #[serde(rename = "SecretAccessKey")]
    secret_access_key: Option<String>,
    #[serde(rename = "SessionToken")]
    session_token: Option<String>,
    #[serde(rename = "Expiration")]
    expiration: Option<String>,
}

#[derive(Deserialize)]
struct AssumedRoleUserXml {
    #[serde(rename = "Arn")]
    arn: Option<String>,
}

/// What a success answer yields.
struct Parsed {
    access_key_id: String,
    secret_access_key: SecretString,
    session_token: SecretString,
    expires_at: u64,
    assumed_role_arn: Option<String>,
}

/// Parses STS's success XML. Failure reasons name the missing element but
/// never quote the body: it holds secrets.
fn parse_success(body: &[u8]) -> Result<Parsed, String> {
    let text = std::str::from_utf8(body).map_err(|_| "response is not UTF-8".to_string())?;
    let doc: SuccessXml = quick_xml::de::from_str(text)
        .map_err(|_| "response is not an AssumeRoleWithWebIdentityResponse document".to_string())?;
    let result = doc
        .result
        .ok_or("response has no AssumeRoleWithWebIdentityResult")?;
    let creds = result.credentials.ok_or("response has no Credentials")?;
    let non_empty = |v: Option<String>, name: &str| {
        v.map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .ok_or_else(|| format!("response has no Credentials/{name}"))
    };
    let access_key_id = non_empty(creds.access_key_id, "AccessKeyId")?;
    let secret_access_key =
        SecretString::from(non_empty(creds.secret_access_key, "SecretAccessKey")?);
    let session_token = SecretString::from(non_empty(creds.session_token, "SessionToken")?);
    let expiration = non_empty(creds.expiration, "Expiration")?;
    let expires_at = parse_iso8601(&expiration).ok_or_else(|| {
        format!("Credentials/Expiration {expiration:?} is not an ISO 8601 UTC time")
    })?;
    Ok(Parsed {
        access_key_id,
        secret_access_key,
        session_token,
        expires_at,
        assumed_role_arn: result
            .assumed_role_user
            .and_then(|u| u.arn)
            .map(|a| a.trim().to_string())
            .filter(|a| !a.is_empty()),
    })
}

#[derive(Deserialize)]
struct ErrorResponseXml {
    #[serde(rename = "Error")]
    error: Option<ErrorXml>,
}

#[derive(Deserialize)]
struct ErrorXml {
    #[serde(rename = "Code")]
    code: Option<String>,
    #[serde(rename = "Message")]
    message: Option<String>,
}

/// Code and message of an STS `ErrorResponse`.
fn parse_error(body: &[u8]) -> Option<(String, String)> {
    let text = std::str::from_utf8(body).ok()?;
    let doc: ErrorResponseXml = quick_xml::de::from_str(text).ok()?;
    let error = doc.error?;
    let code = error
        .code
        .map(|c| c.trim().to_string())
        .filter(|c| !c.is_empty())?;
    Some((code, error.message.unwrap_or_default().trim().to_string()))
}

/// Maps a non-success answer to a [`CloudError`]: throttling and service
/// failures are retryable, refusals of the token or the role are not. The
/// subject token is scrubbed from the message in case an endpoint echoes it.
fn classify(status: u16, retry: Option<Duration>, body: &[u8], token: &str) -> CloudError {
    let parsed = parse_error(body).map(|(code, message)| {
        let mut message = if token.len() >= 4 {
            message.replace(token, "[redacted]")
        } else {
            message
        };
        if message.len() > MAX_MESSAGE {
            let mut cut = MAX_MESSAGE;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push('…');
        }
        (code, message)
    });
    let code = parsed.as_ref().map(|(c, _)| c.as_str());

    if status == 429 || code.is_some_and(|c| THROTTLE_CODES.contains(&c)) {
        return CloudError::Throttled {
            cloud: Cloud::Aws,
            code: code.unwrap_or("HTTP429").to_string(),
            retry_after: retry,
        };
    }
    match parsed {
        Some((code, message))
            if status >= 500
                || UNAVAILABLE_CODES.contains(&code.as_str())
                || (code == "InvalidIdentityToken"
                    && message.starts_with(KEY_RETRIEVAL_PREFIX)) =>
        {
            CloudError::Unavailable {
                cloud: Cloud::Aws,
                reason: format!("HTTP {status}: {code}: {message}"),
            }
        }
        Some((code, message)) => CloudError::Rejected {
            cloud: Cloud::Aws,
            code,
            message,
        },
        None if status >= 500 => CloudError::Unavailable {
            cloud: Cloud::Aws,
            reason: format!("HTTP {status}"),
        },
        None => CloudError::Protocol {
            cloud: Cloud::Aws,
            reason: format!("HTTP {status} without an STS ErrorResponse"),
        },
    }
}

/// Parses `YYYY-MM-DDTHH:MM:SS[.fff](Z|+00:00)` to Unix seconds. STS always
/// answers in UTC with `Z`; other offsets are refused rather than guessed.
fn parse_iso8601(s: &str) -> Option<u64> {
    let s = s.trim();
    let rest = s.strip_suffix('Z').or_else(|| s.strip_suffix("+00:00"))?;
    let (date, time_part) = rest.split_once('T')?;
    let time_part = time_part.split_once('.').map_or(time_part, |(t, frac)| {
        if frac.bytes().all(|b| b.is_ascii_digit()) {
            t
        } else {
            ""
        }
    });
    let num = |s: &str, len: usize| -> Option<u32> {
        (s.len() == len && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse().ok())
            .flatten()
    };
    let mut d = date.split('-');
    let (year, month, day) = (num(d.next()?, 4)?, num(d.next()?, 2)?, num(d.next()?, 2)?);
    let mut t = time_part.split(':');
    let (hour, minute, second) = (num(t.next()?, 2)?, num(t.next()?, 2)?, num(t.next()?, 2)?);
    if d.next().is_some() || t.next().is_some() {
        return None;
    }
    let month = time::Month::try_from(u8::try_from(month).ok()?).ok()?;
    let date =
        time::Date::from_calendar_date(i32::try_from(year).ok()?, month, u8::try_from(day).ok()?)
            .ok()?;
    let time = time::Time::from_hms(
        u8::try_from(hour).ok()?,
        u8::try_from(minute).ok()?,
        u8::try_from(second).ok()?,
    )
    .ok()?;
    u64::try_from(
        time::PrimitiveDateTime::new(date, time)
            .assume_utc()
            .unix_timestamp(),
    )
    .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape STS answers with (element order and whitespace as AWS
    /// sends them), values made up.
    const SUCCESS: &str = r#"<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">
  <AssumeRoleWithWebIdentityResult>
    <Audience>sts.amazonaws.com</Audience>
    <AssumedRoleUser>
      <AssumedRoleId>AROA3XFRBF535PLBIFPI4:lanyard-ml_ray</AssumedRoleId>
      <Arn>arn:aws:sts::123456789012:assumed-role/ray-data/lanyard-ml_ray</Arn>
    </AssumedRoleUser>
    <Provider>arn:aws:iam::123456789012:oidc-provider/oidc.eks.us-west-2.amazonaws.com/id/ABC</Provider>
    <Credentials>
      <AccessKeyId>ASIAQX5EXAMPLE7KEYID</AccessKeyId>
      <SecretAccessKey>wJalrXUtnFEMI/K7MDENG/bPxRfiCY+EXAMPLEKEY</SecretAccessKey>
      <SessionToken>IQoJb3JpZ2luX2VjE&amp;+/=</SessionToken>
      <Expiration>2026-12-02T11:00:00Z</Expiration>
    </Credentials>
    <SubjectFromWebIdentityToken>system:serviceaccount:ml:ray</SubjectFromWebIdentityToken>
  </AssumeRoleWithWebIdentityResult>
  <ResponseMetadata>
    <RequestId>c6104cbe-af31-11e0-8154-cbc7ccf896c7</RequestId>
  </ResponseMetadata>
</AssumeRoleWithWebIdentityResponse>
"#;

    #[test]
    fn aws_parses_the_success_xml() {
        let p = parse_success(SUCCESS.as_bytes()).unwrap();
        assert_eq!(p.access_key_id, "ASIAQX5EXAMPLE7KEYID");
        assert_eq!(
            p.secret_access_key.expose_secret(),
            "wJalrXUtnFEMI/K7MDENG/bPxRfiCY+EXAMPLEKEY"
        );
        assert_eq!(p.session_token.expose_secret(), "IQoJb3JpZ2luX2VjE&+/=");
        assert_eq!(p.expires_at, 1_796_209_200);
        assert_eq!(
            p.assumed_role_arn.as_deref(),
            Some("arn:aws:sts::123456789012:assumed-role/ray-data/lanyard-ml_ray")
        );
    }

    #[test]
    fn aws_incomplete_success_is_a_protocol_error_that_quotes_nothing() {
        let cut = SUCCESS.replace("<SessionToken>IQoJb3JpZ2luX2VjE&amp;+/=</SessionToken>", "");
        let reason = parse_success(cut.as_bytes()).err().unwrap();
        assert_eq!(reason, "response has no Credentials/SessionToken");

        let truncated = &SUCCESS[..SUCCESS.find("</SecretAccessKey>").unwrap()];
        let reason = parse_success(truncated.as_bytes()).err().unwrap();
        assert!(!reason.contains("wJalr"), "{reason}");

        let bad_time = SUCCESS.replace("2026-12-02T11:00:00Z", "tomorrow");
        assert!(parse_success(bad_time.as_bytes()).is_err());
        assert!(parse_success(b"not xml at all <").is_err());
        assert!(parse_success(b"{\"json\": true}").is_err());
    }

    #[test]
    fn aws_parses_the_error_xml() {
        let body = r#"<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">
  <Error>
    <Type>Sender</Type>
    <Code>InvalidIdentityToken</Code>
    <Message>No OpenIDConnect provider found in your account for https://a.example/&lt;x&gt;</Message>
  </Error>
  <RequestId>3714365f-c50b-4cae-b958-917eb6a34b50</RequestId>
</ErrorResponse>"#;
        assert_eq!(
            parse_error(body.as_bytes()),
            Some((
                "InvalidIdentityToken".to_string(),
                "No OpenIDConnect provider found in your account for https://a.example/<x>"
                    .to_string()
            ))
        );
        assert_eq!(
            parse_error(b"<ErrorResponse><Error><Message>m</Message></Error></ErrorResponse>"),
            None
        );
        assert_eq!(parse_error(b"Bad Gateway"), None);
    }

    fn error_body(code: &str, message: &str) -> Vec<u8> {
        format!(
            "<ErrorResponse xmlns=\"https://sts.amazonaws.com/doc/2011-06-15/\"><Error><Type>Sender</Type><Code>{code}</Code><Message>{message}</Message></Error><RequestId>r</RequestId></ErrorResponse>"
        )
        .into_bytes()
    }

    #[test]
    fn aws_error_classification() {
        let tok = "eyJhbGciOiJSUzI1NiJ9.payload.signature";
        let rejected =
            |status, code: &str| match classify(status, None, &error_body(code, "m"), tok) {
                CloudError::Rejected { code: c, .. } => c,
                other => panic!("{code}: expected Rejected, got {other:?}"),
            };
        for code in [
            "InvalidIdentityToken",
            "ExpiredTokenException",
            "IDPRejectedClaim",
            "ValidationError",
            "RegionDisabledException",
        ] {
            assert_eq!(rejected(400, code), code);
        }
        assert_eq!(rejected(403, "AccessDenied"), "AccessDenied");

        match classify(400, None, &error_body("Throttling", "Rate exceeded"), tok) {
            CloudError::Throttled {
                code, retry_after, ..
            } => {
                assert_eq!(code, "Throttling");
                assert_eq!(retry_after, None);
            }
            other => panic!("{other:?}"),
        }
        match classify(429, Some(Duration::from_secs(7)), b"", tok) {
            CloudError::Throttled {
                code, retry_after, ..
            } => {
                assert_eq!(code, "HTTP429");
                assert_eq!(retry_after, Some(Duration::from_secs(7)));
            }
            other => panic!("{other:?}"),
        }
        for (status, body) in [
            (400, error_body("IDPCommunicationError", "timeout")),
            (500, error_body("InternalFailure", "oops")),
            (503, b"<html>Service Unavailable</html>".to_vec()),
            (
                400,
                error_body(
                    "InvalidIdentityToken",
                    "Couldn't retrieve verification key from your identity provider,  please reference AssumeRoleWithWebIdentity documentation for requirements",
                ),
            ),
        ] {
            assert!(
                matches!(classify(status, None, &body, tok), CloudError::Unavailable { .. }),
                "{status} {}",
                String::from_utf8_lossy(&body)
            );
        }
        assert!(matches!(
            classify(400, None, b"<html>nope</html>", tok),
            CloudError::Protocol { .. }
        ));
    }

    #[test]
    fn aws_error_messages_never_carry_the_token() {
        let tok = "eyJhbGciOiJSUzI1NiJ9.payload.signature";
        let err = classify(
            400,
            None,
            &error_body("InvalidIdentityToken", &format!("bad {tok}")),
            tok,
        );
        assert!(!err.to_string().contains(tok));
        assert!(!format!("{err:?}").contains(tok));
        assert!(err.to_string().contains("[redacted]"));
    }

    #[test]
    fn aws_long_messages_are_cut() {
        let long = "é".repeat(2000);
        match classify(400, None, &error_body("ValidationError", &long), "tok.en") {
            CloudError::Rejected { message, .. } => assert!(message.len() <= MAX_MESSAGE + 3),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn aws_iso8601() {
        assert_eq!(parse_iso8601("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_iso8601("2026-12-02T11:00:00Z"), Some(1_796_209_200));
        assert_eq!(
            parse_iso8601("2026-12-02T11:00:00.123Z"),
            Some(1_796_209_200)
        );
        assert_eq!(
            parse_iso8601("2026-12-02T11:00:00+00:00"),
            Some(1_796_209_200)
        );
        assert_eq!(parse_iso8601("2026-12-02T11:00:00+01:00"), None);
        assert_eq!(parse_iso8601("2026-13-02T11:00:00Z"), None);
        assert_eq!(parse_iso8601("2026-12-02 11:00:00Z"), None);
        assert_eq!(parse_iso8601("2026-12-02T11:00Z"), None);
        assert_eq!(parse_iso8601("2026-12-02T11:00:00.x1Z"), None);
    }

    #[test]
    fn aws_regional_endpoints() {
        assert_eq!(
            AwsExchanger::regional_endpoint("us-west-2"),
            "https://sts.us-west-2.amazonaws.com"
        );
        assert_eq!(
            AwsExchanger::regional_endpoint("cn-northwest-1"),
            "https://sts.cn-northwest-1.amazonaws.com.cn"
        );
        assert_eq!(
            AwsExchanger::regional_endpoint("us-gov-west-1"),
            "https://sts.us-gov-west-1.amazonaws.com"
        );
    }

    fn allowed(c: char) -> bool {
        c.is_ascii_alphanumeric() || matches!(c, '_' | '+' | '=' | ',' | '.' | '@' | '-')
    }

    #[test]
    fn aws_session_names_plain() {
        assert_eq!(
            AwsExchanger::session_name("default", "ray-worker"),
            "lanyard-default_ray-worker"
        );
        // The separator keeps hyphenated names apart.
        assert_ne!(
            AwsExchanger::session_name("a-b", "c"),
            AwsExchanger::session_name("a", "b-c")
        );
    }

    #[test]
    fn aws_session_names_long_or_odd() {
        let ns = "n".repeat(63);
        let a = AwsExchanger::session_name(&ns, &format!("{}-a", "s".repeat(200)));
        let b = AwsExchanger::session_name(&ns, &format!("{}-b", "s".repeat(200)));
        for name in [&a, &b] {
            assert_eq!(name.len(), 64, "{name}");
            assert!(name.chars().all(allowed), "{name}");
            assert!(name.starts_with("lanyard-nnn"));
            assert!(name.contains('+'));
        }
        assert_ne!(a, b);
        assert_eq!(
            a,
            AwsExchanger::session_name(&ns, &format!("{}-a", "s".repeat(200)))
        );

        // Characters STS refuses are replaced, and the hash keeps the
        // inputs that sanitise alike apart.
        let odd1 = AwsExchanger::session_name("team a", "sa/1");
        let odd2 = AwsExchanger::session_name("team-a", "sa-1+");
        assert!(odd1.chars().all(allowed), "{odd1}");
        assert!(odd1.len() <= 64 && odd1.len() >= 2);
        assert_ne!(odd1, odd2);
        assert_ne!(odd1, AwsExchanger::session_name("team-a", "sa-1"));
        // The boundary between the inputs is part of the hash.
        assert_ne!(
            AwsExchanger::session_name("ab ", "c"),
            AwsExchanger::session_name("a", "b c")
        );
    }

    #[test]
    fn aws_role_arn_account() {
        assert_eq!(
            account_of("arn:aws:iam::123456789012:role/ray-data"),
            Some("123456789012")
        );
        assert_eq!(
            account_of("arn:aws-cn:iam::123456789012:role/p/ray"),
            Some("123456789012")
        );
        assert_eq!(account_of("arn:aws:iam::123456789012:user/x"), None);
        assert_eq!(account_of("arn:aws:iam::1234:role/x"), None);
        assert_eq!(account_of("ray-data"), None);
        assert_eq!(
            assumed_role_arn("arn:aws-us-gov:iam::123456789012:role/p/ray", "s1"),
            "arn:aws-us-gov:sts::123456789012:assumed-role/ray/s1"
        );
    }

    #[test]
    fn aws_credentials_debug_hides_secrets() {
        let c = AwsCredentials {
            access_key_id: "ASIAEXAMPLE".into(),
            secret_access_key: SecretString::from("very-secret-key".to_string()),
            session_token: SecretString::from("very-secret-token".to_string()),
            expires_at: 1,
            issued_at: 0,
            account_id: "123456789012".into(),
            assumed_role_arn: "arn".into(),
        };
        let shown = format!("{c:?}");
        assert!(shown.contains("ASIAEXAMPLE"));
        assert!(!shown.contains("very-secret"));
    }
}
