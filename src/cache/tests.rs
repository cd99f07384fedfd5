//! Cache behaviour with paused Tokio time: every timing is exact.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex as StdMutex;

use super::*;
use crate::cloud::AccessToken;
use crate::secret::ExposeSecret;

/// A scripted upstream: counts calls, records subjects, answers with the
/// next scripted outcome (or a fresh token when the script is empty).
#[derive(Clone, Default)]
struct Upstream {
    calls: Arc<AtomicU32>,
    subjects: Arc<StdMutex<Vec<String>>>,
    script: Arc<StdMutex<std::collections::VecDeque<Result<u64, CloudError>>>>,
    lifetime: Arc<StdMutex<u64>>,
}

impl Upstream {
    fn new(lifetime: u64) -> Self {
        let u = Upstream::default();
        *u.lifetime.lock().unwrap() = lifetime;
        u
    }

    fn then(&self, outcome: Result<u64, CloudError>) -> &Self {
        self.script.lock().unwrap().push_back(outcome);
        self
    }

    fn calls(&self) -> u32 {
        self.calls.load(Ordering::SeqCst)
    }

    fn fetcher(&self) -> Fetcher {
        let me = self.clone();
        Arc::new(move |subject: SecretString| {
            let me = me.clone();
            Box::pin(async move {
                let n = me.calls.fetch_add(1, Ordering::SeqCst) + 1;
                me.subjects
                    .lock()
                    .unwrap()
                    .push(subject.expose_secret().to_string());
                // Upstream latency, so that concurrent callers overlap.
                tokio::time::sleep(Duration::from_millis(50)).await;
                let scripted = me.script.lock().unwrap().pop_front();
                let lifetime = match scripted {
                    Some(Ok(l)) => l,
                    Some(Err(e)) => return Err(e),
                    None => *me.lifetime.lock().unwrap(),
                };
                let now = now_unix();
                Ok(Credential::Token(AccessToken {
                    rendered: Default::default(),
                    token: SecretString::from(format!("token-{n}")),
                    issued_at: now,
                    expires_at: now + lifetime,
                }))
            }) as FetchFuture
        })
    }
}

fn key(cloud: Cloud, sa: &str, scope: &str) -> CacheKey {
    CacheKey {
        cloud,
        account: "tenant".into(),
        identity: "client-1".into(),
        scope: scope.into(),
        namespace: "default".into(),
        service_account: sa.into(),
        pod_uid: None,
    }
}

fn cache(config: CacheConfig) -> Cache {
    Cache::new(config, Arc::new(Metrics::new()))
}

fn subject(name: &str) -> SecretString {
    SecretString::from(name.to_string())
}

fn far() -> u64 {
    now_unix() + 24 * 3600
}

fn token_of(c: &Credential) -> String {
    match c {
        Credential::Token(t) => t.token.expose_secret().to_string(),
        other => panic!("unexpected {other:?}"),
    }
}

async fn get(cache: &Cache, k: &CacheKey, up: &Upstream) -> Result<String, CloudError> {
    cache
        .get(k.as_ref(), &subject("subject-a"), far(), || up.fetcher())
        .await
        .map(|c| token_of(&c))
}

fn unavailable() -> CloudError {
    CloudError::Unavailable {
        cloud: Cloud::Azure,
        reason: "down".into(),
    }
}

fn rejected() -> CloudError {
    CloudError::Rejected {
        cloud: Cloud::Azure,
        code: "AADSTS70021".into(),
        message: "no match".into(),
    }
}

#[tokio::test(start_paused = true)]
async fn thousand_cold_requests_make_one_upstream_call() {
    let cache = cache(CacheConfig::default());
    let up = Upstream::new(3600);
    let k = key(
        Cloud::Azure,
        "ray-worker",
        "https://storage.azure.com/.default",
    );
    let mut tasks = Vec::new();
    for _ in 0..1000 {
        let (cache, up, k) = (cache.clone(), up.clone(), k.clone());
        tasks.push(tokio::spawn(async move { get(&cache, &k, &up).await }));
    }
    let mut tokens = std::collections::HashSet::new();
    for t in tasks {
        tokens.insert(t.await.unwrap().unwrap());
    }
    assert_eq!(up.calls(), 1);
    assert_eq!(tokens.len(), 1, "all 1000 got the same credential");
    let metrics = cache.inner.metrics.render();
    assert!(
        metrics.contains("lanyard_cache_misses_total{cloud=\"azure\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("lanyard_cache_coalesced_total{cloud=\"azure\"} 999"),
        "{metrics}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_subject_token_valid_for_ever_neither_overflows_nor_is_refused() {
    // `exp` is whatever the issuer signed; u64::MAX must not overflow the
    // instant the entry keeps for it.
    let cache = cache(CacheConfig::default());
    let up = Upstream::new(3600);
    let k = key(
        Cloud::Azure,
        "ray-worker",
        "https://storage.azure.com/.default",
    );
    for _ in 0..2 {
        let got = cache
            .get(k.as_ref(), &subject("subject-a"), u64::MAX, || up.fetcher())
            .await;
        assert!(got.is_ok(), "{got:?}");
    }
    assert_eq!(up.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn refreshes_ahead_of_expiry_without_a_client_waiting() {
    let cache = cache(CacheConfig::default());
    let up = Upstream::new(3600);
    let k = key(Cloud::Azure, "ray-worker", "s");
    assert_eq!(get(&cache, &k, &up).await.unwrap(), "token-1");
    // Nobody asks; at about half the lifetime (minus up to a tenth of it)
    // it refreshes.
    tokio::time::sleep(Duration::from_secs(1430)).await;
    assert_eq!(up.calls(), 1, "not before half the lifetime minus a tenth");
    tokio::time::sleep(Duration::from_secs(371)).await;
    assert_eq!(up.calls(), 2, "refreshed in the background by 1801 s");
    // The client now gets the refreshed credential from cache.
    assert_eq!(get(&cache, &k, &up).await.unwrap(), "token-2");
    assert_eq!(up.calls(), 2);
}

#[tokio::test(start_paused = true)]
async fn credentials_too_short_to_serve_from_cache_are_not_refreshed_ahead() {
    // AWS keeps 15 minutes in hand: a 900-second session can never be
    // served from the cache, and refreshing it ahead would call STS over
    // and over for an entry no one asks for. Nor can one served for mere
    // seconds (Entra's 301 s, found by tests/cache_properties.rs): its
    // refresh would be due at once, and its successor's too.
    let cache = cache(CacheConfig::default());
    for (cloud, lifetime) in [
        (Cloud::Aws, 900),
        (Cloud::Azure, 290),
        (Cloud::Gcp, 60),
        (Cloud::Azure, 301),
        (Cloud::Aws, 920),
        (Cloud::Gcp, 320),
    ] {
        let up = Upstream::new(lifetime);
        let k = key(cloud, &format!("short-lived-{lifetime}"), "s");
        assert_eq!(get(&cache, &k, &up).await.unwrap(), "token-1");
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert_eq!(
            up.calls(),
            1,
            "{cloud:?}: no refresh of an unservable credential"
        );
        // Asked again: a fresh exchange, as for a miss.
        assert_eq!(get(&cache, &k, &up).await.unwrap(), "token-2");
    }
}

#[test]
fn refresh_time_respects_the_sdk_windows() {
    let t0 = Instant::now();
    for _ in 0..50 {
        // One hour: half the lifetime, well before the windows, spread
        // over up to a tenth of the lifetime before it.
        let at = refresh_at(Cloud::Aws, t0, t0 + Duration::from_secs(3600)).unwrap();
        let d = at - t0;
        assert!(
            d <= Duration::from_secs(1800) && d >= Duration::from_secs(1440),
            "{d:?}"
        );
        // Two hours of AWS: half is 60 min, 20 min before expiry is 100 min.
        let at = refresh_at(Cloud::Aws, t0, t0 + Duration::from_secs(7200)).unwrap();
        assert!(at - t0 <= Duration::from_secs(3600));
        // 24 h: half (12 h) is earlier than 10 min before expiry.
        let at = refresh_at(Cloud::Azure, t0, t0 + Duration::from_secs(86_400)).unwrap();
        assert!(at - t0 <= Duration::from_secs(43_200));
        // 30 min Entra: 10 min before expiry = 20 min; half = 15 min.
        let at = refresh_at(Cloud::Azure, t0, t0 + Duration::from_secs(1800)).unwrap();
        assert!(at - t0 <= Duration::from_secs(900));
        // Short Entra: never sooner than a quarter of the lifetime.
        let at = refresh_at(Cloud::Azure, t0, t0 + Duration::from_secs(600)).unwrap();
        assert!(at - t0 >= Duration::from_secs(150), "{:?}", at - t0);
        // 1,000 s of AWS: served only for its first 100 s (15 min must
        // remain), so due within them, not at a quarter (250 s), when
        // callers would already be waiting on an exchange.
        let at = refresh_at(Cloud::Aws, t0, t0 + Duration::from_secs(1000)).unwrap();
        assert!(at - t0 < Duration::from_secs(100), "{:?}", at - t0);
    }
}

#[test]
fn credentials_served_only_briefly_are_not_refreshed_ahead() {
    let t0 = Instant::now();
    // Entra keeps 5 minutes: a 301-s token is served for a second, and a
    // refresh ahead would be due at once, for its successor too.
    assert_eq!(
        refresh_at(Cloud::Azure, t0, t0 + Duration::from_secs(301)),
        None
    );
    assert_eq!(
        refresh_at(Cloud::Azure, t0, t0 + Duration::from_secs(300)),
        None
    );
    // AWS keeps 15 minutes: served for 30 s only past 931 s.
    assert_eq!(
        refresh_at(Cloud::Aws, t0, t0 + Duration::from_secs(930)),
        None
    );
    let at = refresh_at(Cloud::Aws, t0, t0 + Duration::from_secs(931)).unwrap();
    assert_eq!(at - t0, MIN_REFRESH_AHEAD);
    // Never sooner than MIN_REFRESH_AHEAD after the fetch, whatever the lifetime.
    for secs in [331, 332, 400, 600, 1000, 3600] {
        let at = refresh_at(Cloud::Azure, t0, t0 + Duration::from_secs(secs)).unwrap();
        assert!(at - t0 >= MIN_REFRESH_AHEAD, "{secs}: {:?}", at - t0);
    }
}

#[test]
fn refreshes_fetched_together_are_spread_over_minutes() {
    let t0 = Instant::now();
    let times: Vec<Duration> = (0..1000)
        .map(|_| refresh_at(Cloud::Azure, t0, t0 + Duration::from_secs(3600)).unwrap() - t0)
        .collect();
    let (min, max) = (times.iter().min().unwrap(), times.iter().max().unwrap());
    // Up to 6 minutes (a tenth of the hour) before half the lifetime.
    assert!(*max - *min > Duration::from_secs(300), "{min:?}..{max:?}");
    let in_last_minute = times
        .iter()
        .filter(|d| **d > Duration::from_secs(1740))
        .count();
    assert!(
        in_last_minute < 300,
        "{in_last_minute} of 1000 in one minute"
    );
}

#[tokio::test(start_paused = true)]
async fn serves_cached_credential_through_an_outage_until_the_serving_rule_stops_it() {
    let cache = cache(CacheConfig::default());
    let up = Upstream::new(3600);
    let k = key(Cloud::Azure, "ray-worker", "s");
    assert_eq!(get(&cache, &k, &up).await.unwrap(), "token-1");
    // From now on the upstream is down.
    for _ in 0..200 {
        up.then(Err(unavailable()));
    }
    // 50 minutes later: refreshes have been failing, the token (10 min
    // left) is still served, without a client-triggered upstream call.
    tokio::time::sleep(Duration::from_secs(50 * 60)).await;
    let failed_refreshes = up.calls() - 1;
    assert!(
        failed_refreshes >= 3,
        "background retries happened: {failed_refreshes}"
    );
    let calls_before = up.calls();
    assert_eq!(get(&cache, &k, &up).await.unwrap(), "token-1");
    assert_eq!(up.calls(), calls_before, "a hit does no upstream I/O");
    // Retries back off: far fewer than one a second.
    assert!(
        failed_refreshes < 60,
        "{failed_refreshes} retries in 20 minutes"
    );
    // 56 minutes: under 5 minutes remain, so it is no longer served; the
    // client gets a clear retryable error instead.
    tokio::time::sleep(Duration::from_secs(6 * 60)).await;
    let err = get(&cache, &k, &up).await.unwrap_err();
    assert!(err.is_retryable(), "{err:?}");
    let metrics = cache.inner.metrics.render();
    assert!(metrics.contains("lanyard_cache_refresh_failures_total{cloud=\"azure\"}"));
    assert!(metrics
        .contains("lanyard_upstream_requests_total{cloud=\"azure\",outcome=\"unavailable\"}"));
}

#[tokio::test(start_paused = true)]
async fn retry_after_is_honoured() {
    let cache = cache(CacheConfig::default());
    let up = Upstream::new(3600);
    up.then(Err(CloudError::Throttled {
        cloud: Cloud::Azure,
        code: "HTTP429".into(),
        retry_after: Some(Duration::from_secs(60)),
    }));
    let k = key(Cloud::Azure, "ray-worker", "s");
    let err = get(&cache, &k, &up).await.unwrap_err();
    assert!(matches!(err, CloudError::Throttled { .. }));
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(get(&cache, &k, &up).await.is_err());
    }
    assert_eq!(up.calls(), 1, "no upstream call within Retry-After");
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert_eq!(get(&cache, &k, &up).await.unwrap(), "token-2");
    assert_eq!(up.calls(), 2);
}

/// A throttling window that outlasts many backoff steps, with nothing
/// cached (an agent restarted during it): once the cloud recovers, the next
/// caller is served within the retry bound, not after the backoff grown
/// over the window; meanwhile each caller is told when to come back.
#[tokio::test(start_paused = true)]
async fn a_recovered_cloud_is_asked_again_within_the_retry_bound() {
    let config = CacheConfig::default();
    let bound = config.retry_bound;
    let cache = cache(config);
    let up = Upstream::new(3600);
    let throttled = || {
        Err(CloudError::Throttled {
            cloud: Cloud::Aws,
            code: "Throttling".into(),
            retry_after: None,
        })
    };
    for _ in 0..1000 {
        up.then(throttled());
    }
    let k = key(Cloud::Aws, "ray-worker", "s");
    // Callers asking twice a second for 60 s of throttling.
    let window = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut remembered = 0;
    while tokio::time::Instant::now() < window {
        let before = up.calls();
        match get(&cache, &k, &up).await.unwrap_err() {
            // Not asked upstream this time: the remembered throttle.
            CloudError::Throttled { retry_after, .. } if up.calls() == before => {
                remembered += 1;
                let wait = retry_after.expect("a remembered throttle says when to retry");
                assert!(wait >= Duration::from_secs(1) && wait <= bound, "{wait:?}");
            }
            CloudError::Throttled { .. } => {}
            other => panic!("{other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(remembered > 60, "{remembered}");
    let during = up.calls();
    assert!(
        (60 / bound.as_secs() as u32..=2 * 60).contains(&during),
        "backed off, but asked again within the bound: {during} calls"
    );
    // The cloud recovers: the next caller that arrives once the bound has
    // passed is served.
    up.script.lock().unwrap().clear();
    tokio::time::sleep(bound).await;
    assert!(get(&cache, &k, &up).await.is_ok());
}

/// While a credential is still served, a failing refresh backs off as far
/// as `backoff_max`, but never past the moment the credential stops being
/// served.
#[tokio::test(start_paused = true)]
async fn refresh_backoff_ends_when_the_credential_stops_being_served() {
    let cache = cache(CacheConfig::default());
    let up = Upstream::new(3600);
    let k = key(Cloud::Azure, "ray-worker", "s");
    assert!(get(&cache, &k, &up).await.is_ok());
    for _ in 0..1000 {
        up.then(Err(CloudError::Unavailable {
            cloud: Cloud::Azure,
            reason: "HTTP 503".into(),
        }));
    }
    // Refreshes fail from half-life on; the credential is served until
    // 5 minutes remain (55 min), then the callers wait at most the bound.
    tokio::time::sleep(Duration::from_secs(55 * 60)).await;
    up.script.lock().unwrap().clear();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let _ = get(&cache, &k, &up).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        get(&cache, &k, &up).await.is_ok(),
        "asked again within the bound"
    );
}

#[tokio::test(start_paused = true)]
async fn deterministic_errors_are_cached_briefly_then_retried() {
    let config = CacheConfig {
        negative_ttl: Duration::from_secs(10),
        ..Default::default()
    };
    let cache = cache(config);
    let up = Upstream::new(3600);
    up.then(Err(rejected()));
    let k = key(Cloud::Azure, "ray-worker", "s");
    for _ in 0..50 {
        let err = get(&cache, &k, &up).await.unwrap_err();
        assert_eq!(err.code(), Some("AADSTS70021"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(up.calls(), 1, "refusal remembered for the negative TTL");
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        get(&cache, &k, &up).await.unwrap(),
        "token-2",
        "retried after the TTL"
    );
    assert_eq!(up.calls(), 2);
}

#[tokio::test(start_paused = true)]
async fn lru_and_idle_eviction() {
    let config = CacheConfig {
        max_entries: 2,
        idle_ttl: Duration::from_secs(600),
        ..Default::default()
    };
    let cache = cache(config);
    let up = Upstream::new(3600);
    let (a, b, c) = (
        key(Cloud::Azure, "a", "s"),
        key(Cloud::Azure, "b", "s"),
        key(Cloud::Azure, "c", "s"),
    );
    get(&cache, &a, &up).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    get(&cache, &b, &up).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    get(&cache, &a, &up).await.unwrap(); // a is now the most recent
    get(&cache, &c, &up).await.unwrap(); // evicts b
    assert_eq!(cache.len(), 2);
    let calls = up.calls();
    get(&cache, &a, &up).await.unwrap();
    assert_eq!(up.calls(), calls, "a stayed");
    get(&cache, &b, &up).await.unwrap();
    assert_eq!(up.calls(), calls + 1, "b was evicted");
    assert!(cache.inner.metrics.render().contains("reason=\"lru\""));
    assert!(cache.inner.lock().index_is_exact());

    // Nobody asks for 11 minutes: everything is swept.
    tokio::time::sleep(Duration::from_secs(660)).await;
    assert_eq!(cache.len(), 0);
    assert!(cache.inner.lock().index_is_exact());
    assert!(cache.inner.metrics.render().contains("reason=\"idle\""));
}

#[tokio::test(start_paused = true)]
async fn idle_entries_are_not_refreshed() {
    let config = CacheConfig {
        idle_ttl: Duration::from_secs(20 * 60),
        ..Default::default()
    };
    let cache = cache(config);
    let up = Upstream::new(3 * 3600);
    let k = key(Cloud::Azure, "ray-worker", "s");
    get(&cache, &k, &up).await.unwrap();
    tokio::time::sleep(Duration::from_secs(4 * 3600)).await;
    assert_eq!(
        up.calls(),
        1,
        "an entry nobody used is dropped, not refreshed"
    );
    assert_eq!(cache.len(), 0);
}

#[tokio::test(start_paused = true)]
async fn different_scopes_and_accounts_never_share_an_entry() {
    let cache = cache(CacheConfig::default());
    let up = Upstream::new(3600);
    let keys = [
        key(Cloud::Azure, "a", "storage"),
        key(Cloud::Azure, "a", "vault"),
        key(Cloud::Azure, "b", "storage"),
        key(Cloud::Gcp, "a", "storage"),
        CacheKey {
            namespace: "other".into(),
            ..key(Cloud::Azure, "a", "storage")
        },
        CacheKey {
            identity: "client-2".into(),
            ..key(Cloud::Azure, "a", "storage")
        },
        CacheKey {
            pod_uid: Some("pod-1".into()),
            ..key(Cloud::Azure, "a", "storage")
        },
    ];
    let mut tokens = std::collections::HashSet::new();
    for k in &keys {
        tokens.insert(get(&cache, k, &up).await.unwrap());
    }
    assert_eq!(tokens.len(), keys.len());
    assert_eq!(up.calls() as usize, keys.len());
    // And each key keeps getting its own token back.
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(
            get(&cache, k, &up).await.unwrap(),
            format!("token-{}", i + 1)
        );
    }
}

#[tokio::test(start_paused = true)]
async fn short_lived_credential_is_served_once_but_not_cached_past_the_minimum() {
    let cache = cache(CacheConfig::default());
    let up = Upstream::new(3600);
    up.then(Ok(10 * 60)); // AWS credential with 10 minutes: under the 15-minute minimum
    let k = key(Cloud::Aws, "ray-worker", "sts");
    assert_eq!(
        get(&cache, &k, &up).await.unwrap(),
        "token-1",
        "its waiters get it"
    );
    assert_eq!(
        get(&cache, &k, &up).await.unwrap(),
        "token-2",
        "not served from cache"
    );
    assert_eq!(up.calls(), 2);
    assert_eq!(get(&cache, &k, &up).await.unwrap(), "token-2");
    assert_eq!(up.calls(), 2);
}

#[tokio::test(start_paused = true)]
async fn refresh_uses_the_newest_subject_and_never_an_expired_one() {
    let cache = cache(CacheConfig::default());
    let up = Upstream::new(3600);
    let k = key(Cloud::Azure, "ray-worker", "s");
    let soon = now_unix() + 1200;
    cache
        .get(k.as_ref(), &subject("old"), soon, || up.fetcher())
        .await
        .unwrap();
    cache
        .get(k.as_ref(), &subject("new"), soon + 3600, || up.fetcher())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1801)).await;
    assert_eq!(up.calls(), 2);
    assert_eq!(up.subjects.lock().unwrap().as_slice(), ["old", "new"]);

    // A key whose only subject expires before its refresh is due.
    let k2 = key(Cloud::Azure, "short-subject", "s");
    cache
        .get(k2.as_ref(), &subject("brief"), now_unix() + 600, || {
            up.fetcher()
        })
        .await
        .unwrap();
    let calls = up.calls();
    tokio::time::sleep(Duration::from_secs(1900)).await;
    let sent: Vec<String> = up.subjects.lock().unwrap().clone();
    assert_eq!(
        sent.iter().filter(|s| *s == "brief").count(),
        1,
        "expired subject never sent: {sent:?}"
    );
    assert!(up.calls() >= calls);
}

#[tokio::test(start_paused = true)]
async fn invalidation_drops_a_service_accounts_entries() {
    let cache = cache(CacheConfig::default());
    let up = Upstream::new(3600);
    let a = key(Cloud::Azure, "a", "s");
    let b = key(Cloud::Azure, "b", "s");
    get(&cache, &a, &up).await.unwrap();
    get(&cache, &b, &up).await.unwrap();
    cache.invalidate_service_account("default", "a");
    assert_eq!(cache.len(), 1);
    get(&cache, &a, &up).await.unwrap();
    assert_eq!(up.calls(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_caller_does_not_strand_the_others() {
    let cache = cache(CacheConfig::default());
    let up = Upstream::new(3600);
    let k = key(Cloud::Azure, "ray-worker", "s");
    let first = {
        let (cache, up, k) = (cache.clone(), up.clone(), k.clone());
        tokio::spawn(async move { get(&cache, &k, &up).await })
    };
    tokio::time::sleep(Duration::from_millis(10)).await;
    first.abort();
    assert_eq!(get(&cache, &k, &up).await.unwrap(), "token-1");
    assert_eq!(up.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_flooding_caller_is_limited_and_does_not_delay_another() {
    let cache = cache(CacheConfig::default());
    let up = Upstream::new(3600);
    // 200 distinct scopes at once from one ServiceAccount.
    let flood: Vec<_> = (0..200)
        .map(|i| {
            let (cache, up) = (cache.clone(), up.clone());
            tokio::spawn(async move {
                get(&cache, &key(Cloud::Azure, "flood", &format!("s{i}")), &up).await
            })
        })
        .collect();
    tokio::task::yield_now().await;
    // Another ServiceAccount's first request: one upstream latency (50 ms),
    // not a place behind the flood.
    let started = Instant::now();
    get(&cache, &key(Cloud::Azure, "victim", "s"), &up)
        .await
        .unwrap();
    assert!(
        started.elapsed() <= Duration::from_millis(60),
        "{:?}",
        started.elapsed()
    );
    let mut limited = std::collections::HashMap::new();
    let mut granted = 0;
    for f in flood {
        match f.await.unwrap() {
            Ok(_) => granted += 1,
            Err(CloudError::CallerLimited {
                limit, retry_after, ..
            }) => {
                assert!(retry_after >= Duration::from_secs(1));
                *limited.entry(limit).or_insert(0) += 1;
            }
            Err(e) => panic!("{e}"),
        }
    }
    // At most 8 of its exchanges were in flight at once; the rest waited
    // for nothing upstream: refused at once.
    assert_eq!(granted, 8, "{limited:?}");
    assert_eq!(limited.get(&CallerLimit::Inflight), Some(&192));
    assert_eq!(up.calls(), 9);
}

#[tokio::test(start_paused = true)]
async fn new_keys_are_rate_limited_per_caller() {
    let config = CacheConfig {
        caller: CallerLimits {
            new_keys_per_second: 2.0,
            new_keys_burst: 3.0,
            ..CallerLimits::default()
        },
        ..Default::default()
    };
    let cache = cache(config);
    let up = Upstream::new(3600);
    for i in 0..3 {
        get(&cache, &key(Cloud::Azure, "flood", &format!("s{i}")), &up)
            .await
            .unwrap();
    }
    let err = get(&cache, &key(Cloud::Azure, "flood", "s3"), &up)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            CloudError::CallerLimited {
                limit: CallerLimit::NewKeys,
                ..
            }
        ),
        "{err}"
    );
    // Known keys are still served (hits are never limited), and another
    // caller adds its own.
    assert_eq!(
        get(&cache, &key(Cloud::Azure, "flood", "s0"), &up)
            .await
            .unwrap(),
        "token-1"
    );
    get(&cache, &key(Cloud::Azure, "other", "s0"), &up)
        .await
        .unwrap();
    // Half a second later: one more new key for the flood.
    tokio::time::sleep(Duration::from_millis(500)).await;
    get(&cache, &key(Cloud::Azure, "flood", "s3"), &up)
        .await
        .unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_caller_at_its_quota_or_filling_the_cache_evicts_only_its_own() {
    let config = CacheConfig {
        max_entries: 10,
        caller: CallerLimits {
            max_entries: 6,
            new_keys_burst: 1000.0,
            ..CallerLimits::default()
        },
        ..Default::default()
    };
    let cache = cache(config);
    let up = Upstream::new(3600);
    // Two victims hold two entries each, used before the flood begins.
    for sa in ["v1", "v2"] {
        for s in ["a", "b"] {
            get(&cache, &key(Cloud::Azure, sa, s), &up).await.unwrap();
        }
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    // The flood asks for 30 scopes, one after another.
    for i in 0..30 {
        get(&cache, &key(Cloud::Azure, "flood", &format!("s{i}")), &up)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(cache.len() <= 10);
    let calls = up.calls();
    // Every victim entry is still cached: a hit, no new exchange.
    for sa in ["v1", "v2"] {
        for s in ["a", "b"] {
            get(&cache, &key(Cloud::Azure, sa, s), &up).await.unwrap();
        }
    }
    assert_eq!(up.calls(), calls, "a victim's entry was evicted");
    assert!(cache.inner.lock().index_is_exact());
    // The flood kept at most its quota: its oldest are gone.
    get(&cache, &key(Cloud::Azure, "flood", "s0"), &up)
        .await
        .unwrap();
    assert_eq!(up.calls(), calls + 1);
}

#[tokio::test(start_paused = true)]
async fn a_full_cache_evicts_from_the_heaviest_caller_its_least_recent_entry() {
    let config = CacheConfig {
        max_entries: 7,
        caller: CallerLimits {
            new_keys_burst: 1000.0,
            ..CallerLimits::default()
        },
        ..Default::default()
    };
    let cache = cache(config);
    let up = Upstream::new(3600);
    // a and b hold three entries each, c one; b's oldest is older than a's.
    for (sa, scope) in [
        ("b", "1"),
        ("a", "1"),
        ("a", "2"),
        ("b", "2"),
        ("a", "3"),
        ("b", "3"),
        ("c", "1"),
    ] {
        get(&cache, &key(Cloud::Azure, sa, scope), &up)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert_eq!(cache.len(), 7);
    // c's second entry: a and b tie at three, b's "1" is the least recent.
    get(&cache, &key(Cloud::Azure, "c", "2"), &up)
        .await
        .unwrap();
    assert_eq!(cache.len(), 7);
    let calls = up.calls();
    for (sa, scope) in [("a", "1"), ("a", "2"), ("a", "3"), ("b", "2"), ("b", "3")] {
        get(&cache, &key(Cloud::Azure, sa, scope), &up)
            .await
            .unwrap();
    }
    assert_eq!(up.calls(), calls, "only b's least recent entry went");
    // Now a holds three, b two, c two: a gives way, not c.
    get(&cache, &key(Cloud::Azure, "d", "1"), &up)
        .await
        .unwrap();
    let calls = up.calls();
    for (sa, scope) in [("c", "1"), ("c", "2"), ("b", "2"), ("b", "3")] {
        get(&cache, &key(Cloud::Azure, sa, scope), &up)
            .await
            .unwrap();
    }
    assert_eq!(up.calls(), calls, "the lighter callers kept theirs");
    let index = cache.inner.lock();
    assert!(index.index_is_exact());
    assert_eq!(index.holding("default", "a"), (2, 0), "a gave one way");
    assert_eq!(index.holding("default", "d"), (1, 0));
    assert_eq!(index.holding("default", "nobody"), (0, 0));
}

#[test]
fn keys_hash_as_their_borrowed_form_and_apart_from_each_other() {
    use std::hash::BuildHasher;
    let hasher = std::hash::RandomState::new();
    let base = key(Cloud::Azure, "ray", "https://storage.azure.com/.default");
    let long_scope = "s".repeat(400);
    let mut variants = vec![base.clone()];
    let mut vary = |change: &dyn Fn(&mut CacheKey)| {
        let mut k = base.clone();
        change(&mut k);
        variants.push(k);
    };
    vary(&|k| k.cloud = Cloud::Gcp);
    vary(&|k| k.account.push('x'));
    vary(&|k| k.identity.push('x'));
    vary(&|k| k.scope.push('x'));
    vary(&|k| k.namespace.push('x'));
    vary(&|k| k.service_account.push('x'));
    vary(&|k| k.pod_uid = Some(String::new()));
    vary(&|k| k.pod_uid = Some("uid".into()));
    // Text moved from one field to the next is another key.
    vary(&|k| {
        k.namespace = "defaul".into();
        k.service_account = "tray".into();
    });
    // Past one write's room, hashed field by field.
    vary(&|k| k.scope = long_scope.clone());
    vary(&|k| {
        k.scope = long_scope.clone();
        k.namespace.push('x');
    });
    let mut seen = std::collections::HashSet::new();
    for k in &variants {
        let owned = hasher.hash_one(k);
        assert_eq!(owned, hasher.hash_one(k.as_ref()), "{k:?}");
        assert_eq!(owned, hasher.hash_one(k.clone()), "{k:?}");
        assert!(seen.insert(owned), "{k:?} hashes as another key");
    }
}

/// Requests served on another runtime (a serving thread's, as
/// `http::per_thread` runs them) start their exchange on the cache's own:
/// the upstream call neither waits behind that thread's queue nor ends
/// with its runtime.
#[test]
fn exchanges_run_on_the_runtime_the_cache_was_made_on() {
    let home = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("cache-home")
        .enable_all()
        .build()
        .unwrap();
    let cache = home.block_on(async { cache(CacheConfig::default()) });
    let ran_on = Arc::new(StdMutex::new(Vec::new()));
    let fetcher = {
        let ran_on = ran_on.clone();
        let up = Upstream::new(3600).fetcher();
        Arc::new(move |subject: SecretString| {
            let name = std::thread::current().name().map(str::to_string);
            ran_on.lock().unwrap().push(name);
            up(subject)
        }) as Fetcher
    };
    let k = key(Cloud::Azure, "sa", "scope");
    let served = std::thread::Builder::new()
        .name("serving".into())
        .spawn(move || {
            let serving = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            serving.block_on(async {
                cache
                    .get(k.as_ref(), &subject("s"), far(), || fetcher)
                    .await
                    .map(|c| token_of(&c))
            })
        })
        .unwrap()
        .join()
        .unwrap();
    assert_eq!(served.unwrap(), "token-1");
    assert_eq!(*ran_on.lock().unwrap(), [Some("cache-home".to_string())]);
}

/// The eviction the index finds is the one a scan of every entry finds
/// (the rule: among the callers holding the most, the least recently used
/// idle entry), through a long random run of new keys, hits, exchanges
/// starting and ending, removals and evictions.
#[tokio::test(start_paused = true)]
async fn the_index_evicts_what_a_full_scan_would() {
    use super::entries::Entries;
    let base = Instant::now();
    let up = Upstream::new(3600);
    let entry = |at: Instant| Entry {
        value: None,
        inflight: None,
        failure: None,
        subject: subject("s"),
        subject_until: at,
        fetcher: up.fetcher(),
        last_access: at,
        generation: 0,
    };
    // The rule, by scanning everything.
    let scan = |entries: &Entries, keys: &[Arc<CacheKey>]| {
        let mut held: std::collections::HashMap<&str, usize> = Default::default();
        for k in keys {
            *held.entry(k.service_account.as_str()).or_default() += 1;
        }
        keys.iter()
            .filter_map(|k| {
                let sa = k.service_account.as_str();
                let e = entries.entry_for_tests(k)?;
                e.inflight
                    .is_none()
                    .then(|| (held[sa], e.last_access, k.clone()))
            })
            .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)))
            .map(|(_, _, k)| k)
    };
    let mut entries = Entries::default();
    let mut keys: Vec<Arc<CacheKey>> = Vec::new();
    let mut seed: u64 = 0x5eed;
    let mut next = |n: usize| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) as usize) % n.max(1)
    };
    let (tx, rx) = watch::channel(None);
    for step in 0..4000u64 {
        let at = base + Duration::from_micros(step + 1);
        match next(10) {
            0..=3 => {
                let k = Arc::new(key(
                    Cloud::Azure,
                    &format!("sa{}", next(6)),
                    &format!("k{step}"),
                ));
                entries.insert(k.clone(), entry(at));
                keys.push(k);
            }
            4..=5 if !keys.is_empty() => {
                let k = keys[next(keys.len())].clone();
                entries.get_mut(&k).unwrap().last_access = at;
            }
            6 if !keys.is_empty() => {
                let k = keys[next(keys.len())].clone();
                let e = entries.get_mut(&k).unwrap();
                let ended = e.inflight.is_some();
                e.inflight = match e.inflight {
                    Some(_) => None,
                    None => Some(rx.clone()),
                };
                if ended {
                    entries.exchange_ended(&k);
                }
            }
            7 if !keys.is_empty() => {
                let k = keys.swap_remove(next(keys.len()));
                assert!(entries.remove(&k).is_some());
            }
            8 if !keys.is_empty() => {
                let k = keys[next(keys.len())].clone();
                let own = entries.least_recent_idle(&k.namespace, &k.service_account);
                let expected = keys
                    .iter()
                    .filter(|o| o.service_account == k.service_account)
                    .filter_map(|o| {
                        let e = entries.entry_for_tests(o)?;
                        e.inflight.is_none().then(|| (e.last_access, o.clone()))
                    })
                    .min_by_key(|(at, _)| *at)
                    .map(|(_, o)| o);
                assert_eq!(own, expected, "step {step}: a caller's own least recent");
            }
            _ => {
                let expected = scan(&entries, &keys);
                let victim = entries.eviction_victim();
                assert_eq!(victim, expected, "step {step}");
                if let Some(v) = victim {
                    entries.remove(&v);
                    keys.retain(|k| **k != *v);
                }
            }
        }
        if step % 97 == 0 {
            assert!(entries.index_is_exact(), "step {step}");
            assert_eq!(entries.len(), keys.len());
        }
    }
    drop(tx);
    // Sweeping (retain) keeps the index exact too.
    let cut = base + Duration::from_micros(2000);
    let removed = entries.retain(|_, e| e.last_access >= cut);
    keys.retain(|k| entries.entry_for_tests(k).is_some());
    assert_eq!(entries.len(), keys.len());
    assert!(removed > 0);
    assert!(entries.index_is_exact());
    assert_eq!(entries.eviction_victim(), scan(&entries, &keys));
}
