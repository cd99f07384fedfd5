//! The built-in service-account token issuer: what kube-apiserver is to a
//! cluster, on loopback. Serves OIDC discovery and JWKS and mints tokens
//! with the real Kubernetes claim layout.

use std::sync::Arc;
use std::time::Duration;

use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

use super::keys::SigningKey;
use crate::claims::{Audience, KubernetesClaim, ObjectRef, ServiceAccountClaims};

/// The pod a token is minted for.
#[derive(Debug, Clone)]
pub struct PodIdentity {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's ServiceAccount name.
    pub service_account: String,
    /// The ServiceAccount's uid.
    pub service_account_uid: String,
    /// The pod's name.
    pub pod_name: String,
    /// The pod's uid, which a token bound to the pod carries.
    pub pod_uid: String,
    /// The node the pod is scheduled on.
    pub node_name: String,
    /// That node's uid.
    pub node_uid: String,
}

impl PodIdentity {
    /// A pod with fresh uids, as if just scheduled on `node_name`.
    pub fn new(namespace: &str, service_account: &str, pod_name: &str, node_name: &str) -> Self {
        PodIdentity {
            namespace: namespace.to_string(),
            service_account: service_account.to_string(),
            service_account_uid: uuid::Uuid::new_v4().to_string(),
            pod_name: pod_name.to_string(),
            pod_uid: uuid::Uuid::new_v4().to_string(),
            node_name: node_name.to_string(),
            node_uid: uuid::Uuid::new_v4().to_string(),
        }
    }

    /// The `sub` of the pod's tokens: `system:serviceaccount:NAMESPACE:NAME`.
    pub fn subject(&self) -> String {
        format!(
            "system:serviceaccount:{}:{}",
            self.namespace, self.service_account
        )
    }
}

/// An OIDC issuer of service-account tokens.
pub struct Issuer {
    url: String,
    keys: std::sync::RwLock<Keys>,
}

/// The key tokens are signed with, and the keys the JWKS publishes: the
/// signing key first, then the one it replaced (whose tokens stay valid
/// until they expire, as when kube-apiserver is given old and new keys).
struct Keys {
    signing: Arc<SigningKey>,
    previous: Option<Arc<SigningKey>>,
}

impl Issuer {
    /// An issuer named `url` (its `iss`, a trailing `/` dropped) signing with
    /// `key`.
    pub fn new(url: impl Into<String>, key: SigningKey) -> Self {
        Issuer {
            url: url.into().trim_end_matches('/').to_string(),
            keys: std::sync::RwLock::new(Keys {
                signing: Arc::new(key),
                previous: None,
            }),
        }
    }

    fn keys(&self) -> std::sync::RwLockReadGuard<'_, Keys> {
        // A poisoned lock still holds whole keys (they are only replaced).
        self.keys.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The issuer URL tokens carry as `iss`, without a trailing `/`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The key tokens are signed with now, whose public half the JWKS
    /// publishes first.
    pub fn key(&self) -> Arc<SigningKey> {
        self.keys().signing.clone()
    }

    /// Signs with `key` from now on; the JWKS publishes it and the key it
    /// replaces (an earlier one is dropped), as a cluster rotating its
    /// service-account key does.
    pub fn rotate(&self, key: SigningKey) {
        let mut keys = self.keys.write().unwrap_or_else(|e| e.into_inner());
        let previous = std::mem::replace(&mut keys.signing, Arc::new(key));
        keys.previous = Some(previous);
    }

    /// The JWKS document: `{"keys": [signing, previous?]}`.
    pub fn jwks(&self) -> serde_json::Value {
        let keys = self.keys();
        let published: Vec<&serde_json::Value> = std::iter::once(&keys.signing)
            .chain(keys.previous.as_ref())
            .map(|k| k.jwk())
            .collect();
        json!({ "keys": published })
    }

    /// The claims kube-apiserver would put in a projected token for `pod`.
    pub fn claims_for(
        &self,
        pod: &PodIdentity,
        audiences: &[&str],
        lifetime: Duration,
    ) -> ServiceAccountClaims {
        let now = jsonwebtoken::get_current_timestamp();
        ServiceAccountClaims {
            iss: self.url.clone(),
            sub: pod.subject(),
            aud: Audience::Many(audiences.iter().map(|a| a.to_string()).collect()),
            exp: now + lifetime.as_secs(),
            iat: now,
            nbf: Some(now),
            jti: Some(uuid::Uuid::new_v4().to_string()),
            kubernetes: KubernetesClaim {
                namespace: pod.namespace.clone(),
                pod: Some(ObjectRef {
                    name: pod.pod_name.clone(),
                    uid: pod.pod_uid.clone(),
                }),
                serviceaccount: ObjectRef {
                    name: pod.service_account.clone(),
                    uid: pod.service_account_uid.clone(),
                },
                node: Some(ObjectRef {
                    name: pod.node_name.clone(),
                    uid: pod.node_uid.clone(),
                }),
                secret: None,
            },
        }
    }

    /// Mints a projected token for `pod`.
    pub fn mint(
        &self,
        pod: &PodIdentity,
        audiences: &[&str],
        lifetime: Duration,
    ) -> anyhow::Result<String> {
        self.key().sign(&self.claims_for(pod, audiences, lifetime))
    }

    /// Signs arbitrary claims (tests use this to craft bad tokens).
    pub fn sign<T: serde::Serialize>(&self, claims: &T) -> anyhow::Result<String> {
        self.key().sign(claims)
    }

    /// Discovery and JWKS, at the paths kube-apiserver uses.
    pub fn router(self: &Arc<Self>) -> Router {
        let discovery = json!({
            "issuer": self.url,
            "jwks_uri": format!("{}/openid/v1/jwks", self.url),
            "response_types_supported": ["id_token"],
            "subject_types_supported": ["public"],
            "id_token_signing_alg_values_supported": ["RS256", "ES256"],
        });
        let issuer = self.clone();
        Router::new()
            .route(
                "/.well-known/openid-configuration",
                get(move || async move { Json(discovery) }),
            )
            .route(
                "/openid/v1/jwks",
                get(move || {
                    let jwks = issuer.jwks();
                    async move { Json(jwks) }
                }),
            )
    }
}
