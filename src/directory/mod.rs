//! Where cloud bindings come from: the annotations on a pod's
//! ServiceAccount. `file` serves them from static configuration (dev mode,
//! non-Kubernetes hosts); a Kubernetes reflector arrives with the agent.

pub mod file;
pub mod kube;
mod metadata;

/// The bindings a directory reads from ServiceAccount annotations (each
/// cloud reads its own; `cloud::Bindings`).
pub use crate::cloud::Bindings;
pub use metadata::Metadata;

use std::sync::Arc;

/// What a policy may know about a caller beyond its token: its
/// ServiceAccount's labels and annotations, its namespace's labels, its
/// pod's labels. Empty where the directory does not track the object.
#[derive(Debug, Clone, Default)]
pub struct Attributes {
    /// The ServiceAccount's labels.
    pub service_account_labels: Metadata,
    /// The ServiceAccount's annotations.
    pub service_account_annotations: Metadata,
    /// The namespace's labels.
    pub namespace_labels: Metadata,
    /// The calling pod's labels.
    pub pod_labels: Metadata,
}

impl Attributes {
    /// No labels or annotations at all, shared: the pipeline's answer when
    /// the policy does not look at attributes, without allocating.
    pub fn empty() -> &'static Attributes {
        static EMPTY: std::sync::LazyLock<Attributes> =
            std::sync::LazyLock::new(Attributes::default);
        &EMPTY
    }
}

/// Why bindings could not be looked up (the source, not the answer).
#[derive(Debug, thiserror::Error)]
#[error("binding directory unavailable: {0}")]
pub struct DirectoryError(pub String);

/// What the live objects say of a caller's pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodCheck {
    /// Pods are not tracked here.
    Unknown,
    /// It exists, with that uid, on this node.
    Here,
    /// No pod of that name and uid exists.
    Gone,
    /// It exists on another node (named).
    Elsewhere(String),
}

/// A source of bindings keyed by namespace and ServiceAccount name.
#[async_trait::async_trait]
pub trait Directory: Send + Sync {
    /// `Ok(None)` when the ServiceAccount is unknown. Shared, not copied:
    /// every request asks, and the bindings change only with the
    /// ServiceAccount.
    async fn lookup(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Arc<Bindings>>, DirectoryError>;

    /// Where the pod `namespace/name` with `uid` is, as the live objects
    /// say: [`PodCheck::Unknown`] when this directory does not track pods.
    /// Bound tokens outlive their pod until they expire; this is how they
    /// stop working sooner, and how a token without a node claim (clusters
    /// before 1.30 issue such tokens) is kept to its own node.
    async fn pod_check(
        &self,
        _namespace: &str,
        _name: &str,
        _uid: &str,
    ) -> Result<PodCheck, DirectoryError> {
        Ok(PodCheck::Unknown)
    }

    /// The uid of the live ServiceAccount `namespace/name`; `Ok(None)` when
    /// it is unknown, or this directory does not track uids. A token names
    /// its ServiceAccount's uid: one for a deleted ServiceAccount must not
    /// be honoured for another created under the same name.
    async fn service_account_uid(
        &self,
        _namespace: &str,
        _name: &str,
    ) -> Result<Option<String>, DirectoryError> {
        Ok(None)
    }

    /// Labels and annotations of the caller's ServiceAccount, namespace
    /// and pod, for policies that look at them; empty by default.
    async fn attributes(
        &self,
        _namespace: &str,
        _service_account: &str,
        _pod: &str,
    ) -> Result<Attributes, DirectoryError> {
        Ok(Attributes::default())
    }
}
