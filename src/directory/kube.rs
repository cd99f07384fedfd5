//! Bindings from the Kubernetes API: a reflector over ServiceAccounts (all
//! namespaces) and one over the pods of this node. Lookups are answered
//! from memory; a ServiceAccount the reflector has not seen yet (created a
//! moment ago) is fetched directly. Annotation changes and deletions reach
//! the credential cache through a callback, so a removed binding stops
//! being served at once.
//!
//! Needs `get/list/watch` on serviceaccounts and pods, nothing more.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, ResourceExt};

use super::{Bindings, Directory, DirectoryError};

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
}

type Key = (String, String);

impl KubeDirectory {
    /// Starts the reflectors (pods only when `node_name` is known) and
    /// waits until their first list is in memory.
    pub async fn start(
        client: Client,
        node_name: Option<String>,
        invalidate: Arc<Invalidate>,
    ) -> anyhow::Result<KubeDirectory> {
        let (sa_store, sa_writer) = reflector::store::<ServiceAccount>();
        let sa_api: Api<ServiceAccount> = Api::all(client.clone());
        let known: Arc<Mutex<HashMap<Key, Bindings>>> = Arc::default();
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
                    Ok(event) => track_service_accounts(event, &known, &mut relisted, &inv),
                    Err(e) => tracing::warn!(error = %e, "ServiceAccount watch failed; retrying"),
                }
            }
        });

        let pods = match node_name {
            Some(node) => {
                let (pod_store, pod_writer) = reflector::store::<Pod>();
                let pod_api: Api<Pod> = Api::all(client.clone());
                let config = watcher::Config::default()
                    .any_semantic()
                    .fields(&format!("spec.nodeName={node}"));
                let stream = reflector::reflector(pod_writer, watcher::watcher(pod_api, config))
                    .default_backoff();
                let inv = invalidate.clone();
                tokio::spawn(async move {
                    let mut stream = std::pin::pin!(stream);
                    while let Some(event) = stream.next().await {
                        match event {
                            Ok(Event::Delete(pod)) => {
                                if let Some(uid) = pod.uid() {
                                    (inv.pod)(&uid);
                                }
                            }
                            Ok(_) => {}
                            Err(e) => tracing::warn!(error = %e, "pod watch failed; retrying"),
                        }
                    }
                });
                Some(pod_store)
            }
            None => None,
        };

        let wait = async {
            sa_store.wait_until_ready().await?;
            if let Some(p) = &pods {
                p.wait_until_ready().await?;
            }
            Ok::<_, reflector::store::WriterDropped>(())
        };
        match tokio::time::timeout(std::time::Duration::from_secs(30), wait).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => anyhow::bail!("Kubernetes watch ended before its first list: {e}"),
            Err(_) => anyhow::bail!(
                "no initial list of serviceaccounts/pods from the Kubernetes API within 30 s (check the API server address and that the agent may get/list/watch serviceaccounts and pods)"
            ),
        }
        Ok(KubeDirectory {
            client,
            service_accounts: sa_store,
            pods,
        })
    }
}

/// Keeps the last-seen bindings per ServiceAccount and invalidates cache
/// entries when they change or the account goes away (including accounts
/// that vanished while the watch was down, found at the next relist).
fn track_service_accounts(
    event: Event<ServiceAccount>,
    known: &Mutex<HashMap<Key, Bindings>>,
    relisted: &mut Option<HashSet<Key>>,
    invalidate: &Invalidate,
) {
    let key_of = |sa: &ServiceAccount| (sa.namespace().unwrap_or_default(), sa.name_any());
    let mut known = known.lock().unwrap_or_else(|p| p.into_inner());
    let apply = |sa: &ServiceAccount, known: &mut HashMap<Key, Bindings>| {
        let key = key_of(sa);
        let bindings = Bindings::from_annotations(sa.annotations());
        if let Some(previous) = known.insert(key.clone(), bindings.clone()) {
            if previous != bindings {
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

#[async_trait::async_trait]
impl Directory for KubeDirectory {
    async fn lookup(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Bindings>, DirectoryError> {
        let key = ObjectRef::new(name).within(namespace);
        if let Some(sa) = self.service_accounts.get(&key) {
            return Ok(Some(Bindings::from_annotations(sa.annotations())));
        }
        // Not seen yet: created a moment ago, or does not exist.
        let api: Api<ServiceAccount> = Api::namespaced(self.client.clone(), namespace);
        match api.get_opt(name).await {
            Ok(found) => Ok(found.map(|sa| Bindings::from_annotations(sa.annotations()))),
            Err(e) => Err(DirectoryError(format!(
                "reading serviceaccount {namespace}/{name}: {e}"
            ))),
        }
    }

    async fn pod_exists(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> Result<Option<bool>, DirectoryError> {
        let Some(pods) = &self.pods else {
            return Ok(None);
        };
        if let Some(pod) = pods.get(&ObjectRef::new(name).within(namespace)) {
            return Ok(Some(pod.uid().as_deref() == Some(uid)));
        }
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        match api.get_opt(name).await {
            Ok(found) => Ok(Some(found.is_some_and(|p| p.uid().as_deref() == Some(uid)))),
            Err(e) => Err(DirectoryError(format!(
                "reading pod {namespace}/{name}: {e}"
            ))),
        }
    }
}
