//! The `credential` record, written straight into its line.
//!
//! Every credential request writes one, cache hits included, to each
//! record sink (the file, stdout). Through `serde`'s derived, flattened
//! serialization it cost about 15,700 instructions under callgrind: each
//! of some thirty fields went through the map serializer, its constant key
//! was escaped afresh, and the times and the id were formatted into heap
//! strings first. Here the keys are constants, the times and the id are
//! formatted on the stack, strings with nothing to escape are copied
//! whole, every other string is written by `serde_json`'s own serializer,
//! and the latencies from their integer microseconds
//! ([`super::record_fields::with_millis`]): the bytes are those `serde_json` writes
//! for the same record, byte for byte (a test compares them over awkward
//! caller text). The other, rarer record types keep the derived path in
//! [`super::record`].

use super::record_fields::{self as fields, Origin};
use super::{AuditEvent, CallerText};
use crate::cache::CacheOutcome;
use crate::telemetry::ascii_words::{any_word, byte_in, control_in};

/// Writes the `credential` record of `e` as one JSON object (no newline),
/// with id `id`.
pub(super) fn write(origin: &Origin, e: &AuditEvent<'_>, id: uuid::Uuid, out: &mut Vec<u8>) {
    out.extend_from_slice(b"{\"schema\":");
    string(out, fields::SCHEMA);
    out.extend_from_slice(b",\"id\":\"");
    let mut uuid = uuid::Uuid::encode_buffer();
    out.extend_from_slice(id.hyphenated().encode_lower(&mut uuid).as_bytes());
    out.extend_from_slice(b"\",\"time\":");
    fields::with_rfc3339(e.time, |t| string(out, t));
    out.extend_from_slice(b",\"type\":\"credential\",\"cluster\":");
    string(out, &origin.cluster);
    out.extend_from_slice(b",\"node\":");
    string(out, &origin.node);
    out.extend_from_slice(b",\"role\":");
    string(out, origin.role);
    out.extend_from_slice(b",\"version\":");
    string(out, origin.version);

    let caller = e.caller;
    let pod = caller.and_then(|c| c.pod.as_ref());
    let mut o = Object::open(out, b",\"caller\":{");
    o.some(b"namespace", caller.map(|c| c.namespace.as_str()));
    o.some(
        b"service_account",
        caller.map(|c| c.service_account.as_str()),
    );
    o.some(b"pod", pod.map(|p| p.name.as_str()));
    o.some(b"pod_uid", pod.map(|p| p.uid.as_str()));
    o.some(
        b"node",
        caller
            .and_then(|c| c.node.as_ref())
            .map(|n| n.name.as_str()),
    );
    o.str(b"token", e.token_fingerprint);
    o.close();

    let mut o = Object::open(out, b",\"request\":{");
    o.str(b"cloud", e.cloud.name());
    o.str(b"kind", e.kind.name());
    o.str(b"surface", e.surface.name());
    o.some(b"identity", e.identity);
    texts(&mut o, b"scopes", e.scopes);
    if let Some(audience) = e.audience.and_then(|a| a.iter().next()) {
        o.str(b"audience", &audience);
    }
    if let Some(lifetime) = e.lifetime {
        o.key(b"lifetime_seconds");
        o.out
            .extend_from_slice(itoa::Buffer::new().format(lifetime.as_secs()).as_bytes());
    }
    o.close();

    let mut o = Object::open(out, b",\"decision\":{");
    o.str(b"verdict", e.verdict.name());
    o.some(b"reason", e.reason);
    if !e.policies.is_empty() {
        o.key(b"policies");
        array(o.out, e.policies.iter());
    }
    o.close();

    // `result`: `issued` (an exchange made for this request), `cached`
    // (served from the cache), `refused` (Lanyard said no),
    // `upstream_error` (the cloud said no or failed).
    let mut o = Object::open(out, b",\"outcome\":{");
    o.str(b"result", fields::outcome_of(e));
    o.some(b"cache", e.cache.map(CacheOutcome::name));
    o.some(b"code", e.code);
    o.some(b"message", e.message.as_deref());
    o.close();

    if let Some(c) = &e.credential {
        let mut o = Object::open(out, b",\"credential\":{");
        o.str(b"fingerprint", &c.fingerprint);
        o.key(b"expires_at");
        fields::with_rfc3339(fields::unix_time(c.expires_at), |t| string(o.out, t));
        o.close();
    }
    if let Some(u) = e.upstream {
        let mut o = Object::open(out, b",\"upstream\":{");
        o.key(b"latency_ms");
        fields::with_millis(u.latency, |t| o.out.extend_from_slice(t.as_bytes()));
        o.some(b"request_id", u.request_id.as_deref());
        o.close();
    }
    out.extend_from_slice(b",\"latency_ms\":");
    fields::with_millis(e.latency, |t| out.extend_from_slice(t.as_bytes()));
    out.push(b'}');
}

/// A JSON object being written: commas go before every member but the
/// first.
struct Object<'o> {
    out: &'o mut Vec<u8>,
    first: bool,
}

impl<'o> Object<'o> {
    fn open(out: &'o mut Vec<u8>, opening: &[u8]) -> Self {
        out.extend_from_slice(opening);
        Object { out, first: true }
    }

    /// `key` is a constant of ours: plain ASCII with nothing to escape.
    fn key(&mut self, key: &[u8]) {
        if !self.first {
            self.out.push(b',');
        }
        self.first = false;
        self.out.push(b'"');
        self.out.extend_from_slice(key);
        self.out.extend_from_slice(b"\":");
    }

    fn str(&mut self, key: &[u8], value: &str) {
        self.key(key);
        string(self.out, value);
    }

    /// Left out when `None`, as the derived records skip it.
    fn some(&mut self, key: &[u8], value: Option<&str>) {
        if let Some(value) = value {
            self.str(key, value);
        }
    }

    fn close(self) {
        self.out.push(b'}');
    }
}

/// `key: [texts]`, each bounded; left out when there are none.
fn texts(o: &mut Object<'_>, key: &[u8], texts: CallerText<'_>) {
    let mut texts = texts.iter().peekable();
    if texts.peek().is_some() {
        o.key(key);
        array(o.out, texts);
    }
}

fn array<S: AsRef<str>>(out: &mut Vec<u8>, items: impl Iterator<Item = S>) {
    out.push(b'[');
    for (i, item) in items.enumerate() {
        if i > 0 {
            out.push(b',');
        }
        string(out, item.as_ref());
    }
    out.push(b']');
}

/// A JSON string, escaped by `serde_json` itself. Most values (names,
/// ids, fingerprints) hold nothing to escape: those are copied whole, as
/// `serde_json` would write them, without its byte-by-byte pass.
fn string(out: &mut Vec<u8>, value: &str) {
    // JSON escapes only `"`, `\` and the control characters below 0x20;
    // `serde_json` escapes exactly those.
    let plain = !any_word(value, |w| {
        control_in(w) | byte_in(w, b'"') | byte_in(w, b'\\')
    });
    if plain {
        out.reserve(value.len() + 2);
        out.push(b'"');
        out.extend_from_slice(value.as_bytes());
        out.push(b'"');
        return;
    }
    // Writing into a Vec cannot fail.
    let _ = serde::Serializer::serialize_str(&mut serde_json::Serializer::new(out), value);
}

#[cfg(test)]
mod tests {
    //! The reference: the record as `serde` derives it, as it was written
    //! before this module.

    use serde::Serialize;

    use super::*;
    use crate::audit::examples::Examples;
    use crate::audit::record::Subject;
    use crate::telemetry::ascii_words::texts_with_each_odd_char;

    #[derive(Serialize)]
    struct Record<'a> {
        schema: &'static str,
        id: String,
        time: String,
        #[serde(rename = "type")]
        kind: &'static str,
        #[serde(flatten)]
        origin: &'a Origin,
        caller: Caller<'a>,
        request: Request<'a>,
        decision: Decision<'a>,
        outcome: Outcome<'a>,
        #[serde(skip_serializing_if = "Option::is_none")]
        credential: Option<Credential<'a>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        upstream: Option<Upstream<'a>>,
        latency_ms: f64,
    }

    #[derive(Serialize)]
    struct Caller<'a> {
        #[serde(skip_serializing_if = "Option::is_none")]
        namespace: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        service_account: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pod: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pod_uid: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        node: Option<&'a str>,
        token: &'a str,
    }

    #[derive(Serialize)]
    struct Request<'a> {
        cloud: &'static str,
        kind: &'static str,
        surface: &'static str,
        #[serde(skip_serializing_if = "Option::is_none")]
        identity: Option<&'a str>,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        scopes: Vec<std::borrow::Cow<'a, str>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        audience: Option<std::borrow::Cow<'a, str>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        lifetime_seconds: Option<u64>,
    }

    #[derive(Serialize)]
    struct Decision<'a> {
        verdict: &'static str,
        #[serde(skip_serializing_if = "Option::is_none")]
        reason: Option<&'static str>,
        #[serde(skip_serializing_if = "<[String]>::is_empty")]
        policies: &'a [String],
    }

    #[derive(Serialize)]
    struct Outcome<'a> {
        /// `issued` (an exchange made for this request), `cached` (served from
        /// the cache), `refused` (Lanyard said no), `upstream_error` (the cloud
        /// said no or failed).
        result: &'static str,
        #[serde(skip_serializing_if = "Option::is_none")]
        cache: Option<&'static str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        code: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        message: Option<&'a str>,
    }

    #[derive(Serialize)]
    struct Credential<'a> {
        fingerprint: &'a str,
        expires_at: String,
    }

    /// The upstream exchange a request waited on.
    #[derive(Serialize)]
    struct Upstream<'a> {
        latency_ms: f64,
        #[serde(skip_serializing_if = "Option::is_none")]
        request_id: Option<&'a str>,
    }

    fn reference(origin: &Origin, e: &AuditEvent<'_>, id: uuid::Uuid) -> Vec<u8> {
        let caller = e.caller;
        let pod = caller.and_then(|c| c.pod.as_ref());
        let record = Record {
            schema: fields::SCHEMA,
            id: id.to_string(),
            time: fields::rfc3339(e.time),
            kind: "credential",
            origin,
            caller: Caller {
                namespace: caller.map(|c| c.namespace.as_str()),
                service_account: caller.map(|c| c.service_account.as_str()),
                pod: pod.map(|p| p.name.as_str()),
                pod_uid: pod.map(|p| p.uid.as_str()),
                node: caller
                    .and_then(|c| c.node.as_ref())
                    .map(|n| n.name.as_str()),
                token: e.token_fingerprint,
            },
            request: Request {
                cloud: e.cloud.name(),
                kind: e.kind.name(),
                surface: e.surface.name(),
                identity: e.identity,
                scopes: e.scopes.iter().collect(),
                audience: e.audience.and_then(|a| a.iter().next()),
                lifetime_seconds: e.lifetime.map(|l| l.as_secs()),
            },
            decision: Decision {
                verdict: e.verdict.name(),
                reason: e.reason,
                policies: e.policies,
            },
            outcome: Outcome {
                result: fields::outcome_of(e),
                cache: e.cache.map(CacheOutcome::name),
                code: e.code,
                message: e.message.as_deref(),
            },
            credential: e.credential.as_ref().map(|c| Credential {
                fingerprint: &c.fingerprint,
                expires_at: fields::rfc3339(fields::unix_time(c.expires_at)),
            }),
            upstream: e.upstream.map(|u| Upstream {
                latency_ms: fields::millis(u.latency),
                request_id: u.request_id.as_deref(),
            }),
            latency_ms: fields::millis(e.latency),
        };
        serde_json::to_vec(&record).unwrap()
    }

    #[test]
    fn strings_are_written_as_serde_json_writes_them() {
        let lens = [1, 7, 8, 9, 16, 17];
        for text in texts_with_each_odd_char(&lens, "\u{2028}") {
            let mut ours = Vec::new();
            string(&mut ours, &text);
            assert_eq!(ours, serde_json::to_vec(&text).unwrap(), "{text:?}");
        }
    }

    #[test]
    fn written_records_are_the_derived_records() {
        let examples = Examples::new();
        let origins = [
            Origin::new("prod-eu", "node-1", "agent"),
            Origin::new("c\"l\\u\u{7}s\u{2029}", "", "dev"),
        ];
        let mut checked = 0;
        for origin in &origins {
            for e in examples.events() {
                let id = uuid::Uuid::now_v7();
                let mut written = Vec::new();
                write(origin, &e, id, &mut written);
                let want = reference(origin, &e, id);
                assert_eq!(
                    String::from_utf8_lossy(&written),
                    String::from_utf8_lossy(&want)
                );
                // Every record is one line of valid JSON.
                let v: serde_json::Value = serde_json::from_slice(&written).unwrap();
                assert_eq!(v["type"], "credential");
                assert!(!written.contains(&b'\n'));
                checked += 1;
            }
        }
        assert_eq!(checked, 2 * Examples::new().events().len());
        // The sinks' entry point writes credentials this way too.
        let e = &examples.events()[0];
        let mut through_record = Vec::new();
        crate::audit::record::write(&origins[0], Subject::Credential(e), &mut through_record);
        let v: serde_json::Value = serde_json::from_slice(&through_record).unwrap();
        assert_eq!(v["caller"]["pod"], "ray-worker-0");
        assert_eq!(v["latency_ms"], 0.204);
        assert_eq!(v["credential"]["expires_at"], "2026-12-03T07:47:36.000000Z");
    }
}
