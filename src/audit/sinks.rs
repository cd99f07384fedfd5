//! The configured audit trail: the log record, JSON lines on stdout, the
//! chained file, in any combination, behind the one [`AuditSink`].
//!
//! A record is rendered once and handed to each sink. The file is the
//! durable one: with `on_failure: deny` (the default) a request whose
//! record cannot be written is refused (the caller gets a retryable error)
//! rather than answered without its record; with `allow` it is answered
//! and the loss is counted and recorded once the file works again.

use std::io::Write;
use std::sync::Arc;

use super::export::Progress;
use super::file::FileSink;
use super::record::{self, ExportIncident, Origin, Subject};
use super::{Admission, AuditError, AuditEvent, AuditSink, ConfigReload, LogSink, PolicyReload};
use crate::telemetry::metrics::{Metrics, SinkResultLabels};

/// What to do when a record cannot be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnFailure {
    /// Refuse the credential with a retryable error (no credential without
    /// its record).
    #[default]
    Deny,
    /// Issue the credential and count the lost record.
    Allow,
}

impl OnFailure {
    /// How an outage record names what happened to unwritten records.
    pub fn handling(self) -> &'static str {
        match self {
            OnFailure::Deny => "refused",
            OnFailure::Allow => "issued_unrecorded",
        }
    }
}

/// What to do when an exporter falls `audit.export_max_backlog` records
/// behind the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WhenFull {
    /// Refuse new credentials (retryable) until it catches up: no record is
    /// ever lost to export.
    #[default]
    Deny,
    /// Keep issuing; retention may remove records before they are shipped,
    /// which the exporter counts and records as lost.
    Drop,
}

/// The exporters' backlog bound.
struct Backlog {
    exporters: Vec<Arc<Progress>>,
    max: u64,
    when_full: WhenFull,
    /// Since when issuance has been refused, and how many records.
    refusing: std::sync::Mutex<Option<(std::time::SystemTime, u64, &'static str)>>,
    /// Whether `refusing` holds a refusal: read without the lock.
    refusing_now: std::sync::atomic::AtomicBool,
}

/// The configured sinks.
pub struct Sinks {
    origin: Arc<Origin>,
    log: bool,
    stdout: bool,
    file: Option<FileSink>,
    on_failure: OnFailure,
    metrics: Arc<Metrics>,
    backlog: Option<Backlog>,
}

impl Sinks {
    /// Sinks writing records that name `origin`.
    pub fn new(origin: Arc<Origin>, on_failure: OnFailure, metrics: Arc<Metrics>) -> Self {
        Sinks {
            origin,
            log: false,
            stdout: false,
            file: None,
            on_failure,
            metrics,
            backlog: None,
        }
    }

    /// Bounds how far `exporters` may fall behind the file: past `max`
    /// records, `when_full` applies.
    pub fn with_backlog(
        mut self,
        exporters: Vec<Arc<Progress>>,
        max: u64,
        when_full: WhenFull,
    ) -> Self {
        self.backlog = Some(Backlog {
            exporters,
            max,
            when_full,
            refusing: std::sync::Mutex::new(None),
            refusing_now: std::sync::atomic::AtomicBool::new(false),
        });
        self
    }

    /// `Err` when an exporter is too far behind and issuance must wait;
    /// the record of a refusal that just ended, when one did.
    fn check_backlog(&self, file: &FileSink) -> Result<Option<ExportIncident>, AuditError> {
        let Some(b) = self
            .backlog
            .as_ref()
            .filter(|b| b.when_full == WhenFull::Deny)
        else {
            return Ok(None);
        };
        let written = file.next_seq();
        let behind = b
            .exporters
            .iter()
            .map(|p| (p.name, written.saturating_sub(p.next())))
            .max_by_key(|(_, n)| *n);
        let over = behind.is_some_and(|(_, n)| n >= b.max);
        if !over && !b.refusing_now.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(None);
        }
        let mut refusing = b.refusing.lock().unwrap_or_else(|p| p.into_inner());
        b.refusing_now
            .store(over, std::sync::atomic::Ordering::Release);
        match behind {
            Some((name, n)) if n >= b.max => {
                let entry = refusing.get_or_insert_with(|| {
                    tracing::error!(exporter = name, behind = n, "an audit exporter is too far behind; refusing credentials until it catches up (audit.export_when_full: deny)");
                    (std::time::SystemTime::now(), 0, name)
                });
                entry.1 += 1;
                Err(AuditError::Unavailable(format!(
                    "the {name} audit exporter is {n} records behind"
                )))
            }
            _ => Ok(refusing.take().map(|(since, refused, exporter)| {
                tracing::warn!(exporter, refused, "audit exporter caught up; issuing again");
                ExportIncident {
                    exporter,
                    incident: "backlog_full",
                    records: refused,
                    since: Some(since),
                    seqs: None,
                }
            })),
        }
    }

    /// Also the `lanyard::audit` log record.
    pub fn with_log(mut self, on: bool) -> Self {
        self.log = on;
        self
    }

    /// Also one JSON line per record on stdout.
    pub fn with_stdout(mut self, on: bool) -> Self {
        self.stdout = on;
        self
    }

    /// Also the chained file.
    pub fn with_file(mut self, file: FileSink) -> Self {
        self.file = Some(file);
        self
    }

    /// Reopens the file (SIGHUP).
    pub fn reopen(&self) {
        if let Some(file) = &self.file {
            file.reopen();
        }
    }

    fn count(&self, sink: &'static str, result: &'static str) {
        self.metrics
            .audit_records
            .get_or_create(&SinkResultLabels { sink, result })
            .inc();
    }

    /// The durable copy first: with `on_failure: deny`, a record the file
    /// refused is refused everywhere, so the log and stdout never say a
    /// credential was issued when the caller was refused.
    // INVARIANT: file, then stdout and log.
    async fn write(&self, subject: Subject<'_>) -> Result<(), AuditError> {
        if !self.stdout && self.file.is_none() {
            return Ok(());
        }
        // A credential record is about 900 bytes; room for one without
        // growing.
        let mut line = Vec::with_capacity(1024);
        record::write(&self.origin, subject, &mut line);
        if let Some(file) = &self.file {
            if let Some(over) = self.check_backlog(file)? {
                let mut rec = Vec::new();
                record::write(&self.origin, Subject::Export(&over), &mut rec);
                file.write(&rec).await.map_err(AuditError::Unavailable)?;
            }
            if let Err(e) = file.write(&line).await {
                match self.on_failure {
                    OnFailure::Deny => return Err(AuditError::Unavailable(e)),
                    OnFailure::Allow => self.count("file", "lost"),
                }
            }
        }
        if self.stdout {
            line.push(b'\n');
            let mut out = std::io::stdout().lock();
            match out.write_all(&line).and_then(|()| out.flush()) {
                Ok(()) => self.count("stdout", "written"),
                // stdout is for collectors that tail it; it is never the
                // durable copy.
                Err(_) => self.count("stdout", "failed"),
            }
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl AuditSink for Sinks {
    async fn record(&self, event: &AuditEvent<'_>) -> Result<(), AuditError> {
        self.write(Subject::Credential(event)).await?;
        if self.log {
            LogSink.record(event).await?;
        }
        Ok(())
    }

    async fn record_admission(&self, admission: &Admission) -> Result<(), AuditError> {
        self.write(Subject::Admission(admission)).await
    }

    async fn record_config_reload(&self, reload: &ConfigReload) -> Result<(), AuditError> {
        self.write(Subject::ConfigReload(reload)).await
    }

    async fn record_reload(&self, reload: &PolicyReload) -> Result<(), AuditError> {
        self.write(Subject::PolicyReload(reload)).await?;
        if self.log {
            LogSink.record_reload(reload).await?;
        }
        Ok(())
    }
}
