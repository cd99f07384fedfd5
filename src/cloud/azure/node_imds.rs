//! The node's Azure Instance Metadata Service, for the user-assigned
//! managed identities assigned to the node pool (`azure.node_identities`).
//!
//! Why: a managed identity's token obtained through the identity's own
//! federated credential (the pod's projected token as `client_assertion`)
//! is refused as another app's federated credential: `AADSTS700231: Token
//! obtained using another federated identity credential may not be used as
//! federated identity credential` (azure-workload-identity issue #1363,
//! the same flow under AKS workload identity; it works under
//! aad-pod-identity, whose token came from the node's IMDS). A token the
//! identity gets from the IMDS of the compute it is assigned to is what
//! Entra accepts there (Microsoft's "Configure an application to trust a
//! managed identity" walkthroughs take it from IMDS). The same endpoint
//! serves the identity's own tokens for any resource, which is what
//! aad-pod-identity's NMI handed pods; here the agent asks, after it has
//! verified the pod's token, and the policy has decided.
//!
//! The request (Microsoft Learn, "How to use managed identities for Azure
//! resources on an Azure VM to acquire an access token"): `GET
//! /metadata/identity/oauth2/token?api-version=2018-02-01&resource=R
//! &client_id=C` with `Metadata: true`; the answer's fields are strings,
//! `expires_on` in Unix seconds. Its retry guidance: 404 (IMDS updating),
//! 410 (up to 70 s after a VM starts), 429 and 5xx are retryable; other
//! 4xx (`Identity not found`, a missing header) are not. The agent reaches
//! IMDS from its own network namespace, as any pod on an AKS node can
//! (docs/setup-azure.md).

use std::time::Duration;

use serde::Deserialize;

use crate::cloud::{scrub_message, AccessToken, Cloud, CloudError};
use crate::secret::SecretString;

/// Where IMDS answers on every Azure VM.
pub const DEFAULT_ENDPOINT: &str = "http://169.254.169.254";
/// The API version asked (every SDK's IMDS default).
const API_VERSION: &str = "2018-02-01";

/// Checks an IMDS endpoint: `http://` (IMDS has no TLS) to a link-local
/// address (IMDS's `169.254.169.254`) or a loopback one (an emulator),
/// without path, query or fragment.
pub fn check_endpoint(value: &str) -> Result<(), &'static str> {
    const EXPECTED: &str =
        "an http:// URL of a link-local (169.254.0.0/16) or loopback address, without path, query or fragment";
    let url = url::Url::parse(value).map_err(|_| EXPECTED)?;
    let local = match url.host() {
        Some(url::Host::Ipv4(ip)) => ip.is_link_local() || ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        Some(url::Host::Domain(d)) => d == "localhost",
        None => false,
    };
    let bare = matches!(url.path(), "" | "/") && url.query().is_none() && url.fragment().is_none();
    if url.scheme() != "http" || !local || !bare {
        return Err(EXPECTED);
    }
    Ok(())
}

/// A client of the node's IMDS.
#[derive(Clone)]
pub struct NodeImds {
    http: reqwest::Client,
    endpoint: String,
}

#[derive(Deserialize)]
struct Success {
    access_token: String,
    /// Unix seconds, as a string (a number is taken too).
    expires_on: Option<serde_json::Value>,
    /// Seconds, as a string.
    expires_in: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Failure {
    error: Option<String>,
    error_description: Option<String>,
}

impl NodeImds {
    /// A client of the IMDS at `endpoint` ([`DEFAULT_ENDPOINT`] on a node;
    /// an emulator's in `lanyard dev`).
    pub fn new(http: reqwest::Client, endpoint: &str) -> Self {
        NodeImds {
            http,
            endpoint: endpoint.trim_end_matches('/').to_string(),
        }
    }

    /// The managed identity `client_id`'s token for `resource` (a v1
    /// resource: no `/.default`).
    pub async fn token(&self, client_id: &str, resource: &str) -> Result<AccessToken, CloudError> {
        let url = format!("{}/metadata/identity/oauth2/token", self.endpoint);
        let unavailable = |reason: String| CloudError::Unavailable {
            cloud: Cloud::Azure,
            reason: format!("the node's IMDS: {reason}"),
        };
        let request = self
            .http
            .get(&url)
            .query(&[
                ("api-version", API_VERSION),
                ("resource", resource),
                ("client_id", client_id),
            ])
            .header("Metadata", "true");
        let super::super::send::Answer {
            status,
            retry_after: retry,
            body,
            sent_at: issued_at,
        } = super::super::send::send(Cloud::Azure, request, None)
            .await
            .map_err(|e| match e {
                CloudError::Unavailable { reason, .. } => unavailable(reason),
                other => other,
            })?;
        if status.is_success() {
            let ok: Success = serde_json::from_slice(&body).map_err(|e| CloudError::Protocol {
                cloud: Cloud::Azure,
                reason: format!("the node's IMDS token response: {e}"),
            })?;
            let expires_at = super::seconds(ok.expires_on.as_ref())
                .or_else(|| super::seconds(ok.expires_in.as_ref()).map(|s| issued_at + s))
                .ok_or_else(|| CloudError::Protocol {
                    cloud: Cloud::Azure,
                    reason: "the node's IMDS token response has no expires_on".into(),
                })?;
            return Ok(AccessToken {
                rendered: Default::default(),
                token: SecretString::from(ok.access_token),
                issued_at,
                expires_at,
            });
        }
        let failure: Option<Failure> = serde_json::from_slice(&body).ok();
        let description = failure
            .as_ref()
            .and_then(|f| f.error_description.as_deref().or(f.error.as_deref()))
            .map(|m| scrub_message(m, ""))
            .unwrap_or_else(|| format!("HTTP {status}"));
        match status.as_u16() {
            429 => Err(CloudError::Throttled {
                cloud: Cloud::Azure,
                code: "IMDS429".into(),
                retry_after: retry.or(Some(Duration::from_secs(1))),
            }),
            404 | 410 | 500..=599 => Err(unavailable(format!("HTTP {status}: {description}"))),
            _ => Err(CloudError::Rejected {
                cloud: Cloud::Azure,
                code: failure
                    .and_then(|f| f.error)
                    .unwrap_or_else(|| format!("HTTP{}", status.as_u16())),
                message: format!(
                    "the node's IMDS refused managed identity {client_id}: {description}"
                ),
            }),
        }
    }
}
