//! The audit record as a log line, the default sink ([`super::LogSink`]).
//!
//! Every request writes this line, cache hits included. As a structured
//! `tracing` event of fifteen fields it cost about 10,000 instructions
//! under callgrind: each field passes through the event's value set, a
//! visitor call and six writes through the formatter's `dyn Write`. That
//! was a quarter of a cached hit's instructions (SHA-256 aside), and the
//! largest part of the gap to a static file served by nginx.
//!
//! When the log is plain text (`--log-format text` without colours, as
//! collectors and files get it), the fields are put together in one line
//! behind the log's timestamp, level and target, and the line goes
//! straight to the log's writer (`telemetry::direct_line`): the bytes
//! written are the structured event's, byte for byte (a test compares
//! them). The JSON log and a terminal's coloured log get the structured
//! event, whose fields their formatters lay out themselves.

use std::fmt::{self, Write as _};

use super::{AuditEvent, Joined, JoinedStrs, Verdict};
use crate::cache::CacheOutcome;
use crate::telemetry::direct_line;
use crate::telemetry::text_fields::write_debug_str;

/// The line's fields, worked out once for either way of writing it.
struct Fields<'a> {
    namespace: &'a str,
    service_account: &'a str,
    pod: &'a str,
    identity: &'a str,
    resource: Joined<'a>,
    cache: &'static str,
    policies: JoinedStrs<'a>,
    latency_ms: f64,
}

impl<'a> Fields<'a> {
    fn of(e: &AuditEvent<'a>) -> Self {
        let caller = e.caller;
        Fields {
            namespace: caller.map_or("", |c| c.namespace.as_str()),
            service_account: caller.map_or("", |c| c.service_account.as_str()),
            pod: caller
                .and_then(|c| c.pod.as_ref())
                .map_or("", |p| p.name.as_str()),
            identity: e.identity.unwrap_or(""),
            // Written straight into the line, not joined into a string first.
            resource: Joined(e.audience.unwrap_or(e.scopes), " "),
            cache: e.cache.map_or("", CacheOutcome::name),
            policies: JoinedStrs(e.policies, ","),
            latency_ms: super::record_fields::millis(e.latency),
        }
    }
}

/// Writes `e` on the `lanyard::audit` target: put together as one line
/// and written straight to the log's writer when `prerendered`
/// (`telemetry::direct_line`), else as a structured event.
pub(super) fn emit(e: &AuditEvent<'_>, prerendered: bool) {
    let f = Fields::of(e);
    if prerendered && direct_line::write(level(e.verdict), TARGET, |line| render(e, &f, line)) {
        return;
    }
    emit_structured(e, &f);
}

/// The line's level: refusals are warnings.
fn level(verdict: Verdict) -> tracing::Level {
    match verdict {
        Verdict::Allow => tracing::Level::INFO,
        Verdict::Deny => tracing::Level::WARN,
    }
}

/// The audit line's target (the structured event's, spelled out in its
/// macros).
const TARGET: &str = "lanyard::audit";

fn emit_structured(e: &AuditEvent<'_>, f: &Fields<'_>) {
    let (namespace, service_account, pod, identity) =
        (f.namespace, f.service_account, f.pod, f.identity);
    let resource = tracing::field::debug(&f.resource);
    let policies = tracing::field::debug(&f.policies);
    let (cache, latency_ms) = (f.cache, f.latency_ms);
    let (cloud, kind, surface) = (e.cloud.name(), e.kind.name(), e.surface.name());
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
            code = e.code.unwrap_or(""),
            error = e.message.as_deref().unwrap_or(""),
            token_fingerprint = %e.token_fingerprint, latency_ms,
            "credential refused"
        ),
    }
}

/// The message and fields of [`emit_structured`]'s event as the text log's
/// field formatter writes them: `name=value` separated by spaces, strings
/// quoted and escaped as `Debug` escapes them.
// INVARIANT: the fields, their order and their formatting follow
// `emit_structured` exactly; `prerendered_lines_are_the_structured_lines`
// checks it.
fn render(e: &AuditEvent<'_>, f: &Fields<'_>, out: &mut String) -> fmt::Result {
    let text = |out: &mut String, name: &str, value: &str| {
        out.push(' ');
        out.push_str(name);
        out.push('=');
        write_debug_str(out, value)
    };
    let allow = e.verdict == Verdict::Allow;
    out.push_str(if allow {
        "credential issued decision=\"allow\""
    } else {
        "credential refused decision=\"deny\""
    });
    text(out, "cloud", e.cloud.name())?;
    text(out, "kind", e.kind.name())?;
    text(out, "surface", e.surface.name())?;
    text(out, "namespace", f.namespace)?;
    text(out, "service_account", f.service_account)?;
    text(out, "pod", f.pod)?;
    text(out, "identity", f.identity)?;
    write!(out, " resource={:?}", f.resource)?;
    text(out, "cache", f.cache)?;
    write!(out, " policies={:?}", f.policies)?;
    if allow {
        let credential = e.credential.as_ref();
        text(
            out,
            "credential_fingerprint",
            credential.map_or("", |c| &*c.fingerprint),
        )?;
        out.push_str(" expires_at=");
        out.push_str(itoa::Buffer::new().format(credential.map_or(0, |c| c.expires_at)));
    } else {
        text(out, "reason", e.reason.unwrap_or(""))?;
        text(out, "code", e.code.unwrap_or(""))?;
        text(out, "error", e.message.as_deref().unwrap_or(""))?;
    }
    out.push_str(" token_fingerprint=");
    out.push_str(e.token_fingerprint);
    out.push_str(" latency_ms=");
    super::record_fields::with_millis(e.latency, |text| out.push_str(text));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::examples::Examples;
    use crate::telemetry::text_fields::{capture, TextFields};

    /// `e` as the text log's subscriber writes the structured event (no
    /// time).
    fn structured(e: &AuditEvent<'_>) -> String {
        capture::text_log(TextFields, false, || emit_structured(e, &Fields::of(e)))
    }

    /// `e` as written straight to the log (no time); `None` where the
    /// subscriber would escape the line, and the event goes through it.
    fn direct(e: &AuditEvent<'_>) -> Option<String> {
        let mut line = String::new();
        let f = Fields::of(e);
        direct_line::lay_out(&mut line, level(e.verdict), TARGET, |out| {
            render(e, &f, out)
        })
        .ok()
        .map(|()| line)
    }

    #[test]
    fn direct_lines_are_the_structured_lines() {
        let examples = Examples::new();
        let events = examples.events();
        let mut compared = 0;
        for e in &events {
            let structured = structured(e);
            assert_eq!(structured.matches("lanyard::audit: ").count(), 1);
            if let Some(direct) = direct(e) {
                assert_eq!(direct, structured);
                compared += 1;
            }
        }
        assert!(direct(&events[0]).is_some_and(|l| l.contains("latency_ms=0.204")));
        assert!(
            compared * 2 > events.len(),
            "{compared} of {} written directly",
            events.len()
        );
    }
}
