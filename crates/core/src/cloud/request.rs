//! The uniform request every surface makes, whatever cloud or wire format
//! it speaks, and the identity it is answered for.
//!
//! A surface parses its SDK's request (IMDS query parameters, a GCE
//! metadata path, an IMDSv2 role name) into one [`TokenRequest`]; the broker
//! runs the same steps for every request; the surface renders the grant or
//! the classified error. Everything the policy and the audit record need to
//! know about a request is here.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Cloud, Surface};

/// What is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// An OAuth access token (Entra ID, Google).
    AccessToken,
    /// An OIDC ID token for an audience (Google).
    IdToken,
    /// AWS session credentials.
    AwsCredentials,
    /// Which identity the caller has, without a credential (GCE's account
    /// listings, IMDS's role name): no exchange, no audit record.
    Identity,
}

impl Kind {
    /// The name used in audit records, metrics and policy actions.
    pub fn name(self) -> &'static str {
        match self {
            Kind::AccessToken => "access_token",
            Kind::IdToken => "id_token",
            Kind::AwsCredentials => "aws_credentials",
            Kind::Identity => "identity",
        }
    }
}

/// How a caller names the identity it wants. A selector never chooses
/// among identities: it only has to name the one bound to the caller's
/// service account, or the request is refused as "not found".
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Selector {
    /// Azure: the managed identity's client (application) id.
    ClientId(String),
    /// Azure: its object (principal) id.
    ObjectId(String),
    /// Azure: its ARM resource id.
    ResourceId(String),
    /// Google: the service account's email (GCE's `service-accounts/EMAIL`).
    Email(String),
    /// AWS: the role's name (IMDS's `security-credentials/ROLE`).
    RoleName(String),
}

impl Selector {
    /// The selector's value, for audit.
    pub fn value(&self) -> &str {
        match self {
            Selector::ClientId(v)
            | Selector::ObjectId(v)
            | Selector::ResourceId(v)
            | Selector::Email(v)
            | Selector::RoleName(v) => v,
        }
    }
}

/// One request, as every surface makes it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TokenRequest {
    /// The cloud asked for.
    pub cloud: Cloud,
    /// What is asked for.
    pub kind: Kind,
    /// The identity the caller named, if it named one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<Selector>,
    /// Azure: the resource or scope (one); Google: OAuth scopes (none means
    /// cloud-platform).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scopes: Vec<String>,
    /// ID tokens: the audience.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audience: Option<String>,
    /// ID tokens: carry the identity's email claims (GCE `format=full`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub include_email: bool,
    /// Lifetime the caller asked for; `None` takes the configured one.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "optional_seconds"
    )]
    pub lifetime: Option<Duration>,
    /// The endpoint the request came in on (for policy and audit; it does not
    /// change how the request is decided).
    pub surface: Surface,
}

impl TokenRequest {
    /// A request of `kind` for `cloud` from `surface`, naming no identity
    /// and no scope; set the rest with the struct's fields.
    pub fn new(cloud: Cloud, kind: Kind, surface: Surface) -> Self {
        TokenRequest {
            cloud,
            kind,
            selector: None,
            scopes: Vec::new(),
            audience: None,
            include_email: false,
            lifetime: None,
            surface,
        }
    }

    /// Names the identity wanted (`None`: the one bound, whatever it is).
    pub fn with_selector(mut self, selector: Option<Selector>) -> Self {
        self.selector = selector;
        self
    }

    /// Sets the resource or scopes (see [`TokenRequest::scopes`]).
    pub fn with_scopes(mut self, scopes: Vec<String>) -> Self {
        self.scopes = scopes;
        self
    }
}

/// Durations as whole seconds on the wire.
mod optional_seconds {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&d.as_secs()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_secs))
    }
}

/// The identity a request was answered for, as policy, audit and the
/// surfaces see it, whatever the cloud.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// The cloud the identity belongs to.
    pub cloud: Cloud,
    /// Azure client id, Google service-account email (or
    /// `PROJECT.svc.id.goog` for a federated principal used directly), AWS
    /// role ARN.
    pub id: String,
    /// Azure tenant, Google project id, AWS account.
    pub account: String,
    /// The account's number where the cloud has one (Google's project number).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub account_number: Option<String>,
    /// The identity this one is reached through, when it is chained (an
    /// AWS target role, assumed from the role the pod's token gives).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub via: Option<Via>,
    /// Where the first credential of the chain comes from.
    #[serde(default, skip_serializing_if = "Source::is_federation")]
    pub source: Source,
}

/// Where an identity's first credential comes from, as policy and audit
/// see it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// The pod's projected token, exchanged through the identity's
    /// federated credential or trust (every cloud).
    #[default]
    Federation,
    /// A managed identity assigned to the node (the node pool's VM scale
    /// set), from the node's IMDS (Azure): nothing of the pod's is sent
    /// upstream; Lanyard's proof of the caller and the policy decide.
    Node,
    /// The pod's projected token, exchanged by the cluster's AKS
    /// identity-binding proxy, which checks the ServiceAccount against
    /// Kubernetes RBAC and presents its own assertion to Entra (Azure).
    #[serde(rename = "identity-binding")]
    IdentityBinding,
}

impl Source {
    /// The name policy and audit use: `federation`, `node` or
    /// `identity-binding`.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Federation => "federation",
            Source::Node => "node",
            Source::IdentityBinding => "identity-binding",
        }
    }

    fn is_federation(&self) -> bool {
        *self == Source::Federation
    }
}

/// The first hop of a chained identity and what the second hop carries,
/// as policy and audit see them.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Via {
    /// The first hop's identity (the role assumed with the pod's token).
    pub id: String,
    /// Its account.
    pub account: String,
    /// Whether the second hop carries session tags.
    pub session_tags: bool,
    /// Whether the second hop carries an inline session policy.
    pub session_policy: bool,
}

impl Identity {
    /// The last path segment of the id (an AWS role ARN's role name).
    pub fn short_name(&self) -> &str {
        self.id.rsplit('/').next().unwrap_or(&self.id)
    }
}

/// Why a cloud cannot serve a request for a caller, before any exchange.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The ServiceAccount has no binding for this cloud.
    #[error("no binding")]
    NotBound,
    /// The request is malformed or out of bounds.
    #[error("{0}")]
    BadRequest(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_on_the_wire() {
        let mut r = TokenRequest::new(Cloud::Gcp, Kind::IdToken, Surface::Gce)
            .with_selector(Some(Selector::Email("a@b".into())));
        r.audience = Some("https://x".into());
        r.include_email = true;
        r.lifetime = Some(Duration::from_secs(900));
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["lifetime"], 900);
        assert_eq!(json["selector"]["email"], "a@b");
        let back: TokenRequest = serde_json::from_value(json).unwrap();
        assert_eq!(back, r);
        // Unset fields stay off the wire.
        let bare = TokenRequest::new(Cloud::Aws, Kind::AwsCredentials, Surface::AwsImds);
        assert_eq!(
            serde_json::to_string(&bare).unwrap(),
            r#"{"cloud":"aws","kind":"aws_credentials","surface":"aws_imds"}"#
        );
        assert!(serde_json::from_str::<TokenRequest>(
            r#"{"cloud":"aws","kind":"steal","surface":"aws_imds"}"#
        )
        .is_err());
    }

    #[test]
    fn short_names() {
        let id = Identity {
            cloud: Cloud::Aws,
            id: "arn:aws:iam::1:role/path/ray".into(),
            account: "1".into(),
            account_number: None,
            source: crate::cloud::Source::Federation,
            via: None,
        };
        assert_eq!(id.short_name(), "ray");
    }
}
