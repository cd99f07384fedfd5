//! What Entra must hold for a ServiceAccount's Azure bindings, as `az`
//! and `kubectl` commands (`lanyard doctor`).
//!
//! One of four shapes per binding, as docs/setup-azure.md sets them up:
//! - a **federated identity credential** on the managed identity (or app
//!   registration): issuer, subject `system:serviceaccount:NS:NAME` and
//!   the audience (`azure.audience`), matched exactly. Entra answers a
//!   mismatch with `AADSTS70021` ("No matching federated identity record
//!   found for presented assertion": `700211` for the issuer, `700213`
//!   for the subject, `7002138` for a subject that differs only in case,
//!   as Azure/AKS#4228 quotes it; a trailing `/` makes another issuer:
//!   MicrosoftDocs/azure-docs#104039, azure-workload-identity#1700). An
//!   identity holds at most 20 credentials (Microsoft Learn, "Workload
//!   identity federation considerations").
//! - with **AKS identity bindings**, no credential per ServiceAccount: a
//!   ClusterRole granting `use-managed-identity` on the client id in
//!   `cid.wi.aks.azure.com`, bound to the ServiceAccount (Microsoft
//!   Learn's how-to);
//! - a **node-assigned identity**: no credential, the node's IMDS gives
//!   its tokens, and only policy decides who may use it;
//! - the **app hop**: the app trusts the node's managed identity, issuer
//!   `{login host}/{tenant}/v2.0`, subject the identity's principal
//!   (object) id; a credential obtained through a federated credential
//!   is refused as another (`AADSTS700231`, azure-workload-identity
//!   #1363).

use sha2::{Digest, Sha256};

use super::{authority_for_cloud, Binding, Settings};
use crate::cloud::trust::{command, issuer_note, shell_word, Trust, Workload};
use crate::cloud::Cloud;

/// Federated identity credentials one identity may hold.
pub const MAX_FEDERATED_CREDENTIALS: usize = 20;

/// The trusts `bindings` need for `workload`.
pub fn trust(settings: &Settings, bindings: &[Binding], workload: &Workload) -> Vec<Trust> {
    bindings
        .iter()
        .map(|b| {
            let node = settings
                .node_identities
                .iter()
                .any(|n| n.eq_ignore_ascii_case(&b.client_id));
            match (&b.app, node) {
                (Some(_), _) => app_hop(settings, b, node),
                (None, true) => node_assigned(settings, b),
                (None, false) if settings.identity_binding_sni.is_some() => {
                    identity_binding(settings, b, workload)
                }
                (None, false) => federated(settings, b, workload),
            }
        })
        .collect()
}

fn login_host(settings: &Settings) -> String {
    settings
        .authority_host
        .clone()
        .or_else(|| authority_for_cloud(&settings.cloud).map(str::to_string))
        .unwrap_or_default()
        .trim_end_matches('/')
        .to_string()
}

fn tenant(settings: &Settings, b: &Binding) -> String {
    b.tenant_id
        .clone()
        .or_else(|| settings.tenant_id.clone())
        .unwrap_or_else(|| "<TENANT_ID>".into())
}

/// The parts of a user-assigned identity's ARM id:
/// `/subscriptions/S/resourceGroups/G/providers/Microsoft.ManagedIdentity/userAssignedIdentities/N`.
struct ArmId {
    subscription: String,
    group: String,
    name: String,
}

fn arm_id(id: &str) -> Option<ArmId> {
    let parts: Vec<&str> = id.trim_matches('/').split('/').collect();
    match parts.as_slice() {
        [s, sub, g, group, p, ns, t, name]
            if s.eq_ignore_ascii_case("subscriptions")
                && g.eq_ignore_ascii_case("resourceGroups")
                && p.eq_ignore_ascii_case("providers")
                && ns.eq_ignore_ascii_case("Microsoft.ManagedIdentity")
                && t.eq_ignore_ascii_case("userAssignedIdentities") =>
        {
            Some(ArmId {
                subscription: sub.to_string(),
                group: group.to_string(),
                name: name.to_string(),
            })
        }
        _ => None,
    }
}

/// A credential name Entra takes (3 to 120 letters, digits, `-`, `_`,
/// starting with a letter or digit), distinct per ServiceAccount and
/// cluster: the issuer's hash tells clusters apart.
fn credential_name(workload: &Workload) -> String {
    let hash = hex::encode(&Sha256::digest(workload.issuer.as_bytes())[..4]);
    let clean = |s: &str| s.replace(|c: char| !c.is_ascii_alphanumeric() && c != '-', "-");
    let mut name = format!(
        "lanyard-{}-{}",
        clean(workload.namespace),
        clean(workload.service_account)
    );
    name.truncate(120 - hash.len() - 1);
    format!("{name}-{hash}")
}

fn federated(settings: &Settings, b: &Binding, workload: &Workload) -> Trust {
    let mut t = Trust::new(Cloud::Azure, &b.client_id, "federated identity credential");
    t.issuer = workload.issuer.to_string();
    t.subject = workload.subject();
    t.audience = settings.audience.clone();
    let name = credential_name(workload);
    let arm = b.resource_id.as_deref().and_then(arm_id);
    let (identity, group) = match &arm {
        Some(a) => (a.name.clone(), a.group.clone()),
        None => (
            "<IDENTITY_NAME>".to_string(),
            "<RESOURCE_GROUP>".to_string(),
        ),
    };
    if arm.is_none() {
        t.commands.push(command(&[
            "az",
            "identity",
            "list",
            "--query",
            &format!(
                "[?clientId=='{}'].{{name:name, resourceGroup:resourceGroup}}",
                b.client_id
            ),
            "--output",
            "table",
        ]));
    }
    let mut create = vec![
        "az",
        "identity",
        "federated-credential",
        "create",
        "--name",
        &name,
        "--identity-name",
        &identity,
        "--resource-group",
        &group,
    ];
    if let Some(a) = &arm {
        create.extend(["--subscription", a.subscription.as_str()]);
    }
    create.extend([
        "--issuer",
        &t.issuer,
        "--subject",
        &t.subject,
        "--audiences",
        &t.audience,
    ]);
    t.commands.push(command(&create));
    t.commands.push(command(&[
        "az",
        "identity",
        "federated-credential",
        "list",
        "--identity-name",
        &identity,
        "--resource-group",
        &group,
        "--output",
        "table",
    ]));
    t.notes.push(issuer_note(&t.issuer));
    t.notes.push(format!(
        "the subject is matched exactly, case included: another gets AADSTS700213, one differing only in case AADSTS7002138, and another issuer AADSTS700211 (no matching federated identity record): {}",
        t.subject
    ));
    t.notes.push(format!(
        "if {} is an app registration rather than a managed identity: {}",
        b.client_id,
        app_credential(&b.client_id, &name, &t)
    ));
    if let Some(n) = (workload.sharing)(Cloud::Azure, &b.client_id) {
        if n > MAX_FEDERATED_CREDENTIALS {
            t.problems.push(format!(
                "{n} ServiceAccounts of this cluster use {}, but an identity holds at most {MAX_FEDERATED_CREDENTIALS} federated credentials (one per issuer and subject): give each namespace or team its own identity, or use AKS identity bindings (docs/setup-azure.md)",
                b.client_id
            ));
        }
    }
    t
}

/// `az ad app federated-credential create` for the app `app`: a credential
/// named `name` with `trust`'s issuer, subject and audience.
fn app_credential(app: &str, name: &str, trust: &Trust) -> String {
    let parameters = serde_json::json!({
        "name": name,
        "issuer": trust.issuer,
        "subject": trust.subject,
        "audiences": [trust.audience],
    });
    command(&[
        "az",
        "ad",
        "app",
        "federated-credential",
        "create",
        "--id",
        app,
        "--parameters",
        &parameters.to_string(),
    ])
}

fn identity_binding(settings: &Settings, b: &Binding, workload: &Workload) -> Trust {
    let mut t = Trust::new(
        Cloud::Azure,
        &b.client_id,
        "AKS identity binding (Kubernetes RBAC)",
    );
    t.issuer = format!(
        "https://ib.oic.prod-aks.azure.com/{}/{}",
        tenant(settings, b),
        b.client_id
    );
    t.subject = workload.subject();
    t.audience = settings.audience.clone();
    // Microsoft Learn's grant: `use-managed-identity` on the client id in
    // `cid.wi.aks.azure.com`, bound to the ServiceAccount. As a document
    // for `kubectl apply`: `kubectl create clusterrole --resource` would
    // look the group up in the API's discovery, which does not list it.
    let role = format!("use-mi-{}", b.client_id);
    let labels = serde_json::json!({"app.kubernetes.io/managed-by": "lanyard-doctor"});
    let document = serde_json::json!({
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "metadata": {"name": role, "labels": labels},
                "rules": [{
                    "verbs": ["use-managed-identity"],
                    "apiGroups": ["cid.wi.aks.azure.com"],
                    "resources": [b.client_id],
                }],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": format!("{role}-{}-{}", workload.namespace, workload.service_account), "labels": labels},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                "subjects": [{"kind": "ServiceAccount", "name": workload.service_account, "namespace": workload.namespace}],
            },
        ],
    });
    t.commands.push(format!(
        "printf '%s\\n' {} | kubectl apply -f -",
        shell_word(&document.to_string())
    ));
    t.document = Some(document);
    t.notes.push(
        "AKS creates the identity's one credential (aks-identity-binding) with `az aks identity-binding create`; each ServiceAccount needs only the RBAC grant".into(),
    );
    t
}

fn node_assigned(settings: &Settings, b: &Binding) -> Trust {
    let mut t = Trust::new(Cloud::Azure, &b.client_id, "node-assigned managed identity");
    t.issuer = format!("{}/{}/v2.0", login_host(settings), tenant(settings, b));
    t.subject = "(none: the node's IMDS gives the identity's tokens)".into();
    t.audience = settings.audience.clone();
    t.notes.push(
        "no federated credential: every pod on the node pool could reach this identity, so only the policy decides which ServiceAccounts may (docs/setup-azure.md, node-assigned identities)".into(),
    );
    t
}

fn app_hop(settings: &Settings, b: &Binding, node: bool) -> Trust {
    let app = b
        .app
        .as_ref()
        .map(|a| a.client_id.as_str())
        .unwrap_or_default();
    let mut t = Trust::new(
        Cloud::Azure,
        app,
        "app registration trusting the node's managed identity",
    );
    t.issuer = format!("{}/{}/v2.0", login_host(settings), tenant(settings, b));
    t.subject = b
        .object_id
        .clone()
        .unwrap_or_else(|| "<PRINCIPAL_ID>".into());
    t.audience = settings.audience.clone();
    if b.object_id.is_none() {
        t.commands.push(command(&[
            "az",
            "identity",
            "list",
            "--query",
            &format!("[?clientId=='{}'].principalId", b.client_id),
            "--output",
            "tsv",
        ]));
    }
    t.commands.push(app_credential(
        app,
        &format!("lanyard-mi-{}", b.client_id),
        &t,
    ));
    t.notes.push(format!(
        "the subject is the managed identity {}'s principal (object) id, and the app must be registered in its tenant",
        b.client_id
    ));
    if !node {
        t.problems.push(format!(
            "{} is not one of azure.node_identities: its token would come through a federated credential, which Entra refuses as another (AADSTS700231); assign it to the node pool and list it there",
            b.client_id
        ));
    }
    t
}

/// What Entra's refusal in `message` means and what to do, by its AADSTS
/// code (as Entra's error reference and the threads in the module doc
/// give them); `None` for a code not listed.
pub fn explain(message: &str) -> Option<&'static str> {
    // Longest codes first: 7002138 starts with 700213, and 700213 with 70021.
    const CODES: [(&str, &str); 8] = [
        ("AADSTS7002138", "the federated credential's subject matches only when case is ignored: write it exactly as the doctor prints it"),
        ("AADSTS700211", "no federated credential names the token's issuer: compare the issuer (trailing '/' included) with the doctor's"),
        ("AADSTS700212", "no federated credential lists the token's audience: set its audiences to azure.audience"),
        ("AADSTS700213", "no federated credential names this ServiceAccount's subject: create the one the doctor prints"),
        ("AADSTS700231", "the identity's token came through a federated credential and cannot be another's: use a node-assigned identity for the app hop"),
        ("AADSTS700016", "no application with this client id in the tenant: check the client id annotation and the tenant"),
        ("AADSTS70025", "the identity has no federated credential at all: create the one the doctor prints"),
        ("AADSTS70021", "no federated credential matches the token's issuer, subject and audience: create the one the doctor prints"),
    ];
    CODES
        .iter()
        .find(|(code, _)| message.contains(code))
        .map(|(_, why)| *why)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cloud::azure::AppHop;

    const CLIENT: &str = "11111111-2222-3333-4444-555555555555";

    fn binding() -> Binding {
        Binding {
            client_id: CLIENT.into(),
            tenant_id: None,
            object_id: None,
            resource_id: None,
            app: None,
        }
    }

    fn workload<'a>(sharing: &'a dyn Fn(Cloud, &str) -> Option<usize>) -> Workload<'a> {
        Workload {
            issuer: "https://oidc.prod-aks.azure.com/t/u/",
            namespace: "ray",
            service_account: "worker",
            sharing,
        }
    }

    #[test]
    fn a_federated_credential_names_the_issuer_subject_and_audience_exactly() {
        let none = |_: Cloud, _: &str| None;
        let t = &trust(&Settings::default(), &[binding()], &workload(&none))[0];
        assert_eq!(t.kind, "federated identity credential");
        assert_eq!(t.subject, "system:serviceaccount:ray:worker");
        assert_eq!(t.audience, "api://AzureADTokenExchange");
        let create = &t.commands[1];
        assert!(create
            .starts_with("az identity federated-credential create --name lanyard-ray-worker-"));
        assert!(create.contains("--issuer https://oidc.prod-aks.azure.com/t/u/ --subject system:serviceaccount:ray:worker --audiences api://AzureADTokenExchange"));
        assert!(
            create.contains("--identity-name '<IDENTITY_NAME>'"),
            "{create}"
        );
        assert!(t.problems.is_empty());
    }

    #[test]
    fn the_resource_id_fills_in_the_identity_and_its_group() {
        let none = |_: Cloud, _: &str| None;
        let mut b = binding();
        b.resource_id = Some("/subscriptions/sub-1/resourceGroups/rg-1/providers/Microsoft.ManagedIdentity/userAssignedIdentities/mi-1".into());
        let t = &trust(&Settings::default(), &[b], &workload(&none))[0];
        assert_eq!(t.commands.len(), 2, "no lookup needed");
        assert!(t.commands[0]
            .contains("--identity-name mi-1 --resource-group rg-1 --subscription sub-1"));
    }

    #[test]
    fn more_than_twenty_service_accounts_on_one_identity_is_a_problem() {
        let many = |_: Cloud, _: &str| Some(21);
        let t = &trust(&Settings::default(), &[binding()], &workload(&many))[0];
        assert_eq!(t.problems.len(), 1);
        assert!(t.problems[0].contains("at most 20"));
        let twenty = |_: Cloud, _: &str| Some(20);
        assert!(
            trust(&Settings::default(), &[binding()], &workload(&twenty))[0]
                .problems
                .is_empty()
        );
    }

    #[test]
    fn credential_names_are_distinct_per_cluster_and_within_entras_rules() {
        let none = |_: Cloud, _: &str| None;
        let a = credential_name(&workload(&none));
        let other = Workload {
            issuer: "https://other/",
            ..workload(&none)
        };
        assert_ne!(a, credential_name(&other));
        let long = "x".repeat(300);
        let w = Workload {
            namespace: &long,
            ..workload(&none)
        };
        let n = credential_name(&w);
        assert!(n.len() <= 120 && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'));
    }

    #[test]
    fn the_app_hop_trusts_the_node_identitys_principal_and_needs_a_node_identity() {
        let none = |_: Cloud, _: &str| None;
        let mut b = binding();
        b.object_id = Some("99999999-0000-0000-0000-000000000000".into());
        b.app = Some(AppHop {
            client_id: "app-1".into(),
            tenant_id: None,
        });
        let settings = Settings {
            tenant_id: Some("contoso.onmicrosoft.com".into()),
            ..Settings::default()
        };
        let t = &trust(&settings, std::slice::from_ref(&b), &workload(&none))[0];
        assert_eq!(t.identity, "app-1");
        assert_eq!(
            t.issuer,
            "https://login.microsoftonline.com/contoso.onmicrosoft.com/v2.0"
        );
        assert_eq!(t.subject, "99999999-0000-0000-0000-000000000000");
        assert!(t.problems[0].contains("AADSTS700231"));
        let node = Settings {
            node_identities: vec![CLIENT.into()],
            ..settings
        };
        assert!(trust(&node, &[b], &workload(&none))[0].problems.is_empty());
    }

    #[test]
    fn identity_bindings_need_rbac_not_a_credential() {
        let none = |_: Cloud, _: &str| None;
        let settings = Settings {
            identity_binding_sni: Some("abc.ests.aks".into()),
            ..Settings::default()
        };
        let t = &trust(&settings, &[binding()], &workload(&none))[0];
        assert!(
            t.commands[0].starts_with("printf '%s\\n' '{"),
            "{}",
            t.commands[0]
        );
        assert!(t.commands[0].ends_with("' | kubectl apply -f -"));
        let doc = t.document.as_ref().unwrap();
        assert_eq!(doc["items"][0]["rules"][0]["resources"][0], CLIENT);
        assert_eq!(doc["items"][1]["subjects"][0]["namespace"], "ray");
        assert_eq!(
            doc["items"][1]["roleRef"]["name"],
            format!("use-mi-{CLIENT}")
        );
    }

    #[test]
    fn refusals_are_explained_by_their_codes() {
        assert!(explain("AADSTS7002138: x").unwrap().contains("case"));
        assert!(explain("AADSTS700213: x").unwrap().contains("subject"));
        assert!(explain("AADSTS70021: x")
            .unwrap()
            .contains("issuer, subject and audience"));
        assert!(explain("AADSTS700231: x")
            .unwrap()
            .contains("node-assigned"));
        assert_eq!(explain("something else"), None);
    }
}
