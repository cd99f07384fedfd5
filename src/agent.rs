//! `lanyard agent`: the node agent. Verifies callers' projected tokens
//! against the cluster issuer, resolves their bindings, decides, exchanges
//! through the cache, and answers sidecars on `POST /v1/token`; admin
//! endpoints on a separate port.

use std::sync::Arc;

use crate::audit::AuditSink;
use crate::broker::assemble::Parts;
use crate::broker::Broker;
use crate::cache::Cache;
use crate::config::Config;
use crate::directory::file::StaticDirectory;
use crate::directory::kube::{Invalidate, KubeDirectory, Watch};
use crate::directory::Directory;
use crate::http::{
    bind, drain, per_thread, shutdown_delay, spawn_server, wait_for_signal, Limits, Shutdown,
    DRAIN_TIMEOUT,
};
use crate::pod_events::Explained;
use crate::telemetry::metrics::Metrics;
use crate::telemetry::{Condition, Readiness};
use crate::token::{kube_get, Discovery, KeySet, KeySource, Verifier};

/// Connections the agent API keeps open at once (a node's sidecars, a
/// few pooled connections each); idle ones are shed first at the bound.
const AGENT_CONNECTIONS: usize = 16_384;

/// Builds the agent's broker from configuration.
pub async fn broker(config: &Config, metrics: Arc<Metrics>) -> anyhow::Result<Broker> {
    match (&config.cluster.node_name, config.cluster.insecure_no_node_name) {
        (None, false) => anyhow::bail!(
            "no node name: set --node-name or NODE_NAME (in a DaemonSet, from the downward API: fieldRef spec.nodeName); without it tokens cannot be kept to this node (--insecure-no-node-name runs without, for a single-node test only)"
        ),
        (None, true) => tracing::warn!(
            "running without a node name (--insecure-no-node-name): tokens are not kept to this node"
        ),
        (Some(_), _) => {}
    }
    let http = crate::http::client();
    let cache = Cache::new(config.cache.to_cache_config(), metrics.clone());
    // Static bindings when configured; otherwise the Kubernetes API.
    let kube = if config.cluster.service_accounts.is_empty() {
        Some(crate::http::kube_client().await.map_err(|e| {
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
    // Fail at start, with a message, when the issuer's keys are unreachable;
    // the keys loaded are the ones the first requests are verified with.
    let keys = KeySet::new(source, http.clone());
    keys.preload()
        .await
        .map_err(|e| anyhow::anyhow!("cannot load the cluster issuer's keys: {e}"))?;
    let mut verifier = Verifier::new(issuer, keys);
    if config.cluster.token_review {
        let client = kube.clone().ok_or_else(|| {
            anyhow::anyhow!(
                "cluster.token_review needs the Kubernetes API (no static service_accounts)"
            )
        })?;
        verifier = verifier.with_token_review(crate::token::TokenReviewer::new(client));
    }
    let sinks = crate::broker::assemble::audit(config, "agent", metrics.clone())?;
    let audit: Arc<dyn AuditSink> = match (&kube, &config.cluster.node_name) {
        // Denials explained on the calling pod need the API and a node name
        // to report as.
        (Some(client), Some(node)) => Arc::new(Explained::new(
            sinks,
            client.clone(),
            node.clone(),
            metrics.clone(),
        )),
        _ => Arc::new(sinks),
    };
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
                KubeDirectory::start(
                    client,
                    Watch {
                        node_name: config.cluster.node_name.clone(),
                        namespaces: config.policy.dir.is_some(),
                    },
                    invalidate,
                )
                .await?,
            )
        }
        None => Arc::new(
            StaticDirectory::new(&config.cluster.service_accounts)
                .with_namespaces(&config.cluster.namespaces),
        ),
    };
    crate::broker::assemble::broker(
        config,
        Parts {
            verifier,
            directory,
            cache,
            metrics,
            audit,
        },
        http,
    )
}

/// Runs the agent until SIGINT/SIGTERM.
///
/// `/readyz` answers from the start, 503 until the issuer's keys are loaded
/// and (with Kubernetes bindings) the ServiceAccount and pod reflectors hold
/// their first lists; then the agent API starts listening.
pub async fn run(config: Config) -> anyhow::Result<()> {
    // Before anything binds: a stop signal from now on is kept.
    crate::http::listen_for_signals();

    let metrics = Arc::new(Metrics::new());
    let (readiness, conditions) = readiness(&config);
    let (trigger, shutdown) = Shutdown::new();
    // INVARIANT: the admin port serves before the broker is assembled, so a
    // probe sees 503 (not a refused connection) while keys load and lists
    // sync; the API port is bound only once `broker` returns, so no request
    // reaches a half-built broker; and the conditions are set only once the
    // API listens, so "ready" means a request would be served.
    let admin = bind(config.admin_listen, "admin endpoints").await?;
    let admin_addr = admin.local_addr()?;
    let admin_server = spawn_server(
        admin,
        crate::telemetry::admin_router(metrics.clone(), readiness.clone()),
        shutdown.clone(),
    );
    let delay = std::time::Duration::from_secs(config.shutdown_delay_seconds);
    let broker = Arc::new(broker(&config, metrics).await?);
    let api = per_thread::bind(config.listen, "agent API", per_thread::default_threads()).await?;
    let api_addr = api.local_addr();
    let node = config.cluster.node_name.clone();
    // The broker keeps what it needs of the configuration; the rest (with
    // static bindings, every listed ServiceAccount's labels and
    // annotations: about 1.5 KB each) is not held for the agent's life.
    drop(config);
    let servers = [
        // Every sidecar on the node keeps a few pooled connections.
        per_thread::spawn(
            api,
            crate::serve::agent_api::router(broker),
            shutdown,
            Limits::api(AGENT_CONNECTIONS),
        ),
        admin_server,
    ];
    // `broker` returned only after its start-up probe found the issuer's
    // keys and `KubeDirectory::start` saw the first ServiceAccount (and pod)
    // list, so every condition holds; and the API is listening.
    for condition in &conditions {
        condition.set();
    }
    tracing::info!(api = %api_addr, admin = %admin_addr, node = ?node, "lanyard agent serving");
    let signal = wait_for_signal().await;
    // INVARIANT: the listeners stay open through the delay; only then does
    // the trigger stop accepting and drain what is in flight.
    shutdown_delay(signal, delay, || readiness.stop()).await;
    tracing::info!("shutting down");
    trigger.trigger();
    drain(servers, DRAIN_TIMEOUT).await;
    Ok(())
}

/// What the agent waits for before it is ready: the issuer's keys, and with
/// Kubernetes bindings the first ServiceAccount list (and, when it knows its
/// node, the first list of that node's pods; with a policy, the first list
/// of namespaces). Static bindings need no list.
fn readiness(config: &Config) -> (Readiness, Vec<Condition>) {
    let mut builder = Readiness::builder();
    let mut conditions = vec![builder.condition("issuer keys loaded")];
    if config.cluster.service_accounts.is_empty() {
        conditions.push(builder.condition("ServiceAccount list synced"));
        if config.cluster.node_name.is_some() {
            conditions.push(builder.condition("pod list synced"));
        }
        if config.policy.dir.is_some() {
            conditions.push(builder.condition("namespace list synced"));
        }
    }
    (builder.build(), conditions)
}
