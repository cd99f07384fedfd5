//! The credential cache: the one place that decides when Lanyard talks to a
//! cloud.
//!
//! - **Singleflight.** Concurrent misses for one key make one upstream call;
//!   every waiter gets its result. The call runs in its own task, so a
//!   client that disconnects cannot strand the others.
//! - **Refresh ahead.** A stored credential is refreshed in the background
//!   at about half its lifetime and never later than the SDKs' refresh
//!   window before expiry (20 min for AWS, 10 min for Entra and Google),
//!   with jitter, using the newest projected token seen for the key.
//! - **Serving rule.** A cached credential is handed out only while more
//!   than the surface's minimum remains (15 min for AWS so botocore does not
//!   refresh on every call, 5 min for Entra and Google). A fresh exchange is
//!   returned to its waiters even when shorter, but never served from the
//!   cache past that minimum.
//! - **Failures.** While refreshes fail, the cached credential keeps being
//!   served under the serving rule; retries back off exponentially with
//!   jitter and honour `Retry-After`. Deterministic refusals are remembered
//!   for a few seconds so a misconfigured pod cannot hammer the upstream.
//! - **Bounds.** At most `max_entries` (least recently used evicted first),
//!   idle entries dropped, upstream calls limited in concurrency and rate.
//!
//! Time is `tokio::time::Instant`, so tests drive all of this with paused
//! time; a credential's wall-clock expiry is converted once, when stored.

mod entries;
pub mod fairness;
mod key;
pub mod limits;
mod refreshes;

pub use crate::cloud::{Credential, FetchFuture, Fetcher, UpstreamCall};

use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::cloud::{now_unix, Cloud, CloudError, PerCloud};
use crate::secret::SecretString;
use crate::telemetry::metrics::{cloud_label, Metrics, ReasonLabel, UpstreamLabel};
use fairness::NewKeyBuckets;
pub use fairness::{CallerLimit, CallerLimits};
pub use key::{CacheKey, KeyRef};
use limits::UpstreamLimits;
use refreshes::{random_unit, schedule_refresh, Refreshes};
pub use refreshes::{refresh_at, MIN_REFRESH_AHEAD};

/// The longest a subject token is taken to stay valid (a year).
const SUBJECT_LIFETIME_CAP_SECS: u64 = 365 * 24 * 3600;

// A key is shared (`Arc`) by its entry, its index by caller, its exchange
// in flight and its scheduled refresh, rather than copied into each.
use entries::Entries;

/// How a request was answered, for the audit record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheOutcome {
    /// A cached credential.
    Hit,
    /// An exchange this request started.
    Miss,
    /// An exchange another request had started.
    Coalesced,
    /// A recently cached upstream refusal.
    Negative,
}

impl CacheOutcome {
    /// The name used in audit records.
    pub fn name(self) -> &'static str {
        match self {
            CacheOutcome::Hit => "hit",
            CacheOutcome::Miss => "miss",
            CacheOutcome::Coalesced => "coalesced",
            CacheOutcome::Negative => "negative",
        }
    }
}

/// Whether entries are shared by all pods of a service account or kept per pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheScope {
    /// All pods of a ServiceAccount share an entry (the default): fewest
    /// upstream exchanges.
    #[serde(rename = "serviceaccount")]
    ServiceAccount,
    /// Each pod has its own entries, so each exchange is made with that pod's
    /// own token and attributed to it upstream.
    Pod,
}

/// Cache settings.
#[derive(Debug, Clone)]
pub struct CacheConfig {
    /// Whether entries are shared per ServiceAccount or kept per pod.
    pub scope: CacheScope,
    /// Most entries held; at the bound the least recently used is evicted.
    pub max_entries: usize,
    /// Entries nobody asked for in this long are dropped (and not refreshed).
    pub idle_ttl: Duration,
    /// How long a deterministic refusal is remembered.
    pub negative_ttl: Duration,
    /// First delay before retrying a failed refresh; it doubles with each
    /// further failure (with jitter) up to `backoff_max`.
    pub backoff_base: Duration,
    /// Longest delay between retries of a failing refresh while the
    /// credential it refreshes is still served.
    pub backoff_max: Duration,
    /// Longest delay, after the last failure, before a key whose callers
    /// have nothing to be served is asked upstream again (unless the cloud's
    /// `Retry-After` says later): how soon a recovered cloud is asked again.
    pub retry_bound: Duration,
    /// Most upstream exchanges in flight at once, all clouds together.
    pub upstream_concurrency: usize,
    /// Upstream exchanges per second, per cloud.
    pub rates: PerCloud<f64>,
    /// Bounds per ServiceAccount, so that one caller cannot starve others.
    pub caller: CallerLimits,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            scope: CacheScope::ServiceAccount,
            max_entries: 10_000,
            // Longer than a credential's life: SDKs come back only near
            // expiry, and their entry must still be warm then.
            idle_ttl: Duration::from_secs(2 * 3600),
            negative_ttl: Duration::from_secs(10),
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(300),
            retry_bound: Duration::from_secs(5),
            upstream_concurrency: 64,
            rates: PerCloud::from_fn(Cloud::default_rate),
            caller: CallerLimits::default(),
        }
    }
}

/// A credential as the cache hands it out, with its fingerprint computed
/// once per exchange rather than once per request (audit records name it).
#[derive(Clone, Debug)]
pub struct Served {
    /// The credential itself, shared: a cache hit copies no secret.
    pub credential: Arc<Credential>,
    /// [`Credential::fingerprint`] of `credential`.
    pub fingerprint: Arc<str>,
}

/// An exchange's result, with the upstream call that produced it (`None`
/// when none was made: an expired subject token).
type Outcome = Option<(Result<Served, CloudError>, Option<Arc<UpstreamCall>>)>;

/// How [`Cache::get_traced`] answered one request.
pub struct Traced {
    /// Hit, miss, coalesced or negative.
    pub outcome: CacheOutcome,
    /// The credential, or why there is none.
    pub result: Result<Served, CloudError>,
    /// The upstream call this request waited on (a miss or a coalesced
    /// request); `None` for hits and remembered refusals.
    pub upstream: Option<Arc<UpstreamCall>>,
}

struct Stored {
    served: Served,
    expires: Instant,
}

struct Failure {
    error: CloudError,
    retry_at: Instant,
    attempts: u32,
}

impl Failure {
    /// The error to give a caller at `now`: a throttling error says how
    /// long until the key is asked upstream again, so that the SDK's retry
    /// comes when it can succeed (at least 1 s, as `Retry-After` counts).
    fn until(&self, now: Instant) -> CloudError {
        match &self.error {
            CloudError::Throttled { cloud, code, .. } => CloudError::Throttled {
                cloud: *cloud,
                code: code.clone(),
                retry_after: Some(
                    Duration::from_secs(
                        self.retry_at
                            .saturating_duration_since(now)
                            .as_secs_f64()
                            .ceil() as u64,
                    )
                    .max(Duration::from_secs(1)),
                ),
            },
            other => other.clone(),
        }
    }
}

struct Entry {
    value: Option<Stored>,
    inflight: Option<watch::Receiver<Outcome>>,
    /// Boxed: most entries never have one, and every map slot would
    /// otherwise be sized for it.
    failure: Option<Box<Failure>>,
    subject: SecretString,
    subject_until: Instant,
    fetcher: Fetcher,
    last_access: Instant,
    /// Bumped on every stored value; a scheduled refresh for an older
    /// generation does nothing.
    generation: u64,
}

struct Inner {
    entries: Mutex<Entries>,
    /// `cache_hits` per cloud, resolved once: the hit path counts without
    /// a label lookup.
    hits: PerCloud<prometheus_client::metrics::counter::Counter>,
    config: CacheConfig,
    limits: UpstreamLimits,
    /// New-key buckets per caller.
    // INVARIANT: taken only while `entries` is held, never the other way
    // round.
    new_keys: Mutex<NewKeyBuckets>,
    /// Every entry's next refresh, served by one task.
    // INVARIANT: its lock is taken while `entries` may be held (an
    // exchange completing schedules the next refresh), never the other
    // way round: the refresh task releases it before refreshing.
    refreshes: Refreshes,
    metrics: Arc<Metrics>,
    /// The runtime the cache was made on, where its exchanges and refresh
    /// task run. Requests may be served on other runtimes (one per serving
    /// thread, `http::per_thread`); an exchange started there would wait
    /// behind that thread's queue of requests (a herd's), and the refresh
    /// task would stop with that thread's runtime.
    runtime: Option<tokio::runtime::Handle>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The refresh task holds only a weak reference: woken, it finds
        // the cache gone and ends.
        self.refreshes.wake();
    }
}

/// The credential cache. Cheap to clone.
#[derive(Clone)]
pub struct Cache {
    inner: Arc<Inner>,
}

impl Cache {
    /// Creates the cache and, when inside a Tokio runtime, its idle sweeper.
    pub fn new(config: CacheConfig, metrics: Arc<Metrics>) -> Self {
        let inner = Arc::new(Inner {
            entries: Mutex::new(Entries::default()),
            hits: PerCloud::from_fn(|cloud| {
                metrics
                    .cache_hits
                    .get_or_create(&cloud_label(cloud))
                    .clone()
            }),
            limits: UpstreamLimits::new(config.upstream_concurrency, config.rates),
            new_keys: Mutex::new(NewKeyBuckets::new()),
            refreshes: Refreshes::new(),
            config,
            metrics,
            runtime: tokio::runtime::Handle::try_current().ok(),
        });
        if let Some(runtime) = &inner.runtime {
            runtime.spawn(sweep(Arc::downgrade(&inner)));
        }
        Cache { inner }
    }

    /// How entries are shared, as configured: the broker puts the pod's uid in
    /// the key only for [`CacheScope::Pod`].
    pub fn scope(&self) -> CacheScope {
        self.inner.config.scope
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.inner.lock().len()
    }

    /// Whether the cache holds no entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Returns a servable credential for `key`, exchanging upstream (once,
    /// however many ask at the same time) when there is none. `subject` is
    /// the caller's verified projected token, valid until `subject_exp`
    /// (Unix seconds); `fetcher` is only called when the entry needs one.
    pub async fn get(
        &self,
        key: KeyRef<'_>,
        subject: &SecretString,
        subject_exp: u64,
        fetcher: impl FnOnce() -> Fetcher,
    ) -> Result<Arc<Credential>, CloudError> {
        self.get_traced(key, subject, subject_exp, fetcher)
            .await
            .result
            .map(|served| served.credential)
    }

    /// As [`Cache::get`], also saying how the request was answered.
    pub async fn get_traced(
        &self,
        key: KeyRef<'_>,
        subject: &SecretString,
        subject_exp: u64,
        fetcher: impl FnOnce() -> Fetcher,
    ) -> Traced {
        let inner = &self.inner;
        let cloud = key.cloud;
        let label = cloud_label(cloud);
        let now = Instant::now();
        // Capped: a token's `exp` is the issuer's word, and an instant far
        // enough out overflows (kube-apiserver issues at most days).
        let subject_until = now
            + Duration::from_secs(
                subject_exp
                    .saturating_sub(now_unix())
                    .min(SUBJECT_LIFETIME_CAP_SECS),
            );
        let receiver = {
            let mut entries = inner.lock();
            match entries.get_mut(&key) {
                Some(entry) => {
                    entry.last_access = now;
                    if subject_until > entry.subject_until {
                        // Newer projected token: refreshes use it from now on.
                        entry.subject = subject.clone();
                        entry.subject_until = subject_until;
                    }
                    if let Some(stored) = &entry.value {
                        if stored.expires > now + cloud.min_remaining() {
                            inner.hits[cloud].inc();
                            return Traced {
                                outcome: CacheOutcome::Hit,
                                result: Ok(stored.served.clone()),
                                upstream: None,
                            };
                        }
                    }
                    let coalesce = match (&entry.inflight, &entry.failure) {
                        (Some(rx), _) => Some(rx.clone()),
                        (None, Some(failure)) if failure.retry_at > now => {
                            inner
                                .metrics
                                .cache_negative_hits
                                .get_or_create(&label)
                                .inc();
                            return Traced {
                                outcome: CacheOutcome::Negative,
                                result: Err(failure.until(now)),
                                upstream: None,
                            };
                        }
                        (None, _) => None,
                    };
                    if let Some(rx) = coalesce {
                        inner.metrics.cache_coalesced.get_or_create(&label).inc();
                        (CacheOutcome::Coalesced, rx)
                    } else {
                        // A new exchange for this caller: within its bound.
                        let (_, inflight) = caller_use(&entries, &key);
                        if inflight >= inner.config.caller.inflight.max(1) {
                            return inner.limited(cloud, CallerLimit::Inflight, None);
                        }
                        // Still there: the lock has been held since the lookup.
                        let Some((owned, entry)) = entries.get_key_value_mut(&key) else {
                            let reason = "cache entry vanished".into();
                            return Traced {
                                outcome: CacheOutcome::Miss,
                                result: Err(CloudError::Unavailable { cloud, reason }),
                                upstream: None,
                            };
                        };
                        inner.metrics.cache_misses.get_or_create(&label).inc();
                        let key = owned.clone();
                        (CacheOutcome::Miss, start_fetch(inner, &key, entry, false))
                    }
                }
                None => {
                    if let Err(limit) = inner.admit_new_key(&mut entries, &key, now) {
                        return limit;
                    }
                    inner.make_room(&mut entries);
                    let mut entry = Entry {
                        value: None,
                        inflight: None,
                        failure: None,
                        subject: subject.clone(),
                        subject_until,
                        fetcher: fetcher(),
                        last_access: now,
                        generation: 0,
                    };
                    inner.metrics.cache_misses.get_or_create(&label).inc();
                    // The exchange's task cannot record its result before
                    // the entry is in the map: it needs this lock.
                    let key = Arc::new(key.to_key());
                    let rx = start_fetch(inner, &key, &mut entry, false);
                    entries.insert(key, entry);
                    inner.metrics.cache_entries.set(entries.len() as i64);
                    (CacheOutcome::Miss, rx)
                }
            }
        };
        let (outcome, receiver) = receiver;
        let (result, upstream) = wait(receiver, cloud).await;
        Traced {
            outcome,
            result,
            upstream,
        }
    }

    /// Drops every entry of a service account (deleted, or bindings changed).
    pub fn invalidate_service_account(&self, namespace: &str, name: &str) {
        self.inner.remove_where("invalidated", |k| {
            k.namespace == namespace && k.service_account == name
        });
    }

    /// Drops the entries scoped to one pod (the pod is gone).
    pub fn invalidate_pod(&self, pod_uid: &str) {
        self.inner
            .remove_where("invalidated", |k| k.pod_uid.as_deref() == Some(pod_uid));
    }
}

/// How many entries `key`'s caller holds, and how many of them have an
/// exchange in flight (a look at that caller's entries only).
fn caller_use(entries: &Entries, key: &KeyRef<'_>) -> (usize, usize) {
    entries.holding(key.namespace, key.service_account)
}

async fn wait(
    mut rx: watch::Receiver<Outcome>,
    cloud: Cloud,
) -> (Result<Served, CloudError>, Option<Arc<UpstreamCall>>) {
    match rx.wait_for(|v| v.is_some()).await {
        Ok(outcome) => outcome.clone().unwrap_or_else(|| {
            let reason = "exchange produced no result".into();
            (Err(CloudError::Unavailable { cloud, reason }), None)
        }),
        Err(_) => {
            let reason = "exchange was abandoned".into();
            (Err(CloudError::Unavailable { cloud, reason }), None)
        }
    }
}

/// Starts the upstream call for `entry` in its own task.
fn start_fetch(
    inner: &Arc<Inner>,
    key: &Arc<CacheKey>,
    entry: &mut Entry,
    is_refresh: bool,
) -> watch::Receiver<Outcome> {
    let (tx, rx) = watch::channel(None);
    entry.inflight = Some(rx.clone());
    let subject = entry.subject.clone();
    let subject_until = entry.subject_until;
    let fetcher = entry.fetcher.clone();
    let inner = inner.clone();
    let key = key.clone();
    let this = rx.clone();
    inner.clone().spawn(async move {
        let (result, upstream) = if subject_until <= Instant::now() {
            // Never send an expired subject token upstream.
            let expired = CloudError::Rejected {
                cloud: key.cloud,
                code: "ExpiredSubjectToken".into(),
                message: "the pod's projected service account token has expired".into(),
            };
            (Err(expired), None)
        } else {
            let (result, call) = inner.exchange(key.cloud, fetcher, subject).await;
            (result, Some(Arc::new(call)))
        };
        let result = result.map(|credential| Served {
            fingerprint: credential.fingerprint().into(),
            credential: Arc::new(credential),
        });
        inner.complete(&key, &this, &result, is_refresh);
        let _ = tx.send(Some((result, upstream)));
    });
    rx
}

impl Inner {
    /// Starts `task` on the cache's runtime (see [`Inner::runtime`]), or on
    /// the caller's for a cache made outside one.
    fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        match &self.runtime {
            Some(runtime) => drop(runtime.spawn(task)),
            None => drop(tokio::spawn(task)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Entries> {
        // A panic while holding the lock leaves plain data behind; keep going.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One upstream call, within the limits, with metrics.
    async fn exchange(
        &self,
        cloud: Cloud,
        fetcher: Fetcher,
        subject: SecretString,
    ) -> (Result<Credential, CloudError>, UpstreamCall) {
        let _permit = self.limits.admit(cloud).await;
        let started = Instant::now();
        let (result, request_id) = crate::cloud::with_request_id(fetcher(subject)).await;
        let latency = started.elapsed();
        let label = cloud_label(cloud);
        self.metrics
            .upstream_latency
            .get_or_create(&label)
            .observe(latency.as_secs_f64());
        let outcome = match &result {
            Ok(_) => "ok",
            Err(CloudError::Rejected { .. }) => "rejected",
            Err(CloudError::Throttled { .. } | CloudError::CallerLimited { .. }) => "throttled",
            Err(CloudError::Unavailable { .. }) => "unavailable",
            Err(CloudError::Protocol { .. }) => "protocol",
        };
        self.metrics
            .upstream_requests
            .get_or_create(&UpstreamLabel {
                cloud: label.cloud,
                outcome,
            })
            .inc();
        (
            result,
            UpstreamCall {
                latency,
                request_id,
            },
        )
    }

    /// Records an exchange's result in its entry and schedules what follows.
    /// `this` is the exchange's receiver: the entry it was started for is
    /// the one whose `inflight` it still is.
    fn complete(
        self: &Arc<Self>,
        key: &Arc<CacheKey>,
        this: &watch::Receiver<Outcome>,
        result: &Result<Served, CloudError>,
        is_refresh: bool,
    ) {
        let now = Instant::now();
        let mut entries = self.lock();
        let Some(entry) = entries
            .get_mut(key)
            .filter(|e| e.inflight.as_ref().is_some_and(|rx| rx.same_channel(this)))
        else {
            // Evicted or invalidated meanwhile, maybe replaced by a new
            // entry with an exchange of its own: the waiters still get this
            // result, but it is not stored, nor does it touch the new entry.
            return;
        };
        entry.inflight = None;
        match result {
            Ok(served) => {
                let remaining =
                    Duration::from_secs(served.credential.expires_at().saturating_sub(now_unix()));
                let expires = now + remaining;
                entry.value = Some(Stored {
                    served: served.clone(),
                    expires,
                });
                entry.failure = None;
                entry.generation += 1;
                // A credential (almost) too short to be served from the
                // cache is not refreshed ahead (`refresh_at`): the next
                // request exchanges instead.
                if let Some(at) = refresh_at(key.cloud, now, expires) {
                    schedule_refresh(self, key.clone(), entry.generation, at);
                }
            }
            Err(error) => {
                if is_refresh {
                    self.metrics
                        .cache_refresh_failures
                        .get_or_create(&cloud_label(key.cloud))
                        .inc();
                }
                let attempts = entry.failure.as_ref().map_or(1, |f| f.attempts + 1);
                // INVARIANT: callers are never kept from a recovered cloud
                // longer than `retry_bound` (jittered to [50%, 100%]) past
                // the moment the stored credential stops being served (at
                // once when there is none), unless the cloud's Retry-After
                // says later: the backoff grows only while a credential
                // still covers the callers.
                let servable_for = entry.value.as_ref().map_or(Duration::ZERO, |v| {
                    v.expires
                        .saturating_duration_since(now + key.cloud.min_remaining())
                });
                let bound = self.config.retry_bound.mul_f64(0.5 + 0.5 * random_unit());
                let backoff = self.backoff(attempts).min(servable_for.max(bound));
                let delay = match error {
                    CloudError::Rejected { .. } => self.config.negative_ttl,
                    CloudError::Throttled {
                        retry_after: Some(after),
                        ..
                    } => (*after).max(backoff),
                    _ => backoff,
                };
                let retry_at = now + delay;
                entry.failure = Some(Box::new(Failure {
                    error: error.clone(),
                    retry_at,
                    attempts,
                }));
                // Keep a credential that is still worth serving fresh.
                if entry.value.as_ref().is_some_and(|v| v.expires > retry_at) {
                    schedule_refresh(self, key.clone(), entry.generation, retry_at);
                }
            }
        }
        entries.exchange_ended(key);
        tracing::debug!(cloud = %key.cloud, namespace = %key.namespace, service_account = %key.service_account, ok = result.is_ok(), is_refresh, "exchange completed");
    }

    /// Exponential backoff with full jitter in [50%, 100%].
    fn backoff(&self, attempts: u32) -> Duration {
        let exp = self
            .config
            .backoff_base
            .saturating_mul(1u32 << attempts.saturating_sub(1).min(16));
        let capped = exp.min(self.config.backoff_max);
        capped.mul_f64(0.5 + 0.5 * random_unit())
    }

    /// Background refresh of `key` if it is still wanted.
    fn refresh(self: &Arc<Self>, key: &Arc<CacheKey>, generation: u64) {
        let now = Instant::now();
        let mut entries = self.lock();
        let Some(entry) = entries.get_mut(key) else {
            return;
        };
        if entry.generation != generation || entry.inflight.is_some() {
            return;
        }
        if now.duration_since(entry.last_access) >= self.config.idle_ttl {
            entries.remove(key);
            self.metrics
                .cache_evictions
                .get_or_create(&ReasonLabel { reason: "idle" })
                .inc();
            self.metrics.cache_entries.set(entries.len() as i64);
            return;
        }
        if entry.subject_until <= now + Duration::from_secs(5) {
            // The newest projected token is (nearly) expired; the next
            // request brings a fresh one and fetches then.
            return;
        }
        self.metrics
            .cache_refreshes
            .get_or_create(&cloud_label(key.cloud))
            .inc();
        drop(start_fetch(self, key, entry, true));
    }

    /// Makes room for one entry when the cache is full: evicts the least
    /// recently used idle entry of the caller holding the most entries, so
    /// that a caller filling the cache loses its own entries first.
    fn make_room(&self, entries: &mut Entries) {
        while entries.len() >= self.config.max_entries.max(1) {
            let victim = entries.eviction_victim();
            let Some(victim) = victim else {
                return; // everything is in flight; allow a temporary overshoot
            };
            entries.remove(&victim);
            self.metrics
                .cache_evictions
                .get_or_create(&ReasonLabel { reason: "lru" })
                .inc();
        }
    }

    /// A caller's request that met one of its bounds: a throttling answer,
    /// counted, nothing else touched.
    fn limited(&self, cloud: Cloud, limit: CallerLimit, wait: Option<Duration>) -> Traced {
        self.metrics
            .cache_caller_limited
            .get_or_create(&ReasonLabel {
                reason: limit.name(),
            })
            .inc();
        Traced {
            outcome: CacheOutcome::Miss,
            result: Err(CloudError::CallerLimited {
                cloud,
                limit,
                retry_after: wait
                    .unwrap_or(Duration::from_secs(1))
                    .max(Duration::from_secs(1)),
            }),
            upstream: None,
        }
    }

    /// Whether `key`, new to the cache, may be added for its caller: within
    /// its in-flight bound and new-key rate, with room among its entries
    /// (its own least recently used idle entry gives way at the bound).
    fn admit_new_key(
        &self,
        entries: &mut Entries,
        key: &KeyRef<'_>,
        now: Instant,
    ) -> Result<(), Traced> {
        let limits = &self.config.caller;
        let (held, inflight) = caller_use(entries, key);
        if inflight >= limits.inflight.max(1) {
            return Err(self.limited(key.cloud, CallerLimit::Inflight, None));
        }
        let rate = self
            .new_keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take(key.namespace, key.service_account, limits, now);
        if let Err(wait) = rate {
            return Err(self.limited(key.cloud, CallerLimit::NewKeys, Some(wait)));
        }
        if held >= limits.max_entries.max(1) {
            let own = entries.least_recent_idle(key.namespace, key.service_account);
            let Some(own) = own else {
                return Err(self.limited(key.cloud, CallerLimit::Entries, None));
            };
            entries.remove(&own);
            self.metrics
                .cache_evictions
                .get_or_create(&ReasonLabel {
                    reason: "caller_quota",
                })
                .inc();
        }
        Ok(())
    }

    fn remove_where(&self, reason: &'static str, pred: impl Fn(&CacheKey) -> bool) {
        let mut entries = self.lock();
        let removed = entries.retain(|k, _| !pred(k));
        if removed > 0 {
            self.metrics
                .cache_evictions
                .get_or_create(&ReasonLabel { reason })
                .inc_by(removed as u64);
            self.metrics.cache_entries.set(entries.len() as i64);
        }
    }
}

/// Drops entries nobody asked for within the idle TTL.
async fn sweep(inner: Weak<Inner>) {
    loop {
        let period = match inner.upgrade() {
            Some(i) => {
                (i.config.idle_ttl / 4).clamp(Duration::from_secs(1), Duration::from_secs(60))
            }
            None => return,
        };
        tokio::time::sleep(period).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let now = Instant::now();
        let idle = inner.config.idle_ttl;
        let mut entries = inner.lock();
        let removed =
            entries.retain(|_, e| e.inflight.is_some() || now.duration_since(e.last_access) < idle);
        if removed > 0 {
            inner
                .metrics
                .cache_evictions
                .get_or_create(&ReasonLabel { reason: "idle" })
                .inc_by(removed as u64);
            inner.metrics.cache_entries.set(entries.len() as i64);
        }
    }
}

#[cfg(test)]
mod tests;
