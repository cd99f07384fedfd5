//! `lanyard agent`: the node agent. Verifies callers' projected tokens
//! against the cluster issuer, resolves their bindings, decides, exchanges
//! through the cache, and answers sidecars on `POST /v1/token`; admin
//! endpoints on a separate port.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use crate::broker::assemble::Parts;
use crate::broker::Broker;
use crate::cache::Cache;
use crate::config::Config;
use crate::directory::file::StaticDirectory;
use crate::directory::kube::{Invalidate, KubeDirectory};
use crate::directory::Directory;
use crate::http::{bind, spawn_server, Shutdown};
use crate::telemetry::metrics::Metrics;
use crate::token::{kube_get, Discovery, KeySet, KeySource, Lookup, Verifier};

/// Builds the agent's broker from configuration.
pub async fn broker(config: &Config, metrics: Arc<Metrics>) -> anyhow::Result<Broker> {
    let http = crate::http::client();
    let cache = Cache::new(config.cache.to_cache_config(), metrics.clone());
    // Static bindings when configured; otherwise the Kubernetes API.
    let kube = if config.cluster.service_accounts.is_empty() {
        Some(kube::Client::try_default().await.map_err(|e| {
            anyhow::anyhow!(
                "no Kubernetes API: {e} (run in a cluster, set KUBECONFIG, or configure cluster.service_accounts)"
            )
        })?)
    } else {
        None
    };
    let issuer = match (&config.cluster.issuer, &kube) {
        (Some(issuer), _) => issuer.clone(),
        (None, Some(client)) => {
            let doc: Discovery = kube_get(client, "/.well-known/openid-configuration", "OIDC discovery")
                .await
                .map_err(|e| anyhow::anyhow!("cannot read the cluster's service-account issuer: {e}"))?;
            doc.issuer
        }
        (None, None) => anyhow::bail!(
            "no cluster issuer: set cluster.issuer (LANYARD_CLUSTER_ISSUER) to the service-account issuer URL"
        ),
    };
    let source = match (&config.cluster.jwks_url, &kube) {
        (Some(url), _) => KeySource::Jwks { url: url.clone() },
        (None, Some(client)) => KeySource::KubeApi {
            client: client.clone(),
        },
        (None, None) => KeySource::Discovery {
            issuer: issuer.clone(),
        },
    };
    // Fail at start, with a message, when the issuer's keys are unreachable.
    let probe = KeySet::new(source.clone(), http.clone());
    match probe.lookup(Some("lanyard-startup-probe")).await {
        Ok(Lookup::Unknown) | Ok(Lookup::Found(..)) => {}
        Err(e) => anyhow::bail!("cannot load the cluster issuer's keys: {e}"),
    }
    let mut verifier = Verifier::new(issuer, KeySet::new(source, http.clone()));
    if config.cluster.token_review {
        let client = kube.clone().ok_or_else(|| {
            anyhow::anyhow!(
                "cluster.token_review needs the Kubernetes API (no static service_accounts)"
            )
        })?;
        verifier = verifier.with_token_review(crate::token::TokenReviewer::new(client));
    }
    let directory: Arc<dyn Directory> = match kube {
        Some(client) => {
            let (sa_cache, pod_cache) = (cache.clone(), cache.clone());
            let invalidate = Arc::new(Invalidate {
                service_account: Box::new(move |ns, name| {
                    sa_cache.invalidate_service_account(ns, name)
                }),
                pod: Box::new(move |uid| pod_cache.invalidate_pod(uid)),
            });
            Arc::new(
                KubeDirectory::start(client, config.cluster.node_name.clone(), invalidate).await?,
            )
        }
        None => Arc::new(StaticDirectory::new(&config.cluster.service_accounts)),
    };
    crate::broker::assemble::broker(
        config,
        Parts {
            verifier,
            directory,
            cache,
            metrics,
        },
        http,
    )
}

/// Runs the agent until SIGINT/SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::new());
    let broker = Arc::new(broker(&config, metrics.clone()).await?);
    let (trigger, shutdown) = Shutdown::new();
    let api = bind(config.listen, "agent API").await?;
    let admin = bind(config.admin_listen, "admin endpoints").await?;
    let api_addr = api.local_addr()?;
    let admin_addr = admin.local_addr()?;
    let ready = Arc::new(AtomicBool::new(true));
    let servers = [
        spawn_server(
            api,
            crate::serve::agent_api::router(broker),
            shutdown.clone(),
        ),
        spawn_server(
            admin,
            crate::telemetry::admin_router(metrics, ready),
            shutdown,
        ),
    ];
    tracing::info!(api = %api_addr, admin = %admin_addr, node = ?config.cluster.node_name, "lanyard agent serving");
    crate::http::wait_for_signal().await;
    tracing::info!("shutting down");
    trigger.trigger();
    for server in servers {
        let _ = tokio::time::timeout(Duration::from_secs(10), server).await;
    }
    Ok(())
}
