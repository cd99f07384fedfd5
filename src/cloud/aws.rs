//! AWS: `sts:AssumeRoleWithWebIdentity` with the pod's projected token.
//!
//! An unsigned `POST /` of the query-protocol form to the (regional) STS
//! endpoint; the answer is XML. A ServiceAccount may chain on into a
//! target role (EKS Pod Identity's target role, often in another account):
//! a SigV4-signed `sts:AssumeRole` with the first session's credentials,
//! carrying EKS's session tags, an external id and a session policy. Written on reqwest rather than the AWS SDK:
//! we need the raw STS error code to classify failures for caching, a
//! per-request role and session name, and plain-HTTP endpoints for the
//! emulator, and the SDK's credential chain would go looking for
//! credentials this call does not need.
//!
//! The model (annotations, `Binding`, `Chain`, `RoleArn`, `Region`,
//! `AwsCredentials`) is `lanyard_core::cloud::aws`, re-exported here;
//! this module is the exchanger and its settings.

use std::time::Duration;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::{check_endpoint, invalid, Bindings, Invalid};
use super::{
    fetcher, scrub_message, Cloud, CloudError, CloudExchanger, Credential, Fetcher, Identity, Kind,
    RequestError, Selector, TokenRequest,
};
use crate::names::{is_dns_label, is_dns_subdomain};
use crate::secret::{ExposeSecret, SecretString};
use crate::token::Caller;

const STS_VERSION: &str = "2011-06-15";

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

pub use lanyard_core::cloud::aws::{
    annotations, bindings, session_name_char, AwsCredentials, AwsNameError, Binding, Chain, Region,
    RoleArn, DEFAULT_REGION,
};

mod chain;
pub mod trust;
use chain::MAX_CHAINED_SESSION;
pub use chain::{session_tags, AssumeRoleOptions};

/// The STS exchanger.
#[derive(Clone)]
pub struct AwsExchanger {
    http: reqwest::Client,
    endpoint: String,
}

impl AwsExchanger {
    /// An exchanger calling STS at `endpoint` (a base URL such as
    /// [`AwsExchanger::regional_endpoint`] gives; a trailing `/` is dropped).
    pub fn new(http: reqwest::Client, endpoint: impl Into<String>) -> Self {
        AwsExchanger {
            http,
            endpoint: endpoint.into().trim_end_matches('/').to_string(),
        }
    }

    /// The STS base URL this exchanger calls, without a trailing `/`.
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
        match Region::parse(region.as_str()) {
            Ok(region) => region.sts_endpoint(),
            // Unvalidated input still yields the conventional host name.
            Err(_) => format!("https://sts.{region}.amazonaws.com"),
        }
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
        let plain = format!("lanyard-{namespace}_{service_account}");
        if is_dns_label(namespace) && is_dns_subdomain(service_account) && plain.len() <= MAX {
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
            // `+` is kept for the hash's separator, so it is replaced too.
            .map(|c| {
                if session_name_char(c) && c != '+' {
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
        let role = parse_role(role_arn)?;
        let seconds = duration.as_secs().to_string();
        let form = [
            ("Action", "AssumeRoleWithWebIdentity"),
            ("Version", STS_VERSION),
            ("RoleArn", role_arn),
            ("RoleSessionName", session_name),
            ("WebIdentityToken", token.expose_secret()),
            ("DurationSeconds", seconds.as_str()),
        ];
        let request = self
            .http
            .post(format!("{}/", self.endpoint))
            .header("accept", "text/xml")
            .form(&form);
        let (status, retry, body, issued_at) = send(request).await?;
        if !status.is_success() {
            return Err(classify(
                status.as_u16(),
                retry,
                &body,
                token.expose_secret(),
            ));
        }
        credentials_from(
            &body,
            "AssumeRoleWithWebIdentity",
            &role,
            session_name,
            issued_at,
        )
    }
}

/// `role_arn` as a role, or STS's refusal of it before any call.
fn parse_role(role_arn: &str) -> Result<RoleArn, CloudError> {
    RoleArn::parse(role_arn).map_err(|e| CloudError::Rejected {
        cloud: Cloud::Aws,
        code: "InvalidRoleArn".into(),
        message: e.to_string(),
    })
}

/// Sends one STS request: its status, `Retry-After`, body and the time it
/// was sent (noting the request id for the audit record).
async fn send(
    request: reqwest::RequestBuilder,
) -> Result<(reqwest::StatusCode, Option<Duration>, bytes::Bytes, u64), CloudError> {
    let a = super::send::send(Cloud::Aws, request, Some("x-amzn-requestid")).await?;
    Ok((a.status, a.retry_after, a.body, a.sent_at))
}

/// The credentials of `action`'s success answer for `role`.
fn credentials_from(
    body: &[u8],
    action: &str,
    role: &RoleArn,
    session_name: &str,
    issued_at: u64,
) -> Result<AwsCredentials, CloudError> {
    let protocol = |reason: String| CloudError::Protocol {
        cloud: Cloud::Aws,
        reason,
    };
    let ok = parse_success_of(body, action).map_err(protocol)?;
    if ok.expires_at <= issued_at {
        return Err(protocol(
            "STS returned credentials that have already expired".into(),
        ));
    }
    Ok(AwsCredentials {
        rendered: Default::default(),
        assumed_role_arn: ok
            .assumed_role_arn
            .unwrap_or_else(|| role.assumed_role_arn(session_name)),
        access_key_id: ok.access_key_id,
        secret_access_key: ok.secret_access_key,
        session_token: ok.session_token,
        expires_at: ok.expires_at,
        issued_at,
        account_id: role.account().to_string(),
    })
}

/// The AWS side of the broker: the STS exchanger, the audience callers'
/// tokens carry, and the session duration asked of STS.
#[derive(Clone)]
pub struct AwsCloud {
    /// The STS client.
    pub exchanger: AwsExchanger,
    /// Audience callers' projected tokens must carry for AWS.
    pub audience: String,
    /// `DurationSeconds` asked of STS (and the most a caller may ask).
    pub session_duration: Duration,
    /// The region that signs the chained hop.
    pub region: String,
    /// The cluster's EKS ARN, for the `eks-cluster-arn` and
    /// `eks-cluster-name` session tags of a chained hop.
    pub cluster_arn: Option<String>,
}

/// STS's shortest session.
const MIN_SESSION: Duration = Duration::from_secs(900);

impl CloudExchanger for AwsCloud {
    /// The role, and the role chained into from it.
    type Binding = Binding;

    fn cloud(&self) -> Cloud {
        Cloud::Aws
    }

    fn audience(&self) -> &str {
        &self.audience
    }

    fn kinds(&self) -> &'static [Kind] {
        &[Kind::AwsCredentials]
    }

    fn bind(&self, bindings: &Bindings, _: &Caller) -> Result<Vec<Binding>, RequestError> {
        match bindings.aws.is_empty() {
            true => Err(RequestError::NotBound),
            false => Ok(bindings.aws.clone()),
        }
    }

    /// The role the credentials are for: the target of a chain, else the
    /// role assumed with the pod's token.
    fn identity(&self, binding: &Binding) -> Identity {
        let account = |role_arn: &str| {
            RoleArn::parse(role_arn)
                .map(|arn| arn.account().to_string())
                .unwrap_or_default()
        };
        let role_arn = binding.final_role();
        Identity {
            cloud: Cloud::Aws,
            id: role_arn.to_string(),
            account: account(role_arn),
            account_number: None,
            source: crate::cloud::Source::Federation,
            via: binding.chain.as_ref().map(|chain| super::Via {
                id: binding.role_arn.clone(),
                account: account(&binding.role_arn),
                session_tags: chain.session_tags,
                session_policy: chain.session_policy.is_some(),
            }),
        }
    }

    fn lifetime(&self, binding: &Binding, request: &TokenRequest) -> Option<Duration> {
        Some(self.duration(binding, request))
    }

    fn selects(&self, binding: &Binding, selector: &Selector) -> bool {
        matches!(selector, Selector::RoleName(name) if binding.role_name() == name)
    }

    fn scope(&self, binding: &Binding, request: &TokenRequest) -> Result<String, RequestError> {
        let duration = self.duration(binding, request).as_secs();
        let Some(chain) = &binding.chain else {
            return Ok(format!("sts:AssumeRoleWithWebIdentity {duration}"));
        };
        match chain.checked() {
            Ok(key) => Ok(format!("sts:AssumeRole {duration} {key}")),
            Err(problem) => Err(RequestError::BadRequest(problem.to_string())),
        }
    }

    fn fetcher(&self, binding: &Binding, request: &TokenRequest, caller: &Caller) -> Fetcher {
        let session = AwsExchanger::session_name(&caller.namespace, &caller.service_account);
        let duration = self.duration(binding, request);
        let hop = binding.chain.as_ref().map(|chain| {
            let tags = if chain.session_tags {
                session_tags(self.cluster_arn.as_deref(), caller)
            } else {
                Vec::new()
            };
            (
                chain.target_role_arn.clone(),
                self.region.clone(),
                AssumeRoleOptions {
                    external_id: chain.external_id.clone(),
                    policy: chain.session_policy.clone(),
                    tags,
                },
            )
        });
        let params = (
            self.exchanger.clone(),
            session,
            binding.role_arn.clone(),
            duration,
            hop,
        );
        fetcher(params, |p, subject| async move {
            let (exchanger, session, role_arn, duration, hop) = &*p;
            // The first hop lives as long as the second needs it to sign.
            let first_duration = if hop.is_some() {
                MIN_SESSION
            } else {
                *duration
            };
            let credentials = exchanger
                .assume_role_with_web_identity(role_arn, session, &subject, first_duration)
                .await?;
            let Some((target, region, options)) = hop else {
                return Ok(Credential::Aws(credentials));
            };
            let chained = exchanger
                .assume_role(&credentials, region, target, session, *duration, options)
                .await?;
            Ok(Credential::Aws(chained))
        })
    }
}

impl AwsCloud {
    /// The session asked for: the configured or requested duration, at
    /// most an hour when chained.
    fn duration(&self, binding: &Binding, request: &TokenRequest) -> Duration {
        let asked = request.lifetime.map_or(self.session_duration, |l| {
            l.clamp(MIN_SESSION, self.session_duration.max(MIN_SESSION))
        });
        match binding.chain {
            Some(_) => asked.min(MAX_CHAINED_SESSION),
            None => asked,
        }
    }
}

#[derive(Deserialize)]
struct SuccessXml {
    #[serde(rename = "AssumeRoleWithWebIdentityResult", alias = "AssumeRoleResult")]
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
pub struct Parsed {
    access_key_id: String,
    secret_access_key: SecretString,
    session_token: SecretString,
    expires_at: u64,
    assumed_role_arn: Option<String>,
}

/// Parses STS's success XML. Failure reasons name the missing element but
/// never quote the body: it holds secrets.
pub fn parse_success(body: &[u8]) -> Result<Parsed, String> {
    parse_success_of(body, "AssumeRoleWithWebIdentity")
}

/// [`parse_success`] of `action`'s answer (`AssumeRoleWithWebIdentity`,
/// `AssumeRole`: the same credentials, in `{action}Result`).
fn parse_success_of(body: &[u8], action: &str) -> Result<Parsed, String> {
    let text = std::str::from_utf8(body).map_err(|_| "response is not UTF-8".to_string())?;
    let doc: SuccessXml = quick_xml::de::from_str(text)
        .map_err(|_| format!("response is not an {action}Response document"))?;
    let result = doc
        .result
        .ok_or_else(|| format!("response has no {action}Result"))?;
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
    /// `<Errors><Error>…`, the shape of other query-protocol services,
    /// which some STS-compatible endpoints answer with.
    #[serde(rename = "Errors")]
    errors: Option<ErrorsXml>,
}

#[derive(Deserialize)]
struct ErrorsXml {
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
    let error = doc.error.or(doc.errors.and_then(|e| e.error))?;
    let code = error
        .code
        .map(|c| c.trim().to_string())
        .filter(|c| !c.is_empty())?;
    Some((code, error.message.unwrap_or_default().trim().to_string()))
}

/// Maps a non-success answer to a [`CloudError`]: throttling and service
/// failures are retryable, refusals of the token or the role are not. The
/// subject token is scrubbed from the message in case an endpoint echoes it.
pub fn classify(status: u16, retry: Option<Duration>, body: &[u8], token: &str) -> CloudError {
    // The code is scrubbed and bounded too: it reaches logs and the
    // caller's error as written, and an endpoint may put anything there.
    let parsed = parse_error(body)
        .map(|(code, message)| (scrub_message(&code, token), scrub_message(&message, token)));
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

/// Parses an RFC 3339 time in UTC (`2026-12-02T11:00:00Z`, optionally with
/// a fraction, `+00:00` for `Z`) to Unix seconds. STS always answers in UTC
/// with `Z`; other offsets are refused rather than guessed.
fn parse_iso8601(s: &str) -> Option<u64> {
    super::parse_rfc3339(s.trim())
        .filter(|at| at.offset().is_utc())
        .and_then(super::unix_seconds)
}

/// The `aws` section of the configuration: AWS STS.
#[derive(Debug, Clone, PartialEq, serde::Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// Region of the STS endpoint and the one reported to SDKs.
    pub region: String,
    /// Overrides the regional STS endpoint.
    pub sts_endpoint: Option<String>,
    /// Audience callers' projected tokens must carry for AWS.
    pub audience: String,
    /// `DurationSeconds` asked of STS (900–43200; at most 3600 for a
    /// chained role).
    pub session_duration: u64,
    /// The cluster's EKS ARN (`arn:aws:eks:REGION:ACCOUNT:cluster/NAME`),
    /// for the `eks-cluster-arn` and `eks-cluster-name` session tags of a
    /// chained hop; unset: those two tags are left out.
    pub cluster_arn: Option<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            region: DEFAULT_REGION.into(),
            sts_endpoint: None,
            audience: "sts.amazonaws.com".into(),
            session_duration: 3600,
            cluster_arn: None,
        }
    }
}

impl Settings {
    /// Checks the section: region, audience, session length and STS endpoint.
    pub fn check(&self) -> Result<(), Invalid> {
        let a = self;
        if Region::parse(a.region.as_str()).is_err() {
            return Err(invalid(
                "aws.region",
                "an AWS region such as us-east-1",
                &a.region,
            ));
        }
        if a.audience.trim().is_empty() {
            return Err(invalid("aws.audience", "a non-empty audience", &a.audience));
        }
        if !(900..=43_200).contains(&a.session_duration) {
            return Err(invalid(
                "aws.session_duration",
                "seconds between 900 and 43200",
                &a.session_duration.to_string(),
            ));
        }
        if let Some(v) = &a.sts_endpoint {
            check_endpoint(v).map_err(|expected| invalid("aws.sts_endpoint", expected, v))?;
        }
        if let Some(v) = &a.cluster_arn {
            let parts: Vec<&str> = v.split(':').collect();
            let ok = matches!(parts.as_slice(), ["arn", partition, "eks", region, account, resource]
                if !partition.is_empty() && !region.is_empty()
                    && account.len() == 12 && account.bytes().all(|b| b.is_ascii_digit())
                    && resource.strip_prefix("cluster/").is_some_and(|n| !n.is_empty() && n.len() <= 100));
            if !ok {
                return Err(invalid(
                    "aws.cluster_arn",
                    "arn:aws:eks:REGION:ACCOUNT:cluster/NAME",
                    v,
                ));
            }
        }
        Ok(())
    }

    /// The AWS side of the broker these settings describe.
    pub fn exchanger(&self, http: reqwest::Client) -> AwsCloud {
        let endpoint = self
            .sts_endpoint
            .clone()
            .unwrap_or_else(|| AwsExchanger::regional_endpoint(&self.region));
        AwsCloud {
            exchanger: AwsExchanger::new(http, endpoint),
            audience: self.audience.clone(),
            session_duration: Duration::from_secs(self.session_duration),
            region: self.region.clone(),
            cluster_arn: self.cluster_arn.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cloud::Annotations;

    /// The default binding `annotations` give, if any.
    fn binding(annotations: &Annotations) -> Option<Binding> {
        bindings(annotations).into_iter().next()
    }
    fn chained_annotations(extra: &[(&str, &str)]) -> Annotations {
        let mut a: Annotations = [
            (annotations::ROLE_ARN, "arn:aws:iam::111122223333:role/ray"),
            (
                annotations::TARGET_ROLE_ARN,
                "arn:aws:iam::222233334444:role/lake",
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        a.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        a
    }

    #[test]
    fn aws_chains_are_read_from_lanyards_annotations() {
        let plain: Annotations = [(
            annotations::ROLE_ARN.to_string(),
            "arn:aws:iam::1:role/r".to_string(),
        )]
        .into_iter()
        .collect();
        assert_eq!(
            binding(&plain),
            Some(Binding::from("arn:aws:iam::1:role/r"))
        );
        let b = binding(&chained_annotations(&[
            (annotations::EXTERNAL_ID, "ext-1"),
            (annotations::SESSION_TAGS, "False"),
            (annotations::SESSION_POLICY, "{}"),
        ]))
        .unwrap();
        let chain = b.chain.as_ref().unwrap();
        assert_eq!(b.final_role(), "arn:aws:iam::222233334444:role/lake");
        assert_eq!(chain.external_id.as_deref(), Some("ext-1"));
        assert!(!chain.session_tags);
        assert_eq!(chain.session_policy.as_deref(), Some("{}"));
        // Tags are on unless turned off; a target alone is not a binding.
        let b = binding(&chained_annotations(&[])).unwrap();
        assert!(b.chain.unwrap().session_tags);
        let target_only: Annotations = [(
            annotations::TARGET_ROLE_ARN.to_string(),
            "arn:aws:iam::2:role/t".to_string(),
        )]
        .into_iter()
        .collect();
        assert_eq!(binding(&target_only), None);
    }

    #[test]
    fn aws_chain_annotations_are_checked_naming_the_annotation() {
        let problem = |extra: &[(&str, &str)]| {
            binding(&chained_annotations(extra))
                .unwrap()
                .chain
                .unwrap()
                .checked()
                .err()
                .map(str::to_string)
        };
        assert_eq!(problem(&[]), None);
        let long = "x".repeat(2049);
        for (extra, names) in [
            ((annotations::EXTERNAL_ID, "x"), annotations::EXTERNAL_ID),
            ((annotations::EXTERNAL_ID, "a b"), annotations::EXTERNAL_ID),
            (
                (annotations::SESSION_POLICY, "{"),
                annotations::SESSION_POLICY,
            ),
            (
                (annotations::SESSION_POLICY, long.as_str()),
                annotations::SESSION_POLICY,
            ),
            (
                (annotations::TARGET_ROLE_ARN, "lake"),
                annotations::TARGET_ROLE_ARN,
            ),
        ] {
            let found = problem(&[extra]).expect("refused");
            assert!(found.starts_with(names), "{found}");
        }
    }

    #[test]
    fn aws_session_tags_are_ekss_six_when_the_pod_and_cluster_are_known() {
        let caller = Caller::example();
        let tags = session_tags(
            Some("arn:aws:eks:us-east-1:111122223333:cluster/ray"),
            &caller,
        );
        let keys: Vec<&str> = tags.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            keys,
            [
                "eks-cluster-arn",
                "eks-cluster-name",
                "kubernetes-namespace",
                "kubernetes-service-account",
                "kubernetes-pod-name",
                "kubernetes-pod-uid"
            ]
        );
        assert_eq!(tags[1].1, "ray");
        assert_eq!(tags[2].1, caller.namespace);
        // Without a cluster ARN, the cluster's two are left out.
        assert_eq!(session_tags(None, &caller).len(), 4);
    }

    #[test]
    fn aws_chained_sessions_last_at_most_an_hour_and_key_every_parameter() {
        let cloud = Settings {
            session_duration: 7200,
            ..Settings::default()
        }
        .exchanger(reqwest::Client::new());
        let request = TokenRequest::new(
            Cloud::Aws,
            Kind::AwsCredentials,
            super::super::Surface::AwsContainer,
        );
        let plain = Binding::from("arn:aws:iam::111122223333:role/ray");
        assert_eq!(cloud.duration(&plain, &request), Duration::from_secs(7200));
        let chained = binding(&chained_annotations(&[])).unwrap();
        assert_eq!(
            cloud.duration(&chained, &request),
            Duration::from_secs(3600)
        );
        let scope = cloud.scope(&chained, &request).unwrap();
        let other_id =
            binding(&chained_annotations(&[(annotations::EXTERNAL_ID, "ext-2")])).unwrap();
        assert_ne!(scope, cloud.scope(&other_id, &request).unwrap());
        let untagged = binding(&chained_annotations(&[(
            annotations::SESSION_TAGS,
            "false",
        )]))
        .unwrap();
        assert_ne!(scope, cloud.scope(&untagged, &request).unwrap());
        let bad = binding(&chained_annotations(&[(
            annotations::SESSION_POLICY,
            "nope",
        )]))
        .unwrap();
        assert!(matches!(
            cloud.scope(&bad, &request),
            Err(RequestError::BadRequest(_))
        ));
        // The identity is the target's, reached through the first role.
        let id = cloud.identity(&chained);
        assert_eq!(id.id, "arn:aws:iam::222233334444:role/lake");
        assert_eq!(id.account, "222233334444");
        let via = id.via.unwrap();
        assert_eq!(via.id, "arn:aws:iam::111122223333:role/ray");
        assert!(via.session_tags && !via.session_policy);
    }

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
    fn aws_parses_the_nested_error_shape_too() {
        let body = br#"<?xml version="1.0" encoding="utf-8"?>
<ErrorResponse><Errors><Error><Code>InvalidClientTokenId</Code><Message>The security token included in the request is invalid.</Message><Type>Sender</Type></Error></Errors></ErrorResponse>"#;
        assert_eq!(
            parse_error(body),
            Some((
                "InvalidClientTokenId".into(),
                "The security token included in the request is invalid.".into()
            ))
        );
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
    fn aws_error_codes_never_carry_the_token_either() {
        let tok = "eyJhbGciOiJSUzI1NiJ9.payload.signature";
        let long = "C".repeat(10_000);
        for code in [format!("Invalid{tok}"), long] {
            let err = classify(400, None, &error_body(&code, "m"), tok);
            let (shown, debug) = (err.to_string(), format!("{err:?}"));
            assert!(!shown.contains(tok) && !debug.contains(tok), "{shown}");
            assert!(
                shown.len() < 1_500,
                "an unbounded code: {} bytes",
                shown.len()
            );
        }
    }

    #[test]
    fn aws_long_messages_are_cut() {
        let long = "é".repeat(2000);
        match classify(400, None, &error_body("ValidationError", &long), "tok.en") {
            CloudError::Rejected { message, .. } => {
                assert!(message.len() <= crate::cloud::MAX_MESSAGE_BYTES + 3)
            }
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
        // RFC 3339 allows a space between date and time; nothing else.
        assert_eq!(parse_iso8601("2026-12-02 11:00:00Z"), Some(1_796_209_200));
        assert_eq!(parse_iso8601("2026-12-02X11:00:00Z"), None);
        assert_eq!(parse_iso8601("2026-12-02T11:00:00-01:00"), None);
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
}
