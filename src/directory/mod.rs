//! Where cloud bindings come from: the annotations on a pod's
//! ServiceAccount. `file` serves them from static configuration (dev mode,
//! non-Kubernetes hosts); a Kubernetes reflector arrives with the agent.

pub mod file;
pub mod kube;
mod metadata;

pub use metadata::Metadata;

use std::collections::BTreeMap;
use std::sync::Arc;

/// ServiceAccount annotations Lanyard reads, compatible with the clouds'
/// own workload-identity webhooks.
pub mod annotations {
    /// The managed identity's (or app registration's) client id (Azure
    /// Workload Identity's annotation); its presence is what binds Azure.
    pub const AZURE_CLIENT_ID: &str = "azure.workload.identity/client-id";
    /// The identity's tenant (Azure Workload Identity's annotation); absent
    /// means the configured default tenant.
    pub const AZURE_TENANT_ID: &str = "azure.workload.identity/tenant-id";
    /// Lanyard's own: the managed identity's object (principal) id, so that
    /// IMDS callers selecting by `object_id` can be matched.
    pub const AZURE_OBJECT_ID: &str = "lanyard.dev/azure-object-id";
    /// Lanyard's own: the managed identity's ARM resource id, for `msi_res_id`.
    pub const AZURE_RESOURCE_ID: &str = "lanyard.dev/azure-resource-id";
    /// The Google service account to impersonate (GKE's annotation).
    pub const GCP_SERVICE_ACCOUNT: &str = "iam.gke.io/gcp-service-account";
    /// The IAM role to assume (EKS IRSA's annotation).
    pub const AWS_ROLE_ARN: &str = "eks.amazonaws.com/role-arn";
}

/// The Azure identity a ServiceAccount may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AzureBinding {
    /// The managed identity's client (application) id, as the
    /// `azure.workload.identity/client-id` annotation gives it.
    pub client_id: String,
    /// `None` means the configured default tenant.
    pub tenant_id: Option<String>,
    /// Its object (principal) id, from `lanyard.dev/azure-object-id`, so that
    /// IMDS callers selecting by `object_id` match; `None`: such a selector
    /// never matches.
    pub object_id: Option<String>,
    /// Its ARM resource id, from `lanyard.dev/azure-resource-id`, for callers
    /// selecting by `msi_res_id`; `None`: such a selector never matches.
    pub resource_id: Option<String>,
}

/// Every cloud identity bound to one ServiceAccount.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bindings {
    /// The Azure identity; `None` when the ServiceAccount names no client id.
    pub azure: Option<AzureBinding>,
    /// Google service account email to impersonate; `None` means the
    /// federated principal is used directly.
    pub gcp_service_account: Option<String>,
    /// The IAM role to assume, from `eks.amazonaws.com/role-arn`; `None`: no
    /// AWS binding.
    pub aws_role_arn: Option<String>,
}

impl Bindings {
    /// Reads bindings from ServiceAccount annotations. Empty values count as
    /// absent, as the clouds' webhooks treat them.
    pub fn from_annotations(annotations: &BTreeMap<String, String>) -> Bindings {
        let get = |k: &str| {
            annotations
                .get(k)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        Bindings {
            azure: get(annotations::AZURE_CLIENT_ID).map(|client_id| AzureBinding {
                client_id,
                tenant_id: get(annotations::AZURE_TENANT_ID),
                object_id: get(annotations::AZURE_OBJECT_ID),
                resource_id: get(annotations::AZURE_RESOURCE_ID),
            }),
            gcp_service_account: get(annotations::GCP_SERVICE_ACCOUNT),
            aws_role_arn: get(annotations::AWS_ROLE_ARN),
        }
    }

    /// Whether no cloud is bound at all (Google's federated principal, which
    /// needs no binding, does not count).
    pub fn is_empty(&self) -> bool {
        self.azure.is_none() && self.gcp_service_account.is_none() && self.aws_role_arn.is_none()
    }

    /// No bindings, shared: what an unknown ServiceAccount has.
    pub fn none() -> Arc<Bindings> {
        static NONE: std::sync::LazyLock<Arc<Bindings>> =
            std::sync::LazyLock::new(|| Arc::new(Bindings::default()));
        NONE.clone()
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn annotations_map_to_bindings() {
        let mut a = BTreeMap::new();
        assert!(Bindings::from_annotations(&a).is_empty());
        a.insert(annotations::AZURE_CLIENT_ID.into(), " abc ".into());
        a.insert(annotations::AZURE_TENANT_ID.into(), "".into());
        let b = Bindings::from_annotations(&a);
        let az = b.azure.unwrap();
        assert_eq!(az.client_id, "abc");
        assert_eq!(az.tenant_id, None);
        a.insert(
            annotations::AWS_ROLE_ARN.into(),
            "arn:aws:iam::111122223333:role/r".into(),
        );
        a.insert(
            annotations::GCP_SERVICE_ACCOUNT.into(),
            "sa@p.iam.gserviceaccount.com".into(),
        );
        let b = Bindings::from_annotations(&a);
        assert_eq!(
            b.aws_role_arn.as_deref(),
            Some("arn:aws:iam::111122223333:role/r")
        );
        assert_eq!(
            b.gcp_service_account.as_deref(),
            Some("sa@p.iam.gserviceaccount.com")
        );
    }
}
