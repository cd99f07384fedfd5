//! A fake Kubernetes API server, faithful enough that kube-rs (`Api::get`,
//! `Api::list`, `watcher`, `reflector`) and kubectl use it exactly as they
//! use a real one.
//!
//! It serves the few things Lanyard reads from a cluster (ServiceAccounts,
//! Pods, TokenReview, the issuer's OIDC documents) with the real wire
//! shapes and semantics, because that is where a client breaks:
//!
//! - one global, monotonically increasing `resourceVersion`; lists carry it
//!   in `metadata.resourceVersion` and honour `limit`/`continue` against a
//!   consistent snapshot; items of a list carry no `kind`/`apiVersion`, as
//!   the real server sends them (kubernetes/kubernetes#3030);
//! - watches stream newline-delimited `{"type","object"}` events after a
//!   `resourceVersion`, send `BOOKMARK`s when asked, turn a selector
//!   transition into `ADDED`/`DELETED` as the watch cache does, end after
//!   `timeoutSeconds`, and answer a `resourceVersion` older than the bounded
//!   history with an `ERROR` event carrying `410 Expired`, which is what
//!   makes kube-rs relist;
//! - a static bearer token (401 otherwise) and a least-privilege RBAC model:
//!   get/list/watch ServiceAccounts and Pods, create TokenReviews, and 403
//!   for everything else, so tests prove Lanyard needs nothing more;
//! - TokenReview that checks the signature with the issuer's key and, like
//!   kube-apiserver, that the bound ServiceAccount and Pod still exist with
//!   the uids in the token.
//!
//! State changes only through the mutators (`apply_*`, `delete_*`); the API
//! itself is read-only for the caller's RBAC, as it is for Lanyard.
//!
//! It is a test-support crate of its own, not a module of `lanyard`,
//! because only tests use it: the product crate ships no fake cluster. It
//! needs nothing of Lanyard's emulators, only the issuer's URL and public
//! key, so it depends on `lanyard` without the `dev` feature and Lanyard's
//! tests can still be built with `--no-default-features`.
//! [`FakeKube::hold_lists`] delays LIST answers, as a slow or overloaded
//! API server does, for tests of what a client does before its first list.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewStatus, UserInfo};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::Metadata;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc, watch};

use lanyard::secret::{constant_time_eq, ExposeSecret, SecretString};
use lanyard::token::{parse_subject, ServiceAccountClaims};

/// The user the static token authenticates as; it appears in `Forbidden`
/// messages exactly where kube-apiserver puts the caller's name.
pub const FAKE_USER: &str = "system:serviceaccount:kube-system:lanyard";

/// Changes kept for watches that resume from an older `resourceVersion`.
/// Older ones answer 410 Expired, as after an etcd compaction.
const HISTORY_LIMIT: usize = 1000;
/// Changes buffered per open watch before it is considered too slow and
/// ended with 410 (the real server drops slow watchers too).
const BROADCAST_CAPACITY: usize = 1024;
/// Watch length when the client names none (the real server picks 30-60
/// minutes; tests want streams that end).
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest watch served; clients (kube-rs asks for 290 s) simply re-watch.
const MAX_WATCH_TIMEOUT: Duration = Duration::from_secs(60);
/// Default interval between BOOKMARK events on watches that allow them.
const DEFAULT_BOOKMARK_INTERVAL: Duration = Duration::from_secs(2);
/// Clock skew kube-apiserver tolerates on service-account tokens.
const TOKEN_LEEWAY_SECS: u64 = 60;
/// Most distinct request paths counted by [`FakeKube::requests`].
const MAX_COUNTED_PATHS: usize = 10_000;
/// Most entries kept by [`FakeKube::request_log`].
const MAX_LOGGED_REQUESTS: usize = 10_000;

/// Counters tests read to prove what a client did (and did not) ask.
#[derive(Debug, Default)]
pub struct KubeStats {
    /// LIST requests of ServiceAccounts or Pods.
    pub lists: AtomicU64,
    /// WATCH requests (each counted once, however long it streams).
    pub watches: AtomicU64,
    /// GET requests of a single ServiceAccount or Pod.
    pub gets: AtomicU64,
    /// TokenReviews created.
    pub token_reviews: AtomicU64,
    /// Requests refused with 401: no or a wrong bearer token.
    pub unauthorized: AtomicU64,
    /// Requests refused with 403 by the least-privilege RBAC model
    /// (impersonation included).
    pub forbidden: AtomicU64,
    /// Events created (`events.k8s.io/v1`).
    pub events_created: AtomicU64,
    /// Events patched (a repeat counted in the event's series).
    pub events_patched: AtomicU64,
}

/// The resources the fake stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    ServiceAccount,
    Pod,
    /// Cluster-scoped: stored under the namespace `""`.
    Namespace,
}

impl Kind {
    fn from_plural(plural: &str) -> Option<Kind> {
        match plural {
            "serviceaccounts" => Some(Kind::ServiceAccount),
            "pods" => Some(Kind::Pod),
            "namespaces" => Some(Kind::Namespace),
            _ => None,
        }
    }

    fn cluster_scoped(self) -> bool {
        self == Kind::Namespace
    }

    fn index(self) -> usize {
        self as usize
    }

    fn plural(self) -> &'static str {
        match self {
            Kind::ServiceAccount => "serviceaccounts",
            Kind::Pod => "pods",
            Kind::Namespace => "namespaces",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Kind::ServiceAccount => "ServiceAccount",
            Kind::Pod => "Pod",
            Kind::Namespace => "Namespace",
        }
    }

    /// The value of a field-selector field on `obj`, or `None` when the
    /// field cannot be selected on for this kind (the real server answers
    /// 400 "field label not supported"). Absent fields select as `""`.
    fn field(self, obj: &Value, field: &str) -> Option<String> {
        let text = |pointer: &str| {
            obj.pointer(pointer)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        match (self, field) {
            (_, "metadata.name") => Some(text("/metadata/name")),
            (_, "metadata.namespace") => Some(text("/metadata/namespace")),
            (Kind::Pod, "spec.nodeName") => Some(text("/spec/nodeName")),
            (Kind::Pod, "spec.restartPolicy") => Some(text("/spec/restartPolicy")),
            (Kind::Pod, "spec.schedulerName") => Some(text("/spec/schedulerName")),
            (Kind::Pod, "spec.serviceAccountName") => Some(text("/spec/serviceAccountName")),
            (Kind::Pod, "status.phase") => Some(text("/status/phase")),
            (Kind::Pod, "status.podIP") => Some(text("/status/podIP")),
            (Kind::Pod, "status.nominatedNodeName") => Some(text("/status/nominatedNodeName")),
            (Kind::Pod, "spec.hostNetwork") => Some(
                obj.pointer("/spec/hostNetwork")
                    .and_then(Value::as_bool)
                    .unwrap_or(false)
                    .to_string(),
            ),
            _ => None,
        }
    }
}

/// `(namespace, name)`, ordered as etcd orders `/registry/{resource}/{ns}/{name}`.
type Key = (String, String);

/// One committed change: the object before and after (`None` when absent).
/// Keeping both lets a watch with a selector see an object entering or
/// leaving its selection, and lets a list be served at an older revision.
#[derive(Debug)]
struct Change {
    rv: u64,
    kind: Kind,
    key: Key,
    prev: Option<Value>,
    cur: Option<Value>,
}

struct Store {
    /// The last committed resourceVersion.
    rv: u64,
    /// Every change after `floor` is in `history`; older revisions are gone.
    floor: u64,
    objects: [BTreeMap<Key, Value>; 3],
    history: VecDeque<Arc<Change>>,
}

impl Store {
    /// The objects of `kind` as they were at revision `at`, rewound through
    /// the history; `None` when `at` has been compacted away.
    fn snapshot(&self, kind: Kind, at: u64) -> Option<BTreeMap<Key, Value>> {
        if at < self.floor {
            return None;
        }
        let mut objects = self.objects[kind.index()].clone();
        for change in self.history.iter().rev() {
            if change.rv <= at {
                break;
            }
            if change.kind != kind {
                continue;
            }
            match &change.prev {
                Some(prev) => objects.insert(change.key.clone(), prev.clone()),
                None => objects.remove(&change.key),
            };
        }
        Some(objects)
    }
}

/// What open watches are told to do by [`FakeKube::end_watches`] and
/// [`FakeKube::expire_watches`].
#[derive(Debug, Clone, Copy, Default)]
struct Control {
    /// End with an `ERROR` 410 event rather than a clean end of stream.
    expire: bool,
}

/// An issuer's published keys and their decoding halves.
struct IssuerKeys {
    jwks: Value,
    /// (kid, key, algorithm) of each key that has an algorithm.
    decoding: Vec<(Option<String>, DecodingKey, Algorithm)>,
}

impl IssuerKeys {
    fn from_jwks(jwks: Value) -> IssuerKeys {
        let decoding = jwks["keys"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|jwk| {
                let alg = jwk.get("alg")?.as_str()?.parse::<Algorithm>().ok()?;
                let parsed = serde_json::from_value::<jsonwebtoken::jwk::Jwk>(jwk.clone()).ok()?;
                let key = DecodingKey::from_jwk(&parsed).ok()?;
                Some((parsed.common.key_id, key, alg))
            })
            .collect();
        IssuerKeys { jwks, decoding }
    }
}

/// The fake API server. Create with [`FakeKube::new`], serve
/// [`FakeKube::router`], change state with the mutators.
pub struct FakeKube {
    /// The cluster's service-account issuer URL (`iss` of its tokens).
    issuer_url: String,
    /// The issuer's public keys: the JWKS served and what TokenReview
    /// verifies with (see [`FakeKube::set_issuer_keys`]).
    issuer_keys: std::sync::RwLock<IssuerKeys>,
    /// While `true`, the discovery document and JWKS are answered 503 (see
    /// [`FakeKube::set_keys_unavailable`]).
    keys_unavailable: std::sync::atomic::AtomicBool,
    token: SecretString,
    store: Mutex<Store>,
    events: broadcast::Sender<Arc<Change>>,
    control: watch::Sender<Control>,
    bookmark_interval_ms: AtomicU64,
    path_counts: Mutex<HashMap<String, u64>>,
    log: Mutex<VecDeque<String>>,
    /// While `true`, LIST requests wait (see [`FakeKube::hold_lists`]).
    lists_held: watch::Sender<bool>,
    /// While `true`, every request is answered 503 (see
    /// [`FakeKube::set_unavailable`]).
    unavailable: std::sync::atomic::AtomicBool,
    /// Events created through `events.k8s.io/v1`, by (namespace, name).
    recorded_events: Mutex<BTreeMap<Key, Value>>,
    /// What clients have asked, for tests to assert on.
    pub stats: KubeStats,
}

impl FakeKube {
    /// A fake API server whose callers must present `token` as a bearer
    /// token, and whose TokenReview and OIDC documents are those of the
    /// issuer at `issuer_url` with the public key `issuer_jwk` (for the
    /// built-in issuer: `issuer.url()` and `issuer.key().jwk()`).
    pub fn new(issuer_url: &str, issuer_jwk: &Value, token: &str) -> Arc<Self> {
        Arc::new(FakeKube {
            issuer_url: issuer_url.to_string(),
            issuer_keys: std::sync::RwLock::new(IssuerKeys::from_jwks(
                json!({ "keys": [issuer_jwk] }),
            )),
            keys_unavailable: Default::default(),
            token: SecretString::from(token.to_string()),
            store: Mutex::new(Store {
                rv: 0,
                floor: 0,
                objects: [BTreeMap::new(), BTreeMap::new(), BTreeMap::new()],
                history: VecDeque::new(),
            }),
            events: broadcast::channel(BROADCAST_CAPACITY).0,
            control: watch::channel(Control::default()).0,
            bookmark_interval_ms: AtomicU64::new(DEFAULT_BOOKMARK_INTERVAL.as_millis() as u64),
            path_counts: Mutex::new(HashMap::new()),
            log: Mutex::new(VecDeque::new()),
            lists_held: watch::channel(false).0,
            unavailable: Default::default(),
            recorded_events: Mutex::new(BTreeMap::new()),
            stats: KubeStats::default(),
        })
    }

    /// Every path goes through one handler that classifies the request the
    /// way kube-apiserver's RequestInfo does, so authentication and RBAC
    /// apply before routing, as they do in the real server.
    pub fn router(self: &Arc<Self>) -> Router {
        Router::new().fallback(handle).with_state(self.clone())
    }

    /// A kubeconfig with one cluster at `server_url`, one user with the
    /// static token, and a current context in namespace `default`.
    ///
    /// kube-rs sends the token to an `http://` server; kubectl (client-go)
    /// does not (kubernetes/kubectl#744), so kubectl needs an `https://`
    /// front and `certificate-authority-data` added (see
    /// `tests/fake_kube.rs`).
    pub fn kubeconfig(&self, server_url: &str) -> String {
        let doc = json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "lanyard-fake", "cluster": {"server": server_url}}],
            "users": [{"name": "lanyard-fake", "user": {"token": self.token.expose_secret()}}],
            "contexts": [{
                "name": "lanyard-fake",
                "context": {"cluster": "lanyard-fake", "user": "lanyard-fake", "namespace": "default"},
            }],
            "current-context": "lanyard-fake",
            "preferences": {},
        });
        serde_norway::to_string(&doc).unwrap_or_default()
    }

    /// The current (last committed) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.lock().rv
    }

    /// Sets how often open watches that allow bookmarks get one (applies to
    /// watches opened afterwards).
    pub fn set_bookmark_interval(&self, interval: Duration) {
        let ms = interval.as_millis().clamp(10, u128::from(u32::MAX)) as u64;
        self.bookmark_interval_ms.store(ms, Ordering::Relaxed);
    }

    /// Holds LIST requests (`true`) until released (`false`): a held list
    /// is answered, from the state at release, only once released. GETs,
    /// watches and everything else are served as usual.
    pub fn hold_lists(&self, held: bool) {
        self.lists_held.send_replace(held);
    }

    /// Creates or replaces a ServiceAccount (ADDED, or MODIFIED when one of
    /// that name and uid exists; a different uid is a delete and re-create,
    /// as in a real cluster). Fills `metadata.uid`, `creationTimestamp` and
    /// `namespace` (`default`) when missing; an unchanged object is a no-op
    /// that does not bump the resourceVersion, as on the real server.
    /// Returns the object as stored, with its resourceVersion.
    ///
    /// # Panics
    /// When neither `metadata.name` nor `metadata.generateName` is set.
    pub fn apply_service_account(&self, sa: ServiceAccount) -> ServiceAccount {
        self.apply(Kind::ServiceAccount, sa)
    }

    /// Deletes a ServiceAccount (DELETED); false when there was none.
    pub fn delete_service_account(&self, namespace: &str, name: &str) -> bool {
        self.delete(Kind::ServiceAccount, namespace, name)
    }

    /// Creates or replaces a Pod, with the semantics of
    /// [`FakeKube::apply_service_account`].
    ///
    /// # Panics
    /// When neither `metadata.name` nor `metadata.generateName` is set.
    pub fn apply_pod(&self, pod: Pod) -> Pod {
        self.apply(Kind::Pod, pod)
    }

    /// Deletes a Pod (DELETED); its tokens stop passing TokenReview at once.
    pub fn delete_pod(&self, namespace: &str, name: &str) -> bool {
        self.delete(Kind::Pod, namespace, name)
    }

    /// Creates or replaces a Namespace (cluster-scoped), with the semantics
    /// of [`FakeKube::apply_service_account`].
    ///
    /// # Panics
    /// When neither `metadata.name` nor `metadata.generateName` is set.
    pub fn apply_namespace(&self, namespace: Namespace) -> Namespace {
        self.apply(Kind::Namespace, namespace)
    }

    /// Deletes a Namespace (DELETED); false when there was none.
    pub fn delete_namespace(&self, name: &str) -> bool {
        self.delete(Kind::Namespace, "", name)
    }

    /// The stored Pod `namespace/name`, if any.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<Pod> {
        self.stored(Kind::Pod, namespace, name)
    }

    /// The stored ServiceAccount `namespace/name`, if any.
    pub fn service_account(&self, namespace: &str, name: &str) -> Option<ServiceAccount> {
        self.stored(Kind::ServiceAccount, namespace, name)
    }

    fn stored<K: serde::de::DeserializeOwned>(
        &self,
        kind: Kind,
        namespace: &str,
        name: &str,
    ) -> Option<K> {
        let key = (namespace.to_string(), name.to_string());
        let value = self.lock().objects[kind.index()].get(&key).cloned()?;
        serde_json::from_value(value).ok()
    }

    /// Every Event created through `events.k8s.io/v1`, as stored (patches
    /// applied), oldest first.
    pub fn events(&self) -> Vec<Value> {
        self.recorded_events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// Forgets the change history, as an etcd compaction does: a watch or
    /// paginated list resuming from an earlier resourceVersion gets 410.
    pub fn compact(&self) {
        let mut store = self.lock();
        store.history.clear();
        store.floor = store.rv;
    }

    /// Ends every open watch stream cleanly, as a server timeout or restart
    /// does; clients re-watch from the last resourceVersion they saw.
    pub fn end_watches(&self) {
        let _store = self.lock();
        self.control.send_replace(Control { expire: false });
    }

    /// Compacts the history and ends every open watch with an `ERROR` event
    /// carrying 410 Expired, as a watch served from a compacted etcd
    /// revision ends: clients must relist.
    pub fn expire_watches(&self) {
        let mut store = self.lock();
        store.history.clear();
        store.floor = store.rv;
        self.control.send_replace(Control { expire: true });
    }

    /// Publishes `jwks` (`{"keys": [..]}`) as the issuer's keys, in the JWKS
    /// and for TokenReview, as after the cluster's service-account key was
    /// rotated ([`lanyard::emulator::Issuer::rotate`] and its `jwks()`).
    pub fn set_issuer_keys(&self, jwks: Value) {
        *self.issuer_keys.write().unwrap_or_else(|e| e.into_inner()) = IssuerKeys::from_jwks(jwks);
    }

    /// Makes the issuer's discovery document and JWKS answer 503 (`true`)
    /// while the rest of the API works, or serves them again (`false`).
    pub fn set_keys_unavailable(&self, down: bool) {
        self.keys_unavailable.store(down, Ordering::SeqCst);
    }

    /// Takes the API server down (`true`: every request is answered 503
    /// `ServiceUnavailable` and open watches end, as when its storage is
    /// lost or it restarts) or brings it back (`false`).
    pub fn set_unavailable(&self, down: bool) {
        self.unavailable.store(down, Ordering::SeqCst);
        if down {
            self.end_watches();
        }
    }

    /// Requests received whose path starts with `path_prefix` (any method,
    /// any outcome).
    pub fn requests(&self, path_prefix: &str) -> u64 {
        let counts = self.path_counts.lock().unwrap_or_else(|p| p.into_inner());
        counts
            .iter()
            .filter(|(path, _)| path.starts_with(path_prefix))
            .map(|(_, n)| n)
            .sum()
    }

    /// The most recent requests as `METHOD /path?query -> STATUS`, oldest
    /// first (to see what a client really asks).
    pub fn request_log(&self) -> Vec<String> {
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        log.iter().cloned().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn apply<K>(&self, kind: Kind, mut obj: K) -> K
    where
        K: Metadata<Ty = ObjectMeta> + Serialize,
    {
        let meta = obj.metadata_mut();
        if meta.name.is_none() {
            if let Some(prefix) = &meta.generate_name {
                let suffix: String = uuid::Uuid::new_v4().simple().to_string()[..5].to_string();
                meta.name = Some(format!("{prefix}{suffix}"));
            }
        }
        let Some(name) = meta.name.clone() else {
            panic!(
                "FakeKube: a {} needs metadata.name or metadata.generateName",
                kind.kind()
            );
        };
        let namespace = match kind.cluster_scoped() {
            true => {
                meta.namespace = None;
                String::new()
            }
            false => meta
                .namespace
                .get_or_insert_with(|| "default".to_string())
                .clone(),
        };
        meta.resource_version = None;
        let key = (namespace, name);

        let mut store = self.lock();
        let existing = store.objects[kind.index()].get(&key).cloned();
        let mut recreate = false;
        if let Some(existing) = &existing {
            let existing_uid = existing.pointer("/metadata/uid").and_then(Value::as_str);
            if meta.uid.is_none() || meta.uid.as_deref() == existing_uid {
                meta.uid = existing_uid.map(str::to_string);
                if meta.creation_timestamp.is_none() {
                    meta.creation_timestamp = existing
                        .pointer("/metadata/creationTimestamp")
                        .and_then(|t| serde_json::from_value::<Time>(t.clone()).ok());
                }
            } else {
                recreate = true;
            }
        }
        meta.uid
            .get_or_insert_with(|| uuid::Uuid::new_v4().to_string());
        meta.creation_timestamp
            .get_or_insert_with(|| Time(k8s_openapi::jiff::Timestamp::now()));

        let mut value = match serde_json::to_value(&obj) {
            Ok(value) => value,
            // k8s-openapi types always serialise; failing here is a bug in
            // the caller's object, not a runtime condition.
            Err(e) => panic!("FakeKube: cannot serialise a {}: {e}", kind.kind()),
        };
        if let (Some(existing), false) = (&existing, recreate) {
            let mut unchanged = existing.clone();
            if let Some(meta) = unchanged.get_mut("metadata").and_then(Value::as_object_mut) {
                meta.remove("resourceVersion");
            }
            if unchanged == value {
                obj.metadata_mut().resource_version = existing
                    .pointer("/metadata/resourceVersion")
                    .and_then(Value::as_str)
                    .map(str::to_string);
                return obj;
            }
        }
        if recreate {
            store.rv += 1;
            self.commit(&mut store, kind, key.clone(), None);
        }
        store.rv += 1;
        let rv = store.rv.to_string();
        if let Some(meta) = value.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.insert("resourceVersion".into(), Value::String(rv.clone()));
        }
        obj.metadata_mut().resource_version = Some(rv);
        self.commit(&mut store, kind, key, Some(value));
        obj
    }

    fn delete(&self, kind: Kind, namespace: &str, name: &str) -> bool {
        let mut store = self.lock();
        let key = (namespace.to_string(), name.to_string());
        if !store.objects[kind.index()].contains_key(&key) {
            return false;
        }
        store.rv += 1;
        self.commit(&mut store, kind, key, None);
        true
    }

    /// Records a change at `store.rv` (already bumped by the caller) and
    /// tells open watches. Runs under the store lock, so watches see
    /// changes in resourceVersion order and a watch that subscribes under
    /// the same lock misses none.
    fn commit(&self, store: &mut Store, kind: Kind, key: Key, cur: Option<Value>) {
        let objects = &mut store.objects[kind.index()];
        let prev = match &cur {
            Some(obj) => objects.insert(key.clone(), obj.clone()),
            None => objects.remove(&key),
        };
        let change = Arc::new(Change {
            rv: store.rv,
            kind,
            key,
            prev,
            cur,
        });
        store.history.push_back(change.clone());
        while store.history.len() > HISTORY_LIMIT {
            if let Some(old) = store.history.pop_front() {
                store.floor = old.rv;
            }
        }
        // No open watch is not an error.
        let _ = self.events.send(change);
    }

    fn note(&self, method: &Method, uri: &Uri, status: StatusCode) {
        tracing::debug!(
            %method, uri = %uri, status = status.as_u16(), "fake kube-apiserver request"
        );
        {
            let mut counts = self.path_counts.lock().unwrap_or_else(|p| p.into_inner());
            if counts.len() < MAX_COUNTED_PATHS || counts.contains_key(uri.path()) {
                *counts.entry(uri.path().to_string()).or_default() += 1;
            }
        }
        let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        if log.len() >= MAX_LOGGED_REQUESTS {
            log.pop_front();
        }
        log.push_back(format!("{method} {uri} -> {}", status.as_u16()));
    }

    fn authenticated(&self, headers: &HeaderMap) -> bool {
        let Some(value) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
        else {
            return false;
        };
        let Some((scheme, token)) = value.trim().split_once(' ') else {
            return false;
        };
        let token = token.trim();
        scheme.eq_ignore_ascii_case("bearer")
            && !token.is_empty()
            && constant_time_eq(token.as_bytes(), self.token.expose_secret().as_bytes())
    }

    fn serve(
        self: &Arc<Self>,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Response {
        if !self.authenticated(headers) {
            self.stats.unauthorized.fetch_add(1, Ordering::Relaxed);
            return status_error(
                StatusCode::UNAUTHORIZED,
                "Unauthorized",
                "Unauthorized".into(),
                None,
            );
        }
        if headers
            .keys()
            .any(|name| name.as_str().starts_with("impersonate-"))
        {
            self.stats.forbidden.fetch_add(1, Ordering::Relaxed);
            return status_error(
                StatusCode::FORBIDDEN,
                "Forbidden",
                format!("users is forbidden: User \"{FAKE_USER}\" cannot impersonate resource \"users\" in API group \"\" at the cluster scope"),
                Some(json!({"kind": "users"})),
            );
        }
        let query = Query::parse(uri);
        let info = RequestInfo::parse(method, uri.path(), &query);
        let Some(res) = info else {
            return self.serve_non_resource(method, uri.path(), headers);
        };
        if !res.allowed() {
            self.stats.forbidden.fetch_add(1, Ordering::Relaxed);
            return forbidden(&res);
        }
        match (
            res.group.as_str(),
            res.version.as_str(),
            res.resource.as_str(),
        ) {
            ("", "v1", plural) => {
                let Some(kind) = Kind::from_plural(plural) else {
                    return not_found_path();
                };
                // A cluster-scoped resource is stored under "": its URL's
                // `namespaces/NAME` is the object itself, not a scope.
                let namespace = match kind.cluster_scoped() {
                    true => res.name.as_deref().map(|_| ""),
                    false => res.namespace.as_deref(),
                };
                match (res.verb, namespace, res.name.as_deref()) {
                    (Verb::Get, Some(ns), Some(name)) => self.get(kind, ns, name),
                    (Verb::List, _, None) if kind.cluster_scoped() => self.list(kind, None, &query),
                    (Verb::Watch, _, name) if kind.cluster_scoped() => {
                        self.watch(kind, None, name, &query)
                    }
                    (Verb::List, ns, None) => self.list(kind, ns, &query),
                    (Verb::Watch, ns, name) => self.watch(kind, ns, name, &query),
                    _ => not_found_path(),
                }
            }
            ("events.k8s.io", "v1", "events") => {
                match (res.verb, res.namespace.as_deref(), res.name.as_deref()) {
                    (Verb::Create, Some(ns), None) => self.create_event(ns, body),
                    (Verb::Patch, Some(ns), Some(name)) => {
                        self.patch_event(ns, name, headers, body)
                    }
                    _ => not_found_path(),
                }
            }
            ("authentication.k8s.io", "v1", "tokenreviews")
                if res.verb == Verb::Create && res.namespace.is_none() && res.name.is_none() =>
            {
                self.token_review(body)
            }
            _ => not_found_path(),
        }
    }

    fn serve_non_resource(&self, method: &Method, path: &str, headers: &HeaderMap) -> Response {
        if method != Method::GET && method != Method::HEAD {
            self.stats.forbidden.fetch_add(1, Ordering::Relaxed);
            return status_error(
                StatusCode::FORBIDDEN,
                "Forbidden",
                format!(
                    "forbidden: User \"{FAKE_USER}\" cannot {} path \"{path}\"",
                    method.as_str().to_ascii_lowercase()
                ),
                None,
            );
        }
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("127.0.0.1");
        let addresses = json!([{"clientCIDR": "0.0.0.0/0", "serverAddress": host}]);
        match path.trim_end_matches('/') {
            "/version" => json_response(StatusCode::OK, &version_info()),
            "/api" => json_response(
                StatusCode::OK,
                &json!({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": addresses}),
            ),
            "/apis" => json_response(
                StatusCode::OK,
                &json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [authentication_group()]}),
            ),
            "/apis/authentication.k8s.io" => {
                let mut group = authentication_group();
                if let Some(obj) = group.as_object_mut() {
                    obj.insert("kind".into(), "APIGroup".into());
                    obj.insert("apiVersion".into(), "v1".into());
                }
                json_response(StatusCode::OK, &group)
            }
            "/api/v1" => json_response(StatusCode::OK, &core_v1_resources()),
            "/apis/authentication.k8s.io/v1" => {
                json_response(StatusCode::OK, &authentication_v1_resources())
            }
            "/.well-known/openid-configuration" | "/openid/v1/jwks"
                if self.keys_unavailable.load(Ordering::SeqCst) =>
            {
                status_error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "ServiceUnavailable",
                    "the server is currently unable to handle the request".into(),
                    None,
                )
            }
            "/.well-known/openid-configuration" => json_response(
                StatusCode::OK,
                &json!({
                    "issuer": self.issuer_url.as_str(),
                    "jwks_uri": format!("{}/openid/v1/jwks", self.issuer_url),
                    "response_types_supported": ["id_token"],
                    "subject_types_supported": ["public"],
                    "id_token_signing_alg_values_supported": ["RS256", "ES256"],
                }),
            ),
            "/openid/v1/jwks" => {
                let jwks = self
                    .issuer_keys
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .jwks
                    .clone();
                (
                    StatusCode::OK,
                    [(header::CONTENT_TYPE, "application/jwk-set+json")],
                    jwks.to_string(),
                )
                    .into_response()
            }
            "/healthz" | "/livez" | "/readyz" => (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                "ok",
            )
                .into_response(),
            _ => not_found_path(),
        }
    }

    fn get(&self, kind: Kind, namespace: &str, name: &str) -> Response {
        self.stats.gets.fetch_add(1, Ordering::Relaxed);
        let store = self.lock();
        match store.objects[kind.index()].get(&(namespace.to_string(), name.to_string())) {
            Some(obj) => json_response(StatusCode::OK, obj),
            None => not_found(kind, name),
        }
    }

    fn list(&self, kind: Kind, namespace: Option<&str>, query: &Query) -> Response {
        self.stats.lists.fetch_add(1, Ordering::Relaxed);
        let filter = match Filter::new(kind, namespace, None, query) {
            Ok(filter) => filter,
            Err(message) => return bad_request(message),
        };
        let limit = match query.get("limit").map(str::parse::<usize>) {
            None => 0,
            Some(Ok(limit)) => limit,
            Some(Err(_)) => {
                return bad_request("limit: Invalid value: must be a non-negative integer".into())
            }
        };
        let store = self.lock();
        let (at, after) = match query.get("continue").filter(|c| !c.is_empty()) {
            Some(token) => match decode_continue(token) {
                Some(position) => position,
                None => {
                    return bad_request("continue key is not valid: illegal base64 data".into())
                }
            },
            None => {
                let exact = query.get("resourceVersionMatch") == Some("Exact");
                match query.get("resourceVersion").filter(|rv| !rv.is_empty()) {
                    Some(rv) if exact => match rv.parse::<u64>() {
                        Ok(rv) => (rv.min(store.rv), None),
                        Err(_) => {
                            return bad_request(format!("resourceVersion: Invalid value: \"{rv}\""))
                        }
                    },
                    // Unset, "0" (any) and NotOlderThan: the latest state satisfies all.
                    _ => (store.rv, None),
                }
            }
        };
        let Some(objects) = store.snapshot(kind, at) else {
            return status_error(
                StatusCode::GONE,
                "Expired",
                format!(
                    "The resourceVersion for the provided list is too old: {at} (current floor {})",
                    store.floor
                ),
                None,
            );
        };
        drop(store);

        let matching: Vec<(&Key, &Value)> = objects
            .iter()
            .filter(|(key, _)| after.as_ref().is_none_or(|after| *key > after))
            .filter(|(_, obj)| filter.matches(kind, obj))
            .collect();
        let page = if limit > 0 {
            &matching[..limit.min(matching.len())]
        } else {
            &matching[..]
        };
        let remaining = matching.len() - page.len();
        let items: Vec<Value> = page.iter().map(|(_, obj)| without_type_meta(obj)).collect();
        let last = page.last().map(|(key, _)| (*key).clone());
        let mut metadata = json!({"resourceVersion": at.to_string()});
        if let (true, Some(last)) = (remaining > 0, last) {
            metadata["continue"] = Value::String(encode_continue(at, &last));
            if filter.is_unselective() {
                metadata["remainingItemCount"] = json!(remaining);
            }
        }
        json_response(
            StatusCode::OK,
            &json!({
                "kind": format!("{}List", kind.kind()),
                "apiVersion": "v1",
                "metadata": metadata,
                "items": items,
            }),
        )
    }

    fn watch(
        self: &Arc<Self>,
        kind: Kind,
        namespace: Option<&str>,
        name: Option<&str>,
        query: &Query,
    ) -> Response {
        self.stats.watches.fetch_add(1, Ordering::Relaxed);
        let filter = match Filter::new(kind, namespace, name, query) {
            Ok(filter) => filter,
            Err(message) => return bad_request(message),
        };
        let bookmarks = query.flag("allowWatchBookmarks");
        let send_initial = query.flag("sendInitialEvents");
        if send_initial && (!bookmarks || query.get("resourceVersionMatch") != Some("NotOlderThan"))
        {
            return status_error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "sendInitialEvents requires allowWatchBookmarks=true and resourceVersionMatch=NotOlderThan".into(),
                None,
            );
        }
        let timeout = match query.get("timeoutSeconds").map(str::parse::<u64>) {
            None | Some(Ok(0)) => DEFAULT_WATCH_TIMEOUT,
            Some(Ok(secs)) => Duration::from_secs(secs).min(MAX_WATCH_TIMEOUT),
            Some(Err(_)) => {
                return bad_request("timeoutSeconds: Invalid value: must be an integer".into())
            }
        };
        let from = match query
            .get("resourceVersion")
            .filter(|rv| !rv.is_empty() && *rv != "0")
        {
            _ if send_initial => None,
            None => None,
            Some(rv) => match rv.parse::<u64>() {
                Ok(rv) => Some(rv),
                Err(_) => return bad_request(format!("resourceVersion: Invalid value: \"{rv}\"")),
            },
        };

        let store = self.lock();
        let mut initial = Vec::new();
        let start_rv = match from {
            // No (or "0") resourceVersion: the current state as synthetic
            // ADDED events, then changes.
            None => {
                for obj in store.objects[kind.index()].values() {
                    if filter.matches(kind, obj) {
                        initial.push(line(&json!({"type": "ADDED", "object": obj})));
                    }
                }
                if send_initial {
                    initial.push(bookmark(kind, store.rv, true));
                }
                store.rv
            }
            Some(rv) if rv < store.floor => {
                let gone = gone(format!("too old resource version: {rv} ({})", store.floor));
                return json_response_bytes(StatusCode::OK, gone);
            }
            Some(rv) => {
                for change in store.history.iter().filter(|c| c.rv > rv) {
                    if let Some(event) = render(change, kind, &filter) {
                        initial.push(event);
                    }
                }
                store.rv.max(rv)
            }
        };
        let watch = Watch {
            kind,
            filter,
            initial,
            start_rv,
            bookmarks,
            bookmark_interval: Duration::from_millis(
                self.bookmark_interval_ms.load(Ordering::Relaxed),
            ),
            timeout,
            events: self.events.subscribe(),
            control: self.control.subscribe(),
        };
        drop(store);

        let (tx, rx) = mpsc::channel::<Bytes>(64);
        tokio::spawn(watch.run(tx));
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|chunk| (Ok::<Bytes, Infallible>(chunk), rx))
        });
        (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            Body::from_stream(stream),
        )
            .into_response()
    }

    /// `POST /apis/events.k8s.io/v1/namespaces/NS/events`, validated as
    /// the API server validates an `events.k8s.io/v1` Event.
    fn create_event(&self, namespace: &str, body: &[u8]) -> Response {
        let mut event: Value = match serde_json::from_slice(body) {
            Ok(v @ Value::Object(_)) => v,
            _ => return bad_request("the body of the request was in an unknown format".into()),
        };
        let name = event
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        if let Some(invalid) = invalid_event(&event, namespace, &name, true) {
            return invalid;
        }
        let key = (namespace.to_string(), name.clone());
        let mut events = self
            .recorded_events
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if events.contains_key(&key) {
            return status_error(
                StatusCode::CONFLICT,
                "AlreadyExists",
                format!("events.events.k8s.io \"{name}\" already exists"),
                Some(json!({"name": name, "group": "events.k8s.io", "kind": "events"})),
            );
        }
        let rv = {
            let mut store = self.lock();
            store.rv += 1;
            store.rv
        };
        if let Some(meta) = event.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.insert("resourceVersion".into(), Value::String(rv.to_string()));
            meta.insert(
                "uid".into(),
                Value::String(uuid::Uuid::new_v4().to_string()),
            );
            meta.insert("namespace".into(), Value::String(namespace.to_string()));
        }
        event["apiVersion"] = json!("events.k8s.io/v1");
        event["kind"] = json!("Event");
        events.insert(key, event.clone());
        self.stats.events_created.fetch_add(1, Ordering::Relaxed);
        json_response(StatusCode::CREATED, &event)
    }

    /// `PATCH …/events/NAME` with a JSON merge patch, as
    /// `kube::runtime::events::Recorder` sends a repeat.
    fn patch_event(
        &self,
        namespace: &str,
        name: &str,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Response {
        let content_type = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        if !content_type.starts_with("application/merge-patch+json") {
            return status_error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "UnsupportedMediaType",
                format!("the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml (got {content_type:?})"),
                None,
            );
        }
        let patch: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return bad_request(format!("error decoding patch: {e}")),
        };
        let key = (namespace.to_string(), name.to_string());
        let mut events = self
            .recorded_events
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let Some(stored) = events.get(&key) else {
            return status_error(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("events.events.k8s.io \"{name}\" not found"),
                Some(json!({"name": name, "group": "events.k8s.io", "kind": "events"})),
            );
        };
        let mut merged = stored.clone();
        json_patch::merge(&mut merged, &patch);
        if let Some(invalid) = invalid_event(&merged, namespace, name, false) {
            return invalid;
        }
        let rv = {
            let mut store = self.lock();
            store.rv += 1;
            store.rv
        };
        merged["metadata"]["resourceVersion"] = json!(rv.to_string());
        events.insert(key, merged.clone());
        self.stats.events_patched.fetch_add(1, Ordering::Relaxed);
        json_response(StatusCode::OK, &merged)
    }

    fn token_review(&self, body: &[u8]) -> Response {
        self.stats.token_reviews.fetch_add(1, Ordering::Relaxed);
        let mut review: TokenReview = match serde_json::from_slice(body) {
            Ok(review) => review,
            Err(e) => {
                return bad_request(format!(
                    "the body of the request was in an unknown format: {e}"
                ))
            }
        };
        let token = review.spec.token.clone().unwrap_or_default();
        if token.is_empty() {
            return bad_request("token is required for TokenReview in authentication".into());
        }
        let audiences = match review.spec.audiences.clone().filter(|a| !a.is_empty()) {
            Some(audiences) => audiences,
            // kube-apiserver's --api-audiences default to the issuer.
            None => vec![self.issuer_url.clone()],
        };
        review.status = Some(match self.authenticate(&token, &audiences) {
            Ok((user, audiences)) => TokenReviewStatus {
                authenticated: Some(true),
                user: Some(user),
                audiences: Some(audiences),
                error: None,
            },
            Err(reason) => TokenReviewStatus {
                authenticated: None,
                user: Some(UserInfo::default()),
                audiences: None,
                error: Some(format!("[invalid bearer token, {reason}]")),
            },
        });
        review.metadata = ObjectMeta::default();
        match serde_json::to_value(&review) {
            Ok(value) => json_response(StatusCode::CREATED, &value),
            Err(e) => status_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                e.to_string(),
                None,
            ),
        }
    }

    /// Authenticates a service-account token as kube-apiserver's
    /// service-account authenticator does: this issuer, its key, the
    /// requested audiences, validity window, and bound objects that still
    /// exist with the uids the token names.
    fn authenticate(
        &self,
        token: &str,
        audiences: &[String],
    ) -> Result<(UserInfo, Vec<String>), String> {
        let kid = jsonwebtoken::decode_header(token)
            .map_err(|e| format!("service account token is malformed: {e}"))?
            .kid;
        let (key, alg) = {
            let keys = self.issuer_keys.read().unwrap_or_else(|e| e.into_inner());
            match keys
                .decoding
                .iter()
                .find(|(k, _, _)| kid.is_none() || *k == kid)
            {
                Some((_, key, alg)) => (key.clone(), *alg),
                // kube-apiserver tries every key; none verifies.
                None => return Err("go-jose/go-jose: error in cryptographic primitive".into()),
            }
        };
        let (key, alg) = (&key, &alg);
        if lanyard::token::unverified_issuer(token).as_deref() != Some(self.issuer_url.as_str()) {
            return Err("token is not a service account token of this cluster's issuer".into());
        }
        let mut validation = Validation::new(*alg);
        validation.leeway = TOKEN_LEEWAY_SECS;
        validation.validate_nbf = true;
        validation.validate_aud = false;
        validation.set_issuer(&[self.issuer_url.as_str()]);
        validation.set_required_spec_claims(&["exp", "iss", "sub"]);
        let claims = jsonwebtoken::decode::<ServiceAccountClaims>(token, key, &validation)
            .map_err(|e| {
                use jsonwebtoken::errors::ErrorKind;
                match e.kind() {
                    ErrorKind::InvalidSignature | ErrorKind::InvalidAlgorithm => {
                        "go-jose/go-jose: error in cryptographic primitive".to_string()
                    }
                    ErrorKind::ExpiredSignature => "service account token has expired".into(),
                    ErrorKind::ImmatureSignature => "service account token is not valid yet".into(),
                    _ => format!("service account token is malformed: {e}"),
                }
            })?
            .claims;
        let granted: Vec<String> = audiences
            .iter()
            .filter(|a| claims.aud.contains(a))
            .cloned()
            .collect();
        if granted.is_empty() {
            let token_auds: Vec<&str> = claims.aud.iter().collect();
            return Err(format!(
                "token audiences {token_auds:?} is invalid for the target audiences {audiences:?}"
            ));
        }
        let k8s = &claims.kubernetes;
        match parse_subject(&claims.sub) {
            Some((ns, sa)) if ns == k8s.namespace && sa == k8s.serviceaccount.name => {}
            _ => return Err("service account token claims are invalid".into()),
        }
        if k8s.secret.is_some() {
            // No Secrets exist in this fake: a secret-bound token is void.
            return Err("service account token has been invalidated".into());
        }
        {
            let store = self.lock();
            let uid_of = |kind: Kind, name: &str| {
                store.objects[kind.index()]
                    .get(&(k8s.namespace.clone(), name.to_string()))
                    .map(|obj| {
                        obj.pointer("/metadata/uid")
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                            .to_string()
                    })
            };
            match uid_of(Kind::ServiceAccount, &k8s.serviceaccount.name) {
                None => return Err("service account token has been invalidated".into()),
                Some(uid) if uid != k8s.serviceaccount.uid => {
                    return Err(format!(
                        "service account UID ({uid}) does not match claim ({})",
                        k8s.serviceaccount.uid
                    ))
                }
                Some(_) => {}
            }
            if let Some(pod) = &k8s.pod {
                match uid_of(Kind::Pod, &pod.name) {
                    None => return Err("service account token has been invalidated".into()),
                    Some(uid) if uid != pod.uid => {
                        return Err(format!(
                            "pod UID ({uid}) does not match claim ({})",
                            pod.uid
                        ))
                    }
                    Some(_) => {}
                }
            }
        }
        let mut extra = BTreeMap::new();
        if let Some(jti) = &claims.jti {
            extra.insert(
                "authentication.kubernetes.io/credential-id".to_string(),
                vec![format!("JTI={jti}")],
            );
        }
        if let Some(pod) = &k8s.pod {
            extra.insert(
                "authentication.kubernetes.io/pod-name".to_string(),
                vec![pod.name.clone()],
            );
            extra.insert(
                "authentication.kubernetes.io/pod-uid".to_string(),
                vec![pod.uid.clone()],
            );
        }
        if let Some(node) = &k8s.node {
            extra.insert(
                "authentication.kubernetes.io/node-name".to_string(),
                vec![node.name.clone()],
            );
            extra.insert(
                "authentication.kubernetes.io/node-uid".to_string(),
                vec![node.uid.clone()],
            );
        }
        let user = UserInfo {
            username: Some(claims.sub.clone()),
            uid: Some(k8s.serviceaccount.uid.clone()),
            groups: Some(vec![
                "system:serviceaccounts".to_string(),
                format!("system:serviceaccounts:{}", k8s.namespace),
                "system:authenticated".to_string(),
            ]),
            extra: Some(extra),
        };
        Ok((user, granted))
    }
}

async fn handle(
    State(fake): State<Arc<FakeKube>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if fake.unavailable.load(Ordering::SeqCst) {
        fake.note(&method, &uri, StatusCode::SERVICE_UNAVAILABLE);
        let body = status_body(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the server is currently unable to handle the request".into(),
            None,
        );
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response();
    }
    let is_list = RequestInfo::parse(&method, uri.path(), &Query::parse(&uri))
        .is_some_and(|r| r.verb == Verb::List);
    if is_list {
        // Never fails: `fake` owns the sender.
        let _ = fake.lists_held.subscribe().wait_for(|held| !*held).await;
    }
    let response = fake.serve(&method, &uri, &headers, &body);
    fake.note(&method, &uri, response.status());
    response
}

/// An open watch: what to send first, what to filter, where it started.
struct Watch {
    kind: Kind,
    filter: Filter,
    initial: Vec<Bytes>,
    start_rv: u64,
    bookmarks: bool,
    bookmark_interval: Duration,
    timeout: Duration,
    events: broadcast::Receiver<Arc<Change>>,
    control: watch::Receiver<Control>,
}

impl Watch {
    async fn run(self, tx: mpsc::Sender<Bytes>) {
        let Watch {
            kind,
            filter,
            initial,
            start_rv,
            bookmarks,
            bookmark_interval,
            timeout,
            mut events,
            mut control,
        } = self;
        for chunk in initial {
            if tx.send(chunk).await.is_err() {
                return;
            }
        }
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        let mut ticks = tokio::time::interval_at(
            tokio::time::Instant::now() + bookmark_interval,
            bookmark_interval,
        );
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_rv = start_rv;
        loop {
            // Biased: a control message (sent under the store lock before
            // any later change) always wins over the changes after it.
            tokio::select! {
                biased;
                changed = control.changed() => {
                    let expire = changed.is_ok() && control.borrow().expire;
                    if expire {
                        let _ = tx.send(gone(format!("too old resource version: {last_rv}"))).await;
                    }
                    return;
                }
                () = &mut deadline => return,
                () = tx.closed() => return,
                received = events.recv() => match received {
                    Ok(change) => {
                        if change.rv <= last_rv {
                            continue;
                        }
                        last_rv = change.rv;
                        if let Some(event) = render(&change, kind, &filter) {
                            if tx.send(event).await.is_err() {
                                return;
                            }
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        let _ = tx.send(gone(format!("too old resource version: {last_rv}"))).await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                _ = ticks.tick(), if bookmarks => {
                    if tx.send(bookmark(kind, last_rv, false)).await.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

/// The event a watch with `filter` sees for `change`, as the watch cache
/// computes it: entering the selection is ADDED, leaving it is DELETED
/// (with the last matching state at the change's resourceVersion).
fn render(change: &Change, kind: Kind, filter: &Filter) -> Option<Bytes> {
    if change.kind != kind {
        return None;
    }
    let cur = change.cur.as_ref().filter(|obj| filter.matches(kind, obj));
    let prev = change.prev.as_ref().filter(|obj| filter.matches(kind, obj));
    let event = match (cur, prev) {
        (Some(cur), None) => json!({"type": "ADDED", "object": cur}),
        (Some(cur), Some(_)) => json!({"type": "MODIFIED", "object": cur}),
        (None, Some(prev)) => {
            let mut obj = prev.clone();
            if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
                meta.insert(
                    "resourceVersion".into(),
                    Value::String(change.rv.to_string()),
                );
            }
            json!({"type": "DELETED", "object": obj})
        }
        (None, None) => return None,
    };
    Some(line(&event))
}

fn line(event: &Value) -> Bytes {
    let mut bytes = serde_json::to_vec(event).unwrap_or_default();
    bytes.push(b'\n');
    Bytes::from(bytes)
}

fn bookmark(kind: Kind, rv: u64, initial_events_end: bool) -> Bytes {
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if initial_events_end {
        metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    line(&json!({
        "type": "BOOKMARK",
        "object": {"kind": kind.kind(), "apiVersion": "v1", "metadata": metadata},
    }))
}

fn gone(message: String) -> Bytes {
    line(
        &json!({"type": "ERROR", "object": status_body(StatusCode::GONE, "Expired", message, None)}),
    )
}

/// Which objects a list or watch selects.
#[derive(Debug, Default)]
struct Filter {
    namespace: Option<String>,
    name: Option<String>,
    fields: Vec<FieldRequirement>,
    labels: Vec<LabelRequirement>,
}

#[derive(Debug, PartialEq)]
struct FieldRequirement {
    field: String,
    equal: bool,
    value: String,
}

#[derive(Debug, PartialEq)]
enum LabelRequirement {
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

impl Filter {
    fn new(
        kind: Kind,
        namespace: Option<&str>,
        name: Option<&str>,
        query: &Query,
    ) -> Result<Filter, String> {
        Ok(Filter {
            namespace: namespace.map(str::to_string),
            name: name.map(str::to_string),
            fields: parse_field_selector(kind, query.get("fieldSelector").unwrap_or_default())?,
            labels: parse_label_selector(query.get("labelSelector").unwrap_or_default())?,
        })
    }

    fn is_unselective(&self) -> bool {
        self.name.is_none() && self.fields.is_empty() && self.labels.is_empty()
    }

    fn matches(&self, kind: Kind, obj: &Value) -> bool {
        let text = |pointer: &str| obj.pointer(pointer).and_then(Value::as_str);
        if self
            .namespace
            .as_deref()
            .is_some_and(|ns| text("/metadata/namespace") != Some(ns))
        {
            return false;
        }
        if self
            .name
            .as_deref()
            .is_some_and(|name| text("/metadata/name") != Some(name))
        {
            return false;
        }
        let fields_match = self.fields.iter().all(|req| {
            let value = kind.field(obj, &req.field).unwrap_or_default();
            (value == req.value) == req.equal
        });
        let label = |key: &str| {
            obj.pointer("/metadata/labels")
                .and_then(|labels| labels.get(key))
                .and_then(Value::as_str)
        };
        fields_match
            && self.labels.iter().all(|req| match req {
                LabelRequirement::Exists(key) => label(key).is_some(),
                LabelRequirement::NotExists(key) => label(key).is_none(),
                LabelRequirement::In(key, values) => {
                    label(key).is_some_and(|v| values.iter().any(|x| x == v))
                }
                LabelRequirement::NotIn(key, values) => {
                    label(key).is_none_or(|v| values.iter().all(|x| x != v))
                }
            })
    }
}

/// `a=b,c!=d` (also `==`); only the fields the real server indexes for the
/// kind.
fn parse_field_selector(kind: Kind, selector: &str) -> Result<Vec<FieldRequirement>, String> {
    let mut out = Vec::new();
    for term in selector.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let (field, equal, value) = if let Some((f, v)) = term.split_once("!=") {
            (f, false, v)
        } else if let Some((f, v)) = term.split_once("==") {
            (f, true, v)
        } else if let Some((f, v)) = term.split_once('=') {
            (f, true, v)
        } else {
            return Err(format!(
                "invalid selector: '{selector}'; can't understand '{term}'"
            ));
        };
        let field = field.trim();
        if kind.field(&Value::Null, field).is_none() {
            return Err(format!("field label not supported: {field}"));
        }
        out.push(FieldRequirement {
            field: field.to_string(),
            equal,
            value: value.trim().to_string(),
        });
    }
    Ok(out)
}

/// Equality (`=`, `==`, `!=`), set (`in`, `notin`) and existence (`k`,
/// `!k`) requirements, comma-separated.
fn parse_label_selector(selector: &str) -> Result<Vec<LabelRequirement>, String> {
    let valid_key = |k: &str| {
        !k.is_empty()
            && k.len() <= 316
            && k.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'/'))
    };
    let valid_value = |v: &str| {
        v.len() <= 63
            && v.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    };
    let invalid = |term: &str| {
        format!("unable to parse requirement: found '{term}', expected: a valid label selector")
    };
    let mut terms = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in selector.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                terms.push(&selector[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&selector[start..]);

    let mut out = Vec::new();
    for term in terms.into_iter().map(str::trim).filter(|t| !t.is_empty()) {
        let requirement = if let Some(key) = term.strip_prefix('!') {
            LabelRequirement::NotExists(key.trim().to_string())
        } else if let Some((head, rest)) = term.split_once('(') {
            let values = rest.strip_suffix(')').ok_or_else(|| invalid(term))?;
            let values: Vec<String> = values.split(',').map(|v| v.trim().to_string()).collect();
            if values.iter().any(|v| !valid_value(v)) {
                return Err(invalid(term));
            }
            let mut words = head.split_whitespace();
            match (words.next(), words.next(), words.next()) {
                (Some(key), Some("in"), None) => LabelRequirement::In(key.to_string(), values),
                (Some(key), Some("notin"), None) => {
                    LabelRequirement::NotIn(key.to_string(), values)
                }
                _ => return Err(invalid(term)),
            }
        } else if let Some((key, value)) = term.split_once("!=") {
            LabelRequirement::NotIn(key.trim().to_string(), vec![value.trim().to_string()])
        } else if let Some((key, value)) = term.split_once("==").or_else(|| term.split_once('=')) {
            LabelRequirement::In(key.trim().to_string(), vec![value.trim().to_string()])
        } else {
            LabelRequirement::Exists(term.to_string())
        };
        let (key, values) = match &requirement {
            LabelRequirement::Exists(k) | LabelRequirement::NotExists(k) => (k, None),
            LabelRequirement::In(k, v) | LabelRequirement::NotIn(k, v) => (k, Some(v)),
        };
        if !valid_key(key) || values.is_some_and(|v| v.iter().any(|v| !valid_value(v))) {
            return Err(invalid(term));
        }
        out.push(requirement);
    }
    Ok(out)
}

/// Continue tokens carry the list's revision and the last key served, like
/// the real server's (`{"v":"meta.k8s.io/v1","rv":N,"start":"ns/name\0"}`);
/// later pages are served from that revision.
fn encode_continue(rv: u64, last: &Key) -> String {
    let token =
        json!({"v": "meta.k8s.io/v1", "rv": rv, "start": format!("{}/{}\u{0}", last.0, last.1)});
    URL_SAFE_NO_PAD.encode(token.to_string())
}

fn decode_continue(token: &str) -> Option<(u64, Option<Key>)> {
    let bytes = URL_SAFE_NO_PAD.decode(token.trim_end_matches('=')).ok()?;
    let value: Value = serde_json::from_slice(&bytes).ok()?;
    if value.get("v")?.as_str()? != "meta.k8s.io/v1" {
        return None;
    }
    let rv = value.get("rv")?.as_u64()?;
    let start = value.get("start")?.as_str()?.strip_suffix('\u{0}')?;
    let (ns, name) = start.split_once('/')?;
    Some((rv, Some((ns.to_string(), name.to_string()))))
}

/// List items go out without `kind`/`apiVersion`, as kube-apiserver sends
/// them for built-in types.
fn without_type_meta(obj: &Value) -> Value {
    let mut obj = obj.clone();
    if let Some(map) = obj.as_object_mut() {
        map.remove("kind");
        map.remove("apiVersion");
    }
    obj
}

/// Query parameters, percent-decoded.
struct Query(HashMap<String, String>);

impl Query {
    fn parse(uri: &Uri) -> Query {
        Query(
            url::form_urlencoded::parse(uri.query().unwrap_or_default().as_bytes())
                .into_owned()
                .collect(),
        )
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// A boolean parameter as Go's strconv.ParseBool reads it.
    fn flag(&self, key: &str) -> bool {
        matches!(
            self.get(key),
            Some("1" | "t" | "T" | "true" | "TRUE" | "True")
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verb {
    Get,
    List,
    Watch,
    Create,
    Update,
    Patch,
    Delete,
    DeleteCollection,
    Other,
}

impl Verb {
    fn as_str(self) -> &'static str {
        match self {
            Verb::Get => "get",
            Verb::List => "list",
            Verb::Watch => "watch",
            Verb::Create => "create",
            Verb::Update => "update",
            Verb::Patch => "patch",
            Verb::Delete => "delete",
            Verb::DeleteCollection => "deletecollection",
            Verb::Other => "proxy",
        }
    }
}

/// A resource request, classified as kube-apiserver's RequestInfoFactory
/// does (`/api/v1/...`, `/apis/GROUP/VERSION/...`, `namespaces/NS/...`,
/// `watch/...`), which is what RBAC decides on.
#[derive(Debug, PartialEq)]
struct RequestInfo {
    verb: Verb,
    group: String,
    version: String,
    namespace: Option<String>,
    resource: String,
    name: Option<String>,
    subresource: Option<String>,
}

impl RequestInfo {
    /// `None` for non-resource URLs (discovery, `/version`, OIDC, ...).
    fn parse(method: &Method, path: &str, query: &Query) -> Option<RequestInfo> {
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (group, version, mut rest) = match parts.as_slice() {
            ["api", version, rest @ ..] if !rest.is_empty() => ("", *version, rest),
            ["apis", group, version, rest @ ..] if !rest.is_empty() => (*group, *version, rest),
            _ => return None,
        };
        let mut watch_prefix = false;
        if rest.first() == Some(&"watch") {
            watch_prefix = true;
            rest = &rest[1..];
        }
        let mut namespace = None;
        if rest.first() == Some(&"namespaces") && rest.len() > 1 {
            namespace = Some(rest[1].to_string());
            if rest.len() > 2 && !matches!(rest[2], "status" | "finalize") {
                rest = &rest[2..];
            }
        }
        let resource = rest.first().filter(|r| !r.is_empty())?.to_string();
        let name = rest.get(1).map(|n| n.to_string());
        let subresource = rest.get(2).map(|s| s.to_string());
        let verb = if watch_prefix {
            Verb::Watch
        } else {
            match *method {
                Method::GET | Method::HEAD if name.is_some() => Verb::Get,
                Method::GET | Method::HEAD if query.flag("watch") => Verb::Watch,
                Method::GET | Method::HEAD => Verb::List,
                Method::POST => Verb::Create,
                Method::PUT => Verb::Update,
                Method::PATCH => Verb::Patch,
                Method::DELETE if name.is_some() => Verb::Delete,
                Method::DELETE => Verb::DeleteCollection,
                _ => Verb::Other,
            }
        };
        Some(RequestInfo {
            verb,
            group: group.to_string(),
            version: version.to_string(),
            namespace,
            resource,
            name,
            subresource,
        })
    }

    /// The token's RBAC: get/list/watch ServiceAccounts and Pods (no
    /// subresources), create TokenReviews. Nothing else.
    fn allowed(&self) -> bool {
        if self.subresource.is_some() {
            return false;
        }
        match (self.group.as_str(), self.resource.as_str()) {
            ("", "serviceaccounts" | "pods" | "namespaces") => {
                matches!(self.verb, Verb::Get | Verb::List | Verb::Watch)
            }
            ("events.k8s.io", "events") => matches!(self.verb, Verb::Create | Verb::Patch),
            ("authentication.k8s.io", "tokenreviews") => self.verb == Verb::Create,
            _ => false,
        }
    }
}

fn forbidden(res: &RequestInfo) -> Response {
    let resource = match &res.subresource {
        Some(sub) => format!("{}/{sub}", res.resource),
        None => res.resource.clone(),
    };
    let subject = match &res.name {
        Some(name) => format!("{} \"{name}\"", res.resource),
        None => res.resource.clone(),
    };
    let scope = match &res.namespace {
        Some(ns) => format!("in the namespace \"{ns}\""),
        None => "at the cluster scope".to_string(),
    };
    let message = format!(
        "{subject} is forbidden: User \"{FAKE_USER}\" cannot {} resource \"{resource}\" in API group \"{}\" {scope}",
        res.verb.as_str(),
        res.group
    );
    let mut details = json!({"kind": res.resource});
    if let Some(name) = &res.name {
        details["name"] = json!(name);
    }
    if !res.group.is_empty() {
        details["group"] = json!(res.group);
    }
    status_error(StatusCode::FORBIDDEN, "Forbidden", message, Some(details))
}

/// The API server's validation of an `events.k8s.io/v1` Event: `None`
/// when valid, else its 422 `Invalid` Status with one cause per field.
fn invalid_event(event: &Value, namespace: &str, name: &str, create: bool) -> Option<Response> {
    let text = |pointer: &str| event.pointer(pointer).and_then(Value::as_str);
    let mut causes = Vec::new();
    let mut cause = |reason: &str, message: String, field: &str| {
        causes.push(json!({"reason": reason, "message": message, "field": field}));
    };
    if name.is_empty() {
        cause(
            "FieldValueRequired",
            "Required value: name or generateName is required".into(),
            "metadata.name",
        );
    }
    match text("/metadata/namespace") {
        Some(ns) if ns != namespace => cause(
            "FieldValueInvalid",
            format!("Invalid value: {ns:?}: does not match the namespace of the request"),
            "metadata.namespace",
        ),
        _ => {}
    }
    if text("/eventTime").is_none() {
        cause("FieldValueRequired", "Required value".into(), "eventTime");
    }
    for field in [
        "reportingController",
        "reportingInstance",
        "action",
        "reason",
    ] {
        match text(&format!("/{field}")) {
            None | Some("") => cause("FieldValueRequired", "Required value".into(), field),
            Some(v) if v.len() > 128 => cause(
                "FieldValueTooLong",
                "Too long: may not be more than 128 bytes".into(),
                field,
            ),
            Some(_) => {}
        }
    }
    match text("/type") {
        Some("Normal" | "Warning") => {}
        other => cause(
            "FieldValueNotSupported",
            format!(
                "Unsupported value: {:?}: supported values: \"Normal\", \"Warning\"",
                other.unwrap_or("")
            ),
            "type",
        ),
    }
    if text("/note").is_some_and(|n| n.len() > 1024) {
        cause(
            "FieldValueTooLong",
            "Too long: may not be more than 1024 bytes".into(),
            "note",
        );
    }
    if event.get("regarding").is_none_or(Value::is_null) {
        cause("FieldValueRequired", "Required value".into(), "regarding");
    }
    if let Some(ns) = text("/regarding/namespace") {
        if ns != namespace {
            cause(
                "FieldValueInvalid",
                format!("Invalid value: {ns:?}: does not match event.namespace"),
                "regarding.namespace",
            );
        }
    }
    if create && event.get("series").is_some_and(|s| !s.is_null()) {
        let count = event
            .pointer("/series/count")
            .and_then(Value::as_i64)
            .unwrap_or(0);
        if count < 2 {
            cause(
                "FieldValueInvalid",
                format!("Invalid value: {count}: should be at least 2"),
                "series.count",
            );
        }
    }
    if causes.is_empty() {
        return None;
    }
    let summary = causes
        .iter()
        .map(|c| {
            format!(
                "{}: {}",
                c["field"].as_str().unwrap_or(""),
                c["message"].as_str().unwrap_or("")
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    Some(status_error(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Invalid",
        format!("Event.events.k8s.io \"{name}\" is invalid: [{summary}]"),
        Some(json!({"name": name, "group": "events.k8s.io", "kind": "Event", "causes": causes})),
    ))
}

fn status_body(code: StatusCode, reason: &str, message: String, details: Option<Value>) -> Value {
    let mut body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    if let Some(details) = details {
        body["details"] = details;
    }
    body
}

fn status_error(
    code: StatusCode,
    reason: &str,
    message: String,
    details: Option<Value>,
) -> Response {
    json_response(code, &status_body(code, reason, message, details))
}

fn not_found(kind: Kind, name: &str) -> Response {
    status_error(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("{} \"{name}\" not found", kind.plural()),
        Some(json!({"name": name, "kind": kind.plural()})),
    )
}

fn not_found_path() -> Response {
    status_error(
        StatusCode::NOT_FOUND,
        "NotFound",
        "the server could not find the requested resource".into(),
        Some(
            json!({"causes": [{"reason": "UnexpectedServerResponse", "message": "404 page not found"}]}),
        ),
    )
}

fn bad_request(message: String) -> Response {
    status_error(StatusCode::BAD_REQUEST, "BadRequest", message, None)
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    json_response_bytes(status, Bytes::from(body.to_string()))
}

fn json_response_bytes(status: StatusCode, body: Bytes) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn version_info() -> Value {
    json!({
        "major": "1",
        "minor": "33",
        "emulationMajor": "1",
        "emulationMinor": "33",
        "minCompatibilityMajor": "1",
        "minCompatibilityMinor": "32",
        "gitVersion": "v1.33.0",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2025-04-23T00:00:00Z",
        "goVersion": "go1.24.2",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}

fn authentication_group() -> Value {
    let version = json!({"groupVersion": "authentication.k8s.io/v1", "version": "v1"});
    json!({"name": "authentication.k8s.io", "versions": [version], "preferredVersion": version})
}

/// Discovery lists what a real server serves, not what the caller may do,
/// so that kubectl resolves `secrets` and then meets RBAC's 403.
fn core_v1_resources() -> Value {
    let all = [
        "create",
        "delete",
        "deletecollection",
        "get",
        "list",
        "patch",
        "update",
        "watch",
    ];
    let resource = |name: &str, singular: &str, namespaced: bool, kind: &str, short: &[&str]| {
        let mut r = json!({
            "name": name, "singularName": singular, "namespaced": namespaced,
            "kind": kind, "verbs": all,
        });
        if !short.is_empty() {
            r["shortNames"] = json!(short);
        }
        r
    };
    let mut pods = resource("pods", "pod", true, "Pod", &["po"]);
    pods["categories"] = json!(["all"]);
    json!({
        "kind": "APIResourceList",
        "groupVersion": "v1",
        "resources": [
            resource("configmaps", "configmap", true, "ConfigMap", &["cm"]),
            resource("namespaces", "namespace", false, "Namespace", &["ns"]),
            resource("nodes", "node", false, "Node", &["no"]),
            pods,
            {"name": "pods/status", "singularName": "", "namespaced": true, "kind": "Pod", "verbs": ["get", "patch", "update"]},
            resource("secrets", "secret", true, "Secret", &[]),
            resource("serviceaccounts", "serviceaccount", true, "ServiceAccount", &["sa"]),
            {"name": "serviceaccounts/token", "singularName": "", "namespaced": true,
             "group": "authentication.k8s.io", "version": "v1", "kind": "TokenRequest", "verbs": ["create"]},
        ],
    })
}

fn authentication_v1_resources() -> Value {
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": "authentication.k8s.io/v1",
        "resources": [
            {"name": "selfsubjectreviews", "singularName": "selfsubjectreview", "namespaced": false, "kind": "SelfSubjectReview", "verbs": ["create"]},
            {"name": "tokenreviews", "singularName": "tokenreview", "namespaced": false, "kind": "TokenReview", "verbs": ["create"]},
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use lanyard::emulator::{Issuer, SigningKey};

    fn query(q: &str) -> Query {
        Query::parse(&format!("/x?{q}").parse::<Uri>().unwrap())
    }

    fn info(method: Method, path: &str) -> Option<RequestInfo> {
        RequestInfo::parse(&method, path, &query(""))
    }

    #[test]
    fn request_info_classifies_like_the_apiserver() {
        let sa = info(Method::GET, "/api/v1/namespaces/ns1/serviceaccounts/sa1").unwrap();
        assert_eq!(
            (
                sa.verb,
                sa.namespace.as_deref(),
                sa.resource.as_str(),
                sa.name.as_deref()
            ),
            (Verb::Get, Some("ns1"), "serviceaccounts", Some("sa1"))
        );
        assert_eq!(info(Method::GET, "/api/v1/pods").unwrap().verb, Verb::List);
        let watch = RequestInfo::parse(&Method::GET, "/api/v1/pods", &query("watch=true")).unwrap();
        assert_eq!(watch.verb, Verb::Watch);
        assert_eq!(
            info(Method::GET, "/api/v1/watch/namespaces/a/pods")
                .unwrap()
                .verb,
            Verb::Watch
        );
        let token = info(Method::POST, "/api/v1/namespaces/a/serviceaccounts/b/token").unwrap();
        assert_eq!(token.subresource.as_deref(), Some("token"));
        assert!(!token.allowed(), "TokenRequest must be forbidden");
        let ns = info(Method::GET, "/api/v1/namespaces/kube-system").unwrap();
        assert_eq!(
            (ns.resource.as_str(), ns.name.as_deref()),
            ("namespaces", Some("kube-system"))
        );
        let review = info(Method::POST, "/apis/authentication.k8s.io/v1/tokenreviews").unwrap();
        assert!(review.allowed());
        assert!(info(Method::GET, "/api/v1").is_none());
        assert!(info(Method::GET, "/apis/authentication.k8s.io/v1").is_none());
        assert!(info(Method::GET, "/version").is_none());
    }

    #[test]
    fn rbac_is_least_privilege() {
        let allowed = |m: Method, p: &str| RequestInfo::parse(&m, p, &query("")).unwrap().allowed();
        assert!(allowed(Method::GET, "/api/v1/serviceaccounts"));
        assert!(allowed(Method::GET, "/api/v1/namespaces"));
        assert!(allowed(Method::GET, "/api/v1/namespaces/team-a"));
        assert!(allowed(
            Method::POST,
            "/apis/events.k8s.io/v1/namespaces/a/events"
        ));
        assert!(allowed(
            Method::PATCH,
            "/apis/events.k8s.io/v1/namespaces/a/events/e"
        ));
        assert!(
            !allowed(Method::POST, "/api/v1/namespaces/a/events"),
            "core events: no"
        );
        assert!(!allowed(
            Method::DELETE,
            "/apis/events.k8s.io/v1/namespaces/a/events/e"
        ));
        assert!(
            !allowed(Method::POST, "/api/v1/namespaces"),
            "no namespace writes"
        );
        assert!(allowed(Method::GET, "/api/v1/namespaces/a/pods/b"));
        assert!(!allowed(Method::GET, "/api/v1/secrets"));
        assert!(!allowed(Method::GET, "/api/v1/namespaces/a/pods/b/log"));
        assert!(!allowed(
            Method::POST,
            "/api/v1/namespaces/a/serviceaccounts"
        ));
        assert!(!allowed(Method::DELETE, "/api/v1/namespaces/a/pods/b"));
        assert!(!allowed(Method::PATCH, "/api/v1/namespaces/a/pods/b"));
        assert!(!allowed(
            Method::GET,
            "/apis/authentication.k8s.io/v1/tokenreviews"
        ));
        assert!(!allowed(
            Method::POST,
            "/apis/authorization.k8s.io/v1/subjectaccessreviews"
        ));
    }

    async fn body(resp: Response) -> Value {
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[tokio::test]
    async fn forbidden_message_names_user_verb_resource_and_scope() {
        let res = info(Method::POST, "/api/v1/namespaces/x/serviceaccounts/y/token").unwrap();
        let resp = forbidden(&res);
        assert_eq!(resp.status(), StatusCode::FORBIDDEN);
        let status = body(resp).await;
        assert_eq!(
            status["message"],
            format!("serviceaccounts \"y\" is forbidden: User \"{FAKE_USER}\" cannot create resource \"serviceaccounts/token\" in API group \"\" in the namespace \"x\"")
        );
        assert_eq!(
            (status["reason"].as_str(), status["code"].as_u64()),
            (Some("Forbidden"), Some(403))
        );
        assert_eq!(
            status["details"],
            json!({"kind": "serviceaccounts", "name": "y"})
        );

        let res = info(Method::GET, "/api/v1/secrets").unwrap();
        let status = body(forbidden(&res)).await;
        assert_eq!(
            status["message"],
            format!("secrets is forbidden: User \"{FAKE_USER}\" cannot list resource \"secrets\" in API group \"\" at the cluster scope")
        );
    }

    #[test]
    fn field_selectors() {
        let pod =
            json!({"metadata": {"name": "p", "namespace": "n"}, "spec": {"nodeName": "node-a"}});
        let unscheduled = json!({"metadata": {"name": "q", "namespace": "n"}, "spec": {}});
        let sel = |s: &str| Filter {
            fields: parse_field_selector(Kind::Pod, s).unwrap(),
            ..Filter::default()
        };
        assert!(sel("spec.nodeName=node-a").matches(Kind::Pod, &pod));
        assert!(!sel("spec.nodeName=node-b").matches(Kind::Pod, &pod));
        assert!(sel("spec.nodeName=").matches(Kind::Pod, &unscheduled));
        assert!(sel("spec.nodeName!=node-a").matches(Kind::Pod, &unscheduled));
        assert!(sel("metadata.name==p,spec.nodeName=node-a").matches(Kind::Pod, &pod));
        assert!(!sel("metadata.name==p,spec.nodeName=node-b").matches(Kind::Pod, &pod));
        assert!(
            parse_field_selector(Kind::ServiceAccount, "spec.nodeName=a")
                .unwrap_err()
                .contains("field label not supported")
        );
        assert!(parse_field_selector(Kind::Pod, "spec.nodeName").is_err());
    }

    #[test]
    fn label_selectors() {
        let obj = json!({"metadata": {"labels": {"app": "web", "tier": "front"}}});
        let sel = |s: &str| Filter {
            labels: parse_label_selector(s).unwrap(),
            ..Filter::default()
        };
        for yes in [
            "app=web",
            "app==web",
            "app",
            "!missing",
            "app in (api, web)",
            "tier notin (back),app",
            "app!=api",
            "missing!=x",
        ] {
            assert!(sel(yes).matches(Kind::Pod, &obj), "{yes} should match");
        }
        for no in [
            "app=api",
            "missing",
            "!app",
            "app in (api,db)",
            "app notin (web)",
            "app=web,tier=back",
        ] {
            assert!(!sel(no).matches(Kind::Pod, &obj), "{no} should not match");
        }
        assert_eq!(
            parse_label_selector("a in (x,y),b").unwrap(),
            vec![
                LabelRequirement::In("a".into(), vec!["x".into(), "y".into()]),
                LabelRequirement::Exists("b".into())
            ]
        );
        assert!(parse_label_selector("a in (x").is_err());
        assert!(parse_label_selector("a b=c").is_err());
    }

    fn change(rv: u64, prev: Option<Value>, cur: Option<Value>) -> Change {
        Change {
            rv,
            kind: Kind::Pod,
            key: ("n".into(), "p".into()),
            prev,
            cur,
        }
    }

    fn event_type(bytes: Option<Bytes>) -> Option<String> {
        let v: Value = serde_json::from_slice(&bytes?).unwrap();
        Some(v["type"].as_str().unwrap().to_string())
    }

    #[test]
    fn selector_transitions_become_added_and_deleted() {
        let on = |node: &str| json!({"kind": "Pod", "metadata": {"name": "p", "namespace": "n", "resourceVersion": "1"}, "spec": {"nodeName": node}});
        let filter = Filter {
            fields: parse_field_selector(Kind::Pod, "spec.nodeName=a").unwrap(),
            ..Filter::default()
        };
        assert_eq!(
            event_type(render(&change(2, None, Some(on("a"))), Kind::Pod, &filter)).as_deref(),
            Some("ADDED")
        );
        assert_eq!(
            event_type(render(
                &change(2, Some(on("")), Some(on("a"))),
                Kind::Pod,
                &filter
            ))
            .as_deref(),
            Some("ADDED")
        );
        assert_eq!(
            event_type(render(
                &change(2, Some(on("a")), Some(on("a"))),
                Kind::Pod,
                &filter
            ))
            .as_deref(),
            Some("MODIFIED")
        );
        let left = render(&change(7, Some(on("a")), Some(on("b"))), Kind::Pod, &filter).unwrap();
        let left: Value = serde_json::from_slice(&left).unwrap();
        assert_eq!(left["type"], "DELETED");
        assert_eq!(left["object"]["metadata"]["resourceVersion"], "7");
        assert_eq!(left["object"]["spec"]["nodeName"], "a");
        assert_eq!(
            render(&change(2, Some(on("b")), Some(on("c"))), Kind::Pod, &filter),
            None
        );
        assert_eq!(
            render(
                &change(2, None, Some(on("a"))),
                Kind::ServiceAccount,
                &Filter::default()
            ),
            None
        );
    }

    #[test]
    fn continue_tokens_round_trip_and_reject_garbage() {
        let key = ("ns".to_string(), "name".to_string());
        let token = encode_continue(42, &key);
        assert_eq!(decode_continue(&token), Some((42, Some(key))));
        assert_eq!(decode_continue("not base64!"), None);
        assert_eq!(decode_continue(&URL_SAFE_NO_PAD.encode("{\"rv\":1}")), None);
    }

    fn fake() -> Arc<FakeKube> {
        let issuer = Issuer::new("https://issuer.test", SigningKey::generate_es256().unwrap());
        FakeKube::new(issuer.url(), issuer.key().jwk(), "t")
    }

    fn sa(name: &str) -> ServiceAccount {
        ServiceAccount {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..ObjectMeta::default()
            },
            ..ServiceAccount::default()
        }
    }

    #[test]
    fn apply_fills_metadata_and_skips_no_ops() {
        let fake = fake();
        let first = fake.apply_service_account(sa("a"));
        assert_eq!(first.metadata.resource_version.as_deref(), Some("1"));
        let uid = first.metadata.uid.clone().unwrap();
        assert!(first.metadata.creation_timestamp.is_some());
        // Re-applying the same content changes nothing.
        let again = fake.apply_service_account(sa("a"));
        assert_eq!(again.metadata.resource_version.as_deref(), Some("1"));
        assert_eq!(again.metadata.uid.as_deref(), Some(uid.as_str()));
        assert_eq!(fake.resource_version(), 1);
        // A change keeps the uid and bumps the version.
        let mut changed = sa("a");
        changed.metadata.annotations = Some([("k".to_string(), "v".to_string())].into());
        let changed = fake.apply_service_account(changed);
        assert_eq!(changed.metadata.resource_version.as_deref(), Some("2"));
        assert_eq!(changed.metadata.uid.as_deref(), Some(uid.as_str()));
        // Another uid is a delete and a create.
        let mut other = sa("a");
        other.metadata.uid = Some("other-uid".into());
        let other = fake.apply_service_account(other);
        assert_eq!(other.metadata.resource_version.as_deref(), Some("4"));
        assert!(fake.delete_service_account("ns", "a"));
        assert!(!fake.delete_service_account("ns", "a"));
        assert_eq!(fake.resource_version(), 5);
    }

    #[test]
    fn snapshots_rewind_history_and_expire_after_compaction() {
        let fake = fake();
        fake.apply_service_account(sa("a")); // 1
        fake.apply_service_account(sa("b")); // 2
        fake.delete_service_account("ns", "a"); // 3
        let names = |at: u64| {
            fake.lock()
                .snapshot(Kind::ServiceAccount, at)
                .map(|m| m.keys().map(|k| k.1.clone()).collect::<Vec<_>>())
        };
        assert_eq!(names(0), Some(vec![]));
        assert_eq!(names(1), Some(vec!["a".to_string()]));
        assert_eq!(names(2), Some(vec!["a".to_string(), "b".to_string()]));
        assert_eq!(names(3), Some(vec!["b".to_string()]));
        fake.compact();
        assert_eq!(names(2), None);
        assert_eq!(names(3), Some(vec!["b".to_string()]));
    }

    #[test]
    fn kubeconfig_is_yaml_with_server_and_token() {
        let fake = fake();
        let config: Value =
            serde_norway::from_str(&fake.kubeconfig("http://127.0.0.1:1234")).unwrap();
        assert_eq!(
            config["clusters"][0]["cluster"]["server"],
            "http://127.0.0.1:1234"
        );
        assert_eq!(config["users"][0]["user"]["token"], "t");
        assert_eq!(config["current-context"], "lanyard-fake");
        assert_eq!(config["contexts"][0]["context"]["namespace"], "default");
    }

    #[test]
    fn events_are_validated_like_the_apiserver() {
        let valid = json!({
            "metadata": {"name": "p.1", "namespace": "a"},
            "eventTime": "2026-12-02T00:00:00.000000Z",
            "reportingController": "c", "reportingInstance": "i",
            "action": "A", "reason": "R", "type": "Warning", "note": "n",
            "regarding": {"kind": "Pod", "namespace": "a", "name": "p"},
        });
        assert!(invalid_event(&valid, "a", "p.1", true).is_none());
        let mut missing = valid.clone();
        for field in [
            "eventTime",
            "reportingController",
            "action",
            "reason",
            "regarding",
        ] {
            missing.as_object_mut().unwrap().remove(field);
        }
        missing["type"] = json!("Error");
        missing["note"] = json!("x".repeat(2000));
        let response = invalid_event(&missing, "a", "p.1", true).expect("invalid");
        assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY);
        let mut other_ns = valid.clone();
        other_ns["regarding"]["namespace"] = json!("b");
        assert!(invalid_event(&other_ns, "a", "p.1", true).is_some());
    }
}
