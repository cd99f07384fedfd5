//! What the doctor reads from the cluster, read-only: the issuer from the
//! API server's OIDC discovery document (`GET
//! /.well-known/openid-configuration`, what every token's `iss` is), the
//! pod, its ServiceAccount, the list of ServiceAccounts, and Lanyard's
//! agent pods on the pod's node (by the chart's labels), and the Events of
//! the pod's namespace (`events.k8s.io/v1`). Each read
//! that fails is kept as its error, for the report to name; none stops
//! the others.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams};

use super::Target;
use crate::token::{kube_get, Discovery};

/// The cluster as the doctor found it.
pub struct Facts {
    /// The issuer in the cluster's discovery document.
    pub issuer: Result<String, String>,
    /// The pod (pod targets only); `Ok(None)` when it does not exist.
    pub pod: Option<Result<Option<Pod>, String>>,
    /// The ServiceAccount's namespace and name: the target's, or the pod's.
    pub service_account_name: Option<(String, String)>,
    /// The labels of the ServiceAccount's namespace (for the policy).
    pub namespace_labels: Result<BTreeMap<String, String>, String>,
    /// The ServiceAccount; `Ok(None)` when it does not exist.
    pub service_account: Result<Option<ServiceAccount>, String>,
    /// Every ServiceAccount of the cluster (for identities shared by many).
    pub all_service_accounts: Result<Vec<ServiceAccount>, String>,
    /// Lanyard's agent pods on the pod's node (pod targets on a node).
    pub agents: Option<Result<Vec<Pod>, String>>,
    /// The Events of the pod's namespace (pod targets): the agent's
    /// refusals of this pod are among them.
    pub events: Option<Result<Vec<Event>, String>>,
}

/// Most Events read from the pod's namespace (the API server keeps them an
/// hour, `--event-ttl`; a busy namespace holds more, and the newest refusals
/// are then missed, not the read).
const MAX_EVENTS: u32 = 1000;

/// The labels of the chart's agent pods (its selector).
pub const AGENT_SELECTOR: &str = "app.kubernetes.io/name=lanyard,app.kubernetes.io/component=agent";

/// Reads what `target` needs.
pub async fn gather(client: &kube::Client, target: &Target) -> Facts {
    let issuer = kube_get::<Discovery>(
        client,
        "/.well-known/openid-configuration",
        "OIDC discovery",
    )
    .await
    .map(|d| d.issuer)
    .map_err(|e| e.to_string());
    let (pod, service_account_name) = match target {
        Target::Pod { namespace, name } => {
            let pod = Api::<Pod>::namespaced(client.clone(), namespace)
                .get_opt(name)
                .await
                .map_err(|e| e.to_string());
            let sa = match &pod {
                Ok(Some(p)) => Some((
                    namespace.clone(),
                    p.spec
                        .as_ref()
                        .and_then(|s| s.service_account_name.clone())
                        .unwrap_or_else(|| "default".into()),
                )),
                _ => None,
            };
            (Some(pod), sa)
        }
        Target::ServiceAccount { namespace, name } => {
            (None, Some((namespace.clone(), name.clone())))
        }
    };
    let service_account = match &service_account_name {
        Some((ns, name)) => Api::<ServiceAccount>::namespaced(client.clone(), ns)
            .get_opt(name)
            .await
            .map_err(|e| e.to_string()),
        None => Ok(None),
    };
    let node = match &pod {
        Some(Ok(Some(p))) => p.spec.as_ref().and_then(|s| s.node_name.clone()),
        _ => None,
    };
    let agents = match node {
        Some(node) => Some(
            Api::<Pod>::all(client.clone())
                .list(
                    &ListParams::default()
                        .labels(AGENT_SELECTOR)
                        .fields(&format!("spec.nodeName={node}")),
                )
                .await
                .map(|l| l.items)
                .map_err(|e| e.to_string()),
        ),
        None => None,
    };
    let events = match (target, &pod) {
        (Target::Pod { namespace, .. }, Some(Ok(Some(_)))) => Some(
            Api::<Event>::namespaced(client.clone(), namespace)
                .list(&ListParams::default().limit(MAX_EVENTS))
                .await
                .map(|l| l.items)
                .map_err(|e| e.to_string()),
        ),
        _ => None,
    };
    let namespace_labels = match &service_account_name {
        Some((ns, _)) => Api::<Namespace>::all(client.clone())
            .get_opt(ns)
            .await
            .map(|n| n.and_then(|n| n.metadata.labels).unwrap_or_default())
            .map_err(|e| e.to_string()),
        None => Ok(BTreeMap::new()),
    };
    let all_service_accounts = Api::<ServiceAccount>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .map_err(|e| e.to_string());
    Facts {
        issuer,
        pod,
        service_account_name,
        service_account,
        namespace_labels,
        all_service_accounts,
        agents,
        events,
    }
}
