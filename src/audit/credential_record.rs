//! The `credential` record, the one every request writes (cache hits
//! included) to each record sink: derived with `serde`, like the other
//! record types in [`super::record`].
//!
//! It was written by hand into its line for a while (constant keys, times
//! and the id formatted on the stack, about 15,700 instructions fewer per
//! record under callgrind), with this derived form kept beside it by a test
//! comparing their bytes. Measured where it counts, cached-hit requests/s
//! of `lanyard dev` with `bench/compare` (A B B A, wrk on Azure IMDS,
//! release builds, 2 cores), the hand-written renderer against this one
//! came out at 0.97, 0.97 and 1.03 in three runs: under the 3 % a copy of
//! a library must earn, so there is one renderer, the derived one.

use serde::Serialize;

use super::record_fields::{self as fields, Origin, Rfc3339};
use super::{AuditEvent, CallerText};
use crate::cache::CacheOutcome;

/// The `credential` record's own members (after [`fields::Envelope`]'s).
#[derive(Serialize)]
struct Record<'a> {
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
    #[serde(skip_serializing_if = "Option::is_none")]
    via: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    account: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    via_account: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    source: Option<&'static str>,
    #[serde(skip_serializing_if = "CallerText::is_empty")]
    scopes: CallerText<'a>,
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
    expires_at: Rfc3339,
}

/// The upstream exchange a request waited on.
#[derive(Serialize)]
struct Upstream<'a> {
    latency_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id: Option<&'a str>,
}

/// Writes the `credential` record of `e` as one JSON object (no newline),
/// with id `id`.
pub(super) fn write(origin: &Origin, e: &AuditEvent<'_>, id: uuid::Uuid, out: &mut Vec<u8>) {
    let caller = e.caller;
    let pod = caller.and_then(|c| c.pod.as_ref());
    let record = Record {
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
            via: e.via,
            account: e.account,
            via_account: e.via_account,
            source: e.source,
            scopes: e.scopes,
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
            expires_at: Rfc3339(fields::unix_time(c.expires_at)),
        }),
        upstream: e.upstream.map(|u| Upstream {
            latency_ms: fields::millis(u.latency),
            request_id: u.request_id.as_deref(),
        }),
        latency_ms: fields::millis(e.latency),
    };
    let record = fields::Envelope::new(id, e.time, "credential", origin, record);
    // Serializing these types into a Vec cannot fail: every map key is a
    // string and no Serialize impl here returns an error.
    let _ = serde_json::to_writer(&mut *out, &record);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::examples::Examples;
    use crate::audit::record::Subject;

    #[test]
    fn the_envelope_comes_first_in_its_order() {
        let examples = Examples::new();
        let origin = Origin::new("prod-eu", "node-1", "agent");
        let mut out = Vec::new();
        write(&origin, &examples.events()[0], uuid::Uuid::nil(), &mut out);
        let line = String::from_utf8(out).unwrap();
        let at = |key: &str| line.find(&format!("\"{key}\":")).unwrap();
        let order = [
            "schema",
            "id",
            "time",
            "type",
            "cluster",
            "caller",
            "request",
            "latency_ms",
        ];
        assert!(order.windows(2).all(|w| at(w[0]) < at(w[1])), "{line}");
        assert!(
            line.starts_with("{\"schema\":\"lanyard.audit/v1\",\"id\":"),
            "{line}"
        );
    }

    #[test]
    fn every_example_is_one_line_of_json_with_its_fields() {
        let examples = Examples::new();
        let origins = [
            Origin::new("prod-eu", "node-1", "agent"),
            Origin::new("c\"l\\u\u{7}s\u{2029}", "", "dev"),
        ];
        for origin in &origins {
            for e in examples.events() {
                let id = uuid::Uuid::now_v7();
                let mut written = Vec::new();
                write(origin, &e, id, &mut written);
                assert!(!written.contains(&b'\n'));
                let v: serde_json::Value = serde_json::from_slice(&written).unwrap();
                assert_eq!(v["type"], "credential");
                assert_eq!(v["id"], id.to_string());
                assert_eq!(v["cluster"], origin.cluster);
                assert_eq!(v["schema"], fields::SCHEMA);
            }
        }
        // The sinks' entry point writes credentials this way too.
        let e = &examples.events()[0];
        let mut through_record = Vec::new();
        crate::audit::record::write(&origins[0], Subject::Credential(e), &mut through_record);
        let v: serde_json::Value = serde_json::from_slice(&through_record).unwrap();
        assert_eq!(v["caller"]["pod"], "ray-worker-0");
        assert_eq!(v["latency_ms"], 0.204);
        assert_eq!(v["credential"]["expires_at"], "2026-12-03T07:47:36.000000Z");
    }

    #[test]
    fn a_chained_identity_names_both_hops_and_their_accounts() {
        let examples = Examples::new();
        let origin = Origin::new("prod-eu", "node-1", "agent");
        let written = |e: &AuditEvent<'_>| {
            let mut out = Vec::new();
            write(&origin, e, uuid::Uuid::nil(), &mut out);
            serde_json::from_slice::<serde_json::Value>(&out).unwrap()
        };
        let events = examples.events();
        let chained = events.iter().find(|e| e.via.is_some()).unwrap();
        let r = &written(chained)["request"];
        assert_eq!(r["identity"], "arn:aws:iam::222233334444:role/data-lake");
        assert_eq!(r["via"], "arn:aws:iam::111122223333:role/ray-worker");
        assert_eq!(r["account"], "222233334444");
        assert_eq!(r["via_account"], "111122223333");
        let plain = written(&events[0]);
        assert!(plain["request"].get("account").is_none(), "{plain}");
    }
}
