//! Authorization policy. This module holds the seam: the one place where
//! the pipeline asks "may this caller have this identity, for this, from
//! here?".
//!
//! It is consulted exactly once per credential request, after the caller is
//! authenticated, its binding resolved and its selector matched, and before
//! the cache, so a changed policy bites on the very next request, cached
//! credential or not. Cloud-side trust (federated credentials, IAM trust
//! policies) says whether a service account *can* become an identity; a
//! policy says whether it *may*. The default, [`AllowBound`], allows what
//! the bindings allow; [`cedar::CedarPolicy`] answers from a Cedar policy
//! set (`docs/policy.md`).

pub mod cases;
pub mod cedar;
pub mod entities;
pub mod index;
pub mod load;
pub mod schema;

use std::time::{Duration, SystemTime};

use crate::cloud::{Cloud, Identity, Source, TokenRequest};
use crate::directory::Attributes;
use crate::token::Caller;

/// Everything a decision may look at.
pub struct PolicyInput<'a> {
    /// Who is asking, as its verified token proves.
    pub caller: &'a Caller,
    /// The identity the caller would get: bound to its ServiceAccount and
    /// matched by the request's selector, if it had one.
    pub identity: &'a Identity,
    /// What is asked for: kind, scopes or audience, lifetime, surface.
    pub request: &'a TokenRequest,
    /// Labels and annotations of the caller's ServiceAccount, namespace and
    /// pod; empty unless [`Policy::wants_attributes`] says so.
    pub attributes: &'a Attributes,
    /// The lifetime the credential will be asked for upstream: the
    /// caller's, bounded, or the configured one; `None` where the cloud
    /// alone decides (Entra ID, Google ID tokens).
    pub lifetime: Option<Duration>,
    /// When the request is decided.
    pub time: SystemTime,
}

/// A policy's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The request may proceed to the cache and, on a miss, the exchange.
    Allow {
        /// Ids of the policies that permitted (empty for the default).
        policies: Vec<String>,
    },
    /// The request is refused (the broker reports it as denied, 403).
    Deny {
        /// What users are told.
        reason: String,
        /// Ids of the policies that decided.
        policies: Vec<String>,
    },
}

/// An authorization policy.
pub trait Policy: Send + Sync {
    /// Decides one request. Called on the request path, cache hits included:
    /// it must not block.
    fn decide(&self, input: &PolicyInput<'_>) -> Decision;

    /// Whether decisions look at [`PolicyInput::attributes`]; when not, the
    /// pipeline does not fetch them.
    fn wants_attributes(&self) -> bool {
        false
    }
}

/// Allows what the ServiceAccount's bindings allow: the behaviour with no
/// policy configured; except a managed identity assigned to the node
/// ([`Source::Node`]), which is refused.
///
/// Why: a federated identity's cloud checks which ServiceAccount's token
/// it is given (the federated credential's subject, the role's trust). A
/// node identity's token comes from the node's IMDS, which asks nothing of
/// the pod: only a policy keeps other pods from it, and a ServiceAccount
/// annotation anyone with `edit` on ServiceAccounts can write is not one.
pub struct AllowBound;

/// What a pod asking for `cloud`'s node identity without a policy is told.
pub fn node_identity_needs_policy(cloud: Cloud) -> String {
    format!(
        "an identity assigned to the node ({}.node_identities) is served only under a Cedar policy that permits it: its token comes from the node's metadata service, which checks nothing of the pod (policy.dir; docs/policy.md, resource.source)",
        cloud.name()
    )
}

impl Policy for AllowBound {
    fn decide(&self, input: &PolicyInput<'_>) -> Decision {
        if input.identity.source == Source::Node {
            return Decision::Deny {
                reason: node_identity_needs_policy(input.identity.cloud),
                policies: Vec::new(),
            };
        }
        Decision::Allow {
            policies: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests;
