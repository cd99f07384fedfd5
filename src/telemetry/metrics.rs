//! Prometheus metrics, served as text on the admin port's `/metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::cloud::Cloud;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CloudLabel {
    pub cloud: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamLabel {
    pub cloud: &'static str,
    pub outcome: &'static str,
}

/// A credential request's decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabel {
    pub cloud: &'static str,
    /// `allow` or `deny`.
    pub decision: &'static str,
    /// `granted`, or why it was refused (`BrokerError::reason`).
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
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
    pub cache_hits: Family<CloudLabel, Counter>,
    pub cache_misses: Family<CloudLabel, Counter>,
    pub cache_coalesced: Family<CloudLabel, Counter>,
    pub cache_negative_hits: Family<CloudLabel, Counter>,
    pub cache_refreshes: Family<CloudLabel, Counter>,
    pub cache_refresh_failures: Family<CloudLabel, Counter>,
    pub cache_evictions: Family<ReasonLabel, Counter>,
    pub cache_entries: Gauge,
    pub upstream_requests: Family<UpstreamLabel, Counter>,
    pub upstream_latency: Family<CloudLabel, Histogram, fn() -> Histogram>,
    pub admissions: Family<DecisionLabel, Counter>,
    pub admission_latency: Histogram,
    pub decisions: Family<RequestLabel, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabel {
    /// `inject`, `unchanged`, `deny` or `error`.
    pub decision: &'static str,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
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
            cache_entries: Gauge::default(),
            upstream_requests: Family::default(),
            upstream_latency: Family::new_with_constructor(latency_histogram),
            admissions: Family::default(),
            admission_latency: Histogram::new([
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
            ]),
            decisions: Family::default(),
        };
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
            "decisions",
            "Credential requests decided, by cloud, decision and reason",
            m.decisions.clone(),
        );
        Metrics { registry, ..m }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
