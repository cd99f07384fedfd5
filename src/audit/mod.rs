//! The audit seam: one typed [`AuditEvent`] per decision, handed to an
//! [`AuditSink`].
//!
//! The pipeline builds the event from what each step learned (who called,
//! what for, which identity, the decision, how the cache answered, the
//! credential's fingerprint and expiry) and hands it to the sink before the
//! credential is returned. An event never holds a token, assertion or key:
//! tokens appear only as short SHA-256 fingerprints, and caller-supplied
//! text is bounded. The default sink, [`LogSink`], writes the record on the
//! `lanyard::audit` tracing target; [`sinks::Sinks`] adds the versioned
//! JSON record ([`record`]) on stdout and in a hash-chained, rotated,
//! durable file ([`file`], [`chain`]) that `lanyard audit verify`
//! ([`verify`]) checks. `docs/audit.md` documents the record.

pub mod chain;
pub mod collected;
mod credential_record;
#[cfg(test)]
mod examples;
pub mod export;
pub mod file;
mod group_commit;
pub mod http_export;
mod log_line;
pub mod record;
mod record_fields;
pub mod sinks;
pub mod syslog;
pub mod verify;

use std::borrow::Cow;
use std::time::{Duration, SystemTime};

use crate::cache::CacheOutcome;
use crate::cloud::{Cloud, Kind, Surface};
use crate::token::Caller;

pub use lanyard_core::text::{bounded, MAX_FIELD_CHARS};

/// Whether a request was granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The request was granted and its credential returned (identity
    /// lookups, which return none, are not audited).
    Allow,
    /// The request was refused; the event's `reason`, `code` and `message` say
    /// why.
    Deny,
}

impl Verdict {
    /// The verdict as audit records and the `decision` metrics label spell it:
    /// `allow` or `deny`.
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Allow => "allow",
            Verdict::Deny => "deny",
        }
    }
}

/// The credential that left, by fingerprint only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedCredential {
    /// Short SHA-256 fingerprint of the credential's secret part (the access or
    /// ID token, or the AWS session token), as [`crate::secret::fingerprint`]
    /// computes it.
    pub fingerprint: std::sync::Arc<str>,
    /// Unix seconds.
    pub expires_at: u64,
}

/// One decision. It borrows from the request and the decision's context:
/// building it allocates nothing on the cache-hit path, and a sink that
/// keeps it (a queue, a spool) serializes it or copies what it needs.
#[derive(Debug, Clone)]
pub struct AuditEvent<'a> {
    /// When the decision was made (wall clock, at the end of the pipeline).
    pub time: SystemTime,
    /// Who asked, as the verified token says (namespace, ServiceAccount,
    /// pod name and uid, node); `None` when the token was refused before
    /// it named anyone.
    pub caller: Option<&'a Caller>,
    /// Fingerprint of the caller's projected token.
    pub token_fingerprint: &'a str,
    /// The cloud the request was for.
    pub cloud: Cloud,
    /// What kind of credential was asked for.
    pub kind: Kind,
    /// The SDK-facing endpoint the request came in on.
    pub surface: Surface,
    /// The identity the request was decided for, once bound.
    pub identity: Option<&'a str>,
    /// The identity it was reached through, when chained (an AWS target
    /// role's first role, an Entra app's managed identity).
    pub via: Option<&'a str>,
    /// When chained: the identity's account (the app's tenant, the target
    /// role's account).
    pub account: Option<&'a str>,
    /// When chained: the first hop's account (the managed identity's
    /// tenant, the first role's account).
    pub via_account: Option<&'a str>,
    /// `node` when the identity's first credential came from the node's
    /// IMDS (a managed identity assigned to the node pool),
    /// `identity-binding` when AKS's identity-binding proxy exchanged the
    /// pod's token; absent for an exchange of the pod's token with the
    /// identity's own federated credential.
    pub source: Option<&'static str>,
    /// Scopes or resource, readable only bounded.
    pub scopes: CallerText<'a>,
    /// ID-token audience, readable only bounded.
    pub audience: Option<CallerText<'a>>,
    /// The lifetime the caller asked for; `None` when it asked for none and the
    /// configured one applied.
    pub lifetime: Option<Duration>,
    /// Whether the request was granted.
    pub verdict: Verdict,
    /// Why it was refused (`BrokerError::reason`), for denials.
    pub reason: Option<&'static str>,
    /// The upstream or token-check code, when one decided.
    pub code: Option<&'a str>,
    /// The refusal as the caller was told it, bounded.
    pub message: Option<String>,
    /// Ids of the policies that decided.
    pub policies: &'a [String],
    /// How the cache answered, when it was consulted.
    pub cache: Option<CacheOutcome>,
    /// The upstream exchange this request waited on (a miss, or a request
    /// coalesced onto one): its latency and the cloud's request id.
    pub upstream: Option<&'a crate::cloud::UpstreamCall>,
    /// The credential that was returned, by fingerprint; `None` for denials.
    pub credential: Option<IssuedCredential>,
    /// Time from the request reaching the broker to the decision, cache lookup
    /// and upstream exchange included.
    pub latency: Duration,
}

/// Caller-supplied text in an event (scopes, an audience), borrowed from
/// the request and readable only through [`bounded`]: a sink cannot write
/// it unbounded, and the event copies nothing to bound it.
#[derive(Clone, Copy)]
pub struct CallerText<'a>(&'a [String]);

impl<'a> CallerText<'a> {
    /// The texts of `texts`.
    pub fn new(texts: &'a [String]) -> Self {
        CallerText(texts)
    }

    /// One text.
    pub fn one(text: &'a String) -> Self {
        CallerText(std::slice::from_ref(text))
    }

    /// Each text, bounded.
    pub fn iter(&self) -> impl Iterator<Item = Cow<'a, str>> + 'a {
        self.0.iter().map(|t| bounded(t))
    }

    /// Whether there is no text.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The texts, bounded, joined by `separator`.
    pub fn join(&self, separator: &str) -> String {
        self.iter().collect::<Vec<_>>().join(separator)
    }
}

/// A JSON array of the texts, each bounded, written as it is read.
impl serde::Serialize for CallerText<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.iter())
    }
}

impl std::fmt::Debug for CallerText<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// Why an event could not be recorded.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    /// The sink could not take the event (its destination is down or full); the
    /// text says why. The broker then refuses the request as retryable rather
    /// than issue an unrecorded credential.
    #[error("audit sink unavailable: {0}")]
    Unavailable(String),
}

/// A policy set loaded, or a new one rejected (the last good set stays in
/// force): an event of the audit trail too, since it changes what is
/// decided.
#[derive(Debug, Clone)]
pub struct PolicyReload {
    /// When it happened.
    pub time: SystemTime,
    /// The policy directory.
    pub dir: String,
    /// What happened.
    pub outcome: ReloadOutcome,
}

/// How a policy reload ended.
#[derive(Debug, Clone)]
pub enum ReloadOutcome {
    /// The new set is in force.
    Loaded {
        /// Policies in it.
        policies: usize,
        /// Digest of its files, to tell sets apart.
        digest: String,
    },
    /// The new set was refused; the previous one stays in force.
    Rejected {
        /// Why, naming the file and line.
        error: String,
    },
}

/// Configuration taken in while running, other than policies: today the
/// webhook's serving certificate, re-read when its files change (a
/// rotation by cert-manager, or a mistake that would stop admissions).
#[derive(Debug, Clone)]
pub struct ConfigReload {
    /// When it happened.
    pub time: SystemTime,
    /// What was reloaded (`webhook_tls`).
    pub what: &'static str,
    /// Where it was read from (the certificate file).
    pub source: String,
    /// The new material in force, by fingerprint of the certificate file
    /// (never the key); or why it was refused (the previous stays).
    pub outcome: Result<String, String>,
}

/// A webhook admission: what the webhook did with an opted-in pod.
#[derive(Debug, Clone)]
pub struct Admission {
    /// When it was decided.
    pub time: SystemTime,
    /// The AdmissionReview's uid.
    pub uid: String,
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name (`generateName*` before the API server names it).
    pub pod: String,
    /// Its ServiceAccount.
    pub service_account: String,
    /// `inject`, `unchanged` or `deny`.
    pub decision: &'static str,
    /// The guard's rule that refused the pod (`cloud-token-mount`,
    /// `token-volume-mount`, `agent-address`); `None` for the mutation's
    /// decisions.
    pub rule: Option<&'static str>,
    /// Why it was denied.
    pub reason: Option<String>,
    /// Clouds whose credentials the pod gets.
    pub clouds: Vec<&'static str>,
    /// Warnings returned to the user.
    pub warnings: usize,
    /// A dry run (nothing is stored by the API server).
    pub dry_run: bool,
}

/// Where events go.
#[async_trait::async_trait]
pub trait AuditSink: Send + Sync {
    /// Records `event`. A sink that must be durable returns only once the
    /// event is; an error means it is not recorded.
    async fn record(&self, event: &AuditEvent<'_>) -> Result<(), AuditError>;

    /// Records a policy reload.
    async fn record_reload(&self, reload: &PolicyReload) -> Result<(), AuditError>;

    /// Records configuration reloaded while running. Sinks without a record
    /// for it (the log: the reload logs itself) keep nothing.
    async fn record_config_reload(&self, reload: &ConfigReload) -> Result<(), AuditError> {
        let _ = reload;
        Ok(())
    }

    /// Records a webhook admission. Sinks without a record for it (the
    /// log: the webhook logs its own decisions) keep nothing.
    async fn record_admission(&self, admission: &Admission) -> Result<(), AuditError> {
        let _ = admission;
        Ok(())
    }
}

/// Writes `items` joined by `separator`, quoted and escaped as a string
/// field is, without building the joined string.
fn write_joined<S: AsRef<str>>(
    f: &mut std::fmt::Formatter<'_>,
    items: impl Iterator<Item = S>,
    separator: &str,
) -> std::fmt::Result {
    f.write_str("\"")?;
    for (i, t) in items.enumerate() {
        if i > 0 {
            f.write_str(separator)?;
        }
        let t = t.as_ref();
        // Names and resources are almost always plain text, which
        // `escape_debug` would copy a character at a time unchanged.
        if crate::telemetry::text_fields::needs_no_escape(t) {
            f.write_str(t)?;
        } else {
            write!(f, "{}", t.escape_debug())?;
        }
    }
    f.write_str("\"")
}

/// Caller text, bounded, as one log field.
struct Joined<'a>(CallerText<'a>, &'static str);

impl std::fmt::Debug for Joined<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write_joined(f, self.0.iter(), self.1)
    }
}

/// Policy ids as one log field.
struct JoinedStrs<'a>(&'a [String], &'static str);

impl std::fmt::Debug for JoinedStrs<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write_joined(f, self.0.iter(), self.1)
    }
}

/// Writes each event as one record on the `lanyard::audit` tracing target.
pub struct LogSink;

#[async_trait::async_trait]
impl AuditSink for LogSink {
    async fn record(&self, e: &AuditEvent<'_>) -> Result<(), AuditError> {
        // A filtered-out record costs nothing to format. (The levels are
        // `log_line::level`'s; `enabled!` takes them as constants.)
        let enabled = match e.verdict {
            Verdict::Allow => tracing::enabled!(target: "lanyard::audit", tracing::Level::INFO),
            Verdict::Deny => tracing::enabled!(target: "lanyard::audit", tracing::Level::WARN),
        };
        if enabled {
            log_line::emit(e, crate::telemetry::plain_text_log());
        }
        Ok(())
    }

    async fn record_reload(&self, reload: &PolicyReload) -> Result<(), AuditError> {
        let dir = reload.dir.as_str();
        match &reload.outcome {
            ReloadOutcome::Loaded { policies, digest } => tracing::info!(
                target: "lanyard::audit",
                event = "policy_reload", result = "loaded", dir, policies, digest = %digest,
                "policy set in force"
            ),
            ReloadOutcome::Rejected { error } => tracing::warn!(
                target: "lanyard::audit",
                event = "policy_reload", result = "rejected", dir, error = %error,
                "policy set rejected; the previous set stays in force"
            ),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joined_text_is_escaped_as_escape_debug_escapes_it() {
        let texts: Vec<String> = [
            "https://storage.azure.com/.default",
            "",
            "a \"b\" c",
            "it's",
            "back\\slash",
            "line\nbreak\ttab\r",
            "\x1b[2J\x07\x7f\0",
            "e\u{301}t\u{e9} \u{1f512} \u{85}",
            "\u{301}leading mark",
            "~ !#$%&()*+,-./:;<=>?@[]^_`{|}",
        ]
        .map(String::from)
        .to_vec();
        for one in &texts {
            let expected = format!("\"{}\"", one.escape_debug());
            let written = format!("{:?}", Joined(CallerText::one(one), " "));
            assert_eq!(written, expected);
        }
        let expected = texts
            .iter()
            .map(|t| t.escape_debug().to_string())
            .collect::<Vec<_>>()
            .join(" ");
        let written = format!("{:?}", Joined(CallerText::new(&texts), " "));
        assert_eq!(written, format!("\"{expected}\""));
    }
}
