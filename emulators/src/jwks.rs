//! An issuer's signing keys as a cloud's token service fetches them: OIDC
//! discovery (`{issuer}/.well-known/openid-configuration`, whose `issuer`
//! must be the issuer asked for) names the `jwks_uri`, and the JWKS there
//! holds the keys by `kid`. Kept for an hour; a `kid` not in the set makes
//! it fetch again, at most every ten seconds, so a rotated key is picked
//! up as the clouds pick it up. When a fetch fails the keys fetched before
//! are kept.
//!
//! Written for the emulators alone (no code shared with the product's
//! verifier), so that the emulators check the product's tokens with an
//! implementation of their own.

use std::time::Duration;

use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::DecodingKey;
use tokio::sync::Mutex;
use tokio::time::Instant;

/// How long fetched keys are used before they are fetched again.
const MAX_AGE: Duration = Duration::from_secs(3600);
/// Fetches for an unknown `kid` come at most this often.
const REFETCH_INTERVAL: Duration = Duration::from_secs(10);

/// Where the keys are published.
#[derive(Debug, Clone)]
pub enum KeySource {
    /// OIDC discovery under the issuer URL.
    Discovery {
        /// The issuer, as tokens carry it in `iss`.
        issuer: String,
    },
    /// OIDC discovery of `issuer` fetched from a stand-in for its host
    /// (an issuer on the internet the tests cannot reach): the document
    /// must still name `issuer`.
    StandIn {
        /// The issuer, as tokens carry it in `iss`.
        issuer: String,
        /// Where its discovery document is fetched: the issuer URL with
        /// its origin replaced by the stand-in's.
        discovery_base: String,
    },
}

/// A key fetch that failed.
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    /// The document could not be fetched: unreachable, or not a 2xx.
    #[error("fetching {url} failed: {reason}")]
    Fetch {
        /// The document's URL.
        url: String,
        /// The transport error, or `HTTP STATUS`.
        reason: String,
    },
    /// The document is not what it should be.
    #[error("{url} is not a valid {what} document: {reason}")]
    Parse {
        /// The document's URL.
        url: String,
        /// `OIDC discovery` or `JWKS`.
        what: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

/// What a `kid` finds.
pub enum Lookup {
    /// The key, ready to verify with, and the JWK it came from.
    Found(Box<DecodingKey>, Box<Jwk>),
    /// Not in the set, even after a (rate-limited) fetch.
    Unknown,
}

#[derive(Default)]
struct Fetched {
    /// Each usable key, parsed once when fetched.
    keys: Vec<(Jwk, DecodingKey)>,
    /// When the keys were fetched; `None` before the first success.
    at: Option<Instant>,
    /// When a fetch was last tried.
    tried: Option<Instant>,
}

/// One issuer's keys.
pub struct KeySet {
    source: KeySource,
    http: reqwest::Client,
    fetched: Mutex<Fetched>,
}

#[derive(serde::Deserialize)]
struct Discovery {
    issuer: String,
    jwks_uri: String,
}

impl KeySet {
    /// Keys published at `source`, fetched with `http` on first use.
    pub fn new(source: KeySource, http: reqwest::Client) -> Self {
        KeySet {
            source,
            http,
            fetched: Mutex::default(),
        }
    }

    /// Fetches the keys now.
    pub async fn preload(&self) -> Result<(), KeysError> {
        let mut fetched = self.fetched.lock().await;
        self.fetch(&mut fetched).await
    }

    /// The key named `kid` (with no `kid`, the set's only key).
    pub async fn lookup(&self, kid: Option<&str>) -> Result<Lookup, KeysError> {
        let mut fetched = self.fetched.lock().await;
        let fresh = fetched.at.is_some_and(|at| at.elapsed() < MAX_AGE);
        if !fresh {
            if let Err(e) = self.fetch(&mut fetched).await {
                if fetched.keys.is_empty() {
                    return Err(e);
                }
            }
        }
        if let Some(found) = find(&fetched.keys, kid) {
            return Ok(found);
        }
        let may_refetch = fetched
            .tried
            .is_none_or(|t| t.elapsed() >= REFETCH_INTERVAL);
        if fresh && may_refetch {
            // A rotated key: fetch again, once.
            if let Err(e) = self.fetch(&mut fetched).await {
                tracing::debug!(error = %e, "emulator: fetching rotated keys failed");
            }
            if let Some(found) = find(&fetched.keys, kid) {
                return Ok(found);
            }
        }
        Ok(Lookup::Unknown)
    }

    async fn fetch(&self, fetched: &mut Fetched) -> Result<(), KeysError> {
        fetched.tried = Some(Instant::now());
        let (issuer, base) = match &self.source {
            KeySource::Discovery { issuer } => (issuer, issuer),
            KeySource::StandIn {
                issuer,
                discovery_base,
            } => (issuer, discovery_base),
        };
        let issuer = issuer.trim_end_matches('/');
        let url = format!(
            "{}/.well-known/openid-configuration",
            base.trim_end_matches('/')
        );
        let discovery: Discovery = self.get_json(&url, "OIDC discovery").await?;
        if discovery.issuer.trim_end_matches('/') != issuer {
            return Err(KeysError::Parse {
                url,
                what: "OIDC discovery",
                reason: format!("issuer {:?} is not {issuer:?}", discovery.issuer),
            });
        }
        let set: JwkSet = self.get_json(&discovery.jwks_uri, "JWKS").await?;
        // A key that cannot verify anything (an unknown type) is left out,
        // as if the issuer had not published it.
        fetched.keys = set
            .keys
            .into_iter()
            .filter_map(|jwk| DecodingKey::from_jwk(&jwk).ok().map(|key| (jwk, key)))
            .collect();
        fetched.at = Some(Instant::now());
        Ok(())
    }

    async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        url: &str,
        what: &'static str,
    ) -> Result<T, KeysError> {
        let fail = |reason: String| KeysError::Fetch {
            url: url.to_string(),
            reason,
        };
        let response = self
            .http
            .get(url)
            .send()
            .await
            .map_err(|e| fail(e.without_url().to_string()))?;
        if !response.status().is_success() {
            return Err(fail(format!("HTTP {}", response.status())));
        }
        let body = response
            .bytes()
            .await
            .map_err(|e| fail(e.without_url().to_string()))?;
        serde_json::from_slice(&body).map_err(|e| KeysError::Parse {
            url: url.to_string(),
            what,
            reason: e.to_string(),
        })
    }
}

/// The key named `kid` in `keys`, usable to verify with.
fn find(keys: &[(Jwk, DecodingKey)], kid: Option<&str>) -> Option<Lookup> {
    let (jwk, key) = match kid {
        Some(kid) => keys
            .iter()
            .find(|(k, _)| k.common.key_id.as_deref() == Some(kid))?,
        None if keys.len() == 1 => &keys[0],
        None => return None,
    };
    Some(Lookup::Found(Box::new(key.clone()), Box::new(jwk.clone())))
}
