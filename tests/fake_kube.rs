//! The fake Kubernetes API server driven by the real clients: kube-rs
//! (`Api`, `watcher`, `reflector`) and kubectl, plus TokenReview and the
//! wire shapes a client depends on. If a client would misbehave against a
//! real API server in a way these tests cannot see, the fake is not
//! faithful enough; so the tests go through the clients, not around them.
// Needs the `dev` feature (built-in issuer, emulators, `lanyard dev`).
#![cfg(feature = "dev")]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, TokenReviewStatus};
use k8s_openapi::api::core::v1::{Pod, PodSpec, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client};
use lanyard::http::{bind, spawn_server, Shutdown, ShutdownTrigger};
use lanyard_emulators::{Issuer, PodIdentity, SigningKey};
use lanyard_fake_kube::{FakeKube, FAKE_USER};
use serde_json::Value;

const TOKEN: &str = "fake-kube-static-token-0123456789";
const ISSUER: &str = "https://issuer.lanyard.test";
const AUDIENCE: &str = "lanyard";

struct Env {
    fake: Arc<FakeKube>,
    issuer: Arc<Issuer>,
    url: String,
    _trigger: ShutdownTrigger,
}

async fn start() -> Env {
    let issuer = Arc::new(Issuer::new(ISSUER, SigningKey::generate_rs256().unwrap()));
    let fake = FakeKube::new(issuer.url(), issuer.key().jwk(), TOKEN);
    let listener = bind("127.0.0.1:0".parse().unwrap(), "fake kube-apiserver")
        .await
        .unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (trigger, shutdown) = Shutdown::new();
    spawn_server(listener, fake.router(), shutdown);
    Env {
        fake,
        issuer,
        url,
        _trigger: trigger,
    }
}

impl Env {
    async fn client(&self) -> Client {
        let kubeconfig = Kubeconfig::from_yaml(&self.fake.kubeconfig(&self.url)).unwrap();
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .unwrap();
        Client::try_from(config).unwrap()
    }

    /// A raw GET with the static token, for wire-level assertions.
    async fn get(&self, path: &str) -> reqwest::Response {
        reqwest::Client::new()
            .get(format!("{}{path}", self.url))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
    }
}

fn sa(namespace: &str, name: &str) -> ServiceAccount {
    ServiceAccount {
        metadata: ObjectMeta {
            namespace: Some(namespace.into()),
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        ..ServiceAccount::default()
    }
}

fn annotated(namespace: &str, name: &str, key: &str, value: &str) -> ServiceAccount {
    let mut sa = sa(namespace, name);
    sa.metadata.annotations = Some(BTreeMap::from([(key.to_string(), value.to_string())]));
    sa
}

fn pod(namespace: &str, name: &str, node: Option<&str>) -> Pod {
    Pod {
        metadata: ObjectMeta {
            namespace: Some(namespace.into()),
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: node.map(str::to_string),
            service_account_name: Some("default".into()),
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

/// Polls `check` until it holds, failing after `within`.
async fn eventually(what: &str, within: Duration, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {within:?} waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn names<K: kube::Resource>(objects: impl IntoIterator<Item = Arc<K>>) -> BTreeSet<String> {
    objects
        .into_iter()
        .map(|o| {
            format!(
                "{}/{}",
                o.meta().namespace.clone().unwrap_or_default(),
                o.meta().name.clone().unwrap_or_default()
            )
        })
        .collect()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// Runs a reflector over `api` and returns its store; the task ends with
/// the test's runtime.
fn reflect<K>(api: Api<K>, config: watcher::Config) -> reflector::Store<K>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let (reader, writer) = reflector::store();
    let stream = reflector::reflector(writer, watcher(api, config).default_backoff());
    tokio::spawn(stream.for_each(|_| async {}));
    reader
}

#[tokio::test]
async fn kube_rs_lists_and_gets() {
    let env = start().await;
    env.fake.apply_service_account(sa("default", "a"));
    env.fake.apply_service_account(annotated(
        "team-b",
        "b",
        "eks.amazonaws.com/role-arn",
        "arn:aws:iam::1:role/b",
    ));
    let client = env.client().await;

    let all: Api<ServiceAccount> = Api::all(client.clone());
    let list = all.list(&ListParams::default()).await.unwrap();
    assert_eq!(
        names(list.items.iter().cloned().map(Arc::new)),
        set(&["default/a", "team-b/b"])
    );
    assert_eq!(
        list.metadata.resource_version.as_deref(),
        Some(env.fake.resource_version().to_string().as_str())
    );

    let team_b: Api<ServiceAccount> = Api::namespaced(client.clone(), "team-b");
    let b = team_b.get("b").await.unwrap();
    assert_eq!(
        b.metadata.annotations.unwrap()["eks.amazonaws.com/role-arn"],
        "arn:aws:iam::1:role/b"
    );
    assert!(b.metadata.uid.is_some() && b.metadata.creation_timestamp.is_some());
    assert_eq!(
        team_b
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        1
    );

    match team_b.get("missing").await {
        Err(kube::Error::Api(status)) => {
            assert_eq!((status.code, status.reason.as_str()), (404, "NotFound"));
        }
        other => panic!("expected a 404 Status, got {other:?}"),
    }
    // get_opt is how controllers ask "does it exist"; it relies on the 404.
    assert!(team_b.get_opt("missing").await.unwrap().is_none());
    assert!(env.fake.stats.gets.load(Ordering::Relaxed) >= 3);
}

#[tokio::test]
async fn paginated_lists_are_consistent_snapshots() {
    let env = start().await;
    for name in ["a", "b", "c"] {
        env.fake.apply_service_account(sa("default", name));
    }
    let api: Api<ServiceAccount> = Api::all(env.client().await);
    let first = api.list(&ListParams::default().limit(2)).await.unwrap();
    assert_eq!(first.items.len(), 2);
    let token = first.metadata.continue_.clone().expect("a continue token");
    assert_eq!(first.metadata.remaining_item_count, Some(1));

    // Changes after the first page must not show in the second: the
    // continuation is served from the first page's revision.
    env.fake.delete_service_account("default", "c");
    env.fake.apply_service_account(sa("default", "d"));
    let second = api
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await
        .unwrap();
    assert_eq!(
        names(second.items.into_iter().map(Arc::new)),
        set(&["default/c"])
    );
    assert_eq!(
        second.metadata.resource_version,
        first.metadata.resource_version
    );
    assert!(second
        .metadata
        .continue_
        .as_deref()
        .unwrap_or_default()
        .is_empty());

    // Once that revision is compacted, the token is refused with 410.
    env.fake.compact();
    match api
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await
    {
        Err(kube::Error::Api(status)) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"))
        }
        other => panic!("expected 410 Expired, got {other:?}"),
    }
}

#[tokio::test]
async fn reflector_follows_apply_modify_and_delete() {
    let env = start().await;
    env.fake.apply_service_account(sa("default", "existing"));
    let store = reflect(
        Api::<ServiceAccount>::all(env.client().await),
        watcher::Config::default(),
    );
    tokio::time::timeout(Duration::from_secs(3), store.wait_until_ready())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(names(store.state()), set(&["default/existing"]));

    let key = ObjectRef::new("ray-worker").within("ml");
    env.fake.apply_service_account(sa("ml", "ray-worker"));
    eventually(
        "the reflector sees the new ServiceAccount",
        Duration::from_secs(2),
        || store.get(&key).is_some(),
    )
    .await;

    env.fake.apply_service_account(annotated(
        "ml",
        "ray-worker",
        "iam.gke.io/gcp-service-account",
        "rw@p.iam.gserviceaccount.com",
    ));
    eventually(
        "the reflector sees the annotation",
        Duration::from_secs(2),
        || {
            store
                .get(&key)
                .and_then(|sa| sa.metadata.annotations.clone())
                .is_some_and(|a| {
                    a.get("iam.gke.io/gcp-service-account").map(String::as_str)
                        == Some("rw@p.iam.gserviceaccount.com")
                })
        },
    )
    .await;

    assert!(env.fake.delete_service_account("ml", "ray-worker"));
    eventually(
        "the reflector drops the deleted ServiceAccount",
        Duration::from_secs(2),
        || store.get(&key).is_none(),
    )
    .await;
    assert_eq!(names(store.state()), set(&["default/existing"]));
    // One list, then watches: the changes came through the watch.
    assert_eq!(env.fake.stats.lists.load(Ordering::Relaxed), 1);
    assert!(env.fake.stats.watches.load(Ordering::Relaxed) >= 1);
    for line in env.fake.request_log() {
        println!("kube-rs reflector: {line}");
    }
}

#[tokio::test]
async fn pod_watcher_with_field_selector_sees_only_its_node() {
    let env = start().await;
    env.fake
        .apply_pod(pod("default", "early-a", Some("node-a")));
    env.fake
        .apply_pod(pod("default", "early-b", Some("node-b")));

    let seen = Arc::new(Mutex::new(BTreeSet::new()));
    let api: Api<Pod> = Api::all(env.client().await);
    let (store, writer) = reflector::store();
    let record = seen.clone();
    let stream = reflector::reflector(
        writer,
        watcher(
            api,
            watcher::Config::default().fields("spec.nodeName=node-a"),
        )
        .default_backoff(),
    )
    .touched_objects()
    .for_each(move |pod| {
        if let Ok(pod) = pod {
            let node = pod.spec.and_then(|s| s.node_name).unwrap_or_default();
            record.lock().unwrap().insert(node);
        }
        async {}
    });
    tokio::spawn(stream);
    tokio::time::timeout(Duration::from_secs(3), store.wait_until_ready())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(names(store.state()), set(&["default/early-a"]));

    env.fake.apply_pod(pod("default", "late-b", Some("node-b")));
    env.fake.apply_pod(pod("default", "late-a", Some("node-a")));
    // Created unscheduled, then bound to node-a: enters the selection.
    env.fake.apply_pod(pod("default", "bound-later", None));
    env.fake
        .apply_pod(pod("default", "bound-later", Some("node-a")));
    eventually("node-a's pods arrive", Duration::from_secs(2), || {
        names(store.state()) == set(&["default/early-a", "default/late-a", "default/bound-later"])
    })
    .await;

    env.fake.delete_pod("default", "late-a");
    env.fake.delete_pod("default", "late-b");
    eventually("the deleted pod leaves", Duration::from_secs(2), || {
        names(store.state()) == set(&["default/early-a", "default/bound-later"])
    })
    .await;
    assert_eq!(
        *seen.lock().unwrap(),
        set(&["node-a"]),
        "a pod of another node was seen"
    );
    let log = env.fake.request_log();
    assert!(
        log.iter()
            .all(|l| !l.contains("/api/v1/pods")
                || l.contains("fieldSelector=spec.nodeName%3Dnode-a")),
        "every pod request carries the selector: {log:#?}"
    );
}

#[tokio::test]
async fn watcher_relists_after_a_410_error_event() {
    let env = start().await;
    env.fake.apply_service_account(sa("default", "a"));
    let store = reflect(
        Api::<ServiceAccount>::all(env.client().await),
        watcher::Config::default(),
    );
    tokio::time::timeout(Duration::from_secs(3), store.wait_until_ready())
        .await
        .unwrap()
        .unwrap();
    eventually("the watch is open", Duration::from_secs(2), || {
        env.fake.stats.watches.load(Ordering::Relaxed) >= 1
    })
    .await;
    let lists = env.fake.stats.lists.load(Ordering::Relaxed);

    env.fake.expire_watches();
    env.fake.apply_service_account(sa("default", "b"));
    env.fake.delete_service_account("default", "a");
    eventually(
        "the reflector converges after the relist",
        Duration::from_secs(3),
        || {
            names(store.state()) == set(&["default/b"])
                && env.fake.stats.lists.load(Ordering::Relaxed) > lists
        },
    )
    .await;
}

#[tokio::test]
async fn rewatch_from_a_compacted_revision_gets_410_and_relists() {
    let env = start().await;
    env.fake.apply_service_account(sa("default", "a"));
    // Without bookmarks the watcher's revision stays at its last
    // ServiceAccount event while other resources move on: the case the
    // 410 exists for.
    let config = watcher::Config::default().disable_bookmarks();
    let store = reflect(Api::<ServiceAccount>::all(env.client().await), config);
    tokio::time::timeout(Duration::from_secs(3), store.wait_until_ready())
        .await
        .unwrap()
        .unwrap();
    eventually("the watch is open", Duration::from_secs(2), || {
        env.fake.stats.watches.load(Ordering::Relaxed) >= 1
    })
    .await;
    let lists = env.fake.stats.lists.load(Ordering::Relaxed);

    env.fake.apply_pod(pod("default", "p", Some("node-a")));
    env.fake.compact();
    env.fake.end_watches();
    env.fake.apply_service_account(sa("default", "b"));
    eventually(
        "the reflector relists and converges",
        Duration::from_secs(3),
        || {
            names(store.state()) == set(&["default/a", "default/b"])
                && env.fake.stats.lists.load(Ordering::Relaxed) > lists
        },
    )
    .await;
    // List, watch from 1, re-watch from 1 (answered 410), relist, watch on.
    let log = env.fake.request_log();
    let from_1: Vec<usize> = log
        .iter()
        .enumerate()
        .filter(|(_, l)| l.contains("watch=true") && l.contains("resourceVersion=1 "))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(from_1.len(), 2, "{log:#?}");
    assert!(
        log[from_1[1]..]
            .iter()
            .any(|l| l.contains("limit=500") && !l.contains("watch=true")),
        "no relist after the 410: {log:#?}"
    );
}

/// Reads NDJSON watch events until the stream ends or `stop` says so.
async fn read_events(
    mut resp: reqwest::Response,
    mut stop: impl FnMut(&[Value]) -> bool,
) -> Vec<Value> {
    let mut events = Vec::new();
    let mut buffer = Vec::new();
    while let Some(chunk) = resp.chunk().await.unwrap() {
        buffer.extend_from_slice(&chunk);
        while let Some(end) = buffer.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buffer.drain(..=end).collect();
            events.push(serde_json::from_slice(&line).unwrap());
        }
        if stop(&events) {
            break;
        }
    }
    events
}

#[tokio::test]
async fn wire_shapes_of_lists_and_watches() {
    let env = start().await;
    env.fake.apply_service_account(sa("default", "a"));
    env.fake.set_bookmark_interval(Duration::from_millis(100));

    let list: Value = env
        .get("/api/v1/namespaces/default/serviceaccounts")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(list["kind"], "ServiceAccountList");
    assert_eq!(list["apiVersion"], "v1");
    assert_eq!(list["metadata"]["resourceVersion"], "1");
    // As from kube-apiserver: list items carry no kind/apiVersion.
    assert!(list["items"][0].get("kind").is_none());
    assert_eq!(list["items"][0]["metadata"]["name"], "a");

    let one: Value = env
        .get("/api/v1/namespaces/default/serviceaccounts/a")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        (one["kind"].as_str(), one["apiVersion"].as_str()),
        (Some("ServiceAccount"), Some("v1"))
    );

    let watch = env
        .get("/api/v1/serviceaccounts?watch=true&resourceVersion=1&allowWatchBookmarks=true&timeoutSeconds=1")
        .await;
    assert_eq!(watch.status(), 200);
    let fake = env.fake.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        fake.apply_service_account(annotated("default", "a", "k", "v"));
        fake.delete_service_account("default", "a");
    });
    let started = std::time::Instant::now();
    let events = read_events(watch, |_| false).await;
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(900) && elapsed < Duration::from_secs(3),
        "timeoutSeconds=1 ended after {elapsed:?}"
    );
    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    let changes: Vec<&str> = types.iter().copied().filter(|t| *t != "BOOKMARK").collect();
    assert_eq!(changes, ["MODIFIED", "DELETED"], "events: {events:#?}");
    assert_eq!(
        events.iter().find(|e| e["type"] == "DELETED").unwrap()["object"]["metadata"]
            ["resourceVersion"],
        "3"
    );
    assert_eq!(
        events.iter().find(|e| e["type"] == "MODIFIED").unwrap()["object"]["kind"],
        "ServiceAccount"
    );
    let bookmark = events
        .iter()
        .rev()
        .find(|e| e["type"] == "BOOKMARK")
        .expect("a bookmark");
    assert_eq!(bookmark["object"]["kind"], "ServiceAccount");
    assert_eq!(bookmark["object"]["metadata"]["resourceVersion"], "3");

    // Without a resourceVersion: the current state as ADDED first.
    env.fake.apply_service_account(sa("default", "b"));
    let events = read_events(
        env.get("/api/v1/serviceaccounts?watch=1&timeoutSeconds=1")
            .await,
        |e| !e.is_empty(),
    )
    .await;
    assert_eq!(events[0]["type"], "ADDED");
    assert_eq!(events[0]["object"]["metadata"]["name"], "b");

    // Streaming lists: initial state, then the initial-events-end bookmark.
    let events = read_events(
        env.get("/api/v1/serviceaccounts?watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true&timeoutSeconds=1").await,
        |e| e.len() >= 2,
    )
    .await;
    assert_eq!(events[0]["type"], "ADDED");
    assert_eq!(events[1]["type"], "BOOKMARK");
    assert_eq!(
        events[1]["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
        "true"
    );

    // A compacted revision: HTTP 200 with one ERROR event carrying 410.
    env.fake.compact();
    let events = read_events(
        env.get("/api/v1/serviceaccounts?watch=true&resourceVersion=1")
            .await,
        |_| false,
    )
    .await;
    assert_eq!(events.len(), 1, "{events:#?}");
    assert_eq!(events[0]["type"], "ERROR");
    assert_eq!(events[0]["object"]["kind"], "Status");
    assert_eq!(events[0]["object"]["code"], 410);
    assert_eq!(events[0]["object"]["reason"], "Expired");
}

#[tokio::test]
async fn authentication_rbac_and_discovery() {
    let env = start().await;
    let http = reqwest::Client::new();
    for auth in [None, Some("wrong-token")] {
        let mut req = http.get(format!("{}/api/v1/serviceaccounts", env.url));
        if let Some(token) = auth {
            req = req.bearer_auth(token);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 401);
        let status: Value = resp.json().await.unwrap();
        assert_eq!(
            (
                status["kind"].as_str(),
                status["reason"].as_str(),
                status["code"].as_u64()
            ),
            (Some("Status"), Some("Unauthorized"), Some(401))
        );
    }
    let resp = http
        .get(format!("{}/openid/v1/jwks", env.url))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401, "OIDC documents need authentication too");

    let secrets = env.get("/api/v1/secrets").await;
    assert_eq!(secrets.status(), 403);
    let status: Value = secrets.json().await.unwrap();
    assert_eq!(status["reason"], "Forbidden");
    assert_eq!(
        status["message"],
        format!("secrets is forbidden: User \"{FAKE_USER}\" cannot list resource \"secrets\" in API group \"\" at the cluster scope")
    );

    let token_request = http
        .post(format!("{}/api/v1/namespaces/default/serviceaccounts/a/token", env.url))
        .bearer_auth(TOKEN)
        .json(&serde_json::json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"audiences": ["x"]}}))
        .send()
        .await
        .unwrap();
    assert_eq!(token_request.status(), 403);
    let status: Value = token_request.json().await.unwrap();
    assert!(status["message"]
        .as_str()
        .unwrap()
        .contains("cannot create resource \"serviceaccounts/token\""));
    let create = http
        .post(format!(
            "{}/api/v1/namespaces/default/serviceaccounts",
            env.url
        ))
        .bearer_auth(TOKEN)
        .json(&sa("default", "x"))
        .send()
        .await
        .unwrap();
    assert_eq!(create.status(), 403, "writes are not in the token's RBAC");
    assert_eq!(env.fake.resource_version(), 0);

    assert_eq!(env.get("/nope").await.status(), 404);
    let discovery: Value = env
        .get("/.well-known/openid-configuration")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(discovery["issuer"], ISSUER);
    let jwks: Value = env.get("/openid/v1/jwks").await.json().await.unwrap();
    assert_eq!(&jwks["keys"][0], env.issuer.key().jwk());
    let resources: Value = env.get("/api/v1").await.json().await.unwrap();
    let sa_resource = resources["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "serviceaccounts")
        .unwrap();
    assert_eq!(sa_resource["kind"], "ServiceAccount");
    let version: Value = env.get("/version").await.json().await.unwrap();
    assert_eq!(
        (version["major"].as_str(), version["minor"].as_str()),
        (Some("1"), Some("33"))
    );
    assert!(env.fake.stats.unauthorized.load(Ordering::Relaxed) >= 3);
    assert!(env.fake.stats.forbidden.load(Ordering::Relaxed) >= 3);
}

async fn review(client: &Client, token: &str, audiences: Option<Vec<String>>) -> TokenReviewStatus {
    let api: Api<TokenReview> = Api::all(client.clone());
    let review = TokenReview {
        spec: TokenReviewSpec {
            token: Some(token.to_string()),
            audiences,
        },
        ..TokenReview::default()
    };
    api.create(&PostParams::default(), &review)
        .await
        .unwrap()
        .status
        .unwrap()
}

fn apply_identity(fake: &FakeKube, id: &PodIdentity) {
    let mut account = sa(&id.namespace, &id.service_account);
    account.metadata.uid = Some(id.service_account_uid.clone());
    fake.apply_service_account(account);
    let mut p = pod(&id.namespace, &id.pod_name, Some(&id.node_name));
    p.metadata.uid = Some(id.pod_uid.clone());
    p.spec.as_mut().unwrap().service_account_name = Some(id.service_account.clone());
    fake.apply_pod(p);
}

#[tokio::test]
async fn token_review_checks_signature_audience_and_bound_pod() {
    let env = start().await;
    let id = PodIdentity::new("ml", "ray-worker", "ray-worker-0", "node-a");
    apply_identity(&env.fake, &id);
    let client = env.client().await;
    let token = env
        .issuer
        .mint(&id, &[AUDIENCE, "other"], Duration::from_secs(600))
        .unwrap();

    let status = review(&client, &token, Some(vec![AUDIENCE.into()])).await;
    assert_eq!(status.authenticated, Some(true), "{status:?}");
    assert_eq!(status.audiences, Some(vec![AUDIENCE.to_string()]));
    let user = status.user.unwrap();
    assert_eq!(
        user.username.as_deref(),
        Some("system:serviceaccount:ml:ray-worker")
    );
    assert_eq!(user.uid.as_deref(), Some(id.service_account_uid.as_str()));
    assert_eq!(
        user.groups.unwrap(),
        [
            "system:serviceaccounts",
            "system:serviceaccounts:ml",
            "system:authenticated"
        ]
    );
    let extra = user.extra.unwrap();
    assert_eq!(
        extra["authentication.kubernetes.io/pod-name"],
        vec![id.pod_name.clone()]
    );
    assert_eq!(
        extra["authentication.kubernetes.io/pod-uid"],
        vec![id.pod_uid.clone()]
    );
    assert_eq!(
        extra["authentication.kubernetes.io/node-name"],
        vec![id.node_name.clone()]
    );
    assert!(extra["authentication.kubernetes.io/credential-id"][0].starts_with("JTI="));

    // Audience not in the token; default audience (the issuer) likewise.
    let status = review(&client, &token, Some(vec!["someone-else".into()])).await;
    assert_ne!(status.authenticated, Some(true));
    assert!(status.error.unwrap().contains("audiences"));
    assert_ne!(
        review(&client, &token, None).await.authenticated,
        Some(true)
    );

    // Same claims, another key.
    let forger = Issuer::new(ISSUER, SigningKey::generate_rs256().unwrap());
    let forged = forger
        .mint(&id, &[AUDIENCE], Duration::from_secs(600))
        .unwrap();
    let status = review(&client, &forged, Some(vec![AUDIENCE.into()])).await;
    assert_ne!(status.authenticated, Some(true));
    assert!(status.error.is_some());
    // Same key id claimed, another key's signature.
    let forged = forger
        .key()
        .sign_with_kid(
            &env.issuer
                .claims_for(&id, &[AUDIENCE], Duration::from_secs(600)),
            env.issuer.key().kid(),
        )
        .unwrap();
    assert_ne!(
        review(&client, &forged, Some(vec![AUDIENCE.into()]))
            .await
            .authenticated,
        Some(true)
    );

    // A pod of the same name but another uid (re-created): refused.
    let mut recreated = pod(&id.namespace, &id.pod_name, Some(&id.node_name));
    recreated.metadata.uid = Some("another-uid".into());
    env.fake.apply_pod(recreated);
    let status = review(&client, &token, Some(vec![AUDIENCE.into()])).await;
    assert_ne!(status.authenticated, Some(true));
    assert!(status.error.unwrap().contains("does not match"));

    // The pod is gone: its token is void at once.
    apply_identity(&env.fake, &id);
    assert_eq!(
        review(&client, &token, Some(vec![AUDIENCE.into()]))
            .await
            .authenticated,
        Some(true)
    );
    assert!(env.fake.delete_pod(&id.namespace, &id.pod_name));
    let status = review(&client, &token, Some(vec![AUDIENCE.into()])).await;
    assert_ne!(status.authenticated, Some(true));
    assert!(status.error.unwrap().contains("invalidated"));
    assert!(env.fake.stats.token_reviews.load(Ordering::Relaxed) >= 7);
}

/// kubectl, when installed: the real Go client against the fake.
async fn kubectl(
    kubeconfig: &std::path::Path,
    cache: &std::path::Path,
    args: &[&str],
) -> std::process::Output {
    tokio::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .arg("--cache-dir")
        .arg(cache)
        .args(args)
        .env_remove("KUBECONFIG")
        .output()
        .await
        .unwrap()
}

fn installed(program: &str, args: &[&str]) -> bool {
    std::process::Command::new(program)
        .args(args)
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A TLS-terminating pass-through in front of the fake. client-go never
/// sends credentials to an `http://` server (kubernetes/kubectl#744), so
/// kubectl needs HTTPS; the crate has no TLS server dependency, and this
/// keeps the fake itself plain HTTP.
const TLS_FRONT: &str = r#"
import asyncio, ssl, sys
cert, key, backend = sys.argv[1], sys.argv[2], int(sys.argv[3])

async def pipe(reader, writer):
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except Exception:
        pass
    finally:
        try:
            writer.close()
        except Exception:
            pass

async def handle(client_reader, client_writer):
    try:
        backend_reader, backend_writer = await asyncio.open_connection("127.0.0.1", backend)
    except OSError:
        client_writer.close()
        return
    await asyncio.gather(pipe(client_reader, backend_writer), pipe(backend_reader, client_writer))

async def main():
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["http/1.1"])
    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()

asyncio.run(main())
"#;

/// Starts the TLS front for the fake at `backend_url`; returns its
/// `https://` URL, the PEM of its self-signed certificate, and the child
/// (killed on drop).
async fn tls_front(
    dir: &std::path::Path,
    backend_url: &str,
) -> (String, String, tokio::process::Child) {
    use tokio::io::AsyncBufReadExt;
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let made = std::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "1",
        ])
        .args([
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "openssl: {}",
        String::from_utf8_lossy(&made.stderr)
    );
    let script = dir.join("tls_front.py");
    std::fs::write(&script, TLS_FRONT).unwrap();
    let backend_port = backend_url.rsplit(':').next().unwrap();
    let mut child = tokio::process::Command::new("python3")
        .arg(&script)
        .arg(&cert)
        .arg(&key)
        .arg(backend_port)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let port = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .expect("the TLS front did not start")
        .unwrap()
        .expect("the TLS front exited");
    let pem = std::fs::read_to_string(&cert).unwrap();
    (format!("https://127.0.0.1:{}", port.trim()), pem, child)
}

/// The fake's kubeconfig for `url`, trusting the front's certificate.
fn kubeconfig_with_ca(fake: &FakeKube, url: &str, ca_pem: &str) -> String {
    use base64::Engine;
    let mut config: Value = serde_norway::from_str(&fake.kubeconfig(url)).unwrap();
    config["clusters"][0]["cluster"]["certificate-authority-data"] =
        Value::String(base64::engine::general_purpose::STANDARD.encode(ca_pem));
    serde_norway::to_string(&config).unwrap()
}

#[tokio::test]
async fn kubectl_gets_lists_and_is_refused_what_rbac_denies() {
    if !installed("kubectl", &["version", "--client"])
        || !installed("openssl", &["version"])
        || !installed("python3", &["-c", "import ssl, asyncio"])
    {
        println!("kubectl, openssl or python3 not installed: skipping the kubectl test");
        return;
    }
    let env = start().await;
    env.fake.apply_service_account(sa("default", "a"));
    env.fake.apply_service_account(annotated(
        "team-b",
        "b",
        "azure.workload.identity/client-id",
        "c-1",
    ));
    env.fake.apply_pod(pod("default", "p-a", Some("node-a")));
    env.fake.apply_pod(pod("default", "p-b", Some("node-b")));
    let dir = tempfile::tempdir().unwrap();
    let (https_url, ca_pem, _front) = tls_front(dir.path(), &env.url).await;
    let config = dir.path().join("kubeconfig");
    std::fs::write(&config, kubeconfig_with_ca(&env.fake, &https_url, &ca_pem)).unwrap();
    let cache = dir.path().join("cache");

    let out = kubectl(
        &config,
        &cache,
        &["get", "serviceaccounts", "-A", "-o", "json"],
    )
    .await;
    assert!(
        out.status.success(),
        "kubectl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    let got: BTreeSet<String> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            format!(
                "{}/{}",
                i["metadata"]["namespace"].as_str().unwrap(),
                i["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(got, set(&["default/a", "team-b/b"]));

    let out = kubectl(
        &config,
        &cache,
        &[
            "get",
            "sa",
            "b",
            "-n",
            "team-b",
            "-o",
            "jsonpath={.metadata.annotations}",
        ],
    )
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("c-1"));

    let out = kubectl(
        &config,
        &cache,
        &[
            "get",
            "pods",
            "--field-selector",
            "spec.nodeName=node-a",
            "-o",
            "name",
        ],
    )
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "pod/p-a");

    // Human-readable output without server-side tables falls back to NAME/AGE.
    let out = kubectl(&config, &cache, &["get", "serviceaccounts"]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    println!(
        "kubectl get serviceaccounts:\n{table}stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Vec<&str>> = table
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows.first().and_then(|r| r.first()),
        Some(&"NAME"),
        "{table}"
    );
    assert_eq!(
        rows.iter().skip(1).map(|r| r[0]).collect::<Vec<_>>(),
        ["a"],
        "{table}"
    );

    let out = kubectl(&config, &cache, &["get", "sa", "missing"]).await;
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("NotFound"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let out = kubectl(&config, &cache, &["get", "secrets"]).await;
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("Forbidden") && stderr.contains("cannot list resource \"secrets\""),
        "{stderr}"
    );

    let out = kubectl(&config, &cache, &["create", "token", "a"]).await;
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("forbidden"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let wrong = dir.path().join("wrong");
    std::fs::write(
        &wrong,
        kubeconfig_with_ca(&env.fake, &https_url, &ca_pem).replace(TOKEN, "not-the-token"),
    )
    .unwrap();
    let out = kubectl(
        &wrong,
        &dir.path().join("cache-wrong"),
        &["get", "serviceaccounts"],
    )
    .await;
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("Unauthorized") || stderr.contains("must be logged in"),
        "{stderr}"
    );

    for line in env.fake.request_log() {
        println!("kubectl: {line}");
    }
}

#[tokio::test]
async fn a_rotated_key_is_published_beside_the_old_one_and_reviewed() {
    let env = start().await;
    let id = PodIdentity::new("ml", "ray-worker", "ray-worker-0", "node-a");
    apply_identity(&env.fake, &id);
    let client = env.client().await;
    let ten_min = Duration::from_secs(600);
    let old = env.issuer.mint(&id, &[AUDIENCE], ten_min).unwrap();
    let old_kid = env.issuer.key().kid().to_string();

    env.issuer.rotate(SigningKey::generate_rs256().unwrap());
    env.fake.set_issuer_keys(env.issuer.jwks());
    let new = env.issuer.mint(&id, &[AUDIENCE], ten_min).unwrap();
    let jwks: Value = env.get("/openid/v1/jwks").await.json().await.unwrap();
    let kids: Vec<&str> = jwks["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["kid"].as_str().unwrap())
        .collect();
    assert_eq!(kids, [env.issuer.key().kid(), old_kid.as_str()]);
    for token in [&old, &new] {
        let status = review(&client, token, Some(vec![AUDIENCE.into()])).await;
        assert_eq!(status.authenticated, Some(true), "{status:?}");
    }

    // The keys down, the rest of the API up.
    env.fake.set_keys_unavailable(true);
    assert_eq!(env.get("/openid/v1/jwks").await.status(), 503);
    assert_eq!(
        env.get("/.well-known/openid-configuration").await.status(),
        503
    );
    assert_eq!(env.get("/api/v1").await.status(), 200);
    env.fake.set_keys_unavailable(false);
    assert_eq!(env.get("/openid/v1/jwks").await.status(), 200);
}
