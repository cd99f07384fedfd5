//! The one trait behind which each cloud does what differs between clouds.
//!
//! The broker's pipeline is generic over it, so each cloud's binding type
//! stays typed from binding to exchange (no runtime "wrong variant" checks)
//! while the steps themselves — authenticate, bind, select, policy, cache,
//! exchange, audit — are written once.

use super::Bindings;
use super::{Cloud, Fetcher, Identity, Kind, RequestError, Selector, TokenRequest};
use crate::token::Caller;

/// One cloud, as the broker's pipeline sees it.
pub trait CloudExchanger: Send + Sync + 'static {
    /// What a ServiceAccount's bindings give this cloud: the identity and
    /// whatever the exchange needs to know about it.
    type Binding: Send + Sync + 'static;

    /// Which cloud this is.
    fn cloud(&self) -> Cloud;

    /// The audience callers' projected tokens must carry for this cloud.
    fn audience(&self) -> &str;

    /// The request kinds this cloud answers (besides [`Kind::Identity`],
    /// which every cloud answers).
    fn kinds(&self) -> &'static [Kind];

    /// The caller's bindings of this cloud from its ServiceAccount's, the
    /// default first; [`RequestError::NotBound`] when it has none.
    fn bind(
        &self,
        bindings: &Bindings,
        caller: &Caller,
    ) -> Result<Vec<Self::Binding>, RequestError>;

    /// The identity of a binding, as policy, audit and the surfaces see it.
    fn identity(&self, binding: &Self::Binding) -> Identity;

    /// Whether `selector` names the bound identity (and nothing else).
    fn selects(&self, binding: &Self::Binding, selector: &Selector) -> bool;

    /// Checks `request` for this binding and returns what distinguishes
    /// its credential from the binding's others: the cache key's scope
    /// (normalised resource, sorted scopes, ID-token audience, lifetime).
    fn scope(
        &self,
        binding: &Self::Binding,
        request: &TokenRequest,
    ) -> Result<String, RequestError>;

    /// The lifetime the credential for `request` will be asked for
    /// upstream (the caller's request, bounded, or the configured one), as
    /// a policy sees it; `None` (the default) where the cloud alone decides
    /// (Entra ID, Google ID tokens, Google's federated principal): what a
    /// caller asks for there is never sent upstream, so a policy must not
    /// judge it.
    fn lifetime(
        &self,
        _binding: &Self::Binding,
        _request: &TokenRequest,
    ) -> Option<std::time::Duration> {
        None
    }

    /// The exchange for `request`; built only on a cache miss, and kept by
    /// the cache to refresh ahead.
    fn fetcher(&self, binding: &Self::Binding, request: &TokenRequest, caller: &Caller) -> Fetcher;
}
