//! The one wiring from [`Config`] to a ready [`Broker`], shared by
//! `lanyard agent`, `lanyard dev`, the standalone sidecar and the tests.
//! What differs between them is only where callers' tokens are verified
//! and where bindings come from ([`Parts`]); the clouds, their endpoints,
//! the cache and the node check come from configuration, the same way for
//! all of them.

use std::sync::Arc;
use std::time::Duration;

use super::Broker;
use crate::audit::{AuditSink, LogSink};
use crate::cache::Cache;
use crate::cloud::aws::{AwsCloud, AwsExchanger};
use crate::cloud::azure::{authority_for_cloud, AzureCloud, AzureExchanger, PUBLIC_CLOUD};
use crate::cloud::gcp::{GcpCloud, GcpExchanger, IAMCREDENTIALS_ENDPOINT, STS_ENDPOINT};
use crate::config::Config;
use crate::directory::Directory;
use crate::telemetry::metrics::Metrics;
use crate::token::Verifier;

/// What a role supplies: how callers are verified and where bindings come
/// from, and the cache (created first, since a Kubernetes directory
/// invalidates its entries).
pub struct Parts {
    /// Verifies callers' projected tokens: against the cluster issuer's keys
    /// (agent), the built-in issuer (dev), or claims only (standalone sidecar).
    pub verifier: Verifier,
    /// Where ServiceAccount bindings (and pod liveness) come from.
    pub directory: Arc<dyn Directory>,
    /// The credential cache the broker will use.
    pub cache: Cache,
    /// The metrics `cache` reports to, which the broker reports to as well.
    pub metrics: Arc<Metrics>,
    /// Where decisions (and policy reloads) are recorded.
    pub audit: Arc<dyn AuditSink>,
}

impl Parts {
    /// Parts with a new cache configured from `config`.
    pub fn new(config: &Config, verifier: Verifier, directory: Arc<dyn Directory>) -> Self {
        let metrics = Arc::new(Metrics::new());
        Parts {
            verifier,
            directory,
            cache: Cache::new(config.cache.to_cache_config(), metrics.clone()),
            metrics,
            audit: Arc::new(LogSink),
        }
    }
}

/// The broker `config` describes, over `parts`.
pub fn broker(config: &Config, parts: Parts, http: reqwest::Client) -> anyhow::Result<Broker> {
    let mut broker = Broker::new(parts.verifier, parts.directory)
        .with_cache(parts.cache, parts.metrics)
        .with_audit(parts.audit);
    if let Some(node) = &config.cluster.node_name {
        broker = broker.with_node_name(node.clone());
    }

    let authority = match &config.azure.authority_host {
        Some(host) => host.clone(),
        None => authority_for_cloud(&config.azure.cloud)
            .unwrap_or(PUBLIC_CLOUD)
            .to_string(),
    };
    broker = broker.with_cloud(AzureCloud {
        exchanger: AzureExchanger::new(http.clone(), authority),
        default_tenant: config.azure.tenant_id.clone(),
        audience: config.azure.audience.clone(),
    });

    if let Some(provider) = &config.gcp.workload_identity_provider {
        let project_id = config.gcp.project_id.clone().ok_or_else(|| {
            anyhow::anyhow!("gcp.project_id (LANYARD_GCP_PROJECT_ID) is required with a workload identity provider")
        })?;
        let project_number = match &config.gcp.project_number {
            Some(n) => n.clone(),
            None => provider
                .strip_prefix("//iam.googleapis.com/projects/")
                .and_then(|r| r.split('/').next())
                .unwrap_or_default()
                .to_string(),
        };
        let endpoint = |configured: &Option<String>, default: &str| {
            configured.clone().unwrap_or_else(|| default.to_string())
        };
        broker = broker.with_cloud(GcpCloud {
            exchanger: GcpExchanger::new(
                http.clone(),
                endpoint(&config.gcp.sts_endpoint, STS_ENDPOINT),
                endpoint(&config.gcp.iamcredentials_endpoint, IAMCREDENTIALS_ENDPOINT),
            ),
            provider: provider.clone(),
            audience: config
                .gcp
                .audience
                .clone()
                .unwrap_or_else(|| provider.clone()),
            project_id,
            project_number,
            token_lifetime: Duration::from_secs(config.gcp.token_lifetime),
        });
    }

    let endpoint = config
        .aws
        .sts_endpoint
        .clone()
        .unwrap_or_else(|| AwsExchanger::regional_endpoint(&config.aws.region));
    broker = broker.with_cloud(AwsCloud {
        exchanger: AwsExchanger::new(http, endpoint),
        audience: config.aws.audience.clone(),
        session_duration: Duration::from_secs(config.aws.session_duration),
    });
    Ok(broker)
}
