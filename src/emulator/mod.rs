//! Emulators that stand in for what `lanyard dev` and the tests cannot reach:
//! a Kubernetes service-account token issuer and the clouds' token services.
//! Each validates requests the way the real service does (signatures against
//! the issuer's published keys, issuer/subject/audience matching, expiry)
//! and answers in the real service's error format. An emulator that accepted
//! anything would prove nothing.
//!
//! Only `lanyard dev` and the tests use them, so they are compiled only with
//! the `dev` feature: the agent, sidecar and webhook never reach for them.
//! The fake Kubernetes API server, which only tests use, is not here but in
//! the `lanyard-fake-kube` test-support crate (`tests/fake-kube`).

pub mod aws;
pub mod entra;
pub mod gcp;
pub mod issuer;
pub mod keys;

pub use issuer::{Issuer, PodIdentity};
pub use keys::SigningKey;

/// Issuers' key sets as a cloud's token service keeps them: discovered on
/// first use, one per issuer, shared by all requests.
pub struct IssuerKeys {
    http: reqwest::Client,
    sets: std::sync::Mutex<std::collections::HashMap<String, std::sync::Arc<crate::token::KeySet>>>,
}

impl IssuerKeys {
    /// No key set yet; each is made on the first [`IssuerKeys::get`] of its
    /// issuer and fetches with `http`.
    pub fn new(http: reqwest::Client) -> Self {
        IssuerKeys {
            http,
            sets: Default::default(),
        }
    }

    /// The key set of `issuer`, found by OIDC discovery. Callers ask only
    /// for issuers they have registered, so nothing can make an emulator
    /// fetch from an arbitrary URL.
    pub fn get(&self, issuer: &str) -> std::sync::Arc<crate::token::KeySet> {
        let mut sets = self.sets.lock().unwrap_or_else(|p| p.into_inner());
        sets.entry(issuer.to_string())
            .or_insert_with(|| {
                std::sync::Arc::new(crate::token::KeySet::new(
                    crate::token::KeySource::Discovery {
                        issuer: issuer.to_string(),
                    },
                    self.http.clone(),
                ))
            })
            .clone()
    }
}
