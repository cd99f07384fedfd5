//! The audit seam: one typed [`AuditEvent`] per decision, handed to an
//! [`AuditSink`].
//!
//! The pipeline builds the event from what each step learned (who called,
//! what for, which identity, the decision, how the cache answered, the
//! credential's fingerprint and expiry) and hands it to the sink before the
//! credential is returned. An event never holds a token, assertion or key:
//! tokens appear only as short SHA-256 fingerprints, and caller-supplied
//! text is bounded. The default sink, [`LogSink`], writes the record on the
//! `lanyard::audit` tracing target.

use std::time::{Duration, SystemTime};

use crate::cache::CacheOutcome;
use crate::cloud::{Cloud, Kind, Surface};
use crate::token::Caller;

/// Longest caller-supplied text kept in a record; longer text keeps its
/// head, its length and a hash of the whole.
pub const MAX_FIELD_CHARS: usize = 256;

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

/// Who asked, as the verified token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditCaller {
    /// The namespace of the caller's pod and ServiceAccount.
    pub namespace: String,
    /// The name of the ServiceAccount the token was issued for.
    pub service_account: String,
    /// The name of the pod the token is bound to; `None` for a token that is not
    /// pod-bound (which the broker then refuses).
    pub pod: Option<String>,
    /// The uid of that pod, which tells apart pods that reuse a name.
    pub pod_uid: Option<String>,
}

impl From<&Caller> for AuditCaller {
    fn from(c: &Caller) -> Self {
        AuditCaller {
            namespace: c.namespace.clone(),
            service_account: c.service_account.clone(),
            pod: c.pod.as_ref().map(|p| p.name.clone()),
            pod_uid: c.pod.as_ref().map(|p| p.uid.clone()),
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

/// One decision.
#[derive(Debug, Clone)]
pub struct AuditEvent {
    /// When the decision was made (wall clock, at the end of the pipeline).
    pub time: SystemTime,
    /// `None` when the token was refused before it named anyone.
    pub caller: Option<AuditCaller>,
    /// Fingerprint of the caller's projected token.
    pub token_fingerprint: String,
    /// The cloud the request was for.
    pub cloud: Cloud,
    /// What kind of credential was asked for.
    pub kind: Kind,
    /// The SDK-facing endpoint the request came in on.
    pub surface: Surface,
    /// The identity the request was decided for, once bound.
    pub identity: Option<String>,
    /// Scopes or resource, bounded.
    pub scopes: Vec<String>,
    /// ID-token audience, bounded.
    pub audience: Option<String>,
    /// The lifetime the caller asked for; `None` when it asked for none and the
    /// configured one applied.
    pub lifetime: Option<Duration>,
    /// Whether the request was granted.
    pub verdict: Verdict,
    /// Why it was refused (`BrokerError::reason`), for denials.
    pub reason: Option<&'static str>,
    /// The upstream or token-check code, when one decided.
    pub code: Option<String>,
    /// The refusal as the caller was told it.
    pub message: Option<String>,
    /// Ids of the policies that decided.
    pub policies: Vec<String>,
    /// How the cache answered, when it was consulted.
    pub cache: Option<CacheOutcome>,
    /// The credential that was returned, by fingerprint; `None` for denials.
    pub credential: Option<IssuedCredential>,
    /// Time from the request reaching the broker to the decision, cache lookup
    /// and upstream exchange included.
    pub latency: Duration,
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

/// Where events go.
#[async_trait::async_trait]
pub trait AuditSink: Send + Sync {
    /// Records `event`. A sink that must be durable returns only once the
    /// event is; an error means it is not recorded.
    async fn record(&self, event: &AuditEvent) -> Result<(), AuditError>;
}

/// Caller-supplied text as it may appear in a record: at most
/// [`MAX_FIELD_CHARS`] characters, then its length and a hash of the rest.
pub fn bounded(text: &str) -> String {
    match text.char_indices().nth(MAX_FIELD_CHARS) {
        None => text.to_string(),
        Some((cut, _)) => format!(
            "{}…[{} bytes, {}]",
            &text[..cut],
            text.len(),
            crate::secret::fingerprint(text)
        ),
    }
}

/// Writes each event as one record on the `lanyard::audit` tracing target.
pub struct LogSink;

#[async_trait::async_trait]
impl AuditSink for LogSink {
    async fn record(&self, e: &AuditEvent) -> Result<(), AuditError> {
        let level = match e.verdict {
            Verdict::Allow => tracing::Level::INFO,
            Verdict::Deny => tracing::Level::WARN,
        };
        // A filtered-out record costs nothing to format.
        let enabled = match level {
            tracing::Level::INFO => {
                tracing::enabled!(target: "lanyard::audit", tracing::Level::INFO)
            }
            _ => tracing::enabled!(target: "lanyard::audit", tracing::Level::WARN),
        };
        if !enabled {
            return Ok(());
        }
        let caller = e.caller.as_ref();
        let namespace = caller.map_or("", |c| c.namespace.as_str());
        let service_account = caller.map_or("", |c| c.service_account.as_str());
        let pod = caller.and_then(|c| c.pod.as_deref()).unwrap_or("");
        let identity = e.identity.as_deref().unwrap_or("");
        let resource = match &e.audience {
            Some(audience) => audience.clone(),
            None => e.scopes.join(" "),
        };
        let cache = e.cache.map_or("", CacheOutcome::name);
        let latency_ms = e.latency.as_secs_f64() * 1000.0;
        let (cloud, kind, surface) = (e.cloud.name(), e.kind.name(), e.surface.name());
        let policies = e.policies.join(",");
        match e.verdict {
            Verdict::Allow => {
                let expires_at = e.credential.as_ref().map_or(0, |c| c.expires_at);
                let credential_fingerprint = e.credential.as_ref().map_or("", |c| &*c.fingerprint);
                tracing::info!(
                    target: "lanyard::audit",
                    decision = "allow",
                    cloud, kind, surface, namespace, service_account, pod, identity, resource,
                    cache, policies, credential_fingerprint, expires_at,
                    token_fingerprint = %e.token_fingerprint, latency_ms,
                    "credential issued"
                )
            }
            Verdict::Deny => tracing::warn!(
                target: "lanyard::audit",
                decision = "deny",
                cloud, kind, surface, namespace, service_account, pod, identity, resource,
                cache, policies,
                reason = e.reason.unwrap_or(""),
                code = e.code.as_deref().unwrap_or(""),
                error = e.message.as_deref().unwrap_or(""),
                token_fingerprint = %e.token_fingerprint, latency_ms,
                "credential refused"
            ),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_caller_text_is_bounded_with_length_and_hash() {
        let long = "r".repeat(60_000);
        let b = bounded(&long);
        assert!(b.chars().count() < MAX_FIELD_CHARS + 64, "{}", b.len());
        assert!(b.contains("60000 bytes"));
        assert!(b.contains("sha256:"));
        assert_eq!(
            bounded("https://storage.azure.com/"),
            "https://storage.azure.com/"
        );
        // Multibyte text is cut on a character boundary.
        let wide = "é".repeat(1000);
        assert!(bounded(&wide).starts_with(&"é".repeat(MAX_FIELD_CHARS)));
    }
}
