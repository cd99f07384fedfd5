//! Entra ID's model: the ServiceAccount annotations Azure bindings are
//! read from, the identities (and apps) they bind, what Entra refuses of
//! them before anything is asked, and the audiences Entra accepts a
//! cluster's token under.

use super::{annotation, distinct, listed, Annotations};

/// The ServiceAccount annotations Azure bindings are read from.
pub mod annotations {
    /// The managed identity's (or app registration's) client id (Azure
    /// Workload Identity's annotation); its presence is what binds Azure.
    pub const CLIENT_ID: &str = "azure.workload.identity/client-id";
    /// The identity's tenant (Azure Workload Identity's annotation); absent
    /// means the configured default tenant.
    pub const TENANT_ID: &str = "azure.workload.identity/tenant-id";
    /// Lanyard's own: the managed identity's object (principal) id, so that
    /// IMDS callers selecting by `object_id` can be matched.
    pub const OBJECT_ID: &str = "lanyard.dev/azure-object-id";
    /// Lanyard's own: the managed identity's ARM resource id, for `msi_res_id`.
    pub const RESOURCE_ID: &str = "lanyard.dev/azure-resource-id";
    /// Lanyard's own: further client ids the ServiceAccount may use, in
    /// the same tenant, each selected by the SDK's `client_id` (comma- or
    /// space-separated; after `CLIENT_ID`'s, or the first is the default).
    pub const CLIENT_IDS: &str = "lanyard.dev/azure-client-ids";
    /// Lanyard's own: an app registration that trusts the managed identity
    /// in `CLIENT_ID` as a federated credential; the pod then gets the
    /// app's tokens (`app_hop`).
    pub const APP_CLIENT_ID: &str = "lanyard.dev/azure-app-client-id";
    /// Lanyard's own: the tenant the app's tokens are asked in (where the
    /// multi-tenant app is provisioned); absent: the identity's tenant.
    pub const APP_TENANT_ID: &str = "lanyard.dev/azure-app-tenant-id";
    /// Every annotation above: what Lanyard reads of this cloud's.
    pub const ALL: &[&str] = &[
        CLIENT_ID,
        TENANT_ID,
        OBJECT_ID,
        RESOURCE_ID,
        CLIENT_IDS,
        APP_CLIENT_ID,
        APP_TENANT_ID,
    ];
}

/// The audience AKS's identity-binding proxy accepts (it exchanges a
/// token for it for the identities bound to the cluster).
pub const IDENTITY_BINDING_AUDIENCE: &str = "api://AKSIdentityBinding";

/// The audience Entra requires in federated client assertions, and so the
/// audience of the projected tokens the Azure exchange sends.
pub const FEDERATION_AUDIENCE: &str = "api://AzureADTokenExchange";

/// Entra ID's token-exchange audiences, one per cloud: a token for any of
/// them is what a federated credential in that cloud expects.
pub const EXCHANGE_AUDIENCES: [&str; 5] = [
    "api://AzureADTokenExchange",
    "api://AzureADTokenExchangeUSGov",
    "api://AzureADTokenExchangeChina",
    "api://AzureADTokenExchangeUSNat",
    "api://AzureADTokenExchangeUSSec",
];

/// The audiences Azure accepts a cluster's token under: the configured
/// one, every cloud's token-exchange audience, and AKS's identity-binding
/// proxy's (`api://AKSIdentityBinding`, which the proxy exchanges for the
/// identities bound to the cluster).
pub fn accepted_audiences(configured: &str) -> Vec<String> {
    let mut all: Vec<String> = EXCHANGE_AUDIENCES
        .iter()
        .chain([&IDENTITY_BINDING_AUDIENCE])
        .map(|a| a.to_string())
        .collect();
    if !all.iter().any(|a| a == configured) {
        all.push(configured.to_string());
    }
    all
}

/// The Azure identity a ServiceAccount may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
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
    /// The app this managed identity reaches, whose tokens the pod gets
    /// (`lanyard.dev/azure-app-client-id`); `None`: the identity's own.
    pub app: Option<AppHop>,
}

/// The Azure identities `annotations` name, the default first: the
/// `azure.workload.identity/client-id` one (with its object and resource
/// ids, and the app it reaches, if any), then those of
/// `lanyard.dev/azure-client-ids`, all in the ServiceAccount's tenant.
pub fn bindings(annotations: &Annotations) -> Vec<Binding> {
    let tenant_id = annotation(annotations, annotations::TENANT_ID);
    let first = annotation(annotations, annotations::CLIENT_ID).map(|client_id| Binding {
        client_id,
        tenant_id: tenant_id.clone(),
        object_id: annotation(annotations, annotations::OBJECT_ID),
        resource_id: annotation(annotations, annotations::RESOURCE_ID),
        app: annotation(annotations, annotations::APP_CLIENT_ID).map(|client_id| AppHop {
            client_id,
            tenant_id: annotation(annotations, annotations::APP_TENANT_ID),
        }),
    });
    let listed = listed(annotations, annotations::CLIENT_IDS)
        .into_iter()
        .map(|client_id| Binding {
            client_id,
            tenant_id: tenant_id.clone(),
            object_id: None,
            resource_id: None,
            app: None,
        });
    distinct(
        first.into_iter().chain(listed),
        |a, b| a.client_id.eq_ignore_ascii_case(&b.client_id),
        annotations::CLIENT_IDS,
    )
}

/// The app a managed identity reaches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppHop {
    /// The app registration's client id (`lanyard.dev/azure-app-client-id`).
    pub client_id: String,
    /// The tenant its tokens are asked in (`lanyard.dev/azure-app-tenant-id`);
    /// `None`: the managed identity's.
    pub tenant_id: Option<String>,
}

/// Why a ServiceAccount's app hop through `identity` is refused before
/// anything is asked: its first token would come from the identity's own
/// federated credential, which Entra refuses as the app's.
pub fn chained_federation(identity: &str, app: &str) -> String {
    format!(
        "the app hop to {app} ({APP_CLIENT_ID}) needs managed identity {identity}'s token as the app's federated credential, and this identity's token would be obtained through its own federated credential, which Entra refuses as another federated credential (AADSTS700231: Token obtained using another federated identity credential may not be used as federated identity credential). Assign {identity} to the node pool and list it in azure.node_identities, so that its token comes from the node's IMDS (docs/setup-azure.md), or remove {APP_CLIENT_ID}",
        APP_CLIENT_ID = annotations::APP_CLIENT_ID
    )
}

/// The app hops among `bindings` that the agent refuses: those through an
/// identity not in `node_identities` ([`chained_federation`]).
pub fn known_refusals(bindings: &[Binding], node_identities: &[String]) -> Vec<String> {
    bindings
        .iter()
        .filter_map(|b| {
            let app = b.app.as_ref()?;
            let on_node = node_identities
                .iter()
                .any(|id| id.eq_ignore_ascii_case(&b.client_id));
            (!on_node).then(|| chained_federation(&b.client_id, &app.client_id))
        })
        .collect()
}

/// Whether `s` names a tenant: a GUID or a domain name.
pub fn is_tenant(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 256
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
}
