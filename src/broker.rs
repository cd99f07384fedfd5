//! The one decision pipeline.
//!
//! Every request, whatever its cloud, kind or surface, takes the same
//! steps in the same order:
//!
//! 1. **authenticate** — verify the caller's projected token for the
//!    cloud's audience (a pod-bound token, of a live pod, on this node);
//! 2. **bind** — the cloud identities its ServiceAccount's bindings give it
//!    (the default first);
//! 3. **select** — the one a selector in the request names ("not found"
//!    when it names none of them), or else the first the policy allows
//!    (the default when it allows none, so that the denial is the answer);
//! 4. **policy** — the [`Policy`] seam ([`crate::policy`]), once, before the cache;
//! 5. **cache** — a cached credential, or one singleflight exchange;
//! 6. **exchange** — the cloud's [`CloudExchanger`], only on a miss;
//! 7. **audit** — one [`AuditEvent`] to the [`AuditSink`], before the
//!    credential is returned.
//!
//! What differs per cloud lives behind [`CloudExchanger`]; the steps are
//! written once, generically over it. A decision's context is a local value
//! that each step adds to and that ends in the audit event. Errors are
//! classified once ([`ErrorClass`]) for the surfaces to render.
//!
//! Protocol surfaces talk to a [`TokenBroker`]: the in-process [`Broker`]
//! (`lanyard dev`, the agent, a standalone sidecar) or the sidecar's client
//! of the node agent ([`remote::RemoteBroker`]).

pub mod assemble;

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use crate::audit::{
    bounded, AuditEvent, AuditSink, CallerText, IssuedCredential, LogSink, Verdict,
};
use crate::cache::{Cache, CacheConfig, CacheOutcome, CacheScope, KeyRef, UpstreamCall};
use crate::cloud::{
    Cloud, CloudExchanger, Credential, Identity, Kind, PerCloud, RequestError, TokenRequest,
};
use crate::directory::{Attributes, Bindings, Directory, PodCheck};
use crate::secret::{fingerprint, ExposeSecret, SecretString};
use crate::telemetry::metrics::{Metrics, RequestLabel};
use crate::token::{Caller, Verifier, VerifyError};
use prometheus_client::metrics::counter::Counter;

pub use crate::policy::{AllowBound, Decision, Policy, PolicyInput};
pub use lanyard_agent_api::{remote, reuse, wire};
pub use lanyard_core::grant::{BrokerError, ErrorClass, Grant, TokenBroker};

/// Longest resource, scope or audience accepted: bounded keys keep the
/// cache's memory bounded whatever callers send.
pub const MAX_PARAM_LEN: usize = 1024;
/// Most scopes one request may name.
pub const MAX_SCOPES: usize = 32;

/// The parts of the pipeline that do not depend on the cloud.
struct Core {
    verifier: Verifier,
    directory: Arc<dyn Directory>,
    cache: Cache,
    metrics: Arc<Metrics>,
    policy: Arc<dyn Policy>,
    audit: Arc<dyn AuditSink>,
    /// When set, tokens that name another node are refused.
    node_name: Option<String>,
    /// `decisions{decision="allow",reason="granted"}` per cloud, resolved
    /// once: the hit path counts without a label lookup.
    granted: PerCloud<Counter>,
}

/// The in-process broker: the agent's core.
pub struct Broker {
    core: Core,
    clouds: PerCloud<Option<Arc<dyn CloudPipeline>>>,
}

/// A decision's context: what each step learned, for the audit record.
struct Trail {
    caller: Option<Arc<Caller>>,
    /// The identity decided for, kept for a refusal's record (a grant
    /// carries its own).
    identity: Option<Identity>,
    policies: Vec<String>,
    cache: Option<CacheOutcome>,
    /// The caller's labels and annotations, fetched once per decision for
    /// the policy (which may decide several identities), when it wants them.
    attributes: Option<std::borrow::Cow<'static, Attributes>>,
    /// The upstream call this request waited on, if any.
    upstream: Option<Arc<UpstreamCall>>,
    /// The issued credential's fingerprint, as the cache computed it.
    fingerprint: Option<Arc<str>>,
}

impl Broker {
    /// A broker with no cloud enabled, a default cache, the default policy
    /// ([`AllowBound`]) and the log audit sink; add clouds with
    /// [`Broker::with_cloud`].
    pub fn new(verifier: Verifier, directory: Arc<dyn Directory>) -> Self {
        let metrics = Arc::new(Metrics::new());
        Broker {
            core: Core {
                granted: granted_counters(&metrics),
                verifier,
                directory,
                cache: Cache::new(CacheConfig::default(), metrics.clone()),
                metrics,
                policy: Arc::new(AllowBound),
                audit: Arc::new(LogSink),
                node_name: None,
            },
            clouds: PerCloud::from_fn(|_| None),
        }
    }

    /// Uses `cache` (and the metrics it reports to).
    pub fn with_cache(mut self, cache: Cache, metrics: Arc<Metrics>) -> Self {
        self.core.cache = cache;
        self.core.granted = granted_counters(&metrics);
        self.core.metrics = metrics;
        self
    }

    /// Refuses tokens whose node claim names another node.
    pub fn with_node_name(mut self, node: impl Into<String>) -> Self {
        self.core.node_name = Some(node.into());
        self
    }

    /// Decides with `policy` instead of [`AllowBound`].
    pub fn with_policy(mut self, policy: Arc<dyn Policy>) -> Self {
        self.core.policy = policy;
        self
    }

    /// Records decisions in `sink` instead of the log.
    pub fn with_audit(mut self, sink: Arc<dyn AuditSink>) -> Self {
        self.core.audit = sink;
        self
    }

    /// Enables (or replaces) the cloud `exchanger` serves.
    pub fn with_cloud<E: CloudExchanger>(mut self, exchanger: E) -> Self {
        let cloud = exchanger.cloud();
        self.clouds[cloud] = Some(Arc::new(exchanger));
        self
    }

    /// Whether `cloud` is enabled.
    pub fn serves(&self, cloud: Cloud) -> bool {
        self.clouds[cloud].is_some()
    }

    /// The metrics the broker and its cache report to, for the admin listener's
    /// `/metrics`.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.core.metrics
    }

    /// The credential cache, for inspecting what it holds (the tests check
    /// that a refusal left nothing cached).
    pub fn cache(&self) -> &Cache {
        &self.core.cache
    }
}

impl crate::cloud::Registry for Broker {
    fn register<E: CloudExchanger>(&mut self, exchanger: E) {
        let cloud = exchanger.cloud();
        self.clouds[cloud] = Some(Arc::new(exchanger));
    }
}

#[async_trait::async_trait]
impl TokenBroker for Broker {
    async fn request(
        &self,
        subject: &SecretString,
        request: &TokenRequest,
    ) -> Result<Grant, BrokerError> {
        let started = Instant::now();
        let Some(route) = &self.clouds[request.cloud] else {
            return Err(BrokerError::CloudDisabled(request.cloud));
        };
        let (trail, result) = route.decide(&self.core, subject, request).await;
        if request.kind == Kind::Identity {
            // A lookup, not a grant: nothing leaves, nothing to audit.
            return result;
        }
        self.core
            .finish(subject, request, trail, result, started)
            .await
    }
}

/// A cloud as the broker holds it: the pipeline, typed by the cloud's
/// binding, behind one object-safe method.
#[async_trait::async_trait]
trait CloudPipeline: Send + Sync {
    async fn decide(
        &self,
        core: &Core,
        subject: &SecretString,
        request: &TokenRequest,
    ) -> (Trail, Result<Grant, BrokerError>);
}

#[async_trait::async_trait]
impl<E: CloudExchanger> CloudPipeline for E {
    async fn decide(
        &self,
        core: &Core,
        subject: &SecretString,
        request: &TokenRequest,
    ) -> (Trail, Result<Grant, BrokerError>) {
        core.decide(self, subject, request).await
    }
}

impl Core {
    /// Steps 1–6 for `request` through `cloud`.
    // INVARIANT: the order is authenticate → bind → select → policy → cache
    // (→ exchange). Policy comes after selection, so it decides the identity
    // the caller will actually get, and before the cache, so cache hits are
    // decided too.
    async fn decide<E: CloudExchanger>(
        &self,
        cloud: &E,
        subject: &SecretString,
        request: &TokenRequest,
    ) -> (Trail, Result<Grant, BrokerError>) {
        let mut trail = Trail {
            caller: None,
            identity: None,
            attributes: None,
            policies: Vec::new(),
            cache: None,
            upstream: None,
            fingerprint: None,
        };
        let result = async {
            check_request(cloud, request)?;
            let caller = self.authenticate(subject, cloud.audience()).await?;
            let bindings = self.bindings(&caller).await;
            let caller = trail.caller.insert(caller).clone();
            let caller = &*caller;
            let bound = cloud
                .bind(&*bindings?, caller)
                .map_err(|e| refusal(e, request.cloud, caller))?;
            // INVARIANT: `bind` lists the default first and never returns
            // an empty list (it refuses with NotBound instead).
            let Some(default) = bound.first() else {
                return Err(refusal(RequestError::NotBound, request.cloud, caller));
            };
            // Several listed and none selected: the first the policy allows
            // (for a lookup, all it allows, which a listing shows).
            let allowed = match (&request.selector, bound.len()) {
                (None, 2..) => Some(
                    self.allowed(cloud, &bound, caller, request, &mut trail.attributes)
                        .await?,
                ),
                _ => None,
            };
            let chosen = match (&request.selector, &allowed) {
                (Some(selector), _) => bound.iter().find(|b| cloud.selects(b, selector)),
                (None, Some(allowed)) => Some(allowed.first().map_or(default, |&i| &bound[i])),
                (None, None) => Some(default),
            };
            let Some(binding) = chosen else {
                // A refusal names the default identity, as it always has.
                trail.identity = Some(cloud.identity(default));
                return Err(BrokerError::IdentityNotFound);
            };
            let identity = cloud.identity(binding);
            if request.kind == Kind::Identity {
                let listed = allowed.map(|allowed| {
                    allowed
                        .into_iter()
                        .map(|i| cloud.identity(&bound[i]))
                        .collect()
                });
                return Ok(Grant {
                    identity,
                    credential: None,
                    listed,
                });
            }
            match self
                .issue(
                    cloud, binding, &identity, caller, subject, request, &mut trail,
                )
                .await
            {
                Ok(credential) => Ok(Grant {
                    identity,
                    credential: Some(credential),
                    listed: None,
                }),
                Err(e) => {
                    // A grant names its identity; a refusal keeps it here.
                    trail.identity = Some(identity);
                    Err(e)
                }
            }
        }
        .await;
        (trail, result)
    }

    /// Which of a ServiceAccount's several identities of one cloud the
    /// policy allows the caller `request`, by their index in `bound`. A
    /// credential request stops at the first allowed (the one it gets,
    /// which `issue` then decides again, and audits); a lookup is decided
    /// as a credential of the cloud's first kind with no scopes and no
    /// lifetime (whether this caller may have that identity at all), for
    /// every one, since a listing shows them all.
    // INVARIANT: only a request that selects nothing comes here: a
    // selector names one identity, which the policy alone then decides.
    async fn allowed<E: CloudExchanger>(
        &self,
        cloud: &E,
        bound: &[E::Binding],
        caller: &Caller,
        request: &TokenRequest,
        attributes: &mut Option<std::borrow::Cow<'static, Attributes>>,
    ) -> Result<Vec<usize>, BrokerError> {
        let lookup = request.kind == Kind::Identity;
        let probe;
        let asked = match lookup {
            true => {
                let kind = cloud.kinds().first().copied().unwrap_or(Kind::AccessToken);
                probe = TokenRequest::new(request.cloud, kind, request.surface);
                &probe
            }
            false => request,
        };
        let attributes = self.policy_attributes(caller, attributes).await?;
        let mut allowed = Vec::new();
        for (i, binding) in bound.iter().enumerate() {
            let identity = cloud.identity(binding);
            let input = PolicyInput {
                caller,
                identity: &identity,
                request: asked,
                attributes,
                lifetime: cloud.lifetime(binding, asked),
                time: SystemTime::now(),
            };
            if matches!(self.policy.decide(&input), Decision::Allow { .. }) {
                allowed.push(i);
                if !lookup {
                    break;
                }
            }
        }
        Ok(allowed)
    }

    /// Steps 4–6 for a bound, selected identity: policy, cache, exchange.
    #[allow(clippy::too_many_arguments)]
    async fn issue<E: CloudExchanger>(
        &self,
        cloud: &E,
        binding: &E::Binding,
        identity: &Identity,
        caller: &Caller,
        subject: &SecretString,
        request: &TokenRequest,
        trail: &mut Trail,
    ) -> Result<Arc<Credential>, BrokerError> {
        let scope = cloud
            .scope(binding, request)
            .map_err(|e| refusal(e, request.cloud, caller))?;
        let attributes = self
            .policy_attributes(caller, &mut trail.attributes)
            .await?;
        let input = PolicyInput {
            caller,
            identity,
            request,
            attributes,
            lifetime: cloud.lifetime(binding, request),
            time: SystemTime::now(),
        };
        match self.policy.decide(&input) {
            Decision::Allow { policies } => trail.policies = policies,
            Decision::Deny { reason, policies } => {
                trail.policies = policies.clone();
                return Err(BrokerError::Denied { reason, policies });
            }
        }
        let key = self.cache_key(identity, &scope, caller);
        let traced = self
            .cache
            .get_traced(key, subject, caller.token_expires_at, || {
                cloud.fetcher(binding, request, caller)
            })
            .await;
        trail.cache = Some(traced.outcome);
        trail.upstream = traced.upstream;
        let served = traced.result?;
        trail.fingerprint = Some(served.fingerprint);
        Ok(served.credential)
    }

    /// Step 7: the audit record, then the answer.
    // INVARIANT: a credential is returned only after the sink accepted its
    // record; when the sink fails, the caller gets a retryable error.
    async fn finish(
        &self,
        subject: &SecretString,
        request: &TokenRequest,
        trail: Trail,
        result: Result<Grant, BrokerError>,
        started: Instant,
    ) -> Result<Grant, BrokerError> {
        let unnamed;
        let token_fingerprint = match &trail.caller {
            Some(c) => c.token_fingerprint.as_str(),
            None => {
                unnamed = fingerprint(subject.expose_secret());
                unnamed.as_str()
            }
        };
        let (verdict, reason, code, message, credential) = match &result {
            Ok(grant) => (
                Verdict::Allow,
                None,
                None,
                None,
                grant
                    .credential
                    .as_ref()
                    .zip(trail.fingerprint.as_ref())
                    .map(|(c, fingerprint)| IssuedCredential {
                        fingerprint: fingerprint.clone(),
                        expires_at: c.expires_at(),
                    }),
            ),
            Err(e) => (
                Verdict::Deny,
                Some(e.reason()),
                e.code(),
                Some(bounded(&e.describe()).into_owned()),
                None,
            ),
        };
        let decided = match &result {
            Ok(grant) => Some(&grant.identity),
            Err(_) => trail.identity.as_ref(),
        };
        let via = decided.and_then(|i| i.via.as_ref());
        let event = AuditEvent {
            time: SystemTime::now(),
            caller: trail.caller.as_deref(),
            token_fingerprint,
            cloud: request.cloud,
            kind: request.kind,
            surface: request.surface,
            identity: decided.map(|i| i.id.as_str()),
            via: via.map(|v| v.id.as_str()),
            // A chained identity's record names both hops' accounts.
            account: via.and(decided).map(|i| i.account.as_str()),
            via_account: via.map(|v| v.account.as_str()),
            // Absent for the usual federation, as records always were.
            source: decided
                .filter(|i| i.source != crate::cloud::Source::Federation)
                .map(|i| i.source.as_str()),
            scopes: CallerText::new(&request.scopes),
            audience: request.audience.as_ref().map(CallerText::one),
            lifetime: request.lifetime,
            verdict,
            reason,
            code,
            message,
            policies: &trail.policies,
            cache: trail.cache,
            upstream: trail.upstream.as_deref(),
            credential,
            latency: started.elapsed(),
        };
        let result = match self.audit.record(&event).await {
            Ok(()) => result,
            Err(e) => {
                tracing::error!(error = %e, "audit record not written; refusing to issue");
                result.and(Err(BrokerError::Unavailable(
                    "the audit record could not be written".into(),
                )))
            }
        };
        // Counted as answered: a grant whose record failed is a refusal.
        match &result {
            Ok(_) => self.granted[request.cloud].inc(),
            Err(e) => self
                .metrics
                .decisions
                .get_or_create(&RequestLabel {
                    cloud: request.cloud.name(),
                    decision: Verdict::Deny.name(),
                    reason: e.reason(),
                })
                .inc(),
        };
        result
    }

    /// Verifies the caller's token for `audience`: a projected, pod-bound
    /// token of a pod that still exists, on this node.
    async fn authenticate(
        &self,
        subject: &SecretString,
        audience: &str,
    ) -> Result<Arc<Caller>, BrokerError> {
        let caller = self
            .verifier
            .verify(subject.expose_secret(), audience)
            .await?;
        // Only projected, pod-bound tokens: a legacy secret token outlives
        // its pod forever and proves nothing about where it is used.
        let Some(pod) = &caller.pod else {
            return Err(VerifyError::NotPodBound.into());
        };
        if let (Some(this), Some(node)) = (&self.node_name, &caller.node) {
            if &node.name != this {
                return Err(VerifyError::OtherNode {
                    token_node: node.name.clone(),
                    this_node: this.clone(),
                }
                .into());
            }
        }
        let check = self
            .directory
            .pod_check(&caller.namespace, &pod.name, &pod.uid)
            .await
            .map_err(|e| BrokerError::Unavailable(e.to_string()))?;
        match check {
            PodCheck::Gone => Err(VerifyError::PodGone.into()),
            // INVARIANT: where the token names no node, the pod's own
            // spec.nodeName is what keeps the token to its node.
            PodCheck::Elsewhere(node) => Err(VerifyError::OtherNode {
                token_node: node,
                this_node: self.node_name.clone().unwrap_or_default(),
            }
            .into()),
            PodCheck::Here | PodCheck::Unknown => Ok(caller),
        }
    }

    /// The caller's ServiceAccount's bindings (none when it is unknown).
    async fn bindings(&self, caller: &Caller) -> Result<Arc<Bindings>, BrokerError> {
        let live = self
            .directory
            .service_account_uid(&caller.namespace, &caller.service_account)
            .await
            .map_err(|e| BrokerError::Unavailable(e.to_string()))?;
        if live.is_some_and(|uid| uid != caller.service_account_uid) {
            return Err(VerifyError::ServiceAccountReplaced.into());
        }
        Ok(self
            .directory
            .lookup(&caller.namespace, &caller.service_account)
            .await
            .map_err(|e| BrokerError::Unavailable(e.to_string()))?
            .unwrap_or_else(Bindings::none))
    }

    /// What the policy is given of the caller's labels and annotations:
    /// nothing, without asking the directory, when it looks at none; kept
    /// in `fetched` so that a decision asks the directory once.
    async fn policy_attributes<'s>(
        &self,
        caller: &Caller,
        fetched: &'s mut Option<std::borrow::Cow<'static, Attributes>>,
    ) -> Result<&'s Attributes, BrokerError> {
        let attributes = match fetched.take() {
            Some(attributes) => attributes,
            None if self.policy.wants_attributes() => {
                std::borrow::Cow::Owned(self.attributes(caller).await?)
            }
            None => std::borrow::Cow::Borrowed(Attributes::empty()),
        };
        Ok(fetched.insert(attributes))
    }

    /// The labels and annotations a policy may look at.
    async fn attributes(&self, caller: &Caller) -> Result<Attributes, BrokerError> {
        let pod = caller.pod.as_ref().map_or("", |p| p.name.as_str());
        self.directory
            .attributes(&caller.namespace, &caller.service_account, pod)
            .await
            .map_err(|e| BrokerError::Unavailable(e.to_string()))
    }

    /// The cache key for `caller` asking `identity` for `scope`, borrowed.
    fn cache_key<'a>(
        &self,
        identity: &'a Identity,
        scope: &'a str,
        caller: &'a Caller,
    ) -> KeyRef<'a> {
        KeyRef {
            cloud: identity.cloud,
            account: &identity.account,
            identity: &identity.id,
            scope,
            namespace: &caller.namespace,
            service_account: &caller.service_account,
            pod_uid: match self.cache.scope() {
                CacheScope::Pod => caller.pod.as_ref().map(|p| p.uid.as_str()),
                CacheScope::ServiceAccount => None,
            },
        }
    }
}

/// The `decisions` counter of granted requests, per cloud.
fn granted_counters(metrics: &Metrics) -> PerCloud<Counter> {
    PerCloud::from_fn(|cloud| {
        metrics
            .decisions
            .get_or_create(&RequestLabel {
                cloud: cloud.name(),
                decision: Verdict::Allow.name(),
                reason: "granted",
            })
            .clone()
    })
}

/// Bounds on caller-supplied text and kinds the cloud answers, checked
/// before anything else so that nothing unbounded reaches a log, the cache
/// or an upstream.
fn check_request<E: CloudExchanger>(cloud: &E, request: &TokenRequest) -> Result<(), BrokerError> {
    if request.kind != Kind::Identity && !cloud.kinds().contains(&request.kind) {
        return Err(BrokerError::BadRequest(format!(
            "{} does not issue {}",
            request.cloud,
            request.kind.name()
        )));
    }
    if request.scopes.len() > MAX_SCOPES {
        return Err(BrokerError::BadRequest(format!(
            "at most {MAX_SCOPES} scopes may be requested"
        )));
    }
    let texts = request
        .scopes
        .iter()
        .map(|s| ("scope", s.as_str()))
        .chain(request.audience.as_deref().map(|a| ("audience", a)))
        .chain(
            request
                .selector
                .as_ref()
                .map(|s| ("identity selector", s.value())),
        );
    for (what, value) in texts {
        if value.len() > MAX_PARAM_LEN {
            return Err(BrokerError::BadRequest(format!(
                "{what} is longer than {MAX_PARAM_LEN} characters"
            )));
        }
    }
    Ok(())
}

/// A cloud's refusal of a request as the broker reports it.
fn refusal(error: RequestError, cloud: Cloud, caller: &Caller) -> BrokerError {
    match error {
        RequestError::NotBound => BrokerError::NotBound {
            cloud,
            namespace: caller.namespace.clone(),
            name: caller.service_account.clone(),
        },
        RequestError::BadRequest(message) => BrokerError::BadRequest(message),
    }
}

// The pipeline tests mint tokens with the built-in issuer.
#[cfg(test)]
mod tests;
