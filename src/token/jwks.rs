//! Key sets of token issuers: OIDC discovery, JWKS fetch, caching, and a
//! rate-limited refetch when a token names a key we have not seen (issuers
//! rotate keys; an attacker must not be able to make us fetch on every
//! request by inventing `kid`s).
//!
//! An issuer that cannot be reached when its keys are due for a refresh
//! does not stop verification: the last key set fetched stays in use, for
//! at most [`KeySet::with_ages`]'s stale limit (a day by default), and the
//! refresh is retried at most once per refetch interval, so an outage of
//! the API server's `/openid/v1/jwks` neither refuses every new pod nor
//! turns each verification into a fetch that waits for a timeout. Keys
//! the issuer stopped publishing are honoured that much longer; the
//! tokens they signed still expire on their own (docs/threat-model.md).

use std::sync::Arc;
use std::time::{Duration, Instant};

use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::DecodingKey;
use lanyard_core::token::KeysError;
use serde::Deserialize;
use tokio::sync::{Mutex, OwnedMutexGuard};

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

impl KeySource {
    /// Where the keys come from, for errors.
    fn describe(&self) -> String {
        match self {
            KeySource::Discovery { issuer } => format!("{issuer} (OIDC discovery)"),
            KeySource::Jwks { url } => url.clone(),
            KeySource::KubeApi { .. } => "kubernetes API /openid/v1/jwks".into(),
        }
    }
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

/// The longest one fetch of the keys (discovery and JWKS) may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(15);

/// The key set and when a fetch was last attempted.
#[derive(Default)]
struct State {
    cached: Option<Cached>,
    /// The last fetch attempt, successful or not: refetches (for an
    /// unknown `kid` or a stale set) are at most one per refetch interval.
    attempted_at: Option<Instant>,
    /// Whether that attempt failed: an unknown `kid` is then unchecked,
    /// not unknown.
    attempt_failed: bool,
}

/// Where a key set is fetched from, and with which client.
#[derive(Clone)]
struct Fetcher {
    source: KeySource,
    http: reqwest::Client,
}

/// A cached, refreshable key set for one issuer.
pub struct KeySet {
    fetcher: Fetcher,
    /// Minimum time between two fetches triggered by unknown `kid`s.
    refetch_interval: Duration,
    /// Keys older than this are refetched on the next use.
    max_age: Duration,
    /// Keys older than this are not used even when a refetch fails.
    stale_limit: Duration,
    // INVARIANT: held across a fetch, so concurrent lookups wait for one
    // fetch instead of starting their own (the HTTP clients have timeouts).
    state: Arc<Mutex<State>>,
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
    /// A key set fetched from `source` on first use, refetched once an hour
    /// (keeping the old set for up to a day while the issuer cannot be
    /// reached), and at most every ten seconds for an unknown `kid`.
    pub fn new(source: KeySource, http: reqwest::Client) -> Self {
        KeySet {
            fetcher: Fetcher { source, http },
            refetch_interval: Duration::from_secs(10),
            max_age: Duration::from_secs(3600),
            stale_limit: Duration::from_secs(24 * 3600),
            state: Arc::new(Mutex::new(State::default())),
        }
    }

    /// Sets the minimum interval between refetches caused by unknown keys
    /// or by a failed refresh.
    pub fn with_refetch_interval(mut self, interval: Duration) -> Self {
        self.refetch_interval = interval;
        self
    }

    /// Sets the age at which keys are refreshed, and the age past which
    /// they are no longer used when the refresh keeps failing.
    pub fn with_ages(mut self, max_age: Duration, stale_limit: Duration) -> Self {
        self.max_age = max_age;
        self.stale_limit = stale_limit.max(max_age);
        self
    }

    /// Fetches the keys now: at start-up, so that the first tokens do not
    /// wait for them (a herd of first requests would, all of it, behind one
    /// fetch), and so that an issuer that cannot be reached is reported at
    /// once.
    pub async fn preload(&self) -> Result<(), KeysError> {
        let state = self.state.clone().lock_owned().await;
        self.refresh(state).await.1
    }

    /// Finds the key named `kid` (or, when the token has no `kid`, the only
    /// key of the set), refetching once if it is unknown and the rate limit
    /// allows.
    pub async fn lookup(&self, kid: Option<&str>) -> Result<Lookup, KeysError> {
        let mut state = self.state.clone().lock_owned().await;
        let age = state.cached.as_ref().map(|c| c.fetched_at.elapsed());
        let may_refetch = state
            .attempted_at
            .is_none_or(|at| at.elapsed() >= self.refetch_interval);
        // Whether a fetch ran for this lookup, and how it failed.
        let mut fetched: Option<Result<(), KeysError>> = None;
        match age {
            // Nothing to verify with: fetch, but not more than once per
            // interval, or every caller in an outage would wait in turn
            // for its own fetch to time out.
            None if may_refetch => {
                let result;
                (state, result) = self.refresh(state).await;
                fetched = Some(result);
            }
            None => return Err(self.unavailable("the last attempt failed")),
            Some(age) if age >= self.max_age && may_refetch => {
                let result;
                (state, result) = self.refresh(state).await;
                if let Err(e) = &result {
                    tracing::warn!(
                        error = %e,
                        age_seconds = age.as_secs(),
                        "cannot refresh the issuer's keys; verifying with the last keys fetched"
                    );
                }
                fetched = Some(result);
            }
            Some(_) => {}
        }
        match state.cached.as_ref() {
            None => {
                return Err(match fetched {
                    Some(Err(e)) => e,
                    _ => self.unavailable("the last attempt failed"),
                })
            }
            Some(c) if c.fetched_at.elapsed() >= self.stale_limit => {
                return Err(match fetched {
                    Some(Err(e)) => e,
                    _ => self.unavailable("the keys fetched last are too old to use"),
                })
            }
            Some(c) => {
                if let Some(found) = find(&c.keys, kid) {
                    return Ok(found);
                }
            }
        }
        // An unknown key: a failed fetch says nothing about it (the issuer
        // may have rotated to it), a successful one does.
        match fetched {
            Some(Err(e)) => return Err(e),
            Some(Ok(())) => return Ok(Lookup::Unknown),
            // Not a verdict when the last attempt failed: the issuer may
            // have rotated to this key since the keys were last fetched.
            None if !may_refetch && state.attempt_failed => {
                return Err(KeysError::NotRefetched {
                    interval_seconds: self.refetch_interval.as_secs(),
                })
            }
            // Fetched within the interval, without this key.
            None if !may_refetch => return Ok(Lookup::Unknown),
            None => {}
        }
        let result;
        (state, result) = self.refresh(state).await;
        result?;
        Ok(state
            .cached
            .as_ref()
            .and_then(|c| find(&c.keys, kid))
            .unwrap_or(Lookup::Unknown))
    }

    fn unavailable(&self, reason: &str) -> KeysError {
        self.fetcher.unavailable(reason)
    }

    /// Fetches the key set into `state`; on failure the cached set is kept.
    // INVARIANT: the fetch runs in a task of its own, which holds the lock
    // until the outcome is recorded. A lookup cancelled while it waits (its
    // client went away) neither cancels the fetch nor loses what it found:
    // every attempt recorded, and so rate-limited, is one that finished.
    async fn refresh(
        &self,
        mut state: OwnedMutexGuard<State>,
    ) -> (OwnedMutexGuard<State>, Result<(), KeysError>) {
        let fetcher = self.fetcher.clone();
        let fetch = tokio::spawn(async move {
            state.attempted_at = Some(Instant::now());
            state.attempt_failed = true;
            // Every outbound call has a bound; this one holds the key set's
            // lock, so it bounds every verification waiting on it too.
            let result = match tokio::time::timeout(FETCH_TIMEOUT, fetcher.fetch()).await {
                Ok(Ok(fetched)) => {
                    state.cached = Some(fetched);
                    state.attempt_failed = false;
                    Ok(())
                }
                Ok(Err(e)) => Err(e),
                Err(_) => Err(fetcher.unavailable("timed out")),
            };
            (state, result)
        });
        match fetch.await {
            Ok(done) => done,
            // The fetch panicked (the lock went with it) or the runtime is
            // shutting down.
            Err(e) => (
                self.state.clone().lock_owned().await,
                Err(self.unavailable(&e.to_string())),
            ),
        }
    }
}

impl Fetcher {
    fn unavailable(&self, reason: &str) -> KeysError {
        KeysError::Fetch {
            url: self.source.describe(),
            reason: reason.to_string(),
        }
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
