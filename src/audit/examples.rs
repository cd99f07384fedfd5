//! Audit events for the sinks' tests: one of each shape (granted and
//! refused, with and without a caller, pod, upstream exchange or lifetime)
//! over awkward caller text (quotes, backslashes, control and C1
//! characters, a combining mark, text long enough to be bounded). The
//! tests that compare a hand-written line with its derived twin run over
//! all of them.

use std::time::{Duration, SystemTime};

use super::{AuditEvent, CallerText, IssuedCredential, Verdict};
use crate::cache::CacheOutcome;
use crate::cloud::{Cloud, Kind, Surface, UpstreamCall};
use crate::token::Caller;

/// What the events borrow.
pub(crate) struct Examples {
    caller: Caller,
    podless: Caller,
    texts: Vec<String>,
    policies: Vec<String>,
    upstream: UpstreamCall,
}

impl Examples {
    pub(crate) fn new() -> Self {
        let caller = Caller::example();
        let podless = Caller {
            pod: None,
            node: None,
            namespace: "ns \"x\"\n".into(),
            ..Caller::example()
        };
        Examples {
            caller,
            podless,
            texts: [
                "https://storage.azure.com/",
                "a \"quoted\" 'scope'",
                "back\\slash\ttab\nline",
                "\x1b[2J\x07\x7f\0",
                "caf\u{e9} \u{1f512} \u{85}c1 \u{a2} \u{301}mark \u{2028}",
                &"long-scope-".repeat(40),
            ]
            .map(String::from)
            .to_vec(),
            policies: vec!["allow-bound".to_string(), "team's \"one\"".to_string()],
            upstream: UpstreamCall {
                latency: Duration::from_micros(48_250),
                request_id: Some("req \"7\"\u{1}".into()),
            },
        }
    }

    /// The events; the first is a cache hit granted in 0.204 ms.
    pub(crate) fn events(&self) -> Vec<AuditEvent<'_>> {
        let texts = &self.texts;
        let base = AuditEvent {
            time: SystemTime::UNIX_EPOCH + Duration::from_nanos(1_796_280_456_123_456_789),
            caller: Some(&self.caller),
            token_fingerprint: "sha256:7f6967114fdd",
            cloud: Cloud::Azure,
            kind: Kind::AccessToken,
            surface: Surface::AzureImds,
            identity: Some("5f2c9e1a-8d4b-4c7e-9a13-0d6e2b7f4c21"),
            via: None,
            account: None,
            via_account: None,
            source: None,
            scopes: CallerText::new(&texts[..1]),
            audience: None,
            lifetime: None,
            verdict: Verdict::Allow,
            reason: None,
            code: None,
            message: None,
            policies: &self.policies,
            cache: Some(CacheOutcome::Hit),
            upstream: None,
            credential: Some(IssuedCredential {
                fingerprint: "sha256:52486c204bfb".into(),
                expires_at: 1_796_284_056,
            }),
            latency: Duration::from_nanos(203_694),
        };
        let mut events = vec![base.clone()];
        for text in texts {
            events.push(AuditEvent {
                scopes: CallerText::one(text),
                identity: Some(text),
                ..base.clone()
            });
            events.push(AuditEvent {
                verdict: Verdict::Deny,
                reason: Some("policy_denied"),
                code: Some(text),
                message: Some(format!("Denied: {text}")),
                credential: None,
                cache: None,
                audience: Some(CallerText::one(text)),
                ..base.clone()
            });
        }
        events.push(AuditEvent {
            caller: Some(&self.podless),
            cloud: Cloud::Gcp,
            kind: Kind::IdToken,
            surface: Surface::Gce,
            scopes: CallerText::new(&[]),
            audience: Some(CallerText::new(&texts[2..])),
            lifetime: Some(Duration::from_secs(900)),
            cache: Some(CacheOutcome::Miss),
            upstream: Some(&self.upstream),
            latency: Duration::from_nanos(48_731_500),
            ..base.clone()
        });
        events.push(AuditEvent {
            cloud: Cloud::Aws,
            kind: Kind::AwsCredentials,
            surface: Surface::AwsContainer,
            identity: Some("arn:aws:iam::222233334444:role/data-lake"),
            via: Some("arn:aws:iam::111122223333:role/ray-worker"),
            account: Some("222233334444"),
            via_account: Some("111122223333"),
            source: None,
            scopes: CallerText::new(&[]),
            cache: Some(CacheOutcome::Miss),
            upstream: Some(&self.upstream),
            ..base.clone()
        });
        events.push(AuditEvent {
            caller: None,
            scopes: CallerText::new(texts),
            identity: None,
            policies: &[],
            credential: None,
            verdict: Verdict::Deny,
            reason: Some("bad_request"),
            latency: Duration::ZERO,
            ..base.clone()
        });
        events
    }
}
