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
//! collectors and files get it), the fields are put together in one string
//! and the event carries it as its message: the bytes written are the
//! structured event's, byte for byte (a test compares them). The JSON log
//! and a terminal's coloured log get the structured event, whose fields
//! their formatters lay out themselves.

use std::fmt::{self, Write as _};

use super::{AuditEvent, Joined, JoinedStrs, Verdict};
use crate::cache::CacheOutcome;
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
            latency_ms: super::record::millis(e.latency),
        }
    }
}

/// Writes `e` on the `lanyard::audit` target: put together as one message
/// when `prerendered`, else as a structured event.
pub(super) fn emit(e: &AuditEvent<'_>, prerendered: bool) {
    let f = Fields::of(e);
    if prerendered {
        let written = LINE.with(|line| {
            // Held only while this line is written: nothing below logs an
            // audit record, so the borrow is never taken twice.
            let Ok(mut line) = line.try_borrow_mut() else {
                return false;
            };
            line.clear();
            if render(e, &f, &mut line).is_err() {
                return false;
            }
            match e.verdict {
                Verdict::Allow => tracing::info!(target: "lanyard::audit", "{line}"),
                Verdict::Deny => tracing::warn!(target: "lanyard::audit", "{line}"),
            }
            true
        });
        if written {
            return;
        }
    }
    emit_structured(e, &f);
}

thread_local! {
    /// Each thread's line, reused: writing an audit line allocates nothing
    /// once the thread has written its longest (caller text is bounded).
    static LINE: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

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
    super::record::with_millis(e.latency, |text| out.push_str(text));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::examples::Examples;
    use crate::telemetry::text_fields::{capture, TextFields};

    /// The text log of `events`, each written one way or the other.
    fn log(events: &[AuditEvent<'_>], prerendered: bool) -> String {
        capture::text_log(TextFields, false, || {
            let span = tracing::info_span!("request", surface = "gce");
            let _entered = span.enter();
            for e in events {
                emit(e, prerendered);
            }
        })
    }

    #[test]
    fn prerendered_lines_are_the_structured_lines() {
        let examples = Examples::new();
        let events = examples.events();
        let prerendered = log(&events, true);
        let structured = log(&events, false);
        assert_eq!(prerendered.matches("lanyard::audit").count(), events.len());
        assert!(prerendered.contains("latency_ms=0.204"), "{prerendered}");
        for (a, b) in prerendered.lines().zip(structured.lines()) {
            assert_eq!(a, b);
        }
        assert_eq!(prerendered, structured);
    }
}
