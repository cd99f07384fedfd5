//! The webhook's HTTPS server: `POST /mutate` for AdmissionReviews and
//! `POST /validate` for the governed-namespace guard ([`super::guard`]),
//! with the TLS certificate and key re-read when their files change
//! (cert-manager rotates them in place), and the ServiceAccount lookup with
//! a short bounded retry for an account created moments before its pod.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::routing::post;
use axum::{Json, Router};
use axum_server::tls_rustls::RustlsConfig;

use super::guard::{self, Guard};
use super::review::{self, Action, Answer, Scope};
use super::{mutate, respond, InjectionConfig};
use crate::audit::{Admission, AuditSink, ConfigReload};
use crate::directory::{Bindings, Directory};
use crate::telemetry::metrics::{DecisionLabel, GuardLabels, Metrics};
use crate::telemetry::Readiness;

/// How often and how many times a missing ServiceAccount is looked up again
/// before the pod is admitted without injection.
const LOOKUP_RETRIES: u32 = 5;
const LOOKUP_BACKOFF: Duration = Duration::from_millis(200);

struct Webhook {
    injection: InjectionConfig,
    guard: Guard,
    directory: Arc<dyn Directory>,
    metrics: Arc<Metrics>,
    audit: Arc<dyn AuditSink>,
}

/// Where the TLS material lives and how often to look for a new one.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The PEM certificate chain.
    pub cert: PathBuf,
    /// The PEM private key of that certificate.
    pub key: PathBuf,
    /// How often the files' modification times are checked; a changed pair is
    /// loaded without a restart.
    pub reload_every: Duration,
}

/// A running webhook server.
pub struct WebhookServer {
    /// The address the HTTPS endpoint is bound to (the actual port when port 0
    /// was asked).
    pub addr: SocketAddr,
    handle: axum_server::Handle<SocketAddr>,
    server: tokio::task::JoinHandle<()>,
    reload: tokio::task::JoinHandle<()>,
}

/// How long in-flight reviews get to finish once [`WebhookServer::stop`] is
/// called; kube-apiserver's own webhook timeout is at most 30 s, 10 s by
/// default.
const DRAIN: Duration = Duration::from_secs(10);

/// The certificate and key files' bytes.
type PemPair = (Vec<u8>, Vec<u8>);

/// The digests of the certificate and key files' bytes.
type PairDigest = [Option<[u8; 32]>; 2];

/// What a reload is judged on: the bytes of the certificate and key files
/// as read, as one digest (`None` for a file that cannot be read), and the
/// bytes themselves.
fn read_pair(tls: &TlsFiles) -> (PairDigest, Option<PemPair>) {
    use sha2::{Digest, Sha256};
    let (cert, key) = (std::fs::read(&tls.cert).ok(), std::fs::read(&tls.key).ok());
    let digest = |b: &Option<Vec<u8>>| b.as_ref().map(|b| Sha256::digest(b).into());
    let seen = [digest(&cert), digest(&key)];
    (seen, cert.zip(key))
}

impl WebhookServer {
    /// Loads the certificate and starts serving on `listen`.
    pub async fn start(
        listen: SocketAddr,
        tls: TlsFiles,
        injection: InjectionConfig,
        guard: Guard,
        directory: Arc<dyn Directory>,
        metrics: Arc<Metrics>,
        audit: Arc<dyn AuditSink>,
    ) -> anyhow::Result<WebhookServer> {
        injection
            .validate()
            .map_err(|e| anyhow::anyhow!("invalid injection settings: {e}"))?;
        // INVARIANT: the pair served first and the pair the reload loop
        // compares against are the same bytes, read once here: a rotation
        // that lands between start-up and the loop's first look is then a
        // change, not the baseline.
        let (seen, pair) = read_pair(&tls);
        let Some((cert, key)) = pair else {
            anyhow::bail!(
                "cannot read the TLS certificate {} or key {}",
                tls.cert.display(),
                tls.key.display()
            );
        };
        let rustls = RustlsConfig::from_pem(cert.clone(), key)
            .await
            .map_err(|e| {
                anyhow::anyhow!(
                    "cannot load the TLS certificate {} and key {}: {e}",
                    tls.cert.display(),
                    tls.key.display()
                )
            })?;
        set_expiry(&metrics, &tls.cert, &cert);
        let reload_audit = audit.clone();
        let reload_metrics = metrics.clone();
        let state = Arc::new(Webhook {
            injection,
            guard,
            directory,
            metrics,
            audit,
        });
        let router = Router::new()
            .route("/mutate", post(mutate_handler))
            .route("/validate", post(validate_handler))
            .route("/healthz", axum::routing::get(|| async { "ok" }))
            // Room for a body just over the review limit, so parse() can
            // answer it in AdmissionReview form; far larger bodies get 413.
            .layer(DefaultBodyLimit::max(review::MAX_BODY_BYTES * 2))
            .with_state(state);
        let handle = axum_server::Handle::new();
        let server = axum_server::bind_rustls(listen, rustls.clone())
            .handle(handle.clone())
            .serve(router.into_make_service());
        let server = tokio::spawn(async move {
            if let Err(e) = server.await {
                tracing::error!(error = %e, "webhook server failed");
            }
        });
        let reload = tokio::spawn(reload_loop(rustls, tls, seen, reload_audit, reload_metrics));
        let addr = handle
            .listening()
            .await
            .ok_or_else(|| anyhow::anyhow!("cannot listen on {listen} for the webhook"))?;
        Ok(WebhookServer {
            addr,
            handle,
            server,
            reload,
        })
    }

    /// Stops accepting, waits for in-flight reviews to be answered (at most
    /// ten seconds, after which their connections are closed), and returns.
    pub async fn stop(self) {
        self.reload.abort();
        // INVARIANT: the server task is awaited, never aborted, before the
        // drain ends: aborting it drops the connections of reviews still in
        // flight, which kube-apiserver sees as a failed call (and, failing
        // closed, a refused pod).
        self.handle.graceful_shutdown(Some(DRAIN));
        let mut server = self.server;
        // axum-server closes what is left after DRAIN; the margin covers
        // that and is the last resort should it not.
        match tokio::time::timeout(DRAIN + Duration::from_secs(1), &mut server).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "webhook server task failed"),
            Err(_) => {
                tracing::warn!("webhook server did not drain within {}s", DRAIN.as_secs());
                server.abort();
            }
        }
        let _ = self.reload.await;
    }
}

/// Re-reads the certificate and key when either file's bytes change; a bad
/// pair is logged and the previous one kept. Judged on the bytes read, not
/// on modification times: a file read while half written (its final write
/// can keep the same coarse mtime as the truncation before it) is judged
/// again once its bytes are whole. Each outcome is an audit record
/// (`config_reload`): a new serving certificate, or one that was refused,
/// changes who the API server can reach.
async fn reload_loop(
    rustls: RustlsConfig,
    tls: TlsFiles,
    mut seen: PairDigest,
    audit: Arc<dyn AuditSink>,
    metrics: Arc<Metrics>,
) {
    loop {
        tokio::time::sleep(tls.reload_every).await;
        let (now, pair) = read_pair(&tls);
        if now == seen {
            continue;
        }
        // INVARIANT: each change is judged once: a pair that stays broken
        // is not reported again until the bytes change again.
        seen = now;
        let loaded = match pair {
            Some((cert, key)) => rustls
                .reload_from_pem(cert.clone(), key)
                .await
                .map(|()| cert),
            None => Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "the certificate or key file cannot be read",
            )),
        };
        let outcome = match loaded {
            Ok(cert) => {
                set_expiry(&metrics, &tls.cert, &cert);
                let fingerprint = crate::secret::fingerprint_bytes(&cert);
                tracing::info!(cert = %tls.cert.display(), %fingerprint, "reloaded the webhook certificate");
                Ok(fingerprint)
            }
            Err(e) => {
                tracing::warn!(error = %e, "new webhook certificate not usable; keeping the old one");
                Err(e.to_string())
            }
        };
        let reload = ConfigReload {
            time: SystemTime::now(),
            what: "webhook_tls",
            source: tls.cert.display().to_string(),
            outcome,
        };
        if let Err(e) = audit.record_config_reload(&reload).await {
            tracing::error!(error = %e, "audit record of the certificate reload not written");
        }
    }
}

/// Exports the `notAfter` of the first certificate in `pem` (the serving
/// one, the bytes rustls loaded from `path`) as
/// `lanyard_webhook_certificate_expiry_timestamp_seconds`. A file that
/// rustls took but this cannot read leaves the gauge as it was, with a
/// warning.
fn set_expiry(metrics: &Metrics, path: &Path, pem: &[u8]) {
    match certificate_not_after(pem) {
        Ok(not_after) => {
            metrics.webhook_certificate_expiry.set(not_after);
        }
        Err(e) => {
            tracing::warn!(cert = %path.display(), error = %e, "cannot read the webhook certificate's expiry")
        }
    }
}

/// Why a certificate's expiry could not be read.
#[derive(Debug, thiserror::Error)]
enum ExpiryError {
    #[error("no PEM certificate in it")]
    NoCertificate,
    #[error("the certificate does not parse")]
    Parse,
}

/// The `notAfter` (Unix seconds) of the first PEM certificate in `pem`.
fn certificate_not_after(pem: &[u8]) -> Result<i64, ExpiryError> {
    let (_, block) =
        x509_parser::pem::parse_x509_pem(pem).map_err(|_| ExpiryError::NoCertificate)?;
    if block.label != "CERTIFICATE" {
        return Err(ExpiryError::NoCertificate);
    }
    let cert = block.parse_x509().map_err(|_| ExpiryError::Parse)?;
    Ok(cert.validity().not_after.timestamp())
}

/// Bindings of `namespace/name`, retried briefly when the ServiceAccount is
/// not found (it may have been created a moment before the pod) or the
/// lookup fails. `Ok(None)`: it does not exist; `Err`: it could not be read.
async fn lookup(
    directory: &dyn Directory,
    namespace: &str,
    name: &str,
) -> Result<Option<std::sync::Arc<Bindings>>, String> {
    let mut last_error = None;
    for attempt in 0..=LOOKUP_RETRIES {
        match directory.lookup(namespace, name).await {
            Ok(Some(bindings)) => return Ok(Some(bindings)),
            Ok(None) => last_error = None,
            Err(e) => {
                tracing::warn!(error = %e, namespace, name, "ServiceAccount lookup failed");
                last_error = Some(e.to_string());
            }
        }
        if attempt < LOOKUP_RETRIES {
            tokio::time::sleep(LOOKUP_BACKOFF).await;
        }
    }
    match last_error {
        Some(e) => Err(e),
        None => Ok(None),
    }
}

async fn mutate_handler(State(webhook): State<Arc<Webhook>>, body: Bytes) -> Json<Answer> {
    let started = std::time::Instant::now();
    let (decision, answer) = decide(&webhook, &body).await;
    webhook
        .metrics
        .admissions
        .get_or_create(&DecisionLabel { decision })
        .inc();
    webhook.answered(started);
    answer
}

impl Webhook {
    /// Records how long a review took to answer, mutation or guard.
    fn answered(&self, started: std::time::Instant) {
        self.metrics
            .admission_latency
            .observe(started.elapsed().as_secs_f64());
    }
}

/// The pod's name for logs and records (`generateName*` before the API
/// server names it).
fn pod_name(pod: &k8s_openapi::api::core::v1::Pod) -> String {
    pod.metadata
        .name
        .clone()
        .or_else(|| pod.metadata.generate_name.clone().map(|g| format!("{g}*")))
        .unwrap_or_default()
}

/// The answer to one review, and its decision label for metrics.
async fn decide(webhook: &Webhook, body: &[u8]) -> (&'static str, Json<Answer>) {
    let review = match review::parse(body) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "admission review refused");
            return ("error", Json(e.response()));
        }
    };
    let pod = match review.action {
        Action::AllowUnchanged(reason) => {
            tracing::debug!(uid = %review.uid, %reason, "admitted unchanged");
            return ("unchanged", Json(review::allow(&review.uid, None, &[])));
        }
        Action::Mutate(pod) => pod,
    };
    // Pods that did not opt in need no lookup (and must not be refused when
    // the API is unreachable), whatever the objectSelector let through.
    let opted_in = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(super::vocabulary::INJECT_LABEL))
        .is_some_and(|v| v == "true");
    if !opted_in {
        tracing::info!(
            target: "lanyard::audit",
            decision = "skip",
            namespace = %review.namespace,
            pod = ?pod.metadata.name.as_ref().or(pod.metadata.generate_name.as_ref()),
            "pod admitted unchanged: not opted in"
        );
        return ("unchanged", Json(review::allow(&review.uid, None, &[])));
    }
    let service_account = mutate::service_account_name(&pod).to_string();
    let pod_name = pod_name(&pod);
    let looked_up = lookup(
        webhook.directory.as_ref(),
        &review.namespace,
        &service_account,
    )
    .await;
    let bindings = match looked_up {
        Ok(found) => found.unwrap_or_default(),
        Err(e) => {
            // Admitting an opted-in pod without its credentials would fail
            // later and obscurely; refusing lets its controller retry.
            tracing::warn!(
                target: "lanyard::audit",
                decision = "deny",
                namespace = %review.namespace,
                pod = %pod_name,
                service_account = %service_account,
                error = %e,
                "pod denied: ServiceAccount unreadable"
            );
            let message = format!(
                "lanyard cannot read ServiceAccount {}/{service_account} to decide what to inject: {e}; retry shortly",
                review.namespace
            );
            let admission = Admission {
                time: SystemTime::now(),
                uid: review.uid.clone(),
                namespace: review.namespace.clone(),
                pod: pod_name,
                service_account,
                decision: "deny",
                rule: None,
                reason: Some(message.clone()),
                clouds: Vec::new(),
                warnings: 0,
                dry_run: review.dry_run,
            };
            // Refused either way; a record that cannot be written is logged.
            if let Err(e) = webhook.audit.record_admission(&admission).await {
                tracing::error!(error = %e, "admission record not written");
            }
            return ("deny", Json(review::deny(&review.uid, 503, &message)));
        }
    };
    let outcome = mutate(&pod, &review.namespace, &bindings, &webhook.injection);
    let admission = Admission {
        time: SystemTime::now(),
        uid: review.uid.clone(),
        namespace: review.namespace.clone(),
        pod: pod_name.clone(),
        service_account: service_account.clone(),
        decision: match &outcome {
            Ok(m) if m.is_empty() => "unchanged",
            Ok(_) => "inject",
            Err(_) => "deny",
        },
        rule: None,
        reason: outcome.as_ref().err().map(|d| d.message.clone()),
        clouds: outcome
            .as_ref()
            .map(|m| m.summary.clouds.iter().map(|c| c.name()).collect())
            .unwrap_or_default(),
        warnings: outcome.as_ref().map_or(0, |m| m.warnings.len()),
        dry_run: review.dry_run,
    };
    // No admission without its record: a pod admitted unrecorded would be
    // a hole in the trail, and the API server retries a refusal.
    if let Err(e) = webhook.audit.record_admission(&admission).await {
        tracing::error!(error = %e, "admission record not written; refusing the pod");
        let message = "lanyard cannot write its audit record; retry shortly";
        return ("error", Json(review::deny(&review.uid, 503, message)));
    }
    match &outcome {
        Ok(m) => tracing::info!(
            target: "lanyard::audit",
            decision = "admit",
            namespace = %review.namespace,
            pod = %pod_name,
            service_account = %service_account,
            injected = ?m.summary,
            warnings = ?m.warnings,
            dry_run = review.dry_run,
            "pod admitted"
        ),
        Err(d) => tracing::warn!(
            target: "lanyard::audit",
            decision = "deny",
            namespace = %review.namespace,
            pod = %pod_name,
            service_account = %service_account,
            reason = %d.message,
            dry_run = review.dry_run,
            "pod denied"
        ),
    }
    let decision = match &outcome {
        Ok(m) if m.is_empty() => "unchanged",
        Ok(_) => "inject",
        Err(_) => "deny",
    };
    (decision, Json(respond(&review.uid, &outcome)))
}

async fn validate_handler(State(webhook): State<Arc<Webhook>>, body: Bytes) -> Json<Answer> {
    let started = std::time::Instant::now();
    let (decision, rule, answer) = check(&webhook, &body).await;
    webhook
        .metrics
        .guard_reviews
        .get_or_create(&GuardLabels { decision, rule })
        .inc();
    webhook.answered(started);
    answer
}

/// The guard's answer to one review, with its decision and rule labels.
///
/// INVARIANT: a refusal is answered as one whether or not its audit record
/// could be written (a record that failed is logged); only an allowed pod
/// depends on nothing but the rules.
async fn check(webhook: &Webhook, body: &[u8]) -> (&'static str, &'static str, Json<Answer>) {
    let review = match review::parse_for(body, Scope::Guard) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "guard review refused");
            return ("error", "none", Json(e.response()));
        }
    };
    let pod = match review.action {
        Action::AllowUnchanged(reason) => {
            tracing::debug!(uid = %review.uid, %reason, "guard: not reviewed");
            return ("allow", "none", Json(review::allow(&review.uid, None, &[])));
        }
        Action::Mutate(pod) => pod,
    };
    let refusal = match guard::check(&pod, &webhook.guard) {
        Ok(()) => return ("allow", "none", Json(review::allow(&review.uid, None, &[]))),
        Err(refusal) => refusal,
    };
    let pod_name = pod_name(&pod);
    let service_account = mutate::service_account_name(&pod).to_string();
    tracing::warn!(
        target: "lanyard::audit",
        decision = "deny",
        rule = refusal.rule.name(),
        namespace = %review.namespace,
        pod = %pod_name,
        operation = %review.operation,
        reason = %refusal.message,
        dry_run = review.dry_run,
        "pod refused by the guard"
    );
    let admission = Admission {
        time: SystemTime::now(),
        uid: review.uid.clone(),
        namespace: review.namespace.clone(),
        pod: pod_name,
        service_account,
        decision: "deny",
        rule: Some(refusal.rule.name()),
        reason: Some(refusal.message.clone()),
        clouds: Vec::new(),
        warnings: 0,
        dry_run: review.dry_run,
    };
    if let Err(e) = webhook.audit.record_admission(&admission).await {
        tracing::error!(error = %e, "audit record of a guard refusal not written");
    }
    (
        "deny",
        refusal.rule.name(),
        Json(review::deny(&review.uid, 403, &refusal.message)),
    )
}

/// Runs `lanyard webhook` until SIGINT/SIGTERM: ServiceAccounts from the
/// Kubernetes API, HTTPS on `listen`, health and metrics on `admin_listen`.
///
/// `/readyz` answers from the start, 503 until the ServiceAccount reflector
/// holds its first list (with Kubernetes ServiceAccounts) and the TLS
/// certificate is loaded.
pub async fn run(config: crate::config::Config) -> anyhow::Result<()> {
    // Before anything binds: a stop signal from now on is kept.
    crate::http::listen_for_signals();

    let w = &config.webhook;
    let (Some(cert), Some(key)) = (w.tls_cert.clone(), w.tls_key.clone()) else {
        anyhow::bail!("the webhook serves HTTPS only: set --tls-cert FILE and --tls-key FILE");
    };
    let from_kube = config.cluster.service_accounts.is_empty();
    let mut conditions = Readiness::builder();
    let synced = from_kube.then(|| conditions.condition("ServiceAccount list synced"));
    let certificate = conditions.condition("TLS certificate loaded");
    let readiness = conditions.build();
    let metrics = Arc::new(Metrics::new());
    // INVARIANT: the admin port serves before the ServiceAccount list and
    // the certificate are loaded, so a probe sees 503 while they are, and
    // every condition was declared (above) before it answers at all.
    let (trigger, shutdown) = crate::http::Shutdown::new();
    let admin = crate::http::bind(config.admin_listen, "admin endpoints").await?;
    let admin_addr = admin.local_addr()?;
    let admin_task = crate::http::spawn_server(
        admin,
        crate::telemetry::admin_router(metrics.clone(), readiness.clone()),
        shutdown,
    );
    // Static ServiceAccounts when configured (non-Kubernetes tests and
    // benchmarks); otherwise a ServiceAccount watch through the API.
    let directory: Arc<dyn Directory> = if from_kube {
        let client = crate::http::kube_client().await.map_err(|e| {
            anyhow::anyhow!("no Kubernetes API: {e} (run in a cluster or set KUBECONFIG)")
        })?;
        let invalidate = Arc::new(crate::directory::kube::Invalidate {
            service_account: Box::new(|_, _| {}),
            pod: Box::new(|_| {}),
        });
        // `start` returns once the reflector holds its first list.
        let directory =
            crate::directory::kube::KubeDirectory::start(client, Default::default(), invalidate)
                .await?;
        if let Some(synced) = &synced {
            synced.set();
        }
        Arc::new(directory)
    } else {
        Arc::new(crate::directory::file::StaticDirectory::new(
            &config.cluster.service_accounts,
        ))
    };
    // `start` returns only with the certificate and key loaded.
    let server = WebhookServer::start(
        config.listen,
        TlsFiles {
            cert,
            key,
            reload_every: Duration::from_secs(w.reload_seconds.max(1)),
        },
        crate::webhook::InjectionConfig::from_config(&config),
        Guard::from_config(&config),
        directory,
        metrics.clone(),
        Arc::new(crate::broker::assemble::audit(&config, "webhook", metrics)?),
    )
    .await?;
    certificate.set();
    tracing::info!(addr = %server.addr, admin = %admin_addr, "lanyard webhook serving");
    let signal = crate::http::wait_for_signal().await;
    // INVARIANT: reviews are still served through the delay, while the
    // endpoints drop this replica; only then does the server drain.
    crate::http::shutdown_delay(
        signal,
        Duration::from_secs(config.shutdown_delay_seconds),
        || readiness.stop(),
    )
    .await;
    tracing::info!("shutting down");
    trigger.trigger();
    server.stop().await;
    crate::http::drain([admin_task], crate::http::DRAIN_TIMEOUT).await;
    Ok(())
}
