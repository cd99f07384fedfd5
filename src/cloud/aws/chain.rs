//! AWS target roles: the chained hop EKS Pod Identity makes into a
//! target role (often in another account). The pod's token gives the role
//! in `eks.amazonaws.com/role-arn` (`AssumeRoleWithWebIdentity`); that
//! session's keys sign an `sts:AssumeRole` into the target, with EKS's
//! session tags, an external id and a session policy as the ServiceAccount's
//! `lanyard.dev/aws-*` annotations say.

use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::{
    annotations, classify, credentials_from, parse_role, send, AwsCredentials, AwsExchanger,
    RoleArn, STS_VERSION,
};
use crate::cloud::{annotation, distinct, listed, Annotations, Cloud, CloudError};
use crate::secret::ExposeSecret;
use crate::token::Caller;

/// The IAM role a ServiceAccount assumes, and the role it chains into
/// from there, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    /// The role assumed with the pod's token (`eks.amazonaws.com/role-arn`).
    pub role_arn: String,
    /// The second hop, `sts:AssumeRole` into a target role (shared: a
    /// request clones the binding).
    pub chain: Option<Arc<Chain>>,
}

/// The chained hop's parameters, as EKS Pod Identity's target role
/// association carries them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    /// The role the credentials are for in the end.
    pub target_role_arn: String,
    /// `ExternalId`, when the target's trust policy asks for one.
    pub external_id: Option<String>,
    /// Whether the hop carries EKS's six session tags (transitive).
    pub session_tags: bool,
    /// `Policy`: an inline session policy, JSON.
    pub session_policy: Option<String>,
    /// Judged once, when the ServiceAccount's annotations are read (not on
    /// each request): the hop's part of the cache key, or the first thing
    /// wrong with its annotations.
    checked: Result<String, String>,
}

impl From<String> for Binding {
    fn from(role_arn: String) -> Self {
        Binding {
            role_arn,
            chain: None,
        }
    }
}

impl From<&str> for Binding {
    fn from(role_arn: &str) -> Self {
        Binding::from(role_arn.to_string())
    }
}

/// The roles `annotations` name, the default first: the
/// `eks.amazonaws.com/role-arn` one, with the chained hop the
/// `lanyard.dev/aws-*` annotations describe, then those of
/// `lanyard.dev/aws-role-arns` (each assumed with the pod's token, no
/// chain). IMDS selects a role by its name alone, so a role whose name an
/// earlier one has (in another account) could never be selected: it is
/// dropped.
pub fn bindings(annotations: &Annotations) -> Vec<Binding> {
    let first = annotation(annotations, annotations::ROLE_ARN).map(|role_arn| {
        let chain = annotation(annotations, annotations::TARGET_ROLE_ARN).map(|target_role_arn| {
            Arc::new(Chain::new(
                &role_arn,
                target_role_arn,
                annotation(annotations, annotations::EXTERNAL_ID),
                annotation(annotations, annotations::SESSION_TAGS)
                    .is_none_or(|v| !v.eq_ignore_ascii_case("false")),
                annotation(annotations, annotations::SESSION_POLICY),
            ))
        });
        Binding { role_arn, chain }
    });
    let listed = listed(annotations, annotations::ROLE_ARNS)
        .into_iter()
        .map(Binding::from);
    distinct(
        first.into_iter().chain(listed),
        |a, b| a.role_name() == b.role_name(),
        annotations::ROLE_ARNS,
    )
}

impl Binding {
    /// The name IMDS selects this binding by: the final role's, after the
    /// last `/` of its ARN.
    pub fn role_name(&self) -> &str {
        let arn = self.final_role();
        arn.rsplit('/').next().unwrap_or(arn)
    }
}

/// STS's bounds on the chained hop's caller-supplied values, checked
/// before anything is sent so that the caller learns which annotation is
/// wrong.
const MAX_POLICY_CHARS: usize = 2048;
const EXTERNAL_ID_CHARS: std::ops::RangeInclusive<usize> = 2..=1224;
/// A chained session lasts at most an hour, whatever the role allows.
pub(super) const MAX_CHAINED_SESSION: Duration = Duration::from_secs(3600);
/// STS's limits on session tags.
const MAX_TAG_VALUE_CHARS: usize = 256;

impl Chain {
    /// The hop from `role_arn`'s session into `target_role_arn`, checked.
    pub fn new(
        role_arn: &str,
        target_role_arn: String,
        external_id: Option<String>,
        session_tags: bool,
        session_policy: Option<String>,
    ) -> Chain {
        let mut chain = Chain {
            target_role_arn,
            external_id,
            session_tags,
            session_policy,
            checked: Ok(String::new()),
        };
        chain.checked = match chain.find_problem() {
            Some(problem) => Err(problem),
            None => Ok(chain.key(role_arn)),
        };
        chain
    }

    /// The hop's part of the cache key: every parameter of the second hop
    /// is in it, so that a changed annotation is not served the old
    /// session.
    fn key(&self, role_arn: &str) -> String {
        let mut hasher = Sha256::new();
        hasher.update(role_arn.as_bytes());
        hasher.update([0]);
        hasher.update(self.external_id.as_deref().unwrap_or("").as_bytes());
        hasher.update([0]);
        hasher.update(self.session_policy.as_deref().unwrap_or("").as_bytes());
        let digest = hasher.finalize();
        let hash: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
        format!("via {role_arn} tags={} {hash}", self.session_tags)
    }

    /// The hop's part of the cache key, or what is wrong with its
    /// annotations, in words naming the annotation.
    pub(super) fn checked(&self) -> Result<&str, &str> {
        self.checked.as_deref().map_err(String::as_str)
    }

    /// The first thing wrong with the hop's annotations.
    fn find_problem(&self) -> Option<String> {
        if RoleArn::parse(self.target_role_arn.as_str()).is_err() {
            return Some(format!(
                "{} is not an IAM role ARN (arn:aws:iam::ACCOUNT:role/NAME)",
                annotations::TARGET_ROLE_ARN
            ));
        }
        if let Some(id) = &self.external_id {
            let ok_chars = id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_+=,.@:/-".contains(c));
            if !EXTERNAL_ID_CHARS.contains(&id.chars().count()) || !ok_chars {
                return Some(format!(
                    "{} must be 2-1224 characters of letters, digits and _+=,.@:/-",
                    annotations::EXTERNAL_ID
                ));
            }
        }
        if let Some(policy) = &self.session_policy {
            if policy.chars().count() > MAX_POLICY_CHARS {
                return Some(format!(
                    "{} is longer than STS's {MAX_POLICY_CHARS} characters",
                    annotations::SESSION_POLICY
                ));
            }
            if serde_json::from_str::<serde::de::IgnoredAny>(policy).is_err() {
                return Some(format!("{} is not JSON", annotations::SESSION_POLICY));
            }
        }
        None
    }
}

/// EKS Pod Identity's session tags for a pod: keys and values as EKS
/// sets them, all transitive (they follow further chaining). Values are
/// cut to STS's 256 characters.
pub fn session_tags(cluster_arn: Option<&str>, caller: &Caller) -> Vec<(&'static str, String)> {
    let cut = |v: &str| v.chars().take(MAX_TAG_VALUE_CHARS).collect::<String>();
    let mut tags = Vec::with_capacity(6);
    if let Some(arn) = cluster_arn {
        tags.push(("eks-cluster-arn", cut(arn)));
        tags.push((
            "eks-cluster-name",
            cut(arn.rsplit('/').next().unwrap_or(arn)),
        ));
    }
    tags.push(("kubernetes-namespace", cut(&caller.namespace)));
    tags.push(("kubernetes-service-account", cut(&caller.service_account)));
    if let Some(pod) = &caller.pod {
        tags.push(("kubernetes-pod-name", cut(&pod.name)));
        tags.push(("kubernetes-pod-uid", cut(&pod.uid)));
    }
    tags
}

/// What the chained hop sends besides the role: `ExternalId`, `Policy`,
/// and the session tags (all transitive).
#[derive(Debug, Clone, Default)]
pub struct AssumeRoleOptions {
    /// `ExternalId`.
    pub external_id: Option<String>,
    /// `Policy`, an inline session policy.
    pub policy: Option<String>,
    /// `Tags.member.N`, each also a `TransitiveTagKeys.member.N`.
    pub tags: Vec<(&'static str, String)>,
}

impl AwsExchanger {
    /// Chains from `source` (a web identity's session) into `role_arn` with
    /// a SigV4-signed `sts:AssumeRole`, as EKS Pod Identity does for a
    /// target role. `region` names the signing scope. The session lasts
    /// at most an hour (STS's limit for chained roles).
    pub async fn assume_role(
        &self,
        source: &AwsCredentials,
        region: &str,
        role_arn: &str,
        session_name: &str,
        duration: Duration,
        options: &AssumeRoleOptions,
    ) -> Result<AwsCredentials, CloudError> {
        let role = parse_role(role_arn)?;
        let seconds = duration.min(MAX_CHAINED_SESSION).as_secs().to_string();
        let mut form: Vec<(String, String)> = vec![
            ("Action".into(), "AssumeRole".into()),
            ("Version".into(), STS_VERSION.into()),
            ("RoleArn".into(), role_arn.into()),
            ("RoleSessionName".into(), session_name.into()),
            ("DurationSeconds".into(), seconds),
        ];
        if let Some(id) = &options.external_id {
            form.push(("ExternalId".into(), id.clone()));
        }
        if let Some(policy) = &options.policy {
            form.push(("Policy".into(), policy.clone()));
        }
        for (i, (key, value)) in options.tags.iter().enumerate() {
            let n = i + 1;
            form.push((format!("Tags.member.{n}.Key"), key.to_string()));
            form.push((format!("Tags.member.{n}.Value"), value.clone()));
            form.push((format!("TransitiveTagKeys.member.{n}"), key.to_string()));
        }
        let body = form_body(&form);
        let url = format!("{}/", self.endpoint);
        let signed =
            sign_sts_post(&url, &body, source, region).map_err(|reason| CloudError::Protocol {
                cloud: Cloud::Aws,
                reason: format!("signing AssumeRole: {reason}"),
            })?;
        let mut request = self
            .http
            .post(&url)
            .header("accept", "text/xml")
            .header("content-type", FORM_CONTENT_TYPE);
        for (name, value) in signed {
            request = request.header(name, value);
        }
        let (status, retry, body, issued_at) = send(request.body(body)).await?;
        if !status.is_success() {
            let secret = source.session_token.expose_secret();
            return Err(match classify(status.as_u16(), retry, &body, secret) {
                // Say which hop failed (unless STS's text already does),
                // and for a packed size, the annotation that fixes it.
                CloudError::Rejected {
                    cloud,
                    code,
                    message,
                } => {
                    let hint = if code == "PackedPolicyTooLarge" {
                        format!(
                            " ({}: \"false\" sends no session tags)",
                            annotations::SESSION_TAGS
                        )
                    } else {
                        String::new()
                    };
                    let message = if hint.is_empty() && message.contains("sts:AssumeRole ") {
                        message
                    } else {
                        format!("sts:AssumeRole into {role_arn}: {message}{hint}")
                    };
                    CloudError::Rejected {
                        cloud,
                        code,
                        message,
                    }
                }
                other => other,
            });
        }
        credentials_from(&body, "AssumeRole", &role, session_name, issued_at)
    }
}

const FORM_CONTENT_TYPE: &str = "application/x-www-form-urlencoded; charset=utf-8";

/// `application/x-www-form-urlencoded` of `pairs`, in order.
fn form_body(pairs: &[(String, String)]) -> String {
    let mut out = url::form_urlencoded::Serializer::new(String::new());
    for (k, v) in pairs {
        out.append_pair(k, v);
    }
    out.finish()
}

/// The headers that sign a `POST` of `body` to STS at `url` with `source`'s
/// credentials (SigV4, service `sts`, `region`): `authorization`,
/// `x-amz-date`, `x-amz-security-token`.
fn sign_sts_post(
    url: &str,
    body: &str,
    source: &AwsCredentials,
    region: &str,
) -> Result<Vec<(String, String)>, String> {
    use aws_sigv4::http_request::{sign, SignableBody, SignableRequest, SigningSettings};
    use aws_sigv4::sign::v4;
    let identity = aws_credential_types::Credentials::new(
        source.access_key_id.clone(),
        source.secret_access_key.expose_secret().to_string(),
        Some(source.session_token.expose_secret().to_string()),
        None,
        "lanyard-web-identity",
    )
    .into();
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name("sts")
        .time(std::time::SystemTime::now())
        .settings(SigningSettings::default())
        .build()
        .map_err(|e| e.to_string())?
        .into();
    let headers = [("content-type", FORM_CONTENT_TYPE)];
    let request = SignableRequest::new(
        "POST",
        url,
        headers.into_iter(),
        SignableBody::Bytes(body.as_bytes()),
    )
    .map_err(|e| e.to_string())?;
    let (instructions, _) = sign(request, &params)
        .map_err(|e| e.to_string())?
        .into_parts();
    let (headers, _) = instructions.into_parts();
    Ok(headers
        .into_iter()
        .map(|h| (h.name().to_string(), h.value().to_string()))
        .collect())
}

impl Binding {
    /// The role the credentials are for in the end.
    pub fn final_role(&self) -> &str {
        self.chain
            .as_ref()
            .map_or(&self.role_arn, |c| &c.target_role_arn)
    }
}
