//! The sidecar's short reuse of the agent's grants.
//!
//! Every request through the sidecar used to cross to the node agent: two
//! HTTP exchanges, two JSON codings and the agent's decision for each SDK
//! call, which held cached-hit throughput through the sidecar to about a
//! third of the direct path (the sidecar spent more CPU per request than
//! the agent). Most of those calls repeat one another: a process without
//! a token cache of its own, or many processes of one pod, asking again
//! within seconds for what the agent has just decided.
//!
//! [`ReusingBroker`] keeps each successful grant for a short window
//! (`sidecar.grant_reuse_seconds`, 10 s by default) and answers the *same*
//! request made with the *same* projected token from it, without asking
//! the agent again. What that means, decided deliberately:
//!
//! - **Same caller, same question.** Grants are kept per projected token
//!   (compared byte for byte) and, under it, per whole request (cloud,
//!   kind, selector, scopes, audience, lifetime, surface). A rotated token
//!   or a different question goes to the agent. The sidecar serves one pod
//!   on loopback, so nothing crosses between pods. The key is the request
//!   itself and the token a plain comparison: no encoding and no digest on
//!   the path every reused answer takes (they were a JSON encoding and a
//!   SHA-256 of the token on every request, hit or miss; a pod has one
//!   token per cloud, so the comparison runs once or twice).
//! - **Decisions, policy and revocation.** The agent decides and audits
//!   every grant it issues; a reuse is not a new decision, as an SDK's own
//!   token cache is not. A policy change, a deleted pod or ServiceAccount,
//!   or a changed binding therefore takes effect in the sidecar within the
//!   window. SDKs keep credentials for their whole life (up to an hour)
//!   anyway, so the window adds little to what revocation could reach.
//!   Setting the window to 0 sends every request to the agent.
//! - **Freshness.** A grant is reused only while its credential keeps more
//!   than the cloud's minimum remaining lifetime, the same rule the agent's
//!   cache serves by, so an SDK never gets a credential it would refresh at
//!   once.
//! - **Failures are never kept**: a refusal or an unavailable agent is
//!   asked again on the next request.
//! - **Bounded**: at most [`MAX_ENTRIES`] grants; expired ones are dropped
//!   when the map is full, and if it is still full the grant is simply not
//!   kept.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use lanyard_core::cloud::{now_unix, TokenRequest};
use lanyard_core::grant::{BrokerError, Grant, TokenBroker};
use lanyard_core::secret::{ExposeSecret, SecretString};
// tokio's clock, so that tests on paused time can move the window.
use tokio::time::Instant;

/// Most grants kept: one pod asks for a handful of distinct things.
pub const MAX_ENTRIES: usize = 256;

struct Kept {
    grant: Grant,
    until: Instant,
}

/// The grants kept for one projected token, by request.
struct ForToken {
    token: SecretString,
    kept: HashMap<TokenRequest, Kept>,
}

/// A broker that reuses `inner`'s grants for a short window (see the
/// module documentation).
pub struct ReusingBroker<B> {
    inner: B,
    window: Duration,
    /// One entry per projected token seen within the window: a pod has
    /// one per cloud (two while the kubelet rotates one).
    tokens: Mutex<Vec<ForToken>>,
}

impl<B> ReusingBroker<B> {
    /// Reuses `inner`'s grants for `window` (zero: never).
    pub fn new(inner: B, window: Duration) -> Self {
        ReusingBroker {
            inner,
            window,
            tokens: Mutex::new(Vec::new()),
        }
    }

    /// The wrapped broker.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// How many grants are kept now (expired ones included until pruned).
    pub fn len(&self) -> usize {
        self.tokens
            .lock()
            .map(|t| t.iter().map(|f| f.kept.len()).sum())
            .unwrap_or(0)
    }

    /// Whether no grant is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps `grant` for `subject`'s `request` until `until`, within
    /// [`MAX_ENTRIES`] (expired grants, and tokens left with none, are
    /// dropped when the bound is reached; if it is still reached, the
    /// grant is not kept).
    fn keep(&self, subject: &SecretString, request: &TokenRequest, grant: &Grant, now: Instant) {
        let Ok(mut tokens) = self.tokens.lock() else {
            return;
        };
        let total = |tokens: &Vec<ForToken>| tokens.iter().map(|f| f.kept.len()).sum::<usize>();
        let replacing =
            position(&tokens, subject).is_some_and(|i| tokens[i].kept.contains_key(request));
        if total(&tokens) >= MAX_ENTRIES && !replacing {
            for f in tokens.iter_mut() {
                f.kept.retain(|_, v| now < v.until);
            }
            tokens.retain(|f| !f.kept.is_empty());
            if total(&tokens) >= MAX_ENTRIES {
                return;
            }
        }
        let index = position(&tokens, subject).unwrap_or_else(|| {
            tokens.push(ForToken {
                token: subject.clone(),
                kept: HashMap::new(),
            });
            tokens.len() - 1
        });
        tokens[index].kept.insert(
            request.clone(),
            Kept {
                grant: grant.clone(),
                until: now + self.window,
            },
        );
    }

    /// The grant kept for `subject`'s `request`, while its window lasts and
    /// its credential is fresh.
    fn kept(&self, subject: &SecretString, request: &TokenRequest) -> Option<Grant> {
        let now = Instant::now();
        let tokens = self.tokens.lock().ok()?;
        let hit = tokens[position(&tokens, subject)?].kept.get(request)?;
        (now < hit.until && fresh(&hit.grant, request, now_unix())).then(|| hit.grant.clone())
    }
}

/// Where `subject`'s grants are kept in `tokens`, if anywhere.
fn position(tokens: &[ForToken], subject: &SecretString) -> Option<usize> {
    tokens
        .iter()
        .position(|f| f.token.expose_secret() == subject.expose_secret())
}

/// Whether `grant` may still be served: its credential (if any) keeps more
/// than the cloud's minimum remaining lifetime at wall-clock `now_unix`.
fn fresh(grant: &Grant, request: &TokenRequest, now_unix: u64) -> bool {
    match &grant.credential {
        None => true,
        Some(c) => {
            c.expires_at() > now_unix.saturating_add(request.cloud.min_remaining().as_secs())
        }
    }
}

#[async_trait::async_trait]
impl<B: TokenBroker> TokenBroker for ReusingBroker<B> {
    async fn request(
        &self,
        subject: &SecretString,
        request: &TokenRequest,
    ) -> Result<Grant, BrokerError> {
        if self.window.is_zero() {
            return self.inner.request(subject, request).await;
        }
        if let Some(grant) = self.kept(subject, request) {
            return Ok(grant);
        }
        let grant = self.inner.request(subject, request).await?;
        if fresh(&grant, request, now_unix()) {
            self.keep(subject, request, &grant, Instant::now());
        }
        Ok(grant)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lanyard_core::cloud::{AccessToken, Cloud, Credential, Identity, Kind, Surface};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Counts calls; answers a token expiring `lifetime` seconds from now,
    /// whose text names the call number, or refuses when `refuse` is set.
    struct Counting {
        calls: AtomicUsize,
        lifetime: u64,
        refuse: bool,
    }

    fn counting(lifetime: u64) -> Counting {
        Counting {
            calls: AtomicUsize::new(0),
            lifetime,
            refuse: false,
        }
    }

    #[async_trait::async_trait]
    impl TokenBroker for Counting {
        async fn request(
            &self,
            _subject: &SecretString,
            _request: &TokenRequest,
        ) -> Result<Grant, BrokerError> {
            let n = self.calls.fetch_add(1, Ordering::SeqCst);
            if self.refuse {
                return Err(BrokerError::Unavailable("down".into()));
            }
            Ok(Grant {
                identity: Identity {
                    cloud: Cloud::Azure,
                    id: "c".into(),
                    account: "t".into(),
                    account_number: None,
                    source: lanyard_core::cloud::Source::Federation,
                    via: None,
                },
                credential: Some(Arc::new(Credential::Token(AccessToken {
                    rendered: Default::default(),
                    token: SecretString::from(format!("token-{n}")),
                    issued_at: now_unix(),
                    expires_at: now_unix() + self.lifetime,
                }))),
                listed: None,
            })
        }
    }

    fn imds(resource: &str) -> TokenRequest {
        let mut r = TokenRequest::new(Cloud::Azure, Kind::AccessToken, Surface::AzureImds);
        r.scopes = vec![resource.into()];
        r
    }

    fn token_of(g: &Grant) -> String {
        g.credential
            .as_ref()
            .and_then(|c| c.bearer())
            .map(|t| t.token.expose_secret().to_string())
            .unwrap_or_default()
    }

    #[tokio::test]
    async fn the_same_request_with_the_same_token_is_answered_once_within_the_window() {
        let b = ReusingBroker::new(counting(3600), Duration::from_secs(60));
        let subject = SecretString::from("pod-token".to_string());
        let first = b
            .request(&subject, &imds("https://storage.azure.com/"))
            .await
            .unwrap();
        let again = b
            .request(&subject, &imds("https://storage.azure.com/"))
            .await
            .unwrap();
        assert_eq!(token_of(&first), token_of(&again));
        assert_eq!(b.inner().calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn another_question_or_another_token_goes_to_the_agent() {
        let b = ReusingBroker::new(counting(3600), Duration::from_secs(60));
        let a = SecretString::from("pod-token".to_string());
        let rotated = SecretString::from("pod-token-rotated".to_string());
        let storage = b
            .request(&a, &imds("https://storage.azure.com/"))
            .await
            .unwrap();
        let vault = b
            .request(&a, &imds("https://vault.azure.net"))
            .await
            .unwrap();
        let after_rotation = b
            .request(&rotated, &imds("https://storage.azure.com/"))
            .await
            .unwrap();
        let mut app_service = imds("https://storage.azure.com/");
        app_service.surface = Surface::AppService;
        let other_surface = b.request(&a, &app_service).await.unwrap();
        assert_eq!(b.inner().calls.load(Ordering::SeqCst), 4);
        let tokens = [&storage, &vault, &after_rotation, &other_surface].map(token_of);
        assert_eq!(
            tokens
                .iter()
                .collect::<std::collections::HashSet<_>>()
                .len(),
            4
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_window_ends() {
        let b = ReusingBroker::new(counting(3600), Duration::from_secs(10));
        let s = SecretString::from("pod-token".to_string());
        b.request(&s, &imds("r")).await.unwrap();
        tokio::time::advance(Duration::from_secs(9)).await;
        b.request(&s, &imds("r")).await.unwrap();
        assert_eq!(b.inner().calls.load(Ordering::SeqCst), 1);
        tokio::time::advance(Duration::from_secs(2)).await;
        b.request(&s, &imds("r")).await.unwrap();
        assert_eq!(b.inner().calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_credential_near_its_minimum_lifetime_is_never_reused() {
        // Azure's minimum remaining lifetime is 5 minutes: a 4-minute token
        // is passed through but not kept.
        let b = ReusingBroker::new(counting(240), Duration::from_secs(60));
        let s = SecretString::from("pod-token".to_string());
        b.request(&s, &imds("r")).await.unwrap();
        b.request(&s, &imds("r")).await.unwrap();
        assert_eq!(b.inner().calls.load(Ordering::SeqCst), 2);
        assert!(b.is_empty());
    }

    #[tokio::test]
    async fn failures_are_not_kept_and_a_zero_window_reuses_nothing() {
        let mut down = counting(3600);
        down.refuse = true;
        let b = ReusingBroker::new(down, Duration::from_secs(60));
        let s = SecretString::from("pod-token".to_string());
        assert!(b.request(&s, &imds("r")).await.is_err());
        assert!(b.request(&s, &imds("r")).await.is_err());
        assert_eq!(b.inner().calls.load(Ordering::SeqCst), 2);

        let off = ReusingBroker::new(counting(3600), Duration::ZERO);
        off.request(&s, &imds("r")).await.unwrap();
        off.request(&s, &imds("r")).await.unwrap();
        assert_eq!(off.inner().calls.load(Ordering::SeqCst), 2);
    }

    /// After a rotation, the old token's grants stay only until the bound
    /// is reached and they have expired; then they and the token go.
    #[tokio::test(start_paused = true)]
    async fn a_rotated_tokens_expired_grants_make_room() {
        let b = ReusingBroker::new(counting(3600), Duration::from_secs(10));
        let old = SecretString::from("old-token".to_string());
        for i in 0..MAX_ENTRIES {
            b.request(&old, &imds(&format!("https://r{i}")))
                .await
                .unwrap();
        }
        assert_eq!(b.len(), MAX_ENTRIES);
        tokio::time::advance(Duration::from_secs(11)).await;
        let new = SecretString::from("new-token".to_string());
        b.request(&new, &imds("https://r0")).await.unwrap();
        assert_eq!(b.len(), 1);
        assert_eq!(b.tokens.lock().unwrap().len(), 1, "the old token is gone");
        // And the new token's grant is reused.
        b.request(&new, &imds("https://r0")).await.unwrap();
        assert_eq!(b.inner().calls.load(Ordering::SeqCst), MAX_ENTRIES + 1);
    }

    #[tokio::test]
    async fn the_map_stays_bounded() {
        let b = ReusingBroker::new(counting(3600), Duration::from_secs(60));
        let s = SecretString::from("pod-token".to_string());
        for i in 0..(MAX_ENTRIES + 50) {
            b.request(&s, &imds(&format!("https://r{i}")))
                .await
                .unwrap();
        }
        assert_eq!(b.len(), MAX_ENTRIES);
        // A request not kept still got its answer, from the agent.
        assert_eq!(b.inner().calls.load(Ordering::SeqCst), MAX_ENTRIES + 50);
    }
}
