//! The pipeline's order and seams, with a test cloud behind the
//! [`CloudExchanger`] trait and a live built-in issuer on loopback.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use super::*;
use crate::audit::AuditError;
use crate::cloud::{fetcher, now_unix, AccessToken, Fetcher, Selector, Surface};
use crate::directory::file::{ServiceAccountEntry, StaticDirectory};
use crate::http::{bind, spawn_server, Shutdown, ShutdownTrigger};
use crate::token::{KeySet, KeySource};
use lanyard_emulators::{Issuer, PodIdentity, SigningKey};

const AUD: &str = "test-audience";

/// A cloud that binds every ServiceAccount to `id-<sa>` and counts its
/// exchanges.
struct TestCloud {
    exchanges: Arc<AtomicU32>,
}

impl CloudExchanger for TestCloud {
    type Binding = String;

    fn cloud(&self) -> Cloud {
        Cloud::Azure
    }
    fn audience(&self) -> &str {
        AUD
    }
    fn kinds(&self) -> &'static [Kind] {
        &[Kind::AccessToken]
    }
    /// The default is `id-SA`; further listed identities keep their
    /// client ids.
    fn bind(&self, bindings: &Bindings, caller: &Caller) -> Result<Vec<String>, RequestError> {
        if bindings.azure.is_empty() {
            return Err(RequestError::NotBound);
        }
        Ok(bindings
            .azure
            .iter()
            .enumerate()
            .map(|(i, b)| match i {
                0 => format!("id-{}", caller.service_account),
                _ => b.client_id.clone(),
            })
            .collect())
    }
    fn identity(&self, id: &String) -> Identity {
        Identity {
            cloud: Cloud::Azure,
            id: id.clone(),
            account: "tenant".into(),
            account_number: None,
            source: crate::cloud::Source::Federation,
            via: None,
        }
    }
    fn selects(&self, id: &String, selector: &Selector) -> bool {
        matches!(selector, Selector::ClientId(c) if c == id)
    }
    fn scope(&self, _: &String, request: &TokenRequest) -> Result<String, RequestError> {
        Ok(request.scopes.join(" "))
    }
    fn fetcher(&self, id: &String, _: &TokenRequest, _: &Caller) -> Fetcher {
        let params = (self.exchanges.clone(), id.clone());
        fetcher(params, |p, _subject| async move {
            let n = p.0.fetch_add(1, Ordering::SeqCst) + 1;
            let now = now_unix();
            Ok(Credential::Token(AccessToken {
                rendered: Default::default(),
                token: SecretString::from(format!("credential-{}-{n}", p.1)),
                issued_at: now,
                expires_at: now + 3600,
            }))
        })
    }
}

/// Counts decisions; denies requests for the `https://management` scope
/// and identities whose id says `denied`.
#[derive(Default)]
struct CountingPolicy {
    calls: AtomicU32,
    seen: Mutex<Vec<(String, String)>>,
}

impl Policy for CountingPolicy {
    fn decide(&self, input: &PolicyInput<'_>) -> Decision {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.seen.lock().unwrap().push((
            input.caller.service_account.clone(),
            input.identity.id.clone(),
        ));
        if input.identity.id.contains("denied") {
            return Decision::Deny {
                reason: "not this identity".into(),
                policies: vec!["job-identities".into()],
            };
        }
        if input
            .request
            .scopes
            .iter()
            .any(|s| s.starts_with("https://management"))
        {
            Decision::Deny {
                reason: "no control-plane scopes".into(),
                policies: vec!["no-management".into()],
            }
        } else {
            Decision::Allow {
                policies: vec!["storage".into()],
            }
        }
    }
}

/// What a test checks of an event, copied out of it (events borrow from
/// the request).
#[derive(Debug, Clone)]
struct Seen {
    caller: Option<Caller>,
    token_fingerprint: String,
    surface: Surface,
    identity: Option<String>,
    scopes: Vec<String>,
    verdict: Verdict,
    reason: Option<&'static str>,
    policies: Vec<String>,
    cache: Option<CacheOutcome>,
    credential: Option<IssuedCredential>,
    /// The event as `{:?}` prints it, for leak checks.
    printed: String,
}

/// Keeps every event; fails on demand.
#[derive(Default)]
struct MemorySink {
    events: Mutex<Vec<Seen>>,
    fail: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl AuditSink for MemorySink {
    async fn record(&self, event: &AuditEvent<'_>) -> Result<(), AuditError> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(AuditError::Unavailable("disk full".into()));
        }
        self.events.lock().unwrap().push(Seen {
            caller: event.caller.cloned(),
            token_fingerprint: event.token_fingerprint.to_string(),
            surface: event.surface,
            identity: event.identity.map(str::to_string),
            scopes: event.scopes.iter().map(|s| s.into_owned()).collect(),
            verdict: event.verdict,
            reason: event.reason,
            policies: event.policies.to_vec(),
            cache: event.cache,
            credential: event.credential.clone(),
            printed: format!("{event:?}"),
        });
        Ok(())
    }

    async fn record_reload(&self, _: &crate::audit::PolicyReload) -> Result<(), AuditError> {
        Ok(())
    }
}

struct Fixture {
    broker: Broker,
    issuer: Arc<Issuer>,
    exchanges: Arc<AtomicU32>,
    policy: Arc<CountingPolicy>,
    sink: Arc<MemorySink>,
    _trigger: ShutdownTrigger,
}

async fn fixture() -> Fixture {
    let (trigger, shutdown) = Shutdown::new();
    let listener = bind("127.0.0.1:0".parse().unwrap(), "issuer")
        .await
        .unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let issuer = Arc::new(Issuer::new(
        url.clone(),
        SigningKey::generate_rs256().unwrap(),
    ));
    spawn_server(listener, issuer.router(), shutdown);
    let verifier = Verifier::new(
        url.clone(),
        KeySet::new(KeySource::Discovery { issuer: url }, crate::http::client()),
    );
    let bound = ServiceAccountEntry {
        labels: Default::default(),
        namespace: "ml".into(),
        name: "ray".into(),
        annotations: [(
            crate::cloud::azure::annotations::CLIENT_ID.to_string(),
            "ignored".to_string(),
        )]
        .into_iter()
        .collect(),
    };
    // Three identities each: the default (`id-SA`), then two listed.
    let listing = |name: &str| ServiceAccountEntry {
        labels: Default::default(),
        namespace: "ml".into(),
        name: name.into(),
        annotations: [
            (
                crate::cloud::azure::annotations::CLIENT_ID.to_string(),
                "ignored".to_string(),
            ),
            (
                crate::cloud::azure::annotations::CLIENT_IDS.to_string(),
                "job-b, denied-c job-b".to_string(),
            ),
        ]
        .into_iter()
        .collect(),
    };
    let exchanges = Arc::new(AtomicU32::new(0));
    let policy = Arc::new(CountingPolicy::default());
    let sink = Arc::new(MemorySink::default());
    let directory = StaticDirectory::new(&[bound, listing("jobs"), listing("denied-default")]);
    let broker = Broker::new(verifier, Arc::new(directory))
        .with_cloud(TestCloud {
            exchanges: exchanges.clone(),
        })
        .with_policy(policy.clone())
        .with_audit(sink.clone());
    Fixture {
        broker,
        issuer,
        exchanges,
        policy,
        sink,
        _trigger: trigger,
    }
}

impl Fixture {
    fn token(&self, sa: &str) -> SecretString {
        let pod = PodIdentity::new("ml", sa, &format!("{sa}-0"), "node-a");
        SecretString::from(
            self.issuer
                .mint(&pod, &[AUD], Duration::from_secs(3600))
                .unwrap(),
        )
    }

    fn events(&self) -> Vec<Seen> {
        self.sink.events.lock().unwrap().clone()
    }
}

fn storage() -> TokenRequest {
    TokenRequest::new(Cloud::Azure, Kind::AccessToken, Surface::AzureImds)
        .with_scopes(vec!["https://storage.azure.com/".into()])
}

#[tokio::test]
async fn policy_is_decided_once_per_request_cache_hits_included() {
    let f = fixture().await;
    let token = f.token("ray");
    for _ in 0..3 {
        let grant = f.broker.request(&token, &storage()).await.unwrap();
        assert_eq!(grant.identity.id, "id-ray");
    }
    assert_eq!(
        f.exchanges.load(Ordering::SeqCst),
        1,
        "one exchange, two hits"
    );
    assert_eq!(
        f.policy.calls.load(Ordering::SeqCst),
        3,
        "policy on every request"
    );
    assert_eq!(
        f.policy.seen.lock().unwrap()[0],
        ("ray".to_string(), "id-ray".to_string()),
        "policy sees the caller and the bound identity"
    );
    let events = f.events();
    assert_eq!(events.len(), 3, "one audit event per request");
    let outcomes: Vec<_> = events.iter().map(|e| e.cache).collect();
    assert_eq!(
        outcomes,
        [
            Some(CacheOutcome::Miss),
            Some(CacheOutcome::Hit),
            Some(CacheOutcome::Hit)
        ]
    );
    for e in &events {
        assert_eq!(e.verdict, Verdict::Allow);
        assert_eq!(e.policies, ["storage"]);
        assert_eq!(e.identity.as_deref(), Some("id-ray"));
        assert_eq!(e.caller.as_ref().unwrap().service_account, "ray");
        assert_eq!(e.token_fingerprint, fingerprint(token.expose_secret()));
        let credential = e.credential.as_ref().unwrap();
        assert!(credential.fingerprint.starts_with("sha256:"));
        assert!(credential.expires_at > now_unix());
        let printed = &e.printed;
        assert!(
            !printed.contains(token.expose_secret()),
            "no token in audit"
        );
        assert!(
            !printed.contains("credential-id-ray"),
            "no credential in audit"
        );
    }
}

#[tokio::test]
async fn a_denial_stops_before_the_cache_and_names_its_policies() {
    let f = fixture().await;
    let token = f.token("ray");
    let request = TokenRequest::new(Cloud::Azure, Kind::AccessToken, Surface::AppService)
        .with_scopes(vec!["https://management.azure.com/".into()]);
    let err = f.broker.request(&token, &request).await.unwrap_err();
    assert!(matches!(&err, BrokerError::Denied { policies, .. } if policies == &["no-management"]));
    assert_eq!(err.class(), ErrorClass::Forbidden);
    assert_eq!(f.exchanges.load(Ordering::SeqCst), 0, "no exchange");
    assert!(f.broker.cache().is_empty(), "nothing cached");
    let events = f.events();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].verdict, Verdict::Deny);
    assert_eq!(events[0].reason, Some("policy_denied"));
    assert_eq!(events[0].policies, ["no-management"]);
    assert_eq!(events[0].surface, Surface::AppService);
    assert_eq!(events[0].cache, None);
}

#[tokio::test]
async fn steps_refuse_in_order_before_policy() {
    let f = fixture().await;
    // Not bound: refused at bind, policy never asked.
    let err = f
        .broker
        .request(&f.token("other"), &storage())
        .await
        .unwrap_err();
    assert!(matches!(err, BrokerError::NotBound { .. }), "{err:?}");
    // Another identity named: refused at select.
    let request = storage().with_selector(Some(Selector::ClientId("id-someone-else".into())));
    let err = f
        .broker
        .request(&f.token("ray"), &request)
        .await
        .unwrap_err();
    assert!(matches!(err, BrokerError::IdentityNotFound), "{err:?}");
    // A token for another audience: refused at authenticate.
    let pod = PodIdentity::new("ml", "ray", "ray-0", "node-a");
    let wrong = SecretString::from(
        f.issuer
            .mint(&pod, &["other"], Duration::from_secs(600))
            .unwrap(),
    );
    let err = f.broker.request(&wrong, &storage()).await.unwrap_err();
    assert!(matches!(err, BrokerError::Unauthenticated(_)), "{err:?}");
    assert_eq!(f.policy.calls.load(Ordering::SeqCst), 0);
    let events = f.events();
    assert_eq!(events.len(), 3, "refusals are audited too");
    assert!(
        events[2].caller.is_none(),
        "an unauthenticated caller names no one"
    );
    assert_eq!(
        events[2].token_fingerprint,
        fingerprint(wrong.expose_secret())
    );
}

#[tokio::test]
async fn lookups_and_unsupported_kinds() {
    let f = fixture().await;
    let lookup = TokenRequest::new(Cloud::Azure, Kind::Identity, Surface::AzureImds);
    let grant = f.broker.request(&f.token("ray"), &lookup).await.unwrap();
    assert_eq!(grant.identity.id, "id-ray");
    assert!(grant.credential.is_none());
    assert!(
        f.events().is_empty(),
        "a lookup is not a grant: no audit record"
    );
    let id = TokenRequest::new(Cloud::Azure, Kind::IdToken, Surface::Gce);
    let err = f.broker.request(&f.token("ray"), &id).await.unwrap_err();
    assert_eq!(err.class(), ErrorClass::BadRequest);
    let aws = TokenRequest::new(Cloud::Aws, Kind::AwsCredentials, Surface::AwsImds);
    let err = f.broker.request(&f.token("ray"), &aws).await.unwrap_err();
    assert!(matches!(err, BrokerError::CloudDisabled(Cloud::Aws)));
}

#[tokio::test]
async fn a_selector_picks_among_listed_identities_and_policy_decides_each() {
    let f = fixture().await;
    let token = f.token("jobs");
    let select = |id: &str| storage().with_selector(Some(Selector::ClientId(id.into())));
    // None selected: the default, which the policy allows.
    let grant = f.broker.request(&token, &storage()).await.unwrap();
    assert_eq!(grant.identity.id, "id-jobs");
    // The SDK's selector picks a listed one (listed twice, kept once).
    let grant = f.broker.request(&token, &select("job-b")).await.unwrap();
    assert_eq!(grant.identity.id, "job-b");
    // A listed one the policy denies: a denial naming the policy.
    let err = f
        .broker
        .request(&token, &select("denied-c"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, BrokerError::Denied { policies, .. } if policies == &["job-identities"])
    );
    // An unlisted one: not found, as before there were lists.
    let err = f
        .broker
        .request(&token, &select("job-z"))
        .await
        .unwrap_err();
    assert!(matches!(err, BrokerError::IdentityNotFound));
    let events = f.events();
    let named: Vec<_> = events.iter().map(|e| e.identity.as_deref()).collect();
    assert_eq!(
        named,
        [
            Some("id-jobs"),
            Some("job-b"),
            Some("denied-c"),
            Some("id-jobs")
        ],
        "each record names the identity decided (a miss, the default)"
    );
    assert_eq!(events[2].verdict, Verdict::Deny);
    assert_eq!(events[3].reason, Some("identity_not_found"));
    // Each identity has its own credential.
    assert_eq!(f.exchanges.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn selecting_nothing_gets_the_first_identity_the_policy_allows() {
    let f = fixture().await;
    let token = f.token("denied-default");
    let grant = f.broker.request(&token, &storage()).await.unwrap();
    assert_eq!(
        grant.identity.id, "job-b",
        "the default is denied, job-b is next"
    );
    let events = f.events();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].identity.as_deref(), Some("job-b"));
    // Where the policy allows none, the default's denial is the answer.
    let management = TokenRequest::new(Cloud::Azure, Kind::AccessToken, Surface::AzureImds)
        .with_scopes(vec!["https://management.azure.com/".into()]);
    let err = f.broker.request(&token, &management).await.unwrap_err();
    assert!(
        matches!(&err, BrokerError::Denied { policies, .. } if policies == &["job-identities"])
    );
    assert_eq!(f.events()[1].identity.as_deref(), Some("id-denied-default"));
}

#[tokio::test]
async fn a_lookup_lists_the_identities_the_policy_allows() {
    let f = fixture().await;
    let lookup = TokenRequest::new(Cloud::Azure, Kind::Identity, Surface::Gce);
    let ids = |grant: &Grant| {
        grant
            .listed()
            .iter()
            .map(|i| i.id.clone())
            .collect::<Vec<_>>()
    };
    let grant = f.broker.request(&f.token("jobs"), &lookup).await.unwrap();
    assert_eq!(grant.identity.id, "id-jobs");
    assert_eq!(ids(&grant), ["id-jobs", "job-b"]);
    let grant = f
        .broker
        .request(&f.token("denied-default"), &lookup)
        .await
        .unwrap();
    assert_eq!(grant.identity.id, "job-b", "what selecting nothing gets");
    assert_eq!(ids(&grant), ["job-b"]);
    // One identity: listed as it is, undecided (asking for it meets the
    // policy's answer).
    let grant = f.broker.request(&f.token("ray"), &lookup).await.unwrap();
    assert!(grant.listed.is_none());
    assert_eq!(ids(&grant), ["id-ray"]);
    assert!(f.events().is_empty(), "lookups are not audited");
}

#[tokio::test]
async fn caller_text_is_bounded_before_anything_else() {
    let f = fixture().await;
    let huge = TokenRequest::new(Cloud::Azure, Kind::AccessToken, Surface::AzureImds)
        .with_scopes(vec!["r".repeat(60_000)]);
    let err = f.broker.request(&f.token("ray"), &huge).await.unwrap_err();
    assert_eq!(err.class(), ErrorClass::BadRequest);
    let events = f.events();
    assert!(
        events[0].scopes[0].len() < 400,
        "audit keeps a bounded copy"
    );
    let many = storage().with_scopes(vec!["s".into(); MAX_SCOPES + 1]);
    assert_eq!(
        f.broker
            .request(&f.token("ray"), &many)
            .await
            .unwrap_err()
            .class(),
        ErrorClass::BadRequest
    );
}

#[tokio::test]
async fn no_credential_leaves_without_its_record() {
    let f = fixture().await;
    f.sink.fail.store(true, Ordering::SeqCst);
    let err = f
        .broker
        .request(&f.token("ray"), &storage())
        .await
        .unwrap_err();
    assert_eq!(
        err.class(),
        ErrorClass::Unavailable,
        "retryable, not a credential"
    );
    f.sink.fail.store(false, Ordering::SeqCst);
    assert!(f.broker.request(&f.token("ray"), &storage()).await.is_ok());
}

#[tokio::test]
async fn cache_keys_follow_the_configured_scope() {
    let f = fixture().await;
    let caller = Caller {
        namespace: "ml".into(),
        service_account: "ray".into(),
        service_account_uid: "sa-uid".into(),
        pod: Some(crate::token::ObjectRef {
            name: "ray-7".into(),
            uid: "pod-uid-7".into(),
        }),
        node: None,
        token_expires_at: 0,
        token_fingerprint: "sha256:x".into(),
    };
    let identity = TestCloud {
        exchanges: Default::default(),
    }
    .identity(&"id-ray".to_string());
    let key = f.broker.core.cache_key(&identity, "s", &caller);
    assert_eq!(key.pod_uid, None);
    assert_eq!((key.namespace, key.service_account), ("ml", "ray"));
    let metrics = Arc::new(Metrics::new());
    let per_pod = Cache::new(
        CacheConfig {
            scope: CacheScope::Pod,
            ..Default::default()
        },
        metrics.clone(),
    );
    let broker = fixture().await.broker.with_cache(per_pod, metrics);
    let key = broker.core.cache_key(&identity, "s", &caller);
    assert_eq!(key.pod_uid, Some("pod-uid-7"));
}
