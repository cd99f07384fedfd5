//! The one wiring from [`Config`] to a ready [`Broker`], shared by
//! `lanyard agent`, `lanyard dev`, the standalone sidecar and the tests.
//! What differs between them is only where callers' tokens are verified
//! and where bindings come from ([`Parts`]); the clouds, their endpoints,
//! the cache and the node check come from configuration, the same way for
//! all of them.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::Broker;
use crate::audit::export::{self, Cursor, Exporter, Progress, Shipper};
use crate::audit::file::{FileOptions, FileSink};
use crate::audit::http_export::{HttpShipper, HttpTarget};
use crate::audit::record::Origin;
use crate::audit::record::{self, ExportIncident, Subject};
use crate::audit::sinks::Sinks;
use crate::audit::syslog::{SyslogShipper, SyslogTarget};
use crate::audit::{AuditSink, PolicyReload, ReloadOutcome};
use crate::cache::Cache;
use crate::config::Config;
use crate::directory::Directory;
use crate::policy::cedar::{CedarPolicy, ReloadEvent};
use crate::telemetry::metrics::{Metrics, ResultLabel, SinkLabel};
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
    /// Parts with a new cache and the audit trail configured from `config`,
    /// for `role` (named in each audit record).
    pub fn new(
        config: &Config,
        role: &'static str,
        verifier: Verifier,
        directory: Arc<dyn Directory>,
    ) -> anyhow::Result<Self> {
        let metrics = Arc::new(Metrics::new());
        let audit = Arc::new(audit(config, role, metrics.clone())?);
        Ok(Parts {
            verifier,
            directory,
            cache: Cache::new(config.cache.to_cache_config(), metrics.clone()),
            metrics,
            audit,
        })
    }
}

/// The audit trail `config` describes, for `role`: the log record, stdout,
/// the chained file (opened now: an unwritable file refuses to start), and
/// SIGHUP reopening the file.
pub fn audit(config: &Config, role: &'static str, metrics: Arc<Metrics>) -> anyhow::Result<Sinks> {
    let a = &config.audit;
    let node = match role {
        "dev" => config.dev.node_name.clone(),
        _ => config.cluster.node_name.clone().unwrap_or_default(),
    };
    let origin = Arc::new(Origin::new(a.cluster.clone(), node, role));
    let mut sinks = Sinks::new(origin.clone(), a.on_failure, metrics.clone())
        .with_log(a.log)
        .with_stdout(a.stdout);
    if let Some(path) = &a.file {
        let options = FileOptions {
            path: path.clone(),
            max_bytes: a.file_max_bytes,
            max_age: Duration::from_secs(a.file_max_age_seconds),
            keep: a.file_keep,
            fsync: a.fsync,
            handling: a.on_failure.handling(),
            checkpoint_every: (a.checkpoint_seconds > 0)
                .then(|| Duration::from_secs(a.checkpoint_seconds)),
        };
        let file = FileSink::open(options, origin.clone(), metrics.clone())?;
        reopen_on_hangup(file.clone());
        let mut shippers: Vec<(Box<dyn Shipper>, &str)> = Vec::new();
        if let Some(url) = &a.syslog {
            let target = SyslogTarget::parse(url, a.syslog_ca.clone(), &origin.node)?;
            shippers.push((Box::new(SyslogShipper::new(target)?), url));
        }
        if let Some(url) = &a.http {
            let target = HttpTarget {
                url: url::Url::parse(url)?,
                token_file: a.http_token_file.clone(),
            };
            shippers.push((
                Box::new(HttpShipper::new(target, crate::http::client())),
                url,
            ));
        }
        let mut exporters = Vec::new();
        for (shipper, url) in shippers {
            let name = shipper.name();
            let progress = Progress::new(name);
            exporters.push(progress.clone());
            let mut cursor = path.clone().into_os_string();
            cursor.push(format!(".{name}.cursor"));
            let (recorder, origin) = (file.clone(), origin.clone());
            let on_lost = move |first: u64, last: u64| {
                let incident = ExportIncident {
                    exporter: name,
                    incident: "records_lost",
                    records: last - first + 1,
                    since: None,
                    seqs: Some((first, last)),
                };
                let mut rec = Vec::new();
                record::write(&origin, Subject::Export(&incident), &mut rec);
                let recorder = recorder.clone();
                tokio::spawn(async move {
                    if let Err(e) = recorder.write(&rec).await {
                        tracing::error!(error = %e, "the export loss could not be recorded");
                    }
                });
            };
            tokio::spawn(export::run(Exporter {
                active: path.clone(),
                cursor: Cursor::new(cursor.into()),
                shipper,
                written: file.written(),
                progress,
                on_lost: Box::new(on_lost),
                metrics: metrics.clone(),
            }));
            tracing::info!(exporter = name, to = %url, "audit records exported");
        }
        if !exporters.is_empty() {
            metrics
                .audit_export_max_backlog
                .set(i64::try_from(a.export_max_backlog).unwrap_or(i64::MAX));
            // INVARIANT: the gauge holds the sequence counter, not the
            // file: a FileSink clone would keep its writer open past the
            // broker's drop.
            let (head, shipping) = (file.next_seq_watch(), exporters.clone());
            metrics.before_render(move |m| {
                let written = head.load(std::sync::atomic::Ordering::Acquire);
                for progress in &shipping {
                    let behind = written.saturating_sub(progress.next());
                    m.audit_export_backlog
                        .get_or_create(&SinkLabel {
                            sink: progress.name,
                        })
                        .set(i64::try_from(behind).unwrap_or(i64::MAX));
                }
            });
            sinks = sinks.with_backlog(exporters, a.export_max_backlog, a.export_when_full);
        }
        sinks = sinks.with_file(file);
        tracing::info!(file = %path.display(), fsync = a.fsync, on_failure = ?a.on_failure, "audit file open");
    }
    Ok(sinks)
}

/// Reopens the audit file on SIGHUP, as log rotators expect.
fn reopen_on_hangup(file: FileSink) {
    #[cfg(unix)]
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            use tokio::signal::unix::{signal, SignalKind};
            let Ok(mut hangup) = signal(SignalKind::hangup()) else {
                return;
            };
            while hangup.recv().await.is_some() {
                file.reopen();
            }
        });
    }
}

/// The Cedar policy set in `dir`, checked for changes every `every`:
/// loaded now (an invalid set refuses to start, naming each problem), and
/// each reload logged, counted and audited.
fn policy(
    dir: &Path,
    cluster: &str,
    every: Duration,
    metrics: Arc<Metrics>,
    audit: Arc<dyn AuditSink>,
) -> anyhow::Result<Arc<CedarPolicy>> {
    let policy = Arc::new(
        CedarPolicy::load(dir)
            .map_err(|e| anyhow::anyhow!("the policy set in {} is invalid:\n{e}", dir.display()))?
            .with_cluster(cluster),
    );
    let shown = dir.display().to_string();
    // The set in force at start is as much a part of the trail as each
    // reload: it is counted and audited the same way.
    let on_event = move |event: ReloadEvent| {
        let outcome = match event {
            ReloadEvent::Loaded { policies, digest } => {
                tracing::info!(dir = %shown, policies, digest = %digest, "policy set loaded");
                metrics.policy_policies.set(policies as i64);
                count_reload(&metrics, "loaded");
                ReloadOutcome::Loaded { policies, digest }
            }
            ReloadEvent::Rejected { error } => {
                tracing::error!(dir = %shown, error = %error, "new policy set rejected; the previous set stays in force");
                count_reload(&metrics, "rejected");
                ReloadOutcome::Rejected { error }
            }
        };
        let reload = PolicyReload {
            time: std::time::SystemTime::now(),
            dir: shown.clone(),
            outcome,
        };
        let audit = audit.clone();
        tokio::spawn(async move {
            if let Err(e) = audit.record_reload(&reload).await {
                tracing::error!(error = %e, "policy reload not recorded in the audit trail");
            }
        });
    };
    on_event(ReloadEvent::Loaded {
        policies: policy.policies(),
        digest: policy.digest(),
    });
    policy.clone().watch(every, on_event);
    Ok(policy)
}

fn count_reload(metrics: &Metrics, result: &'static str) {
    metrics
        .policy_reloads
        .get_or_create(&ResultLabel { result })
        .inc();
}

/// The broker `config` describes, over `parts`.
pub fn broker(config: &Config, parts: Parts, http: reqwest::Client) -> anyhow::Result<Broker> {
    let mut broker = Broker::new(parts.verifier, parts.directory)
        .with_cache(parts.cache, parts.metrics.clone())
        .with_audit(parts.audit.clone());
    if let Some(dir) = &config.policy.dir {
        broker = broker.with_policy(policy(
            dir,
            &config.audit.cluster,
            Duration::from_secs(config.policy.reload_seconds),
            parts.metrics,
            parts.audit,
        )?);
    }
    if let Some(node) = &config.cluster.node_name {
        broker = broker.with_node_name(node.clone());
    }

    config.clouds().register(&http, &mut broker)?;
    Ok(broker)
}
