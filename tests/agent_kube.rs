//! The agent against a (fake) Kubernetes API server, as a separate process
//! with only a kubeconfig: issuer discovery and keys through the API,
//! bindings from the ServiceAccount watch (changes take effect without a
//! restart), a ServiceAccount created a moment ago, tokens of deleted pods
//! refused, and nothing asked of the API beyond get/list/watch.
// Needs the `dev` feature (built-in issuer, emulators, `lanyard dev`).
#![cfg(feature = "dev")]

mod support;

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, PodSpec, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use lanyard_emulators::PodIdentity;
use lanyard_fake_kube::FakeKube;
use serde_json::{json, Value};
use support::*;

const NODE: &str = "node-a";
const KUBE_TOKEN: &str = "agent-kube-token";

fn service_account(pod: &PodIdentity, annotations: &[(&str, &str)]) -> ServiceAccount {
    ServiceAccount {
        metadata: ObjectMeta {
            namespace: Some(pod.namespace.clone()),
            name: Some(pod.service_account.clone()),
            uid: Some(pod.service_account_uid.clone()),
            annotations: Some(
                annotations
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<BTreeMap<_, _>>(),
            ),
            ..Default::default()
        },
        ..Default::default()
    }
}

fn pod_object(pod: &PodIdentity) -> Pod {
    Pod {
        metadata: ObjectMeta {
            namespace: Some(pod.namespace.clone()),
            name: Some(pod.pod_name.clone()),
            uid: Some(pod.pod_uid.clone()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(pod.node_name.clone()),
            service_account_name: Some(pod.service_account.clone()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

async fn ask(port: u16, token: &str) -> (u16, Value) {
    let resp = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{port}/v1/token"))
        .bearer_auth(token)
        .json(&json!({"cloud": "azure", "kind": "access_token", "scopes": ["https://storage.azure.com/"], "surface": "azure_imds"}))
        .send()
        .await;
    match resp {
        Ok(resp) => {
            let status = resp.status().as_u16();
            (status, resp.json().await.unwrap_or(Value::Null))
        }
        // Not listening yet (still starting).
        Err(_) => (0, Value::Null),
    }
}

/// Polls until `ask` answers `want`, for changes carried by the watch.
async fn eventually_status(port: u16, token: &str, want: u16) -> Value {
    for _ in 0..200 {
        let (status, body) = ask(port, token).await;
        if status == want {
            return body;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("never answered {want}");
}

/// The upstreams, a fake API server holding `pod` (bound to Azure) and its
/// ServiceAccount, and the agent's kubeconfig and config files.
struct Cluster {
    up: Upstreams,
    kube: Arc<FakeKube>,
    dir: tempfile::TempDir,
    _trigger: lanyard::http::ShutdownTrigger,
}

const BOUND: [(&str, &str); 1] = [("azure.workload.identity/client-id", CLIENT)];

async fn cluster(pod: &PodIdentity) -> Cluster {
    let up = upstreams(&pod.subject(), Duration::from_secs(3600)).await;
    let kube = FakeKube::new(up.issuer.url(), up.issuer.key().jwk(), KUBE_TOKEN);
    let (kube_url, trigger) = serve_router(kube.router(), "fake kube").await;
    kube.apply_service_account(service_account(pod, &BOUND));
    kube.apply_pod(pod_object(pod));
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("kubeconfig"), kube.kubeconfig(&kube_url)).unwrap();
    std::fs::write(
        dir.path().join("agent.yaml"),
        format!(
            "azure:\n  authority_host: {}\n  tenant_id: {TENANT}\n",
            up.entra_url
        ),
    )
    .unwrap();
    Cluster {
        up,
        kube,
        dir,
        _trigger: trigger,
    }
}

impl Cluster {
    /// Starts `lanyard agent` with only a kubeconfig, its API and admin
    /// endpoints on any free ports. It may not serve yet.
    fn spawn_agent(&self, extra: &[&str]) -> Proc {
        Proc::spawn(
            Command::new(env!("CARGO_BIN_EXE_lanyard"))
                .args([
                    "--config",
                    self.dir.path().join("agent.yaml").to_str().unwrap(),
                    "agent",
                ])
                .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
                .args(extra)
                .env("KUBECONFIG", self.dir.path().join("kubeconfig"))
                .env_remove("KUBERNETES_SERVICE_HOST")
                .env("RUST_LOG", "info"),
        )
    }

    /// [`Cluster::spawn_agent`], once it serves; returns it and its API port.
    async fn start_agent(&self, extra: &[&str]) -> (Proc, u16) {
        let mut agent = self.spawn_agent(extra);
        let api = agent.addr("lanyard agent serving", "api").await;
        (agent, api.port())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_follows_the_cluster() {
    let pod = PodIdentity::new("default", "ray-worker", "ray-worker-0", NODE);
    let c = cluster(&pod).await;
    let (up, kube) = (&c.up, &c.kube);
    let bound = BOUND;
    let (agent, port) = c.start_agent(&["--node-name", NODE]).await;
    let aud = ["api://AzureADTokenExchange"];
    let hour = Duration::from_secs(3600);
    let token = up.issuer.mint(&pod, &aud, hour).unwrap();
    // Issuer discovered and keys fetched through the API server.
    let body = eventually_status(port, &token, 200).await;
    assert_eq!(body["identity"]["id"], CLIENT);
    assert_eq!(body["credential"]["type"], "token");
    assert!(
        kube.requests("/openid/v1/jwks") >= 1,
        "keys came through the API"
    );

    // Annotation removed: refused without a restart, and the cached
    // credential is not served any more.
    kube.apply_service_account(service_account(&pod, &[]));
    let body = eventually_status(port, &token, 404).await;
    assert_eq!(body["error"]["kind"], "not_bound");

    // Annotation back: served again (a fresh exchange: the entry was dropped).
    kube.apply_service_account(service_account(&pod, &bound));
    eventually_status(port, &token, 200).await;
    assert_eq!(up.entra.stats.issued.load(Ordering::Relaxed), 2);

    // A ServiceAccount and pod created a moment ago work at once.
    let fresh = PodIdentity::new("default", "ray-worker-2", "ray-worker-2-0", NODE);
    kube.apply_service_account(service_account(&fresh, &bound));
    kube.apply_pod(pod_object(&fresh));
    let (status, _) = ask(port, &up.issuer.mint(&fresh, &aud, hour).unwrap()).await;
    // The emulator federates only the first pod's subject, so the exchange
    // itself is refused upstream; what matters is that the binding was found.
    assert_eq!(
        status, 403,
        "binding of a brand-new ServiceAccount resolved"
    );

    // The pod is deleted: its still-valid token stops working.
    kube.delete_pod("default", "ray-worker-0");
    let body = eventually_status(port, &token, 401).await;
    assert_eq!(body["error"]["code"], "pod_gone");

    // The ServiceAccount is deleted: no binding.
    let other = PodIdentity::new("default", "ray-worker-2", "ray-worker-2-1", NODE);
    kube.apply_pod(pod_object(&other));
    kube.delete_service_account("default", "ray-worker-2");
    let body = eventually_status(port, &up.issuer.mint(&other, &aud, hour).unwrap(), 404).await;
    assert_eq!(body["error"]["kind"], "not_bound");

    assert_eq!(
        kube.stats.forbidden.load(Ordering::Relaxed),
        0,
        "least privilege suffices"
    );
    assert!(
        kube.requests("/api/v1/serviceaccounts") >= 2,
        "list and watch"
    );
    let log = agent.stop();
    assert!(log.contains("bindings changed"), "{log}");
    assert!(!log.contains("eyJ"), "no JWT in the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_ready_until_the_first_lists_arrive() {
    let pod = PodIdentity::new("default", "ray-worker", "ray-worker-0", NODE);
    let c = cluster(&pod).await;
    c.kube.hold_lists(true);
    let mut agent = c.spawn_agent(&["--node-name", NODE]);
    let readyz = format!("http://{}/readyz", agent.listening("admin endpoints").await);

    // The admin port answers while the ServiceAccount and pod lists are
    // held, and says what it waits for; the API does not listen yet.
    let body = eventually_answers(&readyz, 503).await;
    assert!(body.contains("ServiceAccount list synced"), "{body}");
    assert!(body.contains("pod list synced"), "{body}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        get_status(&readyz).await.map(|(s, _)| s),
        Some(503),
        "still held"
    );
    let token =
        c.up.issuer
            .mint(
                &pod,
                &["api://AzureADTokenExchange"],
                Duration::from_secs(3600),
            )
            .unwrap();
    assert_eq!(
        agent.reported("listening for the agent API", "addr"),
        None,
        "no API before ready"
    );

    // Lists released: ready, and serving.
    c.kube.hold_lists(false);
    assert_eq!(eventually_answers(&readyz, 200).await, "ready");
    let port = agent.addr("lanyard agent serving", "api").await.port();
    let (status, body) = ask(port, &token).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_review_on_first_sight() {
    let pod = PodIdentity::new("default", "ray-worker", "ray-worker-0", NODE);
    let c = cluster(&pod).await;
    let (up, kube) = (&c.up, &c.kube);
    let (_agent, port) = c
        .start_agent(&["--token-review", "--node-name", NODE])
        .await;
    let aud = ["api://AzureADTokenExchange"];
    let token = up
        .issuer
        .mint(&pod, &aud, Duration::from_secs(3600))
        .unwrap();
    eventually_status(port, &token, 200).await;
    let reviews = kube.stats.token_reviews.load(Ordering::Relaxed);
    assert_eq!(reviews, 1);
    let (status, _) = ask(port, &token).await;
    assert_eq!(status, 200);
    assert_eq!(
        kube.stats.token_reviews.load(Ordering::Relaxed),
        reviews,
        "reviewed once"
    );

    // A signed token for a pod the API server does not know: TokenReview
    // says no before anything else is looked at.
    let ghost = PodIdentity::new("default", "ray-worker", "ghost-0", NODE);
    let (status, body) = ask(
        port,
        &up.issuer
            .mint(&ghost, &aud, Duration::from_secs(3600))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 401);
    assert_eq!(body["error"]["code"], "token_review");

    // The worker processes of one pod starting together, with the pod's
    // new token: one TokenReview for all of them, not one each.
    let before = kube.stats.token_reviews.load(Ordering::Relaxed);
    let token = up
        .issuer
        .mint(&pod, &aud, Duration::from_secs(3600))
        .unwrap();
    let answers = futures::future::join_all((0..40).map(|_| ask(port, &token))).await;
    for (status, body) in &answers {
        assert_eq!(*status, 200, "{body}");
    }
    assert_eq!(
        kube.stats.token_reviews.load(Ordering::Relaxed),
        before + 1,
        "reviewed once for all of them"
    );
}

fn namespace(name: &str, labels: &[(&str, &str)]) -> k8s_openapi::api::core::v1::Namespace {
    k8s_openapi::api::core::v1::Namespace {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Events stored by the fake API server about `pod` with `reason`.
fn events_on(kube: &FakeKube, pod: &str, reason: &str) -> Vec<Value> {
    kube.events()
        .into_iter()
        .filter(|e| e["regarding"]["name"] == pod && e["reason"] == reason)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_follows_namespace_labels_and_denials_are_explained_on_the_pod() {
    let pod = PodIdentity::new("team-a", "ray-worker", "ray-worker-0", NODE);
    let c = cluster(&pod).await;
    let (up, kube) = (&c.up, &c.kube);
    kube.apply_namespace(namespace("team-a", &[("team", "a")]));
    let policies = c.dir.path().join("policies");
    std::fs::create_dir(&policies).unwrap();
    std::fs::write(
        policies.join("team.cedar"),
        r#"@id("team-a-only")
permit (principal, action, resource)
when { principal.namespace.hasTag("team") && principal.namespace.getTag("team") == "a" };
"#,
    )
    .unwrap();
    let config = c.dir.path().join("agent.yaml");
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str(&format!(
        "policy:\n  dir: {}\n  reload_seconds: 1\n",
        policies.display()
    ));
    std::fs::write(&config, text).unwrap();

    let (agent, port) = c.start_agent(&["--node-name", NODE]).await;
    let token = up
        .issuer
        .mint(
            &pod,
            &["api://AzureADTokenExchange"],
            Duration::from_secs(3600),
        )
        .unwrap();
    // The namespace's labels come from the namespace watch.
    eventually_status(port, &token, 200).await;
    assert!(
        kube.requests("/api/v1/namespaces") >= 1,
        "namespaces watched"
    );

    // Relabelled: the cached credential is no longer served, and the pod
    // says why.
    kube.apply_namespace(namespace("team-a", &[("team", "b")]));
    let body = eventually_status(port, &token, 403).await;
    assert_eq!(body["error"]["kind"], "policy_denied", "{body}");
    let mut explained = Vec::new();
    for _ in 0..100 {
        explained = events_on(kube, "ray-worker-0", "CredentialDenied");
        if !explained.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(explained.len(), 1, "{:?}", kube.events());
    let event = &explained[0];
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["regarding"]["kind"], "Pod");
    assert_eq!(event["regarding"]["uid"], pod.pod_uid.as_str());
    assert_eq!(event["reportingController"], "lanyard.dev/agent");
    assert_eq!(event["reportingInstance"], NODE);
    let note = event["note"].as_str().unwrap();
    assert!(note.contains(CLIENT), "names the identity: {note}");
    assert!(note.contains("team-a/ray-worker"), "says who: {note}");

    // A crash-looping pod asking again and again adds no Event.
    for _ in 0..20 {
        assert_eq!(ask(port, &token).await.0, 403);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        kube.stats.events_created.load(Ordering::Relaxed),
        1,
        "deduplicated"
    );

    // Another denial of the same pod (its ServiceAccount now bound to
    // another identity) is explained in an Event of its own, with its own
    // note, not folded into the first one's series.
    const OTHER: &str = "99999999-9999-4999-8999-999999999999";
    kube.apply_service_account(service_account(
        &pod,
        &[("azure.workload.identity/client-id", OTHER)],
    ));
    for _ in 0..200 {
        let (status, body) = ask(port, &token).await;
        assert_eq!(status, 403, "{body}");
        if kube.stats.events_created.load(Ordering::Relaxed) == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let explained = events_on(kube, "ray-worker-0", "CredentialDenied");
    assert_eq!(explained.len(), 2, "{explained:?}");
    let notes: Vec<&str> = explained
        .iter()
        .map(|e| e["note"].as_str().unwrap())
        .collect();
    assert!(
        notes[0].contains(CLIENT) && !notes[0].contains(OTHER),
        "{notes:?}"
    );
    assert!(notes[1].contains(OTHER), "{notes:?}");
    assert_eq!(
        kube.stats.forbidden.load(Ordering::Relaxed),
        0,
        "least privilege suffices"
    );
    let log = agent.stop();
    assert!(log.contains("policy set loaded"), "{log}");
    assert!(!log.contains("eyJ"), "no JWT in the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_without_a_node_claim_is_kept_to_its_pods_node() {
    // Clusters before 1.30 issue tokens without a node claim: the pod's own
    // spec.nodeName must keep such a token to its node.
    let here = PodIdentity::new("default", "ray-worker", "ray-worker-0", NODE);
    let c = cluster(&here).await;
    let elsewhere = PodIdentity::new("default", "ray-worker", "ray-worker-9", "node-b");
    c.kube.apply_pod(pod_object(&elsewhere));
    let (agent, port) = c.start_agent(&["--node-name", NODE]).await;
    let aud = ["api://AzureADTokenExchange"];
    let hour = Duration::from_secs(3600);
    let without_node = |pod: &PodIdentity| {
        let mut claims = c.up.issuer.claims_for(pod, &aud, hour);
        claims.kubernetes.node = None;
        c.up.issuer.sign(&claims).unwrap()
    };
    // This node's pod: served.
    eventually_status(port, &without_node(&here), 200).await;
    // The other node's pod, whose token names no node: refused, never
    // exchanged.
    let issued = c.up.entra.stats.issued.load(Ordering::Relaxed);
    let (status, body) = ask(port, &without_node(&elsewhere)).await;
    assert_eq!(status, 401, "{body}");
    assert_eq!(body["error"]["code"], "other_node", "{body}");
    assert_eq!(c.up.entra.stats.issued.load(Ordering::Relaxed), issued);
    drop(agent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_of_a_deleted_and_recreated_service_account_is_refused() {
    let pod = PodIdentity::new("default", "ray-worker", "ray-worker-0", NODE);
    let c = cluster(&pod).await;
    let (agent, port) = c.start_agent(&["--node-name", NODE]).await;
    let token =
        c.up.issuer
            .mint(
                &pod,
                &["api://AzureADTokenExchange"],
                Duration::from_secs(3600),
            )
            .unwrap();
    eventually_status(port, &token, 200).await;
    // Deleted and created again under the same name (a new uid), with the
    // same binding: the old account's token gets nothing.
    let mut again = service_account(&pod, &BOUND);
    again.metadata.uid = Some("3c1e9b7a-0000-4000-8000-000000000001".into());
    assert!(c
        .kube
        .delete_service_account(&pod.namespace, &pod.service_account));
    c.kube.apply_service_account(again);
    let body = eventually_status(port, &token, 401).await;
    assert_eq!(body["error"]["code"], "service_account_replaced", "{body}");
    drop(agent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_rides_out_dropped_watches_expired_history_and_an_api_outage() {
    let pod = PodIdentity::new("default", "ray-worker", "ray-worker-0", NODE);
    let c = cluster(&pod).await;
    let (agent, port) = c.start_agent(&["--node-name", NODE]).await;
    let aud = ["api://AzureADTokenExchange"];
    let token =
        c.up.issuer
            .mint(&pod, &aud, Duration::from_secs(3600))
            .unwrap();
    eventually_status(port, &token, 200).await;

    // Watches end (a server timeout): the agent re-watches and still sees
    // changes.
    c.kube.end_watches();
    c.kube.apply_service_account(service_account(&pod, &[]));
    eventually_status(port, &token, 404).await;

    // History compacted and watches ended with 410 Expired: it relists.
    c.kube.expire_watches();
    c.kube.apply_service_account(service_account(&pod, &BOUND));
    eventually_status(port, &token, 200).await;

    // The API server is down: what the agent knows keeps serving, the
    // cached credential included, and nothing is exchanged again.
    let issued = c.up.entra.stats.issued.load(Ordering::Relaxed);
    c.kube.set_unavailable(true);
    for _ in 0..5 {
        let (status, body) = ask(port, &token).await;
        assert_eq!(status, 200, "{body}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(c.up.entra.stats.issued.load(Ordering::Relaxed), issued);

    // Back: changes made meanwhile reach the agent (the pod deleted).
    c.kube.delete_pod("default", "ray-worker-0");
    c.kube.set_unavailable(false);
    let body = eventually_status(port, &token, 401).await;
    assert_eq!(body["error"]["code"], "pod_gone");
    let log = agent.stop();
    assert!(!log.contains("panicked"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_rides_out_an_issuer_key_outage_and_picks_up_a_rotated_key() {
    let pod = PodIdentity::new("default", "ray-worker", "ray-worker-0", NODE);
    let c = cluster(&pod).await;
    let (agent, port) = c.start_agent(&["--node-name", NODE]).await;
    let aud = ["api://AzureADTokenExchange"];
    let hour = Duration::from_secs(3600);
    let mint = || c.up.issuer.mint(&pod, &aud, hour).unwrap();
    eventually_status(port, &mint(), 200).await;

    // The API server's discovery document and JWKS answer 503; the rest of
    // the API works. Tokens of the keys already fetched keep verifying
    // (each a new token, so none is answered from the verifier's memo),
    // past the refetch interval (10 s) since the agent fetched them.
    c.kube.set_keys_unavailable(true);
    for _ in 0..11 {
        let (status, body) = ask(port, &mint()).await;
        assert_eq!(status, 200, "{body}");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    // The cluster rotates its key during the outage: a token of the new key
    // makes the agent try to fetch the keys, which fails: it cannot be
    // checked yet, a retryable 503 and no verdict on the token.
    c.up.issuer
        .rotate(lanyard_emulators::SigningKey::generate_rs256().unwrap());
    c.kube.set_issuer_keys(c.up.issuer.jwks());
    let rotated = mint();
    let (status, body) = ask(port, &rotated).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["kind"], "unavailable", "{body}");

    // The keys are served again: within the refetch interval (10 s) the
    // agent fetches them and the new key's tokens verify.
    c.kube.set_keys_unavailable(false);
    let mut answered = None;
    for _ in 0..300 {
        let (status, body) = ask(port, &rotated).await;
        if status == 200 {
            answered = Some(body);
            break;
        }
        assert_eq!(status, 503, "only retryable answers meanwhile: {body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let body = answered.expect("the rotated key was never picked up");
    assert_eq!(body["identity"]["id"], CLIENT);
    let log = agent.stop();
    assert!(!log.contains("panicked"), "{log}");
    assert!(!log.contains(&rotated), "a token was written to the log");
}
