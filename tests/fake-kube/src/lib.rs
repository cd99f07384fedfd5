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

mod admission;
mod api;
mod events;
pub mod mesh_injector;
pub mod rbac;
mod request;
mod responses;
mod selectors;
mod token_review;
mod watches;

pub use admission::User;
use api::*;
use request::*;
use responses::*;
use selectors::*;

/// The user the static token authenticates as; it appears in `Forbidden`
/// messages exactly where kube-apiserver puts the caller's name.
pub const FAKE_USER: &str = "system:serviceaccount:kube-system:lanyard";
/// The user an admin token authenticates as (`system:masters`), as a
/// cluster's administrator kubeconfig does.
pub const ADMIN_USER: &str = "kubernetes-admin";

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
    /// The administrator's token, when set ([`FakeKube::set_admin_token`]).
    admin_token: std::sync::RwLock<Option<SecretString>>,
    /// The registered admission configurations and webhook endpoints.
    admission: Mutex<admission::Registry>,
    /// ClusterRoles and ClusterRoleBindings, for access reviews.
    rbac: Mutex<rbac::Rbac>,
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
            admin_token: std::sync::RwLock::new(None),
            admission: Mutex::new(admission::Registry::default()),
            rbac: Mutex::new(rbac::Rbac::default()),
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

    /// Accepts `token` as the cluster administrator's (`ADMIN_USER`, in
    /// `system:masters`): it may do anything the fake serves, and pods it
    /// writes through the API go through admission (see the `admission`
    /// module). Lanyard's own token keeps its least privilege.
    pub fn set_admin_token(&self, token: &str) {
        *self.admin_token.write().unwrap_or_else(|p| p.into_inner()) =
            Some(SecretString::from(token.to_string()));
    }

    /// A kubeconfig like [`FakeKube::kubeconfig`] for the administrator
    /// (`None` before [`FakeKube::set_admin_token`]).
    pub fn admin_kubeconfig(&self, server_url: &str) -> Option<String> {
        let admin = self.admin_token.read().unwrap_or_else(|p| p.into_inner());
        let doc = json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "lanyard-fake", "cluster": {"server": server_url}}],
            "users": [{"name": "admin", "user": {"token": admin.as_ref()?.expose_secret()}}],
            "contexts": [{
                "name": "admin",
                "context": {"cluster": "lanyard-fake", "user": "admin", "namespace": "default"},
            }],
            "current-context": "admin",
            "preferences": {},
        });
        serde_norway::to_string(&doc).ok()
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

    /// The stored object of `kind` at `namespace/name` (`""` for a
    /// cluster-scoped one), as JSON.
    fn stored_value(&self, kind: Kind, namespace: &str, name: &str) -> Option<Value> {
        let key = (namespace.to_string(), name.to_string());
        self.lock().objects[kind.index()].get(&key).cloned()
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
    /// rotated ([`lanyard_emulators::Issuer::rotate`] and its `jwks()`).
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

    /// Stores a ClusterRole (replacing one of the same name).
    pub fn apply_cluster_role(
        &self,
        role: k8s_openapi::api::rbac::v1::ClusterRole,
    ) -> Result<k8s_openapi::api::rbac::v1::ClusterRole, String> {
        self.rbac_lock().apply_role(role)
    }

    /// Stores a ClusterRoleBinding, refused as the API server refuses one
    /// whose `roleRef` is not a ClusterRole.
    pub fn apply_cluster_role_binding(
        &self,
        binding: k8s_openapi::api::rbac::v1::ClusterRoleBinding,
    ) -> Result<k8s_openapi::api::rbac::v1::ClusterRoleBinding, String> {
        self.rbac_lock().apply_binding(binding)
    }

    /// Removes a ClusterRole; `false` if there was none.
    pub fn delete_cluster_role(&self, name: &str) -> bool {
        self.rbac_lock().delete_role(name)
    }

    /// Removes a ClusterRoleBinding; `false` if there was none.
    pub fn delete_cluster_role_binding(&self, name: &str) -> bool {
        self.rbac_lock().delete_binding(name)
    }

    /// RBAC's answer to an access review at the cluster scope: whether the
    /// stored ClusterRoleBindings grant `user` what `attrs` asks.
    pub fn authorize(&self, user: &admission::User, attrs: &rbac::Attributes<'_>) -> bool {
        self.rbac_lock().allows(user, attrs)
    }

    fn rbac_lock(&self) -> std::sync::MutexGuard<'_, rbac::Rbac> {
        self.rbac.lock().unwrap_or_else(|e| e.into_inner())
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
}

#[cfg(test)]
mod tests {
    use super::events::*;
    use super::watches::*;
    use super::*;
    use lanyard_emulators::{Issuer, SigningKey};

    fn lanyard_user() -> User {
        User {
            name: FAKE_USER.into(),
            groups: vec!["system:authenticated".into()],
        }
    }

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
        assert!(
            !token.allowed(&lanyard_user()),
            "TokenRequest must be forbidden"
        );
        let ns = info(Method::GET, "/api/v1/namespaces/kube-system").unwrap();
        assert_eq!(
            (ns.resource.as_str(), ns.name.as_deref()),
            ("namespaces", Some("kube-system"))
        );
        let review = info(Method::POST, "/apis/authentication.k8s.io/v1/tokenreviews").unwrap();
        assert!(review.allowed(&lanyard_user()));
        assert!(info(Method::GET, "/api/v1").is_none());
        assert!(info(Method::GET, "/apis/authentication.k8s.io/v1").is_none());
        assert!(info(Method::GET, "/version").is_none());
    }

    #[test]
    fn rbac_is_least_privilege() {
        let allowed = |m: Method, p: &str| {
            RequestInfo::parse(&m, p, &query(""))
                .unwrap()
                .allowed(&lanyard_user())
        };
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
        let resp = forbidden(&res, &lanyard_user());
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
        let status = body(forbidden(&res, &lanyard_user())).await;
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
