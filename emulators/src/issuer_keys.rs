//! Issuers' key sets, as a cloud's token service keeps them.

/// Issuers' key sets as a cloud's token service keeps them: discovered on
/// first use, one per issuer, shared by all requests.
pub struct IssuerKeys {
    http: reqwest::Client,
    sets: std::sync::Mutex<std::collections::HashMap<String, std::sync::Arc<crate::jwks::KeySet>>>,
    /// Origins (`https://host`) whose issuers are fetched from a stand-in
    /// (`http://127.0.0.1:PORT`) instead.
    stand_ins: std::sync::Mutex<Vec<(String, String)>>,
}

impl IssuerKeys {
    /// No key set yet; each is made on the first [`IssuerKeys::get`] of its
    /// issuer and fetches with `http`.
    pub fn new(http: reqwest::Client) -> Self {
        IssuerKeys {
            http,
            sets: Default::default(),
            stand_ins: Default::default(),
        }
    }

    /// Fetches the keys of issuers under `origin` (`https://host`) from
    /// `stand_in` (`http://127.0.0.1:PORT`), which serves the same paths:
    /// an issuer on the internet, emulated on loopback.
    pub fn stand_in(&self, origin: &str, stand_in: &str) {
        self.stand_ins
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((
                origin.trim_end_matches('/').to_string(),
                stand_in.trim_end_matches('/').to_string(),
            ));
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
        let source = {
            let stand_ins = self.stand_ins.lock().unwrap_or_else(|p| p.into_inner());
            let replaced = stand_ins.iter().find_map(|(origin, stand_in)| {
                let path = issuer.strip_prefix(origin.as_str())?;
                (path.is_empty() || path.starts_with('/')).then(|| format!("{stand_in}{path}"))
            });
            match replaced {
                Some(discovery_base) => crate::jwks::KeySource::StandIn {
                    issuer: issuer.to_string(),
                    discovery_base,
                },
                None => crate::jwks::KeySource::Discovery {
                    issuer: issuer.to_string(),
                },
            }
        };
        let mut sets = self.sets.lock().unwrap_or_else(|p| p.into_inner());
        sets.entry(issuer.to_string())
            .or_insert_with(|| {
                std::sync::Arc::new(crate::jwks::KeySet::new(source, self.http.clone()))
            })
            .clone()
    }
}
