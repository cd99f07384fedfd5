//! Prometheus metrics, served as text on the admin port's `/metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::cloud::Cloud;

/// The `cloud` label alone.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CloudLabel {
    /// [`Cloud::name`]: `azure`, `gcp` or `aws`.
    pub cloud: &'static str,
}

/// An upstream exchange's labels: which cloud, and how it ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamLabel {
    /// [`Cloud::name`]: `azure`, `gcp` or `aws`.
    pub cloud: &'static str,
    /// `ok`, or the [`crate::cloud::CloudError`] variant: `rejected`,
    /// `throttled`, `unavailable` or `protocol`.
    pub outcome: &'static str,
}

/// A credential request's decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabel {
    /// [`Cloud::name`]: `azure`, `gcp` or `aws`.
    pub cloud: &'static str,
    /// `allow` or `deny`.
    pub decision: &'static str,
    /// `granted`, or why it was refused (`BrokerError::reason`).
    pub reason: &'static str,
}

/// Why cache entries were evicted.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// `idle` (nobody asked for it within the idle TTL), `lru` (the cache was
    /// full) or `invalidated` (its ServiceAccount's bindings changed, or its pod
    /// is gone).
    pub reason: &'static str,
}

/// Label value of a cloud, without allocating.
pub fn cloud_label(cloud: Cloud) -> CloudLabel {
    CloudLabel {
        cloud: cloud.name(),
    }
}

fn latency_histogram() -> Histogram {
    Histogram::new([
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ])
}

/// Every metric Lanyard exports.
pub struct Metrics {
    registry: Registry,
    /// `lanyard_cache_hits`: requests served from a cached credential.
    pub cache_hits: Family<CloudLabel, Counter>,
    /// `lanyard_cache_misses`: requests that started an upstream exchange.
    pub cache_misses: Family<CloudLabel, Counter>,
    /// `lanyard_cache_coalesced`: requests that waited on an exchange another
    /// request had started (singleflight).
    pub cache_coalesced: Family<CloudLabel, Counter>,
    /// `lanyard_cache_negative_hits`: requests answered with a recently cached
    /// upstream refusal.
    pub cache_negative_hits: Family<CloudLabel, Counter>,
    /// `lanyard_cache_refreshes`: background refreshes started ahead of
    /// expiry.
    pub cache_refreshes: Family<CloudLabel, Counter>,
    /// `lanyard_cache_refresh_failures`: background refreshes that failed (the
    /// cached credential keeps being served while it may be).
    pub cache_refresh_failures: Family<CloudLabel, Counter>,
    /// `lanyard_cache_evictions`: entries removed, by reason.
    pub cache_evictions: Family<ReasonLabel, Counter>,
    /// `lanyard_cache_caller_limited`: requests refused because their
    /// ServiceAccount met one of its fairness bounds, by bound.
    pub cache_caller_limited: Family<ReasonLabel, Counter>,
    /// `lanyard_cache_entries`: entries in the cache now.
    pub cache_entries: Gauge,
    /// `lanyard_upstream_requests`: upstream exchanges, by cloud and outcome.
    pub upstream_requests: Family<UpstreamLabel, Counter>,
    /// `lanyard_upstream_latency_seconds`: how long upstream exchanges took,
    /// rate-limit wait excluded, by cloud.
    pub upstream_latency: Family<CloudLabel, Histogram, fn() -> Histogram>,
    /// `lanyard_admissions`: admission reviews the webhook answered, by
    /// decision.
    pub admissions: Family<DecisionLabel, Counter>,
    /// `lanyard_admission_latency_seconds`: time to answer an admission review.
    pub admission_latency: Histogram,
    /// `lanyard_guard_reviews`: reviews the governed-namespace guard
    /// answered, by decision and the rule that refused (`none` when
    /// allowed).
    pub guard_reviews: Family<GuardLabels, Counter>,
    /// `lanyard_decisions`: credential requests decided, by cloud, decision and
    /// reason.
    pub decisions: Family<RequestLabel, Counter>,
    /// `lanyard_policy_reloads`: policy sets loaded or rejected, by result.
    pub policy_reloads: Family<ResultLabel, Counter>,
    /// `lanyard_policy_policies`: policies in the set in force.
    pub policy_policies: Gauge,
    /// `lanyard_ready`: 1 once every start-up condition `/readyz` waits
    /// for is met, 0 before (set when `/metrics` is scraped).
    pub ready: Gauge,
    /// `lanyard_webhook_certificate_expiry_timestamp_seconds`: when the
    /// serving certificate the webhook uses now stops being valid (its
    /// `notAfter`, Unix seconds); 0 before one is loaded.
    pub webhook_certificate_expiry: Gauge,
    /// `lanyard_pod_events`: denials explained as Kubernetes Events on the
    /// calling pod, by result.
    pub pod_events: Family<ResultLabel, Counter>,
    /// `lanyard_audit_records`: audit records by sink and result.
    pub audit_records: Family<SinkResultLabels, Counter>,
    /// `lanyard_audit_write_seconds`: time to write (and sync) one batch
    /// of the file sink.
    pub audit_sync_seconds: Histogram,
    /// `lanyard_audit_export_backlog_records`: records in the audit file
    /// that an exporter has not delivered yet, by exporter (`syslog`,
    /// `http`); read when `/metrics` is scraped.
    pub audit_export_backlog: Family<SinkLabel, Gauge>,
    /// `lanyard_audit_export_max_backlog_records`: `audit.export_max_backlog`,
    /// the backlog past which `audit.export_when_full` applies (0 without
    /// an exporter).
    pub audit_export_max_backlog: Gauge,
    /// Run before each [`Metrics::render`]: gauges read from state that is
    /// cheaper to look at once per scrape than to keep current.
    before_render: std::sync::Mutex<Vec<ScrapeUpdate>>,
}

/// A gauge update run at each scrape ([`Metrics::before_render`]).
type ScrapeUpdate = Box<dyn Fn(&Metrics) + Send + Sync>;

/// An audit exporter's label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SinkLabel {
    /// `syslog` or `http`.
    pub sink: &'static str,
}

/// An audit record's labels: which sink, and what became of it.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SinkResultLabels {
    /// `file` or `stdout`.
    pub sink: &'static str,
    /// `written`; `failed` (the sink could not take it); `lost` (a
    /// credential was issued without it, `audit.on_failure: allow`).
    pub result: &'static str,
}

/// How an operation ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// Policy reloads: `loaded` or `rejected`. Pod events: `published`,
    /// `deduplicated` (the same denial was explained within the minute),
    /// `rate_limited`, `dropped` (the queue was full) or `failed` (the API
    /// server refused it).
    pub result: &'static str,
}

/// An admission review's label: what the webhook did with the pod.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabel {
    /// `inject`, `unchanged`, `deny` or `error`.
    pub decision: &'static str,
}

/// A guard review's labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GuardLabels {
    /// `allow`, `deny` or `error` (a review that could not be read).
    pub decision: &'static str,
    /// The rule that refused the pod, `none` otherwise.
    pub rule: &'static str,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Every metric at zero, registered under the `lanyard_` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("lanyard");
        let m = Metrics {
            registry: Registry::default(),
            cache_hits: Family::default(),
            cache_misses: Family::default(),
            cache_coalesced: Family::default(),
            cache_negative_hits: Family::default(),
            cache_refreshes: Family::default(),
            cache_refresh_failures: Family::default(),
            cache_evictions: Family::default(),
            cache_caller_limited: Family::default(),
            cache_entries: Gauge::default(),
            upstream_requests: Family::default(),
            upstream_latency: Family::new_with_constructor(latency_histogram),
            admissions: Family::default(),
            admission_latency: Histogram::new([
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
            ]),
            guard_reviews: Family::default(),
            decisions: Family::default(),
            policy_reloads: Family::default(),
            policy_policies: Gauge::default(),
            webhook_certificate_expiry: Gauge::default(),
            ready: Gauge::default(),
            pod_events: Family::default(),
            audit_records: Family::default(),
            audit_sync_seconds: Histogram::new([
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5,
            ]),
            audit_export_backlog: Family::default(),
            audit_export_max_backlog: Gauge::default(),
            before_render: std::sync::Mutex::new(Vec::new()),
        };
        // INVARIANT: the refresh counters exist at 0 for every cloud from
        // the start, so the first failure is an increase that `rate()`
        // sees (a series born at 1 has none, and LanyardRefreshFailing
        // would wait for a second failure).
        for cloud in Cloud::ALL {
            let label = CloudLabel {
                cloud: cloud.name(),
            };
            drop(m.cache_refreshes.get_or_create(&label));
            drop(m.cache_refresh_failures.get_or_create(&label));
        }
        registry.register(
            "cache_hits",
            "Requests served from a cached credential",
            m.cache_hits.clone(),
        );
        registry.register(
            "cache_misses",
            "Requests that started an upstream exchange",
            m.cache_misses.clone(),
        );
        registry.register(
            "cache_coalesced",
            "Requests that waited on an exchange another request started",
            m.cache_coalesced.clone(),
        );
        registry.register(
            "cache_negative_hits",
            "Requests answered with a recently cached upstream error",
            m.cache_negative_hits.clone(),
        );
        registry.register(
            "cache_refreshes",
            "Background refreshes started ahead of expiry",
            m.cache_refreshes.clone(),
        );
        registry.register(
            "cache_refresh_failures",
            "Background refreshes that failed",
            m.cache_refresh_failures.clone(),
        );
        registry.register(
            "cache_evictions",
            "Cache entries evicted, by reason",
            m.cache_evictions.clone(),
        );
        registry.register(
            "cache_caller_limited",
            "Requests refused because their ServiceAccount met a fairness bound (in-flight exchanges, new keys a second, entries), by bound",
            m.cache_caller_limited.clone(),
        );
        registry.register(
            "cache_entries",
            "Entries in the credential cache",
            m.cache_entries.clone(),
        );
        registry.register(
            "upstream_requests",
            "Upstream token exchanges, by cloud and outcome",
            m.upstream_requests.clone(),
        );
        registry.register(
            "upstream_latency_seconds",
            "Latency of upstream token exchanges",
            m.upstream_latency.clone(),
        );
        registry.register(
            "admissions",
            "Admission reviews answered by the webhook, by decision",
            m.admissions.clone(),
        );
        registry.register(
            "admission_latency_seconds",
            "Time to answer an admission review",
            m.admission_latency.clone(),
        );
        registry.register(
            "guard_reviews",
            "Reviews answered by the governed-namespace guard, by decision and refusing rule",
            m.guard_reviews.clone(),
        );
        registry.register(
            "decisions",
            "Credential requests decided, by cloud, decision and reason",
            m.decisions.clone(),
        );
        registry.register(
            "policy_reloads",
            "Policy sets loaded or rejected, by result",
            m.policy_reloads.clone(),
        );
        registry.register(
            "policy_policies",
            "Policies in the set in force",
            m.policy_policies.clone(),
        );
        registry.register(
            "ready",
            "1 once every start-up condition /readyz waits for is met, 0 before",
            m.ready.clone(),
        );
        registry.register(
            "webhook_certificate_expiry_timestamp_seconds",
            "When the webhook's serving certificate in use expires (notAfter, Unix seconds)",
            m.webhook_certificate_expiry.clone(),
        );
        registry.register(
            "pod_events",
            "Denials explained as Kubernetes Events on the calling pod, by result",
            m.pod_events.clone(),
        );
        registry.register(
            "audit_records",
            "Audit records by sink and result",
            m.audit_records.clone(),
        );
        registry.register(
            "audit_write_seconds",
            "Time to write and sync one batch of audit records to the file",
            m.audit_sync_seconds.clone(),
        );
        registry.register(
            "audit_export_backlog_records",
            "Audit records in the file an exporter has not delivered yet",
            m.audit_export_backlog.clone(),
        );
        registry.register(
            "audit_export_max_backlog_records",
            "The exporters' backlog bound (audit.export_max_backlog)",
            m.audit_export_max_backlog.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Runs `update` before each [`Metrics::render`], to set gauges from
    /// state read at scrape time.
    pub fn before_render(&self, update: impl Fn(&Metrics) + Send + Sync + 'static) {
        self.before_render
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Box::new(update));
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        for update in self
            .before_render
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            update(self);
        }
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
