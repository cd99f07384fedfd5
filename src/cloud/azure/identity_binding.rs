//! AKS identity bindings: the pod's token exchanged through the cluster's
//! identity-binding proxy instead of at Entra.
//!
//! Why: a managed identity holds at most 20 federated identity credentials,
//! one per cluster issuer and ServiceAccount, which fleets of clusters
//! outgrow. With an identity binding AKS gives the identity one credential
//! (`aks-identity-binding`, issuer `https://ib.oic.prod-aks.azure.com/
//! TENANT/CLIENT_ID`) shared by every cluster bound to it, and a proxy in
//! each cluster that exchanges a pod's token for the identity's Entra token
//! when Kubernetes RBAC lets the pod's ServiceAccount use the identity
//! (Microsoft Learn, "Identity bindings in AKS": verb
//! `use-managed-identity`, API group `cid.wi.aks.azure.com`, resource the
//! identity's client id). The proxy signs its own assertion for Entra; the
//! pod's token never leaves the cluster.
//!
//! The protocol, as public clients speak it (there is no specification):
//! - the pod's projected token has audience `api://AKSIdentityBinding`
//!   (azure-workload-identity's identity-binding webhook; the Azure
//!   secrets-store CSI provider's `IdentityBindingTokenAudience`, pull
//!   request #1984; AgentBaker's kubelet credential-provider
//!   configuration);
//! - it is posted as Entra's client-credentials grant
//!   (`client_assertion`, `client_id`, exactly one `scope`) to the proxy,
//!   which listens on the API server's address and is told apart from the
//!   API server by the TLS server name, `<label>.ests.aks`
//!   (`AZURE_KUBERNETES_SNI_NAME`), presenting a certificate of the
//!   cluster's CA (cloud-provider-azure pull request #9907: it dials the
//!   API server's address with that server name and the cluster CA, TLS
//!   1.2 or later, no HTTP proxy; the SDKs' `enableAzureProxy` option
//!   does the same with `AZURE_KUBERNETES_TOKEN_PROXY`,
//!   `AZURE_KUBERNETES_SNI_NAME` and `AZURE_KUBERNETES_CA_FILE`);
//! - the path is the SDKs' `/{tenant}/oauth2/v2.0/token` (the proxy does
//!   not route on it: the credential provider posts to `/`);
//! - the answer is Entra's token response, relayed.
//!
//! The CA file is read before every exchange and the client rebuilt when
//! it changed, as the SDKs do, so a rotation of the cluster CA needs no
//! restart; an empty file (mid-rotation) keeps the client it replaces.
//! Exchanges are rare (the cache answers the rest), so one small read each
//! costs nothing measurable.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use super::{post_token, AzureRequest};
use crate::cloud::{AccessToken, Cloud, CloudError};

/// The audience of the pod's token the identity-binding proxy takes.
pub use lanyard_core::cloud::azure::IDENTITY_BINDING_AUDIENCE as AUDIENCE;

/// Where the cluster CA is in every pod (the agent's included).
pub const DEFAULT_CA_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";

/// The proxy, as the agent reaches it.
#[derive(Clone)]
pub struct IdentityBindingProxy {
    inner: Arc<Inner>,
}

struct Inner {
    /// The proxy's TLS server name, `<label>.ests.aks`.
    sni_name: String,
    /// The API server's host (an address or a name) and port.
    host: String,
    port: u16,
    ca_file: PathBuf,
    /// The client built for the CA file's content it was built with.
    client: Mutex<Option<(Vec<u8>, reqwest::Client)>>,
}

/// Why the proxy's settings cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProxySettingsError {
    /// Neither `azure.identity_binding_proxy` nor the in-cluster
    /// `KUBERNETES_SERVICE_HOST` names the API server.
    #[error("azure.identity_binding_proxy is not set and KUBERNETES_SERVICE_HOST is not in the environment: name the API server's address (https://HOST:PORT)")]
    NoApiServer,
    /// The proxy setting is not an `https://HOST[:PORT]` URL.
    #[error("azure.identity_binding_proxy must be an https:// URL of the API server's address without path, query or fragment, not {0:?}")]
    BadProxy(String),
    /// The server name is no DNS name.
    #[error("azure.identity_binding_sni must be the proxy's DNS name (<label>.ests.aks, the AZURE_KUBERNETES_SNI_NAME AKS gives pods), not {0:?}")]
    BadSniName(String),
}

/// Checks the proxy's TLS server name: a lower-case DNS name.
pub fn check_sni_name(name: &str) -> Result<(), ProxySettingsError> {
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    };
    // The last label is not all digits: an address is no server name.
    let tld_ok = name
        .rsplit('.')
        .next()
        .is_some_and(|tld| !tld.bytes().all(|b| b.is_ascii_digit()));
    if name.len() > 253 || name.split('.').count() < 2 || !name.split('.').all(label_ok) || !tld_ok
    {
        return Err(ProxySettingsError::BadSniName(name.to_string()));
    }
    Ok(())
}

/// The API server's address: `proxy` (`https://HOST[:PORT]`) when set,
/// else the in-cluster `KUBERNETES_SERVICE_HOST` and
/// `KUBERNETES_SERVICE_PORT` (`service`, as the environment gives them).
pub fn api_server(
    proxy: Option<&str>,
    service: (Option<String>, Option<String>),
) -> Result<(String, u16), ProxySettingsError> {
    if let Some(proxy) = proxy {
        let bad = || ProxySettingsError::BadProxy(proxy.to_string());
        let url = url::Url::parse(proxy).map_err(|_| bad())?;
        let bare = matches!(url.path(), "" | "/")
            && url.query().is_none()
            && url.fragment().is_none()
            && url.username().is_empty()
            && url.password().is_none();
        let host = match url.host() {
            Some(url::Host::Ipv6(ip)) => ip.to_string(),
            Some(host) => host.to_string(),
            None => return Err(bad()),
        };
        if url.scheme() != "https" || !bare {
            return Err(bad());
        }
        return Ok((host, url.port().unwrap_or(443)));
    }
    let (Some(host), port) = service else {
        return Err(ProxySettingsError::NoApiServer);
    };
    let port = match port {
        Some(p) => p
            .parse()
            .map_err(|_| ProxySettingsError::BadProxy(format!("KUBERNETES_SERVICE_PORT={p}")))?,
        None => 443,
    };
    Ok((host, port))
}

/// Resolves every name this client asks for (only ever the proxy's server
/// name) to the API server's address: the server name is for TLS, not DNS.
struct ToApiServer {
    host: String,
    port: u16,
}

impl reqwest::dns::Resolve for ToApiServer {
    fn resolve(&self, _name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let target = (self.host.clone(), self.port);
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host(target).await?.collect();
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

impl IdentityBindingProxy {
    /// The proxy named `sni_name` at the API server `host:port`, trusted
    /// through the CA in `ca_file`.
    pub fn new(sni_name: String, (host, port): (String, u16), ca_file: PathBuf) -> Self {
        IdentityBindingProxy {
            inner: Arc::new(Inner {
                sni_name,
                host,
                port,
                ca_file,
                client: Mutex::new(None),
            }),
        }
    }

    /// The proxy's TLS server name.
    pub fn sni_name(&self) -> &str {
        &self.inner.sni_name
    }

    /// Exchanges the pod's token (`req.assertion`, audience [`AUDIENCE`])
    /// at the proxy, answered and classified as Entra's exchange is.
    pub async fn exchange(&self, req: &AzureRequest<'_>) -> Result<AccessToken, CloudError> {
        let http = self.client().await?;
        let base = format!("https://{}:{}", self.inner.sni_name, self.inner.port);
        post_token(&http, &base, req).await.map_err(|e| match e {
            CloudError::Unavailable { cloud, reason } => CloudError::Unavailable {
                cloud,
                reason: format!(
                    "the identity-binding proxy ({}): {reason}",
                    self.inner.sni_name
                ),
            },
            other => other,
        })
    }

    /// The client for the CA file's current content.
    async fn client(&self) -> Result<reqwest::Client, CloudError> {
        let unavailable = |reason: String| CloudError::Unavailable {
            cloud: Cloud::Azure,
            reason: format!(
                "the identity-binding proxy's CA ({}): {reason}",
                self.inner.ca_file.display()
            ),
        };
        let pem = tokio::fs::read(&self.inner.ca_file).await;
        let mut held = self.inner.client.lock().unwrap_or_else(|p| p.into_inner());
        let pem = match pem {
            Ok(pem) if !pem.iter().all(u8::is_ascii_whitespace) => pem,
            // Empty while it is rewritten, or gone: the client built from
            // the last content, if any.
            Ok(_) | Err(_) if held.is_some() => {
                return Ok(held.as_ref().map(|(_, c)| c.clone()).unwrap_or_default())
            }
            Ok(_) => return Err(unavailable("the file is empty".into())),
            Err(e) => return Err(unavailable(e.to_string())),
        };
        if let Some((built_from, client)) = held.as_ref() {
            if *built_from == pem {
                return Ok(client.clone());
            }
        }
        let certs = reqwest::Certificate::from_pem_bundle(&pem)
            .map_err(|e| unavailable(format!("not PEM certificates: {e}")))?;
        if certs.is_empty() {
            return Err(unavailable("no certificate in the file".into()));
        }
        let client = reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(5))
            .timeout(std::time::Duration::from_secs(15))
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("lanyard/", env!("CARGO_PKG_VERSION")))
            // The cluster's CA alone: the proxy's certificate is the
            // cluster's, and no public CA may vouch for it.
            .tls_certs_only(certs)
            .min_tls_version(reqwest::tls::Version::TLS_1_2)
            // The API server is dialled directly, never through a proxy.
            .no_proxy()
            .dns_resolver(Arc::new(ToApiServer {
                host: self.inner.host.clone(),
                port: self.inner.port,
            }))
            .build()
            .map_err(|e| unavailable(format!("cannot build the client: {e}")))?;
        *held = Some((pem, client.clone()));
        Ok(client)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_names_are_dns_names() {
        assert!(check_sni_name("a4k2n8q0.ests.aks").is_ok());
        assert!(check_sni_name(&format!("{}.ests.aks", "c".repeat(63))).is_ok());
        for bad in [
            "",
            "ests",
            "A.ests.aks",
            "-a.ests.aks",
            "a..aks",
            "a b.aks",
            "a.ests.aks/x",
        ] {
            assert_eq!(
                check_sni_name(bad),
                Err(ProxySettingsError::BadSniName(bad.to_string())),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_api_server_is_the_setting_or_the_in_cluster_service() {
        let none = (None, None);
        assert_eq!(
            api_server(Some("https://10.0.0.1"), none.clone()),
            Ok(("10.0.0.1".into(), 443))
        );
        assert_eq!(
            api_server(Some("https://[fd00::1]:6443/"), none.clone()),
            Ok(("fd00::1".into(), 6443))
        );
        assert_eq!(
            api_server(Some("https://kubernetes.default.svc"), none.clone()),
            Ok(("kubernetes.default.svc".into(), 443))
        );
        for bad in [
            "http://10.0.0.1",
            "https://10.0.0.1/token",
            "https://u@10.0.0.1",
            "10.0.0.1",
        ] {
            assert_eq!(
                api_server(Some(bad), none.clone()),
                Err(ProxySettingsError::BadProxy(bad.into())),
                "{bad}"
            );
        }
        assert_eq!(
            api_server(None, (Some("10.96.0.1".into()), Some("443".into()))),
            Ok(("10.96.0.1".into(), 443))
        );
        assert_eq!(api_server(None, none), Err(ProxySettingsError::NoApiServer));
        assert!(api_server(None, (Some("h".into()), Some("x".into()))).is_err());
    }
}
