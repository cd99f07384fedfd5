//! Denials explained where users look: a Kubernetes Event on the calling
//! Pod, so `kubectl describe pod` says why its SDK calls fail.
//!
//! An SDK turns a refusal into a terse exception deep in an application's
//! log; the pod's events are where a platform user looks first. For the
//! refusals a user can act on — a policy denied the request, the
//! ServiceAccount has no binding, the cloud refused the exchange (no
//! federated credential, role not trusted) — the agent records a `Warning`
//! Event with reason `CredentialDenied` on the pod, naming the identity and
//! the policy ids or the upstream code.
//!
//! A crash-looping pod must not flood the API server: the same denial of
//! the same pod is explained at most once a minute (the Events API then
//! counts repeats in that denial's event series), all pods together at most
//! [`RATE_PER_SECOND`] a second, and the queue to the publisher is bounded
//! (a full queue drops, and counts, the explanation; never the request).
//! Publishing happens off the request path.
//!
//! Needs `create` and `patch` on `events.k8s.io` events: the only write the
//! agent's RBAC has.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::audit::{AuditError, AuditEvent, AuditSink, PolicyReload, Verdict};
use crate::telemetry::metrics::{Metrics, ResultLabel};

/// The Event's reason, as `kubectl describe pod` shows it.
pub const REASON: &str = "CredentialDenied";
/// The Event's action.
pub const ACTION: &str = "IssueCredential";
/// The reporting controller named in each Event.
pub const CONTROLLER: &str = "lanyard.dev/agent";
/// The same denial of the same pod is explained at most once per this.
pub const REPEAT_AFTER: Duration = Duration::from_secs(60);
/// Events published per second, all pods together (with a burst of twice
/// as many).
pub const RATE_PER_SECOND: f64 = 5.0;
/// Explanations waiting to be published; more are dropped.
const QUEUE: usize = 1024;
/// Denials remembered for deduplication; the oldest go first.
const REMEMBERED: usize = 10_000;
/// Longest note the Events API accepts is 1 kB.
const MAX_NOTE: usize = 1000;

/// The refusal reasons worth explaining on the pod: a user can act on
/// them. Token and transient failures are not (they are the cluster's or
/// the cloud's, and the log has them).
const EXPLAINED: [&str; 3] = ["policy_denied", "not_bound", "upstream_rejected"];

/// One denial to explain.
#[derive(Debug, Clone)]
struct Denial {
    namespace: String,
    pod: String,
    pod_uid: String,
    /// What is deduplicated on: pod uid, cloud, kind, identity, reason.
    key: String,
    note: String,
}

/// An audit sink that passes every event to `inner` and, for denials worth
/// explaining, queues a Kubernetes Event on the calling pod.
pub struct Explained<S> {
    inner: S,
    queue: mpsc::Sender<Denial>,
    metrics: Arc<Metrics>,
}

impl<S: AuditSink> Explained<S> {
    /// Wraps `inner`; Events are published with `client` by a task started
    /// here, as `instance` (the node's name, say) of [`CONTROLLER`].
    pub fn new(inner: S, client: kube::Client, instance: String, metrics: Arc<Metrics>) -> Self {
        let (queue, rx) = mpsc::channel(QUEUE);
        let reporter = Reporter {
            controller: CONTROLLER.into(),
            instance: Some(instance),
        };
        tokio::spawn(publish(rx, client, reporter, metrics.clone()));
        Explained {
            inner,
            queue,
            metrics,
        }
    }
}

#[async_trait::async_trait]
impl<S: AuditSink> AuditSink for Explained<S> {
    async fn record(&self, event: &AuditEvent<'_>) -> Result<(), AuditError> {
        self.inner.record(event).await?;
        if let Some(denial) = denial(event) {
            if self.queue.try_send(denial).is_err() {
                count(&self.metrics, "dropped");
            }
        }
        Ok(())
    }

    async fn record_reload(&self, reload: &PolicyReload) -> Result<(), AuditError> {
        self.inner.record_reload(reload).await
    }
}

/// The explanation of `event`, if it is a denial worth one.
fn denial(event: &AuditEvent<'_>) -> Option<Denial> {
    if event.verdict != Verdict::Deny || !EXPLAINED.contains(&event.reason?) {
        return None;
    }
    let caller = event.caller?;
    let pod = caller.pod.as_ref()?;
    let identity = event.identity.unwrap_or("(none bound)");
    let what = format!(
        "{} {} for identity {identity}",
        event.cloud,
        event.kind.name().replace('_', " ")
    );
    let mut note = format!(
        "{what} was refused: {}",
        event.message.as_deref().unwrap_or("no reason given")
    );
    note.truncate(note.floor_char_boundary(MAX_NOTE));
    Some(Denial {
        namespace: caller.namespace.clone(),
        pod: pod.name.clone(),
        pod_uid: pod.uid.clone(),
        key: format!(
            "{}/{}/{}/{identity}/{}",
            pod.uid,
            event.cloud,
            event.kind.name(),
            event.reason.unwrap_or("")
        ),
        note,
    })
}

fn count(metrics: &Metrics, result: &'static str) {
    metrics
        .pod_events
        .get_or_create(&ResultLabel { result })
        .inc();
}

/// Publishes queued denials, deduplicated and rate-limited.
///
/// Each denial has a [`Recorder`] of its own: a recorder folds every event
/// of one type, reason and action on one object into one series that keeps
/// the first note, so a pod's second, different denial would show the
/// first one's explanation. Per denial, a repeat joins its own series.
async fn publish(
    mut rx: mpsc::Receiver<Denial>,
    client: kube::Client,
    reporter: Reporter,
    metrics: Arc<Metrics>,
) {
    let mut last_sent: HashMap<String, (Instant, Recorder)> = HashMap::new();
    let mut bucket = Bucket::new(RATE_PER_SECOND, 2.0 * RATE_PER_SECOND);
    while let Some(denial) = rx.recv().await {
        let now = Instant::now();
        if last_sent
            .get(&denial.key)
            .is_some_and(|(at, _)| now.duration_since(*at) < REPEAT_AFTER)
        {
            count(&metrics, "deduplicated");
            continue;
        }
        if !bucket.take(now) {
            count(&metrics, "rate_limited");
            continue;
        }
        if last_sent.len() >= REMEMBERED {
            last_sent.retain(|_, (at, _)| now.duration_since(*at) < REPEAT_AFTER);
            if last_sent.len() >= REMEMBERED {
                last_sent.clear();
            }
        }
        let recorder = match last_sent.remove(&denial.key) {
            Some((_, recorder)) => recorder,
            None => Recorder::new(client.clone(), reporter.clone()),
        };
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            namespace: Some(denial.namespace.clone()),
            name: Some(denial.pod.clone()),
            uid: Some(denial.pod_uid.clone()),
            ..Default::default()
        };
        let event = Event {
            type_: EventType::Warning,
            reason: REASON.into(),
            note: Some(denial.note),
            action: ACTION.into(),
            secondary: None,
        };
        let published = recorder.publish(&event, &reference).await;
        last_sent.insert(denial.key.clone(), (now, recorder));
        match published {
            Ok(()) => count(&metrics, "published"),
            Err(e) => {
                count(&metrics, "failed");
                tracing::warn!(
                    namespace = %denial.namespace, pod = %denial.pod, error = %e,
                    "could not record the denial as an Event on the pod"
                );
            }
        }
    }
}

/// A token bucket: `rate` tokens a second, at most `burst` saved.
struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn new(rate: f64, burst: f64) -> Self {
        Bucket {
            rate,
            burst,
            tokens: burst,
            at: Instant::now(),
        }
    }

    fn take(&mut self, now: Instant) -> bool {
        let elapsed = now.duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::CallerText;
    use crate::cloud::{Cloud, Kind, Surface};
    use crate::token::{Caller, ObjectRef};

    fn caller() -> Caller {
        Caller {
            namespace: "team-a".into(),
            service_account: "ray".into(),
            service_account_uid: "sa-uid".into(),
            pod: Some(ObjectRef {
                name: "ray-worker-0".into(),
                uid: "pod-uid".into(),
            }),
            node: None,
            token_expires_at: 0,
            token_fingerprint: "sha256:x".into(),
        }
    }

    fn event<'a>(caller: &'a Caller, reason: &'static str, message: &str) -> AuditEvent<'a> {
        AuditEvent {
            time: std::time::SystemTime::now(),
            caller: Some(caller),
            token_fingerprint: "sha256:x",
            cloud: Cloud::Azure,
            kind: Kind::AccessToken,
            surface: Surface::AzureImds,
            identity: Some("client-1"),
            via: None,
            account: None,
            via_account: None,
            source: None,
            scopes: CallerText::new(&[]),
            audience: None,
            lifetime: None,
            verdict: Verdict::Deny,
            reason: Some(reason),
            code: None,
            message: Some(message.into()),
            policies: &[],
            cache: None,
            upstream: None,
            credential: None,
            latency: Duration::ZERO,
        }
    }

    #[test]
    fn only_actionable_denials_are_explained() {
        let c = caller();
        let d = denial(&event(
            &c,
            "policy_denied",
            "Denied by Lanyard policy: x (policies: p1)",
        ))
        .expect("a policy denial is explained");
        assert_eq!(
            (d.namespace.as_str(), d.pod.as_str()),
            ("team-a", "ray-worker-0")
        );
        assert!(d.note.contains("client-1"), "{}", d.note);
        assert!(d.note.contains("p1"), "{}", d.note);
        assert!(denial(&event(&c, "upstream_rejected", "AADSTS70021: no match")).is_some());
        assert!(denial(&event(&c, "not_bound", "no binding")).is_some());
        for transient in [
            "expired",
            "unavailable",
            "upstream_throttled",
            "bad_request",
        ] {
            assert!(denial(&event(&c, transient, "x")).is_none(), "{transient}");
        }
        let mut allowed = event(&c, "policy_denied", "x");
        allowed.verdict = Verdict::Allow;
        assert!(denial(&allowed).is_none());
    }

    #[test]
    fn notes_fit_the_events_api() {
        let c = caller();
        let d = denial(&event(&c, "policy_denied", &"é".repeat(2000))).unwrap();
        assert!(d.note.len() <= MAX_NOTE);
    }

    #[test]
    fn the_bucket_limits_a_burst_then_refills() {
        let start = Instant::now();
        let mut b = Bucket::new(5.0, 10.0);
        let taken = (0..100).filter(|_| b.take(start)).count();
        assert_eq!(taken, 10, "the burst");
        assert!(!b.take(start + Duration::from_millis(100)), "half a token");
        assert!(b.take(start + Duration::from_millis(250)), "refilled");
    }
}
