//! The JSON the emulators read from and write into tokens: the
//! `kubernetes.io` service-account claims kube-apiserver mints (the
//! issuer writes them; the clouds read `iss`, `sub`, `aud`, `exp`), in
//! the layout the Kubernetes documentation gives, written here
//! independently of the product's reader.

use serde::{Deserialize, Serialize};

/// `aud`: one string or a list, as JWTs allow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Audience {
    /// A single audience string.
    One(String),
    /// A list of audiences.
    Many(Vec<String>),
}

impl Audience {
    /// The audiences, in token order.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        let slice: &[String] = match self {
            Audience::One(a) => std::slice::from_ref(a),
            Audience::Many(list) => list,
        };
        slice.iter().map(String::as_str)
    }
}

/// A named object inside the `kubernetes.io` claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectRef {
    /// The object's name.
    pub name: String,
    /// The object's uid.
    pub uid: String,
}

/// The `kubernetes.io` claim of a projected service-account token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KubernetesClaim {
    /// The pod's namespace.
    pub namespace: String,
    /// The ServiceAccount.
    pub serviceaccount: ObjectRef,
    /// The pod the token is bound to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<ObjectRef>,
    /// The node the pod runs on (Kubernetes 1.30 and later).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<ObjectRef>,
    /// A Secret the token is bound to (legacy tokens).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<ObjectRef>,
}

/// A projected service-account token's claims.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceAccountClaims {
    /// The issuer.
    pub iss: String,
    /// `system:serviceaccount:NAMESPACE:NAME`.
    pub sub: String,
    /// The audiences the token was requested for.
    pub aud: Audience,
    /// Expiry, Unix seconds.
    pub exp: u64,
    /// Issue time, Unix seconds.
    pub iat: u64,
    /// Not valid before, Unix seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbf: Option<u64>,
    /// The token's unique id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jti: Option<String>,
    /// Namespace, ServiceAccount, pod and node.
    #[serde(rename = "kubernetes.io")]
    pub kubernetes: KubernetesClaim,
}

/// `len` random bytes, base64url without padding: access tokens, keys.
pub fn random_token(len: usize) -> String {
    use aws_lc_rs::rand::SecureRandom;
    use base64::Engine;
    let mut buf = vec![0u8; len];
    // The system RNG failing leaves an emulator nothing to issue.
    aws_lc_rs::rand::SystemRandom::new()
        .fill(&mut buf)
        .expect("system random number generator failed");
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(buf)
}
