//! Key sets of token issuers: OIDC discovery, JWKS fetch, caching, and a
//! rate-limited refetch when a token names a key we have not seen (issuers
//! rotate keys; an attacker must not be able to make us fetch on every
//! request by inventing `kid`s).

use std::sync::Arc;
use std::time::{Duration, Instant};

use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::DecodingKey;
use serde::Deserialize;
use tokio::sync::Mutex;

/// Where to find an issuer's keys.
#[derive(Clone)]
pub enum KeySource {
    /// `{issuer}/.well-known/openid-configuration` names the `jwks_uri`.
    Discovery {
        /// The issuer URL, exactly as tokens carry it in `iss`; the
        /// discovery document must name the same issuer.
        issuer: String,
    },
    /// A JWKS document at a fixed URL.
    Jwks {
        /// The JWKS document's URL.
        url: String,
    },
    /// `/openid/v1/jwks` through the Kubernetes API, with the client's own
    /// credentials (works where the issuer is not publicly reachable).
    KubeApi {
        /// The client whose credentials read the API server's
        /// `/openid/v1/jwks`.
        client: kube::Client,
    },
}

/// Why keys could not be obtained.
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    /// The document could not be fetched: unreachable, or not a 2xx.
    #[error("fetching {url} failed: {reason}")]
    Fetch {
        /// The document's URL (or `kubernetes API PATH`).
        url: String,
        /// What failed: the transport error, or `HTTP STATUS`.
        reason: String,
    },
    /// The document was fetched but is not what it should be.
    #[error("{url} is not a valid {what} document: {reason}")]
    Parse {
        /// The document's URL (or `kubernetes API PATH`).
        url: String,
        /// Which document was expected (`JWKS`, `OIDC discovery`).
        what: &'static str,
        /// The JSON error.
        reason: String,
    },
    /// The discovery document names another issuer than the one asked,
    /// so its keys cannot be trusted for this issuer's tokens.
    #[error("discovery document of {issuer} names issuer {found}")]
    IssuerMismatch {
        /// The issuer whose document was fetched.
        issuer: String,
        /// The issuer the document names.
        found: String,
    },
}

/// The parts of an OIDC discovery document Lanyard reads.
#[derive(Deserialize)]
pub struct Discovery {
    /// The issuer the document describes; must equal the one asked for.
    pub issuer: String,
    /// Where the issuer's JWKS is published.
    pub jwks_uri: String,
}

struct Cached {
    keys: Arc<JwkSet>,
    fetched_at: Instant,
}

/// A cached, refreshable key set for one issuer.
pub struct KeySet {
    source: KeySource,
    http: reqwest::Client,
    /// Minimum time between two fetches triggered by unknown `kid`s.
    refetch_interval: Duration,
    /// Keys older than this are refetched on the next use.
    max_age: Duration,
    state: Mutex<Option<Cached>>,
}

/// The outcome of looking up a key id.
pub enum Lookup {
    /// The key, ready to verify with, and the JWK it came from (whose `alg`,
    /// when set, binds the key to that algorithm).
    Found(Box<DecodingKey>, Box<Jwk>),
    /// Not in the set, even after a (rate-limited) refetch.
    Unknown,
}

impl KeySet {
    /// A key set fetched from `source` on first use, refetched once an hour,
    /// and at most every ten seconds for an unknown `kid`.
    pub fn new(source: KeySource, http: reqwest::Client) -> Self {
        KeySet {
            source,
            http,
            refetch_interval: Duration::from_secs(10),
            max_age: Duration::from_secs(3600),
            state: Mutex::new(None),
        }
    }

    /// Sets the minimum interval between refetches caused by unknown keys.
    pub fn with_refetch_interval(mut self, interval: Duration) -> Self {
        self.refetch_interval = interval;
        self
    }

    /// Finds the key named `kid` (or, when the token has no `kid`, the only
    /// key of the set), refetching once if it is unknown and the rate limit
    /// allows.
    pub async fn lookup(&self, kid: Option<&str>) -> Result<Lookup, KeysError> {
        let mut state = self.state.lock().await;
        let stale = match &*state {
            None => true,
            Some(c) => c.fetched_at.elapsed() >= self.max_age,
        };
        if stale {
            *state = Some(self.fetch().await?);
        }
        if let Some(found) = state.as_ref().and_then(|c| find(&c.keys, kid)) {
            return Ok(found);
        }
        let may_refetch = state
            .as_ref()
            .is_none_or(|c| c.fetched_at.elapsed() >= self.refetch_interval);
        if !may_refetch || stale {
            return Ok(Lookup::Unknown);
        }
        *state = Some(self.fetch().await?);
        Ok(state
            .as_ref()
            .and_then(|c| find(&c.keys, kid))
            .unwrap_or(Lookup::Unknown))
    }

    async fn fetch(&self) -> Result<Cached, KeysError> {
        let keys: JwkSet = match &self.source {
            KeySource::KubeApi { client } => kube_get(client, "/openid/v1/jwks", "JWKS").await?,
            KeySource::Jwks { url } => self.get_json(url, "JWKS").await?,
            KeySource::Discovery { issuer } => {
                let url = format!(
                    "{}/.well-known/openid-configuration",
                    issuer.trim_end_matches('/')
                );
                let doc: Discovery = self.get_json(&url, "OIDC discovery").await?;
                if doc.issuer.trim_end_matches('/') != issuer.trim_end_matches('/') {
                    return Err(KeysError::IssuerMismatch {
                        issuer: issuer.clone(),
                        found: doc.issuer,
                    });
                }
                self.get_json(&doc.jwks_uri, "JWKS").await?
            }
        };
        tracing::debug!(keys = keys.keys.len(), "fetched issuer keys");
        Ok(Cached {
            keys: Arc::new(keys),
            fetched_at: Instant::now(),
        })
    }

    async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        url: &str,
        what: &'static str,
    ) -> Result<T, KeysError> {
        let fetch_err = |reason: String| KeysError::Fetch {
            url: url.to_string(),
            reason,
        };
        let resp = self
            .http
            .get(url)
            .header("accept", "application/json")
            .send()
            .await
            .map_err(|e| fetch_err(e.without_url().to_string()))?;
        if !resp.status().is_success() {
            return Err(fetch_err(format!("HTTP {}", resp.status())));
        }
        let body = resp
            .bytes()
            .await
            .map_err(|e| fetch_err(e.without_url().to_string()))?;
        serde_json::from_slice(&body).map_err(|e| KeysError::Parse {
            url: url.to_string(),
            what,
            reason: e.to_string(),
        })
    }
}

/// GETs a JSON document from the Kubernetes API server.
pub async fn kube_get<T: serde::de::DeserializeOwned>(
    client: &kube::Client,
    path: &str,
    what: &'static str,
) -> Result<T, KeysError> {
    let request = axum::http::Request::get(path)
        .body(Vec::new())
        .map_err(|e| KeysError::Fetch {
            url: path.to_string(),
            reason: e.to_string(),
        })?;
    let text = client
        .request_text(request)
        .await
        .map_err(|e| KeysError::Fetch {
            url: format!("kubernetes API {path}"),
            reason: e.to_string(),
        })?;
    serde_json::from_str(&text).map_err(|e| KeysError::Parse {
        url: format!("kubernetes API {path}"),
        what,
        reason: e.to_string(),
    })
}

fn find(keys: &JwkSet, kid: Option<&str>) -> Option<Lookup> {
    let jwk = match kid {
        Some(kid) => keys.find(kid)?,
        None if keys.keys.len() == 1 => &keys.keys[0],
        None => return None,
    };
    let key = DecodingKey::from_jwk(jwk).ok()?;
    Some(Lookup::Found(Box::new(key), Box::new(jwk.clone())))
}
