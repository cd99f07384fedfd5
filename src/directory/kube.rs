//! Bindings from the Kubernetes API: a reflector over ServiceAccounts (all
//! namespaces) and one over the pods of this node. Lookups are answered
//! from memory; a ServiceAccount the reflector has not seen yet (created a
//! moment ago) is fetched directly. Annotation changes and deletions reach
//! the credential cache through a callback, so a removed binding stops
//! being served at once.
//!
//! For policies, the labels and annotations of ServiceAccounts, the labels
//! of this node's pods and (when a policy is configured) of namespaces are
//! kept as shared snapshots, so a decision reads them without copying.
//!
//! Needs `get/list/watch` on serviceaccounts and pods, and on namespaces
//! when a policy is configured; nothing more.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, ResourceExt};

use super::{Attributes, Bindings, Directory, DirectoryError, Metadata, PodCheck};

/// Called with (namespace, name) when a ServiceAccount's bindings change
/// or it is deleted, and with a pod uid when a pod of this node is gone.
pub struct Invalidate {
    /// Called when a ServiceAccount's bindings change or it is deleted.
    pub service_account: ServiceAccountHook,
    /// Called when a pod of this node is deleted.
    pub pod: PodHook,
}

/// A callback taking a ServiceAccount's namespace and name; it runs on the
/// watch task, so it must not block.
pub type ServiceAccountHook = Box<dyn Fn(&str, &str) + Send + Sync>;
/// A callback taking a pod's uid; it runs on the watch task, so it must not
/// block.
pub type PodHook = Box<dyn Fn(&str) + Send + Sync>;

/// Bindings and pod liveness from the Kubernetes API.
pub struct KubeDirectory {
    client: Client,
    service_accounts: Store<ServiceAccount>,
    pods: Option<Store<Pod>>,
    /// This node, whose pods `pods` holds.
    node_name: Option<String>,
    known: Arc<Mutex<HashMap<Key, Known>>>,
    pod_labels: Arc<Mutex<HashMap<Key, Metadata>>>,
    namespace_labels: Option<Arc<Mutex<HashMap<String, Metadata>>>>,
}

type Key = (String, String);

/// What is kept of a ServiceAccount: its bindings (to notice changes) and
/// its labels and annotations (for policies), shared.
#[derive(Clone)]
struct Known {
    bindings: Bindings,
    labels: Metadata,
    annotations: Metadata,
}

/// What the agent watches besides ServiceAccounts.
#[derive(Debug, Clone, Default)]
pub struct Watch {
    /// This node's name: its pods are watched (liveness, labels).
    pub node_name: Option<String>,
    /// Whether namespaces are watched (for their labels; a policy needs them).
    pub namespaces: bool,
}

impl KubeDirectory {
    /// Starts the reflectors (pods only when the node name is known,
    /// namespaces only when asked) and waits until their first list is in
    /// memory.
    pub async fn start(
        client: Client,
        watch: Watch,
        invalidate: Arc<Invalidate>,
    ) -> anyhow::Result<KubeDirectory> {
        let (sa_store, sa_writer) = reflector::store::<ServiceAccount>();
        let sa_api: Api<ServiceAccount> = Api::all(client.clone());
        let known: Arc<Mutex<HashMap<Key, Known>>> = Arc::default();
        let known_by_watch = known.clone();
        let inv = invalidate.clone();
        let stream = reflector::reflector(
            sa_writer,
            watcher::watcher(sa_api, watcher::Config::default().any_semantic()),
        )
        .default_backoff();
        tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            let mut relisted: Option<HashSet<Key>> = None;
            while let Some(event) = stream.next().await {
                match event {
                    Ok(event) => {
                        track_service_accounts(event, &known_by_watch, &mut relisted, &inv)
                    }
                    Err(e) => tracing::warn!(error = %e, "ServiceAccount watch failed; retrying"),
                }
            }
        });

        let pod_labels: Arc<Mutex<HashMap<Key, Metadata>>> = Arc::default();
        let node_name = watch.node_name.clone();
        let pods = match watch.node_name {
            Some(node) => {
                let (pod_store, pod_writer) = reflector::store::<Pod>();
                let pod_api: Api<Pod> = Api::all(client.clone());
                let config = watcher::Config::default()
                    .any_semantic()
                    .fields(&format!("spec.nodeName={node}"));
                let stream = reflector::reflector(pod_writer, watcher::watcher(pod_api, config))
                    .default_backoff();
                let inv = invalidate.clone();
                let labels = LabelIndex::new(pod_labels.clone());
                tokio::spawn(async move {
                    let mut stream = std::pin::pin!(stream);
                    let key_of = |pod: &Pod| (pod.namespace().unwrap_or_default(), pod.name_any());
                    let mut labels = labels;
                    while let Some(event) = stream.next().await {
                        match event {
                            Ok(event) => {
                                if let Event::Delete(pod) = &event {
                                    if let Some(uid) = pod.uid() {
                                        (inv.pod)(&uid);
                                    }
                                }
                                labels.track(&event, key_of);
                            }
                            Err(e) => tracing::warn!(error = %e, "pod watch failed; retrying"),
                        }
                    }
                });
                Some(pod_store)
            }
            None => None,
        };

        let namespaces = match watch.namespaces {
            true => {
                let (ns_store, ns_writer) = reflector::store::<Namespace>();
                let ns_api: Api<Namespace> = Api::all(client.clone());
                let stream = reflector::reflector(
                    ns_writer,
                    watcher::watcher(ns_api, watcher::Config::default().any_semantic()),
                )
                .default_backoff();
                let map: Arc<Mutex<HashMap<String, Metadata>>> = Arc::default();
                let mut labels = LabelIndex::new(map.clone());
                tokio::spawn(async move {
                    let mut stream = std::pin::pin!(stream);
                    while let Some(event) = stream.next().await {
                        match event {
                            Ok(event) => labels.track(&event, |ns: &Namespace| ns.name_any()),
                            Err(e) => {
                                tracing::warn!(error = %e, "namespace watch failed; retrying")
                            }
                        }
                    }
                });
                Some((ns_store, map))
            }
            false => None,
        };

        let wait = async {
            sa_store.wait_until_ready().await?;
            if let Some(p) = &pods {
                p.wait_until_ready().await?;
            }
            if let Some((n, _)) = &namespaces {
                n.wait_until_ready().await?;
            }
            Ok::<_, reflector::store::WriterDropped>(())
        };
        match tokio::time::timeout(std::time::Duration::from_secs(30), wait).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => anyhow::bail!("Kubernetes watch ended before its first list: {e}"),
            Err(_) => anyhow::bail!(
                "no initial list of serviceaccounts/pods/namespaces from the Kubernetes API within 30 s (check the API server address and that the agent may get/list/watch serviceaccounts and pods, and namespaces when a policy is configured)"
            ),
        }
        Ok(KubeDirectory {
            client,
            service_accounts: sa_store,
            pods,
            node_name,
            known,
            pod_labels,
            namespace_labels: namespaces.map(|(_, map)| map),
        })
    }
}

/// Labels of watched objects by key, kept current from watch events: a
/// relist replaces the whole map when it is done, so objects deleted while
/// the watch was down go too.
struct LabelIndex<K> {
    map: Arc<Mutex<HashMap<K, Metadata>>>,
    relisting: Option<HashMap<K, Metadata>>,
}

impl<K: std::hash::Hash + Eq> LabelIndex<K> {
    fn new(map: Arc<Mutex<HashMap<K, Metadata>>>) -> Self {
        LabelIndex {
            map,
            relisting: None,
        }
    }

    fn track<T: ResourceExt>(&mut self, event: &Event<T>, key_of: impl Fn(&T) -> K) {
        match event {
            Event::Apply(o) => {
                let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
                map.insert(key_of(o), Metadata::from(o.labels()));
            }
            Event::Delete(o) => {
                let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
                map.remove(&key_of(o));
            }
            Event::Init => self.relisting = Some(HashMap::new()),
            Event::InitApply(o) => {
                let entry = (key_of(o), Metadata::from(o.labels()));
                match self.relisting.as_mut() {
                    Some(next) => {
                        next.insert(entry.0, entry.1);
                    }
                    None => {
                        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
                        map.insert(entry.0, entry.1);
                    }
                }
            }
            Event::InitDone => {
                if let Some(next) = self.relisting.take() {
                    *self.map.lock().unwrap_or_else(|p| p.into_inner()) = next;
                }
            }
        }
    }
}

/// Keeps the last-seen bindings per ServiceAccount and invalidates cache
/// entries when they change or the account goes away (including accounts
/// that vanished while the watch was down, found at the next relist).
fn track_service_accounts(
    event: Event<ServiceAccount>,
    known: &Mutex<HashMap<Key, Known>>,
    relisted: &mut Option<HashSet<Key>>,
    invalidate: &Invalidate,
) {
    let key_of = |sa: &ServiceAccount| (sa.namespace().unwrap_or_default(), sa.name_any());
    let mut known = known.lock().unwrap_or_else(|p| p.into_inner());
    let apply = |sa: &ServiceAccount, known: &mut HashMap<Key, Known>| {
        let key = key_of(sa);
        let bindings = Bindings::from_annotations(sa.annotations());
        let entry = Known {
            bindings: bindings.clone(),
            labels: Metadata::from(sa.labels()),
            annotations: Metadata::from(sa.annotations()),
        };
        if let Some(previous) = known.insert(key.clone(), entry) {
            if previous.bindings != bindings {
                tracing::info!(namespace = %key.0, service_account = %key.1, "bindings changed");
                (invalidate.service_account)(&key.0, &key.1);
            }
        }
        key
    };
    match event {
        Event::Apply(sa) => {
            apply(&sa, &mut known);
        }
        Event::Delete(sa) => {
            let key = key_of(&sa);
            known.remove(&key);
            (invalidate.service_account)(&key.0, &key.1);
        }
        Event::Init => *relisted = Some(HashSet::new()),
        Event::InitApply(sa) => {
            let key = apply(&sa, &mut known);
            if let Some(seen) = relisted.as_mut() {
                seen.insert(key);
            }
        }
        Event::InitDone => {
            if let Some(seen) = relisted.take() {
                let gone: Vec<Key> = known
                    .keys()
                    .filter(|k| !seen.contains(*k))
                    .cloned()
                    .collect();
                for key in gone {
                    known.remove(&key);
                    (invalidate.service_account)(&key.0, &key.1);
                }
            }
        }
    }
}

impl KubeDirectory {
    /// The ServiceAccount `namespace/name`: from the watch, or read when
    /// the watch has not seen it yet (created a moment ago, or absent).
    async fn service_account(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Arc<ServiceAccount>>, DirectoryError> {
        let key = ObjectRef::new(name).within(namespace);
        if let Some(sa) = self.service_accounts.get(&key) {
            return Ok(Some(sa));
        }
        let api: Api<ServiceAccount> = Api::namespaced(self.client.clone(), namespace);
        tokio::time::timeout(crate::http::KUBE_REQUEST_TIMEOUT, api.get_opt(name))
            .await
            .map_err(|_| {
                DirectoryError(format!(
                    "reading serviceaccount {namespace}/{name}: timed out"
                ))
            })?
            .map(|found| found.map(Arc::new))
            .map_err(|e| DirectoryError(format!("reading serviceaccount {namespace}/{name}: {e}")))
    }
}

#[async_trait::async_trait]
impl Directory for KubeDirectory {
    async fn lookup(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Arc<Bindings>>, DirectoryError> {
        let sa = self.service_account(namespace, name).await?;
        Ok(sa.map(|sa| Arc::new(Bindings::from_annotations(sa.annotations()))))
    }

    async fn service_account_uid(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<String>, DirectoryError> {
        let sa = self.service_account(namespace, name).await?;
        Ok(sa.and_then(|sa| sa.uid()))
    }

    async fn attributes(
        &self,
        namespace: &str,
        service_account: &str,
        pod: &str,
    ) -> Result<Attributes, DirectoryError> {
        let key = |name: &str| (namespace.to_string(), name.to_string());
        let mut attributes = Attributes::default();
        {
            let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(k) = known.get(&key(service_account)) {
                attributes.service_account_labels = k.labels.clone();
                attributes.service_account_annotations = k.annotations.clone();
            }
        }
        {
            let pods = self.pod_labels.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(labels) = pods.get(&key(pod)) {
                attributes.pod_labels = labels.clone();
            }
        }
        if let Some(namespaces) = &self.namespace_labels {
            let namespaces = namespaces.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(labels) = namespaces.get(namespace) {
                attributes.namespace_labels = labels.clone();
            }
        }
        Ok(attributes)
    }

    async fn pod_check(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> Result<PodCheck, DirectoryError> {
        let (Some(pods), Some(node)) = (&self.pods, &self.node_name) else {
            return Ok(PodCheck::Unknown);
        };
        // The watch holds this node's pods only.
        if let Some(pod) = pods.get(&ObjectRef::new(name).within(namespace)) {
            return Ok(match pod.uid().as_deref() == Some(uid) {
                true => PodCheck::Here,
                false => PodCheck::Gone,
            });
        }
        // Not seen by the watch (yet): read it, and where it runs.
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let found = tokio::time::timeout(crate::http::KUBE_REQUEST_TIMEOUT, api.get_opt(name))
            .await
            .map_err(|_| DirectoryError(format!("reading pod {namespace}/{name}: timed out")))?
            .map_err(|e| DirectoryError(format!("reading pod {namespace}/{name}: {e}")))?;
        Ok(match found.filter(|p| p.uid().as_deref() == Some(uid)) {
            None => PodCheck::Gone,
            Some(p) => match p.spec.and_then(|s| s.node_name) {
                Some(n) if &n == node => PodCheck::Here,
                Some(n) => PodCheck::Elsewhere(n),
                // Not scheduled yet: it runs nowhere, here least of all.
                None => PodCheck::Elsewhere(String::new()),
            },
        })
    }
}
