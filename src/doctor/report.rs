//! The doctor's report: one line per check with its verdict and, when it
//! failed, the fix; then the trust each cloud needs. As a table for a
//! person, as JSON (`--output json`, [`Report::to_json`]) for scripts;
//! docs/operations.md lists the JSON's fields, which stay as they are
//! within a major version (`version` says which).

use std::fmt::Write;

use serde::Serialize;

use crate::cloud::trust::Trust;

/// The JSON document's format version.
pub const FORMAT_VERSION: u32 = 1;

/// A check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// As it should be.
    Ok,
    /// Worth knowing; nothing fails because of it.
    Info,
    /// Could not be checked, or likely to fail later.
    Warn,
    /// Credentials will not come until this is fixed.
    Fail,
}

impl Status {
    fn word(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Info => "info",
            Status::Warn => "warn",
            Status::Fail => "FAIL",
        }
    }
}

/// One check's outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// The check's stable name (`pod`, `opted-in`, `sidecar`,
    /// `token-audience`, `agent`, `release`, `refusal`, `serviceaccount`,
    /// `binding`, `annotation`, `policy`, `issuer`, `trust`, `fleet`).
    pub check: &'static str,
    /// The cloud it concerns, if one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cloud: Option<&'static str>,
    /// The verdict.
    pub status: Status,
    /// What was found, in one line.
    pub message: String,
    /// What to do, in one line (failed and warned checks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Finding {
    /// A finding with no fix.
    pub fn new(
        check: &'static str,
        cloud: Option<&'static str>,
        status: Status,
        message: impl Into<String>,
    ) -> Finding {
        Finding {
            check,
            cloud,
            status,
            message: message.into(),
            fix: None,
        }
    }

    /// The same, with the fix.
    pub fn fix(mut self, fix: impl Into<String>) -> Finding {
        self.fix = Some(fix.into());
        self
    }
}

/// What the doctor examined.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Examined {
    /// `pod` or `serviceaccount`.
    pub kind: &'static str,
    /// The target's namespace.
    pub namespace: String,
    /// The target's name.
    pub name: String,
    /// The ServiceAccount examined (the pod's, for a pod).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_account: Option<String>,
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    /// [`FORMAT_VERSION`].
    pub version: u32,
    /// What was examined.
    pub target: Examined,
    /// The issuer the trust names (the cluster's, else the configured one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub issuer: Option<String>,
    /// Whether no check failed.
    pub ok: bool,
    /// Every check, in the order they were made.
    pub findings: Vec<Finding>,
    /// What each cloud must trust.
    pub trust: Vec<Trust>,
}

impl Report {
    /// The report as one JSON document.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }

    /// The report as text for a terminal.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let t = &self.target;
        let _ = write!(out, "lanyard doctor: {} {}/{}", t.kind, t.namespace, t.name);
        if let (Some(sa), "pod") = (&t.service_account, t.kind) {
            let _ = write!(out, " (ServiceAccount {sa})");
        }
        out.push_str("\n\n");
        let width = self
            .findings
            .iter()
            .map(|f| label(f).len())
            .max()
            .unwrap_or(0);
        for f in &self.findings {
            let _ = writeln!(
                out,
                "  {:<4}  {:<width$}  {}",
                f.status.word(),
                label(f),
                f.message
            );
            if let Some(fix) = &f.fix {
                let _ = writeln!(out, "  {:<4}  {:<width$}  fix: {fix}", "", "");
            }
        }
        if !self.trust.is_empty() {
            out.push_str("\nWhat each cloud must trust (compare with what is configured there):\n");
            for trust in &self.trust {
                let _ = writeln!(
                    out,
                    "\n  {} {} ({})",
                    trust.cloud, trust.identity, trust.kind
                );
                for (key, value) in [
                    ("issuer", &trust.issuer),
                    ("subject", &trust.subject),
                    ("audience", &trust.audience),
                ] {
                    if !value.is_empty() {
                        let _ = writeln!(out, "    {key:<9} {value}");
                    }
                }
                for c in &trust.commands {
                    let _ = writeln!(out, "    $ {c}");
                }
                for n in &trust.notes {
                    let _ = writeln!(out, "    note: {n}");
                }
            }
        }
        let failed = self
            .findings
            .iter()
            .filter(|f| f.status == Status::Fail)
            .count();
        let _ = match failed {
            0 => writeln!(out, "\nNo problem found."),
            1 => writeln!(out, "\n1 problem found."),
            n => writeln!(out, "\n{n} problems found."),
        };
        out
    }
}

fn label(f: &Finding) -> String {
    match f.cloud {
        Some(cloud) => format!("{} ({cloud})", f.check),
        None => f.check.to_string(),
    }
}
