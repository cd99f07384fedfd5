//! The claim layout of a Kubernetes projected service-account token.

use crate::names::{is_dns_label, is_dns_subdomain};
use serde::{Deserialize, Serialize};

/// `aud` may be a single string or a list; Kubernetes always emits a list,
/// other issuers sometimes a string.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Audience {
    /// A single audience string.
    One(String),
    /// A list of audiences.
    Many(Vec<String>),
}

impl Audience {
    /// Whether `aud` is one of the audiences (exact, case-sensitive match).
    pub fn contains(&self, aud: &str) -> bool {
        match self {
            Audience::One(a) => a == aud,
            Audience::Many(list) => list.iter().any(|a| a == aud),
        }
    }

    /// The audiences, in token order.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        let slice: &[String] = match self {
            Audience::One(a) => std::slice::from_ref(a),
            Audience::Many(list) => list,
        };
        slice.iter().map(String::as_str)
    }
}

/// A named Kubernetes object reference inside the `kubernetes.io` claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectRef {
    /// The object's name.
    pub name: String,
    /// The object's uid, which tells apart objects that reuse a name.
    pub uid: String,
}

/// The private `kubernetes.io` claim of a bound service-account token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KubernetesClaim {
    /// The namespace of the ServiceAccount (and pod).
    pub namespace: String,
    /// The pod the token is bound to; `None` for a token not bound to a pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<ObjectRef>,
    /// The ServiceAccount the token was issued for.
    pub serviceaccount: ObjectRef,
    /// The node the pod runs on (Kubernetes 1.30 and later).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<ObjectRef>,
    /// The Secret a secret-bound token is bound to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<ObjectRef>,
}

/// Claims of a projected service-account token, as the kube-apiserver mints
/// them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceAccountClaims {
    /// The issuer: the cluster's `--service-account-issuer`.
    pub iss: String,
    /// `system:serviceaccount:NAMESPACE:NAME`.
    pub sub: String,
    /// The audiences the token was requested for.
    pub aud: Audience,
    /// Expiry, Unix seconds.
    pub exp: u64,
    /// Issue time, Unix seconds.
    pub iat: u64,
    /// Not valid before, Unix seconds; `None`: valid from issue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbf: Option<u64>,
    /// The token's unique id, when the issuer sets one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jti: Option<String>,
    /// The `kubernetes.io` claim: namespace, ServiceAccount, pod and node.
    #[serde(rename = "kubernetes.io")]
    pub kubernetes: KubernetesClaim,
}

/// Who is calling, as proven by a verified token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The caller's namespace.
    pub namespace: String,
    /// The caller's ServiceAccount name.
    pub service_account: String,
    /// That ServiceAccount's uid.
    pub service_account_uid: String,
    /// The pod the token is bound to; the broker refuses callers without one.
    pub pod: Option<ObjectRef>,
    /// The node the token names, when the issuer adds it.
    pub node: Option<ObjectRef>,
    /// Expiry of the presented token (Unix seconds).
    pub token_expires_at: u64,
    /// Fingerprint of the presented token, for logs and audit.
    pub token_fingerprint: String,
}

#[cfg(test)]
impl Caller {
    /// A caller for tests: pod `ray-worker-0` of `team-a/ray-worker` on
    /// `node-1`.
    pub(crate) fn example() -> Caller {
        Caller {
            namespace: "team-a".into(),
            service_account: "ray-worker".into(),
            service_account_uid: "sa-uid".into(),
            pod: Some(ObjectRef {
                name: "ray-worker-0".into(),
                uid: "pod-uid".into(),
            }),
            node: Some(ObjectRef {
                name: "node-1".into(),
                uid: "node-uid".into(),
            }),
            token_expires_at: 0,
            token_fingerprint: "sha256:x".into(),
        }
    }
}

/// Splits `system:serviceaccount:NS:SA` into its namespace and name.
pub fn parse_subject(sub: &str) -> Option<(&str, &str)> {
    let rest = sub.strip_prefix("system:serviceaccount:")?;
    let (ns, sa) = rest.split_once(':')?;
    // A namespace is a DNS-1123 label, a service account name a subdomain.
    (is_dns_label(ns) && is_dns_subdomain(sa)).then_some((ns, sa))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subject_parsing() {
        assert_eq!(
            parse_subject("system:serviceaccount:default:ray-worker"),
            Some(("default", "ray-worker"))
        );
        assert_eq!(parse_subject("system:serviceaccount:default"), None);
        assert_eq!(parse_subject("system:serviceaccount::sa"), None);
        assert_eq!(parse_subject("system:serviceaccount:ns:sa:extra"), None);
        assert_eq!(parse_subject("user:alice"), None);
        assert_eq!(parse_subject("system:serviceaccount:NS:sa"), None);
        assert_eq!(
            parse_subject("system:serviceaccount:kube-system:a.b"),
            Some(("kube-system", "a.b"))
        );
        // A namespace cannot contain '.'; no name may start with '-'.
        assert_eq!(parse_subject("system:serviceaccount:a.b:sa"), None);
        assert_eq!(parse_subject("system:serviceaccount:ns:-sa"), None);
    }

    #[test]
    fn audience_string_or_list() {
        let one: Audience = serde_json::from_str("\"a\"").unwrap();
        let many: Audience = serde_json::from_str("[\"a\",\"b\"]").unwrap();
        assert!(one.contains("a") && !one.contains("b"));
        assert!(many.contains("b"));
        assert_eq!(many.iter().collect::<Vec<_>>(), vec!["a", "b"]);
    }
}
