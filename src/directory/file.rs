//! Static bindings: ServiceAccounts and their annotations given in
//! configuration, in the same shape as in a cluster.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{Attributes, Bindings, Directory, DirectoryError, Metadata};

/// A ServiceAccount as configured: name, namespace and annotations.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceAccountEntry {
    /// The ServiceAccount's namespace.
    pub namespace: String,
    /// The ServiceAccount's name.
    pub name: String,
    /// Its annotations, read as a cluster's would be (see
    /// [`super::annotations`]); none means no bindings.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    /// Its labels, for policies.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// A namespace as configured: its name and labels, for policies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamespaceEntry {
    /// The namespace's name.
    pub name: String,
    /// Its labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// What is kept of one configured ServiceAccount.
struct Account {
    bindings: Arc<Bindings>,
    labels: Metadata,
    annotations: Metadata,
}

/// Bindings from a fixed list of ServiceAccounts (and namespace labels).
pub struct StaticDirectory {
    /// namespace → name → account: looked up by `&str`, without allocating.
    entries: HashMap<String, HashMap<String, Account>>,
    namespaces: HashMap<String, Metadata>,
    /// `namespace/name` → labels of the pods it knows (`lanyard dev`'s).
    pods: HashMap<String, Metadata>,
}

impl StaticDirectory {
    /// A directory of `entries`, their bindings read once. A ServiceAccount
    /// listed twice keeps its last entry.
    pub fn new(entries: &[ServiceAccountEntry]) -> Self {
        let mut map: HashMap<String, HashMap<String, Account>> = HashMap::new();
        for e in entries {
            map.entry(e.namespace.clone()).or_default().insert(
                e.name.clone(),
                Account {
                    bindings: Arc::new(Bindings::from_annotations(&e.annotations)),
                    labels: Metadata::from(&e.labels),
                    annotations: Metadata::from(&e.annotations),
                },
            );
        }
        StaticDirectory {
            entries: map,
            namespaces: HashMap::new(),
            pods: HashMap::new(),
        }
    }

    /// Also knows the labels of `namespaces`.
    pub fn with_namespaces(mut self, namespaces: &[NamespaceEntry]) -> Self {
        self.namespaces = namespaces
            .iter()
            .map(|n| (n.name.clone(), Metadata::from(&n.labels)))
            .collect();
        self
    }

    /// Also knows the labels of the pod `namespace/name`.
    pub fn with_pod(
        mut self,
        namespace: &str,
        name: &str,
        labels: &std::collections::BTreeMap<String, String>,
    ) -> Self {
        self.pods
            .insert(format!("{namespace}/{name}"), Metadata::from(labels));
        self
    }
}

#[async_trait::async_trait]
impl Directory for StaticDirectory {
    async fn lookup(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Arc<Bindings>>, DirectoryError> {
        Ok(self
            .entries
            .get(namespace)
            .and_then(|names| names.get(name))
            .map(|account| account.bindings.clone()))
    }

    async fn attributes(
        &self,
        namespace: &str,
        service_account: &str,
        pod: &str,
    ) -> Result<Attributes, DirectoryError> {
        let account = self
            .entries
            .get(namespace)
            .and_then(|names| names.get(service_account));
        let mut attributes = Attributes::default();
        if let Some(account) = account {
            attributes.service_account_labels = account.labels.clone();
            attributes.service_account_annotations = account.annotations.clone();
        }
        if let Some(labels) = self.namespaces.get(namespace) {
            attributes.namespace_labels = labels.clone();
        }
        if !self.pods.is_empty() {
            if let Some(labels) = self.pods.get(&format!("{namespace}/{pod}")) {
                attributes.pod_labels = labels.clone();
            }
        }
        Ok(attributes)
    }
}

/// The same bindings for every caller: a standalone sidecar serves only its
/// own pod, whose bindings it is given.
pub struct FixedDirectory(pub Arc<Bindings>);

#[async_trait::async_trait]
impl Directory for FixedDirectory {
    async fn lookup(
        &self,
        _namespace: &str,
        _name: &str,
    ) -> Result<Option<Arc<Bindings>>, DirectoryError> {
        Ok(Some(self.0.clone()))
    }
}
