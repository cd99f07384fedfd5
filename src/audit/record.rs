//! The audit record: one JSON object per line, the same for every sink,
//! versioned by its `schema` field (`docs/audit.md` documents each field
//! and each record type).
//!
//! A record names where it was written (cluster, node, role, version), so
//! records of many clusters can share one collector, and carries a unique,
//! time-sortable id (UUIDv7) by which a receiver drops duplicates of an
//! at-least-once delivery. It holds no token, assertion or key: tokens
//! appear as short SHA-256 fingerprints, and caller-supplied text only
//! bounded ([`super::CallerText`]).
//!
//! The `credential` record, the one every request writes, has a module of
//! its own, [`super::credential_record`]; all are derived with `serde`.

use std::time::SystemTime;

use serde::Serialize;

use super::record_fields::Envelope;
pub use super::record_fields::{rfc3339, Origin, SCHEMA};
use super::{Admission, AuditEvent, ConfigReload, PolicyReload, ReloadOutcome};

/// What a record is about.
#[derive(Debug, Clone, Copy)]
pub enum Subject<'a> {
    /// A credential request, granted or refused.
    Credential(&'a AuditEvent<'a>),
    /// A policy set loaded or rejected.
    PolicyReload(&'a PolicyReload),
    /// A sink that failed, and for how long; written once it works again.
    SinkFailure(&'a SinkFailure),
    /// A webhook admission.
    Admission(&'a Admission),
    /// Configuration reloaded while running (the webhook certificate).
    ConfigReload(&'a ConfigReload),
    /// An exporter that fell too far behind, or lost records.
    Export(&'a ExportIncident),
    /// The first record of a new file: the file before it (by name, when
    /// known) and why a new one was begun.
    Rotation {
        /// The file before it.
        previous_file: Option<&'a str>,
        /// `rotated`, `reopened` or `previous file unreadable`.
        reason: &'a str,
    },
    /// A chain's heartbeat, written every `audit.checkpoint_seconds` even
    /// when nothing else is: its `prev` is the chain's head, so a
    /// collector tells a quiet node (checkpoints keep coming) from one that
    /// went silent or lost its tail before export (they stop).
    Checkpoint {
        /// The interval the writer keeps.
        interval_seconds: u64,
        /// Records chained since the previous checkpoint (or since the
        /// writer started), checkpoints not counted.
        records: u64,
        /// The previous checkpoint's `seq`, when this writer wrote one.
        previous_checkpoint_seq: Option<u64>,
    },
}

/// What happened to an exporter, recorded once it is over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportIncident {
    /// The exporter (`syslog`, `http`).
    pub exporter: &'static str,
    /// `backlog_full` (issuance was refused while it was too far behind)
    /// or `records_lost` (retention removed records it had not delivered).
    pub incident: &'static str,
    /// Requests refused, or records lost.
    pub records: u64,
    /// When a `backlog_full` began.
    pub since: Option<SystemTime>,
    /// The first and last sequence numbers lost.
    pub seqs: Option<(u64, u64)>,
}

/// An outage of a sink, recorded once it is over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SinkFailure {
    /// The sink (`file`, `stdout`).
    pub sink: &'static str,
    /// The first error seen.
    pub error: String,
    /// When the outage began.
    pub since: SystemTime,
    /// Records that could not be written: refused credentials
    /// (`on_failure: deny`) or credentials issued without their record
    /// (`allow`).
    pub records: u64,
    /// What was done with them: `refused` or `issued_unrecorded`.
    pub handling: &'static str,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Body<'a> {
    PolicyReload {
        dir: &'a str,
        result: &'static str,
        #[serde(skip_serializing_if = "Option::is_none")]
        policies: Option<usize>,
        #[serde(skip_serializing_if = "Option::is_none")]
        digest: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        error: Option<&'a str>,
    },
    ConfigReload {
        what: &'static str,
        source: &'a str,
        result: &'static str,
        #[serde(skip_serializing_if = "Option::is_none")]
        fingerprint: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        error: Option<&'a str>,
    },
    SinkFailure {
        sink: &'static str,
        error: &'a str,
        since: String,
        records: u64,
        handling: &'static str,
    },
    Rotation {
        #[serde(skip_serializing_if = "Option::is_none")]
        previous_file: Option<&'a str>,
        reason: &'a str,
    },
    Checkpoint {
        interval_seconds: u64,
        records: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        previous_checkpoint_seq: Option<u64>,
    },
    Export {
        exporter: &'static str,
        incident: &'static str,
        records: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        since: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        first_seq: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        last_seq: Option<u64>,
    },
    Admission {
        review_uid: &'a str,
        pod: AdmittedPod<'a>,
        decision: &'static str,
        #[serde(skip_serializing_if = "Option::is_none")]
        rule: Option<&'static str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        reason: Option<&'a str>,
        #[serde(skip_serializing_if = "<[&str]>::is_empty")]
        clouds: &'a [&'static str],
        warnings: usize,
        dry_run: bool,
    },
}

#[derive(Serialize)]
struct AdmittedPod<'a> {
    namespace: &'a str,
    name: &'a str,
    service_account: &'a str,
}

/// Writes `subject` as one JSON object (no newline) to `out`.
pub fn write(origin: &Origin, subject: Subject<'_>, out: &mut Vec<u8>) {
    let (time, kind, body) = match subject {
        Subject::Credential(e) => {
            super::credential_record::write(origin, e, uuid::Uuid::now_v7(), out);
            return;
        }
        Subject::PolicyReload(r) => {
            let body = match &r.outcome {
                ReloadOutcome::Loaded { policies, digest } => Body::PolicyReload {
                    dir: &r.dir,
                    result: "loaded",
                    policies: Some(*policies),
                    digest: Some(digest),
                    error: None,
                },
                ReloadOutcome::Rejected { error } => Body::PolicyReload {
                    dir: &r.dir,
                    result: "rejected",
                    policies: None,
                    digest: None,
                    error: Some(error),
                },
            };
            (r.time, "policy_reload", body)
        }
        Subject::ConfigReload(r) => (
            r.time,
            "config_reload",
            Body::ConfigReload {
                what: r.what,
                source: &r.source,
                result: if r.outcome.is_ok() {
                    "loaded"
                } else {
                    "rejected"
                },
                fingerprint: r.outcome.as_ref().ok().map(String::as_str),
                error: r.outcome.as_ref().err().map(String::as_str),
            },
        ),
        Subject::SinkFailure(f) => (
            SystemTime::now(),
            "sink_failure",
            Body::SinkFailure {
                sink: f.sink,
                error: &f.error,
                since: rfc3339(f.since),
                records: f.records,
                handling: f.handling,
            },
        ),
        Subject::Rotation {
            previous_file,
            reason,
        } => (
            SystemTime::now(),
            "rotation",
            Body::Rotation {
                previous_file,
                reason,
            },
        ),
        Subject::Checkpoint {
            interval_seconds,
            records,
            previous_checkpoint_seq,
        } => (
            SystemTime::now(),
            "checkpoint",
            Body::Checkpoint {
                interval_seconds,
                records,
                previous_checkpoint_seq,
            },
        ),
        Subject::Export(x) => (
            SystemTime::now(),
            "export",
            Body::Export {
                exporter: x.exporter,
                incident: x.incident,
                records: x.records,
                since: x.since.map(rfc3339),
                first_seq: x.seqs.map(|s| s.0),
                last_seq: x.seqs.map(|s| s.1),
            },
        ),
        Subject::Admission(a) => (
            a.time,
            "admission",
            Body::Admission {
                review_uid: &a.uid,
                pod: AdmittedPod {
                    namespace: &a.namespace,
                    name: &a.pod,
                    service_account: &a.service_account,
                },
                decision: a.decision,
                rule: a.rule,
                reason: a.reason.as_deref(),
                clouds: &a.clouds,
                warnings: a.warnings,
                dry_run: a.dry_run,
            },
        ),
    };
    let record = Envelope::new(uuid::Uuid::now_v7(), time, kind, origin, body);
    // INVARIANT: a record serializes to one JSON object with no newline
    // (serde_json escapes control characters in strings), which the file
    // sink's chain and every line-based reader rely on.
    if serde_json::to_writer(&mut *out, &record).is_err() {
        out.extend_from_slice(b"{}");
    }
}
