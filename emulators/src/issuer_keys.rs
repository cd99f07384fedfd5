//! Issuers' key sets, as a cloud's token service keeps them.

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
