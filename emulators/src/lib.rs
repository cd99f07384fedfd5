//! Emulators that stand in for what `lanyard dev` and the tests cannot reach:
//! a Kubernetes service-account token issuer and the clouds' token services.
//! Each validates requests the way the real service does (signatures against
//! the issuer's published keys, issuer/subject/audience matching, expiry)
//! and answers in the real service's error format. An emulator that accepted
//! anything would prove nothing.
//!
//! A crate of their own, not a module of `lanyard`: only `lanyard dev` (the
//! `dev` feature), the tests, the fake API server and the bench drivers
//! use them, and the compiler keeps it so. The product library does not
//! depend on this crate, so the agent, sidecar and webhook cannot reach for
//! an emulator; and this crate does not depend on the product, so it checks
//! the product's tokens and requests with code of its own (`jwks`, `claims`,
//! `arn`), not with the verifier it is there to test. The fake Kubernetes
//! API server is in the `lanyard-fake-kube` test-support crate.

pub mod arn;
pub mod aws;
pub mod claims;
pub mod entra;
pub mod faults;
pub mod gcp;
pub mod issuer;
pub mod jwks;
pub mod keys;
pub mod set;

pub use issuer::{Issuer, PodIdentity};
pub use keys::SigningKey;
pub use set::{Binding, CloudsConfig, EmulatorSet, Lifetimes};

/// Issuers' key sets as a cloud's token service keeps them: discovered on
/// first use, one per issuer, shared by all requests.
pub struct IssuerKeys {
    http: reqwest::Client,
    sets: std::sync::Mutex<std::collections::HashMap<String, std::sync::Arc<crate::jwks::KeySet>>>,
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

    /// Fetches the key sets of `issuers` now.
    pub async fn preload(
        &self,
        issuers: impl IntoIterator<Item = &str>,
    ) -> Result<(), crate::jwks::KeysError> {
        for issuer in issuers {
            self.get(issuer).preload().await?;
        }
        Ok(())
    }

    /// The key set of `issuer`, found by OIDC discovery. Callers ask only
    /// for issuers they have registered, so nothing can make an emulator
    /// fetch from an arbitrary URL.
    pub fn get(&self, issuer: &str) -> std::sync::Arc<crate::jwks::KeySet> {
        let mut sets = self.sets.lock().unwrap_or_else(|p| p.into_inner());
        sets.entry(issuer.to_string())
            .or_insert_with(|| {
                std::sync::Arc::new(crate::jwks::KeySet::new(
                    crate::jwks::KeySource::Discovery {
                        issuer: issuer.to_string(),
                    },
                    self.http.clone(),
                ))
            })
            .clone()
    }
}

/// What an emulator handed out and to whom, as the real service's own
/// records would show (Entra's sign-in log, CloudTrail, IAM audit logs):
/// tests ask it which identity a credential a pod received belongs to, and
/// how many exchanges each identity caused.
///
/// Bounded: it keeps the last [`Ledger::CAPACITY`] credentials; the counts
/// are per principal, of which an emulator knows a configured handful.
#[derive(Default)]
pub struct Ledger {
    inner: std::sync::Mutex<LedgerInner>,
}

#[derive(Default)]
struct LedgerInner {
    owners: std::collections::HashMap<String, String>,
    order: std::collections::VecDeque<String>,
    counts: std::collections::BTreeMap<String, u64>,
}

impl Ledger {
    /// Credentials remembered at most; the oldest are forgotten first.
    pub const CAPACITY: usize = 100_000;

    /// Records that `credential` was issued to `principal`.
    pub fn record(&self, credential: &str, principal: &str) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        *inner.counts.entry(principal.to_string()).or_default() += 1;
        if inner.order.len() >= Self::CAPACITY {
            if let Some(oldest) = inner.order.pop_front() {
                inner.owners.remove(&oldest);
            }
        }
        inner.order.push_back(credential.to_string());
        inner
            .owners
            .insert(credential.to_string(), principal.to_string());
    }

    /// The principal `credential` was issued to, if it was issued here.
    pub fn owner(&self, credential: &str) -> Option<String> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.owners.get(credential).cloned()
    }

    /// Issuances per principal since start.
    pub fn counts(&self) -> std::collections::BTreeMap<String, u64> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.counts.clone()
    }
}

#[cfg(test)]
mod ledger_tests {
    use super::Ledger;

    #[test]
    fn remembers_owners_and_counts_and_forgets_the_oldest_beyond_capacity() {
        let ledger = Ledger::default();
        ledger.record("c0", "alice");
        ledger.record("c1", "bob");
        ledger.record("c2", "alice");
        assert_eq!(ledger.owner("c1").as_deref(), Some("bob"));
        assert_eq!(ledger.owner("nope"), None);
        assert_eq!(ledger.counts().get("alice"), Some(&2));
        for i in 0..Ledger::CAPACITY {
            ledger.record(&format!("x{i}"), "carol");
        }
        assert_eq!(ledger.owner("c0"), None, "the oldest is forgotten");
        assert_eq!(ledger.owner("x0").as_deref(), Some("carol"));
        assert_eq!(ledger.counts().get("alice"), Some(&2), "counts are kept");
    }
}
