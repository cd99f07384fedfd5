//! AWS target roles: the chained hop EKS Pod Identity makes into a
//! target role (often in another account). The pod's token gives the role
//! in `eks.amazonaws.com/role-arn` (`AssumeRoleWithWebIdentity`); that
//! session's keys sign an `sts:AssumeRole` into the target, with EKS's
//! session tags, an external id and a session policy as the ServiceAccount's
//! `lanyard.dev/aws-*` annotations say.
//!
//! The hop's model (`Binding`, `Chain`, read from the annotations and
//! checked once) is `lanyard_core::cloud::aws`; this file sends the hop.

use std::time::Duration;

use super::{
    annotations, classify, credentials_from, parse_role, send, AwsCredentials, AwsExchanger,
    STS_VERSION,
};
use crate::cloud::{Cloud, CloudError};
use crate::secret::ExposeSecret;
use crate::token::Caller;

/// A chained session lasts at most an hour, whatever the role allows.
pub(super) const MAX_CHAINED_SESSION: Duration = Duration::from_secs(3600);
/// STS's limits on session tags.
const MAX_TAG_VALUE_CHARS: usize = 256;

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
