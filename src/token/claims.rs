//! The claim layout of a Kubernetes projected service-account token.

use crate::names::{is_dns_label, is_dns_subdomain};
use serde::{Deserialize, Serialize};

/// `aud` may be a single string or a list; Kubernetes always emits a list,
/// other issuers sometimes a string.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Audience {
    One(String),
    Many(Vec<String>),
}

impl Audience {
    pub fn contains(&self, aud: &str) -> bool {
        match self {
            Audience::One(a) => a == aud,
            Audience::Many(list) => list.iter().any(|a| a == aud),
        }
    }

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
    pub name: String,
    pub uid: String,
}

/// The private `kubernetes.io` claim of a bound service-account token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KubernetesClaim {
    pub namespace: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<ObjectRef>,
    pub serviceaccount: ObjectRef,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<ObjectRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<ObjectRef>,
}

/// Claims of a projected service-account token, as the kube-apiserver mints
/// them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceAccountClaims {
    pub iss: String,
    pub sub: String,
    pub aud: Audience,
    pub exp: u64,
    pub iat: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbf: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jti: Option<String>,
    #[serde(rename = "kubernetes.io")]
    pub kubernetes: KubernetesClaim,
}

/// Who is calling, as proven by a verified token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub namespace: String,
    pub service_account: String,
    pub service_account_uid: String,
    pub pod: Option<ObjectRef>,
    pub node: Option<ObjectRef>,
    /// Expiry of the presented token (Unix seconds).
    pub token_expires_at: u64,
    /// Fingerprint of the presented token, for logs and audit.
    pub token_fingerprint: String,
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
