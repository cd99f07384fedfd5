//! Static bindings: ServiceAccounts and their annotations given in
//! configuration, in the same shape as in a cluster.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::{Bindings, Directory, DirectoryError};

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
}

/// Bindings from a fixed list of ServiceAccounts.
pub struct StaticDirectory {
    /// namespace → name → bindings: looked up by `&str`, without allocating.
    entries: HashMap<String, HashMap<String, Bindings>>,
}

impl StaticDirectory {
    /// A directory of `entries`, their bindings read once. A ServiceAccount
    /// listed twice keeps its last entry.
    pub fn new(entries: &[ServiceAccountEntry]) -> Self {
        let mut map: HashMap<String, HashMap<String, Bindings>> = HashMap::new();
        for e in entries {
            map.entry(e.namespace.clone())
                .or_default()
                .insert(e.name.clone(), Bindings::from_annotations(&e.annotations));
        }
        StaticDirectory { entries: map }
    }
}

#[async_trait::async_trait]
impl Directory for StaticDirectory {
    async fn lookup(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Bindings>, DirectoryError> {
        Ok(self
            .entries
            .get(namespace)
            .and_then(|names| names.get(name))
            .cloned())
    }
}

/// The same bindings for every caller: a standalone sidecar serves only its
/// own pod, whose bindings it is given.
pub struct FixedDirectory(pub Bindings);

#[async_trait::async_trait]
impl Directory for FixedDirectory {
    async fn lookup(
        &self,
        _namespace: &str,
        _name: &str,
    ) -> Result<Option<Bindings>, DirectoryError> {
        Ok(Some(self.0.clone()))
    }
}
