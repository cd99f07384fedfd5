//! Cost of a new key in a full cache: each one counts its caller's entries
//! and evicts the least recently used idle entry of the caller holding the
//! most, under the cache lock that every cached hit also takes. The cache
//! holds `max_entries` (10,000, the default) across 100 ServiceAccounts;
//! then 5,000 new keys arrive, one at a time, round robin over the
//! callers. Prints the mean and p99 of one miss (the upstream answers at
//! once) and the hits a second served between them. Run:
//! `cargo bench --bench cache_misses`. It prints figures; it asserts none.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lanyard::cache::{Cache, CacheConfig, CacheKey, CallerLimits, FetchFuture, Fetcher};
use lanyard::cloud::{AccessToken, Cloud, Credential, PerCloud};
use lanyard::secret::SecretString;
use lanyard::telemetry::metrics::Metrics;

const CALLERS: usize = 100;
const ENTRIES: usize = 10_000;
const NEW_KEYS: usize = 5_000;

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn fetcher() -> Fetcher {
    Arc::new(|_subject: SecretString| {
        Box::pin(async {
            let now = now_unix();
            Ok(Credential::Token(AccessToken {
                rendered: Default::default(),
                token: SecretString::from("t".to_string()),
                issued_at: now,
                expires_at: now + 3600,
            }))
        }) as FetchFuture
    })
}

fn key(caller: usize, scope: usize) -> CacheKey {
    CacheKey {
        cloud: Cloud::Azure,
        account: "tenant".into(),
        identity: "client".into(),
        scope: format!("https://storage.azure.com/{scope}"),
        namespace: "ray".into(),
        service_account: format!("worker-{caller}"),
        pod_uid: None,
    }
}

async fn get(cache: &Cache, key: &CacheKey, subject: &SecretString, exp: u64) {
    cache
        .get(key.as_ref(), subject, exp, fetcher)
        .await
        .expect("the upstream answers");
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let config = CacheConfig {
        max_entries: ENTRIES,
        upstream_concurrency: 1024,
        rates: PerCloud::from_fn(|_| 1_000_000.0),
        caller: CallerLimits {
            inflight: 1024,
            new_keys_per_second: 1_000_000.0,
            new_keys_burst: 1_000_000.0,
            max_entries: ENTRIES,
        },
        ..Default::default()
    };
    let cache = Cache::new(config, Arc::new(Metrics::new()));
    let subject = SecretString::from("subject".to_string());
    let exp = now_unix() + 24 * 3600;
    for i in 0..ENTRIES {
        get(&cache, &key(i % CALLERS, i / CALLERS), &subject, exp).await;
    }
    assert_eq!(cache.len(), ENTRIES);
    let hit = key(0, ENTRIES);
    get(&cache, &hit, &subject, exp).await;
    let mut misses = Vec::with_capacity(NEW_KEYS);
    let started = Instant::now();
    let mut hits = 0u64;
    for i in 0..NEW_KEYS {
        let k = key(i % CALLERS, ENTRIES + 1 + i);
        let t = Instant::now();
        get(&cache, &k, &subject, exp).await;
        misses.push(t.elapsed());
        for _ in 0..10 {
            get(&cache, &hit, &subject, exp).await;
            hits += 1;
        }
    }
    let total = started.elapsed();
    misses.sort();
    let mean = misses.iter().sum::<Duration>() / misses.len() as u32;
    let p99 = misses[misses.len() * 99 / 100];
    println!(
        "{ENTRIES} entries, {CALLERS} callers, {NEW_KEYS} new keys: miss mean {:.1} µs, p99 {:.1} µs; {:.0} requests/s with 10 hits per miss",
        mean.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6,
        (NEW_KEYS as u64 + hits) as f64 / total.as_secs_f64()
    );
}
