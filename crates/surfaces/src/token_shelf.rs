//! The pod's current projected token per cloud, held where every request
//! can read it without a lock or a copy.
//!
//! Every SDK request, a cache hit included, presents the pod's projected
//! token to the broker. Holding an async mutex across that read and copying
//! the token out (a kilobyte, zeroized again when the copy is dropped) cost
//! `lanyard dev` 3.3 % of its CPU under `wrk`, part of it waking the other
//! worker thread that waited on the mutex. Here a request loads the held
//! token (an atomic pointer load and a reference count), and only a request
//! that finds it missing or too old fetches it again: from the kubelet's
//! file in the sidecar, from the built-in issuer in `lanyard dev`.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use tokio::sync::Mutex;

use lanyard_core::cloud::Cloud;
use lanyard_core::secret::SecretString;

/// One token per cloud, each trusted for `max_age` after it was fetched.
pub struct TokenShelf {
    held: [ArcSwapOption<Held>; Cloud::COUNT],
    max_age: Duration,
    /// Serializes fetches, so that requests finding a stale token together
    /// fetch it once.
    refill: Mutex<()>,
}

struct Held {
    token: Arc<SecretString>,
    fetched: Instant,
}

impl TokenShelf {
    /// An empty shelf whose tokens are fetched again once `max_age` old.
    pub fn new(max_age: Duration) -> Self {
        TokenShelf {
            held: Default::default(),
            max_age,
            refill: Mutex::new(()),
        }
    }

    /// The token held for `cloud` when it is younger than `max_age`, else
    /// the one `fetch` returns, which is then held. A failed fetch holds
    /// nothing new: the next request tries again.
    pub async fn get<F, Fut>(&self, cloud: Cloud, fetch: F) -> Result<Arc<SecretString>, String>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<SecretString, String>>,
    {
        let slot = &self.held[cloud as usize];
        if let Some(token) = self.fresh(slot) {
            return Ok(token);
        }
        // INVARIANT: a fetch happens under `refill`, after looking at the
        // slot again under it: a request that waited for another's fetch
        // takes that token instead of fetching a second time.
        let _refill = self.refill.lock().await;
        if let Some(token) = self.fresh(slot) {
            return Ok(token);
        }
        let token = Arc::new(fetch().await?);
        slot.store(Some(Arc::new(Held {
            token: token.clone(),
            fetched: Instant::now(),
        })));
        Ok(token)
    }

    fn fresh(&self, slot: &ArcSwapOption<Held>) -> Option<Arc<SecretString>> {
        let held = slot.load();
        held.as_ref()
            .filter(|h| h.fetched.elapsed() < self.max_age)
            .map(|h| h.token.clone())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use lanyard_core::secret::ExposeSecret;

    use super::*;

    async fn fetcher(calls: &AtomicUsize, value: &'static str) -> Result<SecretString, String> {
        calls.fetch_add(1, Ordering::SeqCst);
        tokio::task::yield_now().await;
        Ok(SecretString::from(value.to_string()))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_requests_fetch_once_and_share_the_token() {
        let shelf = Arc::new(TokenShelf::new(Duration::from_secs(60)));
        let calls = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..50 {
            let (shelf, calls) = (shelf.clone(), calls.clone());
            tasks.push(tokio::spawn(async move {
                shelf
                    .get(Cloud::Azure, || fetcher(&calls, "azure-token"))
                    .await
            }));
        }
        let mut tokens = Vec::new();
        for task in tasks {
            tokens.push(task.await.unwrap().unwrap());
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(tokens.iter().all(|t| Arc::ptr_eq(t, &tokens[0])));
        assert_eq!(tokens[0].expose_secret(), "azure-token");
    }

    #[tokio::test]
    async fn clouds_are_held_apart_and_an_old_token_is_fetched_again() {
        let shelf = TokenShelf::new(Duration::from_millis(30));
        let calls = AtomicUsize::new(0);
        let azure = shelf.get(Cloud::Azure, || fetcher(&calls, "a1")).await;
        let aws = shelf.get(Cloud::Aws, || fetcher(&calls, "w1")).await;
        assert_eq!(azure.unwrap().expose_secret(), "a1");
        assert_eq!(aws.unwrap().expose_secret(), "w1");
        let again = shelf.get(Cloud::Azure, || fetcher(&calls, "a2")).await;
        assert_eq!(again.unwrap().expose_secret(), "a1", "still fresh");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        tokio::time::sleep(Duration::from_millis(40)).await;
        let later = shelf.get(Cloud::Azure, || fetcher(&calls, "a2")).await;
        assert_eq!(later.unwrap().expose_secret(), "a2", "fetched again");
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_failed_fetch_is_reported_and_retried() {
        let shelf = TokenShelf::new(Duration::from_secs(60));
        let failed = shelf
            .get(Cloud::Gcp, || async { Err("no file yet".to_string()) })
            .await;
        assert_eq!(failed.unwrap_err(), "no file yet");
        let calls = AtomicUsize::new(0);
        let later = shelf.get(Cloud::Gcp, || fetcher(&calls, "g1")).await;
        assert_eq!(later.unwrap().expose_secret(), "g1");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}
